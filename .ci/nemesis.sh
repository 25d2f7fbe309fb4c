#!/usr/bin/env bash
# CI: the nemesis smoke (bench/src/nemesis): a 20 s seeded fault schedule
# (kill -9, restart in place, SIGSTOP past the lease with tight follow-ups,
# drains, joins, undrains, and coordinator failover on three loopback etcd
# members) under logged reads and writes, then the per-page linearizability
# check of the whole history: 0 violations required.
#
# Builds nothing new when .ci/run already built the release binaries
# (`k8s/image/build.sh --binaries-only`: the coordinator with its `etcd`
# feature, which failover needs, the node and bench with verbs).
# NEMESIS_SEED picks the seed (default: from the clock; printed either way).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
B=target/release
echo "== build (CI's one release line; fresh when .ci/run built it)"
t1=$SECONDS
bash k8s/image/build.sh --binaries-only
echo "built in $((SECONDS - t1)) s"
etcd_args=()
if command -v etcd >/dev/null 2>&1; then
  etcd_args=(--etcd)
else
  echo "== no etcd on the PATH (apt install etcd-server etcd-client): failover left out"
fi

seed=${NEMESIS_SEED:-$(( $(date +%s%N) % 1000000007 ))}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "== nemesis smoke: seed $seed"
if ! "$B/pagewire-bench" nemesis --quick --seed "$seed" --bin-dir "$B" "${etcd_args[@]}" \
    --json --work-dir "$out/run" >"$out/report.json"; then
  echo "nemesis smoke FAILED: seed $seed (rerun: $B/pagewire-bench nemesis --quick --seed $seed --bin-dir $B ${etcd_args[*]})" >&2
  cat "$out/report.json" >&2 || true
  exit 1
fi
python3 - "$out/report.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["bench"] == "nemesis", d["bench"]
c = d["check"]
assert not c["violations"], c["violations"]
assert d["reads"] > 0 and d["writes"] > 0, (d["reads"], d["writes"])
assert sum(d["faults_by_kind"].values()) > 0, d["faults_by_kind"]
print(f"nemesis: seed {d['seed']}: {d['reads']} reads, {d['writes']} writes "
      f"({d['writes_failed']} failed), {c['pages_written']} pages written, "
      f"faults {d['faults_by_kind']}, 0 violations")
PY
echo "nemesis.sh: passed in $((SECONDS - t0)) s"
