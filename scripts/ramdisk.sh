#!/usr/bin/env bash
# A RAM-backed block device with ext4, standing in for a fast NVMe drive (root only).
#
#   scripts/ramdisk.sh up   [MOUNTPOINT] [SIZE]   # default /mnt/kvtier-ram 8G
#   scripts/ramdisk.sh down [MOUNTPOINT]
#
# A file on a tmpfs, attached with `losetup --direct-io=on`, formatted ext4 and mounted:
# O_DIRECT works on it as on a real drive.
set -euo pipefail
action=${1:?usage: ramdisk.sh up|down [MOUNTPOINT] [SIZE]}
mnt=${2:-/mnt/kvtier-ram}
size=${3:-8G}
backing_dir=/dev/shm/kvtier-ramdisk
backing="$backing_dir/$(echo "$mnt" | tr / _).img"

case "$action" in
up)
  if mountpoint -q "$mnt"; then echo "$mnt already mounted"; exit 0; fi
  mkdir -p "$backing_dir" "$mnt"
  truncate -s "$size" "$backing"
  dev=$(losetup --find --show --direct-io=on "$backing")
  mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dev"
  mount -o noatime "$dev" "$mnt"
  chmod 0700 "$mnt"
  echo "$dev on $mnt ($size, RAM-backed)"
  ;;
down)
  dev=$(findmnt -n -o SOURCE "$mnt" || true)
  if [ -n "$dev" ]; then umount "$mnt"; losetup -d "$dev"; fi
  rm -f "$backing"
  ;;
*) echo "unknown action $action" >&2; exit 2 ;;
esac
