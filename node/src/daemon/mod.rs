//! The node daemon: registers with the coordinator, renews its lease, follows
//! the ownership map (taking new extents, dropping the ones it no longer owns
//! nor hands off), serves the `pagewire.v1.Node` gRPC service from the local
//! [`pagewire_node::PageCache`], applies the pushed eviction watermarks, and
//! serves Prometheus `/metrics`.
//!
//! It lives beside the library (in the binary's module tree) so that the
//! cache crate itself never needs tokio or tonic.

mod agent;
pub(crate) mod config;
mod error;
mod metrics;
mod service;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use pagewire_node::PageCache;
use pagewire_proto::auth::{AttachToken, TokenCheck};
use pagewire_proto::net::{ClientTls, ServerTls};
use pagewire_proto::v1::node_server::NodeServer;
use pagewire_proto::v1::{NodeStats, OwnershipMap, Policy};
use tokio::net::TcpListener;
use tokio::sync::Notify;

pub(crate) use config::Config;
pub(crate) use error::DaemonError;

/// The map as this node applied it.
pub(crate) struct MapView {
    pub(crate) map: Arc<OwnershipMap>,
    pub(crate) me: u32,
    pub(crate) pages_per_extent: u64,
}

impl MapView {
    fn extent_of(&self, page: u64) -> usize {
        usize::try_from(page / self.pages_per_extent).unwrap_or(usize::MAX)
    }

    /// Whether this node serves `extent`: it owns it, or hands it off.
    pub(crate) fn serves(&self, extent: usize) -> bool {
        self.map.owner.get(extent) == Some(&self.me)
            || self.map.previous_owner.get(extent) == Some(&self.me)
    }

    pub(crate) fn owned(&self) -> u64 {
        self.map.owner.iter().filter(|&&o| o == self.me).count() as u64
    }
}

/// State shared by the gRPC service, the coordinator agent and metrics.
pub(crate) struct Node {
    pub(crate) node_id: String,
    pub(crate) cache: Arc<PageCache>,
    pub(crate) view: RwLock<Option<Arc<MapView>>>,
    pub(crate) index: AtomicU32,
    pub(crate) incarnation: AtomicU64,
    pub(crate) policy: Mutex<Policy>,
    pub(crate) bytes_served: AtomicU64,
    pub(crate) stale_rejections: AtomicU64,
    pub(crate) heartbeat_failures: AtomicU64,
    pub(crate) registrations: AtomicU64,
    pub(crate) max_pages_per_call: u64,
    /// Wakes the heartbeat loop at once (after a map is applied).
    pub(crate) heartbeat_now: Notify,
}

impl Node {
    pub(crate) fn view(&self) -> Option<Arc<MapView>> {
        self.view.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn applied_epoch(&self) -> u64 {
        self.view().map_or(0, |v| v.map.epoch)
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

/// Runs the daemon until `shutdown` completes (then leaves the cluster when
/// configured to), or until the coordinator refuses it for good.
pub(crate) async fn run(
    cfg: Config,
    token: String,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), DaemonError> {
    cfg.validate()?;
    let cache_cfg = cfg.cache_config();
    let path = cfg.backing_file.clone();
    let cache = tokio::task::spawn_blocking(move || PageCache::open(&path, cache_cfg))
        .await
        .map_err(|e| DaemonError::Internal(e.to_string()))??;
    let node_id = cfg.node_id();
    tracing::info!(
        node = %node_id,
        file = %cfg.backing_file.display(),
        pages = cache.pages(),
        frames = cache.config().frames,
        placement = %cache.placement().how,
        "cache open"
    );
    let node = Arc::new(Node {
        node_id,
        cache: Arc::new(cache),
        view: RwLock::new(None),
        index: AtomicU32::new(0),
        incarnation: AtomicU64::new(0),
        policy: Mutex::new(Policy::default()),
        bytes_served: AtomicU64::new(0),
        stale_rejections: AtomicU64::new(0),
        heartbeat_failures: AtomicU64::new(0),
        registrations: AtomicU64::new(0),
        max_pages_per_call: cfg.max_pages_per_call,
        heartbeat_now: Notify::new(),
    });

    let grpc = bind(&cfg.listen).await?;
    let grpc_addr: SocketAddr = grpc.local_addr().map_err(|source| DaemonError::Bind {
        addr: cfg.listen.clone(),
        source,
    })?;
    let mut tasks = tokio::task::JoinSet::new();
    let mut metrics_addr = String::new();
    if !cfg.metrics_listen.is_empty() {
        let l = bind(&cfg.metrics_listen).await?;
        metrics_addr = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
        let registry = Arc::new(metrics::registry(node.clone()));
        tasks.spawn(pagewire_proto::metrics_http::serve(
            l,
            Arc::new(move || metrics::render(&registry)),
        ));
    }
    let advertise = if cfg.advertise.is_empty() {
        grpc_addr.to_string()
    } else {
        cfg.advertise.clone()
    };

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
    {
        let agent = agent.clone();
        tasks.spawn(async move {
            if let Err(e) = agent.run().await {
                let _ = fatal_tx.send(e).await;
            }
        });
    }
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
    let check = TokenCheck::new(&token).map_err(|e| DaemonError::Config {
        key: "token",
        reason: e.to_string(),
    })?;
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
        () = shutdown => {
            if cfg.leave_on_shutdown {
                agent.leave().await;
            }
            Ok(())
        }
    };
    let _ = stop_tx.send(());
    tasks.abort_all();
    outcome
}
