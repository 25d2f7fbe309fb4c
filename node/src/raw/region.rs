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
//! Frame bytes are plain memory. They are written only by the one thread that
//! owns a frame in state `Filling` (refcount frozen at 0) and read only by
//! holders of a reference or by remote readers that validate by checksum; the
//! refcount protocol in [`super::frames`] supplies the happens-before edges.

use super::{Bucket, Header};
use crate::layout::{self, RegionLayout};
use crate::sync::{AtomicU64, Ordering};

pub(crate) struct Region {
    layout: RegionLayout,
    #[cfg(not(loom))]
    base: std::ptr::NonNull<u8>,
    #[cfg(loom)]
    buckets: Box<[Bucket]>,
    #[cfg(loom)]
    overflow: Box<[Bucket]>,
    #[cfg(loom)]
    headers: Box<[Header]>,
    #[cfg(loom)]
    arena: Box<[loom::cell::UnsafeCell<Box<[u8]>>]>,
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
    /// Allocate a zeroed region and write its superblock.
    pub(crate) fn new(
        layout: RegionLayout,
        file_pages: u64,
        file_len: u64,
    ) -> std::io::Result<Self> {
        #[cfg(not(loom))]
        {
            // SAFETY: an anonymous private mapping with no address hint; the
            // result is checked for MAP_FAILED before use.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    layout.len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if ptr == libc::MAP_FAILED {
                return Err(std::io::Error::last_os_error());
            }
            let base = std::ptr::NonNull::new(ptr.cast::<u8>())
                .ok_or_else(std::io::Error::last_os_error)?;
            let region = Self { layout, base };
            region.write_superblock(file_pages, file_len);
            Ok(region)
        }
        #[cfg(loom)]
        {
            let _ = (file_pages, file_len);
            Ok(Self {
                layout,
                buckets: (0..layout.bucket_count).map(|_| Bucket::new()).collect(),
                overflow: (0..layout.overflow_count).map(|_| Bucket::new()).collect(),
                headers: (0..layout.frame_count).map(|_| Header::new()).collect(),
                arena: (0..layout.frame_count)
                    .map(|_| {
                        loom::cell::UnsafeCell::new(vec![0u8; layout.page_size].into_boxed_slice())
                    })
                    .collect(),
                epoch: AtomicU64::new(0),
            })
        }
    }

    #[cfg(not(loom))]
    fn write_superblock(&self, file_pages: u64, file_len: u64) {
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

    /// Let `op` write frame `f`'s bytes.
    ///
    /// # Safety
    /// The caller owns frame `f` exclusively: it is in state `Filling` (its
    /// refcount is 0 and the caller took it off the free list), so no other
    /// thread reads or writes its bytes until the caller publishes it.
    pub(crate) unsafe fn fill<R>(&self, f: u32, op: impl FnOnce(&mut [u8]) -> R) -> R {
        assert!((f as usize) < self.layout.frame_count);
        #[cfg(not(loom))]
        {
            // SAFETY: the frame lies inside the mapping (f < frame_count) and
            // the caller guarantees exclusive access for the call.
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(
                    self.base.as_ptr().add(self.layout.frame(f as usize)),
                    self.layout.page_size,
                )
            };
            op(bytes)
        }
        #[cfg(loom)]
        // SAFETY: exclusive access is the caller's contract; loom checks it.
        self.arena[f as usize].with_mut(|p| op(unsafe { &mut **p }))
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
        // SAFETY: the caller's reference excludes writers; loom checks it.
        self.arena[f as usize].with(|p| op(unsafe { &**p }))
    }

    /// Frame `f`'s bytes for as long as the caller's reference lives.
    ///
    /// # Safety
    /// As for [`Region::read`], and the returned slice must not outlive the
    /// caller's reference on the frame.
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

#[cfg(not(loom))]
impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `base` came from mmap with exactly `layout.len` bytes and is
        // unmapped once; every borrow of the region ended with `&mut self`.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.layout.len) };
    }
}
