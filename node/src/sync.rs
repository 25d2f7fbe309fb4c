//! The synchronisation shim: std atomics and locks normally, loom's under `--cfg loom`.
//!
//! Every lock-free structure of this crate takes its atomics from here, so the
//! loom models in `src/loom_models.rs` explore the very code that ships. Run
//! them with both cfgs (crossbeam-epoch only becomes loom-aware with
//! `crossbeam_loom`):
//!
//! ```text
//! RUSTFLAGS="--cfg loom --cfg crossbeam_loom" cargo test -p pagewire-node --release --lib loom_models --target-dir target/loom
//! ```

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard, RwLock};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard, RwLock};

/// Spin (or, under loom, yield to the model) while waiting for a bit lock.
#[inline]
pub(crate) fn spin_wait(backoff: &crossbeam_utils::Backoff) {
    #[cfg(loom)]
    {
        let _ = backoff;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    backoff.snooze();
}

/// Back off before retrying a lookup whose recheck failed. Under loom this
/// yields, so the model lets the thread that changed the slot make progress
/// instead of exploring a reader that re-reads stale values forever.
#[inline]
pub(crate) fn retry_hint() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// `Pin::repin` of a guard (the loom models repin theirs): moves a pinned
/// thread to the epoch of now, protecting what it looks up next as a fresh
/// pin would (`raw::frames`, "Guard-scoped readers").
#[inline(always)]
pub(crate) fn repin(guard: &mut crossbeam_epoch::Guard) {
    // crossbeam's repin stores the new epoch (Release) when it moved, with
    // no fence; the fence makes it a fresh pin's store-then-fence, which
    // the frames protocol's argument takes before a reader's loads.
    guard.repin();
    fence(Ordering::SeqCst);
}

/// Lock a mutex, taking the data even if a panicking thread poisoned it: every
/// structure guarded this way is left consistent at each unlock point.
#[inline]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// `assert!` in debug builds and with feature `strict_assertions` (stress
/// runs in release), nothing otherwise: the protocol's invariants, checked
/// where a violation would otherwise corrupt state silently.
macro_rules! strict_assert {
    ($($t:tt)*) => {
        if cfg!(any(debug_assertions, feature = "strict_assertions")) {
            assert!($($t)*);
        }
    };
}
pub(crate) use strict_assert;
