//! [`PageCache`]: one node's share of a big file in a lockless page cache.
//!
//! * Hit: [`Core::lookup`] (no lock; see [`crate::raw::index`]).
//! * Miss: claim the page (single flight), read it and any readahead window
//!   from the backing file into fresh frames with one `preadv`, publish and
//!   gang-insert them, release the claim. Under the `second-hit` admission
//!   policy a page's first miss (per the ghost set, [`crate::ghost`]) reads
//!   it into a private buffer instead: served, never published.
//!   The readahead window never crosses the end of the faulting page's
//!   extent ([`CacheConfig::extent_pages`]): a node must not cache pages of
//!   an extent it does not answer for.
//! * No free frame: [`PageCache::reclaim`] evicts unreferenced, unheld
//!   frames by the policy ([`crate::policy`]): a CLOCK sweep (`clock`), or
//!   the oldest stamp of random samples (`lru`: last hit, `fifo`: fill).
//! * Dropping a range ([`PageCache::evict_range`], an extent the node no
//!   longer answers for): close it against fills already under way, then
//!   claim each page in turn and unlink its copy even if readers hold it
//!   (the protocol is in [`crate::flight`]).
//! * Write: claim the page, fill a fresh frame (copy-on-write), write the
//!   bytes through to the backing file, swap the index entry, retire the old
//!   frame, then acknowledge.

use crate::backing::BackingFile;
use crate::core::{Core, Dropped, Lost, Sweep};
use crate::error::{OpenError, ReadError, WriteError};
use crate::flight::{Began, Claim, Claimed, Closes, Flights};
use crate::ghost::GhostSet;
use crate::index::{Index, IndexKind, Lockless};
use crate::layout::{IndexCode, RegionLayout};
use crate::page_ref::{Held, PageRef, Pin};
use crate::policy::{Admission, CachePolicy, Eviction};
use crate::raw::frames::Frames;
use crate::raw::region::Region;
use crate::stats::{Counter, Counters, Stats};
use std::cell::Cell;
use std::path::Path;

mod reclaim;

/// How a cache is set up.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Bytes per page (power of two, 512 B ..= 1 MiB).
    pub page_size: usize,
    /// Frames in the cache (its capacity in pages).
    pub frames: usize,
    /// Read the backing file with O_DIRECT (bypass the kernel's page cache).
    pub direct_io: bool,
    /// `fdatasync` after each write-through, before the write is acknowledged.
    pub sync_writes: bool,
    /// Largest readahead window in pages (0 turns readahead off).
    pub readahead_max: usize,
    /// Frames one reclaim (CLOCK sweep or sampled eviction) frees at once.
    pub evict_batch: usize,
    /// Bind the region to this NUMA node (needs feature `numa`).
    pub numa_node: Option<usize>,
    /// Pages per extent of the ownership map: readahead stops at the end of
    /// the faulting page's extent (0: no extents, only the file bounds it).
    /// A node learns it from the map ([`PageCache::set_extent_pages`]).
    pub extent_pages: u64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            page_size: 4096,
            frames: 1 << 16,
            direct_io: false,
            sync_writes: false,
            readahead_max: 32,
            evict_batch: 32,
            numa_node: None,
            extent_pages: 0,
        }
    }
}

/// The registered memory of a cache: what a transport registers and what a
/// remote reader decodes with [`crate::layout`].
#[derive(Clone, Copy, Debug)]
pub struct RegionView {
    pub addr: *const u8,
    pub len: usize,
    pub layout: RegionLayout,
}

/// The outcome of evicting one page.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Evicted {
    Yes,
    /// A reader holds the page's frame.
    Busy,
    NotCached,
}

/// A page cache over one backing file, generic over its index variant.
pub struct PageCache<I: Index = Lockless> {
    core: Core<I>,
    file: BackingFile,
    flights: Flights,
    closes: Closes,
    /// Pages per extent (0: none); [`CacheConfig::extent_pages`].
    extent_pages: std::sync::atomic::AtomicU64,
    stats: Counters,
    cfg: CacheConfig,
    pages: u64,
    numa: crate::numa::Placement,
    policy: std::sync::Mutex<CachePolicy>,
    /// Admission, copied out of `policy` for the miss path.
    second_hit: std::sync::atomic::AtomicBool,
    ghost: GhostSet,
    /// Set once a frame was wanted with none free: from then on the cache
    /// keeps a reserve of free frames (`reclaim.rs`). Until then it has
    /// never had to evict, so it holds as many pages as it has frames.
    pressed: std::sync::atomic::AtomicBool,
}

/// What a fill did with the first page of its run.
enum First {
    /// Published; its frame, with a reference held.
    Frame(u32),
    /// Dropped since the fill began: its bytes at `buf[off..]`, unpublished.
    Private { buf: Vec<u8>, off: usize },
    /// Another copy of it was indexed first.
    Lost,
}

/// What a fault produced.
enum Faulted {
    /// The page's frame, with a reference held.
    Frame(u32),
    /// Not admitted: its bytes at `buf[off..]`.
    Uncached { buf: Vec<u8>, off: usize },
}

thread_local! {
    /// Per-thread sequential-fault detector: (cache id, next page, window).
    static READAHEAD: Cell<(usize, u64, usize)> = const { Cell::new((0, u64::MAX, 0)) };
}

impl PageCache<Lockless> {
    /// Open a cache with the lockless index.
    pub fn open(path: &Path, cfg: CacheConfig) -> Result<Self, OpenError> {
        Self::open_with(path, cfg)
    }
}

impl<I: Index> PageCache<I> {
    /// Open a cache with index variant `I`, its region in anonymous private
    /// memory (transparent huge pages where the kernel gives them): served
    /// locally, or by a transport that registers this process's memory.
    pub fn open_with(path: &Path, cfg: CacheConfig) -> Result<Self, OpenError> {
        Self::open_on(path, cfg, None)
    }

    /// Open a cache whose region lives in `shared`, memory that a transport
    /// registered and serves (an `shm` region that other processes map
    /// read-only, say). `shared` must be fresh (zero-filled), page-aligned
    /// and at least [`PageCache::region_len`] bytes; the cache keeps it
    /// alive. `None` is [`PageCache::open_with`].
    pub fn open_on(
        path: &Path,
        cfg: CacheConfig,
        shared: Option<Box<dyn pagewire_rdma::LocalRegion>>,
    ) -> Result<Self, OpenError> {
        if cfg.frames == 0 {
            return Err(OpenError::ZeroFrames(0));
        }
        if !cfg.page_size.is_power_of_two() || !(512..=1 << 20).contains(&cfg.page_size) {
            return Err(OpenError::BadPageSize(cfg.page_size));
        }
        if cfg.frames >= u32::MAX as usize {
            return Err(OpenError::TooManyFrames { frames: cfg.frames });
        }
        let layout = RegionLayout::new(cfg.page_size, cfg.frames);
        // Overflow buckets are linked by a 32-bit index + 1.
        if layout.overflow_count >= u32::MAX as usize {
            return Err(OpenError::TooManyFrames { frames: cfg.frames });
        }
        let file = BackingFile::open(path, cfg.page_size, cfg.direct_io, cfg.sync_writes)?;
        let index = match I::KIND {
            IndexKind::Lockless => IndexCode::Lockless,
            IndexKind::RwLock => IndexCode::RwLock,
            IndexKind::Mutex => IndexCode::Mutex,
            IndexKind::Sharded => IndexCode::Sharded,
        };
        let region = Region::with_memory(layout, file.pages(), file.len(), index, shared).map_err(
            |source| OpenError::Alloc {
                len: layout.len,
                source,
            },
        )?;
        let (addr, len) = region.raw();
        let numa = crate::numa::place(addr, len, cfg.numa_node);
        let pages = file.pages();
        let frames = cfg.frames;
        Ok(Self {
            core: Core::new(Frames::new(region)),
            file,
            flights: Flights::new(),
            closes: Closes::new(),
            extent_pages: std::sync::atomic::AtomicU64::new(cfg.extent_pages),
            stats: Counters::new(),
            cfg,
            pages,
            numa,
            policy: std::sync::Mutex::new(CachePolicy::default()),
            second_hit: std::sync::atomic::AtomicBool::new(false),
            pressed: std::sync::atomic::AtomicBool::new(false),
            ghost: GhostSet::new(frames),
        })
    }

    /// Bytes of the region of a cache of `frames` frames of `page_size`
    /// bytes: what [`PageCache::open_on`] needs.
    pub fn region_len(page_size: usize, frames: usize) -> usize {
        RegionLayout::new(page_size, frames).len
    }

    /// The index variant.
    pub fn index_kind(&self) -> IndexKind {
        I::KIND
    }

    /// Pages in the backing file.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    pub fn page_size(&self) -> usize {
        self.cfg.page_size
    }

    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// Pages per extent readahead stays within (0: no extents).
    pub fn extent_pages(&self) -> u64 {
        self.extent_pages.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Set the pages per extent (the ownership map's extent size over the
    /// page size; 0: no extents). Call it before the first fault of a page
    /// of an extent the node answers for, and again if the map's extent size
    /// changes (with every extent evicted).
    pub fn set_extent_pages(&self, pages: u64) {
        self.extent_pages
            .store(pages, std::sync::atomic::Ordering::Relaxed);
    }

    /// The first page past `page`'s extent (`u64::MAX` with no extents).
    pub(crate) fn extent_end(&self, page: u64) -> u64 {
        match self.extent_pages() {
            0 => u64::MAX,
            n => (page / n).saturating_add(1).saturating_mul(n),
        }
    }

    /// Frames not holding a page now.
    pub fn free_frames(&self) -> usize {
        self.core.frames.free_count()
    }

    /// Where the region's memory was placed.
    pub fn placement(&self) -> &crate::numa::Placement {
        &self.numa
    }

    /// The backing file.
    pub fn backing(&self) -> &BackingFile {
        &self.file
    }

    /// The registered region, for transports and remote readers.
    pub fn region(&self) -> RegionView {
        let (addr, len) = self.core.frames.region().raw();
        RegionView {
            addr,
            len,
            layout: *self.core.frames.region().layout(),
        }
    }

    /// The admission and eviction policies in force.
    pub fn policy(&self) -> CachePolicy {
        *self.policy.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Switch policies; takes effect for the next miss and eviction.
    pub fn set_policy(&self, p: CachePolicy) {
        let mut cur = self.policy.lock().unwrap_or_else(|e| e.into_inner());
        self.second_hit.store(
            p.admission == Admission::SecondHit,
            std::sync::atomic::Ordering::Relaxed,
        );
        self.core
            .frames
            .set_stamp_mode(if p.eviction == Eviction::Lru {
                crate::raw::frames::STAMP_ON_HIT
            } else {
                crate::raw::frames::STAMP_ON_INSERT
            });
        *cur = p;
    }

    /// Bytes of bookkeeping the policies keep besides the region (the
    /// ghost set of `second-hit`, allocated at open whatever the policy).
    pub fn policy_memory(&self) -> usize {
        self.ghost.len() * 8
    }

    /// Announce a new node epoch in the superblock.
    pub fn set_epoch(&self, epoch: u64) {
        self.core.frames.region().set_epoch(epoch);
    }

    pub fn stats(&self) -> Stats {
        self.stats.snapshot()
    }

    fn check_page(&self, page: u64) -> Result<(), ReadError> {
        if page >= self.pages {
            return Err(ReadError::BeyondEnd {
                page,
                pages: self.pages,
            });
        }
        Ok(())
    }

    #[inline(always)]
    fn page_ref(&self, page: u64, frame: u32) -> PageRef<'_> {
        PageRef {
            inner: Held::Frame {
                frames: &self.core.frames,
                frame,
            },
            len: self.file.page_len(page),
        }
    }

    /// The page if it is cached, without faulting it in.
    #[inline(always)]
    pub fn lookup(&self, page: u64) -> Option<PageRef<'_>> {
        Some(self.page_ref(page, self.hit(page)?))
    }

    /// Where the page is cached: its frame and the frame's generation,
    /// without faulting it in and without counting a hit (what a fault's
    /// readahead tells a remote reader, which validates the frame anyway
    /// when it reads it).
    pub fn location(&self, page: u64) -> Option<(u32, u64)> {
        let mut retries = 0;
        let frame = self.core.lookup(page, &mut retries)?;
        // With the reference held the frame is not refilled, so its
        // generation is the one the lookup found published.
        let generation = self
            .core
            .frames
            .header(frame)
            .generation
            .load(crate::sync::Ordering::Relaxed);
        self.core.frames.put(frame);
        Some((frame, generation))
    }

    /// A hit's frame, with a reference held and counted.
    #[inline(always)]
    fn hit(&self, page: u64) -> Option<u32> {
        let mut retries = 0;
        let hit = self.core.lookup(page, &mut retries);
        self.stats.add(Counter::Retries, retries);
        let f = hit?;
        self.stats.add(Counter::Hits, 1);
        Some(f)
    }

    /// The page, faulted in from the backing file on a miss (zero-copy).
    /// The `PageRef` is built after the hit and miss paths meet, so a hit
    /// hands it back in registers.
    #[inline(always)]
    pub fn get(&self, page: u64) -> Result<PageRef<'_>, ReadError> {
        let inner = match self.hit(page) {
            Some(frame) => Held::Frame {
                frames: &self.core.frames,
                frame,
            },
            None => match self.get_missed(page)? {
                Faulted::Frame(frame) => Held::Frame {
                    frames: &self.core.frames,
                    frame,
                },
                Faulted::Uncached { buf, off } => Held::Uncached(Box::new((buf, off))),
            },
        };
        Ok(PageRef {
            inner,
            len: self.file.page_len(page),
        })
    }

    /// The page's bytes if it is cached, lent for as long as `pin` lives,
    /// without faulting it in. A hit takes no reference and stores nothing
    /// shared (with the lockless index): readers of one hot page do not
    /// contend, unlike [`PageCache::lookup`]'s counted reference. The bytes
    /// are the page's published copy when it was found (a later write makes
    /// a new copy; eviction frees the frame only after `pin` drops). There
    /// is no faulting variant on purpose: a fault may wait for another
    /// thread's fill, which may wait for frames that wait for this pin. On a
    /// miss, drop the pin (or finish the batch) and use [`PageCache::get`].
    #[inline(always)]
    pub fn lookup_pinned<'p>(&'p self, page: u64, pin: &'p Pin) -> Option<&'p [u8]> {
        let mut retries = 0;
        let hit = self.core.lookup_pinned(page, &pin.0, &mut retries);
        if retries > 0 {
            self.stats.add(Counter::Retries, retries);
        }
        let frame = hit?;
        self.stats.add(Counter::Hits, 1);
        let len = self.file.page_len(page);
        // SAFETY: `frame` was found published as `page` after `pin` was
        // taken, and every free of a published frame waits for the grace
        // period of the pins older than it, so the frame is not refilled
        // while `pin` lives; a published frame's bytes are never written
        // (writes copy on write). The slice borrows `pin`, so it cannot
        // outlive it.
        Some(unsafe { &self.core.frames.region().frame(frame)[..len] })
    }

    /// [`PageCache::get`] after a miss, out of line: the hit path inlines.
    #[inline(never)]
    fn get_missed(&self, page: u64) -> Result<Faulted, ReadError> {
        self.check_page(page)?;
        self.fault(page)
    }

    /// Copy the page into `buf` (at least the page's length); returns the
    /// number of bytes copied. With the lockless index a hit takes no
    /// reference: it copies the frame between two loads of its generation
    /// and retries if the frame changed (no store, so readers of one hot page
    /// do not contend); a miss faults the page in.
    pub fn read_into(&self, page: u64, buf: &mut [u8]) -> Result<usize, ReadError> {
        let mut retries = 0;
        let copied = self
            .core
            .index
            .copy_out(&self.core.frames, page, buf, &mut retries);
        if retries > 0 {
            self.stats.add(Counter::Retries, retries);
        }
        match copied {
            Some(Ok(Some((_, len)))) => {
                self.stats.add(Counter::Hits, 1);
                return Ok(len);
            }
            Some(Err(need)) => {
                return Err(ReadError::BufferSize {
                    page,
                    need,
                    got: buf.len(),
                });
            }
            Some(Ok(None)) | None => {}
        }
        let r = self.get(page)?;
        let Some(dst) = buf.get_mut(..r.len()) else {
            return Err(ReadError::BufferSize {
                page,
                need: r.len(),
                got: buf.len(),
            });
        };
        dst.copy_from_slice(&r);
        Ok(r.len())
    }

    /// Copy `buf.len()` bytes of the page starting at `offset` into `buf`.
    pub fn read_at(&self, page: u64, offset: usize, buf: &mut [u8]) -> Result<(), ReadError> {
        let r = self.get(page)?;
        let Some(src) = r.get(offset..offset.saturating_add(buf.len())) else {
            return Err(ReadError::BufferSize {
                page,
                need: offset.saturating_add(buf.len()),
                got: r.len(),
            });
        };
        buf.copy_from_slice(src);
        Ok(())
    }

    /// Fault `page` in; returns its frame with a reference held, or its
    /// bytes if the admission policy keeps it out.
    #[cold]
    fn fault(&self, page: u64) -> Result<Faulted, ReadError> {
        self.stats.add(Counter::Misses, 1);
        let began = self.closes.begin();
        loop {
            let claim = match self.flights.claim(page) {
                Claimed::Now(c) => c,
                Claimed::AfterWait(c) => {
                    self.stats.add(Counter::FlightWaits, 1);
                    c
                }
            };
            // Someone may have filled it between our miss and our claim.
            let mut retries = 0;
            let hit = self.core.lookup(page, &mut retries);
            self.stats.add(Counter::Retries, retries);
            if let Some(f) = hit {
                return Ok(Faulted::Frame(f));
            }
            let second_hit = self.second_hit.load(std::sync::atomic::Ordering::Relaxed);
            if second_hit && !self.ghost.second_miss(page) {
                // First miss: read it for the caller only. The claim is held
                // so that no write of the page runs between the read and
                // the return (the bytes are current when they are served).
                let r = self.read_uncached(page);
                drop(claim);
                return r;
            }
            // No readahead under second-hit: the pages ahead did not miss.
            let ahead = if second_hit {
                0
            } else {
                self.readahead_window(page)
            };
            let mut claims = vec![claim];
            let end = (page + 1 + ahead as u64)
                .min(self.pages)
                .min(self.extent_end(page));
            for p in page + 1..end {
                if self.is_cached(p) {
                    break;
                }
                match self.flights.try_claim(p) {
                    Some(c) => claims.push(c),
                    None => break,
                }
            }
            match self.fill_run(&claims, began)? {
                (First::Frame(f), read) => {
                    self.note_fault(page, read);
                    return Ok(Faulted::Frame(f));
                }
                // Dropped since this fault began: served, not published.
                (First::Private { buf, off }, _) => return Ok(Faulted::Uncached { buf, off }),
                // Lost an insert race to a writer-allocated copy: look again.
                (First::Lost, _) => continue,
            }
        }
    }

    /// Read `page` from the backing file into a private buffer, aligned for
    /// O_DIRECT; nothing of the cache changes.
    fn read_uncached(&self, page: u64) -> Result<Faulted, ReadError> {
        let ps = self.cfg.page_size;
        let mut buf = vec![0u8; 2 * ps];
        let off = buf.as_ptr().align_offset(ps);
        self.file
            .read_frames(page, &mut [&mut buf[off..off + ps]])?;
        self.stats.add(Counter::Faults, 1);
        self.stats.add(Counter::PagesRead, 1);
        self.stats.add(Counter::AdmitSkipped, 1);
        Ok(Faulted::Uncached { buf, off })
    }

    fn is_cached(&self, page: u64) -> bool {
        self.location(page).is_some()
    }

    /// Read the claimed run of pages into fresh frames and gang-insert those
    /// not dropped since `began` (the filler's start, [`crate::flight`]).
    /// Returns what became of the first page and how many pages of the run
    /// were read: fewer than claimed when frames ran out part-way.
    fn fill_run(&self, claims: &[Claim<'_>], began: Began) -> Result<(First, usize), ReadError> {
        let first = claims[0].page();
        let mut frames = Vec::with_capacity(claims.len());
        for i in 0..claims.len() {
            // Readahead takes what is free now; only the demanded page
            // waits out grace periods.
            match self.alloc_frame_waiting(i == 0) {
                Ok(f) => frames.push(f),
                Err(e) if i == 0 => return Err(e),
                Err(_) => break,
            }
        }
        let region = self.core.frames.region();
        let ps = self.cfg.page_size;
        let spans: Vec<(*mut u8, usize)> =
            frames.iter().map(|&f| (region.frame_ptr(f), ps)).collect();
        // SAFETY: each frame was just taken off the free list by
        // `alloc_frame`: it is `Filling`, refcount 0, owned by us alone, and
        // the frames are distinct, so the spans do not overlap; each is `ps`
        // bytes inside the live region. No Rust reference to them exists; a
        // responder copying a stale location of one uses atomic loads and
        // validates, and `read_spans` writes only through the kernel and
        // atomic stores.
        let read = unsafe { self.file.read_spans(first, &spans) };
        if let Err(e) = read {
            for f in frames {
                self.core.frames.free_unpublished(f);
            }
            return Err(e.into());
        }
        self.stats.add(Counter::Faults, 1);
        self.core.frames.advance_clock();
        self.stats.add(Counter::PagesRead, frames.len() as u64);
        self.stats.add(Counter::Readahead, frames.len() as u64 - 1);
        let read = frames.len();
        // Every claim of the run is held: a drop that claimed a page before
        // us closed it first, and one that comes after waits for our release
        // and unlinks what we publish (`crate::flight`).
        let closed: Vec<bool> = (0..read)
            .map(|i| self.closes.closed_since(first + i as u64, began))
            .collect();
        let mut first_page = First::Lost;
        let mut first_full = false;
        let mut i = 0;
        while i < read {
            if closed[i] {
                let f = frames[i];
                if i == 0 {
                    first_page = self.private_copy(f, self.file.page_len(first));
                }
                self.core.frames.free_unpublished(f);
                i += 1;
                continue;
            }
            let start = i;
            while i < read && !closed[i] {
                i += 1;
            }
            let run: Vec<(u32, u32)> = (start..i)
                .map(|j| (frames[j], self.file.page_len(first + j as u64) as u32))
                .collect();
            self.core
                .insert_filled_run(first + start as u64, &run, &mut |j, r| match r {
                    Ok(f) if start + j == 0 => first_page = First::Frame(f),
                    Ok(f) => self.core.frames.put(f),
                    Err(Lost::NoRoom) if start + j == 0 => first_full = true,
                    Err(_) => {}
                });
        }
        if first_full {
            return Err(ReadError::IndexFull);
        }
        Ok((first_page, read))
    }

    /// The first `len` bytes of frame `f`, which the caller filled and still
    /// owns, copied into a private buffer aligned like [`Self::read_uncached`]'s.
    fn private_copy(&self, f: u32, len: usize) -> First {
        let ps = self.cfg.page_size;
        let mut buf = vec![0u8; 2 * ps];
        let off = buf.as_ptr().align_offset(ps);
        // SAFETY: the caller owns `f` (`Filling`, refcount 0, never
        // published): nothing writes its bytes while we copy them.
        unsafe {
            self.core
                .frames
                .region()
                .read(f, |b| buf[off..off + len].copy_from_slice(&b[..len]))
        };
        self.stats.add(Counter::AdmitSkipped, 1);
        First::Private { buf, off }
    }

    /// Readahead: the window for a fault on `page` by this thread.
    fn readahead_window(&self, page: u64) -> usize {
        if self.cfg.readahead_max == 0 {
            return 0;
        }
        let id = self as *const Self as usize;
        READAHEAD.with(|ra| {
            let (cache, next, window) = ra.get();
            if cache == id && next == page {
                (window * 2).clamp(2, self.cfg.readahead_max)
            } else {
                0
            }
        })
    }

    fn note_fault(&self, page: u64, read: usize) {
        let id = self as *const Self as usize;
        READAHEAD.with(|ra| ra.set((id, page + read as u64, read.saturating_sub(1))));
    }

    /// Evict one page if it is cached and no reader holds it.
    pub fn evict(&self, page: u64) -> Evicted {
        let Some((f, generation)) = self.core.index.peek(&self.core.frames, page) else {
            return Evicted::NotCached;
        };
        match self.core.remove_frame(page, f, generation) {
            Sweep::Evicted => {
                self.stats.add(Counter::Evictions, 1);
                Evicted::Yes
            }
            Sweep::Busy => Evicted::Busy,
            _ => Evicted::NotCached,
        }
    }

    /// Drop the `count` pages from `first` (an extent this node no longer
    /// answers for): when this returns, no page of the range is in the index
    /// or validates for a remote reader, and no fault, readahead, preload or
    /// write that began before this call puts one back (it serves or writes
    /// through without publishing). A page readers hold is unpublished at
    /// once and its frame freed when the last of them lets go. A call that
    /// begins after this one may cache the pages again: keeping those out
    /// is the caller's admission. Returns (pages dropped, of which still
    /// held by readers).
    pub fn evict_range(&self, first: u64, count: u64) -> (u64, u64) {
        let end = first.saturating_add(count).min(self.pages);
        // Transition 2 of `crate::flight`: close, then claim page by page.
        self.closes.close(first, end);
        let (mut dropped, mut held) = (0, 0);
        for p in first..end {
            let _claim = self.flights.claim(p);
            match self.core.drop_page(p) {
                Dropped::Freed => dropped += 1,
                Dropped::Retired => {
                    dropped += 1;
                    held += 1;
                }
                Dropped::NotCached => {}
            }
        }
        self.stats.add(Counter::Evictions, dropped);
        (dropped, held)
    }

    /// The lowest page this cache holds for which `keep` is false, if any:
    /// the invariant check "only pages this node answers for are cached"
    /// (`keep(page)`: the node answers for the page's extent). Walks every
    /// frame header and confirms each candidate through the index, so a
    /// frame in flux is not reported; a page cached concurrently by a call
    /// the caller admitted may be. O(frames).
    pub fn cached_pages_outside(&self, keep: impl Fn(u64) -> bool) -> Option<u64> {
        let frames = &self.core.frames;
        let mut worst: Option<u64> = None;
        for f in 0..frames.count() as u32 {
            let h = frames.header(f);
            if h.state.load(crate::sync::Ordering::Relaxed)
                != crate::layout::FrameState::Published as u32
            {
                continue;
            }
            let page = h.page.load(crate::sync::Ordering::Relaxed);
            if keep(page) || worst.is_some_and(|w| w <= page) {
                continue;
            }
            if self
                .core
                .index
                .peek(frames, page)
                .is_some_and(|(g, _)| g == f)
            {
                worst = Some(page);
            }
        }
        worst
    }

    /// Fault in `count` pages from `first` (gang reads of up to the readahead
    /// window, or 32 pages); pages already cached are skipped.
    pub fn preload(&self, first: u64, count: u64) -> Result<u64, ReadError> {
        let began = self.closes.begin();
        let end = first.saturating_add(count).min(self.pages);
        let run = self.cfg.readahead_max.max(32);
        let mut p = first;
        let mut loaded = 0;
        while p < end {
            if self.is_cached(p) {
                p += 1;
                continue;
            }
            let Some(claim) = self.flights.try_claim(p) else {
                p += 1;
                continue;
            };
            let mut claims = vec![claim];
            while claims.len() < run {
                let q = p + claims.len() as u64;
                if q >= end || self.is_cached(q) {
                    break;
                }
                match self.flights.try_claim(q) {
                    Some(c) => claims.push(c),
                    None => break,
                }
            }
            // Advance by what was read: with frames short, the run may stop
            // early, and the rest is claimed again on the next turn.
            let (first_page, read) = self.fill_run(&claims, began)?;
            if let First::Frame(f) = first_page {
                self.core.frames.put(f);
            }
            drop(claims);
            loaded += read as u64;
            p += read as u64;
        }
        Ok(loaded)
    }

    /// Replace the whole page (`data.len()` must be the page's length).
    pub fn write(&self, page: u64, data: &[u8]) -> Result<u64, WriteError> {
        let len = self.write_len(page)?;
        if data.len() != len {
            return Err(WriteError::WrongLength {
                page,
                offset: 0,
                got: data.len(),
                len,
            });
        }
        self.write_at(page, 0, data)
    }

    fn write_len(&self, page: u64) -> Result<usize, WriteError> {
        if page >= self.pages {
            return Err(WriteError::BeyondEnd {
                page,
                pages: self.pages,
            });
        }
        Ok(self.file.page_len(page))
    }

    /// Write `data` at byte `offset` of `page`: copy-on-write into a fresh
    /// frame, write through to the backing file (and `fdatasync` if
    /// configured), publish, retire the old copy. Returns the new frame
    /// generation once the write is durable in the file and visible to
    /// every later reader.
    pub fn write_at(&self, page: u64, offset: usize, data: &[u8]) -> Result<u64, WriteError> {
        let len = self.write_len(page)?;
        if offset.checked_add(data.len()).is_none_or(|end| end > len) {
            return Err(WriteError::WrongLength {
                page,
                offset,
                got: data.len(),
                len,
            });
        }
        let began = self.closes.begin();
        let claim = self.flights.claim(page);
        let f = self.alloc_frame().map_err(|e| match e {
            ReadError::NoFrame => WriteError::NoFrame,
            e => WriteError::Read(e),
        })?;
        let ps = self.cfg.page_size;
        let whole = offset == 0 && data.len() == len;
        let filled: Result<(), WriteError> = (|| {
            let mut retries = 0;
            let old = self.core.lookup(page, &mut retries);
            let region = self.core.frames.region();
            // SAFETY: `f` came from `alloc_frame`: `Filling`, owned by us.
            unsafe {
                region.fill(f, |dst| -> Result<(), WriteError> {
                    if let Some(old) = old {
                        // SAFETY: the lookup gave us a reference on `old`.
                        region.read(old, |src| dst.copy_from_slice(src));
                        self.core.frames.put(old);
                    } else if !whole {
                        self.file.read_frames(page, &mut [&mut dst[..ps]])?;
                    }
                    dst[offset..offset + data.len()].copy_from_slice(data);
                    dst[len..].fill(0);
                    Ok(())
                })
            }?;
            self.file.write_at(page * ps as u64 + offset as u64, data)?;
            Ok(())
        })();
        if let Err(e) = filled {
            self.core.frames.free_unpublished(f);
            return Err(e);
        }
        let generation = self
            .core
            .publish_cow(page, f, len as u32)
            .map_err(|_| WriteError::IndexFull)?;
        // Dropped since this write began (`crate::flight`): the new copy is
        // current, but the page must not stay cached.
        if self.closes.closed_since(page, began) {
            let _ = self.core.drop_page(page);
        }
        drop(claim);
        self.stats.add(Counter::Writes, 1);
        self.stats.add(Counter::BytesWritten, data.len() as u64);
        Ok(generation)
    }
}
