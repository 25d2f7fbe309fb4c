#!/usr/bin/env bash
# Checks the dashboard and the alert rules against a live pagewire cluster
# with a real Prometheus: every panel query and every alert expression must
# return data (check.py says exactly what that means), and `promtool check
# rules` must pass. Installs Debian's `prometheus` package when promtool or
# prometheus is missing (without starting its service), then runs check.py.
#
#   k8s/monitoring/check.sh --coordinator HOST:7401 --node HOST:7501,HOST:7501,... [check.py options]
#       [--storm COORD_GRPC --token-file FILE [--bench PATH] [--storm-transport tcp] [--storm-readers N]]
#
# --storm HOST:PORT starts `pagewire-bench storm --coordinator HOST:PORT`
# (attach mode, read-only, no compare phases) as check.py's --load-cmd,
# for --load-seconds + 20 s (bounded by timeout(1) to 60 s more); check.py
# waits for it after the evaluation and fails unless it exits 0.
# Its readers serve their client metrics (`storm --metrics-listen`: reader i
# on 127.0.0.1:PORT+i, PORT the first of a free run of loopback ports this
# script picks), which check.py scrapes as job pagewire-client (--client)
# and checks, so the client library's series (pagewire_client_*) are
# covered too, with no option of the caller's. Without --storm the caller
# runs the read load (and may give --client HOST:PORT for its own client). Every other option goes to
# check.py (`check.py --help`): --proxy-reads NODE_GRPC,... and
# --provoke-rpc-error COORD_GRPC (both need --token-file) make the
# node-proxied one-sided counters and the coordinator's RPC-error family
# non-empty. Exit status: check.py's (0 all ok, 1 a check failed, 2 usage).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
storm="" bench="" storm_transport=tcp storm_readers=2 token_file="" load_seconds=20
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --storm) storm=$2; shift 2 ;;
        --bench) bench=$2; shift 2 ;;
        --storm-transport) storm_transport=$2; shift 2 ;;
        --storm-readers) storm_readers=$2; shift 2 ;;
        --token-file) token_file=$2; args+=("$1" "$2"); shift 2 ;;
        --load-seconds) load_seconds=$2; args+=("$1" "$2"); shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done

if ! [ -x /usr/bin/promtool ] || ! [ -x /usr/bin/prometheus ]; then
    echo "check.sh: installing Debian's prometheus package (its service is not started)" >&2
    # policy-rc.d 101: invoke-rc.d / deb-systemd-invoke start no service.
    restore=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        restore=1
    fi
    rc=0
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >&2 || rc=$?
    [ -n "$restore" ] && rm -f /usr/sbin/policy-rc.d
    if [ "$rc" -ne 0 ]; then
        apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >&2
    fi
    # Belt and braces: a service the package managed to start is stopped.
    if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
        systemctl stop prometheus; systemctl disable prometheus >/dev/null 2>&1 || true
    fi
fi

if [ -n "$storm" ]; then
    [ -n "$token_file" ] || { echo "check.sh: --storm needs --token-file" >&2; exit 2; }
    if [ -z "$bench" ]; then
        bench=$(command -v pagewire-bench || true)
        [ -n "$bench" ] || { echo "check.sh: --storm: pagewire-bench not on PATH (give --bench)" >&2; exit 2; }
    fi
    # The storm runs --load-seconds plus 20 s for the evaluation, then ends by
    # itself: check.py waits for it (--load-wait) and fails unless it exits 0
    # (the storm fails on a wrong or stale read). timeout bounds it anyway.
    storm_seconds=$(( ${load_seconds%.*} + 20 ))
    bound=$(( storm_seconds + 60 ))
    # N consecutive free loopback ports, one per reader (a port taken
    # between this probe and the reader's bind fails that reader, and so
    # the check: said, not silent).
    metrics_base=$(python3 - "$storm_readers" <<'EOF'
import random, socket, sys
n = int(sys.argv[1])
for _ in range(200):
    base = random.randint(20000, 60000 - n)
    socks = []
    try:
        for p in range(base, base + n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", p))
        print(base)
        break
    except OSError:
        pass
    finally:
        for s in socks:
            s.close()
else:
    sys.exit("check.sh: no %d consecutive free loopback ports" % n)
EOF
)
    clients=""
    for ((i = 0; i < storm_readers; i++)); do clients+="${clients:+,}127.0.0.1:$((metrics_base + i))"; done
    out=$(mktemp -d -t pagewire-storm-out-XXXXXX)
    trap 'rm -rf "$out"' EXIT
    # --file is only read by the pread row, which --compare "" leaves out.
    load="exec timeout -k 5 $bound $(printf %q "$bench") storm --coordinator $(printf %q "$storm") \
--token-file $(printf %q "$token_file") --file /dev/null --compare '' --writer-fraction 0 \
--transport $(printf %q "$storm_transport") --readers $(printf %q "$storm_readers") \
--metrics-listen 127.0.0.1:$metrics_base \
--duration ${storm_seconds}s --out $(printf %q "$out") --work-dir $(printf %q "$out")"
    args+=(--load-cmd "$load" --load-wait 60 --client "$clients")
fi

# Not exec: the EXIT trap removes the storm's output folder afterwards.
rc=0
python3 "$here/check.py" "${args[@]}" || rc=$?
exit "$rc"
