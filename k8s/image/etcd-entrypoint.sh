#!/bin/sh
# pagewire-etcd: the etcd image's entrypoint (k8s/image/etcd.sh installs it
# as /usr/local/bin/pagewire-etcd). Starts one member of a static etcd
# cluster whose members are named in PAGEWIRE_ETCD_MEMBERS, the same way
# in the compose HA cluster (k8s/compose/ha.yml) and in Kubernetes
# (k8s/components/ha: a StatefulSet, whose pods are named NAME-0, NAME-1,
# ...):
#
#   PAGEWIRE_ETCD_MEMBERS  the members' names, comma-separated (required),
#                          e.g. pagewire-etcd-0,pagewire-etcd-1,pagewire-etcd-2
#   PAGEWIRE_ETCD_DOMAIN   appended to a member's name to reach it: member
#                          m is at m.DOMAIN (Kubernetes: the headless
#                          Service's name; compose: the network alias);
#                          empty: the bare name
#   PAGEWIRE_ETCD_TOKEN    the initial cluster token (default pagewire-etcd)
#   ETCD_NAME              this member's name (default: the hostname, a
#                          StatefulSet pod's name)
#
# Data in /var/lib/etcd/data (mount a volume at /var/lib/etcd); a member
# that finds data there rejoins with it and ignores the initial-cluster
# flags. Clients on port 2379, peers on 2380, both plain HTTP on the
# cluster's private network (TLS: give etcd's own --cert-file and friends
# as arguments; they are passed through, after these). Extra arguments are
# passed to etcd.
set -eu
members=${PAGEWIRE_ETCD_MEMBERS:-}
domain=${PAGEWIRE_ETCD_DOMAIN:-}
name=${ETCD_NAME:-$(cat /proc/sys/kernel/hostname)}
if [ -z "$members" ]; then
  echo "pagewire-etcd: PAGEWIRE_ETCD_MEMBERS is empty: name every member (e.g. pagewire-etcd-0,pagewire-etcd-1,pagewire-etcd-2)" >&2
  exit 2
fi
host() { if [ -n "$domain" ]; then echo "$1.$domain"; else echo "$1"; fi; }
cluster=
found=
for m in $(echo "$members" | tr ',' ' '); do
  cluster="${cluster:+$cluster,}$m=http://$(host "$m"):2380"
  [ "$m" = "$name" ] && found=1
done
if [ -z "$found" ]; then
  echo "pagewire-etcd: this member's name \"$name\" (ETCD_NAME, else the hostname) is not in PAGEWIRE_ETCD_MEMBERS ($members)" >&2
  exit 2
fi
me=$(host "$name")
echo "pagewire-etcd: member $name of $cluster"
exec etcd --name "$name" --data-dir /var/lib/etcd/data \
  --listen-client-urls http://0.0.0.0:2379 --advertise-client-urls "http://$me:2379" \
  --listen-peer-urls http://0.0.0.0:2380 --initial-advertise-peer-urls "http://$me:2380" \
  --initial-cluster "$cluster" --initial-cluster-state new \
  --initial-cluster-token "${PAGEWIRE_ETCD_TOKEN:-pagewire-etcd}" "$@"
