//! `pagewire-bench readloop`: a read loop against a running cluster, for the
//! container scenarios (`k8s/compose/scenarios.py`) and for an operator who
//! wants to see a cluster serve.
//!
//! `--threads` clients read uniformly random pages (each at most
//! `--read-rate` per second) through [`ClusterClient`] (one-sided over
//! `--transport`, or the gRPC `Read`) and verify every byte against the
//! self-describing format ([`pagewire_node::pattern`]); `--writers` threads
//! write pages at `--write-rate` (each writer owns the pages
//! `p % writers == w`, so its generations of a page go up one by one), and a
//! read that returns an older generation than the one acknowledged before it
//! began is *stale*. A
//! prober client sweeps one page of every extent with a short deadline;
//! a sweep that read every extent is *clean*, and the first clean sweep
//! that started after an event is when every extent was served again.
//!
//! Every `--interval-ms` it prints one JSON line to stdout:
//! `{"tick": {"unix_ms", "ok", "err", "wrong", "stale", "wr", "wr_err",
//! "max_ms", "epoch", "sweeps": [[start_unix_ms, end_unix_ms], ...],
//! "samples": [...]}}` (the counts are of operations completed in the
//! interval; `samples` holds up to 3 error or mismatch messages), and at
//! the end one line `{"final": {...}}` with the totals. It stops after
//! `--seconds`, on SIGTERM or SIGINT, or (with `--until-eof`) when its
//! standard input closes; exit status 1 when any read was wrong or stale.

use std::io::Read as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use pagewire_client::cluster::{
    ClientConfig, ClusterClient, MapFollower, ReadPath, TransportChoice,
};
use pagewire_node::pattern;
use serde::Serialize;

#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// The coordinator(s), comma-separated host:port.
    #[arg(long, env = "PAGEWIRE_COORDINATOR")]
    pub coordinator: String,
    /// File holding the cluster token (else PAGEWIRE_TOKEN).
    #[arg(long, env = "PAGEWIRE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// One-sided transport: tcp, shm or auto.
    #[arg(long, default_value = "tcp")]
    pub transport: String,
    /// Read one-sidedly, or with the two-sided gRPC `Read`.
    #[arg(long, value_enum, default_value = "one-sided")]
    pub path: Path,
    /// Reading clients (one thread each).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Reads per second of each reading client (0: as fast as it can).
    #[arg(long, default_value_t = 0.0)]
    pub read_rate: f64,
    /// Writing clients (one thread each; 0: no writes, so no stale check).
    #[arg(long, default_value_t = 1)]
    pub writers: usize,
    /// Writes per second of each writer (0: as fast as they are acknowledged).
    #[arg(long, default_value_t = 50.0)]
    pub write_rate: f64,
    /// How long one read or write keeps retrying through a failover (ms);
    /// past it the operation counts as failed.
    #[arg(long, default_value_t = 10_000)]
    pub op_deadline_ms: u64,
    /// The prober's deadline per read (ms; 0: no prober).
    #[arg(long, default_value_t = 250)]
    pub probe_deadline_ms: u64,
    /// Length of one tick (ms).
    #[arg(long, default_value_t = 200)]
    pub interval_ms: u64,
    /// Stop after this many seconds (0: no limit).
    #[arg(long, default_value_t = 0.0)]
    pub seconds: f64,
    /// Stop when standard input reaches end of file.
    #[arg(long)]
    pub until_eof: bool,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Path {
    OneSided,
    Grpc,
}

static STOP: AtomicBool = AtomicBool::new(false);

fn stopped() -> bool {
    STOP.load(Ordering::Relaxed)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Counters shared by the threads; a tick takes and zeroes them.
#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    err: AtomicU64,
    wrong: AtomicU64,
    stale: AtomicU64,
    wr: AtomicU64,
    wr_err: AtomicU64,
    max_us: AtomicU64,
}

impl Counts {
    fn take(&self) -> [u64; 7] {
        [
            self.ok.swap(0, Ordering::Relaxed),
            self.err.swap(0, Ordering::Relaxed),
            self.wrong.swap(0, Ordering::Relaxed),
            self.stale.swap(0, Ordering::Relaxed),
            self.wr.swap(0, Ordering::Relaxed),
            self.wr_err.swap(0, Ordering::Relaxed),
            self.max_us.swap(0, Ordering::Relaxed),
        ]
    }
}

/// What every thread shares.
struct Shared {
    counts: Counts,
    /// The acknowledged generation of every page.
    acked: Vec<AtomicU64>,
    /// Error and mismatch messages of the current tick (at most 3).
    samples: Mutex<Vec<String>>,
    /// Clean sweeps of the current tick.
    sweeps: Mutex<Vec<(u64, u64)>>,
    totals: Mutex<Totals>,
}

#[derive(Default, Serialize)]
struct Totals {
    reads: u64,
    errors: u64,
    wrong: u64,
    stale: u64,
    writes: u64,
    write_errors: u64,
    clean_sweeps: u64,
    first_error: Option<String>,
    first_wrong: Option<String>,
    one_sided: u64,
    fault_ins: u64,
    grpc_reads: u64,
    retries: u64,
    reconnects: u64,
    map_refreshes: u64,
    validation_failures: u64,
}

impl Shared {
    fn sample(&self, msg: String, wrong: bool) {
        {
            let mut t = self.totals.lock().unwrap_or_else(|e| e.into_inner());
            let slot = if wrong {
                &mut t.first_wrong
            } else {
                &mut t.first_error
            };
            if slot.is_none() {
                *slot = Some(msg.clone());
            }
        }
        let mut s = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        if s.len() < 3 {
            s.push(msg);
        }
    }

    /// Checks a page read when `floor` was its acknowledged generation.
    fn check(&self, page: u64, buf: &[u8], floor: u64, what: &str) {
        match pattern::verify(page, buf) {
            Ok(g) if g >= floor => {
                self.counts.ok.fetch_add(1, Ordering::Relaxed);
            }
            Ok(g) => {
                self.counts.stale.fetch_add(1, Ordering::Relaxed);
                self.sample(
                    format!("{what}: stale page {page}: generation {g}, {floor} acknowledged before the read"),
                    true,
                );
            }
            Err(m) => {
                self.counts.wrong.fetch_add(1, Ordering::Relaxed);
                self.sample(format!("{what}: wrong page {page}: {m}"), true);
            }
        }
    }

    fn add_stats(&self, c: &ClusterClient) {
        let s = c.stats();
        let mut t = self.totals.lock().unwrap_or_else(|e| e.into_inner());
        t.one_sided += s.one_sided;
        t.fault_ins += s.fault_ins;
        t.grpc_reads += s.grpc_reads;
        t.retries += s.retries + s.reader.retries;
        t.reconnects += s.reconnects;
        t.map_refreshes += s.map_refreshes;
        t.validation_failures += s.reader.validation_failures;
    }
}

#[derive(Serialize)]
struct Tick {
    unix_ms: u64,
    ok: u64,
    err: u64,
    wrong: u64,
    stale: u64,
    wr: u64,
    wr_err: u64,
    max_ms: f64,
    epoch: u64,
    sweeps: Vec<(u64, u64)>,
    samples: Vec<String>,
}

/// Paces a loop at `rate` per second (0: no pacing); false when stopped.
struct Pace {
    gap: Option<Duration>,
    next: Instant,
}

impl Pace {
    fn new(rate: f64) -> Self {
        Self {
            gap: (rate > 0.0).then(|| Duration::from_secs_f64(1.0 / rate)),
            next: Instant::now(),
        }
    }

    /// Waits for the next slot (a late loop does not catch up by more than
    /// ten slots).
    fn wait(&mut self) -> bool {
        let Some(g) = self.gap else {
            return !stopped();
        };
        loop {
            if stopped() {
                return false;
            }
            let now = Instant::now();
            if self.next <= now {
                self.next = (self.next + g).max(now - g * 10);
                return true;
            }
            std::thread::sleep((self.next - now).min(Duration::from_millis(50)));
        }
    }
}

fn reader(sh: &Shared, c: &ClusterClient, rate: f64, seed: u64) {
    let pages = c.file_pages();
    let mut buf = vec![0u8; c.page_size()];
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut pace = Pace::new(rate);
    while pace.wait() {
        let p = rng.u64(..pages);
        let floor = sh.acked[p as usize].load(Ordering::Acquire);
        let t = Instant::now();
        match c.read_page(p, &mut buf) {
            Ok(_) => {
                let us = t.elapsed().as_micros() as u64;
                sh.counts.max_us.fetch_max(us, Ordering::Relaxed);
                let n = c.page_len(p);
                sh.check(p, &buf[..n], floor, "read");
            }
            Err(e) => {
                sh.counts.err.fetch_add(1, Ordering::Relaxed);
                sh.sample(format!("read of page {p}: {e}"), false);
            }
        }
    }
}

fn writer(sh: &Shared, c: &ClusterClient, w: u64, writers: u64, rate: f64, seed: u64) {
    let pages = c.file_pages();
    let mut buf = vec![0u8; c.page_size()];
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut pace = Pace::new(rate);
    while pace.wait() {
        let p0 = rng.u64(..pages);
        let p = p0 - p0 % writers + w;
        if p >= pages {
            continue;
        }
        let g = sh.acked[p as usize].load(Ordering::Acquire) + 1;
        let n = c.page_len(p);
        pattern::fill(p, g, &mut buf[..n]);
        match c.write_page(p, &buf[..n]) {
            Ok(_) => {
                sh.acked[p as usize].fetch_max(g, Ordering::AcqRel);
                sh.counts.wr.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                sh.counts.wr_err.fetch_add(1, Ordering::Relaxed);
                sh.sample(format!("write of page {p}: {e}"), false);
            }
        }
    }
}

/// Sweeps one page of every extent (another page each sweep); a sweep that
/// read them all is recorded with its start and end.
fn prober(sh: &Shared, c: ClusterClient) {
    let map = c.follower().map();
    let per_extent = (map.extent_size / u64::from(map.page_size).max(1)).max(1);
    let pages = c.file_pages();
    let extents = pages.div_ceil(per_extent);
    let mut buf = vec![0u8; c.page_size()];
    let mut k = 0u64;
    while !stopped() {
        let s = unix_ms();
        let mut clean = true;
        for e in 0..extents {
            let p = (e * per_extent + k.wrapping_mul(7919) % per_extent).min(pages - 1);
            let floor = sh.acked[p as usize].load(Ordering::Acquire);
            match c.read_page(p, &mut buf) {
                Ok(_) => {
                    let n = c.page_len(p);
                    sh.check(p, &buf[..n], floor, "probe");
                }
                Err(_) => {
                    clean = false;
                    break;
                }
            }
            if stopped() {
                clean = false;
                break;
            }
        }
        k += 1;
        if clean {
            sh.sweeps
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((s, unix_ms()));
            sh.totals
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clean_sweeps += 1;
        }
        std::thread::sleep(Duration::from_millis(if clean { 20 } else { 5 }));
    }
}

fn emit(out: &mut impl std::io::Write, v: &serde_json::Value) -> anyhow::Result<()> {
    serde_json::to_writer(&mut *out, v)?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(())
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let _ = ctrlc::set_handler(|| STOP.store(true, Ordering::Relaxed));
    let token = match &a.token_file {
        Some(f) => std::fs::read_to_string(f)
            .with_context(|| format!("reading {}", f.display()))?
            .trim()
            .to_owned(),
        None => std::env::var("PAGEWIRE_TOKEN")
            .context("no --token-file and no PAGEWIRE_TOKEN")?
            .trim()
            .to_owned(),
    };
    let transport = a
        .transport
        .parse::<TransportChoice>()
        .map_err(anyhow::Error::msg)?;
    let cfg = ClientConfig {
        transport,
        path: match a.path {
            Path::OneSided => ReadPath::OneSided,
            Path::Grpc => ReadPath::Grpc,
        },
        op_deadline: Duration::from_millis(a.op_deadline_ms),
        ..ClientConfig::default()
    };
    let follower = MapFollower::start(&a.coordinator, &token)
        .with_context(|| format!("following the map of {}", a.coordinator))?;
    // One client for the process's readers and writers, as a program
    // would have; the prober has its own (a shorter deadline).
    let client = Arc::new(ClusterClient::new(follower.clone(), &token, cfg.clone())?);
    let pages = client.file_pages();
    let sh = Arc::new(Shared {
        counts: Counts::default(),
        acked: (0..pages).map(|_| AtomicU64::new(0)).collect(),
        samples: Mutex::new(Vec::new()),
        sweeps: Mutex::new(Vec::new()),
        totals: Mutex::new(Totals::default()),
    });
    let mut threads = Vec::new();
    for i in 0..a.threads.max(1) {
        let c = client.clone();
        let (sh, seed, rate) = (sh.clone(), a.seed ^ ((i as u64 + 1) << 40), a.read_rate);
        threads.push(std::thread::spawn(move || reader(&sh, &c, rate, seed)));
    }
    for w in 0..a.writers {
        let c = client.clone();
        let (sh, seed) = (sh.clone(), a.seed ^ 0x5752 ^ ((w as u64 + 1) << 48));
        let (n, rate) = (a.writers as u64, a.write_rate);
        threads.push(std::thread::spawn(move || {
            writer(&sh, &c, w as u64, n, rate, seed)
        }));
    }
    if a.probe_deadline_ms > 0 {
        let pcfg = ClientConfig {
            op_deadline: Duration::from_millis(a.probe_deadline_ms),
            ..cfg.clone()
        };
        let c = ClusterClient::new(follower.clone(), &token, pcfg)?;
        let sh = sh.clone();
        threads.push(std::thread::spawn(move || prober(&sh, c)));
    }
    if a.until_eof {
        std::thread::spawn(|| {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            STOP.store(true, Ordering::Relaxed);
        });
    }

    let mut out = std::io::stdout().lock();
    let t0 = Instant::now();
    let interval = Duration::from_millis(a.interval_ms.max(10));
    let mut next = t0 + interval;
    let tick = |sh: &Shared| -> Tick {
        let [ok, err, wrong, stale, wr, wr_err, max_us] = sh.counts.take();
        {
            let mut t = sh.totals.lock().unwrap_or_else(|e| e.into_inner());
            t.reads += ok + wrong + stale;
            t.errors += err;
            t.wrong += wrong;
            t.stale += stale;
            t.writes += wr;
            t.write_errors += wr_err;
        }
        Tick {
            unix_ms: unix_ms(),
            ok,
            err,
            wrong,
            stale,
            wr,
            wr_err,
            max_ms: max_us as f64 / 1000.0,
            epoch: follower.epoch(),
            sweeps: std::mem::take(&mut *sh.sweeps.lock().unwrap_or_else(|e| e.into_inner())),
            samples: std::mem::take(&mut *sh.samples.lock().unwrap_or_else(|e| e.into_inner())),
        }
    };
    loop {
        if a.seconds > 0.0 && t0.elapsed().as_secs_f64() >= a.seconds {
            STOP.store(true, Ordering::Relaxed);
        }
        if stopped() {
            break;
        }
        let now = Instant::now();
        if now < next {
            std::thread::sleep((next - now).min(Duration::from_millis(50)));
            continue;
        }
        while next <= now {
            next += interval;
        }
        emit(&mut out, &serde_json::json!({ "tick": tick(&sh) }))?;
    }
    for t in threads {
        let _ = t.join();
    }
    sh.add_stats(&client);
    emit(&mut out, &serde_json::json!({ "tick": tick(&sh) }))?;
    let t = std::mem::take(&mut *sh.totals.lock().unwrap_or_else(|e| e.into_inner()));
    let bad = t.wrong + t.stale;
    let mut fin = serde_json::to_value(&t)?;
    fin["secs"] = t0.elapsed().as_secs_f64().into();
    emit(&mut out, &serde_json::json!({ "final": fin }))?;
    if bad > 0 {
        anyhow::bail!("{} wrong and {} stale reads", t.wrong, t.stale);
    }
    Ok(())
}
