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
//! The files: this one holds [`ClusterClient`] and its operations;
//! `cluster::api` its settings, answers, counters and errors;
//! `cluster::routing` which node answers a page; `cluster::attempt` one
//! attempt per read path and the retry loop; `cluster::follower` the map
//! follower; `cluster::owner` connections to a node; `cluster::flight`
//! single flight.
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

mod api;
mod attempt;
mod flight;
mod follower;
pub(crate) mod owner;
mod routing;

pub use api::{ClientConfig, ClientError, ClientStats, ReadInfo, ReadPath, RunInfo, Via};
pub use follower::{FollowerConfig, MapFollower, trust_window};
pub use owner::{Transport, TransportChoice};
pub use routing::{read_owner, write_owner};

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::latency::{LatencyHistogram, PathLatency, ReadPathLabel};
use crate::pool::{OwnerPool, PoolConfig, RunOptions};
use crate::slot::Padded;
use attempt::Step;
use flight::{Answer, Flights, Role};
use follower::Snapshot;
use owner::NodeRpc;
use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::WriteRequest;
use pagewire_rdma::tcp::ConnectionConfig;
use routing::{node_of, reader_of, same_reader};

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
                fault_calls: true,
                readahead: true,
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

    /// Whether the bytes a [`ClusterClient::read_run`] of pages `first..`
    /// returned earlier (`pages`: its [`RunInfo::pages`]) are still every
    /// page's content, checked without reading them again: each page must
    /// still be answered by the node that gave it under the current map
    /// (within its trust window), from the same incarnation of that node's
    /// region, and the frame it was copied from must still hold the same
    /// generation, one READ of its generation word per page, batched per
    /// node ([`crate::RemoteReader::still_current`]). `true`: the copy is
    /// what a read now would return, coherent with every write
    /// acknowledged before this call. `false`: read the pages again; so
    /// too for pages read over gRPC or served uncached (nothing to check
    /// them by), and whenever the check itself fails (an unreachable
    /// owner, an expired trust window): the read again reports the error.
    pub fn still_current(&self, first: u64, pages: &[ReadInfo]) -> bool {
        self.still_current_runs(&[(first, pages)])[0]
    }

    /// [`ClusterClient::still_current`] for several runs at once, one
    /// answer per run, in order: every page of every run is checked under
    /// one map and one trust window, and each node's pages, whichever runs
    /// they belong to, in one batch ([`crate::RemoteReader::current_each`]:
    /// one READ per page, one doorbell per transport batch), so checking
    /// many runs costs about one round trip per node instead of one per
    /// run and node. A node that cannot be reached makes only the runs
    /// with pages on it `false`.
    pub fn still_current_runs(&self, runs: &[(u64, &[ReadInfo])]) -> Vec<bool> {
        /// One node's pages to check: the node, the first page asked of it
        /// (named in errors), the copies and the run of each.
        struct Ask<'m> {
            node: &'m pagewire_proto::v1::MapNode,
            first: u64,
            copies: Vec<crate::pool::FrameCopy>,
            runs: Vec<usize>,
        }
        let deadline = Instant::now() + self.cfg.op_deadline;
        self.with_snapshot(|snap| {
            let mut current = vec![false; runs.len()];
            let Some(trust) = snap.trust_until else {
                return current;
            };
            if !snap.trusted(crate::clock::now()) {
                return current;
            }
            let opts = RunOptions {
                trust_until: Some(trust),
                map_epoch: snap.map.epoch,
                deadline: Some(deadline),
            };
            let mut asks: Vec<(u32, Ask<'_>)> = Vec::new();
            // The run being looked at, by node: (node index, node, first
            // page of the segment, its pages).
            let mut segments = Vec::new();
            'runs: for (r, &(first, pages)) in runs.iter().enumerate() {
                // A run is asked only if every page of it can be checked.
                segments.clear();
                let mut i = 0;
                while i < pages.len() {
                    let at = first + i as u64;
                    let Ok((index, node)) = reader_of(&snap.map, at) else {
                        continue 'runs;
                    };
                    let n = same_reader(&snap.map, at, pages.len() - i, index);
                    let segment = &pages[i..i + n];
                    if !segment.iter().all(|p| p.copy.is_some() && p.owner == index) {
                        continue 'runs;
                    }
                    segments.push((index, node, at, segment));
                    i += n;
                }
                current[r] = true;
                for &(index, node, at, segment) in &segments {
                    let k = match asks.iter().position(|(i, _)| *i == index) {
                        Some(k) => k,
                        None => {
                            let ask = Ask {
                                node,
                                first: at,
                                copies: Vec::new(),
                                runs: Vec::new(),
                            };
                            asks.push((index, ask));
                            asks.len() - 1
                        }
                    };
                    let ask = &mut asks[k].1;
                    ask.copies.extend(segment.iter().filter_map(|p| p.copy));
                    ask.runs.extend(std::iter::repeat_n(r, segment.len()));
                }
            }
            for (_, ask) in &asks {
                match self
                    .pool
                    .current_each(ask.node, ask.first, &ask.copies, &opts)
                {
                    Ok(answers) => {
                        for (ok, &r) in answers.into_iter().zip(&ask.runs) {
                            current[r] &= ok;
                        }
                    }
                    Err(_) => ask.runs.iter().for_each(|&r| current[r] = false),
                }
            }
            current
        })
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
        let pool = self.pool.stats();
        s.reconnects = pool.reconnects + self.channel_reconnects.load(Ordering::Relaxed);
        s.fault_calls = pool.fault_calls;
        s.readahead = pool.readahead;
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
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
