//! A client for a standalone process: reads and writes any page of the
//! cluster's file, following the ownership map and failing over by itself.
//!
//! * [`MapFollower`]: one thread per process polls the coordinator and says
//!   until when the map may be trusted (the *trust window*).
//! * [`ClusterClient`]: one per process, shared by every thread (`Send +
//!   Sync`, `&self`); routes each page to the node that answers it, reads
//!   it one-sidedly ([`crate::one_sided`] through the [`crate::OwnerPool`],
//!   over `shm`, `verbs` or `tcp`) or with the two-sided `Read` RPC, writes
//!   through the owner's `Write` RPC, and retries through failover until a
//!   deadline.
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
//! reader is given the window ([`crate::one_sided::RemoteReader::trust_until`]):
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
//! # One client per process
//!
//! Every thread of a process reads through one [`ClusterClient`]:
//!
//! * **Connections.** One gRPC channel per node, multiplexed; one `verbs`
//!   queue pair per owner (readers are handles on it); `tcp` one connection
//!   per reader thread, or one per owner with [`ClientConfig::tcp_shared`];
//!   `shm` readers each map the owner's file (no state on the owner). See
//!   [`crate::pool`].
//! * **Hit path.** Each thread reads through its own reader (its own index
//!   cache), taken from per-thread slots, with its own copy of the
//!   `(map, trust window)` pair, refreshed when the follower's sequence
//!   number moves, and its own counters: two threads reading at once write
//!   no common cache line (`crate::slot`). [`ClusterClient::stats`] sums
//!   the slots.
//! * **Runs.** [`ClusterClient::read_run`] reads the pages one node answers
//!   in batches (up to [`crate::pool::RUN_CHUNK`] pages) under one doorbell each, the
//!   misses among them in one `FaultIn` per stretch, each node's part with
//!   its own retries; a run over several nodes goes node by node.
//! * **Single flight.** Concurrent reads of the same run share one read,
//!   one that started after each of them was asked for (`cluster::flight`
//!   says why that keeps the freshness guarantee above).
//!
//! gRPC from this synchronous API: the client has a tokio runtime with one
//! worker thread for its connections, and callers' threads block on it, so
//! none of these calls may be made from inside an async runtime (use
//! `spawn_blocking`).

mod flight;
mod follower;
pub(crate) mod owner;

pub use follower::{FollowerConfig, MapFollower, trust_window};
pub use owner::{Transport, TransportChoice};

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::latency::{LatencyHistogram, PathLatency, ReadPathLabel};
use crate::one_sided::{ReaderConfig, ReaderStats};
use crate::pool::{OwnerPool, PoolConfig, PoolError, RunOptions};
use crate::slot::Padded;
use flight::{Answer, Flights, Role};
use follower::Snapshot;
use owner::NodeRpc;
use pagewire_proto::auth::{AttachToken, TokenError};
use pagewire_proto::net::ClientTls;
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
    /// TLS for the gRPC channels to nodes (`Read`, `Write`, `FaultIn`): the
    /// CA that signs the nodes' certificates and the name they carry. None:
    /// plain text. (The coordinator's is [`FollowerConfig::tls`].)
    pub tls: Option<ClientTls>,
    /// One `tcp` connection per owner for the whole process
    /// ([`crate::PoolConfig::tcp_shared`]; default `false`).
    pub tcp_shared: bool,
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
            tls: None,
            tcp_shared: false,
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

/// What one page of a read took.
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
    /// The frame generation of the copy read (0: the node served the page
    /// without caching it). Compare only for equality, for one owner.
    pub generation: u64,
    /// Another thread's read of the same run answered this one (a read
    /// that started after this one was asked for).
    pub coalesced: bool,
}

/// What a [`ClusterClient::read_run`] took: one entry per page.
#[derive(Clone, Debug)]
pub struct RunInfo {
    pub pages: Vec<ReadInfo>,
}

/// Counters of one [`ClusterClient`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ClientStats {
    /// Pages read (`one_sided + fault_ins + grpc_reads + coalesced`).
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
    /// Pages answered by another thread's read of the same run (single
    /// flight); counted in `reads`, not in `one_sided`/`fault_ins`/`grpc_reads`.
    pub coalesced: u64,
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

impl Step {
    /// What to do about a node's own refusal (`code`, from
    /// [`owner::refusal`]) of a call for `page`: `FailedPrecondition` (not
    /// the owner, map moved on) refreshes the map; `Unavailable`,
    /// `ResourceExhausted` and `Aborted` (fenced, moving, no frame, lease
    /// expired) back off and retry; anything else (a bad token, a page past
    /// the end) is final.
    fn of_refusal(code: tonic::Code, why: String, node: &str, page: u64, message: &str) -> Self {
        use tonic::Code;
        match code {
            Code::FailedPrecondition => Step::Refresh(why),
            Code::Unavailable | Code::ResourceExhausted | Code::Aborted => Step::Backoff(why),
            code => Step::Fatal(ClientError::Rejected {
                node: node.to_owned(),
                page,
                code,
                message: message.to_owned(),
            }),
        }
    }
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

/// Per-thread-slot counters of a [`ClusterClient`].
#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    one_sided: AtomicU64,
    fault_ins: AtomicU64,
    grpc_reads: AtomicU64,
    one_sided_shm: AtomicU64,
    one_sided_verbs: AtomicU64,
    one_sided_tcp: AtomicU64,
    writes: AtomicU64,
    retries: AtomicU64,
    map_refreshes: AtomicU64,
    unavailable: AtomicU64,
    lease_waits: AtomicU64,
    coalesced: AtomicU64,
    latency: PathLatency,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Reads and writes pages of the cluster's file: one per process, shared
/// by every thread (`Send + Sync`, every call takes `&self`).
pub struct ClusterClient {
    follower: Arc<MapFollower>,
    cfg: ClientConfig,
    attach: AttachToken,
    /// Runs the gRPC calls; callers' threads block on it.
    rt: tokio::runtime::Runtime,
    /// One-sided readers of owners, and `FaultIn`.
    pool: OwnerPool,
    page_size: usize,
    file_size: u64,
    file_pages: u64,
    /// gRPC clients (`Read`, `Write`) by node address.
    channels: Mutex<HashMap<String, NodeRpc>>,
    /// Addresses connected to before (for `reconnects`).
    seen_channels: Mutex<HashSet<String>>,
    channel_reconnects: AtomicU64,
    slots: Box<[Padded<Counters>]>,
    flights: Flights,
    /// This client, for the threads' cached snapshots (`THREAD_SNAPS`).
    id: u64,
    alive: Arc<()>,
}

const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<ClusterClient>();
};

thread_local! {
    /// Each thread's copy of each client's `(map, trust window)`: taken
    /// again only when the follower's sequence number moves, so threads
    /// reading at once share no reference count on the hit path. Entries
    /// of dropped clients go the next time the thread adds one.
    static THREAD_SNAPS: RefCell<Vec<(u64, Weak<()>, Snapshot)>> = const { RefCell::new(Vec::new()) };
}

/// The most pages one attempt reads from one node (a gRPC `Read` or a
/// run of one-sided batches); nodes take up to 1024 per call by default.
const MAX_ATTEMPT_PAGES: usize = 256;

impl ClusterClient {
    /// A client over `follower`'s map, with the cluster token. Waits (up to
    /// `op_deadline`) for a map that names the file (a node registered).
    pub fn new(
        follower: Arc<MapFollower>,
        token: &str,
        cfg: ClientConfig,
    ) -> Result<Self, ClientError> {
        static IDS: AtomicU64 = AtomicU64::new(1);
        let attach = AttachToken::new(token).map_err(ClientError::Token)?;
        // One worker drives the connections' I/O; callers' threads run
        // their own futures in `block_on`, several at once.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("pagewire-client")
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
        let pool = OwnerPool::new(
            token,
            page_size,
            PoolConfig {
                transport: cfg.transport,
                reader: cfg.reader.clone(),
                tcp: ConnectionConfig {
                    op_timeout: cfg.rpc_timeout,
                    connect_timeout: cfg.connect_timeout,
                    ..ConnectionConfig::new(Vec::new())
                },
                fault_in_deadline: cfg.rpc_timeout,
                tls: cfg.tls.clone(),
                tcp_shared: cfg.tcp_shared,
            },
            rt.handle().clone(),
        )
        .map_err(ClientError::Token)?;
        Ok(Self {
            follower,
            attach,
            rt,
            pool,
            page_size,
            file_size,
            file_pages: file_size.div_ceil(page_size as u64),
            cfg,
            channels: Mutex::new(HashMap::new()),
            seen_channels: Mutex::new(HashSet::new()),
            channel_reconnects: AtomicU64::new(0),
            slots: crate::slot::slots(),
            flights: Flights::new(),
            id: IDS.fetch_add(1, Ordering::Relaxed),
            alive: Arc::new(()),
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

    fn counters(&self) -> &Counters {
        &self.slots[crate::slot::thread_slot()]
    }

    /// Reads `page` into `out` (page_size bytes; the valid length, zero past it).
    pub fn read_page(&self, page: u64, out: &mut [u8]) -> Result<ReadInfo, ClientError> {
        if out.len() < self.page_size {
            return Err(ClientError::BufferSize {
                need: self.page_size,
                got: out.len(),
            });
        }
        let mut info = self.read_run(page, 1, &mut out[..self.page_size])?;
        Ok(info.pages.pop().expect("one page"))
    }

    /// Reads pages `first..first + count` into `out` (at least `count *
    /// page_size` bytes: each page's valid length, zeros to the page's
    /// end), batched: the pages of one node go in one-sided batches (as
    /// many as the connection's queue holds, at most
    /// [`crate::pool::RUN_CHUNK`]) under one doorbell each, the misses among
    /// them in one `FaultIn` per stretch, or in one gRPC `Read`. Pages of
    /// different nodes are read node by node, each with its own retries.
    /// Concurrent reads of the same run in this process share one read
    /// (`ReadInfo::coalesced`), one that started after each of them did.
    pub fn read_run(
        &self,
        first: u64,
        count: usize,
        out: &mut [u8],
    ) -> Result<RunInfo, ClientError> {
        let end = first.saturating_add(count as u64);
        if end > self.file_pages || first >= self.file_pages && count > 0 {
            return Err(ClientError::BeyondEnd {
                page: end.max(first + 1) - 1,
                pages: self.file_pages,
            });
        }
        let need = count.saturating_mul(self.page_size);
        if out.len() < need {
            return Err(ClientError::BufferSize {
                need,
                got: out.len(),
            });
        }
        let out = &mut out[..need];
        if count == 0 {
            return Ok(RunInfo { pages: Vec::new() });
        }
        let t0 = Instant::now();
        let deadline = t0 + self.cfg.op_deadline;
        let lead = match self.flights.begin((first, count), deadline) {
            Role::Follow(a) => {
                out.copy_from_slice(&a.bytes);
                let c = self.counters();
                bump(&c.reads, count as u64);
                bump(&c.coalesced, count as u64);
                c.latency.observe(ReadPathLabel::Coalesced, t0.elapsed());
                let pages = a
                    .infos
                    .iter()
                    .map(|i| ReadInfo {
                        coalesced: true,
                        ..*i
                    })
                    .collect();
                return Ok(RunInfo { pages });
            }
            Role::Lead(l) => Some(l),
            Role::Alone => None,
        };
        let r = self.read_span(first, count, out, deadline);
        if let Some(l) = lead {
            let answer = match &r {
                Ok(info) if l.has_followers() => Some(Answer {
                    bytes: out.to_vec(),
                    infos: info.pages.clone(),
                }),
                _ => None,
            };
            l.finish(answer);
        }
        if let Ok(info) = &r {
            let via = |v| info.pages.iter().any(|p| p.via == v);
            let path = if via(Via::Grpc) {
                ReadPathLabel::Grpc
            } else if via(Via::FaultIn) {
                ReadPathLabel::Fallback
            } else {
                ReadPathLabel::OneSided
            };
            self.counters().latency.observe(path, t0.elapsed());
        }
        r
    }

    /// [`ClusterClient::read_run`] after its checks, not shared.
    fn read_span(
        &self,
        first: u64,
        count: usize,
        out: &mut [u8],
        deadline: Instant,
    ) -> Result<RunInfo, ClientError> {
        let ps = self.page_size;
        let path = self.cfg.path;
        let mut pages = Vec::with_capacity(count);
        let mut done = 0usize;
        while done < count {
            let at = first + done as u64;
            let rest = &mut out[done * ps..];
            let want = count - done;
            let ((n, infos), attempts) = self.retrying(at, deadline, |snap, left| match path {
                ReadPath::OneSided => self.one_sided(snap, at, want, rest, left),
                ReadPath::Grpc => self.grpc_read(snap, at, want, rest, left),
            })?;
            pages.extend(infos.into_iter().map(|i| ReadInfo { attempts, ..i }));
            done += n;
        }
        let c = self.counters();
        bump(&c.reads, count as u64);
        for p in &pages {
            match (p.via, p.transport) {
                (Via::OneSided, Some(Transport::Shm)) => bump(&c.one_sided_shm, 1),
                (Via::OneSided, Some(Transport::Verbs)) => bump(&c.one_sided_verbs, 1),
                (Via::OneSided, Some(Transport::Tcp)) => bump(&c.one_sided_tcp, 1),
                _ => {}
            }
            match p.via {
                Via::OneSided => bump(&c.one_sided, 1),
                Via::FaultIn => bump(&c.fault_ins, 1),
                Via::Grpc => bump(&c.grpc_reads, 1),
            }
        }
        Ok(RunInfo { pages })
    }

    /// Writes one page through the owner's gRPC `Write` (write-through:
    /// acknowledged once the backing file has it) and returns the new frame
    /// generation. `data` is the page's valid length (`page_size`, less for
    /// a partial last page), or `page_size` bytes with zeros past the valid
    /// length. A write whose answer was lost (timeout, dead connection) is
    /// sent again, so it may be applied twice: the same bytes, a later
    /// frame generation.
    pub fn write_page(&self, page: u64, data: &[u8]) -> Result<u64, ClientError> {
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
        let deadline = Instant::now() + self.cfg.op_deadline;
        let (generation, _) = self.retrying(page, deadline, |snap, left| {
            let index = write_owner(&snap.map, page).ok_or_else(|| {
                Step::Backoff(format!(
                    "no node owns page {page} at epoch {}",
                    snap.map.epoch
                ))
            })?;
            let node = node_of(&snap.map, index, page)?;
            let epoch = snap.map.epoch;
            let r = self.rpc(node, page, left, |mut n| async move {
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
        bump(&self.counters().writes, 1);
        Ok(generation)
    }

    /// How long this client's answered `read_page`/`read_run` calls took
    /// (from the call to its answer, retries included), one histogram per
    /// path, over every thread, in [`ReadPathLabel::ALL`]'s order. Failed
    /// reads are in [`ClientStats::unavailable`], not here.
    pub fn read_latency(&self) -> Vec<(ReadPathLabel, LatencyHistogram)> {
        crate::latency::sum(self.slots.iter().map(|c| &c.latency))
    }

    /// This client's counters, over every thread.
    pub fn stats(&self) -> ClientStats {
        let mut s = ClientStats::default();
        for c in self.slots.iter() {
            let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
            s.reads += get(&c.reads);
            s.one_sided += get(&c.one_sided);
            s.fault_ins += get(&c.fault_ins);
            s.grpc_reads += get(&c.grpc_reads);
            s.one_sided_shm += get(&c.one_sided_shm);
            s.one_sided_verbs += get(&c.one_sided_verbs);
            s.one_sided_tcp += get(&c.one_sided_tcp);
            s.writes += get(&c.writes);
            s.retries += get(&c.retries);
            s.map_refreshes += get(&c.map_refreshes);
            s.unavailable += get(&c.unavailable);
            s.lease_waits += get(&c.lease_waits);
            s.coalesced += get(&c.coalesced);
        }
        s.reconnects =
            self.pool.stats().reconnects + self.channel_reconnects.load(Ordering::Relaxed);
        s.reader = self.pool.reader_stats();
        s
    }

    /// Runs `f` on this thread's copy of the follower's `(map, trust
    /// window)`, taken again first if the follower has a newer one.
    fn with_snapshot<R>(&self, f: impl FnOnce(&Snapshot) -> R) -> R {
        THREAD_SNAPS.with_borrow_mut(|v| {
            let i = match v.iter().position(|(id, _, _)| *id == self.id) {
                Some(i) => {
                    if let Some(s) = self.follower.shared.snapshot_if_changed(v[i].2.seq) {
                        v[i].2 = s;
                    }
                    i
                }
                None => {
                    v.retain(|(_, alive, _)| alive.strong_count() > 0);
                    v.push((
                        self.id,
                        Arc::downgrade(&self.alive),
                        self.follower.shared.snapshot(),
                    ));
                    v.len() - 1
                }
            };
            f(&v[i].2)
        })
    }

    /// Runs `attempt` until it succeeds, fails for good, or `deadline`
    /// passes (the module doc's table). Returns its value and the attempts.
    fn retrying<T>(
        &self,
        page: u64,
        deadline: Instant,
        mut attempt: impl FnMut(&Snapshot, Duration) -> Result<T, Step>,
    ) -> Result<(T, u32), ClientError> {
        let start = Instant::now();
        let c = self.counters();
        let mut attempts = 0u32;
        let mut backoff = self.cfg.backoff_min;
        let mut epoch = None;
        loop {
            attempts += 1;
            if attempts > 1 {
                bump(&c.retries, 1);
            }
            let (step, snap_epoch, was_trusted) = self.with_snapshot(|snap| {
                let now = Instant::now();
                let trusted = snap.trusted(crate::clock::now());
                let step = if trusted {
                    attempt(snap, deadline.saturating_duration_since(now))
                } else {
                    Err(Step::LeaseExpired(format!(
                        "the map (epoch {}) is past its trust window{}",
                        snap.map.epoch,
                        self.follower
                            .last_error()
                            .map(|e| format!(" and the coordinator does not answer ({e})"))
                            .unwrap_or_default()
                    )))
                };
                (step, snap.map.epoch, snap.trust_until)
            });
            let step = match step {
                Ok(v) => return Ok((v, attempts)),
                Err(s) => s,
            };
            let (why, refresh) = match step {
                Step::Fatal(e) => return Err(e),
                Step::LeaseExpired(why) => {
                    bump(&c.lease_waits, 1);
                    (why, true)
                }
                Step::Refresh(why) => (why, true),
                Step::Backoff(why) => (why, false),
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bump(&c.unavailable, 1);
                return Err(ClientError::Unavailable {
                    page,
                    waited: start.elapsed(),
                    last: why,
                });
            }
            bump(&c.map_refreshes, 1);
            if epoch != Some(snap_epoch) {
                // A new map: its owners get a fresh series of backoffs.
                epoch = Some(snap_epoch);
                backoff = self.cfg.backoff_min;
            }
            let pause = if refresh {
                // A poll that started after this point; no sleep when it
                // brought a trusted, newer map.
                let trusted = self.follower.refresh(left);
                let now_epoch = self.follower.shared.snapshot().map.epoch;
                let still = was_trusted.is_some_and(|t| crate::clock::now() < t);
                if trusted && (now_epoch != snap_epoch || !still) {
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
                self.follower.shared.wait_epoch_change(snap_epoch, pause);
                backoff = (backoff * 2).min(self.cfg.backoff_max);
            }
        }
    }

    /// One one-sided attempt: READs of the answering node's region for the
    /// pages from `first` (up to `want`) that node answers, its `FaultIn`
    /// for those its index does not show. Returns how many pages it read.
    fn one_sided(
        &self,
        snap: &Snapshot,
        first: u64,
        want: usize,
        out: &mut [u8],
        left: Duration,
    ) -> Result<(usize, Vec<ReadInfo>), Step> {
        let (index, node) = reader_of(&snap.map, first)?;
        let n = same_reader(&snap.map, first, want, index);
        let Some(trust) = snap.trust_until else {
            return Err(Step::LeaseExpired("the map has no trust window".into()));
        };
        let opts = RunOptions {
            trust_until: Some(trust),
            map_epoch: snap.map.epoch,
            deadline: Some(Instant::now() + left),
        };
        let ps = self.page_size;
        match self
            .pool
            .read_into(node, first, n, &mut out[..n * ps], &opts)
        {
            Ok(pages) => Ok((
                n,
                pages
                    .iter()
                    .map(|p| ReadInfo {
                        via: if p.fault_in {
                            Via::FaultIn
                        } else {
                            Via::OneSided
                        },
                        owner: index,
                        attempts: 1,
                        transport: Some(p.transport),
                        generation: p.generation,
                        coalesced: false,
                    })
                    .collect(),
            )),
            Err(e) => Err(match e {
                PoolError::LeaseExpired { .. } => Step::LeaseExpired(e.to_string()),
                PoolError::FaultIn {
                    refused: Some(code),
                    ref node,
                    page,
                    ref reason,
                } => Step::of_refusal(code, e.to_string(), node, page, reason),
                e => Step::Backoff(e.to_string()),
            }),
        }
    }

    /// One attempt over the answering node's `Read` RPC, for the pages from
    /// `first` (up to `want`) that node answers.
    fn grpc_read(
        &self,
        snap: &Snapshot,
        first: u64,
        want: usize,
        out: &mut [u8],
        left: Duration,
    ) -> Result<(usize, Vec<ReadInfo>), Step> {
        let (index, node) = reader_of(&snap.map, first)?;
        let n = same_reader(&snap.map, first, want, index);
        let epoch = snap.map.epoch;
        let r = self.rpc(node, first, left, |mut c| async move {
            c.read(ReadRequest {
                run: Some(PageRun {
                    first_page: first,
                    page_count: n as u64,
                }),
                map_epoch: epoch,
            })
            .await
            .map(tonic::Response::into_inner)
        })?;
        let want_len: usize = (first..first + n as u64).map(|p| self.page_len(p)).sum();
        if r.data.len() != want_len || r.frame_generations.len() != n {
            return Err(Step::Backoff(format!(
                "node {}'s Read returned {} bytes and {} generations for pages {first}..+{n}, not {want_len} and {n}",
                node.node_id,
                r.data.len(),
                r.frame_generations.len()
            )));
        }
        let ps = self.page_size;
        let mut off = 0;
        let mut infos = Vec::with_capacity(n);
        for (k, &generation) in r.frame_generations.iter().enumerate() {
            let len = self.page_len(first + k as u64);
            let dst = &mut out[k * ps..(k + 1) * ps];
            dst[..len].copy_from_slice(&r.data[off..off + len]);
            dst[len..].fill(0);
            off += len;
            infos.push(ReadInfo {
                via: Via::Grpc,
                owner: index,
                attempts: 1,
                transport: None,
                generation,
                coalesced: false,
            });
        }
        Ok((n, infos))
    }

    /// One RPC to `node`, within `rpc_timeout` (and `left`); classifies a
    /// failure as the module doc's table says.
    fn rpc<T, F, Fut>(&self, node: &MapNode, page: u64, left: Duration, call: F) -> Result<T, Step>
    where
        F: FnOnce(NodeRpc) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        let limit = self.cfg.rpc_timeout.min(left).max(Duration::from_millis(1));
        let addr = &node.grpc_address;
        let cached = lock(&self.channels).get(addr).cloned();
        let client = match cached {
            Some(c) => c,
            None => {
                let connect = self.cfg.connect_timeout.min(limit);
                let c = self
                    .rt
                    .block_on(owner::node_client(
                        addr,
                        &self.attach,
                        self.cfg.tls.as_ref(),
                        connect,
                    ))
                    .map_err(|why| {
                        Step::Backoff(format!(
                            "cannot connect to node {} at {addr}: {why}",
                            node.node_id
                        ))
                    })?;
                if !lock(&self.seen_channels).insert(addr.clone()) {
                    self.channel_reconnects.fetch_add(1, Ordering::Relaxed);
                }
                lock(&self.channels).insert(addr.clone(), c.clone());
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
                let why = format!("node {}: {:?}: {}", node.node_id, s.code(), s.message());
                match owner::refusal(&s) {
                    // The node's own refusal (moving, fenced, lease
                    // expired, no frame, ...): the channel is fine.
                    Some(code) => Err(Step::of_refusal(
                        code,
                        why,
                        &node.node_id,
                        page,
                        s.message(),
                    )),
                    None => {
                        lock(&self.channels).remove(addr);
                        Err(Step::Backoff(why))
                    }
                }
            }
            Err(_) => {
                lock(&self.channels).remove(addr);
                Err(Step::Backoff(format!(
                    "node {} did not answer within {limit:?}",
                    node.node_id
                )))
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How many pages from `first` (at most `want`, at most
/// [`MAX_ATTEMPT_PAGES`]) node `index` answers reads of under `map`.
fn same_reader(map: &OwnershipMap, first: u64, want: usize, index: u32) -> usize {
    let want = want.min(MAX_ATTEMPT_PAGES);
    let Some(e0) = extent_of(map, first) else {
        return 1;
    };
    let pages_per_extent = (map.extent_size / u64::from(map.page_size).max(1)).max(1);
    // Pages left in `first`'s extent, then whole extents while the reader
    // stays the same.
    let mut n = (pages_per_extent - first % pages_per_extent) as usize;
    let mut e = e0 + 1;
    while n < want {
        let page = e as u64 * pages_per_extent;
        if read_owner(map, page) != Some(index) {
            break;
        }
        n += pages_per_extent as usize;
        e += 1;
    }
    n.min(want)
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
