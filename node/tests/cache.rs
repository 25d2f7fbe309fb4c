//! Behaviour of the page cache through its public API, for every index variant.

use pagewire_node::index::{Index, Lockless, Mutexed, RwLocked, Sharded};
use pagewire_node::policy::{Admission, CachePolicy};
use pagewire_node::{
    CacheConfig, Evicted, OpenError, PageCache, Pin, ReadError, WriteError, pattern,
};
use std::path::PathBuf;

const PS: usize = 4096;

fn file(pages: u64, extra: u64) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data");
    pattern::generate_file(&path, pages * PS as u64 + extra, PS).unwrap();
    (dir, path)
}

fn cfg(frames: usize) -> CacheConfig {
    CacheConfig {
        frames,
        ..CacheConfig::default()
    }
}

/// A cache of `frames` frames that reads only the pages asked for.
fn no_readahead(frames: usize) -> CacheConfig {
    CacheConfig {
        readahead_max: 0,
        ..cfg(frames)
    }
}

type Opener<'a> = &'a dyn Fn(&std::path::Path, CacheConfig) -> Box<dyn Cache>;

fn each_variant(test: fn(Opener<'_>)) {
    test(&|p, c| Box::new(PageCache::<Lockless>::open_with(p, c).unwrap()));
    test(&|p, c| Box::new(PageCache::<RwLocked>::open_with(p, c).unwrap()));
    test(&|p, c| Box::new(PageCache::<Mutexed>::open_with(p, c).unwrap()));
    test(&|p, c| Box::new(PageCache::<Sharded>::open_with(p, c).unwrap()));
}

/// The operations the tests use, object-safe so one test covers all variants.
trait Cache {
    fn read(&self, page: u64) -> Result<Vec<u8>, ReadError>;
    fn cached(&self, page: u64) -> bool;
    fn write(&self, page: u64, data: &[u8]) -> Result<u64, WriteError>;
    fn write_at(&self, page: u64, off: usize, data: &[u8]) -> Result<u64, WriteError>;
    fn evict(&self, page: u64) -> Evicted;
    fn stats(&self) -> pagewire_node::Stats;
    fn set_policy(&self, p: CachePolicy);
    fn read_into(&self, page: u64, buf: &mut [u8]) -> Result<usize, ReadError>;
}

impl<I: Index> Cache for PageCache<I> {
    fn read(&self, page: u64) -> Result<Vec<u8>, ReadError> {
        Ok(self.get(page)?.to_vec())
    }
    fn cached(&self, page: u64) -> bool {
        self.lookup(page).is_some()
    }
    fn write(&self, page: u64, data: &[u8]) -> Result<u64, WriteError> {
        PageCache::write(self, page, data)
    }
    fn write_at(&self, page: u64, off: usize, data: &[u8]) -> Result<u64, WriteError> {
        PageCache::write_at(self, page, off, data)
    }
    fn evict(&self, page: u64) -> Evicted {
        PageCache::evict(self, page)
    }
    fn stats(&self) -> pagewire_node::Stats {
        PageCache::stats(self)
    }
    fn set_policy(&self, p: CachePolicy) {
        PageCache::set_policy(self, p)
    }
    fn read_into(&self, page: u64, buf: &mut [u8]) -> Result<usize, ReadError> {
        PageCache::read_into(self, page, buf)
    }
}

#[test]
fn faults_in_and_hits() {
    each_variant(|open| {
        let (_d, path) = file(64, 0);
        let c = open(&path, cfg(16));
        for p in [0, 5, 63] {
            let bytes = c.read(p).unwrap();
            assert_eq!(pattern::verify(p, &bytes), Ok(0));
        }
        assert!(c.cached(5));
        let s = c.stats();
        assert_eq!(s.misses, 3);
        assert!(s.hits >= 1);
    });
}

#[test]
fn more_pages_than_frames_evicts_and_stays_correct() {
    each_variant(|open| {
        let (_d, path) = file(200, 0);
        let c = open(&path, cfg(8));
        for round in 0..3 {
            for p in 0..200 {
                let bytes = c.read(p).unwrap();
                assert_eq!(pattern::verify(p, &bytes), Ok(0), "round {round} page {p}");
            }
        }
        assert!(c.stats().evictions > 0);
    });
}

#[test]
fn sequential_faults_read_ahead() {
    let (_d, path) = file(256, 0);
    let c = PageCache::open(&path, cfg(256)).unwrap();
    for p in 0..256 {
        pattern::verify(p, &c.get(p).unwrap()).unwrap();
    }
    let s = c.stats();
    assert!(s.readahead > 100, "readahead {s:?}");
    assert!(s.faults < 64, "one backing read per window, got {s:?}");
}

#[test]
fn writes_are_copy_on_write_and_written_through() {
    each_variant(|open| {
        let (_d, path) = file(8, 0);
        let c = open(&path, cfg(4));
        let old = c.read(3).unwrap();
        let mut new = vec![0u8; PS];
        pattern::fill(3, 1, &mut new);
        c.write(3, &new).unwrap();
        assert_eq!(pattern::verify(3, &c.read(3).unwrap()), Ok(1));
        assert_eq!(
            pattern::verify(3, &old),
            Ok(0),
            "a reader's old copy is not changed under it"
        );
        // Write-through: the file has it, even after eviction.
        assert_eq!(c.evict(3), Evicted::Yes);
        assert_eq!(pattern::verify(3, &c.read(3).unwrap()), Ok(1));
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!(pattern::verify(3, &on_disk[3 * PS..4 * PS]), Ok(1));
        // Uncached page, partial write: read-modify-write.
        assert_eq!(c.evict(5), Evicted::NotCached);
        c.write_at(5, 100, &[0xAB]).unwrap();
        let b = c.read(5).unwrap();
        assert_eq!(b[100], 0xAB);
        let mut want = vec![0u8; PS];
        pattern::fill(5, 0, &mut want);
        want[100] = 0xAB;
        assert_eq!(b, want);
        assert_eq!(std::fs::read(&path).unwrap()[5 * PS + 100], 0xAB);
    });
}

#[test]
fn held_pages_are_not_evicted() {
    let (_d, path) = file(8, 0);
    let c = PageCache::open(&path, cfg(2)).unwrap();
    let a = c.get(0).unwrap();
    let b = c.get(1).unwrap();
    assert_eq!(c.evict(0), Evicted::Busy);
    // Every frame is held: a third page cannot come in.
    assert!(matches!(c.get(2), Err(ReadError::NoFrame)));
    drop(a);
    pattern::verify(2, &c.get(2).unwrap()).unwrap();
    pattern::verify(1, &b).unwrap();
}

#[test]
fn partial_last_page() {
    let (_d, path) = file(3, 100);
    let c = PageCache::open(&path, cfg(4)).unwrap();
    assert_eq!(c.pages(), 4);
    let last = c.get(3).unwrap();
    assert_eq!(last.len(), 100);
    pattern::verify(3, &last).unwrap();
    drop(last);
    assert!(matches!(
        c.write(3, &[0u8; PS]),
        Err(WriteError::WrongLength { .. })
    ));
    let mut d = vec![0u8; 100];
    pattern::fill(3, 1, &mut d);
    c.write(3, &d).unwrap();
    assert_eq!(pattern::verify(3, &c.get(3).unwrap()), Ok(1));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 3 * PS as u64 + 100);
}

#[test]
fn bad_input_is_a_typed_error() {
    let (_d, path) = file(4, 0);
    assert!(matches!(
        PageCache::open(&path, cfg(0)),
        Err(OpenError::ZeroFrames(_))
    ));
    assert!(matches!(
        PageCache::open(
            &path,
            CacheConfig {
                page_size: 3000,
                ..cfg(4)
            }
        ),
        Err(OpenError::BadPageSize(3000))
    ));
    assert!(matches!(
        PageCache::open(&path.with_extension("nope"), cfg(4)),
        Err(OpenError::Backing { .. })
    ));
    let empty = path.with_extension("empty");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        PageCache::open(&empty, cfg(4)),
        Err(OpenError::EmptyFile(_))
    ));
    assert!(matches!(
        PageCache::open(path.parent().unwrap(), cfg(4)),
        Err(OpenError::NotAFile(_)) | Err(OpenError::Backing { .. })
    ));

    let c = PageCache::open(&path, cfg(4)).unwrap();
    assert!(matches!(
        c.get(4),
        Err(ReadError::BeyondEnd { page: 4, pages: 4 })
    ));
    assert!(matches!(
        c.write(9, &[0u8; PS]),
        Err(WriteError::BeyondEnd { .. })
    ));
    assert!(matches!(
        c.write(1, &[0u8; 10]),
        Err(WriteError::WrongLength { .. })
    ));
    assert!(matches!(
        c.write_at(1, PS - 1, &[0u8; 2]),
        Err(WriteError::WrongLength { .. })
    ));
    assert!(matches!(
        c.write_at(1, usize::MAX, &[0u8; 2]),
        Err(WriteError::WrongLength { .. })
    ));
    let mut small = [0u8; 10];
    assert!(matches!(
        c.read_into(1, &mut small),
        Err(ReadError::BufferSize { .. })
    ));
}

#[test]
fn a_shrinking_backing_file_is_an_error_not_short_data() {
    let (_d, path) = file(16, 0);
    let c = PageCache::open(&path, cfg(16)).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4 * PS as u64 + 10)
        .unwrap();
    pattern::verify(1, &c.get(1).unwrap()).unwrap();
    assert!(matches!(c.get(10), Err(ReadError::Backing(_))));
}

#[test]
fn direct_io_reads_verify() {
    let (_d, path) = file(40, 0);
    // Not every file system supports O_DIRECT (tmpfs does not): skip there.
    let Ok(c) = PageCache::open(
        &path,
        CacheConfig {
            direct_io: true,
            ..cfg(16)
        },
    ) else {
        eprintln!("O_DIRECT not supported here; skipped");
        return;
    };
    for p in 0..40 {
        pattern::verify(p, &c.get(p).unwrap()).unwrap();
    }
    c.write_at(7, 1, &[1, 2, 3]).unwrap();
    assert_eq!(&c.get(7).unwrap()[1..4], &[1, 2, 3]);
}

#[test]
fn region_is_self_describing() {
    use pagewire_node::layout::{self, RawHeader};
    assert_eq!(layout::LINE, 64);
    let (_d, path) = file(8, 0);
    let c = PageCache::open(&path, cfg(8)).unwrap();
    let g = c.get(6).unwrap();
    let frame = g.frame().unwrap();
    let generation = g.frame_generation().unwrap();
    let view = c.region();
    // SAFETY: the region is live for the cache's lifetime and nothing writes
    // it while this single-threaded test reads it.
    let raw = unsafe { std::slice::from_raw_parts(view.addr, view.len) };
    assert_eq!(&raw[..8], b"PAGEWIRE");
    let l = view.layout;
    // Find the page through the raw bucket bytes, as a remote reader would.
    let b = l.bucket(layout::bucket_of(6, l.bucket_count as u64) as usize);
    let bucket = layout::RawBucket::decode(&raw[b..b + layout::LINE]).unwrap();
    let val = bucket.find(6).expect("page 6 in its head bucket");
    assert_eq!(layout::val_frame(val), frame);
    assert_eq!(layout::val_gen32(val), generation as u32);
    let h = RawHeader::decode(&raw[l.header(frame as usize)..]).unwrap();
    let bytes = &raw[l.frame(frame as usize)..l.frame(frame as usize) + PS];
    assert!(h.validates(6, generation, bytes));
    pattern::verify(6, bytes).unwrap();
}

#[test]
fn numa_topology_and_placement() {
    let topo = pagewire_node::numa::discover();
    assert!(!topo.nodes.is_empty());
    assert!(!topo.cpus().is_empty());
    #[cfg(feature = "numa")]
    assert_eq!(topo.source, "hwloc");
    #[cfg(not(feature = "numa"))]
    assert_eq!(topo.source, "fallback");
    let (_d, path) = file(8, 0);
    let node = topo.nodes[0].os_index;
    let c = PageCache::open(
        &path,
        CacheConfig {
            numa_node: Some(node),
            ..cfg(8)
        },
    )
    .unwrap();
    let how = &c.placement().how;
    #[cfg(feature = "numa")]
    assert!(
        c.placement().node == Some(node) || how.contains("failed"),
        "{how}"
    );
    #[cfg(not(feature = "numa"))]
    assert!(how.contains("without feature"), "{how}");
    pattern::verify(1, &c.get(1).unwrap()).unwrap();
    pagewire_node::numa::pin_current_thread(topo.cpus()[0]).unwrap();
}

#[test]
fn overflow_chains_are_readable_from_raw_bytes() {
    use pagewire_node::layout::{self, RawBucket};
    let (_d, path) = file(4096, 0);
    let c = PageCache::open(&path, no_readahead(16)).unwrap();
    let l = c.region().layout;
    let n = l.bucket_count as u64;
    // Six pages of one chain: three fill the head bucket, three overflow.
    let chain: Vec<u64> = (0..4096u64)
        .filter(|&p| layout::bucket_of(p, n) == 0)
        .take(6)
        .collect();
    assert_eq!(chain.len(), 6);
    let held: Vec<_> = chain.iter().map(|&p| c.get(p).unwrap()).collect();
    // A copy of the region's bytes: the slice over the live region exists
    // only during the copy, while no thread changes the cache.
    let snapshot = |c: &PageCache| {
        let view = c.region();
        // SAFETY: the region is mapped while `c` lives; this thread is the
        // only one using the cache, and it makes no change while the
        // borrowed slice exists (it is dropped at the end of the statement).
        unsafe { std::slice::from_raw_parts(view.addr, view.len) }.to_vec()
    };
    let raw = snapshot(&c);
    for (&p, g) in chain.iter().zip(&held) {
        let mut b = RawBucket::decode(&raw[l.bucket(0)..]).unwrap();
        let mut hops = 0;
        let val = loop {
            if let Some(v) = b.find(p) {
                break v;
            }
            let o = b.next().expect("page in the chain") as usize;
            b = RawBucket::decode(&raw[l.overflow(o)..]).unwrap();
            hops += 1;
        };
        assert_eq!(Some(layout::val_frame(val)), g.frame());
        assert!(hops <= 2);
        pattern::verify(p, g).unwrap();
    }
    drop(held);
    // Evicting empties the overflow buckets; lookups still work afterwards.
    for &p in &chain {
        assert_eq!(c.evict(p), Evicted::Yes);
    }
    let raw = snapshot(&c);
    assert!(
        RawBucket::decode(&raw[l.bucket(0)..])
            .unwrap()
            .next()
            .is_none(),
        "empty overflow buckets are unlinked"
    );
    for &p in &chain {
        pattern::verify(p, &c.get(p).unwrap()).unwrap();
    }
}

#[test]
fn second_hit_admits_on_the_second_miss_only_and_serves_every_read() {
    each_variant(|open| {
        // 40 pages (the last one short) over 8 frames.
        let (_d, path) = file(39, 100);
        let c = open(&path, cfg(8));
        c.set_policy(CachePolicy {
            admission: Admission::SecondHit,
            ..CachePolicy::default()
        });
        let mut buf = vec![0u8; PS];
        for p in 0..40 {
            // First miss: correct bytes, not cached.
            pattern::verify(p, &c.read(p).unwrap()).unwrap();
            assert!(!c.cached(p), "page {p} admitted on its first miss");
            assert_eq!(c.stats().admissions_skipped, p + 1);
            // Second miss (through the copy-out path on odd pages): admitted.
            if p % 2 == 1 {
                let n = c.read_into(p, &mut buf).unwrap();
                pattern::verify(p, &buf[..n]).unwrap();
            } else {
                pattern::verify(p, &c.read(p).unwrap()).unwrap();
            }
            assert!(c.cached(p), "page {p} not admitted on its second miss");
            // A hit stays a hit.
            pattern::verify(p, &c.read(p).unwrap()).unwrap();
        }
        let s = c.stats();
        assert_eq!(s.admissions_skipped, 40);
        assert!(s.evictions >= 32, "{s:?}");
        // An admitted page that was evicted starts over (the ghost set
        // forgot it when it was admitted).
        let _ = c.evict(3);
        pattern::verify(3, &c.read(3).unwrap()).unwrap();
        assert!(!c.cached(3));
        assert_eq!(c.stats().admissions_skipped, 41);
        // A write of an uncached page inserts it (write-through copy), and a
        // later read of it hits.
        let data = vec![7u8; PS];
        c.write(5, &data).unwrap();
        assert_eq!(c.read(5).unwrap(), data);
        // Back to always: the next miss is admitted at once.
        c.set_policy(CachePolicy::default());
        pattern::verify(6, &c.read(6).unwrap()).unwrap();
        assert!(c.cached(6));
    });
}

#[test]
fn fifo_evicts_the_first_inserted_and_lru_the_least_recently_hit() {
    use pagewire_node::policy::Eviction;
    each_variant(|open| {
        for (eviction, victim) in [(Eviction::Fifo, 0), (Eviction::Lru, 1)] {
            let (_d, path) = file(16, 0);
            // 8 frames: no more than the sample, so the choice is exact.
            let c = open(
                &path,
                CacheConfig {
                    readahead_max: 0,
                    evict_batch: 1,
                    ..cfg(8)
                },
            );
            c.set_policy(CachePolicy {
                eviction,
                ..CachePolicy::default()
            });
            for p in 0..8 {
                pattern::verify(p, &c.read(p).unwrap()).unwrap();
            }
            // Hits of page 0 (both paths) after page 7 was inserted.
            pattern::verify(0, &c.read(0).unwrap()).unwrap();
            let mut buf = vec![0u8; PS];
            c.read_into(0, &mut buf).unwrap();
            pattern::verify(8, &c.read(8).unwrap()).unwrap();
            assert_eq!(c.stats().evictions, 1, "{eviction:?}");
            for p in 0..9 {
                assert_eq!(c.cached(p), p != victim, "{eviction:?}: page {p}");
            }
        }
    });
}

/// A file of `pages` whole pages and `extra` bytes on a file system that
/// takes O_DIRECT (the target dir, not a tmpfs `/tmp`).
fn direct_file(pages: u64, extra: u64) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("data");
    pattern::generate_file(&path, pages * PS as u64 + extra, PS).unwrap();
    (dir, path)
}

/// O_DIRECT reads of a file whose size is not a multiple of the page size:
/// the last page comes back short (`page_len`), on every read path: a
/// single fault, a readahead run that ends on it, a second-hit private
/// read and the read-modify-write of a partial write.
#[test]
fn direct_io_reads_the_partial_last_page() {
    let (_d, path) = direct_file(3, 100);
    let open = |readahead_max| {
        PageCache::open(
            &path,
            CacheConfig {
                direct_io: true,
                readahead_max,
                ..cfg(8)
            },
        )
    };
    let c = match open(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("O_DIRECT refused by the file system of {path:?} ({e}); skipped");
            return;
        }
    };
    let last = c.get(3).expect("O_DIRECT fault of the partial last page");
    assert_eq!(last.len(), 100);
    pattern::verify(3, &last).unwrap();
    drop(last);

    // A readahead run that ends on the partial page.
    let c = open(32).unwrap();
    pattern::verify(0, &c.get(0).unwrap()).unwrap();
    pattern::verify(1, &c.get(1).unwrap()).unwrap();
    assert!(c.lookup(3).is_some(), "the run read ahead to the last page");
    pattern::verify(3, &c.get(3).unwrap()).unwrap();

    // Second hit: the first miss reads into a private buffer.
    let c = open(0).unwrap();
    c.set_policy(CachePolicy {
        admission: Admission::SecondHit,
        ..CachePolicy::default()
    });
    let mut buf = vec![0u8; PS];
    assert_eq!(c.read_into(3, &mut buf).unwrap(), 100);
    pattern::verify(3, &buf[..100]).unwrap();

    // A partial write of the uncached last page reads the rest of it first.
    let c = open(0).unwrap();
    c.write_at(3, 1, &[7, 8]).unwrap();
    assert_eq!(
        &c.get(3).unwrap()[..4],
        &{
            let mut want = vec![0u8; 100];
            pattern::fill(3, 0, &mut want);
            want[1] = 7;
            want[2] = 8;
            want
        }[..4]
    );
}

/// Readahead never crosses the end of the faulting page's extent: pages of
/// an extent the node may not answer for must not enter its region.
#[test]
fn readahead_stops_at_the_extent_boundary() {
    const EXTENT: u64 = 8;
    let (_d, path) = file(64, 0);
    let c = PageCache::open(
        &path,
        CacheConfig {
            readahead_max: 32,
            extent_pages: EXTENT,
            ..cfg(64)
        },
    )
    .unwrap();
    // A sequential scan of extent 0, ending on its last page.
    for p in 0..EXTENT {
        pattern::verify(p, &c.get(p).unwrap()).unwrap();
    }
    assert!(
        c.stats().readahead > 0,
        "the scan read ahead: {:?}",
        c.stats()
    );
    for p in EXTENT..2 * EXTENT {
        assert!(c.lookup(p).is_none(), "page {p} of extent 1 was read ahead");
    }
    assert_eq!(c.cached_pages_outside(|p| p < EXTENT), None);
    // Extent 1 reads ahead within itself just the same.
    for p in EXTENT..2 * EXTENT {
        pattern::verify(p, &c.get(p).unwrap()).unwrap();
    }
    assert_eq!(c.cached_pages_outside(|p| p < 2 * EXTENT), None);
    assert_eq!(c.cached_pages_outside(|p| p < EXTENT), Some(EXTENT));
}

/// Evicting a range drops every page of it, even one a reader still holds:
/// the held copy is unpublished at once and freed when the reader lets go.
#[test]
fn evicting_a_range_unpublishes_held_pages() {
    let (_d, path) = file(16, 0);
    let c = PageCache::open(&path, no_readahead(8)).unwrap();
    let held = c.get(2).unwrap();
    pattern::verify(3, &c.get(3).unwrap()).unwrap();
    let free = c.free_frames();
    let (gone, still_held) = c.evict_range(0, 8);
    assert_eq!(
        (gone, still_held),
        (2, 1),
        "both pages dropped, one still held"
    );
    assert!(c.lookup(2).is_none(), "a held page stayed published");
    assert!(c.lookup(3).is_none());
    // The reader's copy stays intact and its frame comes back on drop.
    pattern::verify(2, &held).unwrap();
    assert_eq!(c.free_frames(), free + 1);
    drop(held);
    assert_eq!(c.free_frames(), free + 2);
    pattern::verify(2, &c.get(2).unwrap()).unwrap();
}

/// Pages lent under a pin (`lookup_pinned`) keep their bytes while the
/// page is rewritten, evicted and its frame wanted for other pages; a
/// lookup after a write under the same pin sees the write; a miss is a
/// miss (no fault); frames freed meanwhile come back once the pin drops.
fn pinned_lookups_outlive_writes_and_evictions<I: Index>() {
    let (_d, path) = file(16, 0);
    let c = PageCache::<I>::open_with(&path, no_readahead(4)).unwrap();
    drop((c.get(1).unwrap(), c.get(2).unwrap()));
    let pin = Pin::new();
    assert!(
        c.lookup_pinned(3, &pin).is_none(),
        "a pinned lookup does not fault"
    );
    let hits = c.stats().hits;
    let one = c.lookup_pinned(1, &pin).unwrap();
    let two = c.lookup_pinned(2, &pin).unwrap();
    assert_eq!(c.stats().hits, hits + 2, "pinned hits are counted");
    assert_eq!(pattern::verify(1, one).unwrap(), 0);
    assert_eq!(pattern::verify(2, two).unwrap(), 0);

    let mut page = vec![0u8; PS];
    pattern::fill(1, 1, &mut page);
    c.write(1, &page).unwrap();
    assert_eq!(
        pattern::verify(1, c.lookup_pinned(1, &pin).unwrap()).unwrap(),
        1,
        "the write is seen"
    );
    assert_eq!(
        c.evict(2),
        Evicted::Yes,
        "a pinned lookup holds no reference"
    );
    assert!(c.lookup_pinned(2, &pin).is_none());
    // Every other page wants a frame; those freed above wait for the pin.
    let mut no_frame = 0;
    for p in 3..16 {
        match c.get(p) {
            Ok(r) => assert_eq!(pattern::verify(p, &r).unwrap(), 0),
            Err(ReadError::NoFrame) => no_frame += 1,
            Err(e) => panic!("page {p}: {e}"),
        }
    }
    assert_eq!(
        pattern::verify(1, one).unwrap(),
        0,
        "lent bytes changed after a write"
    );
    assert_eq!(
        pattern::verify(2, two).unwrap(),
        0,
        "lent bytes changed after eviction"
    );
    drop(pin);
    for p in 0..16 {
        let want = u64::from(p == 1);
        assert_eq!(
            pattern::verify(p, &c.get(p).unwrap()).unwrap(),
            want,
            "page {p}"
        );
    }
    println!(
        "{}: {no_frame} of 13 faults under the pin found no frame",
        I::KIND.name()
    );
}

#[test]
fn pinned_lookups_outlive_writes_and_evictions_every_variant() {
    pinned_lookups_outlive_writes_and_evictions::<Lockless>();
    pinned_lookups_outlive_writes_and_evictions::<RwLocked>();
    pinned_lookups_outlive_writes_and_evictions::<Mutexed>();
    pinned_lookups_outlive_writes_and_evictions::<Sharded>();
}

/// A thread that keeps its pin and repins it (`Pin::repin`) between lookups
/// does not hold back what was freed before: another thread's fault that
/// needs a frame freed while the pin was older gets it once the pin moves.
/// Held without repinning, the same pin keeps that fault at `NoFrame`.
#[test]
fn a_repinned_pin_lets_frames_freed_before_it_come_back() {
    let (_d, path) = file(16, 0);
    let c = PageCache::<Lockless>::open_with(&path, no_readahead(4)).unwrap();
    for p in 0..4 {
        drop(c.get(p).unwrap());
    }
    let mut pin = Pin::new();
    assert_eq!(
        pattern::verify(0, c.lookup_pinned(0, &pin).unwrap()).unwrap(),
        0
    );
    // Every frame is freed while the pin lives: each waits for it.
    for p in 0..4 {
        assert_eq!(c.evict(p), Evicted::Yes);
    }
    let fault = |page| std::thread::scope(|s| s.spawn(|| c.get(page).map(drop)).join().unwrap());
    assert!(
        matches!(fault(5), Err(ReadError::NoFrame)),
        "a held pin keeps the frames freed after it out of use"
    );
    let done = std::sync::atomic::AtomicBool::new(false);
    let got = std::thread::scope(|s| {
        let t = s.spawn(|| {
            let r = c.get(6).map(drop);
            done.store(true, std::sync::atomic::Ordering::Release);
            r
        });
        while !done.load(std::sync::atomic::Ordering::Acquire) {
            pin.repin();
            assert!(c.lookup_pinned(0, &pin).is_none(), "page 0 was evicted");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        t.join().unwrap()
    });
    got.expect("a fault while the pin moves gets a frame freed before");
    pattern::verify(6, c.lookup_pinned(6, &pin).unwrap()).unwrap();
}

/// A write that finds every frame held by readers reports
/// `WriteError::NoFrame`, the variant callers match on (it came back as
/// `WriteError::Read(NoFrame)` before, which the stress writer's
/// `NoFrame` arm never caught).
#[test]
fn a_write_with_every_frame_held_is_no_frame() {
    let (_d, path) = file(8, 0);
    let c = PageCache::open(&path, no_readahead(2)).unwrap();
    let held = (c.get(0).unwrap(), c.get(1).unwrap());
    let mut page = vec![0u8; PS];
    pattern::fill(5, 1, &mut page);
    match c.write(5, &page) {
        Err(WriteError::NoFrame) => {}
        other => panic!("expected WriteError::NoFrame, got {other:?}"),
    }
    drop(held);
    c.write(5, &page).unwrap();
    assert_eq!(pattern::verify(5, &c.get(5).unwrap()).unwrap(), 1);
}

/// A cache with a frame for every page of the file holds all of it: after
/// a preload, sequential passes over the file never miss (a cache one
/// frame short would miss on every page of such a pass under CLOCK).
#[test]
fn a_cache_as_large_as_the_file_holds_all_of_it() {
    const PAGES: u64 = 8192;
    let (_d, path) = file(PAGES, 0);
    let c = PageCache::<Lockless>::open_with(&path, cfg(PAGES as usize)).unwrap();
    c.preload(0, PAGES).unwrap();
    let after_preload = c.stats();
    for pass in 0..3 {
        for p in 0..PAGES {
            pattern::verify(p, &c.get(p).unwrap()).unwrap();
        }
        let s = c.stats();
        assert_eq!(
            (s.misses, s.evictions),
            (after_preload.misses, after_preload.evictions),
            "pass {pass}: {s:?}, after the preload {after_preload:?}"
        );
    }
}
