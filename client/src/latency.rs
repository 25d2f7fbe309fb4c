//! How long the client's reads take, by the path that answered them: a
//! histogram per path in fixed buckets (10 µs to about 1.3 s, doubling, the
//! buckets of the node's `grpc_read_seconds`), kept in plain atomic
//! counters in each thread slot so that timing a read shares no cache line
//! between threads. [`crate::ClusterClient::read_latency`] sums the slots;
//! with the feature `prometheus`, `metrics::collector` exports them
//! (and the client's counters) into a `prometheus-client` registry the
//! program serves.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in seconds: 10 µs × 2^i (the last finite
/// one about 1.31 s); one more bucket holds everything slower.
pub const BOUNDS_SECONDS: [f64; 18] = {
    let mut b = [0.0; 18];
    let mut i = 0;
    let mut v = 10e-6;
    while i < 18 {
        b[i] = v;
        v *= 2.0;
        i += 1;
    }
    b
};

/// The path a whole read call took (one label per call, however many
/// pages it read).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReadPathLabel {
    /// Every page read one-sidedly from its owner's memory.
    OneSided,
    /// At least one page faulted in on its owner (`FaultIn`) after a
    /// one-sided miss, none by the gRPC `Read`.
    Fallback,
    /// At least one page read by the owner's gRPC `Read`.
    Grpc,
    /// Answered by another thread's read of the same run (single flight).
    Coalesced,
}

impl ReadPathLabel {
    /// Every label, in the order [`crate::ClusterClient::read_latency`]
    /// returns them.
    pub const ALL: [ReadPathLabel; 4] = [
        ReadPathLabel::OneSided,
        ReadPathLabel::Fallback,
        ReadPathLabel::Grpc,
        ReadPathLabel::Coalesced,
    ];

    /// The metric label: `one_sided`, `fallback`, `grpc`, `coalesced`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ReadPathLabel::OneSided => "one_sided",
            ReadPathLabel::Fallback => "fallback",
            ReadPathLabel::Grpc => "grpc",
            ReadPathLabel::Coalesced => "coalesced",
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            ReadPathLabel::OneSided => 0,
            ReadPathLabel::Fallback => 1,
            ReadPathLabel::Grpc => 2,
            ReadPathLabel::Coalesced => 3,
        }
    }
}

/// A histogram's counts at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LatencyHistogram {
    /// Reads in each bucket (not cumulative), one per [`BOUNDS_SECONDS`]
    /// entry and a last one for slower reads.
    pub buckets: Vec<u64>,
    /// Reads timed.
    pub count: u64,
    /// Their total time, in seconds.
    pub sum_seconds: f64,
}

impl LatencyHistogram {
    /// The upper bound (seconds) of the bucket holding the `q` quantile
    /// (0..=1); `None` with no reads, infinity past the last bound.
    #[must_use]
    pub fn quantile_bound(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        // The rank of the quantile, 1-based: at least the first read.
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(BOUNDS_SECONDS.get(i).copied().unwrap_or(f64::INFINITY));
            }
        }
        Some(f64::INFINITY)
    }

    fn add(&mut self, other: &LatencyHistogram) {
        if self.buckets.len() < other.buckets.len() {
            self.buckets.resize(other.buckets.len(), 0);
        }
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.count += other.count;
        self.sum_seconds += other.sum_seconds;
    }
}

/// One path's histogram in one thread slot.
#[derive(Default)]
pub(crate) struct Latency {
    buckets: [AtomicU64; BOUNDS_SECONDS.len() + 1],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Latency {
    pub(crate) fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BOUNDS_SECONDS
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(BOUNDS_SECONDS.len());
        // Relaxed: statistics; a snapshot may see a read in `count` and not
        // yet in its bucket, never a torn value.
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(
            u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    fn snapshot(&self) -> LatencyHistogram {
        LatencyHistogram {
            buckets: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            count: self.count.load(Ordering::Relaxed),
            sum_seconds: self.sum_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}

/// A thread slot's histograms, one per [`ReadPathLabel`].
#[derive(Default)]
pub(crate) struct PathLatency([Latency; 4]);

impl PathLatency {
    pub(crate) fn observe(&self, path: ReadPathLabel, d: Duration) {
        self.0[path.index()].observe(d);
    }
}

/// Sums `slots` into one histogram per path, in [`ReadPathLabel::ALL`]'s
/// order.
pub(crate) fn sum<'a>(
    slots: impl Iterator<Item = &'a PathLatency>,
) -> Vec<(ReadPathLabel, LatencyHistogram)> {
    let mut out: Vec<(ReadPathLabel, LatencyHistogram)> = ReadPathLabel::ALL
        .iter()
        .map(|&p| (p, LatencyHistogram::default()))
        .collect();
    for s in slots {
        for (path, h) in out.iter_mut() {
            h.add(&s.0[path.index()].snapshot());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_land_in_their_buckets_and_quantiles_read_back() {
        let a = PathLatency::default();
        let b = PathLatency::default();
        a.observe(ReadPathLabel::OneSided, Duration::from_micros(5)); // ≤ 10 µs
        a.observe(ReadPathLabel::OneSided, Duration::from_micros(15)); // ≤ 20 µs
        b.observe(ReadPathLabel::OneSided, Duration::from_micros(20)); // ≤ 20 µs
        b.observe(ReadPathLabel::Grpc, Duration::from_secs(3)); // past the last
        let all = sum([&a, &b].into_iter());
        assert_eq!(
            all.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
            ReadPathLabel::ALL
        );
        let one = &all[0].1;
        assert_eq!(one.count, 3);
        assert_eq!(&one.buckets[..3], &[1, 2, 0]);
        assert!(
            (one.sum_seconds - 40e-6).abs() < 1e-9,
            "{}",
            one.sum_seconds
        );
        assert_eq!(one.quantile_bound(0.5), Some(20e-6));
        assert_eq!(one.quantile_bound(0.0), Some(10e-6));
        let grpc = &all[2].1;
        assert_eq!(grpc.buckets.last(), Some(&1));
        assert_eq!(grpc.quantile_bound(0.99), Some(f64::INFINITY));
        assert_eq!(all[1].1.quantile_bound(0.5), None);
        assert!((BOUNDS_SECONDS[17] - 1.31072).abs() < 1e-9);
    }
}
