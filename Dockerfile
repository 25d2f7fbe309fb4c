# pagewire's image: pagewire-coordinator, pagewire-node, pwctl and
# pagewire-bench on Debian bookworm slim, run as the unprivileged user
# pagewire (uid/gid 10001); no build tools in the final image. The node is
# built with its RDMA verbs transport (cargo feature pagewire-node/verbs),
# which loads libibverbs at run time: the image carries libibverbs1 and
# ibverbs-providers (the rxe, mlx5 and other user-space drivers), nothing
# else of rdma-core. Whether a node serves verbs is its config's choice
# ([transports] verbs; the soft-roce and roce overlays turn it on).
#
#   docker build -t pagewire:dev .
#
# builds it from the rust and debian images of a registry. Without one,
# k8s/image/build.sh builds the same runtime stage offline, on a Debian base
# made with debootstrap (k8s/image/base.sh), from binaries built on the host
# with the command below. Keep the runtime stage last: build.sh takes
# everything from its FROM line to the end of this file.
#
# Paths (the deployment contract, k8s/ and k8s/compose/ use them):
#   /etc/pagewire/            configs (coordinator.toml, node.toml)
#   /etc/pagewire/token/token the cluster token file
#   /var/lib/pagewire/        the coordinator's state (writable by pagewire)
#   /var/lib/pagewire/shm/    the node's shm_dir (mount a tmpfs or emptyDir)
#   /data/                    the backing file (read-write for nodes)
# Ports: coordinator gRPC 7400, HTTP 7401; node gRPC 7500, HTTP 7501,
# tcp one-sided transport 7502.

ARG BASE=debian:bookworm-slim

FROM rust:1.95-slim-bookworm AS build
# protoc and the well-known types: the coordinator's etcd store (etcd-client).
# clang, libclang, cmake (with make, which the slim image lacks) and the
# rdma-core headers: the verbs transport (sideway's bindgen and its
# libibverbs loader, built from source).
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev \
      clang libclang-dev cmake make libibverbs-dev librdmacm-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The workspace's release profile; the copies are stripped (no debug info
# or symbols in the image). k8s/image/build.sh runs the same cargo command
# and k8s/check_drift.py checks that both carry these features.
RUN cargo build --release --locked \
      -p pagewire-node -p pagewire-coordinator -p pagewire-pwctl -p pagewire-bench \
      --features pagewire-coordinator/etcd,pagewire-node/verbs,pagewire-bench/verbs \
 && mkdir /out \
 && cp target/release/pagewire-coordinator target/release/pagewire-node \
       target/release/pwctl target/release/pagewire-bench /out/ \
 && strip --strip-unneeded /out/*

FROM ${BASE} AS runtime
# libibverbs1 and ibverbs-providers, which pagewire-node loads (dlopen) when
# its config says verbs = true; without them it finds "no RDMA device". The
# offline base (k8s/image/base.sh) has them already (debootstrap --include),
# so this installs only on a base that lacks them.
RUN if ! dpkg -s libibverbs1 ibverbs-providers >/dev/null 2>&1; then \
      apt-get update \
      && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers \
      && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /usr/share/doc/* /usr/share/man/*; \
    fi
RUN groupadd --system --gid 10001 pagewire \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/pagewire \
      --no-create-home --shell /usr/sbin/nologin pagewire \
 && mkdir -p /etc/pagewire/token /var/lib/pagewire/shm /data \
 && chown pagewire:pagewire /etc/pagewire/token /var/lib/pagewire /var/lib/pagewire/shm /data \
 && chmod 0750 /etc/pagewire/token
COPY --from=build /out/ /usr/local/bin/
USER 10001:10001
WORKDIR /var/lib/pagewire
EXPOSE 7400 7401 7500 7501 7502
CMD ["pagewire-node", "--config", "/etc/pagewire/node.toml"]
