#!/bin/bash
# On the GPU machine, from the project's root, with .device-kit beside it (kit.sh beside this
# file builds it): the parts named (default "p8 p8-fresh cold16"), each under its own time limit.
#   p8          ResNet-50 through the mount vs a local directory (../shared/device/p8_resnet.py),
#               source and cache in /tmp on the machine's root filesystem
#   p8-fresh    the same with source and cache on a fresh ext4 of their own (loop device)
#   cold16      scripts/bench/mount_cold.py --only file, 16 readers, 12,000 files, 1 round
#   cold16-scale  the same with --scale (1..16 readers; ~2.5 minutes more)
#   p3          ResNet-50 at a 20% cache, shim vs shuffle + LRU (../shared/device/p3_gpu.py)
# Results: $OUT/*.log and *.json.
set -u
export PYTHONUNBUFFERED=1
KIT=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$KIT"/whl/*.whl || exit 3
mkdir -p /tmp/fuse3; for f in "$KIT"/deb/*.deb; do dpkg -x "$f" /tmp/fuse3; done
export PATH=/tmp/fuse3/bin:/tmp/fuse3/usr/bin:$PATH
export PYTHONPATH=/tmp/site:$PWD
{ date -u; nproc; nvidia-smi -L; python3 -c "import torch; print(torch.__version__)"; } 2>&1 | tee "$OUT/env.txt"
cleanup() {
  for m in $(awk '$3 ~ /^fuse/ {print $2}' /proc/mounts); do fusermount3 -u "$m" 2>/dev/null; done
  pkill -f "quiverfs.cli mountd" 2>/dev/null; sleep 1
}
cold() {
  timeout "${COLD_TIMEOUT:-100}" python3 scripts/bench/mount_cold.py --only file --readers 16 \
    --files 12000 --rounds 1 "$@" 2>&1 | tee "$OUT/cold16.log"
}
for part in ${@:-p8 p8-fresh cold16}; do
  SECONDS=0
  case $part in
    p8) timeout "${P8_TIMEOUT:-170}" python3 "$KIT/p8_resnet.py" 2>&1 | tee "$OUT/p8_root.log"
        [ -f "$OUT/p8.json" ] && mv "$OUT/p8.json" "$OUT/p8_root.json"; rm -rf /tmp/p8 ;;
    p8-fresh)
        truncate -s 12G /tmp/fresh.img && mkfs.ext4 -q -F /tmp/fresh.img && mkdir -p /mnt/fresh \
          && mount -o loop /tmp/fresh.img /mnt/fresh || { echo "no loop device: p8-fresh skipped"; continue; }
        P8_ROOT=/mnt/fresh/p8 timeout "${P8_TIMEOUT:-170}" python3 "$KIT/p8_resnet.py" 2>&1 | tee "$OUT/p8_fresh.log"
        [ -f "$OUT/p8.json" ] && mv "$OUT/p8.json" "$OUT/p8_fresh.json"
        cleanup; umount /mnt/fresh; rm -f /tmp/fresh.img ;;
    cold16) cold ;;
    cold16-scale) COLD_TIMEOUT=${COLD_TIMEOUT:-240} cold --scale ;;
    p3) P3_EPOCHS=${P3_EPOCHS:-3} timeout "${P3_TIMEOUT:-300}" python3 "$KIT/p3_gpu.py" 2>&1 | tee "$OUT/p3.log" ;;
    *) echo "unknown part: $part" ;;
  esac
  cleanup
  echo "$part took $SECONDS s" | tee -a "$OUT/env.txt"
done
echo DONE
