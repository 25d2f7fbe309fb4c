//! A fake `Coordinator` gRPC server for failover tests, in-process on
//! 127.0.0.1:0: a leader serves every call; a follower serves the reads
//! (Status, GetMap, WatchMap, ListNodes) and refuses the writes with
//! UNAVAILABLE, naming the leader in `pagewire-leader` when told one; a
//! candidate refuses everything, naming no one. Each fake records the calls
//! it received, so a test can tell which coordinator a client reached.
//!
//! Used by the node's failover test and pwctl's.

use std::sync::{Arc, Mutex, MutexGuard};

use pagewire_proto::auth::TokenCheck;
use pagewire_proto::leader::not_leading;
use pagewire_proto::v1::coordinator_server::{Coordinator, CoordinatorServer};
use pagewire_proto::v1::{
    ClusterRangeRequest, ClusterRangeResponse, CoordinatorPeer, CoordinatorRole, DrainRequest,
    DrainResponse, GetMapRequest, HeartbeatRequest, HeartbeatResponse, LeaveRequest, LeaveResponse,
    ListNodesRequest, ListNodesResponse, OwnershipMap, RegisterRequest, RegisterResponse,
    SetPolicyRequest, SetPolicyResponse, StatusRequest, StatusResponse, WatchMapRequest,
};
use tonic::codegen::tokio_stream::{self, Stream};
use tonic::{Request, Response, Status};

/// What a fake is now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    Leader,
    /// Serves reads; refuses writes naming `hint` (None: no leader known).
    Follower {
        hint: Option<String>,
    },
    /// Refuses every call with UNAVAILABLE and no hint.
    Candidate,
}

/// A fake's state; tests change it under the lock.
#[derive(Debug)]
pub struct FakeState {
    pub role: Role,
    /// Every call received, by method name (`Register`, `Status`, ...).
    pub calls: Vec<&'static str>,
    pub map: OwnershipMap,
    pub lease_ms: u64,
    /// The heartbeat interval a registration is told (default 50 ms).
    pub heartbeat_interval_ms: u64,
    pub uptime_ms: u64,
    /// What `Status` says of the cluster's coordinators.
    pub store: String,
    pub leader: String,
    pub coordinators: Vec<(String, CoordinatorRole)>,
    pub store_problem: String,
    /// `DrainRequest.node_id` of each drain served.
    pub drained: Vec<String>,
    /// WatchMap sends `map` and ends the stream (the watcher comes back);
    /// otherwise it stays open and silent.
    pub stream_maps: bool,
    /// `applied_epoch` of each heartbeat served, in order.
    pub heartbeat_epochs: Vec<u64>,
}

#[derive(Clone)]
struct Svc(Arc<Mutex<FakeState>>);

/// A running fake.
pub struct Fake {
    pub address: String,
    state: Arc<Mutex<FakeState>>,
}

impl Fake {
    /// Starts a fake on `rt` that checks the cluster `token`.
    pub fn start(rt: &tokio::runtime::Runtime, token: &str, role: Role) -> Fake {
        let state = Arc::new(Mutex::new(FakeState {
            role,
            calls: Vec::new(),
            map: OwnershipMap::default(),
            lease_ms: 3000,
            heartbeat_interval_ms: 50,
            uptime_ms: 1000,
            store: "etcd://127.0.0.1:2379".into(),
            leader: String::new(),
            coordinators: Vec::new(),
            store_problem: String::new(),
            drained: Vec::new(),
            stream_maps: false,
            heartbeat_epochs: Vec::new(),
        }));
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind a fake coordinator");
        let address = listener.local_addr().expect("local address").to_string();
        let check = TokenCheck::new(token).expect("token");
        let svc = CoordinatorServer::with_interceptor(Svc(state.clone()), check);
        rt.spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(pagewire_proto::net::incoming(listener)),
        );
        Fake { address, state }
    }

    pub fn state(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_role(&self, role: Role) {
        self.state().role = role;
    }

    /// How many `method` calls this fake received.
    pub fn count(&self, method: &str) -> usize {
        self.state().calls.iter().filter(|c| **c == method).count()
    }
}

impl Svc {
    fn state(&self) -> MutexGuard<'_, FakeState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `method`; refuses it unless this fake's role serves it.
    fn enter(
        &self,
        method: &'static str,
        write: bool,
    ) -> Result<MutexGuard<'_, FakeState>, Status> {
        let mut st = self.state();
        st.calls.push(method);
        match (&st.role, write) {
            (Role::Leader, _) | (Role::Follower { .. }, false) => Ok(st),
            (Role::Follower { hint }, true) => Err(not_leading(
                "this coordinator follows; send writes to the leader",
                hint.as_deref(),
            )),
            (Role::Candidate, _) => Err(not_leading("no coordinator leads now", None)),
        }
    }
}

fn role_of(r: &Role) -> CoordinatorRole {
    match r {
        Role::Leader => CoordinatorRole::Leader,
        Role::Follower { .. } => CoordinatorRole::Follower,
        Role::Candidate => CoordinatorRole::Candidate,
    }
}

type MapStream = std::pin::Pin<Box<dyn Stream<Item = Result<OwnershipMap, Status>> + Send>>;

#[tonic::async_trait]
impl Coordinator for Svc {
    async fn register(
        &self,
        r: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let st = self.enter("Register", true)?;
        assert!(
            !r.get_ref().node_id.is_empty(),
            "a registration names its node"
        );
        Ok(Response::new(RegisterResponse {
            node_index: 1,
            incarnation: 1,
            lease_ms: st.lease_ms,
            heartbeat_interval_ms: st.heartbeat_interval_ms,
            map: None,
            policy: None,
        }))
    }

    async fn heartbeat(
        &self,
        r: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let mut st = self.enter("Heartbeat", true)?;
        st.heartbeat_epochs.push(r.get_ref().applied_epoch);
        Ok(Response::new(HeartbeatResponse {
            lease_ms: st.lease_ms,
            map_epoch: 0,
            policy: None,
        }))
    }

    async fn leave(&self, _r: Request<LeaveRequest>) -> Result<Response<LeaveResponse>, Status> {
        let st = self.enter("Leave", true)?;
        Ok(Response::new(LeaveResponse {
            map_epoch: st.map.epoch,
        }))
    }

    type WatchMapStream = MapStream;

    async fn watch_map(&self, _r: Request<WatchMapRequest>) -> Result<Response<MapStream>, Status> {
        let st = self.enter("WatchMap", false)?;
        if st.stream_maps {
            let map = st.map.clone();
            return Ok(Response::new(Box::pin(tokio_stream::iter([Ok(map)]))));
        }
        // Open, and silent: the node keeps the map it registered with.
        Ok(Response::new(Box::pin(tokio_stream::pending())))
    }

    async fn get_map(&self, _r: Request<GetMapRequest>) -> Result<Response<OwnershipMap>, Status> {
        let st = self.enter("GetMap", false)?;
        Ok(Response::new(st.map.clone()))
    }

    async fn list_nodes(
        &self,
        _r: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        let _st = self.enter("ListNodes", false)?;
        Ok(Response::new(ListNodesResponse { nodes: Vec::new() }))
    }

    async fn status(&self, _r: Request<StatusRequest>) -> Result<Response<StatusResponse>, Status> {
        let st = self.enter("Status", false)?;
        let m = &st.map;
        let mut s = StatusResponse {
            cluster_name: "fake".into(),
            epoch: m.epoch,
            file_size: m.file_size,
            extent_size: m.extent_size,
            page_size: m.page_size,
            extent_count: m.owner.len() as u64,
            lease_ms: st.lease_ms,
            uptime_ms: st.uptime_ms,
            version: "fake".into(),
            store: st.store.clone(),
            leader: st.leader.clone(),
            coordinators: st
                .coordinators
                .iter()
                .map(|(address, role)| CoordinatorPeer {
                    address: address.clone(),
                    role: *role as i32,
                })
                .collect(),
            store_problem: st.store_problem.clone(),
            ..Default::default()
        };
        s.set_role(role_of(&st.role));
        Ok(Response::new(s))
    }

    async fn drain(&self, r: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        let mut st = self.enter("Drain", true)?;
        st.drained.push(r.into_inner().node_id);
        Ok(Response::new(DrainResponse {
            map_epoch: st.map.epoch + 1,
            extents_moved: 3,
        }))
    }

    async fn undrain(&self, _r: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        let st = self.enter("Undrain", true)?;
        Ok(Response::new(DrainResponse {
            map_epoch: st.map.epoch + 1,
            extents_moved: 0,
        }))
    }

    async fn warm(
        &self,
        _r: Request<ClusterRangeRequest>,
    ) -> Result<Response<ClusterRangeResponse>, Status> {
        let st = self.enter("Warm", true)?;
        Ok(Response::new(ClusterRangeResponse {
            map_epoch: st.map.epoch,
            results: Vec::new(),
        }))
    }

    async fn evict(
        &self,
        _r: Request<ClusterRangeRequest>,
    ) -> Result<Response<ClusterRangeResponse>, Status> {
        let st = self.enter("Evict", true)?;
        Ok(Response::new(ClusterRangeResponse {
            map_epoch: st.map.epoch,
            results: Vec::new(),
        }))
    }

    async fn set_policy(
        &self,
        r: Request<SetPolicyRequest>,
    ) -> Result<Response<SetPolicyResponse>, Status> {
        let _st = self.enter("SetPolicy", true)?;
        Ok(Response::new(SetPolicyResponse {
            policy: r.into_inner().policy,
        }))
    }
}
