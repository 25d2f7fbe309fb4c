#!/usr/bin/env bash
# Runs check.sh against a one-machine cluster this script starts and stops:
# a coordinator and 3 pagewire-nodes on loopback (ports BASE..BASE+32,
# default 27400), a generated self-describing 64 MiB backing file (the
# nodes' caches hold 3 x 8 MiB of it, so eviction runs), a bounded
# `pagewire-bench storm` reader over tcp (attach mode), node-proxied gRPC
# Reads, and one provoked coordinator RPC error. Every process it starts is
# killed at the end (by pid) and its temporary folder removed.
#
#   BIN=/path/to/release k8s/monitoring/loopback-test.sh [--load-seconds N] [check.py options]
#
# BIN holds pagewire-coordinator, pagewire-node and pagewire-bench (default
# /work/target-snap/release). BASE moves the ports.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BIN=${BIN:-/work/target-snap/release}
BASE=${BASE:-27400}
PAGES=${PAGES:-16384}
FRAMES=${FRAMES:-2048}
for b in pagewire-coordinator pagewire-node pagewire-bench; do
    [ -x "$BIN/$b" ] || { echo "loopback-test: $BIN/$b not found (set BIN)" >&2; exit 2; }
done

work=$(mktemp -d -t pagewire-monitoring-XXXXXX)
coord_pid="" node_pids=()
alive() { [ -n "$(ps -o stat= -p "$1" 2>/dev/null | grep -v '^Z')" ]; }
stop_pid() { # SIGTERM, up to $2 s, then SIGKILL (said on stderr)
    local p=$1 n=$(( $2 * 10 ))
    kill "$p" 2>/dev/null || return 0
    while [ "$n" -gt 0 ] && alive "$p"; do sleep 0.1; n=$((n - 1)); done
    if alive "$p"; then echo "loopback-test: pid $p ($3) still running $2 s after SIGTERM: SIGKILL" >&2; kill -9 "$p" 2>/dev/null || true; fi
    wait "$p" 2>/dev/null || true
}
cleanup() {
    local rc=$?
    # Nodes first (SIGTERM drains them through the coordinator, bounded by
    # shutdown_drain_timeout_ms, 20 s by default), then the coordinator.
    for p in "${node_pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${node_pids[@]}"; do stop_pid "$p" 25 node; done
    [ -n "$coord_pid" ] && stop_pid "$coord_pid" 15 coordinator
    if [ "$rc" -ne 0 ] && [ -d "$work" ]; then
        for f in "$work"/*.log; do echo "== $f"; tail -5 "$f"; done >&2
    fi
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

coord_grpc=127.0.0.1:$BASE
coord_http=127.0.0.1:$((BASE + 1))
echo "pagewire-monitoring-$RANDOM$RANDOM" > "$work/token"

# The self-describing file (node/src/pattern.rs): page number and generation
# 0 in bytes 0..16, then SplitMix64 seeded with page * GOLDEN.
python3 - "$work/data" "$PAGES" <<'EOF'
import struct, sys
M, G = (1 << 64) - 1, 0x9E3779B97F4A7C15
with open(sys.argv[1], "wb") as f:
    for p in range(int(sys.argv[2])):
        s, words = (p * G) & M, []
        for _ in range(510):
            s = (s + G) & M
            z = ((s ^ (s >> 30)) * 0xBF58476D1CE4E5B9) & M
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
            words.append(z ^ (z >> 31))
        f.write(struct.pack("<QQ", p, 0) + struct.pack("<510Q", *words))
EOF

"$BIN/pagewire-coordinator" --token-file "$work/token" --lease-ms 3000 \
    --listen "$coord_grpc" --metrics-listen "$coord_http" \
    --state-file "$work/coord.state" > "$work/coordinator.log" 2>&1 &
coord_pid=$!

nodes_http=() nodes_grpc=()
for i in 1 2 3; do
    grpc=127.0.0.1:$((BASE + 10 + i)) http=127.0.0.1:$((BASE + 20 + i)) tcp=127.0.0.1:$((BASE + 30 + i))
    mkdir -p "$work/shm-$i"
    cat > "$work/node-$i.toml" <<EOF
[transports]
shm = true
tcp = true
tcp_listen = "$tcp"
EOF
    "$BIN/pagewire-node" -c "$work/node-$i.toml" --node-id "node-$i" --backing-file "$work/data" \
        --listen "$grpc" --metrics-listen "$http" --coordinator "$coord_grpc" \
        --token-file "$work/token" --frames "$FRAMES" --shm-dir "$work/shm-$i" \
        > "$work/node-$i.log" 2>&1 &
    node_pids+=($!)
    nodes_http+=("$http") nodes_grpc+=("$grpc")
done

# Wait for 3 alive members (the coordinator's own metric).
for _ in $(seq 100); do
    alive=$(curl -sf "http://$coord_http/metrics" | awk '/^pagewire_coordinator_nodes\{state="alive"\}/ {print $2}' || true)
    [ "${alive:-0}" = 3 ] && break
    sleep 0.2
done
[ "${alive:-0}" = 3 ] || { echo "loopback-test: only ${alive:-0} of 3 nodes alive after 20 s" >&2; exit 1; }
echo "loopback-test: coordinator $coord_grpc (metrics $coord_http), nodes ${nodes_grpc[*]} (metrics ${nodes_http[*]})"

join() { local IFS=,; echo "$*"; }
"$here/check.sh" --coordinator "$coord_http" --node "$(join "${nodes_http[@]}")" \
    --storm "$coord_grpc" --token-file "$work/token" --bench "$BIN/pagewire-bench" \
    --proxy-reads "$(join "${nodes_grpc[@]}")" --proxy-read-pages "$PAGES" \
    --provoke-rpc-error "$coord_grpc" --work-dir "$work" "$@"
