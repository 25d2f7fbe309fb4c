//! Taking frames for fills and writes, and evicting to free them: the
//! eviction policies' sweeps (CLOCK, or the oldest stamp of a random sample
//! for `lru` and `fifo`) and the reserve that keeps frames flowing while
//! freed ones sit out their epoch grace period ([`crate::raw::frames`],
//! transition 8). Part of [`PageCache`]; split from `cache.rs` by job.

use super::PageCache;
use crate::core::Sweep;
use crate::error::ReadError;
use crate::index::Index;
use crate::policy::Eviction;
use crate::stats::Counter;
use std::cell::Cell;

/// A per-thread xorshift64* generator for eviction samples.
fn next_random() -> u64 {
    thread_local! {
        // Seeded by the thread's own address.
        static RNG: Cell<u64> = Cell::new((&RNG as *const _ as u64 ^ 0x9E37_79B9_7F4A_7C15) | 1);
    }
    RNG.with(|r| {
        let mut x = r.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        r.set(x);
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    })
}

impl<I: Index> PageCache<I> {
    /// A free frame, evicting if there is none, or, in a cache of at least
    /// 64 eviction batches that once found no free frame, if the frames
    /// free and waiting fall below one batch: frames an eviction frees
    /// reach the free list only after their grace period, so the next batch
    /// starts while the list still has frames, and a miss rarely waits for
    /// one. (A smaller cache keeps its policy's exact order: it evicts only
    /// when it has no frame. A cache that never ran out keeps no reserve:
    /// one with a frame per page of what it is given holds all of it, where
    /// a reserve of a batch would make every page of a sequential pass miss
    /// under CLOCK.)
    pub(super) fn alloc_frame(&self) -> Result<u32, ReadError> {
        self.alloc_frame_waiting(true)
    }

    /// [`PageCache::alloc_frame`]; with `wait`, a thread that holds no pin
    /// waits up to 250 ms for frames in their grace period before it
    /// reports `NoFrame` (a pinned thread descheduled on a loaded machine
    /// holds every grace period up for its time off the CPU).
    pub(super) fn alloc_frame_waiting(&self, wait: bool) -> Result<u32, ReadError> {
        let batch = self.cfg.evict_batch.max(1);
        let reserve = if self.core.frames.count() / batch >= 64
            && self.pressed.load(std::sync::atomic::Ordering::Relaxed)
        {
            batch
        } else {
            0
        };
        for _ in 0..8 {
            if let Some(f) = self.core.frames.alloc() {
                if self.core.frames.free_count() < reserve {
                    self.reclaim(batch);
                }
                return Ok(f);
            }
            if !self.pressed.load(std::sync::atomic::Ordering::Relaxed) {
                self.pressed
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
            self.reclaim(batch);
        }
        if let Some(f) = self.core.frames.alloc() {
            return Ok(f);
        }
        // Frames freed but waiting for their grace period wait for pins
        // older than their free (`lookup_pinned` hits, and the brief pins of
        // index walks and frees): give those pins time to drop, unless this
        // thread holds one itself (then they would not drop while it waits).
        // Each round evicts another batch too: other threads (readahead
        // above all) may take the frames that come back first, and this one
        // must not starve while they do.
        if wait && !crossbeam_epoch::is_pinned() {
            let mut wait = std::time::Duration::from_micros(20);
            let mut waited = std::time::Duration::ZERO;
            while waited < std::time::Duration::from_millis(250) {
                if self.reclaim(batch) == 0 && self.core.frames.free_count() == 0 {
                    break; // every frame is held or filling: no grace helps
                }
                if let Some(f) = self.core.frames.alloc() {
                    return Ok(f);
                }
                std::thread::sleep(wait);
                waited += wait;
                wait = (wait * 2).min(std::time::Duration::from_millis(5));
                if let Some(f) = self.core.frames.alloc() {
                    return Ok(f);
                }
            }
        }
        Err(ReadError::NoFrame)
    }

    /// Free up to `want` frames by the eviction policy: a CLOCK sweep, or
    /// for `lru`/`fifo` the oldest stamp of each random sample. Gives up
    /// after two full turns (CLOCK) or `2 × frames` samples.
    pub fn reclaim(&self, want: usize) -> usize {
        // One grace-period deferral for the whole batch of frees.
        self.core.frames.batch_frees(|| self.reclaim_batch(want))
    }

    fn reclaim_batch(&self, want: usize) -> usize {
        if self.policy().eviction != Eviction::Clock {
            return self.reclaim_sampled(want);
        }
        let (mut freed, mut busy) = (0, 0);
        let n = self.core.frames.count();
        for _ in 0..2 * n {
            if freed >= want {
                break;
            }
            match self.core.sweep(self.core.frames.clock_next()) {
                Sweep::Evicted => freed += 1,
                Sweep::Busy => busy += 1,
                Sweep::SecondChance | Sweep::Skip => {}
            }
        }
        self.stats.add(Counter::Evictions, freed as u64);
        self.stats.add(Counter::EvictBusy, busy);
        freed
    }

    fn reclaim_sampled(&self, want: usize) -> usize {
        let (mut freed, mut busy) = (0, 0);
        let n = self.core.frames.count();
        for _ in 0..2 * n {
            if freed >= want {
                break;
            }
            let Some(f) = self.oldest_sampled() else {
                continue;
            };
            match self.core.evict_chosen(f) {
                Sweep::Evicted => freed += 1,
                Sweep::Busy => busy += 1,
                Sweep::SecondChance | Sweep::Skip => {}
            }
        }
        self.stats.add(Counter::Evictions, freed as u64);
        self.stats.add(Counter::EvictBusy, busy);
        freed
    }

    /// The published frame with the smallest stamp among
    /// [`crate::policy::SAMPLE`] frames drawn at random (every frame when
    /// there are no more than that). Racy: the caller's eviction rechecks.
    fn oldest_sampled(&self) -> Option<u32> {
        let frames = &self.core.frames;
        let n = frames.count();
        let published = |f: u32| {
            frames.header(f).state.load(crate::sync::Ordering::Relaxed)
                == crate::layout::FrameState::Published as u32
        };
        let pick = |best: Option<(u64, u32)>, f: u32| {
            if !published(f) {
                return best;
            }
            let s = frames.stamp(f);
            match best {
                Some((b, _)) if b <= s => best,
                _ => Some((s, f)),
            }
        };
        let best = if n <= crate::policy::SAMPLE {
            (0..n as u32).fold(None, pick)
        } else {
            (0..crate::policy::SAMPLE).fold(None, |b, _| pick(b, (next_random() % n as u64) as u32))
        };
        best.map(|(_, f)| f)
    }
}
