//! A client for a standalone process: reads and writes any page of the
//! cluster's file, following the ownership map and failing over by itself.
//!
//! * [`MapFollower`]: one thread per process polls the coordinator and says
//!   until when the map may be trusted (the *trust window*).
//! * [`ClusterClient`]: one per thread; routes each page to the node that
//!   answers it, reads it one-sidedly ([`crate::remote`], over `shm` or
//!   `tcp`) or with the two-sided `Read` RPC, writes through the owner's
//!   `Write` RPC, and retries through failover until a deadline.
//!
//! The node daemon reads other nodes' pages with the same connection code
//! (`cluster::owner`); it bounds its trust in its map by its own lease instead.
//!
//! # Freshness (ARCHITECTURE.md, "Ownership, leases and writes")
//!
//! **Guarantee.** A [`ClusterClient::read_page`] that starts after a write
//! of the page was acknowledged (to anyone) returns the written bytes or
//! newer ones, or an error; never older bytes. Assumptions: the cluster's
//! (any two clocks drift apart by less than `clock_drift_margin` over one
//! lease; monotonic clocks run while a process is frozen), this process
//! included, with a margin ([`FollowerConfig::clock_drift_margin`]) at
//! least the nodes'.
//!
//! **Trust window.** A map is trusted until `t_send + lease − margin`, where
//! `t_send` is when this process sent the request (`Status` or `GetMap`)
//! whose answer confirmed the map's epoch as the coordinator's current one
//! ([`trust_window`]; `cluster::follower` says why a `Status` epoch confirms a
//! map). No operation starts on a map past its window, and every one-sided
//! reader is given the window ([`crate::remote::RemoteReader::trust_until`]):
//! a read that starts or *ends* past it fails with `LeaseExpired` and
//! returns no bytes; the client then waits for a poll (blocking, bounded by
//! the deadline) and retries.
//!
//! **Why the bytes are fresh**, by where they came from:
//!
//! 1. *gRPC* (`Read`, or `FaultIn` with the bytes inline): the node answers
//!    only pages of extents it serves at the map it applied, only while its
//!    own lease holds, checked again right before it answers; the node's
//!    guarantee (no gRPC read answered with bytes older than a write
//!    acknowledged before it was sent) is this one.
//! 2. *One-sided from node X*, which the trusted map (epoch E, confirmed by a
//!    request sent at `t_s`; the coordinator had E current at some `t_c ≥
//!    t_s`) names as the answering node. Let W be a write acknowledged before
//!    the read started, by node Y.
//!    * Y = X: X invalidated the old frame before acknowledging, so a READ
//!      that starts after the acknowledgement sees the new frame or fails
//!      validation (ARCHITECTURE.md, "Remote hit"); an absent page goes to
//!      X's `FaultIn`, case 1.
//!    * Y acknowledged at an epoch where X did not answer the extent, before
//!      E: X's cache of the extent was filled after X gained it, when Y no
//!      longer acknowledged writes to it (the node-level argument: handoff,
//!      lease expiry, eviction of dropped extents).
//!    * Y gained the extent at an epoch G > E: G was published after `t_c ≥
//!      t_s`, and Y acknowledges no write to an extent it gained until one
//!      lease plus the margin after it applied G (the write fence). So W's
//!      acknowledgement came after `t_s + lease` in real time, and our
//!      window closed at `t_s + lease − margin` by our clock, earlier than
//!      `t_s + lease` as long as our clock drifts by less than the margin
//!      over a lease: the read started past the window and was refused.
//!      This is the case only the window covers: X may be frozen or cut
//!      off with its memory still readable (`shm`), and X's CPU, which would
//!      check X's lease, is not involved in a one-sided read.
//!
//! # Routing
//!
//! `extent = page * page_size / extent_size`. Reads go to
//! `previous_owner[extent]` while it is non-zero (a handoff: the previous
//! owner answers until it completes, the new one refuses the extent as
//! moving), else to `owner[extent]` ([`read_owner`]). Writes go to
//! `owner[extent]` ([`write_owner`]), which refuses them (UNAVAILABLE)
//! during a handoff and for a lease after it gained the extent; the client
//! retries. Index 0 means no owner: wait for a map. A one-sided connection
//! remembers the region epoch of the descriptor it was opened with; when
//! the map names another (the node restarted) it reconnects.
//!
//! # Fallback and failover
//!
//! One attempt's outcome decides the next step (until `op_deadline`, then
//! [`ClientError::Unavailable`] naming the last reason):
//!
//! | outcome | step |
//! |---|---|
//! | one-sided hit | done (`Via::OneSided`) |
//! | one-sided `Absent` / `GaveUp` | `FaultIn` (bytes inline) on the same node, `learn` the frame: done (`Via::FaultIn`) |
//! | `LeaseExpired`, map past its window | wait for a poll (bounded), retry |
//! | FAILED_PRECONDITION ("stale map", node behind) | wait for a poll (bounded), retry |
//! | UNAVAILABLE from the node (moving, writes fenced, its lease expired), RESOURCE_EXHAUSTED | ask for a poll, back off, retry |
//! | transport error, timeout, connection refused (killed, frozen, partitioned) | drop the connection, ask for a poll, back off, retry |
//! | any other gRPC error (bad argument, wrong token) | [`ClientError::Rejected`] at once |
//!
//! Backoff doubles from [`ClientConfig::backoff_min`] to
//! [`ClientConfig::backoff_max`] (1 ms to 100 ms), starts over with each
//! new map epoch, and ends early when a new map arrives (the failover's
//! map ends the stall at once). Every wait is bounded:
//! connects by [`ClientConfig::connect_timeout`] (a `tcp` handshake with a
//! frozen node included), each RPC and each one-sided `tcp` READ by
//! [`ClientConfig::rpc_timeout`], each clamped to the time left.
//!
//! **Stall after a failure.** A node killed or frozen is declared dead
//! `lease` after its last heartbeat; the client keeps asking for a poll
//! while it fails, so it learns the new map within a few milliseconds of
//! its publication. Reads stall about one lease; writes to the dead node's
//! extents one more lease plus the margin (the new owner's fence). With
//! every coordinator down, the window runs out after at most `lease −
//! margin`, and every operation then returns `Unavailable` after its
//! deadline until a poll succeeds again.
//!
//! gRPC from this synchronous API: each client has its own current-thread
//! tokio runtime and blocks on it, so none of these calls may be made from
//! inside an async runtime.

mod follower;
pub(crate) mod owner;

pub use follower::{FollowerConfig, MapFollower, trust_window};
pub use owner::{Transport, TransportChoice};

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::remote::{Outcome, ReaderConfig, ReaderStats, RemoteError};
use follower::Snapshot;
use owner::{ConnectHow, NodeRpc, OwnerConn};
use pagewire_proto::auth::{AttachToken, TokenError};
use pagewire_proto::v1::{MapNode, OwnershipMap, PageRun, ReadRequest, WriteRequest};
use pagewire_rdma::tcp::ConnectionConfig;

/// How a [`ClusterClient`] reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReadPath {
    /// One-sided READs of the owner's region, `FaultIn` on the owner when
    /// its index does not show the page.
    #[default]
    OneSided,
    /// The two-sided `Read` RPC on the owner (for comparison).
    Grpc,
}

/// Settings of a [`ClusterClient`].
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Which transport one-sided reads use.
    pub transport: TransportChoice,
    /// One-sided reads or the gRPC `Read`.
    pub path: ReadPath,
    /// How long one read/write keeps retrying through failover before it returns Unavailable (default 10 s).
    pub op_deadline: Duration,
    /// The one-sided readers' retries.
    pub reader: ReaderConfig,
    /// Connecting to a node (gRPC, or the `tcp` transport with its
    /// handshake) gives up after this long (default 500 ms).
    pub connect_timeout: Duration,
    /// One RPC to a node, or one one-sided `tcp` READ, gives up after this
    /// long (default 1 s): a frozen node must not hold an operation.
    pub rpc_timeout: Duration,
    /// First backoff between attempts (default 1 ms); doubles each time.
    pub backoff_min: Duration,
    /// Largest backoff (default 100 ms).
    pub backoff_max: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            transport: TransportChoice::Auto,
            path: ReadPath::OneSided,
            op_deadline: Duration::from_secs(10),
            reader: ReaderConfig::default(),
            connect_timeout: Duration::from_millis(500),
            rpc_timeout: Duration::from_secs(1),
            backoff_min: Duration::from_millis(1),
            backoff_max: Duration::from_millis(100),
        }
    }
}

/// How a read was answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// One-sided READs of the node's region.
    OneSided,
    /// The node's `FaultIn`, bytes inline (after a one-sided miss).
    FaultIn,
    /// The node's `Read` RPC.
    Grpc,
}

/// What one read took.
#[derive(Clone, Copy, Debug)]
pub struct ReadInfo {
    /// The path that returned the bytes.
    pub via: Via,
    /// The node index that answered.
    pub owner: u32,
    /// Attempts this read took (1: no retry).
    pub attempts: u32,
    /// The transport of the one-sided connection to the answering node
    /// (`None` for the gRPC `Read`): a `FaultIn` read names the transport
    /// whose miss sent it to the owner.
    pub transport: Option<Transport>,
}

/// Counters of one [`ClusterClient`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ClientStats {
    /// Reads that returned bytes (`one_sided + fault_ins + grpc_reads`).
    pub reads: u64,
    /// Reads answered by one-sided READs.
    pub one_sided: u64,
    /// Reads answered by `FaultIn` after a one-sided miss.
    pub fault_ins: u64,
    /// Reads answered by the gRPC `Read`.
    pub grpc_reads: u64,
    /// Of `one_sided`, those read over shm, verbs and tcp.
    pub one_sided_shm: u64,
    pub one_sided_verbs: u64,
    pub one_sided_tcp: u64,
    /// Writes acknowledged.
    pub writes: u64,
    /// attempts beyond the first (owner unreachable, stale map, moving extent, lease wait)
    pub retries: u64,
    /// Connections (one-sided or gRPC) opened to a node again after one to
    /// it was dropped (a failure, or a new region epoch).
    pub reconnects: u64,
    /// Polls this client asked the follower for.
    pub map_refreshes: u64,
    /// Operations that returned [`ClientError::Unavailable`].
    pub unavailable: u64,
    /// Attempts that found the map past its trust window (before starting,
    /// or a one-sided read's `LeaseExpired`) and waited for a poll.
    pub lease_waits: u64,
    /// the one-sided readers' totals (validation failures, torn buckets, ... as ReaderStats) over every connection so far
    pub reader: ReaderStats,
}

/// Why an operation of the client failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The coordinator could not be reached or answered an error at start.
    #[error("the coordinator at {address}: {reason}")]
    Coordinator { address: String, reason: String },
    /// The coordinator address list is empty, too long or not host:port.
    #[error("bad coordinator addresses: {0}")]
    Addresses(#[source] pagewire_proto::leader::AddressListError),
    /// The token cannot be sent (empty, or not printable ASCII).
    #[error("bad cluster token: {0}")]
    Token(#[source] TokenError),
    /// The runtime or the follower thread could not be started.
    #[error("cannot start the client's runtime or thread: {0}")]
    Runtime(#[source] std::io::Error),
    /// No node registered within `op_deadline`, so the file is unknown.
    #[error("the cluster names no file yet (no node registered within {waited:?})")]
    NoFile { waited: Duration },
    /// Retries through failover ran out of time; `last` says why the last
    /// attempt failed.
    #[error("page {page} unavailable after {waited:?}: {last}")]
    Unavailable {
        page: u64,
        waited: Duration,
        last: String,
    },
    /// The page is past the end of the file.
    #[error("page {page} is past the end of the file ({pages} pages)")]
    BeyondEnd { page: u64, pages: u64 },
    /// The read buffer is shorter than a page.
    #[error("buffer of {got} bytes for a page of {need}")]
    BufferSize { need: usize, got: usize },
    /// The write's length fits neither the page's valid length nor a whole
    /// page with zeros past it.
    #[error(
        "write of {got} bytes to page {page}, which holds {len} (or {page_size} with zeros past {len})"
    )]
    WriteLength {
        page: u64,
        got: usize,
        len: usize,
        page_size: usize,
    },
    /// A node refused the request for good (not a failover condition).
    #[error("node {node} refused page {page}: {code:?}: {message}")]
    Rejected {
        node: String,
        page: u64,
        code: tonic::Code,
        message: String,
    },
}

/// The extent of `page` under `map` (None: a map without a usable extent
/// size, or a page whose offset overflows).
fn extent_of(map: &OwnershipMap, page: u64) -> Option<usize> {
    if map.extent_size == 0 {
        return None;
    }
    let offset = page.checked_mul(u64::from(map.page_size))?;
    usize::try_from(offset / map.extent_size).ok()
}

/// The node index that answers reads of `page` under `map`: the previous
/// owner while the extent is handed off, else the owner (None: no owner).
pub fn read_owner(map: &OwnershipMap, page: u64) -> Option<u32> {
    let e = extent_of(map, page)?;
    match map.previous_owner.get(e).copied().unwrap_or(0) {
        0 => map.owner.get(e).copied().filter(|&o| o != 0),
        prev => Some(prev),
    }
}

/// The node index that acknowledges writes of `page` under `map` (it
/// refuses them while the extent is handed off; None: no owner).
pub fn write_owner(map: &OwnershipMap, page: u64) -> Option<u32> {
    map.owner
        .get(extent_of(map, page)?)
        .copied()
        .filter(|&o| o != 0)
}

/// What to do after an attempt that did not succeed.
enum Step {
    /// Wait for a poll (bounded), then retry.
    Refresh(String),
    /// The map is past its trust window: wait for a poll, then retry.
    LeaseExpired(String),
    /// Ask for a poll, back off, retry.
    Backoff(String),
    /// Give up now.
    Fatal(ClientError),
}

/// The node of `index` in `map`, or a reason to refresh.
fn node_of(map: &OwnershipMap, index: u32, page: u64) -> Result<&MapNode, Step> {
    map.nodes.iter().find(|n| n.index == index).ok_or_else(|| {
        Step::Refresh(format!(
            "the map (epoch {}) names node index {index} for page {page} but not the node",
            map.epoch
        ))
    })
}

/// The node that answers reads of `page` at `map` (its index and entry).
fn reader_of(map: &OwnershipMap, page: u64) -> Result<(u32, &MapNode), Step> {
    let index = read_owner(map, page).ok_or_else(|| {
        Step::Backoff(format!(
            "no node answers page {page} at epoch {}",
            map.epoch
        ))
    })?;
    Ok((index, node_of(map, index, page)?))
}

/// Reads and writes pages of the cluster's file. One per thread (Send, not necessarily Sync).
pub struct ClusterClient {
    follower: Arc<MapFollower>,
    cfg: ClientConfig,
    token: String,
    attach: AttachToken,
    rt: tokio::runtime::Runtime,
    snap: Snapshot,
    page_size: usize,
    file_size: u64,
    file_pages: u64,
    /// One-sided connections by node index.
    owners: HashMap<u32, OwnerConn>,
    /// gRPC clients by node address.
    channels: HashMap<String, NodeRpc>,
    /// Nodes and addresses connected to before (for `reconnects`).
    seen_owners: HashSet<u32>,
    seen_channels: HashSet<String>,
    /// Reader counters of connections since closed.
    retired: ReaderStats,
    stats: ClientStats,
}

const _: fn() = || {
    fn send<T: Send>() {}
    send::<ClusterClient>();
};

impl ClusterClient {
    /// A client over `follower`'s map, with the cluster token. Waits (up to
    /// `op_deadline`) for a map that names the file (a node registered).
    pub fn new(
        follower: Arc<MapFollower>,
        token: &str,
        cfg: ClientConfig,
    ) -> Result<Self, ClientError> {
        let attach = AttachToken::new(token).map_err(ClientError::Token)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(ClientError::Runtime)?;
        let start = Instant::now();
        let snap = loop {
            let snap = follower.shared.snapshot();
            let m = &snap.map;
            if m.page_size != 0 && m.file_size != 0 && m.extent_size != 0 {
                break snap;
            }
            let left = (start + cfg.op_deadline).saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ClientError::NoFile {
                    waited: start.elapsed(),
                });
            }
            follower.refresh(left);
            std::thread::sleep(Duration::from_millis(20).min(left));
        };
        let page_size = snap.map.page_size as usize;
        let file_size = snap.map.file_size;
        Ok(Self {
            follower,
            token: token.to_owned(),
            attach,
            rt,
            page_size,
            file_size,
            file_pages: file_size.div_ceil(page_size as u64),
            snap,
            cfg,
            owners: HashMap::new(),
            channels: HashMap::new(),
            seen_owners: HashSet::new(),
            seen_channels: HashSet::new(),
            retired: ReaderStats::default(),
            stats: ClientStats::default(),
        })
    }

    /// The cluster's page size in bytes.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages in the file (the last one may be partial).
    pub fn file_pages(&self) -> u64 {
        self.file_pages
    }

    /// Bytes in the file.
    pub fn file_size(&self) -> u64 {
        self.file_size
    }

    /// The valid length of `page` (`page_size`, less for a partial last page).
    pub fn page_len(&self, page: u64) -> usize {
        let start = page.saturating_mul(self.page_size as u64);
        (self.file_size.saturating_sub(start)).min(self.page_size as u64) as usize
    }

    /// The follower this client reads its map from.
    pub fn follower(&self) -> &Arc<MapFollower> {
        &self.follower
    }

    /// Reads `page` into `out` (page_size bytes; the valid length, zero past it).
    pub fn read_page(&mut self, page: u64, out: &mut [u8]) -> Result<ReadInfo, ClientError> {
        if page >= self.file_pages {
            return Err(ClientError::BeyondEnd {
                page,
                pages: self.file_pages,
            });
        }
        if out.len() < self.page_size {
            return Err(ClientError::BufferSize {
                need: self.page_size,
                got: out.len(),
            });
        }
        let out = &mut out[..self.page_size];
        let len = self.page_len(page);
        let path = self.cfg.path;
        let ((via, owner), attempts) = self.retrying(page, |c, snap, left| match path {
            ReadPath::OneSided => c.one_sided(snap, page, len, out, left),
            ReadPath::Grpc => c.grpc_read(snap, page, len, out, left),
        })?;
        self.stats.reads += 1;
        let transport = match via {
            Via::Grpc => None,
            _ => self.owners.get(&owner).map(|o| o.reader.transport()),
        };
        match via {
            Via::OneSided => {
                self.stats.one_sided += 1;
                match transport {
                    Some(Transport::Shm) => self.stats.one_sided_shm += 1,
                    Some(Transport::Verbs) => self.stats.one_sided_verbs += 1,
                    Some(Transport::Tcp) => self.stats.one_sided_tcp += 1,
                    None => {}
                }
            }
            Via::FaultIn => self.stats.fault_ins += 1,
            Via::Grpc => self.stats.grpc_reads += 1,
        }
        Ok(ReadInfo {
            via,
            owner,
            attempts,
            transport,
        })
    }

    /// Writes one page through the owner's gRPC `Write` (write-through:
    /// acknowledged once the backing file has it) and returns the new frame
    /// generation. `data` is the page's valid length (`page_size`, less for
    /// a partial last page), or `page_size` bytes with zeros past the valid
    /// length. A write whose answer was lost (timeout, dead connection) is
    /// sent again, so it may be applied twice: the same bytes, a later
    /// frame generation.
    pub fn write_page(&mut self, page: u64, data: &[u8]) -> Result<u64, ClientError> {
        if page >= self.file_pages {
            return Err(ClientError::BeyondEnd {
                page,
                pages: self.file_pages,
            });
        }
        let len = self.page_len(page);
        let fits = data.len() == len
            || (data.len() == self.page_size && data[len..].iter().all(|&b| b == 0));
        if !fits {
            return Err(ClientError::WriteLength {
                page,
                got: data.len(),
                len,
                page_size: self.page_size,
            });
        }
        let data = &data[..len];
        let (generation, _) = self.retrying(page, |c, snap, left| {
            let index = write_owner(&snap.map, page).ok_or_else(|| {
                Step::Backoff(format!(
                    "no node owns page {page} at epoch {}",
                    snap.map.epoch
                ))
            })?;
            let node = node_of(&snap.map, index, page)?;
            let epoch = snap.map.epoch;
            let r = c.rpc(node, page, left, |mut n| async move {
                n.write(WriteRequest {
                    page,
                    data: data.to_vec(),
                    map_epoch: epoch,
                })
                .await
                .map(tonic::Response::into_inner)
            })?;
            Ok(r.frame_generation)
        })?;
        self.stats.writes += 1;
        Ok(generation)
    }

    /// This client's counters.
    pub fn stats(&self) -> ClientStats {
        let mut reader = self.retired;
        for o in self.owners.values() {
            reader.add(&o.reader.stats());
        }
        ClientStats {
            reader,
            ..self.stats
        }
    }

    /// Takes the follower's newer `(map, trust window)`, if there is one.
    fn sync_map(&mut self) {
        if let Some(s) = self.follower.shared.snapshot_if_changed(self.snap.seq) {
            self.snap = s;
        }
    }

    /// Runs `attempt` until it succeeds, fails for good, or `op_deadline`
    /// passes (the module doc's table). Returns its value and the attempts.
    fn retrying<T>(
        &mut self,
        page: u64,
        mut attempt: impl FnMut(&mut Self, &Snapshot, Duration) -> Result<T, Step>,
    ) -> Result<(T, u32), ClientError> {
        let start = Instant::now();
        let deadline = start + self.cfg.op_deadline;
        let mut attempts = 0u32;
        let mut backoff = self.cfg.backoff_min;
        let mut epoch = self.snap.map.epoch;
        loop {
            attempts += 1;
            if attempts > 1 {
                self.stats.retries += 1;
            }
            self.sync_map();
            let now = Instant::now();
            let snap = self.snap.clone();
            let step = if snap.trusted(crate::clock::now()) {
                match attempt(self, &snap, deadline.saturating_duration_since(now)) {
                    Ok(v) => return Ok((v, attempts)),
                    Err(s) => s,
                }
            } else {
                Step::LeaseExpired(format!(
                    "the map (epoch {}) is past its trust window{}",
                    snap.map.epoch,
                    self.follower
                        .last_error()
                        .map(|e| format!(" and the coordinator does not answer ({e})"))
                        .unwrap_or_default()
                ))
            };
            let (why, refresh) = match step {
                Step::Fatal(e) => return Err(e),
                Step::LeaseExpired(why) => {
                    self.stats.lease_waits += 1;
                    (why, true)
                }
                Step::Refresh(why) => (why, true),
                Step::Backoff(why) => (why, false),
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.stats.unavailable += 1;
                return Err(ClientError::Unavailable {
                    page,
                    waited: start.elapsed(),
                    last: why,
                });
            }
            self.stats.map_refreshes += 1;
            if snap.map.epoch != epoch {
                // A new map: its owners get a fresh series of backoffs.
                epoch = snap.map.epoch;
                backoff = self.cfg.backoff_min;
            }
            let pause = if refresh {
                // A poll that started after this point; no sleep when it
                // brought a trusted, newer map.
                let trusted = self.follower.refresh(left);
                self.sync_map();
                let moved = self.snap.map.epoch != snap.map.epoch;
                if trusted && (moved || !snap.trusted(crate::clock::now())) {
                    Duration::ZERO
                } else {
                    backoff
                }
            } else {
                self.follower.refresh_soon();
                backoff
            };
            if !pause.is_zero() {
                let pause = pause.min(deadline.saturating_duration_since(Instant::now()));
                self.follower
                    .shared
                    .wait_epoch_change(self.snap.map.epoch, pause);
                backoff = (backoff * 2).min(self.cfg.backoff_max);
            }
        }
    }

    /// One one-sided attempt: READs of the answering node's region, its
    /// `FaultIn` when its index does not show the page.
    fn one_sided(
        &mut self,
        snap: &Snapshot,
        page: u64,
        len: usize,
        out: &mut [u8],
        left: Duration,
    ) -> Result<(Via, u32), Step> {
        let (index, node) = reader_of(&snap.map, page)?;
        let Some(trust) = snap.trust_until else {
            return Err(Step::LeaseExpired("the map has no trust window".into()));
        };
        if self
            .owners
            .get(&index)
            .is_some_and(|o| Some(o.epoch) != owner::region_epoch(node))
        {
            // The node restarted: the map names a new region epoch.
            self.retire(index);
        }
        if !self.owners.contains_key(&index) {
            let how = ConnectHow {
                token: &self.token,
                transport: self.cfg.transport,
                reader: self.cfg.reader.clone(),
                tcp: ConnectionConfig {
                    op_timeout: self.cfg.rpc_timeout,
                    connect_timeout: self.cfg.connect_timeout,
                    ..ConnectionConfig::new(Vec::new())
                },
            };
            let conn = owner::connect(node, &how).map_err(|why| {
                Step::Backoff(format!(
                    "cannot read node {} (index {index}) one-sidedly: {why}",
                    node.node_id
                ))
            })?;
            if !self.seen_owners.insert(index) {
                self.stats.reconnects += 1;
            }
            self.owners.insert(index, conn);
        }
        let o = self.owners.get_mut(&index).expect("inserted above");
        o.reader.trust_until(trust);
        match o.reader.read_page(page, out) {
            Ok(Outcome::Hit { .. }) => Ok((Via::OneSided, index)),
            Ok(Outcome::Absent | Outcome::GaveUp) => {
                let epoch = snap.map.epoch;
                let f = self.rpc(node, page, left, |mut n| async move {
                    owner::fault_in(&mut n, page, epoch).await
                })?;
                if f.data.len() != len {
                    return Err(Step::Backoff(format!(
                        "node {}'s FaultIn returned {} bytes of page {page}, not {len}",
                        node.node_id,
                        f.data.len()
                    )));
                }
                out[..len].copy_from_slice(&f.data);
                out[len..].fill(0);
                if let (Some(o), Some((frame, generation))) =
                    (self.owners.get_mut(&index), f.location)
                {
                    o.reader.learn(page, frame, generation);
                }
                Ok((Via::FaultIn, index))
            }
            Err(RemoteError::LeaseExpired(late)) => Err(Step::LeaseExpired(format!(
                "a one-sided read of page {page} from node {} ended {late:?} past the map's trust window",
                node.node_id
            ))),
            Err(e) => {
                // A stale descriptor (restarted node), a lost or timed out
                // connection: drop it; the next attempt reconnects.
                self.retire(index);
                Err(Step::Backoff(format!(
                    "one-sided read of page {page} from node {}: {}",
                    node.node_id,
                    owner::chain(&e)
                )))
            }
        }
    }

    /// One attempt over the answering node's `Read` RPC.
    fn grpc_read(
        &mut self,
        snap: &Snapshot,
        page: u64,
        len: usize,
        out: &mut [u8],
        left: Duration,
    ) -> Result<(Via, u32), Step> {
        let (index, node) = reader_of(&snap.map, page)?;
        let epoch = snap.map.epoch;
        let r = self.rpc(node, page, left, |mut n| async move {
            n.read(ReadRequest {
                run: Some(PageRun {
                    first_page: page,
                    page_count: 1,
                }),
                map_epoch: epoch,
            })
            .await
            .map(tonic::Response::into_inner)
        })?;
        if r.data.len() != len {
            return Err(Step::Backoff(format!(
                "node {}'s Read returned {} bytes of page {page}, not {len}",
                node.node_id,
                r.data.len()
            )));
        }
        out[..len].copy_from_slice(&r.data);
        out[len..].fill(0);
        Ok((Via::Grpc, index))
    }

    /// Drops the one-sided connection to `index`, keeping its counters.
    fn retire(&mut self, index: u32) {
        if let Some(o) = self.owners.remove(&index) {
            self.retired.add(&o.reader.stats());
        }
    }

    /// One RPC to `node`, within `rpc_timeout` (and `left`); classifies a
    /// failure as the module doc's table says.
    fn rpc<T, F, Fut>(
        &mut self,
        node: &MapNode,
        page: u64,
        left: Duration,
        call: F,
    ) -> Result<T, Step>
    where
        F: FnOnce(NodeRpc) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        let limit = self.cfg.rpc_timeout.min(left).max(Duration::from_millis(1));
        let addr = &node.grpc_address;
        let client = match self.channels.get(addr) {
            Some(c) => c.clone(),
            None => {
                let connect = self.cfg.connect_timeout.min(limit);
                let c = self
                    .rt
                    .block_on(owner::node_client(addr, &self.attach, connect))
                    .map_err(|why| {
                        Step::Backoff(format!(
                            "cannot connect to node {} at {addr}: {why}",
                            node.node_id
                        ))
                    })?;
                if !self.seen_channels.insert(addr.clone()) {
                    self.stats.reconnects += 1;
                }
                self.channels.insert(addr.clone(), c.clone());
                c
            }
        };
        // The timer is made inside the runtime (it needs its time driver).
        let fut = call(client);
        match self
            .rt
            .block_on(async move { tokio::time::timeout(limit, fut).await })
        {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(s)) => {
                use tonic::Code;
                let why = format!("node {}: {:?}: {}", node.node_id, s.code(), s.message());
                match s.code() {
                    Code::FailedPrecondition => Err(Step::Refresh(why)),
                    // The node's own refusals (moving, fenced, lease expired,
                    // no frame): the connection is fine.
                    Code::Unavailable | Code::ResourceExhausted | Code::Aborted
                        if std::error::Error::source(&s).is_none() =>
                    {
                        Err(Step::Backoff(why))
                    }
                    Code::Unavailable
                    | Code::ResourceExhausted
                    | Code::Aborted
                    | Code::DeadlineExceeded
                    | Code::Cancelled
                    | Code::Unknown
                    | Code::Internal => {
                        self.channels.remove(addr);
                        Err(Step::Backoff(why))
                    }
                    code => Err(Step::Fatal(ClientError::Rejected {
                        node: node.node_id.clone(),
                        page,
                        code,
                        message: s.message().to_owned(),
                    })),
                }
            }
            Err(_) => {
                self.channels.remove(addr);
                Err(Step::Backoff(format!(
                    "node {} did not answer within {limit:?}",
                    node.node_id
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{read_owner, write_owner};
    use pagewire_proto::v1::OwnershipMap;

    /// Four extents of 4 pages of 4 KiB.
    fn map(owner: &[u32], prev: &[u32]) -> OwnershipMap {
        OwnershipMap {
            epoch: 7,
            file_size: 16 * 4096,
            extent_size: 4 * 4096,
            page_size: 4096,
            owner: owner.to_vec(),
            previous_owner: prev.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn reads_go_to_the_previous_owner_during_a_handoff_and_writes_to_the_owner() {
        let m = map(&[1, 2, 3, 0], &[]);
        // extent = page * page_size / extent_size: pages 0..4 → 0, 4..8 → 1.
        assert_eq!(read_owner(&m, 0), Some(1));
        assert_eq!(read_owner(&m, 3), Some(1));
        assert_eq!(read_owner(&m, 4), Some(2));
        assert_eq!(read_owner(&m, 11), Some(3));
        assert_eq!(read_owner(&m, 12), None, "index 0: no owner");
        assert_eq!(read_owner(&m, 16), None, "past the map");
        assert_eq!(read_owner(&m, u64::MAX), None, "an offset that overflows");
        assert_eq!(write_owner(&m, 5), Some(2));
        assert_eq!(write_owner(&m, 13), None);
        // Extent 1 moves from 2 to 3 (handoff): reads stay with 2, writes
        // go to 3 (which refuses them until the handoff completes).
        let h = map(&[1, 3, 3, 0], &[0, 2, 0, 0]);
        assert_eq!(read_owner(&h, 4), Some(2));
        assert_eq!(write_owner(&h, 4), Some(3));
        assert_eq!(read_owner(&h, 8), Some(3), "no handoff for extent 2");
        assert_eq!(read_owner(&h, 0), Some(1));
        // A handoff to nobody yet (owner 0, previous owner set): reads still
        // go to the previous owner.
        let g = map(&[0, 0, 0, 0], &[4, 0, 0, 0]);
        assert_eq!(read_owner(&g, 1), Some(4));
        assert_eq!(write_owner(&g, 1), None);
        // A map without an extent size routes nothing.
        let mut z = map(&[1, 1, 1, 1], &[]);
        z.extent_size = 0;
        assert_eq!(read_owner(&z, 0), None);
    }
}
