//! What this node may do with each extent under the map it applied.
//!
//! Rules (ARCHITECTURE.md, "Ownership, leases and writes"):
//!
//! 1. Only an extent this node answers *from its cache* may have pages in
//!    the cache: one it owns outright (no handoff), or one it hands off as
//!    `previous_owner`. Applying a map refuses every other extent from the
//!    moment it is installed and then evicts its pages (the next map waits
//!    for that); when the epochs applied are not consecutive (a skipped epoch
//!    may have moved an extent away and back, with writes in between) it
//!    evicts every page before answering anything under the new map.
//! 2. The new owner of an extent in handoff answers none of it (the previous
//!    owner does, and may still be acknowledging writes under an older map):
//!    it refuses it as moving.
//! 3. Writes are acknowledged only by the outright owner, and, where the map
//!    names a node that released the extent (`released_by`), only from one
//!    lease plus the clock-drift margin after this node first applied such a
//!    map: by then the releasing node has applied a map without the extent or
//!    its lease ran out. The same fence holds for an extent this node gains
//!    from another owner in any other way (the coordinator moved it off a
//!    dead node), and for every extent it owns after skipped epochs: other
//!    nodes read pages one-sidedly from the owner their map names, which may
//!    be the old one (frozen, its memory still readable) until *their* lease
//!    runs out, at most one lease after this map was published. Every
//!    extent owned in the first map after a registration is fenced too (a
//!    predecessor of the same node id may have been killed and restarted in
//!    place, keeping its extents with no move). A fence lasts until its
//!    deadline whatever maps follow, as long as the extent stays owned
//!    under consecutive epochs (it is not one epoch long).
//! 4. Pages of an extent this node does not serve come from a [`PageSource`]
//!    (reading them from their owner, never caching them), or, with none, are
//!    refused as a stale map.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pagewire_proto::v1::OwnershipMap;

use super::DaemonError;

/// Reads pages of an extent this node does not serve from the node that
/// does, without caching them here (`pagewire_client::OwnerPool` reads them
/// one-sidedly). Without one, such reads are refused as a stale map.
pub(crate) trait PageSource: Send + Sync {
    /// Pages `first..first + count` (all in one extent owned by `owner` at
    /// `epoch`).
    fn read(
        &self,
        owner: &pagewire_proto::v1::MapNode,
        epoch: u64,
        first: u64,
        count: u64,
    ) -> Result<Sourced, DaemonError>;
}

/// Pages a [`PageSource`] read.
#[derive(Debug)]
pub(crate) struct Sourced {
    /// Their bytes, concatenated.
    pub(crate) data: Vec<u8>,
    /// Each page's frame generation on its owner.
    pub(crate) generations: Vec<u64>,
    /// Whether any page was faulted in on the owner over gRPC (a one-sided
    /// miss) rather than read one-sidedly.
    pub(crate) faulted_in: bool,
}

/// This node's part in one extent at one epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Owner, no handoff: answers from its cache, may write.
    Owner,
    /// Previous owner in a handoff: answers reads from its cache, no writes.
    HandingOff { to: u32 },
    /// New owner in a handoff: answers nothing of it yet.
    Receiving { from: u32 },
    /// Someone else's (0: nobody's).
    Other { owner: u32 },
}

impl Role {
    /// Whether this node answers the extent from its own cache.
    pub(crate) fn cached(self) -> bool {
        matches!(self, Role::Owner | Role::HandingOff { .. })
    }
}

/// The map as this node applied it.
pub(crate) struct MapView {
    pub(crate) map: Arc<OwnershipMap>,
    pub(crate) me: u32,
    pub(crate) pages_per_extent: u64,
    /// Extents owned outright whose writes wait: until when.
    write_fences: HashMap<usize, Instant>,
}

/// What applying a new map takes.
pub(crate) struct Plan {
    pub(crate) view: MapView,
    /// Extents whose cached pages must go before the view is served.
    pub(crate) evict: Vec<usize>,
    /// Whether every extent's pages go (epochs not consecutive).
    pub(crate) evict_all: bool,
}

impl MapView {
    pub(crate) fn extent_of(&self, page: u64) -> usize {
        usize::try_from(page / self.pages_per_extent).unwrap_or(usize::MAX)
    }

    pub(crate) fn role(&self, extent: usize) -> Role {
        let owner = self.map.owner.get(extent).copied().unwrap_or(0);
        let prev = self.map.previous_owner.get(extent).copied().unwrap_or(0);
        match (owner == self.me, prev) {
            (true, 0) => Role::Owner,
            (true, from) => Role::Receiving { from },
            (false, p) if p == self.me => Role::HandingOff { to: owner },
            (false, _) => Role::Other { owner },
        }
    }

    pub(crate) fn owned(&self) -> u64 {
        self.map.owner.iter().filter(|&&o| o == self.me).count() as u64
    }

    /// Extents this node answers from its cache (owned outright or handed
    /// off); 0 once a drain finished.
    pub(crate) fn serving(&self) -> u64 {
        (0..self.extents())
            .filter(|&e| self.role(e).cached())
            .count() as u64
    }

    fn extents(&self) -> usize {
        self.map.owner.len()
    }

    /// How long writes to `extent` still wait (None: they may go now).
    pub(crate) fn write_wait(&self, extent: usize, now: Instant) -> Option<Duration> {
        self.write_fences
            .get(&extent)
            .map(|&at| at.saturating_duration_since(now))
            .filter(|d| !d.is_zero())
    }

    /// The view of `map` for node `me`, and what applying it after `old`
    /// must evict. `fence` is one lease plus the drift margin.
    pub(crate) fn plan(
        old: Option<&MapView>,
        map: OwnershipMap,
        me: u32,
        pages_per_extent: u64,
        fence: Duration,
        now: Instant,
    ) -> Plan {
        let mut view = MapView {
            map: Arc::new(map),
            me,
            pages_per_extent,
            write_fences: HashMap::new(),
        };
        // Consecutive epochs of one coordinator: the difference is all that
        // changed. Anything else (a skipped epoch, a coordinator that started
        // afresh, the same epoch with another content) may hide a move away
        // and back.
        let continuous = old.is_some_and(|o| {
            o.me == me
                && o.extents() == view.extents()
                && (o.map.epoch + 1 == view.map.epoch
                    || (o.map.epoch == view.map.epoch && *o.map == *view.map))
        });
        for e in 0..view.extents() {
            if view.role(e) != Role::Owner {
                continue;
            }
            let released = view
                .map
                .released_by
                .get(e)
                .is_some_and(|&r| r != 0 && r != me);
            // Gained since the last map from another owner (not a handoff
            // that ended: that one names `released_by`), owned after a gap
            // in the epochs, where anything may have moved, or owned in the
            // first map after a registration: this process cannot know who
            // served the extent before (a predecessor of the same id killed
            // and restarted in place within its lease keeps its extents
            // with no move, and readers may still copy its frozen region).
            let gained = match old {
                Some(o) if continuous => o.role(e) != Role::Owner,
                Some(_) | None => true,
            };
            // A fence runs to its deadline, however many epochs follow: it
            // is carried over (expired ones too, so that a `released_by`
            // still named does not start a second fence) for as long as the
            // extent stays owned outright under consecutive epochs.
            let kept = old
                .filter(|o| continuous && o.role(e) == Role::Owner)
                .and_then(|o| o.write_fences.get(&e).copied());
            match kept {
                Some(at) => {
                    view.write_fences.insert(e, at);
                }
                None if released || gained => {
                    view.write_fences.insert(e, now + fence);
                }
                None => {}
            }
        }
        let Some(old) = old else {
            // Nothing is cached without a view (start, or after losing
            // everything, which evicted it all).
            return Plan {
                view,
                evict: Vec::new(),
                evict_all: false,
            };
        };
        if !continuous {
            return Plan {
                view,
                evict: Vec::new(),
                evict_all: true,
            };
        }
        let evict = (0..old.extents())
            .filter(|&e| old.role(e).cached() && !view.role(e).cached())
            .collect();
        Plan {
            view,
            evict,
            evict_all: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use pagewire_proto::v1::OwnershipMap;

    use super::{MapView, Role};

    fn map(epoch: u64, owner: &[u32], prev: &[u32], released: &[u32]) -> OwnershipMap {
        OwnershipMap {
            epoch,
            owner: owner.to_vec(),
            previous_owner: prev.to_vec(),
            released_by: released.to_vec(),
            ..Default::default()
        }
    }

    const FENCE: Duration = Duration::from_secs(1);

    /// proto/testdata/rendezvous-vectors.json, through what the node does
    /// with a compact map from its watch stream: expand it with the shared
    /// code and take each extent's role from the view.
    #[test]
    fn the_rendezvous_test_vectors_hold_on_the_node() {
        use pagewire_proto::v1::{CandidateSet, CompactMap, MapNode, NodeState};
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
            let extents = s["extent_count"].as_u64().unwrap();
            let nodes: Vec<MapNode> = s["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| MapNode {
                    index: c["index"].as_u64().unwrap() as u32,
                    node_id: c["node_id"].as_str().unwrap().to_owned(),
                    weight: c["weight"].as_u64().unwrap(),
                    state: NodeState::Alive.into(),
                    ..Default::default()
                })
                .collect();
            let compact = CompactMap {
                epoch: 3,
                file_size: extents * (2 << 20) - 1,
                extent_size: 2 << 20,
                page_size: 4096,
                nodes: nodes.clone(),
                sets: vec![CandidateSet {
                    id: 3,
                    ..Default::default()
                }],
                owner_set: 3,
                ..Default::default()
            };
            let map = pagewire_proto::map::MapApplier::new()
                .apply(OwnershipMap {
                    epoch: 3,
                    compact: Some(compact),
                    ..Default::default()
                })
                .unwrap();
            let bytes: Vec<u8> = map.owner.iter().flat_map(|o| o.to_le_bytes()).collect();
            let want = u64::from_str_radix(
                s["owners_fnv1a64"]
                    .as_str()
                    .unwrap()
                    .trim_start_matches("0x"),
                16,
            )
            .unwrap();
            assert_eq!(pagewire_proto::rendezvous::fnv1a(&bytes), want, "{name}");
            let now = Instant::now();
            for x in s["expect"].as_array().unwrap() {
                let e = x["extent"].as_u64().unwrap() as usize;
                let owner = x["owner"].as_u64().unwrap() as u32;
                for n in &nodes {
                    let view = MapView::plan(None, map.clone(), n.index, 512, FENCE, now).view;
                    let want = if n.index == owner {
                        Role::Owner
                    } else {
                        Role::Other { owner }
                    };
                    assert_eq!(view.role(e), want, "{name}: extent {e}, node {}", n.index);
                }
            }
        }
    }

    /// Finding 2 of issue 18: a process restarted in place (same id, same
    /// index, within its predecessor's lease) gets the same extents with no
    /// move; it cannot tell that case from a first start, so every extent
    /// of its first map is fenced.
    #[test]
    fn the_first_map_after_a_registration_fences_every_owned_extent() {
        let now = Instant::now();
        let v1 = MapView::plan(None, map(7, &[1, 2, 1], &[], &[]), 1, 16, FENCE, now).view;
        assert_eq!(v1.write_wait(0, now), Some(FENCE));
        assert_eq!(v1.write_wait(2, now), Some(FENCE));
        assert_eq!(
            v1.write_wait(0, now + FENCE),
            None,
            "until one lease + margin"
        );
    }

    #[test]
    fn an_extent_taken_from_a_dead_node_fences_its_writes() {
        let t0 = Instant::now();
        let v1 = MapView::plan(None, map(1, &[1, 2, 1], &[], &[]), 1, 16, FENCE, t0).view;
        // Node 2 died: its extent comes to us with no handoff and no release.
        let t1 = t0 + 2 * FENCE;
        let v2 = MapView::plan(Some(&v1), map(2, &[1, 1, 1], &[], &[]), 1, 16, FENCE, t1).view;
        assert_eq!(v2.write_wait(1, t1), Some(FENCE), "taken from a dead node");
        assert_eq!(v2.write_wait(0, t1), None, "kept, its first fence over");
        // After a gap in the epochs every owned extent is fenced.
        let v3 = MapView::plan(Some(&v2), map(5, &[1, 1, 1], &[], &[]), 1, 16, FENCE, t1).view;
        assert_eq!(v3.write_wait(0, t1), Some(FENCE));
    }

    /// Finding 1 of issue 18: a takeover's fence used to end with the next
    /// epoch (any unrelated change: a drain, a join), so the new owner
    /// acknowledged writes while readers could still trust the old map and
    /// read the frozen old owner's region.
    #[test]
    fn a_takeover_fence_outlives_the_epochs_that_follow() {
        let t0 = Instant::now();
        let v1 = MapView::plan(None, map(1, &[1, 2, 3], &[], &[]), 1, 16, FENCE, t0).view;
        let t1 = t0 + 2 * FENCE;
        // Node 2 is declared dead: extent 1 comes to node 1.
        let v2 = MapView::plan(Some(&v1), map(2, &[1, 1, 3], &[], &[]), 1, 16, FENCE, t1).view;
        assert_eq!(v2.write_wait(1, t1), Some(FENCE));
        // 4 ms later an unrelated change (node 3 drained) publishes epoch 3.
        let t2 = t1 + Duration::from_millis(4);
        let v3 = MapView::plan(
            Some(&v2),
            map(3, &[1, 1, 1], &[0, 0, 3], &[]),
            1,
            16,
            FENCE,
            t2,
        )
        .view;
        assert_eq!(
            v3.write_wait(1, t2),
            Some(FENCE - Duration::from_millis(4)),
            "the takeover's fence runs to its deadline"
        );
        let t3 = t2 + Duration::from_millis(6);
        let v4 = MapView::plan(
            Some(&v3),
            map(4, &[1, 1, 1], &[], &[0, 0, 3]),
            1,
            16,
            FENCE,
            t3,
        )
        .view;
        assert_eq!(
            v4.write_wait(1, t3),
            Some(FENCE - Duration::from_millis(10))
        );
        assert_eq!(v4.write_wait(2, t3), Some(FENCE), "released by 3: fenced");
        assert_eq!(v4.write_wait(1, t1 + FENCE), None, "and no longer");
    }

    #[test]
    fn roles_evictions_and_write_fences() {
        // The first map's fence (every owned extent) is over by `now`.
        let t0 = Instant::now();
        let now = t0 + 2 * FENCE;
        let v1 = MapView::plan(None, map(1, &[1, 2, 1], &[], &[]), 1, 16, FENCE, t0);
        assert!(v1.evict.is_empty() && !v1.evict_all);
        let v1 = v1.view;
        assert_eq!(v1.role(0), Role::Owner);
        assert_eq!(v1.role(1), Role::Other { owner: 2 });
        assert_eq!(v1.write_wait(0, now), None);
        // Extent 0 moves to 3 (handoff), extent 1 comes to us (handoff).
        let p = MapView::plan(
            Some(&v1),
            map(2, &[3, 1, 1], &[1, 2, 0], &[]),
            1,
            16,
            FENCE,
            now,
        );
        assert!(p.evict.is_empty(), "a handing-off node keeps its pages");
        let v2 = p.view;
        assert_eq!(v2.role(0), Role::HandingOff { to: 3 });
        assert_eq!(v2.role(1), Role::Receiving { from: 2 });
        assert!(!v2.role(1).cached());
        // Handoffs clear: 0 is gone (evicted), 1 ours with writes fenced.
        let p = MapView::plan(
            Some(&v2),
            map(3, &[3, 1, 1], &[], &[1, 2, 0]),
            1,
            16,
            FENCE,
            now,
        );
        assert_eq!(p.evict, vec![0]);
        let v3 = p.view;
        assert_eq!(v3.write_wait(1, now), Some(FENCE));
        assert_eq!(v3.write_wait(2, now), None);
        // The fence keeps its deadline while the entry stays.
        let later = now + Duration::from_millis(600);
        let v4 = MapView::plan(
            Some(&v3),
            map(4, &[3, 1, 1], &[], &[1, 2, 0]),
            1,
            16,
            FENCE,
            later,
        )
        .view;
        assert_eq!(v4.write_wait(1, later), Some(Duration::from_millis(400)));
        // A skipped epoch evicts everything.
        let p = MapView::plan(Some(&v4), map(6, &[3, 1, 1], &[], &[]), 1, 16, FENCE, later);
        assert!(p.evict_all);
    }
}
