#!/usr/bin/env bash
# The shm owner on huge pages (needs root): a hugetlbfs mount with a small
# pool of 2 MiB pages, and a tmpfs mounted huge=always. rdma's test
# `region_files_are_sized_for_huge_pages` checks that region files there are
# sized in huge pages (hugetlbfs refuses any other length) and hold the
# region's bytes. Everything is undone on exit, the pool size included.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=$(mktemp -d /tmp/pw-huge.XXXXXX)
mkdir -p "$dir/hugetlbfs" "$dir/thp"
old=$(cat /proc/sys/vm/nr_hugepages)
cleanup() {
  umount "$dir/hugetlbfs" 2>/dev/null || true
  umount "$dir/thp" 2>/dev/null || true
  echo "$old" > /proc/sys/vm/nr_hugepages || true
  rm -rf "$dir"
}
trap cleanup EXIT

# Two pages per owner (its control file and one region), with room to spare.
echo $((old + 8)) > /proc/sys/vm/nr_hugepages
got=$(cat /proc/sys/vm/nr_hugepages)
if [ "$got" -lt $((old + 4)) ]; then
  echo "hugepages.sh: asked for $((old + 8)) huge pages, the kernel gave $got (memory too fragmented?)" >&2
  exit 1
fi
mount -t hugetlbfs -o pagesize=2M none "$dir/hugetlbfs"
mount -t tmpfs -o huge=always,size=64m none "$dir/thp"
PAGEWIRE_HUGETLBFS_DIR="$dir/hugetlbfs" PAGEWIRE_THP_TMPFS_DIR="$dir/thp" \
  cargo test -p pagewire-rdma --test shm region_files_are_sized_for_huge_pages -- --nocapture
