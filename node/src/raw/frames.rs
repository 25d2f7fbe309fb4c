//! The frame table: headers, the free list, and the reference-count protocol
//! that makes frame reuse safe for lockless readers, local and remote.
//!
//! Local readers follow Nick Piggin's lockless pagecache protocol (2.6.2x
//! `page_cache_get_speculative` and `page_freeze_refs`) applied to frames.
//! Remote readers take no reference at all: they copy a header and a frame
//! with one-sided READs, word by word in any order, at any time, and accept
//! the copy only if it validates (the generation's parity and the checksum,
//! below). The protocol is built so that such a copy can validate only if
//! its bytes were the page's content at some instant while it was being read.
//!
//! # State
//!
//! Per frame, in its [`Header`]: `generation` (u64), `page`, `len`,
//! `checksum`, `state` ([`FrameState`], local bookkeeping), `refcount` (u32)
//! and the CLOCK bit in `flags`.
//!
//! * `generation` is **odd exactly while the frame is published** (visible
//!   through the index) and even otherwise (free, filling, retired). It
//!   only grows: +1 when the frame is made visible, +1 when it is
//!   invalidated, +2 when a frame that was filled (and maybe prepared) but
//!   never made visible goes back to the free list. So every `prepare`
//!   computes an odd value no earlier `prepare` of the frame used, the
//!   published incarnations have distinct odd generations, and a
//!   generation value is never seen twice. A zero-filled region has every
//!   frame at generation 0: free.
//! * The refcount counts the index's own reference (1 while the frame is in
//!   the index) plus one per local reader holding it. 0 means "not
//!   gettable": free, filling, or frozen by an evictor.
//!
//! # Fields
//!
//! * `page`, `len`, `checksum` and the frame bytes are written only by the
//!   thread that owns the frame in state `Filling` (it popped it off the
//!   free list; refcount 0, generation even, so no reader can accept it).
//!   The bytes are written by the kernel (`preadv` into the frame) or with
//!   word-sized atomic stores ([`super::region::Region::fill`]), never with
//!   plain stores, because a transport responder in this process may be
//!   copying the same frame with atomic loads at any time.
//! * `generation` is written by the owner of the frame (`prepare` computes
//!   the next odd value but does not store it; `free_unpublished` moves the
//!   even value on by 2) and, under the lock of the
//!   index chain that links the frame, by `make_visible` (even → odd) and
//!   `invalidate` (odd → even).
//! * `checksum` = xxh3-64 of (page, generation, len as u64, all `page_size`
//!   bytes) for the generation the frame will have once visible.
//! * `refcount` is touched by anyone, with the transitions below.
//! * `flags` (CLOCK referenced bit): readers set it, the evictor clears it;
//!   advisory only.
//! * `stamps[f]` (outside the region, local only): the logical time the
//!   frame was published (eviction `fifo`) or last hit (`lru`); plain std
//!   atomics, Relaxed, advisory only, like `flags`: the evictor uses them to
//!   *choose* a candidate, which then goes through transitions 6–8 exactly
//!   like a CLOCK victim. No safety property reads them.
//!
//! # Transitions
//!
//! 1. `alloc`: pop from the free list; state `Filling`; refcount stays 0;
//!    generation stays even.
//! 2. `prepare` (no lock): with the bytes in place, compute the next
//!    generation `g` (odd) and the checksum for it; store `page`, `len`,
//!    `checksum`. Nothing a reader accepts has changed: the generation word
//!    is still even.
//! 3. `make_visible` (under the chain lock, only once the index will link
//!    the frame): generation := `g` (Release), state `Published`, refcount
//!    := 1 or 2 (Release). The index links the frame right after, in the same
//!    critical section. An insert that loses (page already present, no
//!    room) never makes its frame visible: the frame goes back as `Filling`.
//! 4. `try_get` (get unless zero): CAS refcount n → n + 1 for n > 0. A
//!    local reader that got the frame must still recheck that the index maps
//!    its page to this frame at this generation.
//! 5. `put`: refcount − 1; whoever takes it to 0 frees the frame (transition
//!    8). While the frame is indexed the index's reference keeps it above 0,
//!    so only an invalidated frame can be freed by `put`.
//! 6. `freeze` (evict): under the chain lock, CAS refcount 1 → 0. Fails if
//!    any reader holds the frame (the evictor skips it).
//! 7. `invalidate` (under the chain lock, before the slot that names the
//!    frame is cleared or swapped): generation := `g + 1` (even, Release),
//!    state `Retired`. Copy-on-write invalidates the old copy *before* it
//!    makes the new one visible, in one critical section, so **at most one
//!    frame of a page is published at any instant**.
//! 8. free: state `Free`, push on the free list (after `freeze` and
//!    `invalidate` for an eviction; by the last `put` for a retired copy;
//!    `free_unpublished` for a fill or insert that failed, which first moves
//!    the even generation on by 2, so the odd value a `prepare` stamped a
//!    checksum for is never stamped again with another one). A frame that
//!    was ever published reaches the list only after crossbeam-epoch's
//!    grace period (`FreeList::push_after_grace`: deferred on the default
//!    collector and flushed to its global queue; an eviction batch,
//!    `Frames::batch_frees`, hands its frees over as one deferral at its
//!    end); one that never was (`free_unpublished`) at once. `alloc`
//!    drives the epoch when the list is empty but frames wait.
//!
//! # Ordering
//!
//! * The Release store of the refcount in `make_visible` pairs with the
//!   Acquire CAS in `try_get`: a local reader that got the frame sees its
//!   header and bytes.
//! * `make_visible`'s Release store of the generation orders every earlier
//!   store of the writer before it: the frame's bytes, page, len, checksum,
//!   and the `invalidate` of the page's previous copy. A remote reader needs
//!   no ordering for safety (the checksum decides), only for progress.
//! * `invalidate` is a Release store made under the chain lock before the
//!   slot changes; the write path issues a SeqCst fence after it and before
//!   the acknowledgement leaves the node, so a read that starts after the
//!   acknowledgement sees the even generation (or a later one).
//! * `put` is a Release decrement; `freeze` is an Acquire CAS and the final
//!   `put` is followed by an Acquire fence: the freeing thread sees every
//!   reader's accesses of the bytes happen before its own reuse.
//! * The free list hands a frame from the freeing thread to the next
//!   `alloc` with its own Release/Acquire.
//!
//! # Guard-scoped readers (no reference)
//!
//! `PageCache::lookup_pinned` lends a cached page's bytes for the life of an epoch
//! pin (crossbeam-epoch's default collector) and stores nothing shared, so
//! readers of one hot page do not bounce its refcount between cores. The
//! reader: pin; load the slot `(f, gen32)` (`RawIndex::get_pinned`); load
//! `f`'s generation (Acquire) and accept iff it is odd with low half
//! `gen32` and `page` matches (`is_published_as`); else reload the slot
//! (the entry is changing under its chain lock) or miss. Then use the
//! frame's bytes until the pin drops. It never faults: a fault can wait on
//! another thread's fill, which can wait for frames whose free waits for
//! this very pin.
//!
//! Why the bytes stay that incarnation's while pinned: the frame's bytes
//! change only after a free (transition 8) and the `alloc` that follows.
//! The free of incarnation `G` comes after its `invalidate` (G → G + 1):
//! in program order for an eviction, and through the refcount's
//! Release/Acquire for the last `put`. The reader loaded `G`, so its load
//! precedes that invalidate in the generation word's modification order.
//! crossbeam seals the deferred free with the global epoch read after a
//! SeqCst fence that follows the free; the reader's pin stored its epoch
//! before its own SeqCst fence, which precedes its loads. If the sealing
//! fence came first in the SeqCst order, the reader's later load would see
//! the invalidate (or a later store), not `G`; so the reader's fence came
//! first, the seal's epoch is at most one past the reader's, and the bag
//! expires only two epochs on, which cannot happen while the reader stays
//! pinned. So the push, the `alloc` and every refill store happen after
//! the reader unpins (crossbeam's unpin is a Release store its collector
//! reads with Acquire). A copy-on-write never writes a published frame, so
//! nothing else changes the bytes. A stale or torn slot is harmless: the
//! frame it names must show an odd generation with that low half for the
//! page, and the frame it names is not refilled while pinned by the same
//! argument, so `page` and `len` read after the generation are the
//! incarnation's.
//!
//! A repin (`Pin::repin`: a thread that keeps its pin between lookups)
//! protects the lookups after it as a fresh pin does. crossbeam's repin
//! reads the global epoch `e1` and stores it as the thread's (Release) if
//! it moved; `Pin::repin` then issues a SeqCst fence `Fr`, as a fresh pin
//! does after its store, so the argument above holds with `e1`: if the
//! reader's load after `Fr` saw `G`, `Fr` precedes the sealing fence `Fs`
//! in the SeqCst order. The seal's epoch `s` is then at least `e1`: were it
//! older, the seal's read (after `Fs`) would be coherence-ordered before the
//! reader's read of `e1` (before `Fr`), which puts `Fs` before `Fr`. So the
//! bag expires at `s + 2 > e1 + 1`, which needs the reader seen at `e1 + 1`
//! or later: after its next repin or unpin, which `&mut` puts after every
//! use of bytes lent before it. Without the fence `Fr` does not exist and
//! this order is not given (crossbeam's repin has none: its comment argues
//! only that a late store delays collection).
//! Bytes lent before the repin are out of reach (`&mut`). A repin that
//! finds the epoch unmoved stores nothing: the earlier store and fence
//! still precede the loads.
//!
//! Read freshness is a counted reader's: the copy is the page's content at
//! the instant of the generation load; a write acknowledged before the pin
//! invalidated every older copy first (transition 7), so it is never older.
//!
//! Cost: a pin (an outermost pin stores the thread's epoch and issues a
//! full fence, on x86-64 a locked instruction on a word no other core
//! writes; a nested pin bumps a counter) instead of a CAS and a decrement
//! on the frame's shared refcount; frees wait a grace period, so up to one bag per thread
//! (64) of freed frames is out of use at a time, and a thread that holds a
//! pin while it faults can see [`crate::ReadError::NoFrame`] in a cache
//! whose every free frame waits on that pin. A repin costs a load of the
//! global epoch, a store of the thread's own when it moved, and the fence;
//! a fresh outermost pin also tries to advance the global epoch and collect
//! every 128 pins, which writes the global epoch's line that every pin
//! reads: the repinning readers of one hot page share nothing written.
//!
//! # Why a remote copy that validates is sound
//!
//! A remote reader copies the header and the frame with separate READs,
//! each aligned 8-byte word atomically but the words in any order and at
//! any times `≥ t0` (the start of its read). It accepts iff the generation
//! word it got, `G`, is odd, `page` = the page it wants, `state` =
//! `Published`, and `checksum` = xxh3(page, G, len, bytes it got).
//!
//! 1. The generation word held `G` at the instant `tG ≥ t0` it was read.
//!    Generations only grow and each odd value is held exactly while one
//!    incarnation is visible, so at `tG` the incarnation `G` was published.
//! 2. Every checksum ever stored in this header is the checksum of its own
//!    (page, generation, len, bytes), with a distinct generation each time:
//!    each `prepare` uses the even generation word + 1, and the word only
//!    grows, by 2 between two `prepare`s (visible then invalidated, or
//!    `free_unpublished`).
//!    A checksum word equal to xxh3(p, G, len', B) for the bytes `B` the
//!    reader got therefore came from incarnation `G` itself (anything else
//!    is a 64-bit hash collision), so `B` = that incarnation's bytes and
//!    `p` its page, whatever order the words were copied in and whatever
//!    was overwritten between them.
//! 3. At most one frame of page `p` is published at any instant
//!    (transition 7), so at `tG` the bytes `B` were *the* content of page
//!    `p`. A write acknowledged before `t0` had invalidated every older copy
//!    before its acknowledgement, so `B` is never older than it.
//!
//! A reader that finds an even generation, another page, or a checksum
//! mismatch retries (after re-reading the bucket) or falls back to the
//! owner; it never needs the slot's 32-bit generation for safety (that is a
//! hint to skip frames that were reused, see [`crate::layout`]).
//!
//! # Ordered remote readers: a seqlock instead of the checksum
//!
//! A reader whose READs are performed in order, each one's loads ordered
//! before the next one's as by an Acquire fence, and on the owner's own
//! coherent memory (`shm`: the reader's thread copies, with
//! `fence(Acquire)` after each READ; `Connection::ordered_reads`), may
//! validate as the local copy-out does ([`Frames::copy_validated`]): it
//! READs the generation word (`G1`), then the header and the frame, then
//! the generation word again (`G2`), and accepts iff `G1` is odd and equals
//! the header's generation and `G2`, the state is `Published` and the page
//! matches (`RawHeader::validate_bracketed`); it computes no checksum.
//!
//! * `G1` was read first, and the fence after it makes it an Acquire load:
//!   it pairs with `make_visible`'s Release store of `G1`, so the header
//!   and bytes the later READs copy are at least incarnation `G1`'s.
//! * If any word or byte of those copies came from a later refill of the
//!   frame, that refill began with `alloc`'s Release fence, which the
//!   reader's Acquire fence after that copy synchronises with; the
//!   invalidation of `G1` happens before the fence (it preceded the frame's
//!   free, which the free list's Acquire orders before `alloc`), so the
//!   READ of `G2` sees the generation moved on and the copy is refused.
//! * So an accepted copy holds only incarnation `G1`'s stores, and at the
//!   instant `G1` was read it was *the* content of the page (step 3 above).
//!
//! This is the local copy-out's argument with the reader in another
//! process; it needs the loads' order, so it is sound only for such a
//! reader. A reader of any other transport validates by checksum, as
//! above.
//!
//! # Critical interleavings
//!
//! * Reader loads `page → frame f` from the index; evictor freezes f,
//!   invalidates it, frees it; an inserter reuses f for page q and makes it
//!   visible. A local reader's `try_get` succeeds, but its recheck sees
//!   `header.page = q` (or a new generation, or the slot changed): it `put`s
//!   and retries. A remote reader sees a new generation or page q, or, if it
//!   copied words of several incarnations, a checksum mismatch.
//! * Reader's `try_get` races the evictor's `freeze`: both are RMWs on one
//!   word, so exactly one wins: the reader holds the frame (freeze fails) or
//!   the refcount is 0 (the reader retries).
//! * A copy-on-write invalidates the old frame, makes the new one visible
//!   and swaps the slot, under the chain lock. A local reader that got the
//!   old frame before holds bytes that were current when it rechecked (it
//!   linearises before the write); one that rechecks after sees the even
//!   generation and retries until the swap is visible.
//! * A remote reader copies the old frame's header before the invalidation
//!   and its bytes after the frame was freed and refilled: its generation
//!   word is the old odd value, its checksum word the old or the new one,
//!   and its bytes new ones: the checksum does not match (step 2).
//! * An ordered (`shm`) reader READs `G1` odd, then the frame is
//!   invalidated, freed and refilled while it copies the bytes: it copies
//!   some new bytes, so its second READ of the generation sees the
//!   invalidation (the refill's `alloc` fence) and it retries; it never
//!   looks at the checksum word, which the refill may already have set to
//!   the new bytes' checksum.

use super::Header;
use super::region::Region;
use crate::layout::FrameState;
use crate::sync::{Ordering, fence};
use std::sync::Arc;

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

/// What [`Frames::copy_validated`] achieved.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyOut {
    /// `out[..len]` holds the page as incarnation `generation`.
    Copied { generation: u64, len: usize },
    /// The frame was not (or stopped being) that page's published copy.
    Changed,
    /// `out` is shorter than the page's `len` bytes (`len` validated: the
    /// generation was unchanged after it was loaded).
    Short(usize),
}

/// A lock-free FIFO queue of free indices (frames or overflow buckets).
/// It is sized for every index it can ever hold, so a push can fail only if
/// an index is pushed twice: that is a broken invariant, and it panics.
pub(crate) struct FreeList {
    #[cfg(not(loom))]
    q: crossbeam_queue::ArrayQueue<u32>,
    #[cfg(loom)]
    q: crate::sync::Mutex<Vec<u32>>,
    /// Indices freed through [`FreeList::push_after_grace`] and not yet on
    /// the list (waiting for crossbeam-epoch's grace period).
    waiting: crate::sync::AtomicU64,
}

impl FreeList {
    pub(crate) fn full(n: usize) -> Self {
        assert!(n <= u32::MAX as usize, "{n} indices do not fit in u32");
        #[cfg(not(loom))]
        {
            let q = crossbeam_queue::ArrayQueue::new(n.max(1));
            for i in 0..n {
                let _ = q.push(i as u32);
            }
            Self {
                q,
                waiting: crate::sync::AtomicU64::new(0),
            }
        }
        #[cfg(loom)]
        Self {
            q: crate::sync::Mutex::new((0..n as u32).rev().collect()),
            waiting: crate::sync::AtomicU64::new(0),
        }
    }

    /// Push `i` once every thread pinned now (crossbeam-epoch's default
    /// collector) has unpinned: the grace period that lets a guard-scoped
    /// reader keep using what it found before `i` was freed.
    pub(crate) fn push_after_grace(self: &Arc<Self>, i: u32) {
        self.defer_push(1, move |list| list.push(i));
    }

    /// [`FreeList::push_after_grace`] for several indices: one deferral and
    /// one flush for the lot.
    #[cfg(not(loom))]
    pub(crate) fn push_all_after_grace(self: &Arc<Self>, all: Vec<u32>) {
        if all.is_empty() {
            return;
        }
        self.defer_push(all.len() as u64, move |list| {
            for &i in &all {
                list.push(i);
            }
        });
    }

    /// Counts `n` indices as waiting, and defers `push` (which pushes them)
    /// until every guard pinned now is gone.
    fn defer_push(self: &Arc<Self>, n: u64, push: impl FnOnce(&Self) + Send + 'static) {
        // Relaxed: a count for `len_with_waiting` and for `collect`'s
        // decision to drive the epoch; nothing is published through it.
        self.waiting.fetch_add(n, Ordering::Relaxed);
        let list = Arc::clone(self);
        let guard = crossbeam_epoch::pin();
        guard.defer(move || {
            push(&list);
            list.waiting.fetch_sub(n, Ordering::Relaxed);
        });
        // Hand the deferral to the global queue at once: left in this
        // thread's bag (up to 64), it would wait for this thread's next
        // flush, and a small cache would run out of frames meanwhile.
        guard.flush();
    }

    /// Drive crossbeam-epoch's collection until something waiting reaches
    /// the list, at most `rounds` times (a reader pinned for longer keeps
    /// it waiting). True if the list is non-empty afterwards.
    pub(crate) fn collect(&self, rounds: usize) -> bool {
        for round in 0..rounds {
            if self.len() > 0 {
                return true;
            }
            if self.waiting.load(Ordering::Relaxed) == 0 {
                return false;
            }
            // Seals this thread's bag with the epoch now and tries to
            // advance the epoch and run expired bags (two advances expire
            // a bag when no thread stays pinned at an older epoch, so the
            // first rounds go without yielding).
            crossbeam_epoch::pin().flush();
            // Then let a thread pinned at an older epoch unpin (under loom:
            // let the model run it).
            #[cfg(loom)]
            {
                let _ = round;
                loom::thread::yield_now();
            }
            #[cfg(not(loom))]
            if round >= 2 {
                std::thread::yield_now();
            }
        }
        self.len() > 0
    }

    /// Free indices, counting those still in their grace period.
    pub(crate) fn len_with_waiting(&self) -> usize {
        self.len() + self.waiting.load(Ordering::Relaxed) as usize
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
            // when it is not on the list: a failed push is a double free.
            if self.q.push(i).is_err() {
                panic!("free list overflow: index {i} pushed twice");
            }
        }
        #[cfg(loom)]
        crate::sync::lock(&self.q).push(i);
    }

    /// Whether index `i` is on the list (loom models only).
    #[cfg(loom)]
    pub(crate) fn contains(&self, i: u32) -> bool {
        crate::sync::lock(&self.q).contains(&i)
    }

    pub(crate) fn len(&self) -> usize {
        #[cfg(not(loom))]
        return self.q.len();
        #[cfg(loom)]
        return crate::sync::lock(&self.q).len();
    }
}

/// This thread's frees gathered by [`Frames::batch_frees`]: for the table
/// at `owner` only (its address; a free of another table's frame goes its
/// own way).
#[cfg(not(loom))]
#[derive(Default)]
struct Batch {
    owner: Option<usize>,
    frees: Vec<u32>,
}

#[cfg(not(loom))]
impl Batch {
    /// Gather `f` if this thread batches `frames`' frees; else give it back.
    #[inline]
    fn add(&mut self, frames: &Frames, f: u32) -> Option<u32> {
        if self.owner != Some(frames as *const Frames as usize) {
            return Some(f);
        }
        self.frees.push(f);
        None
    }
}

#[cfg(not(loom))]
thread_local! {
    static BATCH: std::cell::RefCell<Batch> = std::cell::RefCell::new(Batch::default());
}

/// Which stamp a hit refreshes (the eviction policy, as frames see it).
pub(crate) const STAMP_ON_INSERT: u8 = 0;
/// `lru`: a hit refreshes the frame's stamp too.
pub(crate) const STAMP_ON_HIT: u8 = 1;

/// The frame table over a region. Opaque outside this crate.
pub struct Frames {
    pub(crate) region: Region,
    free: Arc<FreeList>,
    hand: crate::sync::AtomicU64,
    /// Per frame: logical time of publication (or last hit under `lru`).
    stamps: Box<[std::sync::atomic::AtomicU64]>,
    /// The logical clock: advanced once per fault (run of pages read).
    tick: std::sync::atomic::AtomicU64,
    /// `STAMP_ON_INSERT` or `STAMP_ON_HIT`.
    stamp_mode: std::sync::atomic::AtomicU8,
}

impl Frames {
    pub(crate) fn new(region: Region) -> Self {
        let n = region.layout().frame_count;
        Self {
            region,
            free: Arc::new(FreeList::full(n)),
            hand: crate::sync::AtomicU64::new(0),
            stamps: (0..n)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
            tick: std::sync::atomic::AtomicU64::new(0),
            stamp_mode: std::sync::atomic::AtomicU8::new(STAMP_ON_INSERT),
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

    /// Frames not in use: on the free list, or freed and waiting for their
    /// grace period (transition 8).
    pub(crate) fn free_count(&self) -> usize {
        self.free.len_with_waiting()
    }

    /// Transition 1: take a free frame for filling. With the list empty
    /// but frames in their grace period, drive crossbeam-epoch a few times
    /// first.
    pub(crate) fn alloc(&self) -> Option<u32> {
        let f = match self.free.pop() {
            Some(f) => f,
            None => {
                // A thread that holds a pin itself cannot wait out a grace
                // period: one try, for frees sealed before its pin.
                let rounds = if crossbeam_epoch::is_pinned() { 1 } else { 8 };
                self.free.collect(rounds);
                self.free.pop()?
            }
        };
        // Release: orders the invalidation that preceded this frame's free
        // (seen through the free list's Acquire) before every store of the
        // refill; pairs with the Acquire fence in `copy_validated` and with
        // the one an ordered (`shm`) remote reader makes after each READ.
        fence(Ordering::Release);
        let h = self.header(f);
        debug_assert_eq!(h.refcount.load(Ordering::Relaxed), 0);
        h.state.store(FrameState::Filling as u32, Ordering::Relaxed);
        Some(f)
    }

    /// Give back a `Filling` frame that was never published (transition 8
    /// for a fill or insert that failed). Its generation moves on by 2 (even
    /// still): a `prepare` may have stored a checksum for the odd value
    /// after it, and the next `prepare` must not reuse that value with
    /// another checksum (see "Why a remote copy that validates is sound",
    /// step 2).
    pub(crate) fn free_unpublished(&self, f: u32) {
        let h = self.header(f);
        debug_assert_eq!(h.state.load(Ordering::Relaxed), FrameState::Filling as u32);
        let g = h.generation.load(Ordering::Relaxed);
        crate::sync::strict_assert!(g.is_multiple_of(2), "freeing a visible frame {f}");
        // Relaxed: the next owner gets the frame through the free list's
        // Release/Acquire, and a remote reader can only ever load this even
        // value (never accepted) or a later one.
        h.generation.store(g.wrapping_add(2), Ordering::Relaxed);
        // At once: it was never visible, so no reader can have found it.
        h.state.store(FrameState::Free as u32, Ordering::Relaxed);
        self.free.push(f);
    }

    /// Transition 2: stamp the header of a filled frame for the generation
    /// it will have once visible, and return that generation. The frame
    /// stays invisible (`Filling`, generation even) until
    /// [`Frames::make_visible`].
    pub(crate) fn prepare(&self, f: u32, page: u64, len: u32) -> u64 {
        let h = self.header(f);
        let now = h.generation.load(Ordering::Relaxed);
        crate::sync::strict_assert!(now.is_multiple_of(2), "preparing a visible frame {f}");
        let generation = now.wrapping_add(1);
        // SAFETY: the caller filled frame `f` and still owns it (`Filling`,
        // refcount 0): nothing writes its bytes during the checksum.
        let sum = unsafe {
            self.region.read(f, |bytes| {
                crate::layout::checksum(page, generation, len, bytes)
            })
        };
        h.page.store(page, Ordering::Relaxed);
        h.len.store(len, Ordering::Relaxed);
        h.checksum.store(sum, Ordering::Relaxed);
        generation
    }

    /// Transition 3: make a prepared frame visible as `generation` with
    /// `refs` references (1: the index's; 2: the index's and the caller's).
    /// Called under the lock of the chain that is about to link it.
    pub(crate) fn make_visible(&self, f: u32, generation: u64, refs: u32) {
        let h = self.header(f);
        crate::sync::strict_assert!(
            generation % 2 == 1,
            "making frame {f} visible at an even generation"
        );
        crate::sync::strict_assert!(
            h.refcount.load(Ordering::Relaxed) == 0,
            "making a referenced frame {f} visible"
        );
        h.flags.store(FLAG_REFERENCED, Ordering::Relaxed);
        self.stamps[f as usize].store(self.now(), std::sync::atomic::Ordering::Relaxed);
        // Release: the bytes, page, len and checksum stored before (and the
        // invalidation of the page's previous copy) are visible to whoever
        // sees this generation.
        h.generation.store(generation, Ordering::Release);
        h.state
            .store(FrameState::Published as u32, Ordering::Relaxed);
        // Release: pairs with the Acquire CAS in `try_get`; a reader that gets
        // the frame sees the header and bytes written above.
        h.refcount.store(refs, Ordering::Release);
    }

    /// Transition 7: the frame leaves the index (evicted, or replaced by a
    /// copy-on-write). Called under the chain lock, before the slot that
    /// names it changes. Remote readers fail validation from this store on.
    pub(crate) fn invalidate(&self, f: u32) {
        let h = self.header(f);
        let g = h.generation.load(Ordering::Relaxed);
        crate::sync::strict_assert!(g % 2 == 1, "invalidating an invisible frame {f}");
        // Release: ordered after everything the frame's holder did before;
        // the write path fences after it before acknowledging.
        h.generation.store(g.wrapping_add(1), Ordering::Release);
        h.state.store(FrameState::Retired as u32, Ordering::Relaxed);
    }

    /// The local reference-free read (a seqlock over the generation): copy
    /// frame `f` as `page` into `out` if it is published at a generation
    /// whose low half is `gen32` and stays so for the whole copy. No store,
    /// so readers of a hot page do not contend on its refcount. Bytes are
    /// copied with atomic word loads (the frame may be refilled meanwhile).
    pub(crate) fn copy_validated(&self, f: u32, page: u64, gen32: u32, out: &mut [u8]) -> CopyOut {
        let h = self.header(f);
        // Acquire: pairs with the Release store of `make_visible`: the bytes
        // of incarnation g1 are visible to the copy.
        let g1 = h.generation.load(Ordering::Acquire);
        if g1.is_multiple_of(2) || g1 as u32 != gen32 || h.page.load(Ordering::Relaxed) != page {
            return CopyOut::Changed;
        }
        let len = h.len.load(Ordering::Relaxed) as usize;
        let Some(dst) = out.get_mut(..len) else {
            // `len` may be a later refill's (torn): report it only if the
            // generation still is `g1` after it was loaded (the Acquire fence
            // pairs with the refill's `alloc` fence, as for the bytes below).
            fence(Ordering::Acquire);
            if h.generation.load(Ordering::Relaxed) != g1 {
                return CopyOut::Changed;
            }
            return CopyOut::Short(len);
        };
        self.region.copy_frame_prefix(f, dst);
        // Acquire: if any load of the copy read a store of a later refill,
        // that refill's `alloc` Release fence synchronises with this fence,
        // so the load below sees the invalidation that preceded it.
        fence(Ordering::Acquire);
        if h.generation.load(Ordering::Relaxed) != g1 {
            return CopyOut::Changed;
        }
        self.touch(f);
        CopyOut::Copied {
            generation: g1,
            len,
        }
    }

    /// Transition 4 for a guard-scoped reader, which takes no reference:
    /// whether frame `f` is published as `page` at a generation whose low
    /// half is `gen32`. The caller is pinned (crossbeam-epoch's default
    /// collector) and found `(f, gen32)` in the index after pinning; if
    /// this says yes, the frame holds that incarnation's bytes until the
    /// caller unpins (see "Guard-scoped readers").
    #[inline(always)]
    pub(crate) fn is_published_as(&self, f: u32, page: u64, gen32: u32) -> bool {
        let h = self.header(f);
        // Acquire: pairs with the Release store of `make_visible`: the
        // header and bytes of incarnation `g` are visible to the reader.
        let g = h.generation.load(Ordering::Acquire);
        g % 2 == 1 && g as u32 == gen32 && h.page.load(Ordering::Relaxed) == page
    }

    /// Transition 4: take a reference unless the refcount is zero.
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

    /// Transition 5: drop a reference.
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

    /// Transition 6: freeze an indexed frame's refcount from 1 to 0. The
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

    /// Transition 8 after a successful `freeze`, `invalidate` and unlink.
    pub(crate) fn free_frozen(&self, f: u32) {
        self.release(f);
    }

    /// Transition 5 for the index's own reference of an invalidated frame
    /// (copy-on-write replaced it): its last local reader frees it.
    pub(crate) fn drop_index_ref(&self, f: u32) {
        crate::sync::strict_assert!(
            self.header(f).state.load(Ordering::Relaxed) == FrameState::Retired as u32,
            "dropping the index reference of frame {f}, which is not retired"
        );
        self.put(f);
    }

    /// Transition 8 for a frame that was published: after the grace period,
    /// so a guard-scoped reader that found it before its invalidation reads
    /// the same bytes until it unpins.
    fn release(&self, f: u32) {
        self.header(f)
            .state
            .store(FrameState::Free as u32, Ordering::Relaxed);
        #[cfg(not(loom))]
        let f = match BATCH.with(|b| b.borrow_mut().add(self, f)) {
            None => return,
            Some(f) => f,
        };
        self.free.push_after_grace(f);
    }

    /// Run `op` with this thread's frees of this table's frames gathered
    /// and handed to the grace period as one deferral at the end (an
    /// eviction batch pays one deferral and one flush, not one per frame).
    /// The frames are off the free list until then, as they would be
    /// during their grace period anyway.
    #[cfg(not(loom))]
    pub(crate) fn batch_frees<R>(&self, op: impl FnOnce() -> R) -> R {
        let nested = BATCH.with(|b| {
            let mut b = b.borrow_mut();
            if b.owner.is_some() {
                return true;
            }
            b.owner = Some(self as *const Self as usize);
            false
        });
        if nested {
            return op();
        }
        // Hand over what was gathered even if `op` panics.
        struct Hand<'a>(&'a Frames);
        impl Drop for Hand<'_> {
            fn drop(&mut self) {
                let all = BATCH.with(|b| {
                    let mut b = b.borrow_mut();
                    b.owner = None;
                    std::mem::take(&mut b.frees)
                });
                self.0.free.push_all_after_grace(all);
            }
        }
        let _hand = Hand(self);
        op()
    }

    /// Wait (bounded) until every frame freed so far is back on the list:
    /// for the loom models that count frames after a free.
    #[cfg(loom)]
    pub(crate) fn settle(&self) {
        for _ in 0..64 {
            if self.free.waiting.load(Ordering::Relaxed) == 0 {
                return;
            }
            crossbeam_epoch::pin().flush();
            #[cfg(loom)]
            loom::thread::yield_now();
        }
    }

    /// Set the CLOCK bit on a hit (a load first, so hot frames stay shared
    /// in every reader's cache instead of bouncing on a store).
    /// Under `lru` it refreshes the frame's stamp instead, the same way: a
    /// load, and a store only if the clock moved since.
    #[inline(always)]
    pub(crate) fn touch(&self, f: u32) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.stamp_mode.load(Relaxed) == STAMP_ON_HIT {
            let now = self.now();
            let s = &self.stamps[f as usize];
            if s.load(Relaxed) != now {
                s.store(now, Relaxed);
            }
            return;
        }
        let flags = &self.header(f).flags;
        if flags.load(Ordering::Relaxed) & FLAG_REFERENCED == 0 {
            flags.fetch_or(FLAG_REFERENCED, Ordering::Relaxed);
        }
    }

    /// The logical clock of stamps.
    #[inline]
    fn now(&self) -> u64 {
        self.tick.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Advance the logical clock (once per fault).
    pub(crate) fn advance_clock(&self) {
        self.tick.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Choose `STAMP_ON_INSERT` (fifo, clock) or `STAMP_ON_HIT` (lru).
    pub(crate) fn set_stamp_mode(&self, mode: u8) {
        self.stamp_mode
            .store(mode, std::sync::atomic::Ordering::Relaxed);
    }

    /// Frame `f`'s stamp (advisory).
    pub(crate) fn stamp(&self, f: u32) -> u64 {
        self.stamps[f as usize].load(std::sync::atomic::Ordering::Relaxed)
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::layout::RegionLayout;

    /// A frame whose fill failed after `prepare` (an insert that lost, a
    /// write whose write-through failed) goes back to the free list; the
    /// next `prepare` of it must use a generation no earlier `prepare` used,
    /// or a remote copy mixing the two checksums could validate.
    #[test]
    fn every_prepare_gets_a_distinct_generation() {
        let frames = Frames::new(Region::new(RegionLayout::new(512, 1), 1, 512).unwrap());
        let mut seen = Vec::new();
        for round in 0..4u8 {
            let f = frames.alloc().expect("the only frame is free");
            // SAFETY: `alloc` gave us the frame in state Filling, exclusively.
            unsafe { frames.region().fill(f, |b| b.fill(round)) };
            let g = frames.prepare(f, 0, 512);
            assert!(
                !seen.contains(&g),
                "round {round}: generation {g} prepared twice ({seen:?})"
            );
            seen.push(g);
            frames.free_unpublished(f);
        }
    }
}
