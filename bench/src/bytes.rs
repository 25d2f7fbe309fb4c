//! `bytes`: per-operation cost of 1-byte reads and writes through each index
//! variant (the thread's `dd bs=1` comparison of spinlock and rwlock), beside
//! 1-byte `pread`/`pwrite` of the same file.
//!
//! Writes go through the whole write path (copy-on-write of the page, write
//! through to the file, publish, retire). Each write stores the byte that
//! is already there (one of the page-number bytes), so the file stays
//! self-describing and is verified afterwards.

use crate::local::IndexKindArg;
use crate::report::{self, median, si};
use crate::workers::{self, Chooser, ThreadRun, Workload};
use pagewire_node::index::{Index, IndexKind, Lockless, Mutexed, RwLocked, Sharded};
use pagewire_node::{CacheConfig, PageCache, pattern};
use serde::Serialize;
use std::os::unix::fs::FileExt;
use std::time::Duration;

#[derive(clap::Args, Serialize, Clone, Debug)]
pub struct Args {
    /// Most threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    #[arg(long, default_value_t = 64)]
    pub file_mib: u64,
    #[arg(long, default_value_t = 300)]
    pub duration_ms: u64,
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "lockless,rwlock,mutex,sharded"
    )]
    pub indexes: Vec<IndexKindArg>,
    /// fdatasync each write before acknowledging it.
    #[arg(long)]
    pub sync_writes: bool,
    #[arg(long)]
    pub no_pin: bool,
    /// A seconds-long smoke run.
    #[arg(long)]
    pub quick: bool,
    #[command(flatten)]
    #[serde(skip)]
    pub output: crate::report::Output,
}

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub index: String,
    pub threads: usize,
    pub mode: &'static str,
    pub ops_per_sec: f64,
    pub ns_per_op: f64,
    pub runs: Vec<f64>,
}

const PS: usize = 4096;

trait Target: Sync {
    fn name(&self, write: bool) -> String;
    fn op(&self, page: u64, off: usize, write: bool) -> anyhow::Result<()>;
    fn verify(&self, pages: u64) -> anyhow::Result<()>;
}

impl<I: Index> Target for PageCache<I> {
    fn name(&self, _: bool) -> String {
        I::KIND.name().into()
    }

    #[inline]
    fn op(&self, page: u64, off: usize, write: bool) -> anyhow::Result<()> {
        let want = page.to_le_bytes()[off];
        if write {
            self.write_at(page, off, &[want])?;
        } else {
            let mut b = [0u8; 1];
            self.read_at(page, off, &mut b)?;
            anyhow::ensure!(
                b[0] == want,
                "page {page} byte {off}: {:#x} != {want:#x}",
                b[0]
            );
        }
        Ok(())
    }

    fn verify(&self, pages: u64) -> anyhow::Result<()> {
        for p in 0..pages {
            pattern::verify(p, &self.get(p)?)?;
        }
        Ok(())
    }
}

struct Linux(std::fs::File);

impl Target for Linux {
    fn name(&self, write: bool) -> String {
        if write {
            "linux_pwrite".into()
        } else {
            "linux_pread".into()
        }
    }

    #[inline]
    fn op(&self, page: u64, off: usize, write: bool) -> anyhow::Result<()> {
        let want = page.to_le_bytes()[off];
        let at = page * PS as u64 + off as u64;
        if write {
            self.0.write_all_at(&[want], at)?;
        } else {
            let mut b = [0u8; 1];
            self.0.read_exact_at(&mut b, at)?;
            anyhow::ensure!(b[0] == want, "page {page} byte {off}");
        }
        Ok(())
    }

    fn verify(&self, pages: u64) -> anyhow::Result<()> {
        let mut buf = vec![0u8; PS];
        for p in 0..pages {
            self.0.read_exact_at(&mut buf, p * PS as u64)?;
            pattern::verify(p, &buf)?;
        }
        Ok(())
    }
}

fn open<I: Index>(path: &std::path::Path, pages: u64, a: &Args) -> anyhow::Result<Box<dyn Target>> {
    let c = PageCache::<I>::open_with(
        path,
        CacheConfig {
            frames: pages as usize + 64,
            sync_writes: a.sync_writes,
            ..Default::default()
        },
    )?;
    c.preload(0, pages)?;
    Ok(Box::new(c))
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let mut a = a.clone();
    if a.quick {
        a.file_mib = a.file_mib.min(8);
        a.duration_ms = a.duration_ms.min(50);
        a.repeats = 1;
    }
    a.threads = crate::workers::threads_or_cores(a.threads);
    anyhow::ensure!(a.repeats > 0, "--repeats must be at least 1");
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bytes.dat");
    let pages = (a.file_mib << 20) / PS as u64;
    pattern::generate_file(&path, pages * PS as u64, PS)?;
    let mut targets: Vec<Box<dyn Target>> = Vec::new();
    for k in &a.indexes {
        targets.push(match k.0 {
            IndexKind::Lockless => open::<Lockless>(&path, pages, &a)?,
            IndexKind::RwLock => open::<RwLocked>(&path, pages, &a)?,
            IndexKind::Mutex => open::<Mutexed>(&path, pages, &a)?,
            _ => open::<Sharded>(&path, pages, &a)?,
        });
    }
    targets.push(Box::new(Linux(
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)?,
    )));
    let points = workers::thread_points(a.threads);
    let mut raw: std::collections::BTreeMap<(usize, bool, usize), Vec<(f64, f64)>> =
        Default::default();
    for _ in 0..a.repeats {
        for &n in &points {
            for (ti, t) in targets.iter().enumerate() {
                for write in [false, true] {
                    let runs: Vec<ThreadRun> = workers::timed(
                        n,
                        Duration::from_millis(a.duration_ms),
                        !a.no_pin,
                        |tid| {
                            let mut ch = Chooser::new(Workload::Partitioned, tid, n, pages);
                            let mut off = 0usize;
                            let t = &**t;
                            move || {
                                off = (off + 1) % 8;
                                t.op(ch.next(), off, write)
                            }
                        },
                    )?;
                    raw.entry((ti, write, n))
                        .or_default()
                        .push(workers::rates(&runs));
                }
            }
        }
    }
    for t in &targets {
        t.verify(pages)?;
    }
    let rows: Vec<Row> = raw
        .iter()
        .map(|(&(ti, write, threads), v)| Row {
            index: targets[ti].name(write),
            threads,
            mode: if write { "write" } else { "read" },
            ops_per_sec: median(v.iter().map(|x| x.0).collect()),
            ns_per_op: median(v.iter().map(|x| x.1).collect()),
            runs: v.iter().map(|x| x.0).collect(),
        })
        .collect();
    let ns = |idx: &str, mode: &str, t: usize| {
        rows.iter()
            .find(|r| r.index == idx && r.mode == mode && r.threads == t)
            .map(|r| r.ns_per_op)
    };
    let mut summary = Vec::new();
    for t in &points {
        for mode in ["read", "write"] {
            if let (Some(rw), Some(mx)) = (ns("rwlock", mode, *t), ns("mutex", mode, *t)) {
                summary.push((
                    format!("rwlock - mutex ns per 1-byte {mode}, {t} thread(s)"),
                    rw - mx,
                ));
            }
            if let (Some(l), Some(mx)) = (ns("lockless", mode, *t), ns("mutex", mode, *t)) {
                summary.push((
                    format!("lockless - mutex ns per 1-byte {mode}, {t} thread(s)"),
                    l - mx,
                ));
            }
        }
    }
    report::emit(
        "bytes",
        &a.output,
        &serde_json::json!({ "args": &a, "pages": pages, "summary": &summary }),
        &rows,
        || {
            let body: Vec<Vec<String>> = rows
                .iter()
                .map(|r| {
                    vec![
                        r.mode.into(),
                        r.index.clone(),
                        r.threads.to_string(),
                        si(r.ops_per_sec),
                        format!("{:.1}", r.ns_per_op),
                    ]
                })
                .collect();
            let mut s = report::table(&["mode", "index", "threads", "ops/s", "ns/op"], &body);
            s += "\nsummary (medians):\n";
            for (k, v) in &summary {
                s += &format!("  {k}: {v:+.1}\n");
            }
            s
        },
    )
}
