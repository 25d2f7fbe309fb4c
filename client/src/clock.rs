//! The clock of leases and trust windows: monotonic, and counting the time
//! the machine spent suspended.
//!
//! `std::time::Instant` is `CLOCK_MONOTONIC`, which stops while the machine
//! is suspended: a node (or a client) suspended for longer than its lease
//! would wake up still trusting a lease (or a map) that the coordinator let
//! run out long ago, and answer from extents that have moved. `CLOCK_BOOTTIME`
//! keeps counting during suspend. [`now`] is an `Instant` moved forward by
//! the time spent suspended since the process first asked, so every lease
//! and trust window, computed and checked with it, counts suspend too, while
//! the rest of the code keeps the `Instant` type.
//!
//! Mixing the two clocks is safe in one direction only: a deadline computed
//! from [`now`] must be checked against [`now`] (checking it against
//! `Instant::now()` would trust it too long after a suspend); a deadline
//! from `Instant::now()` checked against [`now`] only ends early.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn read(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; both clocks exist on every
    // Linux this runs on (BOOTTIME since 2.6.39), so the call cannot fail.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

/// `BOOTTIME - MONOTONIC` now, in nanoseconds: the time suspended since boot.
/// The two clocks are read back to back; a pair the scheduler split apart
/// (more than 20 µs between the monotonic reads around the boot-time read)
/// is read again, so that no pause of this thread reads as a suspend.
fn suspended_since_boot() -> u64 {
    let mut best = u64::MAX;
    for _ in 0..4 {
        let m0 = read(libc::CLOCK_MONOTONIC);
        let b = read(libc::CLOCK_BOOTTIME);
        let m1 = read(libc::CLOCK_MONOTONIC);
        let mid = m0 + (m1.saturating_sub(m0)) / 2;
        let off = u64::try_from(b.saturating_sub(mid).as_nanos()).unwrap_or(u64::MAX);
        best = best.min(off);
        if m1.saturating_sub(m0) < Duration::from_micros(20) {
            break;
        }
    }
    best
}

/// The suspended time since the process first asked, never going back.
fn suspended() -> Duration {
    static BASE: OnceLock<u64> = OnceLock::new();
    static MAX: AtomicU64 = AtomicU64::new(0);
    let off = suspended_since_boot();
    let base = *BASE.get_or_init(|| off);
    let s = off.saturating_sub(base);
    // Relaxed: the value is the whole message; it only makes `now` never
    // go back when two reads disagree by their jitter.
    let s = MAX.fetch_max(s, Ordering::Relaxed).max(s);
    Duration::from_nanos(s) + injected()
}

/// Now, by a monotonic clock that counts suspend (see the module doc).
pub fn now() -> Instant {
    Instant::now() + suspended()
}

#[cfg(any(test, feature = "test-util"))]
thread_local! {
    static INJECTED: std::cell::Cell<Duration> = const { std::cell::Cell::new(Duration::ZERO) };
}

#[cfg(any(test, feature = "test-util"))]
fn injected() -> Duration {
    INJECTED.with(|c| c.get())
}

#[cfg(not(any(test, feature = "test-util")))]
fn injected() -> Duration {
    Duration::ZERO
}

/// Tests: as if this thread's machine had been suspended `d` more (feature
/// `test-util`; the node's lease tests use it).
#[cfg(any(test, feature = "test-util"))]
pub fn suspend_for_test(d: Duration) {
    INJECTED.with(|c| c.set(c.get() + d));
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    #[test]
    fn counts_suspend_and_never_goes_back() {
        let before = Instant::now();
        let a = super::now();
        assert!(a >= before, "behind the monotonic clock");
        super::suspend_for_test(Duration::from_secs(5));
        let b = super::now();
        assert!(b >= a + Duration::from_secs(5));
        let mut last = b;
        for _ in 0..10_000 {
            let t = super::now();
            assert!(t >= last, "went back");
            last = t;
        }
    }
}
