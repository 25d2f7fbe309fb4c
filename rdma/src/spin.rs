//! Adaptive polling for `tcp`: spin on a non-blocking socket for a bounded
//! time before blocking, within a per-process budget of spinning threads.
//!
//! A blocking loopback round trip pays two wake-ups (tens of µs on an idle
//! VM core); a thread that polls its socket for a few µs after it answered
//! (the responder) or after it posted (the reader) catches the next message
//! without one. Spinning burns a core, so a process lets at most
//! `available_parallelism() - 1` threads of each role spin at once; the rest
//! block at once, and with one core nobody spins.
//!
//! # Protocol
//!
//! **State.** Per role ([`RESPONDER`], [`READER`]), a counter of threads
//! spinning now, `0 ..= cap`.
//!
//! **Fields.** `spinning` is changed only by [`SpinBudget::try_acquire`]
//! (increment) and by dropping the [`SpinSlot`] it returned (decrement).
//!
//! **Transitions.** 1. acquire: `n -> n + 1` by CAS, only if `n < cap`;
//! otherwise the thread does not spin. 2. release: `n -> n - 1`, exactly
//! once per successful acquire (the slot's `Drop`).
//!
//! **Ordering.** `Relaxed` everywhere: the counter protects no data, only
//! CPU time; a thread that sees a stale count at worst blocks instead of
//! spinning (or the reverse, once), and the CAS keeps the count exact.
//!
//! **Critical interleavings.** Two threads race for the last slot: one CAS
//! wins, the other fails and re-reads `n == cap`, so it blocks. A spinner
//! that panics releases its slot while unwinding (`Drop`).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// How many threads of one role may spin at once.
pub(crate) struct SpinBudget {
    spinning: AtomicUsize,
    /// `None`: `available_parallelism() - 1`.
    cap: Option<usize>,
}

/// Serving threads of every `tcp` responder of this process.
pub(crate) static RESPONDER: SpinBudget = SpinBudget::new(None);
/// Waiting `tcp` connections of this process.
pub(crate) static READER: SpinBudget = SpinBudget::new(None);

fn default_cap() -> usize {
    static CAP: OnceLock<usize> = OnceLock::new();
    *CAP.get_or_init(|| {
        std::thread::available_parallelism().map_or(0, |n| n.get().saturating_sub(1))
    })
}

impl SpinBudget {
    pub(crate) const fn new(cap: Option<usize>) -> Self {
        Self {
            spinning: AtomicUsize::new(0),
            cap,
        }
    }

    /// A slot to spin in, or `None` when enough threads spin already.
    pub(crate) fn try_acquire(&self) -> Option<SpinSlot<'_>> {
        let cap = self.cap.unwrap_or_else(default_cap);
        self.spinning
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < cap).then_some(n + 1)
            })
            .ok()
            .map(|_| SpinSlot { budget: self })
    }
}

/// The right to spin; given back on drop.
pub(crate) struct SpinSlot<'a> {
    budget: &'a SpinBudget,
}

impl Drop for SpinSlot<'_> {
    fn drop(&mut self) {
        self.budget.spinning.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_cap_spinners() {
        let b = SpinBudget::new(Some(2));
        let s1 = b.try_acquire().expect("first");
        let s2 = b.try_acquire().expect("second");
        assert!(b.try_acquire().is_none(), "a third spinner over a cap of 2");
        drop(s1);
        let s3 = b.try_acquire().expect("a freed slot");
        assert!(b.try_acquire().is_none());
        drop((s2, s3));
        assert_eq!(b.spinning.load(Ordering::Relaxed), 0);
        assert!(SpinBudget::new(Some(0)).try_acquire().is_none());
    }
}
