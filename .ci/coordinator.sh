#!/usr/bin/env bash
# Checks of the proto, coordinator, pwctl and node-daemon code beyond the
# workspace's fmt/clippy/tests (which .ci/run runs):
#   1. their tests and the end-to-end tests (pagewire-e2e: real processes on
#      loopback, built by that package), run explicitly so a filter elsewhere
#      cannot skip them;
#   2. a smoke run of a three-node cluster driven by pwctl: status, nodes,
#      map, topology, warm, stats, evict, /metrics, kill -9 of a node, drain;
#   3. the same over TLS (rustls) with a throwaway CA made by openssl.
# Run from the repository root, as root, on a fresh Debian machine with the
# Rust toolchain and cargo-nextest. Everything listens on 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

missing=()
command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
if ((${#missing[@]})); then
  echo "== installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

echo "== build"
cargo build --locked -p pagewire-coordinator --bins -p pagewire-pwctl -p pagewire-node --bin pagewire-node

echo "== tests: proto, coordinator, end-to-end (pagewire-e2e), node daemon"
if [[ ${PAGEWIRE_CI_TESTED:-0} == 1 ]]; then
  # .ci/run ran `cargo test --workspace` already, which holds these.
  echo "(run by .ci/run's workspace tests: skipped here)"
elif cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --locked --no-fail-fast -p pagewire-proto -p pagewire-coordinator -p pagewire-pwctl -p pagewire-e2e
  cargo nextest run --locked --no-fail-fast -p pagewire-node --lib daemon::
else
  cargo test --locked --no-fail-fast -p pagewire-proto -p pagewire-coordinator -p pagewire-pwctl -p pagewire-e2e
  cargo test --locked --no-fail-fast -p pagewire-node --lib daemon::
fi

B=target/debug
W=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  if [[ ${keep_logs:-0} == 1 ]]; then
    for f in "$W"/*.log; do echo "--- $f"; tail -n 20 "$f"; done
  fi
  rm -rf "$W"
}
trap cleanup EXIT
keep_logs=1

echo "smoke-token-$$" >"$W/token"
truncate -s 1G "$W/data.bin"

# Waits up to 30 s for "$@" to succeed.
wait_for() {
  local what=$1; shift
  for _ in $(seq 300); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  echo "timed out waiting for $what" >&2
  return 1
}

# The address a process logged for KEY (e.g. grpc=127.0.0.1:41234).
logged_addr() { grep -o "$2=[0-9.]*:[0-9]*" "$1" | head -n1 | cut -d= -f2; }

start_coordinator() { # LOG ARGS...
  local log=$1; shift
  "$B/pagewire-coordinator" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
    --state-file "$W/coordinator.state" --token-file "$W/token" --lease-ms 1000 "$@" \
    >/dev/null 2>"$log" &
  pids+=($!)
  disown $!
  wait_for "coordinator address" grep -q "grpc=" "$log"
  COORD=$(logged_addr "$log" grpc)
  COORD_METRICS=$(logged_addr "$log" metrics)
}

start_node() { # ID ARGS...
  local id=$1; shift
  "$B/pagewire-node" --node-id "$id" --backing-file "$W/data.bin" --listen 127.0.0.1:0 \
    --metrics-listen 127.0.0.1:0 --coordinator "$COORD" --token-file "$W/token" --frames 4096 "$@" \
    >/dev/null 2>"$W/$id.log" &
  pids+=($!)
  disown $!
  eval "PID_${id//-/_}=$!"
}

settled() { # N: N nodes hold a lease, nothing in handoff
  "$B/pwctl" --json status | grep -q "\"nodes_alive\": $1," &&
    "$B/pwctl" --json status | grep -q '"extents_in_handoff": 0,'
}

run_cluster() { # label, extra pwctl flags
  local label=$1
  echo "== smoke ($label): three nodes"
  for n in 1 2 3; do start_node "node-$n" "${NODE_TLS[@]}"; done
  wait_for "three settled nodes" settled 3
  "$B/pwctl" status
  "$B/pwctl" nodes
  "$B/pwctl" map
  "$B/pwctl" topology
  "$B/pwctl" warm 0..16M
  "$B/pwctl" stats
  "$B/pwctl" evict all
  "$B/pwctl" --json map >/dev/null
  curl -fsS "http://$COORD_METRICS/metrics" >"$W/coord.metrics"
  grep -q '^pagewire_coordinator_map_epoch ' "$W/coord.metrics"
  local nm
  nm=$(logged_addr "$W/node-1.log" metrics)
  [[ -n $nm ]] || nm=$("$B/pwctl" --json nodes | grep -o '"metrics_address": "[0-9.:]*"' | head -n1 | cut -d'"' -f4)
  curl -fsS "http://$nm/metrics" >"$W/node.metrics"
  grep -q '^pagewire_node_cache_frames{node_id="node-[0-9]"} ' "$W/node.metrics"
  echo "metrics: coordinator and node-1 answer"

  echo "== smoke ($label): kill -9 node-2"
  local t0 t1
  t0=$(date +%s%N)
  kill -9 "$PID_node_2"
  wait_for "node-2 declared dead" sh -c "'$B/pwctl' nodes | grep -E '^node-2 ' | grep -q dead"
  t1=$(date +%s%N)
  echo "node-2's extents reassigned $(((t1 - t0) / 1000000)) ms after kill -9 (lease 1000 ms)"
  "$B/pwctl" map

  echo "== smoke ($label): drain node-3"
  "$B/pwctl" drain node-3 --wait 20
  "$B/pwctl" map
  "$B/pwctl" map | grep -E '^node-3 ' | grep -q ' drained '
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  pids=()
  rm -f "$W/coordinator.state"
}

export PAGEWIRE_TOKEN
PAGEWIRE_TOKEN=$(cat "$W/token")
NODE_TLS=()
start_coordinator "$W/coordinator.log"
export PAGEWIRE_COORDINATOR=$COORD
run_cluster plain

echo "== TLS: throwaway CA and server certificate for localhost"
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=pagewire-test-ca \
  -keyout "$W/ca.key" -out "$W/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout "$W/srv.key" -out "$W/srv.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >"$W/ext"
openssl x509 -req -in "$W/srv.csr" -CA "$W/ca.crt" -CAkey "$W/ca.key" -CAcreateserial -days 1 \
  -extfile "$W/ext" -out "$W/srv.crt" 2>/dev/null
cat >"$W/coordinator-tls.toml" <<TOML
[tls]
cert_file = "$W/srv.crt"
key_file = "$W/srv.key"
node_ca_file = "$W/ca.crt"
node_domain = "localhost"
TOML
cat >"$W/node-tls.toml" <<TOML
[tls]
cert_file = "$W/srv.crt"
key_file = "$W/srv.key"
coordinator_ca_file = "$W/ca.crt"
coordinator_domain = "localhost"
TOML
start_coordinator "$W/coordinator-tls.log" --config "$W/coordinator-tls.toml"
COORD="https://$COORD"
export PAGEWIRE_COORDINATOR=$COORD
NODE_TLS=(--config "$W/node-tls.toml")
pwctl_tls() { "$B/pwctl" --tls-ca "$W/ca.crt" --tls-domain localhost "$@"; }
# A plain-text client must not get through.
if "$B/pwctl" --timeout-ms 2000 status >/dev/null 2>&1; then
  echo "plain-text pwctl reached the TLS coordinator" >&2
  exit 1
fi
for n in 1 2 3; do start_node "node-$n" "${NODE_TLS[@]}"; done
# Settled as in the plain run: three leases and no extent in handoff (a
# warm of an extent still moving is refused; CI saw it once).
settled_tls() {
  pwctl_tls --json status >"$W/status-tls.json" &&
    grep -q '"nodes_alive": 3,' "$W/status-tls.json" &&
    grep -q '"extents_in_handoff": 0,' "$W/status-tls.json"
}
wait_for "three settled nodes over TLS" settled_tls
pwctl_tls status
pwctl_tls warm 0..4M
pwctl_tls stats
echo "TLS: coordinator, nodes and pwctl talk over rustls"

keep_logs=0
echo "coordinator.sh: all checks passed in $(($(date +%s) - start)) s"
