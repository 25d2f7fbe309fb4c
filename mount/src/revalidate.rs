//! The cached mode's revalidation: every period, drop from the kernel's
//! page cache only the runs that changed since they were read.
//!
//! With `--cached SECS` the kernel keeps the pages it read through the
//! mount. Every read the mount answers in that mode is recorded here before
//! its reply leaves: the run's first page and how each page was read (its
//! [`ReadInfo`], which names the owner's frame and the generation copied).
//! Every SECS seconds [`Revalidator::tick`] takes the records and checks
//! them with [`crate::Source::still_current_runs`] (one 8-byte READ of each
//! page's frame generation; the pages of up to [`CHECK_PAGES`] pages' worth
//! of runs in one batch per owner, so a round costs about one round trip
//! per owner and transport batch, not one per run): a run still current stays
//! cached and recorded; any other (a page written since, moved to another
//! owner, read over gRPC or served uncached, an owner that cannot be
//! reached) has its byte range dropped from the kernel's cache (a FUSE
//! `inval_inode` of that range) and its record forgotten, so the next read
//! of it comes to the mount again and is recorded again. A write through
//! a writable cached mount records the pages it touched as written: the
//! kernel keeps whole pages written through its cache without reading
//! them, and nothing could tell later whether they are still the page, so
//! the next tick drops them unchecked. Records are keyed by first page and
//! length: a shorter run read again from the same page must not hide the
//! rest of a longer one the kernel may still hold.
//!
//! # The bound
//!
//! A check that finds a run current at time `c` means every page of it is,
//! at `c`, the bytes a read would return: no write to it was acknowledged
//! before `c` (the argument is
//! [`pagewire_client::RemoteReader::still_current`]'s). Bytes the kernel
//! holds came from a read or a write through the mount that was recorded
//! before its reply, hence before the kernel could hold them, and every
//! record is checked (or, for a write, dropped) by the first tick that
//! starts after it was made. So a write acknowledged at `t` is
//! seen by every read through the mount that starts after `t` + SECS +
//! the time a read may take (the deadline) + the time one tick's checks
//! take: the same bound as dropping every page every SECS seconds, with the
//! check's time added, and a page that nobody writes stays cached.
//!
//! # Memory
//!
//! Records are kept for at most [`MAX_PAGES`] pages. A read that would go
//! past it is not recorded and marks the table full; the next tick then
//! drops the whole file from the kernel's cache and forgets every record
//! (what the mode did at every tick before revalidation), so the bound
//! holds whatever the kernel caches. The kernel may also evict pages on its
//! own; their records stay until a check fails or the table is dropped
//! whole, and cost a READ per page per tick meanwhile.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pagewire_client::ReadInfo;

/// Pages recorded at most (1 GiB of cache at 4 KiB pages; a record costs
/// at most 56 bytes a page, so at most 14 MiB).
pub const MAX_PAGES: usize = 1 << 18;

/// Pages checked in one call at most: runs are handed to the check in
/// groups of about this many pages (a run is never split), each group under
/// one map and one trust window, so a trust window that runs out mid-round
/// drops only the runs of the group it cut. 4,096 pages: a few transport
/// batches per owner (1,024 READs each over tcp) and a call's buffers of
/// about 100 KiB each. With 65,536 (megabytes of buffers per call) a round
/// over shm in `pagewire-bench mount` took about twice as long as one call
/// per run (3.8 against 1.8 ms beside fio; not profiled further).
pub const CHECK_PAGES: usize = 1 << 12;

/// What revalidation did, since the mount started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RevalidateStats {
    /// Ticks run.
    pub ticks: u64,
    /// Runs checked, over every tick.
    pub checked: u64,
    /// Runs found current (kept cached).
    pub kept: u64,
    /// Runs dropped from the kernel's cache: changed, or not checkable.
    pub dropped: u64,
    /// Ticks that dropped the whole file (the table was full).
    pub dropped_all: u64,
    /// Time the ticks took, over every tick (checks and drops).
    pub busy: Duration,
    /// The longest tick.
    pub longest: Duration,
}

/// The runs the kernel may hold, by first page and length (runs of one
/// first page and different lengths are different runs: a shorter one must
/// not hide the rest of a longer one), each with how its pages were read
/// (None: written through this mount, so nothing to check it by).
#[derive(Default)]
struct Table {
    runs: HashMap<(u64, u64), Option<Vec<ReadInfo>>>,
    /// Pages in `runs`.
    pages: usize,
    /// A read was not recorded: the next tick drops everything.
    full: bool,
}

impl Table {
    /// Makes `pages` the record of run `key` (`key.1` pages), unless one
    /// is there and `replace` is false. Marks the table full instead, and
    /// returns false, when that could take it past `max_pages`.
    fn put(
        &mut self,
        key: (u64, u64),
        pages: Option<Vec<ReadInfo>>,
        max_pages: usize,
        replace: bool,
    ) -> bool {
        let len = key.1 as usize;
        let there = self.runs.contains_key(&key);
        let old = if there && replace { len } else { 0 };
        if self.pages - old + len > max_pages {
            self.full = true;
            return false;
        }
        if !there || replace {
            self.pages = self.pages - old + len;
            self.runs.insert(key, pages);
        }
        true
    }
}

/// The records of one cached mount ([`crate::Consistency::Cached`]).
pub struct Revalidator {
    table: Mutex<Table>,
    max_pages: usize,
    ticks: AtomicU64,
    checked: AtomicU64,
    kept: AtomicU64,
    dropped: AtomicU64,
    dropped_all: AtomicU64,
    /// Nanoseconds.
    busy: AtomicU64,
    longest: AtomicU64,
}

/// What a tick asks the kernel to drop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Invalidate {
    /// Pages `first..first + count` of the cluster's file.
    Run { first: u64, count: u64 },
    /// Every cached page of the file.
    All,
}

impl Default for Revalidator {
    fn default() -> Self {
        Self::new(MAX_PAGES)
    }
}

impl Revalidator {
    /// Records of at most `max_pages` pages.
    pub fn new(max_pages: usize) -> Self {
        Self {
            table: Mutex::new(Table::default()),
            max_pages,
            ticks: AtomicU64::new(0),
            checked: AtomicU64::new(0),
            kept: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            dropped_all: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            longest: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that pages `first..first + pages.len()` were just read as
    /// `pages` say (call before the reply leaves). A newer record of the
    /// same run replaces the older one (the kernel reads only pages it
    /// does not hold, so it holds the newer bytes).
    pub fn record(&self, first: u64, pages: &[ReadInfo]) {
        self.insert((first, pages.len() as u64), Some(pages.to_vec()));
    }

    /// Records that pages `first..first + count` were written through this
    /// mount (call before the reply leaves): the kernel keeps the bytes of
    /// whole pages written through its cache, with no read, and nothing
    /// tells later whether they are still the page, so the next tick drops
    /// them.
    pub fn record_written(&self, first: u64, count: u64) {
        self.insert((first, count), None);
    }

    fn insert(&self, key: (u64, u64), pages: Option<Vec<ReadInfo>>) {
        self.lock().put(key, pages, self.max_pages, true);
    }

    /// One period's revalidation: checks every recorded run with
    /// `still_current(runs)` (one answer per `(first, pages)` run, in order;
    /// runs are passed in groups of about [`CHECK_PAGES`] pages, a run never
    /// split) and asks `invalidate` to drop each run that is not current
    /// (or the whole file, once, when the table was full), then keeps the
    /// records of the current runs. Reads recorded while it
    /// runs are kept for the next tick (a record of the same run made
    /// meanwhile is newer than the one checked, and wins). Runs written
    /// through the mount are dropped without a check.
    pub fn tick(
        &self,
        still_current: impl Fn(&[(u64, &[ReadInfo])]) -> Vec<bool>,
        invalidate: impl FnMut(Invalidate),
    ) {
        let started = Instant::now();
        self.check(still_current, invalidate);
        let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.ticks.fetch_add(1, Ordering::Relaxed);
        self.busy.fetch_add(ns, Ordering::Relaxed);
        self.longest.fetch_max(ns, Ordering::Relaxed);
    }

    fn check(
        &self,
        still_current: impl Fn(&[(u64, &[ReadInfo])]) -> Vec<bool>,
        mut invalidate: impl FnMut(Invalidate),
    ) {
        let taken = std::mem::take(&mut *self.lock());
        if taken.full {
            self.dropped_all.fetch_add(1, Ordering::Relaxed);
            invalidate(Invalidate::All);
            return;
        }
        let mut kept = Vec::with_capacity(taken.runs.len());
        self.checked
            .fetch_add(taken.runs.len() as u64, Ordering::Relaxed);
        // Written runs: dropped unchecked. Read runs: checked in groups.
        let mut read = Vec::with_capacity(taken.runs.len());
        for ((first, count), pages) in taken.runs {
            match pages {
                Some(pages) => read.push(((first, count), pages)),
                None => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    invalidate(Invalidate::Run { first, count });
                }
            }
        }
        let mut read = read.into_iter();
        let mut group: Vec<((u64, u64), Vec<ReadInfo>)> = Vec::new();
        loop {
            // Empty here: the previous group was drained below.
            let mut pages = 0;
            while pages < CHECK_PAGES {
                let Some(run) = read.next() else { break };
                pages += run.1.len();
                group.push(run);
            }
            if group.is_empty() {
                break;
            }
            let asked: Vec<(u64, &[ReadInfo])> = group
                .iter()
                .map(|((first, _), p)| (*first, &p[..]))
                .collect();
            let answers = still_current(&asked);
            assert_eq!(answers.len(), asked.len(), "one answer per run checked");
            drop(asked);
            for (((first, count), pages), current) in group.drain(..).zip(answers) {
                if current {
                    self.kept.fetch_add(1, Ordering::Relaxed);
                    kept.push(((first, count), pages));
                } else {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    invalidate(Invalidate::Run { first, count });
                }
            }
        }
        let mut t = self.lock();
        for (key, pages) in kept {
            // Full only if reads filled the table while the checks ran: the
            // next tick drops everything anyway.
            if !t.put(key, Some(pages), self.max_pages, false) {
                break;
            }
        }
    }

    /// What it did so far.
    pub fn stats(&self) -> RevalidateStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RevalidateStats {
            ticks: get(&self.ticks),
            checked: get(&self.checked),
            kept: get(&self.kept),
            dropped: get(&self.dropped),
            dropped_all: get(&self.dropped_all),
            busy: Duration::from_nanos(get(&self.busy)),
            longest: Duration::from_nanos(get(&self.longest)),
        }
    }

    /// Pages recorded now.
    pub fn recorded_pages(&self) -> usize {
        self.lock().pages
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagewire_client::{ReadInfo, Via};

    fn info(generation: u64) -> ReadInfo {
        ReadInfo {
            via: Via::OneSided,
            owner: 1,
            attempts: 1,
            transport: None,
            generation,
            coalesced: false,
            copy: None,
        }
    }

    fn run(generation: u64, n: usize) -> Vec<ReadInfo> {
        vec![info(generation); n]
    }

    /// A check that calls a run current iff every page's generation is odd.
    fn odd(runs: &[(u64, &[ReadInfo])]) -> Vec<bool> {
        runs.iter()
            .map(|(_, p)| p.iter().all(|i| i.generation % 2 == 1))
            .collect()
    }

    fn tick(r: &Revalidator) -> Vec<Invalidate> {
        let mut out = Vec::new();
        r.tick(odd, |d| out.push(d));
        out.sort_by_key(|d| match d {
            Invalidate::Run { first, .. } => *first,
            Invalidate::All => u64::MAX,
        });
        out
    }

    #[test]
    fn current_runs_stay_and_changed_ones_are_dropped_once() {
        let r = Revalidator::new(100);
        r.record(0, &run(1, 8));
        r.record(8, &run(2, 8));
        r.record(16, &run(3, 4));
        assert_eq!(r.recorded_pages(), 20);
        assert_eq!(tick(&r), vec![Invalidate::Run { first: 8, count: 8 }]);
        assert_eq!(r.recorded_pages(), 12);
        // Checked again at every tick; the dropped run is forgotten.
        assert_eq!(tick(&r), vec![]);
        let s = r.stats();
        assert_eq!(
            (s.ticks, s.checked, s.kept, s.dropped, s.dropped_all),
            (2, 5, 4, 1, 0)
        );
        assert!(s.longest <= s.busy);
    }

    #[test]
    fn runs_are_checked_in_groups_of_about_check_pages_pages() {
        // 3 * CHECK_PAGES / 256 runs of 256 pages: three calls, each
        // answering every run it was given, in order.
        let r = Revalidator::new(4 * CHECK_PAGES);
        let n = 3 * CHECK_PAGES / 256;
        for i in 0..n as u64 {
            r.record(i * 256, &run(if i == 7 { 2 } else { 1 }, 256));
        }
        let calls = std::cell::RefCell::new(Vec::new());
        let mut drops = Vec::new();
        r.tick(
            |runs| {
                calls.borrow_mut().push(runs.len());
                odd(runs)
            },
            |d| drops.push(d),
        );
        assert_eq!(*calls.borrow(), vec![CHECK_PAGES / 256; 3]);
        assert_eq!(
            drops,
            vec![Invalidate::Run {
                first: 7 * 256,
                count: 256
            }]
        );
        assert_eq!(r.recorded_pages(), (n - 1) * 256);
    }

    #[test]
    fn a_record_costs_what_the_limit_is_sized_for() {
        // MAX_PAGES records: at most 14 MiB ([`MAX_PAGES`]).
        assert!(std::mem::size_of::<ReadInfo>() <= 56);
    }

    #[test]
    fn a_newer_record_of_a_run_replaces_the_older() {
        let r = Revalidator::new(100);
        r.record(0, &run(2, 8));
        r.record(0, &run(1, 8));
        assert_eq!(r.recorded_pages(), 8);
        assert_eq!(tick(&r), vec![]);
    }

    #[test]
    fn a_shorter_run_from_the_same_page_does_not_hide_the_longer_one() {
        // The kernel read pages 0..8, dropped and read again 0..4: it may
        // still hold 4..8 as the first read left them.
        let r = Revalidator::new(100);
        let mut first = run(1, 8);
        first[6].generation = 2;
        r.record(0, &first);
        r.record(0, &run(1, 4));
        assert_eq!(r.recorded_pages(), 12);
        assert_eq!(tick(&r), vec![Invalidate::Run { first: 0, count: 8 }]);
        assert_eq!(r.recorded_pages(), 4);
    }

    #[test]
    fn pages_written_through_the_mount_are_dropped_at_the_next_tick() {
        let r = Revalidator::new(100);
        r.record(0, &run(1, 8));
        r.record_written(5, 2);
        assert_eq!(r.recorded_pages(), 10);
        assert_eq!(tick(&r), vec![Invalidate::Run { first: 5, count: 2 }]);
        assert_eq!(tick(&r), vec![]);
        assert_eq!(r.recorded_pages(), 8);
    }

    #[test]
    fn a_read_past_the_limit_makes_the_next_tick_drop_everything() {
        let r = Revalidator::new(10);
        r.record(0, &run(1, 8));
        r.record(8, &run(1, 4));
        assert_eq!(r.recorded_pages(), 8);
        assert_eq!(tick(&r), vec![Invalidate::All]);
        // Everything forgotten: recording starts over.
        assert_eq!(r.recorded_pages(), 0);
        r.record(8, &run(1, 4));
        assert_eq!(tick(&r), vec![]);
        assert_eq!(r.stats().dropped_all, 1);
    }

    #[test]
    fn a_record_made_during_the_checks_wins_over_the_checked_one() {
        let r = Revalidator::new(100);
        r.record(0, &run(1, 4));
        let mut drops = Vec::new();
        r.tick(
            |runs| {
                // A read of the same run, recorded while this tick checks:
                // even generations, so the next tick must drop it.
                r.record(runs[0].0, &run(2, 4));
                odd(runs)
            },
            |d| drops.push(d),
        );
        assert!(drops.is_empty());
        assert_eq!(tick(&r), vec![Invalidate::Run { first: 0, count: 4 }]);
    }
}
