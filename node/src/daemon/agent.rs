//! The node's side of membership: register, heartbeat, follow the map.
//!
//! * Register (retrying while the coordinator is unreachable; a refusal such
//!   as a file size mismatch stops the daemon with the coordinator's message).
//! * Heartbeat every interval the coordinator asked for, carrying the applied
//!   map epoch and the cache counters; a reply that says the node was declared
//!   dead or re-registered elsewhere sends it back to registration.
//!   A heartbeat renews this node's own lease ([`super::lease`]) only when
//!   the node had applied the coordinator's current epoch when it sent it.
//! * Watch the map: each new epoch is applied by [`Node::apply_map`] on the
//!   blocking pool (so a cancelled watcher cannot stop it halfway): it
//!   refuses at once what this node no longer answers from its cache and
//!   evicts it (everything, before answering anything, when epochs were
//!   skipped); then heartbeat at once so the coordinator can finish the
//!   handoff.
//! * Whenever this node must register again (declared dead, lease lapsed),
//!   it first loses everything ([`Node::lose_everything`]): the extents it
//!   held may have moved and been written meanwhile. It sends the
//!   incarnation it held, so the coordinator tells it from another process
//!   with the same node id.
//! * The coordinator refuses the node id while another process holds its
//!   lease at another address (`ALREADY_EXISTS`): this node waits out that
//!   lease once (a restart at a new address) and registers again; a second
//!   refusal stops the daemon with the coordinator's message.
//! * Leaving is final: once [`Agent::leave`] starts, this process never
//!   registers or heartbeats again.
//! * Failover between coordinators (`coordinator = "a:7400,b:7400"`): one
//!   lazy channel per address, one current ([`Coordinators`]). Register,
//!   Heartbeat, Leave and the map stream all go to the current one. A
//!   transport error, a timeout or `UNAVAILABLE` moves it: to the leader
//!   the refusal names in `pagewire-leader` (added to the list when it is
//!   not in it), else to the next address; each switch is logged at info
//!   (`switching coordinator from=.. to=..`). The call is retried at once
//!   until every address has failed once since the last success, then after
//!   the backoff that a single coordinator gets (registration and the map
//!   stream: 100 ms doubling to 2 s; heartbeats: 100 ms doubling to a
//!   quarter of the interval, so a new leader is found within the lease). The
//!   map stream may stay on a follower: followers confirm with etcd that
//!   their copy is current before they answer, so their maps are as good
//!   as the leader's. Whatever a coordinator sends, a map older than the
//!   applied one is never applied (not even as a stream's first message;
//!   see [`Node::apply_map`]). With one address nothing switches, and every failure
//!   waits out that backoff, as with a single coordinator.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pagewire_proto::auth::AttachToken;
use pagewire_proto::leader::{AfterFailure, Coordinators, CoordinatorsError};
use pagewire_proto::net::ClientTls;
use pagewire_proto::v1::{
    DrainRequest, HeartbeatRequest, LeaveRequest, NumaNode, OwnershipMap, RegisterRequest,
    Topology, TransportDescriptor, WatchMapRequest,
};
use tonic::Code;

use super::{Config, DaemonError, Node};

/// The first wait before retrying a round of failed heartbeats (then
/// doubling, at most a quarter of the heartbeat interval).
const FAILING_HEARTBEAT_FIRST: Duration = Duration::from_millis(100);

/// How [`Agent::drain`] ended.
#[derive(Debug)]
pub(crate) enum Drained {
    /// The node serves no extent any more, after this long.
    Done(Duration),
    /// Not registered or no map applied: nothing to hand off.
    NotServing,
    /// The coordinator refused (the last alive node; not a member).
    Refused(String),
    /// The handoff did not finish in time.
    TimedOut,
}

#[derive(Clone)]
pub(crate) struct Agent {
    node: Arc<Node>,
    coords: Arc<Coordinators>,
    register: RegisterRequest,
    /// Heartbeat interval the coordinator asked for.
    interval: Arc<std::sync::Mutex<Duration>>,
    /// Set when leaving starts; never cleared.
    leaving: Arc<AtomicBool>,
}

/// Metadata entry of an `ALREADY_EXISTS` registration refusal: milliseconds
/// until the lease holding the node id runs out (the coordinator's
/// `error::LEASE_REMAINING_KEY`).
const LEASE_REMAINING_KEY: &str = "pagewire-lease-remaining-ms";

const CALL_TIMEOUT: Duration = Duration::from_secs(5);

fn request<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(CALL_TIMEOUT);
    r
}

/// The NUMA layout as the cache crate discovered it.
pub(crate) fn topology() -> Topology {
    let t = crate::numa::discover();
    Topology {
        numa_nodes: t
            .nodes
            .iter()
            .map(|n| NumaNode {
                os_index: u32::try_from(n.os_index).unwrap_or(u32::MAX),
                memory_bytes: n.memory_bytes,
                cpus: n
                    .cpus
                    .iter()
                    .map(|&c| u32::try_from(c).unwrap_or(u32::MAX))
                    .collect(),
            })
            .collect(),
        source: t.source.to_owned(),
        hostname: super::config::hostname().unwrap_or_default(),
    }
}

/// What a remote reader needs to READ this node's region: one descriptor
/// per transport serving it, all carrying the region epoch (see
/// `transports`). Empty when no transport serves it (readers use gRPC).
pub(crate) fn transports(node: &Node) -> Vec<TransportDescriptor> {
    node.served
        .as_ref()
        .map(|s| s.descriptors())
        .unwrap_or_default()
}

impl Agent {
    pub(crate) fn new(
        node: Arc<Node>,
        cfg: &Config,
        advertise: String,
        metrics_address: String,
        token: AttachToken,
        tls: Option<ClientTls>,
    ) -> Result<Self, DaemonError> {
        let coords = Coordinators::new(&cfg.coordinators()?, token, tls, Duration::from_secs(3))
            .map_err(|e| match e {
                CoordinatorsError::Net(e) => DaemonError::Net(e),
                other => DaemonError::Config {
                    key: "coordinator",
                    reason: other.to_string(),
                },
            })?;
        let register = RegisterRequest {
            node_id: node.node_id.clone(),
            grpc_address: advertise,
            metrics_address,
            capacity_bytes: cfg.capacity(),
            topology: Some(topology()),
            transports: Vec::new(),
            file_size: node.cache.backing().len(),
            page_size: u32::try_from(node.cache.page_size()).unwrap_or(u32::MAX),
            previous_incarnation: 0,
            compact_map: true,
        };
        Ok(Self {
            node,
            coords: Arc::new(coords),
            register,
            interval: Arc::new(std::sync::Mutex::new(Duration::from_secs(1))),
            leaving: Arc::new(AtomicBool::new(false)),
        })
    }

    fn leaving(&self) -> bool {
        // Pairs with the SeqCst store in `leave`: once it is set, no
        // registration starts after it.
        self.leaving.load(Ordering::SeqCst)
    }

    /// Registers, then heartbeats and watches the map, forever; returns only
    /// when the coordinator refuses this node for good (an error) or the
    /// node leaves (`Ok`).
    pub(crate) async fn run(&self) -> Result<(), DaemonError> {
        loop {
            if self.leaving() {
                return Ok(());
            }
            if !self.register().await? {
                return Ok(());
            }
            let generation = self.node.generation.load(Ordering::Acquire);
            let watcher = tokio::spawn(self.clone().watch_loop(generation));
            let why = self.heartbeat_loop().await;
            watcher.abort();
            let node = self.node.clone();
            let _ = tokio::task::spawn_blocking(move || node.lose_everything(why)).await;
        }
    }

    /// Registers; `Ok(false)` when leaving started meanwhile.
    async fn register(&self) -> Result<bool, DaemonError> {
        let mut backoff = Duration::from_millis(100);
        let mut waited_out = false;
        loop {
            if self.leaving() {
                return Ok(false);
            }
            let mut req = self.register.clone();
            req.transports = transports(&self.node);
            req.previous_incarnation = self.node.incarnation.load(Ordering::Relaxed);
            let sent = pagewire_client::clock::now();
            let generation = self.node.generation.load(Ordering::Acquire);
            let pick = self.coords.pick();
            match pick.client().register(request(req)).await {
                Ok(resp) => {
                    self.coords.succeeded(&pick);
                    let r = resp.into_inner();
                    self.node.index.store(r.node_index, Ordering::Relaxed);
                    self.node
                        .incarnation
                        .store(r.incarnation, Ordering::Relaxed);
                    self.node.registrations.fetch_add(1, Ordering::Relaxed);
                    if let Some(p) = r.policy {
                        self.apply_policy(p);
                    }
                    tracing::info!(
                        coordinator = pick.address(),
                        index = r.node_index,
                        incarnation = r.incarnation,
                        lease_ms = r.lease_ms,
                        "registered with the coordinator"
                    );
                    let lease = Duration::from_millis(r.lease_ms);
                    *self
                        .node
                        .lease_len
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = lease;
                    // The map comes compact: expanded here (shared code).
                    match r
                        .map
                        .map(|m| pagewire_proto::map::MapApplier::new().apply(m))
                    {
                        Some(Ok(map)) => self.apply_map(map, generation).await,
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "the registration's map is unusable; the map stream brings one");
                        }
                        None => {}
                    }
                    // The registration granted a lease for the map it carried.
                    self.node.lease.renew(sent, lease);
                    *self.interval.lock().unwrap_or_else(|e| e.into_inner()) =
                        Duration::from_millis(r.heartbeat_interval_ms.max(10));
                    return Ok(true);
                }
                Err(s) if s.code() == Code::AlreadyExists && !waited_out => {
                    // Maybe our own previous process, restarted at a new
                    // address: its lease runs out within one lease.
                    let wait = s
                        .metadata()
                        .get(LEASE_REMAINING_KEY)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<u64>().ok())
                        .map_or(Duration::from_secs(10), Duration::from_millis)
                        .min(Duration::from_secs(600));
                    tracing::warn!(
                        message = s.message(),
                        wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                        "node id in use; waiting once for that lease to run out"
                    );
                    tokio::time::sleep(wait + Duration::from_millis(50)).await;
                    waited_out = true;
                }
                Err(s)
                    if matches!(
                        s.code(),
                        Code::InvalidArgument
                            | Code::Unauthenticated
                            | Code::AlreadyExists
                            | Code::FailedPrecondition
                    ) =>
                {
                    return Err(DaemonError::Refused(format!(
                        "{:?}: {}",
                        s.code(),
                        s.message()
                    )));
                }
                Err(s) => {
                    tracing::warn!(coordinator = pick.address(), code = ?s.code(), message = s.message(), "registration failed; retrying");
                    if self.coords.failed(&pick, &s) != AfterFailure::RetryNow {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
            }
        }
    }

    fn interval(&self) -> Duration {
        *self.interval.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns (why) when the node must register again.
    async fn heartbeat_loop(&self) -> &'static str {
        let mut failing = false;
        // After a failover switch: send the next heartbeat at once.
        let mut retry_now = false;
        // While heartbeats fail: the wait before the next round, 100 ms
        // doubling to a quarter of the interval, so that a new leader
        // elected within the lease is found before it lapses (waiting a
        // whole interval let leases lapse in a leader failover: two tries
        // in the 4 s a lease had left, the new leader up between them).
        let mut failing_wait = FAILING_HEARTBEAT_FIRST;
        loop {
            if !std::mem::take(&mut retry_now) {
                let wait = if failing {
                    let w = failing_wait.min(self.interval() / 4);
                    failing_wait = (failing_wait * 2).min(self.interval() / 4);
                    w
                } else {
                    failing_wait = FAILING_HEARTBEAT_FIRST;
                    self.interval()
                };
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = self.node.heartbeat_now.notified() => {}
                }
            }
            if self.leaving() {
                return "leaving";
            }
            if self.node.lease.lapsed() {
                tracing::warn!("lease lapsed without a renewal; registering again");
                return "lease lapsed";
            }
            let applied = self.node.applied_epoch();
            let req = HeartbeatRequest {
                node_id: self.node.node_id.clone(),
                incarnation: self.node.incarnation.load(Ordering::Relaxed),
                applied_epoch: applied,
                stats: Some(self.node.stats()),
            };
            let sent = pagewire_client::clock::now();
            let pick = self.coords.pick();
            match pick.client().heartbeat(request(req)).await {
                Ok(resp) => {
                    self.coords.succeeded(&pick);
                    if failing {
                        tracing::info!("heartbeats go through again");
                        failing = false;
                    }
                    let resp = resp.into_inner();
                    let lease = Duration::from_millis(resp.lease_ms);
                    *self
                        .node
                        .lease_len
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = lease;
                    if resp.map_epoch <= applied {
                        self.node.lease.renew(sent, lease);
                    } else {
                        tracing::debug!(
                            applied,
                            current = resp.map_epoch,
                            "behind the coordinator's map: lease not renewed"
                        );
                    }
                    if let Some(p) = resp.policy {
                        self.apply_policy(p);
                    }
                }
                Err(s) if matches!(s.code(), Code::FailedPrecondition | Code::NotFound) => {
                    tracing::warn!(
                        message = s.message(),
                        "the coordinator no longer knows this registration; registering again"
                    );
                    return "declared dead";
                }
                Err(s) => {
                    self.node.heartbeat_failures.fetch_add(1, Ordering::Relaxed);
                    if !failing {
                        tracing::warn!(coordinator = pick.address(), code = ?s.code(), message = s.message(), "heartbeat failed; retrying");
                        failing = true;
                    }
                    retry_now = self.coords.failed(&pick, &s) == AfterFailure::RetryNow;
                }
            }
        }
    }

    async fn watch_loop(self, generation: u64) {
        let mut backoff = Duration::from_millis(100);
        // Compact maps and deltas, expanded here (shared code in proto).
        let mut compact = pagewire_proto::map::MapApplier::new();
        loop {
            compact.reset();
            let pick = self.coords.pick();
            let mut retry_now = false;
            match pick
                .client()
                .watch_map(WatchMapRequest {
                    min_epoch: 0,
                    compact: true,
                })
                .await
            {
                Ok(resp) => {
                    self.coords.succeeded(&pick);
                    let mut stream = resp.into_inner();
                    loop {
                        match stream.message().await.map(|m| m.map(|m| compact.apply(m))) {
                            Ok(Some(Err(e))) => {
                                tracing::warn!(error = %e, "unusable map; watching again");
                                break;
                            }
                            Ok(Some(Ok(map))) => {
                                // Never an older epoch than the applied one,
                                // even as a stream's first map (`Node::apply_map`).
                                self.apply_map(map, generation).await;
                                backoff = Duration::from_millis(100);
                            }
                            Ok(None) => break,
                            Err(s) => {
                                tracing::debug!(coordinator = pick.address(), code = ?s.code(), message = s.message(), "map stream broke");
                                retry_now = self.coords.failed(&pick, &s) == AfterFailure::RetryNow;
                                break;
                            }
                        }
                    }
                }
                Err(s) => {
                    tracing::debug!(coordinator = pick.address(), code = ?s.code(), message = s.message(), "cannot watch the map");
                    retry_now = self.coords.failed(&pick, &s) == AfterFailure::RetryNow;
                }
            }
            if !retry_now {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }

    /// Applies `map` on the blocking pool; it runs to the end even if this
    /// future is dropped.
    async fn apply_map(&self, map: OwnershipMap, generation: u64) {
        let node = self.node.clone();
        let _ = tokio::task::spawn_blocking(move || node.apply_map(map, generation)).await;
    }

    fn apply_policy(&self, p: pagewire_proto::v1::Policy) {
        let mut cur = self.node.policy.lock().unwrap_or_else(|e| e.into_inner());
        if p.version <= cur.version {
            return;
        }
        // The node reports what it applied, not what it was asked.
        let (applied, reported, refused) = super::policy::apply(&self.node.cache, &p);
        *cur = reported;
        if let Some(why) = refused {
            tracing::error!(
                version = p.version,
                %why,
                "policy refused in part: the cache keeps {applied}"
            );
        }
        tracing::info!(
            version = p.version,
            admission = applied.admission.name(),
            eviction = applied.eviction.name(),
            high = p.high_watermark_percent,
            low = p.low_watermark_percent,
            "policy applied"
        );
    }

    /// The planned half of a graceful shutdown: asks the coordinator to
    /// drain this node (it names new owners and keeps this node as the
    /// previous owner while they take over, so reads never lose a server),
    /// then waits until the applied map has this node serve no extent.
    /// Heartbeats and map application go on meanwhile (the agent still
    /// runs). Bounded by `timeout`; says how it ended.
    pub(crate) async fn drain(&self, timeout: Duration) -> Drained {
        let start = Instant::now();
        let end = start + timeout;
        if self.node.index.load(Ordering::Relaxed) == 0 || self.node.view().is_none() {
            return Drained::NotServing;
        }
        // Our incarnation: the drain ends with this process, so a restart
        // after a kill mid-drain serves again (an operator's drain would
        // stay).
        let req = DrainRequest {
            node_id: self.node.node_id.clone(),
            incarnation: self.node.incarnation.load(Ordering::Relaxed),
        };
        let mut backoff = Duration::from_millis(100);
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Drained::TimedOut;
            }
            let mut r = tonic::Request::new(req.clone());
            r.set_timeout(left.min(CALL_TIMEOUT));
            let pick = self.coords.pick();
            match pick.client().drain(r).await {
                Ok(resp) => {
                    self.coords.succeeded(&pick);
                    let resp = resp.into_inner();
                    tracing::info!(
                        epoch = resp.map_epoch,
                        extents = resp.extents_moved,
                        "draining: the coordinator is moving this node's extents"
                    );
                    break;
                }
                Err(s) if s.code() == Code::FailedPrecondition || s.code() == Code::NotFound => {
                    // The last alive node, or not a member (any more).
                    return Drained::Refused(s.message().to_owned());
                }
                Err(s) => {
                    if self.coords.failed(&pick, &s) != AfterFailure::RetryNow {
                        tracing::warn!(coordinator = pick.address(), code = ?s.code(), message = s.message(), "drain request failed; retrying");
                        tokio::time::sleep(backoff.min(left)).await;
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                    }
                }
            }
        }
        loop {
            let serving = self.node.view().map_or(0, |v| v.serving());
            if serving == 0 {
                return Drained::Done(start.elapsed());
            }
            if Instant::now() >= end {
                tracing::warn!(serving, "drain timed out with extents still served");
                return Drained::TimedOut;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Leaves the cluster on purpose (on shutdown), so extents move at once.
    /// From then on this process never registers again (the coordinator
    /// refuses it too).
    pub(crate) async fn leave(&self) {
        self.leaving.store(true, Ordering::SeqCst);
        let req = LeaveRequest {
            node_id: self.node.node_id.clone(),
            incarnation: self.node.incarnation.load(Ordering::Relaxed),
        };
        // Two seconds in all, whichever coordinators it takes.
        let end = Instant::now() + Duration::from_secs(2);
        loop {
            let left = end.saturating_duration_since(Instant::now());
            let mut r = tonic::Request::new(req.clone());
            r.set_timeout(left.max(Duration::from_millis(1)));
            let pick = self.coords.pick();
            match pick.client().leave(r).await {
                Ok(resp) => {
                    tracing::info!(epoch = resp.into_inner().map_epoch, "left the cluster");
                    return;
                }
                Err(s) => {
                    let again = self.coords.failed(&pick, &s) == AfterFailure::RetryNow;
                    if !again || Instant::now() >= end {
                        tracing::warn!(coordinator = pick.address(), code = ?s.code(), message = s.message(), "could not leave the cluster");
                        return;
                    }
                }
            }
        }
    }
}
