//! `insert`: the seed's insertion test. 2^23 sequential page insertions into
//! an empty index, one page per call (single) or runs of pages per call
//! (gang), under a global lock (`rwlock`, `mutex`) and fine-grained locking
//! (`lockless`'s per-bucket locks, `sharded`'s 64 locks).
//!
//! This measures the index alone (pages are not read or copied; 2^23 pages
//! of data would be 32 GiB): entries point at frames that are never filled.
//! Each repeat starts from a fresh, empty index; its creation is not timed.

use crate::local::IndexKindArg;
use crate::report::{self, median};
use pagewire_node::index::{
    Index, IndexKind, Inserted, Lockless, Mutexed, RwLocked, Sharded, Standalone,
};
use serde::Serialize;
use std::sync::Barrier;
use std::time::Instant;

#[derive(clap::Args, Serialize, Clone, Debug)]
pub struct Args {
    /// Pages to insert.
    #[arg(long, default_value_t = 1 << 23)]
    pub pages: u64,
    /// Pages per gang insertion.
    #[arg(long, default_value_t = 16)]
    pub gang: usize,
    /// Thread counts, comma-separated (each thread inserts its own run).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "lockless,rwlock,mutex,sharded"
    )]
    pub indexes: Vec<IndexKindArg>,
    /// A seconds-long smoke run (2^16 pages, one repeat).
    #[arg(long)]
    pub quick: bool,
    #[command(flatten)]
    #[serde(skip)]
    pub output: crate::report::Output,
}

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub index: String,
    pub method: &'static str,
    pub threads: usize,
    pub pages: u64,
    pub seconds: f64,
    pub ns_per_page: f64,
    pub runs: Vec<f64>,
}

fn once<I: Index>(pages: u64, threads: usize, gang: usize) -> anyhow::Result<f64> {
    let idx = Standalone::<I>::new(pages as usize)?;
    let start = Barrier::new(threads + 1);
    let per = pages.div_ceil(threads as u64);
    let secs = std::thread::scope(|s| -> anyhow::Result<f64> {
        let hs: Vec<_> = (0..threads as u64)
            .map(|t| {
                let (idx, start) = (&idx, &start);
                s.spawn(move || -> anyhow::Result<()> {
                    let (lo, hi) = (t * per, ((t + 1) * per).min(pages));
                    start.wait();
                    if gang <= 1 {
                        for p in lo..hi {
                            anyhow::ensure!(
                                idx.insert(p, p as u32) == Inserted::Yes,
                                "insert of page {p} failed"
                            );
                        }
                    } else {
                        let mut run = Vec::with_capacity(gang);
                        let mut p = lo;
                        while p < hi {
                            let n = (hi - p).min(gang as u64);
                            run.clear();
                            run.extend((p..p + n).map(|q| (q as u32, 1u64)));
                            anyhow::ensure!(
                                idx.insert_run(p, &run) == n as usize,
                                "gang insert at page {p} failed"
                            );
                            p += n;
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        start.wait();
        let t0 = Instant::now();
        for h in hs {
            h.join()
                .map_err(|_| anyhow::anyhow!("insert thread panicked"))??;
        }
        Ok(t0.elapsed().as_secs_f64())
    })?;
    // Every page went in and maps to its frame.
    for p in (0..pages).step_by((pages as usize / 4096).max(1)) {
        anyhow::ensure!(
            idx.frame_of(p) == Some(p as u32),
            "page {p} is not indexed after insertion"
        );
    }
    Ok(secs)
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let mut a = a.clone();
    if a.quick {
        a.pages = a.pages.min(1 << 16);
        a.repeats = 1;
    }
    anyhow::ensure!(
        a.repeats > 0 && a.pages > 0 && a.pages < u32::MAX as u64,
        "bad --repeats or --pages"
    );
    anyhow::ensure!(
        a.threads.iter().all(|&t| t > 0),
        "--threads must be positive"
    );
    let mut raw: std::collections::BTreeMap<(usize, &'static str, usize), Vec<f64>> =
        Default::default();
    for _ in 0..a.repeats {
        for &t in &a.threads {
            for (ki, k) in a.indexes.iter().enumerate() {
                for (method, gang) in [("single", 1), ("gang", a.gang)] {
                    let secs = match k.0 {
                        IndexKind::Lockless => once::<Lockless>(a.pages, t, gang)?,
                        IndexKind::RwLock => once::<RwLocked>(a.pages, t, gang)?,
                        IndexKind::Mutex => once::<Mutexed>(a.pages, t, gang)?,
                        _ => once::<Sharded>(a.pages, t, gang)?,
                    };
                    raw.entry((ki, method, t)).or_default().push(secs);
                }
            }
        }
    }
    let rows: Vec<Row> = raw
        .into_iter()
        .map(|((ki, method, threads), v)| {
            let seconds = median(v.clone());
            Row {
                index: a.indexes[ki].0.name().into(),
                method,
                threads,
                pages: a.pages,
                seconds,
                ns_per_page: seconds * 1e9 / a.pages as f64,
                runs: v,
            }
        })
        .collect();
    let secs = |i: &str, m: &str, t: usize| {
        rows.iter()
            .find(|r| r.index == i && r.method == m && r.threads == t)
            .map(|r| r.seconds)
    };
    let mut summary = Vec::new();
    for &t in &a.threads {
        for global in ["rwlock", "mutex"] {
            if let Some(base) = secs(global, "single", t) {
                for (i, m) in [
                    ("lockless", "gang"),
                    ("lockless", "single"),
                    (global, "gang"),
                    ("sharded", "gang"),
                ] {
                    if let Some(x) = secs(i, m, t) {
                        summary.push((
                            format!("{global} single / {i} {m}, {t} thread(s)"),
                            base / x,
                        ));
                    }
                }
            }
        }
    }
    report::emit(
        "insert",
        &a.output,
        &serde_json::json!({ "args": &a, "summary": &summary }),
        &rows,
        || {
            let body: Vec<Vec<String>> = rows
                .iter()
                .map(|r| {
                    vec![
                        r.index.clone(),
                        r.method.into(),
                        r.threads.to_string(),
                        r.pages.to_string(),
                        format!("{:.3}", r.seconds),
                        format!("{:.1}", r.ns_per_page),
                    ]
                })
                .collect();
            let mut s = report::table(
                &["index", "method", "threads", "pages", "seconds", "ns/page"],
                &body,
            );
            s += "\nspeed-up over single insertion under a global lock (medians):\n";
            for (k, v) in &summary {
                s += &format!("  {k}: {v:.2}x\n");
            }
            s
        },
    )
}
