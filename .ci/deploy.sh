#!/usr/bin/env bash
# CI for the deployment (issue 9); .ci/run calls it as `bash .ci/deploy.sh`
# from the repository root, as root, on a Debian bookworm machine with the
# Docker engine running and docker-compose installed (no registry).
#
# 1. the Kubernetes manifests: every overlay rendered, validated offline
#    against the API schemas, checkov, and checked against the compose
#    cluster (k8s/validate.sh);
# 2. the image, built offline on a debootstrapped Debian base
#    (k8s/image/build.sh), pagewire-node with its verbs transport, and the
#    RDMA libraries in it;
#    and the etcd image (k8s/image/etcd.sh, Debian's etcd on the same base);
# 3. the compose scenarios on the highly available cluster (three etcd
#    members, three coordinators: docker-compose.yml plus ha.yml), every
#    read verified (k8s/compose/scenarios.py --ha): the five of the single
#    cluster and four of coordinator and etcd failures; the cluster kept up
#    after them;
# 4. a real Prometheus scraping that cluster (every coordinator, every
#    node) under a read load: every
#    dashboard query and alert operand must return data, promtool must
#    accept the rules (k8s/monitoring/check.sh); then the cluster goes.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { echo "=== deploy ci: $* ($(date -u +%T))"; }
project=pagewire-ci
out=target/deploy-ci
mkdir -p "$out"

step "packages (debootstrap for the base image, python3-venv for the validators, the verbs feature's build tools)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends debootstrap python3-venv iproute2 \
    clang libclang-dev cmake libibverbs-dev librdmacm-dev >/dev/null
command -v docker >/dev/null || { echo "deploy ci: docker is missing" >&2; exit 1; }
command -v docker-compose >/dev/null || apt-get install -y -qq docker-compose >/dev/null

step "k8s manifests: render, schemas, checkov, drift against compose"
bash k8s/validate.sh

step "image, offline"
bash k8s/image/build.sh | tee "$out/image.log"

step "etcd image, offline"
bash k8s/image/etcd.sh | tee "$out/etcd-image.log"

cleanup() {
    docker-compose -p "$project" -f k8s/compose/docker-compose.yml -f k8s/compose/ha.yml --profile tools \
        down -v --remove-orphans >/dev/null 2>&1 || true
}
trap cleanup EXIT

step "compose HA scenarios (kill, rolling SIGTERM restart, partition, pause, coordinator restart; leader kill, coordinators' rolling restart, etcd member loss, leader cut off from etcd)"
python3 k8s/compose/scenarios.py --ha --project "$project" --keep --json-out "$out/scenarios.json"

step "monitoring: Prometheus against the compose cluster"
# The token lives in the cluster's own volume; the host reads the
# containers' ports over the compose bridge.
docker run --rm -v "${project}_token:/t:ro" --entrypoint cat pagewire:dev /t/token > "$out/token"
chmod 0600 "$out/token"
# An operator's drain and undrain: the leader restarted in scenario 5 (or
# elected since) may have saved nothing yet, so its store-save panels would
# have no observation to show.
coordinators=10.213.7.10:7400,10.213.7.14:7400,10.213.7.15:7400
pwctl=(target/release/pwctl --coordinator "$coordinators" --token-file "$out/token")
"${pwctl[@]}" drain node-3 --wait 15
"${pwctl[@]}" undrain node-3
bash k8s/monitoring/check.sh \
    --coordinator 10.213.7.10:7401,10.213.7.14:7401,10.213.7.15:7401 \
    --node 10.213.7.11:7501,10.213.7.12:7501,10.213.7.13:7501 \
    --token-file "$out/token" \
    --storm "$coordinators" --bench target/release/pagewire-bench \
    --proxy-reads 10.213.7.11:7500,10.213.7.12:7500,10.213.7.13:7500 \
    --provoke-rpc-error "$coordinators"

step "done"
