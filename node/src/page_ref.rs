//! What a reader holds. [`PageRef`]: a page, as a counted reference to its
//! cached frame (zero-copy: the frame is not reused until the reference
//! drops; [`crate::raw::frames`] has the protocol), or, for a page the
//! admission policy kept out of the cache, a private copy. [`Pin`]: an
//! epoch pin under which [`crate::PageCache::lookup_pinned`] lends a page's
//! bytes with no reference at all (no shared store, so readers of a hot
//! page scale), for as long as the pin lives.

use crate::raw::frames::Frames;

/// A page read: a reference to its cached frame, which cannot be reused
/// while it lives (zero-copy; dropping it releases the frame), or, for a
/// page the admission policy kept out of the cache, a private copy.
pub struct PageRef<'a> {
    pub(crate) inner: Held<'a>,
    pub(crate) len: usize,
}

pub(crate) enum Held<'a> {
    Frame {
        frames: &'a Frames,
        frame: u32,
    },
    /// The page's bytes at `buf[off..]` (aligned for O_DIRECT); boxed, so
    /// that a `PageRef` is three words.
    Uncached(Box<(Vec<u8>, usize)>),
}

impl PageRef<'_> {
    /// The frame holding the page; `None` if the page was not admitted to
    /// the cache (it has no location anyone may be told about).
    pub fn frame(&self) -> Option<u32> {
        let Held::Frame { frame, .. } = self.inner else {
            return None;
        };
        Some(frame)
    }

    /// The frame's generation: odd while published; with the frame it names
    /// one immutable copy of the page (not a per-page version: a page faulted
    /// into another frame can get a smaller number). `None` if the page was
    /// not admitted.
    pub fn frame_generation(&self) -> Option<u64> {
        let Held::Frame { frames, frame } = self.inner else {
            return None;
        };
        let generation = &frames.header(frame).generation;
        Some(generation.load(crate::sync::Ordering::Relaxed))
    }

    /// Whether the page is in the cache (false: served from the backing
    /// file without being admitted).
    pub fn is_cached(&self) -> bool {
        matches!(self.inner, Held::Frame { .. })
    }
}

impl std::ops::Deref for PageRef<'_> {
    type Target = [u8];
    #[inline(always)]
    fn deref(&self) -> &[u8] {
        match &self.inner {
            // SAFETY: we hold a reference on the frame (taken by a successful
            // lookup or fault), so it is not freed or refilled until our drop;
            // the slice borrows `self`, so it cannot outlive that reference.
            Held::Frame { frames, frame } => unsafe { &frames.region().frame(*frame)[..self.len] },
            Held::Uncached(b) => &b.0[b.1..b.1 + self.len],
        }
    }
}

impl Drop for PageRef<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        if let Held::Frame { frames, frame } = self.inner {
            frames.put(frame);
        }
    }
}

/// A pin of crossbeam-epoch's default collector, for
/// [`crate::PageCache::lookup_pinned`]: while it lives (until its next
/// [`Pin::repin`]), no frame a pinned lookup lent is reused (every free of
/// a published frame waits until every pin older than the free has
/// dropped). Hold it for a batch of
/// lookups, not across anything that blocks: frames freed meanwhile stay
/// out of use until it drops, so a fault, a write or a flight wait made
/// while this thread holds a pin may find no frame
/// ([`crate::ReadError::NoFrame`]) in a cache under pressure. Not `Send`:
/// it belongs to the thread that pinned. A thread reading one page at a
/// time keeps one and calls [`Pin::repin`] between lookups.
pub struct Pin(pub(crate) crossbeam_epoch::Guard);

impl Pin {
    /// Pin this thread (nested pins are cheap).
    #[inline(always)]
    pub fn new() -> Self {
        Self(crossbeam_epoch::pin())
    }

    /// Move this pin to the epoch of now, as dropping it and pinning again
    /// would, for a thread that looks up one page at a time and keeps its
    /// pin between lookups. `&mut` ends every borrow of bytes lent under
    /// the pin before; bytes lent after it are protected as under a fresh
    /// pin (`raw::frames`, "Guard-scoped readers": the epoch store, then a
    /// SeqCst fence, then the lookups). What it saves is the fresh pin's
    /// shared traffic: crossbeam's `pin` tries to advance the global epoch
    /// and collect garbage every 128 pins, which bounces the global epoch's
    /// cache line between readers of one hot page; a repin only reads it
    /// (and stores the thread's own epoch when it moved). So a repinning
    /// reader never helps reclaim: the threads that free frames (eviction,
    /// writes, faults) drive the epoch. The thread stays pinned between
    /// lookups, so drop the pin before anything that blocks, as for any
    /// [`Pin`]. A nested pin (another `Pin` of this thread alive) does not
    /// move: it stays at its older epoch, which protects at least as much.
    #[inline(always)]
    pub fn repin(&mut self) {
        crate::sync::repin(&mut self.0);
    }
}

impl Default for Pin {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Pin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pin")
    }
}
