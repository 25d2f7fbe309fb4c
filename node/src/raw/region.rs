//! The registered region: one page-aligned allocation holding the superblock,
//! the bucket index, the overflow buckets, the frame headers and the arena, at
//! the offsets [`RegionLayout`] computes.
//!
//! Outside loom the region is an anonymous `mmap`, so it is page-aligned,
//! zero-filled (all-zero is a valid state for every atomic in it), can be bound
//! to a NUMA node before first touch, and can be registered with a NIC as one
//! memory region. Under loom the same parts are separate heap arrays of loom
//! atomics and `UnsafeCell`s, so the model checker sees every access.
//!
//! Frame bytes are written only by the one thread that owns a frame in state
//! `Filling` (refcount frozen at 0), with word-sized atomic stores
//! ([`Region::fill`]) or by the kernel (`preadv` straight into the frame).
//! They are read with plain loads by holders of a reference (no writer can
//! exist then: the zero-copy fast path) and with word-sized atomic loads by
//! transport responders and other processes at any time, which validate by
//! checksum. So no plain store ever races with any load, and plain loads
//! race only with other loads. Under loom the arena is made of atomic words,
//! so a model can read a frame while it is refilled, as a remote reader does.

use super::{Bucket, Header};
#[cfg(not(loom))]
use crate::layout;
use crate::layout::{IndexCode, RegionLayout};
use crate::sync::{AtomicU64, Ordering};

pub(crate) struct Region {
    layout: RegionLayout,
    #[cfg(not(loom))]
    base: std::ptr::NonNull<u8>,
    /// The transport memory the region lives in; `None`: an anonymous
    /// private mapping of ours, unmapped on drop.
    #[cfg(not(loom))]
    shared: Option<Box<dyn pagewire_rdma::LocalRegion>>,
    /// Bytes mapped at `base` (of our own mapping; `layout.len` rounded
    /// up to [`HUGE_PAGE`] for a region of at least one).
    #[cfg(not(loom))]
    mapped_len: usize,
    #[cfg(loom)]
    buckets: Box<[Bucket]>,
    #[cfg(loom)]
    overflow: Box<[Bucket]>,
    #[cfg(loom)]
    headers: Box<[Header]>,
    #[cfg(loom)]
    arena: Box<[Box<[AtomicU64]>]>,
    #[cfg(loom)]
    epoch: AtomicU64,
}

// SAFETY: the region is shared memory whose every mutable word is an atomic,
// except frame bytes, whose exclusive writer is fixed by the refcount protocol
// (see `frames`); the mapping itself is owned and unmapped once on drop.
unsafe impl Send for Region {}
// SAFETY: as for `Send`: shared access goes through atomics or through frame
// accessors whose callers uphold the refcount protocol.
unsafe impl Sync for Region {}

impl Region {
    /// Allocate a zeroed anonymous region for a lockless index and write its
    /// superblock.
    pub(crate) fn new(
        layout: RegionLayout,
        file_pages: u64,
        file_len: u64,
    ) -> std::io::Result<Self> {
        #[cfg(not(loom))]
        return Self::with_memory(layout, file_pages, file_len, IndexCode::Lockless, None);
        #[cfg(loom)]
        {
            let _ = (file_pages, file_len, IndexCode::Lockless);
            Ok(Self {
                layout,
                buckets: (0..layout.bucket_count).map(|_| Bucket::new()).collect(),
                overflow: (0..layout.overflow_count).map(|_| Bucket::new()).collect(),
                headers: (0..layout.frame_count).map(|_| Header::new()).collect(),
                arena: (0..layout.frame_count)
                    .map(|_| {
                        (0..layout.page_size / 8)
                            .map(|_| AtomicU64::new(0))
                            .collect()
                    })
                    .collect(),
                epoch: AtomicU64::new(0),
            })
        }
    }

    /// A region on `shared` memory (a transport's registered mapping, e.g. an
    /// `shm` file that other processes map), or on a fresh anonymous private
    /// mapping when `shared` is `None`. `shared` must be zero-filled (freshly
    /// registered), page-aligned and at least `layout.len` bytes; the region
    /// keeps it alive. Writes the superblock.
    #[cfg(not(loom))]
    pub(crate) fn with_memory(
        layout: RegionLayout,
        file_pages: u64,
        file_len: u64,
        index: IndexCode,
        shared: Option<Box<dyn pagewire_rdma::LocalRegion>>,
    ) -> std::io::Result<Self> {
        let ptr = match &shared {
            Some(m) => {
                if m.len() < layout.len || !(m.as_ptr() as usize).is_multiple_of(4096) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!(
                            "shared memory of {} bytes at {:p} cannot hold a page-aligned region of {} bytes",
                            m.len(),
                            m.as_ptr(),
                            layout.len
                        ),
                    ));
                }
                m.as_ptr().cast::<libc::c_void>()
            }
            None => map_private(layout.len)?,
        };
        let mapped_len = if shared.is_some() {
            layout.len
        } else {
            private_len(layout.len)
        };
        // Transparent huge pages: a walk over a big index or arena otherwise
        // pays a TLB miss per page, and a NIC needs fewer translation
        // entries. Only a hint; for shared (shmem) memory the kernel's
        // `shmem_enabled` setting decides, and it is often `never`.
        // SAFETY: `ptr..ptr + len` is mapped (checked or just created).
        if unsafe { libc::madvise(ptr, mapped_len, libc::MADV_HUGEPAGE) } != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "madvise(MADV_HUGEPAGE) refused");
        }
        // Fault the metadata (superblock, index, overflow pool, headers) in
        // now, as registering the region with a NIC would: lookups and
        // inserts then never take a page fault. The arena is left to first
        // touch (or to registration), as it can be large.
        // SAFETY: `ptr..ptr + arena_offset` lies inside the mapping.
        if unsafe { libc::madvise(ptr, layout.arena_offset, libc::MADV_POPULATE_WRITE) } != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "madvise(MADV_POPULATE_WRITE) refused");
        }
        let base =
            std::ptr::NonNull::new(ptr.cast::<u8>()).ok_or_else(std::io::Error::last_os_error)?;
        let region = Self {
            layout,
            base,
            shared,
            mapped_len,
        };
        region.write_superblock(file_pages, file_len, index);
        Ok(region)
    }

    #[cfg(not(loom))]
    fn write_superblock(&self, file_pages: u64, file_len: u64, index: IndexCode) {
        use layout::sb;
        let l = &self.layout;
        let mut page = [0u8; layout::SUPERBLOCK_SIZE];
        let mut put = |off: usize, v: u64, width: usize| {
            page[off..off + width].copy_from_slice(&v.to_le_bytes()[..width])
        };
        put(sb::MAGIC, layout::MAGIC, 8);
        put(sb::VERSION, layout::LAYOUT_VERSION as u64, 4);
        put(sb::PAGE_SIZE, l.page_size as u64, 4);
        put(sb::BUCKET_COUNT, l.bucket_count as u64, 8);
        put(sb::OVERFLOW_COUNT, l.overflow_count as u64, 8);
        put(sb::FRAME_COUNT, l.frame_count as u64, 8);
        put(sb::NODE_EPOCH, 0, 8);
        put(sb::FILE_PAGES, file_pages, 8);
        put(sb::FILE_LEN, file_len, 8);
        put(sb::INDEX_OFFSET, l.index_offset as u64, 8);
        put(sb::OVERFLOW_OFFSET, l.overflow_offset as u64, 8);
        put(sb::HEADERS_OFFSET, l.headers_offset as u64, 8);
        put(sb::ARENA_OFFSET, l.arena_offset as u64, 8);
        put(sb::REGION_LEN, l.len as u64, 8);
        put(sb::INDEX_KIND, index as u64, 4);
        // SAFETY: the superblock area is the first SUPERBLOCK_SIZE bytes of a
        // live mapping at least that long; no other thread has the region yet.
        unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), self.base.as_ptr(), page.len()) };
    }

    pub(crate) fn layout(&self) -> &RegionLayout {
        &self.layout
    }

    #[cfg(not(loom))]
    fn typed<T>(&self, offset: usize, count: usize) -> &[T] {
        debug_assert!(offset + count * std::mem::size_of::<T>() <= self.layout.len);
        // SAFETY:
        // - `offset..offset + count * size_of::<T>()` lies inside the mapping
        //   (RegionLayout computes disjoint, in-bounds parts) and is 64-byte
        //   aligned, which is `T`'s alignment (Bucket and Header).
        // - `T` is made only of atomics, for which the zero bytes of a fresh
        //   mapping are valid, and which allow shared mutation.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(offset).cast::<T>(), count) }
    }

    pub(crate) fn buckets(&self) -> &[Bucket] {
        #[cfg(not(loom))]
        return self.typed(self.layout.index_offset, self.layout.bucket_count);
        #[cfg(loom)]
        return &self.buckets;
    }

    pub(crate) fn overflow(&self) -> &[Bucket] {
        #[cfg(not(loom))]
        return self.typed(self.layout.overflow_offset, self.layout.overflow_count);
        #[cfg(loom)]
        return &self.overflow;
    }

    pub(crate) fn headers(&self) -> &[Header] {
        #[cfg(not(loom))]
        return self.typed(self.layout.headers_offset, self.layout.frame_count);
        #[cfg(loom)]
        return &self.headers;
    }

    /// Publish a new node epoch in the superblock (remote readers compare it
    /// with the epoch of the key they were given).
    pub(crate) fn set_epoch(&self, epoch: u64) {
        #[cfg(not(loom))]
        {
            let words: &[AtomicU64] = self.typed(0, layout::SUPERBLOCK_SIZE / 8);
            words[layout::sb::NODE_EPOCH / 8].store(epoch, Ordering::Release);
        }
        #[cfg(loom)]
        self.epoch.store(epoch, Ordering::Release);
    }

    /// Let `op` write frame `f`'s bytes: `op` fills a zeroed staging buffer
    /// (it must write every byte it means to keep), which is then stored
    /// into the frame with word-sized atomic stores. A transport responder of
    /// this process may be copying the frame (a stale location) with atomic
    /// loads at the same time; plain stores would race with those loads.
    ///
    /// # Safety
    /// The caller owns frame `f` exclusively: it is in state `Filling` (its
    /// refcount is 0 and the caller took it off the free list), so no other
    /// thread writes its bytes, and no local reader reads them, until the
    /// caller publishes it.
    pub(crate) unsafe fn fill<R>(&self, f: u32, op: impl FnOnce(&mut [u8]) -> R) -> R {
        assert!((f as usize) < self.layout.frame_count);
        // Page-aligned, like the frame itself, so `op` may read into it with
        // O_DIRECT.
        let mut staged = Staging::new(self.layout.page_size);
        let r = op(staged.as_mut());
        for (i, chunk) in staged.as_mut().chunks_exact(8).enumerate() {
            let w = u64::from_ne_bytes(chunk.try_into().expect("8 bytes"));
            self.frame_word(f, i).store(w, Ordering::Relaxed);
        }
        r
    }

    /// Word `i` of frame `f`, as an atomic.
    #[inline]
    fn frame_word(&self, f: u32, i: usize) -> &AtomicU64 {
        #[cfg(not(loom))]
        {
            assert!(i < self.layout.page_size / 8);
            // SAFETY:
            // - the word lies inside frame `f` (f < frame_count was asserted
            //   by the caller, i < page_size / 8 here), inside the mapping;
            // - the arena is page-aligned and page sizes are powers of two of
            //   at least 512, so the word is 8-byte aligned;
            // - concurrent accesses to frame bytes are atomic (this, transport
            //   copies), by the kernel (`preadv`), or plain reads by holders of
            //   a reference, which exclude writers (see `frames`).
            unsafe {
                AtomicU64::from_ptr(
                    self.base
                        .as_ptr()
                        .add(self.layout.frame(f as usize) + i * 8)
                        .cast::<u64>(),
                )
            }
        }
        #[cfg(loom)]
        &self.arena[f as usize][i]
    }

    // Used by the loom models' remote reader and by `read` under loom.
    #[cfg_attr(not(loom), allow(dead_code))]
    /// Copy frame `f` into `out` with word-sized atomic loads, the way a
    /// transport responder or a remote reader sees it: valid at any time,
    /// even while the frame is refilled (the copy may then be torn).
    pub(crate) fn copy_frame(&self, f: u32, out: &mut [u8]) {
        assert!((f as usize) < self.layout.frame_count);
        for (i, chunk) in out
            .chunks_exact_mut(8)
            .take(self.layout.page_size / 8)
            .enumerate()
        {
            chunk.copy_from_slice(&self.frame_word(f, i).load(Ordering::Relaxed).to_ne_bytes());
        }
    }

    /// Copy the first `out.len()` bytes of frame `f` with atomic loads (the
    /// fast form of [`Region::copy_frame`] for the local copy-out path).
    pub(crate) fn copy_frame_prefix(&self, f: u32, out: &mut [u8]) {
        assert!((f as usize) < self.layout.frame_count && out.len() <= self.layout.page_size);
        #[cfg(all(not(loom), target_arch = "x86_64"))]
        {
            let src = self.frame_ptr(f).cast_const();
            // SAFETY:
            // - `src..src + out.len()` lies inside frame `f` (checked above),
            //   inside the live mapping; `out` is ours, exclusively borrowed.
            // - The frame may be written concurrently (atomic word stores of a
            //   refill, or the kernel's `preadv`). The copy is one `rep movsb`
            //   in inline assembly, which the compiler treats as an opaque
            //   operation with hardware semantics: every byte it reads is some
            //   value a store wrote, and there is no Rust-level data race.
            //   The caller validates the copy (generation reread) and throws
            //   a torn one away. `rep movsb` is the fast string copy on every
            //   x86-64 with ERMS, and plain correct on the others.
            unsafe {
                std::arch::asm!(
                    "rep movsb",
                    inout("rcx") out.len() => _,
                    inout("rsi") src => _,
                    inout("rdi") out.as_mut_ptr() => _,
                    options(nostack, preserves_flags)
                );
            }
        }
        #[cfg(any(loom, not(target_arch = "x86_64")))]
        {
            let words = out.len() / 8;
            let (body, tail) = out.split_at_mut(words * 8);
            for (i, chunk) in body.chunks_exact_mut(8).enumerate() {
                chunk.copy_from_slice(
                    &self
                        .frame_word_unchecked(f, i)
                        .load(Ordering::Relaxed)
                        .to_ne_bytes(),
                );
            }
            if !tail.is_empty() {
                let w = self
                    .frame_word_unchecked(f, words)
                    .load(Ordering::Relaxed)
                    .to_ne_bytes();
                let n = tail.len();
                tail.copy_from_slice(&w[..n]);
            }
        }
    }

    /// Word `i` of frame `f`; the caller checked `f < frame_count` and
    /// `i < page_size / 8`.
    #[cfg(any(loom, not(target_arch = "x86_64")))]
    #[inline(always)]
    fn frame_word_unchecked(&self, f: u32, i: usize) -> &AtomicU64 {
        #[cfg(not(loom))]
        {
            debug_assert!((f as usize) < self.layout.frame_count && i < self.layout.page_size / 8);
            // SAFETY: as in `frame_word`; the bounds are the caller's contract
            // (checked by `copy_frame_prefix` once per copy).
            unsafe {
                AtomicU64::from_ptr(
                    self.base
                        .as_ptr()
                        .add(self.layout.arena_offset + f as usize * self.layout.page_size + i * 8)
                        .cast::<u64>(),
                )
            }
        }
        #[cfg(loom)]
        &self.arena[f as usize][i]
    }

    /// Let `op` read frame `f`'s bytes.
    ///
    /// # Safety
    /// The caller holds a reference on frame `f` (refcount taken with
    /// `try_get`, or the frame is its own `Filling` frame), so no thread
    /// writes the bytes during the call.
    pub(crate) unsafe fn read<R>(&self, f: u32, op: impl FnOnce(&[u8]) -> R) -> R {
        assert!((f as usize) < self.layout.frame_count);
        #[cfg(not(loom))]
        {
            // SAFETY: in bounds as in `fill`; no writer exists while the
            // caller's reference is held.
            op(unsafe { self.frame(f) })
        }
        #[cfg(loom)]
        {
            let mut out = vec![0u8; self.layout.page_size];
            self.copy_frame(f, &mut out);
            op(&out)
        }
    }

    /// Frame `f`'s bytes for as long as the caller's reference (or epoch
    /// pin, under which it found the frame published) lives.
    ///
    /// # Safety
    /// As for [`Region::read`], and the returned slice must not outlive the
    /// caller's reference on the frame, or its pin.
    #[cfg(not(loom))]
    pub(crate) unsafe fn frame(&self, f: u32) -> &[u8] {
        // SAFETY: in bounds (f < frame_count, checked by the callers through
        // `read` or by holding a reference to a frame of this region); no
        // writer exists while the reference is held.
        unsafe {
            std::slice::from_raw_parts(
                self.base.as_ptr().add(self.layout.frame(f as usize)),
                self.layout.page_size,
            )
        }
    }

    /// Address of frame `f`'s bytes (for I/O into a frame the caller owns).
    #[cfg(not(loom))]
    pub(crate) fn frame_ptr(&self, f: u32) -> *mut u8 {
        assert!((f as usize) < self.layout.frame_count);
        self.base
            .as_ptr()
            .wrapping_add(self.layout.frame(f as usize))
    }

    /// The whole region as raw memory, for registration with a transport.
    #[cfg(not(loom))]
    pub(crate) fn raw(&self) -> (*const u8, usize) {
        (self.base.as_ptr(), self.layout.len)
    }
}

/// A zeroed, page-aligned staging buffer for [`Region::fill`].
struct Staging {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

impl Staging {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, len.clamp(8, 4096))
            .expect("page sizes are powers of two");
        // SAFETY: `layout` has a non-zero size (page sizes are at least 512,
        // 16 under loom).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, layout }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` owns `layout.size()` initialised (zeroed) bytes,
        // borrowed mutably through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// The size of a transparent huge page on x86-64 and arm64 with 4 KiB
/// pages. The kernel backs only the 2 MiB-aligned 2 MiB stretches of a
/// mapping with one, and (since Linux 6.13) aligns an anonymous mapping by
/// itself only when its length is a multiple of it; so a private region's
/// mapping is placed and sized in whole huge pages, and every part of it,
/// the tail included, can get one.
#[cfg(not(loom))]
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// Bytes mapped for a private region of `len` bytes: whole huge pages for
/// a region of at least one (a smaller one keeps its length: rounding it
/// would only cost memory).
#[cfg(not(loom))]
pub(crate) fn private_len(len: usize) -> usize {
    if len >= HUGE_PAGE {
        len.next_multiple_of(HUGE_PAGE)
    } else {
        len
    }
}

/// A zeroed anonymous private mapping of [`private_len`]`(len)` bytes,
/// starting on a [`HUGE_PAGE`] boundary when it is at least one long: one
/// huge page more is reserved, and the unaligned head and the tail past
/// the aligned stretch are unmapped again.
#[cfg(not(loom))]
fn map_private(len: usize) -> std::io::Result<*mut libc::c_void> {
    let want = private_len(len);
    let slack = if want >= HUGE_PAGE { HUGE_PAGE } else { 0 };
    let reserve = want
        .checked_add(slack)
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
    // SAFETY: an anonymous private mapping with no address hint; the result
    // is checked for MAP_FAILED before use.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    if slack == 0 {
        return Ok(ptr);
    }
    let start = ptr as usize;
    let aligned = start.next_multiple_of(HUGE_PAGE);
    let head = aligned - start;
    let tail = reserve - head - want;
    // SAFETY: both ranges lie inside the mapping just made and outside
    // `aligned..aligned + want`, which stays mapped; mmap returns
    // page-aligned addresses, so `head` and `tail` are whole pages.
    unsafe {
        if head > 0 {
            libc::munmap(ptr, head);
        }
        if tail > 0 {
            libc::munmap((aligned + want) as *mut libc::c_void, tail);
        }
    }
    Ok(aligned as *mut libc::c_void)
}

#[cfg(not(loom))]
impl Drop for Region {
    fn drop(&mut self) {
        if self.shared.is_some() {
            // The transport's mapping goes with `shared`.
            return;
        }
        // SAFETY: `base..base + mapped_len` is what `map_private` left
        // mapped, unmapped once; every borrow of the region ended with
        // `&mut self`.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.mapped_len) };
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{HUGE_PAGE, Region, private_len};
    use crate::layout::RegionLayout;

    #[test]
    fn a_private_region_is_placed_and_sized_in_whole_huge_pages() {
        for frames in [600, 1000, 4000] {
            let layout = RegionLayout::new(4096, frames);
            assert!(layout.len >= HUGE_PAGE && !layout.len.is_multiple_of(HUGE_PAGE));
            let r = Region::new(layout, 1, 4096).unwrap();
            assert_eq!(
                r.base.as_ptr() as usize % HUGE_PAGE,
                0,
                "{frames} frames: base {:p}",
                r.base
            );
            assert_eq!(r.mapped_len, private_len(layout.len));
            assert!(r.mapped_len.is_multiple_of(HUGE_PAGE) && r.mapped_len >= layout.len);
            // The whole mapping is usable memory: its last byte is writable
            // and reads back.
            // SAFETY: inside the mapping, which `r` owns; no other borrow.
            unsafe {
                let last = r.base.as_ptr().add(r.mapped_len - 1);
                last.write(7);
                assert_eq!(last.read(), 7);
            }
        }
        // A small region keeps its length.
        let small = RegionLayout::new(512, 4);
        assert!(small.len < HUGE_PAGE);
        assert_eq!(Region::new(small, 1, 512).unwrap().mapped_len, small.len);
    }
}
