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
    let h = splitmix64(node_seed ^ splitmix64(extent));
    // 53 random bits, shifted into (0, 1): never 0 nor 1, so ln(u) < 0.
    #[allow(clippy::cast_precision_loss)]
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    #[allow(clippy::cast_precision_loss)]
    let w = weight as f64;
    -w / u.ln()
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

/// Owner (node index) of `extent` among `candidates`; 0 when there is none.
pub fn owner_of(extent: u64, candidates: &[Candidate<'_>]) -> u32 {
    best_of(&seeded(candidates), extent)
}

/// Owner (node index) of each of `extent_count` extents; 0 for every extent
/// when there is no candidate.
pub fn assign(extent_count: u64, candidates: &[Candidate<'_>]) -> Vec<u32> {
    let seeds = seeded(candidates);
    (0..extent_count).map(|e| best_of(&seeds, e)).collect()
}

/// The owners after `added` joins a candidate set whose owners were
/// `owners` (`added.index` must not be in that set). O(extents): only the
/// newcomer's score and the current owner's are compared.
pub fn with_added(owners: &[u32], before: &[Candidate<'_>], added: Candidate<'_>) -> Vec<u32> {
    let seeds = seeded(before);
    let by_index = NodeTable::new(None, seeds.iter().map(|s| (s.index, Some(*s))));
    let mut all = seeds.clone();
    all.extend(seeded(&[added]));
    let Some(new) = all.last().copied().filter(|n| n.index == added.index) else {
        // A weight of 0 never wins: nothing moves.
        return owners.to_vec();
    };
    owners
        .iter()
        .enumerate()
        .map(|(e, &cur)| {
            let e = e as u64;
            match by_index.get(cur) {
                Some(c) => {
                    let s_new = score(new.seed, e, new.weight);
                    if beats(new.index, s_new, (cur, score(c.seed, e, c.weight))) {
                        new.index
                    } else {
                        cur
                    }
                }
                // No owner before (no candidate), or one that is not in
                // `before`: count it afresh.
                None => best_of(&all, e),
            }
        })
        .collect()
}

/// The owners after the candidate `removed` leaves; `after` is the set
/// without it and `owners` the owners with it. O(extents) in expectation:
/// only the leaver's extents are counted afresh.
pub fn with_removed(owners: &[u32], after: &[Candidate<'_>], removed: u32) -> Vec<u32> {
    let seeds = seeded(after);
    owners
        .iter()
        .enumerate()
        .map(|(e, &cur)| {
            if cur == removed {
                best_of(&seeds, e as u64)
            } else {
                cur
            }
        })
        .collect()
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
}
