//! Timed runs of N pinned threads, and the page choosers of the workloads.

use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// One thread's result.
#[derive(Clone, Copy, Debug)]
pub struct ThreadRun {
    pub ops: u64,
    /// Wall-clock seconds of the thread's loop.
    pub secs: f64,
    /// CPU seconds the thread actually ran (less than `secs` when other
    /// processes took its core: the figure that survives a noisy machine).
    pub cpu_secs: f64,
}

/// This thread's CPU time in seconds.
pub fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant
    // Linux supports for the calling thread.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Total ops per CPU-second (sum over threads of ops / CPU time).
pub fn cpu_rate(runs: &[ThreadRun]) -> f64 {
    runs.iter()
        .map(|r| r.ops as f64 / r.cpu_secs.max(1e-9))
        .sum()
}

/// The sum over threads of ops/s, and the mean per-thread ns/op.
pub fn rates(runs: &[ThreadRun]) -> (f64, f64) {
    let ops_per_sec = runs.iter().map(|r| r.ops as f64 / r.secs).sum();
    let ns = runs
        .iter()
        .map(|r| r.secs * 1e9 / r.ops.max(1) as f64)
        .sum::<f64>()
        / runs.len().max(1) as f64;
    (ops_per_sec, ns)
}

/// Run `threads` workers for `dur`. `make(t)` builds thread t's operation;
/// each call of the operation is one op. Threads are pinned to distinct CPUs
/// when `pin` is set (round robin when there are more threads than CPUs).
pub fn timed<F, W>(
    threads: usize,
    dur: Duration,
    pin: bool,
    make: F,
) -> anyhow::Result<Vec<ThreadRun>>
where
    F: Fn(usize) -> W + Sync,
    W: FnMut() -> anyhow::Result<()>,
{
    let cpus = pagewire_node::numa::discover().cpus();
    let stop = AtomicBool::new(false);
    let start = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (stop, start, make, cpus) = (&stop, &start, &make, &cpus);
                s.spawn(move || -> anyhow::Result<ThreadRun> {
                    if pin && !cpus.is_empty() {
                        let _ = pagewire_node::numa::pin_current_thread(cpus[t % cpus.len()]);
                    }
                    let mut op = make(t);
                    start.wait();
                    let t0 = Instant::now();
                    let c0 = thread_cpu_secs();
                    let mut ops = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        for _ in 0..64 {
                            op()?;
                        }
                        ops += 64;
                    }
                    Ok(ThreadRun {
                        ops,
                        secs: t0.elapsed().as_secs_f64(),
                        cpu_secs: thread_cpu_secs() - c0,
                    })
                })
            })
            .collect();
        start.wait();
        std::thread::sleep(dur);
        stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a bench thread panicked"))?
            })
            .collect()
    })
}

/// Which pages a reader touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// Each thread reads its own slice of the file in order (the seed's test).
    Partitioned,
    /// Each thread reads pages uniformly at random over the whole file.
    Uniform,
    /// Every thread reads the same 64 hot pages at random.
    Hot,
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::Partitioned => "partitioned",
            Workload::Uniform => "uniform",
            Workload::Hot => "hot",
        }
    }
}

/// Thread t's page sequence.
pub struct Chooser {
    lo: u64,
    span: u64,
    next: u64,
    rng: u64,
    random: bool,
}

impl Chooser {
    pub fn new(w: Workload, t: usize, threads: usize, pages: u64) -> Self {
        let rng = 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(t as u64 + 1);
        match w {
            Workload::Partitioned => {
                let per = pages / threads as u64;
                let lo = per * t as u64;
                Self {
                    lo,
                    span: per.max(1),
                    next: 0,
                    rng,
                    random: false,
                }
            }
            Workload::Uniform => Self {
                lo: 0,
                span: pages,
                next: 0,
                rng,
                random: true,
            },
            Workload::Hot => Self {
                lo: 0,
                span: pages.min(64),
                next: 0,
                rng,
                random: true,
            },
        }
    }

    #[inline]
    pub fn next(&mut self) -> u64 {
        if self.random {
            // xorshift64*
            self.rng ^= self.rng >> 12;
            self.rng ^= self.rng << 25;
            self.rng ^= self.rng >> 27;
            self.lo + (self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) % self.span
        } else {
            let p = self.lo + self.next;
            self.next += 1;
            if self.next == self.span {
                self.next = 0;
            }
            p
        }
    }
}

/// `n`, or one thread per core when `n` is 0.
pub fn threads_or_cores(n: usize) -> usize {
    if n > 0 {
        return n;
    }
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Thread counts to measure: 1, 2, 4, … up to `max`, and `max`.
pub fn thread_points(max: usize) -> Vec<usize> {
    let mut v: Vec<usize> = std::iter::successors(Some(1usize), |&n| Some(n * 2))
        .take_while(|&n| n < max)
        .collect();
    v.push(max.max(1));
    v
}
