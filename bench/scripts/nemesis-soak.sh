#!/usr/bin/env bash
# The nemesis soak (opt-in): seeds back to back for MINUTES minutes, the
# focus rotating over mixed, takeover-followup, restart-in-place and
# readahead-boundary; the failing seeds' work folders (histories, logs)
# kept under OUT; at the end the seed list and the totals (operations,
# faults by kind, violations).
#
#   bench/scripts/nemesis-soak.sh [MINUTES=30] [RUN_SECONDS=60] [-- nemesis args...]
#
# Environment: BENCH (default target/release/pagewire-bench), BIN_DIR (the
# daemons, default target/release; its coordinator needs the etcd feature
# for --etcd, which is passed when etcd is on the PATH and NO_ETCD is
# unset), OUT (default bench-out/nemesis-soak), FOCUS (one focus instead of
# the rotation).
set -euo pipefail
cd "$(dirname "$0")/../.."
minutes=${1:-30}
run_s=${2:-60}
shift $(($# >= 2 ? 2 : $#))
[[ ${1:-} == -- ]] && shift
extra=("$@")
BENCH=${BENCH:-target/release/pagewire-bench}
BIN_DIR=${BIN_DIR:-target/release}
OUT=${OUT:-bench-out/nemesis-soak}
mkdir -p "$OUT"
etcd=()
if [[ -z ${NO_ETCD:-} ]] && command -v etcd >/dev/null 2>&1; then etcd=(--etcd); fi
foci=(mixed takeover-followup restart-in-place readahead-boundary)
[[ -n ${FOCUS:-} ]] && foci=("$FOCUS")
end=$((SECONDS + minutes * 60))
i=0
: >"$OUT/seeds.txt"
while ((SECONDS + run_s / 2 < end)); do
  seed=$(( ($(date +%s%N) + i * 7919) % 1000000007 ))
  focus=${foci[$((i % ${#foci[@]}))]}
  i=$((i + 1))
  dir="$OUT/seed-$seed"
  echo "== run $i: seed $seed, focus $focus, ${run_s} s"
  if "$BENCH" nemesis --seed "$seed" --focus "$focus" --duration "${run_s}s" \
      --bin-dir "$BIN_DIR" "${etcd[@]}" "${extra[@]}" --json --work-dir "$dir" \
      >"$OUT/seed-$seed.json" 2>"$OUT/seed-$seed.log"; then
    echo "$seed $focus ok" >>"$OUT/seeds.txt"
    rm -rf "$dir"
  else
    echo "$seed $focus FAILED" >>"$OUT/seeds.txt"
    echo "   FAILED: kept $dir and $OUT/seed-$seed.log"
    grep -A12 VIOLATION "$OUT/seed-$seed.log" | head -30 || tail -5 "$OUT/seed-$seed.log"
  fi
done
python3 - "$OUT" <<'PY'
import json, os, sys, collections
out = sys.argv[1]
runs = [l.split() for l in open(os.path.join(out, "seeds.txt")) if l.strip()]
tot = collections.Counter()
faults = collections.Counter()
secs = 0.0
for seed, focus, st in runs:
    try:
        d = json.load(open(os.path.join(out, f"seed-{seed}.json")))
    except Exception:
        continue
    secs += d["secs"]
    for k in ("reads", "reads_failed", "writes", "writes_failed"):
        tot[k] += d[k]
    tot["violations"] += len(d["check"]["violations"])
    faults.update(d["faults_by_kind"])
print(f"soak: {len(runs)} runs, {secs/60:.1f} min of schedule")
print("seeds:", " ".join(f"{s}({f[:8]}{'' if st == 'ok' else ',FAILED'})" for s, f, st in runs))
print("operations:", dict(tot))
print("faults by kind:", dict(sorted(faults.items())))
failed = [s for s, _, st in runs if st != "ok"]
print("failing seeds:", failed or "none")
sys.exit(1 if failed else 0)
PY
