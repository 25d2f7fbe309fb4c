//! Owners resolved one extent at a time, when asked, from a compact map:
//! what a reader needs of a map (who answers reads of an extent, who
//! acknowledges its writes) without expanding all of it.
//!
//! [`crate::map::Expander`] computes every extent's owner under every set a
//! map names, O(extents) per map even when one member joined. A reader
//! touches a few extents per epoch, so [`LazyMap`] computes an extent's
//! owner under a set the first time it is asked and keeps it (per set, in
//! chunks of 65,536 extents allocated on first use). Applying a map is then
//! O(members + layers), whatever the size of the file.
//!
//! Caching across epochs: a set whose candidates are those of a set of the
//! map before (same indexes, weights and ids) is that set, answers and all.
//! A set one or two candidates away from one of the map before is derived
//! from it per extent: where the older set knows the extent's owner and
//! that owner did not leave, the new owner is it or the best of the
//! candidates added (one score each, as `rendezvous::with_added`); else the
//! extent is counted afresh over the whole set. To bound memory, a set
//! keeps at most two generations behind it: deriving a set from `S` cuts
//! the link of the set `S` was derived from.
//!
//! The rules are those of the expansion (ARCHITECTURE.md, "The compact
//! map"); `owner` and `previous_owner` answer exactly what the expanded
//! map's arrays hold (the tests compare every extent). `released_by` is not
//! resolved here: only a node acts on it, and it expands its maps.
//!
//! Concurrency: a `LazyMap` is shared by a process's reader threads. A
//! cached answer is a deterministic function of the map, so two threads
//! that race to fill the same entry store the same value; entries are
//! plain atomics read and written with `Relaxed` ordering (no other memory
//! is published through them), and a chunk is created once (`OnceLock`).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::map::{self, MAX_EXTENTS, MapError, NO_SKIP};
use crate::rendezvous::{self, NodeTable, Seeded};
use crate::v1::{CompactMap, MapNode, OwnershipMap};

/// Extents per cache chunk.
const CHUNK: u64 = 1 << 16;

/// How answers were found, for tests and benchmarks.
#[derive(Debug, Default)]
pub struct LazyStats {
    /// Owners counted over a whole set.
    pub full: AtomicU64,
    /// Owners derived from an older set's answer.
    pub derived: AtomicU64,
}

/// An older set a set is derived from: its candidates that left and those
/// that came.
struct Base {
    from: Arc<SetOwners>,
    removed: Vec<u32>,
    added: Vec<Seeded>,
}

/// The owners of one candidate set, filled in as they are asked for.
struct SetOwners {
    /// The candidates with a weight, sorted by index.
    key: Vec<Seeded>,
    extents: u64,
    /// Owner + 1 per extent; 0: not known yet.
    chunks: Box<[OnceLock<Box<[AtomicU32]>>]>,
    base: Mutex<Option<Base>>,
}

impl SetOwners {
    fn new(key: Vec<Seeded>, extents: u64, base: Option<Base>) -> Self {
        let n = usize::try_from(extents.div_ceil(CHUNK)).unwrap_or(0);
        Self {
            key,
            extents,
            chunks: (0..n).map(|_| OnceLock::new()).collect(),
            base: Mutex::new(base),
        }
    }

    fn slot(&self, e: u64) -> Option<&AtomicU32> {
        let chunk = self.chunks.get(usize::try_from(e / CHUNK).ok()?)?;
        let c = chunk.get_or_init(|| (0..CHUNK).map(|_| AtomicU32::new(0)).collect());
        c.get(usize::try_from(e % CHUNK).ok()?)
    }

    /// The owner of `e` if it was computed (no chunk is created).
    fn known(&self, e: u64) -> Option<u32> {
        let chunk = self.chunks.get(usize::try_from(e / CHUNK).ok()?)?.get()?;
        let v = chunk
            .get(usize::try_from(e % CHUNK).ok()?)?
            .load(Ordering::Relaxed);
        // An owner of index u32::MAX is stored as 0: asked again each time.
        (v != 0).then(|| v.wrapping_sub(1))
    }

    fn seeded(&self, index: u32) -> Option<Seeded> {
        self.key
            .binary_search_by_key(&index, |s| s.index)
            .ok()
            .map(|k| self.key[k])
    }

    /// The owner of extent `e` under this set (0: no candidate).
    fn owner(&self, e: u64, stats: &LazyStats) -> u32 {
        if e >= self.extents {
            return 0;
        }
        if let Some(o) = self.known(e) {
            return o;
        }
        let base = self
            .base
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|b| (b.from.clone(), b.removed.clone(), b.added.clone()));
        let derived = base.and_then(|(from, removed, added)| {
            let o = from.known(e)?;
            if removed.contains(&o) {
                return None;
            }
            let mut best = match o {
                0 => (0, f64::NEG_INFINITY),
                o => {
                    let s = from.seeded(o)?;
                    (o, rendezvous::score(s.seed, e, s.weight))
                }
            };
            for a in &added {
                let s = rendezvous::score(a.seed, e, a.weight);
                if rendezvous::beats(a.index, s, best) {
                    best = (a.index, s);
                }
            }
            Some(best.0)
        });
        let o = match derived {
            Some(o) => {
                stats.derived.fetch_add(1, Ordering::Relaxed);
                o
            }
            None => {
                stats.full.fetch_add(1, Ordering::Relaxed);
                rendezvous::best_of(&self.key, e)
            }
        };
        if let Some(slot) = self.slot(e) {
            slot.store(o.wrapping_add(1), Ordering::Relaxed);
        }
        o
    }
}

/// A layer ready to scan: its set's owners and its skips.
struct Layer {
    set: Arc<SetOwners>,
    skips: NodeTable<usize>,
    any: bool,
}

/// The lazily resolved rules of one compact map.
struct Rules {
    owner: Arc<SetOwners>,
    handoff: Vec<Layer>,
    owner_overrides: HashMap<u64, u32>,
    previous_overrides: HashMap<u64, u32>,
    /// Every set built for this map, for the next one to reuse.
    sets: Vec<Arc<SetOwners>>,
    /// The map, for [`LazyMap::expand`].
    compact: CompactMap,
}

enum Inner {
    /// A coordinator that sends expanded maps: the arrays as they came.
    Expanded(Arc<OwnershipMap>),
    Lazy(Box<Rules>),
}

/// A map whose owners are resolved per extent when asked.
pub struct LazyMap {
    pub epoch: u64,
    pub file_size: u64,
    pub extent_size: u64,
    pub page_size: u32,
    pub nodes: Vec<MapNode>,
    extents: u64,
    inner: Inner,
    pub stats: LazyStats,
}

impl LazyMap {
    /// A map that came expanded (from a coordinator without compact maps).
    pub fn from_expanded(map: OwnershipMap) -> Self {
        Self {
            epoch: map.epoch,
            file_size: map.file_size,
            extent_size: map.extent_size,
            page_size: map.page_size,
            nodes: map.nodes.clone(),
            extents: map.owner.len() as u64,
            inner: Inner::Expanded(Arc::new(map)),
            stats: LazyStats::default(),
        }
    }

    /// The map `full` (not a delta), reusing what `prev` computed where its
    /// sets match. Refuses what [`crate::map::Expander::expand`] refuses.
    pub fn from_compact(full: &CompactMap, prev: Option<&LazyMap>) -> Result<Self, MapError> {
        let bad = |reason: String| MapError::Malformed {
            epoch: full.epoch,
            reason,
        };
        if full.base_epoch != 0 {
            return Err(bad("a delta cannot be expanded alone".into()));
        }
        let extents = map::extent_count(full.file_size, full.extent_size);
        if extents > MAX_EXTENTS {
            return Err(bad(format!("{extents} extents (at most {MAX_EXTENTS})")));
        }
        let resolved = map::resolve(full)?;
        let ids: HashMap<u32, &str> = full
            .nodes
            .iter()
            .map(|n| (n.index, n.node_id.as_str()))
            .collect();
        let older: &[Arc<SetOwners>] = match prev.map(|p| &p.inner) {
            Some(Inner::Lazy(r)) => &r.sets,
            _ => &[],
        };
        let mut built: BTreeMap<u64, Arc<SetOwners>> = BTreeMap::new();
        let mut set = |id: u64, what: &str| -> Result<Arc<SetOwners>, MapError> {
            if let Some(s) = built.get(&id) {
                return Ok(s.clone());
            }
            let s = resolved
                .get(&id)
                .ok_or_else(|| bad(format!("{what} names set {id}, which it lacks")))?;
            let mut key: Vec<Seeded> = s
                .iter()
                .filter(|&&(_, w)| w > 0)
                .map(|&(index, weight)| Seeded {
                    index,
                    seed: rendezvous::fnv1a(ids.get(&index).copied().unwrap_or("").as_bytes()),
                    weight,
                })
                .collect();
            key.sort_unstable_by_key(|s| s.index);
            let owners = match older.iter().find(|o| o.extents == extents && o.key == key) {
                Some(same) => same.clone(),
                None => {
                    let base = older
                        .iter()
                        .filter(|o| o.extents == extents)
                        .filter_map(|o| {
                            let removed: Vec<u32> = o
                                .key
                                .iter()
                                .filter(|k| !key.contains(k))
                                .map(|k| k.index)
                                .collect();
                            let added: Vec<Seeded> =
                                key.iter().filter(|k| !o.key.contains(k)).copied().collect();
                            (removed.len() + added.len() <= 2).then_some((o, removed, added))
                        })
                        .min_by_key(|(_, r, a)| r.len() + a.len());
                    let base = base.map(|(o, removed, added)| {
                        // Two generations at most: what `o` derives from
                        // derives from nothing from now on.
                        if let Some(b) = o
                            .base
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .as_ref()
                        {
                            *b.from
                                .base
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
                        }
                        Base {
                            from: o.clone(),
                            removed,
                            added,
                        }
                    });
                    Arc::new(SetOwners::new(key, extents, base))
                }
            };
            built.insert(id, owners.clone());
            Ok(owners)
        };
        let layer = |l: &crate::v1::Layer, set: Arc<SetOwners>| {
            let (skips, any) = map::layer_skips(l);
            Layer { set, skips, any }
        };
        let owner = set(full.owner_set, "owner_set")?;
        let mut handoff = Vec::new();
        for l in &full.handoff {
            handoff.push(layer(l, set(l.set, "a handoff layer")?));
        }
        // Release groups are not resolved here, but a map naming a set it
        // lacks is refused as the expansion refuses it.
        for g in &full.releases {
            for l in &g.layers {
                if !resolved.contains_key(&l.set) {
                    return Err(bad(format!(
                        "a release layer names set {}, which it lacks",
                        l.set
                    )));
                }
            }
            for id in &g.dropped_by {
                if !resolved.contains_key(id) {
                    return Err(bad(format!(
                        "a release group's dropped_by names set {id}, which it lacks"
                    )));
                }
            }
        }
        let sparse = |e: &[u64], v: &[u32], what: &str| -> Result<HashMap<u64, u32>, MapError> {
            if e.len() != v.len() {
                return Err(bad(format!(
                    "{what} overrides: {} extents, {} nodes",
                    e.len(),
                    v.len()
                )));
            }
            e.iter()
                .zip(v)
                .map(|(&e, &v)| {
                    if e >= extents {
                        Err(bad(format!("{what} override of extent {e}, past the end")))
                    } else {
                        Ok((e, v))
                    }
                })
                .collect()
        };
        let (mut owner_overrides, mut previous_overrides) = (HashMap::new(), HashMap::new());
        if let Some(o) = &full.overrides {
            owner_overrides = sparse(&o.owner_extent, &o.owner_node, "owner")?;
            previous_overrides = sparse(&o.previous_extent, &o.previous_node, "previous")?;
            sparse(&o.released_extent, &o.released_node, "released")?;
        }
        Ok(Self {
            epoch: full.epoch,
            file_size: full.file_size,
            extent_size: full.extent_size,
            page_size: full.page_size,
            nodes: full.nodes.clone(),
            extents,
            inner: Inner::Lazy(Box::new(Rules {
                owner,
                handoff,
                owner_overrides,
                previous_overrides,
                sets: built.into_values().collect(),
                compact: full.clone(),
            })),
            stats: LazyStats::default(),
        })
    }

    /// Number of extents.
    pub fn extents(&self) -> u64 {
        self.extents
    }

    /// The owner of `extent` (0: none, or past the end).
    pub fn owner(&self, extent: u64) -> u32 {
        match &self.inner {
            Inner::Expanded(m) => usize::try_from(extent)
                .ok()
                .and_then(|e| m.owner.get(e))
                .copied()
                .unwrap_or(0),
            Inner::Lazy(r) => {
                if !r.owner_overrides.is_empty()
                    && let Some(&o) = r.owner_overrides.get(&extent)
                {
                    return o;
                }
                r.owner.owner(extent, &self.stats)
            }
        }
    }

    /// The previous owner of `extent` in a handoff (0: none).
    pub fn previous_owner(&self, extent: u64) -> u32 {
        match &self.inner {
            Inner::Expanded(m) => usize::try_from(extent)
                .ok()
                .and_then(|e| m.previous_owner.get(e))
                .copied()
                .unwrap_or(0),
            Inner::Lazy(r) => {
                if extent >= self.extents {
                    return 0;
                }
                if !r.previous_overrides.is_empty()
                    && let Some(&p) = r.previous_overrides.get(&extent)
                {
                    return p;
                }
                let mut k = 0;
                let v = loop {
                    let Some(l) = r.handoff.get(k) else {
                        break 0;
                    };
                    let v = l.set.owner(extent, &self.stats);
                    if v == 0 {
                        k += 1;
                        continue;
                    }
                    let skip = if l.any { l.skips.get(v) } else { NO_SKIP };
                    if skip == NO_SKIP {
                        break v;
                    }
                    k = skip.max(k + 1);
                };
                // Against the rules' owner, before overrides (as expanded).
                if v != 0 && v != r.owner.owner(extent, &self.stats) {
                    v
                } else {
                    0
                }
            }
        }
    }

    /// The whole map, expanded (O(extents × members) for a map that came
    /// compact: for tools, not for the read path).
    pub fn expand(&self) -> Result<OwnershipMap, MapError> {
        match &self.inner {
            Inner::Expanded(m) => Ok((**m).clone()),
            Inner::Lazy(r) => map::Expander::new(1).expand(&r.compact),
        }
    }
}

/// What routing needs of a map, from an expanded [`OwnershipMap`] or a
/// [`LazyMap`] alike.
pub trait Owners {
    fn epoch(&self) -> u64;
    fn extent_size(&self) -> u64;
    fn page_size(&self) -> u32;
    fn nodes(&self) -> &[MapNode];
    /// The owner of `extent` (0: none, or past the end).
    fn owner(&self, extent: u64) -> u32;
    /// The previous owner of `extent` in a handoff (0: none).
    fn previous_owner(&self, extent: u64) -> u32;
}

impl Owners for LazyMap {
    fn epoch(&self) -> u64 {
        self.epoch
    }
    fn extent_size(&self) -> u64 {
        self.extent_size
    }
    fn page_size(&self) -> u32 {
        self.page_size
    }
    fn nodes(&self) -> &[MapNode] {
        &self.nodes
    }
    fn owner(&self, extent: u64) -> u32 {
        LazyMap::owner(self, extent)
    }
    fn previous_owner(&self, extent: u64) -> u32 {
        LazyMap::previous_owner(self, extent)
    }
}

impl Owners for OwnershipMap {
    fn epoch(&self) -> u64 {
        self.epoch
    }
    fn extent_size(&self) -> u64 {
        self.extent_size
    }
    fn page_size(&self) -> u32 {
        self.page_size
    }
    fn nodes(&self) -> &[MapNode] {
        &self.nodes
    }
    fn owner(&self, extent: u64) -> u32 {
        let e = usize::try_from(extent).unwrap_or(usize::MAX);
        self.owner.get(e).copied().unwrap_or(0)
    }
    fn previous_owner(&self, extent: u64) -> u32 {
        let e = usize::try_from(extent).unwrap_or(usize::MAX);
        self.previous_owner.get(e).copied().unwrap_or(0)
    }
}

impl<T: Owners + ?Sized> Owners for Arc<T> {
    fn epoch(&self) -> u64 {
        (**self).epoch()
    }
    fn extent_size(&self) -> u64 {
        (**self).extent_size()
    }
    fn page_size(&self) -> u32 {
        (**self).page_size()
    }
    fn nodes(&self) -> &[MapNode] {
        (**self).nodes()
    }
    fn owner(&self, extent: u64) -> u32 {
        (**self).owner(extent)
    }
    fn previous_owner(&self, extent: u64) -> u32 {
        (**self).previous_owner(extent)
    }
}

/// Applies a `WatchMap` stream or `GetMap` answers of compact maps and
/// deltas as [`crate::map::MapApplier`] does, into [`LazyMap`]s: each
/// reuses what the one before computed.
#[derive(Default)]
pub struct LazyApplier {
    current: Option<CompactMap>,
    last: Option<Arc<LazyMap>>,
}

impl LazyApplier {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes one message and returns its map. A message without `compact`
    /// is taken as the expanded map it is.
    pub fn apply(&mut self, msg: OwnershipMap) -> Result<Arc<LazyMap>, MapError> {
        let Some(c) = msg.compact.clone() else {
            self.current = None;
            let m = Arc::new(LazyMap::from_expanded(msg));
            self.last = Some(m.clone());
            return Ok(m);
        };
        let full = if c.base_epoch == 0 {
            c
        } else {
            match &self.current {
                Some(base) => map::apply_delta(base, &c)?,
                None => {
                    return Err(MapError::WrongBase {
                        base: c.base_epoch,
                        held: None,
                    });
                }
            }
        };
        let m = Arc::new(LazyMap::from_compact(&full, self.last.as_deref())?);
        self.current = Some(full);
        self.last = Some(m.clone());
        Ok(m)
    }

    /// Forgets the map held (a new stream starts with a full map).
    pub fn reset(&mut self) {
        self.current = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::Expander;
    use crate::v1::{CandidateSet, NodeState, SparseOverrides};

    fn node(index: u32, weight: u64) -> MapNode {
        MapNode {
            index,
            node_id: format!("n{index}"),
            state: NodeState::Alive.into(),
            weight,
            ..Default::default()
        }
    }

    fn settled(members: u32, extents: u64) -> CompactMap {
        CompactMap {
            epoch: 1,
            file_size: extents * 4096,
            extent_size: 4096,
            page_size: 4096,
            nodes: (1..=members)
                .map(|i| node(i, u64::from(1 + i % 3) << 30))
                .collect(),
            sets: vec![CandidateSet {
                id: 1,
                ..Default::default()
            }],
            owner_set: 1,
            ..Default::default()
        }
    }

    /// `m` with node `n` joined: owner set 2, the old set as the handoff.
    fn joined(m: &CompactMap, n: u32) -> CompactMap {
        let mut j = m.clone();
        j.epoch += 1;
        j.nodes.push(node(n, 1 << 30));
        let old = m.owner_set;
        j.sets = vec![
            CandidateSet {
                id: old,
                remove: vec![n],
                add: vec![],
            },
            CandidateSet {
                id: old + 1,
                ..Default::default()
            },
        ];
        j.owner_set = old + 1;
        j.handoff = vec![crate::v1::Layer {
            set: old,
            ..Default::default()
        }];
        j
    }

    fn same(lazy: &LazyMap, full: &CompactMap, order: &[u64]) {
        let want = Expander::default().expand(full).unwrap();
        for &e in order {
            let i = e as usize;
            assert_eq!(lazy.owner(e), want.owner[i], "owner of extent {e}");
            assert_eq!(
                lazy.previous_owner(e),
                want.previous_owner.get(i).copied().unwrap_or(0),
                "previous owner of extent {e}"
            );
        }
        assert_eq!(lazy.owner(want.owner.len() as u64), 0, "past the end");
    }

    #[test]
    fn every_extent_resolves_as_the_expansion_says() {
        let n = 3000u64;
        let order: Vec<u64> = (0..n).rev().collect();
        let base = settled(20, n);
        let l0 = LazyMap::from_compact(&base, None).unwrap();
        same(&l0, &base, &order[..n as usize / 2]);
        // A join derives from the settled set where that set knows the
        // extent (half of them), and counts the rest afresh.
        let j = joined(&base, 21);
        let l1 = LazyMap::from_compact(&j, Some(&l0)).unwrap();
        same(&l1, &j, &order);
        assert_eq!(l1.stats.derived.load(Ordering::Relaxed), n / 2);
        // A leave, a resume past a skipped node, and overrides on top.
        let mut m = joined(&j, 22);
        m.sets.push(CandidateSet {
            id: 9,
            remove: vec![1, 2, 3],
            add: vec![],
        });
        m.handoff = vec![
            crate::v1::Layer {
                set: 2,
                except: vec![4, 5],
                resume: vec![2, 0],
            },
            crate::v1::Layer {
                set: 3,
                ..Default::default()
            },
            crate::v1::Layer {
                set: 9,
                ..Default::default()
            },
        ];
        m.nodes[6].state = NodeState::Dead.into();
        m.overrides = Some(SparseOverrides {
            owner_extent: vec![5, 17],
            owner_node: vec![2, 0],
            previous_extent: vec![5],
            previous_node: vec![7],
            ..Default::default()
        });
        let l2 = LazyMap::from_compact(&m, Some(&l1)).unwrap();
        same(&l2, &m, &order);
        // A map that came expanded answers from its arrays.
        let e = Expander::default().expand(&m).unwrap();
        let x = LazyMap::from_expanded(e.clone());
        for i in 0..n {
            assert_eq!(x.owner(i), e.owner[i as usize]);
        }
        assert_eq!(l2.expand().unwrap(), e);
    }

    #[test]
    fn applying_a_join_is_independent_of_the_file_and_reuses_the_sets_before() {
        // 2^24 extents: expanding would compute 16 M owners per set; a
        // lazy map computes none until asked.
        let n = MAX_EXTENTS;
        let mut a = LazyApplier::new();
        let wrap = |c: CompactMap| OwnershipMap {
            epoch: c.epoch,
            compact: Some(c),
            ..Default::default()
        };
        let base = settled(50, n);
        let l0 = a.apply(wrap(base.clone())).unwrap();
        let probe = [0, 1, n / 2, n - 1];
        let before: Vec<u32> = probe.iter().map(|&e| l0.owner(e)).collect();
        let j = joined(&base, 51);
        let l1 = a.apply(wrap(map::delta(&base, &j))).unwrap();
        for (k, &e) in probe.iter().enumerate() {
            let o = l1.owner(e);
            assert!(o == before[k] || o == 51, "extent {e}: {o}");
            let want = rendezvous::owner_of(
                e,
                &j.nodes
                    .iter()
                    .map(|n| rendezvous::Candidate {
                        index: n.index,
                        node_id: &n.node_id,
                        weight: n.weight,
                    })
                    .collect::<Vec<_>>(),
            );
            assert_eq!(o, want, "extent {e}");
            // The handoff layer is the settled set itself: known already.
            assert_eq!(l1.previous_owner(e), if o == 51 { before[k] } else { 0 });
        }
        assert_eq!(l1.stats.derived.load(Ordering::Relaxed), probe.len() as u64);
        assert_eq!(l1.stats.full.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn malformed_maps_are_refused_as_the_expansion_refuses_them() {
        let base = settled(3, 100);
        let bad = |f: &dyn Fn(&mut CompactMap)| {
            let mut m = joined(&base, 4);
            f(&mut m);
            (
                LazyMap::from_compact(&m, None).is_err(),
                Expander::default().expand(&m).is_err(),
            )
        };
        let cases: [&dyn Fn(&mut CompactMap); 6] = [
            &|m| m.owner_set = 77,
            &|m| m.handoff[0].set = 77,
            &|m| m.base_epoch = 3,
            &|m| m.file_size = u64::MAX,
            &|m| {
                m.overrides = Some(SparseOverrides {
                    owner_extent: vec![100],
                    owner_node: vec![1],
                    ..Default::default()
                })
            },
            &|m| {
                m.releases = vec![crate::v1::ReleaseGroup {
                    dropped_by: vec![77],
                    ..Default::default()
                }]
            },
        ];
        for (k, c) in cases.iter().enumerate() {
            assert_eq!(bad(*c), (true, true), "case {k}");
        }
    }
}
