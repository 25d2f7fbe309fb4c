//! Pages of extents another node owns, read from that node one-sidedly.
//!
//! A node asked (gRPC `Read`) for a page it does not serve reads it from the
//! owner's region with the one-sided reader ([`crate::remote`]):
//! over `shm` when the owner's shm file is on this host, else over `tcp`;
//! nothing is cached here. A page the owner's index does not show (or that
//! keeps moving) is faulted in on the owner with gRPC `FaultIn`, whose reply
//! carries the bytes and the frame's location, so the next read of it is one
//! round trip again. The caller (`Node::serve`) holds the map's read guard
//! and checks this node's own lease before and after, so a map is trusted
//! only while that lease holds (ARCHITECTURE.md, "Ownership, leases and
//! writes"). The connection and fault-in code is shared with the
//! standalone client ([`crate::client::owner`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::client::owner::{self, ConnectHow, Faulted, OwnerConn};
use crate::remote::{Outcome, ReaderStats};
use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::MapNode;

use super::DaemonError;
use super::ownership::PageSource;

/// Counters of the one-sided path, exported on `/metrics`.
#[derive(Default)]
pub(crate) struct SourceStats {
    pub(crate) pages: AtomicU64,
    pub(crate) one_sided: AtomicU64,
    pub(crate) fallbacks: AtomicU64,
    pub(crate) reconnects: AtomicU64,
}

/// The one-sided [`PageSource`].
pub(crate) struct OneSided {
    token: String,
    page_size: usize,
    owners: Mutex<HashMap<u32, OwnerConn>>,
    pub(crate) stats: SourceStats,
    /// Reader counters of connections since closed, so totals only grow.
    retired: Mutex<ReaderStats>,
    /// The last total [`OneSided::reader_stats`] computed.
    last_total: Mutex<ReaderStats>,
}

impl OneSided {
    pub(crate) fn new(token: String, page_size: usize) -> Self {
        Self {
            token,
            page_size,
            owners: Mutex::new(HashMap::new()),
            stats: SourceStats::default(),
            retired: Mutex::new(ReaderStats::default()),
            last_total: Mutex::new(ReaderStats::default()),
        }
    }

    /// The one-sided reader's counters, over every connection so far.
    ///
    /// Never waits for `owners`: a read holds it across a connect and a
    /// `FaultIn` (up to seconds, on the blocking pool), and this runs on the
    /// runtime's workers (heartbeats, `Stats`, `/metrics`), which that
    /// `FaultIn` needs to make progress; waiting here once deadlocked a node
    /// under load. While a read holds it, the last total is returned again
    /// (so totals still only grow).
    pub(crate) fn reader_stats(&self) -> ReaderStats {
        let mut last = self.last_total.lock().unwrap_or_else(|e| e.into_inner());
        let owners = match self.owners.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        if let Some(owners) = owners {
            let mut total = *self.retired.lock().unwrap_or_else(|e| e.into_inner());
            for o in owners.values() {
                total.add(&o.reader.stats());
            }
            *last = total;
        }
        *last
    }

    /// Drops the connection to `index`, keeping its counters.
    fn retire(&self, owners: &mut HashMap<u32, OwnerConn>, index: u32) {
        if let Some(old) = owners.remove(&index) {
            self.retired
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .add(&old.reader.stats());
        }
    }

    /// Fault `page` in on its owner over gRPC and take the bytes from the
    /// reply. Returns the bytes and the frame's location.
    fn fault_in(&self, owner: &MapNode, page: u64) -> Result<Faulted, String> {
        let handle = tokio::runtime::Handle::try_current().map_err(|e| e.to_string())?;
        let token = self.token.clone();
        let addr = owner.grpc_address.clone();
        handle.block_on(async move {
            let attach = AttachToken::new(&token).map_err(|e| e.to_string())?;
            let mut client = owner::node_client(&addr, &attach, Duration::from_secs(5)).await?;
            owner::fault_in(&mut client, page, 0)
                .await
                .map_err(|s| s.message().to_owned())
        })
    }
}

impl PageSource for OneSided {
    fn read(
        &self,
        owner: &MapNode,
        _epoch: u64,
        first: u64,
        count: u64,
    ) -> Result<(Vec<u8>, Vec<u64>), DaemonError> {
        let unavailable = |page, reason: String| DaemonError::OwnerUnavailable { page, reason };
        let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        let want_epoch = owner::region_epoch(owner);
        if owners
            .get(&owner.index)
            .is_some_and(|o| Some(o.epoch) != want_epoch)
        {
            // The owner restarted (the map names a new region epoch).
            self.retire(&mut owners, owner.index);
        }
        let o = match owners.entry(owner.index) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let o = owner::connect(owner, &ConnectHow::daemon(&self.token))
                    .map_err(|why| unavailable(first, why))?;
                self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                v.insert(o)
            }
        };
        let mut data = Vec::with_capacity(count as usize * self.page_size);
        let mut gens = Vec::with_capacity(count as usize);
        let mut buf = vec![0u8; self.page_size];
        let file_len = o.reader.file_len();
        for page in first..first.saturating_add(count) {
            let len = (file_len.saturating_sub(page * self.page_size as u64) as usize)
                .min(self.page_size);
            self.stats.pages.fetch_add(1, Ordering::Relaxed);
            match o.reader.read_page(page, &mut buf) {
                Ok(Outcome::Hit { generation, .. }) => {
                    self.stats.one_sided.fetch_add(1, Ordering::Relaxed);
                    data.extend_from_slice(&buf[..len]);
                    gens.push(generation);
                }
                Ok(Outcome::Absent | Outcome::GaveUp) => {
                    self.stats.fallbacks.fetch_add(1, Ordering::Relaxed);
                    let Faulted {
                        data: bytes,
                        location,
                    } = self
                        .fault_in(owner, page)
                        .map_err(|why| unavailable(page, why))?;
                    if bytes.len() != len {
                        return Err(unavailable(
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
                Err(e) => {
                    // Stale descriptor (owner restarted) or a lost connection:
                    // drop the reader; the caller retries with a fresh map.
                    let why = e.to_string();
                    self.retire(&mut owners, owner.index);
                    return Err(unavailable(page, why));
                }
            }
        }
        Ok((data, gens))
    }
}
