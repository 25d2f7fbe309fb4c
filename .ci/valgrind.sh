#!/usr/bin/env bash
# The node's unsafe core under valgrind memcheck: its unit tests and a short
# stress run. Miri and the sanitizers need a nightly toolchain, which these
# machines cannot install; memcheck runs the stable build as it ships and
# catches reads of unmapped or uninitialised memory, bad frees and leaks of
# definitely lost blocks. .ci/run calls it as `bash .ci/valgrind.sh` from the
# repository root, as root (it installs valgrind if missing).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v valgrind >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends valgrind >/dev/null
fi

# The test executables cargo builds, by target name (lib unit tests, stress).
exes=$(cargo test -p pagewire-node --release --lib --test stress --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("pagewire_node", "stress"):
        print(m["target"]["name"], m["executable"])
')

vg() {
  valgrind --quiet --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite \
    --show-leak-kinds=definite --fair-sched=yes "$@"
}

while read -r name exe; do
  case "$name" in
    pagewire_node)
      echo "== memcheck: node unit tests"
      vg "$exe" --test-threads 1 -q
      ;;
    stress)
      echo "== memcheck: stress, 1 s per index variant (readers, faults, eviction, writes)"
      PAGEWIRE_STRESS_SECS=1 vg "$exe" --test-threads 1 --nocapture
      ;;
  esac
done <<<"$exes"
