//! `pagewire-bench miss`: what a one-sided reader's miss costs, beside a
//! hit and the backing read, in one run.
//!
//! One owner (a `pagewire-coordinator` and a `pagewire-node` daemon,
//! [`crate::remote::cluster`]) over a self-describing file of `--pages`
//! 4 KiB pages, with a cache of `--frames` frames, far fewer. One reader
//! thread, one page per op, every page verified (`pattern::verify`).
//!
//! Rows, each measured `--runs` times for `--seconds`, the repeats
//! interleaved across rows:
//! - `pread`: a 4 KiB `pread` of a random page of the file in this
//!   process (the file is in the kernel's page cache): the backing read a
//!   miss cannot avoid;
//! - `hit tcp` / `hit shm`: one-sided reads ([`OwnerPool`]) of a hot set of
//!   `--hot` pages, read once just before (cached, index entries learnt);
//! - `miss tcp call` / `miss shm call`: one-sided reads of pages of the
//!   rest of the file in one fixed random order, cycled, so the cache
//!   (clock eviction) never holds the page asked: the reader's miss and
//!   the fault on the owner as a call on its tcp transport
//!   (`pagewire_proto::call`; over shm on a tcp connection opened beside);
//! - `miss tcp gRPC` / `miss shm gRPC`: the same with the gRPC `FaultIn`
//!   (`PoolConfig::fault_calls` off), the path every miss took before;
//! - `seq tcp` / `seq tcp no-ra`: the cold pages in file order, one page
//!   per read, where the last such row stopped: a sequential reader, with
//!   the readahead of locations (`PoolConfig::readahead`: a miss that
//!   continues the reader's stream brings the locations of the pages after
//!   it, which it then reads with one READ) and without. Every read is
//!   timed, hit or miss; `FAULTED` says how many went to the owner.
//!
//! A miss row counts only reads the owner faulted in (a page found cached
//! after all is counted in `hits`, not timed). Medians over the runs of
//! each run's p50 and p99. Beside them, how this process's `tcp` waits
//! went in each row (`pagewire_rdma::tcp::spin_stats`, summed over the
//! runs): waits, spins that caught their answer, and waits that blocked
//! at once because the window was closed or a preemption cooldown ran.
//!
//! Target (issue 20): `miss tcp call` p50 within 2x of `hit tcp` p50 plus
//! `pread` p50.

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use pagewire_client::cluster::TransportChoice;
use pagewire_client::pool::{OwnerPool, PoolConfig};
use pagewire_node::pattern;
use pagewire_proto::v1::MapNode;
use pagewire_rdma::tcp::{SpinStats, spin_stats};
use serde::Serialize;

use crate::remote::cluster::{self, Cluster, Placement};
use crate::report::{self, Output, median};

const TOKEN: &str = "pagewire-bench-miss-token";
const PAGE: usize = 4096;

/// Options of `pagewire-bench miss`.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct Args {
    /// Smoke run: 4,096 pages, 256 frames, 0.2 s per measurement, one run.
    #[arg(long)]
    pub quick: bool,
    /// Pages of the file (4 KiB each).
    #[arg(long, default_value_t = 32_768)]
    pub pages: u64,
    /// The owner's cache frames (far fewer than pages: misses).
    #[arg(long, default_value_t = 2048)]
    pub frames: usize,
    /// Pages of the hot set the hit rows read (fewer than frames).
    #[arg(long, default_value_t = 256)]
    pub hot: u64,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    /// Repeats of every row, interleaved.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Folder with `pagewire-node` and `pagewire-coordinator` (default:
    /// next to this program).
    #[arg(long)]
    #[serde(skip)]
    pub bin_dir: Option<std::path::PathBuf>,
    #[command(flatten)]
    #[serde(skip)]
    pub output: Output,
}

#[derive(Serialize, Clone, Debug)]
pub struct Row {
    pub row: String,
    pub ops: u64,
    pub ops_per_sec: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Miss rows: reads found cached after all (not timed).
    pub hits: u64,
    /// Reads the owner faulted in (every row but `pread`).
    pub faulted: u64,
    pub wrong_pages: u64,
    /// This process's `tcp` waits during the row, over every run.
    pub reader_spin: SpinStats,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Pread,
    Hit(TransportChoice),
    Miss(TransportChoice, bool),
    /// Sequential cold reads, with readahead of locations or without.
    Seq(TransportChoice, bool),
}

fn name(k: Kind) -> String {
    let t = |t: TransportChoice| {
        if t == TransportChoice::Shm {
            "shm"
        } else {
            "tcp"
        }
    };
    match k {
        Kind::Pread => "pread".into(),
        Kind::Hit(tr) => format!("hit {}", t(tr)),
        Kind::Miss(tr, true) => format!("miss {} call", t(tr)),
        Kind::Miss(tr, false) => format!("miss {} gRPC", t(tr)),
        Kind::Seq(tr, true) => format!("seq {}", t(tr)),
        Kind::Seq(tr, false) => format!("seq {} no-ra", t(tr)),
    }
}

/// One measurement's outcome.
struct Sample {
    spin: SpinStats,
    hist: Histogram<u64>,
    secs: f64,
    hits: u64,
    faulted: u64,
    wrong: u64,
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let mut a = a.clone();
    if a.quick {
        (a.pages, a.frames, a.hot, a.seconds, a.runs) = (4096, 256, 64, 0.2, 1);
    }
    if a.hot >= a.frames as u64 || a.frames as u64 * 2 > a.pages {
        bail!(
            "--hot ({}) must be below --frames ({}), and --frames at most half of --pages ({})",
            a.hot,
            a.frames,
            a.pages
        );
    }
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("data");
    pattern::generate_file(&file, a.pages * PAGE as u64, PAGE)?;
    let bins = cluster::binaries(a.bin_dir.as_deref()).context(
        "pagewire-node or pagewire-coordinator not found next to pagewire-bench \
         (cargo build --release -p pagewire-node -p pagewire-coordinator, or --bin-dir)",
    )?;
    let placement = Placement {
        exec: Vec::new(),
        ip: "127.0.0.1".into(),
        verbs: false,
    };
    let c = Cluster::start(
        bins,
        dir.path(),
        &file,
        a.pages,
        a.frames,
        TOKEN,
        &placement,
    )?;
    let owner = owner_node(&c)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let kinds = [
        Kind::Pread,
        Kind::Hit(TransportChoice::Tcp),
        Kind::Miss(TransportChoice::Tcp, true),
        Kind::Miss(TransportChoice::Tcp, false),
        Kind::Hit(TransportChoice::Shm),
        Kind::Miss(TransportChoice::Shm, true),
        Kind::Miss(TransportChoice::Shm, false),
        Kind::Seq(TransportChoice::Tcp, true),
        Kind::Seq(TransportChoice::Tcp, false),
    ];
    let pool = |t: TransportChoice, calls: bool, readahead: bool| {
        OwnerPool::new(
            TOKEN,
            PAGE,
            PoolConfig {
                transport: t,
                fault_calls: calls,
                readahead,
                ..PoolConfig::default()
            },
            rt.handle().clone(),
        )
    };
    let pools: Vec<Option<OwnerPool>> = kinds
        .iter()
        .map(|&k| match k {
            Kind::Pread => Ok(None),
            Kind::Hit(t) => pool(t, true, true).map(Some),
            Kind::Miss(t, calls) => pool(t, calls, true).map(Some),
            Kind::Seq(t, readahead) => pool(t, true, readahead).map(Some),
        })
        .collect::<Result<_, _>>()?;
    let backing = std::fs::File::open(&file)?;
    // The cold pages in one fixed random order, cycled by every miss row.
    let mut cold: Vec<u64> = (a.hot..a.pages).collect();
    fastrand::Rng::with_seed(7).shuffle(&mut cold);
    let mut next_cold = 0usize;
    let mut next_seq = a.hot;
    let mut samples: Vec<Vec<Sample>> = kinds.iter().map(|_| Vec::new()).collect();
    let secs = Duration::from_secs_f64(a.seconds);
    for _ in 0..a.runs {
        for (i, &k) in kinds.iter().enumerate() {
            let before = spin_stats().0;
            let mut s = match k {
                Kind::Pread => pread_row(&backing, a.pages, secs)?,
                Kind::Hit(_) => {
                    let p = pools[i].as_ref().expect("a pool");
                    hit_row(p, &owner, a.hot, secs)?
                }
                Kind::Miss(..) => {
                    let p = pools[i].as_ref().expect("a pool");
                    miss_row(p, &owner, &cold, &mut next_cold, secs)?
                }
                Kind::Seq(..) => {
                    let p = pools[i].as_ref().expect("a pool");
                    let (hot, pages) = (a.hot, a.pages);
                    pool_row(p, &owner, secs, None, || {
                        let page = next_seq;
                        next_seq = if page + 1 >= pages { hot } else { page + 1 };
                        page
                    })?
                }
            };
            s.spin = spin_stats().0.since(&before);
            samples[i].push(s);
        }
    }
    let rows: Vec<Row> = kinds
        .iter()
        .zip(&samples)
        .map(|(&k, ss)| Row {
            row: name(k),
            ops: ss.iter().map(|s| s.hist.len()).sum(),
            ops_per_sec: median(ss.iter().map(|s| s.hist.len() as f64 / s.secs).collect()),
            p50_us: median(
                ss.iter()
                    .map(|s| s.hist.value_at_quantile(0.5) as f64 / 1e3)
                    .collect(),
            ),
            p99_us: median(
                ss.iter()
                    .map(|s| s.hist.value_at_quantile(0.99) as f64 / 1e3)
                    .collect(),
            ),
            hits: ss.iter().map(|s| s.hits).sum(),
            faulted: ss.iter().map(|s| s.faulted).sum(),
            wrong_pages: ss.iter().map(|s| s.wrong).sum(),
            reader_spin: crate::remote::sum_spin(ss.iter().map(|s| Some(s.spin)))
                .unwrap_or_default(),
        })
        .collect();
    let p50 = |n: &str| rows.iter().find(|r| r.row == n).map_or(0.0, |r| r.p50_us);
    let ops = |n: &str| {
        rows.iter()
            .find(|r| r.row == n)
            .map_or(0.0, |r| r.ops_per_sec)
    };
    let floor = p50("hit tcp") + p50("pread");
    let ratio = p50("miss tcp call") / floor;
    let wrong: u64 = rows.iter().map(|r| r.wrong_pages).sum();
    report::emit("miss", &a.output, &a, &rows, || {
        let body: Vec<Vec<String>> = rows
            .iter()
            .map(|r| {
                vec![
                    r.row.clone(),
                    r.ops.to_string(),
                    format!("{:.0}", r.ops_per_sec),
                    format!("{:.1}", r.p50_us),
                    format!("{:.1}", r.p99_us),
                    r.hits.to_string(),
                    r.faulted.to_string(),
                    r.wrong_pages.to_string(),
                    r.reader_spin.waits.to_string(),
                    r.reader_spin.caught.to_string(),
                    r.reader_spin.closed.to_string(),
                    r.reader_spin.cooling.to_string(),
                ]
            })
            .collect();
        let mut t = report::table(
            &[
                "ROW", "OPS", "OPS/S", "P50 US", "P99 US", "HITS", "FAULTED", "WRONG", "WAITS",
                "CAUGHT", "CLOSED", "COOLING",
            ],
            &body,
        );
        t += &format!(
            "target: miss tcp call p50 {:.1} us within 2x of hit tcp + pread = {floor:.1} us: \
             {ratio:.2}x ({}); miss tcp gRPC / call p50: {:.2}x; miss shm gRPC / call p50: {:.2}x\n",
            p50("miss tcp call"),
            if ratio <= 2.0 { "met" } else { "missed" },
            p50("miss tcp gRPC") / p50("miss tcp call"),
            p50("miss shm gRPC") / p50("miss shm call"),
        );
        t += &format!(
            "sequential cold reads over tcp: {:.2}x the pages/s with readahead of locations\n",
            ops("seq tcp") / ops("seq tcp no-ra"),
        );
        t
    })?;
    drop(c);
    if wrong > 0 {
        bail!("{wrong} pages read wrong");
    }
    Ok(())
}

/// The owner as the map names it (its transports, gRPC address, index).
fn owner_node(c: &Cluster) -> anyhow::Result<MapNode> {
    let rt = cluster::rt()?;
    rt.block_on(async {
        let ch =
            pagewire_proto::net::connect(&c.coordinator_addr, None, Duration::from_secs(5)).await?;
        let mut cc = pagewire_proto::v1::coordinator_client::CoordinatorClient::with_interceptor(
            ch,
            pagewire_proto::auth::AttachToken::new(c.token())?,
        );
        let m = cc
            .get_map(pagewire_proto::v1::GetMapRequest::default())
            .await?
            .into_inner();
        m.nodes.into_iter().next().context("no node in the map")
    })
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds")
}

fn pread_row(f: &std::fs::File, pages: u64, secs: Duration) -> anyhow::Result<Sample> {
    let mut h = hist();
    let mut buf = vec![0u8; PAGE];
    let mut wrong = 0;
    let t0 = Instant::now();
    while t0.elapsed() < secs {
        let p = fastrand::u64(0..pages);
        let t = Instant::now();
        f.read_exact_at(&mut buf, p * PAGE as u64)?;
        h.record(t.elapsed().as_nanos().max(1) as u64)?;
        wrong += u64::from(pattern::verify(p, &buf).is_err());
    }
    Ok(Sample {
        spin: SpinStats::default(),
        hist: h,
        secs: t0.elapsed().as_secs_f64(),
        hits: 0,
        faulted: 0,
        wrong,
    })
}

fn hit_row(pool: &OwnerPool, owner: &MapNode, hot: u64, secs: Duration) -> anyhow::Result<Sample> {
    let mut buf = vec![0u8; PAGE];
    // Cached again (the miss rows evicted them) and their index entries learnt.
    for p in 0..hot {
        pool.read_into(owner, p, 1, &mut buf, &Default::default())?;
    }
    let s = pool_row(pool, owner, secs, Some(false), || fastrand::u64(0..hot))?;
    if s.hits > 0 {
        tracing::warn!(
            misses = s.hits,
            "hit row: pages of the hot set were not cached"
        );
    }
    Ok(Sample { hits: 0, ..s })
}

fn miss_row(
    pool: &OwnerPool,
    owner: &MapNode,
    cold: &[u64],
    next: &mut usize,
    secs: Duration,
) -> anyhow::Result<Sample> {
    pool_row(pool, owner, secs, Some(true), || {
        *next += 1;
        cold[(*next - 1) % cold.len()]
    })
}

/// Reads one page at a time from `owner` for `secs`, the pages `pick`
/// gives, every one verified; times the reads that were (`timed` true) or
/// were not (false) faulted in on the owner, and counts the others in
/// `hits`; `timed` None: times every read.
fn pool_row(
    pool: &OwnerPool,
    owner: &MapNode,
    secs: Duration,
    timed: Option<bool>,
    mut pick: impl FnMut() -> u64,
) -> anyhow::Result<Sample> {
    let mut buf = vec![0u8; PAGE];
    let opts = Default::default();
    let (mut h, mut wrong, mut others, mut faulted) = (hist(), 0, 0u64, 0u64);
    let t0 = Instant::now();
    while t0.elapsed() < secs {
        let p = pick();
        let t = Instant::now();
        let how = pool.read_into(owner, p, 1, &mut buf, &opts)?;
        let ns = t.elapsed().as_nanos().max(1) as u64;
        wrong += u64::from(pattern::verify(p, &buf).is_err());
        faulted += u64::from(how[0].fault_in);
        if timed.is_none_or(|t| t == how[0].fault_in) {
            h.record(ns)?;
        } else {
            others += 1;
        }
    }
    Ok(Sample {
        spin: SpinStats::default(),
        hist: h,
        secs: t0.elapsed().as_secs_f64(),
        hits: others,
        faulted,
        wrong,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hot_set_as_big_as_the_cache_is_refused() {
        let a = Args {
            quick: false,
            pages: 1000,
            frames: 100,
            hot: 100,
            seconds: 0.1,
            runs: 1,
            bin_dir: None,
            output: Output {
                json: false,
                out: "bench-out".into(),
            },
        };
        let e = run(&a).expect_err("refused");
        assert!(e.to_string().contains("--hot"), "{e}");
    }
}
