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
//!   core nobody spins. When more than `cap` waiters of a role are busy
//!   (began a wait within the last 1–2 ms: serving threads and connections
//!   with traffic), none of them spins: many clients on few cores keep every
//!   core busy with real work, and a spinner would only delay them. Idle
//!   waiters (a connection nobody reads from, a serving thread whose client
//!   is quiet) do not count: they take no CPU.
//! * **Window** ([`AdaptiveSpin`], one per serving thread or connection,
//!   after KVM's halt polling): it starts at the configured spin; a wait
//!   that ended by blocking longer than that halves it (traffic too sparse
//!   for spinning to pay), down to zero; a blocking wait shorter than the
//!   configured spin, or a spin that caught its message, doubles it again
//!   (from an eighth of it). A closed window is probed every 64 waits with
//!   the whole configured spin: a blocking wait pays the wake-up itself,
//!   which here costs more than the spin, so without probes a window closed
//!   by an idle spell would never reopen under dense traffic. The probe is
//!   the whole spin, not a fraction of it, because both ends of a
//!   connection adapt: when both windows have closed (one end's cooldown
//!   after a preemption makes its answers slow, and the other end's spins
//!   miss them), every message wakes a sleeping peer, and a probe shorter
//!   than that wake-up (an eighth of 50 µs against 35–40 µs on an idle
//!   2-core VM) can never catch one. A probe costs at most one configured
//!   spin per 64 waits that each paid a wake-up anyway.
//! * **Preemption.** A spin during which the thread was involuntarily
//!   switched out (`getrusage(RUSAGE_THREAD)`'s `ru_nivcsw` grew) *and* lost
//!   its core for longer than the configured spin (the longest gap between
//!   two of its polls) means the cores are oversubscribed: no spinning for
//!   the next 16 waits; the next cooldown doubles (up to 4096 waits) each
//!   time it happens and halves (down to 16) after each spin that caught its
//!   message unpreempted. The gap matters because Linux counts a
//!   `sched_yield` that switched to another thread as an *involuntary*
//!   switch (`__schedule` charges `nivcsw` whenever the task is still
//!   runnable), so the spinner's own yield to the peer it waits for (the
//!   owner's serving thread woken on the reader's core, on two cores) read
//!   as a preemption: each started a cooldown, the blocked side's slow
//!   answers then closed the other side's window (blocks longer than the
//!   spin), and one client on an idle 2-core VM made 39 k reads/s against
//!   the spinning ping-pong's 69 k at the same p50.
//!
//! A spinning thread yields (`sched_yield`) between polls after the first
//! few, so a runnable peer on its core still gets to run.
//!
//! Every wait is counted by what it did ([`SpinStats`], per role and
//! process, `pagewire_rdma::tcp::spin_stats`): the benches print them
//! beside each `tcp` row, so a window that stays shut shows why.
//!
//! # Protocol
//!
//! **State.** Per role ([`RESPONDER`], [`READER`]), a counter of threads
//! spinning now, `0 ..= cap`; the busy waiters of the current and the
//! previous millisecond tick ([`Busy`]: a tick number and two counts); and
//! a counter of live waiters (statistics only).
//!
//! **Fields.** `spinning` is changed only by [`SpinBudget::try_acquire`]
//! (increment) and by dropping the [`SpinSlot`] it returned (decrement).
//! A waiter adds itself to the count of the tick it begins a wait in, at
//! most once per tick (it remembers the last tick it counted in); the
//! first waiter to see a new tick advances `tick` by CAS and zeroes the
//! count that tick reuses (both, if a whole tick passed without waits).
//!
//! **Transitions.** 1. acquire: `n -> n + 1` by CAS, only if `n < cap`
//! and the busy count (the larger of this tick's and the last one's) is
//! at most `cap`; otherwise the thread does not spin. 2. release:
//! `n -> n - 1`, exactly once per successful acquire (the slot's `Drop`).
//! 3. a waiter counts itself busy in a tick; 4. a new tick zeroes the
//! count it reuses.
//!
//! **Ordering.** `Relaxed` everywhere: the counters protect no data, only
//! CPU time; a thread that sees a stale count at worst blocks instead of
//! spinning (or the reverse, once), and the CAS keeps `spinning` exact.
//!
//! **Critical interleavings.** Two threads race for the last slot: one CAS
//! wins, the other fails and re-reads `n == cap`, so it blocks. A waiter
//! counts itself into a slot just before another thread zeroes it for the
//! new tick: it goes uncounted for up to one tick, so at worst one spin
//! episode runs that should not, bounded by its window. Two threads see
//! the new tick at once: one CAS wins and zeroes; the other's count lands
//! in the zeroed slot or, lost to the same race, is missing for a tick. A
//! spinner that panics releases its slot while unwinding (`Drop`).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How many threads of one role may spin at once.
pub(crate) struct SpinBudget {
    spinning: AtomicUsize,
    /// Live waiters (statistics only).
    waiters: AtomicUsize,
    /// Waiters that began a wait lately.
    busy: Busy,
    /// `None`: `available_parallelism() - 1`.
    cap: Option<usize>,
    /// What the role's waiters did, for [`stats`].
    counters: Counters,
}

/// What the waiters of one role did since the process started: every wait
/// either spins or says why it did not, and ends caught by a spin or by
/// blocking. Counted with `Relaxed` adds (statistics, no protocol), once
/// per wait: a wait is a round trip of microseconds, an add a few ns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SpinStats {
    /// Waiters of the role alive now (busy or idle).
    pub waiters: u64,
    /// Of `waiters`, those that began a wait in the last 1–2 ms.
    pub busy: u64,
    /// The most that may spin at once (cores - 1).
    pub cap: u64,
    /// Waits that began.
    pub waits: u64,
    /// Waits that spun.
    pub spins: u64,
    /// Spins that caught their message.
    pub caught: u64,
    /// Spins during which the thread was preempted (each starts a cooldown).
    pub preempted: u64,
    /// Waits that did not spin because the window was closed.
    pub closed: u64,
    /// Of `spins`, probes of a closed window.
    pub probes: u64,
    /// Waits that did not spin because of a cooldown.
    pub cooling: u64,
    /// Waits that did not spin because the budget was full (or more
    /// waiters than `cap`).
    pub no_budget: u64,
    /// Waits that blocked.
    pub blocks: u64,
    /// Of `blocks`, those longer than the configured spin (each halves the
    /// window).
    pub long_blocks: u64,
    /// Sum of the windows that spins began with, ns (`/ spins`: the mean).
    pub window_ns: u64,
}

impl SpinStats {
    /// The counts of `self` since `earlier` (`waiters` and `cap` as now).
    pub fn since(&self, earlier: &SpinStats) -> SpinStats {
        SpinStats {
            waiters: self.waiters,
            busy: self.busy,
            cap: self.cap,
            waits: self.waits.saturating_sub(earlier.waits),
            spins: self.spins.saturating_sub(earlier.spins),
            caught: self.caught.saturating_sub(earlier.caught),
            preempted: self.preempted.saturating_sub(earlier.preempted),
            closed: self.closed.saturating_sub(earlier.closed),
            probes: self.probes.saturating_sub(earlier.probes),
            cooling: self.cooling.saturating_sub(earlier.cooling),
            no_budget: self.no_budget.saturating_sub(earlier.no_budget),
            blocks: self.blocks.saturating_sub(earlier.blocks),
            long_blocks: self.long_blocks.saturating_sub(earlier.long_blocks),
            window_ns: self.window_ns.saturating_sub(earlier.window_ns),
        }
    }

    /// Mean window a spin began with, µs (0 without spins).
    pub fn mean_window_us(&self) -> f64 {
        if self.spins == 0 {
            0.0
        } else {
            self.window_ns as f64 / self.spins as f64 / 1e3
        }
    }
}

/// [`SpinStats`]' counts as atomics.
struct Counters {
    waits: AtomicU64,
    spins: AtomicU64,
    caught: AtomicU64,
    preempted: AtomicU64,
    closed: AtomicU64,
    probes: AtomicU64,
    cooling: AtomicU64,
    no_budget: AtomicU64,
    blocks: AtomicU64,
    long_blocks: AtomicU64,
    window_ns: AtomicU64,
}

impl Counters {
    const fn new() -> Self {
        Self {
            waits: AtomicU64::new(0),
            spins: AtomicU64::new(0),
            caught: AtomicU64::new(0),
            preempted: AtomicU64::new(0),
            closed: AtomicU64::new(0),
            probes: AtomicU64::new(0),
            cooling: AtomicU64::new(0),
            no_budget: AtomicU64::new(0),
            blocks: AtomicU64::new(0),
            long_blocks: AtomicU64::new(0),
            window_ns: AtomicU64::new(0),
        }
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// What the `tcp` readers (`READER`) and responders (`RESPONDER`) of
/// this process did since it started: `(reader, responder)`.
pub fn stats() -> (SpinStats, SpinStats) {
    (READER.snapshot(), RESPONDER.snapshot())
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
            busy: Busy::new(),
            cap,
            counters: Counters::new(),
        }
    }

    pub(crate) fn snapshot(&self) -> SpinStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SpinStats {
            waiters: self.waiters.load(Ordering::Relaxed) as u64,
            busy: self.busy.count(tick_now()) as u64,
            cap: self.cap.unwrap_or_else(default_cap) as u64,
            waits: l(&c.waits),
            spins: l(&c.spins),
            caught: l(&c.caught),
            preempted: l(&c.preempted),
            closed: l(&c.closed),
            probes: l(&c.probes),
            cooling: l(&c.cooling),
            no_budget: l(&c.no_budget),
            blocks: l(&c.blocks),
            long_blocks: l(&c.long_blocks),
            window_ns: l(&c.window_ns),
        }
    }

    /// A slot to spin in, or `None` when enough threads spin already or
    /// more busy waiters than cores-to-spare share the role (as of tick
    /// `now`).
    pub(crate) fn try_acquire(&self, now: u64) -> Option<SpinSlot<'_>> {
        let cap = self.cap.unwrap_or_else(default_cap);
        if self.busy.count(now) > cap {
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

/// The busy waiters of a role: how many distinct waiters began a wait in
/// the current millisecond tick and in the one before.
struct Busy {
    /// The newest tick anyone counted in.
    tick: AtomicU64,
    /// Waiters counted in ticks `tick` and `tick - 1`, at `t % 2`.
    counts: [AtomicUsize; 2],
}

/// Milliseconds since the first call in this process.
fn tick_now() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl Busy {
    const fn new() -> Self {
        Self {
            tick: AtomicU64::new(0),
            counts: [AtomicUsize::new(0), AtomicUsize::new(0)],
        }
    }

    /// Counts a waiter that last counted itself in tick `*last` as busy in
    /// tick `now` (once per tick).
    fn note(&self, last: &mut u64, now: u64) {
        if *last == now {
            return;
        }
        *last = now;
        let t = self.tick.load(Ordering::Relaxed);
        if now > t
            && self
                .tick
                .compare_exchange(t, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.counts[(now % 2) as usize].store(0, Ordering::Relaxed);
            if now > t + 1 {
                self.counts[((now + 1) % 2) as usize].store(0, Ordering::Relaxed);
            }
        }
        self.counts[(now % 2) as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Busy waiters as of tick `now`: the larger count of the last two
    /// ticks (0 when nobody waited in either).
    fn count(&self, now: u64) -> usize {
        let t = self.tick.load(Ordering::Relaxed);
        let at = |k: u64| self.counts[(k % 2) as usize].load(Ordering::Relaxed);
        if now > t + 1 {
            0
        } else if now == t + 1 {
            at(t)
        } else {
            at(t).max(at(t.wrapping_sub(1)))
        }
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
/// A closed window is reopened (to the whole configured spin) once every
/// this many waits.
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
    /// to `max` (a probe).
    closed_waits: u32,
    /// The next cooldown's length.
    next_cooldown: u32,
    /// The last tick this waiter counted itself busy in.
    last_tick: u64,
}

/// One spin in progress: holds a budget slot until [`AdaptiveSpin::end`].
pub(crate) struct Episode {
    _slot: SpinSlot<'static>,
    /// Poll until then, then block.
    pub(crate) until: Instant,
    switches: i64,
    polls: u32,
    /// When the spin began or last paused.
    last: Instant,
    /// The longest time between two pauses (or the start and the first, or
    /// the last and the end): how long the thread was away from its polls.
    longest_gap: Duration,
}

impl Episode {
    /// Between two polls: a CPU hint, then, after a few polls, a yield.
    /// `now` is the clock the caller just read to check `until`.
    pub(crate) fn pause(&mut self, now: Instant) {
        self.note_gap(now);
        self.polls += 1;
        if self.polls < PURE_SPINS {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }

    fn note_gap(&mut self, now: Instant) {
        self.longest_gap = self
            .longest_gap
            .max(now.saturating_duration_since(self.last));
        self.last = now;
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
            last_tick: u64::MAX,
        }
    }

    /// Starts a spin, or `None` to block at once (no window, cooling down
    /// after a preemption, or the budget full).
    pub(crate) fn begin(&mut self) -> Option<Episode> {
        if self.max.is_zero() {
            return None;
        }
        let c = &self.budget.counters;
        bump(&c.waits);
        let now = tick_now();
        self.budget.busy.note(&mut self.last_tick, now);
        let mut probe = false;
        if self.window.is_zero() {
            // A closed window cannot learn that traffic became dense again:
            // every blocking wait costs a wake-up (tens of µs here, more than
            // a typical window), so it would stay closed for good. Probe now
            // and then with the whole window (module docs: a smaller one
            // cannot catch a sleeping peer's answer); a spin that catches
            // its message keeps it open (`end`).
            self.closed_waits += 1;
            if self.closed_waits < PROBE_EVERY {
                bump(&c.closed);
                return None;
            }
            self.closed_waits = 0;
            self.window = self.max;
            probe = true;
        }
        if self.cooldown > 0 {
            self.cooldown -= 1;
            bump(&c.cooling);
            return None;
        }
        let Some(slot) = self.budget.try_acquire(now) else {
            bump(&c.no_budget);
            return None;
        };
        bump(&c.spins);
        if probe {
            bump(&c.probes);
        }
        c.window_ns.fetch_add(
            u64::try_from(self.window.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        let now = Instant::now();
        Some(Episode {
            _slot: slot,
            until: now + self.window,
            switches: involuntary_switches(),
            polls: 0,
            last: now,
            longest_gap: Duration::ZERO,
        })
    }

    /// Ends a spin; `got` when it caught what it waited for.
    pub(crate) fn end(&mut self, mut episode: Episode, got: bool) {
        episode.note_gap(Instant::now());
        // A switch alone may be the spinner's own yield to the peer it is
        // waiting for (module docs): preempted means away for longer than
        // it would have spun.
        let preempted = involuntary_switches() > episode.switches && episode.longest_gap > self.max;
        drop(episode);
        let c = &self.budget.counters;
        if got {
            bump(&c.caught);
        }
        if preempted {
            bump(&c.preempted);
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
        bump(&self.budget.counters.blocks);
        if blocked > self.max {
            bump(&self.budget.counters.long_blocks);
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
        let s1 = b.try_acquire(tick_now()).expect("first");
        let s2 = b.try_acquire(tick_now()).expect("second");
        assert!(
            b.try_acquire(tick_now()).is_none(),
            "a third spinner over a cap of 2"
        );
        drop(s1);
        let s3 = b.try_acquire(tick_now()).expect("a freed slot");
        assert!(b.try_acquire(tick_now()).is_none());
        drop((s2, s3));
        assert_eq!(b.spinning.load(Ordering::Relaxed), 0);
        assert!(SpinBudget::new(Some(0)).try_acquire(tick_now()).is_none());
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
        assert_eq!(
            a.window, max,
            "a probe spins as long as the configured spin: a sleeping peer's answer takes a wake-up"
        );
        probe.switches = i64::MAX; // not preempted (a loaded machine may preempt it)
        a.end(probe, true);
        assert_eq!(
            a.window, max,
            "a probe that caught its message keeps it open"
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
        assert!(
            B.try_acquire(tick_now()).is_none(),
            "the episode holds the slot"
        );
        ep.switches = i64::MAX; // not preempted: no cooldown after it
        a.end(ep, true);
        assert!(
            B.try_acquire(tick_now()).is_some(),
            "ending the episode frees it"
        );
        assert!(AdaptiveSpin::new(&B, Duration::ZERO).begin().is_none());
        // A second busy waiter in a role with one core to spare: nobody
        // spins. (A tick may pass between the two begins; then b counted
        // in the previous one, which still counts.)
        let mut b = AdaptiveSpin::new(&B, max);
        let _ = b.begin();
        assert!(a.begin().is_none(), "two busy waiters, cap 1");
        drop(b);
        // b is no longer busy once two ticks pass without a wait of its.
        std::thread::sleep(Duration::from_millis(3));
        assert!(a.begin().is_some(), "alone again");
    }

    /// Waiters that are alive but idle (connections nobody reads from,
    /// serving threads of quiet clients) take no CPU and do not stop a
    /// busy one from spinning.
    #[test]
    fn idle_waiters_do_not_stop_a_busy_one_from_spinning() {
        static B: SpinBudget = SpinBudget::new(Some(1));
        let max = Duration::from_micros(50);
        let idle: Vec<AdaptiveSpin> = (0..7).map(|_| AdaptiveSpin::new(&B, max)).collect();
        let mut a = AdaptiveSpin::new(&B, max);
        let mut ep = a.begin().expect("the one busy waiter spins");
        ep.switches = i64::MAX;
        a.end(ep, true);
        let st = B.snapshot();
        assert_eq!(st.waiters, 8);
        assert_eq!(st.busy, 1);
        assert_eq!((st.spins, st.caught, st.no_budget), (1, 1, 0));
        drop(idle);
    }

    #[test]
    fn busy_counts_each_waiter_once_per_tick_and_forgets_old_ticks() {
        let b = Busy::new();
        let (mut x, mut y) = (u64::MAX, u64::MAX);
        b.note(&mut x, 5);
        b.note(&mut x, 5);
        b.note(&mut y, 5);
        assert_eq!(b.count(5), 2, "two waiters, however many waits");
        assert_eq!(b.count(6), 2, "the last tick still counts");
        b.note(&mut x, 6);
        assert_eq!(b.count(6), 2, "max of this tick (1) and the last (2)");
        assert_eq!(b.count(8), 0, "two quiet ticks: nobody is busy");
        b.note(&mut y, 9);
        assert_eq!(b.count(9), 1, "both old counts were zeroed");
    }

    #[test]
    fn preemption_while_spinning_cools_down() {
        static B: SpinBudget = SpinBudget::new(Some(4));
        let mut a = AdaptiveSpin::new(&B, Duration::from_micros(50));
        let mut ep = a.begin().expect("spin");
        // As if preempted during the spin: switched out, and away longer
        // than the window.
        ep.switches = -1;
        ep.last -= Duration::from_millis(5);
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

    /// A yield that switched to another runnable thread counts as an
    /// involuntary switch; when the spinner was back at its polls within its
    /// window, that is the peer running briefly on its core, not a
    /// preemption, and must not stop it from spinning.
    #[test]
    fn a_short_switch_is_not_a_preemption() {
        static B: SpinBudget = SpinBudget::new(Some(4));
        // A window far longer than any stall of a loaded test machine
        // between two polls of this loop.
        let mut a = AdaptiveSpin::new(&B, Duration::from_secs(2));
        for _ in 0..3 {
            let mut ep = a.begin().expect("spins: no cooldown");
            ep.switches = -1; // switched out (a yield to the peer) ...
            ep.pause(Instant::now()); // ... and polling again right away
            a.end(ep, true);
        }
        assert_eq!(a.cooldown, 0);
        assert_eq!(a.next_cooldown, COOLDOWN_START);
    }
}
