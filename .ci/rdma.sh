#!/usr/bin/env bash
# CI for the rdma crate and `pagewire-bench transport`; .ci/run calls it as
# `bash .ci/rdma.sh` from the repository root, as root, on a fresh Debian
# bookworm machine that has only the Rust toolchain and cargo-nextest.
#
# 1. installs what it needs (verbs build deps, the soft-RoCE VM's tools,
#    redis-server for the bench);
# 2. builds and lints pagewire-rdma with every feature (verbs included), and
#    pagewire-node with `verbs` (its remote-read test over verbs);
# 3. runs the rdma tests (tcp and shm conformance; the verbs tests are
#    ignored here: no RDMA in this kernel);
# 4. runs, inside a soft-RoCE VM, the verbs conformance suite (own and
#    shared queue pairs), the node's refusals to start, and the node's
#    remote-read test over verbs (node/tests/remote_verbs.rs, 3 s of reads);
# 5. runs a cluster of soft-RoCE VMs (rdma/scripts/softroce-cluster.sh): a
#    coordinator VM and 3 node VMs; the storm over verbs with kill -9,
#    restart, SIGSTOP past the lease, a link cut and the coordinator killed
#    and restarted (0 wrong, 0 stale, every
#    event recovered, reads over verbs, asserted from its JSON), then
#    `pagewire-bench remote` between two VMs (verbs, tcp, gRPC, Redis,
#    perftest; 0 wrong);
# 6. smoke-runs `pagewire-bench transport --quick`.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { echo "=== rdma ci: $* ($(date -u +%T))"; }

step "installing packages"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q \
    clang libclang-dev cmake pkg-config libhwloc-dev libudev-dev \
    libibverbs-dev librdmacm-dev rdma-core ibverbs-providers \
    qemu-system-x86 busybox-static kmod cpio iproute2 \
    ibverbs-utils perftest redis-server redis-tools python3 binutils util-linux >/dev/null

# .ci/run lints the whole workspace with every feature before it calls this
# script (PAGEWIRE_CI_LINTED=1): the same checks again would cost minutes.
if [[ ${PAGEWIRE_CI_LINTED:-0} != 1 ]]; then
    step "fmt"
    cargo fmt --all --check

    step "clippy (pagewire-rdma, all features; pagewire-node with verbs; pagewire-bench)"
    cargo clippy -p pagewire-rdma --all-targets --all-features -- -D warnings
    cargo clippy -p pagewire-node --all-targets --features verbs -- -D warnings
    cargo clippy -p pagewire-bench --all-targets --features verbs -- -D warnings
fi

step "tests (pagewire-rdma, all features)"
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run -p pagewire-rdma --all-features
else
    cargo test -p pagewire-rdma --all-features
fi

step "verbs conformance suite (own and shared queue pairs), the node's start refusals and the remote-read test on soft-RoCE"
bash rdma/scripts/softroce-test.sh

step "the storm over verbs across soft-RoCE VMs, then remote between two of them"
# CI's one release line (fresh when .ci/run built it).
bash k8s/image/build.sh --binaries-only
# --force-clean: CI's machine is its own, so whatever an earlier run that was
# killed left in the namespace (a qemu, the agent) goes.
bash rdma/scripts/softroce-cluster.sh --no-build --force-clean --keep target/softroce-cluster-results

step "pagewire-bench transport --quick"
target/release/pagewire-bench transport --quick

step "done"
