#!/usr/bin/env bash
# CI: fuzz every decoder that reads bytes from outside the process
# (fuzz/README.md lists the targets) for a bounded time each: builds every
# target once with libFuzzer's coverage instrumentation, runs each for
# PAGEWIRE_FUZZ_SECS seconds (default 10) from the checked-in corpus
# (fuzz/corpus/<target>) and fails on the first crash, timeout or
# out-of-memory (the input is left under fuzz/artifacts/<target>/).
#
# Budget: .ci/run is near its 60-minute cap, so this smoke run is built for
# compile time, not for speed of execution: an unoptimised build, no
# AddressSanitizer (the targets are safe Rust over the decoders; overflow
# and debug assertions stay on), line tables only, and cargo itself with
# the flags cargo-fuzz would pass (the same sancov passes; installing
# cargo-fuzz costs a minute more). Longer runs with ASan: fuzz/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never CARGO_INCREMENTAL=0
secs=${PAGEWIRE_FUZZ_SECS:-10}
t0=$SECONDS
step() { echo; echo "== fuzz: $* ($((SECONDS - t0)) s)"; }

step "tools"
# libFuzzer is C++, built by libfuzzer-sys.
if ! command -v c++ >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends g++ >/dev/null
fi

# What `cargo fuzz build --dev -s none` passes (cargo-fuzz 0.13, project.rs).
flags=(
  -Cdebug-assertions -Coverflow_checks
  -Cpasses=sancov-module
  -Cllvm-args=-sanitizer-coverage-level=4
  -Cllvm-args=-sanitizer-coverage-inline-8bit-counters
  -Cllvm-args=-sanitizer-coverage-pc-table
  -Cllvm-args=-sanitizer-coverage-trace-compares
  -Cllvm-args=-sanitizer-coverage-stack-depth
  -Cllvm-args=-simplifycfg-branch-fold-threshold=0
  --cfg fuzzing
)
export RUSTFLAGS="${flags[*]}"
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
triple=$(rustc -vV | sed -n 's/^host: //p')
target_dir=fuzz/target/ci
bins=$target_dir/$triple/debug

step "build"
# --target keeps RUSTFLAGS off the build scripts and proc macros, as
# cargo-fuzz does.
cargo build --manifest-path fuzz/Cargo.toml --locked --bins --target "$triple" \
  --target-dir "$target_dir"

mapfile -t targets < <(sed -n 's/^name = "\(.*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^pagewire-fuzz$')
((${#targets[@]} > 0)) || { echo "no fuzz targets found in fuzz/Cargo.toml"; exit 1; }
for target in "${targets[@]}"; do
  step "run $target (${secs} s)"
  # New inputs go to a scratch directory, not into the checked-in corpus.
  scratch="$target_dir/corpus/$target"
  mkdir -p "$scratch" "fuzz/artifacts/$target"
  log="$target_dir/corpus/$target.log"
  if ! "$bins/$target" "$scratch" "fuzz/corpus/$target" \
    -artifact_prefix="fuzz/artifacts/$target/" \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz target $target failed; the input is under fuzz/artifacts/$target/"
    exit 1
  fi
  grep -E '^(#[0-9]+ +(INITED|DONE)|stat::number_of_executed_units|stat::peak_rss_mb)' "$log" || true
done

step "done"
