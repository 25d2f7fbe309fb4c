//! The `pagewire.v1.Coordinator` gRPC service.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pagewire_proto::auth::AttachToken;
use pagewire_proto::net::{self, ClientTls};
use pagewire_proto::v1::coordinator_server::Coordinator;
use pagewire_proto::v1::node_client::NodeClient;
use pagewire_proto::v1::{
    ByteRange, ClusterRangeRequest, ClusterRangeResponse, CoordinatorPeer, CoordinatorRole,
    DrainRequest, DrainResponse, GetMapRequest, HeartbeatRequest, HeartbeatResponse, LeaveRequest,
    LeaveResponse, ListNodesRequest, ListNodesResponse, NodeRangeRequest, NodeRangeResult,
    OwnershipMap, PageRun, RegisterRequest, RegisterResponse, SetPolicyRequest, SetPolicyResponse,
    StatusRequest, StatusResponse, WatchMapRequest,
};
use tokio_stream::{Stream, StreamExt, wrappers::WatchStream};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::error::CoordError;
use crate::ha::Leadership;
use crate::metrics::Metrics;
use crate::state::{ClusterState, Published, StatusView};
use crate::store::Store;

type Client = NodeClient<InterceptedService<Channel, AttachToken>>;

pub(crate) struct Shared {
    /// An async mutex: a change holds it across its save, which runs on a
    /// blocking thread ([`Shared::write`]), so a call waiting for it waits
    /// without holding a runtime worker. Changes, heartbeats and
    /// `ListNodes` take it; the reads of what is saved (`GetMap`,
    /// `WatchMap`, `Status`, the owners `Warm` and `Evict` forward to) read
    /// `published` and `status` instead, so a slow save does not hold
    /// them up.
    cluster: Arc<tokio::sync::Mutex<ClusterState>>,
    /// The published map, read without the cluster lock.
    published: tokio::sync::watch::Receiver<Arc<Published>>,
    /// What `Status` shows, as of the last save, read without the lock.
    status: tokio::sync::watch::Receiver<Arc<StatusView>>,
    pub(crate) ha: Arc<Leadership>,
    /// The store the cluster saves to, for what else it does (see
    /// [`Store`]).
    pub(crate) store: Arc<dyn Store>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) token: AttachToken,
    pub(crate) node_tls: Option<ClientTls>,
    pub(crate) node_timeout: Duration,
    clients: Mutex<HashMap<(u32, String), Client>>,
    /// Set once the coordinator stops: ends every `WatchMap` stream.
    pub(crate) stopping: tokio::sync::watch::Sender<bool>,
}

impl Shared {
    pub(crate) fn new(
        cluster: ClusterState,
        ha: Arc<Leadership>,
        metrics: Arc<Metrics>,
        token: AttachToken,
        node_tls: Option<ClientTls>,
        node_timeout: Duration,
    ) -> Self {
        Self {
            published: cluster.subscribe(),
            status: cluster.subscribe_status(),
            store: cluster.store(),
            cluster: Arc::new(tokio::sync::Mutex::new(cluster)),
            ha,
            metrics,
            token,
            node_tls,
            node_timeout,
            clients: Mutex::new(HashMap::new()),
            stopping: tokio::sync::watch::Sender::new(false),
        }
    }

    /// The cluster, for what does not save (a save may hold it for up to
    /// the store's request timeout: use [`Shared::write`] or
    /// [`Shared::blocking`]).
    pub(crate) async fn cluster(&self) -> tokio::sync::MutexGuard<'_, ClusterState> {
        self.cluster.lock().await
    }

    /// The map published last (it is in the store).
    pub(crate) fn published(&self) -> Arc<Published> {
        self.published.borrow().clone()
    }

    /// Runs `f` on the cluster on a blocking thread, holding the cluster
    /// lock throughout: the store's save inside it blocks that thread, not
    /// a runtime worker. Calls queue on the lock in order; one whose caller
    /// went away while it ran still completes (a change is never left half
    /// done).
    pub(crate) async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut ClusterState) -> T + Send + 'static,
    ) -> Result<T, tokio::task::JoinError> {
        let mut c = self.cluster.clone().lock_owned().await;
        tokio::task::spawn_blocking(move || f(&mut c)).await
    }

    /// A change (it saves): refused unless this coordinator leads, before
    /// and after waiting for the lock.
    async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut ClusterState) -> Result<T, CoordError> + Send + 'static,
    ) -> Result<T, Status> {
        self.write_if(|_| true, f).await
    }

    /// [`Shared::write`], run on the runtime worker when `may_save` says
    /// that `f` will not save (a heartbeat outside a handoff: most of
    /// them), which spares the blocking thread's round trip.
    async fn write_if<T: Send + 'static>(
        &self,
        may_save: impl FnOnce(&ClusterState) -> bool,
        f: impl FnOnce(&mut ClusterState) -> Result<T, CoordError> + Send + 'static,
    ) -> Result<T, Status> {
        self.ha.check_write().map_err(Status::from)?;
        let mut c = self.cluster.clone().lock_owned().await;
        // It may have stopped leading while this waited.
        self.ha.check_write().map_err(Status::from)?;
        if !may_save(&c) {
            return f(&mut c).map_err(Status::from);
        }
        tokio::task::spawn_blocking(move || f(&mut c))
            .await
            .unwrap_or_else(|e| Err(CoordError::Internal(format!("the change failed: {e}"))))
            .map_err(Status::from)
    }

    /// Waits until this coordinator's copy of the state is the store's
    /// current one: at once on the leader (it wrote it), after a quorum read
    /// of etcd on a follower. A read answered after this reflects the state
    /// at some instant after the call arrived.
    async fn confirm_read(&self) -> Result<(), String> {
        if self.ha.is_leading() {
            return Ok(());
        }
        self.store.confirm().await
    }

    /// A read that must be current: refused while it cannot be confirmed,
    /// naming the leader if one is known.
    async fn confirmed(&self) -> Result<(), Status> {
        self.confirm_read().await.map_err(|why| {
            let leader = self.ha.leader().filter(|l| l != self.ha.me());
            let msg = match &leader {
                Some(l) => format!(
                    "this coordinator cannot confirm its copy of the state with the store \
                     ({why}); ask the leader, {l}"
                ),
                None => format!(
                    "this coordinator cannot confirm its copy of the state with the store \
                     ({why}), and no leader is known now"
                ),
            };
            pagewire_proto::leader::not_leading(msg, leader.as_deref())
        })
    }

    /// Every coordinator sharing the store, with its role as this one sees it.
    async fn peers(&self, view: &crate::ha::View) -> Vec<CoordinatorPeer> {
        let mut addresses = self.store.peers().await.unwrap_or_default();
        if addresses.is_empty() {
            addresses.push(self.ha.me().to_owned());
        }
        addresses.sort();
        addresses.dedup();
        addresses
            .into_iter()
            .map(|address| CoordinatorPeer {
                role: if view.leader.as_deref() == Some(address.as_str()) {
                    CoordinatorRole::Leader
                } else if address == self.ha.me() {
                    view.role
                } else {
                    CoordinatorRole::Follower
                }
                .into(),
                address,
            })
            .collect()
    }

    fn client(&self, index: u32, address: &str) -> Result<Client, String> {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        let key = (index, address.to_owned());
        if let Some(c) = clients.get(&key) {
            return Ok(c.clone());
        }
        let channel = net::connect_lazy(address, self.node_tls.as_ref(), Duration::from_secs(3))
            .map_err(|e| e.to_string())?;
        let c = NodeClient::with_interceptor(channel, self.token.clone())
            .max_decoding_message_size(64 << 20);
        clients.retain(|(i, _), _| *i != index);
        clients.insert(key, c.clone());
        Ok(c)
    }

    /// Declares dead the nodes whose lease ran out, every `tick`.
    pub(crate) async fn lease_loop(self: Arc<Self>, tick: Duration) {
        let mut interval = tokio::time::interval(tick);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            // Only the leader declares nodes dead: a follower hears no
            // heartbeat.
            if !self.ha.is_leading() {
                continue;
            }
            let ha = self.ha.clone();
            let r = self
                .blocking(move |c| {
                    if !ha.is_leading() {
                        return Ok(Vec::new());
                    }
                    c.expire_leases(Instant::now())
                })
                .await;
            match r {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "could not publish the map after a lease expired; retrying")
                }
                Err(e) => tracing::error!(error = %e, "the lease check failed; retrying"),
            }
        }
    }
}

#[derive(Clone)]
pub struct CoordinatorService {
    pub(crate) shared: Arc<Shared>,
}

#[derive(Clone, Copy)]
enum RangeOp {
    Warm,
    Evict,
}

/// Splits `range` into runs of pages per owner, with the map they came from.
fn runs_by_owner(
    map: &OwnershipMap,
    range: Option<ByteRange>,
) -> Result<BTreeMap<u32, Vec<PageRun>>, Status> {
    let r = range.ok_or_else(|| Status::invalid_argument("range is required"))?;
    if map.file_size == 0 {
        return Err(Status::failed_precondition(
            "the cluster has no file yet: no node has registered",
        ));
    }
    if r.length == 0 {
        return Err(Status::invalid_argument("range length must be > 0"));
    }
    if r.offset >= map.file_size {
        return Err(Status::invalid_argument(format!(
            "range offset {} is past the end of the {} byte file",
            r.offset, map.file_size
        )));
    }
    let end = r.offset.saturating_add(r.length).min(map.file_size);
    let ps = u64::from(map.page_size);
    let pages_per_extent = map.extent_size / ps;
    let (first, last) = (r.offset / ps, end.div_ceil(ps));
    let mut out: BTreeMap<u32, Vec<PageRun>> = BTreeMap::new();
    let mut page = first;
    while page < last {
        let extent = page / pages_per_extent;
        let stop = ((extent + 1) * pages_per_extent).min(last);
        let owner = usize::try_from(extent)
            .ok()
            .and_then(|e| map.owner.get(e))
            .copied()
            .unwrap_or(0);
        let runs = out.entry(owner).or_default();
        match runs.last_mut() {
            Some(run) if run.first_page + run.page_count == page => run.page_count += stop - page,
            _ => runs.push(PageRun {
                first_page: page,
                page_count: stop - page,
            }),
        }
        page = stop;
    }
    Ok(out)
}

impl CoordinatorService {
    fn track<T>(&self, method: &str, r: Result<T, Status>) -> Result<Response<T>, Status> {
        match r {
            Ok(v) => Ok(Response::new(v)),
            Err(s) => {
                self.shared.metrics.rpc_error(method, s.code());
                tracing::debug!(method, code = ?s.code(), message = s.message(), "call failed");
                Err(s)
            }
        }
    }

    async fn forward(
        &self,
        op: RangeOp,
        range: Option<ByteRange>,
    ) -> Result<ClusterRangeResponse, Status> {
        self.shared.ha.check_write().map_err(Status::from)?;
        let map = self.shared.published().map.clone();
        let plan = runs_by_owner(&map, range)?;
        // The owners' addresses from the same map (not the cluster, whose
        // lock a save may hold).
        let nodes: HashMap<u32, (String, String)> = map
            .nodes
            .iter()
            .map(|n| (n.index, (n.node_id.clone(), n.grpc_address.clone())))
            .collect();
        let mut results = Vec::new();
        let mut calls = tokio::task::JoinSet::new();
        for (owner, runs) in plan {
            let addr = if owner == 0 {
                None
            } else {
                nodes.get(&owner).cloned()
            };
            let Some((node_id, address)) = addr else {
                results.push(NodeRangeResult {
                    node_id: String::new(),
                    pages: 0,
                    error: format!(
                        "{} pages have no owner",
                        runs.iter().map(|r| r.page_count).sum::<u64>()
                    ),
                });
                continue;
            };
            let client = self.shared.client(owner, &address);
            let (epoch, timeout) = (map.epoch, self.shared.node_timeout);
            calls.spawn(async move {
                let mut client = match client {
                    Ok(c) => c,
                    Err(e) => {
                        return NodeRangeResult {
                            node_id,
                            pages: 0,
                            error: e,
                        };
                    }
                };
                let mut pages = 0;
                for run in runs {
                    let mut req = Request::new(NodeRangeRequest {
                        run: Some(run),
                        map_epoch: epoch,
                    });
                    req.set_timeout(timeout);
                    let r = match op {
                        RangeOp::Warm => client.warm(req).await,
                        RangeOp::Evict => client.evict(req).await,
                    };
                    match r {
                        Ok(resp) => pages += resp.into_inner().pages,
                        Err(s) => {
                            return NodeRangeResult {
                                node_id,
                                pages,
                                error: format!("{:?}: {}", s.code(), s.message()),
                            };
                        }
                    }
                }
                NodeRangeResult {
                    node_id,
                    pages,
                    error: String::new(),
                }
            });
        }
        while let Some(r) = calls.join_next().await {
            match r {
                Ok(r) => results.push(r),
                Err(e) => results.push(NodeRangeResult {
                    node_id: String::new(),
                    pages: 0,
                    error: format!("forwarding task failed: {e}"),
                }),
            }
        }
        results.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        Ok(ClusterRangeResponse {
            map_epoch: map.epoch,
            results,
        })
    }
}

type MapStream = Pin<Box<dyn Stream<Item = Result<OwnershipMap, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    async fn register(
        &self,
        req: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let req = req.into_inner();
        let r = self.shared.write(move |c| c.register(req)).await;
        self.track("Register", r)
    }

    async fn heartbeat(
        &self,
        req: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let req = req.into_inner();
        let r = self
            .shared
            .write_if(ClusterState::heartbeat_may_save, move |c| c.heartbeat(req))
            .await;
        self.track("Heartbeat", r)
    }

    async fn leave(&self, req: Request<LeaveRequest>) -> Result<Response<LeaveResponse>, Status> {
        let req = req.into_inner();
        let r = self
            .shared
            .write(move |c| {
                c.leave(&req.node_id, req.incarnation)
                    .map(|map_epoch| LeaveResponse { map_epoch })
            })
            .await;
        self.track("Leave", r)
    }

    type WatchMapStream = MapStream;

    async fn watch_map(
        &self,
        req: Request<WatchMapRequest>,
    ) -> Result<Response<MapStream>, Status> {
        let req = req.into_inner();
        let min = req.min_epoch;
        // A follower streams only a copy it confirmed with the store, as
        // GetMap answers: its copy may lag (its watch on the store broke,
        // or it led and stepped down), and a node takes the first map of a
        // stream for the cluster's. Refused otherwise, naming the leader,
        // so the node asks another coordinator.
        if let Err(s) = self.shared.confirmed().await {
            return self.track("WatchMap", Err(s));
        }
        // Subscribed after the confirmation: the first map sent is at
        // least the confirmed one.
        let rx = self.shared.published.clone();
        let stream = WatchStream::new(rx).filter(move |p| p.map.epoch >= min);
        // Ends when the coordinator stops, so that a graceful shutdown
        // does not wait for ever on streams that never end by themselves.
        let stop = WatchStream::new(self.shared.stopping.subscribe())
            .filter(|stopping| *stopping)
            .map(|_| None);
        if !req.compact {
            let maps = stream.map(|p| Some(Ok((*p.map).clone())));
            return Ok(Response::new(Box::pin(
                maps.merge(stop)
                    .take_while(Option::is_some)
                    .filter_map(|m| m),
            )));
        }
        // A full compact map first, then deltas on the one sent before (the
        // watch channel may skip epochs: then the delta spans them).
        let mut sent: Option<Arc<pagewire_proto::v1::CompactMap>> = None;
        let maps = stream.map(move |p| {
            let compact = match &sent {
                None => (*p.compact).clone(),
                Some(prev) => match &p.delta {
                    Some(d) if d.base_epoch == prev.epoch => (**d).clone(),
                    _ => pagewire_proto::map::delta(prev, &p.compact),
                },
            };
            sent = Some(p.compact.clone());
            Some(Ok(OwnershipMap {
                epoch: p.map.epoch,
                compact: Some(compact),
                ..Default::default()
            }))
        });
        Ok(Response::new(Box::pin(
            maps.merge(stop)
                .take_while(Option::is_some)
                .filter_map(|m| m),
        )))
    }

    async fn get_map(&self, req: Request<GetMapRequest>) -> Result<Response<OwnershipMap>, Status> {
        let compact = req.into_inner().compact;
        let r = self.shared.confirmed().await.map(|()| {
            let p = self.shared.published();
            if compact {
                return OwnershipMap {
                    epoch: p.compact.epoch,
                    compact: Some((*p.compact).clone()),
                    ..Default::default()
                };
            }
            (*p.map).clone()
        });
        self.track("GetMap", r)
    }

    async fn list_nodes(
        &self,
        _req: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        // The heartbeat fields (lease left, applied epoch, counters) live
        // only on the leader: a follower that knows it sends the caller
        // there, and answers from its own copy, without them, only when no
        // leader is known.
        if !self.shared.ha.is_leading()
            && let Some(leader) = self.shared.ha.leader()
        {
            let s = pagewire_proto::leader::not_leading(
                format!(
                    "this coordinator does not lead; the leader is {leader}, which alone has the \
                     nodes' heartbeat fields"
                ),
                Some(&leader),
            );
            return self.track("ListNodes", Err(s));
        }
        let r = match self.shared.confirmed().await {
            Ok(()) => Ok(ListNodesResponse {
                nodes: self.shared.cluster().await.nodes(),
            }),
            Err(s) => Err(s),
        };
        self.track("ListNodes", r)
    }

    async fn status(
        &self,
        _req: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        // Always answers: with `store_problem` set when this coordinator
        // could not confirm its state, which clients must not take as a
        // confirmation of their map.
        let confirmed = self.shared.confirm_read().await;
        let mut s = self.shared.status.borrow().status();
        let view = self.shared.ha.view();
        s.store = self.shared.ha.store().to_owned();
        s.role = view.role.into();
        s.leader = view.leader.clone().unwrap_or_default();
        s.coordinators = self.shared.peers(&view).await;
        s.store_problem = match (confirmed, view.problem) {
            (Ok(()), _) if view.role == CoordinatorRole::Leader => String::new(),
            (Ok(()), p) => p.unwrap_or_default(),
            (Err(why), p) => {
                p.unwrap_or_else(|| format!("cannot confirm the state with the store: {why}"))
            }
        };
        Ok(Response::new(s))
    }

    async fn drain(&self, req: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        let req = req.into_inner();
        let r = self
            .shared
            .write(move |c| {
                c.drain(&req.node_id, req.incarnation)
                    .map(|(map_epoch, extents_moved)| DrainResponse {
                        map_epoch,
                        extents_moved,
                    })
            })
            .await;
        self.track("Drain", r)
    }

    async fn undrain(&self, req: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        let node_id = req.into_inner().node_id;
        let r = self
            .shared
            .write(move |c| {
                c.undrain(&node_id).map(|map_epoch| DrainResponse {
                    map_epoch,
                    extents_moved: 0,
                })
            })
            .await;
        self.track("Undrain", r)
    }

    async fn warm(
        &self,
        req: Request<ClusterRangeRequest>,
    ) -> Result<Response<ClusterRangeResponse>, Status> {
        let r = self.forward(RangeOp::Warm, req.into_inner().range).await;
        self.track("Warm", r)
    }

    async fn evict(
        &self,
        req: Request<ClusterRangeRequest>,
    ) -> Result<Response<ClusterRangeResponse>, Status> {
        let r = self.forward(RangeOp::Evict, req.into_inner().range).await;
        self.track("Evict", r)
    }

    async fn set_policy(
        &self,
        req: Request<SetPolicyRequest>,
    ) -> Result<Response<SetPolicyResponse>, Status> {
        let r = match req.into_inner().policy {
            None => Err(Status::invalid_argument("policy is required")),
            Some(p) => {
                self.shared
                    .write(move |c| {
                        c.set_policy(p).map(|policy| SetPolicyResponse {
                            policy: Some(policy),
                        })
                    })
                    .await
            }
        };
        self.track("SetPolicy", r)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    use crate::persist::PersistedState;
    use crate::store::StoreError;

    /// A store that keeps nothing and takes `delay_ms` per save (an etcd
    /// that answers slowly), recording the epochs saved.
    #[derive(Default)]
    struct Slow {
        delay_ms: AtomicU64,
        epochs: Mutex<Vec<u64>>,
    }

    impl Store for Slow {
        fn save(&self, _: &PersistedState, e: Option<(u64, &str)>) -> Result<(), StoreError> {
            std::thread::sleep(Duration::from_millis(self.delay_ms.load(Ordering::SeqCst)));
            if let Some((e, _)) = e {
                self.epochs.lock().unwrap().push(e);
            }
            Ok(())
        }
    }

    fn service(store: Arc<dyn Store>, ha: Leadership) -> CoordinatorService {
        let params = crate::state::Params {
            cluster_name: "t".into(),
            extent_size: 1 << 16,
            page_size: 4096,
            lease: Duration::from_secs(60),
            heartbeat_interval: Duration::from_secs(1),
            state_file: "unused".into(),
        };
        let metrics = Arc::new(Metrics::new());
        let cluster = ClusterState::new(
            params,
            0,
            crate::config::Config::default().policy().unwrap(),
            metrics.clone(),
            store,
        );
        CoordinatorService {
            shared: Arc::new(Shared::new(
                cluster,
                Arc::new(ha),
                metrics,
                AttachToken::new("a-test-token").unwrap(),
                None,
                Duration::from_secs(1),
            )),
        }
    }

    fn leader() -> Leadership {
        Leadership::standalone("me:1".into(), "test".into())
    }

    /// A registration of node `id` (shared with the etcd store's tests).
    pub(crate) fn reg(id: &str) -> Request<RegisterRequest> {
        Request::new(RegisterRequest {
            node_id: id.into(),
            grpc_address: "127.0.0.1:9".into(),
            capacity_bytes: 1 << 30,
            file_size: 256 << 16,
            page_size: 4096,
            ..Default::default()
        })
    }

    /// A save that takes long (up to the store's request timeout) holds no
    /// runtime worker: on a runtime with one worker, timers still fire and
    /// the published map is served while it runs.
    #[test]
    fn a_slow_save_blocks_no_runtime_worker() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let store = Arc::new(Slow::default());
            let svc = service(store.clone(), leader());
            svc.register(reg("a")).await.unwrap();
            svc.register(reg("b")).await.unwrap();
            let epoch = svc.shared.published().map.epoch;
            store.delay_ms.store(1500, Ordering::SeqCst);
            let s = svc.clone();
            let drain = tokio::spawn(async move {
                s.drain(Request::new(DrainRequest {
                    node_id: "b".into(),
                    incarnation: 0,
                }))
                .await
            });
            // Timers are driven by the runtime's worker.
            let t0 = Instant::now();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let slept = t0.elapsed();
            assert!(
                slept < Duration::from_millis(700),
                "a 200 ms sleep took {slept:?}: the save holds the runtime's worker"
            );
            // A task on the runtime: its 10 ms timer.
            let t0 = Instant::now();
            let timer = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                t0.elapsed()
            });
            let late = timer.await.unwrap();
            assert!(
                late < Duration::from_millis(500),
                "a 10 ms timer fired after {late:?}: the save holds the runtime's worker"
            );
            let t0 = Instant::now();
            let m = svc
                .get_map(Request::new(GetMapRequest::default()))
                .await
                .unwrap()
                .into_inner();
            let took = t0.elapsed();
            assert!(
                took < Duration::from_millis(500),
                "GetMap took {took:?} during a save"
            );
            assert_eq!(m.epoch, epoch, "an epoch not saved yet was served");
            eprintln!(
                "during a 1.5 s save: a 200 ms sleep took {slept:?}, a 10 ms timer {late:?}, \
                 GetMap {took:?}"
            );
            let r = drain.await.unwrap().unwrap().into_inner();
            assert_eq!(r.map_epoch, epoch + 1);
            assert_eq!(svc.shared.published().map.epoch, epoch + 1);
        });
    }

    /// A read-only call does not queue behind a save: while a change waits
    /// 1.5 s for the store, `Status` (which every map follower polls) and
    /// `Warm` answer at once, from what is already in the store.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_save_does_not_hold_up_status_or_forwarding() {
        let store = Arc::new(Slow::default());
        let svc = service(store.clone(), leader());
        svc.register(reg("a")).await.unwrap();
        svc.register(reg("b")).await.unwrap();
        let epoch = svc.shared.published().map.epoch;
        store.delay_ms.store(1500, Ordering::SeqCst);
        let s = svc.clone();
        let drain = tokio::spawn(async move {
            s.drain(Request::new(DrainRequest {
                node_id: "b".into(),
                incarnation: 0,
            }))
            .await
        });
        // The drain holds the save now.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let t0 = Instant::now();
        let st = svc
            .status(Request::new(StatusRequest::default()))
            .await
            .unwrap()
            .into_inner();
        let took = t0.elapsed();
        assert!(
            took < Duration::from_millis(500),
            "Status took {took:?}: it waited for the save"
        );
        assert_eq!(st.epoch, epoch, "Status showed an epoch not saved yet");
        assert_eq!(st.nodes_alive, 2);
        // Forwarding finds the owners' addresses without the cluster lock
        // (the nodes are not listening: each answers with an error).
        let t0 = Instant::now();
        let mut req = Request::new(ClusterRangeRequest {
            range: Some(ByteRange {
                offset: 0,
                length: 4096,
            }),
        });
        req.set_timeout(Duration::from_millis(200));
        let fwd = svc.warm(req).await.unwrap().into_inner();
        let took = t0.elapsed();
        assert!(
            took < Duration::from_millis(1000),
            "Warm took {took:?}: it waited for the save"
        );
        assert_eq!(fwd.map_epoch, epoch);
        assert!(!drain.is_finished(), "the save ended too early to tell");
        let r = drain.await.unwrap().unwrap().into_inner();
        assert_eq!(r.map_epoch, epoch + 1);
        let st = svc
            .status(Request::new(StatusRequest::default()))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(st.epoch, epoch + 1);
    }

    /// Concurrent changes are saved one at a time, each epoch once and in
    /// order, and each answer names what it did.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_changes_are_saved_one_at_a_time() {
        let store = Arc::new(Slow::default());
        store.delay_ms.store(5, Ordering::SeqCst);
        let svc = service(store.clone(), leader());
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..12 {
            let s = svc.clone();
            calls.spawn(async move { s.register(reg(&format!("n{i}"))).await });
        }
        let mut indices = Vec::new();
        while let Some(r) = calls.join_next().await {
            indices.push(r.unwrap().unwrap().into_inner().node_index);
        }
        indices.sort_unstable();
        indices.dedup();
        assert_eq!(indices.len(), 12, "two registrations got one index");
        let epochs = store.epochs.lock().unwrap().clone();
        assert!(
            epochs.windows(2).all(|w| w[1] == w[0] + 1),
            "epochs saved out of order or twice: {epochs:?}"
        );
        let m = svc.shared.published();
        assert_eq!(Some(&m.map.epoch), epochs.last());
        assert_eq!(m.map.nodes.len(), 12);
    }

    /// A follower that cannot confirm its copy with the store streams no
    /// map: it refuses, naming the leader, as GetMap does.
    #[tokio::test]
    async fn a_follower_that_cannot_confirm_its_copy_streams_no_map() {
        let ha = Leadership::candidate("me:1".into(), "etcd://x:1".into());
        ha.follow(Some("leader:2".into()));
        let svc = service(Arc::new(Slow::default()), ha);
        let refused = match svc
            .watch_map(Request::new(WatchMapRequest::default()))
            .await
        {
            Ok(_) => panic!("a follower streamed a map it had not confirmed"),
            Err(s) => s,
        };
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
        assert_eq!(
            pagewire_proto::leader::leader_hint(&refused).as_deref(),
            Some("leader:2"),
            "{refused:?}"
        );
        assert!(
            svc.get_map(Request::new(GetMapRequest::default()))
                .await
                .is_err()
        );
    }

    #[test]
    fn ranges_split_by_owner_and_merge() {
        let map = OwnershipMap {
            epoch: 3,
            file_size: 4 * 8192 - 100,
            extent_size: 8192,
            page_size: 4096,
            owner: vec![1, 1, 2, 1],
            ..Default::default()
        };
        let plan = runs_by_owner(
            &map,
            Some(ByteRange {
                offset: 4096,
                length: u64::MAX,
            }),
        )
        .unwrap();
        assert_eq!(
            plan[&1],
            vec![
                PageRun {
                    first_page: 1,
                    page_count: 3
                },
                PageRun {
                    first_page: 6,
                    page_count: 2
                }
            ]
        );
        assert_eq!(
            plan[&2],
            vec![PageRun {
                first_page: 4,
                page_count: 2
            }]
        );
        assert!(runs_by_owner(&map, None).is_err());
        assert!(
            runs_by_owner(
                &map,
                Some(ByteRange {
                    offset: 1 << 40,
                    length: 1
                })
            )
            .is_err()
        );
        assert!(
            runs_by_owner(
                &map,
                Some(ByteRange {
                    offset: 0,
                    length: 0
                })
            )
            .is_err()
        );
    }
}
