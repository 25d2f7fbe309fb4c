//! Single flight: at most one thread fills or writes a given page at a time;
//! and close marks, which keep a fill that began before a range was dropped
//! from publishing into it.
//!
//! A thread that misses claims the page here before it reads the backing
//! file; a second thread that misses on the same page waits for the first
//! and then finds the page in the index, so concurrent faults make one
//! backing read. Writers claim the page too, so a fault that read the file
//! before a write cannot insert stale bytes after it. Claims are sharded by
//! page so unrelated faults do not contend.
//!
//! # Dropping a range against concurrent fills ([`Closes`])
//!
//! The cache drops a range of pages (an extent the node stops answering
//! for) with `PageCache::evict_range`; a fault, readahead, preload or write
//! of a page of it that began before the drop must not leave a copy behind.
//!
//! **State.** A close counter `seq` (u64, only grows) and `MARKS` marks
//! (u64 each, only grow). A page maps to the mark of its granule of
//! `GRANULE` pages (`page / GRANULE % MARKS`); several granules share a
//! mark, which only makes the check below more conservative.
//!
//! **Transitions.**
//! 1. A filler (fault, preload, write) loads `start = seq` when it begins,
//!    before it looks the page up or claims it.
//! 2. A drop takes `s = ++seq`, raises the mark of every granule the range
//!    touches to at least `s` (`fetch_max`), then for each page of the range
//!    in turn: claims it (waiting out the claim of any fill or write in
//!    flight), unlinks whatever copy the index holds (even one readers
//!    hold), releases the claim.
//! 3. A filler, holding the claims of its whole run and with the bytes
//!    read, publishes page `p` only if `mark(p) <= start` (not closed since
//!    it began); a fault serves its own page from a private copy instead,
//!    and a write publishes (its copy is current) and then unlinks it.
//!
//! **Ordering.** A drop's `fetch_max` is sequenced before its claim of `p`;
//! the claim is a mutex, so if the drop claims `p` before the filler does,
//! the drop's unlock of `p` happens before the filler's lock, and the
//! filler's load of the mark (after that lock) happens after the
//! `fetch_max`: it reads `>= s` (coherence). No ordering stronger than
//! Relaxed is needed on the marks; the mutex carries it.
//!
//! **Critical interleavings.** For a filler with `start < s` (it began
//! before the drop took `s`) and each page `p` of its run, the two claims of
//! `p` are ordered:
//! * the drop's first: the filler's check of `p` sees the mark `>= s > start`
//!   and does not publish `p`;
//! * the filler's first: the drop waits until the filler released `p`, which
//!   is after it published (or not), so the drop's lookup sees the copy and
//!   unlinks it.
//!
//! Either way no copy that the filler read survives the drop. A filler with
//! `start >= s` began after the drop took `s`: it is a new request, and it
//! may publish (keeping such requests out is the caller's job, as the
//! daemon's view does).

use crate::sync::{AtomicU64, Condvar, Mutex, Ordering};
use std::collections::HashSet;

/// Pages per close-mark granule.
const GRANULE: u64 = 64;
/// Close marks (granules share them modulo this).
const MARKS: usize = 256;

/// Close marks: which ranges were dropped since a fill began (see the
/// module header).
pub(crate) struct Closes {
    seq: AtomicU64,
    marks: Box<[AtomicU64]>,
}

/// When a filler began, as the close marks see it (transition 1).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Began(u64);

impl Closes {
    pub(crate) fn new() -> Self {
        Self {
            seq: AtomicU64::new(0),
            marks: (0..MARKS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn mark(&self, page: u64) -> &AtomicU64 {
        &self.marks[((page / GRANULE) % MARKS as u64) as usize]
    }

    /// Transition 1: a fill or write begins.
    pub(crate) fn begin(&self) -> Began {
        // Relaxed: a stale (smaller) value only makes the check stricter.
        Began(self.seq.load(Ordering::Relaxed))
    }

    /// Transition 2, first half: close pages `first..end` for every fill
    /// that began before now. The caller then claims and drops each page.
    pub(crate) fn close(&self, first: u64, end: u64) {
        if first >= end {
            return;
        }
        // Relaxed: the flight claims that follow order it (module header).
        let s = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let granules = (end - 1) / GRANULE - first / GRANULE + 1;
        if granules >= MARKS as u64 {
            for m in self.marks.iter() {
                m.fetch_max(s, Ordering::Relaxed);
            }
        } else {
            for g in first / GRANULE..=(end - 1) / GRANULE {
                self.mark(g * GRANULE).fetch_max(s, Ordering::Relaxed);
            }
        }
    }

    /// Transition 3: whether `page` was closed since `began` (the caller
    /// holds the page's claim, which orders this load after any close whose
    /// drop claimed the page before it).
    pub(crate) fn closed_since(&self, page: u64, began: Began) -> bool {
        self.mark(page).load(Ordering::Relaxed) > began.0
    }
}

const SHARDS: usize = 64;

struct Shard {
    pages: Mutex<HashSet<u64>>,
    cv: Condvar,
}

pub(crate) struct Flights {
    shards: Box<[crossbeam_utils::CachePadded<Shard>]>,
}

/// A claim on one page; released (and waiters woken) on drop.
pub(crate) struct Claim<'a> {
    flights: &'a Flights,
    page: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let shard = self.flights.shard(self.page);
        crate::sync::lock(&shard.pages).remove(&self.page);
        shard.cv.notify_all();
    }
}

impl Claim<'_> {
    pub(crate) fn page(&self) -> u64 {
        self.page
    }
}

/// What `claim` had to do.
#[must_use]
pub(crate) enum Claimed<'a> {
    /// The page was free: the caller holds it now.
    Now(Claim<'a>),
    /// Another thread held it; the caller waited for it and holds it now.
    AfterWait(Claim<'a>),
}

impl Flights {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| {
                    crossbeam_utils::CachePadded::new(Shard {
                        pages: Mutex::new(HashSet::new()),
                        cv: Condvar::new(),
                    })
                })
                .collect(),
        }
    }

    fn shard(&self, page: u64) -> &Shard {
        &self.shards[crate::layout::bucket_of(page, SHARDS as u64) as usize]
    }

    /// Claim `page`, waiting while another thread holds it.
    pub(crate) fn claim(&self, page: u64) -> Claimed<'_> {
        let shard = self.shard(page);
        let mut pages = crate::sync::lock(&shard.pages);
        let mut waited = false;
        while pages.contains(&page) {
            waited = true;
            pages = match shard.cv.wait(pages) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
        pages.insert(page);
        let claim = Claim {
            flights: self,
            page,
        };
        if waited {
            Claimed::AfterWait(claim)
        } else {
            Claimed::Now(claim)
        }
    }

    /// Claim `page` only if nobody holds it.
    pub(crate) fn try_claim(&self, page: u64) -> Option<Claim<'_>> {
        let shard = self.shard(page);
        let mut pages = crate::sync::lock(&shard.pages);
        if pages.insert(page) {
            Some(Claim {
                flights: self,
                page,
            })
        } else {
            None
        }
    }
}
