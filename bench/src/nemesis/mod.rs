//! `pagewire-bench nemesis`: a seeded random fault schedule against a
//! cluster under reads and writes, every operation logged, and a per-page
//! linearizability check of the whole history afterwards.
//!
//! It reuses the storm's processes (`storm::procs`: the coordinator, the
//! nodes, on loopback or on `--hosts` network-namespace hosts) and adds:
//! - **the schedule** (`schedule`): kill -9 and restart; restart in place
//!   (same id, same address, at once, within the lease) while co-located
//!   shm readers hold connections; SIGSTOP past the lease, then SIGCONT;
//!   link cuts and heals (`--hosts` only); coordinator failover on etcd
//!   (`--etcd`: three etcd members and two coordinators on loopback; the
//!   leader is killed with -9 and brought back); drains, joins and
//!   undrains through the coordinator's admin API; and tight follow-ups: a
//!   second map change within milliseconds of a takeover. `--focus` biases
//!   it to one of the interleavings of issue 18's findings 1 to 3. The
//!   choices come from `--seed` alone (printed first); the times they run
//!   at are as exact as the machine allows.
//! - **the workers** (`worker`): processes that write (one writer per page,
//!   each write the page's next content generation) and read a working set
//!   made of every extent's edges, logging each operation with its
//!   invocation and completion time on one clock (`history`).
//! - **the checker** (`check`): every read returned the latest write
//!   acknowledged before it began or one concurrent with it, and no
//!   new-old inversion. A violation prints the seed and the page's
//!   operations around it, and the run exits non-zero.

pub mod check;
mod etcd;
pub mod history;
mod schedule;
pub mod worker;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use pagewire_node::pattern;

use crate::storm::faults::parse_duration;
use crate::storm::procs::{self, Cluster, ClusterSpec, Hosts, Programs};

static STOP: AtomicBool = AtomicBool::new(false);

fn stopped() -> bool {
    STOP.load(Ordering::Relaxed)
}

/// Which interleaving the schedule leans to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Focus {
    /// Every fault kind, at random.
    Mixed,
    /// No faults at all: the control (the history must check clean).
    None,
    /// Finding 1: a node frozen past its lease, its extents taken over, and
    /// another map change (drain, undrain, join) milliseconds later.
    TakeoverFollowup,
    /// Finding 2: kill -9 and an immediate restart with the same id and
    /// address, shm readers connected.
    RestartInPlace,
    /// Finding 3: runs read up to extents' last pages, then drains and
    /// undrains that move the next extents.
    ReadaheadBoundary,
}

impl Focus {
    pub fn name(self) -> &'static str {
        match self {
            Focus::Mixed => "mixed",
            Focus::None => "none",
            Focus::TakeoverFollowup => "takeover-followup",
            Focus::RestartInPlace => "restart-in-place",
            Focus::ReadaheadBoundary => "readahead-boundary",
        }
    }
}

#[derive(clap::Args, Clone, Debug, serde::Serialize)]
pub struct Args {
    /// The schedule's seed (default: from the clock); printed at the start.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Length of the run (faults and operations).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub duration: Duration,
    #[arg(long, value_enum, default_value = "mixed")]
    pub focus: Focus,
    /// Nodes started at first.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Nodes kept aside for joins (with --hosts: the hosts file's nodes
    /// past --nodes).
    #[arg(long, default_value_t = 1)]
    pub spare_nodes: usize,
    /// Worker processes (each one writer thread and --reader-threads).
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    #[arg(long, default_value_t = 2)]
    pub reader_threads: u64,
    /// One-sided transport of the readers: shm, tcp, auto, verbs.
    #[arg(long, default_value = "shm")]
    pub transport: String,
    /// Size of the generated file in MiB.
    #[arg(long, default_value_t = 32)]
    pub file_mib: u64,
    /// Extent size in KiB (the coordinator's --extent-size).
    #[arg(long, default_value_t = 1024)]
    pub extent_kib: u64,
    /// The nodes' caches together, as a fraction of the file.
    #[arg(long, default_value_t = 0.3)]
    pub cache_fraction: f64,
    #[arg(long, default_value_t = 1000)]
    pub lease_ms: u64,
    /// How long one operation keeps retrying through a failover.
    #[arg(long, default_value_t = 3000)]
    pub op_deadline_ms: u64,
    /// Coordinator failover: three etcd members and two coordinators on
    /// loopback (the coordinator needs the `etcd` feature: --bin-dir with
    /// `pagewire-coordinator` built `--features etcd`).
    #[arg(long)]
    pub etcd: bool,
    /// Hosts file (network-namespace hosts; storm-netns.sh writes one):
    /// link cuts and heals join the schedule.
    #[arg(long)]
    pub hosts: Option<PathBuf>,
    /// Run the pagewire-node / pagewire-coordinator of this folder.
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Where the file, logs and histories go (kept); default: a temporary
    /// folder, removed unless the run fails or --keep.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    #[arg(long)]
    pub keep: bool,
    /// The checker's end-to-end self-test: the workers log one in N reads
    /// of a rewritten page as the generation before the one read (the run
    /// must then fail). 0: off.
    #[arg(long, default_value_t = 0, hide = true)]
    pub self_test_lie_every: u64,
    /// The CI smoke run: 20 s, a 16 MiB file, two workers.
    #[arg(long)]
    pub quick: bool,
    #[command(flatten)]
    #[serde(skip)]
    pub output: crate::report::Output,
}

/// One fault done (or skipped) by the schedule.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FaultRec {
    pub kind: &'static str,
    pub target: String,
    /// Seconds since the start of the run.
    pub at_s: f64,
    pub note: String,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    bench: &'static str,
    seed: u64,
    focus: Focus,
    params: Args,
    secs: f64,
    reads: u64,
    reads_failed: u64,
    writes: u64,
    writes_failed: u64,
    faults_by_kind: std::collections::BTreeMap<&'static str, u64>,
    faults: Vec<FaultRec>,
    check: check::Outcome,
    first_violation_s: Option<f64>,
    history_dir: Option<String>,
    notes: Vec<String>,
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let _ = ctrlc::set_handler(|| STOP.store(true, Ordering::Relaxed));
    let r = run_inner(a);
    if stopped() {
        eprintln!("nemesis: interrupted");
        std::process::exit(130);
    }
    r
}

fn run_inner(a: &Args) -> anyhow::Result<()> {
    let mut a = a.clone();
    if a.quick {
        a.duration = a.duration.min(Duration::from_secs(20));
        a.file_mib = a.file_mib.min(16);
        a.workers = a.workers.min(2);
    }
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            % 1_000_000_007
    });
    a.seed = Some(seed);
    eprintln!(
        "nemesis: seed {seed} (focus {}, {:.0} s; rerun with --seed {seed} and the same arguments)",
        a.focus.name(),
        a.duration.as_secs_f64()
    );
    if a.workers == 0 || a.nodes < 2 {
        bail!("--workers must be at least 1 and --nodes at least 2");
    }
    let mut notes = Vec::new();
    let hosts = match &a.hosts {
        Some(h) => {
            let h = Hosts::load(h)?;
            if h.node
                .iter()
                .chain(&h.reader)
                .any(|x| x.exec.iter().any(|e| e.contains("vm-exec")))
            {
                bail!(
                    "--hosts with VM hosts: the history needs one clock for every process \
                     (network-namespace hosts share the machine's; VMs do not)"
                );
            }
            if a.transport == "shm" {
                bail!("--hosts with --transport shm: a cut would not cut shm reads; use tcp");
            }
            h
        }
        None => {
            notes.push(
                "link cuts and heals need --hosts (network-namespace hosts): left out".into(),
            );
            Hosts::loopback(a.nodes + a.spare_nodes)
        }
    };
    if hosts.node.len() < a.nodes {
        bail!(
            "the hosts file has {} nodes, fewer than --nodes {}",
            hosts.node.len(),
            a.nodes
        );
    }
    if !a.etcd {
        notes.push("coordinator failover needs --etcd: left out".into());
    }

    let tmp;
    let dir = match &a.work_dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            tmp = tempfile::Builder::new()
                .prefix("pagewire-nemesis-")
                .tempdir()?;
            tmp.path().to_owned()
        }
    };
    let file = dir.join("nemesis.data");
    let len = a.file_mib << 20;
    pattern::generate_file(&file, len, 4096)
        .with_context(|| format!("generating {}", file.display()))?;
    let token = format!("nemesis-{:016x}", fastrand::u64(..));
    let token_file = dir.join("cluster-token");
    std::fs::write(&token_file, &token)?;
    let pages = len / 4096;
    let frames = ((pages as f64 * a.cache_fraction) / a.nodes as f64).ceil() as usize;

    let etcd = if a.etcd {
        Some(etcd::Etcd::start(&dir, &stopped)?)
    } else {
        None
    };
    let mut coordinator_args = vec!["--extent-size".to_owned(), (a.extent_kib << 10).to_string()];
    if etcd.is_some() {
        let cfg = dir.join("coordinator.toml");
        std::fs::write(
            &cfg,
            format!(
                "[etcd]\nprefix = \"/nemesis-{seed}\"\nlease_ttl_s = 3\nrequest_timeout_ms = 1000\n"
            ),
        )?;
        coordinator_args.push("--config".into());
        coordinator_args.push(cfg.display().to_string());
    }
    let node_ports = (0..hosts.node.len())
        .map(|i| procs::free_port(&hosts.node[i].ip))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let spec = ClusterSpec {
        programs: Programs::new(a.bin_dir.as_deref())?,
        coordinator_port: procs::free_port(&hosts.coordinator.ip)?,
        standby_ports: if etcd.is_some() {
            vec![procs::free_port(&hosts.coordinator.ip)?]
        } else {
            Vec::new()
        },
        store: etcd.as_ref().map(|e| format!("etcd://{}", e.endpoints())),
        coordinator_args,
        hosts: hosts.clone(),
        dir: dir.clone(),
        file: file.clone(),
        token_file: token_file.clone(),
        frames_per_node: frames.max(64),
        lease_ms: a.lease_ms,
        shm: a.transport == "shm" || a.transport == "auto",
        verbs: a.transport == "verbs",
        node_ports,
    };
    eprintln!(
        "nemesis: {} nodes (+{} spare), {} workers, a {} MiB file in {} KiB extents, lease {} ms, {}",
        a.nodes,
        hosts.node.len() - a.nodes,
        a.workers,
        a.file_mib,
        a.extent_kib,
        a.lease_ms,
        if etcd.is_some() {
            "two coordinators on three etcd members"
        } else {
            "one coordinator"
        }
    );
    let coordinators = spec.coordinator_list();
    let mut cluster = Cluster::start_with(spec, &token, a.nodes, &stopped)?;

    // The workers.
    let hist = dir.join("history");
    std::fs::create_dir_all(&hist)?;
    let secs = a.duration.as_secs_f64();
    let t_start = history::now_ns();
    let mut workers = Vec::new();
    for id in 0..a.workers {
        let host = &hosts.reader[id % hosts.reader.len()];
        let mut c = procs::prefixed(&host.exec, std::env::current_exe()?);
        procs::die_with_parent(&mut c);
        c.arg("nemesis-worker")
            .args(["--id", &id.to_string(), "--workers", &a.workers.to_string()])
            .args(["--coordinator", &coordinators])
            .arg("--token-file")
            .arg(&token_file)
            .args(["--transport", &a.transport])
            .args(["--reader-threads", &a.reader_threads.to_string()])
            .arg("--write")
            .arg("--history")
            .arg(hist.join(format!("worker-{id}")))
            .args([
                "--duration-ms",
                &(a.duration.as_millis() as u64).to_string(),
            ])
            .args(["--op-deadline-ms", &a.op_deadline_ms.to_string()])
            .args(["--seed", &(seed ^ (id as u64) << 40).to_string()])
            .args(["--lie-every", &a.self_test_lie_every.to_string()]);
        match a.focus {
            // Runs up to extents' ends, and reads anywhere to keep misses
            // (and so readahead) going.
            Focus::ReadaheadBoundary => {
                c.args(["--run-fraction", "0.4", "--churn-fraction", "0.2"])
                    .arg("--runs-grpc");
            }
            // Few pages, read often: a stale window of a few hundred ms
            // must see reads of the pages written in it. No reads outside
            // them: a miss on a frozen node times out and makes the
            // reader's follower poll at once, which would close the very
            // window (a reader that trusts the map it confirmed last) the
            // focus is after.
            Focus::TakeoverFollowup | Focus::RestartInPlace => {
                c.args(["--edge-pages", "2", "--spread-pages", "0"]).args([
                    "--run-fraction",
                    "0",
                    "--churn-fraction",
                    "0",
                ]);
            }
            Focus::Mixed | Focus::None => {}
        }
        c.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null());
        workers.push(c.spawn().context("starting a worker")?);
    }
    // Let the workers connect and fill the caches before the first fault.
    let t0 = Instant::now();
    let end = t0 + a.duration;
    let mut sched = schedule::Schedule::new(
        seed,
        a.focus,
        &token,
        a.lease_ms,
        a.hosts.is_some(),
        etcd.is_some(),
        t0,
    );
    std::thread::sleep(Duration::from_millis(1500).min(a.duration / 4));
    sched.run(&mut cluster, end, &stopped);
    let faults = sched.done;

    let mut totals = worker::Totals::default();
    for mut w in workers {
        let out = w.stdout.take();
        let err = w.stderr.take();
        let st = w.wait()?;
        let mut line = String::new();
        if let Some(o) = out {
            let _ = BufReader::new(o).read_line(&mut line);
        }
        let mut errs = String::new();
        if let Some(e) = err {
            let _ = std::io::Read::read_to_string(&mut BufReader::new(e), &mut errs);
        }
        match serde_json::from_str::<worker::Totals>(line.trim()) {
            Ok(t) if st.success() => {
                totals.reads += t.reads;
                totals.reads_failed += t.reads_failed;
                totals.writes += t.writes;
                totals.writes_failed += t.writes_failed;
                totals.corrupt += t.corrupt;
            }
            _ => bail!(
                "a worker failed ({st}): {}",
                errs.lines().rev().take(6).collect::<Vec<_>>().join(" | ")
            ),
        }
    }
    drop(cluster);
    drop(etcd);

    // The check.
    let mut ops = Vec::new();
    for e in std::fs::read_dir(&hist)? {
        ops.extend(history::load(&e?.path())?);
    }
    let outcome = check::check(&ops, t_start);
    let mut by_kind = std::collections::BTreeMap::new();
    for f in &faults {
        *by_kind.entry(f.kind).or_insert(0) += 1;
    }
    let first_violation_s = outcome
        .violations
        .iter()
        .filter_map(|v| v.witnesses.iter().map(|o| o.resp_ns).max())
        .min()
        .map(|t| t.saturating_sub(t_start) as f64 / 1e9);
    let failed = !outcome.violations.is_empty();
    let keep = failed || a.keep || a.work_dir.is_some();
    let rep = Report {
        bench: "nemesis",
        seed,
        focus: a.focus,
        params: a.clone(),
        secs,
        reads: totals.reads,
        reads_failed: totals.reads_failed,
        writes: totals.writes,
        writes_failed: totals.writes_failed,
        faults_by_kind: by_kind,
        faults,
        check: outcome,
        first_violation_s,
        history_dir: keep.then(|| hist.display().to_string()),
        notes,
    };
    if a.output.json {
        println!("{}", serde_json::to_string_pretty(&rep)?);
    } else {
        print_report(&rep);
    }
    for v in rep.check.violations.iter().take(5) {
        eprintln!(
            "\nnemesis: VIOLATION ({}) on page {} [seed {seed}]: {}",
            v.kind.name(),
            v.page,
            v.message
        );
        for l in check::window(&ops, v, 50_000_000, 40, t_start) {
            eprintln!("  {l}");
        }
    }
    if keep {
        // The temporary folder would be removed on return: keep it.
        if a.work_dir.is_none() {
            let kept = std::env::temp_dir().join(format!("pagewire-nemesis-{seed}"));
            let _ = std::fs::remove_dir_all(&kept);
            if std::fs::rename(&dir, &kept).is_ok() {
                eprintln!("nemesis: histories and logs kept in {}", kept.display());
            }
        } else {
            eprintln!("nemesis: histories and logs in {}", dir.display());
        }
    }
    if failed {
        bail!(
            "seed {seed}: {} page(s) with a linearizability violation (first {:?})",
            rep.check.violations.len(),
            rep.check.violations.first().map(|v| v.kind.name())
        );
    }
    Ok(())
}

fn print_report(r: &Report) {
    println!(
        "nemesis  seed {}  focus {}  {:.0} s",
        r.seed,
        r.focus.name(),
        r.secs
    );
    println!(
        "operations  reads {} (failed {})  writes {} (failed/indeterminate {})",
        r.reads, r.reads_failed, r.writes, r.writes_failed
    );
    println!(
        "checked     {} pages ({} written), {} reads",
        r.check.pages, r.check.pages_written, r.check.reads_checked
    );
    let kinds: Vec<String> = r
        .faults_by_kind
        .iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    println!("faults      {}", kinds.join(", "));
    for f in &r.faults {
        println!(
            "  {:>7.2} s  {:<22} {:<14} {}",
            f.at_s, f.kind, f.target, f.note
        );
    }
    println!("violations  {}", r.check.violations.len());
    if let Some(t) = r.first_violation_s {
        println!("first violation at {t:.2} s");
    }
    for n in &r.notes {
        println!("note: {n}");
    }
}
