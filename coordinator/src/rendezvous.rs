//! Weighted rendezvous (highest random weight) hashing of extents to nodes.
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
//! The hash is fixed here (FNV-1a over the node id, then SplitMix64 mixing)
//! so that the map is the same on every build and architecture.

/// A node that may own extents.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Candidate<'a> {
    pub(crate) index: u32,
    pub(crate) node_id: &'a str,
    /// Relative weight (the node's capacity); must be > 0.
    pub(crate) weight: u64,
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Score of `node_seed` (a hash of the node id) for `extent`.
fn score(node_seed: u64, extent: u64, weight: u64) -> f64 {
    let h = splitmix64(node_seed ^ splitmix64(extent));
    // 53 random bits, shifted into (0, 1): never 0 nor 1, so ln(u) < 0.
    #[allow(clippy::cast_precision_loss)]
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    #[allow(clippy::cast_precision_loss)]
    let w = weight as f64;
    -w / u.ln()
}

/// Owner (node index) of each of `extent_count` extents; 0 for every extent
/// when there is no candidate.
pub(crate) fn assign(extent_count: u64, candidates: &[Candidate<'_>]) -> Vec<u32> {
    let seeds: Vec<(u32, u64, u64)> = candidates
        .iter()
        .filter(|c| c.weight > 0)
        .map(|c| (c.index, fnv1a(c.node_id.as_bytes()), c.weight))
        .collect();
    (0..extent_count)
        .map(|extent| {
            let mut best = (0u32, f64::NEG_INFINITY);
            for &(index, seed, weight) in &seeds {
                let s = score(seed, extent, weight);
                // Ties (practically never) go to the lower index, so the
                // result does not depend on the order of the candidates.
                if s > best.1 || (s == best.1 && index < best.0) {
                    best = (index, s);
                }
            }
            best.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
