//! `pagewire-bench mount`: fio through `pagewire-mount`, side by side with
//! its floors, in one run.
//!
//! * Paths (`--paths`): the mount over `shm` and over `tcp` (two
//!   `pagewire-mount` processes on one loopback cluster: a coordinator and
//!   three nodes whose caches hold the whole file), the same backing file
//!   read directly (`local`: the kernel page cache, the floor of any file
//!   read), and a do-nothing FUSE file system answering zeros from memory
//!   ([`zerofs`]: the floor of any FUSE file system here). `shm-noverify`
//!   and `local-noverify` are the same reads without fio's verification,
//!   so its cost shows beside them; `tcp-noahead` is `tcp` through a
//!   third mount started with `--no-read-ahead`, so what the mount's
//!   read-ahead of sequential readers (on for runs that come over the
//!   network) is worth shows too. `shm-cached` and `tcp-cached` (not in
//!   the default list) read through a mount started with `--cached 1`: the
//!   kernel page cache, whose changed runs the mount drops every second.
//! * Jobs: 4 KiB random reads and 1 MiB sequential reads at queue depth 1
//!   and 16, fio's `psync` engine; depth 16 is 16 jobs ([`fio`]).
//! * Verification: the backing file is written by fio with a crc32c verify
//!   header in every 4 KiB block; every measured job on the mounts and the
//!   local file verifies every block it reads, inside the timed job. Before
//!   anything is measured, the whole file is also read once through each
//!   mount (warming the nodes' caches' readers, the mounts' clients and
//!   their index caches) and compared byte for byte with the backing file.
//! * Each cell is measured `--runs` times for `--seconds`, the repeats
//!   interleaved across cells; the table shows medians, wrong reads are
//!   summed. CPU of fio (its rusage), of the FUSE server (`pagewire-mount`'s
//!   or this process's, from `/proc/PID/stat`) and of the three nodes,
//!   in cores over each measurement.
//! * Every mount is unmounted at the end, on error too ([`PwMount`] and
//!   [`zerofs::ZeroMount`] guards; `fusermount3 -u -z` as the last resort).
//!
//! The files: this one runs the cells; `fio` the jobs and their parsing;
//! `pwmount` the `pagewire-mount` processes; `zerofs` the zero file system;
//! `summary` the rows, the table and the targets.

mod fio;
mod pwmount;
mod summary;
mod zerofs;

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;

use crate::remote::owner::process_cpu_us;
use crate::report;
use crate::storm::procs::{self, ClusterSpec, Hosts, Programs};
use fio::{Job, Measured};
use pwmount::{Flavor, PwMount, detach_if_mounted, wait_for_file};
use summary::{Row, row, table, targets};

const TOKEN: &str = "pagewire-bench-mount-token";
const PAGE: u64 = 4096;

static STOP: AtomicBool = AtomicBool::new(false);

fn stopped() -> bool {
    STOP.load(Ordering::Relaxed)
}

/// Options of `pagewire-bench mount`.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct Args {
    /// CI smoke run: one run of 1 s per cell over a 16 MiB file.
    #[arg(long)]
    pub quick: bool,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Measurements per cell (the table shows medians).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// The file's size, MiB (a multiple of 16: 16 jobs each read a slice).
    #[arg(long, default_value_t = 256)]
    pub file_mib: u64,
    /// Paths, comma-separated: shm, tcp (through pagewire-mount), local
    /// (the backing file), zero (the do-nothing FUSE file system),
    /// shm-noverify, local-noverify (without fio's verification),
    /// tcp-noahead (tcp through a mount that does not read ahead: what
    /// read-ahead is worth), shm-cached and tcp-cached (through a mount
    /// with `--cached 1`: the kernel page cache, revalidated every second;
    /// not in the default list).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "shm,tcp,local,zero,shm-noverify,local-noverify,tcp-noahead"
    )]
    pub paths: Vec<String>,
    /// Jobs, comma-separated: rand4k-qd1, rand4k-qd16, seq1m-qd1,
    /// seq1m-qd16 (default: all four).
    #[arg(long, value_delimiter = ',')]
    pub jobs: Vec<String>,
    /// pagewire-mount's --workers.
    #[arg(long, default_value_t = 16)]
    pub workers: u32,
    /// Folder holding pagewire-mount, pagewire-node and
    /// pagewire-coordinator (default: this executable's folder; the nodes
    /// and coordinator fall back to this executable's hidden commands).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Where the file, the logs and the mount points go (kept); default: a
    /// temporary folder, removed at the end.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// The fio binary.
    #[arg(long, default_value = "fio")]
    pub fio: String,
    #[command(flatten)]
    #[serde(skip)]
    pub output: report::Output,
}

/// Where a cell reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    Shm,
    Tcp,
    Local,
    Zero,
    ShmNoVerify,
    LocalNoVerify,
    /// tcp, verified, through a mount started with `--no-read-ahead`.
    TcpNoAhead,
    /// shm, verified, through a mount started with `--cached 1`.
    ShmCached,
    /// tcp, verified, through a mount started with `--cached 1`.
    TcpCached,
}

impl Via {
    const ALL: [Via; 9] = [
        Via::Shm,
        Via::Tcp,
        Via::Local,
        Via::Zero,
        Via::ShmNoVerify,
        Via::LocalNoVerify,
        Via::TcpNoAhead,
        Via::ShmCached,
        Via::TcpCached,
    ];

    fn key(self) -> &'static str {
        match self {
            Via::Shm => "shm",
            Via::Tcp => "tcp",
            Via::Local => "local",
            Via::Zero => "zero",
            Via::ShmNoVerify => "shm-noverify",
            Via::LocalNoVerify => "local-noverify",
            Via::TcpNoAhead => "tcp-noahead",
            Via::ShmCached => "shm-cached",
            Via::TcpCached => "tcp-cached",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Via::Shm | Via::Tcp | Via::ShmNoVerify => "mount",
            Via::TcpNoAhead => "mount-noahead",
            Via::ShmCached | Via::TcpCached => "mount-cached",
            Via::Local | Via::LocalNoVerify => "local",
            Via::Zero => "zero-fuse",
        }
    }

    fn transport(self) -> &'static str {
        match self {
            Via::Shm | Via::ShmNoVerify | Via::ShmCached => "shm",
            Via::Tcp | Via::TcpNoAhead | Via::TcpCached => "tcp",
            Via::Local | Via::LocalNoVerify => "page cache",
            Via::Zero => "-",
        }
    }

    /// The mount a cell reads through: its transport and flavour.
    fn mount(self) -> Option<(&'static str, Flavor)> {
        let flavor = match self {
            Via::Shm | Via::Tcp | Via::ShmNoVerify => Flavor::Default,
            Via::TcpNoAhead => Flavor::NoAhead,
            Via::ShmCached | Via::TcpCached => Flavor::Cached,
            Via::Local | Via::LocalNoVerify | Via::Zero => return None,
        };
        Some((self.transport(), flavor))
    }

    fn verify(self) -> bool {
        matches!(
            self,
            Via::Shm | Via::Tcp | Via::Local | Via::TcpNoAhead | Via::ShmCached | Via::TcpCached
        )
    }
}

/// One measurement of a cell.
#[derive(Clone, Debug, Serialize)]
struct Sample {
    #[serde(flatten)]
    fio: Measured,
    wall_s: f64,
    /// fio's CPU (its processes' rusage), cores.
    fio_cores: f64,
    /// The FUSE server's CPU, cores (none for `local`).
    fuse_cores: Option<f64>,
    /// The three nodes' CPU, cores (mount rows).
    node_cores: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
struct WarmPass {
    path: String,
    bytes: u64,
    seconds: f64,
    /// Bytes that differ from the backing file.
    wrong_bytes: u64,
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let _ = ctrlc::set_handler(|| STOP.store(true, Ordering::Relaxed));
    let r = run_inner(a);
    if stopped() {
        eprintln!("mount: interrupted; every mount is unmounted and every process stopped");
        std::process::exit(130);
    }
    r
}

fn run_inner(a: &Args) -> anyhow::Result<()> {
    let mut a = a.clone();
    if a.quick {
        a.runs = 1;
        a.seconds = 1.0;
        a.file_mib = 16;
    }
    if a.file_mib < 16 || !a.file_mib.is_multiple_of(16) {
        bail!("--file-mib {}: a multiple of 16, at least 16", a.file_mib);
    }
    if a.runs == 0 || a.seconds.is_nan() || a.seconds <= 0.0 {
        bail!("--runs and --seconds must be positive");
    }
    let vias: Vec<Via> = Via::ALL
        .into_iter()
        .filter(|v| a.paths.iter().any(|p| p == v.key()))
        .collect();
    for p in &a.paths {
        if !Via::ALL.iter().any(|v| v.key() == p) {
            bail!(
                "--paths: unknown path {p:?} (shm, tcp, local, zero, shm-noverify, local-noverify, tcp-noahead, shm-cached, tcp-cached)"
            );
        }
    }
    for j in &a.jobs {
        if !Job::ALL.iter().any(|k| &k.name() == j) {
            bail!("--jobs: unknown job {j:?} (rand4k-qd1, rand4k-qd16, seq1m-qd1, seq1m-qd16)");
        }
    }
    let jobs: Vec<Job> = Job::ALL
        .into_iter()
        .filter(|j| a.jobs.is_empty() || a.jobs.contains(&j.name()))
        .collect();
    preflight(&a.fio)?;
    let size = a.file_mib << 20;

    let tmp;
    let work = match &a.work_dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            tmp = tempfile::Builder::new().prefix("pwbench-mount").tempdir()?;
            tmp.path().to_owned()
        }
    };
    let backing = work.join("backing");
    let t = Instant::now();
    run_fio(
        &a.fio,
        &fio::fill_args(&backing, size),
        Duration::from_secs(600),
    )
    .context("writing the backing file with fio")?;
    eprintln!(
        "mount: backing file {} ({} MiB) written by fio with crc32c verify headers in {:.1?}",
        backing.display(),
        a.file_mib,
        t.elapsed()
    );

    let mut mounts_needed: Vec<(&'static str, Flavor)> = Vec::new();
    for m in vias.iter().filter_map(|v| v.mount()) {
        if !mounts_needed.contains(&m) {
            mounts_needed.push(m);
        }
    }

    // Declared in this order so that they drop in the reverse one: the
    // zero FS and the mounts before the cluster, the cluster before the
    // folder.
    let mut cluster = None;
    let mut mounts: Vec<PwMount> = Vec::new();
    let mut zero = None;
    let mut warm = Vec::new();

    if !mounts_needed.is_empty() {
        let (programs, mount_bin) = programs(a.bin_dir.as_deref())?;
        let token_file = work.join("cluster-token");
        std::fs::write(&token_file, TOKEN)?;
        let pages = size / PAGE;
        let spec = ClusterSpec {
            programs,
            hosts: Hosts::loopback(3),
            dir: work.clone(),
            file: backing.clone(),
            token_file: token_file.clone(),
            // Each node could hold the whole file: nothing is evicted.
            frames_per_node: pages as usize,
            // Long: a node starved by 16 fio jobs on a small machine must
            // not be declared dead mid-measurement.
            lease_ms: 30_000,
            coordinator_port: procs::free_port("127.0.0.1")?,
            shm: true,
            verbs: false,
            node_ports: Vec::new(),
            standby_ports: Vec::new(),
            store: None,
            coordinator_args: Vec::new(),
        };
        let t = Instant::now();
        let c = procs::Cluster::start(spec, TOKEN, &stopped)?;
        let warmed = procs::warm(&c.spec.coordinator_addr(), TOKEN, size)?;
        eprintln!(
            "mount: cluster of 3 nodes up, {warmed} pages faulted in, in {:.1?}",
            t.elapsed()
        );
        for &(transport, flavor) in &mounts_needed {
            let name = pwmount::name(transport, flavor);
            let dir = work.join(format!("mnt-{name}"));
            std::fs::create_dir_all(&dir)?;
            let m = PwMount::start(
                &mount_bin,
                &c.spec.coordinator_addr(),
                &token_file,
                (transport, flavor),
                a.workers,
                &dir,
                &work.join(format!("mount-{name}.log")),
                size,
            )?;
            mounts.push(m);
        }
        cluster = Some(c);
    }
    if vias.contains(&Via::Zero) {
        let dir = work.join("mnt-zero");
        std::fs::create_dir_all(&dir)?;
        zero = Some(zerofs::ZeroMount::start(
            &dir,
            size,
            fuse_threads(a.workers),
        )?);
    }
    // The backing file into the page cache, then every mount read whole
    // once and compared with it.
    read_compare(&backing, &backing, "local")?;
    for m in &mounts {
        warm.push(read_compare(
            &m.file(),
            &backing,
            &format!("mount {}", m.name()),
        )?);
    }
    for w in &warm {
        eprintln!(
            "mount: warm pass {}: {} MiB in {:.2} s, {} wrong bytes",
            w.path,
            w.bytes >> 20,
            w.seconds,
            w.wrong_bytes
        );
    }

    let node_pids: Vec<u32> = cluster
        .as_ref()
        .map(|c: &procs::Cluster| {
            c.nodes
                .iter()
                .filter_map(|n| n.pid())
                .map(|p| p as u32)
                .collect()
        })
        .unwrap_or_default();
    let cells: Vec<(Job, Via)> = jobs
        .into_iter()
        .flat_map(|j| vias.iter().map(move |&v| (j, v)))
        .collect();
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); cells.len()];
    let total = cells.len() * a.runs;
    for r in 0..a.runs {
        for (i, &(job, via)) in cells.iter().enumerate() {
            if stopped() {
                bail!("interrupted");
            }
            let (file, fuse_pid) = match via {
                Via::Local | Via::LocalNoVerify => (backing.clone(), None),
                Via::Zero => (
                    zero.as_ref().context("zero FS")?.dir.join(zerofs::NAME),
                    Some(std::process::id()),
                ),
                _ => {
                    let m = mounts
                        .iter()
                        .find(|m| via.mount() == Some((m.transport, m.flavor)))
                        .context("mount")?;
                    (m.file(), Some(m.child.id()))
                }
            };
            let nodes = if via.mount().is_some() {
                &node_pids[..]
            } else {
                &[]
            };
            let s = measure(&a.fio, job, via, &file, size, a.seconds, fuse_pid, nodes)
                .with_context(|| format!("{} {} run {}", job.name(), via.key(), r + 1))?;
            eprintln!(
                "mount: [{}/{total}] {} {}: {:.0} IOPS, {:.1} MiB/s, p50 {:.1} µs, p99 {:.1} µs{}",
                r * cells.len() + i + 1,
                job.name(),
                via.key(),
                s.fio.iops,
                s.fio.bytes_per_sec / 1048576.0,
                s.fio.p50_us,
                s.fio.p99_us,
                if via.verify() {
                    format!(", {} wrong reads", s.fio.wrong_reads)
                } else {
                    String::new()
                }
            );
            samples[i].push(s);
        }
    }
    for m in &mut mounts {
        m.check_alive()?;
    }

    let rows: Vec<Row> = cells
        .iter()
        .zip(samples)
        .map(|(&(job, via), runs)| row(job, via, runs))
        .collect();
    let targets = targets(&rows, &warm);
    let params = serde_json::json!({
        "args": a,
        "engine": "psync (pread); queue depth 16 = numjobs=16, each job its own 1/16 of the file; no O_DIRECT (the mounts open the file with FOPEN_DIRECT_IO themselves, the local file is read through the page cache)",
        "verification": "crc32c header in every 4 KiB block, written by fio; verified rows check every block of every read inside the timed job (--verify=crc32c --verify_interval=4096 --continue_on_error=verify), wrong reads counted from fio's JSON and stderr; the *-noverify rows are the same reads unverified, the cost of verification",
        "cluster": "1 coordinator + 3 nodes on loopback, frames per node = the file's pages, warmed (coordinator Warm) and read whole through each mount before measuring",
        "mount": format!("pagewire-mount --transport shm|tcp --workers {} (direct I/O, max_read 1 MiB, read-ahead of sequential readers, checked before use; the mount-noahead rows: --no-read-ahead; the mount-cached rows: --cached 1, reads through the kernel page cache; {} FUSE threads running reads themselves)", a.workers, fuse_threads(a.workers)),
        "zero_fs": format!("fuser 0.18 in this process: same mount options and init as pagewire-mount, FOPEN_DIRECT_IO, {} FUSE threads with cloned fds (as many as the mount's); reads answered with zeros on the FUSE thread", fuse_threads(a.workers)),
        "fio_version": fio_version(&a.fio),
        "fio_example": Job::ALL.iter().map(|j| format!("{} {}", a.fio, j.args(Path::new("MOUNT/data"), size, a.seconds, true).join(" "))).collect::<Vec<_>>(),
        "warm": warm,
        "targets": targets,
    });
    let json = a.output.json;
    report::emit("mount", &a.output, &params, &rows, || table(&rows))?;
    if !json {
        for w in &warm {
            println!(
                "warm pass {}: {} MiB read whole in {:.2} s and compared with the backing file: {} wrong bytes",
                w.path,
                w.bytes >> 20,
                w.seconds,
                w.wrong_bytes
            );
        }
        println!("targets (from the medians above):");
        for t in &targets {
            let verdict = match t.met {
                Some(true) => "met",
                Some(false) => "MISSED",
                None => "not measured",
            };
            println!("  {verdict:>12}: {} — {}", t.target, t.detail);
        }
    }
    drop(zero);
    drop(mounts);
    drop(cluster);
    let wrong: u64 = rows.iter().filter_map(|r| r.wrong_reads).sum::<u64>()
        + warm.iter().map(|w| w.wrong_bytes).sum::<u64>();
    if wrong > 0 {
        bail!("wrong bytes were read (see the wrong column and the warm passes)");
    }
    Ok(())
}

/// fio, /dev/fuse and (unprivileged) fusermount3 are here.
fn preflight(fio: &str) -> anyhow::Result<()> {
    let mut missing = Vec::new();
    if Command::new(fio)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| !s.success())
        .unwrap_or(true)
    {
        missing.push(format!("{fio} (Debian package fio)"));
    }
    if !Path::new("/dev/fuse").exists() {
        missing.push("/dev/fuse (the fuse kernel module, or the device in the container)".into());
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let fusermount = Command::new("fusermount3")
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !root && !fusermount {
        missing.push("fusermount3 (Debian package fuse3)".into());
    }
    if !missing.is_empty() {
        bail!("pagewire-bench mount needs: {}", missing.join(", "));
    }
    Ok(())
}

/// The FUSE threads pagewire-mount starts for `--workers N` (N that run
/// reads, two spare); the zero file system gets as many, so the floor is
/// measured with the same threads.
fn fuse_threads(workers: u32) -> usize {
    workers as usize + 2
}

fn fio_version(fio: &str) -> String {
    Command::new(fio)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The programs of the cluster and pagewire-mount: from `bin_dir`, else
/// beside this executable (the cluster's falling back to this
/// executable's hidden commands).
fn programs(bin_dir: Option<&Path>) -> anyhow::Result<(Programs, PathBuf)> {
    let exe = std::env::current_exe().context("finding this executable")?;
    let dir = match bin_dir {
        Some(d) => d.to_owned(),
        None => exe.parent().context("this executable's folder")?.to_owned(),
    };
    let mount = dir.join("pagewire-mount");
    if !mount.exists() {
        bail!(
            "{} not found: build it beside pagewire-bench (cargo build --release -p pagewire-mount \
             -p pagewire-node -p pagewire-coordinator -p pagewire-bench) or name its folder with --bin-dir",
            mount.display()
        );
    }
    let programs = if bin_dir.is_some()
        || (dir.join("pagewire-node").exists() && dir.join("pagewire-coordinator").exists())
    {
        Programs::new(Some(&dir))?
    } else {
        Programs::new(None)?
    };
    Ok((programs, mount))
}

/// Reads `file` whole (1 MiB reads) and compares it with `backing`.
fn read_compare(file: &Path, backing: &Path, name: &str) -> anyhow::Result<WarmPass> {
    let t = Instant::now();
    let mut f = std::fs::File::open(file).with_context(|| format!("opening {}", file.display()))?;
    let mut b = std::fs::File::open(backing)?;
    let (mut x, mut y) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let (mut bytes, mut wrong) = (0u64, 0u64);
    loop {
        let n = read_full(&mut f, &mut x).with_context(|| format!("reading {}", file.display()))?;
        let m = read_full(&mut b, &mut y[..n.max(1)])?;
        if n == 0 {
            wrong += m as u64;
            break;
        }
        wrong += x[..n].iter().zip(&y[..m]).filter(|(p, q)| p != q).count() as u64
            + n.abs_diff(m) as u64;
        bytes += n as u64;
    }
    Ok(WarmPass {
        path: name.to_owned(),
        bytes,
        seconds: t.elapsed().as_secs_f64(),
        wrong_bytes: wrong,
    })
}

fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// CPU time of this process's reaped children, seconds.
fn children_cpu_s() -> f64 {
    // SAFETY: an all-zero rusage is a valid value to be overwritten.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the rusage we own.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// One measurement of `job` over `file`.
#[allow(clippy::too_many_arguments)]
fn measure(
    fio_bin: &str,
    job: Job,
    via: Via,
    file: &Path,
    size: u64,
    seconds: f64,
    fuse_pid: Option<u32>,
    node_pids: &[u32],
) -> anyhow::Result<Sample> {
    let cpu = |pid: u32| process_cpu_us(pid).unwrap_or(0.0) / 1e6;
    let nodes = || node_pids.iter().map(|&p| cpu(p)).sum::<f64>();
    let (fuse0, nodes0, fio0) = (fuse_pid.map(cpu), nodes(), children_cpu_s());
    let t = Instant::now();
    let args = job.args(file, size, seconds, via.verify());
    let (stdout, stderr) = run_fio(fio_bin, &args, Duration::from_secs_f64(seconds + 120.0))?;
    let wall = t.elapsed().as_secs_f64();
    let m = fio::parse(&stdout, &stderr).with_context(|| {
        format!(
            "fio {}\n{}",
            args.join(" "),
            stderr.lines().take(20).collect::<Vec<_>>().join("\n")
        )
    })?;
    Ok(Sample {
        fio: m,
        wall_s: wall,
        fio_cores: (children_cpu_s() - fio0) / wall,
        fuse_cores: fuse_pid.zip(fuse0).map(|(p, c0)| (cpu(p) - c0) / wall),
        node_cores: (!node_pids.is_empty()).then(|| (nodes() - nodes0) / wall),
    })
}

/// Runs fio with `args` in its own process group, killing the group after
/// `limit` or on ^C; its stdout and stderr. Fails when fio does.
fn run_fio(fio: &str, args: &[String], limit: Duration) -> anyhow::Result<(String, String)> {
    let mut child = Command::new(fio)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {fio}"))?;
    let pipe = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            String::from_utf8_lossy(&v).into_owned()
        })
    };
    let out = pipe(
        child
            .stdout
            .take()
            .map(|o| Box::new(o) as Box<dyn Read + Send>),
    );
    let err = pipe(
        child
            .stderr
            .take()
            .map(|e| Box::new(e) as Box<dyn Read + Send>),
    );
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        if stopped() || start.elapsed() > limit {
            // SAFETY: kill(2) of the process group fio leads (our child).
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let (stdout, stderr) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    match status {
        None if stopped() => bail!("interrupted"),
        None => bail!("fio {} ran past {limit:?}", args.join(" ")),
        Some(st) if !st.success() => bail!(
            "fio {} failed ({st}):\n{}",
            args.join(" "),
            stderr.lines().take(20).collect::<Vec<_>>().join("\n")
        ),
        Some(_) => Ok((stdout, stderr)),
    }
}
