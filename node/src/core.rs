//! The cache's I/O-free core: frames plus an index, and the compound
//! operations built from their protocols (insert a filled frame, publish a
//! copy-on-write, evict a frame). [`crate::PageCache`] adds the backing
//! file, single flight and readahead; the loom models drive this core
//! directly, so they check the code that ships.

use crate::index::{IfHeld, Index, Inserted, Link, Removed};
use crate::layout::FrameState;
use crate::raw::frames::Frames;
use crate::sync::{Ordering, fence};

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

/// What dropping a page did ([`Core::drop_page`]).
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dropped {
    /// Unlinked and its frame freed.
    Freed,
    /// Unlinked and invalidated; readers still hold the frame, and the last
    /// of them frees it.
    Retired,
    NotCached,
}

fn lost(r: Inserted) -> Lost {
    if r == Inserted::AlreadyPresent {
        Lost::Present
    } else {
        Lost::NoRoom
    }
}

impl<I: Index> Core<I> {
    pub(crate) fn new(frames: Frames) -> Self {
        let index = I::create(&frames);
        Self { frames, index }
    }

    /// Find `page`; on a hit the caller owns one reference on the frame.
    #[inline(always)]
    pub(crate) fn lookup(&self, page: u64, retries: &mut u64) -> Option<u32> {
        self.index.get(&self.frames, page, retries)
    }

    /// Find `page` for a reader pinned by `guard`; no reference is left
    /// held (the frame is not reused before the guard drops).
    #[inline(always)]
    pub(crate) fn lookup_pinned(
        &self,
        page: u64,
        guard: &crossbeam_epoch::Guard,
        retries: &mut u64,
    ) -> Option<u32> {
        self.index.get_pinned(&self.frames, page, guard, retries)
    }

    /// Publish a frame the caller filled (state `Filling`) as `page` and link
    /// it. On success the caller holds one reference on it besides the
    /// index's, so it cannot be evicted before the caller is done. On
    /// failure the frame was never visible and is back on the free list.
    // The cache inserts runs (`insert_filled_run`); the loom models insert
    // one page at a time through this.
    #[cfg_attr(not(loom), allow(dead_code))]
    pub(crate) fn insert_filled(&self, page: u64, f: u32, len: u32) -> Result<u32, Lost> {
        let generation = self.frames.prepare(f, page, len);
        let link = Link::Publish { refs: 2 };
        match self.index.insert(&self.frames, page, f, generation, link) {
            Inserted::Yes => Ok(f),
            other => {
                self.frames.free_unpublished(f);
                Err(lost(other))
            }
        }
    }

    /// Gang insertion of a run of filled frames `run[i] = (frame, len)` as
    /// pages `first + i`: every frame is prepared (checksummed) first, then
    /// the index links the whole run in one pass (the lockless index
    /// prefetches every bucket of the run before it takes the first lock).
    /// `done(i, outcome)` reports each page as [`Core::insert_filled`] would.
    pub(crate) fn insert_filled_run(
        &self,
        first: u64,
        run: &[(u32, u32)],
        done: &mut dyn FnMut(usize, Result<u32, Lost>),
    ) {
        let prepared: Vec<(u32, u64)> = run
            .iter()
            .enumerate()
            .map(|(i, &(f, len))| (f, self.frames.prepare(f, first + i as u64, len)))
            .collect();
        let link = Link::Publish { refs: 2 };
        self.index
            .insert_run(&self.frames, first, &prepared, link, &mut |i, r| {
                let f = prepared[i].0;
                if r == Inserted::Yes {
                    done(i, Ok(f));
                } else {
                    self.frames.free_unpublished(f);
                    done(i, Err(lost(r)));
                }
            });
    }

    /// Publish a filled frame as the new copy of `page` (copy-on-write). The
    /// copy it replaces is invalidated before the new one becomes visible,
    /// and both before this returns: the caller may acknowledge the write.
    /// Returns the new generation.
    pub(crate) fn publish_cow(&self, page: u64, f: u32, len: u32) -> Result<u64, Lost> {
        let generation = self.frames.prepare(f, page, len);
        match self.index.replace(&self.frames, page, f, generation) {
            Ok(Some(old)) => self.frames.drop_index_ref(old),
            Ok(None) => {}
            Err(_) => {
                self.frames.free_unpublished(f);
                return Err(Lost::NoRoom);
            }
        }
        // SeqCst: the invalidation and the new generation are ordered before
        // whatever acknowledges the write (a reply on a socket, a store that
        // another thread reads), so a read that starts after the
        // acknowledgement cannot accept the old copy.
        fence(Ordering::SeqCst);
        Ok(generation)
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

    /// Try to evict frame `f`, chosen by stamp (no second chance).
    pub(crate) fn evict_chosen(&self, f: u32) -> Sweep {
        let h = self.frames.header(f);
        if h.state.load(Ordering::Relaxed) != FrameState::Published as u32 {
            return Sweep::Skip;
        }
        // Racy reads: `remove` rechecks page → (f, generation) under the lock.
        let page = h.page.load(Ordering::Relaxed);
        let generation = h.generation.load(Ordering::Relaxed);
        self.remove_frame(page, f, generation)
    }

    /// Take `page` out of the index whatever holds its frame: from this
    /// call's return on, no lookup finds it and no remote copy of it
    /// validates. A held frame is retired like a copy-on-write's old copy.
    /// The caller holds the page's flight claim, so no fill or write puts a
    /// copy back meanwhile; a concurrent eviction only makes it look again.
    pub(crate) fn drop_page(&self, page: u64) -> Dropped {
        loop {
            let Some((f, generation)) = self.index.peek(&self.frames, page) else {
                return Dropped::NotCached;
            };
            match self
                .index
                .remove(&self.frames, page, f, generation, IfHeld::Unlink)
            {
                Removed::Yes => {
                    self.frames.free_frozen(f);
                    return Dropped::Freed;
                }
                Removed::Unlinked => {
                    self.frames.drop_index_ref(f);
                    return Dropped::Retired;
                }
                // Evicted (and maybe refilled) since the peek: look again.
                _ => continue,
            }
        }
    }

    /// Evict `page` from frame `f` at `generation`, if it is still there.
    pub(crate) fn remove_frame(&self, page: u64, f: u32, generation: u64) -> Sweep {
        match self
            .index
            .remove(&self.frames, page, f, generation, IfHeld::Skip)
        {
            Removed::Yes => {
                self.frames.free_frozen(f);
                Sweep::Evicted
            }
            Removed::Busy => Sweep::Busy,
            _ => Sweep::Skip,
        }
    }
}
