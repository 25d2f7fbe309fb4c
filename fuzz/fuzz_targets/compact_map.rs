//! The map stream a node or client follows (`WatchMap`): the input is a
//! sequence of length-delimited `OwnershipMap` messages, each decoded with
//! prost and applied to one `MapFollower` (compact maps, deltas on them,
//! expanded maps). Whatever the follower accepts must equal what a fresh
//! expander computes from scratch for the map it now holds (the follower's
//! owner arrays are derived incrementally from the ones it cached).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagewire_proto::map::{Expander, MapFollower};
use pagewire_proto::v1::OwnershipMap;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    // The raw bytes as one message too (GetMap's answer).
    let _ = OwnershipMap::decode(data);
    let mut follower = MapFollower::new();
    let mut buf = data;
    for _ in 0..8 {
        let Ok(msg) = OwnershipMap::decode_length_delimited(&mut buf) else {
            break;
        };
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
