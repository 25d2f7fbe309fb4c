//! Measuring one row: run every client of a [`Group`] for a while on runs
//! of pages, with latency histograms, the owner's and the readers' CPU, and
//! the clients' counters; priming clients on threads; the cost of verifying
//! a page.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use pagewire_node::pattern;
use pagewire_rdma::tcp::{SpinStats, spin_stats};

use super::clients::{Client, Counters, PAGE};
use super::{cluster, owner};
use crate::report::median;

/// One kind of client at one client count; its clients live across repeats.
pub(super) struct Group {
    pub(super) path: &'static str,
    pub(super) transport: &'static str,
    pub(super) index_cache: &'static str,
    pub(super) owner: &'static str,
    pub(super) owner_cpu: OwnerCpu,
    /// The owner's tcp responder counters (the bench's own owner process).
    pub(super) owner_spin: Option<owner::SpinProbe>,
    /// tcp groups: their readers' spin, which the bench's owner is set to
    /// before each measurement.
    pub(super) spin_us: Option<u64>,
    pub(super) clients: Vec<Box<dyn Client>>,
    pub(super) runs: Vec<usize>,
}

pub(super) struct Sample {
    pub(super) ops_per_sec: f64,
    pub(super) p50_us: f64,
    pub(super) p99_us: f64,
    pub(super) max_us: f64,
    pub(super) owner_cpu_us: Option<f64>,
    pub(super) reader_cpu_us: Option<f64>,
    pub(super) counters: Counters,
    /// tcp rows: how this process's readers polled during the row.
    pub(super) reader_spin: Option<SpinStats>,
    /// tcp rows of the bench's owner: how its responder polled.
    pub(super) owner_spin: Option<SpinStats>,
}

/// Whose CPU a row's owner CPU is.
#[derive(Clone)]
pub(super) enum OwnerCpu {
    None,
    /// One process of this machine.
    Pid(u32),
    /// A whole machine (another one: the owner's VM).
    Machine(cluster::Placement),
}

impl OwnerCpu {
    fn read(&self) -> Option<f64> {
        match self {
            OwnerCpu::None => None,
            OwnerCpu::Pid(p) => owner::process_cpu_us(*p),
            OwnerCpu::Machine(m) => m.machine_cpu_us(),
        }
    }
}

pub(super) fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds")
}

/// Runs every client of `g` for `secs` on runs of `run` pages.
pub(super) fn measure(g: &mut Group, run: usize, pages: u64, secs: f64) -> anyhow::Result<Sample> {
    if let (Some(us), Some(p)) = (g.spin_us, &g.owner_spin) {
        p.set_spin_us(us)?;
    }
    let n = g.clients.len();
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(n + 1));
    let handles: Vec<_> = std::mem::take(&mut g.clients)
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            let (stop, start) = (Arc::clone(&stop), Arc::clone(&start));
            std::thread::spawn(move || {
                let mut hist = new_hist();
                let mut rng = fastrand::Rng::new();
                rng.seed(fastrand::u64(..) ^ i as u64);
                let before = c.counters();
                start.wait();
                let mut res = Ok(());
                while !stop.load(Ordering::Relaxed) {
                    let first = rng.u64(0..=pages - run as u64);
                    let t = Instant::now();
                    if let Err(e) = c.op(first, run) {
                        res = Err(e);
                        break;
                    }
                    let _ = hist.record(t.elapsed().as_nanos() as u64);
                }
                let delta = c.counters() - before;
                (c, hist, delta, res)
            })
        })
        .collect();
    let tcp = g.transport.starts_with("tcp");
    let spin0 = (
        tcp.then(|| spin_stats().0),
        g.owner_spin.as_ref().and_then(|p| p.read()),
    );
    let cpu0 = g.owner_cpu.read();
    let me = OwnerCpu::Pid(std::process::id());
    let reader0 = me.read();
    start.wait();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    stop.store(true, Ordering::Relaxed);
    let mut total = new_hist();
    let mut counters = Counters::default();
    let mut first_err = None;
    for h in handles {
        let (c, hist, delta, res) = h.join().map_err(|_| anyhow::anyhow!("a client panicked"))?;
        g.clients.push(c);
        total.add(&hist).expect("same bounds");
        counters += delta;
        if let Err(e) = res {
            first_err.get_or_insert(e);
        }
    }
    let el = t0.elapsed().as_secs_f64();
    let cpu1 = g.owner_cpu.read();
    let reader1 = me.read();
    let spin1 = (
        tcp.then(|| spin_stats().0),
        g.owner_spin.as_ref().and_then(|p| p.read()),
    );
    if let Some(e) = first_err {
        return Err(e);
    }
    let reads = counters.pages.max(1) as f64;
    Ok(Sample {
        ops_per_sec: counters.pages as f64 / el,
        p50_us: total.value_at_quantile(0.5) as f64 / 1000.0,
        p99_us: total.value_at_quantile(0.99) as f64 / 1000.0,
        max_us: total.max() as f64 / 1000.0,
        owner_cpu_us: cpu0.zip(cpu1).map(|(a, b)| (b - a) / reads),
        reader_cpu_us: reader0.zip(reader1).map(|(a, b)| (b - a) / reads),
        counters,
        reader_spin: spin1.0.zip(spin0.0).map(|(b, a)| b.since(&a)),
        owner_spin: spin1.1.zip(spin0.1).map(|(b, a)| b.since(&a)),
    })
}

/// Primes `cs` on as many threads at once, so that each holds its own
/// reader of a shared client while it primes (every reader warm).
pub(super) fn prime_on_threads(
    cs: Vec<Box<dyn Client>>,
    pages: u64,
) -> anyhow::Result<Vec<Box<dyn Client>>> {
    let handles: Vec<_> = cs
        .into_iter()
        .map(|mut c| {
            std::thread::spawn(move || {
                let r = c.prime(pages);
                (c, r)
            })
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        let (c, r) = h.join().map_err(|_| anyhow::anyhow!("a client panicked"))?;
        r?;
        out.push(c);
    }
    Ok(out)
}

/// What `pattern::verify` of one page costs here, µs (median of 5 passes
/// over the file).
pub(super) fn verify_cost_us(file: &Path) -> anyhow::Result<f64> {
    let bytes = std::fs::read(file)?;
    let mut passes = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for (p, page) in bytes.chunks_exact(PAGE).enumerate() {
            std::hint::black_box(pattern::verify(p as u64, page)).ok();
        }
        passes.push(t.elapsed().as_secs_f64() * 1e6 / (bytes.len() / PAGE).max(1) as f64);
    }
    Ok(median(passes))
}
