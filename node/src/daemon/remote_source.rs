//! Pages of extents another node owns, read from that node one-sidedly.
//!
//! A node asked (gRPC `Read`) for a page it does not serve reads it from the
//! owner with the client library's owner pool
//! ([`pagewire_client::OwnerPool`]): one-sided READs of the owner's region
//! (shm when the owner's shm file is on this host, else tcp), `FaultIn` on
//! the owner for a page its index does not show, no lock held across network
//! I/O, a deadline on every `FaultIn`. Nothing is cached here. The caller
//! (`Node::read_pages`) takes the owner from the applied map, lets go of
//! the map's lock before reading here, and checks this node's own lease
//! before and after, so a map is trusted only while that lease holds
//! (ARCHITECTURE.md, "Ownership, leases and writes"). The standalone
//! client reads owners with the same connection and fault-in code.

use pagewire_client::{OwnerPool, PoolConfig};
use pagewire_proto::v1::MapNode;

use super::DaemonError;
use super::ownership::{PageSource, Sourced};

/// The daemon's pool: the transports' default settings (shm if reachable,
/// else tcp; `FaultIn` within 2 s), `FaultIn` calls on the daemon's
/// runtime, over TLS when `tls` names the peers' CA. Must be called inside
/// that runtime.
pub(crate) fn pool(
    token: &str,
    page_size: usize,
    tls: Option<pagewire_proto::net::ClientTls>,
) -> Result<OwnerPool, DaemonError> {
    OwnerPool::new(
        token,
        page_size,
        PoolConfig {
            tls,
            ..PoolConfig::default()
        },
        tokio::runtime::Handle::current(),
    )
    .map_err(|e| DaemonError::Config {
        key: "token",
        reason: e.to_string(),
    })
}

impl PageSource for OwnerPool {
    fn read(
        &self,
        owner: &MapNode,
        _epoch: u64,
        first: u64,
        count: u64,
    ) -> Result<Sourced, DaemonError> {
        let (data, pages) =
            self.read_run(owner, first, count)
                .map_err(|e| DaemonError::OwnerUnavailable {
                    page: e.page(first),
                    reason: e.to_string(),
                })?;
        Ok(Sourced {
            data,
            generations: pages.iter().map(|p| p.generation()).collect(),
            faulted_in: pages.iter().any(|p| p.fault_in),
        })
    }
}
