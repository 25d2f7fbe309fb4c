//! [`MapFollower`]: one thread per process that keeps the ownership map
//! current and says until when it may be trusted.
//!
//! # What a confirmation is
//!
//! A poll sends `Status` at `t_send` (this process's monotonic clock). The
//! coordinator answers with the epoch it had published when it answered,
//! which was at or after `t_send`, and its `lease_ms`. If that epoch is the
//! map's, the map was current at some instant after `t_send`: the map is
//! trusted until [`trust_window`]`(t_send, lease, margin)` = `t_send + lease
//! − clock_drift_margin`. Otherwise (or after a lost connection, or when
//! the uptime of the coordinator that answered went back, i.e. it
//! restarted, or another coordinator answered) the poll fetches
//! `GetMap`, sent at `t_send'`, and trusts the new map until `t_send' +
//! lease − margin`. Polls run one after another on the follower thread, so
//! `t_send` only grows; a failed poll changes nothing and the window runs
//! out by itself.
//!
//! Why `Status` and not `GetMap` every time: the epoch says everything
//! (the coordinator bumps it whenever anything in the map changes, node
//! descriptors included, under the lock `Status` reads it under), and a
//! map grows with the file (a TiB file in 2 MiB extents is half a million
//! entries per array), which many reader processes would fetch every
//! lease/4. Why not `WatchMap`: a pushed map says nothing about *when* it
//! was current, and silence on the stream does not confirm anything (a cut
//! off stream is silent too), so confirmations need a request with a known
//! send time anyway; with a poll every lease/4 and [`MapFollower::refresh_soon`]
//! after any failure, a stream would only save a quarter lease of latency
//! in learning a new epoch that readers find out about on their own (a
//! stale-map refusal, an owner that stopped answering).
//!
//! # Several coordinators
//!
//! The follower takes a list of coordinator addresses and polls one of them
//! ([`pagewire_proto::leader::Coordinators`], the rule the node daemon
//! follows too): a transport error, a timeout or `UNAVAILABLE` moves the
//! poll at once to the leader the refusal names, else to the next address,
//! until one answers or each has failed once in that poll (then the poll
//! failed, and the next comes [`RETRY_POLL`] later). A confirmation from
//! any coordinator is as good as one from the leader: a follower answers
//! `Status` and `GetMap` only after confirming with etcd that its copy is
//! current, so the epoch it names was current at some instant after
//! `t_send`, which is all the window needs. A `Status` that could not be
//! confirmed says so in `store_problem`; it is taken as a failure of that
//! coordinator (the poll moves on), never as a confirmation. Uptimes compare only on one
//! address: a `Status` whose `uptime_ms` went back *on the same address*
//! still means that coordinator restarted (fetch the map), while the first
//! answer from another address than the last one always fetches `GetMap`,
//! since a different coordinator's uptime says nothing about this one's
//! map. One address behaves as a single coordinator always did.
//!
//! # Sharing with the clients
//!
//! `(map, trust_until)` change together under `state`'s lock, which then
//! bumps `seq`. A client keeps a copy of the pair and of `seq`; it takes
//! the lock only when `seq` moved. A stale load of `seq` (Relaxed) makes it
//! use its older pair, which is consistent and trusted no longer than it
//! should be: never a newer trust window with an older map.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pagewire_proto::auth::AttachToken;
use pagewire_proto::lazy::LazyMap;
use pagewire_proto::leader::{AfterFailure, Coordinators, Pick, parse_address_list};
use pagewire_proto::v1::{GetMapRequest, OwnershipMap, StatusRequest};

use super::ClientError;
use super::owner::chain;

/// How a [`MapFollower`] polls the coordinator.
#[derive(Clone, Debug)]
pub struct FollowerConfig {
    /// Taken off every trust window against clock drift between this
    /// process and the nodes (the nodes' `clock_drift_margin_ms`; default
    /// 100 ms).
    pub clock_drift_margin: Duration,
    /// Connecting to the coordinator gives up after this long (default
    /// 500 ms).
    pub connect_timeout: Duration,
    /// One `Status` or `GetMap` call gives up after this long (default 1 s).
    pub rpc_timeout: Duration,
    /// Time between polls (None: a quarter of the coordinator's lease).
    /// Longer than the lease, the trust window lapses between polls and
    /// readers wait for a confirmation (tests use it to prove the window).
    pub poll_interval: Option<Duration>,
    /// TLS for the channels to the coordinators: the CA that signs their
    /// certificates and the name they carry. None: plain text.
    pub tls: Option<pagewire_proto::net::ClientTls>,
}

impl Default for FollowerConfig {
    fn default() -> Self {
        Self {
            clock_drift_margin: Duration::from_millis(100),
            connect_timeout: Duration::from_millis(500),
            rpc_timeout: Duration::from_secs(1),
            poll_interval: None,
            tls: None,
        }
    }
}

/// Polls asked for by [`MapFollower::refresh_soon`] start at most this
/// often (a storm of failing reads must not become a storm of polls).
const MIN_POLL_GAP: Duration = Duration::from_millis(10);
/// Polls after a failed one (coordinator down or unreachable), at most
/// this far apart.
const RETRY_POLL: Duration = Duration::from_millis(50);

/// Until when a map confirmed by a request sent at `sent` may be trusted,
/// with the coordinator's `lease` and this process's drift `margin`
/// (None: a lease no longer than the margin never holds).
pub fn trust_window(sent: Instant, lease: Duration, margin: Duration) -> Option<Instant> {
    lease
        .checked_sub(margin)
        .filter(|d| !d.is_zero())
        .map(|d| sent + d)
}

/// Follows the coordinator's ownership map for a process: one background
/// thread, shared by the process's clients.
pub struct MapFollower {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) struct Shared {
    state: Mutex<State>,
    /// Signalled (notify_all) when a poll is wanted, and when one finishes.
    cv: Condvar,
    /// Bumped under `state`'s lock each time `(map, trust_until)` changes.
    seq: AtomicU64,
    cfg: FollowerConfig,
}

struct State {
    map: Arc<LazyMap>,
    lease: Duration,
    trust_until: Option<Instant>,
    /// Polls started and finished (a waiter wants one started after it asked).
    started: u64,
    finished: u64,
    want: bool,
    shutdown: bool,
    last_error: Option<String>,
}

/// A consistent copy of what clients need: the map and until when to trust it.
#[derive(Clone)]
pub(crate) struct Snapshot {
    pub(crate) seq: u64,
    pub(crate) map: Arc<LazyMap>,
    pub(crate) trust_until: Option<Instant>,
}

impl Snapshot {
    pub(crate) fn trusted(&self, now: Instant) -> bool {
        self.trust_until.is_some_and(|t| now < t)
    }
}

/// What one poll learnt.
struct Confirmed {
    /// A new map (None: the current one is confirmed).
    map: Option<Arc<LazyMap>>,
    /// When the confirming request was sent.
    sent: Instant,
    lease: Duration,
}

/// The follower thread's connections to the coordinators.
struct Coordinator {
    coords: Coordinators,
    cfg: FollowerConfig,
    /// The next poll fetches the map whatever the epoch: set at start and
    /// by every failed call, cleared by a successful `GetMap`.
    fresh: bool,
    /// Who answered the last `Status`, and its uptime (a smaller one from
    /// the same address: it restarted).
    last: Option<(String, u64)>,
    /// The last map read: the next one reuses the owners it resolved
    /// (`pagewire_proto::lazy`: owners are resolved per extent when a read
    /// asks, never for the whole file).
    last_map: Option<Arc<LazyMap>>,
}

/// A failed call: which, and the status (a timeout is `DEADLINE_EXCEEDED`).
type CallError = (&'static str, tonic::Status);

impl Coordinator {
    async fn timed<T>(
        &self,
        what: &'static str,
        f: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, CallError> {
        match tokio::time::timeout(self.cfg.rpc_timeout, f).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err((what, s)),
            Err(_) => Err((
                what,
                tonic::Status::deadline_exceeded(format!(
                    "no answer within {:?}",
                    self.cfg.rpc_timeout
                )),
            )),
        }
    }

    /// One poll: on the current coordinator, failing over (module header,
    /// "Several coordinators") until one answers or each has failed once.
    async fn poll(&mut self, epoch: Option<u64>) -> Result<Confirmed, String> {
        let mut errors: Vec<String> = Vec::new();
        loop {
            let pick = self.coords.pick();
            match self.poll_one(&pick, epoch).await {
                Ok(c) => {
                    self.coords.succeeded(&pick);
                    return Ok(c);
                }
                Err((what, status)) => {
                    self.fresh = true;
                    errors.push(format!("{}: {what}: {}", pick.address(), status.message()));
                    if self.coords.failed(&pick, &status) != AfterFailure::RetryNow {
                        return Err(errors.join("; "));
                    }
                }
            }
        }
    }

    /// `Status`, and `GetMap` when the epoch moved, after a failure, on
    /// another coordinator than the last answer's, or when that one
    /// restarted.
    async fn poll_one(&mut self, pick: &Pick, epoch: Option<u64>) -> Result<Confirmed, CallError> {
        let mut c = pick.client();
        let sent = crate::clock::now();
        let st = self.timed("Status", c.status(StatusRequest {})).await?;
        if !st.store_problem.is_empty() {
            // That coordinator could not confirm its copy with the store:
            // its epoch confirms nothing (try another).
            return Err((
                "Status",
                tonic::Status::unavailable(format!(
                    "the coordinator cannot confirm its map: {}",
                    st.store_problem
                )),
            ));
        }
        let (switched, restarted) = match &self.last {
            Some((address, uptime)) if address == pick.address() => (false, st.uptime_ms < *uptime),
            _ => (true, false),
        };
        self.last = Some((pick.address().to_owned(), st.uptime_ms));
        let lease = Duration::from_millis(st.lease_ms);
        if !self.fresh && !switched && !restarted && epoch == Some(st.epoch) {
            return Ok(Confirmed {
                map: None,
                sent,
                lease,
            });
        }
        let sent = crate::clock::now();
        let map = self
            .timed("GetMap", c.get_map(GetMapRequest { compact: true }))
            .await?;
        // A compact map, resolved per extent when asked with the shared
        // code (an older coordinator's expanded one is used as it is).
        let map = Arc::new(match &map.compact {
            Some(cm) => LazyMap::from_compact(cm, self.last_map.as_deref()).map_err(|e| {
                (
                    "GetMap",
                    tonic::Status::data_loss(format!("an unusable map: {e}")),
                )
            })?,
            None => LazyMap::from_expanded(map),
        });
        self.last_map = Some(map.clone());
        self.fresh = false;
        Ok(Confirmed {
            map: Some(map),
            sent,
            lease,
        })
    }
}

impl MapFollower {
    /// Connects to the coordinators at `coordinator` (host:port, or a
    /// comma-separated list of them: see "Several coordinators" in the
    /// module header) with the cluster token (sent as
    /// `pagewire_proto::auth::AttachToken`, like the node daemon), reads
    /// `Status` (lease) and `GetMap` from the first that answers, and
    /// starts the follower thread.
    pub fn start(coordinator: &str, token: &str) -> Result<Arc<Self>, ClientError> {
        Self::start_with(coordinator, token, FollowerConfig::default())
    }

    /// [`MapFollower::start`] with settings.
    pub fn start_with(
        coordinator: &str,
        token: &str,
        cfg: FollowerConfig,
    ) -> Result<Arc<Self>, ClientError> {
        let addresses = parse_address_list(coordinator).map_err(ClientError::Addresses)?;
        let attach = AttachToken::new(token).map_err(ClientError::Token)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(ClientError::Runtime)?;
        // Lazy channels spawn their workers on the runtime they are made in.
        let coords = {
            let _in = rt.enter();
            Coordinators::new(&addresses, attach, cfg.tls.clone(), cfg.connect_timeout).map_err(
                |e| ClientError::Coordinator {
                    address: coordinator.to_owned(),
                    reason: chain(&e),
                },
            )?
        };
        let mut coord = Coordinator {
            coords,
            cfg: cfg.clone(),
            fresh: true,
            last: None,
            last_map: None,
        };
        let first = rt
            .block_on(coord.poll(None))
            .map_err(|reason| ClientError::Coordinator {
                address: coordinator.to_owned(),
                reason,
            })?;
        let map = first
            .map
            .unwrap_or_else(|| Arc::new(LazyMap::from_expanded(OwnershipMap::default())));
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                map,
                lease: first.lease,
                trust_until: trust_window(first.sent, first.lease, cfg.clock_drift_margin),
                started: 1,
                finished: 1,
                want: false,
                shutdown: false,
                last_error: None,
            }),
            cv: Condvar::new(),
            seq: AtomicU64::new(1),
            cfg,
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("pagewire-map".into())
            .spawn(move || s.run(rt, coord, first.sent))
            .map_err(ClientError::Runtime)?;
        Ok(Arc::new(Self { shared }))
    }

    /// The epoch of the map followed now.
    pub fn epoch(&self) -> u64 {
        self.shared.lock().map.epoch
    }

    /// The map followed now (which may be past its trust window: see
    /// [`MapFollower::trusted_until`]); its owners are resolved per extent
    /// when asked ([`LazyMap::owner`]), and [`LazyMap::expand`] gives the
    /// whole map.
    pub fn map(&self) -> Arc<LazyMap> {
        self.shared.lock().map.clone()
    }

    /// The coordinator's lease, as it last said.
    pub fn lease(&self) -> Duration {
        self.shared.lock().lease
    }

    /// Until when the current map may be trusted (None: never confirmed
    /// under a usable lease), on a clock that counts the time the machine
    /// spends suspended (it is later than `Instant::now()` after a suspend;
    /// [`crate::one_sided::RemoteReader::trust_until`] checks it on that clock).
    pub fn trusted_until(&self) -> Option<Instant> {
        self.shared.lock().trust_until
    }

    /// Why the last poll failed, if it did.
    pub fn last_error(&self) -> Option<String> {
        self.shared.lock().last_error.clone()
    }

    /// Ask for a fresh map now (non-blocking); used after an owner failed.
    pub fn refresh_soon(&self) {
        self.shared.ask();
    }

    /// Asks for a poll and waits (at most `bound`) until one that started
    /// after this call has finished; returns whether the map is trusted now.
    pub fn refresh(&self, bound: Duration) -> bool {
        self.shared.refresh(bound)
    }
}

impl Drop for MapFollower {
    fn drop(&mut self) {
        // The thread ends after its current poll; nobody waits for it.
        self.shared.lock().shutdown = true;
        self.shared.cv.notify_all();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pair clients use, if it changed since `seq`.
    pub(crate) fn snapshot_if_changed(&self, seq: u64) -> Option<Snapshot> {
        // Relaxed: a stale value only keeps the caller on its older,
        // consistent pair (module doc); the pair itself is read under the lock.
        if self.seq.load(Ordering::Relaxed) == seq {
            return None;
        }
        Some(self.snapshot())
    }

    pub(crate) fn snapshot(&self) -> Snapshot {
        let st = self.lock();
        Snapshot {
            seq: self.seq.load(Ordering::Relaxed),
            map: st.map.clone(),
            trust_until: st.trust_until,
        }
    }

    pub(crate) fn ask(&self) {
        let mut st = self.lock();
        if !st.want {
            st.want = true;
            self.cv.notify_all();
        }
    }

    pub(crate) fn refresh(&self, bound: Duration) -> bool {
        let end = Instant::now() + bound;
        let mut st = self.lock();
        let target = st.started + 1;
        st.want = true;
        self.cv.notify_all();
        while st.finished < target && !st.shutdown {
            let now = Instant::now();
            if now >= end {
                break;
            }
            st = self
                .cv
                .wait_timeout(st, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        st.trust_until.is_some_and(|t| crate::clock::now() < t)
    }

    /// Sleeps up to `pause`, waking early when the map's epoch is no longer
    /// `epoch` (a failover's new map ends a backoff at once).
    pub(crate) fn wait_epoch_change(&self, epoch: u64, pause: Duration) {
        let end = Instant::now() + pause;
        let mut st = self.lock();
        while st.map.epoch == epoch && !st.shutdown {
            let now = Instant::now();
            if now >= end {
                break;
            }
            st = self
                .cv
                .wait_timeout(st, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The follower thread: polls every `poll_interval` (a quarter lease),
    /// sooner when asked (at most every [`MIN_POLL_GAP`]), every
    /// [`RETRY_POLL`] while polls fail.
    fn run(self: Arc<Self>, rt: tokio::runtime::Runtime, mut coord: Coordinator, first: Instant) {
        let mut last_start = first;
        let mut failing = false;
        loop {
            let epoch = {
                let mut st = self.lock();
                loop {
                    if st.shutdown {
                        return;
                    }
                    let mut interval = self.cfg.poll_interval.unwrap_or(if st.lease.is_zero() {
                        Duration::from_millis(250)
                    } else {
                        st.lease / 4
                    });
                    if failing {
                        interval = interval.min(RETRY_POLL);
                    }
                    if st.want {
                        interval = interval.min(MIN_POLL_GAP);
                    }
                    let now = Instant::now();
                    let due = last_start + interval;
                    if now >= due {
                        break;
                    }
                    st = self
                        .cv
                        .wait_timeout(st, due - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                st.want = false;
                st.started += 1;
                st.map.epoch
            };
            last_start = Instant::now();
            let r = rt.block_on(coord.poll(Some(epoch)));
            let mut st = self.lock();
            failing = r.is_err();
            match r {
                Ok(c) => {
                    if let Some(map) = c.map {
                        if map.epoch < st.map.epoch {
                            tracing::warn!(
                                old = st.map.epoch,
                                new = map.epoch,
                                "the coordinator's map epoch went back; following it"
                            );
                        }
                        st.map = map;
                    }
                    st.lease = c.lease;
                    st.trust_until = trust_window(c.sent, c.lease, self.cfg.clock_drift_margin);
                    st.last_error = None;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "map poll failed");
                    st.last_error = Some(e);
                }
            }
            st.finished += 1;
            // Under the lock: a client that sees the new value reads the new pair.
            self.seq.fetch_add(1, Ordering::Relaxed);
            drop(st);
            self.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::trust_window;
    use std::time::{Duration, Instant};

    #[test]
    fn the_trust_window_counts_from_the_send_time_less_the_margin() {
        let sent = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(trust_window(sent, ms(1500), ms(100)), Some(sent + ms(1400)));
        assert_eq!(trust_window(sent, ms(100), ms(100)), None, "lease = margin");
        assert_eq!(trust_window(sent, ms(50), ms(100)), None, "lease < margin");
        assert_eq!(trust_window(sent, ms(0), ms(0)), None, "no lease");
        assert_eq!(trust_window(sent, ms(10), ms(0)), Some(sent + ms(10)));
    }
}
