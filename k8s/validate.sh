#!/usr/bin/env bash
# Validates the Kubernetes manifests offline. CI runs it (as root, Debian
# bookworm); it installs what it needs itself, into a venv under target/.
#
#   bash k8s/validate.sh
#
# 1. renders every overlay with `kubectl kustomize` (tcp, soft-roce, roce,
#    roce with the optional hugepages component, ha, ha-external), with a
#    throwaway token and throwaway etcd TLS files in a temporary copy of k8s/
#    (never the operator's k8s/base/cluster-token or certificates);
# 2. validates every rendered object against the Kubernetes API schemas,
#    offline and strict (kubernetes-validate, Kubernetes $K8S_VERSION);
# 3. runs checkov's Kubernetes checks on each rendering, with no network;
#    the checks it skips, each with its reason, are listed in
#    k8s/validate_helper.py (SKIP_ALL, SKIP_ONE) and printed below;
# 4. runs the overlays' init scripts (gid-check.sh, rxe-setup.sh) against a
#    fake sysfs, fake node.toml files and a fake `rdma`;
# 5. runs k8s/check_drift.py: the tcp rendering against the compose cluster,
#    the soft-roce and roce renderings against the tcp one (verbs on there,
#    off in tcp; the node container the same but for what each overlay must
#    change: soft-roce's privileged, roce's device resource) and the image
#    build against the verbs feature, the ha rendering against the compose
#    HA cluster (docker-compose.yml with ha.yml) and ha-external against
#    ha.
# The renderings are left in target/k8s-validate/.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
venv="${PAGEWIRE_K8S_VENV:-$repo/target/k8s-venv}"
out="$repo/target/k8s-validate"
K8S_VERSION="${K8S_VERSION:-1.30.0}"
KUBERNETES_VALIDATE_VERSION=1.37.0
CHECKOV_VERSION=3.3.30
PYYAML_VERSION=6.0.2
start=$SECONDS

say() { printf '== %s\n' "$*"; }
die() { printf 'validate.sh: %s\n' "$*" >&2; exit 1; }

# --- tools -------------------------------------------------------------------
kubectl="${KUBECTL:-$(command -v kubectl || true)}"
[ -n "$kubectl" ] && [ -x "$kubectl" ] || die "kubectl not found (set KUBECTL or put kubectl >= 1.27, which has kustomize v5, on PATH; kubectl kustomize needs no cluster)"
kver="$("$kubectl" version --client 2>/dev/null | tr '\n' ' ')"
case "$kver" in *"Kustomize Version: v5"*) ;; *) die "kubectl with kustomize v5 needed (the overlays use kustomize v5's labels and components); have: $kver" ;; esac

want_stamp="kubernetes-validate==$KUBERNETES_VALIDATE_VERSION checkov==$CHECKOV_VERSION PyYAML==$PYYAML_VERSION"
if [ "$(cat "$venv/.pagewire-stamp" 2>/dev/null)" != "$want_stamp" ]; then
    say "installing $want_stamp into $venv"
    if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
        [ "$(id -u)" = 0 ] || die "python3 -m venv is missing (Debian: apt-get install python3-venv)"
        apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    fi
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check \
        "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "checkov==$CHECKOV_VERSION" \
        "PyYAML==$PYYAML_VERSION"
    echo "$want_stamp" > "$venv/.pagewire-stamp"
fi
py="$venv/bin/python"
installed=$SECONDS

# checkov must not phone home: --skip-download, and a network namespace
# without any network where we may make one (root).
nonet=()
if unshare -n true 2>/dev/null; then nonet=(unshare -n); fi

# --- 1. render -----------------------------------------------------------------
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r "$here/base" "$here/overlays" "$here/components" "$work/"
rm -f "$work/base/cluster-token"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/base/cluster-token"
# ha-external's TLS files (git-ignored, no placeholders): kustomize only
# copies their bytes into the Secret, so any bytes render.
for f in ca.crt client.crt client.key; do
    echo "throwaway $f for validate.sh" > "$work/components/ha/external/tls/$f"
done
# The hugepages component is off in the roce overlay; render it too.
mkdir -p "$work/overlays/roce-hugepages"
cat > "$work/overlays/roce-hugepages/kustomization.yaml" <<'EOF'
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../roce
components:
  - ../roce/hugepages
EOF

variants=(tcp soft-roce roce roce-hugepages ha ha-external)
rm -rf "$out"
mkdir -p "$out"
say "render (kubectl kustomize; $(echo "$kver" | grep -o 'Kustomize Version: v[0-9.]*'))"
for v in "${variants[@]}"; do
    "$kubectl" kustomize "$work/overlays/$v" > "$out/$v.yaml" \
        || die "kubectl kustomize k8s/overlays/$v failed"
    "$py" "$here/validate_helper.py" objects "$out/$v.yaml" > "$out/$v.objects"
    printf '  %-15s %2d objects: %s\n' "$v" "$(wc -l < "$out/$v.objects")" \
        "$(cut -d' ' -f1 "$out/$v.objects" | sort | uniq -c | awk '{printf "%s%s x%s", s, $2, $1; s=", "}')"
done
# The rendered Secret holds the throwaway token: keep it out of target/.
for v in "${variants[@]}"; do
    "$py" - "$out/$v.yaml" <<'EOF'
import sys, yaml
p = sys.argv[1]
docs = [d for d in yaml.safe_load_all(open(p)) if d]
for d in docs:
    if d["kind"] == "Secret":
        d["data"] = {k: "UkVEQUNURUQ=" for k in d.get("data", {})}
open(p, "w").write(yaml.safe_dump_all(docs, sort_keys=False))
EOF
done

# --- 2. schemas ----------------------------------------------------------------
say "API schemas (kubernetes-validate $KUBERNETES_VALIDATE_VERSION, --strict, Kubernetes $K8S_VERSION, offline)"
for v in "${variants[@]}"; do
    log="$out/$v.schema.log"
    if ! "$venv/bin/kubernetes-validate" --strict -k "$K8S_VERSION" "$out/$v.yaml" > "$log" 2>&1; then
        grep -v ' passed for resource ' "$log" >&2 || true
        die "$v: schema validation failed"
    fi
    n_ok="$(grep -c ' passed for resource ' "$log" || true)"
    n_obj="$(wc -l < "$out/$v.objects")"
    [ "$n_ok" = "$n_obj" ] || { cat "$log" >&2; die "$v: $n_ok of $n_obj objects validated"; }
    printf '  %-15s %2d of %2d objects valid\n' "$v" "$n_ok" "$n_obj"
done

# --- 3. policy -----------------------------------------------------------------
say "policy (checkov $CHECKOV_VERSION, framework kubernetes${nonet:+, no network})"
reports=()
for v in "${variants[@]}"; do
    "${nonet[@]}" "$venv/bin/checkov" -f "$out/$v.yaml" --framework kubernetes \
        --skip-download -o json > "$out/$v.checkov.json" 2> "$out/$v.checkov.err" || true
    [ -s "$out/$v.checkov.json" ] || { cat "$out/$v.checkov.err" >&2; die "$v: checkov wrote no report"; }
    reports+=("$v" "$out/$v.checkov.json")
done
"$py" "$here/validate_helper.py" checkov "${reports[@]}" || die "checkov found problems (above)"

# --- 4. init scripts -----------------------------------------------------------
say "overlay init scripts (/bin/sh, fake sysfs, node.toml and rdma)"
t="$work/scripts"
ib="$t/ib/mlx5_0/ports/1"
mkdir -p "$ib/gids" "$ib/gid_attrs/types" "$ib/gid_attrs/ndevs" "$t/empty" "$t/bin"
echo Ethernet > "$ib/link_layer"; echo "4: ACTIVE" > "$ib/state"
gid() { echo "$2" > "$ib/gids/$1"; [ -z "$3" ] || echo "$3" > "$ib/gid_attrs/types/$1"; [ -z "$3" ] || echo eth1 > "$ib/gid_attrs/ndevs/$1"; }
gid 0 fe80:0000:0000:0000:0a00:27ff:fe00:0001 "IB/RoCE v1"
gid 1 fe80:0000:0000:0000:0a00:27ff:fe00:0001 "RoCE v2"
gid 2 0000:0000:0000:0000:0000:ffff:0a00:0105 "IB/RoCE v1"
gid 3 0000:0000:0000:0000:0000:ffff:0a00:0105 "RoCE v2"
gid 4 0000:0000:0000:0000:0000:0000:0000:0000 ""
gid 10 0000:0000:0000:0000:0000:ffff:c0a8:0a0b "RoCE v2"
# A second device with no RoCE v2 GID of those addresses.
ib2="$t/ib/rxe0/ports/1"
mkdir -p "$ib2/gids" "$ib2/gid_attrs/types" "$ib2/gid_attrs/ndevs"
echo 0000:0000:0000:0000:0000:ffff:ac10:0001 > "$ib2/gids/1"; echo "RoCE v2" > "$ib2/gid_attrs/types/1"; echo eth0 > "$ib2/gid_attrs/ndevs/1"
# node.toml files: the soft-roce/roce one (verbs on, GID auto), the base's
# (verbs off), and variants with keys changed.
verbs_toml="$here/components/verbs/node.toml"
conf() { # conf NAME SED-EXPRESSION: a copy of the verbs node.toml, edited
    sed "$2" "$verbs_toml" > "$t/$1.toml"
}
conf auto 's/^x//'
conf pin10 's/^verbs_device = ""/verbs_device = "mlx5_0"/; s/^verbs_gid_index = -1/verbs_gid_index = 10/'
conf pin2 's/^verbs_device = ""/verbs_device = "mlx5_0"/; s/^verbs_gid_index = -1/verbs_gid_index = 2/'
conf pin4 's/^verbs_device = ""/verbs_device = "mlx5_0"/; s/^verbs_gid_index = -1/verbs_gid_index = 4/'
conf pin3nodev 's/^verbs_gid_index = -1/verbs_gid_index = 3/'
conf port2 's/^verbs_port = 1/verbs_port = 2/'
conf nodev 's/^verbs_device = ""/verbs_device = "mlx5_9"/'
conf adv 's/^advertise = ""/advertise = "192.168.10.11:7500"/'
conf onrxe 's/^verbs_device = ""/verbs_device = "rxe0"/'
ntest=0
expect() { # expect RC WANT_IN_OUTPUT -- command...
    local rc="$1" want="$2"; shift 3
    local got=0 o
    o="$("$@" 2>&1)" || got=$?
    ntest=$((ntest + 1))
    if [ "$got" != "$rc" ] || ! grep -qF -- "$want" <<<"$o"; then
        printf '%s\n' "$o" >&2
        die "init script test: '$*' exited $got (want $rc) or lacks '$want'"
    fi
}
gc="$here/overlays/roce/gid-check.sh"
g() { env -u POD_IP -u PAGEWIRE_ADVERTISE IB_SYSFS="$t/ib" PAGEWIRE_NODE_CONFIG="$t/$1.toml" "${@:2}" sh "$gc"; }
expect 0 "will use mlx5_0 port 1 GID index 3 (eth1, 10.0.1.5)" -- g auto POD_IP=10.0.1.5
expect 0 "will use mlx5_0 port 1 GID index 10 (eth1, 192.168.10.11)" -- g auto POD_IP=192.168.10.11
expect 0 "will use rxe0 port 1 GID index 1 (eth0, 172.16.0.1)" -- g auto POD_IP=172.16.0.1
expect 1 "no RoCE v2 GID holds the advertised address 10.0.9.9" -- g auto POD_IP=10.0.9.9
expect 1 "no RoCE v2 GID holds the advertised address 10.0.1.5" -- g onrxe POD_IP=10.0.1.5
expect 1 "advertised address is unknown" -- g auto
expect 0 "GID index 10 (eth1, 192.168.10.11)" -- g adv POD_IP=10.0.1.5
expect 0 "GID index 3 (eth1, 10.0.1.5)" -- g adv PAGEWIRE_ADVERTISE=10.0.1.5:7500 POD_IP=10.0.9.9
expect 0 "not an IPv4 literal" -- g auto PAGEWIRE_ADVERTISE=node-1.example:7500
expect 0 "holds 192.168.10.11, not the advertised address 10.0.1.5" -- g pin10 POD_IP=10.0.1.5
expect 0 "is 'IB/RoCE v1', not RoCE v2" -- g pin2 POD_IP=10.0.1.5
expect 1 "GID index 4 does not exist on mlx5_0 port 1" -- g pin4 POD_IP=10.0.1.5
expect 1 "needs transports.verbs_device" -- g pin3nodev POD_IP=10.0.1.5
expect 1 "no RDMA device named 'mlx5_9'" -- g nodev POD_IP=10.0.1.5
expect 1 "10.0.1.5 (the pod's IP) on any device port 2" -- g port2 POD_IP=10.0.1.5
expect 0 "verbs is off" -- env IB_SYSFS="$t/ib" PAGEWIRE_NODE_CONFIG="$here/base/config/node.toml" sh "$gc"
expect 1 "no RDMA device visible" -- env IB_SYSFS="$t/empty" PAGEWIRE_NODE_CONFIG="$t/auto.toml" POD_IP=10.0.1.5 sh "$gc"
expect 1 "cannot read the node config" -- env IB_SYSFS="$t/ib" PAGEWIRE_NODE_CONFIG="$t/none.toml" sh "$gc"
rm "$ib/gids/3" "$ib/gids/10"
expect 1 "no RoCE v2 GID holds the advertised address 10.0.1.5" -- g auto POD_IP=10.0.1.5
# A fake `rdma`: `link show` prints $FAKE_LINKS, `link add` logs its arguments.
cat > "$t/bin/rdma" <<'EOF'
#!/bin/sh
case "$1 $2" in
    "link show") printf '%s' "${FAKE_LINKS:-}" ;;
    "link add") echo "$*" >> "$FAKE_LOG"; [ -z "${FAKE_ADD_FAILS:-}" ] || { echo "error: Unknown device type" >&2; exit 1; } ;;
    *) exit 2 ;;
esac
EOF
chmod +x "$t/bin/rdma"
rx="$here/overlays/soft-roce/rxe-setup.sh"
: > "$t/log"
expect 0 "" -- env PATH="$t/bin:$PATH" FAKE_LOG="$t/log" sh "$rx"
grep -qx "link add rxe0 type rxe netdev eth0" "$t/log" || die "rxe-setup did not run 'rdma link add rxe0 type rxe netdev eth0'"
: > "$t/log"
expect 0 "already has an RDMA link" -- env PATH="$t/bin:$PATH" FAKE_LOG="$t/log" \
    FAKE_LINKS="link rxe0/1 state ACTIVE physical_state LINK_UP netdev eth0
" sh "$rx"
[ ! -s "$t/log" ] || die "rxe-setup added a link although eth0 had one"
expect 0 "" -- env PATH="$t/bin:$PATH" FAKE_LOG="$t/log" \
    FAKE_LINKS="link rxe9/1 state ACTIVE physical_state LINK_UP netdev eth01
" sh "$rx"
grep -q "netdev eth0$" "$t/log" || die "rxe-setup took eth01's link for eth0's"
expect 1 "modprobe rdma_rxe" -- env PATH="$t/bin:$PATH" FAKE_LOG="$t/log" FAKE_ADD_FAILS=1 sh "$rx"
expect 1 "no 'rdma' tool" -- env PATH="$t/empty" /bin/sh "$rx"
printf '  %d script tests passed (gid-check.sh, rxe-setup.sh)\n' "$ntest"

# --- 5. drift ------------------------------------------------------------------
say "drift: k8s/overlays/tcp against k8s/compose/docker-compose.yml, soft-roce and roce against tcp, the image, ha against the compose HA cluster, ha-external against ha (k8s/check_drift.py)"
for f in docker-compose.yml ha.yml; do
    [ -f "$here/compose/$f" ] || die "k8s/compose/$f is missing"
done
# Render again, unredacted: check_drift compares the ConfigMaps' bytes only,
# but use the real renderings rather than the rewritten ones.
for v in tcp soft-roce roce ha ha-external; do
    "$kubectl" kustomize "$work/overlays/$v" > "$work/$v.yaml"
done
"$py" "$here/check_drift.py" --rendered "$work/tcp.yaml" \
    --overlay soft-roce="$work/soft-roce.yaml" --overlay roce="$work/roce.yaml" \
    --overlay ha="$work/ha.yaml" --overlay ha-external="$work/ha-external.yaml" > "$out/drift.log" 2>&1 \
    || { cat "$out/drift.log"; die "the manifests drifted (above)"; }
grep -E '^\S|FAIL' "$out/drift.log" | sed 's/^/  /'

say "covered: ${#variants[@]} renderings (${variants[*]}), schemas of Kubernetes $K8S_VERSION, checkov, $ntest script tests, drift (compose, RDMA overlays, image, compose HA); $((SECONDS - installed)) s (+$((installed - start)) s install)"
echo "validate.sh: ok"
