#!/usr/bin/env bash
# CI for the storm's multi-host harness (bench/scripts/storm-netns.sh); .ci/run
# calls it as `bash .ci/netns.sh` from the repository root, as root, on a
# fresh Debian machine with the Rust toolchain.
#
# 1. installs what it needs (iproute2, python3 for the self-check's TOML and
#    JSON, shellcheck);
# 2. lints the harness and this script with shellcheck;
# 3. builds the release coordinator, pwctl and node daemon;
# 4. runs the self-check: network-namespace hosts on a bridge, a coordinator
#    and three nodes in them, a cut of node-2 (declared dead, its extents
#    moved) and a heal (it registers again and gets extents back), within
#    two minutes, cleaning up after itself whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { echo "=== netns ci: $* ($(date -u +%T))"; }

step "installing packages"
missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
python3 -c 'import tomllib' >/dev/null 2>&1 || missing+=(python3)
command -v shellcheck >/dev/null 2>&1 || missing+=(shellcheck)
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

step "shellcheck"
shellcheck bench/scripts/storm-netns.sh .ci/netns.sh

step "build (release: pagewire-coordinator, pwctl, pagewire-node, pagewire-bench)"
# CI's one release line (fresh when .ci/run built it).
bash k8s/image/build.sh --binaries-only

step "storm-netns.sh --self-check"
# The script cleans up on SIGTERM; --kill-after is the last resort, and
# --force-clean removes what a run killed that way (or a CI machine reused
# after one) left behind: CI's machine is its own.
timeout --kill-after=20 120 bash bench/scripts/storm-netns.sh --self-check --force-clean \
  --bin-dir "${CARGO_TARGET_DIR:-target}/release"

step "a short storm across the namespace hosts, node-2 cut off and healed"
# tcp only (a namespace host has its own /dev/shm); every read verified; the
# cut must be recovered from (its extents served by the others) within the run.
timeout --kill-after=20 240 bash bench/scripts/storm-netns.sh --force-clean --nodes 3 --readers 2 \
  --cut-at 4s --heal-at 9s -- --file-mib 16 --duration 12s --compare one-sided,grpc,pread \
  --compare-duration 1s --lease-ms 1500 --json --out "${CARGO_TARGET_DIR:-target}/storm-netns" |
  python3 -c '
import json, sys
# The script logs to stdout too: take the JSON line of the storm.
d = json.loads([l for l in sys.stdin.read().splitlines() if l.startswith("{\"bench\"")][-1])
assert d["bench"] == "storm", d
for r in d["results"]:
    assert r["wrong_reads"] == 0 and r["stale_reads"] == 0, r
cut = [e for e in d["events"] if e["kind"] == "cut"]
assert cut and cut[0]["recovered_after_s"] is not None, d["events"]
print("netns storm: cut recovered after %.2f s; %s" % (cut[0]["recovered_after_s"],
      ", ".join("%s %s %.0f pages/s" % (r["phase"], r["path"], r["pages_per_sec"]) for r in d["results"])))
'

step "done"
