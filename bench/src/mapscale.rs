//! `mapscale`: what the ownership map costs as the file and the cluster
//! grow, compact form against the old expanded one.
//!
//! Per cell (extents × members): an in-process coordinator
//! (`pagewire_coordinator::run`) on a temporary state file written settled
//! (`write_settled_state`: every member alive, no handoff), simulated
//! members that only heartbeat (no page data, no node daemon; a member
//! reports the newest epoch any of them has seen as applied), and W
//! watchers on `WatchMap` with `compact` set, each expanding every map with
//! the shared code (`pagewire_proto::map::MapApplier`). Measured:
//!
//! - bytes of the full compact map (`GetMap` with `compact`), of the delta a
//!   join streams and of the one its handoff's end streams, and of the old
//!   expanded map (`GetMap` without `compact`), all protobuf-encoded;
//! - time from a `Register` call of a new member to every watcher having
//!   applied (expanded) the epoch it returned, and of the `Register` call
//!   alone (the coordinator's commit), and to every lazy reader (R
//!   watchers resolving owners per extent with `pagewire_proto::lazy::LazyApplier`,
//!   as the cluster client does, each resolving `--reader-extents` owners
//!   of every map); the medians of the joins;
//! - coordinator CPU per heartbeat: time on CPU of the coordinator's own
//!   runtime threads (named `pw-coord`, read from
//!   `/proc/self/task/*/schedstat`) over a steady window, divided by the
//!   heartbeats answered in it. The simulator and the watchers run on
//!   other threads (`pw-sim`), so their CPU is excluded; the whole
//!   process's CPU per heartbeat (getrusage) is reported beside it.
//!
//! A cell whose full expansion would take more than `--max-cell-evals`
//! score evaluations (extents × members) is not run: its row is projected
//! from measured cells and says so.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::coordinator_client::CoordinatorClient;
use pagewire_proto::v1::{GetMapRequest, HeartbeatRequest, RegisterRequest, WatchMapRequest};
use prost::Message;
use serde::Serialize;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::report::{self, Output};

#[derive(clap::Args, Serialize, Clone, Debug)]
pub struct Args {
    /// Extent counts to measure (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1000,10000,100000,1000000"
    )]
    pub extents: Vec<u64>,
    /// Member counts to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000")]
    pub members: Vec<u32>,
    /// WatchMap (compact) watchers, each expanding every map it gets.
    #[arg(long, default_value_t = 2)]
    pub watchers: usize,
    /// WatchMap (compact) readers, each resolving owners lazily
    /// (`pagewire_proto::lazy`, as the cluster client does) and, for every
    /// map, the owners of `--reader-extents` extents spread over the file.
    #[arg(long, default_value_t = 2)]
    pub readers: usize,
    /// Extents each reader resolves per map.
    #[arg(long, default_value_t = 64)]
    pub reader_extents: u64,
    /// Heartbeat interval of each simulated member.
    #[arg(long, default_value_t = 500)]
    pub heartbeat_ms: u64,
    /// Length of the steady window whose CPU is divided by its heartbeats.
    #[arg(long, default_value_t = 2000)]
    pub window_ms: u64,
    /// Joins per cell (the median time is reported).
    #[arg(long, default_value_t = 3)]
    pub joins: usize,
    /// Cells needing more rendezvous score evaluations than this for one
    /// full expansion (extents × members) are projected, not run.
    #[arg(long, default_value_t = 2_000_000_000)]
    pub max_cell_evals: u64,
    /// A seconds-long smoke run: 10^3 and 10^4 extents, 10 and 100
    /// members, one watcher, one join, short windows.
    #[arg(long)]
    pub quick: bool,
    #[command(flatten)]
    #[serde(skip)]
    pub output: Output,
}

#[derive(Serialize, Clone, Debug, Default)]
struct Row {
    extents: u64,
    members: u32,
    /// false: projected from measured cells (see `note`).
    measured: bool,
    note: String,
    compact_full_bytes: u64,
    delta_join_bytes: u64,
    delta_handoff_done_bytes: u64,
    expanded_bytes: u64,
    join_to_all_watchers_ms: f64,
    /// The `Register` call's round trip (the coordinator's commit: owners,
    /// handoff, releases, the compact map's encoding, the save); the rest
    /// of `join_to_all_watchers_ms` is the watchers' expansion.
    register_ms: f64,
    /// Time from the `Register` call to every lazy reader having applied
    /// the epoch and resolved its extents.
    join_to_all_readers_ms: f64,
    coordinator_cpu_us_per_heartbeat: f64,
    process_cpu_us_per_heartbeat: f64,
    heartbeats_in_window: u64,
    /// Start of the coordinator (state load, one full expansion) and of
    /// the watchers' first full expansion.
    setup_s: f64,
}

type Client = CoordinatorClient<InterceptedService<Channel, AttachToken>>;

const TOKEN: &str = "mapscale-bench-token";
const EXTENT: u64 = 2 << 20;

pub fn run(a: &Args) -> anyhow::Result<()> {
    let mut a = a.clone();
    if a.quick {
        a.extents = vec![1000, 10_000];
        a.members = vec![10, 100];
        a.watchers = 1;
        a.readers = 1;
        a.joins = 1;
        a.heartbeat_ms = 200;
        a.window_ms = 400;
    }
    anyhow::ensure!(a.watchers >= 1, "--watchers must be at least 1");
    anyhow::ensure!(a.readers >= 1, "--readers must be at least 1");
    anyhow::ensure!(a.joins >= 1, "--joins must be at least 1");
    anyhow::ensure!(
        a.extents.iter().all(|&e| (1..=1 << 24).contains(&e)),
        "--extents must be in 1..=16777216"
    );
    anyhow::ensure!(
        a.members.iter().all(|&m| (1..=100_000).contains(&m)),
        "--members must be in 1..=100000"
    );
    let mut rows = Vec::new();
    for &m in &a.members {
        for &e in &a.extents {
            if e.saturating_mul(u64::from(m)) > a.max_cell_evals {
                rows.push(Row {
                    extents: e,
                    members: m,
                    ..Row::default()
                });
                continue;
            }
            eprintln!("mapscale: {e} extents, {m} members ...");
            let r = cell(&a, e, m).with_context(|| format!("{e} extents, {m} members"))?;
            rows.push(r);
        }
    }
    project(&mut rows);
    rows.sort_by_key(|r| (r.extents, r.members));
    let table = || {
        let body: Vec<Vec<String>> = rows
            .iter()
            .map(|r| {
                vec![
                    r.extents.to_string(),
                    r.members.to_string(),
                    if r.measured { "yes" } else { "projected" }.into(),
                    bytes(r.compact_full_bytes),
                    bytes(r.delta_join_bytes),
                    bytes(r.delta_handoff_done_bytes),
                    bytes(r.expanded_bytes),
                    format!("{:.1}", r.join_to_all_watchers_ms),
                    format!("{:.1}", r.register_ms),
                    format!("{:.1}", r.join_to_all_readers_ms),
                    format!("{:.1}", r.coordinator_cpu_us_per_heartbeat),
                    format!("{:.1}", r.process_cpu_us_per_heartbeat),
                ]
            })
            .collect();
        report::table(
            &[
                "EXTENTS",
                "MEMBERS",
                "MEASURED",
                "COMPACT",
                "DELTA JOIN",
                "DELTA DONE",
                "EXPANDED",
                "JOIN→ALL MS",
                "REGISTER MS",
                "JOIN→READERS MS",
                "COORD µs/HB",
                "PROC µs/HB",
            ],
            &body,
        )
    };
    report::emit("mapscale", &a.output, &a, &rows, table)
}

fn bytes(b: u64) -> String {
    if b >= 10 << 20 {
        format!("{:.1} MiB", b as f64 / f64::from(1 << 20))
    } else if b >= 10 << 10 {
        format!("{:.1} KiB", b as f64 / 1024.0)
    } else {
        format!("{b} B")
    }
}

/// Fills the rows that were not run from measured ones: bytes of the
/// compact forms depend on the members only, the expanded map's grow with
/// the extents, a join's time with the extents (the expansion after one
/// change is incremental), CPU per heartbeat with neither.
fn project(rows: &mut [Row]) {
    let measured: Vec<Row> = rows.iter().filter(|r| r.measured).cloned().collect();
    for r in rows.iter_mut().filter(|r| !r.measured) {
        let same_m = measured
            .iter()
            .filter(|x| x.members == r.members)
            .max_by_key(|x| x.extents);
        let same_e = measured
            .iter()
            .filter(|x| x.extents == r.extents)
            .max_by_key(|x| x.members);
        let (Some(sm), Some(se)) = (same_m, same_e) else {
            r.note = "not run (over --max-cell-evals) and nothing measured to project from".into();
            continue;
        };
        let scale = r.extents as f64 / sm.extents as f64;
        r.compact_full_bytes = sm.compact_full_bytes;
        r.delta_join_bytes = sm.delta_join_bytes;
        r.delta_handoff_done_bytes = sm.delta_handoff_done_bytes;
        r.expanded_bytes = (sm.expanded_bytes as f64 * scale) as u64;
        r.join_to_all_watchers_ms = se.join_to_all_watchers_ms;
        r.register_ms = se.register_ms;
        r.join_to_all_readers_ms = se.join_to_all_readers_ms;
        r.coordinator_cpu_us_per_heartbeat = sm.coordinator_cpu_us_per_heartbeat;
        r.process_cpu_us_per_heartbeat = sm.process_cpu_us_per_heartbeat;
        r.note = format!(
            "projected: bytes and CPU from ({} extents, {} members), expanded bytes scaled by extents; \
             join time from ({} extents, {} members)",
            sm.extents, sm.members, se.extents, se.members
        );
    }
}

/// CPU seconds of this process's threads whose name starts with `prefix`:
/// the time on CPU in `/proc/self/task/*/schedstat` (nanoseconds), else
/// user + system time from `stat` (clock ticks).
fn thread_cpu(prefix: &str) -> f64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let mut total = 0.0;
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    for t in dir.flatten() {
        let p = t.path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        let ns = std::fs::read_to_string(p.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
        if let Some(ns) = ns {
            total += ns as f64 / 1e9;
            continue;
        }
        let stat = std::fs::read_to_string(p.join("stat")).unwrap_or_default();
        // Fields after the parenthesised name: utime is field 14, stime 15.
        if let Some((_, rest)) = stat.rsplit_once(')') {
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ut: u64 = f.get(11).and_then(|x| x.parse().ok()).unwrap_or(0);
            let st: u64 = f.get(12).and_then(|x| x.parse().ok()).unwrap_or(0);
            total += (ut + st) as f64 / tick;
        }
    }
    total
}

fn process_cpu() -> f64 {
    // SAFETY: `ru` is a plain C struct getrusage fills; zeroed is valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid out pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// What the watchers have applied.
#[derive(Default)]
struct Watched {
    /// Per watcher: the newest epoch expanded, and when.
    applied: Vec<(u64, Instant)>,
    /// Per lazy reader: the newest epoch applied and resolved, and when.
    read: Vec<(u64, Instant)>,
    /// (epoch, encoded bytes, whether it was a delta) of every message.
    messages: Vec<(u64, u64, bool)>,
}

struct Sim {
    watched: Mutex<Watched>,
    changed: tokio::sync::Notify,
    /// Newest epoch any member or watcher has seen.
    latest: AtomicU64,
    heartbeats: AtomicU64,
    stop: AtomicU64,
}

impl Sim {
    /// When every expanding watcher had applied `epoch` (the latest of
    /// their times), waiting for it.
    async fn wait_all_applied(&self, epoch: u64, limit: Duration) -> anyhow::Result<Instant> {
        self.wait(epoch, limit, |w| &w.applied).await
    }

    /// As [`Sim::wait_all_applied`], for the lazy readers.
    async fn wait_all_read(&self, epoch: u64, limit: Duration) -> anyhow::Result<Instant> {
        self.wait(epoch, limit, |w| &w.read).await
    }

    async fn wait(
        &self,
        epoch: u64,
        limit: Duration,
        which: impl Fn(&Watched) -> &Vec<(u64, Instant)>,
    ) -> anyhow::Result<Instant> {
        let deadline = Instant::now() + limit;
        loop {
            let notified = self.changed.notified();
            {
                let w = self.watched.lock().unwrap();
                let all = which(&w);
                if all.iter().all(|&(e, _)| e >= epoch) {
                    return Ok(all
                        .iter()
                        .map(|&(_, at)| at)
                        .max()
                        .unwrap_or_else(Instant::now));
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            anyhow::ensure!(
                !left.is_zero(),
                "watchers did not apply epoch {epoch} within {limit:?}"
            );
            let _ = tokio::time::timeout(left, notified).await;
        }
    }
}

async fn connect(addr: &str) -> anyhow::Result<Client> {
    let ch = pagewire_proto::net::connect(addr, None, Duration::from_secs(5)).await?;
    Ok(
        CoordinatorClient::with_interceptor(ch, AttachToken::new(TOKEN)?)
            .max_decoding_message_size(512 << 20),
    )
}

/// A `WatchMap` stream of compact maps and deltas from the first epoch
/// (None: the call failed; the watcher then stays at epoch 0 and the cell
/// fails on its deadline).
async fn watch_compact(
    c: &mut Client,
) -> Option<tonic::Streaming<pagewire_proto::v1::OwnershipMap>> {
    c.watch_map(WatchMapRequest {
        min_epoch: 0,
        compact: true,
    })
    .await
    .ok()
    .map(tonic::Response::into_inner)
}

fn cell(a: &Args, extents: u64, members: u32) -> anyhow::Result<Row> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    let map_cfg = pagewire_coordinator::config::MapConfig {
        file_size: extents * EXTENT,
        extent_size: EXTENT,
        page_size: 4096,
    };
    let ids: Vec<(String, u64)> = (0..members)
        .map(|i| (format!("sim-{i:05}"), (1 + u64::from(i % 4)) << 30))
        .collect();
    pagewire_coordinator::write_settled_state(&state, "mapscale", &map_cfg, &ids, "127.0.0.1:9")?;
    let started = Instant::now();
    let (addr, stop_coord, coord_stopped, coord_rt) = start_coordinator(&state, &map_cfg, a)?;
    let sim_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("pw-sim")
        .enable_all()
        .build()?;
    let row = sim_rt.block_on(simulate(a, &addr, extents, members, &ids, started));
    sim_rt.shutdown_background();
    // Let the coordinator stop as a process would (its last save included)
    // before its runtime goes: shutting the runtime down at once cancelled
    // that save ("cannot persist the state on shutdown").
    let _ = stop_coord.send(());
    if coord_stopped.recv_timeout(Duration::from_secs(30)).is_err() {
        eprintln!("mapscale: the coordinator did not stop within 30 s");
    }
    coord_rt.shutdown_timeout(Duration::from_secs(5));
    drop(dir);
    row
}

fn start_coordinator(
    state: &Path,
    map_cfg: &pagewire_coordinator::config::MapConfig,
    a: &Args,
) -> anyhow::Result<(
    String,
    tokio::sync::oneshot::Sender<()>,
    std::sync::mpsc::Receiver<()>,
    tokio::runtime::Runtime,
)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("pw-coord")
        .enable_all()
        .build()?;
    let cfg = pagewire_coordinator::Config {
        cluster_name: "mapscale".into(),
        listen: "127.0.0.1:0".into(),
        metrics_listen: String::new(),
        state_file: state.to_owned(),
        // Long enough that no member loses its lease while the big cells
        // start (a full expansion per watcher on shared cores); the lease
        // plays no part in what is measured.
        lease_ms: 60_000,
        heartbeat_interval_ms: a.heartbeat_ms,
        map: map_cfg.clone(),
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (btx, brx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    rt.spawn(async move {
        let r = pagewire_coordinator::run(
            cfg,
            TOKEN.into(),
            async {
                let _ = rx.await;
            },
            move |b| {
                let _ = btx.send(Ok(b.grpc));
            },
        )
        .await;
        if let Err(e) = r {
            eprintln!("mapscale: coordinator stopped: {e}");
        }
        let _ = done_tx.send(());
    });
    let addr = brx
        .recv_timeout(Duration::from_secs(600))
        .context("the coordinator did not start")?
        .map_err(|e: anyhow::Error| e)?;
    Ok((addr.to_string(), tx, done_rx, rt))
}

async fn simulate(
    a: &Args,
    addr: &str,
    extents: u64,
    members: u32,
    ids: &[(String, u64)],
    started: Instant,
) -> anyhow::Result<Row> {
    let client = connect(addr).await?;
    let sim = Arc::new(Sim {
        watched: Mutex::new(Watched {
            applied: vec![(0, Instant::now()); a.watchers],
            read: vec![(0, Instant::now()); a.readers],
            messages: Vec::new(),
        }),
        changed: tokio::sync::Notify::new(),
        latest: AtomicU64::new(1),
        heartbeats: AtomicU64::new(0),
        stop: AtomicU64::new(0),
    });
    let interval = Duration::from_millis(a.heartbeat_ms);
    // Members: index i has incarnation i (write_settled_state).
    let mut all: Vec<(String, u64)> = ids
        .iter()
        .zip(1u64..)
        .map(|((id, _), inc)| (id.clone(), inc))
        .collect();
    let mut tasks = Vec::new();
    let spawn_member = |id: String, inc: u64, offset: Duration| {
        let (mut c, sim) = (client.clone(), sim.clone());
        tokio::spawn(async move {
            tokio::time::sleep(offset).await;
            let mut tick = tokio::time::interval(interval);
            while sim.stop.load(Ordering::Relaxed) == 0 {
                tick.tick().await;
                let r = c
                    .heartbeat(HeartbeatRequest {
                        node_id: id.clone(),
                        incarnation: inc,
                        applied_epoch: sim.latest.load(Ordering::Relaxed),
                        stats: None,
                    })
                    .await;
                if let Ok(r) = r {
                    sim.heartbeats.fetch_add(1, Ordering::Relaxed);
                    sim.latest
                        .fetch_max(r.into_inner().map_epoch, Ordering::Relaxed);
                }
            }
        })
    };
    for (k, (id, inc)) in all.iter().enumerate() {
        let offset = interval.mul_f64(k as f64 / f64::from(members.max(1)));
        tasks.push(spawn_member(id.clone(), *inc, offset));
    }
    for w in 0..a.watchers {
        let (mut c, sim) = (client.clone(), sim.clone());
        tasks.push(tokio::spawn(async move {
            let Some(mut stream) = watch_compact(&mut c).await else {
                return;
            };
            let mut follower = Some(pagewire_proto::map::MapApplier::new());
            while let Ok(Some(msg)) = stream.message().await {
                let len = msg.encoded_len() as u64;
                let delta = msg.compact.as_ref().is_some_and(|c| c.base_epoch != 0);
                let mut f = follower.take().expect("put back below");
                let (f, r) = tokio::task::spawn_blocking(move || {
                    let r = f.apply(msg);
                    (f, r)
                })
                .await
                .expect("expansion panicked");
                follower = Some(f);
                let Ok(map) = r else {
                    eprintln!(
                        "mapscale: watcher {w}: {}",
                        r.err().map(|e| e.to_string()).unwrap_or_default()
                    );
                    return;
                };
                assert_eq!(
                    map.owner.len() as u64,
                    extents,
                    "an expanded map of the wrong size"
                );
                sim.latest.fetch_max(map.epoch, Ordering::Relaxed);
                {
                    let mut wd = sim.watched.lock().unwrap();
                    wd.applied[w] = (map.epoch, Instant::now());
                    wd.messages.push((map.epoch, len, delta));
                }
                sim.changed.notify_waiters();
            }
        }));
    }
    for w in 0..a.readers {
        let (mut c, sim) = (client.clone(), sim.clone());
        let probes = a.reader_extents.clamp(1, extents);
        tasks.push(tokio::spawn(async move {
            let Some(mut stream) = watch_compact(&mut c).await else {
                return;
            };
            let mut applier = pagewire_proto::lazy::LazyApplier::new();
            while let Ok(Some(msg)) = stream.message().await {
                // Applying is O(members): no blocking thread needed.
                let map = match applier.apply(msg) {
                    Ok(m) => m,
                    Err(e) => {
                        eprintln!("mapscale: reader {w}: {e}");
                        return;
                    }
                };
                // What a reader's first reads of the epoch resolve.
                let mut owned = 0u64;
                for k in 0..probes {
                    let e = (k * extents / probes + u64::try_from(w).unwrap_or(0)) % extents;
                    owned += u64::from(map.owner(e) != 0 || map.previous_owner(e) != 0);
                }
                if owned != probes {
                    eprintln!(
                        "mapscale: reader {w}: an extent with no owner at epoch {}",
                        map.epoch
                    );
                    return;
                }
                sim.latest.fetch_max(map.epoch, Ordering::Relaxed);
                sim.watched.lock().unwrap().read[w] = (map.epoch, Instant::now());
                sim.changed.notify_waiters();
            }
        }));
    }
    let limit = Duration::from_secs(600);
    sim.wait_all_applied(1, limit).await?;
    sim.wait_all_read(1, limit).await?;
    let setup_s = started.elapsed().as_secs_f64();
    // Every member heartbeats once before the window.
    tokio::time::sleep(interval * 2).await;
    let mut c = client.clone();
    let compact_full_bytes = c
        .get_map(GetMapRequest { compact: true })
        .await?
        .into_inner()
        .encoded_len() as u64;
    let expanded_bytes = c
        .get_map(GetMapRequest { compact: false })
        .await?
        .into_inner()
        .encoded_len() as u64;

    let (hb0, coord0, proc0) = (
        sim.heartbeats.load(Ordering::Relaxed),
        thread_cpu("pw-coord"),
        process_cpu(),
    );
    tokio::time::sleep(Duration::from_millis(a.window_ms)).await;
    let (hb1, coord1, proc1) = (
        sim.heartbeats.load(Ordering::Relaxed),
        thread_cpu("pw-coord"),
        process_cpu(),
    );
    let hbs = (hb1 - hb0).max(1);

    let mut join_ms = Vec::new();
    let mut register_ms = Vec::new();
    let mut read_ms = Vec::new();
    let mut delta_join = Vec::new();
    let mut delta_done = Vec::new();
    for j in 0..a.joins {
        let id = format!("join-{j}");
        let t0 = Instant::now();
        let r = c
            .register(RegisterRequest {
                node_id: id.clone(),
                grpc_address: "127.0.0.1:9".into(),
                capacity_bytes: 2 << 30,
                file_size: extents * EXTENT,
                page_size: 4096,
                compact_map: true,
                ..Default::default()
            })
            .await?
            .into_inner();
        register_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        let epoch = r.map.as_ref().map_or(0, |m| m.epoch);
        sim.latest.fetch_max(epoch, Ordering::Relaxed);
        let done = sim.wait_all_applied(epoch, limit).await?;
        join_ms.push((done - t0).as_secs_f64() * 1e3);
        let read = sim.wait_all_read(epoch, limit).await?;
        read_ms.push((read - t0).as_secs_f64() * 1e3);
        let handoff = r
            .map
            .as_ref()
            .and_then(|m| m.compact.as_ref())
            .is_some_and(|c| !c.handoff.is_empty());
        all.push((id.clone(), r.incarnation));
        tasks.push(spawn_member(id, r.incarnation, Duration::ZERO));
        if !handoff {
            // The newcomer won no extent: nothing to hand off.
            continue;
        }
        // The handoff ends once the newcomer and the previous owners report
        // the epoch: the next epoch.
        sim.wait_all_applied(epoch + 1, limit).await?;
        let wd = sim.watched.lock().unwrap();
        let find = |e: u64| wd.messages.iter().find(|m| m.0 == e && m.2).map(|m| m.1);
        delta_join.extend(find(epoch).map(|b| b as f64));
        delta_done.extend(find(epoch + 1).map(|b| b as f64));
    }
    sim.stop.store(1, Ordering::Relaxed);
    for t in tasks {
        t.abort();
    }
    Ok(Row {
        extents,
        members,
        measured: true,
        note: String::new(),
        compact_full_bytes,
        delta_join_bytes: report::median(delta_join) as u64,
        delta_handoff_done_bytes: report::median(delta_done) as u64,
        expanded_bytes,
        join_to_all_watchers_ms: report::median(join_ms),
        register_ms: report::median(register_ms),
        join_to_all_readers_ms: report::median(read_ms),
        coordinator_cpu_us_per_heartbeat: (coord1 - coord0) * 1e6 / hbs as f64,
        process_cpu_us_per_heartbeat: (proc1 - proc0) * 1e6 / hbs as f64,
        heartbeats_in_window: hbs,
        setup_s,
    })
}
