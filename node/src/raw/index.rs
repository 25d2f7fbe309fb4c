//! The lockless bucket index: page number → (frame, generation), searched by
//! readers with plain atomic loads, changed by writers under a per-chain bit
//! lock (Zijlstra's "lock only what changes").
//!
//! # State
//!
//! `bucket_count` head buckets (a power of two) and a pool of overflow
//! buckets, all in the registered region (byte layout in [`crate::layout`]).
//! A head's `ctrl` word holds the chain's writer lock (bit 0), a change
//! counter (bits 1..32) and the next overflow bucket (bits 32..64, +1). An
//! overflow bucket's `ctrl` holds only its next link. A slot holds `key` =
//! page + 1 (0 = empty) and `val` = frame | generation-low-32 << 32.
//!
//! # Fields
//!
//! * Slots and links of a chain change only under the head's lock.
//! * Readers load `ctrl`, `key` and `val` without any lock, and run the
//!   frame protocol of [`super::frames`] on what they find.
//! * An overflow bucket is taken from the pool under the lock of the chain
//!   that links it, and returned to the pool through crossbeam-epoch once it
//!   is empty and unlinked: deferred *after* the unlock that makes the
//!   unlink visible, so no pinned reader still walks it when it is reused
//!   for another chain. An unlinked bucket keeps its own link, so a reader
//!   inside it walks on to the rest of its old chain.
//! * Pool bound: every linked overflow bucket holds at least one entry (one
//!   left empty is unlinked), so at most `frames` are linked; the pool has
//!   `ceil(frames / 3) + min(buckets, frames) + 64 ≥ frames + ceil(frames /
//!   3) + 64` buckets. An insert that finds it empty releases its lock,
//!   drives crossbeam-epoch's collection, and tries again; only if buckets
//!   stay stuck in grace periods (a reader pinned for that long) does it
//!   report `Full`, which the cache turns into a typed error.
//!
//! # Transitions (all under the head's lock)
//!
//! 1. Insert: find room (an empty slot, or a pool bucket to link right
//!    after the head); only then make the frame visible
//!    ([`super::frames`] transition 3), store `val`, then `key` (Release).
//!    An insert that finds the page present or no room leaves its frame
//!    invisible.
//! 2. Replace (copy-on-write publish): invalidate the old frame, make the
//!    new one visible, store the new `val` (Release) in the slot that holds
//!    the key. At no instant are both frames visible.
//! 3. Remove (evict): freeze the frame's refcount (1 → 0), invalidate the
//!    frame, then store `key = 0` (Release). An overflow bucket left empty is
//!    unlinked (Release store of its predecessor's link) and deferred to the
//!    pool. A frame readers hold cannot be frozen: the removal gives up
//!    (making room), or, when the page must go (`IfHeld::Unlink`: a dropped
//!    extent), invalidates and unlinks it all the same, exactly as a
//!    copy-on-write retires its old copy; the remover then drops the index's
//!    reference after unlocking, and the last reader's `put` frees the
//!    frame ([`super::frames`] transitions 5, 7, 8).
//! 4. Unlock: store `ctrl` with the lock bit clear and the counter bumped
//!    (Release), publishing any new link.
//!
//! # Ordering
//!
//! * Lookup loads `ctrl` (Acquire; pairs with the Release unlock or link
//!   store that published an overflow bucket), then `key` (Acquire; pairs
//!   with the Release key store of transition 1, so `val` is the one written
//!   with it or a later one) and `val` (Acquire; pairs with transition 2).
//! * The recheck after `try_get` reloads `key` and `val`; the Acquire CAS of
//!   `try_get` keeps those loads after it.
//! * A reader pins the epoch *before* it loads a link to an overflow bucket,
//!   so an unlinked bucket cannot be recycled under it.
//!
//! # Critical interleavings
//!
//! * Lookup reads `key` of one insert and `val` of a later reuse of the slot
//!   (torn entry): the frame it names holds another page, or the recheck
//!   sees the slot changed; either way the reader retries.
//! * Lookup races an evict of the same page: the reader's `try_get` either
//!   beats the freeze (eviction skips the frame) or sees 0 (retry; the slot
//!   is then empty: a miss).
//! * Two inserts of one page: both take the head lock in turn; the second
//!   finds the key and gets [`Err`] with the winner's entry.
//! * A reader inside an overflow bucket that is emptied and unlinked: it is
//!   pinned, so the bucket is not reused; it sees empty slots (a miss, or the
//!   recheck fails) and the fault path resolves the miss under the lock.

use super::frames::{CopyOut, Frames, FreeList, Freeze};
use super::{Bucket, Slot};
use crate::index::{IfHeld, Link};
use crate::layout::{self, ctrl, key_of, val_frame, val_gen32};
use crate::sync::Ordering;
use std::sync::Arc;

/// The outcome of removing an entry.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Remove {
    /// The entry was removed and its frame frozen: the caller must free it.
    Removed,
    /// The entry was removed and its frame invalidated, but readers hold
    /// it ([`IfHeld::Unlink`]): the caller drops the index's reference.
    Unlinked,
    /// A reader holds the frame; nothing changed.
    Busy,
    /// The index does not map the page to that frame (any more).
    Absent,
}

/// The outcome of an insert.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Insert {
    Inserted,
    /// The page is already present with this slot value.
    Exists(u64),
    /// No overflow bucket left (cannot happen with a [`layout::RegionLayout`]
    /// pool and a bounded number of frames; reported rather than assumed).
    Full,
}

/// Lockless index state beyond the region: the pool of overflow buckets.
pub(crate) struct RawIndex {
    pool: Arc<FreeList>,
}

/// A held chain lock; unlocks on drop, bumping the change counter.
struct Locked<'a> {
    head: &'a Bucket,
    ctrl: u64,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let next = (self.ctrl & !ctrl::LOCKED & !ctrl::SEQ_MASK)
            | ((self.ctrl & ctrl::SEQ_MASK).wrapping_add(ctrl::SEQ_ONE) & ctrl::SEQ_MASK);
        // Release: publishes slot changes and a new overflow link (pairs with
        // the Acquire ctrl load of lookups and of the next locker).
        self.head.ctrl.store(next, Ordering::Release);
    }
}

impl RawIndex {
    pub(crate) fn new(frames: &Frames) -> Self {
        Self {
            pool: Arc::new(FreeList::full(frames.region().layout().overflow_count)),
        }
    }

    #[inline]
    fn head(frames: &Frames, page: u64) -> &Bucket {
        let buckets = frames.region().buckets();
        &buckets[layout::bucket_of(page, buckets.len() as u64) as usize]
    }

    #[inline]
    fn overflow(frames: &Frames, o: u32) -> &Bucket {
        &frames.region().overflow()[o as usize]
    }

    /// Hint the CPU to fetch `page`'s head bucket (gang operations issue
    /// these for a whole run first, so the cache misses overlap).
    #[inline]
    pub(crate) fn prefetch(frames: &Frames, page: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let b: *const Bucket = Self::head(frames, page);
            // SAFETY: a prefetch is only a hint: it never faults and has no
            // architectural effect; SSE is part of the x86-64 baseline.
            unsafe {
                core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(b.cast())
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (frames, page);
    }

    fn lock<'a>(frames: &'a Frames, page: u64) -> Locked<'a> {
        let head = Self::head(frames, page);
        let backoff = crossbeam_utils::Backoff::new();
        let mut cur = head.ctrl.load(Ordering::Relaxed);
        loop {
            if cur & ctrl::LOCKED == 0 {
                // Acquire: pairs with the previous holder's Release unlock.
                match head.ctrl.compare_exchange_weak(
                    cur,
                    cur | ctrl::LOCKED,
                    Ordering::Acquire,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        return Locked {
                            head,
                            ctrl: cur | ctrl::LOCKED,
                        };
                    }
                    Err(now) => cur = now,
                }
            } else {
                crate::sync::spin_wait(&backoff);
                cur = head.ctrl.load(Ordering::Relaxed);
            }
        }
    }

    /// Scan one bucket's slots for `key`.
    #[inline]
    fn scan(b: &Bucket, key: u64) -> Option<(&Slot, u64)> {
        for s in &b.slots {
            // Acquire: pairs with the Release key store of an insert.
            if s.key.load(Ordering::Acquire) == key {
                // Acquire: pairs with the Release val store of a replace.
                return Some((s, s.val.load(Ordering::Acquire)));
            }
        }
        None
    }

    /// Walk `head`'s overflow chain, unlocked, for `key`: the first slot
    /// holding it, with its val. The caller is pinned (crossbeam-epoch)
    /// from before this call until it is done with the slot: an unlinked
    /// overflow bucket is recycled only after every guard pinned before
    /// its unlink.
    fn scan_chain<'a>(frames: &'a Frames, head: &Bucket, key: u64) -> Option<(&'a Slot, u64)> {
        // Acquire: pairs with the Release store that linked a bucket.
        let mut next = ctrl::next(head.ctrl.load(Ordering::Acquire));
        while let Some(o) = next {
            let b = Self::overflow(frames, o);
            if let Some(hit) = Self::scan(b, key) {
                return Some(hit);
            }
            next = ctrl::next(b.ctrl.load(Ordering::Acquire));
        }
        None
    }

    /// Lookup with Piggin's protocol. Returns the frame, with a reference the
    /// caller must `put`, or `None` on a miss. `retries` counts failed
    /// rechecks and lost races.
    ///
    /// The common cases (a hit in the head bucket, a miss with no overflow
    /// chain) are inlined into the caller, so a zero-copy hit makes no call;
    /// a failed recheck and the overflow chain go to
    /// [`RawIndex::get_slow`], which runs every step again from the start.
    #[inline(always)]
    pub(crate) fn get(&self, frames: &Frames, page: u64, retries: &mut u64) -> Option<u32> {
        let key = key_of(page);
        let head = Self::head(frames, page);
        if let Some((slot, val)) = Self::scan(head, key) {
            if let Some(f) = Self::try_slot(frames, page, key, slot, val) {
                return Some(f);
            }
            *retries += 1;
            crate::sync::retry_hint();
        } else if ctrl::next(head.ctrl.load(Ordering::Acquire)).is_none() {
            // Acquire: pairs with the Release store that linked a bucket.
            return None;
        }
        Self::get_slow(frames, page, retries)
    }

    /// [`RawIndex::get`] from the start, every step of it: after a failed
    /// recheck, or when the head bucket has an overflow chain.
    #[cold]
    #[inline(never)]
    fn get_slow(frames: &Frames, page: u64, retries: &mut u64) -> Option<u32> {
        let key = key_of(page);
        let head = Self::head(frames, page);
        loop {
            if let Some((slot, val)) = Self::scan(head, key) {
                match Self::try_slot(frames, page, key, slot, val) {
                    Some(f) => return Some(f),
                    None => {
                        *retries += 1;
                        crate::sync::retry_hint();
                        continue;
                    }
                }
            }
            // Acquire: pairs with the Release store that linked a bucket.
            ctrl::next(head.ctrl.load(Ordering::Acquire))?;
            // Pin before loading the link again: an unlinked overflow bucket
            // is recycled only after every guard pinned before its unlink.
            let guard = crossbeam_epoch::pin();
            let (slot, val) = Self::scan_chain(frames, head, key)?;
            let got = Self::try_slot(frames, page, key, slot, val);
            drop(guard);
            match got {
                Some(f) => return Some(f),
                None => {
                    *retries += 1;
                    crate::sync::retry_hint();
                }
            }
        }
    }

    /// Reference-free lookup for a reader pinned with crossbeam-epoch (the
    /// caller's guard, pinned before this is called): the frame of
    /// `page`'s published copy, or `None` on a miss. No store: readers of
    /// one hot page do not contend. The frame's bytes stay that copy's
    /// until the guard drops, because every free of a published frame waits
    /// for the grace period ([`super::frames`], "Guard-scoped readers").
    /// The pin also covers the overflow walk.
    #[inline(always)]
    pub(crate) fn get_pinned(&self, frames: &Frames, page: u64, retries: &mut u64) -> Option<u32> {
        let key = key_of(page);
        let head = Self::head(frames, page);
        if let Some((_, val)) = Self::scan(head, key) {
            if let Some(f) = Self::pinned_slot(frames, page, val) {
                return Some(f);
            }
            *retries += 1;
            crate::sync::retry_hint();
        } else if ctrl::next(head.ctrl.load(Ordering::Acquire)).is_none() {
            // Acquire: pairs with the Release store that linked a bucket.
            return None;
        }
        Self::get_pinned_slow(frames, page, retries)
    }

    /// [`RawIndex::get_pinned`] from the start, overflow chain included.
    #[cold]
    #[inline(never)]
    fn get_pinned_slow(frames: &Frames, page: u64, retries: &mut u64) -> Option<u32> {
        let key = key_of(page);
        let head = Self::head(frames, page);
        loop {
            let val = match Self::scan(head, key) {
                Some((_, val)) => val,
                // The caller's pin covers the walk.
                None => Self::scan_chain(frames, head, key)?.1,
            };
            if let Some(f) = Self::pinned_slot(frames, page, val) {
                return Some(f);
            }
            *retries += 1;
            crate::sync::retry_hint();
        }
    }

    #[inline(always)]
    fn pinned_slot(frames: &Frames, page: u64, val: u64) -> Option<u32> {
        let f = val_frame(val);
        // A torn slot (key of one insert, val of another) may name anything.
        if f as usize >= frames.count() {
            return None;
        }
        if !frames.is_published_as(f, page, val_gen32(val)) {
            return None;
        }
        frames.touch(f);
        Some(f)
    }

    /// Reference-free copy-out of `page` into `out` (a seqlock read of the
    /// frame, [`Frames::copy_validated`]): `Some((generation, len))`, or
    /// `None` on a miss. `retries` counts copies that raced a change.
    pub(crate) fn copy_out(
        &self,
        frames: &Frames,
        page: u64,
        out: &mut [u8],
        retries: &mut u64,
    ) -> Result<Option<(u64, usize)>, usize> {
        let key = key_of(page);
        let head = Self::head(frames, page);
        loop {
            let copied = if let Some((_, val)) = Self::scan(head, key) {
                Self::copy_slot(frames, page, val, out)?
            } else {
                // Acquire: pairs with the Release store that linked a bucket.
                if ctrl::next(head.ctrl.load(Ordering::Acquire)).is_none() {
                    return Ok(None);
                }
                let _guard = crossbeam_epoch::pin();
                let Some((_, val)) = Self::scan_chain(frames, head, key) else {
                    return Ok(None);
                };
                Self::copy_slot(frames, page, val, out)?
            };
            match copied {
                Some(done) => return Ok(Some(done)),
                None => {
                    *retries += 1;
                    crate::sync::retry_hint();
                }
            }
        }
    }

    fn copy_slot(
        frames: &Frames,
        page: u64,
        val: u64,
        out: &mut [u8],
    ) -> Result<Option<(u64, usize)>, usize> {
        let f = val_frame(val);
        if f as usize >= frames.count() {
            return Ok(None);
        }
        match frames.copy_validated(f, page, val_gen32(val), out) {
            CopyOut::Copied { generation, len } => Ok(Some((generation, len))),
            CopyOut::Changed => Ok(None),
            CopyOut::Short(len) => Err(len),
        }
    }

    /// Steps 2–4 of the protocol on one candidate slot: get unless zero,
    /// recheck header and slot, or drop and report failure.
    #[inline(always)]
    fn try_slot(frames: &Frames, page: u64, key: u64, slot: &Slot, val: u64) -> Option<u32> {
        let f = val_frame(val);
        if f as usize >= frames.count() || !frames.try_get(f) {
            return None;
        }
        let h = frames.header(f);
        // The refcount we hold pins this incarnation: header fields are stable.
        let ok = h.page.load(Ordering::Relaxed) == page
            && h.generation.load(Ordering::Relaxed) as u32 == val_gen32(val)
            && h.state.load(Ordering::Relaxed) == layout::FrameState::Published as u32
            // Acquire: after our Acquire CAS; see the slot as of now.
            && slot.key.load(Ordering::Acquire) == key
            && slot.val.load(Ordering::Acquire) == val;
        if ok {
            frames.touch(f);
            Some(f)
        } else {
            frames.put(f);
            None
        }
    }

    /// Walk a locked chain; `visit` gets each bucket and whether it is the head.
    fn find_locked<'a>(frames: &'a Frames, locked: &Locked<'a>, key: u64) -> Option<&'a Slot> {
        if let Some((s, _)) = Self::scan(locked.head, key) {
            return Some(s);
        }
        let mut next = ctrl::next(locked.ctrl);
        while let Some(o) = next {
            let b = Self::overflow(frames, o);
            if let Some((s, _)) = Self::scan(b, key) {
                return Some(s);
            }
            next = ctrl::next(b.ctrl.load(Ordering::Relaxed));
        }
        None
    }

    fn empty_slot_locked<'a>(frames: &'a Frames, locked: &Locked<'a>) -> Option<&'a Slot> {
        let empty = |b: &'a Bucket| b.slots.iter().find(|s| s.key.load(Ordering::Relaxed) == 0);
        if let Some(s) = empty(locked.head) {
            return Some(s);
        }
        let mut next = ctrl::next(locked.ctrl);
        while let Some(o) = next {
            let b = Self::overflow(frames, o);
            if let Some(s) = empty(b) {
                return Some(s);
            }
            next = ctrl::next(b.ctrl.load(Ordering::Relaxed));
        }
        None
    }

    /// Put `key → val` into a free slot of the locked chain (transition 1).
    /// `publish` runs once room is found, just before the entry becomes
    /// reachable (it makes the frame visible); it does not run on `Full`.
    fn place(
        &self,
        frames: &Frames,
        locked: &mut Locked<'_>,
        key: u64,
        val: u64,
        publish: impl FnOnce(),
    ) -> Insert {
        if let Some(s) = Self::empty_slot_locked(frames, locked) {
            publish();
            s.val.store(val, Ordering::Relaxed);
            // Release: a reader that sees the key sees the val stored above
            // (and the frame made visible before it).
            s.key.store(key, Ordering::Release);
            return Insert::Inserted;
        }
        let Some(o) = self.pool.pop() else {
            return Insert::Full;
        };
        publish();
        let b = Self::overflow(frames, o);
        for s in &b.slots[1..] {
            s.key.store(0, Ordering::Relaxed);
        }
        b.slots[0].val.store(val, Ordering::Relaxed);
        b.slots[0].key.store(key, Ordering::Relaxed);
        b.ctrl.store(
            ctrl::with_next(0, ctrl::next(locked.ctrl)),
            Ordering::Relaxed,
        );
        // Published by the Release unlock of the head.
        locked.ctrl = ctrl::with_next(locked.ctrl, Some(o));
        Insert::Inserted
    }

    /// Insert `page → (frame, generation)` unless the page is present; the
    /// frame is made visible (`link`) under the lock only if it goes in.
    pub(crate) fn insert(
        &self,
        frames: &Frames,
        page: u64,
        frame: u32,
        generation: u64,
        link: Link,
    ) -> Insert {
        self.with_room(
            || self.insert_once(frames, page, frame, generation, link),
            |r| matches!(r, Insert::Full),
        )
    }

    fn insert_once(
        &self,
        frames: &Frames,
        page: u64,
        frame: u32,
        generation: u64,
        link: Link,
    ) -> Insert {
        let key = key_of(page);
        let mut locked = Self::lock(frames, page);
        if let Some(s) = Self::find_locked(frames, &locked, key) {
            return Insert::Exists(s.val.load(Ordering::Relaxed));
        }
        let val = layout::val_of(frame, generation);
        self.place(frames, &mut locked, key, val, || {
            link.apply(frames, frame, generation)
        })
    }

    /// Point `page` at `(frame, generation)` (transition 2), or insert it:
    /// under the lock, the old frame is invalidated, then the new one made
    /// visible, then the slot swapped. Returns the replaced slot value.
    pub(crate) fn replace(
        &self,
        frames: &Frames,
        page: u64,
        frame: u32,
        generation: u64,
    ) -> Result<Option<u64>, ()> {
        self.with_room(
            || self.replace_once(frames, page, frame, generation),
            Result::is_err,
        )
    }

    fn replace_once(
        &self,
        frames: &Frames,
        page: u64,
        frame: u32,
        generation: u64,
    ) -> Result<Option<u64>, ()> {
        let key = key_of(page);
        let val = layout::val_of(frame, generation);
        let mut locked = Self::lock(frames, page);
        if let Some(s) = Self::find_locked(frames, &locked, key) {
            let old = s.val.load(Ordering::Relaxed);
            frames.invalidate(val_frame(old));
            frames.make_visible(frame, generation, 1);
            // Release: the new frame's header and bytes are visible to a
            // reader that loads this val (it also gets the frame's refcount).
            s.val.store(val, Ordering::Release);
            return Ok(Some(old));
        }
        match self.place(frames, &mut locked, key, val, || {
            frames.make_visible(frame, generation, 1)
        }) {
            Insert::Inserted => Ok(None),
            _ => Err(()),
        }
    }

    /// Remove `page → val` if the index still holds exactly that entry and
    /// the frame can be frozen, or, held by readers, `if_held` is
    /// [`IfHeld::Unlink`] (transition 3).
    pub(crate) fn remove(&self, frames: &Frames, page: u64, val: u64, if_held: IfHeld) -> Remove {
        let (outcome, unlinked) = self.remove_locked(frames, page, val, if_held);
        if let Some(o) = unlinked {
            // Deferred only now that the chain lock is released, so the
            // unlink (stored by the unlock) is visible before the deferral:
            // a reader that pins after this point cannot reach the bucket,
            // and every reader pinned before it delays the recycling.
            let pool = Arc::clone(&self.pool);
            let guard = crossbeam_epoch::pin();
            guard.defer(move || pool.push(o));
            // Hand the deferral to the global queue at once, so recycling
            // keeps pace with unlinks instead of waiting for a full bag.
            guard.flush();
        }
        outcome
    }

    /// [`RawIndex::remove`] under the chain lock; returns the overflow bucket
    /// it unlinked, if any, for the caller to defer after unlocking.
    fn remove_locked(
        &self,
        frames: &Frames,
        page: u64,
        val: u64,
        if_held: IfHeld,
    ) -> (Remove, Option<u32>) {
        let key = key_of(page);
        let mut locked = Self::lock(frames, page);
        // Find the slot, remembering the bucket and its predecessor.
        let mut prev: Option<&Bucket> = None;
        let mut here: &Bucket = locked.head;
        let mut here_idx: Option<u32> = None;
        loop {
            if let Some((s, v)) = Self::scan(here, key) {
                if v != val {
                    return (Remove::Absent, None);
                }
                let outcome = match frames.freeze(val_frame(val)) {
                    Freeze::Frozen => Remove::Removed,
                    Freeze::Busy if if_held == IfHeld::Unlink => Remove::Unlinked,
                    Freeze::Busy => return (Remove::Busy, None),
                };
                // Remote readers fail validation before the entry goes.
                frames.invalidate(val_frame(val));
                // Release: pairs with the recheck's Acquire load of the key.
                s.key.store(0, Ordering::Release);
                if let Some(o) = here_idx
                    && here
                        .slots
                        .iter()
                        .all(|s| s.key.load(Ordering::Relaxed) == 0)
                {
                    Self::unlink(&mut locked, prev, here);
                    return (outcome, Some(o));
                }
                return (outcome, None);
            }
            let next = match here_idx {
                None => ctrl::next(locked.ctrl),
                Some(_) => ctrl::next(here.ctrl.load(Ordering::Relaxed)),
            };
            let Some(o) = next else {
                return (Remove::Absent, None);
            };
            prev = Some(here);
            here = Self::overflow(frames, o);
            here_idx = Some(o);
        }
    }

    /// Unlink the empty overflow bucket `b` (its own link stays, so a reader
    /// inside it walks on); the caller recycles it after a grace period.
    fn unlink(locked: &mut Locked<'_>, prev: Option<&Bucket>, b: &Bucket) {
        let after = ctrl::next(b.ctrl.load(Ordering::Relaxed));
        match prev {
            Some(p) if !std::ptr::eq(p, locked.head) => {
                let pc = p.ctrl.load(Ordering::Relaxed);
                // Release: readers that follow the new link see a complete bucket.
                p.ctrl.store(ctrl::with_next(pc, after), Ordering::Release);
            }
            _ => locked.ctrl = ctrl::with_next(locked.ctrl, after),
        }
    }

    /// Run `op` (which takes and releases the chain lock) until `full` says
    /// it did not find the overflow pool empty, replenishing the pool between
    /// tries: four tries, then a last one whose outcome stands.
    fn with_room<T>(&self, mut op: impl FnMut() -> T, full: impl Fn(&T) -> bool) -> T {
        for _ in 0..4 {
            let r = op();
            if !full(&r) {
                return r;
            }
            self.replenish();
        }
        op()
    }

    /// The pool ran dry: help crossbeam-epoch collect deferred buckets (no
    /// lock held). Buckets in use never exceed the frames (each holds an
    /// entry), and the pool has `ceil(frames / 3) + 64` more than that, so
    /// only buckets waiting for their grace period can be missing.
    fn replenish(&self) {
        for _ in 0..8 {
            crossbeam_epoch::pin().flush();
            if self.pool.len() > 0 {
                return;
            }
            std::thread::yield_now();
        }
    }

    /// Whether overflow bucket `o` is in the pool (loom models only).
    #[cfg(loom)]
    pub(crate) fn overflow_pooled(&self, o: u32) -> bool {
        self.pool.contains(o)
    }

    /// Overflow buckets in the pool (for tests and stats).
    pub(crate) fn overflow_free(&self) -> usize {
        self.pool.len()
    }

    /// The frame and full generation indexed for `page` right now, if any
    /// (no reference). Both are read under the chain lock, which every
    /// change of the entry or of its frame's visibility holds.
    pub(crate) fn peek(&self, frames: &Frames, page: u64) -> Option<(u32, u64)> {
        let key = key_of(page);
        let locked = Self::lock(frames, page);
        let val = Self::find_locked(frames, &locked, key)?
            .val
            .load(Ordering::Relaxed);
        let f = val_frame(val);
        let generation = frames.header(f).generation.load(Ordering::Relaxed);
        drop(locked);
        Some((f, generation))
    }
}
