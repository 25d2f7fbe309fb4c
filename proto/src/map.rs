//! Compact ownership maps: expanding them, and applying a stream of deltas.
//!
//! A [`CompactMap`] describes an ownership map by what determines it (the
//! members, their weights, the candidate sets of weighted rendezvous hashing
//! and how a handoff and a release are formed from them) in O(members +
//! handoff descriptions) bytes. [`Expander::expand`] turns it into the
//! [`OwnershipMap`] of the same epoch, arrays and all. The rule, for every
//! extent `i` (ARCHITECTURE.md, "The compact map"):
//!
//! 1. `O_S[i]` is the rendezvous owner of `i` under candidate set `S`
//!    ([`crate::rendezvous`]); a set is the base set (nodes in state ALIVE,
//!    weight `MapNode.weight`) minus `remove` plus `add`.
//! 2. A list of layers is scanned from its first: at layer `k`,
//!    `v = O_{set_k}[i]`; `v == 0`: go on at `k + 1`; `v` in `except_k`: go
//!    on at the matching `resume_k` entry (`k + 1` where there is none);
//!    else `v` is the list's *hit*. Running off the end: no hit.
//! 3. `owner[i] = O_{owner_set}[i]`.
//! 4. `previous_owner[i]` = the hit of `handoff`, if it is not `owner[i]`;
//!    else 0.
//! 5. `released_by[i]` = for the first group of `releases` (in order) whose
//!    layers' hit `v` holds a lease in this map (ALIVE, DRAINING, DRAINED),
//!    is not in the group's `except`, is neither `owner[i]` nor
//!    `previous_owner[i]` and is not `O_S[i]` for any `S` in the group's
//!    `dropped_by`: `v`; else 0.
//! 6. `overrides` replace single entries last. `previous_owner` and
//!    `released_by` are empty when all their entries are 0.
//!
//! Computing `O_S` is O(extents × |S|); [`Expander`] keeps the last few
//! arrays it computed and derives one from a cached one that differs by a
//! candidate or two in O(extents) ([`crate::rendezvous::with_added`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::rendezvous::{self, Candidate as RvCandidate, NodeTable};
use crate::v1::{Candidate, CompactMap, MapNode, NodeState, OwnershipMap, SparseOverrides};

/// At most this many extents (the coordinator refuses larger files).
pub const MAX_EXTENTS: u64 = 1 << 24;

/// Why a compact map or delta could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MapError {
    /// The map refers to something it does not contain or is out of range.
    #[error("malformed compact map at epoch {epoch}: {reason}")]
    Malformed { epoch: u64, reason: String },
    /// A delta on an epoch other than the one held.
    #[error("delta from epoch {base} cannot apply to the map of epoch {held:?}")]
    WrongBase { base: u64, held: Option<u64> },
}

/// A candidate set, resolved: (index, weight), sorted by index.
pub type Set = Vec<(u32, u64)>;

fn holds_lease(state: i32) -> bool {
    matches!(
        NodeState::try_from(state),
        Ok(NodeState::Alive | NodeState::Draining | NodeState::Drained)
    )
}

/// Number of extents of a map.
pub fn extent_count(file_size: u64, extent_size: u64) -> u64 {
    if extent_size == 0 {
        0
    } else {
        file_size.div_ceil(extent_size)
    }
}

/// The base set of `nodes`: every node in state ALIVE with its weight.
pub fn base_set(nodes: &[MapNode]) -> Set {
    let mut s: Set = nodes
        .iter()
        .filter(|n| n.state == NodeState::Alive as i32)
        .map(|n| (n.index, n.weight))
        .collect();
    s.sort_unstable();
    s
}

/// Describes `set` relative to `base` (what [`resolve`] undoes).
pub fn relative(id: u64, set: &Set, base: &Set) -> crate::v1::CandidateSet {
    let b: BTreeMap<u32, u64> = base.iter().copied().collect();
    let s: BTreeMap<u32, u64> = set.iter().copied().collect();
    crate::v1::CandidateSet {
        id,
        remove: b.keys().filter(|i| !s.contains_key(i)).copied().collect(),
        add: s
            .iter()
            .filter(|(i, w)| b.get(i) != Some(w))
            .map(|(&index, &weight)| Candidate { index, weight })
            .collect(),
    }
}

/// The candidate sets of `map`, by id.
pub fn resolve(map: &CompactMap) -> Result<BTreeMap<u64, Set>, MapError> {
    let base: BTreeMap<u32, u64> = base_set(&map.nodes).into_iter().collect();
    let known: BTreeSet<u32> = map.nodes.iter().map(|n| n.index).collect();
    let mut out = BTreeMap::new();
    for cs in &map.sets {
        let mut s = base.clone();
        for r in &cs.remove {
            s.remove(r);
        }
        for a in &cs.add {
            if !known.contains(&a.index) {
                return Err(malformed(
                    map,
                    format!("set {} names node {}", cs.id, a.index),
                ));
            }
            s.insert(a.index, a.weight);
        }
        if out.insert(cs.id, s.into_iter().collect()).is_some() {
            return Err(malformed(map, format!("set {} appears twice", cs.id)));
        }
    }
    Ok(out)
}

fn malformed(map: &CompactMap, reason: String) -> MapError {
    MapError::Malformed {
        epoch: map.epoch,
        reason,
    }
}

/// A set as the cache knows it: (index, weight, hash seed).
type Key = Vec<(u32, u64, u64)>;

/// A layer ready to scan: its set's owners and its skips (node → resume;
/// `NO_SKIP` for a node it does not skip), with whether it has any.
type ResolvedLayer = (Arc<Vec<u32>>, NodeTable<usize>, bool);

/// A node a layer does not skip.
pub(crate) const NO_SKIP: usize = usize::MAX;

/// A layer's skips: node → the layer to resume at (`NO_SKIP` for a node it
/// does not skip), and whether it has any (so a scan can skip the lookup).
pub(crate) fn layer_skips(l: &crate::v1::Layer) -> (NodeTable<usize>, bool) {
    let t = NodeTable::new(
        NO_SKIP,
        l.except.iter().enumerate().map(|(k, &v)| {
            let r = l.resume.get(k).map_or(0, |&r| r as usize);
            // A resume of NO_SKIP still moves on (to the next layer).
            (v, r.min(NO_SKIP - 1))
        }),
    );
    (t, !l.except.is_empty())
}

/// One cached owner array, with its floor ([`rendezvous::Floored`]).
struct Cached {
    key: Key,
    extents: u64,
    owners: Arc<Vec<u32>>,
    floor: f64,
}

/// What `to` has that `from` lacks and what `from` has that `to` lacks,
/// both sorted; None once more than `limit` entries differ. O(|from| +
/// |to|): the keys are sorted by node index.
fn key_diff(from: &Key, to: &Key, limit: usize) -> Option<(Key, Key)> {
    let (mut removed, mut added) = (Vec::new(), Vec::new());
    let (mut a, mut b) = (from.iter().peekable(), to.iter().peekable());
    loop {
        match (a.peek(), b.peek()) {
            (None, None) => break,
            (Some(&&x), Some(&&y)) if x == y => {
                a.next();
                b.next();
            }
            (Some(&&x), Some(&&y)) if x < y => {
                removed.push(x);
                a.next();
            }
            (Some(_), Some(&&y)) | (None, Some(&&y)) => {
                added.push(y);
                b.next();
            }
            (Some(&&x), None) => {
                removed.push(x);
                a.next();
            }
        }
        if removed.len() + added.len() > limit {
            return None;
        }
    }
    Some((removed, added))
}

/// Computes owner arrays, remembering the last few.
pub struct Expander {
    cache: Vec<Cached>,
    capacity: usize,
    /// Owner arrays computed from scratch / derived incrementally.
    pub full_computations: u64,
    pub incremental_computations: u64,
}

impl Default for Expander {
    fn default() -> Self {
        Self::new(6)
    }
}

impl Expander {
    /// An expander that keeps up to `capacity` owner arrays (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            cache: Vec::new(),
            capacity: capacity.max(1),
            full_computations: 0,
            incremental_computations: 0,
        }
    }

    /// Owners of `extents` extents under `set`, whose nodes hash by the ids
    /// in `ids`.
    pub fn owners(&mut self, set: &Set, ids: &HashMap<u32, &str>, extents: u64) -> Arc<Vec<u32>> {
        let mut key: Key = set
            .iter()
            .map(|&(i, w)| {
                let seed = rendezvous::fnv1a(ids.get(&i).copied().unwrap_or("").as_bytes());
                (i, w, seed)
            })
            .collect();
        key.sort_unstable();
        if let Some(pos) = self
            .cache
            .iter()
            .position(|c| c.extents == extents && c.key == key)
        {
            let c = self.cache.remove(pos);
            let owners = c.owners.clone();
            self.cache.push(c);
            return owners;
        }
        let cands = |k: &[(u32, u64, u64)]| -> Set { k.iter().map(|&(i, w, _)| (i, w)).collect() };
        let to_rv = |s: &[(u32, u64)]| -> Vec<RvCandidate<'_>> {
            s.iter()
                .map(|&(index, weight)| RvCandidate {
                    index,
                    node_id: ids.get(&index).copied().unwrap_or(""),
                    weight,
                })
                .collect()
        };
        // The cached array closest to `set`: at most two candidates apart.
        let mut best: Option<(usize, Key, Key)> = None;
        for (pos, c) in self.cache.iter().enumerate() {
            if c.extents != extents {
                continue;
            }
            let Some((removed, added)) = key_diff(&c.key, &key, 2) else {
                continue;
            };
            let d = removed.len() + added.len();
            if best.as_ref().is_none_or(|(_, r, a)| d < r.len() + a.len()) {
                best = Some((pos, removed, added));
            }
        }
        let floored = match best {
            Some((pos, removed, added)) => {
                self.incremental_computations += 1;
                let mut cur_key = self.cache[pos].key.clone();
                let mut f = rendezvous::Floored {
                    owners: self.cache[pos].owners.to_vec(),
                    floor: self.cache[pos].floor,
                };
                for r in removed {
                    cur_key.retain(|k| *k != r);
                    let after = cands(&cur_key);
                    f = f.with_removed(&to_rv(&after), r.0);
                }
                for a in added {
                    let before = cands(&cur_key);
                    let new = to_rv(&[(a.0, a.1)])[0];
                    f = f.with_added(&to_rv(&before), new);
                    cur_key.push(a);
                }
                f
            }
            None => {
                self.full_computations += 1;
                rendezvous::Floored::assign(extents, &to_rv(set))
            }
        };
        let owners = Arc::new(floored.owners);
        if self.cache.len() >= self.capacity {
            self.cache.remove(0);
        }
        self.cache.push(Cached {
            key,
            extents,
            owners: owners.clone(),
            floor: floored.floor,
        });
        owners
    }

    /// The expanded map of `map` (which must be a full map, not a delta).
    pub fn expand(&mut self, map: &CompactMap) -> Result<OwnershipMap, MapError> {
        let a = self.arrays(map)?;
        Ok(OwnershipMap {
            epoch: map.epoch,
            file_size: map.file_size,
            extent_size: map.extent_size,
            page_size: map.page_size,
            nodes: map.nodes.clone(),
            owner: a.owner,
            previous_owner: a.previous,
            released_by: a.released,
            compact: None,
        })
    }

    /// The three arrays of `map`, with what the rules gave before overrides.
    pub fn arrays(&mut self, map: &CompactMap) -> Result<Arrays, MapError> {
        if map.base_epoch != 0 {
            return Err(malformed(map, "a delta cannot be expanded alone".into()));
        }
        let extents = extent_count(map.file_size, map.extent_size);
        if extents > MAX_EXTENTS {
            return Err(malformed(
                map,
                format!("{extents} extents (at most {MAX_EXTENTS})"),
            ));
        }
        let n = usize::try_from(extents).unwrap_or(usize::MAX);
        let sets = resolve(map)?;
        let ids: HashMap<u32, &str> = map
            .nodes
            .iter()
            .map(|nd| (nd.index, nd.node_id.as_str()))
            .collect();
        let lease = NodeTable::new(
            false,
            map.nodes
                .iter()
                .filter(|nd| holds_lease(nd.state))
                .map(|nd| (nd.index, true)),
        );
        let mut get = |id: u64, what: &str| -> Result<Arc<Vec<u32>>, MapError> {
            let s = sets
                .get(&id)
                .ok_or_else(|| malformed(map, format!("{what} names set {id}, which it lacks")))?;
            Ok(self.owners(s, &ids, extents))
        };
        let owner_arr = get(map.owner_set, "owner_set")?;
        let resolved = |o: Arc<Vec<u32>>, l: &crate::v1::Layer| -> ResolvedLayer {
            let (t, any) = layer_skips(l);
            (o, t, any)
        };
        let handoff: Vec<ResolvedLayer> = map
            .handoff
            .iter()
            .map(|l| Ok(resolved(get(l.set, "a handoff layer")?, l)))
            .collect::<Result<_, MapError>>()?;
        type Group = (Vec<ResolvedLayer>, NodeTable<bool>, Vec<Arc<Vec<u32>>>);
        let groups: Vec<Group> = map
            .releases
            .iter()
            .map(|g| {
                let layers = g
                    .layers
                    .iter()
                    .map(|l| Ok(resolved(get(l.set, "a release layer")?, l)))
                    .collect::<Result<_, MapError>>()?;
                let dropped = g
                    .dropped_by
                    .iter()
                    .map(|&id| get(id, "a release group's dropped_by"))
                    .collect::<Result<_, MapError>>()?;
                let except = NodeTable::new(false, g.except.iter().map(|&v| (v, true)));
                Ok((layers, except, dropped))
            })
            .collect::<Result<_, MapError>>()?;
        let hit = |layers: &[ResolvedLayer], i: usize| -> (u32, usize) {
            let mut k = 0;
            while let Some((o, except, any)) = layers.get(k) {
                let v = o[i];
                if v == 0 {
                    k += 1;
                    continue;
                }
                let r = if *any { except.get(v) } else { NO_SKIP };
                if r == NO_SKIP {
                    return (v, k);
                }
                k = r.max(k + 1);
            }
            (0, usize::MAX)
        };
        let mut owner = owner_arr.to_vec();
        // An array no layer or override can fill stays empty (all zero):
        // no 4 bytes per extent to allocate, fill and scan for nothing.
        let o = map.overrides.as_ref();
        let sized = |needed: bool| if needed { vec![0u32; n] } else { Vec::new() };
        let mut previous =
            sized(!handoff.is_empty() || o.is_some_and(|o| !o.previous_extent.is_empty()));
        let mut released =
            sized(!groups.is_empty() || o.is_some_and(|o| !o.released_extent.is_empty()));
        let mut handoff_hits = vec![0u64; handoff.len()];
        let mut group_hits = vec![0u64; groups.len()];
        let mut group_values = vec![BTreeSet::new(); groups.len()];
        let mut group_seen: Vec<NodeTable<bool>> =
            vec![NodeTable::new(false, std::iter::empty()); groups.len()];
        let mut release_layer_hits: Vec<Vec<u64>> =
            groups.iter().map(|(l, _, _)| vec![0; l.len()]).collect();
        for i in 0..n {
            if handoff.is_empty() && groups.is_empty() {
                break;
            }
            let (v, k) = hit(&handoff, i);
            if v != 0 {
                handoff_hits[k] += 1;
                if v != owner[i] {
                    previous[i] = v;
                }
            }
            for (g, (layers, except, dropped)) in groups.iter().enumerate() {
                let (v, k) = hit(layers, i);
                if v != 0 {
                    release_layer_hits[g][k] += 1;
                }
                if v != 0
                    && lease.get(v)
                    && !except.get(v)
                    && v != owner[i]
                    && v != previous.get(i).copied().unwrap_or(0)
                    && dropped.iter().all(|o| o[i] != v)
                {
                    released[i] = v;
                    group_hits[g] += 1;
                    if !group_seen[g].get(v) {
                        group_seen[g].set(v, true);
                        group_values[g].insert(v);
                    }
                    break;
                }
            }
        }
        if let Some(o) = &map.overrides {
            apply_sparse(map, &mut owner, &o.owner_extent, &o.owner_node, "owner")?;
            apply_sparse(
                map,
                &mut previous,
                &o.previous_extent,
                &o.previous_node,
                "previous",
            )?;
            apply_sparse(
                map,
                &mut released,
                &o.released_extent,
                &o.released_node,
                "released",
            )?;
        }
        let empty_if_zero = |v: Vec<u32>| {
            if v.is_empty() || v.iter().all(|&x| x == 0) {
                Vec::new()
            } else {
                v
            }
        };
        Ok(Arrays {
            owner,
            previous: empty_if_zero(previous),
            released: empty_if_zero(released),
            handoff_hits,
            group_hits,
            group_values,
            release_layer_hits,
        })
    }
}

/// What [`Expander::arrays`] computed: the map's arrays and, for an encoder,
/// how often each layer decided. (An encoder wanting the rules' values
/// without overrides expands the map without them.)
pub struct Arrays {
    pub owner: Vec<u32>,
    /// Empty when all zero.
    pub previous: Vec<u32>,
    /// Empty when all zero.
    pub released: Vec<u32>,
    /// Per handoff layer: extents it was the hit of.
    pub handoff_hits: Vec<u64>,
    /// Per release group: extents it gave `released_by` for.
    pub group_hits: Vec<u64>,
    /// Per release group: the nodes it gave as `released_by`.
    pub group_values: Vec<BTreeSet<u32>>,
    /// Per release group and layer: extents that layer was the hit of.
    pub release_layer_hits: Vec<Vec<u64>>,
}

fn apply_sparse(
    map: &CompactMap,
    arr: &mut [u32],
    extents: &[u64],
    nodes: &[u32],
    what: &str,
) -> Result<(), MapError> {
    if extents.len() != nodes.len() {
        return Err(malformed(
            map,
            format!(
                "{what} overrides: {} extents, {} nodes",
                extents.len(),
                nodes.len()
            ),
        ));
    }
    for (&e, &v) in extents.iter().zip(nodes) {
        let slot = usize::try_from(e)
            .ok()
            .and_then(|e| arr.get_mut(e))
            .ok_or_else(|| {
                malformed(map, format!("{what} override of extent {e}, past the end"))
            })?;
        *slot = v;
    }
    Ok(())
}

/// The sparse differences `truth - predicted` over the first `n` entries
/// (a missing entry of either is 0: an empty array is all zeros).
pub fn sparse_diff(truth: &[u32], predicted: &[u32], n: usize) -> (Vec<u64>, Vec<u32>) {
    let mut e = Vec::new();
    let mut v = Vec::new();
    for i in 0..n {
        let p = predicted.get(i).copied().unwrap_or(0);
        let t = truth.get(i).copied().unwrap_or(0);
        if t != p {
            e.push(i as u64);
            v.push(t);
        }
    }
    (e, v)
}

/// Number of explicit entries in `o`.
pub fn override_count(o: Option<&SparseOverrides>) -> usize {
    o.map_or(0, |o| {
        o.owner_extent.len() + o.previous_extent.len() + o.released_extent.len()
    })
}

/// The delta that turns `from` into `to` (both full maps).
pub fn delta(from: &CompactMap, to: &CompactMap) -> CompactMap {
    let old: HashMap<u32, &MapNode> = from.nodes.iter().map(|n| (n.index, n)).collect();
    CompactMap {
        base_epoch: from.epoch,
        nodes: to
            .nodes
            .iter()
            .filter(|n| old.get(&n.index).is_none_or(|o| *o != *n))
            .cloned()
            .collect(),
        ..to.clone()
    }
}

/// `base` with `delta` applied: a full map of `delta.epoch`.
pub fn apply_delta(base: &CompactMap, delta: &CompactMap) -> Result<CompactMap, MapError> {
    if delta.base_epoch != base.epoch {
        return Err(MapError::WrongBase {
            base: delta.base_epoch,
            held: Some(base.epoch),
        });
    }
    let mut nodes: BTreeMap<u32, MapNode> =
        base.nodes.iter().map(|n| (n.index, n.clone())).collect();
    for n in &delta.nodes {
        nodes.insert(n.index, n.clone());
    }
    Ok(CompactMap {
        base_epoch: 0,
        nodes: nodes.into_values().collect(),
        ..delta.clone()
    })
}

/// Applies a `WatchMap` stream (or `GetMap` answers) of compact maps and
/// deltas, expanding each: what a node or a client holds. It only applies
/// what it is given: the thread that polls the coordinator for it, with the
/// trust window, is the client crate's `pagewire_client::MapFollower`.
#[derive(Default)]
pub struct MapApplier {
    current: Option<CompactMap>,
    expander: Expander,
}

impl MapApplier {
    pub fn new() -> Self {
        Self::default()
    }

    /// The compact map last applied.
    pub fn current(&self) -> Option<&CompactMap> {
        self.current.as_ref()
    }

    /// Takes one message of the stream and returns the expanded map. A
    /// message without `compact` (a coordinator that does not know compact
    /// maps) is returned as it is.
    pub fn apply(&mut self, msg: OwnershipMap) -> Result<OwnershipMap, MapError> {
        let Some(c) = msg.compact else {
            self.current = None;
            return Ok(msg);
        };
        let full = if c.base_epoch == 0 {
            c
        } else {
            match &self.current {
                Some(base) => apply_delta(base, &c)?,
                None => {
                    return Err(MapError::WrongBase {
                        base: c.base_epoch,
                        held: None,
                    });
                }
            }
        };
        let expanded = self.expander.expand(&full)?;
        self.current = Some(full);
        Ok(expanded)
    }

    /// Forgets the map held (a new stream starts with a full map).
    pub fn reset(&mut self) {
        self.current = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{CandidateSet, Layer, ReleaseGroup};

    fn node(index: u32, state: NodeState, weight: u64) -> MapNode {
        MapNode {
            index,
            node_id: format!("n{index}"),
            state: state.into(),
            weight,
            ..Default::default()
        }
    }

    fn set(id: u64) -> CandidateSet {
        CandidateSet {
            id,
            ..Default::default()
        }
    }

    /// Three alive nodes, then a fourth joins: the handoff layer names the
    /// old owner set, and the arrays are what the definitions say.
    fn joined() -> CompactMap {
        CompactMap {
            epoch: 5,
            file_size: 1000 * 4096,
            extent_size: 4096,
            page_size: 4096,
            nodes: (1..=4)
                .map(|i| node(i, NodeState::Alive, 1 << 30))
                .collect(),
            sets: vec![
                set(5),
                CandidateSet {
                    id: 4,
                    remove: vec![4],
                    add: vec![],
                },
            ],
            owner_set: 5,
            handoff: vec![Layer {
                set: 4,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn ids() -> Vec<String> {
        (1..=4).map(|i| format!("n{i}")).collect()
    }

    fn cands(ids: &[String], n: usize) -> Vec<RvCandidate<'_>> {
        (0..n)
            .map(|k| RvCandidate {
                index: k as u32 + 1,
                node_id: &ids[k],
                weight: 1 << 30,
            })
            .collect()
    }

    #[test]
    fn a_join_expands_to_a_handoff_from_the_old_owners() {
        let ids = ids();
        let m = Expander::default().expand(&joined()).unwrap();
        let before = rendezvous::assign(1000, &cands(&ids, 3));
        let after = rendezvous::assign(1000, &cands(&ids, 4));
        assert_eq!(m.owner, after);
        let want: Vec<u32> = before
            .iter()
            .zip(&after)
            .map(|(&b, &a)| if a == b { 0 } else { b })
            .collect();
        assert!(want.iter().any(|&p| p != 0));
        assert_eq!(m.previous_owner, want);
        assert!(m.released_by.is_empty());
        // The handoff ends: the old owners released what moved.
        let mut done = joined();
        done.epoch = 6;
        done.handoff.clear();
        done.releases = vec![ReleaseGroup {
            layers: vec![Layer {
                set: 4,
                ..Default::default()
            }],
            dropped_by: vec![5],
            released_at: 6,
            ..Default::default()
        }];
        let m = Expander::default().expand(&done).unwrap();
        assert!(m.previous_owner.is_empty());
        assert_eq!(m.released_by, want);
        // Node 2 applied the release: its entries go.
        done.releases[0].except = vec![2];
        let m = Expander::default().expand(&done).unwrap();
        let want2: Vec<u32> = want.iter().map(|&r| if r == 2 { 0 } else { r }).collect();
        assert_eq!(m.released_by, want2);
    }

    #[test]
    fn resume_skips_to_the_named_layer_and_overrides_apply_last() {
        let ids = ids();
        // Layer 0: {1,2,3} with 1 excepted, resuming at layer 2 ({1,2}).
        let mut cm = joined();
        cm.sets.push(CandidateSet {
            id: 3,
            remove: vec![3, 4],
            add: vec![],
        });
        cm.handoff = vec![
            Layer {
                set: 4,
                except: vec![1],
                resume: vec![2],
            },
            Layer {
                set: 5,
                ..Default::default()
            },
            Layer {
                set: 3,
                ..Default::default()
            },
        ];
        cm.overrides = Some(SparseOverrides {
            owner_extent: vec![7],
            owner_node: vec![3],
            ..Default::default()
        });
        let m = Expander::default().expand(&cm).unwrap();
        let s4 = rendezvous::assign(1000, &cands(&ids, 3));
        let s5 = rendezvous::assign(1000, &cands(&ids, 4));
        let s3 = rendezvous::assign(1000, &cands(&ids, 2));
        let mut owner = s5.clone();
        owner[7] = 3;
        assert_eq!(m.owner, owner);
        for i in 0..1000 {
            let v = if s4[i] == 1 { s3[i] } else { s4[i] };
            // The override changes the owner, not the rule's previous
            // owner (computed against the rule's owner).
            let want = if v == s5[i] { 0 } else { v };
            assert_eq!(
                m.previous_owner.get(i).copied().unwrap_or(0),
                want,
                "extent {i}"
            );
        }
    }

    #[test]
    fn deltas_apply_in_order_and_are_refused_on_another_base() {
        let base = joined();
        let mut next = joined();
        next.epoch = 6;
        next.nodes[1].state = NodeState::Draining.into();
        next.nodes.push(node(9, NodeState::Dead, 1));
        let d = delta(&base, &next);
        assert_eq!(d.base_epoch, 5);
        assert_eq!(d.nodes.len(), 2, "only what changed travels");
        assert_eq!(apply_delta(&base, &d).unwrap(), next);
        let mut f = MapApplier::new();
        let wrap = |c: CompactMap| OwnershipMap {
            epoch: c.epoch,
            compact: Some(c),
            ..Default::default()
        };
        assert!(matches!(
            f.apply(wrap(d.clone())),
            Err(MapError::WrongBase { held: None, .. })
        ));
        f.apply(wrap(base.clone())).unwrap();
        let got = f.apply(wrap(d.clone())).unwrap();
        assert_eq!(got, Expander::default().expand(&next).unwrap());
        assert!(matches!(
            f.apply(wrap(d)),
            Err(MapError::WrongBase {
                base: 5,
                held: Some(6)
            })
        ));
        // An expanded map (an older coordinator) passes as it is.
        let plain = OwnershipMap {
            epoch: 9,
            owner: vec![1, 2],
            ..Default::default()
        };
        assert_eq!(f.apply(plain.clone()).unwrap(), plain);
    }

    #[test]
    fn malformed_maps_are_errors_not_panics() {
        let bad = |f: &dyn Fn(&mut CompactMap)| {
            let mut cm = joined();
            f(&mut cm);
            Expander::default().expand(&cm)
        };
        assert!(bad(&|c| c.owner_set = 77).is_err());
        assert!(bad(&|c| c.handoff[0].set = 77).is_err());
        assert!(bad(&|c| c.sets.push(set(5))).is_err());
        assert!(
            bad(&|c| c.sets[0].add.push(Candidate {
                index: 42,
                weight: 1
            }))
            .is_err()
        );
        assert!(bad(&|c| c.file_size = u64::MAX).is_err());
        assert!(bad(&|c| c.base_epoch = 3).is_err());
        assert!(
            bad(&|c| {
                c.overrides = Some(SparseOverrides {
                    owner_extent: vec![1000],
                    owner_node: vec![1],
                    ..Default::default()
                })
            })
            .is_err()
        );
        assert!(
            bad(&|c| {
                c.overrides = Some(SparseOverrides {
                    owner_extent: vec![1, 2],
                    owner_node: vec![1],
                    ..Default::default()
                })
            })
            .is_err()
        );
        // A resume pointing backwards or past the end still ends.
        assert!(
            bad(&|c| {
                c.handoff[0].except = vec![1, 2, 3];
                c.handoff[0].resume = vec![0, 99];
            })
            .is_ok()
        );
        assert!(bad(&|c| c.extent_size = 0).is_ok());
    }

    #[test]
    fn sparse_diff_reads_an_empty_array_as_zeros() {
        assert_eq!(sparse_diff(&[0, 5, 0], &[], 3), (vec![1], vec![5]));
        assert_eq!(sparse_diff(&[], &[0, 0, 4], 3), (vec![2], vec![0]));
        assert_eq!(sparse_diff(&[1, 2], &[1, 2], 2), (vec![], vec![]));
    }

    #[test]
    fn key_diff_finds_what_was_added_and_removed_up_to_its_limit() {
        let k = |v: &[u32]| -> Key { v.iter().map(|&i| (i, 1, u64::from(i))).collect() };
        assert_eq!(
            key_diff(&k(&[1, 2, 3]), &k(&[1, 2, 3]), 2),
            Some((k(&[]), k(&[])))
        );
        assert_eq!(
            key_diff(&k(&[1, 3, 5]), &k(&[2, 3, 5, 9]), 3),
            Some((k(&[1]), k(&[2, 9])))
        );
        assert_eq!(key_diff(&k(&[1, 3, 5]), &k(&[2, 3, 5, 9]), 2), None);
        assert_eq!(key_diff(&k(&[]), &k(&[4]), 2), Some((k(&[]), k(&[4]))));
        assert_eq!(
            key_diff(&k(&[4, 7]), &k(&[]), 2),
            Some((k(&[4, 7]), k(&[])))
        );
        // A new weight for the same node is a removal and an addition.
        let mut heavier = k(&[1, 2]);
        heavier[1].1 = 2;
        assert_eq!(
            key_diff(&k(&[1, 2]), &heavier, 2),
            Some((k(&[2]), vec![(2, 2, 2)]))
        );
    }

    #[test]
    fn the_expander_derives_a_one_member_change_incrementally() {
        let mut e = Expander::default();
        let cm = joined();
        e.expand(&cm).unwrap();
        let full = e.full_computations;
        assert!(full >= 1);
        // A fifth node joins: derived from the cached 4-node array.
        let mut next = joined();
        next.epoch = 6;
        next.nodes.push(node(5, NodeState::Alive, 1 << 29));
        next.sets = vec![set(6), set(5)];
        next.sets[1].remove = vec![5];
        next.owner_set = 6;
        next.handoff[0].set = 5;
        let m = e.expand(&next).unwrap();
        assert_eq!(e.full_computations, full, "no full recount");
        assert!(e.incremental_computations >= 1);
        assert_eq!(m, Expander::default().expand(&next).unwrap());
    }
}
