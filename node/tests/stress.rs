//! Randomized stress: concurrent readers (counted zero-copy, copy-out,
//! lookup, and guard-scoped reads whose lent bytes are verified again
//! before their pin drops), faulting inserters, evictors and writers over
//! a self-describing file, every byte of every read verified, and no read
//! older than an acknowledged write.
//!
//! Every eviction × admission combination runs on the lockless index; each
//! other index variant runs under one combination (rotated), so every
//! policy also meets a locked index.
//!
//! Bounded by default (`PAGEWIRE_STRESS_SECS`, default 2 s per run: six
//! lockless runs and three others, 18 s in all); set it higher for a soak,
//! e.g. `PAGEWIRE_STRESS_SECS=300`. It prints what it covered.

use pagewire_node::index::{Index, Lockless, Mutexed, RwLocked, Sharded};
use pagewire_node::policy::{Admission, CachePolicy, Eviction};
use pagewire_node::{CacheConfig, PageCache, Pin, ReadError, pattern};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PS: usize = 4096;
const PAGES: u64 = 512;

fn secs() -> f64 {
    std::env::var("PAGEWIRE_STRESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0)
}

#[derive(Default)]
struct Tally {
    reads: AtomicU64,
    bytes: AtomicU64,
    writes: AtomicU64,
    evicted: AtomicU64,
    no_frame: AtomicU64,
    /// Reads lent under a pin and verified again before it dropped.
    pinned: AtomicU64,
}

fn stress<I: Index>(seed: u64, policy: CachePolicy) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data");
    pattern::generate_file(&path, PAGES * PS as u64, PS).unwrap();
    let cache = Arc::new(
        PageCache::<I>::open_with(
            &path,
            CacheConfig {
                frames: 48,
                readahead_max: 8,
                evict_batch: 4,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    cache.set_policy(policy);
    // Highest acknowledged generation of each page, and test-side writer
    // serialisation per page (so generations only grow).
    let acked: Arc<Vec<AtomicU64>> = Arc::new((0..PAGES).map(|_| AtomicU64::new(0)).collect());
    let wlocks: Arc<Vec<Mutex<()>>> = Arc::new((0..64).map(|_| Mutex::new(())).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let deadline = Instant::now() + Duration::from_secs_f64(secs());
    let mut handles = Vec::new();

    for r in 0..4u64 {
        let (cache, acked, stop, tally) =
            (cache.clone(), acked.clone(), stop.clone(), tally.clone());
        handles.push(std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(seed ^ r);
            let mut buf = vec![0u8; PS];
            while !stop.load(Ordering::Relaxed) {
                // Mostly a hot set, sometimes a sequential scan (readahead).
                let p = if rng.random_bool(0.1) { rng.random_range(0..PAGES) } else { rng.random_range(0..64) };
                let run = if rng.random_bool(0.05) { 16 } else { 1 };
                if r == 3 {
                    pinned_reads(&cache, &acked, &tally, p, run);
                    continue;
                }
                for p in p..(p + run).min(PAGES) {
                    let before = acked[p as usize].load(Ordering::Acquire);
                    let got = match r % 3 {
                        0 => cache.get(p).map(|g| {
                            let generation = pattern::verify(p, &g).unwrap_or_else(|e| panic!("zero-copy read: {e}"));
                            tally.bytes.fetch_add(g.len() as u64, Ordering::Relaxed);
                            generation
                        }),
                        1 => cache.read_into(p, &mut buf).map(|n| {
                            tally.bytes.fetch_add(n as u64, Ordering::Relaxed);
                            pattern::verify(p, &buf[..n]).unwrap_or_else(|e| panic!("copy-out read: {e}"))
                        }),
                        _ => match cache.lookup(p) {
                            Some(g) => Ok(pattern::verify(p, &g).unwrap_or_else(|e| panic!("lookup read: {e}"))),
                            None => continue,
                        },
                    };
                    match got {
                        Ok(generation) => {
                            assert!(generation >= before, "page {p}: read generation {generation} after {before} was acknowledged");
                            tally.reads.fetch_add(1, Ordering::Relaxed);
                        }
                        // All frames momentarily held by readers: allowed, counted.
                        Err(ReadError::NoFrame) => {
                            tally.no_frame.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("read of page {p}: {e}"),
                    }
                }
            }
        }));
    }
    {
        let (cache, acked, wlocks, stop, tally) = (
            cache.clone(),
            acked.clone(),
            wlocks.clone(),
            stop.clone(),
            tally.clone(),
        );
        handles.push(std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(seed ^ 100);
            let mut page = vec![0u8; PS];
            while !stop.load(Ordering::Relaxed) {
                let p = rng.random_range(0..64);
                let _w = wlocks[p as usize % 64].lock().unwrap();
                let next = acked[p as usize].load(Ordering::Acquire) + 1;
                if rng.random_bool(0.5) {
                    pattern::fill(p, next, &mut page);
                    match cache.write(p, &page) {
                        Ok(_) => {}
                        Err(pagewire_node::WriteError::NoFrame) => continue,
                        Err(e) => panic!("write of page {p}: {e}"),
                    }
                } else {
                    // A partial write (the read-modify-write path) that keeps
                    // the page valid: rewrite a range of the current generation
                    // with its own bytes, so no reader may see a difference.
                    pattern::fill(p, next - 1, &mut page);
                    let off = rng.random_range(0..PS - 64);
                    let len = rng.random_range(1..64);
                    match cache.write_at(p, off, &page[off..off + len]) {
                        Ok(_) => {}
                        Err(pagewire_node::WriteError::NoFrame) => continue,
                        Err(e) => panic!("partial write of page {p}: {e}"),
                    }
                    tally.writes.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                acked[p as usize].store(next, Ordering::Release);
                tally.writes.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    {
        let (cache, stop, tally) = (cache.clone(), stop.clone(), tally.clone());
        handles.push(std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(seed ^ 200);
            while !stop.load(Ordering::Relaxed) {
                let n = if rng.random_bool(0.5) {
                    cache.evict_range(rng.random_range(0..PAGES), 8).0
                } else {
                    cache.reclaim(4) as u64
                };
                tally.evicted.fetch_add(n, Ordering::Relaxed);
                std::thread::yield_now();
            }
        }));
    }
    while Instant::now() < deadline && !handles.iter().any(|h| h.is_finished()) {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        if let Err(e) = h.join() {
            std::panic::resume_unwind(e);
        }
    }
    // Every page, cached or not, ends at its last acknowledged generation.
    for p in 0..PAGES {
        let g = pattern::verify(p, &cache.get(p).unwrap()).unwrap();
        assert_eq!(
            g,
            acked[p as usize].load(Ordering::Relaxed),
            "page {p} lost a write"
        );
    }
    let st = cache.stats();
    drop(cache);
    let file = std::fs::read(&path).unwrap();
    for p in 0..PAGES {
        let g = pattern::verify(p, &file[p as usize * PS..(p as usize + 1) * PS]).unwrap();
        assert_eq!(
            g,
            acked[p as usize].load(Ordering::Relaxed),
            "page {p} not written through"
        );
    }
    let t = &tally;
    // Under valgrind (.ci/valgrind.sh, 1 s) a run makes about 80k reads,
    // 175–430 of them pinned; natively millions.
    assert!(
        t.reads.load(Ordering::Relaxed) > 1000 && t.pinned.load(Ordering::Relaxed) > 20,
        "the stress did too little to mean anything"
    );
    println!(
        "stress {:9} ({policy}): {:.1} s, {} verified reads ({} pinned, checked twice; {} MiB), {} writes, {} evictions by the evictor, {} NoFrame; cache: {st:?}",
        I::KIND.name(),
        secs(),
        t.reads.load(Ordering::Relaxed),
        t.pinned.load(Ordering::Relaxed),
        t.bytes.load(Ordering::Relaxed) >> 20,
        t.writes.load(Ordering::Relaxed),
        t.evicted.load(Ordering::Relaxed),
        t.no_frame.load(Ordering::Relaxed),
    );
}

/// Guard-scoped lookups of pages `p..p + run` (at least 4) under one pin,
/// repinned (`Pin::repin`) halfway: each hit verified when lent, then every
/// one of the half verified again just before the repin (or the drop), so
/// bytes the cache lent must not change while evictions, writes and refills
/// go on, and a repin must protect the second half as a fresh pin would. A
/// miss is faulted in after the pin drops.
fn pinned_reads<I: Index>(
    cache: &PageCache<I>,
    acked: &[AtomicU64],
    tally: &Tally,
    p: u64,
    run: u64,
) {
    let pages: Vec<u64> = (p..(p + run.max(4)).min(PAGES)).collect();
    let (first, second) = pages.split_at(pages.len() / 2);
    let mut pin = Pin::new();
    let mut missed = Vec::new();
    for (i, half) in [first, second].into_iter().enumerate() {
        if i > 0 {
            pin.repin();
        }
        let mut lent = Vec::new();
        for &p in half {
            let before = acked[p as usize].load(Ordering::Acquire);
            let Some(b) = cache.lookup_pinned(p, &pin) else {
                missed.push(p);
                continue;
            };
            let generation = pattern::verify(p, b).unwrap_or_else(|e| panic!("pinned read: {e}"));
            assert!(
                generation >= before,
                "page {p}: read generation {generation} after {before} was acknowledged"
            );
            tally.reads.fetch_add(1, Ordering::Relaxed);
            tally.bytes.fetch_add(b.len() as u64, Ordering::Relaxed);
            lent.push((p, generation, b));
        }
        for (p, generation, b) in &lent {
            let again = pattern::verify(*p, b)
                .unwrap_or_else(|e| panic!("lent bytes changed under the pin: {e}"));
            assert_eq!(
                again, *generation,
                "page {p}: lent bytes changed under the pin"
            );
        }
        tally.pinned.fetch_add(lent.len() as u64, Ordering::Relaxed);
    }
    drop(pin);
    for p in missed {
        match cache.get(p) {
            Ok(g) => {
                pattern::verify(p, &g).unwrap_or_else(|e| panic!("zero-copy read: {e}"));
            }
            Err(ReadError::NoFrame) => {
                tally.no_frame.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => panic!("read of page {p}: {e}"),
        }
    }
}

fn policy(eviction: Eviction, admission: Admission) -> CachePolicy {
    CachePolicy {
        admission,
        eviction,
    }
}

#[test]
fn stress_lockless() {
    let mut seed = 1;
    for &e in Eviction::ALL {
        for &a in Admission::ALL {
            stress::<Lockless>(seed, policy(e, a));
            seed += 10;
        }
    }
}

#[test]
fn stress_rwlock() {
    stress::<RwLocked>(2, policy(Eviction::Lru, Admission::SecondHit));
}

#[test]
fn stress_mutex() {
    stress::<Mutexed>(3, policy(Eviction::Fifo, Admission::Always));
}

#[test]
fn stress_sharded() {
    stress::<Sharded>(4, policy(Eviction::Clock, Admission::SecondHit));
}

/// Extent eviction against sequential readers, the way the daemon drops an
/// extent: a "view" lock admits each read or write only for extents the
/// node answers for (as the daemon's view does); the evictor closes an
/// extent under the write lock, evicts it with `evict_range`, and while it
/// stays closed "another node" writes its pages straight into the backing
/// file. Readers scan runs that end past extent boundaries (readahead) and
/// keep some pages held after their admission ends (busy frames). Checked:
/// no page of a closed extent is cached after its eviction, and every read,
/// once the extent is open again, has every byte right and is never older
/// than an acknowledged write.
#[test]
fn stress_extent_eviction_vs_readahead() {
    const EXTENT: u64 = 16;
    const N: u64 = 256;
    let extents = (N / EXTENT) as usize;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data");
    pattern::generate_file(&path, N * PS as u64, PS).unwrap();
    let cache = Arc::new(
        PageCache::<Lockless>::open_with(
            &path,
            CacheConfig {
                frames: 96,
                readahead_max: 32,
                evict_batch: 4,
                extent_pages: EXTENT,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let closed: Arc<std::sync::RwLock<Vec<bool>>> =
        Arc::new(std::sync::RwLock::new(vec![false; extents]));
    let acked: Arc<Vec<AtomicU64>> = Arc::new((0..N).map(|_| AtomicU64::new(0)).collect());
    let wlocks: Arc<Vec<Mutex<()>>> = Arc::new((0..N).map(|_| Mutex::new(())).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let deadline = Instant::now() + Duration::from_secs_f64(secs());
    let mut handles = Vec::new();
    for r in 0..3u64 {
        let (cache, closed, acked, stop, tally) = (
            cache.clone(),
            closed.clone(),
            acked.clone(),
            stop.clone(),
            tally.clone(),
        );
        handles.push(std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(0xE7 ^ r);
            let mut buf = vec![0u8; PS];
            while !stop.load(Ordering::Relaxed) {
                // A run that ends a few pages into the next extent.
                let e = rng.random_range(0..N / EXTENT);
                let start = e * EXTENT + rng.random_range(0..EXTENT);
                let end = ((e + 1) * EXTENT + rng.random_range(0..4)).min(N);
                let mut held = Vec::new();
                for p in start..end {
                    let view = closed.read().unwrap();
                    if view[(p / EXTENT) as usize] {
                        continue;
                    }
                    let before = acked[p as usize].load(Ordering::Acquire);
                    let generation = if r == 0 {
                        let n = cache.read_into(p, &mut buf).unwrap();
                        pattern::verify(p, &buf[..n])
                            .unwrap_or_else(|e| panic!("copy-out read: {e}"))
                    } else {
                        let g = cache.get(p).unwrap();
                        let generation = pattern::verify(p, &g)
                            .unwrap_or_else(|e| panic!("zero-copy read: {e}"));
                        held.push((p, generation, g));
                        generation
                    };
                    drop(view);
                    assert!(
                        generation >= before,
                        "page {p}: read generation {generation} after {before} was acknowledged"
                    );
                    tally.reads.fetch_add(1, Ordering::Relaxed);
                    tally.bytes.fetch_add(PS as u64, Ordering::Relaxed);
                    // Held past the admission, as a transport may hold them.
                    if held.len() > 4 {
                        held.remove(0);
                    }
                }
                // A held copy never changes under its holder, evicted or not.
                for (p, generation, g) in &held {
                    assert_eq!(
                        pattern::verify(*p, g),
                        Ok(*generation),
                        "held page {p} changed"
                    );
                }
            }
        }));
    }
    {
        // The cache's own writer, for open extents.
        let (cache, closed, acked, wlocks, stop, tally) = (
            cache.clone(),
            closed.clone(),
            acked.clone(),
            wlocks.clone(),
            stop.clone(),
            tally.clone(),
        );
        handles.push(std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(0xE7 ^ 100);
            let mut page = vec![0u8; PS];
            while !stop.load(Ordering::Relaxed) {
                let p = rng.random_range(0..N);
                let view = closed.read().unwrap();
                if view[(p / EXTENT) as usize] {
                    continue;
                }
                let _w = wlocks[p as usize].lock().unwrap();
                let next = acked[p as usize].load(Ordering::Acquire) + 1;
                pattern::fill(p, next, &mut page);
                cache.write(p, &page).unwrap();
                acked[p as usize].store(next, Ordering::Release);
                tally.writes.fetch_add(1, Ordering::Relaxed);
                drop(view);
                std::thread::yield_now();
            }
        }));
    }
    let mut rng = SmallRng::seed_from_u64(0xE7 ^ 200);
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let mut page = vec![0u8; PS];
    let mut rounds = 0u64;
    while Instant::now() < deadline && !handles.iter().any(|h| h.is_finished()) {
        let e = rng.random_range(0..extents);
        closed.write().unwrap()[e] = true;
        let first = e as u64 * EXTENT;
        tally
            .evicted
            .fetch_add(cache.evict_range(first, EXTENT).0, Ordering::Relaxed);
        // While it is closed: another node writes a page of it, and the
        // readers of the extent before it keep reading ahead.
        let p = first + rng.random_range(0..EXTENT);
        {
            let _w = wlocks[p as usize].lock().unwrap();
            let next = acked[p as usize].load(Ordering::Acquire) + 1;
            pattern::fill(p, next, &mut page);
            std::os::unix::fs::FileExt::write_all_at(&file, &page, p * PS as u64).unwrap();
            acked[p as usize].store(next, Ordering::Release);
        }
        for check in 0..2 {
            for q in first..first + EXTENT {
                assert!(
                    cache.lookup(q).is_none(),
                    "round {rounds}: page {q} of closed extent {e} is cached (check {check})"
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        closed.write().unwrap()[e] = false;
        rounds += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        if let Err(e) = h.join() {
            std::panic::resume_unwind(e);
        }
    }
    for p in 0..N {
        let g = pattern::verify(p, &cache.get(p).unwrap()).unwrap();
        assert_eq!(g, acked[p as usize].load(Ordering::Relaxed), "page {p}");
    }
    let t = &tally;
    assert!(
        rounds > 10 && t.reads.load(Ordering::Relaxed) > 1000,
        "too little done: {rounds} rounds"
    );
    println!(
        "stress extents: {:.1} s, {rounds} extents closed and evicted, {} verified reads ({} MiB), {} writes, {} pages evicted; cache: {:?}",
        secs(),
        t.reads.load(Ordering::Relaxed),
        t.bytes.load(Ordering::Relaxed) >> 20,
        t.writes.load(Ordering::Relaxed),
        t.evicted.load(Ordering::Relaxed),
        cache.stats(),
    );
}
