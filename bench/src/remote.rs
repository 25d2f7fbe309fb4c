//! `pagewire-bench remote`: the same pages of one owner read four ways in
//! one run, side by side: one-sided over `shm`, one-sided over `tcp`, the
//! two-sided gRPC `Read` of the node daemon, and Redis GET of the same 4 KiB
//! values; with raw TCP ping-pongs (one spinning, one blocking) as the floor
//! of `tcp`.
//!
//! * The file: a self-describing file (`pattern::generate_file`) of
//!   `--pages` 4 KiB pages, fully cached by every owner before anything is
//!   measured; every page read on every path is verified whole
//!   (`pattern::verify`); a wrong page is counted in `wrong_reads` and fails
//!   the run after the table is printed.
//! * Owners are separate processes, so their CPU per read can be measured
//!   from outside: user + system time from `/proc/PID/stat` (the total
//!   `getrusage(RUSAGE_SELF)` gives inside the process, in clock ticks) over
//!   each measurement, divided by the pages read. gRPC: the `pagewire-node`
//!   daemon under a `pagewire-coordinator` (its `Read`); Redis:
//!   `redis-server`; one-sided: the daemon when its `Transports` RPC names
//!   `shm` and `tcp` regions, else the bench's own owner process
//!   ([`owner`]): a page cache on an `shm` region, the same memory
//!   registered with a `tcp` owner.
//! * Clients are threads of this process, each with its own connection (and
//!   reader, and index cache). An op reads a run of `run` consecutive pages
//!   from a random start: one-sided, one `read_run` of the run (its READs
//!   batched under one doorbell per round); gRPC, one `Read` of the run;
//!   Redis, one GET or MGET. `ops_per_sec` counts pages; `p50_us`/`p99_us`
//!   are per op (medians over the repeats), `max_us` the slowest op of all
//!   repeats.
//! * Index cache: `warm` readers read every page once before the
//!   measurements; `cold` ones forget each page before reading it, so every
//!   read walks its bucket.
//! * Each row is measured `--runs` times for `--seconds`, the repeats
//!   interleaved across rows so drift hits all alike; the table shows
//!   medians, the counters are summed over the repeats.
//!
//! The files: this one holds the arguments, the rows and [`run`], which
//! builds every group of clients and measures them; `clients` the ways of
//! reading; `measure` one row's measurement; `one_sided` the one-sided
//! targets and their clients; `owner` the bench's own owner process;
//! `cluster` the coordinator and node daemon it starts; `perftest` and
//! `redis` the floors and the comparison it runs
//! beside pagewire; `summary` the table and the targets.

pub mod clients;
pub mod cluster;
mod measure;
mod one_sided;
pub mod owner;
mod perftest;
mod redis;
mod summary;

pub use redis::{redis_benchmark, start_redis_on};

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use pagewire_client::one_sided::ReaderConfig;
use pagewire_node::pattern;
use pagewire_rdma::tcp::SpinStats;
use serde::Serialize;

use crate::report::{self, median};
use clients::{Client, Counters, PAGE};
use measure::{Group, OwnerCpu, Sample, measure, prime_on_threads, verify_cost_us};
use one_sided::{OneSidedTarget, daemon_target, frame_only_client, one_sided_clients, shm_tempdir};
use perftest::perftest_rows;
use redis::start_redis_via;
use summary::{table, targets};

const TOKEN: &str = "pagewire-bench-remote-token";

/// Options of `pagewire-bench remote`.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct Args {
    /// Smoke run (a few seconds): 512 pages, 0.1 s per measurement, one run.
    #[arg(long)]
    pub quick: bool,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    /// Measurements per row (the table shows medians).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Pages (4 KiB) in the file.
    #[arg(long, default_value_t = 4096)]
    pub pages: u64,
    /// Concurrent clients, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,8")]
    pub clients: Vec<usize>,
    /// Pages per op (a run of consecutive pages), comma-separated.
    #[arg(long = "run", value_delimiter = ',', default_value = "1,16")]
    pub run: Vec<usize>,
    /// Paths to measure, comma-separated: shm, tcp, verbs (one-sided;
    /// verbs needs the `verbs` feature and an RDMA device), client (one
    /// `ClusterClient` shared by every client thread, over the daemon's shm
    /// and tcp: the library as programs use it), grpc, redis,
    /// raw_tcp (the ping-pong floor: one that spins for `--spin-us`, one
    /// that blocks at once), perftest (ib_read_lat and ib_read_bw of 4 KiB
    /// on the same RDMA link: the verbs floor).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "shm,tcp,client,grpc,redis,raw_tcp"
    )]
    pub paths: Vec<String>,
    /// Who serves the one-sided rows: `auto` (the daemon when its
    /// `Transports` names shm and tcp regions, else the bench's owner),
    /// `daemon`, or `internal`.
    #[arg(long, default_value = "auto")]
    pub owner: String,
    /// Adaptive polling of `tcp` (owner's responder and readers) and of the
    /// raw ping-pong, microseconds; several, comma-separated, give the
    /// one-sided tcp and raw ping-pong rows once per value (a sweep: the
    /// bench's own owner takes each value in turn; a daemon keeps its own).
    /// The targets are judged on the first.
    #[arg(long, value_delimiter = ',', default_value = "50")]
    pub spin_us: Vec<u64>,
    /// The redis-server binary.
    #[arg(long, default_value = "redis-server")]
    pub redis_server: String,
    /// Folder holding pagewire-node and pagewire-coordinator (default: this
    /// executable's folder).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// This machine's address for the daemon, the coordinator and Redis
    /// when they run here (for verbs: an address whose interface carries
    /// an RDMA device, never loopback).
    #[arg(long, default_value = "127.0.0.1")]
    pub ip: String,
    /// Run the owner's programs (coordinator, node, Redis, the perftest
    /// server) on another machine through this command prefix, split on
    /// whitespace, e.g. "pagewire-bench vm-exec 10.99.0.11:7700 owner --";
    /// the binaries and --work-dir must be at the same paths there. The
    /// owner's CPU is then that whole machine's (from its /proc/stat).
    #[arg(long)]
    pub owner_exec: Option<String>,
    /// The owner machine's address (with --owner-exec).
    #[arg(long)]
    pub owner_ip: Option<String>,
    /// Where the file and token go (a folder both machines see at the same
    /// path with --owner-exec); default: a temporary folder.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// RDMA device for the verbs and perftest rows.
    #[arg(long, env = "PAGEWIRE_RDMA_DEVICE", default_value = "rxe0")]
    pub rdma_device: String,
    /// Iterations of perftest's ib_read_lat (ib_read_bw runs as many).
    #[arg(long, default_value_t = 2000)]
    pub perftest_iters: u64,
    #[command(flatten)]
    #[serde(skip)]
    pub output: report::Output,
}

#[derive(Serialize, Clone, Debug)]
pub struct Row {
    pub path: &'static str,
    pub transport: &'static str,
    pub index_cache: &'static str,
    /// The process whose CPU `owner_cpu_us_per_read` is.
    pub owner: &'static str,
    pub clients: usize,
    pub run: usize,
    /// tcp rows: the spin of the readers (and of the bench's owner).
    pub spin_us: Option<u64>,
    /// Pages per second (median over repeats).
    pub ops_per_sec: f64,
    /// Latency of one op (a run of `run` pages), µs.
    pub p50_us: f64,
    pub p99_us: f64,
    /// The slowest op of every repeat (a stall the percentiles hide).
    pub max_us: f64,
    pub owner_cpu_us_per_read: Option<f64>,
    /// User + system CPU of this process (the readers) per page read, µs.
    pub reader_cpu_us_per_read: Option<f64>,
    pub round_trips_per_read: f64,
    pub wrong_reads: u64,
    pub retries: u64,
    pub validation_failures: u64,
    pub fallbacks: u64,
    /// Every repeat's pages per second, for spread.
    pub repeats_ops_per_sec: Vec<f64>,
    /// tcp rows: how this process's readers polled, summed over repeats.
    pub reader_spin: Option<SpinStats>,
    /// tcp rows of the bench's owner: how its responder polled, summed
    /// over repeats.
    pub owner_spin: Option<SpinStats>,
}

/// Runs the bench and prints the table (or JSON).
///
/// # Errors
/// A setup step failed, a client failed, or a page read was wrong.
pub fn run(a: &Args) -> anyhow::Result<()> {
    const KNOWN: [&str; 8] = [
        "shm", "tcp", "verbs", "client", "grpc", "redis", "raw_tcp", "perftest",
    ];
    if let Some(p) = a.paths.iter().find(|p| !KNOWN.contains(&p.as_str())) {
        bail!("unknown path {p:?} (known: {})", KNOWN.join(", "));
    }
    if !["auto", "daemon", "internal"].contains(&a.owner.as_str()) {
        bail!("--owner is auto, daemon or internal");
    }
    let (secs, runs, pages) = if a.quick {
        (0.1, 1, a.pages.min(512))
    } else {
        (a.seconds, a.runs.max(1), a.pages)
    };
    if !(secs > 0.0 && secs.is_finite()) {
        bail!("--seconds must be a positive number");
    }
    if a.clients.contains(&0) || a.run.contains(&0) {
        bail!("--clients and --run take positive numbers");
    }
    let max_run = a.run.iter().copied().max().unwrap_or(1) as u64;
    if pages < max_run.max(2) {
        bail!("--pages must be at least the longest run ({max_run}) and 2");
    }
    let want = |p: &str| a.paths.iter().any(|x| x == p);
    let Some(&first_spin) = a.spin_us.first() else {
        bail!("--spin-us needs a value");
    };
    let spin = Duration::from_micros(first_spin);
    let mut notes = vec![
        "frame_read rows: the floor of a one-sided page read on that transport, one READ of the page's frame bytes alone (no header READ, no checksum), at the frame a primed reader found, still verified against the pattern".to_owned(),
        "ops_per_sec counts pages; p50/p99 are per op, an op reading a run of `run` consecutive pages".to_owned(),
        "one-sided runs of 16: one RemoteReader::read_run (warm: every header and frame under one doorbell; cold: one READ per cluster of 8 buckets, then the frames); gRPC: one Read of 16 pages; Redis: one MGET of 16 keys".to_owned(),
    ];
    if a.owner_exec.is_none() {
        notes.push(format!(
            "owner CPU: utime+stime of the owner process from /proc/PID/stat over each measurement (resolution {:.0} ms), per page read",
            1000.0 / owner::clock_ticks()
        ));
    }
    let mut skipped = Vec::new();

    let placement = cluster::Placement {
        exec: a
            .owner_exec
            .as_deref()
            .map(|s| s.split_whitespace().map(str::to_owned).collect())
            .unwrap_or_default(),
        ip: a.owner_ip.clone().unwrap_or_else(|| a.ip.clone()),
        verbs: want("verbs"),
    };
    let elsewhere = !placement.exec.is_empty();
    if want("verbs") && !cfg!(feature = "verbs") {
        bail!(
            "--paths verbs: this pagewire-bench was built without RDMA support (--features verbs)"
        );
    }
    if elsewhere && want("shm") {
        bail!("--owner-exec with the shm path: shm reads the owner's memory on this host");
    }
    if elsewhere && a.owner == "internal" {
        bail!("--owner-exec runs the daemon elsewhere: not with --owner internal");
    }
    if elsewhere {
        notes.push(format!(
            "owner machine: {} via {:?}; owner CPU is that whole machine's busy time (user+nice+system+irq+softirq from its /proc/stat, which includes the kernel's soft-RoCE work), per page read",
            placement.ip, placement.exec
        ));
    }
    let dir = match &a.work_dir {
        Some(w) => {
            std::fs::create_dir_all(w)?;
            tempfile::Builder::new().prefix("remote-").tempdir_in(w)?
        }
        None => tempfile::tempdir()?,
    };
    let file = dir.path().join("data");
    pattern::generate_file(&file, pages * PAGE as u64, PAGE)?;
    let verify_us = verify_cost_us(&file)?;
    notes.push(format!(
        "every path verifies each page whole inside the timed op (pattern::verify): {verify_us:.2} us per page on this machine, included in every latency and throughput"
    ));
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN)?;
    // Twice the file: the daemon's policy starts evicting above its high
    // watermark (a percentage of the frames), and every page must stay cached.
    let frames = 2 * pages as usize;

    // The daemon: the gRPC row, and the one-sided owner once it serves shm/tcp.
    let need_daemon =
        want("grpc") || want("client") || a.owner == "daemon" || want("verbs") || elsewhere;
    let cluster = if need_daemon {
        match cluster::binaries(a.bin_dir.as_deref()) {
            Some(bins) => Some(cluster::Cluster::start(
                bins,
                dir.path(),
                &file,
                pages,
                frames,
                TOKEN,
                &placement,
            )?),
            None => {
                let msg = "grpc: pagewire-node or pagewire-coordinator not found next to pagewire-bench (cargo build --release -p pagewire-node -p pagewire-coordinator, or --bin-dir): gRPC rows skipped".to_owned();
                eprintln!("{msg}");
                skipped.push(msg);
                None
            }
        }
    } else {
        None
    };
    // Whose CPU the daemon's rows are: the owner's machine, or its process.
    let daemon_cpu = |c: &cluster::Cluster| {
        if elsewhere {
            OwnerCpu::Machine(placement.clone())
        } else {
            OwnerCpu::Pid(c.node_pid())
        }
    };
    let from_daemon = cluster
        .as_ref()
        .and_then(|c| daemon_target(c, daemon_cpu(c)));
    // What the daemon's Transports named, for the refusals below.
    let kinds = cluster.as_ref().map(|c| {
        c.transports
            .iter()
            .map(|t| t.kind.clone())
            .collect::<Vec<_>>()
    });
    if want("verbs") && from_daemon.as_ref().is_none_or(|t| t.verbs.is_none()) {
        bail!(
            "--paths verbs: the daemon publishes no verbs region (its Transports: {kinds:?}; see its log in the work folder)"
        );
    }
    let _shm_dir;
    let mut _internal = None;
    let target = if !(want("shm") || want("tcp") || want("verbs")) {
        None
    } else if a.owner != "internal"
        && let Some(t) = from_daemon
        && (t.shm.is_some() || !want("shm"))
    {
        notes.push(
            "one-sided rows: served by the pagewire-node daemon (its Transports descriptors)"
                .into(),
        );
        Some(t)
    } else if a.owner == "daemon" {
        bail!("--owner daemon: the daemon's Transports names no shm and tcp regions ({kinds:?})");
    } else {
        _shm_dir = shm_tempdir()?;
        let o = owner::OwnerProcess::start(
            &std::env::current_exe()?,
            &file,
            _shm_dir.path(),
            frames,
            &token_file,
            first_spin,
        )?;
        if o.served.preloaded != pages {
            bail!(
                "the owner preloaded {} of {pages} pages",
                o.served.preloaded
            );
        }
        let why = match (&cluster, a.owner.as_str()) {
            (_, "internal") => "--owner internal".to_owned(),
            (None, _) => "no daemon started".to_owned(),
            (Some(c), _) => format!(
                "the daemon's Transports named {:?}, not shm and tcp",
                c.transports.iter().map(|t| &t.kind).collect::<Vec<_>>()
            ),
        };
        notes.push(format!(
            "one-sided rows: served by the bench's owner process (PageCache on an shm region, the same memory registered with a tcp responder): {why}"
        ));
        let t = OneSidedTarget {
            label: "bench-owner",
            cpu: OwnerCpu::Pid(o.pid()),
            shm: Some((
                o.served.shm_dir.clone(),
                o.served.shm_name.clone(),
                o.served.shm,
            )),
            tcp_addr: o.served.tcp_addr,
            tcp: o.served.tcp,
            verbs: None,
            spin: Some(o.spin_probe()),
        };
        _internal = Some(o);
        Some(t)
    };
    if let Some(c) = &cluster {
        notes.push(format!(
            "gRPC rows: pagewire-node daemon (pid {}) under a pagewire-coordinator, every page warmed",
            c.node_pid()
        ));
    }

    let redis = if want("redis") {
        let r = start_redis_via(&placement, &a.redis_server, pages)?;
        if r.is_none() {
            let msg = format!("redis: {} not found, Redis rows skipped", a.redis_server);
            eprintln!("{msg}");
            skipped.push(msg);
        }
        r
    } else {
        None
    };
    // The floor of one-sided tcp: a raw ping-pong that spins (as the issue
    // names it) and one that blocks at once, side by side.
    let mut raw = Vec::new();
    if want("raw_tcp") {
        let bytes = Arc::new(std::fs::read(&file)?);
        let spinning = a.spin_us.iter().filter(|&&us| us > 0);
        for (transport, us) in spinning
            .map(|&us| ("tcp_spin", us))
            .chain([("tcp_block", 0)])
        {
            let s = Duration::from_micros(us);
            raw.push((
                transport,
                us,
                clients::raw_tcp_server(Arc::clone(&bytes), s)?,
            ));
        }
    }

    // Build every group (connections open, warm readers primed).
    let mut groups = Vec::new();
    for &n in &a.clients {
        if let Some(t) = &target {
            for transport in ["shm", "verbs", "tcp"] {
                if !want(transport) {
                    continue;
                }
                // tcp: once per --spin-us value.
                let spins: &[u64] = if transport == "tcp" { &a.spin_us } else { &[0] };
                for &us in spins {
                    for (cache, cold) in [("warm", false), ("cold", true)] {
                        let s = Duration::from_micros(us);
                        let mut cs = one_sided_clients(t, transport, n, cold, s, TOKEN)?;
                        for c in &mut cs {
                            c.prime(pages)?;
                        }
                        groups.push(Group {
                            path: "one_sided",
                            transport,
                            index_cache: cache,
                            owner: t.label,
                            owner_cpu: t.cpu.clone(),
                            owner_spin: t.spin.clone().filter(|_| transport == "tcp"),
                            spin_us: (transport == "tcp").then_some(us),
                            clients: cs,
                            runs: a.run.clone(),
                        });
                    }
                }
            }
        }
        if let Some(c) = &cluster {
            // tcp_1conn: every thread's reader a handle on one connection.
            for (label, transport, tcp_shared) in [
                ("shm", "shm", false),
                ("tcp", "tcp", false),
                ("tcp_1conn", "tcp", true),
            ] {
                if !want("client") || !c.transports.iter().any(|t| t.kind == transport) {
                    continue;
                }
                let follower = pagewire_client::MapFollower::start(&c.coordinator_addr, c.token())?;
                let shared = Arc::new(pagewire_client::ClusterClient::new(
                    follower,
                    c.token(),
                    pagewire_client::ClientConfig {
                        transport: transport.parse().map_err(anyhow::Error::msg)?,
                        tcp_shared,
                        ..Default::default()
                    },
                )?);
                let mut cs: Vec<Box<dyn Client>> = Vec::new();
                for _ in 0..n {
                    cs.push(Box::new(clients::SharedCluster::new(shared.clone())));
                }
                // Prime on as many threads at once: one warm reader each.
                let cs = prime_on_threads(cs, pages)?;
                groups.push(Group {
                    path: "client_shared",
                    transport: label,
                    index_cache: "warm",
                    owner: "pagewire-node",
                    owner_cpu: daemon_cpu(c),
                    owner_spin: None,
                    spin_us: None,
                    clients: cs,
                    runs: a.run.clone(),
                });
            }
        }
        if n == 1
            && let Some(t) = &target
        {
            for transport in ["verbs", "tcp"] {
                if !want(transport) {
                    continue;
                }
                groups.push(Group {
                    path: "frame_read",
                    transport,
                    index_cache: "-",
                    owner: t.label,
                    owner_cpu: t.cpu.clone(),
                    owner_spin: t.spin.clone().filter(|_| transport == "tcp"),
                    spin_us: (transport == "tcp").then_some(first_spin),
                    clients: vec![frame_only_client(t, transport, pages, spin, TOKEN)?],
                    runs: vec![1],
                });
            }
        }
        if want("grpc")
            && let Some(c) = &cluster
        {
            let mut cs: Vec<Box<dyn Client>> = Vec::new();
            for _ in 0..n {
                cs.push(Box::new(clients::Grpc::connect(
                    &c.node_addr,
                    c.token(),
                    c.map_epoch,
                )?));
            }
            groups.push(Group {
                path: "grpc",
                transport: "grpc",
                index_cache: "-",
                owner: "pagewire-node",
                owner_cpu: daemon_cpu(c),
                owner_spin: None,
                spin_us: None,
                clients: cs,
                runs: a.run.clone(),
            });
        }
        if let Some(r) = &redis {
            let mut cs: Vec<Box<dyn Client>> = Vec::new();
            for _ in 0..n {
                cs.push(Box::new(clients::Redis::connect_to(&r.addr())?));
            }
            groups.push(Group {
                path: "redis",
                transport: "redis",
                index_cache: "-",
                owner: "redis-server",
                owner_cpu: if elsewhere {
                    OwnerCpu::Machine(placement.clone())
                } else {
                    OwnerCpu::Pid(r.child.id())
                },
                owner_spin: None,
                spin_us: None,
                clients: cs,
                runs: a.run.clone(),
            });
        }
        for &(transport, us, addr) in &raw {
            let mut cs: Vec<Box<dyn Client>> = Vec::new();
            for _ in 0..n {
                cs.push(Box::new(clients::RawTcp::connect(
                    addr,
                    Duration::from_micros(us),
                )?));
            }
            groups.push(Group {
                path: "raw_tcp",
                transport,
                index_cache: "-",
                owner: "-",
                owner_cpu: OwnerCpu::None,
                owner_spin: None,
                spin_us: Some(us),
                clients: cs,
                runs: vec![1],
            });
        }
    }

    // Interleaved repeats.
    let mut samples: Vec<Vec<Vec<Sample>>> = groups
        .iter()
        .map(|g| g.runs.iter().map(|_| Vec::new()).collect())
        .collect();
    let mut perftest_runs = Vec::new();
    for _ in 0..runs {
        if want("perftest") {
            perftest_runs.push(perftest_rows(
                &placement,
                &a.rdma_device,
                a.perftest_iters,
                &mut skipped,
            )?);
        }
        for (g, per_run) in groups.iter_mut().zip(&mut samples) {
            for (run, ss) in g.runs.clone().into_iter().zip(per_run.iter_mut()) {
                let s = measure(g, run, pages, secs).with_context(|| {
                    format!(
                        "{} {} {} x{} run {run}",
                        g.path,
                        g.transport,
                        g.index_cache,
                        g.clients.len()
                    )
                })?;
                ss.push(s);
            }
        }
    }
    let mut rows = Vec::new();
    for (g, per_run) in groups.iter().zip(samples) {
        for (&run, ss) in g.runs.iter().zip(per_run) {
            let mut c = Counters::default();
            for s in &ss {
                c += s.counters;
            }
            let cpu: Vec<f64> = ss.iter().filter_map(|s| s.owner_cpu_us).collect();
            let reader_cpu: Vec<f64> = ss.iter().filter_map(|s| s.reader_cpu_us).collect();
            rows.push(Row {
                path: g.path,
                transport: g.transport,
                index_cache: g.index_cache,
                owner: g.owner,
                clients: g.clients.len(),
                run,
                spin_us: g.spin_us,
                ops_per_sec: median(ss.iter().map(|s| s.ops_per_sec).collect()),
                p50_us: median(ss.iter().map(|s| s.p50_us).collect()),
                p99_us: median(ss.iter().map(|s| s.p99_us).collect()),
                max_us: ss.iter().map(|s| s.max_us).fold(0.0, f64::max),
                owner_cpu_us_per_read: (!cpu.is_empty()).then(|| median(cpu)),
                reader_cpu_us_per_read: (!reader_cpu.is_empty()).then(|| median(reader_cpu)),
                round_trips_per_read: c.round_trips as f64 / c.pages.max(1) as f64,
                wrong_reads: c.wrong_reads,
                retries: c.retries,
                validation_failures: c.validation_failures,
                fallbacks: c.fallbacks,
                repeats_ops_per_sec: ss.iter().map(|s| s.ops_per_sec).collect(),
                reader_spin: sum_spin(ss.iter().map(|s| s.reader_spin)),
                owner_spin: sum_spin(ss.iter().map(|s| s.owner_spin)),
            });
        }
    }
    drop(groups);
    if want("perftest") {
        // One perftest run per repeat, interleaved with the rows above
        // (drift hits it alike); the medians go in the table.
        // By tool: a repeat may have skipped one (its output unusable).
        let mut by_tool: Vec<Vec<Row>> = Vec::new();
        for row in perftest_runs.into_iter().flatten() {
            match by_tool.iter_mut().find(|g| g[0].transport == row.transport) {
                Some(g) => g.push(row),
                None => by_tool.push(vec![row]),
            }
        }
        for rs in by_tool {
            let mut row = rs[0].clone();
            row.ops_per_sec = median(rs.iter().map(|r| r.ops_per_sec).collect());
            row.p50_us = median(rs.iter().map(|r| r.p50_us).collect());
            row.p99_us = median(rs.iter().map(|r| r.p99_us).collect());
            row.max_us = rs.iter().map(|r| r.max_us).fold(0.0, f64::max);
            row.repeats_ops_per_sec = rs.iter().map(|r| r.ops_per_sec).collect();
            rows.push(row);
        }
    }

    let targets = targets(&rows);
    let machine = crate::machine::describe();
    let params = serde_json::json!({
        "args": a,
        "seconds": secs,
        "runs": runs,
        "pages": pages,
        "page_bytes": PAGE,
        "verify_us_per_page": verify_us,
        "reader": format!("{:?}", ReaderConfig::default()),
    });
    let doc = serde_json::json!({
        "bench": "remote",
        "machine": machine,
        "params": params,
        "results": rows,
        "targets": targets,
        "notes": notes,
        "skipped": skipped,
    });
    std::fs::create_dir_all(&a.output.out)?;
    std::fs::write(
        a.output.out.join("remote.json"),
        serde_json::to_string_pretty(&doc)?,
    )?;
    if a.output.json {
        println!("{}", serde_json::to_string(&doc)?);
    } else {
        println!("remote: {machine}");
        println!(
            "params: {pages} pages of {PAGE} B, {secs} s x {runs} runs per row (medians), tcp spin {:?} us (targets: the first)",
            a.spin_us
        );
        print!("{}", table(&rows));
        let polling = summary::spin_table(&rows);
        if !polling.is_empty() {
            println!(
                "tcp polling (counts summed over repeats; caught: spins that caught their message; closed/cooling/no budget: waits that did not spin, and why):"
            );
            print!("{polling}");
        }
        for n in &notes {
            println!("note: {n}");
        }
        for s in &skipped {
            println!("skipped: {s}");
        }
        for t in &targets {
            println!(
                "target {}: {:.3} (bound {}) -> {}",
                t.target,
                t.value,
                t.bound,
                if t.met { "met" } else { "MISSED" }
            );
        }
    }
    let wrong: u64 = rows.iter().map(|r| r.wrong_reads).sum();
    if wrong > 0 {
        bail!("{wrong} wrong reads");
    }
    Ok(())
}

/// The counts of several repeats added up (`None` if none has any).
pub(crate) fn sum_spin(it: impl Iterator<Item = Option<SpinStats>>) -> Option<SpinStats> {
    it.flatten().reduce(|a, b| SpinStats {
        waiters: b.waiters,
        busy: b.busy,
        cap: b.cap,
        waits: a.waits + b.waits,
        spins: a.spins + b.spins,
        caught: a.caught + b.caught,
        preempted: a.preempted + b.preempted,
        closed: a.closed + b.closed,
        probes: a.probes + b.probes,
        cooling: a.cooling + b.cooling,
        no_budget: a.no_budget + b.no_budget,
        blocks: a.blocks + b.blocks,
        long_blocks: a.long_blocks + b.long_blocks,
        window_ns: a.window_ns + b.window_ns,
    })
}
