//! This node's own view of its lease, by its own monotonic clock, one that
//! counts the time the machine spends suspended ([`pagewire_client::clock`]): a node
//! suspended past its lease wakes up with the lease over, as the
//! coordinator sees it.
//!
//! The coordinator declares a node dead `lease` after it *received* the
//! node's last heartbeat; the node counts from when it *sent* it, which was
//! earlier, and takes off a clock-drift margin: so, as long as the two clocks
//! drift apart by less than the margin over one lease, the node stops
//! answering before the coordinator can hand its extents to anyone else.
//!
//! A heartbeat renews the lease only if the node had applied the
//! coordinator's current epoch when it sent it (the reply carries that
//! epoch): a node lagging behind the map lets its lease run out instead of
//! answering from a map that may have taken extents away from it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub(crate) struct Lease {
    base: Instant,
    /// Nanoseconds after `base` until which the lease holds; 0: none.
    until: AtomicU64,
    margin: Duration,
}

impl Lease {
    pub(crate) fn new(margin: Duration) -> Self {
        Self {
            base: Instant::now(),
            until: AtomicU64::new(0),
            margin,
        }
    }

    fn nanos(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
    }

    /// A grant of `lease` for a request sent at `sent`; never shortens the
    /// current one.
    pub(crate) fn renew(&self, sent: Instant, lease: Duration) {
        let Some(valid) = lease.checked_sub(self.margin) else {
            tracing::error!(
                lease_ms = lease.as_millis(),
                margin_ms = self.margin.as_millis(),
                "the clock-drift margin is not shorter than the lease: this node cannot serve"
            );
            return;
        };
        // Relaxed: the value itself is the whole message; readers compare it
        // with their own clock.
        self.until
            .fetch_max(self.nanos(sent + valid).max(1), Ordering::Relaxed);
    }

    /// Ends the lease now (declared dead, leaving, lost).
    pub(crate) fn revoke(&self) {
        self.until.store(0, Ordering::Relaxed);
    }

    /// Whether the lease holds now.
    pub(crate) fn valid(&self) -> bool {
        self.nanos(pagewire_client::clock::now()) < self.until.load(Ordering::Relaxed)
    }

    /// Whether a lease was granted and has run out since (not revoked).
    pub(crate) fn lapsed(&self) -> bool {
        let until = self.until.load(Ordering::Relaxed);
        until != 0 && self.nanos(pagewire_client::clock::now()) >= until
    }

    pub(crate) fn margin(&self) -> Duration {
        self.margin
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::Lease;

    #[test]
    fn counts_from_the_send_time_less_the_margin() {
        let l = Lease::new(Duration::from_millis(40));
        assert!(!l.valid() && !l.lapsed(), "no lease before the first grant");
        let sent = Instant::now();
        l.renew(sent, Duration::from_millis(100));
        assert!(l.valid());
        std::thread::sleep(
            (sent + Duration::from_millis(61)).saturating_duration_since(Instant::now()),
        );
        assert!(!l.valid(), "valid past send + lease - margin");
        assert!(l.lapsed());
        l.renew(Instant::now(), Duration::from_secs(10));
        l.renew(sent, Duration::from_millis(100));
        assert!(l.valid(), "an older grant must not shorten a newer one");
        l.revoke();
        assert!(!l.valid() && !l.lapsed());
        l.renew(Instant::now(), Duration::from_millis(40));
        assert!(!l.valid(), "a lease no longer than the margin never holds");
    }

    /// Issue 18, finding 8: the lease counted by CLOCK_MONOTONIC, which
    /// stops while the machine is suspended, so a node suspended past its
    /// lease woke up still answering (the coordinator had moved its
    /// extents). A suspend is simulated on this thread.
    #[test]
    fn a_suspend_longer_than_the_lease_ends_it() {
        let l = Lease::new(Duration::from_millis(100));
        l.renew(pagewire_client::clock::now(), Duration::from_secs(3));
        assert!(l.valid());
        pagewire_client::clock::suspend_for_test(Duration::from_secs(10));
        assert!(!l.valid(), "still valid after a 10 s suspend");
        assert!(l.lapsed());
    }
}
