//! The frame table: headers, the free list, and the reference-count protocol
//! that makes frame reuse safe for lockless readers.
//!
//! This is Nick Piggin's lockless pagecache protocol (2.6.2x
//! `page_cache_get_speculative` and `page_freeze_refs`) applied to frames.
//!
//! # State
//!
//! Per frame, in its [`Header`]: `state` ([`FrameState`]), `refcount` (u32),
//! `page`, `generation`, `len`, `checksum`, and the CLOCK bit in `flags`.
//! The refcount counts the index's own reference (1 while the frame is in the
//! index) plus one per reader holding it. 0 means "not gettable": free,
//! filling, or frozen by an evictor.
//!
//! # Fields
//!
//! * `page`, `generation`, `len`, `checksum` and the frame bytes are written
//!   only by the thread that owns the frame in state `Filling` (it popped it
//!   off the free list; refcount is 0, so no reader can take it).
//! * `state` moves `Free → Filling` (owner), `Filling → Published` (owner,
//!   before it inserts the frame into the index), `Published → Retired`
//!   (the thread that unlinked it from the index under the bucket lock), and
//!   back to `Free` by whoever drops the refcount to 0.
//! * `refcount` is touched by anyone, with the transitions below.
//! * `flags` (CLOCK referenced bit): readers set it, the evictor clears it;
//!   advisory only.
//!
//! # Transitions
//!
//! 1. `alloc`: pop from the free list; state `Filling`; refcount stays 0.
//! 2. `publish`: fill header fields; generation += 1; state `Published`;
//!    then refcount 0 → 1 with a Release store. Only then is the frame put
//!    in the index.
//! 3. `try_get` (get unless zero): CAS refcount n → n + 1 for n > 0. A
//!    reader that got the frame must still recheck that the index maps its
//!    page to this frame at this generation (the frame may have been freed
//!    and reused between the reader's index load and its CAS).
//! 4. `put`: refcount − 1; whoever takes it to 0 frees the frame (transition
//!    6). While the frame is indexed the index's reference keeps it above 0,
//!    so only a retired frame can be freed by `put`.
//! 5. `freeze` (evict): under the bucket lock, CAS refcount 1 → 0. Fails if
//!    any reader holds the frame (the evictor skips it). On success the
//!    evictor removes the index entry and frees the frame (transition 6).
//! 6. free: state `Free`, push on the free list.
//! 7. `retire` (copy-on-write replaced it, or a lost insert race): state
//!    `Retired`, then `put` the index's reference (transition 4).
//!
//! # Ordering
//!
//! * The Release store of refcount = 1 in `publish` pairs with the Acquire
//!   CAS in `try_get`: a reader that got the frame sees its header and bytes.
//! * `put` is a Release decrement; `freeze` is an Acquire CAS and the final
//!   `put` is AcqRel: the freeing thread sees every reader's accesses of the
//!   bytes happen before its own reuse of the frame.
//! * The free list (a lock-free queue) hands a frame from the freeing thread
//!   to the next `alloc` with its own Release/Acquire.
//!
//! # Critical interleavings
//!
//! * Reader loads `page → frame f` from the index; evictor freezes f, frees
//!   it; an inserter reuses f for page q and publishes it (refcount 1). The
//!   reader's `try_get` now succeeds, but its recheck sees `header.page = q`
//!   (or a new generation, or the index slot changed): it `put`s and retries.
//!   The reader never returns q's bytes as p's.
//! * Reader's `try_get` races the evictor's `freeze`: both are RMWs on one
//!   word, so exactly one wins: either the reader holds the frame (freeze
//!   fails, eviction skips it) or the refcount is 0 (the reader retries).
//! * A copy-on-write swaps the index slot to the new frame, then retires the
//!   old one. A reader that got the old frame before the swap holds bytes
//!   that were current when it looked (it linearises before the write); one
//!   that gets it after fails its recheck of the slot and retries.

use super::Header;
use super::region::Region;
use crate::layout::FrameState;
use crate::sync::{Ordering, fence};

/// The CLOCK "referenced" bit in a header's flags.
pub(crate) const FLAG_REFERENCED: u32 = 1;

/// What `freeze` achieved.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Freeze {
    /// Refcount went 1 → 0: the caller now owns the frame.
    Frozen,
    /// A reader holds the frame: leave it.
    Busy,
}

/// A lock-free stack of free indices (frames or overflow buckets).
pub(crate) struct FreeList {
    #[cfg(not(loom))]
    q: crossbeam_queue::ArrayQueue<u32>,
    #[cfg(loom)]
    q: crate::sync::Mutex<Vec<u32>>,
}

impl FreeList {
    pub(crate) fn full(n: usize) -> Self {
        #[cfg(not(loom))]
        {
            let q = crossbeam_queue::ArrayQueue::new(n.max(1));
            for i in 0..n {
                let _ = q.push(i as u32);
            }
            Self { q }
        }
        #[cfg(loom)]
        Self {
            q: crate::sync::Mutex::new((0..n as u32).rev().collect()),
        }
    }

    pub(crate) fn pop(&self) -> Option<u32> {
        #[cfg(not(loom))]
        return self.q.pop();
        #[cfg(loom)]
        return crate::sync::lock(&self.q).pop();
    }

    pub(crate) fn push(&self, i: u32) {
        #[cfg(not(loom))]
        {
            // The list was sized for every index, and an index is pushed only
            // when it is not on the list: the push cannot fail.
            let pushed = self.q.push(i);
            debug_assert!(pushed.is_ok(), "free list overflow");
        }
        #[cfg(loom)]
        crate::sync::lock(&self.q).push(i);
    }

    pub(crate) fn len(&self) -> usize {
        #[cfg(not(loom))]
        return self.q.len();
        #[cfg(loom)]
        return crate::sync::lock(&self.q).len();
    }
}

/// The frame table over a region. Opaque outside this crate.
pub struct Frames {
    pub(crate) region: Region,
    free: FreeList,
    hand: crate::sync::AtomicU64,
}

impl Frames {
    pub(crate) fn new(region: Region) -> Self {
        let n = region.layout().frame_count;
        Self {
            region,
            free: FreeList::full(n),
            hand: crate::sync::AtomicU64::new(0),
        }
    }

    #[inline]
    pub(crate) fn count(&self) -> usize {
        self.region.layout().frame_count
    }

    #[inline]
    pub(crate) fn header(&self, f: u32) -> &Header {
        &self.region.headers()[f as usize]
    }

    /// Frames on the free list now.
    pub(crate) fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Transition 1: take a free frame for filling.
    pub(crate) fn alloc(&self) -> Option<u32> {
        let f = self.free.pop()?;
        let h = self.header(f);
        debug_assert_eq!(h.refcount.load(Ordering::Relaxed), 0);
        h.state.store(FrameState::Filling as u32, Ordering::Relaxed);
        Some(f)
    }

    /// Give back a `Filling` frame that was never published.
    pub(crate) fn free_unpublished(&self, f: u32) {
        debug_assert_eq!(
            self.header(f).state.load(Ordering::Relaxed),
            FrameState::Filling as u32
        );
        self.release(f);
    }

    /// Transition 2: stamp the header of a filled frame and make it gettable.
    /// Returns the frame's new generation. The caller then inserts it into
    /// the index (or retires it if it loses the insert).
    pub(crate) fn publish(&self, f: u32, page: u64, len: u32) -> u64 {
        let h = self.header(f);
        let generation = h.generation.load(Ordering::Relaxed).wrapping_add(1);
        // SAFETY: the caller filled frame `f` and still owns it (`Filling`,
        // refcount 0); reading its bytes cannot race a writer.
        let sum = unsafe {
            self.region.read(f, |bytes| {
                crate::layout::checksum(page, generation, len, bytes)
            })
        };
        h.page.store(page, Ordering::Relaxed);
        h.generation.store(generation, Ordering::Relaxed);
        h.len.store(len, Ordering::Relaxed);
        h.checksum.store(sum, Ordering::Relaxed);
        h.flags.store(FLAG_REFERENCED, Ordering::Relaxed);
        h.state
            .store(FrameState::Published as u32, Ordering::Relaxed);
        // Release: pairs with the Acquire CAS in `try_get`; a reader that gets
        // the frame sees the header and bytes written above.
        h.refcount.store(1, Ordering::Release);
        generation
    }

    /// Transition 3: take a reference unless the refcount is zero.
    #[must_use]
    #[inline]
    pub(crate) fn try_get(&self, f: u32) -> bool {
        let rc = &self.header(f).refcount;
        // Acquire: a reader that finds the frame frozen or free also sees
        // the index change that came before (the put or unlink), so its
        // retry does not re-read the stale slot.
        let mut n = rc.load(Ordering::Acquire);
        loop {
            if n == 0 {
                return false;
            }
            // Acquire: pairs with the Release store in `publish` (and the
            // release sequence of later RMWs), so the header and bytes of this
            // incarnation are visible to the recheck and the read that follow.
            match rc.compare_exchange_weak(n, n + 1, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(now) => n = now,
            }
        }
    }

    /// Take one more reference on a frame the caller already holds.
    #[inline]
    pub(crate) fn get_more(&self, f: u32) {
        let prev = self.header(f).refcount.fetch_add(1, Ordering::Relaxed);
        debug_assert!(prev > 0);
    }

    /// Transition 4: drop a reference.
    #[inline]
    pub(crate) fn put(&self, f: u32) {
        // Release: this reader's accesses to the frame happen before the
        // freeing thread's reuse (pairs with the Acquire in `freeze` or the
        // fence below).
        let prev = self.header(f).refcount.fetch_sub(1, Ordering::Release);
        debug_assert!(prev > 0, "put of an unreferenced frame {f}");
        if prev == 1 {
            // Acquire: see every other holder's accesses before freeing.
            fence(Ordering::Acquire);
            self.release(f);
        }
    }

    /// Transition 5: freeze an indexed frame's refcount from 1 to 0. The
    /// caller holds the lock of the bucket chain that indexes it.
    pub(crate) fn freeze(&self, f: u32) -> Freeze {
        // Acquire: pairs with readers' Release `put`s (see `put`).
        match self
            .header(f)
            .refcount
            .compare_exchange(1, 0, Ordering::Acquire, Ordering::Relaxed)
        {
            Ok(_) => Freeze::Frozen,
            Err(_) => Freeze::Busy,
        }
    }

    /// Transition 6 after a successful `freeze` and unlink.
    pub(crate) fn free_frozen(&self, f: u32) {
        self.release(f);
    }

    /// Transition 7: the frame left the index (replaced or lost a race).
    /// Remote readers fail validation from the state store on.
    pub(crate) fn retire(&self, f: u32) {
        self.header(f)
            .state
            .store(FrameState::Retired as u32, Ordering::Release);
        self.put(f);
    }

    fn release(&self, f: u32) {
        self.header(f)
            .state
            .store(FrameState::Free as u32, Ordering::Relaxed);
        self.free.push(f);
    }

    /// Set the CLOCK bit on a hit (a load first, so hot frames stay shared
    /// in every reader's cache instead of bouncing on a store).
    #[inline]
    pub(crate) fn touch(&self, f: u32) {
        let flags = &self.header(f).flags;
        if flags.load(Ordering::Relaxed) & FLAG_REFERENCED == 0 {
            flags.fetch_or(FLAG_REFERENCED, Ordering::Relaxed);
        }
    }

    /// Advance the CLOCK hand; returns the frame under it.
    pub(crate) fn clock_next(&self) -> u32 {
        (self.hand.fetch_add(1, Ordering::Relaxed) % self.count() as u64) as u32
    }

    /// Second chance: clear the referenced bit; true if it was set.
    pub(crate) fn clock_clear(&self, f: u32) -> bool {
        self.header(f)
            .flags
            .fetch_and(!FLAG_REFERENCED, Ordering::Relaxed)
            & FLAG_REFERENCED
            != 0
    }

    /// The region (layout, raw memory, frame accessors).
    pub(crate) fn region(&self) -> &Region {
        &self.region
    }
}
