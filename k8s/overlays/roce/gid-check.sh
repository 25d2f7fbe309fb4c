#!/bin/sh
# gid-check: prints the GID tables of this pod's RDMA devices and checks,
# before the node starts, that the node will find the GID it needs: the
# most common RoCE deployment failure is the wrong GID (a RoCE v1 entry, an
# IPv6 link-local one, one of another interface: queue pairs that never
# connect, or connect over the wrong path). What `show_gids` shows, from
# sysfs: /sys/class/infiniband/DEV/ports/PORT/{gids,gid_attrs/types,
# gid_attrs/ndevs}/INDEX.
#
# One source of truth: it reads the node's own config (the ConfigMap's
# node.toml) and applies the node's rule (node/src/daemon/gid.rs):
#  * verbs_gid_index = -1 (auto): on verbs_device (empty: every device), at
#    verbs_port, the RoCE v2 GID whose value is the node's advertised IPv4
#    address (::ffff:a.b.c.d), the GID of the interface carrying it; none:
#    the node would refuse to start, so this fails;
#  * verbs_gid_index = N: that entry must exist on verbs_device (needed when
#    there are several devices); a RoCE v1 entry, or one not holding the
#    advertised address, is allowed but warned about.
# The advertised address, as the node takes it: PAGEWIRE_ADVERTISE (the
# node's --advertise), else `advertise` in node.toml, else the pod's IP
# (POD_IP; an empty advertise makes the node advertise the address it
# reaches the coordinator from, the pod's IP). Only IPv4 literals are
# checked. With verbs = false it prints the tables and exits 0.
#
# Env: PAGEWIRE_NODE_CONFIG (/etc/pagewire/node.toml), POD_IP,
# PAGEWIRE_ADVERTISE; IB_SYSFS (tests: a fake sysfs).
set -eu
sysfs="${IB_SYSFS:-/sys/class/infiniband}"
config="${PAGEWIRE_NODE_CONFIG:-/etc/pagewire/node.toml}"

fail() {
    echo "gid-check: $*" >&2
    exit 1
}
warn() {
    echo "gid-check: warning: $*" >&2
}

[ -r "$config" ] || fail "cannot read the node config $config"
# A key of node.toml: SECTION ("" for the top level) and KEY; prints the
# value, unquoted, or nothing. Enough for the flat scalar keys read here.
toml_get() {
    awk -v want_sec="$1" -v want_key="$2" '
        /^[[:space:]]*\[/ { sec = $0; gsub(/^[[:space:]]*\[|\][[:space:]]*(#.*)?$/, "", sec); next }
        sec == want_sec {
            line = $0
            sub(/^[[:space:]]+/, "", line)
            n = index(line, "=")
            if (n == 0) next
            k = substr(line, 1, n - 1); sub(/[[:space:]]+$/, "", k)
            if (k != want_key) next
            v = substr(line, n + 1); sub(/^[[:space:]]+/, "", v)
            if (v ~ /^"/) { v = substr(v, 2); sub(/".*$/, "", v) }
            else { sub(/[[:space:]]*(#.*)?$/, "", v) }
            print v; exit
        }' "$config"
}
verbs=$(toml_get transports verbs)
dev=$(toml_get transports verbs_device)
port=$(toml_get transports verbs_port)
want=$(toml_get transports verbs_gid_index)
port=${port:-1}
want=${want:--1}
case "$port" in *[!0-9]*|"") fail "transports.verbs_port in $config is '$port', not a number" ;; esac
case "$want" in -1) ;; *[!0-9]*|"") fail "transports.verbs_gid_index in $config is '$want', not -1 or an index" ;; esac

adv="${PAGEWIRE_ADVERTISE:-$(toml_get "" advertise)}"
adv_from="advertise"
if [ -z "$adv" ]; then
    adv="${POD_IP:-}"
    adv_from="the pod's IP"
fi
# host:port -> host
case "$adv" in
    \[*) adv=${adv#\[}; adv=${adv%%\]*} ;;
    *:*:*) ;;
    *:*) adv=${adv%:*} ;;
esac
case "$adv" in
    *[!0-9.]*|"") v4_adv="" ;;
    *) v4_adv=$adv ;;
esac

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

if [ -n "$dev" ]; then
    [ -d "$sysfs/$dev" ] || fail "no RDMA device named '$dev' (transports.verbs_device; this pod sees: $(ls "$sysfs" 2>/dev/null | tr '\n' ' '))"
    devs=$dev
else
    devs=$(ls "$sysfs" 2>/dev/null || true)
    [ -n "$devs" ] || fail "no RDMA device visible in this pod ($sysfs is empty): the node would refuse to start (is the RDMA device plugin's resource granted?)"
fi
ndevs=$(echo "$devs" | wc -w)

auto_dev="" auto_idx=""
for d in $devs; do
    p="$sysfs/$d/ports/$port"
    if [ ! -d "$p" ]; then
        echo "gid-check: $d has no port $port"
        continue
    fi
    echo "gid-check: $d port $port, link layer $(cat "$p/link_layer" 2>/dev/null || echo '?'), state $(cat "$p/state" 2>/dev/null || echo '?')"
    printf '%-6s %-12s %-16s %-40s %s\n' index type netdev gid ipv4
    for i in $(ls "$p/gids" | sort -n); do
        gid=$(cat "$p/gids/$i" 2>/dev/null) || continue
        [ "$gid" = 0000:0000:0000:0000:0000:0000:0000:0000 ] && continue
        type=$(cat "$p/gid_attrs/types/$i" 2>/dev/null) || type='?'
        ndev=$(cat "$p/gid_attrs/ndevs/$i" 2>/dev/null) || ndev='?'
        v4=$(ipv4_of "$gid")
        printf '%-6s %-12s %-16s %-40s %s\n' "$i" "$type" "$ndev" "$gid" "$v4"
        if [ -z "$auto_idx" ] && [ "$type" = "RoCE v2" ] && [ -n "$v4_adv" ] && [ "$v4" = "$v4_adv" ]; then
            auto_dev=$d
            auto_idx=$i
        fi
    done
done

if [ "$verbs" != true ]; then
    echo "gid-check: transports.verbs is off in $config: nothing to check"
    exit 0
fi

if [ "$want" = -1 ]; then
    [ -n "$adv" ] || fail "the node's advertised address is unknown here (no advertise in $config, no PAGEWIRE_ADVERTISE, no POD_IP)"
    if [ -z "$v4_adv" ]; then
        warn "the advertised address '$adv' is not an IPv4 literal; not checked (the node resolves it and picks the RoCE v2 GID holding it)"
        exit 0
    fi
    [ -n "$auto_idx" ] || fail "no RoCE v2 GID holds the advertised address $v4_adv ($adv_from) on ${dev:-any device} port $port: the node would refuse to start. Give the interface carrying $v4_adv an RDMA device (hostNetwork on the RoCE NIC, or a secondary network on it), advertise an address that has one, or pin transports.verbs_device and verbs_gid_index"
    d=$auto_dev
    idx=$auto_idx
else
    [ "$ndevs" = 1 ] || fail "transports.verbs_gid_index $want needs transports.verbs_device: this pod sees $(echo $devs)"
    d=$devs
    idx=$want
    p="$sysfs/$d/ports/$port"
    [ -d "$p" ] || fail "no port $port on RDMA device $d"
    gid=$(cat "$p/gids/$idx" 2>/dev/null) || fail "GID index $idx does not exist on $d port $port"
    [ "$gid" != 0000:0000:0000:0000:0000:0000:0000:0000 ] || fail "GID index $idx does not exist on $d port $port (empty)"
    type=$(cat "$p/gid_attrs/types/$idx" 2>/dev/null || echo '?')
    [ "$type" = "RoCE v2" ] || warn "GID index $idx is '$type', not RoCE v2 (routable over UDP 4791; RoCE v1 is link-layer only): both ends must use the same type; verbs_gid_index = -1 picks RoCE v2"
    v4=$(ipv4_of "$gid")
    if [ -z "$v4" ]; then
        warn "GID index $idx is not IPv4-mapped ($gid); both ends must use the same address family"
    elif [ -n "$v4_adv" ] && [ "$v4" != "$v4_adv" ]; then
        warn "GID index $idx holds $v4, not the advertised address $v4_adv ($adv_from): peers must reach this node at $v4 for RDMA"
    fi
fi
p="$sysfs/$d/ports/$port"
gid=$(cat "$p/gids/$idx")
ndev=$(cat "$p/gid_attrs/ndevs/$idx" 2>/dev/null || echo '?')
v4=$(ipv4_of "$gid")
echo "gid-check: the node will use $d port $port GID index $idx ($ndev, ${v4:-$gid})"
