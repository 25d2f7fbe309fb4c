//! Pages of extents another node owns, read from that node one-sidedly.
//!
//! A node asked (gRPC `Read`) for a page it does not serve reads it from the
//! owner's region with the one-sided reader ([`crate::remote`]):
//! over `shm` when the owner's shm file is on this host, else over `tcp`;
//! nothing is cached here. A page the owner's index does not show (or that
//! keeps moving) is faulted in on the owner with gRPC `FaultIn`, whose reply
//! carries the bytes and the frame's location, so the next read of it is one
//! round trip again. The caller (`Node::read_pages`) takes the owner from
//! the applied map, lets go of the map's lock before reading here, and
//! checks this node's own lease before and after, so a map is trusted only
//! while that lease holds (ARCHITECTURE.md, "Ownership, leases and
//! writes"). No lock is held across network I/O, and a `FaultIn` has a
//! deadline: an owner that froze holds up the read waiting on it, nothing
//! else. The connection and fault-in code is shared with the
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

/// How long a `FaultIn` on an owner may take, connecting included: past it
/// the read fails as the owner unavailable (the caller retries), instead of
/// waiting on a frozen owner for as long as TCP does.
const FAULT_IN_DEADLINE: Duration = Duration::from_secs(2);

/// The one-sided [`PageSource`].
///
/// No lock is held across network I/O: a read takes an idle connection to
/// the owner out of the pool (or connects a new one, with no lock held),
/// reads, and puts it back. Reads of one owner from several threads each
/// get their own connection; a connection to a frozen owner holds up only
/// the read using it.
pub(crate) struct OneSided {
    token: String,
    page_size: usize,
    /// Idle connections, by owner index.
    idle: Mutex<HashMap<u32, Vec<OwnerConn>>>,
    pub(crate) stats: SourceStats,
    /// Reader counters of connections since closed, so totals only grow.
    retired: Mutex<ReaderStats>,
    /// The largest total [`OneSided::reader_stats`] computed (connections in
    /// use are not in the pool, so a new sum can come out lower).
    last_total: Mutex<ReaderStats>,
}

impl OneSided {
    pub(crate) fn new(token: String, page_size: usize) -> Self {
        Self {
            token,
            page_size,
            idle: Mutex::new(HashMap::new()),
            stats: SourceStats::default(),
            retired: Mutex::new(ReaderStats::default()),
            last_total: Mutex::new(ReaderStats::default()),
        }
    }

    /// The one-sided reader's counters, over every connection so far
    /// (connections in use count from when they are back in the pool).
    pub(crate) fn reader_stats(&self) -> ReaderStats {
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
    fn take(&self, owner: &MapNode) -> Result<OwnerConn, String> {
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
        let c = owner::connect(owner, &ConnectHow::daemon(&self.token))?;
        self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
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

    /// Fault `page` in on its owner over gRPC and take the bytes from the
    /// reply, within [`FAULT_IN_DEADLINE`]. Returns the bytes and the
    /// frame's location.
    fn fault_in(&self, owner: &MapNode, page: u64) -> Result<Faulted, String> {
        let handle = tokio::runtime::Handle::try_current().map_err(|e| e.to_string())?;
        let token = self.token.clone();
        let addr = owner.grpc_address.clone();
        handle.block_on(async move {
            let call = async {
                let attach = AttachToken::new(&token).map_err(|e| e.to_string())?;
                let mut client = owner::node_client(&addr, &attach, FAULT_IN_DEADLINE).await?;
                owner::fault_in(&mut client, page, 0)
                    .await
                    .map_err(|s| s.message().to_owned())
            };
            tokio::time::timeout(FAULT_IN_DEADLINE, call)
                .await
                .map_err(|_| {
                    format!(
                        "the owner at {addr} did not answer FaultIn within {} ms",
                        FAULT_IN_DEADLINE.as_millis()
                    )
                })?
        })
    }

    /// Reads `first..first + count` over `o`; `Err` closes `o`.
    fn read_with(
        &self,
        o: &mut OwnerConn,
        owner: &MapNode,
        first: u64,
        count: u64,
    ) -> Result<(Vec<u8>, Vec<u64>), ReadFailure> {
        let n = usize::try_from(count).unwrap_or(0);
        let mut data = Vec::with_capacity(n.saturating_mul(self.page_size));
        let mut gens = Vec::with_capacity(n);
        let mut buf = vec![0u8; self.page_size];
        let file_len = o.reader.file_len();
        for page in first..first.saturating_add(count) {
            let len = (file_len.saturating_sub(page.saturating_mul(self.page_size as u64))
                as usize)
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
                        .map_err(|why| ReadFailure::Keep(page, why))?;
                    if bytes.len() != len {
                        return Err(ReadFailure::Keep(
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
                Err(e) => return Err(ReadFailure::Close(page, e.to_string())),
            }
        }
        Ok((data, gens))
    }
}

/// Why [`OneSided::read_with`] stopped, and whether its connection is
/// still good.
enum ReadFailure {
    /// The one-sided connection works (the `FaultIn` failed): keep it.
    Keep(u64, String),
    /// The connection failed: close it.
    Close(u64, String),
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
        let mut o = self.take(owner).map_err(|why| unavailable(first, why))?;
        match self.read_with(&mut o, owner, first, count) {
            Ok(out) => {
                self.put_back(owner.index, o);
                Ok(out)
            }
            Err(ReadFailure::Keep(page, why)) => {
                self.put_back(owner.index, o);
                Err(unavailable(page, why))
            }
            Err(ReadFailure::Close(page, why)) => {
                self.retire(o);
                Err(unavailable(page, why))
            }
        }
    }
}
