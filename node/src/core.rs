//! The cache's I/O-free core: frames plus an index, and the compound
//! operations built from their protocols (insert a filled frame, publish a
//! copy-on-write, evict a frame). [`crate::PageCache`] adds the backing
//! file, single flight and readahead; the loom models drive this core
//! directly, so they check the code that ships.

use crate::index::{Index, Inserted, Removed};
use crate::layout::FrameState;
use crate::raw::frames::Frames;
use crate::sync::Ordering;

pub(crate) struct Core<I: Index> {
    pub(crate) frames: Frames,
    pub(crate) index: I,
}

/// Why a filled frame did not make it into the index.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lost {
    /// Another thread indexed the page first.
    Present,
    /// No index room.
    NoRoom,
}

/// One step of a CLOCK sweep.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sweep {
    Evicted,
    /// Referenced since the last pass: given a second chance.
    SecondChance,
    /// Held by a reader.
    Busy,
    /// Not an indexed frame.
    Skip,
}

impl<I: Index> Core<I> {
    pub(crate) fn new(frames: Frames) -> Self {
        let index = I::create(&frames);
        Self { frames, index }
    }

    /// Find `page`; on a hit the caller owns one reference on the frame.
    #[inline]
    pub(crate) fn lookup(&self, page: u64, retries: &mut u64) -> Option<u32> {
        self.index.get(&self.frames, page, retries)
    }

    /// Publish a frame the caller filled (state `Filling`) as `page` and link
    /// it. On success the caller holds one reference on it besides the
    /// index's, so it cannot be evicted before the caller is done.
    pub(crate) fn insert_filled(&self, page: u64, f: u32, len: u32) -> Result<u32, Lost> {
        let generation = self.frames.publish(f, page, len);
        self.frames.get_more(f);
        match self.index.insert(&self.frames, page, f, generation) {
            Inserted::Yes => Ok(f),
            other => {
                self.frames.retire(f);
                self.frames.put(f);
                Err(if other == Inserted::AlreadyPresent {
                    Lost::Present
                } else {
                    Lost::NoRoom
                })
            }
        }
    }

    /// Publish a filled frame as the new copy of `page` (copy-on-write) and
    /// retire the copy it replaces. Returns the new generation.
    pub(crate) fn publish_cow(&self, page: u64, f: u32, len: u32) -> Result<u64, Lost> {
        let generation = self.frames.publish(f, page, len);
        match self.index.replace(&self.frames, page, f, generation) {
            Ok(Some(old)) => {
                // The old frame's header is invalidated before the write is
                // acknowledged: remote readers fail validation from here on.
                self.frames.retire(old);
                Ok(generation)
            }
            Ok(None) => Ok(generation),
            Err(_) => {
                self.frames.retire(f);
                Err(Lost::NoRoom)
            }
        }
    }

    /// Try to evict frame `f` (one CLOCK step).
    pub(crate) fn sweep(&self, f: u32) -> Sweep {
        let h = self.frames.header(f);
        if h.state.load(Ordering::Relaxed) != FrameState::Published as u32 {
            return Sweep::Skip;
        }
        if self.frames.clock_clear(f) {
            return Sweep::SecondChance;
        }
        // Racy reads: `remove` rechecks page → (f, generation) under the lock.
        let page = h.page.load(Ordering::Relaxed);
        let generation = h.generation.load(Ordering::Relaxed);
        self.remove_frame(page, f, generation)
    }

    /// Evict `page` from frame `f` at `generation`, if it is still there.
    pub(crate) fn remove_frame(&self, page: u64, f: u32, generation: u64) -> Sweep {
        match self.index.remove(&self.frames, page, f, generation) {
            Removed::Yes => {
                self.frames.free_frozen(f);
                Sweep::Evicted
            }
            Removed::Busy => Sweep::Busy,
            _ => Sweep::Skip,
        }
    }
}
