//! The `pagewire.v1.Coordinator` gRPC service.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
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
use crate::state::Cluster;

type Client = NodeClient<InterceptedService<Channel, AttachToken>>;

pub(crate) struct Shared {
    pub(crate) cluster: Mutex<Cluster>,
    pub(crate) ha: Arc<Leadership>,
    #[cfg(feature = "etcd")]
    pub(crate) etcd: Option<Arc<crate::store::etcd::EtcdStore>>,
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
        cluster: Cluster,
        ha: Arc<Leadership>,
        metrics: Arc<Metrics>,
        token: AttachToken,
        node_tls: Option<ClientTls>,
        node_timeout: Duration,
    ) -> Self {
        Self {
            cluster: Mutex::new(cluster),
            ha,
            #[cfg(feature = "etcd")]
            etcd: None,
            metrics,
            token,
            node_tls,
            node_timeout,
            clients: Mutex::new(HashMap::new()),
            stopping: tokio::sync::watch::Sender::new(false),
        }
    }

    /// The cluster, even if a panic poisoned the lock (every method leaves
    /// the state consistent before anything can panic).
    pub(crate) fn cluster(&self) -> MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cluster, for a write: refused unless this coordinator leads.
    fn leading(&self) -> Result<MutexGuard<'_, Cluster>, Status> {
        self.ha.check_write().map_err(Status::from)?;
        Ok(self.cluster())
    }

    /// Waits until this coordinator's copy of the state is the store's
    /// current one: at once on the leader (it wrote it), after a quorum read
    /// of etcd on a follower. A read answered after this reflects the state
    /// at some instant after the call arrived.
    async fn confirm_read(&self) -> Result<(), String> {
        if self.ha.is_leading() {
            return Ok(());
        }
        #[cfg(feature = "etcd")]
        if let Some(etcd) = &self.etcd {
            return etcd.confirm().await;
        }
        Err("this coordinator does not lead".into())
    }

    /// A read that must be current: refused while it cannot be confirmed.
    async fn confirmed(&self) -> Result<MutexGuard<'_, Cluster>, Status> {
        match self.confirm_read().await {
            Ok(()) => Ok(self.cluster()),
            Err(why) => Err(Status::from(CoordError::NotLeading {
                leader: self.ha.leader(),
                problem: Some(format!("cannot confirm the state with the store: {why}")),
            })),
        }
    }

    /// Every coordinator sharing the store, with its role as this one sees it.
    async fn peers(&self, view: &crate::ha::View) -> Vec<CoordinatorPeer> {
        #[allow(unused_mut)]
        let mut addresses = vec![self.ha.me().to_owned()];
        #[cfg(feature = "etcd")]
        if let Some(etcd) = &self.etcd {
            addresses = etcd.peers().await.unwrap_or(addresses);
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
            if let Err(e) = self.cluster().expire_leases(Instant::now()) {
                tracing::error!(error = %e, "could not publish the map after a lease expired; retrying");
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
        let map = self.shared.leading()?.map();
        let plan = runs_by_owner(&map, range)?;
        let mut results = Vec::new();
        let mut calls = tokio::task::JoinSet::new();
        for (owner, runs) in plan {
            let addr = if owner == 0 {
                None
            } else {
                self.shared.cluster().node_address(owner)
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
        let r = self
            .shared
            .leading()
            .and_then(|mut c| c.register(req.into_inner()).map_err(Status::from));
        self.track("Register", r)
    }

    async fn heartbeat(
        &self,
        req: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let r = self
            .shared
            .leading()
            .and_then(|mut c| c.heartbeat(req.into_inner()).map_err(Status::from));
        self.track("Heartbeat", r)
    }

    async fn leave(&self, req: Request<LeaveRequest>) -> Result<Response<LeaveResponse>, Status> {
        let req = req.into_inner();
        let r = self.shared.leading().and_then(|mut c| {
            c.leave(&req.node_id, req.incarnation)
                .map(|map_epoch| LeaveResponse { map_epoch })
                .map_err(Status::from)
        });
        self.track("Leave", r)
    }

    type WatchMapStream = MapStream;

    async fn watch_map(
        &self,
        req: Request<WatchMapRequest>,
    ) -> Result<Response<MapStream>, Status> {
        let req = req.into_inner();
        let min = req.min_epoch;
        let rx = self.shared.cluster().subscribe();
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
        let r = self.shared.confirmed().await.map(|cluster| {
            if compact {
                let compact = cluster.compact_map();
                return OwnershipMap {
                    epoch: compact.epoch,
                    compact: Some((*compact).clone()),
                    ..Default::default()
                };
            }
            (*cluster.map()).clone()
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
        let r = self
            .shared
            .confirmed()
            .await
            .map(|c| ListNodesResponse { nodes: c.nodes() });
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
        let mut s = self.shared.cluster().status();
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
        let r = self.shared.leading().and_then(|mut c| {
            let req = req.into_inner();
            c.drain(&req.node_id, req.incarnation)
                .map(|(map_epoch, extents_moved)| DrainResponse {
                    map_epoch,
                    extents_moved,
                })
                .map_err(Status::from)
        });
        self.track("Drain", r)
    }

    async fn undrain(&self, req: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        let r = self.shared.leading().and_then(|mut c| {
            c.undrain(&req.into_inner().node_id)
                .map(|map_epoch| DrainResponse {
                    map_epoch,
                    extents_moved: 0,
                })
                .map_err(Status::from)
        });
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
            Some(p) => self.shared.leading().and_then(|mut c| {
                c.set_policy(p)
                    .map(|policy| SetPolicyResponse {
                        policy: Some(policy),
                    })
                    .map_err(Status::from)
            }),
        };
        self.track("SetPolicy", r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
