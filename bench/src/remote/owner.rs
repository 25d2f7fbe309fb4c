//! The bench's own owner process: a page cache whose region lives in `shm`
//! memory, the same memory registered with a `tcp` responder
//! (`register_external`), the whole file preloaded.
//!
//! It stands in for the node daemon until the daemon serves its region over
//! `shm` and `tcp` itself: a separate process, so that the CPU it spends per
//! one-sided read can be measured from outside. The parent starts it as
//! `pagewire-bench remote-owner ...`, reads one JSON line of descriptors from
//! its stdout, and ends it by closing its stdin.

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use pagewire_node::index::Lockless;
use pagewire_node::{CacheConfig, PageCache};
use pagewire_rdma::shm::ShmOwner;
use pagewire_rdma::tcp::{OwnerConfig, SpinStats, TcpOwner};
use pagewire_rdma::{LocalRegion, MemoryOwner, RegionDescriptor};
use serde::{Deserialize, Serialize};

/// Name of the `shm` owner inside its directory.
const SHM_NAME: &str = "owner";

/// The line that asks the owner process for its responder's polling
/// counters (it answers one JSON [`SpinStats`] line).
const SPIN_STATS: &str = "spin-stats";

/// `spin-us N`: the owner's responder polls for N µs from now on (answered
/// like [`SPIN_STATS`]).
const SET_SPIN: &str = "spin-us ";

/// Options of the hidden `remote-owner` subcommand.
#[derive(clap::Args, Debug, Clone)]
pub struct OwnerArgs {
    /// The self-describing file to cache.
    #[arg(long)]
    pub file: PathBuf,
    /// Directory for the `shm` owner's files (a tmpfs such as /dev/shm).
    #[arg(long)]
    pub shm_dir: PathBuf,
    /// Frames in the cache.
    #[arg(long)]
    pub frames: usize,
    /// File holding the `tcp` token.
    #[arg(long)]
    pub token_file: PathBuf,
    /// Adaptive polling of the `tcp` responder, microseconds.
    #[arg(long)]
    pub spin_us: u64,
}

/// What the owner prints once it serves (one JSON line).
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct Served {
    pub pid: u32,
    pub shm_dir: PathBuf,
    pub shm_name: String,
    pub shm: RegionDescriptor,
    pub tcp_addr: SocketAddr,
    pub tcp: RegionDescriptor,
    pub pages: u64,
    pub preloaded: u64,
}

/// The owner process's main: set up, preload, print [`Served`], then serve
/// until stdin closes.
///
/// # Errors
/// Any set-up step failed.
pub fn serve(a: &OwnerArgs) -> anyhow::Result<()> {
    let token = std::fs::read(&a.token_file).context("token file")?;
    let epoch = fastrand::u64(1..);
    let owner = ShmOwner::create_in_with_epoch(&a.shm_dir, SHM_NAME, epoch)?;
    let region = owner.register(PageCache::<Lockless>::region_len(4096, a.frames))?;
    let shm = region.descriptor();
    let cache = Arc::new(PageCache::<Lockless>::open_on(
        &a.file,
        CacheConfig {
            frames: a.frames,
            ..CacheConfig::default()
        },
        Some(Box::new(region)),
    )?);
    cache.set_epoch(epoch);
    let mut config = OwnerConfig::new(token);
    config.epoch = Some(epoch);
    config.spin = Duration::from_micros(a.spin_us);
    let responder = TcpOwner::bind((Ipv4Addr::LOCALHOST, 0), config)?;
    let view = cache.region();
    let keep: MemoryOwner = Arc::clone(&cache) as MemoryOwner;
    // SAFETY:
    // * `view` is the cache's whole region, which the cache keeps mapped for
    //   its lifetime; `keep` holds the cache, so the memory outlives the
    //   registration.
    // * The cache writes its region only with atomic word stores (frames are
    //   filled through raw spans of atomics, headers and buckets are
    //   atomics), and hands out no `&mut` to it.
    let tcp_region = unsafe {
        responder.register_external(
            NonNull::new(view.addr.cast_mut()).context("null region")?,
            view.len,
            keep,
        )
    }?;
    let preloaded = cache.preload(0, cache.pages())?;
    let served = Served {
        pid: std::process::id(),
        shm_dir: a.shm_dir.clone(),
        shm_name: SHM_NAME.into(),
        shm,
        tcp_addr: responder.local_addr(),
        tcp: tcp_region.descriptor(),
        pages: cache.pages(),
        preloaded,
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&served)?)?;
    out.flush()?;
    drop(out);
    // Serve until the parent closes our stdin (or dies), answering each
    // `spin-stats` line with the responder's polling counters.
    let mut line = String::new();
    let mut stdin = std::io::stdin().lock();
    loop {
        line.clear();
        match stdin.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let line = line.trim();
        if let Some(us) = line.strip_prefix(SET_SPIN) {
            let us: u64 = us.trim().parse().context("spin-us from the parent")?;
            responder.set_spin(Duration::from_micros(us));
        } else if line != SPIN_STATS {
            continue;
        }
        // Every command is answered with the counters as they are now.
        let (_, responder) = pagewire_rdma::tcp::spin_stats();
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", serde_json::to_string(&responder)?)?;
        out.flush()?;
    }
    drop(tcp_region);
    drop(responder);
    drop(cache);
    drop(owner);
    Ok(())
}

/// The parent's handle on a running owner process; ends it on drop.
pub struct OwnerProcess {
    child: Child,
    pipe: Arc<std::sync::Mutex<Pipe>>,
    pub served: Served,
}

/// The owner's stdin and stdout: closing stdin ends it.
pub struct Pipe {
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

/// Asks a running owner process for its responder's polling counters.
#[derive(Clone)]
pub struct SpinProbe(Arc<std::sync::Mutex<Pipe>>);

impl SpinProbe {
    /// The owner's [`SpinStats`] now, or `None` if it does not answer.
    pub fn read(&self) -> Option<SpinStats> {
        self.command(SPIN_STATS)
    }

    /// Sets the owner's responder spin (every serving thread takes it up at
    /// its next request).
    pub fn set_spin_us(&self, us: u64) -> anyhow::Result<()> {
        self.command(&format!("{SET_SPIN}{us}"))
            .map(drop)
            .context("the owner process did not take the new spin")
    }

    fn command(&self, cmd: &str) -> Option<SpinStats> {
        let mut p = self.0.lock().ok()?;
        let stdin = p.stdin.as_mut()?;
        writeln!(stdin, "{cmd}").ok()?;
        stdin.flush().ok()?;
        let mut line = String::new();
        p.stdout.read_line(&mut line).ok()?;
        serde_json::from_str(line.trim()).ok()
    }
}

impl OwnerProcess {
    /// Starts `exe remote-owner` over `file` and waits until it serves.
    pub fn start(
        exe: &Path,
        file: &Path,
        shm_dir: &Path,
        frames: usize,
        token_file: &Path,
        spin_us: u64,
    ) -> anyhow::Result<Self> {
        let mut child = Command::new(exe)
            .arg("remote-owner")
            .arg("--file")
            .arg(file)
            .arg("--shm-dir")
            .arg(shm_dir)
            .arg("--frames")
            .arg(frames.to_string())
            .arg("--token-file")
            .arg(token_file)
            .arg("--spin-us")
            .arg(spin_us.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the owner process")?;
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().context("owner stdout")?);
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .context("reading the owner's descriptors")?;
        if line.trim().is_empty() {
            let status = child.wait()?;
            bail!("the owner process exited before serving ({status})");
        }
        let served: Served = serde_json::from_str(line.trim()).context("owner's descriptors")?;
        Ok(Self {
            child,
            pipe: Arc::new(std::sync::Mutex::new(Pipe { stdin, stdout })),
            served,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A handle that reads the owner's polling counters.
    pub fn spin_probe(&self) -> SpinProbe {
        SpinProbe(Arc::clone(&self.pipe))
    }
}

impl Drop for OwnerProcess {
    fn drop(&mut self) {
        if let Ok(mut p) = self.pipe.lock() {
            drop(p.stdin.take());
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// User + system CPU time of process `pid` so far, µs: fields 14 and 15 of
/// `/proc/PID/stat`, the same per-process total `getrusage(RUSAGE_SELF)`
/// gives inside it (threads that exited included), in clock ticks.
pub fn process_cpu_us(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; fields count from after its ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state): utime is field 14, stime 15.
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) * 1e6 / clock_ticks())
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`).
pub fn clock_ticks() -> f64 {
    // SAFETY: sysconf with a valid name has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}
