#!/bin/sh
# The QEMU guest's PID 1 after switch_root, one per run: proxyshift.localcluster.vm fills in the
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
if cd @CWD@; then
  env -i @ENV@ @COMMAND@ > "$out" 2>&1 < /dev/null
  rc=$?
else
  echo "proxyshift-vm: no directory @CWD@ in the guest" > "$out"
  rc=125
fi
echo "$rc" > @RUN_DIR@/rc.tmp && mv @RUN_DIR@/rc.tmp @RUN_DIR@/rc
sync
echo o > /proc/sysrq-trigger
sleep 60
