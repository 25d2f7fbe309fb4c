//! One-sided remote reads across processes: an owner process runs a page
//! cache whose region lives in `shm` memory (and is served in place by a
//! `tcp` responder in chaos mode), under concurrent faults, CLOCK eviction
//! and copy-on-write writes; reader threads in this process find and read
//! its pages with READs alone, in chaos mode (cache lines copied in random
//! order, pauses mid-copy), single pages and runs of 16. Every byte of every
//! accepted read is verified against the self-describing file, and no read
//! may be older than a write the owner acknowledged before the read began.
//!
//! Bounded by `PAGEWIRE_REMOTE_SECS` (default 2 s); it prints what it
//! covered. The owner is this same test binary, re-executed with
//! `PAGEWIRE_REMOTE_OWNER` set (the `owner_process` test, ignored otherwise).
//! The verbs form of this test is `tests/remote_verbs.rs`.

#[path = "common/remote.rs"]
mod common;

use common::{
    FRAMES, OwnerProcess, PAGES, PS, Tally, acked_words, create_acked, open_acked, read_loop,
    run_owner, secs, wait_for,
};
use pagewire_client::one_sided::{Outcome, ReaderConfig, RemoteReader};
use pagewire_node::index::Lockless;
use pagewire_node::{CacheConfig, PageCache, pattern};
use pagewire_rdma::shm::{ShmConfig, ShmConnection, ShmOwner};
use pagewire_rdma::tcp::{ConnectionConfig, OwnerConfig, TcpConnection, TcpOwner};
use pagewire_rdma::{Chaos, LocalRegion, RegionDescriptor};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

const OWNER_ENV: &str = "PAGEWIRE_REMOTE_OWNER";
const TOKEN: &str = "remote-test-token";

/// The owner: runs until `dir/stop` appears, then prints its tally.
#[test]
#[ignore = "the owner half of remote_reads_across_processes; run by it"]
fn owner_process() {
    let Ok(dir) = std::env::var(OWNER_ENV) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let owner = ShmOwner::create_in(&dir, "owner").unwrap();
    let region = owner
        .register(PageCache::<Lockless>::region_len(PS, FRAMES))
        .unwrap();
    let desc = region.descriptor();
    let cache: Arc<PageCache> = Arc::new(
        PageCache::<Lockless>::open_on(
            &dir.join("data"),
            CacheConfig {
                frames: FRAMES,
                readahead_max: 8,
                evict_batch: 4,
                ..Default::default()
            },
            Some(Box::new(region)),
        )
        .unwrap(),
    );
    cache.set_epoch(desc.epoch);
    // The tcp software NIC serves the same memory in place, in chaos mode
    // (cache lines of each READ copied in random order, half of the READs
    // paused halfway).
    let mut rc = OwnerConfig::new(TOKEN.as_bytes().to_vec());
    rc.epoch = Some(desc.epoch);
    rc.chaos = Some(Chaos {
        pause: Some(Duration::from_micros(20)),
    });
    let responder = TcpOwner::bind("127.0.0.1:0", rc).unwrap();
    let r = cache.region();
    let keep: pagewire_rdma::MemoryOwner = cache.clone();
    // SAFETY: the region stays mapped while `keep` (the cache) lives, and the
    // cache writes it only with atomic stores, the kernel or inline assembly.
    let tcp_region = unsafe {
        responder.register_external(
            std::ptr::NonNull::new(r.addr.cast_mut()).unwrap(),
            r.len,
            keep,
        )
    }
    .unwrap();
    let acked_map = create_acked(&dir);
    std::fs::write(dir.join("desc"), desc.to_bytes()).unwrap();
    std::fs::write(dir.join("tcp.desc"), tcp_region.descriptor().to_bytes()).unwrap();
    // Renamed into place last: its appearance says everything is ready.
    std::fs::write(dir.join("tcp.tmp"), responder.local_addr().to_string()).unwrap();
    std::fs::rename(dir.join("tcp.tmp"), dir.join("tcp")).unwrap();
    println!("{}", run_owner(&cache, acked_words(&acked_map), &dir, None));
    drop(tcp_region);
    drop(responder);
    drop(cache);
    drop(owner);
}

#[test]
fn remote_reads_across_processes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    pattern::generate_file(&d.join("data"), PAGES * PS as u64, PS).unwrap();
    let owner = OwnerProcess::start("owner_process", OWNER_ENV, d);
    wait_for(&d.join("tcp"), Duration::from_secs(60));
    let read_desc =
        |f: &str| RegionDescriptor::from_bytes(&std::fs::read(d.join(f)).unwrap()).unwrap();
    let (desc, tcp_desc) = (read_desc("desc"), read_desc("tcp.desc"));
    assert_eq!(tcp_desc.epoch, desc.epoch, "one epoch for both transports");
    let tcp_addr = std::fs::read_to_string(d.join("tcp")).unwrap();
    let acked_map = open_acked(d);
    let acked = acked_words(&acked_map);
    let tally = Tally::default();
    let deadline = Instant::now() + Duration::from_secs_f64(secs());
    std::thread::scope(|s| {
        // shm readers: plain, chaos, chaos with pauses (the reader copies).
        for (seed, chaos) in [
            (10, None),
            (11, Some(Chaos { pause: None })),
            (
                12,
                Some(Chaos {
                    pause: Some(Duration::from_micros(50)),
                }),
            ),
        ] {
            let tally = &tally;
            s.spawn(move || {
                let config = ShmConfig {
                    dir: Some(d.to_owned()),
                    chaos,
                };
                let conn = ShmConnection::connect("owner", config).unwrap();
                let reader = RemoteReader::connect(conn, desc, ReaderConfig::default()).unwrap();
                read_loop(reader, seed, deadline, acked, tally, true);
            });
        }
        // A tcp reader: the owner's responder copies in chaos mode.
        let (tally, tcp_addr) = (&tally, tcp_addr.as_str());
        s.spawn(move || {
            let config = ConnectionConfig::new(TOKEN.as_bytes().to_vec());
            let conn = TcpConnection::connect(tcp_addr, config).unwrap();
            let reader = RemoteReader::connect(conn, tcp_desc, ReaderConfig::default()).unwrap();
            read_loop(reader, 13, deadline, acked, tally, true);
        });
    });
    let owner_line = owner.finish();
    println!(
        "remote, {:.1} s, 4 reader threads (shm plain, shm chaos, shm chaos+pause, tcp with a \
         chaos responder): {}; {owner_line}",
        secs(),
        tally.line()
    );
    tally.check();
}

/// An owner in this process: a cache of `frames` frames (no readahead) over
/// `d/data`, its region in the shm memory `name` under `d`.
fn in_process_owner(
    d: &std::path::Path,
    name: &str,
    frames: usize,
) -> (ShmOwner, PageCache<Lockless>, RegionDescriptor) {
    let owner = ShmOwner::create_in(d, name).unwrap();
    let region = owner
        .register(PageCache::<Lockless>::region_len(PS, frames))
        .unwrap();
    let desc = region.descriptor();
    let cache = PageCache::<Lockless>::open_on(
        &d.join("data"),
        CacheConfig {
            frames,
            readahead_max: 0,
            ..Default::default()
        },
        Some(Box::new(region)),
    )
    .unwrap();
    cache.set_epoch(desc.epoch);
    (owner, cache, desc)
}

/// A plain (no chaos) shm connection to [`in_process_owner`]'s `name`.
fn shm_connect(d: &std::path::Path, name: &str) -> ShmConnection {
    let config = ShmConfig {
        dir: Some(d.to_owned()),
        chaos: None,
    };
    ShmConnection::connect(name, config).unwrap()
}

/// A reader's index cache stays bounded by the owner's frames, however many
/// distinct pages it reads: it once kept every page it had ever read (2,048
/// entries here, for an owner of 64 frames), so a client streaming a large
/// file grew without bound. Entries that replaced others still read warm,
/// and every byte read is verified.
#[test]
fn a_readers_index_cache_stays_bounded_by_the_owners_frames() {
    const SMALL: usize = 64;
    const READ: u64 = 2048;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    pattern::generate_file(&d.join("data"), READ * PS as u64, PS).unwrap();
    let (_owner, cache, desc) = in_process_owner(d, "bounded", SMALL);
    let conn = shm_connect(d, "bounded");
    let mut reader = RemoteReader::connect(conn, desc, ReaderConfig::default()).unwrap();
    let mut buf = vec![0u8; PS];
    let mut hits = 0;
    for page in 0..READ {
        drop(cache.get(page).unwrap());
        if let Outcome::Hit { .. } = reader.read_page(page, &mut buf).unwrap() {
            pattern::verify(page, &buf).unwrap();
            hits += 1;
        }
    }
    assert!(hits > READ / 2, "only {hits} of {READ} reads hit");
    let (held, capacity) = reader.index_cache();
    assert!(
        held <= capacity && capacity <= SMALL,
        "the index cache holds {held} pages (capacity {capacity}) for an owner of {SMALL} frames"
    );
    // The last page read is still known: its next read is one round trip.
    let last = READ - 1;
    match reader.read_page(last, &mut buf).unwrap() {
        Outcome::Hit { round_trips, .. } => assert_eq!(round_trips, 1),
        o => panic!("page {last}, just read, is now {o:?}"),
    }
    pattern::verify(last, &buf).unwrap();
}

/// An `shm` reader validates a frame by the generation it READs before and
/// after the frame's header and bytes (its READs are ordered: a seqlock),
/// not by the frame's checksum; with `ordered_validation` off it validates
/// by checksum, as every `tcp` and `verbs` reader does. Shown with a frame
/// whose checksum word is made wrong while it stays published: the ordered
/// reader reads it (its bytes are the page's), the checksum reader never
/// accepts it. (That the ordered reader rejects a frame refilled under it
/// is `remote_reads_across_processes`, whose shm readers copy in chaos mode
/// against an owner that evicts, refills and writes.)
#[test]
fn an_shm_reader_validates_by_generation_brackets_not_checksums() {
    const SMALL: usize = 16;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    pattern::generate_file(&d.join("data"), SMALL as u64 * PS as u64, PS).unwrap();
    let (_owner, cache, desc) = in_process_owner(d, "brackets", SMALL);
    let reader = |ordered_validation: bool| {
        let conn = shm_connect(d, "brackets");
        assert!(pagewire_rdma::Connection::ordered_reads(&conn));
        let cfg = ReaderConfig {
            ordered_validation,
            ..ReaderConfig::default()
        };
        RemoteReader::connect(conn, desc, cfg).unwrap()
    };
    let page = 3;
    drop(cache.get(page).unwrap());
    let (frame, generation) = cache.location(page).unwrap();
    let mut buf = vec![0u8; PS];
    for ordered in [true, false] {
        match reader(ordered).read_page(page, &mut buf).unwrap() {
            Outcome::Hit { frame: f, .. } => assert_eq!(f, frame),
            o => panic!("an intact frame, ordered {ordered}: {o:?}"),
        }
        pattern::verify(page, &buf).unwrap();
    }
    // Make the frame's checksum word wrong; the frame stays published.
    let view = cache.region();
    let at = view.layout.header(frame as usize) + pagewire_node::layout::hdr::CHECKSUM;
    assert!(at + 8 <= view.len);
    // SAFETY: `at` is the 8-aligned checksum word of a frame header inside
    // the cache's region, which stays mapped while `cache` lives; the cache
    // and readers only ever access that word atomically.
    let word = unsafe { &*view.addr.add(at).cast::<std::sync::atomic::AtomicU64>() };
    word.fetch_xor(1, std::sync::atomic::Ordering::Relaxed);
    let mut ordered = reader(true);
    buf.fill(0);
    match ordered.read_page(page, &mut buf).unwrap() {
        Outcome::Hit {
            frame: f,
            generation: g,
            ..
        } => assert_eq!((f, g), (frame, generation)),
        o => panic!("the ordered reader, wrong checksum word: {o:?}"),
    }
    pattern::verify(page, &buf).unwrap();
    assert_eq!(ordered.stats().validation_failures, 0);
    let mut summed = reader(false);
    let o = summed.read_page(page, &mut buf).unwrap();
    assert!(
        !matches!(o, Outcome::Hit { .. }),
        "the checksum reader accepted a frame whose checksum is wrong: {o:?}"
    );
    assert!(summed.stats().validation_failures > 0);
}
