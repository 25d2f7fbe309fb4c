//! `local`: the seed's read-fault storm on one node.
//!
//! N threads read a file that is preloaded in the cache: each its own part
//! (partitioned, the seed's 64-process test), uniformly at random, or a
//! shared hot set. Every index variant, in zero-copy (lookup, check, drop),
//! zero-copy under an epoch pin (no reference: pin, lookup, check, unpin)
//! and copy-out modes, beside Linux `pread` of the same file from the
//! kernel's page cache. Repeats are interleaved across variants so drift on
//! a shared machine hits them alike; the figures are medians.

use crate::report::{self, median, si};
use crate::workers::{self, Chooser, ThreadRun, Workload};
use anyhow::Context;
use pagewire_node::index::{Index, IndexKind, Lockless, Mutexed, RwLocked, Sharded};
use pagewire_node::{CacheConfig, PageCache, Pin, pattern};
use serde::Serialize;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args, Serialize, Clone, Debug)]
pub struct Args {
    /// Most threads to run (default: one per core).
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
    /// Length of one measurement.
    #[arg(long, default_value_t = 300)]
    pub duration_ms: u64,
    /// Measurements per point; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Index variants, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "lockless,rwlock,mutex,sharded"
    )]
    pub indexes: Vec<IndexKindArg>,
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "partitioned,uniform,hot"
    )]
    pub workloads: Vec<Workload>,
    /// Check every byte of every read (slow: measures the checker).
    #[arg(long)]
    pub verify_all: bool,
    /// Lookups per epoch pin in mode `zero_copy_pinned` (1: one pin per
    /// lookup; more: what a reader of a batch of pages pays).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub pin_batch: u32,
    /// Do not pin threads to CPUs.
    #[arg(long)]
    pub no_pin: bool,
    /// Bind the caches to this NUMA node (feature `numa`).
    #[arg(long)]
    pub numa_node: Option<usize>,
    /// A seconds-long smoke run: 16 MiB, 50 ms, one repeat.
    #[arg(long)]
    pub quick: bool,
    #[command(flatten)]
    #[serde(skip)]
    pub output: crate::report::Output,
}

#[derive(Clone, Copy, Debug, Serialize)]
#[serde(transparent)]
pub struct IndexKindArg(#[serde(serialize_with = "ser_kind")] pub IndexKind);

fn ser_kind<S: serde::Serializer>(k: &IndexKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(k.name())
}

impl std::str::FromStr for IndexKindArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        s.parse().map(IndexKindArg)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Lookup, check the page header in place, release.
    ZeroCopy,
    /// Pin the epoch, look up without a reference, check in place, unpin
    /// (a miss: unpin, then fault it in as zero-copy does).
    ZeroCopyPinned,
    /// As `ZeroCopyPinned`, but the thread keeps its pin and repins it
    /// before each lookup (`Pin::repin`: a reader of one page at a time).
    ZeroCopyRepinned,
    /// Copy the page into the thread's buffer, check the header.
    Copy,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::ZeroCopy => "zero_copy",
            Mode::ZeroCopyPinned => "zero_copy_pinned",
            Mode::ZeroCopyRepinned => "zero_copy_repinned",
            Mode::Copy => "copy",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub index: String,
    pub threads: usize,
    pub mode: &'static str,
    pub workload: &'static str,
    pub ops_per_sec: f64,
    pub ns_per_op: f64,
    /// Sum over threads of ops per CPU-second the thread ran: what the
    /// throughput would be had no other process taken the cores.
    pub ops_per_cpu_sec: f64,
    /// Every repeat's ops/s, for spread.
    pub runs: Vec<f64>,
}

/// A thing to read pages from.
trait Target: Sync {
    fn name(&self) -> String;
    fn modes(&self) -> &'static [Mode];
    fn measure(
        &self,
        w: Workload,
        threads: usize,
        mode: Mode,
        a: &Args,
    ) -> anyhow::Result<Vec<ThreadRun>>;
}

fn check(page: u64, bytes: &[u8], all: bool) -> anyhow::Result<()> {
    if all {
        pattern::verify(page, bytes)?;
    } else {
        pattern::check_header(page, bytes)?;
    }
    Ok(())
}

impl<I: Index> Target for PageCache<I> {
    fn name(&self) -> String {
        I::KIND.name().into()
    }

    fn modes(&self) -> &'static [Mode] {
        &[
            Mode::ZeroCopy,
            Mode::ZeroCopyPinned,
            Mode::ZeroCopyRepinned,
            Mode::Copy,
        ]
    }

    fn measure(
        &self,
        w: Workload,
        threads: usize,
        mode: Mode,
        a: &Args,
    ) -> anyhow::Result<Vec<ThreadRun>> {
        let pages = self.pages();
        let all = a.verify_all;
        workers::timed(
            threads,
            Duration::from_millis(a.duration_ms),
            !a.no_pin,
            |t| {
                let mut ch = Chooser::new(w, t, threads, pages);
                let mut buf = vec![0u8; self.page_size()];
                let (batch, mut pinned) = (a.pin_batch, 0u32);
                let mut pin: Option<Pin> = None;
                move || {
                    let p = ch.next();
                    match mode {
                        Mode::ZeroCopy => {
                            let g = self.get(p)?;
                            check(p, &g, all)
                        }
                        Mode::ZeroCopyPinned | Mode::ZeroCopyRepinned => {
                            if mode == Mode::ZeroCopyRepinned {
                                // One pin kept, moved on before each lookup.
                                if let Some(held) = pin.as_mut() {
                                    held.repin();
                                }
                            } else {
                                pinned += 1;
                                if pinned >= batch {
                                    // Unpin before pinning again, so a batch
                                    // of 1 pins once per lookup.
                                    pin = None;
                                    pinned = 0;
                                }
                            }
                            let held = pin.get_or_insert_with(Pin::new);
                            if let Some(b) = self.lookup_pinned(p, held) {
                                return check(p, b, all);
                            }
                            // A miss: fault it in unpinned.
                            pin = None;
                            let g = self.get(p)?;
                            check(p, &g, all)
                        }
                        Mode::Copy => {
                            let n = self.read_into(p, &mut buf)?;
                            check(p, &buf[..n], all)
                        }
                    }
                }
            },
        )
    }
}

/// Linux `pread` of the same file, from the kernel's page cache.
struct Pread {
    file: std::fs::File,
    pages: u64,
    page_size: usize,
}

impl Target for Pread {
    fn name(&self) -> String {
        "linux_pread".into()
    }

    fn modes(&self) -> &'static [Mode] {
        &[Mode::Copy]
    }

    fn measure(
        &self,
        w: Workload,
        threads: usize,
        _: Mode,
        a: &Args,
    ) -> anyhow::Result<Vec<ThreadRun>> {
        let all = a.verify_all;
        workers::timed(
            threads,
            Duration::from_millis(a.duration_ms),
            !a.no_pin,
            |t| {
                let mut ch = Chooser::new(w, t, threads, self.pages);
                let mut buf = vec![0u8; self.page_size];
                move || {
                    let p = ch.next();
                    let n = self.file.read_at(&mut buf, p * self.page_size as u64)?;
                    check(p, &buf[..n], all)
                }
            },
        )
    }
}

fn open_cache<I: Index>(
    path: &std::path::Path,
    a: &Args,
    pages: u64,
) -> anyhow::Result<Box<dyn Target>> {
    let cfg = CacheConfig {
        page_size: a.page_size,
        frames: pages as usize,
        numa_node: a.numa_node,
        ..Default::default()
    };
    let c = PageCache::<I>::open_with(path, cfg)?;
    c.preload(0, pages)?;
    // Every page, every byte, once: the cache holds the file exactly.
    for p in 0..pages {
        pattern::verify(p, &c.get(p)?).with_context(|| format!("{} cache, page {p}", I::KIND))?;
    }
    Ok(Box::new(c))
}

/// (target, mode, workload, threads) -> (ops/s, ns/op) of each repeat.
type Samples =
    std::collections::BTreeMap<(usize, &'static str, &'static str, usize), Vec<(f64, f64, f64)>>;

pub fn run(a: &Args) -> anyhow::Result<()> {
    let mut a = a.clone();
    if a.quick {
        a.file_mib = a.file_mib.min(16);
        a.duration_ms = a.duration_ms.min(50);
        a.repeats = 1;
    }
    a.threads = crate::workers::threads_or_cores(a.threads);
    anyhow::ensure!(a.repeats > 0, "--repeats must be at least 1");
    let dir = tempfile::tempdir()?;
    let path = match &a.file {
        Some(p) => p.clone(),
        None => {
            let p = dir.path().join("local.dat");
            pattern::generate_file(&p, a.file_mib << 20, a.page_size)?;
            p
        }
    };
    let file = std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let pages = file.metadata()?.len().div_ceil(a.page_size as u64);
    // Warm the kernel's page cache for the pread reference.
    let mut buf = vec![0u8; a.page_size];
    for p in 0..pages {
        let n = file.read_at(&mut buf, p * a.page_size as u64)?;
        pattern::verify(p, &buf[..n]).with_context(|| format!("the file itself, page {p}"))?;
    }
    let mut targets: Vec<Box<dyn Target>> = Vec::new();
    for k in &a.indexes {
        targets.push(match k.0 {
            IndexKind::Lockless => open_cache::<Lockless>(&path, &a, pages)?,
            IndexKind::RwLock => open_cache::<RwLocked>(&path, &a, pages)?,
            IndexKind::Mutex => open_cache::<Mutexed>(&path, &a, pages)?,
            _ => open_cache::<Sharded>(&path, &a, pages)?,
        });
    }
    targets.push(Box::new(Pread {
        file,
        pages,
        page_size: a.page_size,
    }));

    let points = workers::thread_points(a.threads);
    // (target, mode, workload, threads) -> (ops/s, ns/op) of each repeat
    let mut raw: Samples = Default::default();
    for _ in 0..a.repeats {
        for &w in &a.workloads {
            for &n in &points {
                for (ti, t) in targets.iter().enumerate() {
                    for &m in t.modes() {
                        let runs = t.measure(w, n, m, &a)?;
                        let (ops, ns) = workers::rates(&runs);
                        raw.entry((ti, m.name(), w.name(), n)).or_default().push((
                            ops,
                            ns,
                            workers::cpu_rate(&runs),
                        ));
                    }
                }
            }
        }
    }
    let rows: Vec<Row> = raw
        .iter()
        .map(|(&(ti, mode, workload, threads), v)| Row {
            index: targets[ti].name(),
            threads,
            mode,
            workload,
            ops_per_sec: median(v.iter().map(|x| x.0).collect()),
            ns_per_op: median(v.iter().map(|x| x.1).collect()),
            ops_per_cpu_sec: median(v.iter().map(|x| x.2).collect()),
            runs: v.iter().map(|x| x.0).collect(),
        })
        .collect();
    let summary = summarize(&rows);
    crate::plot::scaling(&a.output.out, "local", &rows)?;
    report::emit(
        "local",
        &a.output,
        &serde_json::json!({ "args": &a, "pages": pages, "summary": &summary }),
        &rows,
        || {
            let body: Vec<Vec<String>> = rows
                .iter()
                .map(|r| {
                    let base = rows
                        .iter()
                        .find(|b| {
                            b.index == r.index
                                && b.mode == r.mode
                                && b.workload == r.workload
                                && b.threads == 1
                        })
                        .map(|b| r.ops_per_sec / b.ops_per_sec)
                        .unwrap_or(f64::NAN);
                    vec![
                        r.workload.into(),
                        r.index.clone(),
                        r.mode.into(),
                        r.threads.to_string(),
                        si(r.ops_per_sec),
                        format!("{:.1}", r.ns_per_op),
                        format!("{base:.2}x"),
                        si(r.ops_per_cpu_sec),
                    ]
                })
                .collect();
            let mut s = report::table(
                &[
                    "workload",
                    "index",
                    "mode",
                    "threads",
                    "ops/s",
                    "ns/op",
                    "vs 1 thread",
                    "ops/cpu-s",
                ],
                &body,
            );
            s += "\nsummary (medians):\n";
            for (k, v) in &summary {
                s += &format!("  {k}: {v:.2}\n");
            }
            s
        },
    )
}

/// The ratios the issue asks for, computed from the medians.
fn summarize(rows: &[Row]) -> Vec<(String, f64)> {
    let find = |index: &str, mode: &str, w: &str, t: usize| {
        rows.iter()
            .find(|r| r.index == index && r.mode == mode && r.workload == w && r.threads == t)
    };
    let get =
        |index: &str, mode: &str, w: &str, t: usize| find(index, mode, w, t).map(|r| r.ops_per_sec);
    // Per CPU-second: what the scaling would be had no other process taken
    // the cores (the machines are shared).
    let cpu = |index: &str, mode: &str, w: &str, t: usize| {
        find(index, mode, w, t).map(|r| r.ops_per_cpu_sec)
    };
    let mut out = Vec::new();
    let max_t = rows.iter().map(|r| r.threads).max().unwrap_or(1);
    for idx in ["lockless", "rwlock", "mutex", "sharded", "linux_pread"] {
        for mode in [
            "zero_copy",
            "zero_copy_pinned",
            "zero_copy_repinned",
            "copy",
        ] {
            for w in ["partitioned", "hot"] {
                if let (Some(a), Some(b)) = (get(idx, mode, w, 1), get(idx, mode, w, 2)) {
                    out.push((format!("{idx} {mode} {w} 2-thread / 1-thread"), b / a));
                }
            }
            if let (Some(a), Some(b)) = (
                cpu(idx, mode, "partitioned", 1),
                cpu(idx, mode, "partitioned", 2),
            ) {
                out.push((
                    format!("{idx} {mode} partitioned 2-thread / 1-thread, per CPU-second"),
                    b / a,
                ));
            }
            if max_t > 2
                && let (Some(a), Some(b)) = (
                    get(idx, mode, "partitioned", 1),
                    get(idx, mode, "partitioned", max_t),
                )
            {
                out.push((
                    format!("{idx} {mode} partitioned {max_t}-thread / 1-thread"),
                    b / a,
                ));
            }
        }
    }
    for t in [1, max_t] {
        if let Some(p) = get("linux_pread", "copy", "partitioned", t) {
            for idx in ["lockless", "rwlock", "mutex", "sharded"] {
                for mode in [
                    "zero_copy",
                    "zero_copy_pinned",
                    "zero_copy_repinned",
                    "copy",
                ] {
                    if let Some(x) = get(idx, mode, "partitioned", t) {
                        out.push((
                            format!("{idx} {mode} / linux_pread, partitioned, {t} thread(s)"),
                            x / p,
                        ));
                    }
                }
            }
        }
    }
    out
}
