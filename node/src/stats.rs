//! Cache statistics as striped counters: each thread bumps a counter on its
//! own cache line, so counting hits does not serialise the lockless readers.
//! These are plain std atomics even under loom: they are not part of any
//! protocol.

use crossbeam_utils::CachePadded;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Counter names, in the order of [`Stats`]'s fields.
#[derive(Clone, Copy, Debug)]
#[repr(usize)]
pub(crate) enum Counter {
    Hits,
    Misses,
    Faults,
    PagesRead,
    Readahead,
    Evictions,
    EvictBusy,
    Retries,
    Writes,
    BytesWritten,
    FlightWaits,
    AdmitSkipped,
}

const COUNTERS: usize = 12;
const STRIPES: usize = 32;

static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static STRIPE: usize = NEXT_STRIPE.fetch_add(1, Ordering::Relaxed) % STRIPES;
}

pub(crate) struct Counters {
    stripes: Box<[CachePadded<[AtomicU64; COUNTERS]>]>,
}

impl Counters {
    pub(crate) fn new() -> Self {
        Self {
            stripes: (0..STRIPES)
                .map(|_| CachePadded::new(std::array::from_fn(|_| AtomicU64::new(0))))
                .collect(),
        }
    }

    #[inline]
    pub(crate) fn add(&self, c: Counter, n: u64) {
        if n == 0 {
            return;
        }
        let s = STRIPE.with(|s| *s);
        self.stripes[s][c as usize].fetch_add(n, Ordering::Relaxed);
    }

    fn sum(&self, c: Counter) -> u64 {
        self.stripes
            .iter()
            .map(|s| s[c as usize].load(Ordering::Relaxed))
            .sum()
    }

    pub(crate) fn snapshot(&self) -> Stats {
        use Counter::*;
        Stats {
            hits: self.sum(Hits),
            misses: self.sum(Misses),
            faults: self.sum(Faults),
            pages_read: self.sum(PagesRead),
            readahead: self.sum(Readahead),
            evictions: self.sum(Evictions),
            evict_busy: self.sum(EvictBusy),
            retries: self.sum(Retries),
            writes: self.sum(Writes),
            bytes_written: self.sum(BytesWritten),
            flight_waits: self.sum(FlightWaits),
            admissions_skipped: self.sum(AdmitSkipped),
        }
    }
}

/// A snapshot of a cache's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Lookups that found the page.
    pub hits: u64,
    /// Lookups that did not (each leads to a fault or a wait for one).
    pub misses: u64,
    /// Backing reads issued (one per run of pages).
    pub faults: u64,
    /// Pages read from the backing file, readahead included.
    pub pages_read: u64,
    /// Pages read ahead of demand.
    pub readahead: u64,
    /// Frames evicted.
    pub evictions: u64,
    /// Eviction candidates skipped because a reader held them.
    pub evict_busy: u64,
    /// Lookups retried after a failed recheck or a lost race.
    pub retries: u64,
    /// Writes acknowledged.
    pub writes: u64,
    /// Bytes written through to the backing file.
    pub bytes_written: u64,
    /// Misses that waited for another thread's fault of the same page.
    pub flight_waits: u64,
    /// Misses served from the backing file without inserting the page (the
    /// admission policy refused it).
    pub admissions_skipped: u64,
}
