//! The cluster state machine: members, leases and the ownership map.
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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pagewire_proto::map::{self as cmap, Expander, Set};
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

/// What a change may alter before it commits (see [`Cluster::transact`]).
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

impl MapDesc {
    /// No owner yet: the empty set as owner set (id `epoch`).
    fn empty(epoch: u64) -> Self {
        MapDesc {
            sets: BTreeMap::from([(epoch, Vec::new())]),
            owner_set: epoch,
            ..MapDesc::default()
        }
    }

    /// The description a compact map carries (release epochs: its epoch,
    /// as for the arrays restored with it).
    fn of(cm: &CompactMap) -> Result<Self, cmap::MapError> {
        let layer = |l: &Layer| LayerDesc {
            set: l.set,
            except: l
                .except
                .iter()
                .enumerate()
                .map(|(k, &v)| (v, l.resume.get(k).map_or(0, |&r| r as usize)))
                .collect(),
        };
        Ok(MapDesc {
            sets: cmap::resolve(cm)?,
            owner_set: cm.owner_set,
            handoff: cm.handoff.iter().map(layer).collect(),
            groups: cm
                .releases
                .iter()
                .map(|g| GroupDesc {
                    layers: g.layers.iter().map(layer).collect(),
                    except: g.except.iter().copied().collect(),
                    dropped_by: g.dropped_by.clone(),
                    at: cm.epoch,
                    gave: None,
                })
                .collect(),
        })
    }

    /// The compact map of this description, without overrides.
    fn to_proto(&self, nodes: Vec<MapNode>, epoch: u64, file_size: u64, p: &Params) -> CompactMap {
        let base = cmap::base_set(&nodes);
        let layer = |l: &LayerDesc| Layer {
            set: l.set,
            except: l.except.keys().copied().collect(),
            resume: l
                .except
                .values()
                .map(|&r| u32::try_from(r).unwrap_or(u32::MAX))
                .collect(),
        };
        CompactMap {
            base_epoch: 0,
            epoch,
            file_size,
            extent_size: p.extent_size,
            page_size: p.page_size,
            nodes,
            sets: self
                .sets
                .iter()
                .map(|(&id, s)| cmap::relative(id, s, &base))
                .collect(),
            owner_set: self.owner_set,
            handoff: self.handoff.iter().map(layer).collect(),
            releases: self
                .groups
                .iter()
                .map(|g| ReleaseGroup {
                    layers: g.layers.iter().map(layer).collect(),
                    except: g.except.iter().copied().collect(),
                    dropped_by: g.dropped_by.clone(),
                    released_at: g.at,
                })
                .collect(),
            overrides: None,
        }
    }
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
        let (map_tx, _) = watch::channel(Arc::new(Published {
            map: Arc::default(),
            compact: Arc::default(),
            delta: None,
        }));
        let (status_tx, _) = watch::channel(Arc::new(StatusView {
            status: StatusResponse::default(),
            started: Instant::now(),
        }));
        let mut c = Cluster {
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
        let config_file_size = self.config_file_size;
        self.policy = self.config_policy;
        self.members.clear();
        self.handoff_nodes = None;
        // Format 2 files hold the compact map, format 1 files the
        // expanded one (converted here; the next save writes format 2).
        let compact = st.compact.clone();
        let map = match &compact {
            Some(cm) => Expander::default()
                .expand(cm)
                .map_err(|e| crate::StartError::StateMismatch(format!("{}: {e}", what)))?,
            None => st.map.clone().unwrap_or_default(),
        };
        if map.extent_size != self.params.extent_size || map.page_size != self.params.page_size {
            return Err(crate::StartError::StateMismatch(format!(
                "{} was written with extent_size {} and page_size {}, the config \
                 says {} and {}; keep the old values or start with a new state",
                what,
                map.extent_size,
                map.page_size,
                self.params.extent_size,
                self.params.page_size
            )));
        }
        if config_file_size != 0 && map.file_size != 0 && map.file_size != config_file_size {
            return Err(crate::StartError::StateMismatch(format!(
                "{} is for a {} byte file, the config says {}",
                what, map.file_size, config_file_size
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
        self.desc = match &compact {
            Some(cm) => MapDesc::of(cm)
                .map_err(|e| crate::StartError::StateMismatch(format!("{}: {e}", what)))?,
            None => {
                // No history: the owner set from the members, the rest
                // as overrides until the handoff and releases pass.
                let owner_set = st
                    .members
                    .iter()
                    .filter(|m| m.state() == NodeState::Alive)
                    .map(|m| (m.index, m.capacity_bytes))
                    .collect::<BTreeMap<_, _>>()
                    .into_iter()
                    .collect();
                MapDesc {
                    sets: BTreeMap::from([(self.epoch, owner_set)]),
                    owner_set: self.epoch,
                    ..MapDesc::default()
                }
            }
        };
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
        for info in st.members {
            // Every member that held a lease gets a fresh one: it had no
            // chance to heartbeat while the coordinator was down.
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
        self.compact = Arc::new(self.encode());
        // A state saved without a new epoch (a registration, a policy) may
        // carry the same map: watchers get a map once.
        if *self.map() != self.build_map() {
            self.publish_current();
        }
        self.refresh_status();
        Ok(())
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

    /// The compact map of the current state: the description, with its
    /// unused layers, groups and sets dropped, plus overrides wherever its
    /// expansion differs from the arrays.
    fn encode(&mut self) -> CompactMap {
        let cm = self
            .desc
            .to_proto(self.map_nodes(), self.epoch, self.file_size, &self.params);
        let arrays = match self.expander.arrays(&cm) {
            Ok(a) => a,
            Err(e) => {
                // Cannot happen (every set the description names is in it);
                // start over from an empty owner set, with the arrays as
                // overrides: still exact.
                tracing::error!(error = %e, "map description unusable; sending overrides");
                self.desc = MapDesc::empty(self.epoch);
                let mut cm =
                    self.desc
                        .to_proto(self.map_nodes(), self.epoch, self.file_size, &self.params);
                let zeros = vec![0; self.owner.len()];
                let (owner_extent, owner_node) = cmap::sparse_diff(&self.owner, &zeros);
                let (previous_extent, previous_node) = cmap::sparse_diff(&self.previous, &zeros);
                let (released_extent, released_node) = cmap::sparse_diff(&self.released, &zeros);
                cm.overrides = Some(SparseOverrides {
                    owner_extent,
                    owner_node,
                    previous_extent,
                    previous_node,
                    released_extent,
                    released_node,
                });
                return cm;
            }
        };
        // Drop the release groups that give no value: that changes none.
        // (Layers stay: a resume names its target by position.)
        let d = &mut self.desc;
        for (g, gave) in d.groups.iter_mut().zip(&arrays.group_values) {
            g.gave = Some(gave.clone());
        }
        let mut g = 0;
        d.groups.retain(|_| {
            g += 1;
            arrays.group_hits[g - 1] > 0
        });
        let used: BTreeSet<u64> = std::iter::once(d.owner_set)
            .chain(d.handoff.iter().map(|l| l.set))
            .chain(d.groups.iter().flat_map(|g| g.layers.iter().map(|l| l.set)))
            .chain(d.groups.iter().flat_map(|g| g.dropped_by.iter().copied()))
            .collect();
        d.sets.retain(|id, _| used.contains(id));
        let mut cm = self
            .desc
            .to_proto(self.map_nodes(), self.epoch, self.file_size, &self.params);
        let (owner_extent, owner_node) = cmap::sparse_diff(&self.owner, &arrays.predicted_owner);
        let (previous_extent, previous_node) =
            cmap::sparse_diff(&self.previous, &arrays.predicted_previous);
        let (released_extent, released_node) =
            cmap::sparse_diff(&self.released, &arrays.predicted_released);
        let o = SparseOverrides {
            owner_extent,
            owner_node,
            previous_extent,
            previous_node,
            released_extent,
            released_node,
        };
        cm.overrides = (cmap::override_count(Some(&o)) > 0).then_some(o);
        cm
    }

    /// The description after a commit installing `previous` (non-empty only
    /// from a rebalance) with the owner set `next_set` (None: unchanged).
    fn next_desc(&self, previous: &[u32], next_set: Option<Set>) -> MapDesc {
        let serving: BTreeSet<u32> = self
            .members
            .values()
            .filter(|m| holds_lease(m.info.state()))
            .map(|m| m.info.index)
            .collect();
        let applied: BTreeMap<u32, u64> = self
            .members
            .values()
            .map(|m| (m.info.index, m.info.applied_epoch))
            .collect();
        let old = &self.desc;
        let mut d = MapDesc {
            sets: old.sets.clone(),
            owner_set: old.owner_set,
            handoff: Vec::new(),
            groups: Vec::new(),
        };
        let not_serving = |set: u64| -> Vec<u32> {
            old.sets
                .get(&set)
                .into_iter()
                .flatten()
                .map(|&(i, _)| i)
                .filter(|i| !serving.contains(i))
                .collect()
        };
        if let Some(s) = next_set
            && old.sets.get(&old.owner_set) != Some(&s)
        {
            d.owner_set = self.epoch + 1;
            d.sets.insert(d.owner_set, s);
        }
        if !previous.is_empty() {
            // The server of each extent: the one serving since the handoff
            // began; where it stopped serving at a rebalance, the owner
            // before that rebalance (the layer added then) takes over.
            if !self.previous.is_empty() {
                let at = old.handoff.len();
                d.handoff = old.handoff.clone();
                for l in &mut d.handoff {
                    for v in not_serving(l.set) {
                        l.except.entry(v).or_insert(at);
                    }
                }
            }
            let next = d.handoff.len() + 1;
            d.handoff.push(LayerDesc {
                set: old.owner_set,
                except: not_serving(old.owner_set)
                    .into_iter()
                    .map(|v| (v, next))
                    .collect(),
            });
        }
        // What this commit releases: each extent's server at the current
        // epoch (its previous owner, else its owner).
        let mut layers = if self.previous.is_empty() {
            Vec::new()
        } else {
            old.handoff.clone()
        };
        layers.push(LayerDesc {
            set: old.owner_set,
            except: BTreeMap::new(),
        });
        d.groups.push(GroupDesc {
            layers,
            except: BTreeSet::new(),
            dropped_by: vec![d.owner_set],
            at: self.epoch + 1,
            gave: None,
        });
        // Older releases stay while their node holds a lease and has not
        // applied the epoch that released them.
        for g in &old.groups {
            let mut g = g.clone();
            let named: BTreeSet<u32> = match &g.gave {
                Some(gave) => gave.clone(),
                None => g
                    .layers
                    .iter()
                    .flat_map(|l| old.sets.get(&l.set).into_iter().flatten().map(|&(i, _)| i))
                    .collect(),
            };
            for i in named {
                if !serving.contains(&i) || applied.get(&i).is_some_and(|&a| a >= g.at) {
                    g.except.insert(i);
                }
            }
            if !g.dropped_by.contains(&d.owner_set) {
                g.dropped_by.push(d.owner_set);
            }
            d.groups.push(g);
        }
        d
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

    /// Draining nodes that own and hand off nothing are drained; returns
    /// their ids.
    fn settle_drains(&mut self) -> Vec<String> {
        let busy: HashSet<u32> = self
            .owner
            .iter()
            .chain(self.previous.iter())
            .copied()
            .collect();
        let mut drained = Vec::new();
        for m in self.members.values_mut() {
            if m.info.state() == NodeState::Draining && !busy.contains(&m.info.index) {
                m.info.set_state(NodeState::Drained);
                tracing::info!(node = %m.info.node_id, "node drained");
                drained.push(m.info.node_id.clone());
            }
        }
        drained
    }

    /// Puts back what [`Cluster::settle_drains`] did (its commit failed).
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
        self.transact(|c| c.admit(req))
    }

    /// The rest of [`Cluster::register`], once the request is valid: may
    /// change members before it fails (see [`Cluster::transact`]).
    fn admit(&mut self, req: RegisterRequest) -> Result<RegisterResponse, CoordError> {
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
        // A restarted node keeps an operator's drain, not the one its
        // previous process started for its own shutdown (which a kill in
        // the middle of it would otherwise leave behind for good).
        let state = match m.info.state() {
            s @ (NodeState::Draining | NodeState::Drained) if m.info.drain_incarnation == 0 => s,
            _ => NodeState::Alive,
        };
        m.info.drain_incarnation = 0;
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
        let compact_map = req.compact_map;
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
            map: Some(if compact_map {
                let compact = self.compact_map();
                OwnershipMap {
                    epoch: compact.epoch,
                    compact: Some((*compact).clone()),
                    ..Default::default()
                }
            } else {
                (*self.map()).clone()
            }),
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

    /// Whether a heartbeat may save now: only one that completes a
    /// handoff does ([`Cluster::maybe_finish_handoff`]).
    pub(crate) fn heartbeat_may_save(&self) -> bool {
        !self.previous.is_empty()
    }

    pub(crate) fn leave(&mut self, node_id: &str, incarnation: u64) -> Result<u64, CoordError> {
        validate_node_id(node_id)?;
        self.transact(|c| {
            let m = c.member_checked(node_id, incarnation)?;
            m.info.set_state(NodeState::Left);
            m.lease_deadline = None;
            tracing::info!(node = %node_id, "node left");
            c.rebalance("node left")?;
            Ok(c.epoch)
        })
    }

    /// Declares dead every node whose lease ran out; returns their ids.
    /// When the new map cannot be saved nobody is declared dead: the next
    /// call finds the same expired leases and tries again.
    pub(crate) fn expire_leases(&mut self, now: Instant) -> Result<Vec<String>, CoordError> {
        let expired = |m: &Member| m.lease_deadline.is_some_and(|d| d <= now);
        if !self.members.values().any(expired) {
            return Ok(Vec::new());
        }
        self.transact(|c| {
            let mut dead = Vec::new();
            for m in c.members.values_mut() {
                if expired(m) {
                    m.lease_deadline = None;
                    m.info.set_state(NodeState::Dead);
                    m.info.applied_epoch = 0;
                    dead.push(m.info.node_id.clone());
                }
            }
            c.rebalance("lease expired")?;
            for id in &dead {
                tracing::warn!(node = %id, lease_ms = c.lease_ms(), "node missed its lease: declared dead");
                c.metrics.deaths.inc();
            }
            Ok(dead)
        })
    }

    /// Starts moving every extent off `node_id`. Returns the new epoch and
    /// how many extents the node owned.
    /// Refused when no other alive node would be left to take its extents.
    /// `incarnation` 0: an operator's drain, kept across the node's
    /// restarts; else the node's own shutdown drain, which only that
    /// incarnation may ask for and which ends when another registers.
    pub(crate) fn drain(
        &mut self,
        node_id: &str,
        incarnation: u64,
    ) -> Result<(u64, u64), CoordError> {
        self.transact(|c| c.start_drain(node_id, incarnation))
    }

    /// [`Cluster::drain`], which puts back what this changed if it fails.
    fn start_drain(&mut self, node_id: &str, incarnation: u64) -> Result<(u64, u64), CoordError> {
        validate_node_id(node_id)?;
        if incarnation != 0 {
            self.member_checked(node_id, incarnation)?;
        }
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
            NodeState::Alive => {
                m.info.set_state(NodeState::Draining);
                m.info.drain_incarnation = incarnation;
            }
            NodeState::Draining | NodeState::Drained => {
                if incarnation == 0 {
                    // The operator's now: it outlives the process.
                    m.info.drain_incarnation = 0;
                }
            }
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
        self.transact(|c| c.end_drain(node_id))
    }

    /// [`Cluster::undrain`], which puts back what this changed if it fails.
    fn end_drain(&mut self, node_id: &str) -> Result<u64, CoordError> {
        validate_node_id(node_id)?;
        let m = self
            .members
            .get_mut(node_id)
            .ok_or_else(|| CoordError::UnknownNode(node_id.to_owned()))?;
        m.info.drain_incarnation = 0;
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

    /// The status of the state as it is now (saved or not: see
    /// [`StatusView`]).
    fn status(&self) -> StatusResponse {
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
            version: env!("CARGO_PKG_VERSION").to_owned(),
            ..Default::default()
        }
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
        let (_, owned) = c.drain("a", 0).unwrap();
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

    /// The state file, failing the next `fail` saves as a store that did
    /// not answer.
    struct Flaky {
        file: FileStore,
        fail: std::sync::atomic::AtomicUsize,
    }

    impl Flaky {
        fn fail_next(&self, n: usize) {
            self.fail.store(n, std::sync::atomic::Ordering::SeqCst);
        }
    }

    impl Store for Flaky {
        fn save(
            &self,
            state: &PersistedState,
            new_epoch: Option<(u64, &str)>,
        ) -> Result<(), crate::store::StoreError> {
            use std::sync::atomic::Ordering::SeqCst;
            if self
                .fail
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(crate::store::StoreError::Unavailable("injected".into()));
            }
            self.file.save(state, new_epoch)
        }
    }

    fn open_flaky(dir: &std::path::Path) -> (Cluster, Arc<Flaky>) {
        let store = Arc::new(Flaky {
            file: FileStore {
                path: dir.join("state"),
            },
            fail: 0.into(),
        });
        let c = Cluster::new(
            params(dir),
            0,
            crate::config::Config::default().policy().unwrap(),
            Arc::new(Metrics::new()),
            store.clone(),
        );
        (c, store)
    }

    /// Two members, handoffs finished; returns their incarnations.
    fn two_settled(c: &mut Cluster) -> (RegisterResponse, RegisterResponse) {
        let a = c.register(reg("a")).unwrap();
        let b = c.register(reg("b")).unwrap();
        for _ in 0..2 {
            hb(c, "a", a.incarnation).unwrap();
            hb(c, "b", b.incarnation).unwrap();
        }
        assert!(c.previous.is_empty());
        (a, b)
    }

    /// A lease expiry whose map could not be saved is found again at the
    /// next tick and retried: the dead node does not keep its extents.
    #[test]
    fn a_lease_expiry_whose_save_failed_is_retried() {
        let dir = tempfile::tempdir().unwrap();
        let (mut c, store) = open_flaky(dir.path());
        let (_, b) = two_settled(&mut c);
        let epoch = c.epoch;
        let now = Instant::now() + Duration::from_secs(1);
        c.members.get_mut("a").unwrap().lease_deadline = Some(now + Duration::from_secs(60));
        store.fail_next(1);
        assert!(c.expire_leases(now).is_err());
        assert_eq!(c.epoch, epoch);
        assert_eq!(
            c.members["b"].info.state(),
            NodeState::Alive,
            "half a change"
        );
        // The next tick.
        let dead = c.expire_leases(now + Duration::from_millis(10)).unwrap();
        assert_eq!(dead, vec!["b".to_owned()], "the expiry was not retried");
        assert_eq!(c.epoch, epoch + 1);
        assert_eq!(count(&c, b.node_index), 0, "the dead node kept extents");
        assert!(!c.map().owner.contains(&b.node_index));
    }

    /// A leave, a drain and a registration whose save failed change no
    /// member: each can be asked again, and no member is left that never
    /// got its answer.
    #[test]
    fn changes_whose_save_failed_leave_the_members_as_they_were() {
        let dir = tempfile::tempdir().unwrap();
        let (mut c, store) = open_flaky(dir.path());
        let (a, b) = two_settled(&mut c);
        let (epoch, next_inc) = (c.epoch, c.next_incarnation);

        store.fail_next(1);
        assert!(c.register(reg("c")).is_err());
        assert!(
            !c.members.contains_key("c"),
            "a refused registration stayed"
        );
        assert_eq!(c.next_incarnation, next_inc);

        store.fail_next(1);
        assert!(c.leave("b", b.incarnation).is_err());
        assert_eq!(c.members["b"].info.state(), NodeState::Alive);
        c.leave("b", b.incarnation).expect("the leave asked again");
        assert_eq!(count(&c, b.node_index), 0);
        assert_eq!(c.epoch, epoch + 1);

        let c2 = c.register(reg("c")).unwrap();
        for _ in 0..2 {
            hb(&mut c, "a", a.incarnation).unwrap();
            hb(&mut c, "c", c2.incarnation).unwrap();
        }
        store.fail_next(1);
        assert!(c.drain("c", 0).is_err());
        assert_eq!(c.members["c"].info.state(), NodeState::Alive);
        // A drain that starts, and whose handoff's completion cannot be
        // saved: the node stays Draining while the map still names it.
        c.drain("c", 0).unwrap();
        assert!(c.previous.contains(&c2.node_index));
        hb(&mut c, "a", a.incarnation).unwrap();
        store.fail_next(1);
        assert!(hb(&mut c, "c", c2.incarnation).is_err());
        assert!(c.previous.contains(&c2.node_index));
        assert_eq!(
            c.members["c"].info.state(),
            NodeState::Draining,
            "drained while the map still hands its extents off"
        );
        hb(&mut c, "c", c2.incarnation).unwrap();
        assert!(c.previous.is_empty());
        assert_eq!(c.members["c"].info.state(), NodeState::Drained);
    }

    #[test]
    fn a_shutdown_drain_ends_with_its_process_and_an_operators_drain_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        let a = c.register(reg("a")).unwrap();
        c.register(reg("b")).unwrap();
        let state = |c: &Cluster| c.members["a"].info.state();
        // Only the current incarnation may start its own shutdown drain.
        assert!(matches!(
            c.drain("a", a.incarnation + 100),
            Err(CoordError::StaleIncarnation { .. })
        ));
        c.drain("a", a.incarnation).unwrap();
        assert_eq!(state(&c), NodeState::Draining);
        // Killed mid-drain and started again: the new process serves again.
        let a2 = c.register(reg("a")).unwrap();
        assert_eq!(state(&c), NodeState::Alive);
        assert!(
            count(&c, a2.node_index) > 0,
            "the restarted node got no extents"
        );
        // The operator's drain outlives the process, and an operator's drain
        // of a node draining for its shutdown becomes the operator's.
        c.drain("a", a2.incarnation).unwrap();
        c.drain("a", 0).unwrap();
        c.register(reg("a")).unwrap();
        assert_ne!(
            state(&c),
            NodeState::Alive,
            "the operator's drain was dropped"
        );
        c.undrain("a").unwrap();
        assert_eq!(state(&c), NodeState::Alive);
    }

    #[test]
    fn a_registration_may_ask_for_the_map_compact() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        c.register(reg("a")).unwrap();
        let full = c.register(reg("b")).unwrap().map.unwrap();
        assert!(!full.owner.is_empty() && full.compact.is_none());
        let compact = c
            .register(RegisterRequest {
                compact_map: true,
                ..reg("c")
            })
            .unwrap()
            .map
            .unwrap();
        assert!(
            compact.owner.is_empty(),
            "the expanded arrays were sent too"
        );
        let expanded = pagewire_proto::map::MapFollower::new()
            .apply(compact)
            .unwrap();
        let now = c.map();
        assert_eq!(
            (expanded.epoch, &expanded.owner, &expanded.previous_owner),
            (now.epoch, &now.owner, &now.previous_owner)
        );
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
        let e = c.drain("a", 0).unwrap_err();
        assert!(
            matches!(e, CoordError::NoNodeLeft { extents: 4096, .. }),
            "{e}"
        );
        assert_eq!(c.members["a"].info.state(), NodeState::Alive);
        assert_eq!(count(&c, a.node_index), 4096);
        c.register(reg("b")).unwrap();
        c.drain("a", 0).unwrap();
        let e = c.drain("b", 0).unwrap_err();
        assert!(e.to_string().contains("no alive node"), "{e}");
        assert_eq!(
            tonic::Status::from(e).code(),
            tonic::Code::FailedPrecondition
        );
        c.undrain("a").unwrap();
        c.drain("b", 0).unwrap();
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
            c.drain(&huge, 0).unwrap_err(),
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
        let e = tonic::Status::from(c.drain(&"y".repeat(128), 0).unwrap_err());
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

    /// A small deterministic generator for the randomized tests.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(1);
            pagewire_proto::rendezvous::splitmix64(self.0)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Expands what the coordinator publishes and stores, after a trip
    /// through the wire encoding, and compares it with the arrays of the
    /// state machine. Returns the number of overrides the map carries.
    fn check_compact(
        c: &Cluster,
        follower: &mut cmap::MapFollower,
        sent: &mut Option<Arc<CompactMap>>,
    ) -> usize {
        use prost::Message;
        let cm = c.compact_map();
        let wire = CompactMap::decode(cm.encode_to_vec().as_slice()).unwrap();
        let m = Expander::default().expand(&wire).unwrap();
        let at = format!("epoch {}", c.epoch);
        assert_eq!(m.epoch, c.epoch, "{at}");
        assert_eq!(m.owner, c.owner, "{at}: owner");
        assert_eq!(m.previous_owner, c.previous, "{at}: previous_owner");
        assert_eq!(m.released_by, c.released, "{at}: released_by");
        assert_eq!(
            m,
            *c.map(),
            "{at}: the expanded map differs from the published one"
        );
        // The stored form is the compact one.
        let st = c.persisted();
        assert!(st.map.is_none());
        assert_eq!(st.compact.as_ref(), Some(&*cm));
        // A watcher following deltas gets the same.
        let msg = match sent.as_ref() {
            Some(prev) if prev.epoch != cm.epoch || **prev != *cm => cmap::delta(prev, &cm),
            Some(_) => return cmap::override_count(cm.overrides.as_ref()),
            None => (*cm).clone(),
        };
        let followed = follower
            .apply(OwnershipMap {
                epoch: cm.epoch,
                compact: Some(msg),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(followed, *c.map(), "{at}: through deltas");
        *sent = Some(cm.clone());
        cmap::override_count(cm.overrides.as_ref())
    }

    /// Random joins, leaves, drains, undrains, lease expiries, heartbeats
    /// (finishing handoffs, applying releases) and restarts: after every
    /// step the compact map expands to exactly the arrays.
    #[test]
    fn the_compact_map_always_expands_to_the_arrays() {
        let (mut steps, mut handoffs, mut releases) = (0usize, 0usize, 0usize);
        // PAGEWIRE_MAP_SEEDS=500 for a longer soak.
        let seeds: u64 = std::env::var("PAGEWIRE_MAP_SEEDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(24);
        for seed in 0..seeds {
            let dir = tempfile::tempdir().unwrap();
            let mut c = open(dir.path());
            let mut rng = Rng(seed * 1_000_003);
            let mut follower = cmap::MapFollower::new();
            let mut sent = None;
            let ids: Vec<String> = (0..7).map(|i| format!("n{i}")).collect();
            for _ in 0..70 {
                let id = ids[rng.below(ids.len())].clone();
                let inc = c.members.get(&id).map_or(0, |m| m.info.incarnation);
                let op = rng.below(10);
                let e0 = c.epoch;
                match op {
                    0 | 1 => {
                        let mut r = reg(&id);
                        r.capacity_bytes = (1 + rng.below(4) as u64) << 30;
                        r.previous_incarnation = inc;
                        let _ = c.register(r);
                    }
                    2 => {
                        let _ = c.leave(&id, inc);
                    }
                    3 => {
                        let _ = c.drain(&id, 0);
                    }
                    4 => {
                        let _ = c.undrain(&id);
                    }
                    5 => {
                        let now = Instant::now();
                        for m in c.members.values_mut() {
                            if m.lease_deadline.is_some() {
                                m.lease_deadline = Some(if m.info.node_id == id {
                                    now
                                } else {
                                    now + Duration::from_secs(60)
                                });
                            }
                        }
                        c.expire_leases(now + Duration::from_millis(1)).unwrap();
                    }
                    6 => {
                        // A round: every lease holder reports, most at the
                        // current epoch (finishing handoffs).
                        let live: Vec<(String, u64)> = c
                            .members
                            .values()
                            .filter(|m| holds_lease(m.info.state()))
                            .map(|m| (m.info.node_id.clone(), m.info.incarnation))
                            .collect();
                        for (id, inc) in live {
                            let lag = u64::from(rng.below(5) == 0);
                            let _ = c.heartbeat(HeartbeatRequest {
                                node_id: id,
                                incarnation: inc,
                                applied_epoch: c.epoch.saturating_sub(lag),
                                stats: None,
                            });
                        }
                    }
                    7 | 8 => {
                        // Most nodes apply the current epoch, some lag one.
                        let lag = u64::from(rng.below(4) == 0);
                        let epoch = c.epoch.saturating_sub(lag);
                        let _ = c.heartbeat(HeartbeatRequest {
                            node_id: id,
                            incarnation: inc,
                            applied_epoch: epoch,
                            stats: None,
                        });
                    }
                    _ => {
                        let before = (
                            c.epoch,
                            c.owner.clone(),
                            c.previous.clone(),
                            c.released.clone(),
                        );
                        drop(c);
                        c = open(dir.path());
                        assert_eq!(
                            (
                                c.epoch,
                                c.owner.clone(),
                                c.previous.clone(),
                                c.released.clone()
                            ),
                            before,
                            "a restart changed the map"
                        );
                        // A new stream after a restart starts with a full map.
                        follower.reset();
                        sent = None;
                    }
                }
                let n = check_compact(&c, &mut follower, &mut sent);
                if n > 0 {
                    let o = c.compact.overrides.clone().unwrap();
                    let e = o
                        .released_extent
                        .first()
                        .or(o.previous_extent.first())
                        .copied()
                        .unwrap() as usize;
                    let ids = c.ids();
                    let per_set: Vec<(u64, u32)> = c
                        .desc
                        .sets
                        .iter()
                        .map(|(id, set)| {
                            let cands: Vec<_> = set
                                .iter()
                                .map(|&(index, weight)| pagewire_proto::rendezvous::Candidate {
                                    index,
                                    node_id: ids[&index],
                                    weight,
                                })
                                .collect();
                            (*id, pagewire_proto::rendezvous::owner_of(e as u64, &cands))
                        })
                        .collect();
                    panic!(
                        "seed {seed}, op {op}, epoch {e0} -> {}: prev {} rel {} overrides; extent {e}: owner {} prev {:?} rel {:?} (override {:?}), owners by set {per_set:?}, desc {:?}, members {:?}",
                        c.epoch,
                        o.previous_extent.len(),
                        o.released_extent.len(),
                        c.owner[e],
                        c.previous.get(e),
                        c.released.get(e),
                        o.released_node.first(),
                        c.desc,
                        c.members
                            .values()
                            .map(|m| (m.info.index, m.info.state, m.info.applied_epoch))
                            .collect::<Vec<_>>()
                    );
                }
                steps += 1;
                handoffs += usize::from(!c.previous.is_empty());
                releases += usize::from(!c.released.is_empty());
            }
        }
        // The histories did exercise handoffs and releases.
        assert!(
            handoffs > steps / 10 && releases > steps / 10,
            "{steps} {handoffs} {releases}"
        );
    }

    /// A format 1 state file (expanded map, mid-handoff) loads into the
    /// same arrays, and the compact map that replaces it expands to them.
    #[test]
    fn a_format_1_state_file_is_converted_on_load() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = open(dir.path());
        c.register(reg("a")).unwrap();
        c.register(reg("b")).unwrap();
        c.register(reg("c")).unwrap();
        assert!(!c.previous.is_empty(), "the map is mid-handoff");
        let mut old = c.persisted();
        old.compact = None;
        old.map = Some(c.build_map());
        let truth = (
            c.epoch,
            c.owner.clone(),
            c.previous.clone(),
            c.released.clone(),
        );
        drop(c);
        crate::persist::save_as(&dir.path().join("state"), &old, 1).unwrap();
        let mut c = open(dir.path());
        assert_eq!(
            (
                c.epoch,
                c.owner.clone(),
                c.previous.clone(),
                c.released.clone()
            ),
            truth
        );
        let mut follower = cmap::MapFollower::new();
        let mut sent = None;
        let n = check_compact(&c, &mut follower, &mut sent);
        assert_eq!(
            n,
            c.previous.iter().filter(|&&p| p != 0).count(),
            "without history, the handoff is carried as overrides"
        );
        // Finishing the handoff and one more epoch leave no override.
        for id in ["a", "b", "c"] {
            let inc = c.members[id].info.incarnation;
            hb(&mut c, id, inc).unwrap();
        }
        assert!(c.previous.is_empty());
        check_compact(&c, &mut follower, &mut sent);
        for id in ["a", "b", "c"] {
            let inc = c.members[id].info.incarnation;
            hb(&mut c, id, inc).unwrap();
        }
        c.register(reg("d")).unwrap();
        assert_eq!(check_compact(&c, &mut follower, &mut sent), 0);
        // Saved as format 2 now.
        let bytes = std::fs::read(dir.path().join("state")).unwrap();
        assert_eq!(u32::from_le_bytes(bytes[4..8].try_into().unwrap()), 2);
    }

    /// proto/testdata/rendezvous-vectors.json, through the coordinator's own
    /// path: members in state Alive with their capacities, a rebalance, the
    /// owners it commits (and the compact map they expand from).
    #[test]
    fn the_rendezvous_test_vectors_hold_on_the_coordinator() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../proto/testdata/rendezvous-vectors.json"
        );
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let sets = v["sets"].as_array().unwrap();
        assert!(sets.len() >= 5);
        for s in sets {
            let name = s["name"].as_str().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let mut c = open(dir.path());
            c.file_size = s["extent_count"].as_u64().unwrap() * c.params.extent_size;
            for (k, cand) in s["candidates"].as_array().unwrap().iter().enumerate() {
                let id = cand["node_id"].as_str().unwrap().to_owned();
                let info = NodeInfo {
                    node_id: id.clone(),
                    index: cand["index"].as_u64().unwrap() as u32,
                    capacity_bytes: cand["weight"].as_u64().unwrap(),
                    // A member that is not alive is no candidate.
                    state: NodeState::Alive.into(),
                    ..Default::default()
                };
                c.members.insert(
                    id,
                    Member {
                        info,
                        lease_deadline: None,
                    },
                );
                // A dead bystander changes nothing.
                if k == 0 {
                    let info = NodeInfo {
                        node_id: "bystander".into(),
                        index: 999_999,
                        capacity_bytes: 1 << 40,
                        state: NodeState::Dead.into(),
                        ..Default::default()
                    };
                    c.members.insert(
                        "bystander".into(),
                        Member {
                            info,
                            lease_deadline: None,
                        },
                    );
                }
            }
            c.rebalance("test vectors").unwrap();
            let owners = if c.owner.is_empty() {
                vec![0; s["extent_count"].as_u64().unwrap() as usize]
            } else {
                c.owner.clone()
            };
            let bytes: Vec<u8> = owners.iter().flat_map(|o| o.to_le_bytes()).collect();
            let want = u64::from_str_radix(
                s["owners_fnv1a64"]
                    .as_str()
                    .unwrap()
                    .trim_start_matches("0x"),
                16,
            )
            .unwrap();
            assert_eq!(pagewire_proto::rendezvous::fnv1a(&bytes), want, "{name}");
            for x in s["expect"].as_array().unwrap() {
                let e = x["extent"].as_u64().unwrap() as usize;
                assert_eq!(
                    u64::from(owners[e]),
                    x["owner"].as_u64().unwrap(),
                    "{name}: {e}"
                );
            }
            let m = Expander::default().expand(&c.compact_map()).unwrap();
            assert_eq!(m.owner, c.owner, "{name}: compact");
        }
    }
}
