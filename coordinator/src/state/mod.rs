//! The cluster state machine: members, leases and the ownership map.
//!
//! This file holds [`ClusterState`], its commit (save, then publish) and
//! its rebalancing; `members.rs` the calls nodes and operators make (with
//! the checks of what they send); `restore.rs` loading a saved state
//! (format 1 converted); `desc.rs` the compact map's description and
//! encoding; `tests.rs` the tests of all of them.
//!
//! All of it lives behind one mutex in [`crate::service`]; every method here
//! is synchronous, and short but for the store's save, which the service
//! runs on a blocking thread. A change whose save fails is undone whole
//! (map and members), so that it is tried again as a whole. Every map
//! change bumps the epoch, is written to the store (the state file, or
//! etcd: [`crate::store`]), and only then published to watchers, so a
//! published epoch always survives a restart or a change of leader. What
//! `Status` shows is refreshed the same way, after each save
//! ([`StatusView`]). So the calls that only read the store's state (the map
//! and the status) read those two and never wait for the lock, which a save
//! holds for up to the store's request timeout. A coordinator that follows another (etcd) holds the
//! same `ClusterState`, replaced with each state the store shows
//! ([`ClusterState::load_state`]); it changes nothing itself.
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
//!
//! ## The compact map
//!
//! The arrays above (`owner`, `previous`, `released`) are the truth, computed
//! as described. Alongside them [`MapDesc`] says how they came about, in
//! O(members) terms: the owner set (the rendezvous candidates) and, as
//! layers naming earlier owner sets, the handoff (the owners under the sets
//! before each rebalance since the handoff began) and each group of releases
//! (the servers of the epoch that released them). Every commit derives the
//! [`CompactMap`] from it, expands that with the shared code
//! (`pagewire_proto::map`) and lists where the expansion differs from the
//! arrays as explicit overrides, so the compact map always expands to
//! exactly the arrays; the state file and compact watchers get that form.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pagewire_proto::map::{self as cmap, Expander, Set};
use pagewire_proto::rendezvous::NodeTable;
use pagewire_proto::v1::{
    CompactMap, HeartbeatRequest, HeartbeatResponse, Layer, MapNode, NodeInfo, NodeState,
    OwnershipMap, Policy, RegisterRequest, RegisterResponse, ReleaseGroup, SparseOverrides,
    StatusResponse,
};
use tokio::sync::watch;

use crate::error::{CoordError, quoted, state_name};
use crate::metrics::Metrics;
use crate::persist::PersistedState;
use crate::store::{FileStore, Store};

mod desc;
mod members;
mod restore;

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

#[derive(Clone)]
struct Member {
    /// Persistent fields plus the runtime ones (`applied_epoch`, `stats`).
    info: NodeInfo,
    /// When the lease runs out (only for states holding a lease).
    lease_deadline: Option<Instant>,
}

/// What a change may alter before it commits (see [`ClusterState::transact`]).
struct Undo {
    members: BTreeMap<String, Member>,
    next_index: u32,
    next_incarnation: u64,
    file_size: u64,
}

/// One layer of a compact map rule (`pagewire.v1.Layer`).
#[derive(Debug, Clone, PartialEq)]
struct LayerDesc {
    set: u64,
    /// Node → index of the layer the scan goes on at when it is the owner
    /// here (see `pagewire.v1.Layer`).
    except: BTreeMap<u32, usize>,
}

/// One group of releases (`pagewire.v1.ReleaseGroup`).
#[derive(Debug, Clone, PartialEq)]
struct GroupDesc {
    layers: Vec<LayerDesc>,
    except: BTreeSet<u32>,
    /// The owner sets since the release (an entry goes where its extent's
    /// owner was its node at a commit).
    dropped_by: Vec<u64>,
    /// The epoch that released these extents (entries of a node that
    /// applied it go at the next commit).
    at: u64,
    /// The nodes it gave as `released_by` at the last expansion (None: not
    /// known yet): only they need `except` entries.
    gave: Option<BTreeSet<u32>>,
}

/// How the map's arrays came about (see "The compact map" above).
#[derive(Debug, Clone, Default, PartialEq)]
struct MapDesc {
    /// Every set the rules name, by id (the epoch it became the owner set).
    sets: BTreeMap<u64, Set>,
    owner_set: u64,
    /// Oldest first.
    handoff: Vec<LayerDesc>,
    /// Newest first.
    groups: Vec<GroupDesc>,
}

/// What the watch channel carries: the map of one epoch in both forms.
pub(crate) struct Published {
    pub(crate) map: Arc<OwnershipMap>,
    pub(crate) compact: Arc<CompactMap>,
    /// From the map published before this one (None for the first).
    pub(crate) delta: Option<Arc<CompactMap>>,
}

/// What `Status` shows of the cluster, as of the last save: refreshed
/// after each one, so that `Status` reads it without the cluster lock (a
/// save may hold that for up to the store's request timeout) and never
/// shows what is not in the store yet.
pub(crate) struct StatusView {
    /// Every field but `uptime_ms` and the leadership's.
    status: StatusResponse,
    started: Instant,
}

impl StatusView {
    pub(crate) fn status(&self) -> StatusResponse {
        StatusResponse {
            uptime_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            ..self.status.clone()
        }
    }
}

pub(crate) struct ClusterState {
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
    desc: MapDesc,
    compact: Arc<CompactMap>,
    expander: Expander,
    /// The new and the previous owners of the handoff at this epoch (so a
    /// heartbeat does not scan the extents): (epoch, new, previous).
    handoff_nodes: Option<(u64, Vec<u32>, Vec<u32>)>,
    policy: Policy,
    /// What the config says, for a state without them.
    config_file_size: u64,
    config_policy: Policy,
    map_tx: watch::Sender<Arc<Published>>,
    status_tx: watch::Sender<Arc<StatusView>>,
    metrics: Arc<Metrics>,
    store: Arc<dyn Store>,
}

/// Only these states hold a lease (and may serve extents).
fn holds_lease(s: NodeState) -> bool {
    matches!(
        s,
        NodeState::Alive | NodeState::Draining | NodeState::Drained
    )
}
impl ClusterState {
    /// An empty cluster (no member, epoch 0) that saves to `store`.
    pub(crate) fn new(
        params: Params,
        config_file_size: u64,
        config_policy: Policy,
        metrics: Arc<Metrics>,
        store: Arc<dyn Store>,
    ) -> Self {
        let (map_tx, _) = watch::channel(Arc::new(Published {
            map: Arc::default(),
            compact: Arc::default(),
            delta: None,
        }));
        let (status_tx, _) = watch::channel(Arc::new(StatusView {
            status: StatusResponse::default(),
            started: Instant::now(),
        }));
        let mut c = ClusterState {
            file_size: config_file_size,
            members: BTreeMap::new(),
            next_index: 1,
            next_incarnation: 1,
            epoch: 0,
            owner: Vec::new(),
            previous: Vec::new(),
            released: Vec::new(),
            released_epoch: Vec::new(),
            desc: MapDesc::empty(0),
            compact: Arc::default(),
            expander: Expander::new(12),
            handoff_nodes: None,
            policy: config_policy,
            config_file_size,
            config_policy,
            map_tx,
            status_tx,
            metrics,
            params,
            store,
        };
        c.compact = Arc::new(c.encode());
        c.publish_current();
        c
    }

    /// Gives every member holding a lease a fresh one (a follower that
    /// starts leading: it saw none of their heartbeats).
    pub(crate) fn renew_all_leases(&mut self) {
        let deadline = Instant::now() + self.params.lease;
        for m in self.members.values_mut() {
            if holds_lease(m.info.state()) {
                m.lease_deadline = Some(deadline);
            }
        }
    }

    /// The store it saves to.
    pub(crate) fn store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Arc<Published>> {
        self.map_tx.subscribe()
    }

    /// The status as of the last save (see [`StatusView`]).
    pub(crate) fn subscribe_status(&self) -> watch::Receiver<Arc<StatusView>> {
        self.status_tx.subscribe()
    }

    pub(crate) fn map(&self) -> Arc<OwnershipMap> {
        self.map_tx.borrow().map.clone()
    }

    /// The current map in compact form.
    pub(crate) fn compact_map(&self) -> Arc<CompactMap> {
        self.map_tx.borrow().compact.clone()
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
                weight: m.info.capacity_bytes,
            })
            .collect();
        nodes.sort_by_key(|n| n.index);
        nodes
    }

    /// Node index → node id, for hashing.
    fn ids(&self) -> HashMap<u32, &str> {
        self.members
            .values()
            .map(|m| (m.info.index, m.info.node_id.as_str()))
            .collect()
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
            compact: None,
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
            map: None,
            compact: Some((*self.compact).clone()),
            policy: Some(self.policy),
            next_index: self.next_index,
            next_incarnation: self.next_incarnation,
        }
    }

    /// Saves without a new epoch (a registration, a policy, a drain that
    /// moved nothing; once more on shutdown, so the last word in the store
    /// is this process's).
    pub(crate) fn save(&self) -> Result<(), CoordError> {
        self.store_save(None)?;
        self.refresh_status();
        Ok(())
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
        let before = self.map_tx.borrow().compact.clone();
        let delta = (before.epoch != 0 || !before.nodes.is_empty())
            .then(|| Arc::new(cmap::delta(&before, &self.compact)));
        self.map_tx.send_replace(Arc::new(Published {
            map,
            compact: self.compact.clone(),
            delta,
        }));
        self.refresh_status();
    }

    /// Shows the state as it is now in `Status`: called once it is saved.
    fn refresh_status(&self) {
        let status = self.status();
        self.status_tx.send_modify(|v| {
            *v = Arc::new(StatusView {
                status,
                started: v.started,
            });
        });
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
        let mut candidates: Set = self
            .members
            .values()
            .filter(|m| m.info.state() == NodeState::Alive)
            .map(|m| (m.info.index, m.info.capacity_bytes))
            .collect();
        candidates.sort_unstable();
        let extents = self.extent_count();
        // Incremental from the current owner set's owners when one member
        // changed (the expander keeps them).
        let ids: HashMap<u32, String> = self
            .ids()
            .into_iter()
            .map(|(i, id)| (i, id.to_owned()))
            .collect();
        let ids: HashMap<u32, &str> = ids.iter().map(|(&i, id)| (i, id.as_str())).collect();
        let new_owner = self.expander.owners(&candidates, &ids, extents).to_vec();
        let serving = NodeTable::new(
            false,
            self.members
                .values()
                .filter(|m| holds_lease(m.info.state()))
                .map(|m| (m.info.index, true)),
        );
        let mut new_prev = vec![0u32; new_owner.len()];
        let mut any_prev = false;
        for (i, &new) in new_owner.iter().enumerate() {
            let cur = self.owner.get(i).copied().unwrap_or(0);
            let prev = self.previous.get(i).copied().unwrap_or(0);
            // The node certainly serving this extent now: the one handing it
            // off, else its owner.
            let server = if prev != 0 && serving.get(prev) {
                prev
            } else if cur != 0 && serving.get(cur) {
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
        self.commit(new_owner, new_prev, Some(candidates), reason)
    }

    /// Installs owners and handoffs; bumps the epoch if anything changed.
    fn commit(
        &mut self,
        owner: Vec<u32>,
        previous: Vec<u32>,
        next_set: Option<Set>,
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
        let desc = self.next_desc(&previous, next_set);
        let old_desc = (
            std::mem::replace(&mut self.desc, desc),
            self.compact.clone(),
        );
        let old = (
            std::mem::replace(&mut self.owner, owner),
            std::mem::replace(&mut self.previous, previous),
            std::mem::replace(&mut self.released, released),
            std::mem::replace(&mut self.released_epoch, released_epoch),
        );
        self.epoch += 1;
        let drained = self.settle_drains();
        self.compact = Arc::new(self.encode());
        if let Err(e) = self.store_save(Some((self.epoch, reason))) {
            // Roll back: an epoch that is not on disk must not be published.
            self.epoch -= 1;
            self.unsettle(&drained);
            (self.desc, self.compact) = old_desc;
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
            overrides = cmap::override_count(self.compact.overrides.as_ref()),
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
        // Lease holders' applied epochs (None: no lease).
        let live = NodeTable::new(
            None,
            self.members
                .values()
                .filter(|m| holds_lease(m.info.state()))
                .map(|m| (m.info.index, Some(m.info.applied_epoch))),
        );
        // Allocated at the first entry: most commits release nothing, and
        // 12 bytes per extent of fresh zeroed memory cost page faults.
        let (mut released, mut since) = (Vec::new(), Vec::new());
        let mut set = |i: usize, node: u32, at: u64| {
            if released.is_empty() {
                released = vec![0u32; owner.len()];
                since = vec![0u64; owner.len()];
            }
            released[i] = node;
            since[i] = at;
        };
        for (i, &new_owner) in owner.iter().enumerate() {
            let new_prev = previous.get(i).copied().unwrap_or(0);
            let old_prev = self.previous.get(i).copied().unwrap_or(0);
            let old_server = if old_prev != 0 {
                old_prev
            } else {
                self.owner.get(i).copied().unwrap_or(0)
            };
            if old_server != 0
                && live.get(old_server).is_some()
                && old_server != new_owner
                && old_server != new_prev
            {
                set(i, old_server, epoch);
                continue;
            }
            let (r, at) = (
                self.released.get(i).copied().unwrap_or(0),
                self.released_epoch.get(i).copied().unwrap_or(0),
            );
            if r != 0 && r != new_owner && live.get(r).is_some_and(|applied| applied < at) {
                set(i, r, at);
            }
        }
        (released, since)
    }

    /// Draining nodes that own and hand off nothing are drained; returns
    /// their ids.
    fn settle_drains(&mut self) -> Vec<String> {
        let mut busy = NodeTable::new(false, std::iter::empty());
        for &i in self.owner.iter().chain(self.previous.iter()) {
            busy.set(i, true);
        }
        let mut drained = Vec::new();
        for m in self.members.values_mut() {
            if m.info.state() == NodeState::Draining && !busy.get(m.info.index) {
                m.info.set_state(NodeState::Drained);
                tracing::info!(node = %m.info.node_id, "node drained");
                drained.push(m.info.node_id.clone());
            }
        }
        drained
    }

    /// Puts back what [`ClusterState::settle_drains`] did (its commit failed).
    fn unsettle(&mut self, drained: &[String]) {
        for id in drained {
            if let Some(m) = self.members.get_mut(id) {
                m.info.set_state(NodeState::Draining);
            }
        }
    }

    /// Runs `change`, which alters members and then commits; if it fails,
    /// puts the members (and the counters and file size a registration
    /// sets) back as they were, as the failed commit put the map back. So a
    /// change whose save failed has not half happened: a lease expiry is
    /// found again at the next tick and retried, a refused registration
    /// leaves no member that never got its answer, a failed leave or drain
    /// can be asked again.
    fn transact<T>(
        &mut self,
        change: impl FnOnce(&mut Self) -> Result<T, CoordError>,
    ) -> Result<T, CoordError> {
        let undo = Undo {
            members: self.members.clone(),
            next_index: self.next_index,
            next_incarnation: self.next_incarnation,
            file_size: self.file_size,
        };
        let r = change(self);
        if r.is_err() {
            self.members = undo.members;
            self.next_index = undo.next_index;
            self.next_incarnation = undo.next_incarnation;
            self.file_size = undo.file_size;
        }
        r
    }

    /// Clears the handoff once every new owner in it, and every previous
    /// owner still holding a lease, applied this epoch: from then on no
    /// previous owner acknowledges a write to a moving extent (it is not
    /// its owner at this epoch), so its new owner may fill its cache.
    fn maybe_finish_handoff(&mut self) -> Result<(), CoordError> {
        if self.previous.is_empty() {
            return Ok(());
        }
        if self
            .handoff_nodes
            .as_ref()
            .is_none_or(|h| h.0 != self.epoch)
        {
            let new_owners: BTreeSet<u32> = self
                .owner
                .iter()
                .zip(&self.previous)
                .filter(|(_, p)| **p != 0)
                .map(|(o, _)| *o)
                .collect();
            let previous: BTreeSet<u32> =
                self.previous.iter().copied().filter(|&p| p != 0).collect();
            self.handoff_nodes = Some((
                self.epoch,
                new_owners.into_iter().collect(),
                previous.into_iter().collect(),
            ));
        }
        let (_, new_owners, previous) = self.handoff_nodes.as_ref().expect("set above");
        let by_index: HashMap<u32, &Member> =
            self.members.values().map(|m| (m.info.index, m)).collect();
        let applied = |idx: u32| {
            by_index
                .get(&idx)
                .is_some_and(|m| m.info.applied_epoch >= self.epoch)
        };
        let holds = |idx: u32| {
            by_index
                .get(&idx)
                .is_some_and(|m| holds_lease(m.info.state()))
        };
        let ready = new_owners.iter().all(|&i| applied(i))
            && previous.iter().all(|&i| !holds(i) || applied(i));
        if ready {
            let owner = self.owner.clone();
            self.commit(owner, Vec::new(), None, "handoff complete")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
