#!/usr/bin/env bash
# softroce-cluster.sh: pagewire's storm over real ibverbs, across several
# soft-RoCE VMs (qemu TCG, Debian's stock kernel, rdma_rxe) on a private
# virtual network.
#
# The development and CI kernels have no RDMA, and KVM does not run a stock
# kernel on these hosts (../shared/reference/softroce-vm.md), so each machine
# of the cluster is a qemu TCG VM booting a hand-made busybox initramfs
# (built with softroce-lib.sh, as softroce-test.sh does) that loads rdma_rxe
# and adds rxe0 on its eth0. The VMs' NICs are taps on one bridge inside a
# network namespace this script makes; nothing else is connected to it:
#
#   netns  pwvm                       (no link to the host's interfaces)
#   bridge pwbr    10.99.0.1/24       a vm-agent here runs the cuts and heals
#   tap    pwtap0  VM0 "ctl"  10.99.0.10  coordinator, storm, readers, redis
#   tap    pwtapK  VM K "node-K" 10.99.0.(10+K)  a vm-agent runs the node
#   MAC    52:54:00:99:00:KK (each VM its own: with equal MACs the TCP
#          exchange works and an RDMA READ hangs forever)
#
# Every VM mounts two 9p shares of the host: host0 (read-only, at /mnt/host:
# pagewire-bench, with its debug info stripped) and work (read-write, at
# /mnt/work, cache=mmap: the storm's shared mmap of its acked file works in
# VM0, while read and write stay uncached, so the nodes' backing file there
# is coherent across VMs). The storm's process control crosses VMs through
# `pagewire-bench vm-agent` / `vm-exec` (bench/src/vmexec.rs): the hosts file
# (/mnt/work/hosts.toml) runs node K as `vm-exec 10.99.0.(10+K):7700 node-K
# -- ...`, pauses it through `vm-exec ... --signal STOP|CONT`, and cuts its
# VM off by `ip link set pwtapK down` run by the agent on the bridge's side
# (its packets vanish silently, the VM's own interface stays up).
#
# VM0 waits for every agent to answer, runs perftest's ib_read_lat and
# ib_read_bw (4 KiB READs) against node-1 (the known-good baseline), then
# the storm over verbs with a fault schedule, then `pagewire-bench remote`
# with node-1 as the owner (its coordinator, node, Redis and perftest
# servers started there through its agent; the readers in VM0): one-sided
# verbs, one-sided tcp, gRPC Read, Redis GET and ib_read_lat/ib_read_bw
# side by side on the same link; and writes /mnt/work/ctl-done;
# the node VMs power off when they see it. Prints SOFTROCE-CLUSTER PASS and
# exits 0 only if the storm's JSON says: no wrong and no stale read in any
# result row, every scheduled event recovered, and the verbs rows read
# one-sided over verbs (one_sided_verbs > 0), and, for remote, no wrong
# read and verbs rows present (its targets are printed, met or MISSED; a
# missed speed target under TCG does not fail the run).
#
# Usage (as root, from anywhere):
#   rdma/scripts/softroce-cluster.sh [OPTIONS] [-- STORM ARGS...]
#
#   --nodes M         node VMs (default 3; 1..9, the default schedule needs 3)
#   --mem MIB         memory of each node VM (default 1024); VM0 gets
#                     max(MIB, --ctl-mem)
#   --ctl-mem MIB     memory of VM0 (default 1536)
#   --smp N           vCPUs of each node VM (default 1)
#   --ctl-smp N       vCPUs of VM0 (default 2)
#   --mtu N           MTU of the bridge, the taps and the VMs' eth0 (default
#                     1500: rxe's IB MTU 1024, a 4 KiB page in 4 packets)
#   --timeout SECS    the whole run, boot to power-off (default 1500)
#   --perftest        only the perftest baseline (no storm)
#   --remote-only     the perftest baseline and `pagewire-bench remote`
#                     between VM0 and node-1 (no storm)
#   --no-remote       the storm without `pagewire-bench remote` after it
#   --self-check      boot, prove rxe, the agents and ib_read_lat between VM0
#                     and node-1, tear down; no storm
#   --keep DIR        copy the results (consoles, storm JSON, plots, logs) to DIR
#   --bench-bin PATH  pagewire-bench (default $CARGO_TARGET_DIR or
#                     target, then release/pagewire-bench)
#   --no-build        do not run `cargo build --release -p pagewire-bench
#                     --features verbs` first
#   --clean           only remove leftovers of an earlier run (the netns and
#                     every process in it), then exit
#   --force-clean     remove such leftovers, then run (an empty leftover
#                     netns goes without it; one with processes in it needs it)
#   --                everything after it goes to the storm; when it names a
#                     fault (--kill --restart --pause --cut --heal) the default
#                     schedule is dropped
#
# The storm VM0 runs (times from the start of the storm phase):
#   pagewire-bench storm --transport verbs --hosts /mnt/work/hosts.toml
#     --work-dir /mnt/work/storm --keep --json --out /mnt/work/out
#     --readers 2 --file-mib 32 --lease-ms 4000 --op-deadline-ms 20000
#     --compare one-sided,grpc,redis,pread --compare-duration 4s --duration 100s
#     --kill node-2@10s --restart node-2@25s --pause node-3@40s+8s
#     --cut node-1@65s --heal node-1@77s
#     --kill coordinator@86s --restart coordinator@89s  [STORM ARGS]
# with PAGEWIRE_RDMA_DEVICE=rxe0, PAGEWIRE_VERBS_ACK_TIMEOUT=17 and
# PAGEWIRE_VERBS_RETRY=7 (rxe under TCG is slow) in every pagewire process,
# and PAGEWIRE_VERBS_OP_TIMEOUT_MS=30000 for `pagewire-bench remote`.
#
# Results: target/softroce-cluster/ (console-ctl.log, console-node-K.log,
# work/out/: storm.json, plots, perftest-*.txt, storm-stderr.log; work/storm/:
# the storm's logs).
#
# Needs (apt): qemu-system-x86 busybox-static kmod cpio rdma-core
# ibverbs-providers ibverbs-utils perftest redis-server iproute2 python3,
# binutils (objcopy) and util-linux (flock); the kernel package comes with
# `apt-get download` (cached in target/softroce/, shared with
# softroce-test.sh). Traffic stays on the bridge inside pwvm: the namespace
# has no route out and no link to any host interface; IPv6 is off on the
# bridge and the taps.
set -euo pipefail

readonly NS=pwvm
readonly BR=pwbr
readonly NET=10.99.0
readonly AGENT_PORT=7700
readonly LOCK=/run/lock/pagewire-softroce-cluster.lock

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
nodes=3
mem=1024
ctl_mem=1536
smp=1
ctl_smp=2
mtu=1500
timeout_s=1500
mode=storm
remote=1
keep=""
bench_bin=""
build=1
force_clean=0
user_args=()

say() { printf '%s softroce-cluster: %s\n' "$(date +%T)" "$*" >&2; }
die() {
    printf 'softroce-cluster: error: %s\n' "$*" >&2
    exit 1
}
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }

while (($#)); do
    case $1 in
        --nodes) nodes=${2:?--nodes needs a number}; shift 2 ;;
        --mem) mem=${2:?--mem needs MiB}; shift 2 ;;
        --ctl-mem) ctl_mem=${2:?--ctl-mem needs MiB}; shift 2 ;;
        --smp) smp=${2:?--smp needs a number}; shift 2 ;;
        --ctl-smp) ctl_smp=${2:?--ctl-smp needs a number}; shift 2 ;;
        --mtu) mtu=${2:?--mtu needs a number}; shift 2 ;;
        --timeout) timeout_s=${2:?--timeout needs seconds}; shift 2 ;;
        --perftest) mode=perftest; shift ;;
        --remote-only) mode=remote; shift ;;
        --no-remote) remote=0; shift ;;
        --self-check) mode=self-check; shift ;;
        --keep) keep=${2:?--keep needs a directory}; shift 2 ;;
        --bench-bin) bench_bin=${2:?--bench-bin needs a path}; shift 2 ;;
        --no-build) build=0; shift ;;
        --clean) mode=clean; shift ;;
        --force-clean) force_clean=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; user_args+=("$@"); break ;;
        *) die "unknown option '$1' (storm arguments go after --; see --help)" ;;
    esac
done

in_range() { [[ $1 =~ ^[0-9]+$ ]] && (($1 >= $2 && $1 <= $3)); }
in_range "$nodes" 1 9 || die "--nodes must be 1..9, not '$nodes'"
in_range "$mem" 256 8192 || die "--mem must be 256..8192 MiB, not '$mem'"
in_range "$ctl_mem" 256 8192 || die "--ctl-mem must be 256..8192 MiB, not '$ctl_mem'"
in_range "$smp" 1 8 || die "--smp must be 1..8, not '$smp'"
in_range "$ctl_smp" 1 8 || die "--ctl-smp must be 1..8, not '$ctl_smp'"
in_range "$mtu" 1280 9000 || die "--mtu must be 1280..9000, not '$mtu'"
in_range "$timeout_s" 60 86400 || die "--timeout must be 60..86400 s, not '$timeout_s'"
((ctl_mem >= mem)) || ctl_mem=$mem
[[ -n $bench_bin ]] || bench_bin=$target/release/pagewire-bench

node_ip() { echo "$NET.$((10 + $1))"; } # VM index 0 is ctl
vm_name() { if (($1 == 0)); then echo ctl; else echo "node-$1"; fi; }
vm_mac() { printf '52:54:00:99:00:%02x' "$1"; }

# The storm's arguments: ours, then the user's (when the user names a fault,
# ours are dropped: the flags accumulate).
storm_defaults=(--readers 2 --file-mib 32 --lease-ms 4000 --op-deadline-ms 20000
    --compare one-sided,grpc,redis,pread --compare-duration 4s --duration 100s)
fault_defaults=(--kill node-2@10s --restart node-2@25s --pause node-3@40s+8s
    --cut node-1@65s --heal node-1@77s --kill coordinator@86s --restart coordinator@89s)
user_faults=0
for a in "${user_args[@]}"; do
    case $a in --kill | --kill=* | --restart | --restart=* | --pause | --pause=* | --cut | --cut=* | --heal | --heal=*) user_faults=1 ;; esac
done
if [[ $mode == storm ]] && ((!user_faults && nodes < 3)); then
    die "the default fault schedule needs --nodes 3 or more (or give one after --)"
fi

# ------------------------------------------------------------ teardown

dir=$target/softroce-cluster
ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$NS"; }

# Ends every process inside our namespace (the qemus, the host's agent),
# TERM then KILL, each loop bounded, then deletes the namespace (its bridge
# and taps go with it).
teardown() {
    local pids i
    ns_exists || return 0
    for ((i = 0; i < 50; i++)); do
        pids=$(ip netns pids "$NS" 2>/dev/null | xargs)
        [[ -n $pids ]] || break
        if ((i == 0)); then
            # shellcheck disable=SC2086 # a list of pids
            kill -TERM $pids 2>/dev/null || true
        elif ((i == 30)); then
            # shellcheck disable=SC2086
            kill -KILL $pids 2>/dev/null || true
        fi
        sleep 0.1
    done
    ip netns del "$NS" 2>/dev/null || true
    ! ns_exists || echo "softroce-cluster: warning: could not remove netns $NS" >&2
}

owned=0
cleaned=0
vm_pids=()
agent_pid=""
cleanup() {
    local rc=$?
    trap '' INT TERM
    ((cleaned)) && return "$rc"
    cleaned=1
    local p
    for p in "${vm_pids[@]}" $agent_pid; do
        jobs -rp | grep -qx "$p" && kill -TERM "$p" 2>/dev/null
    done
    ((owned)) && teardown
    for p in "${vm_pids[@]}" $agent_pid; do
        jobs -rp | grep -qx "$p" && kill -KILL "$p" 2>/dev/null
    done
    if [[ -n $keep && -d $dir/work ]]; then
        mkdir -p "$keep"
        cp "$dir"/console-*.log "$dir"/qemu-*.log "$dir"/agent-host.log "$keep"/ 2>/dev/null || true
        cp "$dir"/work/hosts.toml "$dir"/work/storm-args "$keep"/ 2>/dev/null || true
        [[ ! -d $dir/work/out ]] || cp -r "$dir/work/out" "$keep"/
        if [[ -d $dir/work/storm ]]; then
            mkdir -p "$keep/storm"
            find "$dir/work/storm" -maxdepth 2 -type f \( -name '*.log' -o -name '*.toml' \) \
                -exec cp {} "$keep/storm"/ \; 2>/dev/null || true
        fi
        say "results copied to $keep"
    fi
    return "$rc"
}

# ------------------------------------------------------------ checks

(($(id -u) == 0)) || die "must run as root (it makes a network namespace and taps)"
for c in ip timeout flock qemu-system-x86_64 busybox cpio modprobe depmod python3 objcopy \
    ib_read_lat ib_read_bw redis-server; do
    command -v "$c" >/dev/null 2>&1 || die "needs '$c' (see --help for the packages)"
done
[[ -c /dev/net/tun ]] || die "no /dev/net/tun (the VMs' NICs are taps)"

mkdir -p "$(dirname "$LOCK")"
exec 9>"$LOCK"
flock -n 9 || die "another softroce-cluster.sh is running (it holds $LOCK)"

if [[ $mode == clean ]]; then
    if ns_exists; then
        say "removing netns $NS and its processes: $(ip netns pids "$NS" 2>/dev/null | xargs)"
        teardown
    else
        say "nothing to remove"
    fi
    exit 0
fi
# We hold the lock, so no other run of this script is alive: a namespace
# of ours that is still here was left by a run that died before its
# cleanup (kill -9, a machine reset with /run kept). An empty one holds
# nothing anybody could want and goes without asking; one with processes
# in it (a qemu that outlived its script) goes only with --force-clean.
if ns_exists; then
    leftover=$(ip netns pids "$NS" 2>/dev/null | xargs)
    if [[ -z $leftover ]]; then
        say "removing netns $NS, left empty by an earlier run that ended without its cleanup"
    else
        ((force_clean)) || die "netns $NS already exists with processes in it: $leftover
  (left over from an earlier run? rerun with --force-clean, or --clean to only remove it)"
        say "--force-clean: removing netns $NS and its processes: $leftover"
    fi
    teardown
    ! ns_exists || die "could not remove netns $NS"
fi

# ------------------------------------------------------------ build

if ((build)); then
    say "building pagewire-bench (cargo build --release -p pagewire-bench --features verbs)"
    (cd "$repo" && cargo build --release -p pagewire-bench --features verbs) ||
        die "the build failed (--no-build to use the binary as it is)"
fi
[[ -x $bench_bin ]] || die "no $bench_bin (build it, or --bench-bin)"
"$bench_bin" vm-agent --help >/dev/null 2>&1 ||
    die "$bench_bin has no vm-agent subcommand (bench/src/vmexec.rs; rebuild it)"
if [[ $mode == storm ]]; then
    "$bench_bin" storm --help >/dev/null 2>&1 || die "$bench_bin has no storm subcommand"
fi

rm -rf "$dir"
mkdir -p "$dir/share" "$dir/work/out"
# The binary, without its debug info (100 MB less for every VM to read over
# 9p under TCG); symbols stay, for backtraces.
objcopy --strip-debug "$bench_bin" "$dir/share/pagewire-bench"

# ------------------------------------------------------------ kernel and initramfs

work=$target/softroce # the kernel cache, shared with softroce-test.sh
mkdir -p "$work"
# shellcheck source=softroce-lib.sh
. "$repo/rdma/scripts/softroce-lib.sh"
softroce_kernel
say "building the initramfs"
root=$dir/initramfs
# shellcheck disable=SC2046 # busybox --list: one applet a line
softroce_initramfs_base $(busybox --list) -- \
    "$(command -v ib_read_lat)" "$(command -v ib_read_bw)" \
    "$(command -v redis-server)" "$(command -v redis-benchmark || echo /usr/bin/redis-benchmark)"
# pagewire-bench itself comes over 9p; its libraries must be here.
ldd "$bench_bin" | grep -o '/[^ ]*' | while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"
    [ -e "$root$lib" ] || cp -L "$lib" "$root$lib"
done
mkdir -p "$root"/{mnt/work,etc,root,run,var/tmp}
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
{
    echo "127.0.0.1 localhost"
    echo "$NET.1 host"
    for ((k = 0; k <= nodes; k++)); do echo "$(node_ip "$k") $(vm_name "$k")"; done
} >"$root/etc/hosts"
{
    cat <<'INIT'
#!/bin/sh
# pagewire soft-RoCE cluster VM (rdma/scripts/softroce-cluster.sh)
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 shm /dev/shm
for w in $(cat /proc/cmdline); do
    case $w in
        pw.name=*) name=${w#pw.name=} ;;
        pw.ip=*) ip=${w#pw.ip=} ;;
        pw.mtu=*) mtu=${w#pw.mtu=} ;;
        pw.mode=*) mode=${w#pw.mode=} ;;
        pw.nodes=*) nodes=${w#pw.nodes=} ;;
        pw.secs=*) secs=${w#pw.secs=} ;;
        pw.remote=*) remote=${w#pw.remote=} ;;
    esac
done
say() { echo "pwvm[$name] $(cut -d' ' -f1 /proc/uptime)s: $*"; }
finish() {
    [ "$name" = ctl ] && touch /mnt/work/ctl-done
    sync
    say "power off; peak memory in use $(cat /tmp/mem-peak 2>/dev/null || echo ?) MiB of $(awk '/MemTotal/{print int($2/1024)}' /proc/meminfo)"
    echo "PWVM-MEM $name $(cat /tmp/mem-peak 2>/dev/null || echo ?)"
    poweroff -f
}
fail() {
    echo "PWVM-FAIL $name: $*"
    [ "$name" = ctl ] && echo "$*" > /mnt/work/ctl-failed
    finish
}
INIT
    echo "$softroce_load_modules_sh"
    cat <<'INIT'
hostname "$name"
ip link set lo up
ip link set eth0 mtu "$mtu"
ip link set eth0 up
ip addr add "$ip/24" dev eth0
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add rxe0 failed"
i=0
until rdma link show 2>/dev/null | grep -q 'rxe0/1 state ACTIVE'; do
    i=$((i + 1)); [ $i -le 100 ] || fail "rxe0 not ACTIVE after 50 s: $(rdma link show 2>&1)"
    sleep 0.5
done
mount -t 9p -o trans=virtio,version=9p2000.L,ro host0 /mnt/host || fail "mounting host0"
mount -t 9p -o trans=virtio,version=9p2000.L,cache=mmap work /mnt/work || fail "mounting work"
ulimit -l unlimited
ulimit -n 65536
export HOME=/root RUST_BACKTRACE=1 PAGEWIRE_RDMA_DEVICE=rxe0 \
    PAGEWIRE_VERBS_ACK_TIMEOUT=17 PAGEWIRE_VERBS_RETRY=7 \
    PAGEWIRE_VM_EXEC_ENV=PAGEWIRE_RDMA_DEVICE,PAGEWIRE_VERBS_ACK_TIMEOUT,PAGEWIRE_VERBS_RETRY,RUST_BACKTRACE
bench=/mnt/host/pagewire-bench
say "up: $ip, $(rdma link show | grep -o 'rxe0/1 state [A-Z]*'), mtu $mtu, $(grep -c ^processor /proc/cpuinfo) cpu, $(awk '/MemTotal/{print int($2/1024)}' /proc/meminfo) MiB"
echo "PWVM-UP $name $(cut -d' ' -f1 /proc/uptime)"
# Peak memory in use (MemTotal - MemAvailable), sampled every 2 s.
(
    peak=0
    while :; do
        u=$(awk '/MemTotal/{t=$2} /MemAvailable/{a=$2} END{print int((t - a) / 1024)}' /proc/meminfo)
        [ "$u" -gt "$peak" ] && peak=$u && echo "$peak" > /tmp/mem-peak
        sleep 2
    done
) &

if [ "$name" != ctl ]; then
    "$bench" vm-agent --listen "$ip:7700" &
    until [ -e /mnt/work/ctl-done ]; do sleep 1; done
    finish
fi

# ---- VM0: wait for every agent, perftest against node-1, the storm.
out=/mnt/work/out
mkdir -p "$out"
probe() { # ADDR COMMAND...: the agent at ADDR runs COMMAND
    pa=$1; shift
    timeout 20 "$bench" vm-exec "$pa:7700" probe --connect-timeout-ms 2000 -- "$@" 2>&1
}
t0=$(cut -d. -f1 /proc/uptime)
for k in $(seq 1 "$nodes") host; do
    if [ "$k" = host ]; then a=10.99.0.1; check=true; else a=10.99.0.$((10 + k)); check="rdma link show"; fi
    i=0
    until r=$(probe "$a" $check) && { [ "$k" = host ] || echo "$r" | grep -q 'rxe0/1 state ACTIVE'; }; do
        i=$((i + 1)); [ $i -le 300 ] || fail "the agent at $a does not answer: $r"
        sleep 1
    done
    say "agent $a answers${r:+: $(echo "$r" | head -n1)}"
done
echo "PWVM-AGENTS $(( $(cut -d. -f1 /proc/uptime) - t0 ))"
# The guest's clock against the host's (the host's agent runs `date`): under
# TCG a guest whose TSC calibration went wrong keeps a clock that runs at
# another pace than the host's, and every lease and timeout with it.
host_now() { probe 10.99.0.1 date +%s.%N | tail -n1; }
g1=$(cut -d' ' -f1 /proc/uptime); h1=$(host_now)

# perftest TOOL ARGS...: TOOL's server on node-1 through its agent, its
# client here; both outputs in $out. A perftest server serves one client
# and exits, so each try starts its own, on a port of its own (a server of
# a failed try may still hold the last one until the agent kills it); a
# failed try's outputs are kept as perftest-TOOL[-server].try-N.txt.
perftest() {
    tool=$1; shift
    j=0
    while :; do
        port=$((18515 + j))
        "$bench" vm-exec 10.99.0.11:7700 "perf-$tool-$j" -- "$tool" -d rxe0 -p $port "$@" \
            > "$out/perftest-$tool-server.txt" 2>&1 &
        spid=$!
        sleep 2
        ok=0
        timeout 300 "$tool" -d rxe0 -p $port "$@" 10.99.0.11 > "$out/perftest-$tool.txt" 2>&1 && ok=1
        k=0
        while kill -0 $spid 2>/dev/null && [ $k -lt 20 ]; do sleep 0.5; k=$((k + 1)); done
        kill $spid 2>/dev/null; wait $spid 2>/dev/null
        [ $ok = 1 ] && break
        cp "$out/perftest-$tool.txt" "$out/perftest-$tool.try-$j.txt"
        cp "$out/perftest-$tool-server.txt" "$out/perftest-$tool-server.try-$j.txt"
        say "$tool: try $j failed: $(tail -n2 "$out/perftest-$tool.txt" | tr -s ' \n' ' ')"
        j=$((j + 1)); [ $j -lt 5 ] || break
        sleep 2
    done
    say "$tool: $(grep -A1 '#bytes' "$out/perftest-$tool.txt" | tail -n1 | tr -s ' ')"
}
perftest ib_read_lat -s 4096 -n 1000
perftest ib_read_bw -s 4096 -n 2000
echo "PWVM-PERFTEST done"
g2=$(cut -d' ' -f1 /proc/uptime); h2=$(host_now)
echo "PWVM-CLOCK guest $(awk -v a="$g1" -v b="$g2" 'BEGIN{printf "%.2f", b - a}') s, host $(awk -v a="$h1" -v b="$h2" 'BEGIN{printf "%.2f", b - a}') s, clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource)"
# remote_bench: `pagewire-bench remote` with node-1 as the owner machine.
remote_bench() {
    say "remote: verbs, tcp, gRPC, Redis and perftest between ctl and node-1"
    echo "PWVM-REMOTE start"
    cd /tmp
    # The rdma crate's debug lines say what a failed READ met (a flush, a
    # fresh queue pair, a timeout). The bare one-sided readers' operation
    # timeout is 30 s, as node/tests/remote_verbs.rs's under TCG: the
    # default 5 s failed a READ ("timed out") in two recent CI runs. (The
    # storm's readers go through the cluster client, whose READ timeout is
    # its 1 s RPC timeout, but which falls back to FaultIn and retries
    # within --op-deadline-ms; a bare reader has no fallback.)
    RUST_LOG=${RUST_LOG:-warn,pagewire_rdma=debug} PAGEWIRE_VERBS_OP_TIMEOUT_MS=30000 \
        timeout -s KILL 900 "$bench" remote --paths verbs,tcp,grpc,redis,perftest \
        --clients 1 --run 1,16 --pages 1024 --seconds 2 --runs 3 --perftest-iters 1000 \
        --ip 10.99.0.10 --owner-ip 10.99.0.11 \
        --owner-exec "$bench vm-exec 10.99.0.11:7700 remote-owner --" \
        --work-dir /mnt/work/remote --json --out "$out/remote" \
        > "$out/remote-stdout.json" 2> "$out/remote-stderr.log"
    rrc=$?
    echo "$rrc" > "$out/remote.rc"
    echo "PWVM-REMOTE rc=$rrc"
}
if [ "$mode" = self-check ] || [ "$mode" = perftest ]; then
    finish
fi
if [ "$mode" = remote ]; then
    remote_bench
    finish
fi

set --
while IFS= read -r a; do set -- "$@" "$a"; done < /mnt/work/storm-args
say "storm: $bench storm $*"
echo "PWVM-STORM start"
cd /tmp
timeout -s KILL "$secs" "$bench" storm "$@" > "$out/storm-stdout.json" 2> "$out/storm-stderr.log"
rc=$?
echo "$rc" > "$out/storm.rc"
echo "PWVM-STORM rc=$rc"
if [ "$remote" = 1 ]; then
    remote_bench
fi
finish
INIT
} >"$root/init"
chmod +x "$root/init"
softroce_pack "$dir/initrd.gz"
say "initramfs: $(du -h "$dir/initrd.gz" | cut -f1), kernel $kver"

# ------------------------------------------------------------ the network

owned=1
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT
trap 'say "terminated"; exit 143' TERM
t_start=$(date +%s)
nsx() { ip netns exec "$NS" "$@"; }
ip netns add "$NS"
nsx sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 2>/dev/null || true
ip -n "$NS" link set lo up
ip -n "$NS" link add "$BR" type bridge stp_state 0 forward_delay 0
ip -n "$NS" link set "$BR" mtu "$mtu"
ip -n "$NS" addr add "$NET.1/24" dev "$BR"
ip -n "$NS" link set "$BR" up
for ((k = 0; k <= nodes; k++)); do
    ip -n "$NS" tuntap add dev "pwtap$k" mode tap
    ip -n "$NS" link set "pwtap$k" mtu "$mtu" master "$BR" up
done
# Docker hosts may have br_netfilter: frames bridged in this namespace then
# go through this namespace's own iptables, which is empty (ACCEPT); say so,
# and accept bridge-to-bridge explicitly should its FORWARD policy not.
brnf=$(nsx cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || echo absent)
fwd=$(nsx iptables -S FORWARD 2>/dev/null | head -n1 || true)
if [[ $brnf == 1 && $fwd != "-P FORWARD ACCEPT" ]] && command -v iptables >/dev/null; then
    nsx iptables -I FORWARD -i "$BR" -o "$BR" -j ACCEPT
    say "br_netfilter on and FORWARD is '$fwd' in $NS: accepting $BR<->$BR there"
fi
say "netns $NS: bridge $BR $NET.1/24 (mtu $mtu), taps pwtap0..pwtap$nodes; bridge-nf-call-iptables=$brnf, ${fwd:-no iptables}"

# The hosts file and the storm's arguments.
toml_list() {
    local out="" a
    for a in "$@"; do out+="${out:+, }\"$a\""; done
    printf '[%s]' "$out"
}
B=/mnt/host/pagewire-bench
{
    echo "# written by softroce-cluster.sh: VM0 ($NET.10) runs the storm, the coordinator and the readers"
    echo "[orchestrator]"
    echo "ip = \"$NET.10\""
    echo "[coordinator]"
    echo "ip = \"$NET.10\""
    for ((k = 1; k <= nodes; k++)); do
        ip=$(node_ip "$k")
        echo "[[node]]"
        echo "name = \"node-$k\""
        echo "ip = \"$ip\""
        echo "exec = $(toml_list "$B" vm-exec "$ip:$AGENT_PORT" "node-$k" --)"
        echo "signal = $(toml_list "$B" vm-exec "$ip:$AGENT_PORT" "node-$k" --signal)"
        echo "cut = $(toml_list "$B" vm-exec "$NET.1:$AGENT_PORT" "cut-$k" -- ip link set "pwtap$k" down)"
        echo "heal = $(toml_list "$B" vm-exec "$NET.1:$AGENT_PORT" "heal-$k" -- ip link set "pwtap$k" up)"
    done
    echo "[[reader]]"
    echo "ip = \"$NET.10\""
} >"$dir/work/hosts.toml"
storm_args=(--transport verbs --hosts /mnt/work/hosts.toml --work-dir /mnt/work/storm --keep
    --json --out /mnt/work/out "${storm_defaults[@]}")
((user_faults)) || storm_args+=("${fault_defaults[@]}")
storm_args+=("${user_args[@]}")
printf '%s\n' "${storm_args[@]}" >"$dir/work/storm-args"

# The host's agent, inside the namespace, for the cuts and heals.
nsx timeout -k 5 "$timeout_s" "$dir/share/pagewire-bench" vm-agent --listen "$NET.1:$AGENT_PORT" \
    >"$dir/agent-host.log" 2>&1 &
agent_pid=$!

# ------------------------------------------------------------ the VMs

# The storm's own bound inside VM0: what is left after a boot allowance.
storm_secs=$((timeout_s - 240))
((storm_secs > 60)) || storm_secs=60
boot_vm() { # K
    local k=$1 name m s
    name=$(vm_name "$k")
    if ((k == 0)); then m=$ctl_mem s=$ctl_smp; else m=$mem s=$smp; fi
    nsx timeout -k 10 "$timeout_s" qemu-system-x86_64 -accel tcg -cpu max -smp "$s" -m "$m" \
        -kernel "$kdir/boot/vmlinuz-$kver" -initrd "$dir/initrd.gz" \
        -append "console=ttyS0 panic=-1 quiet rdinit=/init pw.name=$name pw.ip=$(node_ip "$k") pw.mtu=$mtu pw.mode=$mode pw.nodes=$nodes pw.secs=$storm_secs pw.remote=$remote" \
        -display none -serial "file:$dir/console-$name.log" -monitor none -no-reboot \
        -netdev "tap,id=n0,ifname=pwtap$k,script=no,downscript=no" \
        -device "virtio-net-pci,netdev=n0,mac=$(vm_mac "$k")" \
        -virtfs "local,path=$dir/share,mount_tag=host0,security_model=none,readonly=on" \
        -virtfs "local,path=$dir/work,mount_tag=work,security_model=none" \
        </dev/null >"$dir/qemu-$name.log" 2>&1 &
    vm_pids[k]=$!
}
say "booting $((nodes + 1)) VMs under qemu TCG: ctl ${ctl_mem} MiB/${ctl_smp} cpu, $nodes node(s) ${mem} MiB/${smp} cpu; timeout ${timeout_s}s; mode $mode"
for ((k = 0; k <= nodes; k++)); do boot_vm "$k"; done

# Follows VM0's console and the node VMs' up markers until VM0 exits.
declare -A seen=()
up_at=()
show_new() { # NAME: prints the console lines of VM NAME not shown yet
    local f=$dir/console-$1.log n
    [[ -f $f ]] || return 0
    n=$(wc -l <"$f")
    if ((n > ${seen[$1]:-0})); then
        sed -n "$((${seen[$1]:-0} + 1)),${n}p" "$f" | tr -d '\r' | grep -E '^(pwvm|PWVM)' | sed "s/^/  /" >&2 || true
        seen[$1]=$n
    fi
}
deadline=$((t_start + timeout_s))
while jobs -rp | grep -qx "${vm_pids[0]}"; do
    for ((k = 0; k <= nodes; k++)); do
        name=$(vm_name "$k")
        if [[ -z ${up_at[k]:-} ]] && grep -q "^PWVM-UP $name" "$dir/console-$name.log" 2>/dev/null; then
            up_at[k]=$(($(date +%s) - t_start))
        fi
        show_new "$name"
    done
    (($(date +%s) < deadline + 15)) || break
    sleep 2
done
for ((k = 0; k <= nodes; k++)); do show_new "$(vm_name "$k")"; done
ctl_rc=0
wait "${vm_pids[0]}" || ctl_rc=$?
touch "$dir/work/ctl-done"
# The node VMs power off when they see ctl-done (polled each second).
for ((i = 0; i < 60; i++)); do
    left=0
    for ((k = 1; k <= nodes; k++)); do jobs -rp | grep -qx "${vm_pids[k]}" && left=1; done
    ((left)) || break
    sleep 0.5
done
t_total=$(($(date +%s) - t_start))
[[ $ctl_rc != 124 && $ctl_rc != 137 ]] || say "VM0 did not finish within ${timeout_s}s (a hang?)"

# ------------------------------------------------------------ the verdict

boot_line=""
for ((k = 0; k <= nodes; k++)); do
    name=$(vm_name "$k")
    g=$(tr -d '\r' <"$dir/console-$name.log" 2>/dev/null | awk -v n="$name" '$1 == "PWVM-UP" && $2 == n {print $3}')
    boot_line+=" $name:${g:-?}s guest/${up_at[k]:-?}s wall"
done
say "boot (to rxe0 ACTIVE and 9p mounted):$boot_line"
grep -h '^PWVM-FAIL' "$dir"/console-*.log 2>/dev/null | tr -d '\r' | sed 's/^/  /' >&2 || true

verdict=$(python3 - "$dir/work" "$mode" "$nodes" "$remote" <<'PY'
import json, os, re, sys
work, mode, nodes, remote = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
out = os.path.join(work, "out")
lines, ok = [], True
def bad(msg):
    global ok
    ok = False
    lines.append("FAIL " + msg)

def error_line(log):
    """The `Error: ...` line (and its causes) a bench printed as it exited:
    on the FAIL line itself, which a log that keeps only a part of the
    output still shows."""
    try:
        text = open(os.path.join(out, log), errors="replace").read().splitlines()
    except OSError:
        return f"no {log}"
    for i, l in enumerate(text):
        if l.startswith("Error: "):
            causes = []
            for c in (c.strip() for c in text[i + 1:i + 12]):
                if c.startswith("Stack backtrace"):
                    break
                if c and c != "Caused by:":
                    causes.append(c)
            return " / ".join([l] + causes)
    return f"no error line in {log}"

def perf(tool, cols):
    p = os.path.join(out, f"perftest-{tool}.txt")
    try:
        text = open(p).read()
    except OSError:
        bad(f"{tool}: no output")
        return None
    rows = text.splitlines()
    for i, l in enumerate(rows):
        if l.strip().startswith("#bytes") and i + 1 < len(rows):
            h = l.strip().replace("% percentile", "%_percentile").replace("BW ", "BW_")
            head = h.split()
            vals = rows[i + 1].split()
            if len(vals) >= 3:
                return dict(zip(head, vals))
    bad(f"{tool}: no result table in {p}:\n    " + "\n    ".join(rows[-8:]))
    return None

lat = perf("ib_read_lat", 0)
if lat:
    keys = list(lat)
    def pick(sub):
        k = [k for k in keys if sub in k]
        return lat[k[0]] if k else "?"
    lines.append(f"ib_read_lat 4 KiB ctl->node-1: typical(p50) {pick('typical')} us, avg {pick('avg')} us, "
                 f"min {pick('min')} us, p99 {pick('99%')} us, p99.9 {pick('99.9%')} us, {pick('iterations')} iterations")
bw = perf("ib_read_bw", 0)
if bw:
    keys = list(bw)
    k = [k for k in keys if "average" in k]
    r = [k for k in keys if "MsgRate" in k]
    lines.append(f"ib_read_bw 4 KiB ctl->node-1: average {bw[k[0]] if k else '?'} MB/s, "
                 f"{bw[r[0]] if r else '?'} Mpps")

if mode == "storm":
    args = open(os.path.join(work, "storm-args")).read().split("\n")
    expected = 0
    for i, a in enumerate(args):
        flag = a.split("=", 1)[0]
        if flag in ("--kill", "--restart", "--cut", "--heal"):
            expected += 1
        elif flag == "--pause":
            expected += 2  # SIGSTOP, then SIGCONT
    rc = open(os.path.join(out, "storm.rc")).read().strip() if os.path.exists(os.path.join(out, "storm.rc")) else "none"
    if rc != "0":
        bad(f"the storm exited with {rc}: {error_line('storm-stderr.log')}")
    try:
        doc = json.load(open(os.path.join(out, "storm.json")))
    except (OSError, ValueError) as e:
        bad(f"no storm.json: {e}")
        doc = None
    if doc is not None:
        rows = doc.get("results", [])
        if not rows:
            bad("no result rows")
        verbs_rows = 0
        for r in rows:
            tag = f"{r.get('phase')}/{r.get('path')}/{r.get('transport')}"
            osv = r.get("one_sided_verbs")
            lines.append(f"row {tag:24s} {r.get('pages_per_sec', 0):7.1f} pages/s  p50 {r.get('p50_us', 0) / 1000:.1f} ms  "
                         f"wrong {r.get('wrong_reads')}  stale {r.get('stale_reads')}  errors {r.get('errors')}  "
                         f"one_sided_verbs {osv}  fallbacks {r.get('fallbacks')}  hit_ratio {r.get('hit_ratio')}")
            if r.get("wrong_reads") != 0 or r.get("stale_reads") != 0:
                bad(f"{tag}: wrong_reads={r.get('wrong_reads')} stale_reads={r.get('stale_reads')}")
            if r.get("path") == "one-sided" and r.get("transport") == "verbs":
                verbs_rows += 1
                if not (isinstance(osv, int) and osv > 0):
                    bad(f"{tag}: one_sided_verbs={osv}")
        if verbs_rows == 0:
            bad("no one-sided row over verbs")
        ev = doc.get("events", [])
        for e in ev:
            rec = e.get("recovered_after_s")
            lines.append(f"event {e.get('event')!s:24s} at {e.get('at_s', 0):6.1f} s: recovered after "
                         + (f"{rec:.2f} s" if isinstance(rec, (int, float)) else f"{rec}")
                         + f", dip {e.get('dip_pct')} %")
            if e.get("recovered_after_s") is None:
                bad(f"event {e.get('event')} did not recover")
        if len(ev) != expected:
            bad(f"{len(ev)} events in the JSON, {expected} scheduled")
        for n in doc.get("notes", []):
            lines.append(f"note: {n}")
if mode == "remote" or (mode == "storm" and remote == "1"):
    rc = open(os.path.join(out, "remote.rc")).read().strip() if os.path.exists(os.path.join(out, "remote.rc")) else "none"
    if rc != "0":
        bad(f"pagewire-bench remote exited with {rc}: {error_line('remote-stderr.log')}")
    try:
        doc = json.load(open(os.path.join(out, "remote", "remote.json")))
    except (OSError, ValueError) as e:
        bad(f"no remote.json: {e}")
        doc = None
    if doc is not None:
        rows = doc.get("results", [])
        if not any(r.get("transport") == "verbs" for r in rows):
            bad("remote: no verbs row")
        for r in rows:
            cpu = r.get("owner_cpu_us_per_read")
            rcpu = r.get("reader_cpu_us_per_read")
            lines.append(f"remote {r.get('path')}/{r.get('transport')}/{r.get('index_cache')} x{r.get('clients')} run {r.get('run')}: "
                         f"{r.get('ops_per_sec', 0):.0f} pages/s, p50 {r.get('p50_us', 0):.0f} us, p99 {r.get('p99_us', 0):.0f} us, max {r.get('max_us', 0):.0f} us, "
                         f"owner cpu {'-' if cpu is None else f'{cpu:.0f}'} us/read, reader cpu {'-' if rcpu is None else f'{rcpu:.0f}'} us/read, rt/read {r.get('round_trips_per_read', 0):.3f}, wrong {r.get('wrong_reads')}")
            if r.get("wrong_reads") != 0:
                bad(f"remote {r.get('path')}/{r.get('transport')}: wrong_reads={r.get('wrong_reads')}")
        for t in doc.get("targets", []):
            lines.append(f"remote target {t.get('target')}: {t.get('value'):.3f} (bound {t.get('bound')}) -> {'met' if t.get('met') else 'MISSED'}")
        for n in doc.get("skipped", []):
            lines.append(f"remote skipped: {n}")
if mode in ("self-check", "perftest"):
    cons = open(os.path.join(os.path.dirname(work), "console-ctl.log"), errors="replace").read()
    if "PWVM-AGENTS" not in cons:
        bad("not every agent answered")
    if "PWVM-PERFTEST done" not in cons:
        bad("perftest did not finish")
if os.path.exists(os.path.join(work, "ctl-failed")):
    bad("VM0: " + open(os.path.join(work, "ctl-failed")).read().strip())
print("\n".join(lines))
print("VERDICT " + ("PASS" if ok else "FAIL"))
PY
) || verdict="VERDICT FAIL (the check itself failed)"
echo "$verdict" | grep -v '^VERDICT' | sed 's/^/  /'
if grep -q '^VERDICT PASS' <<<"$verdict" && [[ $ctl_rc == 0 ]]; then
    echo "SOFTROCE-CLUSTER PASS: $mode on $((nodes + 1)) soft-RoCE VMs in ${t_total}s (results in $dir)"
    exit 0
fi
echo "SOFTROCE-CLUSTER FAIL: $mode (VM0 qemu rc=$ctl_rc, ${t_total}s); see $dir/console-*.log and $dir/work/out"
# The remote's stderr too: its error line is the only trace of why it
# exited non-zero (its JSON is written only at the end).
for f in "$dir/work/out/storm-stderr.log" "$dir/work/out/remote-stderr.log" "$dir/console-ctl.log"; do
    [[ -s $f ]] || continue
    echo "----- $f (last 30 lines)"
    tail -n 30 "$f" | tr -d '\r'
done
exit 1
