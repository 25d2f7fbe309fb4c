//! The cached mode (`--cached SECS`) keeps what did not change: pages the
//! kernel cached through the mount stay cached across the mount's periodic
//! checks, a page written elsewhere is seen within the bound, and only the
//! run that held it is dropped from the kernel's cache; and a page written
//! through a writable cached mount, which the kernel keeps with no read,
//! is dropped too, so a later write elsewhere is seen. What the kernel
//! holds is asked with `mincore` on a mapping of the file.

mod mount_common;

use mount_common::*;
use pagewire_client::{ClientConfig, ClusterClient, MapFollower};
use pagewire_node::pattern;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
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
