//! The cached mode (`--cached SECS`) keeps what did not change: pages the
//! kernel cached through the mount stay cached across the mount's periodic
//! checks, a page written elsewhere is seen within the bound, and only the
//! run that held it is dropped from the kernel's cache; and a page written
//! through a writable cached mount, which the kernel keeps with no read,
//! is dropped too, so a later write elsewhere is seen. What the kernel
//! holds is asked with `mincore` on a mapping of the file. A stress runs
//! readers through a cached mount while a client writes random pages:
//! every page read must verify whole and be no older than the bound
//! allows.

mod mount_common;

use mount_common::*;
use pagewire_client::{ClientConfig, ClusterClient, MapFollower};
use pagewire_node::pattern;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// 4 MiB.
const PAGES: u64 = 1024;
/// The page written elsewhere.
const WRITTEN: u64 = 700;
/// The largest run the kernel reads in one request (max_read, 1 MiB).
const MAX_RUN: usize = 256;

/// 4 KiB pages of `path` in the kernel's page cache (mincore over a shared
/// read-only mapping; mincore reads nothing in).
fn resident_pages(path: &Path) -> usize {
    let f = std::fs::File::open(path).expect("open");
    let len = f.metadata().expect("stat").len() as usize;
    // SAFETY: a fresh read-only shared mapping of an open file, unmapped
    // below; nothing reads through it.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(at, libc::MAP_FAILED, "mmap of {}", path.display());
    let mut vec = vec![0u8; len.div_ceil(4096)];
    // SAFETY: `at..at + len` is the mapping made above; `vec` holds one
    // byte per 4 KiB page of it.
    let r = unsafe { libc::mincore(at, len, vec.as_mut_ptr()) };
    // SAFETY: unmaps exactly the mapping made above.
    unsafe { libc::munmap(at, len) };
    assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().filter(|&&b| b & 1 == 1).count()
}

/// Waits (`limit` at most) until `f` holds; how long that took.
fn within(limit: Duration, what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t.elapsed()
}

#[test]
fn a_cached_mount_keeps_unchanged_pages_across_its_checks_and_drops_only_a_written_run() {
    let _s = serial();
    preflight(&[]);
    let t0 = Instant::now();
    let cluster = Cluster::pattern(3, PAGES * PS as u64);
    let mut m = Mount::start(&cluster, "mnt", &["--cached", "1"]);
    let file = m.file();
    let mut want = std::fs::read(cluster.backing()).unwrap();
    let all = PAGES as usize;

    // Read through the page cache: the kernel keeps every page.
    assert!(std::fs::read(&file).unwrap() == want, "the first read");
    let cached = resident_pages(&file);
    assert_eq!(cached, all, "pages cached after reading the whole file");

    // Three periods later, nothing having changed, they are all still
    // there (dropping every page every period left none) and still right.
    std::thread::sleep(Duration::from_millis(3200));
    let kept = resident_pages(&file);
    assert_eq!(
        kept, all,
        "pages still cached three checks later, nothing written"
    );
    assert!(std::fs::read(&file).unwrap() == want, "the cached read");

    // A write elsewhere: its run is dropped within the bound (a period and
    // the check), the rest stays, and the next read has the new bytes.
    let follower = MapFollower::start(&cluster.coord_addr(), TOKEN).expect("follower");
    let client = ClusterClient::new(follower, TOKEN, ClientConfig::default()).expect("client");
    let mut bytes = vec![0u8; PS];
    pattern::fill(WRITTEN, 1, &mut bytes);
    client.write_page(WRITTEN, &bytes).expect("client write");
    let at = WRITTEN as usize * PS;
    want[at..at + PS].copy_from_slice(&bytes);
    let mut left = 0;
    let took = within(Duration::from_secs(4), "the written run dropped", || {
        left = resident_pages(&file);
        left < all
    });
    assert!(
        left >= all - MAX_RUN,
        "{left} of {all} pages cached after one page was written: more than its run was dropped"
    );
    let f = std::fs::File::open(&file).unwrap();
    let mut page = vec![0u8; PS];
    f.read_exact_at(&mut page, at as u64).unwrap();
    assert!(
        page == bytes,
        "the written page read after its run was dropped"
    );
    assert!(
        std::fs::read(&file).unwrap() == want,
        "the whole file after the write"
    );
    eprintln!(
        "MEASURE --cached 1: the written page's run dropped {took:?} after the write; \
         {left} of {all} pages still cached"
    );

    drop(f);
    let line = m.stop_and_find("cached pages: ");
    eprintln!("MEASURE {line}");
    assert!(
        line.contains(" 0 times the whole file"),
        "the records overflowed: {line}"
    );
    eprintln!("COVERED cached mode revalidation: {:?}", t0.elapsed());
}

#[test]
fn a_page_written_through_a_cached_mount_is_dropped_so_a_later_write_elsewhere_is_seen() {
    let _s = serial();
    preflight(&[]);
    let t0 = Instant::now();
    let cluster = Cluster::pattern(3, PAGES * PS as u64);
    let m = Mount::start(&cluster, "mnt", &["--cached", "1", "--writable"]);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.file())
        .expect("open");
    let follower = MapFollower::start(&cluster.coord_addr(), TOKEN).expect("follower");
    let client = ClusterClient::new(follower, TOKEN, ClientConfig::default()).expect("client");
    // A whole page written through the mount, never read: the kernel keeps
    // the bytes it wrote.
    let at = WRITTEN * PS as u64;
    let mut mine = vec![0u8; PS];
    pattern::fill(WRITTEN, 1, &mut mine);
    f.write_all_at(&mine, at).expect("write through the mount");
    let mut page = vec![0u8; PS];
    f.read_exact_at(&mut page, at).unwrap();
    assert!(page == mine, "the page just written through the mount");
    // Past the tick that drops it, then written elsewhere: seen within the
    // bound (a period and the check).
    std::thread::sleep(Duration::from_millis(1500));
    let mut theirs = vec![0u8; PS];
    pattern::fill(WRITTEN, 2, &mut theirs);
    client.write_page(WRITTEN, &theirs).expect("client write");
    let took = within(Duration::from_secs(4), "the write elsewhere seen", || {
        f.read_exact_at(&mut page, at).unwrap();
        page == theirs
    });
    eprintln!(
        "MEASURE --cached 1 --writable: a page written through the mount, then elsewhere: \
         the second write seen after {took:?}"
    );
    eprintln!("COVERED cached mode, writes through it: {:?}", t0.elapsed());
}

/// A page's acknowledged writes: when, and the generation written.
type History = Vec<(Instant, u64)>;

/// Readers through a `--cached 1 --deadline-ms 2000` mount (buffered
/// reads, so the kernel's page cache, of random runs of 1 to 64 pages)
/// while a client writes random pages, each with the next generation of
/// the self-describing pattern. Every page read must verify whole (no torn
/// or foreign page), have a generation that was written (or is being
/// written), and be no older than the newest write acknowledged BOUND
/// before the read began: the mount's bound, 1 s period + 2 s deadline,
/// plus 1 s for a round of checks. `PAGEWIRE_MOUNT_CACHED_SECS` sets how
/// long it runs (default 10: the bound applies to writes acknowledged 4 s
/// before a read, so a shorter run checks little; run it for minutes by
/// hand).
#[test]
fn cached_mount_readers_never_see_a_page_older_than_the_bound_while_pages_are_written() {
    const BOUND: Duration = Duration::from_secs(4);
    let _s = serial();
    preflight(&[]);
    let secs: u64 = std::env::var("PAGEWIRE_MOUNT_CACHED_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let cluster = Cluster::pattern(3, PAGES * PS as u64);
    let m = Mount::start(&cluster, "mnt", &["--cached", "1", "--deadline-ms", "2000"]);
    let follower = MapFollower::start(&cluster.coord_addr(), TOKEN).expect("follower");
    let client = ClusterClient::new(follower, TOKEN, ClientConfig::default()).expect("client");
    // Per page: the generations acknowledged, with when (the backing
    // file's pages are generation 0), and the highest one sent.
    let acked: Arc<Mutex<Vec<History>>> = Arc::new(Mutex::new(vec![Vec::new(); PAGES as usize]));
    let sent: Arc<Vec<AtomicU64>> = Arc::new((0..PAGES).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, pages_read, behind) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let writer = {
        let (acked, sent, stop) = (acked.clone(), sent.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(7);
            let mut buf = vec![0u8; PS];
            let mut writes = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let page = rng.random_range(0..PAGES);
                let g = sent[page as usize].fetch_add(1, Ordering::SeqCst) + 1;
                pattern::fill(page, g, &mut buf);
                client.write_page(page, &buf).expect("client write");
                acked.lock().unwrap()[page as usize].push((Instant::now(), g));
                writes += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            writes
        })
    };
    let readers: Vec<_> = (0..2u64)
        .map(|r| {
            let (acked, sent, stop) = (acked.clone(), sent.clone(), stop.clone());
            let (reads, pages_read, behind) = (reads.clone(), pages_read.clone(), behind.clone());
            let f = std::fs::File::open(m.file()).expect("open");
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(100 + r);
                let mut buf = vec![0u8; 64 * PS];
                while !stop.load(Ordering::Relaxed) {
                    let first = rng.random_range(0..PAGES);
                    let n = rng.random_range(1..=64).min(PAGES - first) as usize;
                    let began = Instant::now();
                    let bytes = &mut buf[..n * PS];
                    f.read_exact_at(bytes, first * PS as u64).expect("read");
                    let acked = acked.lock().unwrap();
                    for (k, page_bytes) in bytes.chunks(PS).enumerate() {
                        let page = first + k as u64;
                        let g = pattern::verify(page, page_bytes).unwrap_or_else(|e| {
                            panic!("page {page} read through the cached mount: {e}")
                        });
                        let sent = sent[page as usize].load(Ordering::SeqCst);
                        assert!(g <= sent, "page {page}: generation {g}, never written (sent {sent})");
                        let history = &acked[page as usize];
                        let newest = history.last().map_or(0, |&(_, g)| g);
                        let required = history
                            .iter()
                            .rev()
                            .find(|(at, _)| began.checked_duration_since(*at).is_some_and(|d| d > BOUND))
                            .map_or(0, |&(_, g)| g);
                        assert!(
                            g >= required,
                            "page {page}: read generation {g}, but {required} was acknowledged more \
                             than {BOUND:?} before the read began (newest acknowledged {newest})"
                        );
                        if g < newest {
                            behind.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    reads.fetch_add(1, Ordering::Relaxed);
                    pages_read.fetch_add(n as u64, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(secs) && !readers.iter().any(|r| r.is_finished()) {
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().expect("a reader failed");
    }
    let writes = writer.join().expect("the writer failed");
    let pages = pages_read.load(Ordering::Relaxed);
    assert!(
        pages > 0 && writes > 0,
        "{pages} pages read, {writes} written"
    );
    eprintln!(
        "MEASURE cached stress: {secs} s, {writes} writes, {} reads of {pages} pages through a --cached 1 mount, \
         every page verified; {} pages older than the newest acknowledged write (within the bound)",
        reads.load(Ordering::Relaxed),
        behind.load(Ordering::Relaxed)
    );
    drop(m);
    eprintln!("COVERED cached mode under writes: {:?}", t0.elapsed());
}
