//! One worker process of the nemesis (`pagewire-bench nemesis-worker`,
//! started by `nemesis`; not for direct use).
//!
//! Writer threads write, each one page at a time, the pages of the working
//! set that are theirs (each page has exactly one writer thread in the
//! whole run: see `--writer-threads`), each time the next
//! content generation of the page (so a page has one writer and its
//! generations are its write order), and reader threads read the working
//! set: single pages at random, and runs that end at an extent's last page
//! (the owner's readahead then crosses into the next extent). Every
//! operation goes to the history file with its invocation and completion
//! time (see `history`). At the end one JSON line of totals on stdout.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use pagewire_client::cluster::{ClientConfig, ClusterClient, MapFollower};
use pagewire_node::pattern;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::history::{Log, Op, now_ns};

#[derive(clap::Args, Clone, Debug)]
pub struct WorkerArgs {
    #[arg(long)]
    pub id: u64,
    #[arg(long)]
    pub workers: u64,
    /// Coordinators, comma-separated.
    #[arg(long)]
    pub coordinator: String,
    #[arg(long)]
    pub token_file: PathBuf,
    #[arg(long, default_value = "shm")]
    pub transport: String,
    /// Read one-sided (default) or through the gRPC `Read`.
    #[arg(long)]
    pub grpc: bool,
    /// Pages at each end of every extent in the working set.
    #[arg(long, default_value_t = 4)]
    pub edge_pages: u64,
    /// More pages of the working set, spread over the file.
    #[arg(long, default_value_t = 64)]
    pub spread_pages: u64,
    /// Pages per boundary run (ending at an extent's last page): 40 lets
    /// a node's readahead (1, 3, 5, 9, then 17 and 33 pages when each miss
    /// follows the last) reach past the extent's end.
    #[arg(long, default_value_t = 40)]
    pub run_pages: u64,
    /// Fraction of reader operations that are boundary runs.
    #[arg(long, default_value_t = 0.2)]
    pub run_fraction: f64,
    /// Fraction of reader operations that read a page anywhere in the
    /// file (keeps eviction and readahead going).
    #[arg(long, default_value_t = 0.1)]
    pub churn_fraction: f64,
    #[arg(long, default_value_t = 2)]
    pub reader_threads: u64,
    /// Writer threads (a page still has one writer: thread `t` of worker
    /// `w` writes the pages `p` with `p % (workers * threads) == w +
    /// workers * t`).
    #[arg(long, default_value_t = 2)]
    pub writer_threads: u64,
    /// One RPC's limit (and the connect limit): short, so that an operation
    /// stuck on a frozen node tries the new owner soon after a map change.
    #[arg(long, default_value_t = 150)]
    pub rpc_timeout_ms: u64,
    /// Read the boundary runs through the gRPC `Read` (another client):
    /// the owner serves a miss there through its cache's fault path, whose
    /// readahead follows a run of misses (a `FaultIn` loads only the pages
    /// asked for).
    #[arg(long)]
    pub runs_grpc: bool,
    /// Whether this worker writes.
    #[arg(long)]
    pub write: bool,
    #[arg(long)]
    pub history: PathBuf,
    #[arg(long)]
    pub duration_ms: u64,
    #[arg(long, default_value_t = 3000)]
    pub op_deadline_ms: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The checker's own end-to-end test: every Nth read of a page at
    /// generation 2 or more is logged as the generation before (0: never).
    #[arg(long, default_value_t = 0)]
    pub lie_every: u64,
}

/// A worker's totals (its stdout line).
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Totals {
    pub reads: u64,
    pub reads_failed: u64,
    pub writes: u64,
    pub writes_failed: u64,
    pub corrupt: u64,
    pub first_error: Option<String>,
}

/// The working set: the first and last `edge` pages of every extent and
/// `spread` pages spread over the file, sorted.
pub fn working_set(pages: u64, per_extent: u64, edge: u64, spread: u64) -> Vec<u64> {
    let mut v = Vec::new();
    let per = per_extent.max(1);
    let mut e = 0;
    while e < pages {
        let end = (e + per).min(pages);
        for p in e..(e + edge).min(end) {
            v.push(p);
        }
        for p in end.saturating_sub(edge).max(e)..end {
            v.push(p);
        }
        e = end;
    }
    for k in 0..spread {
        v.push((k * 7919 + 13) % pages.max(1));
    }
    v.sort_unstable();
    v.dedup();
    v
}

/// A client with its own map follower: a thread's failures make only its
/// own follower poll sooner, as in separate processes (one follower shared
/// by the writer and the readers would let a writer stuck on a frozen node
/// refresh the readers' map and close the windows the nemesis looks for).
fn client(a: &WorkerArgs, token: &str) -> anyhow::Result<ClusterClient> {
    client_on(a, token, a.grpc)
}

fn client_on(a: &WorkerArgs, token: &str, grpc: bool) -> anyhow::Result<ClusterClient> {
    let follower = MapFollower::start(&a.coordinator, token)
        .with_context(|| format!("following the map of {}", a.coordinator))?;
    let cfg = ClientConfig {
        rpc_timeout: Duration::from_millis(a.rpc_timeout_ms),
        connect_timeout: Duration::from_millis(a.rpc_timeout_ms),
        backoff_max: Duration::from_millis(20),
        ..crate::storm::reader::client_config(&a.transport, grpc, a.op_deadline_ms)?
    };
    Ok(ClusterClient::new(follower, token, cfg)?)
}

pub fn run(a: &WorkerArgs) -> anyhow::Result<()> {
    let token = std::fs::read_to_string(&a.token_file)
        .with_context(|| format!("reading {}", a.token_file.display()))?
        .trim()
        .to_owned();
    let probe = client(a, &token)?;
    let map = probe.follower().map();
    let per_extent = (map.extent_size / u64::from(map.page_size).max(1)).max(1);
    let pages = probe.file_pages();
    drop(probe);
    let set = Arc::new(working_set(pages, per_extent, a.edge_pages, a.spread_pages));
    let stop = Arc::new(AtomicBool::new(false));
    let id = a.id as u32;
    let mut threads = Vec::new();
    let writers = a.workers.max(1) * a.writer_threads.max(1);
    for wt in 0..if a.write { a.writer_threads.max(1) } else { 0 } {
        let me = a.id + a.workers.max(1) * wt;
        let mine: Vec<u64> = set.iter().copied().filter(|p| p % writers == me).collect();
        let c = client(a, &token)?;
        let mut log = Log::create(&a.history.with_extension(format!("w{wt}")))?;
        let stop = stop.clone();
        let seed = a.seed ^ (wt + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
        threads.push(std::thread::spawn(move || -> anyhow::Result<Totals> {
            let mut t = Totals::default();
            let mut generation = vec![0u64; mine.len()];
            let mut rng = SmallRng::seed_from_u64(seed ^ 0x5772);
            let mut buf = vec![0u8; c.page_size()];
            while !stop.load(Ordering::Relaxed) && !mine.is_empty() {
                let k = rng.random_range(0..mine.len());
                let p = mine[k];
                generation[k] += 1;
                let g = generation[k];
                let len = c.page_len(p);
                buf.fill(0);
                pattern::fill(p, g, &mut buf[..len]);
                let inv = now_ns();
                let r = c.write_page(p, &buf);
                let resp = now_ns();
                let ok = r.is_ok();
                if let Err(e) = r {
                    t.writes_failed += 1;
                    t.first_error
                        .get_or_insert_with(|| format!("write of page {p}: {e}"));
                } else {
                    t.writes += 1;
                }
                log.push(&Op {
                    write: true,
                    ok,
                    corrupt: false,
                    page: p,
                    generation: g,
                    inv_ns: inv,
                    resp_ns: resp,
                    process: id,
                })?;
            }
            log.finish()?;
            Ok(t)
        }));
    }
    for r in 0..a.reader_threads {
        let c = client(a, &token)?;
        let cg = if a.runs_grpc {
            Some(client_on(a, &token, true)?)
        } else {
            None
        };
        let mut log = Log::create(&a.history.with_extension(format!("r{r}")))?;
        let (stop, set) = (stop.clone(), set.clone());
        let (run_pages, run_fraction, churn) = (a.run_pages, a.run_fraction, a.churn_fraction);
        let lie_every = a.lie_every;
        let mut n_read = 0u64;
        let seed = a.seed ^ (r + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        threads.push(std::thread::spawn(move || -> anyhow::Result<Totals> {
            let mut t = Totals::default();
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut buf = vec![0u8; c.page_size()];
            let extents = pages.div_ceil(per_extent);
            while !stop.load(Ordering::Relaxed) {
                let x: f64 = rng.random();
                let is_run = x < run_fraction;
                let (first, n) = if is_run {
                    let e = rng.random_range(0..extents);
                    let end = ((e + 1) * per_extent).min(pages);
                    let first = end.saturating_sub(run_pages).max(e * per_extent);
                    (first, end - first)
                } else if x < run_fraction + churn {
                    (rng.random_range(0..pages), 1)
                } else {
                    (set[rng.random_range(0..set.len())], 1)
                };
                // A run is one read_run (batched, one doorbell per batch):
                // every page of it logged with the run's invocation and
                // response, as each page was read somewhere in between.
                let inv = now_ns();
                let client = match (&cg, is_run) {
                    (Some(g), true) => g,
                    _ => &c,
                };
                let need = n as usize * client.page_size();
                if buf.len() < need {
                    buf.resize(need, 0);
                }
                let r = client.read_run(first, n as usize, &mut buf[..need]);
                let resp = now_ns();
                for (k, p) in (first..first + n).enumerate() {
                    let ps = c.page_size();
                    let page = &buf[k * ps..k * ps + c.page_len(p)];
                    let (ok, corrupt, g) = match &r {
                        Ok(_) => match pattern::verify(p, page) {
                            Ok(g) if lie_every > 0 && g >= 2 => {
                                n_read += 1;
                                (
                                    true,
                                    false,
                                    if n_read.is_multiple_of(lie_every) {
                                        g - 1
                                    } else {
                                        g
                                    },
                                )
                            }
                            Ok(g) => (true, false, g),
                            Err(e) => {
                                t.corrupt += 1;
                                t.first_error
                                    .get_or_insert_with(|| format!("read of page {p}: {e}"));
                                (true, true, u64::MAX)
                            }
                        },
                        Err(e) => {
                            t.reads_failed += 1;
                            t.first_error
                                .get_or_insert_with(|| format!("read of pages {first}..+{n}: {e}"));
                            (false, false, 0)
                        }
                    };
                    if ok {
                        t.reads += 1;
                    }
                    log.push(&Op {
                        write: false,
                        ok,
                        corrupt,
                        page: p,
                        generation: g,
                        inv_ns: inv,
                        resp_ns: resp,
                        process: id,
                    })?;
                    if !ok {
                        break;
                    }
                }
            }
            log.finish()?;
            Ok(t)
        }));
    }
    std::thread::sleep(Duration::from_millis(a.duration_ms));
    stop.store(true, Ordering::Relaxed);
    let mut total = Totals::default();
    for th in threads {
        let t = th
            .join()
            .map_err(|_| anyhow::anyhow!("a worker thread panicked"))??;
        total.reads += t.reads;
        total.reads_failed += t.reads_failed;
        total.writes += t.writes;
        total.writes_failed += t.writes_failed;
        total.corrupt += t.corrupt;
        if total.first_error.is_none() {
            total.first_error = t.first_error;
        }
    }
    println!("{}", serde_json::to_string(&total)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_working_set_holds_every_extent_edge() {
        let s = working_set(100, 32, 2, 3);
        for p in [0, 1, 30, 31, 32, 33, 62, 63, 64, 65, 94, 95, 96, 97, 98, 99] {
            assert!(s.contains(&p), "{p} missing from {s:?}");
        }
        assert!(s.windows(2).all(|w| w[0] < w[1]));
        assert!(s.iter().all(|&p| p < 100));
    }
}
