//! The cluster state machine: members, leases and the ownership map.
//!
//! All of it lives behind one mutex in [`crate::service`]; every method here
//! is short and synchronous. Every map change bumps the epoch, is written to
//! the store (the state file, or etcd: [`crate::store`]), and only then
//! published to watchers, so a published epoch always survives a restart or
//! a change of leader. A coordinator that follows another (etcd) holds the
//! same `Cluster`, replaced with each state the store shows
//! ([`Cluster::load_state`]); it changes nothing itself.
//!
//! ## Moving extents without a gap
//!
//! When an extent moves from a live node A to a node B (B joins, A drains, A
//! leaves through a rebalance), the new map names B as `owner` and A as
//! `previous_owner`. A keeps answering reads of it, so a reader with either
//! map is answered; B answers none of it yet (A, still at an older epoch, may
//! be acknowledging writes to it), and nobody acknowledges writes to it. Once
//! B and A both report (in a heartbeat) that they applied the epoch, the
//! coordinator publishes the next epoch with the handoff cleared and A named
//! in `released_by`: A drops the extent when it applies that epoch, B fills
//! its cache from the backing file, and B acknowledges writes to it one lease
//! (plus its drift margin) after it applied the map, when A has either
//! applied it or lost its lease. `released_by` entries go at a later epoch
//! once their node applied the release or lost its lease.
//!
//! An extent whose owner died moves with no handoff and no release: the dead
//! node's own lease ran out before the coordinator's did. Until its new owner
//! applies the map, readers retry and fall back to reading the backing file
//! themselves (the source of truth), as for any failed owner.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pagewire_proto::v1::{
    HeartbeatRequest, HeartbeatResponse, MapNode, NodeInfo, NodeState, OwnershipMap, Policy,
    RegisterRequest, RegisterResponse, StatusResponse,
};
use tokio::sync::watch;

use crate::error::{CoordError, quoted, state_name};
use crate::metrics::Metrics;
use crate::persist::PersistedState;
use crate::rendezvous::{self, Candidate};
use crate::store::{FileStore, Store};

/// Fixed parameters of a cluster.
#[derive(Debug, Clone)]
pub(crate) struct Params {
    pub(crate) cluster_name: String,
    pub(crate) extent_size: u64,
    pub(crate) page_size: u32,
    pub(crate) lease: Duration,
    pub(crate) heartbeat_interval: Duration,
    pub(crate) state_file: PathBuf,
}

struct Member {
    /// Persistent fields plus the runtime ones (`applied_epoch`, `stats`).
    info: NodeInfo,
    /// When the lease runs out (only for states holding a lease).
    lease_deadline: Option<Instant>,
}

pub(crate) struct Cluster {
    params: Params,
    file_size: u64,
    /// By node id; the BTreeMap keeps listings sorted.
    members: BTreeMap<String, Member>,
    next_index: u32,
    next_incarnation: u64,
    epoch: u64,
    owner: Vec<u32>,
    previous: Vec<u32>,
    /// `released_by` of the map (see `OwnershipMap`), and the epoch at which
    /// each entry was released (0 where none).
    released: Vec<u32>,
    released_epoch: Vec<u64>,
    policy: Policy,
    /// What the config says, for a state without them.
    config_file_size: u64,
    config_policy: Policy,
    map_tx: watch::Sender<Arc<OwnershipMap>>,
    metrics: Arc<Metrics>,
    started: Instant,
    store: Arc<dyn Store>,
}

/// Only these states hold a lease (and may serve extents).
fn holds_lease(s: NodeState) -> bool {
    matches!(
        s,
        NodeState::Alive | NodeState::Draining | NodeState::Drained
    )
}

fn validate_node_id(id: &str) -> Result<(), CoordError> {
    if id.is_empty() || id.len() > 128 {
        return Err(CoordError::InvalidArgument(
            "node_id must be 1 to 128 bytes".into(),
        ));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(CoordError::InvalidArgument(format!(
            "node_id {} may only hold letters, digits, '.', '_' and '-'",
            quoted(id)
        )));
    }
    Ok(())
}

/// A free-form string field of a request: at most `max` bytes.
fn validate_len(field: &str, value: &str, max: usize) -> Result<(), CoordError> {
    if value.len() > max {
        return Err(CoordError::InvalidArgument(format!(
            "{field} is {} bytes, at most {max} are allowed: {}",
            value.len(),
            quoted(value)
        )));
    }
    Ok(())
}

fn validate_address(field: &str, addr: &str, required: bool) -> Result<(), CoordError> {
    if addr.is_empty() {
        return if required {
            Err(CoordError::InvalidArgument(format!("{field} is required")))
        } else {
            Ok(())
        };
    }
    let ok = addr.len() <= 256
        && addr.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0)
        });
    if ok {
        Ok(())
    } else {
        Err(CoordError::InvalidArgument(format!(
            "{field} {} is not host:port",
            quoted(addr)
        )))
    }
}

impl Cluster {
    /// An empty cluster (no member, epoch 0) that saves to `store`.
    pub(crate) fn new(
        params: Params,
        config_file_size: u64,
        config_policy: Policy,
        metrics: Arc<Metrics>,
        store: Arc<dyn Store>,
    ) -> Self {
        let (map_tx, _) = watch::channel(Arc::new(OwnershipMap::default()));
        let mut c = Cluster {
            file_size: config_file_size,
            config_file_size,
            members: BTreeMap::new(),
            next_index: 1,
            next_incarnation: 1,
            epoch: 0,
            owner: Vec::new(),
            previous: Vec::new(),
            released: Vec::new(),
            released_epoch: Vec::new(),
            policy: config_policy,
            config_policy,
            map_tx,
            metrics,
            started: Instant::now(),
            params,
            store,
        };
        c.publish_current();
        c
    }

    /// Loads the state file (or starts empty) and checks it against `params`.
    pub(crate) fn open(
        params: Params,
        config_file_size: u64,
        config_policy: Policy,
        metrics: Arc<Metrics>,
    ) -> Result<Self, crate::StartError> {
        let file = FileStore {
            path: params.state_file.clone(),
        };
        let loaded = file.load()?;
        let what = format!("state file {}", params.state_file.display());
        let mut c = Self::new(
            params,
            config_file_size,
            config_policy,
            metrics,
            Arc::new(file),
        );
        if let Some(st) = loaded {
            c.load_state(st, &what)?;
        }
        Ok(c)
    }

    /// Replaces everything with `st` (read from the store; `what` names it
    /// in errors) and publishes its map. Every member that held a lease gets
    /// a fresh one: it had no chance to heartbeat to this coordinator (a
    /// restart, or a follower taking over the leadership).
    pub(crate) fn load_state(
        &mut self,
        st: PersistedState,
        what: &str,
    ) -> Result<(), crate::StartError> {
        let map = st.map.unwrap_or_default();
        if map.extent_size != self.params.extent_size || map.page_size != self.params.page_size {
            return Err(crate::StartError::StateMismatch(format!(
                "{what} was written with extent_size {} and page_size {}, the config \
                 says {} and {}; keep the old values or start with a new state",
                map.extent_size, map.page_size, self.params.extent_size, self.params.page_size
            )));
        }
        let config_file_size = self.config_file_size;
        if config_file_size != 0 && map.file_size != 0 && map.file_size != config_file_size {
            return Err(crate::StartError::StateMismatch(format!(
                "{what} is for a {} byte file, the config says {}",
                map.file_size, config_file_size
            )));
        }
        self.file_size = map.file_size.max(config_file_size);
        self.epoch = map.epoch;
        self.owner = map.owner;
        self.previous = map.previous_owner;
        // The release epochs are not saved: count them from now, which
        // only keeps an entry longer.
        self.released_epoch = vec![map.epoch; map.released_by.len()];
        self.released = map.released_by;
        self.policy = self.config_policy;
        if let Some(p) = st.policy {
            // A policy saved by an older coordinator may name what the
            // nodes do not implement: the config's replaces it, with a
            // higher version so nodes that applied the old one switch.
            match crate::config::check_implemented(&p) {
                Ok(()) => self.policy = p,
                Err(why) => {
                    tracing::warn!(saved_version = p.version, %why, "saved policy refused; using the config's");
                    self.policy.version = p.version + 1;
                }
            }
        }
        self.next_index = st.next_index.max(1);
        self.next_incarnation = st.next_incarnation.max(1);
        let now = Instant::now();
        self.members.clear();
        for info in st.members {
            let lease_deadline = holds_lease(info.state()).then(|| now + self.params.lease);
            self.members.insert(
                info.node_id.clone(),
                Member {
                    info,
                    lease_deadline,
                },
            );
        }
        tracing::info!(
            epoch = self.epoch,
            members = self.members.len(),
            from = %what,
            "state restored"
        );
        // A state saved without a new epoch (a registration, a policy) may
        // carry the same map: watchers get a map once.
        if *self.map() != self.build_map() {
            self.publish_current();
        }
        Ok(())
    }

    /// Gives every member holding a lease a fresh one (a follower that
    /// starts leading: it saw none of their heartbeats).
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn renew_all_leases(&mut self) {
        let deadline = Instant::now() + self.params.lease;
        for m in self.members.values_mut() {
            if holds_lease(m.info.state()) {
                m.lease_deadline = Some(deadline);
            }
        }
    }

    /// Saves to `store` from now on.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn set_store(&mut self, store: Arc<dyn Store>) {
        self.store = store;
    }

    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Arc<OwnershipMap>> {
        self.map_tx.subscribe()
    }

    pub(crate) fn map(&self) -> Arc<OwnershipMap> {
        self.map_tx.borrow().clone()
    }

    fn extent_count(&self) -> u64 {
        self.file_size.div_ceil(self.params.extent_size)
    }

    fn map_nodes(&self) -> Vec<MapNode> {
        let mut nodes: Vec<MapNode> = self
            .members
            .values()
            .map(|m| MapNode {
                index: m.info.index,
                node_id: m.info.node_id.clone(),
                grpc_address: m.info.grpc_address.clone(),
                transports: m.info.transports.clone(),
                state: m.info.state,
            })
            .collect();
        nodes.sort_by_key(|n| n.index);
        nodes
    }

    fn build_map(&self) -> OwnershipMap {
        OwnershipMap {
            epoch: self.epoch,
            file_size: self.file_size,
            extent_size: self.params.extent_size,
            page_size: self.params.page_size,
            nodes: self.map_nodes(),
            owner: self.owner.clone(),
            previous_owner: self.previous.clone(),
            released_by: self.released.clone(),
        }
    }

    fn persisted(&self) -> PersistedState {
        PersistedState {
            cluster_name: self.params.cluster_name.clone(),
            members: self
                .members
                .values()
                .map(|m| NodeInfo {
                    node_id: m.info.node_id.clone(),
                    index: m.info.index,
                    grpc_address: m.info.grpc_address.clone(),
                    metrics_address: m.info.metrics_address.clone(),
                    capacity_bytes: m.info.capacity_bytes,
                    topology: m.info.topology.clone(),
                    transports: m.info.transports.clone(),
                    state: m.info.state,
                    incarnation: m.info.incarnation,
                    ..Default::default()
                })
                .collect(),
            map: Some(self.build_map()),
            policy: Some(self.policy),
            next_index: self.next_index,
            next_incarnation: self.next_incarnation,
        }
    }

    /// Saves without a new epoch (a registration, a policy, a drain that
    /// moved nothing).
    fn save(&self) -> Result<(), CoordError> {
        self.store_save(None)
    }

    /// Saves to the store, timing it.
    fn store_save(&self, new_epoch: Option<(u64, &str)>) -> Result<(), CoordError> {
        let started = Instant::now();
        let r = self.store.save(&self.persisted(), new_epoch);
        self.metrics
            .store_save_seconds
            .observe(started.elapsed().as_secs_f64());
        if r.is_err() {
            self.metrics.store_errors.inc();
        }
        Ok(r?)
    }

    fn publish_current(&mut self) {
        let map = Arc::new(self.build_map());
        self.metrics.observe_map(&map, &self.members_for_metrics());
        self.map_tx.send_replace(map);
    }

    fn members_for_metrics(&self) -> Vec<(String, NodeState)> {
        self.members
            .values()
            .map(|m| (m.info.node_id.clone(), m.info.state()))
            .collect()
    }

    /// Recomputes owners from the members' states; when the map changes,
    /// bumps the epoch, saves and publishes. Returns whether it changed.
    fn rebalance(&mut self, reason: &str) -> Result<bool, CoordError> {
        let candidates: Vec<Candidate<'_>> = self
            .members
            .values()
            .filter(|m| m.info.state() == NodeState::Alive)
            .map(|m| Candidate {
                index: m.info.index,
                node_id: &m.info.node_id,
                weight: m.info.capacity_bytes,
            })
            .collect();
        let new_owner = rendezvous::assign(self.extent_count(), &candidates);
        let serving: HashSet<u32> = self
            .members
            .values()
            .filter(|m| holds_lease(m.info.state()))
            .map(|m| m.info.index)
            .collect();
        let mut new_prev = vec![0u32; new_owner.len()];
        let mut any_prev = false;
        for (i, &new) in new_owner.iter().enumerate() {
            let cur = self.owner.get(i).copied().unwrap_or(0);
            let prev = self.previous.get(i).copied().unwrap_or(0);
            // The node certainly serving this extent now: the one handing it
            // off, else its owner.
            let server = if prev != 0 && serving.contains(&prev) {
                prev
            } else if cur != 0 && serving.contains(&cur) {
                cur
            } else {
                0
            };
            if server != 0 && server != new {
                new_prev[i] = server;
                any_prev = true;
            }
        }
        if !any_prev {
            new_prev.clear();
        }
        self.commit(new_owner, new_prev, reason)
    }

    /// Installs owners and handoffs; bumps the epoch if anything changed.
    fn commit(
        &mut self,
        owner: Vec<u32>,
        previous: Vec<u32>,
        reason: &str,
    ) -> Result<bool, CoordError> {
        let nodes = self.map_nodes();
        let current = self.map();
        if owner == self.owner
            && previous == self.previous
            && nodes == current.nodes
            && self.epoch != 0
        {
            return Ok(false);
        }
        let moved = owner
            .iter()
            .zip(self.owner.iter().chain(std::iter::repeat(&0)))
            .filter(|(a, b)| a != b)
            .count();
        let (released, released_epoch) = self.releases(&owner, &previous, self.epoch + 1);
        let old = (
            std::mem::replace(&mut self.owner, owner),
            std::mem::replace(&mut self.previous, previous),
            std::mem::replace(&mut self.released, released),
            std::mem::replace(&mut self.released_epoch, released_epoch),
        );
        self.epoch += 1;
        self.settle_drains();
        if let Err(e) = self.store_save(Some((self.epoch, reason))) {
            // Roll back: an epoch that is not on disk must not be published.
            self.epoch -= 1;
            (
                self.owner,
                self.previous,
                self.released,
                self.released_epoch,
            ) = old;
            return Err(e);
        }
        tracing::info!(
            epoch = self.epoch,
            reason,
            moved,
            handoffs = self.previous.iter().filter(|&&p| p != 0).count(),
            "new ownership map"
        );
        self.metrics.map_changes.inc();
        self.publish_current();
        Ok(true)
    }

    /// `released_by` for the map about to be published at `epoch` with these
    /// owners and handoffs: the live node that answered an extent from its
    /// cache at the current epoch (its previous owner in a handoff, else its
    /// owner) and is neither owner nor previous owner any more; else the
    /// entry carried over, while its node still holds a lease and has not
    /// applied the epoch that released it. Empty when there is none.
    fn releases(&self, owner: &[u32], previous: &[u32], epoch: u64) -> (Vec<u32>, Vec<u64>) {
        let live: BTreeMap<u32, u64> = self
            .members
            .values()
            .filter(|m| holds_lease(m.info.state()))
            .map(|m| (m.info.index, m.info.applied_epoch))
            .collect();
        let mut released = vec![0u32; owner.len()];
        let mut since = vec![0u64; owner.len()];
        for (i, &new_owner) in owner.iter().enumerate() {
            let new_prev = previous.get(i).copied().unwrap_or(0);
            let old_prev = self.previous.get(i).copied().unwrap_or(0);
            let old_server = if old_prev != 0 {
                old_prev
            } else {
                self.owner.get(i).copied().unwrap_or(0)
            };
            if old_server != 0
                && live.contains_key(&old_server)
                && old_server != new_owner
                && old_server != new_prev
            {
                released[i] = old_server;
                since[i] = epoch;
                continue;
            }
            let (r, at) = (
                self.released.get(i).copied().unwrap_or(0),
                self.released_epoch.get(i).copied().unwrap_or(0),
            );
            if r != 0 && r != new_owner && live.get(&r).is_some_and(|&applied| applied < at) {
                released[i] = r;
                since[i] = at;
            }
        }
        if released.iter().all(|&r| r == 0) {
            return (Vec::new(), Vec::new());
        }
        (released, since)
    }

    /// Draining nodes that own and hand off nothing are drained.
    fn settle_drains(&mut self) {
        let busy: HashSet<u32> = self
            .owner
            .iter()
            .chain(self.previous.iter())
            .copied()
            .collect();
        for m in self.members.values_mut() {
            if m.info.state() == NodeState::Draining && !busy.contains(&m.info.index) {
                m.info.set_state(NodeState::Drained);
                tracing::info!(node = %m.info.node_id, "node drained");
            }
        }
    }

    /// Clears the handoff once every new owner in it, and every previous
    /// owner still holding a lease, applied this epoch: from then on no
    /// previous owner acknowledges a write to a moving extent (it is not
    /// its owner at this epoch), so its new owner may fill its cache.
    fn maybe_finish_handoff(&mut self) -> Result<(), CoordError> {
        if self.previous.is_empty() {
            return Ok(());
        }
        let new_owners: HashSet<u32> = self
            .owner
            .iter()
            .zip(&self.previous)
            .filter(|(_, p)| **p != 0)
            .map(|(o, _)| *o)
            .collect();
        let previous: HashSet<u32> = self.previous.iter().copied().filter(|&p| p != 0).collect();
        let applied = |idx: u32| {
            self.members
                .values()
                .any(|m| m.info.index == idx && m.info.applied_epoch >= self.epoch)
        };
        let holds = |idx: u32| {
            self.members
                .values()
                .any(|m| m.info.index == idx && holds_lease(m.info.state()))
        };
        let ready = new_owners.iter().all(|&i| applied(i))
            && previous.iter().all(|&i| !holds(i) || applied(i));
        if ready {
            let owner = self.owner.clone();
            self.commit(owner, Vec::new(), "handoff complete")?;
        }
        Ok(())
    }

    pub(crate) fn register(
        &mut self,
        req: RegisterRequest,
    ) -> Result<RegisterResponse, CoordError> {
        validate_node_id(&req.node_id)?;
        validate_address("grpc_address", &req.grpc_address, true)?;
        validate_address("metrics_address", &req.metrics_address, false)?;
        if req.capacity_bytes == 0 {
            return Err(CoordError::InvalidArgument(
                "capacity_bytes must be > 0".into(),
            ));
        }
        if req.page_size != self.params.page_size {
            return Err(CoordError::PageSizeMismatch {
                cluster: self.params.page_size,
                node: req.page_size,
            });
        }
        if req.file_size == 0 {
            return Err(CoordError::InvalidArgument(
                "file_size must be > 0 (the node's backing file is empty?)".into(),
            ));
        }
        if req.transports.len() > 64 {
            return Err(CoordError::InvalidArgument(
                "at most 64 transport descriptors".into(),
            ));
        }
        for t in &req.transports {
            validate_len("transport kind", &t.kind, 64)?;
            validate_len("transport endpoint", &t.endpoint, 1024)?;
            if t.opaque.len() > 4096 {
                return Err(CoordError::InvalidArgument(
                    "a transport's opaque field is limited to 4096 bytes".into(),
                ));
            }
        }
        if let Some(t) = &req.topology {
            if t.numa_nodes.len() > 4096 {
                return Err(CoordError::InvalidArgument(
                    "at most 4096 NUMA nodes".into(),
                ));
            }
            if t.numa_nodes.iter().map(|n| n.cpus.len()).sum::<usize>() > 1 << 20 {
                return Err(CoordError::InvalidArgument("at most 1 Mi CPUs".into()));
            }
            validate_len("topology source", &t.source, 64)?;
            validate_len("topology hostname", &t.hostname, 256)?;
        }
        self.check_identity(&req, Instant::now())?;
        if self.file_size == 0 {
            if req.file_size.div_ceil(self.params.extent_size) > 1 << 24 {
                return Err(CoordError::InvalidArgument(
                    "file too large for the extent size: more than 16 Mi extents".into(),
                ));
            }
            tracing::info!(file_size = req.file_size, node = %req.node_id, "cluster file size set by first node");
            self.file_size = req.file_size;
        } else if req.file_size != self.file_size {
            return Err(CoordError::FileSizeMismatch {
                cluster: self.file_size,
                node: req.file_size,
            });
        }

        let incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        let now = Instant::now();
        let lease = self.params.lease;
        let next_index = &mut self.next_index;
        let m = self.members.entry(req.node_id.clone()).or_insert_with(|| {
            let index = *next_index;
            *next_index += 1;
            Member {
                info: NodeInfo {
                    node_id: req.node_id.clone(),
                    index,
                    ..Default::default()
                },
                lease_deadline: None,
            }
        });
        // A restarted node keeps an operator's drain.
        let state = match m.info.state() {
            s @ (NodeState::Draining | NodeState::Drained) => s,
            _ => NodeState::Alive,
        };
        m.info.grpc_address = req.grpc_address;
        m.info.metrics_address = req.metrics_address;
        m.info.capacity_bytes = req.capacity_bytes;
        m.info.topology = req.topology;
        m.info.transports = req.transports;
        m.info.set_state(state);
        m.info.incarnation = incarnation;
        m.info.applied_epoch = 0;
        m.lease_deadline = Some(now + lease);
        let index = m.info.index;
        tracing::info!(node = %req.node_id, index, incarnation, "node registered");
        self.metrics.registrations.inc();
        if !self.rebalance("node registered")? {
            // Even with the same map, the registration must be durable.
            self.save()?;
        }
        Ok(RegisterResponse {
            node_index: index,
            incarnation,
            lease_ms: self.lease_ms(),
            heartbeat_interval_ms: self.heartbeat_interval_ms(),
            map: Some((*self.map()).clone()),
            policy: Some(self.policy),
        })
    }

    /// Refuses a registration that would take `req.node_id` from another
    /// live process, or bring back an incarnation that left.
    ///
    /// The restart rule: a registration for an id whose lease another
    /// incarnation holds is accepted only from that incarnation itself (it
    /// sends it as `previous_incarnation` after losing its own lease) or at
    /// the same `grpc_address` (two live processes cannot listen on one
    /// address, so that is a restart in place). A process restarted at
    /// another address is refused until the old lease runs out, at most one
    /// lease; the node waits that long once and registers again.
    fn check_identity(&self, req: &RegisterRequest, now: Instant) -> Result<(), CoordError> {
        let Some(m) = self.members.get(&req.node_id) else {
            return Ok(());
        };
        let same_incarnation =
            req.previous_incarnation != 0 && req.previous_incarnation == m.info.incarnation;
        if same_incarnation && m.info.state() == NodeState::Left {
            return Err(CoordError::Left {
                node_id: req.node_id.clone(),
                incarnation: m.info.incarnation,
            });
        }
        let remaining = m
            .lease_deadline
            .filter(|_| holds_lease(m.info.state()))
            .map(|d| d.saturating_duration_since(now))
            .filter(|r| !r.is_zero());
        match remaining {
            Some(r) if !same_incarnation && m.info.grpc_address != req.grpc_address => {
                Err(CoordError::NodeIdInUse {
                    node_id: req.node_id.clone(),
                    address: m.info.grpc_address.clone(),
                    incarnation: m.info.incarnation,
                    lease_remaining_ms: u64::try_from(r.as_millis()).unwrap_or(u64::MAX).max(1),
                })
            }
            _ => Ok(()),
        }
    }

    fn lease_ms(&self) -> u64 {
        u64::try_from(self.params.lease.as_millis()).unwrap_or(u64::MAX)
    }

    fn heartbeat_interval_ms(&self) -> u64 {
        u64::try_from(self.params.heartbeat_interval.as_millis()).unwrap_or(u64::MAX)
    }

    fn member_checked(
        &mut self,
        node_id: &str,
        incarnation: u64,
    ) -> Result<&mut Member, CoordError> {
        let m = self
            .members
            .get_mut(node_id)
            .ok_or_else(|| CoordError::UnknownNode(node_id.to_owned()))?;
        if m.info.incarnation != incarnation {
            return Err(CoordError::StaleIncarnation {
                node_id: node_id.to_owned(),
            });
        }
        if !holds_lease(m.info.state()) {
            return Err(CoordError::NotAlive {
                node_id: node_id.to_owned(),
                state: state_name(m.info.state()),
            });
        }
        Ok(m)
    }

    pub(crate) fn heartbeat(
        &mut self,
        req: HeartbeatRequest,
    ) -> Result<HeartbeatResponse, CoordError> {
        validate_node_id(&req.node_id)?;
        let lease = self.params.lease;
        let epoch = self.epoch;
        let m = self.member_checked(&req.node_id, req.incarnation)?;
        m.lease_deadline = Some(Instant::now() + lease);
        m.info.applied_epoch = req.applied_epoch.min(epoch);
        if let Some(stats) = req.stats {
            m.info.stats = Some(stats);
        }
        self.metrics.heartbeats.inc();
        self.maybe_finish_handoff()?;
        Ok(HeartbeatResponse {
            lease_ms: self.lease_ms(),
            map_epoch: self.epoch,
            policy: Some(self.policy),
        })
    }

    pub(crate) fn leave(&mut self, node_id: &str, incarnation: u64) -> Result<u64, CoordError> {
        validate_node_id(node_id)?;
        let m = self.member_checked(node_id, incarnation)?;
        m.info.set_state(NodeState::Left);
        m.lease_deadline = None;
        tracing::info!(node = %node_id, "node left");
        self.rebalance("node left")?;
        Ok(self.epoch)
    }

    /// Declares dead every node whose lease ran out; returns their ids.
    pub(crate) fn expire_leases(&mut self, now: Instant) -> Result<Vec<String>, CoordError> {
        let mut dead = Vec::new();
        for m in self.members.values_mut() {
            if m.lease_deadline.is_some_and(|d| d <= now) {
                m.lease_deadline = None;
                m.info.set_state(NodeState::Dead);
                m.info.applied_epoch = 0;
                dead.push(m.info.node_id.clone());
            }
        }
        if !dead.is_empty() {
            for id in &dead {
                tracing::warn!(node = %id, lease_ms = self.lease_ms(), "node missed its lease: declared dead");
                self.metrics.deaths.inc();
            }
            self.rebalance("lease expired")?;
        }
        Ok(dead)
    }

    /// Starts moving every extent off `node_id`. Returns the new epoch and
    /// how many extents the node owned.
    /// Refused when no other alive node would be left to take its extents.
    pub(crate) fn drain(&mut self, node_id: &str) -> Result<(u64, u64), CoordError> {
        validate_node_id(node_id)?;
        let others_alive = self
            .members
            .values()
            .any(|m| m.info.node_id != node_id && m.info.state() == NodeState::Alive);
        let m = self
            .members
            .get_mut(node_id)
            .ok_or_else(|| CoordError::UnknownNode(node_id.to_owned()))?;
        let index = m.info.index;
        match m.info.state() {
            NodeState::Alive if !others_alive => {
                return Err(CoordError::NoNodeLeft {
                    node_id: node_id.to_owned(),
                    extents: self.owner.iter().filter(|&&o| o == index).count() as u64,
                });
            }
            NodeState::Alive => m.info.set_state(NodeState::Draining),
            NodeState::Draining | NodeState::Drained => {}
            s => {
                return Err(CoordError::NotAlive {
                    node_id: node_id.to_owned(),
                    state: state_name(s),
                });
            }
        }
        let owned = self.owner.iter().filter(|&&o| o == index).count() as u64;
        tracing::info!(node = %node_id, extents = owned, "draining node");
        if !self.rebalance("drain")? {
            self.settle_drains();
            self.save()?;
        }
        Ok((self.epoch, owned))
    }

    pub(crate) fn undrain(&mut self, node_id: &str) -> Result<u64, CoordError> {
        validate_node_id(node_id)?;
        let m = self
            .members
            .get_mut(node_id)
            .ok_or_else(|| CoordError::UnknownNode(node_id.to_owned()))?;
        match m.info.state() {
            NodeState::Draining | NodeState::Drained => m.info.set_state(NodeState::Alive),
            NodeState::Alive => {}
            s => {
                return Err(CoordError::NotAlive {
                    node_id: node_id.to_owned(),
                    state: state_name(s),
                });
            }
        }
        if !self.rebalance("undrain")? {
            self.save()?;
        }
        Ok(self.epoch)
    }

    pub(crate) fn set_policy(&mut self, mut p: Policy) -> Result<Policy, CoordError> {
        crate::config::validate_policy(&p).map_err(CoordError::InvalidArgument)?;
        crate::config::check_implemented(&p).map_err(CoordError::Unimplemented)?;
        p.version = self.policy.version + 1;
        let old = std::mem::replace(&mut self.policy, p);
        if let Err(e) = self.save() {
            self.policy = old;
            return Err(e);
        }
        tracing::info!(
            version = p.version,
            admission = crate::config::admission_name(p.admission()),
            eviction = crate::config::eviction_name(p.eviction()),
            high = p.high_watermark_percent,
            low = p.low_watermark_percent,
            "policy changed"
        );
        Ok(p)
    }

    pub(crate) fn nodes(&self) -> Vec<NodeInfo> {
        let now = Instant::now();
        let mut counts: BTreeMap<u32, u64> = BTreeMap::new();
        for &o in &self.owner {
            *counts.entry(o).or_default() += 1;
        }
        let mut out: Vec<NodeInfo> = self
            .members
            .values()
            .map(|m| {
                let mut info = m.info.clone();
                info.lease_remaining_ms = m
                    .lease_deadline
                    .map(|d| {
                        u64::try_from(d.saturating_duration_since(now).as_millis()).unwrap_or(0)
                    })
                    .unwrap_or(0);
                info.extents_owned = counts.get(&info.index).copied().unwrap_or(0);
                info
            })
            .collect();
        out.sort_by_key(|n| n.index);
        out
    }

    pub(crate) fn status(&self) -> StatusResponse {
        let alive = self
            .members
            .values()
            .filter(|m| holds_lease(m.info.state()))
            .count();
        StatusResponse {
            cluster_name: self.params.cluster_name.clone(),
            epoch: self.epoch,
            file_size: self.file_size,
            extent_size: self.params.extent_size,
            page_size: self.params.page_size,
            extent_count: self.extent_count(),
            nodes_alive: u32::try_from(alive).unwrap_or(u32::MAX),
            nodes_total: u32::try_from(self.members.len()).unwrap_or(u32::MAX),
            extents_unowned: self
                .extent_count()
                .saturating_sub(self.owner.iter().filter(|&&o| o != 0).count() as u64),
            extents_in_handoff: self.previous.iter().filter(|&&p| p != 0).count() as u64,
            lease_ms: self.lease_ms(),
            policy: Some(self.policy),
            uptime_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            ..Default::default()
        }
    }

    /// Node index → (node id, gRPC address), for forwarding calls.
    pub(crate) fn node_address(&self, index: u32) -> Option<(String, String)> {
        self.members
            .values()
            .find(|m| m.info.index == index)
            .map(|m| (m.info.node_id.clone(), m.info.grpc_address.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagewire_proto::v1::RegisterRequest;

    fn params(dir: &std::path::Path) -> Params {
        Params {
            cluster_name: "t".into(),
            extent_size: 1 << 16,
            page_size: 4096,
            lease: Duration::from_millis(500),
            heartbeat_interval: Duration::from_millis(100),
            state_file: dir.join("state"),
        }
    }

    fn reg(id: &str) -> RegisterRequest {
        RegisterRequest {
            node_id: id.into(),
            grpc_address: "127.0.0.1:9".into(),
            capacity_bytes: 1 << 30,
            file_size: 4096 << 16,
            page_size: 4096,
            ..Default::default()
        }
    }

    fn open(dir: &std::path::Path) -> Cluster {
        Cluster::open(
            params(dir),
            0,
            crate::config::Config::default().policy().unwrap(),
            Arc::new(Metrics::new()),
        )
        .unwrap()
    }

    fn count(c: &Cluster, index: u32) -> usize {
        c.owner.iter().filter(|&&o| o == index).count()
    }

    #[test]
    fn join_hands_off_then_commits_and_restart_restores() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        let a = c.register(reg("a")).unwrap();
        assert_eq!(count(&c, a.node_index), 4096);
        assert!(c.previous.is_empty(), "nothing to hand off from nobody");
        let b = c.register(reg("b")).unwrap();
        let e = c.epoch;
        assert!(c.previous.contains(&a.node_index));
        assert!(c.released.is_empty(), "a still serves what it hands off");
        let moving = c.previous.clone();
        // b has not applied yet: the handoff stays.
        c.heartbeat(HeartbeatRequest {
            node_id: "a".into(),
            incarnation: a.incarnation,
            applied_epoch: e,
            stats: None,
        })
        .unwrap();
        assert_eq!(c.epoch, e);
        c.heartbeat(HeartbeatRequest {
            node_id: "b".into(),
            incarnation: b.incarnation,
            applied_epoch: e,
            stats: None,
        })
        .unwrap();
        assert_eq!(c.epoch, e + 1);
        assert!(c.previous.is_empty());
        // The map names a as having released exactly what it handed off.
        assert_eq!(c.released, moving);
        assert_eq!(c.map().released_by, moving);
        let (owner, epoch) = (c.owner.clone(), c.epoch);
        drop(c);
        let c = open(dir.path());
        assert_eq!((c.owner.clone(), c.epoch), (owner, epoch));
        assert_eq!(c.members.len(), 2);
    }

    #[test]
    fn a_handoff_waits_for_the_previous_owner_and_a_release_for_its_node() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        let a = c.register(reg("a")).unwrap();
        let b = c.register(reg("b")).unwrap();
        let hb = |c: &mut Cluster, id: &str, incarnation: u64, applied_epoch: u64| {
            c.heartbeat(HeartbeatRequest {
                node_id: id.into(),
                incarnation,
                applied_epoch,
                stats: None,
            })
            .unwrap();
        };
        let e = c.epoch;
        // The new owner applied, the previous one not yet: a may still be at
        // the epoch where it owned (and wrote) the moving extents.
        hb(&mut c, "b", b.incarnation, e);
        assert_eq!(c.epoch, e);
        hb(&mut c, "a", a.incarnation, e - 1);
        assert_eq!(c.epoch, e);
        hb(&mut c, "a", a.incarnation, e);
        assert_eq!(c.epoch, e + 1);
        assert!(c.released.contains(&a.node_index));
        // a applies the release; the entry goes at the next epoch.
        hb(&mut c, "a", a.incarnation, e + 1);
        c.register(reg("c")).unwrap();
        assert!(
            !c.released.contains(&a.node_index),
            "a applied the epoch that released it: {:?}",
            c.released.iter().filter(|&&r| r != 0).count()
        );
    }

    #[test]
    fn expiry_moves_extents_and_drain_empties_a_node() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        let a = c.register(reg("a")).unwrap();
        let b = c.register(reg("b")).unwrap();
        c.register(reg("c")).unwrap();
        // Only a's lease is renewed far in the future by expiring at "now + 1s".
        let later = Instant::now() + Duration::from_secs(1);
        c.members.get_mut("a").unwrap().lease_deadline = Some(later + Duration::from_secs(10));
        c.members.get_mut("c").unwrap().lease_deadline = Some(later + Duration::from_secs(10));
        let dead = c.expire_leases(later).unwrap();
        assert_eq!(dead, vec!["b".to_owned()]);
        assert_eq!(count(&c, b.node_index), 0);
        assert!(!c.previous.contains(&b.node_index));
        let (_, owned) = c.drain("a").unwrap();
        assert!(owned > 0);
        assert_eq!(count(&c, a.node_index), 0);
        assert!(matches!(
            c.heartbeat(HeartbeatRequest {
                node_id: "b".into(),
                incarnation: b.incarnation,
                ..Default::default()
            }),
            Err(CoordError::NotAlive { .. })
        ));
    }

    #[test]
    fn bad_registrations_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        let mut r = reg("bad id");
        assert!(matches!(
            c.register(r.clone()),
            Err(CoordError::InvalidArgument(_))
        ));
        r = reg("x");
        r.grpc_address = "nowhere".into();
        assert!(matches!(c.register(r), Err(CoordError::InvalidArgument(_))));
        r = reg("x");
        r.page_size = 512;
        assert!(matches!(
            c.register(r),
            Err(CoordError::PageSizeMismatch { .. })
        ));
        c.register(reg("x")).unwrap();
        r = reg("y");
        r.file_size = 5;
        assert!(matches!(
            c.register(r),
            Err(CoordError::FileSizeMismatch { .. })
        ));
    }

    fn hb(c: &mut Cluster, id: &str, incarnation: u64) -> Result<HeartbeatResponse, CoordError> {
        c.heartbeat(HeartbeatRequest {
            node_id: id.into(),
            incarnation,
            applied_epoch: c.epoch,
            stats: None,
        })
    }

    #[test]
    fn a_live_node_id_is_not_taken_by_another_process() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        let real = c.register(reg("n")).unwrap();
        let epoch = c.epoch;
        // A second process with the same id at another address.
        let mut dup = reg("n");
        dup.grpc_address = "127.0.0.1:10".into();
        let e = c.register(dup.clone()).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, CoordError::NodeIdInUse { .. }), "{msg}");
        assert!(msg.contains("127.0.0.1:9") && msg.contains("ms"), "{msg}");
        let status = tonic::Status::from(e);
        assert_eq!(status.code(), tonic::Code::AlreadyExists);
        let remaining: u64 = status
            .metadata()
            .get(crate::error::LEASE_REMAINING_KEY)
            .unwrap()
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=500).contains(&remaining), "{remaining}");
        assert_eq!(c.epoch, epoch, "a refused registration changed the map");
        assert_eq!(c.members["n"].info.incarnation, real.incarnation);
        hb(&mut c, "n", real.incarnation).unwrap();

        // The same process, after losing its own lease, takes over.
        let mut again = reg("n");
        again.previous_incarnation = real.incarnation;
        let second = c.register(again).unwrap();
        assert_ne!(second.incarnation, real.incarnation);
        // A restart in place (same address, a new process) takes over.
        let third = c.register(reg("n")).unwrap();
        assert_eq!(third.node_index, real.node_index);
        // Once the lease ran out, a process at a new address takes over.
        c.expire_leases(Instant::now() + Duration::from_secs(1))
            .unwrap();
        let moved = c.register(dup).unwrap();
        assert_eq!(moved.node_index, real.node_index);
        assert_eq!(c.members["n"].info.grpc_address, "127.0.0.1:10");
    }

    #[test]
    fn an_incarnation_that_left_never_comes_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        c.register(reg("a")).unwrap();
        let b = c.register(reg("b")).unwrap();
        c.leave("b", b.incarnation).unwrap();
        let epoch = c.epoch;
        assert!(matches!(
            hb(&mut c, "b", b.incarnation),
            Err(CoordError::NotAlive { .. })
        ));
        let mut again = reg("b");
        again.previous_incarnation = b.incarnation;
        let e = c.register(again).unwrap_err();
        assert!(matches!(e, CoordError::Left { .. }), "{e}");
        assert_eq!(
            tonic::Status::from(e).code(),
            tonic::Code::FailedPrecondition
        );
        assert_eq!(c.epoch, epoch);
        assert_eq!(c.members["b"].info.state(), NodeState::Left);
        assert_eq!(count(&c, b.node_index), 0);
        // A new process with that id joins.
        c.register(reg("b")).unwrap();
        assert_eq!(c.members["b"].info.state(), NodeState::Alive);
    }

    #[test]
    fn draining_the_last_alive_node_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        let a = c.register(reg("a")).unwrap();
        let e = c.drain("a").unwrap_err();
        assert!(
            matches!(e, CoordError::NoNodeLeft { extents: 4096, .. }),
            "{e}"
        );
        assert_eq!(c.members["a"].info.state(), NodeState::Alive);
        assert_eq!(count(&c, a.node_index), 4096);
        c.register(reg("b")).unwrap();
        c.drain("a").unwrap();
        let e = c.drain("b").unwrap_err();
        assert!(e.to_string().contains("no alive node"), "{e}");
        assert_eq!(
            tonic::Status::from(e).code(),
            tonic::Code::FailedPrecondition
        );
        c.undrain("a").unwrap();
        c.drain("b").unwrap();
    }

    #[test]
    fn huge_ids_and_fields_are_refused_with_short_messages() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        let a = c.register(reg("a")).unwrap();
        let huge = "x".repeat(70_000);
        let errors = [
            hb(&mut c, &huge, a.incarnation).unwrap_err(),
            c.leave(&huge, a.incarnation).unwrap_err(),
            c.drain(&huge).unwrap_err(),
            c.undrain(&huge).unwrap_err(),
            c.register(reg(&huge)).unwrap_err(),
            c.register(reg(&format!("{huge}!"))).unwrap_err(),
            c.register(RegisterRequest {
                grpc_address: huge.clone(),
                ..reg("b")
            })
            .unwrap_err(),
            c.register(RegisterRequest {
                topology: Some(pagewire_proto::v1::Topology {
                    hostname: huge.clone(),
                    ..Default::default()
                }),
                ..reg("b")
            })
            .unwrap_err(),
            c.register(RegisterRequest {
                transports: vec![pagewire_proto::v1::TransportDescriptor {
                    kind: "tcp".into(),
                    endpoint: huge.clone(),
                    ..Default::default()
                }],
                ..reg("b")
            })
            .unwrap_err(),
        ];
        for e in errors {
            let s = tonic::Status::from(e);
            assert_eq!(s.code(), tonic::Code::InvalidArgument, "{}", s.message());
            assert!(s.message().len() < 300, "{} bytes", s.message().len());
        }
        // An unknown (valid) id is echoed whole; nothing longer than 64
        // characters of any input is.
        let e = tonic::Status::from(c.drain(&"y".repeat(128)).unwrap_err());
        assert_eq!(e.code(), tonic::Code::NotFound);
        assert!(
            e.message().contains(&format!("{}…", "y".repeat(64))),
            "{}",
            e.message()
        );
        assert!(!e.message().contains(&"y".repeat(65)));
    }

    #[test]
    fn set_policy_refuses_what_the_nodes_do_not_implement() {
        use crate::config::{IMPLEMENTED_ADMISSION, IMPLEMENTED_EVICTION};
        use pagewire_proto::v1::{AdmissionPolicy, EvictionPolicy};
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        let base = c.policy;
        for a in [AdmissionPolicy::Always, AdmissionPolicy::SecondHit] {
            for e in [
                EvictionPolicy::Clock,
                EvictionPolicy::Lru,
                EvictionPolicy::Fifo,
            ] {
                let before = c.policy;
                let mut p = base;
                p.admission = a.into();
                p.eviction = e.into();
                let r = c.set_policy(p);
                if IMPLEMENTED_ADMISSION.contains(&a) && IMPLEMENTED_EVICTION.contains(&e) {
                    let got = r.unwrap();
                    assert_eq!(got.version, before.version + 1);
                    assert_eq!((got.admission(), got.eviction()), (a, e));
                } else {
                    let s = tonic::Status::from(r.unwrap_err());
                    assert_eq!(s.code(), tonic::Code::Unimplemented, "{a:?}/{e:?}");
                    assert!(s.message().contains("implemented: "), "{}", s.message());
                    assert_eq!(c.policy, before, "a refused policy changes nothing");
                }
            }
        }
        let mut p = base;
        p.eviction = EvictionPolicy::Unspecified.into();
        let s = tonic::Status::from(c.set_policy(p).unwrap_err());
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
    }
}
