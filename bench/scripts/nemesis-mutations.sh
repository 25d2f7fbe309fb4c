#!/usr/bin/env bash
# Mutation check of the nemesis (issue 18): revert the fix of finding 1, 2
# or 3, rebuild the daemons, run the nemesis with the schedule biased to
# that finding, and report whether it found a violation (and how fast).
#
#   bench/scripts/nemesis-mutations.sh FINDING REVERT [SEEDS=3] [RUN_SECONDS=30]
#
# FINDING: 1 (takeover-followup), 2 (restart-in-place), 3
#   (readahead-boundary).
# REVERT: what undoes the fix, applied to a worktree of HEAD:
#   - a commit or a range (A..B): `git revert --no-commit` of it;
#   - a patch file (the fix as a diff): applied in reverse;
#   - `base=COMMIT`: no revert, the worktree is COMMIT itself (code from
#     before the fix, e.g. e460a64, which has findings 1 to 3).
# The nemesis itself (readers, writers, checker) is this checkout's
# release pagewire-bench (BENCH); only pagewire-node and
# pagewire-coordinator come from the mutated tree (built into
# target-mutation-N, or TARGET_DIR: one already holding a build of a
# nearby tree rebuilds in seconds). Exit 0 when a violation was found (the mutation is
# killed), 1 when none was, 2 on a usage or build error.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
finding=${1:?usage: $0 FINDING REVERT [SEEDS] [RUN_SECONDS]}
revert=${2:?usage: $0 FINDING REVERT [SEEDS] [RUN_SECONDS]}
seeds=${3:-3}
run_s=${4:-30}
case $finding in
  1) focus=takeover-followup ;;
  2) focus=restart-in-place ;;
  3) focus=readahead-boundary ;;
  *) echo "FINDING is 1, 2 or 3" >&2; exit 2 ;;
esac
BENCH=${BENCH:-$root/target/release/pagewire-bench}
[[ -x $BENCH ]] || { echo "no $BENCH: cargo build --release -p pagewire-bench" >&2; exit 2; }
wt=/tmp/nemesis-mutation-$finding
target=${TARGET_DIR:-$root/target-mutation-$finding}
git worktree remove --force "$wt" 2>/dev/null || true
case $revert in
  base=*)
    git worktree add --detach "$wt" "${revert#base=}" >/dev/null
    what="the tree of ${revert#base=}"
    ;;
  *)
    git worktree add --detach "$wt" HEAD >/dev/null
    if [[ -f $revert ]]; then
      git -C "$wt" apply -R "$(realpath "$revert")"
      what="HEAD with $revert reverted"
    else
      git -C "$wt" revert --no-commit "$revert"
      what="HEAD with $revert reverted"
    fi
    ;;
esac
commit=$(git -C "$wt" rev-parse --short HEAD)
echo "== finding $finding ($focus): $what (worktree $wt at $commit)"
t=$SECONDS
(cd "$wt" && CARGO_TARGET_DIR=$target cargo build --release -q -p pagewire-node --bin pagewire-node \
  -p pagewire-coordinator --bin pagewire-coordinator) || { echo "build failed" >&2; exit 2; }
echo "built in $((SECONDS - t)) s"
found=""
for ((k = 1; k <= seeds; k++)); do
  seed=$(( ($(date +%s%N) + k) % 1000000007 ))
  log=$(mktemp)
  t=$SECONDS
  if "$BENCH" nemesis --focus "$focus" --seed "$seed" --duration "${run_s}s" \
      --bin-dir "$target/release" --json >"$log.json" 2>"$log"; then
    echo "seed $seed: no violation in ${run_s} s"
  else
    first=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["first_violation_s"], len(d["check"]["violations"]), d["check"]["violations"][0]["kind"])' "$log.json" 2>/dev/null || echo "? ? ?")
    read -r at n kind <<<"$first"
    echo "seed $seed: VIOLATION ($kind) on $n page(s), the first at ${at} s of the run"
    grep -A8 -m1 VIOLATION "$log" || tail -5 "$log"
    found="$seed"
    rm -f "$log" "$log.json"
    break
  fi
  rm -f "$log" "$log.json"
done
git worktree remove --force "$wt" 2>/dev/null || true
if [[ -n $found ]]; then
  echo "finding $finding: the nemesis ($focus) FOUND it (seed $found)"
  exit 0
fi
echo "finding $finding: the nemesis ($focus) did not find it in $seeds runs of ${run_s} s"
exit 1
