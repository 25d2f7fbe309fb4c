//! What the cross-process remote-read tests share, whatever the transport
//! (`tests/remote.rs`: shm and tcp; `tests/remote_verbs.rs`: verbs): the
//! owner's workload and its acknowledged-write table, the owner process's
//! start and stop, the readers' loop and their tally.
//!
//! The owner is the test binary itself, re-executed with an environment
//! variable naming the working directory; files in that directory carry the
//! descriptors, the acknowledged-write table (one u64 per page, the highest
//! write generation acknowledged) and the stop signal.

#![allow(dead_code)] // each test binary uses its own part

use memmap2::{Mmap, MmapMut};
use pagewire_client::one_sided::{Outcome, RemoteReader};
use pagewire_node::{PageCache, pattern};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub const PS: usize = 4096;
pub const PAGES: u64 = 512;
/// At most 64: `Tally::frames_hit` is a bit set.
pub const FRAMES: usize = 48;

/// Seconds of reading (`PAGEWIRE_REMOTE_SECS`, default 2).
pub fn secs() -> f64 {
    std::env::var("PAGEWIRE_REMOTE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0)
}

/// The acknowledged-write table in a mapping of `PAGES * 8` bytes.
pub fn acked_words(map: &[u8]) -> &[AtomicU64] {
    assert_eq!(map.len(), PAGES as usize * 8);
    assert_eq!(map.as_ptr() as usize % 8, 0);
    // SAFETY: the mapping is PAGES * 8 bytes, 8-aligned (page-aligned), lives
    // as long as the borrow, and every access to it is atomic.
    unsafe { std::slice::from_raw_parts(map.as_ptr().cast::<AtomicU64>(), PAGES as usize) }
}

/// The owner's side of the table: a fresh file `dir/acked`, mapped shared.
pub fn create_acked(dir: &Path) -> MmapMut {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join("acked"))
        .unwrap();
    f.set_len(PAGES * 8).unwrap();
    // SAFETY: our own fresh file; readers map it read-only and load atomically.
    unsafe { MmapMut::map_mut(&f).unwrap() }
}

/// The readers' side of the table.
pub fn open_acked(dir: &Path) -> Mmap {
    // SAFETY: a read-only shared mapping of the owner's table; every access
    // to it is an atomic load.
    unsafe { Mmap::map(&std::fs::File::open(dir.join("acked")).unwrap()).unwrap() }
}

/// The owner's workload until `dir/stop` appears (or, should the test have
/// died, well after its deadline): a faulting reader (the readers' hot set
/// half of the time), a CLOCK evictor (pausing `evict_pause` between sweeps
/// when given) and a writer of whole pages (pattern generation + 1,
/// acknowledged in the table only after `write` returned). Returns the
/// owner's tally line.
pub fn run_owner(
    cache: &PageCache,
    acked: &[AtomicU64],
    dir: &Path,
    evict_pause: Option<Duration>,
) -> String {
    let stop = AtomicBool::new(false);
    let (writes, faults, evicted) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let wlock = Mutex::new(());
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut rng = SmallRng::seed_from_u64(1);
            while !stop.load(Ordering::Relaxed) {
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
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                evicted.fetch_add(cache.reclaim(4) as u64, Ordering::Relaxed);
                match evict_pause {
                    Some(d) => std::thread::sleep(d),
                    None => std::thread::yield_now(),
                }
            }
        });
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
        let give_up = Instant::now() + Duration::from_secs_f64(secs() + 120.0);
        while !dir.join("stop").exists() && Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::Relaxed);
    });
    format!(
        "owner: {} faulting reads, {} writes, {} evictions",
        faults.into_inner(),
        writes.into_inner(),
        evicted.into_inner()
    )
}

/// The owner process: this test binary running test `name` with `env` set
/// to `dir`. Dropping it signals stop, and kills it if the test panicked.
pub struct OwnerProcess<'a> {
    dir: &'a Path,
    child: Option<Child>,
}

impl<'a> OwnerProcess<'a> {
    pub fn start(name: &str, env: &str, dir: &'a Path) -> Self {
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                name,
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(env, dir)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        Self {
            dir,
            child: Some(child),
        }
    }

    /// Signal stop, wait for it, check it succeeded; its tally line.
    pub fn finish(mut self) -> String {
        std::fs::write(self.dir.join("stop"), b"").unwrap();
        let out = self.child.take().unwrap().wait_with_output().unwrap();
        assert!(out.status.success(), "owner failed: {out:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.find("owner:").map(|i| l[i..].to_owned()))
            .unwrap_or_else(|| "owner: (no tally)".to_owned())
    }
}

impl Drop for OwnerProcess<'_> {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("stop"), b"");
        if let Some(mut c) = self.child.take()
            && std::thread::panicking()
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn wait_for(path: &Path, limit: Duration) {
    let t = Instant::now();
    while !path.exists() {
        assert!(t.elapsed() < limit, "owner never started");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[derive(Default)]
pub struct Tally {
    pub reads: AtomicU64,
    pub hits: AtomicU64,
    pub warm: AtomicU64,
    pub absent: AtomicU64,
    pub gave_up: AtomicU64,
    pub validation_failures: AtomicU64,
    pub torn: AtomicU64,
    pub retries: AtomicU64,
    pub round_trips: AtomicU64,
    pub fresh_after_ack: AtomicU64,
    /// Bit `f`: frame `f` delivered a verified single-page hit.
    pub frames_hit: AtomicU64,
}

impl Tally {
    fn count(&self, floor: u64, g: u64, p: u64) {
        assert!(
            g >= floor,
            "page {p}: read generation {g}, but {floor} was acknowledged before the read"
        );
        if floor > 0 {
            self.fresh_after_ack.fetch_add(1, Ordering::Relaxed);
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
    }

    fn miss(&self, o: &Outcome) {
        match o {
            Outcome::Absent => self.absent.fetch_add(1, Ordering::Relaxed),
            _ => self.gave_up.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// The common part of the printed line.
    pub fn line(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "{} reads, {} verified hits ({} warm, one round trip), {} absent, {} gave up, \
             {} validation failures caught, {} torn buckets, {} retries, {} round trips, \
             {} hits of pages with an acknowledged write, {} of {FRAMES} frames hit, 0 wrong",
            g(&self.reads),
            g(&self.hits),
            g(&self.warm),
            g(&self.absent),
            g(&self.gave_up),
            g(&self.validation_failures),
            g(&self.torn),
            g(&self.retries),
            g(&self.round_trips),
            g(&self.fresh_after_ack),
            g(&self.frames_hit).count_ones(),
        )
    }

    /// What every run must show: hits, warm hits, and races provoked.
    pub fn check(&self) {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        assert!(g(&self.hits) > 0, "no remote read hit");
        assert!(g(&self.warm) > 0, "no warm (one round trip) hit");
        assert!(
            g(&self.validation_failures) > 0,
            "no validation failure: the test provoked no race"
        );
    }
}

/// One reader until `deadline`: random pages (half from a hot set), and,
/// with `runs`, one read in eight a batched run of 16. Every hit is verified
/// and checked against the acknowledged-write table read before it began.
pub fn read_loop<C: pagewire_rdma::Connection>(
    mut reader: RemoteReader<C>,
    seed: u64,
    deadline: Instant,
    acked: &[AtomicU64],
    tally: &Tally,
    runs: bool,
) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut buf = vec![0u8; PS];
    let mut run = vec![0u8; 16 * PS];
    while Instant::now() < deadline {
        if runs && rng.random_ratio(1, 8) {
            let first = rng.random_range(0..PAGES - 16);
            let floors: Vec<u64> = (first..first + 16)
                .map(|p| acked[p as usize].load(Ordering::Acquire))
                .collect();
            tally.reads.fetch_add(16, Ordering::Relaxed);
            for (i, o) in reader
                .read_run(first, 16, &mut run)
                .unwrap()
                .iter()
                .enumerate()
            {
                let p = first + i as u64;
                if let Outcome::Hit { .. } = o {
                    let g = pattern::verify(p, &run[i * PS..(i + 1) * PS])
                        .unwrap_or_else(|e| panic!("wrong bytes for page {p} in a run: {e:?}"));
                    tally.count(floors[i], g, p);
                } else {
                    tally.miss(o);
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
        let o = reader.read_page(p, &mut buf).unwrap();
        if let Outcome::Hit {
            round_trips, frame, ..
        } = o
        {
            let g = pattern::verify(p, &buf)
                .unwrap_or_else(|e| panic!("wrong bytes for page {p}: {e:?}"));
            tally.count(floor, g, p);
            tally
                .frames_hit
                .fetch_or(1 << (frame % 64), Ordering::Relaxed);
            if round_trips == 1 {
                tally.warm.fetch_add(1, Ordering::Relaxed);
            }
        } else {
            tally.miss(&o);
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
