#!/usr/bin/env bash
# Builds the base image pagewire's image is built on, offline from any
# container registry: a minimal Debian bookworm (debootstrap --variant
# minbase) imported as pagewire-base:bookworm. Skipped when that image
# exists; --force builds it again.
#
# The Debian mirror is this machine's own (its apt sources: deb822
# /etc/apt/sources.list.d/*.sources, else /etc/apt/sources.list), or
# --mirror URL. Needs root and debootstrap (apt-get install debootstrap).
#
#   k8s/image/base.sh [--force] [--tag pagewire-base:bookworm] [--mirror URL]
#
# pagewire's binaries link only glibc and libgcc_s (both in minbase; check
# with `ldd`). The one addition: libibverbs1 and ibverbs-providers (with
# their dependencies libnl-3-200, libnl-route-3-200, adduser), which the
# node's verbs transport loads at run time; the Dockerfile's runtime stage
# installs them only where the base lacks them, so they are included here
# and the offline build needs no network. No shell tools beyond minbase's,
# no ca-certificates (pagewire's TLS takes its CAs from files it is given).
# Docs, man pages, locales and apt's caches and lists are removed. An
# existing base without the RDMA libraries is built again.
set -euo pipefail

tag=pagewire-base:bookworm
suite=bookworm
mirror=
force=0
include=libibverbs1,ibverbs-providers
while [ $# -gt 0 ]; do
  case $1 in
    --force) force=1 ;;
    --tag) tag=$2; shift ;;
    --mirror) mirror=$2; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "base.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$force" = 0 ] && docker image inspect "$tag" >/dev/null 2>&1; then
  if docker run --rm --network none "$tag" dpkg -s ${include//,/ } >/dev/null 2>&1; then
    echo "base.sh: $tag exists ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.1f MB", $1/1e6}')); --force builds it again"
    exit 0
  fi
  echo "base.sh: $tag exists but lacks ${include//,/ }; building it again"
fi

# The mirror of this machine's apt configuration: the first URI of a source
# that carries the suite itself (not -updates or -security).
find_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    # deb822 stanzas are separated by blank lines.
    awk -v suite="$suite" '
      BEGIN { RS = ""; FS = "\n" }
      {
        uris = ""; ok = 0; deb = 0
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/)   { sub(/^URIs:[ \t]*/, "", $i); uris = $i }
          if ($i ~ /^Types:/  && $i ~ /(^|[ \t])deb([ \t]|$)/) deb = 1
          if ($i ~ /^Suites:/) { n = split(substr($i, 8), s, /[ \t]+/); for (j = 1; j <= n; j++) if (s[j] == suite) ok = 1 }
        }
        if (ok && deb && uris != "") { split(uris, u, /[ \t]+/); print u[1]; exit }
      }' "$f"
  done | head -n1
  if [ -f /etc/apt/sources.list ]; then
    awk -v suite="$suite" '$1 == "deb" { i = 2; if ($2 ~ /^\[/) while ($i !~ /\]$/) i++; if ($2 ~ /^\[/) i++; if ($(i+1) == suite) { print $i; exit } }' /etc/apt/sources.list
  fi
}
if [ -z "$mirror" ]; then
  mirror=$(find_mirror | head -n1)
fi
if [ -z "$mirror" ]; then
  echo "base.sh: no '$suite' source in this machine's apt configuration; pass --mirror URL" >&2
  exit 1
fi
if ! command -v debootstrap >/dev/null; then
  echo "base.sh: debootstrap is not installed (apt-get install debootstrap)" >&2
  exit 1
fi

work=$(mktemp -d /tmp/pagewire-base.XXXXXX)
cleanup() { rm -rf "$work"; }
trap cleanup EXIT
root=$work/root
echo "base.sh: debootstrap --variant=minbase --include=$include $suite from $mirror"
debootstrap --variant=minbase --include="$include" "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
  tail -n 30 "$work/debootstrap.log" >&2
  echo "base.sh: debootstrap failed (log above)" >&2
  exit 1
}

# Smaller: nothing a container runtime reads.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin \
  "$root"/var/lib/apt/lists/* "$root"/var/log/* "$root"/tmp/* \
  "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
  "$root"/usr/share/locale/* "$root"/usr/share/lintian "$root"/usr/share/common-licenses
# A container gets its own resolv.conf and hostname.
: >"$root"/etc/resolv.conf
: >"$root"/etc/hostname

tar --numeric-owner -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --message "debootstrap --variant=minbase --include=$include $suite" - "$tag" >/dev/null
size=$(docker image inspect -f '{{.Size}}' "$tag")
echo "base.sh: built $tag: $(awk -v s="$size" 'BEGIN { printf "%.1f MB (%d bytes)", s/1e6, s }')"
