#!/busybox sh
# The QEMU guest's /init (localcluster.vmkernel packs it into the initramfs). It runs
# inside the guest only, before any of the host's programs are there: mounts the host's root
# read-only over 9p under a tmpfs overlay, then hands over to the per-run stage 2 (vm_stage2.sh).
/busybox --install -s /bin
export PATH=/bin
fail() { echo "proxyshift-vm init: $*"; echo o > /proc/sysrq-trigger; sleep 60; }
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules.list); do insmod "/modules/$m" || fail "insmod $m"; done
opts=trans=virtio,version=9p2000.L,msize=512000
mkdir -p /lower /rw /newroot
mount -t 9p -o "$opts,cache=loose,ro" hostroot /lower || fail "mount hostroot"
mount -t tmpfs -o mode=0755 tmpfs /rw || fail "mount tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot || fail "mount overlay"
mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp || fail "mount /tmp"
mount -t tmpfs -o mode=0755 tmpfs /newroot/run || fail "mount /run"
mkdir -p /newroot/run/proxyshift-vm /newroot/lib/modules
mount -t 9p -o "$opts" psrun /newroot/run/proxyshift-vm || fail "mount psrun"
mount -t 9p -o "$opts,cache=loose,ro" psmodules /newroot/lib/modules || fail "mount psmodules"
# The host's /tmp stays reachable (read-only) for stage 2: a checkout there (a CI clone) is otherwise
# hidden by the guest's own /tmp.
mkdir -p /newroot/run/proxyshift-host-tmp
mount --bind /lower/tmp /newroot/run/proxyshift-host-tmp || fail "bind the host's /tmp"
mount --move /dev /newroot/dev
mount --move /sys /newroot/sys
mount --move /proc /newroot/proc
exec switch_root /newroot /bin/sh /run/proxyshift-vm/stage2.sh
