//! The seed corpus: every target's seeds, made by the real encoders
//! (`pagewire_fuzz::seeds`), are accepted by the decoders they feed, and the
//! checked-in corpus holds them. `PAGEWIRE_WRITE_SEEDS=1` (re)writes
//! `fuzz/corpus/<target>/seed-*`:
//!
//! ```sh
//! PAGEWIRE_WRITE_SEEDS=1 CARGO_TARGET_DIR=target cargo test --manifest-path fuzz/Cargo.toml --test seeds
//! ```

use std::path::PathBuf;

use pagewire_fuzz::seeds::{self, Seed};
use pagewire_node::layout::Superblock;
use pagewire_proto::map::MapApplier;
use pagewire_proto::v1::OwnershipMap;
use prost::Message;

fn corpus(target: &str, seeds: &[Seed]) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    let write = std::env::var_os("PAGEWIRE_WRITE_SEEDS").is_some();
    if write {
        std::fs::create_dir_all(&dir).unwrap();
    }
    for (name, bytes) in seeds {
        assert!(!bytes.is_empty(), "{target}/{name} is empty");
        let path = dir.join(format!("seed-{name}"));
        if write {
            std::fs::write(&path, bytes).unwrap();
        } else {
            assert!(
                path.exists(),
                "{} missing: regenerate the seeds",
                path.display()
            );
        }
    }
}

#[test]
fn region_seeds_are_real_regions() {
    let regions = seeds::regions();
    for (name, bytes) in &regions {
        let sb = Superblock::decode(bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(sb.layout.len, bytes.len(), "{name}");
        assert_eq!(sb.epoch, pagewire_fuzz::EPOCH);
    }
    corpus("layout", &regions);
    corpus("remote_read", &regions);
}

#[test]
fn handshake_seeds_are_a_recorded_exchange() {
    let h = seeds::handshakes();
    assert_eq!(h.len(), 2);
    // The responder sends magic, nonce and MAC; the client hello and MAC.
    assert_eq!(h[0].1.len(), 1 + 8 + 16 + 32 + 1);
    assert_eq!(h[1].1.len(), 1 + 8 + 16 + 32);
    corpus("handshake", &h);
}

#[test]
fn tcp_seeds_are_real_requests_and_answers() {
    let (requests, responses) = seeds::tcp();
    assert_eq!(
        requests[0].1.len(),
        seeds::READS.len() * pagewire_rdma::tcp::REQUEST_LEN
    );
    let ok = &responses[0].1;
    let want: usize = seeds::READS
        .iter()
        .map(|&(_, l)| pagewire_rdma::tcp::RESPONSE_HEADER_LEN + l)
        .sum();
    assert_eq!(ok.len(), want, "every READ answered with its bytes");
    let errors = &responses[1].1;
    assert!(errors.len() < want, "the bad requests got errors");
    corpus("tcp_requests", &requests);
    corpus("tcp_responses", &responses);
    corpus("descriptor", &seeds::descriptors());
}

#[test]
fn compact_map_seeds_expand() {
    let maps = seeds::compact_maps();
    for (name, bytes) in &maps {
        let mut f = MapApplier::new();
        let mut buf = &bytes[..];
        while !buf.is_empty() {
            let m = OwnershipMap::decode_length_delimited(&mut buf).unwrap();
            f.apply(m).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
    corpus("compact_map", &maps);
}

#[test]
fn config_seeds_validate() {
    let node = seeds::node_configs();
    // The example leaves `backing_file` empty, which the daemon requires.
    let e = pagewire_node::check_config_text(std::str::from_utf8(&node[0].1).unwrap()).unwrap_err();
    assert!(e.contains("backing_file"), "{e}");
    pagewire_node::check_config_text(std::str::from_utf8(&node[1].1).unwrap()).unwrap();
    corpus("node_config", &node);
    let coord = seeds::coordinator_configs();
    let c: pagewire_coordinator::Config =
        toml::from_str(std::str::from_utf8(&coord[0].1).unwrap()).unwrap();
    c.validate().unwrap();
    corpus("coordinator_config", &coord);
}
