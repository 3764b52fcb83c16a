#!/usr/bin/env bash
# A RAM-backed block device with ext4, standing in for a fast NVMe drive (root only).
#
#   scripts/ramdisk.sh up   [MOUNTPOINT] [SIZE]   # default /mnt/kvtier-ram 8G
#   scripts/ramdisk.sh down [MOUNTPOINT]
#
# A file on a tmpfs, attached with `losetup --direct-io=on`, formatted ext4 and mounted:
# O_DIRECT works on it as on a real drive. The whole SIZE is taken from RAM at `up` (and
# kept: mkfs does not discard), so a write to a block never written before costs what a
# rewrite does, as on a drive; a sparse file made first writes pay a tmpfs page allocation
# and zeroing, and slowed them 2x (put + flush of 1 MiB chunks, 1.2-1.8 against 3.2-3.4
# GiB/s just after `up`).
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
  fallocate -l "$size" "$backing"
  dev=$(losetup --find --show --direct-io=on "$backing")
  mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0,nodiscard "$dev"
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
