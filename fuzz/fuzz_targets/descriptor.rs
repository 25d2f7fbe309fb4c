//! The fixed byte form of a region descriptor, as it arrives in a protobuf
//! `bytes` field from the coordinator or another node.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagewire_rdma::RegionDescriptor;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = RegionDescriptor::from_bytes(data) {
        assert_eq!(&d.to_bytes()[..], data);
        assert!(d.addr.checked_add(d.len).is_some());
        assert!(d.contains(d.addr, d.len));
        let _ = d.contains(d.addr_at(d.len), 1);
    }
});
