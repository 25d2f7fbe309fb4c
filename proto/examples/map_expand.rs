//! Times what a watcher does when a member joins a large cluster: the
//! expansion of the joined compact map by an expander that holds the
//! settled map's owners (so the owner array is derived incrementally).
//!
//! `cargo run --release -p pagewire-proto --example map_expand -- 1000000 1000 5`
//! (extents, members, joins). Prints the median and each time in ms.

use std::time::Instant;

use pagewire_proto::map::Expander;
use pagewire_proto::v1::{CandidateSet, CompactMap, Layer, MapNode, NodeState};

fn node(index: u32) -> MapNode {
    MapNode {
        index,
        node_id: format!("node-{index}"),
        state: NodeState::Alive.into(),
        weight: 2 << 30,
        ..Default::default()
    }
}

fn main() {
    let arg = |i: usize, d: u64| {
        std::env::args()
            .nth(i)
            .map_or(d, |s| s.parse().expect("a number"))
    };
    let (extents, members, joins) = (arg(1, 1_000_000), arg(2, 1000) as u32, arg(3, 5));
    let base = CompactMap {
        epoch: 1,
        file_size: extents * 4096,
        extent_size: 4096,
        page_size: 4096,
        nodes: (1..=members).map(node).collect(),
        sets: vec![CandidateSet {
            id: 1,
            ..Default::default()
        }],
        owner_set: 1,
        ..Default::default()
    };
    let mut e = Expander::new(12);
    let t = Instant::now();
    e.expand(&base).expect("settled map");
    eprintln!("settled map: {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    let mut times = Vec::new();
    for j in 1..=joins as u32 {
        // Newcomer `members + j` joins the settled cluster: the owner set
        // gains it, and the handoff layer is the settled set.
        let newcomer = members + j;
        let mut joined = base.clone();
        joined.epoch = 1 + u64::from(j);
        joined.nodes.push(node(newcomer));
        joined.sets = vec![
            CandidateSet {
                id: 1,
                remove: vec![newcomer],
                add: vec![],
            },
            CandidateSet {
                id: 2,
                ..Default::default()
            },
        ];
        joined.owner_set = 2;
        joined.handoff = vec![Layer {
            set: 1,
            ..Default::default()
        }];
        let t = Instant::now();
        let m = e.expand(&joined).expect("joined map");
        times.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(m.owner.len() as u64, extents);
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "extents {extents} members {members}: join expansion median {:.1} ms ({})",
        sorted[sorted.len() / 2],
        times
            .iter()
            .map(|t| format!("{t:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
}
