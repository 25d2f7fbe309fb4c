#!/usr/bin/env bash
# Runs pagewire's verbs tests on real ibverbs, inside a soft-RoCE VM: the
# rdma crate's verbs conformance suite (each connection its own, then every
# connection a handle of one shared queue pair), the node's refusals to start
# (node/tests/verbs_start.rs: a GID index or device that does not exist),
# then the node's remote-read test over verbs (node/tests/remote_verbs.rs: an
# owner process's page cache under faults, eviction and writes, read
# one-sided by reader threads).
#
# The development and CI kernels have no RDMA, so this boots Debian's stock
# kernel under qemu (TCG: KVM does not work on these hosts) with a hand-made
# busybox initramfs, loads soft-RoCE (rdma_rxe), adds rxe0 on the VM's eth0,
# and runs the test binaries (built here, shared read-only over 9p) with
# --ignored. Prints SOFTROCE PASS and exits 0 only if every test of each
# passed.
#
# Needs (apt): qemu-system-x86 busybox-static kmod cpio rdma-core
# ibverbs-providers libibverbs-dev librdmacm-dev iproute2, plus the verbs
# build deps (clang libclang-dev cmake). Downloads the kernel package with
# `apt-get download` (needs a fresh `apt-get update`), caches it under
# target/softroce/.
#
# Environment: SOFTROCE_TIMEOUT (seconds for the VM, default 900),
# SOFTROCE_TEST_ARGS (extra libtest args for the conformance suite, e.g. a
# test name filter), SOFTROCE_REMOTE_SECS (seconds the remote-read test
# reads, default 3; 0 skips it), CARGO_TARGET_DIR (as for cargo).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
target=${CARGO_TARGET_DIR:-$repo/target}
work=$target/softroce
timeout_s=${SOFTROCE_TIMEOUT:-900}
remote_secs=${SOFTROCE_REMOTE_SECS:-3}
mkdir -p "$work"

say() { echo "softroce: $*" >&2; }

# 1. The test binaries.
test_binary() { # PACKAGE TEST: builds it with the verbs feature, prints its path
    # The test target's own artifact: building it also builds the package's
    # binaries (for CARGO_BIN_EXE_*), whose artifacts carry executables too.
    cargo test -p "$1" --features verbs --test "$2" --no-run --message-format=json 2>/dev/null \
        | python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and t.get("name") == name and "test" in t.get("kind", []):
        print(m["executable"])
' "$2" | tail -n1
}
say "building the verbs conformance tests and the node's remote-read test"
bin=$(test_binary pagewire-rdma verbs)
[ -x "$bin" ] || { say "could not find the verbs test binary"; exit 1; }
remote_bin=$(test_binary pagewire-node remote_verbs)
[ -x "$remote_bin" ] || { say "could not find the remote_verbs test binary"; exit 1; }
start_bin=$(test_binary pagewire-node verbs_start)
[ -x "$start_bin" ] || { say "could not find the verbs_start test binary"; exit 1; }
# The node binary those tests start, built with verbs by the line above.
node_bin=$target/debug/pagewire-node
[ -x "$node_bin" ] || { say "no $node_bin"; exit 1; }
share=$work/share
rm -rf "$share"; mkdir -p "$share"
cp "$bin" "$share/verbs-tests"
cp "$remote_bin" "$share/remote-verbs-tests"
cp "$start_bin" "$share/verbs-start-tests"
cp "$node_bin" "$share/pagewire-node"

# 2. The kernel, unpacked, never installed.
. "$repo/rdma/scripts/softroce-lib.sh"
softroce_kernel

# 3. The initramfs: busybox, the verbs user space with its libraries, modules.
say "building the initramfs"
root=$work/initramfs
softroce_initramfs_base sh mount ip sleep cat echo poweroff insmod mkdir ls uname dmesg grep seq \
    -- "$bin" "$remote_bin" "$start_bin" "$node_bin"
cat > "$root/init" <<'INIT'
#!/bin/sh
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do
    case "$m" in
        *.xz) xz -dc "$m" > /tmp/m.ko && insmod /tmp/m.ko ;;
        *.zst) zstd -dc "$m" > /tmp/m.ko && insmod /tmp/m.ko ;;
        *) insmod "$m" ;;
    esac || echo "softroce-vm: insmod $m failed"
done
ip link set lo up
ip link set eth0 up
ip addr add 10.0.0.1/24 dev eth0
rdma link add rxe0 type rxe netdev eth0 || echo "softroce-vm: rdma link add failed"
sleep 1
rdma link show
mount -t 9p -o trans=virtio,version=9p2000.L,ro host0 /mnt/host
cd /tmp
export PAGEWIRE_RDMA_DEVICE=rxe0 RUST_BACKTRACE=1
echo "softroce-vm: running the verbs conformance suite"
/mnt/host/verbs-tests --ignored --test-threads=1 $(cat /test-args)
echo "SOFTROCE-RESULT verbs rc=$?"
echo "softroce-vm: a node refuses to start on a GID index or a device that does not exist"
PAGEWIRE_NODE_BIN=/mnt/host/pagewire-node /mnt/host/verbs-start-tests --ignored --test-threads=1
echo "SOFTROCE-RESULT start rc=$?"
secs=$(cat /remote-secs)
if [ "$secs" != 0 ]; then
    echo "softroce-vm: running the remote-read test over verbs (${secs} s)"
    PAGEWIRE_REMOTE_SECS=$secs /mnt/host/remote-verbs-tests --ignored --nocapture --test-threads=1
    echo "SOFTROCE-RESULT remote rc=$?"
fi
poweroff -f
INIT
chmod +x "$root/init"
echo "${SOFTROCE_TEST_ARGS:-}" > "$root/test-args"
echo "$remote_secs" > "$root/remote-secs"
softroce_pack "$work/initrd.gz"

# 4. Boot it.
say "booting $kver under qemu (TCG), timeout ${timeout_s}s"
log=$work/console.log
set +e
timeout "$timeout_s" qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m 2048 \
    -kernel "$kdir/boot/vmlinuz-$kver" -initrd "$work/initrd.gz" \
    -append "console=ttyS0 panic=-1 quiet rdinit=/init" \
    -display none -serial stdio -monitor none -no-reboot \
    -netdev user,id=n0,restrict=on -device virtio-net-pci,netdev=n0,mac=52:54:00:12:34:01 \
    -virtfs local,path="$share",mount_tag=host0,security_model=none,readonly=on \
    < /dev/null 2>&1 | tee "$log"
qemu_rc=${PIPESTATUS[0]}
set -e
if [ "$qemu_rc" = 124 ]; then
    say "the VM did not finish within ${timeout_s}s (a hang)"
fi
# Every suite that ran reported rc=0, each with a passing libtest summary
# that passed something; the remote-read test printed its tally (with
# --nocapture it may share a line with libtest's "test NAME ... ").
clean=$work/console.clean
tr -d '\r' < "$log" > "$clean"
results=$(grep -c '^SOFTROCE-RESULT ' "$clean" || true)
expected=3; [ "$remote_secs" = 0 ] && expected=2
if [ "$results" = "$expected" ] && ! grep '^SOFTROCE-RESULT ' "$clean" | grep -qv ' rc=0$' \
    && [ "$(grep -c '^test result: ok\.' "$clean")" = "$expected" ] && ! grep -q ' 0 passed' "$clean" \
    && { [ "$remote_secs" = 0 ] || grep -q 'remote over verbs (' "$clean"; }; then
    echo "SOFTROCE PASS: verbs tests passed on soft-RoCE:"
    grep '^test result' "$clean" | sed 's/^/  /'
    grep -o 'remote over verbs (.*' "$clean" | sed 's/^/  /' || true
    exit 0
fi
echo "SOFTROCE FAIL: see $log"
exit 1
