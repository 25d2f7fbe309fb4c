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

use memmap2::{Mmap, MmapMut};
use pagewire_node::index::Lockless;
use pagewire_node::remote::{Outcome, ReaderConfig, RemoteReader};
use pagewire_node::{CacheConfig, PageCache, pattern};
use pagewire_rdma::verbs::{DEVICE_ENV, VerbsConfig, VerbsConnection, VerbsOwner};
use pagewire_rdma::{LocalRegion, MemoryOwner, RegionDescriptor};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PS: usize = 4096;
const PAGES: u64 = 512;
const FRAMES: usize = 48; // at most 64: `Tally::frames_hit` is a bit set
const READERS: u64 = 2;
/// Between two CLOCK sweeps of 4 frames in the owner.
const EVICT_PAUSE: Duration = Duration::from_millis(50);
const OWNER_ENV: &str = "PAGEWIRE_REMOTE_VERBS_OWNER";
const TOKEN: &[u8] = b"remote-verbs-test-token";
/// Any nonzero value: what matters is that the superblock and every
/// descriptor carry the same one.
const EPOCH: u64 = 0x7077_7665_7262_7301;

fn secs() -> f64 {
    std::env::var("PAGEWIRE_REMOTE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0)
}

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
fn acked_words(map: &[u8]) -> &[AtomicU64] {
    assert_eq!(map.len(), PAGES as usize * 8);
    assert_eq!(map.as_ptr() as usize % 8, 0);
    // SAFETY: the mapping is PAGES * 8 bytes, 8-aligned (page-aligned), lives
    // as long as the borrow, and every access to it is atomic.
    unsafe { std::slice::from_raw_parts(map.as_ptr().cast::<AtomicU64>(), PAGES as usize) }
}

/// The owner: runs until `dir/stop` appears, then prints its tally.
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
    // The descriptor, then the control address, renamed into place last:
    // its appearance says everything is ready.
    std::fs::write(dir.join("desc"), desc.to_bytes()).unwrap();
    std::fs::write(dir.join("verbs.tmp"), owner.local_addr().to_string()).unwrap();
    std::fs::rename(dir.join("verbs.tmp"), dir.join("verbs")).unwrap();

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
        // Evictor. Paced, unlike tests/remote.rs's, which spins: under an
        // emulated CPU faults come in slowly, and a spinning evictor would
        // keep the cache empty (every remote read absent).
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                evicted.fetch_add(cache.reclaim(4) as u64, Ordering::Relaxed);
                std::thread::sleep(EVICT_PAUSE);
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
    // Deregister (the NIC stops reading the cache) before the cache can go.
    drop(region);
    drop(owner);
    drop(cache);
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
    /// Bit `f`: frame `f` delivered a verified hit. Every frame was
    /// unpopulated anonymous memory when the region was registered, so a
    /// hit on each shows the NIC reads the pages the cache faulted in after
    /// `ibv_reg_mr`, not what was pinned before.
    frames_hit: AtomicU64,
}

fn wait_for(path: &Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "owner never started"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One reader: random pages (half from a hot set), every hit verified and
/// checked against the acknowledged-write table read before it began.
fn read_loop(
    mut reader: RemoteReader<VerbsConnection>,
    seed: u64,
    deadline: Instant,
    acked: &[AtomicU64],
    tally: &Tally,
) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut buf = vec![0u8; PS];
    while Instant::now() < deadline {
        let p = if rng.random_bool(0.5) {
            rng.random_range(0..16)
        } else {
            rng.random_range(0..PAGES)
        };
        let floor = acked[p as usize].load(Ordering::Acquire);
        tally.reads.fetch_add(1, Ordering::Relaxed);
        match reader.read_page(p, &mut buf).unwrap() {
            Outcome::Hit {
                round_trips, frame, ..
            } => {
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
                tally.frames_hit.fetch_or(1 << frame, Ordering::Relaxed);
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
#[ignore = "needs an RDMA device: run by rdma/scripts/softroce-test.sh"]
fn remote_reads_over_verbs() {
    let dir = tempfile::tempdir().unwrap();
    pattern::generate_file(&dir.path().join("data"), PAGES * PS as u64, PS).unwrap();
    let owner = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "verbs_owner_process",
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
    wait_for(&dir.path().join("verbs"));
    let addr = std::fs::read_to_string(dir.path().join("verbs")).unwrap();
    let desc =
        RegionDescriptor::from_bytes(&std::fs::read(dir.path().join("desc")).unwrap()).unwrap();
    assert_eq!(desc.epoch, EPOCH, "the owner's one epoch");
    let acked_map = unsafe {
        // SAFETY: a read-only shared mapping of the owner's table; every
        // access to it is an atomic load.
        Mmap::map(&std::fs::File::open(dir.path().join("acked")).unwrap()).unwrap()
    };
    let acked = acked_words(&acked_map);
    let tally = Tally::default();
    // Connect every reader first (queue pairs are slow to set up under
    // emulation), then read for `secs()`.
    let readers: Vec<_> = (0..READERS)
        .map(|_| {
            let conn =
                VerbsConnection::connect(addr.as_str(), config()).expect("connect over verbs");
            RemoteReader::connect(conn, desc, ReaderConfig::default()).unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs_f64(secs());
    std::thread::scope(|s| {
        for (i, reader) in readers.into_iter().enumerate() {
            let tally = &tally;
            s.spawn(move || read_loop(reader, 20 + i as u64, deadline, acked, tally));
        }
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
        "remote over verbs ({}), {:.1} s, {READERS} reader threads: {} reads, {} verified hits \
         ({} warm, one round trip), {} absent, {} gave up, {} validation failures caught, \
         {} torn buckets, {} retries, {} round trips, {} hits of pages with an acknowledged write, \
         {} of {FRAMES} frames hit, 0 wrong; {}",
        std::env::var(DEVICE_ENV).unwrap_or_else(|_| "first device".to_owned()),
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
        g(&tally.frames_hit).count_ones(),
        owner_line
    );
    assert!(g(&tally.hits) > 0, "no remote read hit");
    assert!(g(&tally.warm) > 0, "no warm (one round trip) hit");
    assert!(
        g(&tally.validation_failures) > 0,
        "no validation failure: the test provoked no race"
    );
}
