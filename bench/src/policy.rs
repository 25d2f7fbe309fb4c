//! `policy`: the cache's eviction and admission policies side by side.
//!
//! N threads read a file through a cache smaller than it (`--cache-fraction`)
//! on the lockless index, pages drawn zipfian (`--theta`), so misses fault
//! from the backing file and eviction runs. Every combination of the
//! eviction and admission policies the node implements (`Eviction::ALL` ×
//! `Admission::ALL`) gets a fresh cache, a warm-up, then a timed run; every
//! byte of every read is verified. Repeats are interleaved across
//! combinations so drift on a shared machine hits them alike; the figures
//! are medians.
//!
//! A separate subcommand rather than a `local` flag: it measures a cache
//! under misses (hit ratio, admissions skipped) where `local` measures the
//! index over a preloaded file, and its parameters and rows differ.

use crate::report::{self, median, si};
use crate::storm::workload::{Chooser, Shape, Workload};
use crate::workers;
use anyhow::Context;
use hdrhistogram::Histogram;
use pagewire_node::index::Lockless;
use pagewire_node::policy::{Admission, CachePolicy, Eviction};
use pagewire_node::{CacheConfig, PageCache, ReadError, Stats, pattern};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(clap::Args, Serialize, Clone, Debug)]
pub struct Args {
    /// Reader threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Size of the generated file in MiB.
    #[arg(long, default_value_t = 256)]
    pub file_mib: u64,
    /// Use this self-describing file instead of generating one.
    #[arg(long)]
    pub file: Option<PathBuf>,
    #[arg(long, default_value_t = 4096)]
    pub page_size: usize,
    /// Cache frames as a fraction of the file's pages.
    #[arg(long, default_value_t = 0.25)]
    pub cache_fraction: f64,
    /// Zipfian skew.
    #[arg(long, default_value_t = 0.99)]
    pub theta: f64,
    /// Readahead window of the cache (0: off, so every policy inserts only
    /// demanded pages; `second-hit` turns it off anyway).
    #[arg(long, default_value_t = 0)]
    pub readahead: usize,
    /// Untimed reads before each measurement, to fill the cache.
    #[arg(long, default_value_t = 1000)]
    pub warmup_ms: u64,
    /// Length of one measurement.
    #[arg(long, default_value_t = 1000)]
    pub duration_ms: u64,
    /// Measurements per combination; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Time one read in this many (latency percentiles).
    #[arg(long, default_value_t = 8)]
    pub sample_every: u64,
    /// Do not pin threads to CPUs.
    #[arg(long)]
    pub no_pin: bool,
    /// A seconds-long smoke run: 16 MiB, 50 ms warm-up and run, one repeat.
    #[arg(long)]
    pub quick: bool,
    #[command(flatten)]
    #[serde(skip)]
    pub output: crate::report::Output,
}

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub eviction: &'static str,
    pub admission: &'static str,
    pub threads: usize,
    /// hits / (hits + misses) of the cache's own counters, measured run only.
    pub hit_ratio: f64,
    pub pages_per_sec: f64,
    /// Latency of `get` (hit, or fault and insert, or fault served without
    /// admission), one read in `--sample-every`; verification not included.
    pub p50_ns: u64,
    pub p99_ns: u64,
    /// Misses served without inserting the page (admission refused it).
    pub admissions_skipped: u64,
    pub evictions: u64,
    /// Pages read from the backing file.
    pub pages_read: u64,
    /// Reads whose bytes failed verification, over all repeats (must be 0).
    pub wrong_reads: u64,
    /// `NoFrame` answers (every frame held by a reader), over all repeats.
    pub no_frame: u64,
    /// Every repeat's pages/s and hit ratio, for spread.
    pub runs: Vec<f64>,
    pub hit_ratios: Vec<f64>,
}

/// One measured run of one combination.
struct Sample {
    stats: Stats,
    pages_per_sec: f64,
    p50: u64,
    p99: u64,
    wrong: u64,
    no_frame: u64,
}

/// A thread's latency histogram, merged into the run's on drop (when
/// `workers::timed` drops the thread's operation).
struct Lat<'a> {
    h: Histogram<u64>,
    sink: &'a Mutex<Histogram<u64>>,
}

impl Drop for Lat<'_> {
    fn drop(&mut self) {
        let mut s = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        let _ = s.add(&self.h);
    }
}

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("static histogram bounds")
}

/// Read zipfian pages through `cache` for `dur`; each read verified.
fn read_for(
    cache: &PageCache<Lockless>,
    a: &Args,
    dur: Duration,
    seed: u64,
) -> anyhow::Result<(Vec<workers::ThreadRun>, Histogram<u64>, u64, u64)> {
    let shape = Shape {
        workload: Workload::Zipfian,
        pages: cache.pages(),
        theta: a.theta,
        hot_pages: 0,
        touch_run: 1,
    };
    // Fail before the threads start on a bad theta.
    Chooser::new(shape, 0, 1, seed)?;
    let sink = Mutex::new(new_hist());
    let (wrong, no_frame) = (AtomicU64::new(0), AtomicU64::new(0));
    let every = a.sample_every.max(1);
    let runs = workers::timed(a.threads, dur, !a.no_pin, |t| {
        let mut ch = Chooser::new(shape, t as u64, a.threads as u64, seed).expect("checked above");
        let mut lat = Lat {
            h: new_hist(),
            sink: &sink,
        };
        let (wrong, no_frame) = (&wrong, &no_frame);
        let mut n = 0u64;
        move || {
            let (p, _) = ch.next();
            n += 1;
            let t0 = n.is_multiple_of(every).then(Instant::now);
            match cache.get(p) {
                Ok(g) => {
                    if let Some(t0) = t0 {
                        let _ = lat.h.record(t0.elapsed().as_nanos() as u64);
                    }
                    if pattern::verify(p, &g).is_err() {
                        wrong.fetch_add(1, Ordering::Relaxed);
                    }
                }
                // Every frame momentarily held by readers: an outcome.
                Err(ReadError::NoFrame) => {
                    no_frame.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => return Err(e).with_context(|| format!("reading page {p}")),
            }
            Ok(())
        }
    })?;
    let h = sink.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok((runs, h, wrong.into_inner(), no_frame.into_inner()))
}

fn measure(path: &std::path::Path, a: &Args, p: CachePolicy, seed: u64) -> anyhow::Result<Sample> {
    let pages = std::fs::metadata(path)?.len().div_ceil(a.page_size as u64);
    let frames = ((pages as f64 * a.cache_fraction).ceil() as usize).max(1);
    let cache = PageCache::<Lockless>::open_with(
        path,
        CacheConfig {
            page_size: a.page_size,
            frames,
            readahead_max: a.readahead,
            ..Default::default()
        },
    )?;
    cache.set_policy(p);
    let (_, _, w0, _) = read_for(&cache, a, Duration::from_millis(a.warmup_ms), seed)?;
    let before = cache.stats();
    let (runs, h, wrong, no_frame) =
        read_for(&cache, a, Duration::from_millis(a.duration_ms), seed + 1)?;
    let after = cache.stats();
    let d = |f: fn(&Stats) -> u64| f(&after) - f(&before);
    let mut stats = Stats::default();
    stats.hits = d(|s| s.hits);
    stats.misses = d(|s| s.misses);
    stats.pages_read = d(|s| s.pages_read);
    stats.evictions = d(|s| s.evictions);
    stats.admissions_skipped = d(|s| s.admissions_skipped);
    Ok(Sample {
        stats,
        pages_per_sec: workers::rates(&runs).0,
        p50: h.value_at_quantile(0.5),
        p99: h.value_at_quantile(0.99),
        wrong: wrong + w0,
        no_frame,
    })
}

fn hit_ratio(s: &Stats) -> f64 {
    s.hits as f64 / (s.hits + s.misses).max(1) as f64
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let mut a = a.clone();
    if a.quick {
        a.file_mib = a.file_mib.min(16);
        a.warmup_ms = a.warmup_ms.min(50);
        a.duration_ms = a.duration_ms.min(50);
        a.repeats = 1;
    }
    a.threads = workers::threads_or_cores(a.threads);
    anyhow::ensure!(a.repeats > 0, "--repeats must be at least 1");
    anyhow::ensure!(
        a.cache_fraction > 0.0 && a.cache_fraction <= 1.0,
        "--cache-fraction must be in (0, 1]"
    );
    let dir = tempfile::tempdir()?;
    let path = match &a.file {
        Some(p) => p.clone(),
        None => {
            let p = dir.path().join("policy.dat");
            pattern::generate_file(&p, a.file_mib << 20, a.page_size)?;
            p
        }
    };
    let pages = std::fs::metadata(&path)
        .with_context(|| format!("opening {}", path.display()))?
        .len()
        .div_ceil(a.page_size as u64);
    let combos: Vec<CachePolicy> = Eviction::ALL
        .iter()
        .flat_map(|&eviction| {
            Admission::ALL.iter().map(move |&admission| CachePolicy {
                admission,
                eviction,
            })
        })
        .collect();
    let mut raw: Vec<Vec<Sample>> = combos.iter().map(|_| Vec::new()).collect();
    for r in 0..a.repeats {
        for (ci, &p) in combos.iter().enumerate() {
            raw[ci].push(measure(&path, &a, p, 1000 * r as u64 + 7)?);
        }
    }
    let med = |v: &[Sample], f: fn(&Sample) -> f64| median(v.iter().map(f).collect());
    let rows: Vec<Row> = combos
        .iter()
        .zip(&raw)
        .map(|(p, v)| Row {
            eviction: p.eviction.name(),
            admission: p.admission.name(),
            threads: a.threads,
            hit_ratio: med(v, |s| hit_ratio(&s.stats)),
            pages_per_sec: med(v, |s| s.pages_per_sec),
            p50_ns: med(v, |s| s.p50 as f64) as u64,
            p99_ns: med(v, |s| s.p99 as f64) as u64,
            admissions_skipped: med(v, |s| s.stats.admissions_skipped as f64) as u64,
            evictions: med(v, |s| s.stats.evictions as f64) as u64,
            pages_read: med(v, |s| s.stats.pages_read as f64) as u64,
            wrong_reads: v.iter().map(|s| s.wrong).sum(),
            no_frame: v.iter().map(|s| s.no_frame).sum(),
            runs: v.iter().map(|s| s.pages_per_sec).collect(),
            hit_ratios: v.iter().map(|s| hit_ratio(&s.stats)).collect(),
        })
        .collect();
    let frames = ((pages as f64 * a.cache_fraction).ceil() as u64).max(1);
    report::emit(
        "policy",
        &a.output,
        &serde_json::json!({ "args": &a, "pages": pages, "frames": frames }),
        &rows,
        || {
            let body: Vec<Vec<String>> = rows
                .iter()
                .map(|r| {
                    vec![
                        r.eviction.into(),
                        r.admission.into(),
                        r.threads.to_string(),
                        format!("{:.3}", r.hit_ratio),
                        si(r.pages_per_sec),
                        format!("{:.2}", r.p50_ns as f64 / 1e3),
                        format!("{:.2}", r.p99_ns as f64 / 1e3),
                        si(r.admissions_skipped as f64),
                        si(r.evictions as f64),
                        r.wrong_reads.to_string(),
                    ]
                })
                .collect();
            report::table(
                &[
                    "eviction",
                    "admission",
                    "threads",
                    "hit ratio",
                    "pages/s",
                    "p50 us",
                    "p99 us",
                    "skipped",
                    "evictions",
                    "wrong",
                ],
                &body,
            )
        },
    )?;
    let wrong: u64 = rows.iter().map(|r| r.wrong_reads).sum();
    anyhow::ensure!(wrong == 0, "{wrong} reads failed verification");
    Ok(())
}
