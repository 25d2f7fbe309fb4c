//! Single flight: at most one thread fills or writes a given page at a time.
//!
//! A thread that misses claims the page here before it reads the backing
//! file; a second thread that misses on the same page waits for the first
//! and then finds the page in the index, so concurrent faults make one
//! backing read. Writers claim the page too, so a fault that read the file
//! before a write cannot insert stale bytes after it. Claims are sharded by
//! page so unrelated faults do not contend.

use crate::sync::{Condvar, Mutex};
use std::collections::HashSet;

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
