# pagewire's image: pagewire-coordinator, pagewire-node, pwctl and
# pagewire-bench on Debian bookworm slim, run as the unprivileged user
# pagewire (uid/gid 10001); no build tools in the final image.
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
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The workspace's release profile; the copies are stripped (no debug info
# or symbols in the image).
RUN cargo build --release --locked \
      -p pagewire-node -p pagewire-coordinator -p pagewire-bench \
      --features pagewire-coordinator/etcd \
 && mkdir /out \
 && cp target/release/pagewire-coordinator target/release/pagewire-node \
       target/release/pwctl target/release/pagewire-bench /out/ \
 && strip --strip-unneeded /out/*

FROM ${BASE} AS runtime
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
