//! Adaptive polling for `tcp`: spin on a non-blocking socket for a bounded
//! time before blocking, within a per-process budget of spinning threads.
//!
//! A blocking loopback round trip pays two wake-ups (tens of µs on an idle
//! VM core); a thread that polls its socket for a few µs after it answered
//! (the responder) or after it posted (the reader) catches the next message
//! without one. Spinning burns a core, and on a busy machine it is worse
//! than blocking: a spinner that the scheduler preempts (other processes want
//! the core) sees its message only at its next time slice, while a thread
//! that slept is woken ahead of them. So spinning backs off three ways:
//!
//! * **Budget.** A process lets at most `cap = available_parallelism() - 1`
//!   threads of each role spin at once; the rest block at once, and with one
//!   core nobody spins. When a role has more waiters than `cap` (serving
//!   threads, connections with spinning enabled), none of them spins: many
//!   clients on few cores keep every core busy with real work, and a
//!   spinner would only delay them.
//! * **Window** ([`AdaptiveSpin`], one per serving thread or connection,
//!   after KVM's halt polling): it starts at the configured spin; a wait
//!   that ended by blocking longer than that halves it (traffic too sparse
//!   for spinning to pay), down to zero; a blocking wait shorter than the
//!   configured spin, or a spin that caught its message, doubles it again
//!   (from an eighth of it). A closed window is probed every 64 waits with
//!   an eighth of the spin: a blocking wait pays the wake-up itself, which
//!   here costs more than the spin, so without probes a window closed by an
//!   idle spell would never reopen under dense traffic.
//! * **Preemption.** A spin during which the thread was involuntarily
//!   switched out (`getrusage(RUSAGE_THREAD)`'s `ru_nivcsw` grew) means the
//!   cores are oversubscribed: no spinning for the next 16 waits; the next
//!   cooldown doubles (up to 4096 waits) each time it happens and halves
//!   (down to 16) after each spin that caught its message unpreempted.
//!
//! A spinning thread yields (`sched_yield`) between polls after the first
//! few, so a runnable peer on its core still gets to run.
//!
//! # Protocol
//!
//! **State.** Per role ([`RESPONDER`], [`READER`]), a counter of threads
//! spinning now, `0 ..= cap`, and a counter of waiters (live
//! [`AdaptiveSpin`]s with a non-zero spin).
//!
//! **Fields.** `spinning` is changed only by [`SpinBudget::try_acquire`]
//! (increment) and by dropping the [`SpinSlot`] it returned (decrement);
//! `waiters` only by [`AdaptiveSpin::new`] (increment) and its `Drop`
//! (decrement).
//!
//! **Transitions.** 1. acquire: `n -> n + 1` by CAS, only if `n < cap`
//! and `waiters <= cap`; otherwise the thread does not spin. 2. release:
//! `n -> n - 1`, exactly once per successful acquire (the slot's `Drop`).
//! 3. a waiter comes (`waiters + 1`) or goes (`waiters - 1`).
//!
//! **Ordering.** `Relaxed` everywhere: the counter protects no data, only
//! CPU time; a thread that sees a stale count at worst blocks instead of
//! spinning (or the reverse, once), and the CAS keeps the count exact.
//!
//! **Critical interleavings.** Two threads race for the last slot: one CAS
//! wins, the other fails and re-reads `n == cap`, so it blocks. A waiter
//! arrives just after another thread checked `waiters <= cap`: that one
//! spin episode runs anyway, bounded by its window; the next one sees the
//! new count. A spinner
//! that panics releases its slot while unwinding (`Drop`).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How many threads of one role may spin at once.
pub(crate) struct SpinBudget {
    spinning: AtomicUsize,
    waiters: AtomicUsize,
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
            waiters: AtomicUsize::new(0),
            cap,
        }
    }

    /// A slot to spin in, or `None` when enough threads spin already or
    /// more waiters than cores-to-spare share the role.
    pub(crate) fn try_acquire(&self) -> Option<SpinSlot<'_>> {
        let cap = self.cap.unwrap_or_else(default_cap);
        if self.waiters.load(Ordering::Relaxed) > cap {
            return None;
        }
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

/// Polls before yielding between polls.
const PURE_SPINS: u32 = 16;
/// Waits without spinning after the first preemption during a spin.
const COOLDOWN_START: u32 = 16;
/// A closed window is reopened (to an eighth of the configured spin) once
/// every this many waits.
const PROBE_EVERY: u32 = 64;

/// Longest cooldown, in waits.
const COOLDOWN_MAX: u32 = 4096;

/// Involuntary context switches of the calling thread so far.
fn involuntary_switches() -> i64 {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `getrusage` fills the zeroed struct we pass; RUSAGE_THREAD
        // is valid on Linux.
        let ru = unsafe {
            let mut ru: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_THREAD, &mut ru);
            ru
        };
        #[allow(clippy::useless_conversion, reason = "c_long is i32 on some targets")]
        i64::from(ru.ru_nivcsw)
    }
    #[cfg(not(target_os = "linux"))]
    {
        0
    }
}

/// The spin window of one waiter (a serving thread, a connection).
pub(crate) struct AdaptiveSpin {
    budget: &'static SpinBudget,
    max: Duration,
    window: Duration,
    /// Waits left that must not spin (after a preemption).
    cooldown: u32,
    /// Waits since the window closed; every [`PROBE_EVERY`]th reopens it
    /// to an eighth of `max` (a probe).
    closed_waits: u32,
    /// The next cooldown's length.
    next_cooldown: u32,
}

/// One spin in progress: holds a budget slot until [`AdaptiveSpin::end`].
pub(crate) struct Episode {
    _slot: SpinSlot<'static>,
    /// Poll until then, then block.
    pub(crate) until: Instant,
    switches: i64,
    polls: u32,
}

impl Episode {
    /// Between two polls: a CPU hint, then, after a few polls, a yield.
    pub(crate) fn pause(&mut self) {
        self.polls += 1;
        if self.polls < PURE_SPINS {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

impl AdaptiveSpin {
    /// A waiter of `budget`'s role spinning up to `max`; zero never spins
    /// (and does not count as a waiter).
    pub(crate) fn new(budget: &'static SpinBudget, max: Duration) -> Self {
        if !max.is_zero() {
            budget.waiters.fetch_add(1, Ordering::Relaxed);
        }
        Self {
            budget,
            max,
            window: max,
            cooldown: 0,
            closed_waits: 0,
            next_cooldown: COOLDOWN_START,
        }
    }

    /// Starts a spin, or `None` to block at once (no window, cooling down
    /// after a preemption, or the budget full).
    pub(crate) fn begin(&mut self) -> Option<Episode> {
        if self.window.is_zero() {
            // A closed window cannot learn that traffic became dense again:
            // every blocking wait costs a wake-up (tens of µs here, more than
            // a typical window), so it would stay closed for good. Probe now
            // and then with a small window; a spin that catches its message
            // widens it (`end`).
            self.closed_waits += 1;
            if self.max.is_zero() || self.closed_waits < PROBE_EVERY {
                return None;
            }
            self.closed_waits = 0;
            self.window = self.max / 8;
        }
        if self.cooldown > 0 {
            self.cooldown -= 1;
            return None;
        }
        let slot = self.budget.try_acquire()?;
        Some(Episode {
            _slot: slot,
            until: Instant::now() + self.window,
            switches: involuntary_switches(),
            polls: 0,
        })
    }

    /// Ends a spin; `got` when it caught what it waited for.
    pub(crate) fn end(&mut self, episode: Episode, got: bool) {
        let preempted = involuntary_switches() > episode.switches;
        drop(episode);
        if preempted {
            self.cooldown = self.next_cooldown;
            self.next_cooldown = (self.next_cooldown * 2).min(COOLDOWN_MAX);
            tracing::trace!(
                cooldown = self.cooldown,
                "tcp: preempted while spinning, blocking for a while"
            );
        } else if got {
            self.next_cooldown = (self.next_cooldown / 2).max(COOLDOWN_START);
            // Caught within the window: traffic is dense enough to spin for.
            self.window = (self.window * 2).min(self.max);
        }
    }

    /// After a wait that blocked for `blocked`: adapts the window.
    pub(crate) fn blocked(&mut self, blocked: Duration) {
        if self.max.is_zero() {
            return;
        }
        if blocked > self.max {
            self.window /= 2;
            if self.window < Duration::from_micros(1) {
                self.window = Duration::ZERO;
            }
        } else {
            self.window = (self.window * 2).max(self.max / 8).min(self.max);
        }
    }
}

impl Drop for AdaptiveSpin {
    fn drop(&mut self) {
        if !self.max.is_zero() {
            self.budget.waiters.fetch_sub(1, Ordering::Relaxed);
        }
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

    #[test]
    fn window_shrinks_when_blocking_long_and_grows_back() {
        static B: SpinBudget = SpinBudget::new(Some(1));
        let max = Duration::from_micros(80);
        let mut a = AdaptiveSpin::new(&B, max);
        for _ in 0..10 {
            a.blocked(Duration::from_millis(5));
        }
        assert_eq!(a.window, Duration::ZERO, "sparse traffic stops spinning");
        assert!(a.begin().is_none());
        // Dense traffic again, but every blocking wait costs a wake-up longer
        // than the window: a probe reopens it, and a caught spin widens it.
        for _ in 1..PROBE_EVERY - 1 {
            assert!(a.begin().is_none(), "closed between probes");
        }
        let mut probe = a.begin().expect("a probe after PROBE_EVERY waits");
        probe.switches = i64::MAX; // not preempted (a loaded machine may preempt it)
        a.end(probe, true);
        assert_eq!(
            a.window,
            max / 4,
            "a probe that caught its message widens the window"
        );
        for _ in 0..10 {
            a.blocked(Duration::from_millis(5));
        }
        assert_eq!(a.window, Duration::ZERO);
        a.blocked(Duration::from_micros(20));
        assert_eq!(a.window, max / 8, "short blocking waits bring it back");
        for _ in 0..5 {
            a.blocked(Duration::from_micros(20));
        }
        assert_eq!(a.window, max);
        let mut ep = a.begin().expect("a window and a free budget");
        assert!(B.try_acquire().is_none(), "the episode holds the slot");
        ep.switches = i64::MAX; // not preempted: no cooldown after it
        a.end(ep, true);
        assert!(B.try_acquire().is_some(), "ending the episode frees it");
        assert!(AdaptiveSpin::new(&B, Duration::ZERO).begin().is_none());
        // A second waiter in a role with one core to spare: nobody spins.
        let b = AdaptiveSpin::new(&B, max);
        assert!(a.begin().is_none(), "two waiters, cap 1");
        drop(b);
        assert!(a.begin().is_some(), "alone again");
    }

    #[test]
    fn preemption_while_spinning_cools_down() {
        static B: SpinBudget = SpinBudget::new(Some(4));
        let mut a = AdaptiveSpin::new(&B, Duration::from_micros(50));
        let mut ep = a.begin().expect("spin");
        ep.switches = -1; // as if preempted during the spin
        a.end(ep, true);
        for _ in 0..COOLDOWN_START {
            assert!(a.begin().is_none(), "cooling down");
        }
        assert_eq!(a.next_cooldown, 2 * COOLDOWN_START);
        let mut ep = a.begin().expect("spins again after the cooldown");
        ep.switches = i64::MAX; // a clean spin, however loaded the machine
        a.end(ep, true);
        assert_eq!(a.next_cooldown, COOLDOWN_START, "a clean spin halves it");
    }
}
