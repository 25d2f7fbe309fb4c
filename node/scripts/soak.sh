#!/usr/bin/env bash
# Opt-in soak of the concurrent structures: the stress test of every index
# variant and the cross-process remote-read test, for minutes instead of
# CI's seconds. Usage: node/scripts/soak.sh [seconds per variant, default 120]
# Prints each test's tally; the last lines are what a closing note quotes.
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-120}
echo "== stress: ${secs} s per index variant (lockless, mutex, rwlock, sharded)"
PAGEWIRE_STRESS_SECS=$secs cargo test -p pagewire-node --release --features strict_assertions --test stress -- --nocapture --test-threads 1
echo "== remote reads across processes: ${secs} s"
PAGEWIRE_REMOTE_SECS=$secs cargo test -p pagewire-node --release --features strict_assertions --test remote -- --nocapture --test-threads 1
