//! The cached mode (`--cached SECS`) keeps what did not change: pages the
//! kernel cached through the mount stay cached across the mount's periodic
//! checks, a page written elsewhere is seen within the bound while pages
//! of other runs stay cached; and a page written
//! through a writable cached mount, which the kernel keeps with no read,
//! is dropped too, so a later write elsewhere is seen. What the kernel
//! holds is asked with `mincore` on a mapping of the file (of pages kept
//! hot: see [`HOT`]). A stress runs
//! readers through a cached mount while a client writes random pages:
//! every page read must verify whole and be no older than the bound
//! allows.

mod mount_common;

use mount_common::*;
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

/// 4 KiB pages of `path` in the kernel's page cache among its first
/// `pages` (mincore over a shared read-only mapping; mincore reads nothing
/// in).
fn resident_pages(path: &Path, pages: usize) -> usize {
    let f = std::fs::File::open(path).expect("open");
    let len = pages * 4096;
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
    let mut vec = vec![0u8; pages];
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

/// These VMs run DAMON with a `pageout` scheme: the kernel evicts page
/// cache pages on its own (1 to 4 of 1,024 idle pages went within 3.2 s in
/// some runs, and 1 to 4 of 512 read every 20 ms, none of them dropped by
/// the mount, whose log said so). So the test keeps the pages it counts
/// hot, reading them through the page cache every 20 ms, counts them just
/// before each read (a drop by the mount shows in the count until the next
/// read fetches them again: every page each period before revalidation),
/// and allows the kernel [`EVICTED`] of them.
const HOT: usize = 512;
/// Hot pages the kernel may evict by itself during the test.
const EVICTED: usize = HOT / 16;

#[test]
fn a_cached_mount_keeps_unchanged_pages_across_its_checks_and_drops_only_a_written_run() {
    let _s = serial();
    preflight(&[]);
    let t0 = Instant::now();
    let cluster = Cluster::pattern(3, PAGES * PS as u64);
    let mut m = Mount::start(&cluster, "mnt", &["--cached", "1"]);
    let file = m.file();
    let mut want = std::fs::read(cluster.backing()).unwrap();
    let f = std::fs::File::open(&file).unwrap();
    let mut hot = vec![0u8; HOT * PS];
    let at = WRITTEN as usize * PS;
    let mut page = vec![0u8; PS];
    // The fewest of the first HOT pages cached at any count, then reads
    // them again (comparing every byte), and the page that will be written
    // (kept hot too: evicted by the kernel, it would be read fresh whether
    // or not the mount dropped it).
    let mut fewest = usize::MAX;
    let mut count_then_read = |want: &[u8], fewest: &mut usize, page: &mut [u8]| {
        *fewest = (*fewest).min(resident_pages(&file, HOT));
        f.read_exact_at(&mut hot, 0).unwrap();
        assert!(hot[..] == want[..HOT * PS], "the first {HOT} pages");
        f.read_exact_at(page, at as u64).unwrap();
    };

    // Read through the page cache: the kernel keeps every page.
    assert!(std::fs::read(&file).unwrap() == want, "the first read");
    assert_eq!(
        resident_pages(&file, PAGES as usize),
        PAGES as usize,
        "pages cached after reading the whole file"
    );

    // Three periods, nothing changing: the hot pages are never dropped
    // (dropping every page every period left none at the count after it).
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(3200) {
        count_then_read(&want, &mut fewest, &mut page);
        assert!(page[..] == want[at..at + PS], "page {WRITTEN}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        fewest >= HOT - EVICTED,
        "of the first {HOT} pages, read every 20 ms, only {fewest} were cached at some point of three checks, nothing written"
    );
    let before_write = fewest;

    // A write elsewhere (past the hot pages): seen within the bound (a
    // period and the check), and the hot pages, in other runs, stay.
    let client = cluster.client();
    let mut bytes = vec![0u8; PS];
    pattern::fill(WRITTEN, 1, &mut bytes);
    client.write_page(WRITTEN, &bytes).expect("client write");
    want[at..at + PS].copy_from_slice(&bytes);
    let took = within(Duration::from_secs(4), "the written page read", || {
        count_then_read(&want, &mut fewest, &mut page);
        page == bytes
    });
    assert!(
        fewest >= HOT - EVICTED,
        "of the first {HOT} pages, read every 20 ms, only {fewest} were cached at some point after page {WRITTEN} was written"
    );
    assert!(
        std::fs::read(&file).unwrap() == want,
        "the whole file after the write"
    );
    eprintln!(
        "MEASURE --cached 1: the written page read {took:?} after the write; of the {HOT} hot pages at least \
         {before_write} cached at every count before the write, {fewest} after it"
    );

    drop(f);
    let line = m.stop_and_find("cached pages: ");
    eprintln!("MEASURE {line}");
    assert!(
        line.contains(" 0 times the whole file"),
        "the records overflowed: {line}"
    );
    // Runs checked and kept: the hot ones at every check.
    let kept: u64 = line
        .split(" kept")
        .next()
        .and_then(|l| l.split_whitespace().last())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no kept count in {line}"));
    assert!(kept >= 3, "{kept} runs kept over the checks: {line}");
    eprintln!("COVERED cached mode revalidation: {:?}", t0.elapsed());
}

#[test]
fn a_page_written_through_a_cached_mount_is_dropped_so_a_later_write_elsewhere_is_seen() {
    let _s = serial();
    preflight(&[]);
    let t0 = Instant::now();
    let cluster = Cluster::pattern(3, PAGES * PS as u64);
    let m = Mount::start(&cluster, "mnt", &["--cached", "1", "--writable"]);
    let f = m.open_rw();
    let client = cluster.client();
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
    let client = cluster.client();
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
