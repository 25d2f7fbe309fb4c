#!/usr/bin/env bash
# CI: fuzz every decoder that reads bytes from outside the process
# (fuzz/README.md lists the targets) for a bounded time each: installs
# cargo-fuzz, builds every target once, runs each for PAGEWIRE_FUZZ_SECS
# seconds (default 8) from the checked-in corpus (fuzz/corpus/<target>) and
# fails on the first crash, leak, timeout or out-of-memory (the input is
# left under fuzz/artifacts/<target>/). About 3-4 minutes on 2 cores from a
# clean clone.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never CARGO_INCREMENTAL=0
secs=${PAGEWIRE_FUZZ_SECS:-8}
t0=$SECONDS
step() { echo; echo "== fuzz: $* ($((SECONDS - t0)) s)"; }

step "tools"
# libFuzzer is C++, built by libfuzzer-sys.
if ! command -v c++ >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends g++ >/dev/null
fi
if ! command -v cargo-fuzz >/dev/null; then
  cargo install cargo-fuzz --locked --version 0.13.2
fi

# The toolchain is stable: cargo-fuzz's sanitizer flags (-Z) need this.
export RUSTC_BOOTSTRAP=1
# One set of flags for build and run (a run with other flags rebuilds).
flags=(--sanitizer address --codegen-units 16)
cd fuzz

step "build"
cargo fuzz build "${flags[@]}"

for target in $(cargo fuzz list); do
  step "run $target (${secs} s)"
  # New inputs go to a scratch directory, not into the checked-in corpus.
  scratch="target/ci-corpus/$target"
  mkdir -p "$scratch"
  log="target/ci-corpus/$target.log"
  if ! cargo fuzz run "${flags[@]}" "$target" "$scratch" "corpus/$target" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz target $target failed; the input is under fuzz/artifacts/$target/"
    exit 1
  fi
  grep -E '^(#[0-9]+ +(INITED|DONE)|stat::number_of_executed_units|stat::peak_rss_mb)' "$log" || true
done

step "done"
