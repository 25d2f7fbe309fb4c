//! `pagewire-bench storm`: the distributed fault storm, and `demo`, the
//! README's one-command tour of the whole system.
//!
//! A coordinator, M nodes and C reader processes (this executable's hidden
//! commands, or the binaries of `--bin-dir`; or an existing cluster with
//! `--coordinator`), on loopback or on the network-namespace hosts of a
//! `--hosts` file (`bench/scripts/storm-netns.sh`). The file is generated
//! self-describing and the nodes' caches together hold only a fraction of
//! it, so eviction runs throughout.
//!
//! 1. **Compare**: the same workload, the same C clients, one path at a
//!    time, no faults: one-sided READs, the two-sided gRPC `Read`, Redis GET
//!    of the same 4 KiB values (our client, and `redis-benchmark` at the
//!    same client count; the better is Redis's figure), and `pread` of the
//!    backing file as the floor.
//! 2. **Storm**: the storm path (one-sided by default) with a writer
//!    fraction and the fault schedule (`--kill`, `--restart`, `--pause`,
//!    `--cut`, `--heal`). A prober client sweeps one page of every extent
//!    over and over; an event's recovery time is from the event to the end
//!    of the first sweep that started after it and read every extent. The
//!    throughput dip is the lowest 200 ms bin from the event to recovery,
//!    against the median of the bins before it.
//!
//! Every read is verified (bytes, and generation against the writes
//! acknowledged before it began); the report states wrong and stale reads
//! (must be 0: the run fails otherwise), retries, validation failures,
//! fallbacks and errors.

pub(crate) mod faults;
pub(crate) mod procs;
pub mod reader;
mod report;
pub(crate) mod workload;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use pagewire_client::cluster::{ClientConfig, ClusterClient, MapFollower, TransportChoice};
use pagewire_node::pattern;

use faults::Fault;
use procs::{Cluster, ClusterSpec, Hosts, Programs};
pub use procs::{die_with_parent, prefixed};
use reader::{Final, Line, Path as ReadPathKind, Tick};
pub use workload::Workload;

/// Set by Ctrl-C / SIGTERM: every loop of the storm checks it.
static STOP: AtomicBool = AtomicBool::new(false);

fn stopped() -> bool {
    STOP.load(Ordering::Relaxed)
}

#[derive(clap::Args, Clone, Debug, serde::Serialize)]
pub struct Args {
    /// Attach to a running cluster (its coordinator's host:port, or a
    /// comma-separated list of coordinators sharing an etcd store) instead
    /// of starting one; needs --token-file and --file (its backing file, for
    /// the pread row). Faults need processes this run started: refused.
    #[arg(long)]
    pub coordinator: Option<String>,
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// The cluster's backing file (with --coordinator).
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Nodes to start.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Reader processes (one client each), the same count on every path.
    #[arg(long, default_value_t = 4)]
    pub readers: usize,
    /// One-sided transport: shm (same host), tcp, auto, or verbs (nodes
    /// serve verbs too; readers read over verbs only, so every one-sided
    /// read crosses an RDMA device; needs the `verbs` feature).
    #[arg(long, default_value = "shm")]
    pub transport: String,
    #[arg(long, value_enum, default_value = "zipfian")]
    pub workload: Workload,
    /// Zipfian exponent.
    #[arg(long, default_value_t = 0.99)]
    pub theta: f64,
    /// Pages of the hot-page workload.
    #[arg(long, default_value_t = 64)]
    pub hot_pages: u64,
    /// Pages per run of the page-touch workload.
    #[arg(long, default_value_t = 64)]
    pub touch_run: u64,
    /// Size of the generated file in MiB.
    #[arg(long, default_value_t = 1024)]
    pub file_mib: u64,
    /// The nodes' caches together, as a fraction of the file (< 1: eviction
    /// runs).
    #[arg(long, default_value_t = 0.5)]
    pub cache_fraction: f64,
    /// Fault the whole file in before the phases (the coordinator's Warm):
    /// with --cache-fraction 1 every read is then a hit, the comparison of
    /// the paths without misses.
    #[arg(long)]
    pub warm: bool,
    /// Fraction of the storm's operations that write a page.
    #[arg(long, default_value_t = 0.01)]
    pub writer_fraction: f64,
    /// Length of the storm phase (e.g. 30s, 1500ms); 0s: no storm, the
    /// compare phases alone (no faults may be given).
    #[arg(long, default_value = "30s", value_parser = faults::parse_duration)]
    pub duration: Duration,
    /// Length of each compare phase.
    #[arg(long, default_value = "5s", value_parser = faults::parse_duration)]
    pub compare_duration: Duration,
    /// Paths compared before the storm, comma-separated (one-sided, grpc,
    /// redis, pread; empty: none).
    #[arg(long, default_value = "one-sided,grpc,redis,pread")]
    pub compare: String,
    /// The storm phase's path.
    #[arg(long, value_enum, default_value = "one-sided")]
    pub storm_path: ReadPathKind,
    /// Kill a process (SIGKILL): `node-2@10s`, `coordinator@12s`.
    #[arg(long)]
    pub kill: Vec<String>,
    /// Start a killed process again (same id; a node gets a new port).
    #[arg(long)]
    pub restart: Vec<String>,
    /// Freeze a process with SIGSTOP, SIGCONT after the given time:
    /// `node-1@5s+4s`.
    #[arg(long)]
    pub pause: Vec<String>,
    /// Cut a node's host off the network (`--hosts` only): `node-2@10s`.
    #[arg(long)]
    pub cut: Vec<String>,
    /// Heal a cut host: `node-2@16s`.
    #[arg(long)]
    pub heal: Vec<String>,
    /// The coordinator's lease (ms): how long a silent node keeps its
    /// extents.
    #[arg(long, default_value_t = 3000)]
    pub lease_ms: u64,
    /// How long one read keeps retrying through a failover (ms).
    #[arg(long, default_value_t = 5000)]
    pub op_deadline_ms: u64,
    /// Serve the readers' client metrics (`pagewire_client_*`) for a
    /// Prometheus: reader i of a one-sided or grpc phase serves its client's
    /// on `GET /metrics` at HOST:PORT+i (each reader process has one client;
    /// the phases run one after another, so they take the same ports).
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_listen_base)]
    pub metrics_listen: Option<ListenBase>,
    /// Hosts file (network-namespace hosts; storm-netns.sh writes it).
    #[arg(long)]
    pub hosts: Option<PathBuf>,
    /// Run the real pagewire-node / pagewire-coordinator of this folder
    /// instead of this executable's built-in ones.
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    #[arg(long, default_value = "redis-server")]
    pub redis_server: String,
    #[arg(long, default_value = "redis-benchmark")]
    pub redis_benchmark: String,
    /// Where the file, logs and the nodes' shm files go (default: a fresh
    /// temporary folder, removed at the end).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Keep the work folder (logs) after the run.
    #[arg(long)]
    pub keep: bool,
    /// A seconds-long smoke run (a small file, short phases).
    #[arg(long)]
    pub quick: bool,
    #[command(flatten)]
    #[serde(skip)]
    pub output: crate::report::Output,
}

/// `--metrics-listen`: the host and the first reader's port.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ListenBase {
    pub host: String,
    pub port: u16,
}

impl ListenBase {
    /// Reader `id`'s address; `run_inner` checked that it fits in a port.
    fn reader(&self, id: usize) -> String {
        format!("{}:{}", self.host, self.port as usize + id)
    }
}

fn parse_listen_base(s: &str) -> Result<ListenBase, String> {
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s:?} is not HOST:PORT"))?;
    let port: u16 = port
        .parse()
        .map_err(|e| format!("{s:?}: port {port:?}: {e}"))?;
    if host.is_empty() || port == 0 {
        // Port 0 would give each reader a port nobody could be told of.
        return Err(format!("{s:?}: give a host and a port above 0"));
    }
    Ok(ListenBase {
        host: host.to_owned(),
        port,
    })
}

/// `pagewire-bench demo`: the whole system on this machine in one command.
#[derive(clap::Args, Clone, Debug)]
pub struct DemoArgs {
    /// Size of the generated file in MiB.
    #[arg(long, default_value_t = 1024)]
    pub file_mib: u64,
    /// One-sided transport: shm, tcp, auto, or verbs (nodes then serve
    /// verbs: an RDMA device on this host's address, the `verbs` feature).
    #[arg(long, default_value = "shm")]
    pub transport: String,
    /// Length of the storm (20 to 40 s make a good picture).
    #[arg(long, default_value = "30s", value_parser = faults::parse_duration)]
    pub duration: Duration,
    /// A short run (a 64 MiB file, a 12 s storm).
    #[arg(long)]
    pub quick: bool,
    #[command(flatten)]
    pub output: crate::report::Output,
}

pub fn demo(d: &DemoArgs) -> anyhow::Result<()> {
    let storm_s = if d.quick {
        12.0
    } else {
        d.duration.as_secs_f64()
    };
    let kill = (storm_s / 3.0).round();
    let restart = (storm_s * 0.6).round();
    let mut output = d.output.clone();
    if output.out == Path::new("bench-out") {
        output.out = PathBuf::from("bench-out/demo");
    }
    let a = Args {
        coordinator: None,
        token_file: None,
        file: None,
        nodes: 3,
        readers: 3,
        transport: d.transport.clone(),
        workload: Workload::Zipfian,
        theta: 0.99,
        hot_pages: 64,
        touch_run: 64,
        file_mib: if d.quick { 64 } else { d.file_mib },
        cache_fraction: 0.5,
        warm: false,
        writer_fraction: 0.01,
        duration: Duration::from_secs_f64(storm_s),
        compare_duration: Duration::from_secs(if d.quick { 2 } else { 4 }),
        compare: "one-sided,grpc,redis,pread".into(),
        storm_path: ReadPathKind::OneSided,
        kill: vec![format!("node-2@{kill}s")],
        restart: vec![format!("node-2@{restart}s")],
        pause: vec![],
        cut: vec![],
        heal: vec![],
        lease_ms: 3000,
        op_deadline_ms: 5000,
        metrics_listen: None,
        hosts: None,
        bin_dir: None,
        redis_server: "redis-server".into(),
        redis_benchmark: "redis-benchmark".into(),
        work_dir: None,
        keep: false,
        quick: false,
        output,
    };
    eprintln!(
        "pagewire demo: a coordinator, 3 nodes and 3 reader processes on loopback over {}; \
         a {} MiB self-describing file, the caches holding half of it; a {storm_s:.0} s zipfian \
         storm with 1 % writes, node-2 killed at {kill:.0} s and restarted at {restart:.0} s. \
         Ctrl-C stops it and cleans up. Then the same file with caches that hold all of it.",
        a.transport, a.file_mib
    );
    run(&a)?;
    // The same paths with every page cached: one-sided reads without misses
    // beside Redis, which always holds every page. A node's share of the
    // extents is not exactly a third, so each cache is sized for half the
    // file (the report's hit column shows whether every read hit).
    let mut whole = a.clone();
    whole.cache_fraction = WHOLE_FILE_CACHE_FRACTION;
    whole.warm = true;
    whole.compare = "one-sided,redis".into();
    whole.duration = Duration::ZERO;
    whole.kill.clear();
    whole.restart.clear();
    whole.writer_fraction = 0.0;
    whole.output.out = a.output.out.join("whole-file");
    eprintln!(
        "\npagewire demo: the same {} MiB file again on a new cluster whose caches hold all of it \
         (warmed first): one-sided reads beside Redis GET, no storm",
        whole.file_mib
    );
    run(&whole)
}

/// The demo's second cluster: the nodes' caches together, as a fraction of
/// the file, so that the node with the most extents holds all of its pages.
const WHOLE_FILE_CACHE_FRACTION: f64 = 1.5;

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What every reader of a phase gets.
struct Ctx<'a> {
    args: &'a Args,
    hosts: Hosts,
    coordinator: String,
    token_file: PathBuf,
    token: String,
    file: PathBuf,
    pages: u64,
    acked: PathBuf,
    redis: Option<String>,
}

/// One phase's raw results.
pub struct Phase {
    pub path: ReadPathKind,
    pub storm: bool,
    pub secs: f64,
    pub finals: Vec<Final>,
    /// Per 200 ms bin: (ok pages, errors, writes).
    pub bins: Vec<(u64, u64, u64)>,
    pub faults: Vec<(Fault, f64)>,
    pub sweeps: Vec<(f64, f64)>,
}

pub const BIN_MS: u64 = 200;

/// Runs the storm: set-up, the compare phases, the storm phase, the report.
pub fn run(a: &Args) -> anyhow::Result<()> {
    let _ = ctrlc::set_handler(|| STOP.store(true, Ordering::Relaxed));
    let r = run_inner(a);
    if stopped() {
        eprintln!("storm: interrupted; every process it started is stopped and its files removed");
        std::process::exit(130);
    }
    r
}

fn run_inner(a: &Args) -> anyhow::Result<()> {
    let mut a = a.clone();
    if a.quick {
        a.file_mib = a.file_mib.min(64);
        a.duration = a.duration.min(Duration::from_secs(6));
        a.compare_duration = a.compare_duration.min(Duration::from_millis(1500));
        a.readers = a.readers.min(2);
    }
    let mut faults = faults::schedule(&a)?;
    if a.transport == "verbs" && !cfg!(feature = "verbs") {
        bail!(
            "--transport verbs: this pagewire-bench was built without RDMA support \
             (cargo build --release -p pagewire-bench --features verbs)"
        );
    }
    if !["shm", "tcp", "auto", "verbs"].contains(&a.transport.as_str()) {
        bail!(
            "--transport {:?}: one of shm, tcp, auto, verbs",
            a.transport
        );
    }
    if !(0.0..=1.0).contains(&a.writer_fraction) {
        bail!("--writer-fraction {} is not in 0..=1", a.writer_fraction);
    }
    if a.readers == 0 || a.nodes == 0 {
        bail!("--readers and --nodes must be at least 1");
    }
    if let Some(m) = &a.metrics_listen
        && m.port as usize + a.readers - 1 > u16::MAX as usize
    {
        bail!(
            "--metrics-listen {}:{}: {} readers need ports up to {}",
            m.host,
            m.port,
            a.readers,
            m.port as usize + a.readers - 1
        );
    }
    let compare: Vec<ReadPathKind> = a
        .compare
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            <ReadPathKind as clap::ValueEnum>::from_str(s, true).map_err(|_| {
                anyhow::anyhow!("--compare {s:?}: one of one-sided, grpc, redis, pread")
            })
        })
        .collect::<anyhow::Result<_>>()?;
    if a.storm_path == ReadPathKind::Redis || a.storm_path == ReadPathKind::Pread {
        bail!("--storm-path must be one-sided or grpc: the faults are done to pagewire's nodes");
    }

    // The work folder: file, logs, shm files, the acknowledged generations.
    let tmp;
    let dir = match &a.work_dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            tmp = tempfile::Builder::new()
                .prefix("pagewire-storm-")
                .tempdir()?;
            tmp.path().to_owned()
        }
    };
    let hosts = match &a.hosts {
        Some(h) => Hosts::load(h)?,
        None => Hosts::loopback(a.nodes),
    };
    if a.hosts.is_some() {
        a.nodes = hosts.node.len();
        if a.transport == "shm" {
            bail!(
                "--hosts with --transport shm: a namespace host reads another's memory through \
                 the shared file system, not the network, so a cut would not cut it: use tcp"
            );
        }
    }

    // The cluster: started here, or attached to.
    let mut cluster = None;
    let (coordinator, token_file, token, file) = match &a.coordinator {
        Some(addr) => {
            if !faults.is_empty() {
                bail!(
                    "faults need processes this run started: drop --coordinator to start a cluster"
                );
            }
            let tf = a
                .token_file
                .clone()
                .context("--coordinator needs --token-file")?;
            let token = std::fs::read_to_string(&tf)
                .with_context(|| format!("reading {}", tf.display()))?
                .trim()
                .to_owned();
            let file = a.file.clone().context("--coordinator needs --file")?;
            (addr.clone(), tf, token, file)
        }
        None => {
            let file = dir.join("storm.data");
            let len = a.file_mib << 20;
            eprintln!(
                "storm: generating a {} MiB self-describing file",
                a.file_mib
            );
            pattern::generate_file(&file, len, 4096)
                .with_context(|| format!("generating {}", file.display()))?;
            let token = format!("storm-{:016x}", fastrand::u64(..));
            let tf = dir.join("cluster-token");
            std::fs::write(&tf, &token)?;
            let pages = len / 4096;
            let frames = ((pages as f64 * a.cache_fraction) / a.nodes as f64).ceil() as usize;
            let spec = ClusterSpec {
                programs: Programs::new(a.bin_dir.as_deref())?,
                coordinator_port: procs::free_port(&hosts.coordinator.ip)?,
                hosts: hosts.clone(),
                dir: dir.clone(),
                file: file.clone(),
                token_file: tf.clone(),
                frames_per_node: frames.max(64),
                lease_ms: a.lease_ms,
                shm: a.transport == "shm" || a.transport == "auto",
                verbs: a.transport == "verbs",
                node_ports: Vec::new(),
                standby_ports: Vec::new(),
                store: None,
                coordinator_args: Vec::new(),
            };
            eprintln!(
                "storm: starting a coordinator and {} nodes ({} frames each, {:.0} % of the file in all)",
                a.nodes,
                spec.frames_per_node,
                100.0 * (spec.frames_per_node * a.nodes) as f64 / pages as f64
            );
            let c = Cluster::start(spec, &token, &stopped)?;
            let addr = c.spec.coordinator_addr();
            cluster = Some(c);
            (addr, tf, token, file)
        }
    };
    let map = procs::get_map(&coordinator, &token)?;
    let page_size = map.page_size as u64;
    if page_size != 4096 {
        bail!("the cluster's page size is {page_size}; the storm reads 4 KiB pages");
    }
    let pages = map.file_size.div_ceil(page_size);
    if a.warm {
        let t = Instant::now();
        let n = procs::warm(&coordinator, &token, map.file_size)?;
        eprintln!(
            "storm: warmed {n} pages in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }
    let acked = dir.join("acked");
    reader::Acked::create(&acked, pages)?;

    // Redis, loaded with the same pages.
    let mut notes = Vec::new();
    let redis_ip = hosts.orchestrator.as_ref().map(|h| h.ip.clone());
    let redis = if compare.contains(&ReadPathKind::Redis) {
        match &redis_ip {
            None => {
                notes.push("redis: the hosts file names no [orchestrator] host to run it on; Redis rows skipped".to_owned());
                None
            }
            Some(ip) => match crate::remote::start_redis_on(&a.redis_server, ip, pages)? {
                Some(r) => Some(r),
                None => {
                    notes.push(format!(
                        "redis: {} not found (Debian: apt install redis-server); Redis rows skipped",
                        a.redis_server
                    ));
                    None
                }
            },
        }
    } else {
        None
    };
    let ctx = Ctx {
        args: &a,
        hosts,
        coordinator,
        token_file,
        token,
        file,
        pages,
        acked,
        redis: redis.as_ref().map(|r| r.addr()),
    };

    let mut phases = Vec::new();
    // Warm-up (not reported): fills the caches with the workload's pages.
    let warm = Duration::from_secs_f64(a.compare_duration.as_secs_f64().min(3.0));
    if !compare.is_empty() {
        run_phase(
            &ctx,
            ReadPathKind::OneSided,
            warm,
            false,
            &mut [],
            None,
            "warm-up",
        )?;
    }
    let mut redis_bench = None;
    for &p in &compare {
        if p == ReadPathKind::Redis && ctx.redis.is_none() {
            continue;
        }
        let ph = run_phase(&ctx, p, a.compare_duration, false, &mut [], None, "compare")?;
        if p == ReadPathKind::Redis
            && let Some(r) = &redis
        {
            let own: f64 = ph
                .finals
                .iter()
                .map(|f| f.reads as f64 / f.secs.max(1e-9))
                .sum();
            redis_bench = match crate::remote::redis_benchmark(
                &a.redis_benchmark,
                &r.addr(),
                a.readers,
                pages,
                ((own * a.compare_duration.as_secs_f64()) as u64).max(10_000),
            ) {
                Ok(x) => x,
                Err(e) => {
                    notes.push(format!("redis-benchmark: {e:#}"));
                    None
                }
            };
            if redis_bench.is_none() && notes.iter().all(|n| !n.starts_with("redis-benchmark")) {
                notes.push(format!(
                    "redis-benchmark: {} not found; Redis's figure is our client's",
                    a.redis_benchmark
                ));
            }
        }
        phases.push(ph);
    }
    drop(redis);

    // The storm (none with `--duration 0s`: the compare phases alone).
    if !a.duration.is_zero() {
        let storm = run_phase(
            &ctx,
            a.storm_path,
            a.duration,
            true,
            &mut faults,
            cluster.as_mut(),
            "storm",
        )?;
        phases.push(storm);
    }
    let rep = report::build(&a, &ctx_summary(&ctx), &phases, redis_bench, notes);
    let fail = rep.failed();
    report::emit(&a, &rep)?;
    if a.keep || a.work_dir.is_some() {
        eprintln!("storm: logs and files kept in {}", dir.display());
    }
    drop(cluster);
    if let Some(msg) = fail {
        bail!("{msg}");
    }
    Ok(())
}

/// What the report says about the set-up.
pub struct Summary {
    pub pages: u64,
    pub coordinator: String,
}

fn ctx_summary(c: &Ctx) -> Summary {
    Summary {
        pages: c.pages,
        coordinator: c.coordinator.clone(),
    }
}

/// One phase: C reader processes on `path` for `len`, the faults fired at
/// their times, the prober sweeping when it is the storm.
fn run_phase(
    ctx: &Ctx,
    path: ReadPathKind,
    len: Duration,
    storm: bool,
    faults: &mut [Fault],
    mut cluster: Option<&mut Cluster>,
    label: &str,
) -> anyhow::Result<Phase> {
    let a = ctx.args;
    // Readers get 1.5 s to start and connect before the common start.
    let start_ms = now_unix_ms() + 1500;
    let mut readers = Vec::new();
    let mut procs = Vec::new();
    for id in 0..a.readers {
        let host = &ctx.hosts.reader[id % ctx.hosts.reader.len()];
        let mut c = Programs::new(None)?.reader(host)?;
        c.args(["--id", &id.to_string(), "--clients", &a.readers.to_string()])
            .args(["--path", path.name()])
            .args(["--workload", a.workload.name()])
            .args(["--pages", &ctx.pages.to_string()])
            .args(["--theta", &a.theta.to_string()])
            .args(["--hot-pages", &a.hot_pages.to_string()])
            .args(["--touch-run", &a.touch_run.to_string()])
            .args([
                "--writer-fraction",
                &(if storm { a.writer_fraction } else { 0.0 }).to_string(),
            ])
            .arg("--acked")
            .arg(&ctx.acked)
            .args(["--start-unix-ms", &start_ms.to_string()])
            .args(["--duration-ms", &(len.as_millis() as u64).to_string()])
            .args(["--interval-ms", &BIN_MS.to_string()])
            .args(["--op-deadline-ms", &a.op_deadline_ms.to_string()])
            .args(["--seed", &(start_ms ^ 0xC0FFEE).to_string()]);
        match path {
            ReadPathKind::OneSided | ReadPathKind::Grpc => {
                c.args(["--coordinator", &ctx.coordinator])
                    .arg("--token-file")
                    .arg(&ctx.token_file)
                    .args(["--transport", &a.transport]);
                if let Some(m) = &a.metrics_listen {
                    c.args(["--metrics-listen", &m.reader(id)]);
                }
            }
            ReadPathKind::Redis => {
                c.args(["--redis", ctx.redis.as_deref().unwrap_or_default()]);
            }
            ReadPathKind::Pread => {
                c.arg("--file").arg(&ctx.file);
            }
        }
        c.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null());
        let mut child = c.spawn().context("starting a reader")?;
        let out = child.stdout.take().context("reader stdout")?;
        let err = child.stderr.take().context("reader stderr")?;
        procs.push(child);
        readers.push((out, err));
    }

    // One thread per reader's stdout; totals for the progress line.
    let ok_total = Arc::new(AtomicU64::new(0));
    let err_total = Arc::new(AtomicU64::new(0));
    let bins: Arc<Mutex<Vec<(u64, u64, u64)>>> = Arc::new(Mutex::new(Vec::new()));
    let mut threads = Vec::new();
    for (out, err) in readers {
        let (ok_total, err_total, bins) = (ok_total.clone(), err_total.clone(), bins.clone());
        threads.push(std::thread::spawn(move || -> (Option<Final>, String) {
            let errs = std::thread::spawn(move || {
                let mut s = String::new();
                let _ = std::io::Read::read_to_string(&mut BufReader::new(err), &mut s);
                s
            });
            let mut fin = None;
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<Line>(&line) {
                    Ok(Line::Tick(t)) => {
                        ok_total.fetch_add(t.ok, Ordering::Relaxed);
                        err_total.fetch_add(t.err, Ordering::Relaxed);
                        add_tick(&bins, &t);
                    }
                    Ok(Line::Final(f)) => fin = Some(*f),
                    Err(_) => {}
                }
            }
            (fin, errs.join().unwrap_or_default())
        }));
    }

    // The prober: its own client, sweeping one page of every extent.
    let sweeps = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now() + Duration::from_millis(start_ms.saturating_sub(now_unix_ms()));
    let end = t0 + len;
    let prober = if storm && !faults.is_empty() {
        let (coord, token, sw) = (ctx.coordinator.clone(), ctx.token.clone(), sweeps.clone());
        let transport = a.transport.clone();
        Some(std::thread::spawn(move || {
            prober(&coord, &token, &transport, t0, end, &sw)
        }))
    } else {
        None
    };

    let bar = ProgressBar::new(len.as_millis() as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>9} [{bar:30}] {elapsed:>4} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(label.to_owned());
    let mut fired = Vec::new();
    let mut last_ok = 0;
    let mut last_t = Instant::now();
    let mut rate = 0.0;
    let mut last_print = Instant::now();
    let mut next = 0;
    loop {
        if stopped() {
            for p in &mut procs {
                let _ = p.kill();
            }
            bail!("interrupted");
        }
        let now = Instant::now();
        let since = now.saturating_duration_since(t0).as_secs_f64();
        // Fire due faults.
        while next < faults.len() && now >= t0 && faults[next].at_s <= since {
            let f = &faults[next];
            let c = cluster
                .as_deref_mut()
                .context("faults need a cluster this run started")?;
            let r = faults::fire(c, f);
            let at = t0.elapsed().as_secs_f64();
            match r {
                Ok(()) => bar.println(format!("storm: {:>6.2} s  {}", at, f.describe())),
                Err(e) => bar.println(format!(
                    "storm: {:>6.2} s  {} FAILED: {e:#}",
                    at,
                    f.describe()
                )),
            }
            fired.push((f.clone(), at));
            next += 1;
        }
        let done = procs
            .iter_mut()
            .all(|p| matches!(p.try_wait(), Ok(Some(_))));
        if done {
            break;
        }
        if now.duration_since(last_t) >= Duration::from_millis(500) {
            let ok = ok_total.load(Ordering::Relaxed);
            rate = (ok - last_ok) as f64 / now.duration_since(last_t).as_secs_f64();
            last_ok = ok;
            last_t = now;
        }
        let msg = format!(
            "{} {} clients: {} pages/s, {} errors",
            path.name(),
            a.readers,
            crate::report::si(rate),
            err_total.load(Ordering::Relaxed)
        );
        bar.set_position(now.saturating_duration_since(t0).as_millis() as u64);
        bar.set_message(msg.clone());
        if bar.is_hidden() && now.duration_since(last_print) >= Duration::from_secs(5) && now > t0 {
            eprintln!("{label:>9} {since:>5.1} s  {msg}");
            last_print = now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bar.finish_and_clear();
    let mut finals = Vec::new();
    for (t, mut p) in threads.into_iter().zip(procs) {
        let (fin, errs) = t
            .join()
            .map_err(|_| anyhow::anyhow!("a reader thread panicked"))?;
        let st = p.wait()?;
        match fin {
            Some(f) if st.success() => finals.push(f),
            _ => bail!(
                "a {} reader failed ({st}): {}",
                path.name(),
                errs.lines()
                    .rev()
                    .take(8)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n")
            ),
        }
    }
    let sweeps = match prober {
        Some(h) => {
            h.join()
                .map_err(|_| anyhow::anyhow!("the prober panicked"))??;
            std::mem::take(&mut *sweeps.lock().unwrap_or_else(|e| e.into_inner()))
        }
        None => Vec::new(),
    };
    let bins = std::mem::take(&mut *bins.lock().unwrap_or_else(|e| e.into_inner()));
    let ph = Phase {
        path,
        storm,
        secs: len.as_secs_f64(),
        finals,
        bins,
        faults: fired,
        sweeps,
    };
    if label != "warm-up" {
        let f = report::sum(&ph.finals);
        eprintln!(
            "{label:>9} {:<9} {} pages/s, wrong {}, stale {}, errors {}",
            path.name(),
            crate::report::si(f.reads as f64 / ph.secs),
            f.wrong,
            f.stale,
            f.errors
        );
    }
    Ok(ph)
}

fn add_tick(bins: &Mutex<Vec<(u64, u64, u64)>>, t: &Tick) {
    // The bin that ends at the tick's boundary (the last, partial tick
    // closes no boundary: it goes into the bin it falls in).
    let i = (t.t_ms.saturating_sub(1) / BIN_MS) as usize;
    let mut b = bins.lock().unwrap_or_else(|e| e.into_inner());
    if b.len() <= i {
        b.resize(i + 1, (0, 0, 0));
    }
    b[i].0 += t.ok;
    b[i].1 += t.err;
    b[i].2 += t.wr;
}

/// Sweeps one page of every extent (a different page each sweep) until
/// `end`; records `(start, end)` of every sweep that read them all, in
/// seconds since `t0`. A failed read abandons the sweep.
fn prober(
    coordinator: &str,
    token: &str,
    transport: &str,
    t0: Instant,
    end: Instant,
    out: &Mutex<Vec<(f64, f64)>>,
) -> anyhow::Result<()> {
    let follower = MapFollower::start(coordinator, token)?;
    let cfg = ClientConfig {
        transport: transport.parse().unwrap_or(TransportChoice::Auto),
        op_deadline: Duration::from_millis(250),
        ..ClientConfig::default()
    };
    let client = ClusterClient::new(follower.clone(), token, cfg)?;
    let map = follower.map();
    let per_extent = (map.extent_size / map.page_size as u64).max(1);
    let pages = client.file_pages();
    let extents = pages.div_ceil(per_extent);
    let mut buf = vec![0u8; client.page_size()];
    let mut k = 0u64;
    while Instant::now() < end && !stopped() {
        let s = Instant::now();
        let mut clean = true;
        for e in 0..extents {
            let p = (e * per_extent + (k.wrapping_mul(7919) % per_extent)).min(pages - 1);
            match client.read_page(p, &mut buf) {
                Ok(_) => {
                    if pattern::verify(p, &buf).is_err() {
                        bail!("the prober read a wrong page {p}");
                    }
                }
                Err(_) => {
                    clean = false;
                    break;
                }
            }
            if Instant::now() >= end {
                clean = false;
                break;
            }
        }
        k += 1;
        if clean {
            let f = |t: Instant| t.saturating_duration_since(t0).as_secs_f64();
            out.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((f(s), f(Instant::now())));
        }
        std::thread::sleep(Duration::from_millis(if clean { 20 } else { 5 }));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_listen_base;

    #[test]
    fn metrics_listen_gives_each_reader_the_next_port() {
        let b = parse_listen_base("127.0.0.1:9100").unwrap();
        assert_eq!(b.reader(0), "127.0.0.1:9100");
        assert_eq!(b.reader(2), "127.0.0.1:9102");
        assert_eq!(
            parse_listen_base("[::1]:9100").unwrap().reader(1),
            "[::1]:9101"
        );
    }

    #[test]
    fn metrics_listen_refuses_what_no_reader_could_be_scraped_on() {
        for bad in ["9100", ":9100", "host:0", "host:http", "host:70000"] {
            assert!(parse_listen_base(bad).is_err(), "{bad} accepted");
        }
    }
}
