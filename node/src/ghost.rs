//! The ghost set of the `second-hit` admission policy: which pages missed
//! recently, lossy and bounded.
//!
//! # State
//!
//! A direct-mapped table of `n` slots (a power of two, at least the cache's
//! frame count), 8 bytes each: `8 n` bytes, fixed at open. Slot `h(p)` (a
//! Fibonacci hash of the page) holds `p + 1` while it remembers page `p`'s
//! miss, or anything else (0: empty, or another page).
//!
//! # Transitions
//!
//! [`GhostSet::second_miss`]`(p)`: the slot holds `p + 1` → clear it (CAS to
//! 0) and answer *second miss* (admit); otherwise store `p + 1` (forgetting
//! whichever page the slot held) and answer *first miss* (do not admit).
//!
//! # Window
//!
//! A miss is remembered until a miss of another page that hashes to the same
//! slot overwrites it: after `m` later misses of other pages it survives with
//! probability about `(1 − 1/n)^m ≈ e^(−m/n)`, so the window is about `n`
//! misses, soft. No false positives (the slot stores the whole page number);
//! false negatives (a forgotten first miss) only delay an admission.
//!
//! # Ordering
//!
//! Relaxed throughout: the set is advisory. Nothing else is published
//! through it, and a lost update (two threads missing different pages of
//! one slot at once) only forgets a miss. Two misses of one page are
//! serialised by the cache's single-flight claim.

use std::sync::atomic::{AtomicU64, Ordering};

/// A bounded, lossy set of recently missed pages.
pub(crate) struct GhostSet {
    slots: Box<[AtomicU64]>,
    shift: u32,
}

impl GhostSet {
    /// A set of at least `entries` slots (rounded up to a power of two).
    pub(crate) fn new(entries: usize) -> Self {
        let n = entries.max(2).next_power_of_two();
        Self {
            slots: (0..n).map(|_| AtomicU64::new(0)).collect(),
            shift: 64 - n.trailing_zeros(),
        }
    }

    /// Slots in the table (each 8 bytes).
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    fn slot(&self, page: u64) -> &AtomicU64 {
        let h = page.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift;
        &self.slots[h as usize]
    }

    /// Record a miss of `page`; true if it is the page's second miss within
    /// the window (the caller admits the page; the set forgets it).
    pub(crate) fn second_miss(&self, page: u64) -> bool {
        let tag = page.wrapping_add(1);
        let s = self.slot(page);
        if s.load(Ordering::Relaxed) == tag {
            // A lost CAS means another miss took the slot meanwhile: still
            // this page's second miss.
            let _ = s.compare_exchange(tag, 0, Ordering::Relaxed, Ordering::Relaxed);
            return true;
        }
        s.store(tag, Ordering::Relaxed);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_on_the_second_miss_only_and_then_forgets() {
        let g = GhostSet::new(1000);
        assert_eq!(g.len(), 1024);
        assert!(!g.second_miss(7));
        assert!(g.second_miss(7));
        assert!(!g.second_miss(7), "an admitted page starts over");
        assert!(!g.second_miss(u64::MAX - 1));
        assert!(g.second_miss(u64::MAX - 1));
    }

    #[test]
    fn remembers_about_a_table_of_misses_and_no_more() {
        let g = GhostSet::new(1 << 12);
        let n = g.len() as u64;
        // First misses of n distinct pages, then their second misses: the
        // ones not overwritten by a colliding page are admitted (at least
        // about 1/e of them for a uniform hash; more for these keys, which
        // Fibonacci hashing spreads well).
        for p in 0..n {
            assert!(!g.second_miss(p * 3));
        }
        let admitted = (0..n).filter(|&p| g.second_miss(p * 3)).count() as u64;
        assert!(admitted > n / 3 && admitted <= n, "{admitted} of {n}");
        // Far beyond the window: a miss 8 n misses ago is forgotten.
        assert!(!g.second_miss(1 << 40));
        for p in 0..8 * n {
            let _ = g.second_miss((1 << 41) + p);
        }
        assert!(!g.second_miss(1 << 40), "remembered beyond 8 windows");
    }
}
