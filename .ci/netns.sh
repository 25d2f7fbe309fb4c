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

step "build (release: pagewire-coordinator, pwctl, pagewire-node)"
cargo build --locked --release -p pagewire-coordinator -p pagewire-node

step "storm-netns.sh --self-check"
# The script cleans up on SIGTERM; --kill-after is the last resort.
timeout --kill-after=20 120 bash bench/scripts/storm-netns.sh --self-check \
  --bin-dir "${CARGO_TARGET_DIR:-target}/release"

step "done"
