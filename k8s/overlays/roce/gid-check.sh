#!/bin/sh
# gid-check: prints the GID table of this pod's RDMA device port and checks
# the GID index choice, the most common RoCE deployment failure (a RoCE v1
# entry, an IPv6 link-local one, or one of another interface: the queue pairs
# then never connect, or connect over the wrong path). What `show_gids` shows,
# from sysfs: /sys/class/infiniband/DEV/ports/PORT/{gids,gid_attrs/types,
# gid_attrs/ndevs}/INDEX.
# Env: RDMA_DEVICE (empty: the first), RDMA_PORT (1), GID_INDEX (auto or a
# number), POD_IP (for a warning only); IB_SYSFS (tests: a fake sysfs).
set -eu
sysfs="${IB_SYSFS:-/sys/class/infiniband}"
dev="${RDMA_DEVICE:-}"
port="${RDMA_PORT:-1}"
want="${GID_INDEX:-auto}"

fail() {
    echo "gid-check: $*" >&2
    exit 1
}

if [ -z "$dev" ] && [ -d "$sysfs" ]; then
    dev=$(ls "$sysfs" | head -n 1)
fi
[ -n "$dev" ] || fail "no RDMA device visible in this pod ($sysfs is empty)"
p="$sysfs/$dev/ports/$port"
[ -d "$p" ] || fail "no port $port on RDMA device $dev"

# The IPv4 address of an IPv4-mapped GID (::ffff:a.b.c.d), else nothing.
ipv4_of() {
    case "$1" in
        0000:0000:0000:0000:0000:ffff:*)
            h=${1#0000:0000:0000:0000:0000:ffff:}
            hi=${h%%:*}
            lo=${h#*:}
            printf '%d.%d.%d.%d' "0x${hi%??}" "0x${hi#??}" "0x${lo%??}" "0x${lo#??}"
            ;;
    esac
}

echo "gid-check: $dev port $port, link layer $(cat "$p/link_layer" 2>/dev/null || echo '?'), state $(cat "$p/state" 2>/dev/null || echo '?')"
printf '%-6s %-12s %-16s %-40s %s\n' index type netdev gid ipv4
auto=""
for i in $(ls "$p/gids" | sort -n); do
    gid=$(cat "$p/gids/$i" 2>/dev/null) || continue
    [ "$gid" = 0000:0000:0000:0000:0000:0000:0000:0000 ] && continue
    type=$(cat "$p/gid_attrs/types/$i" 2>/dev/null) || type='?'
    ndev=$(cat "$p/gid_attrs/ndevs/$i" 2>/dev/null) || ndev='?'
    v4=$(ipv4_of "$gid")
    printf '%-6s %-12s %-16s %-40s %s\n' "$i" "$type" "$ndev" "$gid" "$v4"
    if [ -z "$auto" ] && [ "$type" = "RoCE v2" ] && [ -n "$v4" ]; then
        auto=$i
    fi
done

if [ "$want" = auto ]; then
    [ -n "$auto" ] || fail "no RoCE v2 GID with an IPv4 address on $dev port $port: give the interface of this port an IPv4 address and make it the pod's (hostNetwork, or a secondary network on the RoCE NIC)"
    idx=$auto
else
    case "$want" in *[!0-9]*|"") fail "GID_INDEX must be auto or a number, not '$want'" ;; esac
    idx=$want
    gid=$(cat "$p/gids/$idx" 2>/dev/null) || fail "no GID at index $idx"
    type=$(cat "$p/gid_attrs/types/$idx" 2>/dev/null) || fail "GID index $idx is empty"
    [ "$type" = "RoCE v2" ] || fail "GID index $idx is '$type', not RoCE v2 (routable over UDP 4791; RoCE v1 is not routable): pick a RoCE v2 index, or auto"
    [ -n "$(ipv4_of "$gid")" ] || echo "gid-check: warning: GID index $idx is not IPv4-mapped ($gid); both sides must use the same address family" >&2
fi
gid=$(cat "$p/gids/$idx")
ndev=$(cat "$p/gid_attrs/ndevs/$idx" 2>/dev/null || echo '?')
v4=$(ipv4_of "$gid")
echo "gid-check: using GID index $idx ($ndev, ${v4:-$gid})"
if [ -n "${POD_IP:-}" ] && [ -n "$v4" ] && [ "$v4" != "$POD_IP" ]; then
    echo "gid-check: note: the pod's IP $POD_IP is not this GID's $v4; peers must reach this node at $v4 for RDMA" >&2
fi
