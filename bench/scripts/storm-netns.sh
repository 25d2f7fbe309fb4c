#!/usr/bin/env bash
# storm-netns.sh: several hosts on one machine for `pagewire-bench storm`.
#
# Builds one network namespace per host, each joined by a veth pair to a
# Linux bridge in the root namespace, writes the hosts file the storm reads,
# runs the storm (or a self-check with the existing binaries), and removes
# everything it made on exit, on error and on Ctrl-C/SIGTERM.
#
#   bridge pwbr0        10.77.0.1/24   root namespace (the orchestrator)
#   netns  pw-coord     10.77.0.2      the coordinator
#   netns  pw-n1..pw-nM 10.77.0.11..   nodes   (M: --nodes, default 3, 2..89)
#   netns  pw-r1..pw-rC 10.77.0.101..  readers (C: --readers, default 4, 1..150)
#   veth   pwv-<host> (root side, a bridge port)  <->  eth0 (in the namespace)
#
# Each host also gets its own /dev/shm: the `exec` prefix in the hosts file
# mounts a private tmpfs there before it runs the command. Network namespaces
# do not separate files, and a node publishes its cache region as a file in
# /dev/shm that a reader on "the same host" maps; without this, a reader in
# another namespace would map a partitioned node's memory and never notice
# the partition.
#
# A cut takes the host's bridge port down (`ip link set pwv-n2 down`): its
# packets vanish silently, as in a real partition, and its own interface,
# address, routes and netem qdisc stay as they were; the heal brings the port
# back up (and re-asserts the netem qdisc when one was asked for).
#
# Usage (as root, from anywhere; paths are relative to the repository root):
#   bench/scripts/storm-netns.sh [OPTIONS] [STORM ARGS...]
#
#   --nodes M            node hosts (default 3)
#   --readers C          reader hosts (default 4)
#   --delay D            netem delay on each host's egress, e.g. 200us, 1ms
#   --jitter J           netem jitter with --delay, e.g. 50us
#   --loss P             netem loss on each host's egress, e.g. 0.1%
#   --cut-at T           when the storm cuts node-2 (default 10s; passed as is)
#   --heal-at T          when the storm heals node-2 (default 20s)
#   --hosts-file PATH    where to write the hosts file (default: a temporary
#                        directory, removed at exit)
#   --bench-bin PATH     pagewire-bench (default
#                        $CARGO_TARGET_DIR/release/pagewire-bench when that
#                        variable is set, else target/release/pagewire-bench)
#   --bin-dir DIR        where pagewire-coordinator, pagewire-node and pwctl
#                        are (default: the directory of --bench-bin)
#   --lease-ms N         coordinator lease in the self-check (default 2000)
#   --hold-ms N          self-check: keep node-2 cut at least N ms (default 0:
#                        heal once its extents have moved)
#   --keep-logs DIR      copy the self-check's logs and hosts file to DIR at exit
#   --self-check         set up, prove the topology and a partition with the
#                        coordinator, nodes and pwctl, tear down
#   --dry-run            set up, write the hosts file, self-check, print the
#                        storm command, tear down
#   --force-clean        remove leftovers of an earlier run (namespaces pw-*,
#                        links pwbr0/pwv-*, the iptables rule) before starting
#   --clean              only remove such leftovers, then exit
#   --                   everything after it goes to the storm
# Other arguments go to the storm too:
#   pagewire-bench storm --hosts FILE --transport tcp --nodes M --readers C \
#       --cut node-2@T1 --heal node-2@T2 [STORM ARGS...]
#
# Needs: root; iproute2 (`ip`, and `tc` for netem); python3 >= 3.11 for the
# self-check (it reads the hosts file back with tomllib and pwctl's JSON);
# `timeout` and `flock` (util-linux); iptables on Docker hosts (below). netem needs the kernel's
# sch_netem (CONFIG_NET_SCH_NETEM); the script probes it on a real interface
# and, without it, says so and goes on only when neither --delay nor --loss
# was given. (The 6.18 Firecracker kernel of our dev machines has no netem and
# no loadable modules.)
#
# Docker hosts: Docker sets the iptables FORWARD policy to DROP, and with
# br_netfilter (net.bridge.bridge-nf-call-iptables = 1) frames bridged between
# two namespaces go through that chain, so hosts could reach the root
# namespace but not each other. The script inserts
#   iptables -I FORWARD -i pwbr0 -o pwbr0 -m comment --comment pagewire-storm-netns -j ACCEPT
# and deletes it at exit. It changes no sysctl.
#
# Traffic: only within 10.77.0.0/24 on pwbr0 and loopback; IPv6 is turned off
# on every interface it makes. It refuses to start if a namespace or link of
# its names exists, if any route already covers or lies inside 10.77.0.0/24,
# or if another run holds its lock (/run/lock/pagewire-storm-netns.lock).
set -euo pipefail

readonly NET=10.77.0
readonly BR=pwbr0
readonly COORD_NS=pw-coord
readonly COORD_IP=$NET.2
readonly COORD_PORT=7400
readonly NODE_PORT=7500
readonly FW_COMMENT=pagewire-storm-netns
readonly LOCK=/run/lock/pagewire-storm-netns.lock
readonly OUR_NS_RE='^pw-(coord|n[0-9]+|r[0-9]+)$'
readonly OUR_LINK_RE='^(pwbr0|pwv-(coord|n[0-9]+|r[0-9]+))$'
# Each host's private /dev/shm (see the header); "$@" is the command.
# shellcheck disable=SC2016 # expanded by that sh, not here
readonly SHM_WRAP='mount -t tmpfs -o mode=1777 pagewire-shm /dev/shm && exec "$@"'

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
nodes=3
readers=4
delay=""
jitter=""
loss=""
cut_at=10s
heal_at=20s
hosts_file=""
bench_bin=""
bin_dir=""
lease_ms=2000
keep_logs=""
hold_ms=0
mode=storm
force_clean=0
storm_args=()

log() { printf '%s storm-netns: %s\n' "$(date +%T.%3N)" "$*"; }
die() {
  printf 'storm-netns: error: %s\n' "$*" >&2
  exit 1
}
usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}
now_ms() { date +%s%3N; }

while (($#)); do
  case $1 in
    --nodes) nodes=${2:?--nodes needs a number}; shift 2 ;;
    --readers) readers=${2:?--readers needs a number}; shift 2 ;;
    --delay) delay=${2:?--delay needs a time}; shift 2 ;;
    --jitter) jitter=${2:?--jitter needs a time}; shift 2 ;;
    --loss) loss=${2:?--loss needs a percentage}; shift 2 ;;
    --cut-at) cut_at=${2:?--cut-at needs a time}; shift 2 ;;
    --heal-at) heal_at=${2:?--heal-at needs a time}; shift 2 ;;
    --hosts-file) hosts_file=${2:?--hosts-file needs a path}; shift 2 ;;
    --bench-bin) bench_bin=${2:?--bench-bin needs a path}; shift 2 ;;
    --bin-dir) bin_dir=${2:?--bin-dir needs a directory}; shift 2 ;;
    --lease-ms) lease_ms=${2:?--lease-ms needs a number}; shift 2 ;;
    --hold-ms) hold_ms=${2:?--hold-ms needs a number}; shift 2 ;;
    --keep-logs) keep_logs=${2:?--keep-logs needs a directory}; shift 2 ;;
    --self-check) mode=self-check; shift ;;
    --dry-run) mode=dry-run; shift ;;
    --clean) mode=clean; shift ;;
    --force-clean) force_clean=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; storm_args+=("$@"); break ;;
    *) storm_args+=("$1"); shift ;;
  esac
done

in_range() { [[ $1 =~ ^[0-9]+$ ]] && (($1 >= $2 && $1 <= $3)); }
in_range "$nodes" 2 89 || die "--nodes must be 2..89 (node-2 is the one cut), not '$nodes'"
in_range "$readers" 1 150 || die "--readers must be 1..150, not '$readers'"
in_range "$lease_ms" 100 60000 || die "--lease-ms must be 100..60000, not '$lease_ms'"
in_range "$hold_ms" 0 300000 || die "--hold-ms must be 0..300000, not '$hold_ms'"
time_re='^[0-9]+(\.[0-9]+)?(us|ms|s)$'
[[ -z $delay || $delay =~ $time_re ]] || die "--delay must look like 200us, 1ms or 0.5s, not '$delay'"
[[ -z $jitter || $jitter =~ $time_re ]] || die "--jitter must look like 50us, not '$jitter'"
[[ -z $jitter || -n $delay ]] || die "--jitter needs --delay"
[[ -z $loss || $loss =~ ^[0-9]+(\.[0-9]+)?%$ ]] || die "--loss must look like 0.1%, not '$loss'"

if [[ -z $bench_bin ]]; then
  target=${CARGO_TARGET_DIR:-$repo/target}
  bench_bin=$target/release/pagewire-bench
fi
[[ -n $bin_dir ]] || bin_dir=$(dirname "$bench_bin")

node_ns() { echo "pw-n$1"; }
node_ip() { echo "$NET.$((10 + $1))"; }
reader_ns() { echo "pw-r$1"; }
reader_ip() { echo "$NET.$((100 + $1))"; }
port_of() { echo "pwv-${1#pw-}"; } # the root-side veth of namespace $1

# The command prefix that runs a command on host (namespace) $1.
host_exec() { EXEC=(ip netns exec "$1" sh -c "$SHM_WRAP" sh); }

# netem arguments ("" when none asked for).
netem_args() {
  local a=()
  if [[ -n $delay ]]; then a+=(delay "$delay"); [[ -z $jitter ]] || a+=("$jitter"); fi
  [[ -z $loss ]] || a+=(loss "$loss")
  echo "${a[*]}"
}

# ---------------------------------------------------------------- teardown

our_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "$OUR_NS_RE" || true; }
our_links() {
  ip -o link show 2>/dev/null | awk -F': ' '{sub(/@.*/, "", $2); print $2}' | grep -E "$OUR_LINK_RE" || true
}
fw_rule() { iptables "$1" FORWARD -i "$BR" -o "$BR" -m comment --comment "$FW_COMMENT" -j ACCEPT; }
fw_rule_present() { command -v iptables >/dev/null 2>&1 && fw_rule -C 2>/dev/null; }

# Whether PID is still a process to stop: a running job of this shell, or
# a process inside one of our namespaces. Never a bare `kill -0`: a PID that
# exited may belong to someone else by now.
our_job() { jobs -rp | grep -qx "$1"; }
in_our_ns() { [[ $(ip netns identify "$1" 2>/dev/null) =~ $OUR_NS_RE ]]; }

# stop PRED TENTHS PID...: SIGTERM to each PID for which PRED holds, up to
# TENTHS x 0.1 s for them to exit, then SIGKILL to those PRED still holds for.
stop() {
  local pred=$1 tenths=$2 i p left
  shift 2
  left=()
  for p in "$@"; do "$pred" "$p" && left+=("$p"); done
  for ((i = 0; ${#left[@]} && i <= tenths; i++)); do
    if ((i == 0)); then
      kill -TERM "${left[@]}" 2>/dev/null || true
    else
      sleep 0.1
    fi
    local still=()
    for p in "${left[@]}"; do "$pred" "$p" && still+=("$p"); done
    left=("${still[@]}")
  done
  for p in "${left[@]}"; do "$pred" "$p" && kill -KILL "$p" 2>/dev/null; done
  return 0
}

# Removes every namespace, link and rule of our names, and ends every
# process inside our namespaces (the ones this script started, the storm's
# children): nodes and readers first, so that nodes can still leave the
# cluster, then the coordinator. Idempotent; every loop is bounded.
teardown() {
  local ns hosts_pids=() coord_pids=() p i
  # Heal every cut first, so that nodes can leave and nothing waits on a
  # connection into a partition.
  for p in $(our_links); do ip link set "$p" up 2>/dev/null || true; done
  for ns in $(our_namespaces); do
    for p in $(ip netns pids "$ns" 2>/dev/null || true); do
      if [[ $ns == "$COORD_NS" ]]; then coord_pids+=("$p"); else hosts_pids+=("$p"); fi
    done
  done
  stop in_our_ns 30 "${hosts_pids[@]}"
  stop in_our_ns 30 "${coord_pids[@]}"
  for ((i = 0; i < 10; i++)); do fw_rule_present || break; fw_rule -D 2>/dev/null || true; done
  for ns in $(our_namespaces); do ip netns del "$ns" 2>/dev/null || true; done
  for p in $(our_links); do [[ $p == "$BR" ]] || ip link del "$p" 2>/dev/null || true; done
  ip link del "$BR" 2>/dev/null || true
  local left
  left="$(our_namespaces) $(our_links)"
  [[ -z ${left// /} ]] || echo "storm-netns: warning: could not remove: $left" >&2
}

work=""
pids=() # processes the self-check started
storm_pid=""
cleaned=0
owned=0 # set once we know nothing of our names existed before us
cleanup() {
  local rc=$?
  trap '' INT TERM
  ((cleaned)) && return "$rc"
  cleaned=1
  [[ -z $storm_pid ]] || stop our_job 50 "$storm_pid"
  if ((owned)); then
    local t0
    t0=$(now_ms)
    teardown
    log "cleaned up in $(($(now_ms) - t0)) ms"
  fi
  stop our_job 10 "${pids[@]}" # normally gone with their namespaces already
  if [[ -n $work ]]; then
    if [[ -n $keep_logs ]]; then
      mkdir -p "$keep_logs"
      cp "$work"/*.log "$work"/*.toml "$keep_logs"/ 2>/dev/null || true
    fi
    rm -rf "$work"
  fi
  return "$rc"
}

# ---------------------------------------------------------------- checks

(($(id -u) == 0)) || die "must run as root (it makes network namespaces)"
for c in ip timeout flock; do
  command -v "$c" >/dev/null 2>&1 || die "needs '$c' (iproute2, coreutils, util-linux)"
done
[[ -z $delay && -z $loss ]] || command -v tc >/dev/null 2>&1 ||
  die "--delay/--loss need 'tc' (iproute2)"

mkdir -p "$(dirname "$LOCK")"
exec 9>"$LOCK"
flock -n 9 || die "another storm-netns.sh is running (it holds $LOCK)"

leftovers="$(our_namespaces) $(our_links)"
fw_rule_present && leftovers+=" iptables:$FW_COMMENT"
leftovers=$(echo "$leftovers" | xargs)
if [[ $mode == clean ]]; then
  owned=1
  teardown
  log "removed: ${leftovers:-nothing}"
  exit 0
fi
if [[ -n $leftovers ]]; then
  ((force_clean)) || die "already present: $leftovers
  (left over from an earlier run? rerun with --force-clean, or --clean to only remove them)"
  log "--force-clean: removing $leftovers"
  owned=1
  teardown
  owned=0
fi
# A route covering 10.77.0.0/24 (other than a default route) or one inside
# it would clash with ours.
clash=$( (ip -4 route show match "$NET.0/24"; ip -4 route show root "$NET.0/24") | grep -v '^default' || true)
clash+=$(ip -4 -o addr show | grep -F " $NET." || true)
[[ -z $clash ]] || die "10.77.0.0/24 is already in use here:
$clash"

if [[ $mode != storm ]]; then
  PY=$(command -v /usr/bin/python3 python3 2>/dev/null | head -n1 || true)
  if [[ -z $PY ]] || ! "$PY" -c 'import tomllib' 2>/dev/null; then
    die "the self-check needs python3 >= 3.11 (tomllib)"
  fi
  for b in pagewire-coordinator pagewire-node pwctl; do
    [[ -x $bin_dir/$b ]] || die "no $bin_dir/$b (cargo build --release -p pagewire-node -p pagewire-coordinator -p pagewire-pwctl; or --bin-dir)"
  done
else
  [[ -x $bench_bin ]] || die "no $bench_bin (build it, or --bench-bin)"
  "$bench_bin" storm --help >/dev/null 2>&1 ||
    die "$bench_bin has no 'storm' subcommand yet; --dry-run or --self-check test the harness alone"
fi

owned=1
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT
trap 'log "terminated"; exit 143' TERM
work=$(mktemp -d /tmp/pw-storm-netns.XXXXXX)

# ---------------------------------------------------------------- set-up

no_v6() { sysctl -qw "net.ipv6.conf.$1.disable_ipv6=1" 2>/dev/null || true; }

# make_host NS IP: a namespace with lo and eth0 (IP/24), its veth a port of
# the bridge.
make_host() {
  local ns=$1 ip=$2 port
  port=$(port_of "$ns")
  ip netns add "$ns"
  ip link add "$port" type veth peer name eth0 netns "$ns"
  no_v6 "$port"
  ip link set "$port" master "$BR" up
  ip netns exec "$ns" sh -c 'sysctl -qw net.ipv6.conf.all.disable_ipv6=1 2>/dev/null || true'
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$ip/24" dev eth0
  ip -n "$ns" link set eth0 up
}

t_setup=$(now_ms)
log "bridge $BR $NET.1/24"
ip link add "$BR" type bridge stp_state 0 forward_delay 0
no_v6 "$BR"
ip addr add "$NET.1/24" dev "$BR"
ip link set "$BR" up
if [[ $(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || echo 0) == 1 ]]; then
  if command -v iptables >/dev/null 2>&1; then
    fw_rule -I
    log "bridged frames go through iptables FORWARD (br_netfilter): accepting $BR<->$BR"
  else
    log "warning: bridged frames go through iptables FORWARD, and no iptables here to accept them; if that chain drops, hosts will not reach each other"
  fi
fi
hosts=("$COORD_NS")
ips=("$COORD_IP")
for ((i = 1; i <= nodes; i++)); do hosts+=("$(node_ns "$i")"); ips+=("$(node_ip "$i")"); done
for ((i = 1; i <= readers; i++)); do hosts+=("$(reader_ns "$i")"); ips+=("$(reader_ip "$i")"); done
for ((i = 0; i < ${#hosts[@]}; i++)); do make_host "${hosts[i]}" "${ips[i]}"; done
log "hosts: $COORD_NS $COORD_IP, pw-n1..pw-n$nodes $(node_ip 1).., pw-r1..pw-r$readers $(reader_ip 1).."

# netem: probe on a real interface, then apply to every host's egress.
netem=$(netem_args)
if command -v modprobe >/dev/null 2>&1; then modprobe -q sch_netem 2>/dev/null || true; fi
if command -v tc >/dev/null 2>&1 &&
  ip netns exec "$COORD_NS" tc qdisc add dev eth0 root netem delay 0ms 2>/dev/null; then
  ip netns exec "$COORD_NS" tc qdisc del dev eth0 root
  netem_ok=1
else
  netem_ok=0
fi
if [[ -n $netem ]]; then
  ((netem_ok)) || die "--delay/--loss need netem, and this kernel has none (no sch_netem: CONFIG_NET_SCH_NETEM, modprobe sch_netem)"
  for ns in "${hosts[@]}"; do
    # shellcheck disable=SC2086 # $netem is a list of words
    ip netns exec "$ns" tc qdisc replace dev eth0 root netem $netem
  done
  log "netem on every host's eth0 egress: $netem"
elif ((netem_ok)); then
  log "netem: available (none asked for)"
else
  log "netem: unavailable in this kernel (no sch_netem); none asked for, going on without"
fi
log "set up in $(($(now_ms) - t_setup)) ms"

# ---------------------------------------------------------------- hosts file

toml_str() {
  local s=${1//\\/\\\\}
  printf '"%s"' "${s//\"/\\\"}"
}
toml_list() {
  local out="" a
  for a in "$@"; do out+="${out:+, }$(toml_str "$a")"; done
  printf '[%s]' "$out"
}

[[ -n $hosts_file ]] || hosts_file=$work/hosts.toml
{
  echo "# written by storm-netns.sh"
  # The storm itself (and the Redis it compares with) stays in the root
  # namespace, reached through the bridge.
  echo "[orchestrator]"
  echo "ip = $(toml_str "$NET.1")"
  echo "[coordinator]"
  host_exec "$COORD_NS"
  echo "exec = $(toml_list "${EXEC[@]}")"
  echo "ip = $(toml_str "$COORD_IP")"
  for ((i = 1; i <= nodes; i++)); do
    ns=$(node_ns "$i")
    port=$(port_of "$ns")
    host_exec "$ns"
    echo "[[node]]"
    echo "name = $(toml_str "node-$i")"
    echo "exec = $(toml_list "${EXEC[@]}")"
    echo "ip = $(toml_str "$(node_ip "$i")")"
    echo "cut = $(toml_list ip link set "$port" down)"
    if [[ -n $netem ]]; then
      echo "heal = $(toml_list sh -c "ip link set $port up && ip netns exec $ns tc qdisc replace dev eth0 root netem $netem")"
    else
      echo "heal = $(toml_list ip link set "$port" up)"
    fi
  done
  for ((i = 1; i <= readers; i++)); do
    host_exec "$(reader_ns "$i")"
    echo "[[reader]]"
    echo "exec = $(toml_list "${EXEC[@]}")"
    echo "ip = $(toml_str "$(reader_ip "$i")")"
  done
} >"$hosts_file"
log "hosts file: $hosts_file"

# ---------------------------------------------------------------- self-check

dump_logs() {
  local f
  for f in "$work"/*.log; do
    [[ -e $f ]] || continue
    echo "----- $(basename "$f") (last 40 lines)" >&2
    tail -n 40 "$f" >&2
  done
}
fail() {
  printf 'storm-netns: self-check FAILED: %s\n' "$*" >&2
  dump_logs
  exit 1
}

pwctl() {
  timeout 5 "$bin_dir/pwctl" --coordinator "$COORD_IP:$COORD_PORT" --token-file "$work/token" \
    --timeout-ms 1000 "$@"
}

# One line per node: id state grpc_address extents_owned tcp_endpoint
# applied_epoch incarnation; then "status extents unowned in_handoff alive
# epoch". The coordinator zeroes applied_epoch at a registration; only the
# node's first heartbeat of that incarnation sets it.
snapshot() {
  local n s
  n=$(pwctl --json nodes 2>/dev/null) || return 1
  s=$(pwctl --json status 2>/dev/null) || return 1
  "$PY" -c '
import json, sys
for n in json.loads(sys.argv[1]):
    tcp = [t["endpoint"] for t in n["transports"] if t["kind"] == "tcp"] or ["-"]
    print(n["node_id"], n["state"], n["grpc_address"], n["extents_owned"], tcp[0],
          n["applied_epoch"], n["incarnation"])
s = json.loads(sys.argv[2])
print("status", s["extents"], s["extents_unowned"], s["extents_in_handoff"], s["nodes_alive"],
      s["epoch"])
' "$n" "$s"
}

# wait_for TIMEOUT_MS WHAT PREDICATE: polls PREDICATE (a function reading
# $snap) about every 100 ms until it holds, or fails the check.
wait_for() {
  local timeout=$1 what=$2 pred=$3 t0 i
  t0=$(now_ms)
  for ((i = 0; i < timeout / 50 + 1; i++)); do
    snap=$(snapshot) || snap=""
    if [[ -n $snap ]] && "$pred"; then return 0; fi
    (($(now_ms) - t0 < timeout)) || break
    sleep 0.1
  done
  printf 'last snapshot:\n%s\n' "$snap" >&2
  fail "timed out after ${timeout} ms waiting for $what"
}

node_line() { awk -v id="$1" '$1 == id' <<<"$snap"; }
status_field() { awk -v k="$1" '$1 == "status" {print $k}' <<<"$snap"; }

# Every node alive at its own address, the map whole and settled.
all_settled() {
  local i l ip
  for ((i = 1; i <= nodes; i++)); do
    l=$(node_line "node-$i")
    ip=$(node_ip "$i")
    [[ $l == "node-$i alive $ip:$NODE_PORT "* && $(awk '{print $5}' <<<"$l") == "$ip:"* ]] || return 1
  done
  [[ $(status_field 5) == "$nodes" && $(status_field 3) == 0 && $(status_field 4) == 0 ]]
}
extents_of() { node_line "$1" | awk '{print $4}'; }
others_sum() { awk -v id="$1" '$1 ~ /^node-/ && $1 != id && $2 == "alive" {s += $4} END {print s + 0}' <<<"$snap"; }

n2_dead() { [[ $(node_line node-2) =~ ^node-2\ (dead|left)\  ]]; }
n2_moved() { n2_dead && [[ $(extents_of node-2) == 0 && $(others_sum node-2) == "$total" ]]; }
# Listed alive: the coordinator took a registration, which it may have got
# from a request the node has given up on (see heal_phase).
n2_listed() { [[ $(node_line node-2) == "node-2 alive $(node_ip 2):$NODE_PORT "* ]]; }
# Back for real: the node heard its registration's answer and heartbeated.
n2_joined() { n2_listed && (($(node_line node-2 | awk '{print $6}') > 0)); }
n2_back() { n2_joined && (($(extents_of node-2) > 0)) && [[ $(status_field 4) == 0 && $(status_field 3) == 0 ]]; }

# heal_phase T0: polls from the heal (at T0) until node-2 is back and has
# stayed back for one lease. Sets listed_ms (the coordinator first lists it
# alive), joined_ms (it heartbeats again), back_ms (it owns extents, the map
# settled) and flaps (times it was listed alive and then not).
heal_phase() {
  local t0=$1 now i was=0 stable_until=0
  listed_ms="" joined_ms="" back_ms="" flaps=0
  for ((i = 0; i < 600; i++)); do # 600 x >= 100 ms, and a 40 s deadline
    snap=$(snapshot) || snap=""
    now=$(now_ms)
    if [[ -n $snap ]]; then
      if n2_listed; then
        [[ -n $listed_ms ]] || listed_ms=$((now - t0))
        was=1
      else
        ((was == 0)) || flaps=$((flaps + 1))
        was=0
      fi
      [[ -n $joined_ms ]] || ! n2_joined || joined_ms=$((now - t0))
      if [[ -z $back_ms ]] && n2_back; then
        back_ms=$((now - t0))
        stable_until=$((now + lease_ms))
      fi
      if [[ -n $back_ms ]]; then
        n2_joined || fail "node-2 dropped out again $((now - t0)) ms after the heal, after it got its extents back"
        ((now < stable_until)) || return 0
      fi
    fi
    ((now - t0 < 40000)) || break
    sleep 0.1
  done
  printf 'last snapshot:\n%s\n' "$snap" >&2
  fail "node-2 not back 40 s after the heal (listed alive at ${listed_ms:--} ms, heartbeating at ${joined_ms:--} ms)"
}

# can_reach NS IP PORT: a TCP connection from host NS succeeds within 1 s.
can_reach() {
  # shellcheck disable=SC2016 # expanded by the inner bash
  timeout 1 ip netns exec "$1" bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$2" "$3" 2>/dev/null
}

# hosts_cmd NAME FIELD: node NAME's argv FIELD (cut, heal) from the hosts
# file, NUL-separated.
hosts_cmd() {
  "$PY" -c '
import sys, tomllib
h = tomllib.load(open(sys.argv[1], "rb"))
for n in h["node"]:
    if n["name"] == sys.argv[2]:
        sys.stdout.write("\0".join(n[sys.argv[3]]) + "\0")
' "$hosts_file" "$1" "$2"
}

self_check() {
  log "self-check: lease $lease_ms ms, $nodes nodes, $readers readers"
  # The hosts file is the storm's contract: read it back and use it.
  "$PY" -c '
import sys, tomllib
h = tomllib.load(open(sys.argv[1], "rb"))
c = h["coordinator"]
assert isinstance(c["exec"], list) and c["ip"] == sys.argv[2], c
assert [n["name"] for n in h["node"]] == ["node-%d" % i for i in range(1, int(sys.argv[3]) + 1)]
for n in h["node"]:
    assert all(isinstance(n[k], list) and n[k] for k in ("exec", "cut", "heal")), n
assert len(h["reader"]) == int(sys.argv[4]) and all(r["exec"] and r["ip"] for r in h["reader"])
' "$hosts_file" "$COORD_IP" "$nodes" "$readers" || fail "the hosts file does not parse as the contract says"
  mapfile -d '' cut_cmd < <(hosts_cmd node-2 cut)
  mapfile -d '' heal_cmd < <(hosts_cmd node-2 heal)
  log "hosts file parses (tomllib); node-2 cut: ${cut_cmd[*]}; heal: ${heal_cmd[*]}"

  echo "pw-netns-$$-$RANDOM" >"$work/token"
  truncate -s 256M "$work/data.bin"
  host_exec "$COORD_NS"
  "${EXEC[@]}" "$bin_dir/pagewire-coordinator" --listen "$COORD_IP:$COORD_PORT" --metrics-listen "" \
    --state-file "$work/coordinator.state" --token-file "$work/token" --lease-ms "$lease_ms" \
    >"$work/coordinator.log" 2>&1 &
  pids+=($!)
  local i ns ip
  for ((i = 1; i <= nodes; i++)); do
    ns=$(node_ns "$i")
    ip=$(node_ip "$i")
    host_exec "$ns"
    "${EXEC[@]}" "$bin_dir/pagewire-node" --node-id "node-$i" --backing-file "$work/data.bin" \
      --listen "$ip:$NODE_PORT" --metrics-listen "" --coordinator "$COORD_IP:$COORD_PORT" \
      --token-file "$work/token" --frames 1024 >"$work/node-$i.log" 2>&1 &
    pids+=($!)
  done
  local t0
  t0=$(now_ms)
  wait_for 30000 "every node alive at its own address" all_settled
  total=$(status_field 2)
  local own2
  own2=$(extents_of node-2)
  log "cluster up in $(($(now_ms) - t0)) ms: $nodes nodes alive, each at its own address; node-2 owns $own2 of $total extents"
  awk '$1 ~ /^node-/ {printf "    %-8s %-6s grpc %-16s extents %-4s tcp %s\n", $1, $2, $3, $4, $5}' <<<"$snap"

  for ((i = 1; i <= readers; i++)); do
    host_exec "$(reader_ns "$i")"
    "${EXEC[@]}" "$bin_dir/pwctl" --coordinator "$COORD_IP:$COORD_PORT" --token-file "$work/token" \
      --timeout-ms 2000 status >/dev/null 2>"$work/pwctl-r$i.log" ||
      fail "pwctl in $(reader_ns "$i") cannot reach the coordinator"
  done
  for ((i = 1; i <= nodes; i++)); do
    can_reach pw-r1 "$(node_ip "$i")" "$NODE_PORT" || fail "pw-r1 cannot reach node-$i"
  done
  # pids[1] is node-1 (ip netns exec and the wrapper exec into it).
  local shm1=/proc/${pids[1]}/root/dev/shm
  [[ -n $(ls -A "$shm1" 2>/dev/null) && $(stat -c %d "$shm1") != "$(stat -c %d /dev/shm)" ]] ||
    fail "node-1's /dev/shm is not its own (or it made no shm file there)"
  log "every reader reaches the coordinator, pw-r1 reaches every node; /dev/shm is per host"

  log "cut node-2: ${cut_cmd[*]}"
  t0=$(now_ms)
  "${cut_cmd[@]}" || fail "the cut command failed"
  local bound=$((lease_ms + 5000))
  wait_for "$bound" "node-2 declared dead (lease $lease_ms ms)" n2_dead
  dead_ms=$(($(now_ms) - t0))
  wait_for "$bound" "node-2's extents on the other nodes" n2_moved
  moved_ms=$(($(now_ms) - t0))
  can_reach pw-r1 "$(node_ip 2)" "$NODE_PORT" && fail "pw-r1 still reaches node-2 after the cut"
  can_reach pw-r1 "$(node_ip 1)" "$NODE_PORT" || fail "pw-r1 lost node-1 in node-2's cut"
  log "node-2 declared $(node_line node-2 | awk '{print $2}') ${dead_ms} ms after the cut (lease $lease_ms ms); its $own2 extents on others at ${moved_ms} ms; pw-r1 cannot reach it"

  local held=$(($(now_ms) - t0))
  if ((held < hold_ms)); then
    log "holding the cut for $((hold_ms - held)) ms more (--hold-ms $hold_ms)"
    # In the background so a trapped signal ends the wait at once.
    sleep "$(((hold_ms - held) / 1000)).$(printf '%03d' $(((hold_ms - held) % 1000)))" &
    pids+=($!)
    wait $!
  fi
  log "heal node-2 after $(($(now_ms) - t0)) ms: ${heal_cmd[*]}"
  cut_ms=$(($(now_ms) - t0))
  t0=$(now_ms)
  "${heal_cmd[@]}" || fail "the heal command failed"
  heal_phase "$t0"
  can_reach pw-r1 "$(node_ip 2)" "$NODE_PORT" || fail "pw-r1 does not reach node-2 after the heal"
  log "after the heal: node-2 listed alive at ${listed_ms} ms, heartbeating (incarnation $(node_line node-2 | awk '{print $7}')) at ${joined_ms} ms, owns $(extents_of node-2) extents with the map settled at ${back_ms} ms, and stayed for a lease; dropped out again in between: $flaps time(s)"
  echo "SELF-CHECK OK: lease_ms=$lease_ms cut_ms=$cut_ms dead_ms=$dead_ms moved_ms=$moved_ms listed_ms=$listed_ms rejoin_ms=$joined_ms extents_back_ms=$back_ms flaps=$flaps"
}

case $mode in
  self-check)
    self_check
    ;;
  dry-run)
    self_check
    echo "----- $hosts_file"
    cat "$hosts_file"
    echo "-----"
    echo "would run: $bench_bin storm --hosts $hosts_file --transport tcp --nodes $nodes --readers $readers --cut node-2@$cut_at --heal node-2@$heal_at ${storm_args[*]}"
    ;;
  storm)
    cmd=("$bench_bin" storm --hosts "$hosts_file" --transport tcp --nodes "$nodes" --readers "$readers"
      --cut "node-2@$cut_at" --heal "node-2@$heal_at" "${storm_args[@]}")
    log "running: ${cmd[*]}"
    # In the background so a trapped signal ends the wait at once.
    "${cmd[@]}" &
    storm_pid=$!
    rc=0
    wait "$storm_pid" || rc=$?
    storm_pid=""
    log "storm exited with $rc"
    exit "$rc"
    ;;
esac
