//! A pool of one-sided connections to owners, with the `FaultIn` fallback:
//! "read pages of an extent another node owns" in one place, used by the
//! node daemon for reads it does not serve (`daemon::remote_source`) and by
//! [`crate::ClusterClient`] for every one-sided read.
//!
//! A read ([`OwnerPool::read_into`]) takes an idle reader of the owner out
//! of the pool (or opens a new one, with no lock held), reads the run
//! one-sidedly ([`crate::one_sided`]: over `shm` when the owner's shm file is
//! on this host, else `verbs` where built and usable, else `tcp`), batched
//! under one doorbell per round ([`crate::one_sided::RemoteReader::read_run`],
//! as many pages as the connection's queue holds, at most [`RUN_CHUNK`]),
//! and puts the reader back. Pages the
//! owner's index does not show (or that keep moving) are faulted in on the
//! owner, one request per contiguous stretch of them: a call on the
//! owner's `tcp` transport (`pagewire_proto::call`) when its descriptor
//! says it takes them (on the reader's own tcp connection, or on one
//! opened for calls beside an shm or verbs reader), else a gRPC
//! `FaultIn`. The reply carries the bytes and the frames' locations, so
//! the next read of them is one round trip again. Nothing is cached here.
//!
//! **Connections.** `verbs` readers are handles on the process's one queue
//! pair to each owner (`rdma::SharedConnection`), however many threads
//! read. `tcp` readers each have their own connection (one per thread that
//! reads the owner at once), or, with [`PoolConfig::tcp_shared`], are
//! handles on one per (process, owner) (see there for why that is not the
//! default yet). `shm` readers each map the owner's file: a mapping holds
//! nothing on the owner.
//! gRPC channels (for `FaultIn`) are one per owner address, multiplexed,
//! kept until a call on them fails at the transport.
//!
//! **Threads.** Idle readers and counters sit in per-thread slots
//! (`crate::slot`), so threads reading at once touch no common cache line
//! on the hit path; no lock is held across network I/O, and a reader of a
//! frozen owner holds up only the read using it. A `FaultIn` has a deadline
//! ([`PoolConfig::fault_in_deadline`], connecting included, clamped to the
//! caller's). A reader remembers the region epoch of the descriptor it was
//! opened with; idle readers of an earlier incarnation of the owner (the map
//! names another epoch) are closed when the owner is next read.
//!
//! Freshness is the caller's: the pool reads the owner the caller names and
//! trusts nobody's map. The caller bounds it with
//! [`RunOptions::trust_until`] (the client's trust window), or checks its
//! own lease before and after (the node daemon; ARCHITECTURE.md,
//! "Ownership, leases and writes").

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::cluster::Transport;
use crate::cluster::owner::{self, ConnectHow, Faulted, NodeRpc, OwnerConn, TransportChoice};
use crate::one_sided::{Outcome, ReaderConfig, ReaderStats, RemoteError};
use crate::slot::{self, Padded};
use pagewire_proto::auth::{AttachToken, TokenError};
use pagewire_proto::net::ClientTls;
use pagewire_proto::v1::MapNode;
use pagewire_rdma::tcp::ConnectionConfig;

/// The most pages read one-sidedly per batch (one doorbell): a warm batch
/// is two READs per page (header and frame). Each reader batches as many
/// as its connection's queue holds, up to this: `shm` and `tcp` 256 pages,
/// `verbs` 16 (32 outstanding per queue pair, shared by the process).
pub const RUN_CHUNK: usize = 256;

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
    /// TLS for the gRPC channels to owners (`FaultIn`): the CA that signs
    /// the nodes' certificates and the name they carry. None: plain text.
    pub tls: Option<ClientTls>,
    /// One `tcp` connection per owner for the whole process, every reader a
    /// handle on it (default `false`: each reader its own connection).
    /// Fewer sockets on the owner, but today slower under concurrency: the
    /// owner's tcp responder serves a connection from one thread, whose
    /// spin window stays shut for a single connection, so each READ pays
    /// a blocking wake-up on both ends (measured: 2 threads 22.6 k pages/s
    /// shared against 96 k on their own connections; see the client
    /// crate's README).
    pub tcp_shared: bool,
    /// Fault a miss in with a call on the owner's tcp transport when the
    /// owner takes them (default `true`); `false`: always the gRPC
    /// `FaultIn` (for comparisons, or an owner whose calls misbehave).
    pub fault_calls: bool,
    /// When a reader's miss continues a sequential stream, ask the owner
    /// for the locations of the pages after it (default `true`; see the
    /// crate's README, "Readahead"); `false`: never (for comparisons).
    pub readahead: bool,
}

impl Default for PoolConfig {
    /// The transports' default settings.
    fn default() -> Self {
        Self {
            transport: TransportChoice::Auto,
            reader: ReaderConfig::default(),
            tcp: ConnectionConfig::new(Vec::new()),
            fault_in_deadline: Duration::from_secs(2),
            tls: None,
            tcp_shared: false,
            fault_calls: true,
            readahead: true,
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
    /// Of those, faulted in on the owner (a one-sided miss).
    pub fallbacks: u64,
    /// Of `fallbacks`, faulted in by a call on the owner's tcp transport
    /// rather than a gRPC `FaultIn`.
    pub fault_calls: u64,
    /// Pages after a sequential reader's miss whose locations the fault-in
    /// brought back (readahead): read later with one READ, no index walk.
    pub readahead: u64,
    /// One-sided readers opened (a `tcp` or `verbs` reader is a handle on
    /// the process's one connection to the owner).
    pub connects: u64,
    /// Of `connects`, readers opened to an owner after one to it was closed
    /// (a failure, or a new region epoch).
    pub reconnects: u64,
}

/// What a caller's read needs besides the run.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunOptions {
    /// The caller's trust in the map that named the owner ends then: a
    /// one-sided read that starts or ends later fails with
    /// [`PoolError::LeaseExpired`] and returns no bytes. None: the caller
    /// bounds its trust itself (the node daemon checks its lease).
    pub trust_until: Option<Instant>,
    /// The caller's map epoch, sent with `FaultIn` (0: none; the owner then
    /// does not check that the caller's map is at least its own).
    pub map_epoch: u64,
    /// A `FaultIn` gives up then at the latest (besides
    /// [`PoolConfig::fault_in_deadline`]).
    pub deadline: Option<Instant>,
}

/// How one page of a run was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRead {
    /// `false`: one-sided READs; `true`: the owner's `FaultIn`, after a
    /// one-sided miss.
    pub fault_in: bool,
    /// The transport of the reader (for a `FaultIn`, whose miss sent the
    /// read to the owner).
    pub transport: Transport,
    /// The page's valid length (the page size but for the file's last page).
    pub len: usize,
    /// The owner's frame the copy is of, when it is one (a hit, or a page
    /// the owner faulted in and cached): what
    /// [`OwnerPool::current_each`] checks.
    pub copy: Option<FrameCopy>,
}

impl PageRead {
    /// The frame generation of the copy read (0: the owner served the page
    /// without caching it).
    pub fn generation(&self) -> u64 {
        self.copy.map_or(0, |c| c.generation)
    }
}

/// The frame a copy was read from: which incarnation of the owner's
/// region, which frame, which generation of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameCopy {
    pub region_epoch: u64,
    pub frame: u32,
    pub generation: u64,
}

/// Why [`OwnerPool::read_into`] returned no bytes. Every case but
/// `BufferSize` and a `FaultIn` the owner refused for good (`refused` is
/// not a failover code) is one the caller retries (with a fresh map, or
/// after a backoff): the owner is unreachable, frozen, restarted or busy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// No connection to the owner could be opened (`reason` says why each
    /// transport it publishes failed).
    #[error("cannot connect to node {node}: {reason}")]
    Connect { node: String, reason: String },
    /// The one-sided read of `page` failed (a stale descriptor, a lost
    /// connection, a timeout); the reader was closed.
    #[error("one-sided read of page {page} from node {node}: {reason}")]
    Read {
        node: String,
        page: u64,
        reason: String,
    },
    /// A one-sided read started or ended past [`RunOptions::trust_until`]:
    /// its bytes were not returned (confirm the map, then retry).
    #[error(
        "a one-sided read of page {page} from node {node} ended {late:?} past the map's trust window"
    )]
    LeaseExpired {
        node: String,
        page: u64,
        late: Duration,
    },
    /// `FaultIn` of `page` on the owner failed or ran past its deadline.
    /// `refused`: the gRPC code the owner answered with (None: the call
    /// failed at the transport, timed out, or the reply was malformed).
    #[error("FaultIn of page {page} on node {node}: {reason}")]
    FaultIn {
        node: String,
        page: u64,
        refused: Option<tonic::Code>,
        reason: String,
    },
    /// The caller's buffer does not hold the run.
    #[error("buffer of {got} bytes for a run of {need}")]
    BufferSize { need: usize, got: usize },
}

impl PoolError {
    /// The page the failure is about (the run's first for `Connect` and
    /// `BufferSize`).
    pub fn page(&self, first: u64) -> u64 {
        match self {
            Self::Connect { .. } | Self::BufferSize { .. } => first,
            Self::Read { page, .. }
            | Self::LeaseExpired { page, .. }
            | Self::FaultIn { page, .. } => *page,
        }
    }
}

#[derive(Default)]
struct Counters {
    pages: AtomicU64,
    one_sided: AtomicU64,
    fallbacks: AtomicU64,
    fault_calls: AtomicU64,
    readahead: AtomicU64,
    connects: AtomicU64,
    reconnects: AtomicU64,
}

/// One thread slot: idle readers by owner index, and counters.
#[derive(Default)]
struct Slot {
    idle: Mutex<HashMap<u32, Vec<OwnerConn>>>,
    counters: Counters,
}

/// One-sided connections to owners, shared by every thread of a process.
pub struct OwnerPool {
    token: String,
    attach: AttachToken,
    cfg: PoolConfig,
    page_size: usize,
    /// Runs the `FaultIn` calls.
    rt: tokio::runtime::Handle,
    slots: Box<[Padded<Slot>]>,
    /// gRPC channels by owner address (`FaultIn`).
    channels: Mutex<HashMap<String, NodeRpc>>,
    /// Owners a reader was ever opened to (for `reconnects`).
    seen: Mutex<HashSet<u32>>,
    /// Reader counters of connections since closed, so totals only grow.
    retired: Mutex<ReaderStats>,
    /// The largest total [`OwnerPool::reader_stats`] computed (readers in
    /// use are not in the pool, so a new sum can come out lower).
    last_total: Mutex<ReaderStats>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl OwnerPool {
    /// A pool reading pages of `page_size` bytes with the cluster `token`.
    /// `FaultIn` calls run on `rt`, which must be a multi-thread runtime
    /// (or be driven by another thread): the pool's reads block on it, so
    /// they may not be called from one of `rt`'s async tasks (use
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
            slots: slot::slots(),
            channels: Mutex::new(HashMap::new()),
            seen: Mutex::new(HashSet::new()),
            retired: Mutex::new(ReaderStats::default()),
            last_total: Mutex::new(ReaderStats::default()),
        })
    }

    /// The pool's counters.
    pub fn stats(&self) -> PoolStats {
        let mut s = PoolStats::default();
        for slot in self.slots.iter() {
            let c = &slot.counters;
            s.pages += c.pages.load(Ordering::Relaxed);
            s.one_sided += c.one_sided.load(Ordering::Relaxed);
            s.fallbacks += c.fallbacks.load(Ordering::Relaxed);
            s.fault_calls += c.fault_calls.load(Ordering::Relaxed);
            s.readahead += c.readahead.load(Ordering::Relaxed);
            s.connects += c.connects.load(Ordering::Relaxed);
            s.reconnects += c.reconnects.load(Ordering::Relaxed);
        }
        s
    }

    /// The one-sided readers' counters, over every reader so far (readers
    /// in use count from when they are back in the pool).
    pub fn reader_stats(&self) -> ReaderStats {
        let mut total = *lock(&self.retired);
        for slot in self.slots.iter() {
            for o in lock(&slot.idle).values().flatten() {
                total.add(&o.reader.stats());
            }
        }
        let mut last = lock(&self.last_total);
        last.max_each(&total);
        *last
    }

    /// Reads pages `first..first + count` of the file from `owner` (a node
    /// of the caller's map): their bytes, concatenated (each page's valid
    /// length), and how each page was read (its frame generation: 0 for a
    /// page the owner served without caching it). The node daemon's entry
    /// point.
    pub fn read_run(
        &self,
        owner: &MapNode,
        first: u64,
        count: u64,
    ) -> Result<(Vec<u8>, Vec<PageRead>), PoolError> {
        let n = usize::try_from(count).unwrap_or(usize::MAX);
        let need = n.checked_mul(self.page_size).ok_or(PoolError::BufferSize {
            need: usize::MAX,
            got: 0,
        })?;
        let mut out = vec![0u8; need];
        let pages = self.read_into(owner, first, n, &mut out, &RunOptions::default())?;
        // Only the file's last page is short, so the valid lengths of the
        // run are one prefix of it.
        out.truncate(pages.iter().map(|p| p.len).sum());
        Ok((out, pages))
    }

    /// Reads pages `first..first + count` from `owner` into `out` (at least
    /// `count * page_size` bytes: each page's valid length, zeros to the
    /// page's end) and says how each page was read.
    pub fn read_into(
        &self,
        owner: &MapNode,
        first: u64,
        count: usize,
        out: &mut [u8],
        opts: &RunOptions,
    ) -> Result<Vec<PageRead>, PoolError> {
        match count.checked_mul(self.page_size) {
            Some(need) if out.len() >= need => {}
            need => {
                return Err(PoolError::BufferSize {
                    need: need.unwrap_or(usize::MAX),
                    got: out.len(),
                });
            }
        }
        if count == 0 {
            return Ok(Vec::new());
        }
        self.with_reader(owner, |slot, o| {
            self.read_with(slot, o, owner, first, count, out, opts)
        })
    }

    /// Runs `f` on an idle reader of `owner` (this thread's slot first,
    /// [`OwnerPool::take`]); puts the reader back after, unless `f` failed
    /// saying it must be closed (`(false, _)`).
    fn with_reader<T>(
        &self,
        owner: &MapNode,
        f: impl FnOnce(&Slot, &mut OwnerConn) -> Result<T, (bool, PoolError)>,
    ) -> Result<T, PoolError> {
        let slot = &self.slots[slot::thread_slot()];
        let mut o = self.take(slot, owner)?;
        match f(slot, &mut o) {
            Ok(v) => {
                self.put_back(slot, owner.index, o);
                Ok(v)
            }
            Err((keep, e)) => {
                if keep {
                    self.put_back(slot, owner.index, o);
                } else {
                    self.retire(o);
                }
                Err(e)
            }
        }
    }

    /// Whether each copy `owner` gave earlier (a [`PageRead::copy`] each)
    /// is still its page's content: one READ of each frame's generation
    /// word ([`crate::RemoteReader::current_each`]), one answer per copy,
    /// in order. `false` as well for a copy of another incarnation of the
    /// owner's region than the one `owner` names now. Errors are a read's
    /// and cover every copy; the trust window in `opts` bounds the check
    /// as it bounds a read; `first` is the first page checked, named in
    /// errors.
    pub fn current_each(
        &self,
        owner: &MapNode,
        first: u64,
        copies: &[FrameCopy],
        opts: &RunOptions,
    ) -> Result<Vec<bool>, PoolError> {
        let want = owner::region_epoch(owner);
        // A copy of another incarnation is never current: asked with
        // generation 0, which no live frame has, it is answered `false`
        // with no READ.
        let frames: Vec<(u32, u64)> = copies
            .iter()
            .map(|c| {
                let current = Some(c.region_epoch) == want;
                (c.frame, if current { c.generation } else { 0 })
            })
            .collect();
        if frames.iter().all(|&(_, g)| g == 0) {
            return Ok(vec![false; copies.len()]);
        }
        self.with_reader(owner, |_, o| {
            o.reader.trust(opts.trust_until);
            o.reader
                .current_each(&frames)
                .map_err(|e| reader_failed(owner, first, e))
        })
    }

    /// Closes `conn`, keeping its counters.
    fn retire(&self, conn: OwnerConn) {
        lock(&self.retired).add(&conn.reader.stats());
    }

    /// An idle reader of `owner` at the region epoch the map names (this
    /// thread's slot first, then any other), or a new one (opened with no
    /// lock held). Idle readers of an older region
    /// of the owner (it restarted) are closed.
    fn take(&self, slot: &Slot, owner: &MapNode) -> Result<OwnerConn, PoolError> {
        let want = owner::region_epoch(owner);
        let (conn, stale) = {
            let mut idle = lock(&slot.idle);
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
        // A thread new to the pool (a pool's threads come and go) takes a
        // reader another slot left idle, warm index cache and all, before
        // it opens one. Slots busy right now are skipped.
        for other in self.slots.iter() {
            let Ok(mut idle) = other.idle.try_lock() else {
                continue;
            };
            if let Some(list) = idle.get_mut(&owner.index)
                && let Some(i) = list.iter().position(|o| Some(o.epoch) == want)
            {
                return Ok(list.swap_remove(i));
            }
        }
        let how = ConnectHow {
            token: &self.token,
            transport: self.cfg.transport,
            reader: self.cfg.reader.clone(),
            tcp: self.cfg.tcp.clone(),
            tcp_shared: self.cfg.tcp_shared,
        };
        let c = owner::connect(owner, &how).map_err(|reason| PoolError::Connect {
            node: owner.node_id.clone(),
            reason,
        })?;
        slot.counters.connects.fetch_add(1, Ordering::Relaxed);
        if !lock(&self.seen).insert(owner.index) {
            slot.counters.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        Ok(c)
    }

    fn put_back(&self, slot: &Slot, index: u32, conn: OwnerConn) {
        lock(&slot.idle).entry(index).or_default().push(conn);
    }

    /// Faults `first..first + count` in on `owner` (a call on its tcp
    /// transport when it takes them, else gRPC), with `readahead` pages
    /// after it (their locations only), and takes the bytes from the reply,
    /// within the deadline. Returns the bytes and the frames' locations, or
    /// the owner's refusal code (None: a transport failure or timeout) and
    /// why.
    #[allow(clippy::too_many_arguments)]
    fn fault_in(
        &self,
        slot: &Slot,
        o: &mut OwnerConn,
        owner: &MapNode,
        first: u64,
        count: u64,
        readahead: u32,
        opts: &RunOptions,
    ) -> Result<Faulted, (Option<tonic::Code>, String)> {
        let mut limit = self.cfg.fault_in_deadline;
        if let Some(d) = opts.deadline {
            limit = limit.min(d.saturating_duration_since(Instant::now()));
        }
        let limit = limit.max(Duration::from_millis(1));
        if let Some(r) = self
            .cfg
            .fault_calls
            .then(|| o.fault_call(first, count, readahead, opts.map_epoch, limit))
            .flatten()
        {
            if r.is_ok() {
                slot.counters
                    .fault_calls
                    .fetch_add(count, Ordering::Relaxed);
            }
            return r;
        }
        let addr = owner.grpc_address.clone();
        let cached = lock(&self.channels).get(&addr).cloned();
        let map_epoch = opts.map_epoch;
        let r = self.rt.block_on(async {
            let call = async {
                let mut client = match cached {
                    Some(c) => c,
                    None => {
                        let c =
                            owner::node_client(&addr, &self.attach, self.cfg.tls.as_ref(), limit)
                                .await
                                .map_err(|why| (None, why))?;
                        lock(&self.channels).insert(addr.clone(), c.clone());
                        c
                    }
                };
                owner::fault_in(&mut client, first, count, readahead, map_epoch)
                    .await
                    .map_err(|s| {
                        (
                            owner::refusal(&s),
                            format!("{:?}: {}", s.code(), s.message()),
                        )
                    })
            };
            tokio::time::timeout(limit, call).await.map_err(|_| {
                (
                    None,
                    format!(
                        "the owner at {addr} did not answer FaultIn within {} ms",
                        limit.as_millis()
                    ),
                )
            })?
        });
        if let Err((None, _)) = &r {
            // The channel may be broken: the next call connects again.
            lock(&self.channels).remove(&owner.grpc_address);
        }
        r
    }

    /// Reads `first..first + count` over `o` into `out`. On failure, says
    /// whether `o` still works (`true`: only a `FaultIn` failed, or the
    /// trust window ran out) or must be closed.
    #[allow(clippy::too_many_arguments)]
    fn read_with(
        &self,
        slot: &Slot,
        o: &mut OwnerConn,
        owner: &MapNode,
        first: u64,
        count: usize,
        out: &mut [u8],
        opts: &RunOptions,
    ) -> Result<Vec<PageRead>, (bool, PoolError)> {
        let ps = self.page_size;
        let file_len = o.reader.file_len();
        let transport = o.reader.transport();
        let valid =
            |page: u64| (file_len.saturating_sub(page.saturating_mul(ps as u64)) as usize).min(ps);
        o.reader.trust(opts.trust_until);
        let mut pages = Vec::with_capacity(count);
        let counters = &slot.counters;
        counters.pages.fetch_add(count as u64, Ordering::Relaxed);
        let chunk = o.reader.batch_pages();
        // A read that begins where this connection's last one ended reads
        // on: its misses ask for readahead (`crate::readahead`).
        let sequential = self.cfg.readahead && o.stream.continues(first);
        let mut done = 0usize;
        while done < count {
            let n = (count - done).min(chunk);
            let at = first + done as u64;
            let buf = &mut out[done * ps..(done + n) * ps];
            let outcomes = if n == 1 {
                o.reader.read_page(at, buf).map(|x| vec![x])
            } else {
                o.reader.read_run(at, n, buf)
            };
            let outcomes = outcomes.map_err(|e| reader_failed(owner, at, e))?;
            let mut i = 0;
            while i < n {
                if let Outcome::Hit {
                    frame, generation, ..
                } = outcomes[i]
                {
                    counters.one_sided.fetch_add(1, Ordering::Relaxed);
                    pages.push(PageRead {
                        fault_in: false,
                        transport,
                        len: valid(at + i as u64),
                        copy: Some(FrameCopy {
                            region_epoch: o.epoch,
                            frame,
                            generation,
                        }),
                    });
                    i += 1;
                    continue;
                }
                // A stretch of misses: one FaultIn for all of it.
                let j = (i..n)
                    .find(|&k| matches!(outcomes[k], Outcome::Hit { .. }))
                    .unwrap_or(n);
                let (from, len) = (at + i as u64, (j - i) as u64);
                counters.fallbacks.fetch_add(len, Ordering::Relaxed);
                let fault_failed = |refused, reason| {
                    (
                        true,
                        PoolError::FaultIn {
                            node: owner.node_id.clone(),
                            page: from,
                            refused,
                            reason,
                        },
                    )
                };
                let readahead = o.stream.on_miss(sequential, len);
                let f = self
                    .fault_in(slot, o, owner, from, len, readahead, opts)
                    .map_err(|(code, why)| fault_failed(code, why))?;
                let want: usize = (from..from + len).map(valid).sum();
                if f.data.len() != want {
                    return Err(fault_failed(
                        None,
                        format!(
                            "the owner's FaultIn returned {} bytes for {len} pages, not {want}",
                            f.data.len()
                        ),
                    ));
                }
                let mut off = 0;
                for (k, loc) in f.locations.iter().enumerate() {
                    let page = from + k as u64;
                    let v = valid(page);
                    let dst = &mut buf[(i + k) * ps..(i + k + 1) * ps];
                    dst[..v].copy_from_slice(&f.data[off..off + v]);
                    dst[v..].fill(0);
                    off += v;
                    // A page the owner did not cache has no location.
                    let copy = loc.map(|(frame, generation)| {
                        o.reader.learn(page, frame, generation);
                        FrameCopy {
                            region_epoch: o.epoch,
                            frame,
                            generation,
                        }
                    });
                    pages.push(PageRead {
                        fault_in: true,
                        transport,
                        len: v,
                        copy,
                    });
                }
                for (k, &(frame, generation)) in f.ahead.iter().enumerate() {
                    o.reader.learn(from + len + k as u64, frame, generation);
                }
                counters
                    .readahead
                    .fetch_add(f.ahead.len() as u64, Ordering::Relaxed);
                i = j;
            }
            done += n;
        }
        o.stream.end(first + count as u64);
        Ok(pages)
    }
}

/// A reader's error at `page` of `owner` as the pool reports it, and
/// whether the reader still works (`true`: only the trust window ran out).
fn reader_failed(owner: &MapNode, page: u64, e: RemoteError) -> (bool, PoolError) {
    match e {
        RemoteError::LeaseExpired(late) => (
            true,
            PoolError::LeaseExpired {
                node: owner.node_id.clone(),
                page,
                late,
            },
        ),
        // Stale descriptor (owner restarted) or a lost connection: the
        // reader goes; the caller retries with a fresh map.
        e => (
            false,
            PoolError::Read {
                node: owner.node_id.clone(),
                page,
                reason: owner::chain(&e),
            },
        ),
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
