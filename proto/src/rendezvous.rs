//! Weighted rendezvous (highest random weight) hashing of extents to nodes:
//! the one function the coordinator, the nodes, the cluster client and
//! `pwctl` use to compute which node owns an extent.
//!
//! Every (node, extent) pair gets a pseudo-random score `-w / ln(u)`, with
//! `u` in (0, 1) drawn from a hash of the node id and the extent number and
//! `w` the node's weight (its capacity). The extent goes to the highest score.
//! The probability a node wins is `w / sum(w)` (Schindelhauer & Schomaker,
//! "Weighted distributed hash tables", 2005), and adding or removing a node
//! only moves the extents that node wins or held: on a join of a node with a
//! share `s` of the total weight, a fraction `s` of the extents moves, all of
//! them to the new node.
//!
//! ## The hash, bit for bit
//!
//! - `seed = FNV-1a 64(node_id bytes)` (offset `0xcbf29ce484222325`, prime
//!   `0x100000001b3`).
//! - `h = splitmix64(seed ^ splitmix64(extent))`, where `splitmix64(z)` adds
//!   `0x9E3779B97F4A7C15` (wrapping) and then mixes with the shifts 30, 27,
//!   31 and the multipliers `0xBF58476D1CE4E5B9`, `0x94D049BB133111EB`.
//! - `u = ((h >> 11) as f64 + 0.5) / 2^53` (never 0 nor 1), and
//!   `score = -(weight as f64) / ln(u)` in IEEE-754 double precision.
//! - The highest score wins; an exact tie goes to the lower node index.
//!   Candidates of weight 0 never win; with no candidate the owner is 0.
//!
//! `proto/testdata/rendezvous-vectors.json` pins this down: the tests of this
//! crate, of the node and of the coordinator all check it, so no side can
//! drift (and maps persisted by older coordinators expand the same).
//!
//! ## Incremental updates
//!
//! [`with_added`] and [`with_removed`] compute the owners after one candidate
//! joins or leaves from the owners before, in O(extents) score evaluations
//! instead of O(extents × candidates): a newcomer only has to beat the
//! current owner's score, and only a leaver's extents need a full recount.
//!
//! [`Floored`] does the same with a *floor*: a number no extent's winning
//! score is below. A newcomer's score `-w / ln(u)` is below the floor `F`
//! exactly when `u < exp(-w / F)`, so an extent whose `u` is under that
//! threshold (less a relative margin of 10^-9) keeps its owner without a
//! logarithm or the owner's score: a join costs two hashes per extent and
//! two scores only where the newcomer may win. The margin covers the
//! rounding of `u`, `ln`, `exp` and the divisions (each within 10^-15
//! relative) many times over: a threshold above 0 needs `w / F < 746`
//! (else `exp` underflows and nothing is skipped), and then the margin on
//! `u` keeps a skipped score at least 10^-12 relative below `F`, so
//! strictly below the owner's, whose tie rule never comes into it. The
//! owners are bit for bit those of [`assign`] (the tests compare them).

/// A node that may own extents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate<'a> {
    /// The node's index in the map (never 0).
    pub index: u32,
    /// The node's id: what its hash seed is computed from.
    pub node_id: &'a str,
    /// Relative weight (the node's capacity in bytes); 0 never wins.
    pub weight: u64,
}

/// FNV-1a 64 of `bytes`: a node's hash seed is that of its id.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// SplitMix64's output function (Steele, Lea & Flood, 2014).
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Score of the node with hash seed `node_seed` for `extent`.
pub fn score(node_seed: u64, extent: u64, weight: u64) -> f64 {
    score_of_unit(unit(node_seed, extent), weight)
}

/// The score of a node of weight `weight` whose `u` (below) is `u`.
#[inline]
fn score_of_unit(u: f64, weight: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let w = weight as f64;
    -w / u.ln()
}

/// The `u` of a score: 53 random bits, shifted into (0, 1) (never 0 nor 1,
/// so ln(u) < 0).
#[inline]
fn unit(node_seed: u64, extent: u64) -> f64 {
    let h = splitmix64(node_seed ^ splitmix64(extent));
    #[allow(clippy::cast_precision_loss)]
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    u
}

/// Values by node index, for lookups once per extent: a vector where the
/// indexes are small (the coordinator hands them out in order from 1), a
/// hash map for any index past [`NodeTable::DENSE`] (a malformed map may
/// name any `u32`, and must not make a reader allocate gigabytes).
#[derive(Debug, Clone)]
pub struct NodeTable<T> {
    dense: Vec<T>,
    sparse: std::collections::HashMap<u32, T>,
    default: T,
}

impl<T: Copy> NodeTable<T> {
    /// Indexes below this live in the vector.
    pub const DENSE: u32 = 1 << 16;

    /// The table holding `entries`; every other index reads `default`.
    pub fn new(default: T, entries: impl IntoIterator<Item = (u32, T)>) -> Self {
        let mut t = Self {
            dense: Vec::new(),
            sparse: std::collections::HashMap::new(),
            default,
        };
        for (i, v) in entries {
            t.set(i, v);
        }
        t
    }

    /// Sets the value of `index`.
    pub fn set(&mut self, index: u32, value: T) {
        *self.get_mut(index) = value;
    }

    /// The value of `index`, to change in place.
    #[inline]
    pub fn get_mut(&mut self, index: u32) -> &mut T {
        if index < Self::DENSE {
            let i = index as usize;
            if self.dense.len() <= i {
                self.dense.resize(i + 1, self.default);
            }
            &mut self.dense[i]
        } else {
            self.sparse.entry(index).or_insert(self.default)
        }
    }

    /// The value of `index`.
    #[inline]
    pub fn get(&self, index: u32) -> T {
        match self.dense.get(index as usize) {
            Some(&v) => v,
            None if self.sparse.is_empty() => self.default,
            None => self.sparse.get(&index).copied().unwrap_or(self.default),
        }
    }
}

/// A candidate with its seed computed once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seeded {
    pub(crate) index: u32,
    pub(crate) seed: u64,
    pub(crate) weight: u64,
}

pub(crate) fn seeded(candidates: &[Candidate<'_>]) -> Vec<Seeded> {
    candidates
        .iter()
        .filter(|c| c.weight > 0)
        .map(|c| Seeded {
            index: c.index,
            seed: fnv1a(c.node_id.as_bytes()),
            weight: c.weight,
        })
        .collect()
}

/// Whether `(index, s)` beats the best so far. Ties (practically never) go
/// to the lower index, so the result does not depend on candidate order.
pub(crate) fn beats(index: u32, s: f64, best: (u32, f64)) -> bool {
    s > best.1 || (s == best.1 && index < best.0)
}

pub(crate) fn best_of(seeds: &[Seeded], extent: u64) -> u32 {
    let mut best = (0u32, f64::NEG_INFINITY);
    for c in seeds {
        let s = score(c.seed, extent, c.weight);
        if beats(c.index, s, best) {
            best = (c.index, s);
        }
    }
    best.0
}

/// As [`best_of`], with the winning score (`-inf` when there is no
/// candidate).
fn best_scored(seeds: &[Seeded], extent: u64) -> (u32, f64) {
    let mut best = (0u32, f64::NEG_INFINITY);
    for c in seeds {
        let s = score(c.seed, extent, c.weight);
        if beats(c.index, s, best) {
            best = (c.index, s);
        }
    }
    best
}

/// Owner (node index) of `extent` among `candidates`; 0 when there is none.
pub fn owner_of(extent: u64, candidates: &[Candidate<'_>]) -> u32 {
    best_of(&seeded(candidates), extent)
}

/// Owner (node index) of each of `extent_count` extents; 0 for every extent
/// when there is no candidate.
pub fn assign(extent_count: u64, candidates: &[Candidate<'_>]) -> Vec<u32> {
    Floored::assign(extent_count, candidates).owners
}

/// The owners after `added` joins a candidate set whose owners were
/// `owners` (`added.index` must not be in that set). O(extents): only the
/// newcomer's score and the current owner's are compared.
pub fn with_added(owners: &[u32], before: &[Candidate<'_>], added: Candidate<'_>) -> Vec<u32> {
    Floored::unknown(owners.to_vec())
        .with_added(before, added)
        .owners
}

/// The owners after the candidate `removed` leaves; `after` is the set
/// without it and `owners` the owners with it. O(extents) in expectation:
/// only the leaver's extents are counted afresh.
pub fn with_removed(owners: &[u32], after: &[Candidate<'_>], removed: u32) -> Vec<u32> {
    Floored::unknown(owners.to_vec())
        .with_removed(after, removed)
        .owners
}

/// Owners of extents `0..owners.len()` with a floor: no extent's winning
/// score is below `floor` (`-inf`: not known, or an extent has no owner).
/// See "Incremental updates" above.
#[derive(Debug, Clone, PartialEq)]
pub struct Floored {
    /// Owner of each extent (0: no candidate).
    pub owners: Vec<u32>,
    /// No extent's winning score is below this.
    pub floor: f64,
}

/// Relative margin below the exact threshold (see "Incremental updates").
const FLOOR_MARGIN: f64 = 1e-9;

impl Floored {
    /// Owners whose scores are not known.
    pub fn unknown(owners: Vec<u32>) -> Self {
        Self {
            owners,
            floor: f64::NEG_INFINITY,
        }
    }

    /// Owners of each of `extent_count` extents among `candidates`, with
    /// the lowest winning score as floor.
    pub fn assign(extent_count: u64, candidates: &[Candidate<'_>]) -> Self {
        let seeds = seeded(candidates);
        let mut floor = f64::INFINITY;
        let owners = (0..extent_count)
            .map(|e| {
                let (o, s) = best_scored(&seeds, e);
                floor = floor.min(s);
                o
            })
            .collect();
        Self::with_floor(owners, floor)
    }

    fn with_floor(owners: Vec<u32>, floor: f64) -> Self {
        // No extent: nothing to bound (a floor of +inf would skip all).
        let floor = if owners.is_empty() || floor.is_nan() {
            f64::NEG_INFINITY
        } else {
            floor
        };
        Self { owners, floor }
    }

    /// The owners after `added` joins `before` (these owners' set, which
    /// must not hold `added.index`).
    pub fn with_added(self, before: &[Candidate<'_>], added: Candidate<'_>) -> Self {
        let seeds = seeded(before);
        let by_index = NodeTable::new(None, seeds.iter().map(|s| (s.index, Some(*s))));
        let mut all = seeds.clone();
        all.extend(seeded(&[added]));
        let Some(new) = all.last().copied().filter(|n| n.index == added.index) else {
            // A weight of 0 never wins: nothing moves.
            return self;
        };
        // Below this `u` the newcomer's score is below the floor (0: skip
        // nothing, as with an unknown or non-positive floor).
        #[allow(clippy::cast_precision_loss)]
        let w = new.weight as f64;
        let threshold = if self.floor > 0.0 && self.floor.is_finite() {
            (-w / self.floor).exp() * (1.0 - FLOOR_MARGIN)
        } else {
            0.0
        };
        let mut floor = f64::INFINITY;
        let owners = self
            .owners
            .iter()
            .enumerate()
            .map(|(e, &cur)| {
                let e = e as u64;
                match by_index.get(cur) {
                    Some(c) => {
                        let u = unit(new.seed, e);
                        if u < threshold {
                            // Below the floor, so below the owner's score.
                            return cur;
                        }
                        let s_new = score_of_unit(u, new.weight);
                        let s_cur = score(c.seed, e, c.weight);
                        if beats(new.index, s_new, (cur, s_cur)) {
                            floor = floor.min(s_new);
                            new.index
                        } else {
                            floor = floor.min(s_cur);
                            cur
                        }
                    }
                    // No owner before (no candidate), or one that is not in
                    // `before`: count it afresh.
                    None => {
                        let (o, s) = best_scored(&all, e);
                        floor = floor.min(s);
                        o
                    }
                }
            })
            .collect();
        // A skipped extent kept a winner at or above the old floor; every
        // other extent's winner was seen.
        let floor = if threshold > 0.0 {
            floor.min(self.floor)
        } else {
            floor
        };
        Self::with_floor(owners, floor)
    }

    /// The owners after the candidate `removed` leaves (`after` is the set
    /// without it): only its extents are counted afresh.
    pub fn with_removed(self, after: &[Candidate<'_>], removed: u32) -> Self {
        let seeds = seeded(after);
        let mut floor = self.floor;
        let owners = self
            .owners
            .iter()
            .enumerate()
            .map(|(e, &cur)| {
                if cur == removed {
                    let (o, s) = best_scored(&seeds, e as u64);
                    floor = floor.min(s);
                    o
                } else {
                    cur
                }
            })
            .collect();
        Self::with_floor(owners, floor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_table_reads_what_was_set_dense_or_not() {
        let big = NodeTable::<u8>::DENSE + 7;
        let mut t = NodeTable::new(9u8, [(3, 1), (big, 2), (u32::MAX, 3)]);
        assert_eq!((t.get(3), t.get(big), t.get(u32::MAX)), (1, 2, 3));
        assert_eq!((t.get(0), t.get(4), t.get(big - 1)), (9, 9, 9));
        *t.get_mut(4) += 1;
        *t.get_mut(big + 1) += 1;
        assert_eq!((t.get(4), t.get(big + 1)), (10, 10));
        // A huge index stays out of the vector.
        assert!(t.dense.len() <= 5);
    }

    fn vectors() -> serde_json::Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/testdata/rendezvous-vectors.json"
        );
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn hex(v: &serde_json::Value) -> u64 {
        u64::from_str_radix(v.as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
    }

    fn owners_hash(o: &[u32]) -> u64 {
        let bytes: Vec<u8> = o.iter().flat_map(|x| x.to_le_bytes()).collect();
        fnv1a(&bytes)
    }

    #[test]
    fn the_test_vectors_hold() {
        let v = vectors();
        for f in v["fnv1a64"].as_array().unwrap() {
            assert_eq!(
                fnv1a(f["input"].as_str().unwrap().as_bytes()),
                hex(&f["hash"])
            );
        }
        for f in v["splitmix64"].as_array().unwrap() {
            assert_eq!(splitmix64(hex(&f["input"])), hex(&f["output"]));
        }
        let sets = v["sets"].as_array().unwrap();
        assert!(sets.len() >= 5);
        for s in sets {
            let name = s["name"].as_str().unwrap();
            let ids: Vec<(u32, String, u64)> = s["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| {
                    (
                        c["index"].as_u64().unwrap() as u32,
                        c["node_id"].as_str().unwrap().to_owned(),
                        c["weight"].as_u64().unwrap(),
                    )
                })
                .collect();
            let cands: Vec<Candidate<'_>> = ids
                .iter()
                .map(|(index, node_id, weight)| Candidate {
                    index: *index,
                    node_id,
                    weight: *weight,
                })
                .collect();
            let n = s["extent_count"].as_u64().unwrap();
            let owners = assign(n, &cands);
            assert_eq!(owners_hash(&owners), hex(&s["owners_fnv1a64"]), "{name}");
            if let Some(all) = s["owners"].as_array() {
                let want: Vec<u32> = all.iter().map(|o| o.as_u64().unwrap() as u32).collect();
                assert_eq!(owners, want, "{name}");
            }
            for x in s["expect"].as_array().unwrap() {
                let e = x["extent"].as_u64().unwrap();
                let want = x["owner"].as_u64().unwrap() as u32;
                assert_eq!(owner_of(e, &cands), want, "{name}: extent {e}");
                assert_eq!(owners[e as usize], want, "{name}: extent {e}");
            }
            let mut counts = std::collections::BTreeMap::<String, u64>::new();
            for o in &owners {
                *counts.entry(o.to_string()).or_default() += 1;
            }
            let want: std::collections::BTreeMap<String, u64> = s["owned"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
                .collect();
            assert_eq!(counts, want, "{name}");
            // The incremental paths agree with the full one on every set.
            if cands.len() >= 2 && n <= 1 << 16 {
                let (last, rest) = cands.split_last().unwrap();
                let before = assign(n, rest);
                assert_eq!(with_added(&before, rest, *last), owners, "{name}: join");
                assert_eq!(
                    with_removed(&owners, rest, last.index),
                    before,
                    "{name}: leave"
                );
            }
        }
    }

    fn nodes(n: u32) -> Vec<(u32, String)> {
        (1..=n).map(|i| (i, format!("node-{i}"))).collect()
    }

    fn cands(nodes: &[(u32, String)], weight: impl Fn(u32) -> u64) -> Vec<Candidate<'_>> {
        nodes
            .iter()
            .map(|(i, id)| Candidate {
                index: *i,
                node_id: id,
                weight: weight(*i),
            })
            .collect()
    }

    #[test]
    fn no_candidates_means_no_owner() {
        assert_eq!(assign(3, &[]), vec![0, 0, 0]);
        let n = nodes(1);
        assert_eq!(with_added(&[0, 0], &[], cands(&n, |_| 5)[0]), vec![1, 1]);
        assert_eq!(with_removed(&[1, 1], &[], 1), vec![0, 0]);
    }

    #[test]
    fn fourth_node_moves_about_a_quarter_and_only_to_itself() {
        let extents = 8192;
        let n = nodes(4);
        let before = assign(extents, &cands(&n[..3], |_| 1 << 30));
        let after = assign(extents, &cands(&n, |_| 1 << 30));
        let mut moved = 0u64;
        for (b, a) in before.iter().zip(&after) {
            if b != a {
                moved += 1;
                assert_eq!(*a, 4, "an extent moved between old nodes");
            }
        }
        let frac = moved as f64 / extents as f64;
        assert!((0.22..=0.28).contains(&frac), "moved fraction {frac}");
    }

    #[test]
    fn leaving_node_moves_only_its_extents() {
        let extents = 4096;
        let n = nodes(4);
        let before = assign(extents, &cands(&n, |_| 1));
        let after = assign(extents, &cands(&n[..3], |_| 1));
        for (b, a) in before.iter().zip(&after) {
            if *b != 4 {
                assert_eq!(b, a);
            }
        }
    }

    #[test]
    fn shares_follow_weights() {
        let extents = 20_000u64;
        let n = nodes(3);
        let owners = assign(extents, &cands(&n, u64::from));
        for i in 1..=3u32 {
            let got = owners.iter().filter(|&&o| o == i).count() as f64 / extents as f64;
            let want = f64::from(i) / 6.0;
            assert!(
                (got - want).abs() / want < 0.05,
                "node {i}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn order_of_candidates_does_not_matter() {
        let n = nodes(5);
        let mut c = cands(&n, |i| u64::from(i) * 7);
        let a = assign(1000, &c);
        c.reverse();
        assert_eq!(a, assign(1000, &c));
    }

    #[test]
    fn incremental_join_and_leave_match_a_full_count() {
        let n = nodes(9);
        for k in 1..9 {
            let w = |i: u32| u64::from(i % 3 + 1) << 20;
            let before = assign(3000, &cands(&n[..k], w));
            let after = assign(3000, &cands(&n[..=k], w));
            assert_eq!(
                with_added(&before, &cands(&n[..k], w), cands(&n, w)[k]),
                after
            );
            assert_eq!(
                with_removed(&after, &cands(&n[..k], w), (k + 1) as u32),
                before
            );
        }
    }

    /// The lowest winning score of `owners`, counted in full.
    fn lowest_winner(owners: &[u32], c: &[Candidate<'_>]) -> f64 {
        let seeds = seeded(c);
        (0..owners.len() as u64)
            .map(|e| best_scored(&seeds, e).1)
            .fold(f64::INFINITY, f64::min)
    }

    /// Whether a `u` just under the threshold `exp(-w / F)` less the margin
    /// gives a score strictly under `F`, over many weights, floors and `u`s
    /// a few units in the last place from the threshold (with `margin` 0
    /// some give `F` itself or more).
    fn skips_are_below_the_floor(margin: f64) -> bool {
        let mut z = 7u64;
        let mut next = || {
            z = splitmix64(z);
            z
        };
        for _ in 0..200_000 {
            #[allow(clippy::cast_precision_loss)]
            let w = (next() >> (next() % 64)).max(1) as f64;
            // Floors from w / 700 (threshold near the underflow) to 10^6 w.
            let f = w * (10f64).powf((next() % 10_000) as f64 / 10_000.0 * 8.85 - 2.85);
            let t = (-w / f).exp() * (1.0 - margin);
            let mut u = t;
            for _ in 0..(next() % 4) {
                u = u.next_down();
            }
            if u <= 0.0 || u >= 1.0 {
                continue;
            }
            if -w / u.ln() >= f {
                return false;
            }
        }
        true
    }

    #[test]
    fn a_skipped_score_is_below_the_floor() {
        assert!(skips_are_below_the_floor(FLOOR_MARGIN));
        assert!(!skips_are_below_the_floor(0.0), "the check cannot fail");
    }

    #[test]
    fn floored_joins_and_leaves_match_a_full_count_and_skip_most_extents() {
        // Equal weights, weights 1:100 (the newcomer the heavy one or the
        // light one) and weights near u64::MAX's float range.
        type Weight = fn(u32) -> u64;
        let weights: [(&str, Weight); 4] = [
            ("equal", |_| 1 << 30),
            ("heavy newcomers", |i| if i % 4 == 0 { 100 } else { 1 }),
            ("light newcomers", |i| if i % 4 == 0 { 1 } else { 100 }),
            ("huge", |i| u64::MAX - u64::from(i)),
        ];
        let extents = 20_000;
        let n = nodes(40);
        for (name, w) in weights {
            let mut f = Floored::assign(extents, &cands(&n[..2], w));
            for k in 2..n.len() {
                let before = cands(&n[..k], w);
                f = f.with_added(&before, cands(&n, w)[k]);
                let all = cands(&n[..=k], w);
                assert_eq!(f.owners, assign(extents, &all), "{name}: join of {}", k + 1);
                let lowest = lowest_winner(&f.owners, &all);
                assert!(
                    f.floor <= lowest,
                    "{name}: floor {} above {lowest}",
                    f.floor
                );
                if k % 5 == 0 {
                    // A leave and the same node's return.
                    let gone = (k / 2 + 1) as u32;
                    let rest: Vec<_> = all.iter().copied().filter(|c| c.index != gone).collect();
                    f = f.with_removed(&rest, gone);
                    assert_eq!(f.owners, assign(extents, &rest), "{name}: leave of {gone}");
                    assert!(f.floor <= lowest_winner(&f.owners, &rest), "{name}: leave");
                    let back = all.iter().copied().find(|c| c.index == gone).unwrap();
                    f = f.with_added(&rest, back);
                    assert_eq!(f.owners, assign(extents, &all), "{name}: return of {gone}");
                }
            }
            // The floor is a real one, not -inf: later joins skip extents.
            assert!(f.floor > 0.0, "{name}: floor {}", f.floor);
        }
        // How much a 40th equal candidate's join skips: the threshold is
        // the `u` it needs to match the lowest of 20,000 winners among 39,
        // which most of its `u`s are below.
        let f = Floored::assign(extents, &cands(&n[..39], |_| 1));
        let threshold = (-1.0 / f.floor).exp() * (1.0 - FLOOR_MARGIN);
        let seed = fnv1a(n[39].1.as_bytes());
        let skipped = (0..extents).filter(|&e| unit(seed, e) < threshold).count();
        assert!(
            skipped as f64 > 0.5 * extents as f64,
            "only {skipped} of {extents} skipped"
        );
    }
}
