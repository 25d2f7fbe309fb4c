//! One-sided remote reads across processes over real RDMA (`verbs`): an
//! owner process runs a page cache in anonymous memory, registered in place
//! for remote READ with a `VerbsOwner`, under concurrent faults, CLOCK
//! eviction and copy-on-write writes; reader threads (this test's) find and
//! read its pages through their own queue pairs, the owner's CPU taking no
//! part. Every byte of every accepted read is verified against the
//! self-describing file, and no read may be older than a write the owner
//! acknowledged before the read began. The shm and tcp form of this test is
//! `tests/remote.rs`.
//!
//! Needs an RDMA device (RoCE, or soft-RoCE), named by
//! `PAGEWIRE_RDMA_DEVICE` ([`pagewire_rdma::verbs::DEVICE_ENV`]; the first
//! device when unset), so it is ignored by default:
//! `rdma/scripts/softroce-test.sh` runs it inside a soft-RoCE VM with
//! `--ignored`. Bounded by `PAGEWIRE_REMOTE_SECS` (default 2 s of reading);
//! it prints what it covered. The owner is this same test binary,
//! re-executed with `PAGEWIRE_REMOTE_VERBS_OWNER` set (the
//! `verbs_owner_process` test, which does nothing otherwise).

#![cfg(feature = "verbs")]

#[path = "common/remote.rs"]
mod common;

use common::{
    FRAMES, OwnerProcess, PAGES, PS, Tally, acked_words, create_acked, open_acked, read_loop,
    run_owner, secs, wait_for,
};
use pagewire_client::one_sided::{ReaderConfig, RemoteReader};
use pagewire_node::index::Lockless;
use pagewire_node::{CacheConfig, PageCache, pattern};
use pagewire_rdma::verbs::{DEVICE_ENV, VerbsConfig, VerbsConnection, VerbsOwner};
use pagewire_rdma::{LocalRegion, MemoryOwner, RegionDescriptor, SharedConnection};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

const READERS: u64 = 2;
/// Between two CLOCK sweeps of 4 frames in the owner: under an emulated CPU
/// faults come in slowly, and a spinning evictor would keep the cache empty
/// (every remote read absent).
const EVICT_PAUSE: Duration = Duration::from_millis(50);
const OWNER_ENV: &str = "PAGEWIRE_REMOTE_VERBS_OWNER";
const TOKEN: &[u8] = b"remote-verbs-test-token";
/// Any nonzero value: what matters is that the superblock and every
/// descriptor carry the same one.
const EPOCH: u64 = 0x7077_7665_7262_7301;

/// Both sides' settings. Soft-RoCE under an emulated CPU (TCG) is slow and
/// its queue pairs share two virtual cores with the owner's busy threads:
/// a longer ACK timeout and operation timeout than the defaults, so a slow
/// round trip is not taken for a lost peer. Reads are at most one page.
fn config() -> VerbsConfig {
    let mut c = VerbsConfig::new(TOKEN);
    c.max_outstanding = 8;
    c.max_read_len = PS;
    c.ack_timeout = 17;
    c.retry_count = 7;
    c.op_timeout = Duration::from_secs(30);
    c
}

/// The acknowledged-write table the owner shares with readers: one u64 per
/// page, the highest write generation (pattern bytes 8..16) acknowledged.
#[test]
#[ignore = "the owner half of remote_reads_over_verbs; run by it"]
fn verbs_owner_process() {
    let Ok(dir) = std::env::var(OWNER_ENV) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let cache: Arc<PageCache> = Arc::new(
        PageCache::<Lockless>::open_with(
            &dir.join("data"),
            CacheConfig {
                frames: FRAMES,
                readahead_max: 8,
                evict_batch: 4,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    cache.set_epoch(EPOCH);
    let mut vc = config();
    vc.epoch = Some(EPOCH);
    let owner = VerbsOwner::bind("127.0.0.1:0", vc).expect("open the RDMA device");
    assert_eq!(owner.epoch(), EPOCH);
    let r = cache.region();
    let keep: MemoryOwner = cache.clone();
    // SAFETY:
    // * the region is the cache's anonymous mapping, unmapped only when the
    //   cache drops, which `keep` (a clone of the cache) prevents while the
    //   verbs region lives; the cache never remaps it;
    // * the cache writes it only with atomic stores, the kernel (`preadv`
    //   into frames) or inline assembly, and hands out no `&mut` into it.
    let region =
        unsafe { owner.register_external(NonNull::new(r.addr.cast_mut()).unwrap(), r.len, keep) }
            .expect("register the cache's region");
    let desc = region.descriptor();
    assert_eq!(desc.epoch, EPOCH);
    let acked_map = create_acked(&dir);
    // The descriptor, then the control address, renamed into place last:
    // its appearance says everything is ready.
    std::fs::write(dir.join("desc"), desc.to_bytes()).unwrap();
    std::fs::write(dir.join("verbs.tmp"), owner.local_addr().to_string()).unwrap();
    std::fs::rename(dir.join("verbs.tmp"), dir.join("verbs")).unwrap();
    println!(
        "{}",
        run_owner(&cache, acked_words(&acked_map), &dir, Some(EVICT_PAUSE))
    );
    // Deregister (the NIC stops reading the cache) before the cache can go.
    drop(region);
    drop(owner);
    drop(cache);
}

#[test]
#[ignore = "needs an RDMA device: run by rdma/scripts/softroce-test.sh"]
fn remote_reads_over_verbs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    pattern::generate_file(&d.join("data"), PAGES * PS as u64, PS).unwrap();
    let owner = OwnerProcess::start("verbs_owner_process", OWNER_ENV, d);
    wait_for(&d.join("verbs"), Duration::from_secs(120));
    let addr = std::fs::read_to_string(d.join("verbs")).unwrap();
    let desc = RegionDescriptor::from_bytes(&std::fs::read(d.join("desc")).unwrap()).unwrap();
    assert_eq!(desc.epoch, EPOCH, "the owner's one epoch");
    let acked_map = open_acked(d);
    let acked = acked_words(&acked_map);
    let tally = Tally::default();
    // Connect every reader first (queue pairs are slow to set up under
    // emulation), then read for `secs()`. Half the threads have a queue
    // pair each; the other half share one, as the threads of a reader
    // process do (`SharedConnection`, what `pagewire_client::cluster` uses).
    let own: Vec<_> = (0..READERS)
        .map(|_| {
            let conn =
                VerbsConnection::connect(addr.as_str(), config()).expect("connect over verbs");
            RemoteReader::connect(conn, desc, ReaderConfig::default()).unwrap()
        })
        .collect();
    let shared = SharedConnection::new(
        VerbsConnection::connect(addr.as_str(), config()).expect("connect over verbs"),
    );
    let handles: Vec<_> = (0..READERS)
        .map(|_| RemoteReader::connect(shared.handle(), desc, ReaderConfig::default()).unwrap())
        .collect();
    let deadline = Instant::now() + Duration::from_secs_f64(secs());
    std::thread::scope(|s| {
        let tally = &tally;
        // Reads are at most one page here (`config`): no runs.
        for (i, reader) in own.into_iter().enumerate() {
            s.spawn(move || read_loop(reader, 20 + i as u64, deadline, acked, tally, false));
        }
        for (i, reader) in handles.into_iter().enumerate() {
            s.spawn(move || read_loop(reader, 40 + i as u64, deadline, acked, tally, false));
        }
    });
    assert!(!shared.is_broken(), "the shared queue pair broke");
    let owner_line = owner.finish();
    println!(
        "remote over verbs ({}), {:.1} s, {READERS} reader threads with a queue pair each and {READERS} sharing one: {}; {owner_line}",
        std::env::var(DEVICE_ENV).unwrap_or_else(|_| "first device".to_owned()),
        secs(),
        tally.line()
    );
    tally.check();
}
