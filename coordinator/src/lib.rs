//! pagewire-coordinator: the one place that knows who is in the cluster and
//! who owns which extent of the file.
//!
//! It keeps membership (registration, heartbeats, leases), computes the
//! ownership map by weighted rendezvous hashing (`pagewire_proto::rendezvous`), numbers it
//! by an epoch, streams it to nodes and readers, moves extents on join, leave,
//! failure and drain without a gap ([`state`] explains how), forwards
//! cluster-wide warm/evict to owners, pushes admission/eviction policy, and
//! saves its state before publishing it ([`store`]: the state file, written
//! atomically by `persist`, or etcd, where several coordinators elect one
//! leader and every save is fenced on that leadership). Data never flows
//! through it.
//!
//! It depends on `pagewire-proto` only: never on the node, the transports or
//! the bench. The `pwctl` admin CLI is its own crate (`pwctl/`), built on
//! `pagewire-proto` and the client library, not on this one.

pub mod cli;
pub mod config;
pub mod error;
mod follow;
mod ha;
pub mod metrics;
mod persist;
pub mod service;
mod state;
pub mod store;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pagewire_proto::auth::{AttachToken, TokenCheck};
use pagewire_proto::net::{ClientTls, NetError, ServerTls};
use pagewire_proto::v1::coordinator_server::CoordinatorServer;
use tokio::net::TcpListener;

pub use config::{Config, ConfigError};
pub use persist::PersistError;

/// Why the coordinator could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Persist(#[from] PersistError),
    #[error("{0}")]
    StateMismatch(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Net(#[from] NetError),
    #[error("gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("state store: {0}")]
    Store(String),
}

/// The addresses a started coordinator listens on.
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    pub grpc: SocketAddr,
    pub metrics: Option<SocketAddr>,
}

async fn bind(addr: &str) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind {
            addr: addr.to_owned(),
            source,
        })
}

/// Writes a state file for a cluster whose `members` (node id, capacity in
/// bytes) are all alive with the map settled at epoch 1 (no handoff, no
/// release), as if each had registered and every handoff had finished.
/// Indices and incarnations are 1, 2, ... in the order given; every member
/// gets `grpc_address`. For simulators that need a large cluster without
/// thousands of joins (`pagewire-bench mapscale`); a coordinator started on
/// it gives every member a fresh lease, which it keeps by heartbeating with
/// its incarnation.
pub fn write_settled_state(
    path: &std::path::Path,
    cluster_name: &str,
    map: &config::MapConfig,
    members: &[(String, u64)],
    grpc_address: &str,
) -> Result<(), PersistError> {
    use pagewire_proto::v1::{CandidateSet, CompactMap, MapNode, NodeInfo, NodeState};
    let n = u32::try_from(members.len()).unwrap_or(u32::MAX - 1);
    let infos: Vec<NodeInfo> = members
        .iter()
        .zip(1u32..)
        .map(|((id, capacity), index)| NodeInfo {
            node_id: id.clone(),
            index,
            grpc_address: grpc_address.to_owned(),
            capacity_bytes: *capacity,
            state: NodeState::Alive.into(),
            incarnation: u64::from(index),
            ..Default::default()
        })
        .collect();
    let compact = CompactMap {
        epoch: 1,
        file_size: map.file_size,
        extent_size: map.extent_size,
        page_size: map.page_size,
        nodes: infos
            .iter()
            .map(|i| MapNode {
                index: i.index,
                node_id: i.node_id.clone(),
                grpc_address: i.grpc_address.clone(),
                state: i.state,
                weight: i.capacity_bytes,
                ..Default::default()
            })
            .collect(),
        // The owner set is the base set: every alive member.
        sets: vec![CandidateSet {
            id: 1,
            ..Default::default()
        }],
        owner_set: 1,
        ..Default::default()
    };
    persist::save(
        path,
        &persist::PersistedState {
            cluster_name: cluster_name.to_owned(),
            members: infos,
            map: None,
            policy: None,
            next_index: n + 1,
            next_incarnation: u64::from(n) + 1,
            compact: Some(compact),
        },
    )
}

/// Runs the coordinator until `shutdown` completes. `on_bound` learns the
/// addresses once both listeners are up.
pub async fn run(
    cfg: Config,
    token: String,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(Bound),
) -> Result<(), StartError> {
    cfg.validate()?;
    let metrics = Arc::new(metrics::Metrics::new());
    let params = state::Params {
        cluster_name: cfg.cluster_name.clone(),
        extent_size: cfg.map.extent_size,
        page_size: cfg.map.page_size,
        lease: Duration::from_millis(cfg.lease_ms),
        heartbeat_interval: Duration::from_millis(cfg.heartbeat_interval_ms()),
        state_file: cfg.state_file.clone(),
    };
    let spec = cfg.store_spec()?;
    let grpc = bind(&cfg.listen).await?;
    let grpc_addr = grpc.local_addr().map_err(|source| StartError::Bind {
        addr: cfg.listen.clone(),
        source,
    })?;
    let me = if cfg.advertise.is_empty() {
        grpc_addr.to_string()
    } else {
        cfg.advertise.clone()
    };
    let (cluster, ha, events) = match &spec {
        store::StoreSpec::File(path) => {
            let params = state::Params {
                state_file: path.clone(),
                ..params
            };
            let c = state::ClusterState::open(
                params,
                cfg.map.file_size,
                cfg.policy()?,
                metrics.clone(),
            )?;
            metrics.leading.set(1);
            let ha = Arc::new(ha::Leadership::standalone(me.clone(), spec.describe()));
            (c, ha, None)
        }
        store::StoreSpec::Etcd(endpoints) => {
            let ha = Arc::new(ha::Leadership::candidate(me.clone(), spec.describe()));
            let (store, events) =
                store::connect_etcd(&cfg, endpoints, ha.clone(), metrics.clone()).await?;
            // Replaced by the store's state when this coordinator leads or
            // follows; until then it answers nothing it cannot confirm.
            let c = state::ClusterState::new(
                params,
                cfg.map.file_size,
                cfg.policy()?,
                metrics.clone(),
                store,
            );
            (c, ha, Some(events))
        }
    };
    let node_tls = cfg.tls.node_ca_file.clone().map(|ca_file| ClientTls {
        ca_file,
        domain: cfg.tls.node_domain.clone(),
    });
    let shared = Arc::new(service::Shared::new(
        cluster,
        ha.clone(),
        metrics.clone(),
        AttachToken::new(&token).map_err(ConfigError::from)?,
        node_tls,
        Duration::from_millis(cfg.node_rpc_timeout_ms),
    ));
    let mut background = tokio::task::JoinSet::new();
    let (fatal_tx, fatal_rx) = tokio::sync::oneshot::channel::<StartError>();
    if let Some(rx) = events {
        let s = shared.clone();
        background.spawn(async move {
            if let Err(e) = follow::apply_events(s, rx).await {
                tracing::error!(error = %e, "cannot go on with the state in the store");
                let _ = fatal_tx.send(e);
            }
        });
        shared.store.clone().start();
    }
    let mut metrics_addr = None;
    if !cfg.metrics_listen.is_empty() {
        let l = bind(&cfg.metrics_listen).await?;
        metrics_addr = l.local_addr().ok();
        let m = metrics.clone();
        let s = shared.clone();
        background.spawn(pagewire_proto::metrics_http::serve(
            l,
            pagewire_proto::metrics_http::Routes {
                metrics: Arc::new(move || m.render()),
                ready: Arc::new(move || {
                    if *s.stopping.borrow() {
                        return Err("shutting down".to_owned());
                    }
                    s.ha.readiness()
                }),
            },
        ));
    }
    let tick = Duration::from_millis((cfg.lease_ms / 20).clamp(10, 500));
    background.spawn(shared.clone().lease_loop(tick));

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
    let check =
        TokenCheck::counting_into(&token, metrics.refusals.clone()).map_err(ConfigError::from)?;
    let svc = tonic::service::interceptor::InterceptedService::new(
        CoordinatorServer::new(service::CoordinatorService {
            shared: shared.clone(),
        })
        .max_decoding_message_size(16 << 20)
        .max_encoding_message_size(256 << 20),
        check,
    );
    if let Some(why) = cfg.failover_outlasts_node_leases() {
        tracing::warn!("{why}");
    }
    tracing::info!(
        grpc = %grpc_addr,
        metrics = %metrics_addr.map_or_else(|| "off".to_owned(), |a| a.to_string()),
        tls = cfg.tls.cert_file.is_some(),
        store = %spec.describe(),
        advertise = %me,
        "coordinator listening"
    );
    on_bound(Bound {
        grpc: grpc_addr,
        metrics: metrics_addr,
    });
    let shutdown = async move {
        tokio::select! {
            () = shutdown => None,
            Ok(e) = fatal_rx => Some(e),
        }
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let stopping = shared.clone();
    let fatal = tokio::spawn(async move {
        let r = shutdown.await;
        // Persist before anything is handed over (a follower saves nothing).
        if stopping.ha.is_leading() {
            let epoch = stopping.blocking(|c| c.save().map(|()| c.epoch())).await;
            match epoch {
                Ok(Ok(epoch)) => tracing::info!(epoch, "state persisted"),
                Ok(Err(e)) => tracing::error!(error = %e, "cannot persist the state on shutdown"),
                Err(e) => tracing::error!(error = %e, "cannot persist the state on shutdown"),
            }
        }
        // Hand the leadership over first, at once rather than after the
        // lease TTL: the server then waits for open streams (WatchMap) to
        // end before it returns.
        stopping.store.resign().await;
        stopping.stopping.send_replace(true);
        let _ = stop_tx.send(());
        r
    });
    let result = server
        .add_service(svc)
        .serve_with_incoming_shutdown(pagewire_proto::net::incoming(grpc), async move {
            let _ = stop_rx.await;
        })
        .await;
    background.abort_all();
    result?;
    if let Ok(Some(e)) = fatal.await {
        return Err(e);
    }
    Ok(())
}
