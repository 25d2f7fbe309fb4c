//! One-sided remote reads across processes: an owner process runs a page
//! cache whose region lives in `shm` memory, under concurrent faults,
//! CLOCK eviction and copy-on-write writes; reader processes (this test's)
//! find and read its pages with READs alone, in chaos mode (cache lines
//! copied in random order, pauses mid-copy). Every byte of every accepted
//! read is verified against the self-describing file, and no read may be
//! older than a write the owner acknowledged before the read began.
//!
//! Bounded by `PAGEWIRE_REMOTE_SECS` (default 2 s); it prints what it
//! covered. The owner is this same test binary, re-executed with
//! `PAGEWIRE_REMOTE_OWNER` set (the `owner_process` test, ignored otherwise).

use memmap2::{Mmap, MmapMut};
use pagewire_node::index::Lockless;
use pagewire_node::remote::{Outcome, ReaderConfig, RemoteReader};
use pagewire_node::{CacheConfig, PageCache, pattern};
use pagewire_rdma::shm::{ShmConfig, ShmConnection, ShmOwner};
use pagewire_rdma::tcp::{ConnectionConfig, ResponderConfig, TcpConnection, TcpResponder};
use pagewire_rdma::{Chaos, LocalRegion, RegionDescriptor};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PS: usize = 4096;
const PAGES: u64 = 512;
const FRAMES: usize = 48;
const OWNER_ENV: &str = "PAGEWIRE_REMOTE_OWNER";
const TOKEN: &str = "remote-test-token";

fn secs() -> f64 {
    std::env::var("PAGEWIRE_REMOTE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0)
}

/// The acknowledged-write table the owner shares with readers: one u64 per
/// page, the highest write generation (pattern bytes 8..16) acknowledged.
fn acked_words(map: &[u8]) -> &[AtomicU64] {
    assert_eq!(map.len(), PAGES as usize * 8);
    assert_eq!(map.as_ptr() as usize % 8, 0);
    // SAFETY: the mapping is PAGES * 8 bytes, 8-aligned (page-aligned), lives
    // as long as the borrow, and every access to it is atomic.
    unsafe { std::slice::from_raw_parts(map.as_ptr().cast::<AtomicU64>(), PAGES as usize) }
}

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
    let mut rc = ResponderConfig::new(TOKEN.as_bytes().to_vec());
    rc.epoch = Some(desc.epoch);
    rc.chaos = Some(Chaos {
        pause: Some(Duration::from_micros(20)),
    });
    let responder = TcpResponder::bind("127.0.0.1:0", rc).unwrap();
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
    let tcp_desc = tcp_region.descriptor().to_bytes();
    std::fs::write(dir.join("tcp.desc"), tcp_desc).unwrap();
    std::fs::write(dir.join("tcp.tmp"), responder.local_addr().to_string()).unwrap();
    std::fs::rename(dir.join("tcp.tmp"), dir.join("tcp")).unwrap();
    let acked_file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join("acked"))
        .unwrap();
    acked_file.set_len(PAGES * 8).unwrap();
    // SAFETY: our own fresh file; readers map it read-only and load atomically.
    let acked_map = unsafe { MmapMut::map_mut(&acked_file).unwrap() };
    let acked = acked_words(&acked_map);
    std::fs::write(dir.join("desc.tmp"), desc.to_bytes()).unwrap();
    std::fs::rename(dir.join("desc.tmp"), dir.join("desc")).unwrap();

    let stop = AtomicBool::new(false);
    let (writes, faults, evicted) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let wlock = Mutex::new(());
    std::thread::scope(|s| {
        // Faulting reader: keeps pages coming in (and frames being reused).
        s.spawn(|| {
            let mut rng = SmallRng::seed_from_u64(1);
            while !stop.load(Ordering::Relaxed) {
                // The readers' hot set half of the time, so it stays cached.
                let p = if rng.random_bool(0.5) {
                    rng.random_range(0..16)
                } else {
                    rng.random_range(0..PAGES)
                };
                let r = cache.get(p).unwrap();
                pattern::verify(p, &r).unwrap();
                faults.fetch_add(1, Ordering::Relaxed);
            }
        });
        // Evictor.
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                evicted.fetch_add(cache.reclaim(4) as u64, Ordering::Relaxed);
                std::thread::yield_now();
            }
        });
        // Writer: whole pages, pattern generation + 1, acknowledged in the
        // shared table only after `write` returned.
        s.spawn(|| {
            let mut rng = SmallRng::seed_from_u64(2);
            let mut buf = vec![0u8; PS];
            while !stop.load(Ordering::Relaxed) {
                let p = rng.random_range(0..PAGES);
                let _g = wlock.lock().unwrap();
                let cur = pattern::verify(p, &cache.get(p).unwrap()).unwrap();
                pattern::fill(p, cur + 1, &mut buf);
                cache.write(p, &buf).unwrap();
                acked[p as usize].store(cur + 1, Ordering::Release);
                writes.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        // Until the test says stop, or, should it have died, well after
        // its own deadline.
        let give_up = Instant::now() + Duration::from_secs_f64(secs() + 120.0);
        while !dir.join("stop").exists() && Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::Relaxed);
    });
    println!(
        "owner: {} faulting reads, {} writes, {} evictions",
        faults.into_inner(),
        writes.into_inner(),
        evicted.into_inner()
    );
    drop(tcp_region);
    drop(responder);
    drop(cache);
    drop(owner);
}

#[derive(Default)]
struct Tally {
    reads: AtomicU64,
    hits: AtomicU64,
    warm: AtomicU64,
    absent: AtomicU64,
    gave_up: AtomicU64,
    validation_failures: AtomicU64,
    torn: AtomicU64,
    retries: AtomicU64,
    round_trips: AtomicU64,
    fresh_after_ack: AtomicU64,
}

fn wait_for(path: &Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(t.elapsed() < Duration::from_secs(60), "owner never started");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One reader: random pages (half from a hot set), every hit verified and
/// checked against the acknowledged-write table read before it began.
fn read_loop<C: pagewire_rdma::Connection>(
    mut reader: RemoteReader<C>,
    seed: u64,
    deadline: Instant,
    acked: &[AtomicU64],
    tally: &Tally,
) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut buf = vec![0u8; PS];
    let mut run = vec![0u8; 16 * PS];
    while Instant::now() < deadline {
        // One read in eight is a batched run of 16 pages.
        if rng.random_ratio(1, 8) {
            let first = rng.random_range(0..PAGES - 16);
            let floors: Vec<u64> = (first..first + 16)
                .map(|p| acked[p as usize].load(Ordering::Acquire))
                .collect();
            tally.reads.fetch_add(16, Ordering::Relaxed);
            let outcomes = reader.read_run(first, 16, &mut run).unwrap();
            for (i, o) in outcomes.iter().enumerate() {
                let p = first + i as u64;
                match o {
                    Outcome::Hit { .. } => {
                        let g = pattern::verify(p, &run[i * PS..(i + 1) * PS])
                            .unwrap_or_else(|e| panic!("wrong bytes for page {p} in a run: {e:?}"));
                        assert!(
                            g >= floors[i],
                            "page {p} in a run: {g} < acknowledged {}",
                            floors[i]
                        );
                        tally.hits.fetch_add(1, Ordering::Relaxed);
                    }
                    Outcome::Absent => {
                        tally.absent.fetch_add(1, Ordering::Relaxed);
                    }
                    Outcome::GaveUp => {
                        tally.gave_up.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            continue;
        }
        let p = if rng.random_bool(0.5) {
            rng.random_range(0..16)
        } else {
            rng.random_range(0..PAGES)
        };
        let floor = acked[p as usize].load(Ordering::Acquire);
        tally.reads.fetch_add(1, Ordering::Relaxed);
        match reader.read_page(p, &mut buf).unwrap() {
            Outcome::Hit { round_trips, .. } => {
                let g = pattern::verify(p, &buf)
                    .unwrap_or_else(|e| panic!("wrong bytes for page {p}: {e:?}"));
                assert!(
                    g >= floor,
                    "page {p}: read generation {g}, but {floor} was acknowledged before the read"
                );
                if floor > 0 {
                    tally.fresh_after_ack.fetch_add(1, Ordering::Relaxed);
                }
                tally.hits.fetch_add(1, Ordering::Relaxed);
                if round_trips == 1 {
                    tally.warm.fetch_add(1, Ordering::Relaxed);
                }
            }
            Outcome::Absent => {
                tally.absent.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::GaveUp => {
                tally.gave_up.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    let st = reader.stats();
    tally
        .validation_failures
        .fetch_add(st.validation_failures, Ordering::Relaxed);
    tally.torn.fetch_add(st.torn_buckets, Ordering::Relaxed);
    tally.retries.fetch_add(st.retries, Ordering::Relaxed);
    tally
        .round_trips
        .fetch_add(st.round_trips, Ordering::Relaxed);
}

#[test]
fn remote_reads_across_processes() {
    let dir = tempfile::tempdir().unwrap();
    pattern::generate_file(&dir.path().join("data"), PAGES * PS as u64, PS).unwrap();
    let owner = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "owner_process",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(OWNER_ENV, dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Stop (and reap) the owner however this test ends.
    struct Stop<'a>(&'a Path, Option<std::process::Child>);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            let _ = std::fs::write(self.0.join("stop"), b"");
            if let Some(mut c) = self.1.take()
                && std::thread::panicking()
            {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    let mut guard = Stop(dir.path(), Some(owner));
    wait_for(&dir.path().join("desc"));
    let desc =
        RegionDescriptor::from_bytes(&std::fs::read(dir.path().join("desc")).unwrap()).unwrap();
    let acked_map = unsafe {
        // SAFETY: a read-only shared mapping of the owner's table; every
        // access to it is an atomic load.
        Mmap::map(&std::fs::File::open(dir.path().join("acked")).unwrap()).unwrap()
    };
    let acked = acked_words(&acked_map);
    let tally = Tally::default();
    let deadline = Instant::now() + Duration::from_secs_f64(secs());
    wait_for(&dir.path().join("tcp"));
    let tcp_addr = std::fs::read_to_string(dir.path().join("tcp")).unwrap();
    let tcp_desc =
        RegionDescriptor::from_bytes(&std::fs::read(dir.path().join("tcp.desc")).unwrap()).unwrap();
    assert_eq!(tcp_desc.epoch, desc.epoch, "one epoch for both transports");
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
            let (dir, tally) = (dir.path(), &tally);
            s.spawn(move || {
                let conn = ShmConnection::connect(
                    "owner",
                    ShmConfig {
                        dir: Some(dir.to_owned()),
                        chaos,
                    },
                )
                .unwrap();
                let reader = RemoteReader::connect(conn, desc, ReaderConfig::default()).unwrap();
                read_loop(reader, seed, deadline, acked, tally);
            });
        }
        // A tcp reader: the owner's responder copies in chaos mode.
        let (tally, tcp_addr) = (&tally, tcp_addr.as_str());
        s.spawn(move || {
            let conn =
                TcpConnection::connect(tcp_addr, ConnectionConfig::new(TOKEN.as_bytes().to_vec()))
                    .unwrap();
            let reader = RemoteReader::connect(conn, tcp_desc, ReaderConfig::default()).unwrap();
            read_loop(reader, 13, deadline, acked, tally);
        });
    });
    std::fs::write(dir.path().join("stop"), b"").unwrap();
    let out = guard.1.take().unwrap().wait_with_output().unwrap();
    assert!(out.status.success(), "owner failed: {out:?}");
    let owner_line = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.find("owner:").map(|i| l[i..].to_owned()))
        .unwrap_or_else(|| "owner: (no tally)".to_owned());
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    println!(
        "remote, {:.1} s, 4 reader threads (shm plain, shm chaos, shm chaos+pause, tcp with a chaos responder): {} reads, {} verified hits \
         ({} warm, one round trip), {} absent, {} gave up, {} validation failures caught, \
         {} torn buckets, {} retries, {} round trips, {} hits of pages with an acknowledged write, 0 wrong; {}",
        secs(),
        g(&tally.reads),
        g(&tally.hits),
        g(&tally.warm),
        g(&tally.absent),
        g(&tally.gave_up),
        g(&tally.validation_failures),
        g(&tally.torn),
        g(&tally.retries),
        g(&tally.round_trips),
        g(&tally.fresh_after_ack),
        owner_line
    );
    assert!(g(&tally.hits) > 0, "no remote read hit");
    assert!(g(&tally.warm) > 0, "no warm (one round trip) hit");
    assert!(
        g(&tally.validation_failures) > 0,
        "no validation failure: the test provoked no race"
    );
}
