#!/bin/sh
# The QEMU guest's PID 1 after switch_root, one per run: localcluster.vm fills in the
# @...@ fields (each value shell-quoted) and puts it into the per-run share. Runs inside the guest only.
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
echo proxyshift-vm > /proc/sys/kernel/hostname
ip link set lo up
out=/dev/console
for port in /sys/class/virtio-ports/*; do
  [ "$(cat "$port/name" 2>/dev/null)" = @OUTPUT_PORT@ ] && out="/dev/${port##*/}"
done
cwd=@CWD@
# A working directory under the host's /tmp (a CI clone) is hidden by the guest's own /tmp: lay its
# top folder back as an overlay, so the guest reads the host's files and its writes stay in the guest.
case "$cwd" in
  /tmp/?*)
    top=${cwd#/tmp/}
    top=${top%%/*}
    if [ -d "/run/proxyshift-host-tmp/$top" ] && [ ! -e "/tmp/$top" ]; then
      mkdir -p "/tmp/$top" "/tmp/.proxyshift-vm/$top/upper" "/tmp/.proxyshift-vm/$top/work"
      mount -t overlay -o "lowerdir=/run/proxyshift-host-tmp/$top,upperdir=/tmp/.proxyshift-vm/$top/upper,workdir=/tmp/.proxyshift-vm/$top/work" overlay "/tmp/$top"
    fi
    ;;
esac
if cd "$cwd"; then
  env -i @ENV@ @COMMAND@ > "$out" 2>&1 < /dev/null
  rc=$?
else
  echo "proxyshift-vm: no directory $cwd in the guest" > "$out"
  rc=125
fi
echo "$rc" > @RUN_DIR@/rc.tmp && mv @RUN_DIR@/rc.tmp @RUN_DIR@/rc
sync
echo o > /proc/sysrq-trigger
sleep 60
