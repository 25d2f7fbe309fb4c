//! The node's side of membership: register, heartbeat, follow the map.
//!
//! * Register (retrying while the coordinator is unreachable; a refusal such
//!   as a file size mismatch stops the daemon with the coordinator's message).
//! * Heartbeat every interval the coordinator asked for, carrying the applied
//!   map epoch and the cache counters; a reply that says the node was declared
//!   dead or re-registered elsewhere sends it back to registration.
//! * Watch the map: for each new epoch, drop (evict) the extents this node
//!   neither owns nor hands off any more, start serving the new ones (a page
//!   of a new extent is faulted in from the backing file on first use), then
//!   heartbeat at once so the coordinator can finish the handoff.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use pagewire_proto::auth::AttachToken;
use pagewire_proto::net::{self, ClientTls};
use pagewire_proto::v1::coordinator_client::CoordinatorClient;
use pagewire_proto::v1::{
    HeartbeatRequest, LeaveRequest, NumaNode, OwnershipMap, RegisterRequest, Topology,
    TransportDescriptor, WatchMapRequest,
};
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use super::{Config, DaemonError, MapView, Node};

type Client = CoordinatorClient<InterceptedService<Channel, AttachToken>>;

#[derive(Clone)]
pub(crate) struct Agent {
    node: Arc<Node>,
    client: Client,
    register: RegisterRequest,
    /// Heartbeat interval the coordinator asked for.
    interval: Arc<std::sync::Mutex<Duration>>,
}

const CALL_TIMEOUT: Duration = Duration::from_secs(5);

fn request<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(CALL_TIMEOUT);
    r
}

/// The NUMA layout as the cache crate discovered it.
pub(crate) fn topology() -> Topology {
    let t = pagewire_node::numa::discover();
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

/// What a remote reader needs to find this node's registered region. Until
/// a transport (crate `rdma`) registers it, the descriptor names the region
/// itself: kind `local`, its address and length in this process, and the
/// incarnation as the epoch.
pub(crate) fn transports(node: &Node) -> Vec<TransportDescriptor> {
    let r = node.cache.region();
    vec![TransportDescriptor {
        kind: "local".into(),
        endpoint: String::new(),
        address: r.addr as u64,
        length: r.len as u64,
        rkey: 0,
        epoch: node.incarnation.load(Ordering::Relaxed),
        opaque: Vec::new(),
    }]
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
        let channel = net::connect_lazy(&cfg.coordinator, tls.as_ref(), Duration::from_secs(3))?;
        let client = CoordinatorClient::with_interceptor(channel, token)
            .max_decoding_message_size(256 << 20);
        let register = RegisterRequest {
            node_id: node.node_id.clone(),
            grpc_address: advertise,
            metrics_address,
            capacity_bytes: cfg.capacity(),
            topology: Some(topology()),
            transports: Vec::new(),
            file_size: node.cache.backing().len(),
            page_size: u32::try_from(node.cache.page_size()).unwrap_or(u32::MAX),
        };
        Ok(Self {
            node,
            client,
            register,
            interval: Arc::new(std::sync::Mutex::new(Duration::from_secs(1))),
        })
    }

    /// Registers, then heartbeats and watches the map, forever; returns only
    /// when the coordinator refuses this node for good.
    pub(crate) async fn run(&self) -> Result<(), DaemonError> {
        loop {
            self.register().await?;
            let watcher = tokio::spawn(self.clone().watch_loop());
            self.heartbeat_loop().await;
            watcher.abort();
        }
    }

    async fn register(&self) -> Result<(), DaemonError> {
        let mut backoff = Duration::from_millis(100);
        loop {
            let mut req = self.register.clone();
            req.transports = transports(&self.node);
            match self.client.clone().register(request(req)).await {
                Ok(resp) => {
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
                        index = r.node_index,
                        incarnation = r.incarnation,
                        lease_ms = r.lease_ms,
                        "registered with the coordinator"
                    );
                    if let Some(map) = r.map {
                        self.apply_map(map).await;
                    }
                    *self.interval.lock().unwrap_or_else(|e| e.into_inner()) =
                        Duration::from_millis(r.heartbeat_interval_ms.max(10));
                    return Ok(());
                }
                Err(s)
                    if s.code() == Code::InvalidArgument || s.code() == Code::Unauthenticated =>
                {
                    return Err(DaemonError::Refused(format!(
                        "{:?}: {}",
                        s.code(),
                        s.message()
                    )));
                }
                Err(s) => {
                    tracing::warn!(code = ?s.code(), message = s.message(), "registration failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    fn interval(&self) -> Duration {
        *self.interval.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns when the node must register again.
    async fn heartbeat_loop(&self) {
        let mut failing = false;
        loop {
            tokio::select! {
                () = tokio::time::sleep(self.interval()) => {}
                () = self.node.heartbeat_now.notified() => {}
            }
            let req = HeartbeatRequest {
                node_id: self.node.node_id.clone(),
                incarnation: self.node.incarnation.load(Ordering::Relaxed),
                applied_epoch: self.node.applied_epoch(),
                stats: Some(self.node.stats()),
            };
            match self.client.clone().heartbeat(request(req)).await {
                Ok(resp) => {
                    if failing {
                        tracing::info!("heartbeats go through again");
                        failing = false;
                    }
                    if let Some(p) = resp.into_inner().policy {
                        self.apply_policy(p);
                    }
                }
                Err(s) if matches!(s.code(), Code::FailedPrecondition | Code::NotFound) => {
                    tracing::warn!(
                        message = s.message(),
                        "the coordinator no longer knows this registration; registering again"
                    );
                    return;
                }
                Err(s) => {
                    self.node.heartbeat_failures.fetch_add(1, Ordering::Relaxed);
                    if !failing {
                        tracing::warn!(code = ?s.code(), message = s.message(), "heartbeat failed; retrying");
                        failing = true;
                    }
                }
            }
        }
    }

    async fn watch_loop(self) {
        let mut backoff = Duration::from_millis(100);
        loop {
            match self
                .client
                .clone()
                .watch_map(WatchMapRequest { min_epoch: 0 })
                .await
            {
                Ok(resp) => {
                    let mut stream = resp.into_inner();
                    let mut first = true;
                    loop {
                        match stream.message().await {
                            Ok(Some(map)) => {
                                // The first map of a stream is the coordinator's
                                // current one: authoritative even if its epoch
                                // went down (a coordinator started afresh).
                                self.apply_map_inner(map, first).await;
                                first = false;
                                backoff = Duration::from_millis(100);
                            }
                            Ok(None) => break,
                            Err(s) => {
                                tracing::debug!(code = ?s.code(), message = s.message(), "map stream broke");
                                break;
                            }
                        }
                    }
                }
                Err(s) => {
                    tracing::debug!(code = ?s.code(), message = s.message(), "cannot watch the map");
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    async fn apply_map(&self, map: OwnershipMap) {
        self.apply_map_inner(map, true).await;
    }

    async fn apply_map_inner(&self, map: OwnershipMap, authoritative: bool) {
        let old = self.node.view();
        if let Some(old) = &old
            && (map.epoch < old.map.epoch || (map.epoch == old.map.epoch && !authoritative))
        {
            return;
        }
        let page_size = self.node.cache.page_size() as u64;
        if map.extent_size == 0 || !map.extent_size.is_multiple_of(page_size) {
            tracing::error!(
                extent_size = map.extent_size,
                page_size,
                "map has an extent size this node cannot use; ignored"
            );
            return;
        }
        let view = MapView {
            me: self.node.index.load(Ordering::Relaxed),
            pages_per_extent: map.extent_size / page_size,
            map: Arc::new(map),
        };
        let held = |v: &MapView| -> BTreeSet<usize> {
            (0..v.map.owner.len()).filter(|&e| v.serves(e)).collect()
        };
        let new_held = held(&view);
        let dropped: Vec<usize> = old
            .as_ref()
            .map(|o| held(o).difference(&new_held).copied().collect())
            .unwrap_or_default();
        let gained = match &old {
            Some(o) => new_held.difference(&held(o)).count(),
            None => new_held.len(),
        };
        let (epoch, ppe) = (view.map.epoch, view.pages_per_extent);
        let owned = view.owned();
        // Install first: from here on, calls for dropped extents are refused
        // as stale, so nothing faults them back in while they are evicted.
        *self.node.view.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(view));
        let mut evicted = 0;
        if !dropped.is_empty() {
            let cache = self.node.cache.clone();
            evicted = tokio::task::spawn_blocking(move || {
                dropped
                    .iter()
                    .map(|&e| cache.evict_range(e as u64 * ppe, ppe).0)
                    .sum::<u64>()
            })
            .await
            .unwrap_or(0);
        }
        tracing::info!(
            epoch,
            owned,
            gained,
            evicted_pages = evicted,
            "applied ownership map"
        );
        self.node.heartbeat_now.notify_one();
    }

    fn apply_policy(&self, p: pagewire_proto::v1::Policy) {
        use pagewire_proto::v1::{AdmissionPolicy, EvictionPolicy};
        let mut cur = self.node.policy.lock().unwrap_or_else(|e| e.into_inner());
        if p.version <= cur.version {
            return;
        }
        *cur = p;
        tracing::info!(
            version = p.version,
            admission = ?p.admission(),
            eviction = ?p.eviction(),
            high = p.high_watermark_percent,
            low = p.low_watermark_percent,
            "policy applied"
        );
        if p.admission() != AdmissionPolicy::Always || p.eviction() != EvictionPolicy::Clock {
            tracing::warn!(
                "the local cache admits every page and evicts by CLOCK; only the watermarks \
                 of this policy take effect"
            );
        }
    }

    /// Leaves the cluster on purpose (on shutdown), so extents move at once.
    pub(crate) async fn leave(&self) {
        let req = LeaveRequest {
            node_id: self.node.node_id.clone(),
            incarnation: self.node.incarnation.load(Ordering::Relaxed),
        };
        let mut r = tonic::Request::new(req);
        r.set_timeout(Duration::from_secs(2));
        match self.client.clone().leave(r).await {
            Ok(resp) => tracing::info!(epoch = resp.into_inner().map_epoch, "left the cluster"),
            Err(s) => {
                tracing::warn!(code = ?s.code(), message = s.message(), "could not leave the cluster")
            }
        }
    }
}
