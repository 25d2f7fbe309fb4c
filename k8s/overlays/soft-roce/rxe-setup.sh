#!/bin/sh
# Creates a soft-RoCE device (rxe) on this pod's interface unless an RDMA
# link on it exists already. Runs as the privileged init container of the
# node pod (k8s/overlays/soft-roce). Needs `rdma` (iproute2) and the host
# kernel module rdma_rxe.
set -eu
netdev="${RXE_NETDEV:-eth0}"
name="${RXE_NAME:-rxe0}"
if ! command -v rdma >/dev/null 2>&1; then
    echo "rxe-setup: no 'rdma' tool in this image (Debian package iproute2)" >&2
    exit 1
fi
if rdma link show | grep -Eq " netdev ${netdev}( |\$)"; then
    echo "rxe-setup: $netdev already has an RDMA link"
elif ! rdma link add "$name" type rxe netdev "$netdev"; then
    echo "rxe-setup: 'rdma link add $name type rxe netdev $netdev' failed." >&2
    echo "rxe-setup: is the kernel module rdma_rxe loaded on this host (modprobe rdma_rxe)?" >&2
    echo "rxe-setup: does an RDMA device named $name exist already (set RXE_NAME)?" >&2
    exit 1
fi
rdma link show
