//! The map stream a node or client follows (`WatchMap`): the input is a
//! sequence of length-delimited `OwnershipMap` messages, each decoded with
//! prost and applied to one `MapApplier` (compact maps, deltas on them,
//! expanded maps). Whatever the follower accepts must equal what a fresh
//! expander computes from scratch for the map it now holds (the follower's
//! owner arrays are derived incrementally from the ones it cached).
//!
//! Expanding costs O(extents × candidates) by design (a map may name up to
//! `MAX_EXTENTS` = 16 M extents; the coordinator is trusted to send maps it
//! can afford to expand), and this unoptimised, instrumented build scores
//! about a million candidates a second. So the harness stops at the first
//! message whose expansion would score more than `WORK_BUDGET` candidates
//! over the whole input: a valid map of 2 M extents otherwise took 12 s and
//! tripped libFuzzer's timeout (`corpus/compact_map/regression-2m-extents`)
//! while testing nothing a map of a few thousand extents does not. The
//! `MAX_EXTENTS` refusal itself is a unit test in `proto/src/map.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagewire_proto::map::{apply_delta, extent_count, resolve, Expander, MapApplier};
use pagewire_proto::v1::{CompactMap, OwnershipMap};
use prost::Message;

/// Candidate scores the whole input may cost (about 2 s here, counting the
/// fresh expansion of the check too).
const WORK_BUDGET: u64 = 1 << 20;

/// An upper bound on the candidate scores expanding `full` computes from
/// scratch: every set it names, in full, for every extent, plus one step
/// per extent for each layer and `dropped_by` entry. `None` when the map is
/// malformed in a way the expander refuses before it scores anything.
fn work(full: &CompactMap) -> Option<u64> {
    let extents = extent_count(full.file_size, full.extent_size);
    let sets = resolve(full).ok()?;
    let scores: u64 = sets.values().map(|s| s.len() as u64 + 1).sum();
    let steps = (full.handoff.len()
        + full
            .releases
            .iter()
            .map(|g| g.layers.len() + g.dropped_by.len() + 1)
            .sum::<usize>()) as u64;
    Some(extents.saturating_mul(scores + steps + 1))
}

fuzz_target!(|data: &[u8]| {
    // The raw bytes as one message too (GetMap's answer).
    let _ = OwnershipMap::decode(data);
    let mut follower = MapApplier::new();
    let mut spent = 0u64;
    let mut buf = data;
    for _ in 0..8 {
        let Ok(msg) = OwnershipMap::decode_length_delimited(&mut buf) else {
            break;
        };
        if let Some(c) = &msg.compact {
            let full = match follower.current() {
                Some(base) if c.base_epoch != 0 => apply_delta(base, c).ok(),
                _ => Some(c.clone()),
            };
            // Twice: the follower's expansion and the fresh one below.
            let cost = full.as_ref().and_then(work).unwrap_or(0).saturating_mul(2);
            spent = spent.saturating_add(cost);
            if spent > WORK_BUDGET {
                break;
            }
        }
        let compact = msg.compact.is_some();
        let Ok(expanded) = follower.apply(msg) else {
            continue;
        };
        if compact {
            let held = follower.current().expect("a compact map is held").clone();
            assert_eq!(held.base_epoch, 0, "the follower holds full maps only");
            let fresh = Expander::new(1).expand(&held).expect("it expanded once");
            assert_eq!(expanded, fresh, "incremental and full expansion differ");
        } else {
            assert!(follower.current().is_none());
        }
    }
});
