//! The node daemon: registers with the coordinator, renews its lease, follows
//! the ownership map (taking new extents, dropping the ones it no longer owns
//! nor hands off), serves the `pagewire.v1.Node` gRPC service from the local
//! [`crate::PageCache`], applies the pushed eviction watermarks, and
//! serves Prometheus `/metrics`.
//!
//! The `pagewire-node` binary is [`cli::main_from`]; the bench's one-binary
//! demo runs nodes through the same function. Under `--cfg loom` the module
//! is not built (tokio is not modelled).

mod agent;
pub mod cli;
pub(crate) mod config;
mod error;
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
mod gid;
mod lease;
mod metrics;
mod ownership;
mod policy;
mod remote_source;
mod service;
mod transports;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::PageCache;
use pagewire_proto::auth::{AttachToken, TokenCheck};
use pagewire_proto::net::{ClientTls, ServerTls};
use pagewire_proto::v1::node_server::NodeServer;
use pagewire_proto::v1::{NodeStats, OwnershipMap, Policy};
use tokio::net::TcpListener;
use tokio::sync::Notify;

pub(crate) use config::Config;
pub(crate) use error::DaemonError;
use lease::Lease;
pub(crate) use ownership::{MapView, PageSource};

/// State shared by the gRPC service, the coordinator agent and metrics.
pub(crate) struct Node {
    pub(crate) node_id: String,
    pub(crate) cache: Arc<PageCache>,
    /// The transports serving the cache's region (None in unit tests).
    pub(crate) served: Option<transports::Served>,
    /// The applied map. A data call holds a read guard from its ownership
    /// check until its cache work is done, so installing a new map waits for
    /// the calls admitted under the old one, and nothing admitted under the
    /// old one can fault a page of a dropped extent in after its eviction.
    pub(crate) view: RwLock<Option<Arc<MapView>>>,
    /// Serialises map application, evictions included.
    apply_lock: Mutex<()>,
    /// Epoch whose application (evictions included) completed; 0: none.
    pub(crate) applied: AtomicU64,
    /// Bumped each time this node loses everything: an application started
    /// for an older registration is dropped.
    pub(crate) generation: AtomicU64,
    pub(crate) lease: Lease,
    /// Lease length the coordinator last announced.
    pub(crate) lease_len: Mutex<Duration>,
    /// Where pages of extents this node does not serve come from (None:
    /// refused as a stale map).
    pub(crate) page_source: Option<Arc<dyn PageSource>>,
    /// The same source, typed, for its counters.
    pub(crate) one_sided: Option<Arc<pagewire_client::OwnerPool>>,
    pub(crate) index: AtomicU32,
    pub(crate) incarnation: AtomicU64,
    /// The last pushed policy as applied (a refused part reads as what
    /// the cache kept).
    pub(crate) policy: Mutex<Policy>,
    pub(crate) bytes_served: AtomicU64,
    /// Fault-ins answered as `tcp` transport calls
    /// ([`service::serve_calls`]).
    pub(crate) fault_calls: AtomicU64,
    /// gRPC `Read` calls answered (any outcome).
    pub(crate) grpc_reads: AtomicU64,
    /// Their latency: [served from this node's cache alone, with pages
    /// read from their owners].
    /// Latency of answered gRPC Reads, by [`service::ReadPath`].
    pub(crate) grpc_read_seconds: [prometheus_client::metrics::histogram::Histogram; 3],
    /// Leases lost (every extent dropped until the node registers again).
    pub(crate) lease_losses: AtomicU64,
    pub(crate) stale_rejections: AtomicU64,
    pub(crate) lease_rejections: AtomicU64,
    pub(crate) heartbeat_failures: AtomicU64,
    pub(crate) registrations: AtomicU64,
    /// Maps refused for an epoch older than the applied one.
    pub(crate) older_maps_refused: AtomicU64,
    pub(crate) max_pages_per_call: u64,
    /// Wakes the heartbeat loop at once (after a map is applied).
    pub(crate) heartbeat_now: Notify,
    /// Set when a graceful shutdown starts: `/readyz` answers 503 from then.
    pub(crate) draining: std::sync::atomic::AtomicBool,
}

impl Node {
    fn new(
        cfg: &Config,
        node_id: String,
        cache: Arc<PageCache>,
        served: Option<transports::Served>,
        page_source: Option<Arc<pagewire_client::OwnerPool>>,
    ) -> Self {
        Node {
            node_id,
            cache,
            served,
            one_sided: page_source.clone(),
            view: RwLock::new(None),
            apply_lock: Mutex::new(()),
            applied: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            lease: Lease::new(Duration::from_millis(cfg.clock_drift_margin_ms)),
            lease_len: Mutex::new(Duration::ZERO),
            page_source: page_source.map(|p| p as Arc<dyn PageSource>),
            index: AtomicU32::new(0),
            incarnation: AtomicU64::new(0),
            policy: Mutex::new(Policy::default()),
            bytes_served: AtomicU64::new(0),
            fault_calls: AtomicU64::new(0),
            grpc_reads: AtomicU64::new(0),
            grpc_read_seconds: std::array::from_fn(|_| metrics::latency_histogram()),
            lease_losses: AtomicU64::new(0),
            stale_rejections: AtomicU64::new(0),
            lease_rejections: AtomicU64::new(0),
            heartbeat_failures: AtomicU64::new(0),
            registrations: AtomicU64::new(0),
            older_maps_refused: AtomicU64::new(0),
            max_pages_per_call: cfg.max_pages_per_call,
            heartbeat_now: Notify::new(),
            draining: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Readiness (`/readyz`): registered, a map applied, the lease valid,
    /// the transports serving, and not shutting down; otherwise why not.
    pub(crate) fn readiness(&self) -> Result<(), String> {
        if self.draining.load(Ordering::Relaxed) {
            return Err("shutting down: draining".into());
        }
        if self.index.load(Ordering::Relaxed) == 0 {
            return Err("not registered with the coordinator yet".into());
        }
        if self.applied_epoch() == 0 {
            return Err("no ownership map applied".into());
        }
        if !self.lease.valid() {
            return Err("no valid lease (no renewed heartbeat)".into());
        }
        if self.served.is_none() {
            return Err("the region is not served".into());
        }
        Ok(())
    }

    pub(crate) fn view(&self) -> Option<Arc<MapView>> {
        self.view.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The epoch whose application completed (what heartbeats report).
    pub(crate) fn applied_epoch(&self) -> u64 {
        self.applied.load(Ordering::Acquire)
    }

    /// Applies `map` (blocking: evictions read the cache), unless it was
    /// received for a registration this node has since lost (`generation`),
    /// it is the applied map again, or it is older than the applied one.
    /// Runs to the end once started: callers await it on the blocking pool,
    /// where a cancelled caller does not stop it.
    ///
    /// An older epoch is never applied, whoever sends it: a coordinator's
    /// copy can lag (a follower's, an ex-leader's rolled back after a failed
    /// save), and rolling back could hand this node extents that have moved
    /// and been written since. The one case where epochs legitimately go
    /// down, a coordinator that lost its state, also forgets this node's
    /// registration: the node registers again and loses everything first,
    /// so its next map is applied with no view to compare with. The same
    /// epoch with other content (which no coordinator that kept its state
    /// sends) is applied as a gap: everything is evicted.
    pub(crate) fn apply_map(&self, map: OwnershipMap, generation: u64) {
        let _serial = self.apply_lock.lock().unwrap_or_else(|e| e.into_inner());
        if self.generation.load(Ordering::Acquire) != generation {
            tracing::debug!(epoch = map.epoch, "map for a lost registration; ignored");
            return;
        }
        let old = self.view();
        if let Some(old) = &old {
            if map.epoch < old.map.epoch {
                self.older_maps_refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    epoch = map.epoch,
                    applied = old.map.epoch,
                    "a coordinator sent a map older than the applied one; not rolling back"
                );
                return;
            }
            if map.epoch == old.map.epoch && *old.map == map {
                return;
            }
        }
        let page_size = self.cache.page_size() as u64;
        if map.extent_size == 0 || !map.extent_size.is_multiple_of(page_size) {
            tracing::error!(
                extent_size = map.extent_size,
                page_size,
                "map has an extent size this node cannot use; ignored"
            );
            return;
        }
        let fence = *self.lease_len.lock().unwrap_or_else(|e| e.into_inner()) + self.lease.margin();
        let ppe = map.extent_size / page_size;
        // Readahead stays within the faulting page's extent: a page of an
        // extent this node does not answer for must never enter its cache
        // (it would be served, stale, if that extent came here later). A
        // change of extent size changes the extent count too, which makes
        // the plan below evict everything.
        self.cache.set_extent_pages(ppe);
        let plan = MapView::plan(
            old.as_deref(),
            map,
            self.index.load(Ordering::Relaxed),
            ppe,
            fence,
            Instant::now(),
        );
        let (epoch, owned) = (plan.view.map.epoch, plan.view.owned());
        let evicted = if plan.evict_all {
            // Any cached page may be stale: answer nothing until every page
            // is gone (taking the write lock waits for the calls admitted
            // under the old view).
            *self.view.write().unwrap_or_else(|e| e.into_inner()) = None;
            let n = self.cache.evict_range(0, self.cache.pages()).0;
            *self.view.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(plan.view));
            n
        } else {
            // Install first (waiting for the calls admitted under the old
            // view): from here on, calls for dropped extents are refused, so
            // nothing faults them back in while they are evicted, and what
            // the new view answers from the cache it answered before.
            *self.view.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(plan.view));
            plan.evict
                .iter()
                .map(|&e| self.cache.evict_range(e as u64 * ppe, ppe).0)
                .sum::<u64>()
        };
        if cfg!(any(debug_assertions, feature = "strict_assertions")) {
            self.check_only_served_pages_cached();
        }
        self.applied.store(epoch, Ordering::Release);
        tracing::info!(
            epoch,
            owned,
            evicted_pages = evicted,
            all = plan.evict_all,
            "applied ownership map"
        );
        self.heartbeat_now.notify_one();
    }

    /// Debug builds and strict mode (`strict_assertions`): the invariant
    /// the evictions keep, checked after each map is applied: only extents
    /// this node answers from its cache (owned outright, or handed off)
    /// have pages in it. Panics naming the page.
    fn check_only_served_pages_cached(&self) {
        let Some(view) = self.view() else { return };
        if let Some(page) = self
            .cache
            .cached_pages_outside(|p| view.role(view.extent_of(p)).cached())
        {
            panic!(
                "strict: page {page} (extent {}) is cached, but this node does not answer for \
                 that extent at epoch {} (role {:?})",
                view.extent_of(page),
                view.map.epoch,
                view.role(view.extent_of(page))
            );
        }
    }

    /// Treats every extent as lost (lease lapsed, declared dead, leaving):
    /// stops answering, drops the map and evicts the whole cache. A later
    /// map starts from nothing. Blocking, like [`Node::apply_map`].
    pub(crate) fn lose_everything(&self, why: &str) {
        self.lease.revoke();
        self.generation.fetch_add(1, Ordering::AcqRel);
        let _serial = self.apply_lock.lock().unwrap_or_else(|e| e.into_inner());
        *self.view.write().unwrap_or_else(|e| e.into_inner()) = None;
        let evicted = self.cache.evict_range(0, self.cache.pages()).0;
        self.applied.store(0, Ordering::Release);
        self.lease_losses.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(why, evicted_pages = evicted, "lost every extent");
    }

    pub(crate) fn stats(&self) -> NodeStats {
        let s = self.cache.stats();
        let frames = self.cache.config().frames as u64;
        NodeStats {
            hits: s.hits,
            misses: s.misses,
            faults: s.faults,
            evictions: s.evictions,
            retries: s.retries,
            bytes_served: self.bytes_served.load(Ordering::Relaxed),
            writes: s.writes,
            pages_resident: frames.saturating_sub(self.cache.free_frames() as u64),
            capacity_pages: frames,
            extents_owned: self.view().map_or(0, |v| v.owned()),
            stale_map_rejections: self.stale_rejections.load(Ordering::Relaxed),
            admissions_skipped: s.admissions_skipped,
            verbs_queue_pairs: self.served.as_ref().map_or(0, |s| s.verbs_queue_pairs()),
            verbs_refused: self.served.as_ref().map_or(0, |s| s.verbs_refused()),
            ..self.remote_stats()
        }
    }

    /// The one-sided path's counters, in `NodeStats` form.
    fn remote_stats(&self) -> NodeStats {
        let Some(src) = &self.one_sided else {
            return NodeStats::default();
        };
        let r = src.reader_stats();
        let p = src.stats();
        NodeStats {
            remote_pages: p.pages,
            remote_one_sided: p.one_sided,
            remote_fallbacks: p.fallbacks,
            remote_round_trips: r.round_trips,
            remote_retries: r.retries,
            remote_validation_failures: r.validation_failures,
            ..NodeStats::default()
        }
    }
}

/// The local address this host sends from towards the first coordinator
/// (what a node listening on a wildcard address advertises): a UDP socket
/// connected there, which sends nothing. Waits (up to a minute) while the
/// coordinator's name does not resolve yet, as in a cluster whose DNS lists
/// the coordinator only once it runs.
async fn route_to_coordinator(coordinators: &[String]) -> Result<std::net::IpAddr, DaemonError> {
    let first = coordinators.first().map(String::as_str).unwrap_or_default();
    let target = pagewire_proto::leader::host_port(first);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut warned = false;
    loop {
        let resolved = tokio::net::lookup_host(target).await.map(|mut a| a.next());
        match resolved {
            Ok(Some(addr)) => {
                let any: SocketAddr = if addr.is_ipv4() {
                    (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
                } else {
                    (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
                };
                let sock = std::net::UdpSocket::bind(any)
                    .and_then(|s| s.connect(addr).map(|()| s))
                    .and_then(|s| s.local_addr());
                return sock.map(|a| a.ip()).map_err(|e| DaemonError::Config {
                    key: "advertise",
                    reason: format!(
                        "empty with a wildcard listen address, and no route to the coordinator {addr} to take this host's address from: {e}; set advertise"
                    ),
                });
            }
            Ok(None) | Err(_) if Instant::now() < deadline => {
                if !warned {
                    tracing::warn!(
                        coordinator = target,
                        "the coordinator's address does not resolve yet; waiting to pick the address to advertise"
                    );
                    warned = true;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            other => {
                return Err(DaemonError::Config {
                    key: "advertise",
                    reason: format!(
                        "empty with a wildcard listen address, and the coordinator {target:?} did not resolve within a minute ({}); set advertise",
                        match other {
                            Err(e) => e.to_string(),
                            _ => "no address".to_owned(),
                        }
                    ),
                });
            }
        }
    }
}

async fn bind(addr: &str) -> Result<TcpListener, DaemonError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| DaemonError::Bind {
            addr: addr.to_owned(),
            source,
        })
}

/// Runs the daemon until the first message on `signals` (then, when
/// configured to, drains and leaves the cluster: [`shutdown`]; a second
/// message stops it at once), or until the coordinator refuses it for good.
pub(crate) async fn run(
    cfg: Config,
    token: String,
    mut signals: tokio::sync::mpsc::UnboundedReceiver<()>,
) -> Result<(), DaemonError> {
    cfg.validate()?;
    let mut cfg = cfg;
    let node_id = cfg.node_id();
    // Bound first: the advertised address (and the tcp transport's, which
    // takes its host) may depend on the port it got.
    let grpc = bind(&cfg.listen).await?;
    let grpc_addr: SocketAddr = grpc.local_addr().map_err(|source| DaemonError::Bind {
        addr: cfg.listen.clone(),
        source,
    })?;
    if cfg.advertise.is_empty() {
        let ip = if grpc_addr.ip().is_unspecified() {
            route_to_coordinator(&cfg.coordinators()?).await?
        } else {
            grpc_addr.ip()
        };
        cfg.advertise = SocketAddr::new(ip, grpc_addr.port()).to_string();
        tracing::info!(advertise = %cfg.advertise, "advertising this address");
    }
    let (cache, served) = {
        let (cfg, node_id, token) = (cfg.clone(), node_id.clone(), token.clone());
        tokio::task::spawn_blocking(move || transports::open(&cfg, &node_id, &token))
            .await
            .map_err(|e| DaemonError::Internal(e.to_string()))??
    };
    tracing::info!(
        node = %node_id,
        file = %cfg.backing_file.display(),
        pages = cache.pages(),
        frames = cache.config().frames,
        placement = %cache.placement().how,
        region_epoch = served.epoch,
        "cache open"
    );
    let source = Arc::new(remote_source::pool(
        &token,
        cache.page_size(),
        cfg.tls.peer(),
    )?);
    let node = Arc::new(Node::new(&cfg, node_id, cache, Some(served), Some(source)));
    service::serve_calls(&node);
    for t in node.served.iter().flat_map(|s| s.descriptors()) {
        tracing::info!(kind = %t.kind, endpoint = %t.endpoint, rkey = t.rkey, epoch = t.epoch, "serving the region one-sidedly");
    }

    let check = TokenCheck::new(&token).map_err(|e| DaemonError::Config {
        key: "token",
        reason: e.to_string(),
    })?;
    let mut tasks = tokio::task::JoinSet::new();
    let mut metrics_addr = String::new();
    if !cfg.metrics_listen.is_empty() {
        let l = bind(&cfg.metrics_listen).await?;
        metrics_addr = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
        let registry = Arc::new(metrics::registry(node.clone(), check.refusals()));
        let ready = node.clone();
        tasks.spawn(pagewire_proto::metrics_http::serve(
            l,
            pagewire_proto::metrics_http::Routes {
                metrics: Arc::new(move || metrics::render(&registry)),
                ready: Arc::new(move || ready.readiness()),
            },
        ));
    }
    let advertise = cfg.advertise.clone();

    let attach = AttachToken::new(&token).map_err(|e| DaemonError::Config {
        key: "token",
        reason: e.to_string(),
    })?;
    let coord_tls = cfg
        .tls
        .coordinator_ca_file
        .clone()
        .map(|ca_file| ClientTls {
            ca_file,
            domain: cfg.tls.coordinator_domain.clone(),
        });
    let agent = agent::Agent::new(
        node.clone(),
        &cfg,
        advertise,
        metrics_addr.clone(),
        attach,
        coord_tls,
    )?;
    let (fatal_tx, mut fatal_rx) = tokio::sync::mpsc::channel::<DaemonError>(1);
    let agent_task = {
        let agent = agent.clone();
        tasks.spawn(async move {
            if let Err(e) = agent.run().await {
                let _ = fatal_tx.send(e).await;
            }
        })
    };
    tasks.spawn(service::watermark_loop(
        node.clone(),
        Duration::from_millis(200),
    ));

    // TCP_NODELAY is set per accepted connection by `net::incoming`.
    let mut server = tonic::transport::Server::builder();
    if let (Some(cert_file), Some(key_file)) = (&cfg.tls.cert_file, &cfg.tls.key_file) {
        let tls = ServerTls {
            cert_file: cert_file.clone(),
            key_file: key_file.clone(),
            client_ca_file: cfg.tls.client_ca_file.clone(),
        };
        server = server.tls_config(tls.config()?)?;
    }
    let svc = tonic::service::interceptor::InterceptedService::new(
        NodeServer::new(service::NodeService { node: node.clone() })
            .max_decoding_message_size(16 << 20)
            .max_encoding_message_size(256 << 20),
        check,
    );
    tracing::info!(
        grpc = %grpc_addr,
        metrics = %if metrics_addr.is_empty() { "off" } else { metrics_addr.as_str() },
        "node listening"
    );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serve = server.add_service(svc).serve_with_incoming_shutdown(
        pagewire_proto::net::incoming(grpc),
        async {
            let _ = stop_rx.await;
        },
    );
    tokio::pin!(serve);
    let outcome = tokio::select! {
        r = &mut serve => r.map_err(DaemonError::from),
        Some(e) = fatal_rx.recv() => Err(e),
        Some(()) = signals.recv() => {
            tracing::info!("shutting down");
            // The server keeps accepting while the drain runs: readers of
            // extents in handoff still come here.
            tokio::select! {
                r = &mut serve => r.map_err(DaemonError::from),
                () = shutdown(&node, &agent, agent_task, &cfg, &mut signals) => Ok(()),
            }
        }
    };
    let _ = stop_tx.send(());
    tasks.abort_all();
    outcome
}

/// The graceful shutdown: stop reporting ready, drain through a planned
/// handoff (bounded by `shutdown_drain_timeout_ms`), stop answering, leave.
/// A message on `signals` meanwhile cuts it short: the node stops at once
/// (its extents then move when its lease runs out).
async fn shutdown(
    node: &Arc<Node>,
    agent: &agent::Agent,
    agent_task: tokio::task::AbortHandle,
    cfg: &Config,
    signals: &mut tokio::sync::mpsc::UnboundedReceiver<()>,
) {
    node.draining.store(true, Ordering::Relaxed);
    // Stop answering before the coordinator can move anything more, and no
    // heartbeat or registration after this: leaving is final.
    let stop_serving = || {
        node.lease.revoke();
        agent_task.abort();
    };
    if !cfg.leave_on_shutdown {
        stop_serving();
        return;
    }
    let graceful = async {
        let timeout = Duration::from_millis(cfg.shutdown_drain_timeout_ms);
        match agent.drain(timeout).await {
            agent::Drained::Done(took) => {
                tracing::info!(
                    took_ms = took.as_millis() as u64,
                    "drained: every extent handed over"
                );
            }
            agent::Drained::NotServing => tracing::info!("nothing to hand over"),
            agent::Drained::Refused(why) => {
                tracing::warn!(%why, "the coordinator refused the drain; leaving without a handoff");
            }
            agent::Drained::TimedOut => tracing::warn!(
                timeout_ms = cfg.shutdown_drain_timeout_ms,
                "drain timed out; leaving with extents still served"
            ),
        }
        stop_serving();
        agent.leave().await;
    };
    tokio::select! {
        () = graceful => {}
        Some(()) = signals.recv() => {
            stop_serving();
            tracing::warn!("second signal: exiting at once, without finishing the drain");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use crate::{CacheConfig, PageCache};
    use pagewire_proto::v1::OwnershipMap;

    use super::{Config, Node};

    pub(super) const PAGE: u64 = 4096;
    /// Four extents of four pages.
    pub(super) const PPE: u64 = 4;

    pub(super) fn node() -> (tempfile::TempDir, Node) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(4 * PPE * PAGE)
            .unwrap();
        let cache = PageCache::open(
            &path,
            CacheConfig {
                frames: 64,
                readahead_max: 0,
                ..Default::default()
            },
        )
        .unwrap();
        let node = Node::new(
            &Config::default(),
            "t".into(),
            std::sync::Arc::new(cache),
            None,
            None,
        );
        node.index.store(1, Ordering::Relaxed);
        (dir, node)
    }

    pub(super) fn map(epoch: u64, owner: &[u32]) -> OwnershipMap {
        OwnershipMap {
            epoch,
            extent_size: PPE * PAGE,
            page_size: PAGE as u32,
            owner: owner.to_vec(),
            ..Default::default()
        }
    }

    fn cached(node: &Node, page: u64) -> bool {
        node.cache.lookup(page).is_some()
    }

    #[test]
    fn applying_maps_evicts_what_is_no_longer_served_and_everything_after_a_gap() {
        let (_dir, node) = node();
        let registration = node.generation.load(Ordering::Acquire);
        node.apply_map(map(1, &[1, 1, 2, 1]), registration);
        assert_eq!(node.applied_epoch(), 1);
        for p in [0, PPE, 3 * PPE] {
            node.cache.get(p).unwrap();
        }
        // Consecutive epoch: extent 1 goes (evicted), 0 and 3 stay cached.
        node.apply_map(map(2, &[1, 2, 2, 1]), registration);
        assert!(cached(&node, 0) && cached(&node, 3 * PPE));
        assert!(!cached(&node, PPE), "a dropped extent kept its pages");
        // A skipped epoch: extent 0 may have moved away and back meanwhile.
        node.apply_map(map(4, &[1, 2, 2, 1]), registration);
        assert!(!cached(&node, 0) && !cached(&node, 3 * PPE));
        assert_eq!(node.applied_epoch(), 4);
        // Losing everything: no map, nothing cached, later maps of that
        // registration ignored.
        node.cache.get(0).unwrap();
        node.lose_everything("test");
        assert!(node.view().is_none() && !cached(&node, 0));
        assert_eq!(node.applied_epoch(), 0);
        node.apply_map(map(5, &[1, 1, 1, 1]), registration);
        assert!(
            node.view().is_none(),
            "applied a map of a lost registration"
        );
    }
}

/// Issue 18, finding 7: a read of a page this node does not serve goes to
/// the owner over the network; no lock the map's application needs may be
/// held meanwhile.
#[cfg(test)]
mod frozen_owner_tests {
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex, mpsc};
    use std::time::{Duration, Instant};

    use pagewire_proto::v1::node_server::Node as _;
    use pagewire_proto::v1::{MapNode, OwnershipMap, PageRun, ReadRequest};

    use super::service::NodeService;
    use super::{DaemonError, PageSource};

    use super::tests::{PAGE, PPE};

    /// An owner that does not answer (frozen) until told to.
    struct Frozen {
        entered: Mutex<Option<mpsc::Sender<()>>>,
        release: Mutex<mpsc::Receiver<()>>,
    }

    impl PageSource for Frozen {
        fn read(
            &self,
            _owner: &MapNode,
            _epoch: u64,
            _first: u64,
            count: u64,
        ) -> Result<super::ownership::Sourced, DaemonError> {
            if let Some(tx) = self.entered.lock().unwrap().take() {
                let _ = tx.send(());
            }
            let _ = self
                .release
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(10));
            Ok(super::ownership::Sourced {
                data: vec![0; (count * PAGE) as usize],
                generations: vec![0; count as usize],
                faulted_in: false,
            })
        }
    }

    /// The tests' map, naming nodes 1 and 2 (a non-owner read needs the
    /// owner's entry).
    fn map(epoch: u64, owner: &[u32]) -> OwnershipMap {
        OwnershipMap {
            nodes: [1, 2]
                .into_iter()
                .map(|index| MapNode {
                    index,
                    node_id: format!("n{index}"),
                    ..Default::default()
                })
                .collect(),
            ..super::tests::map(epoch, owner)
        }
    }

    #[test]
    fn a_frozen_owner_does_not_hold_up_the_next_map() {
        let (_dir, mut node) = super::tests::node();
        let (entered_tx, entered) = mpsc::channel();
        let (release, release_rx) = mpsc::channel();
        node.page_source = Some(Arc::new(Frozen {
            entered: Mutex::new(Some(entered_tx)),
            release: Mutex::new(release_rx),
        }));
        node.lease.renew(Instant::now(), Duration::from_secs(30));
        let node = Arc::new(node);
        let generation = node.generation.load(Ordering::Acquire);
        node.apply_map(map(1, &[1, 2, 2, 1]), generation);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let svc = NodeService { node: node.clone() };
        // A read of extent 1 (node 2's): it waits on the frozen owner.
        let read = rt.spawn(async move {
            svc.read(tonic::Request::new(ReadRequest {
                run: Some(PageRun {
                    first_page: PPE,
                    page_count: 1,
                }),
                map_epoch: 1,
            }))
            .await
        });
        entered
            .recv_timeout(Duration::from_secs(10))
            .expect("the read reached the owner");
        // The next map must apply while that read waits.
        let (done_tx, done) = mpsc::channel();
        let n = node.clone();
        std::thread::spawn(move || {
            n.apply_map(map(2, &[1, 2, 2, 2]), generation);
            let _ = done_tx.send(());
        });
        let applied = done.recv_timeout(Duration::from_secs(2)).is_ok();
        let _ = release.send(());
        let answer = rt.block_on(read).unwrap();
        assert!(
            applied,
            "the map's application waited for a read stuck on a frozen owner"
        );
        assert_eq!(node.applied_epoch(), 2);
        assert!(answer.is_ok(), "{answer:?}");
    }
}
