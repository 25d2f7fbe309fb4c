//! A pool of one-sided connections to owners, with the `FaultIn` fallback:
//! "read pages of an extent another node owns" in one place, used by the
//! node daemon for reads it does not serve (`daemon::remote_source`).
//!
//! A read ([`OwnerPool::read_run`]) takes an idle connection to the owner
//! out of the pool (or connects a new one, with no lock held), reads each
//! page one-sidedly ([`crate::remote`]: over `shm` when the owner's shm file
//! is on this host, else `verbs` where built and usable, else `tcp`), and
//! puts the connection back. A page the owner's index does not show (or
//! that keeps moving) is faulted in on the owner with gRPC `FaultIn`, whose
//! reply carries the bytes and the frame's location, so the next read of it
//! is one round trip again. Nothing is cached here.
//!
//! No lock is held across network I/O: reads of one owner from several
//! threads each get their own connection, and a connection to a frozen
//! owner holds up only the read using it. A `FaultIn` has a deadline
//! ([`PoolConfig::fault_in_deadline`], connecting included). A connection
//! remembers the region epoch of the descriptor it was opened with; idle
//! connections to an earlier incarnation of the owner (the map names
//! another epoch) are closed when the owner is next read.
//!
//! Freshness is the caller's: the pool reads the owner the caller names and
//! trusts nobody's map. The node daemon checks its own lease before and
//! after a read (ARCHITECTURE.md, "Ownership, leases and writes").

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::cluster::owner::{self, ConnectHow, Faulted, OwnerConn, TransportChoice};
use crate::remote::{Outcome, ReaderConfig, ReaderStats};
use pagewire_proto::auth::{AttachToken, TokenError};
use pagewire_proto::v1::MapNode;
use pagewire_rdma::tcp::ConnectionConfig;

/// Settings of an [`OwnerPool`].
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// Which transport one-sided reads use (default: shm if reachable, else
    /// verbs, else tcp).
    pub transport: TransportChoice,
    /// The one-sided readers' retries.
    pub reader: ReaderConfig,
    /// The tcp transport's settings; its token is left empty here and the
    /// pool's is used.
    pub tcp: ConnectionConfig,
    /// How long a `FaultIn` on an owner may take, connecting included
    /// (default 2 s): past it the read fails as the owner unavailable,
    /// instead of waiting on a frozen owner for as long as TCP does.
    pub fault_in_deadline: Duration,
}

impl Default for PoolConfig {
    /// The transports' default settings.
    fn default() -> Self {
        Self {
            transport: TransportChoice::Auto,
            reader: ReaderConfig::default(),
            tcp: ConnectionConfig::new(Vec::new()),
            fault_in_deadline: Duration::from_secs(2),
        }
    }
}

/// Counters of an [`OwnerPool`], since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages read for callers.
    pub pages: u64,
    /// Of those, read one-sidedly (no owner CPU).
    pub one_sided: u64,
    /// Of those, faulted in on the owner over gRPC.
    pub fallbacks: u64,
    /// One-sided connections opened to owners.
    pub connects: u64,
}

/// Why [`OwnerPool::read_run`] returned no bytes. Every case is one the
/// caller retries (with a fresh map, or after a backoff): the owner is
/// unreachable, frozen, restarted or busy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// No connection to the owner could be opened (`reason` says why each
    /// transport it publishes failed).
    #[error("cannot connect to node {node}: {reason}")]
    Connect { node: String, reason: String },
    /// The one-sided read of `page` failed (a stale descriptor, a lost
    /// connection, a timeout); the connection was closed.
    #[error("one-sided read of page {page} from node {node}: {reason}")]
    Read {
        node: String,
        page: u64,
        reason: String,
    },
    /// `FaultIn` of `page` on the owner failed or ran past its deadline.
    #[error("FaultIn of page {page} on node {node}: {reason}")]
    FaultIn {
        node: String,
        page: u64,
        reason: String,
    },
}

impl PoolError {
    /// The page the failure is about (the run's first for `Connect`).
    pub fn page(&self, first: u64) -> u64 {
        match self {
            Self::Connect { .. } => first,
            Self::Read { page, .. } | Self::FaultIn { page, .. } => *page,
        }
    }
}

#[derive(Default)]
struct Counters {
    pages: AtomicU64,
    one_sided: AtomicU64,
    fallbacks: AtomicU64,
    connects: AtomicU64,
}

/// One-sided connections to owners, shared by every thread of a process.
pub struct OwnerPool {
    token: String,
    attach: AttachToken,
    cfg: PoolConfig,
    page_size: usize,
    /// Runs the `FaultIn` calls.
    rt: tokio::runtime::Handle,
    /// Idle connections, by owner index.
    idle: Mutex<HashMap<u32, Vec<OwnerConn>>>,
    counters: Counters,
    /// Reader counters of connections since closed, so totals only grow.
    retired: Mutex<ReaderStats>,
    /// The largest total [`OwnerPool::reader_stats`] computed (connections
    /// in use are not in the pool, so a new sum can come out lower).
    last_total: Mutex<ReaderStats>,
}

impl OwnerPool {
    /// A pool reading pages of `page_size` bytes with the cluster `token`.
    /// `FaultIn` calls run on `rt`, which must be a multi-thread runtime
    /// (or be driven by another thread): [`OwnerPool::read_run`] blocks on
    /// it, so it may not be called from one of `rt`'s async tasks (use
    /// `spawn_blocking`).
    pub fn new(
        token: &str,
        page_size: usize,
        cfg: PoolConfig,
        rt: tokio::runtime::Handle,
    ) -> Result<Self, TokenError> {
        Ok(Self {
            token: token.to_owned(),
            attach: AttachToken::new(token)?,
            cfg,
            page_size,
            rt,
            idle: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            retired: Mutex::new(ReaderStats::default()),
            last_total: Mutex::new(ReaderStats::default()),
        })
    }

    /// The pool's counters.
    pub fn stats(&self) -> PoolStats {
        let c = &self.counters;
        PoolStats {
            pages: c.pages.load(Ordering::Relaxed),
            one_sided: c.one_sided.load(Ordering::Relaxed),
            fallbacks: c.fallbacks.load(Ordering::Relaxed),
            connects: c.connects.load(Ordering::Relaxed),
        }
    }

    /// The one-sided readers' counters, over every connection so far
    /// (connections in use count from when they are back in the pool).
    pub fn reader_stats(&self) -> ReaderStats {
        let mut total = *self.retired.lock().unwrap_or_else(|e| e.into_inner());
        for o in self
            .idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .flatten()
        {
            total.add(&o.reader.stats());
        }
        let mut last = self.last_total.lock().unwrap_or_else(|e| e.into_inner());
        last.max_each(&total);
        *last
    }

    /// Reads pages `first..first + count` of the file from `owner` (a node
    /// of the caller's map): their bytes, concatenated (each page's valid
    /// length), and each page's frame generation (0 for a page the owner
    /// served without caching it).
    pub fn read_run(
        &self,
        owner: &MapNode,
        first: u64,
        count: u64,
    ) -> Result<(Vec<u8>, Vec<u64>), PoolError> {
        let mut o = self.take(owner)?;
        match self.read_with(&mut o, owner, first, count) {
            Ok(out) => {
                self.put_back(owner.index, o);
                Ok(out)
            }
            Err((keep, e)) => {
                if keep {
                    self.put_back(owner.index, o);
                } else {
                    self.retire(o);
                }
                Err(e)
            }
        }
    }

    /// Closes `conn`, keeping its counters.
    fn retire(&self, conn: OwnerConn) {
        self.retired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(&conn.reader.stats());
    }

    /// An idle connection to `owner` at the region epoch the map names, or
    /// a new one (connected with no lock held). Idle connections to an older
    /// region of the owner (it restarted) are closed.
    fn take(&self, owner: &MapNode) -> Result<OwnerConn, PoolError> {
        let want = owner::region_epoch(owner);
        let (conn, stale) = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            let list = idle.entry(owner.index).or_default();
            let stale: Vec<OwnerConn> = list.extract_if(.., |o| Some(o.epoch) != want).collect();
            (list.pop(), stale)
        };
        for o in stale {
            self.retire(o);
        }
        if let Some(c) = conn {
            return Ok(c);
        }
        let how = ConnectHow {
            token: &self.token,
            transport: self.cfg.transport,
            reader: self.cfg.reader.clone(),
            tcp: self.cfg.tcp.clone(),
        };
        let c = owner::connect(owner, &how).map_err(|reason| PoolError::Connect {
            node: owner.node_id.clone(),
            reason,
        })?;
        self.counters.connects.fetch_add(1, Ordering::Relaxed);
        Ok(c)
    }

    fn put_back(&self, index: u32, conn: OwnerConn) {
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(index)
            .or_default()
            .push(conn);
    }

    /// Faults `page` in on its owner over gRPC and takes the bytes from the
    /// reply, within the deadline. Returns the bytes and the frame's
    /// location.
    fn fault_in(&self, owner: &MapNode, page: u64) -> Result<Faulted, String> {
        let deadline = self.cfg.fault_in_deadline;
        let attach = self.attach.clone();
        let addr = owner.grpc_address.clone();
        self.rt.block_on(async move {
            let call = async {
                let mut client = owner::node_client(&addr, &attach, deadline).await?;
                owner::fault_in(&mut client, page, 0)
                    .await
                    .map_err(|s| s.message().to_owned())
            };
            tokio::time::timeout(deadline, call).await.map_err(|_| {
                format!(
                    "the owner at {addr} did not answer FaultIn within {} ms",
                    deadline.as_millis()
                )
            })?
        })
    }

    /// Reads `first..first + count` over `o`. On failure, says whether `o`
    /// still works (`true`: only the `FaultIn` failed) or must be closed.
    fn read_with(
        &self,
        o: &mut OwnerConn,
        owner: &MapNode,
        first: u64,
        count: u64,
    ) -> Result<(Vec<u8>, Vec<u64>), (bool, PoolError)> {
        let n = usize::try_from(count).unwrap_or(0);
        let mut data = Vec::with_capacity(n.saturating_mul(self.page_size));
        let mut gens = Vec::with_capacity(n);
        let mut buf = vec![0u8; self.page_size];
        let file_len = o.reader.file_len();
        let fault_in_failed = |page, reason| {
            (
                true,
                PoolError::FaultIn {
                    node: owner.node_id.clone(),
                    page,
                    reason,
                },
            )
        };
        for page in first..first.saturating_add(count) {
            let len = (file_len.saturating_sub(page.saturating_mul(self.page_size as u64))
                as usize)
                .min(self.page_size);
            self.counters.pages.fetch_add(1, Ordering::Relaxed);
            match o.reader.read_page(page, &mut buf) {
                Ok(Outcome::Hit { generation, .. }) => {
                    self.counters.one_sided.fetch_add(1, Ordering::Relaxed);
                    data.extend_from_slice(&buf[..len]);
                    gens.push(generation);
                }
                Ok(Outcome::Absent | Outcome::GaveUp) => {
                    self.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
                    let Faulted {
                        data: bytes,
                        location,
                    } = self
                        .fault_in(owner, page)
                        .map_err(|why| fault_in_failed(page, why))?;
                    if bytes.len() != len {
                        return Err(fault_in_failed(
                            page,
                            format!(
                                "the owner's FaultIn returned {} bytes, not {len}",
                                bytes.len()
                            ),
                        ));
                    }
                    // A page the owner did not cache has no location.
                    let generation = match location {
                        Some((frame, generation)) => {
                            o.reader.learn(page, frame, generation);
                            generation
                        }
                        None => 0,
                    };
                    data.extend_from_slice(&bytes);
                    gens.push(generation);
                }
                // Stale descriptor (owner restarted) or a lost connection:
                // the connection goes; the caller retries with a fresh map.
                Err(e) => {
                    return Err((
                        false,
                        PoolError::Read {
                            node: owner.node_id.clone(),
                            page,
                            reason: e.to_string(),
                        },
                    ));
                }
            }
        }
        Ok((data, gens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    #[test]
    fn a_token_that_cannot_be_sent_is_refused_when_the_pool_is_made() {
        let rt = rt();
        let bad = OwnerPool::new("", 4096, PoolConfig::default(), rt.handle().clone());
        assert!(bad.is_err(), "an empty token was accepted");
        let good = OwnerPool::new("t0ken", 4096, PoolConfig::default(), rt.handle().clone());
        assert!(good.is_ok());
    }

    /// An owner that publishes no transport cannot be read: the error names
    /// the node and why, and nothing counts as read or connected.
    #[test]
    fn an_owner_without_descriptors_is_a_connect_error_naming_it() {
        let rt = rt();
        let pool = OwnerPool::new("t0ken", 4096, PoolConfig::default(), rt.handle().clone())
            .expect("pool");
        let owner = MapNode {
            index: 9,
            node_id: "node-9".into(),
            ..MapNode::default()
        };
        let e = pool.read_run(&owner, 40, 2).expect_err("nothing to read");
        match &e {
            PoolError::Connect { node, reason } => {
                assert_eq!(node, "node-9");
                assert!(reason.contains("publishes no"), "{reason}");
            }
            other => panic!("expected a connect error, got {other:?}"),
        }
        assert_eq!(e.page(40), 40);
        assert_eq!(pool.stats(), PoolStats::default());
    }
}
