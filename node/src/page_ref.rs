//! [`PageRef`]: a page a reader holds. A cached page is a counted
//! reference to its frame (zero-copy: the frame is not reused until the
//! reference drops; [`crate::raw::frames`] has the protocol); a page the
//! admission policy kept out of the cache is a private copy.

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
