//! One reader process of the storm (`pagewire-bench storm-reader`, started
//! by `storm`; not for direct use).
//!
//! It waits for the common start instant, then runs one client for the
//! phase's duration on one path, verifying every page it reads: its bytes
//! against the self-describing format, and its generation against the
//! generation acknowledged for that page before the read began (a shared
//! file of one u64 per page that the writers publish to, so a stale read is
//! caught, not only a torn one). Every `--interval-ms` it prints one JSON
//! line of counts to stdout; at the end one line `{"final": …}` with the
//! totals and the latency histogram.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use pagewire_client::cluster::{
    ClientConfig, ClusterClient, MapFollower, ReadPath, TransportChoice, Via,
};
use pagewire_node::pattern;
use serde::{Deserialize, Serialize};

use super::workload::{Chooser, Shape, Workload};
use crate::remote::clients;

/// How a reader reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Path {
    /// One-sided READs from the owner's region (FaultIn on a miss).
    OneSided,
    /// The two-sided gRPC `Read` on the owner.
    Grpc,
    /// Redis GET of the same 4 KiB values.
    Redis,
    /// `pread` of the backing file (Linux's page cache): the floor.
    Pread,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::OneSided => "one-sided",
            Path::Grpc => "grpc",
            Path::Redis => "redis",
            Path::Pread => "pread",
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct ReaderArgs {
    #[arg(long)]
    pub id: u64,
    #[arg(long)]
    pub clients: u64,
    #[arg(long, value_enum)]
    pub path: Path,
    #[arg(long, default_value = "")]
    pub coordinator: String,
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// auto, shm or tcp.
    #[arg(long, default_value = "auto")]
    pub transport: String,
    #[arg(long, value_enum)]
    pub workload: Workload,
    #[arg(long)]
    pub pages: u64,
    #[arg(long, default_value_t = 0.99)]
    pub theta: f64,
    #[arg(long, default_value_t = 64)]
    pub hot_pages: u64,
    #[arg(long, default_value_t = 64)]
    pub touch_run: u64,
    /// Fraction of operations that write a page (pagewire paths only).
    #[arg(long, default_value_t = 0.0)]
    pub writer_fraction: f64,
    /// The backing file (pread path).
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Redis `host:port` (redis path).
    #[arg(long)]
    pub redis: Option<String>,
    /// The acknowledged-generation file (one u64 per page).
    #[arg(long)]
    pub acked: PathBuf,
    #[arg(long)]
    pub start_unix_ms: u64,
    #[arg(long)]
    pub duration_ms: u64,
    #[arg(long, default_value_t = 200)]
    pub interval_ms: u64,
    /// How long one pagewire read keeps retrying through a failover.
    #[arg(long, default_value_t = 3000)]
    pub op_deadline_ms: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Serve this reader's client metrics on `GET /metrics` at host:port
    /// (one-sided and grpc paths only).
    #[arg(long)]
    pub metrics_listen: Option<String>,
}

/// One interval's counts (one JSON line).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Tick {
    /// The interval boundary this tick closes, in ms since the common start
    /// instant: the counts are of operations completed before it (and the
    /// one that crossed it). A tick is printed after the operation that
    /// crosses a boundary, so stamping the print time would shift a late
    /// print into the next interval.
    pub t_ms: u64,
    /// Pages read and verified.
    pub ok: u64,
    /// Operations that failed (unavailable past the deadline).
    pub err: u64,
    /// Pages written (acknowledged).
    pub wr: u64,
}

/// A reader's totals (the last JSON line).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Final {
    pub path: Option<Path>,
    pub reads: u64,
    pub writes: u64,
    pub wrong: u64,
    pub stale: u64,
    pub errors: u64,
    pub write_errors: u64,
    /// Writes not issued because the writer thread was still blocked on
    /// earlier ones (a fenced extent); the reads went on.
    pub writes_dropped: u64,
    /// Latency of each acknowledged write: `(ns, count)` pairs.
    pub write_hist: Vec<(u64, u64)>,
    pub one_sided: u64,
    /// Of `one_sided`, over shm, verbs and tcp.
    #[serde(default)]
    pub one_sided_shm: u64,
    #[serde(default)]
    pub one_sided_verbs: u64,
    #[serde(default)]
    pub one_sided_tcp: u64,
    pub fallbacks: u64,
    pub retries: u64,
    pub validation_failures: u64,
    pub reconnects: u64,
    pub map_refreshes: u64,
    pub secs: f64,
    /// Latency of each read operation: `(ns, count)` pairs.
    pub hist: Vec<(u64, u64)>,
    /// One-sided path: of `hist`, the operations whose every page was a
    /// one-sided hit, and those with at least one page faulted in on its
    /// owner (a miss).
    #[serde(default)]
    pub hit_hist: Vec<(u64, u64)>,
    #[serde(default)]
    pub miss_hist: Vec<(u64, u64)>,
    pub first_error: Option<String>,
    pub first_wrong: Option<String>,
}

#[derive(Serialize, Deserialize)]
pub enum Line {
    #[serde(rename = "tick")]
    Tick(Tick),
    #[serde(rename = "final")]
    Final(Box<Final>),
}

/// The acknowledged generation of every page, shared by the processes.
pub struct Acked {
    map: memmap2::MmapMut,
}

impl Acked {
    pub fn create(path: &std::path::Path, pages: u64) -> anyhow::Result<()> {
        let f = std::fs::File::create(path)?;
        f.set_len(pages * 8)?;
        Ok(())
    }

    pub fn open(path: &std::path::Path, pages: u64) -> anyhow::Result<Self> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        if f.metadata()?.len() != pages * 8 {
            bail!("{} is not {} pages long", path.display(), pages);
        }
        // SAFETY: the file is only ever accessed through this mapping's
        // atomics (here and in the other storm processes), never truncated
        // while mapped.
        let map = unsafe { memmap2::MmapMut::map_mut(&f)? };
        Ok(Self { map })
    }

    fn words(&self) -> &[AtomicU64] {
        let n = self.map.len() / 8;
        // SAFETY: the mapping is page-aligned (so 8-aligned), `n * 8` bytes
        // long, lives as long as `self`, and AtomicU64 has u64's layout;
        // every access to the file is atomic.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().cast::<AtomicU64>(), n) }
    }

    pub fn get(&self, page: u64) -> u64 {
        self.words()[page as usize].load(Ordering::Acquire)
    }

    fn set(&self, page: u64, g: u64) {
        self.words()[page as usize].fetch_max(g, Ordering::AcqRel);
    }
}

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What the writer thread hands back: failed writes, the first error, the
/// latency of the acknowledged ones.
type WriterEnd = (u64, Option<String>, Histogram<u64>);

/// The writer thread of a reader process: writes the pages the reader hands
/// it, so that a write held up (an extent that just moved is fenced for a
/// lease) does not stall the process's reads.
struct Writer {
    tx: Option<std::sync::mpsc::SyncSender<u64>>,
    writes: std::sync::Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<WriterEnd>>,
}

impl Writer {
    fn start(
        c: std::sync::Arc<ClusterClient>,
        acked: std::sync::Arc<Acked>,
    ) -> anyhow::Result<Self> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<u64>(8);
        let writes = std::sync::Arc::new(AtomicU64::new(0));
        let w = writes.clone();
        let mut hist = Histogram::<u64>::new_with_bounds(100, 120_000_000_000, 3)?;
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; c.page_size()];
            let (mut errors, mut first) = (0u64, None);
            for p in rx {
                // Only this process writes `p` (p % clients == id), so its
                // generations come in order.
                let g = acked.get(p) + 1;
                pattern::fill(p, g, &mut buf);
                let t = Instant::now();
                match c.write_page(p, &buf) {
                    Ok(_) => {
                        let _ = hist
                            .record((t.elapsed().as_nanos() as u64).clamp(100, 120_000_000_000));
                        acked.set(p, g);
                        w.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        errors += 1;
                        first.get_or_insert_with(|| format!("write of page {p}: {e}"));
                    }
                }
            }
            (errors, first, hist)
        });
        Ok(Self {
            tx: Some(tx),
            writes,
            thread: Some(thread),
        })
    }

    /// Hands `p` to the writer; false when it is still busy.
    fn offer(&self, p: u64) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.try_send(p).is_ok())
    }

    fn finish(&mut self) -> (u64, Option<String>, Option<Histogram<u64>>) {
        self.tx = None;
        match self.thread.take().map(|t| t.join()) {
            Some(Ok((e, f, h))) => (e, f, Some(h)),
            Some(Err(_)) => (1, Some("the writer thread panicked".into()), None),
            None => (0, None, None),
        }
    }
}

/// The client of one path.
enum Io {
    /// The process's one client, shared with its writer thread.
    Cluster(std::sync::Arc<ClusterClient>),
    Redis(Box<clients::Redis>),
    Pread(std::fs::File, u64),
}

struct State {
    fin: Final,
    hist: Histogram<u64>,
    /// Operations of the one-sided path, hits only and with a miss.
    hit_hist: Histogram<u64>,
    miss_hist: Histogram<u64>,
    /// Whether the operation being timed faulted a page in.
    missed: bool,
    tick: Tick,
}

impl State {
    fn error(&mut self, e: impl std::fmt::Display) {
        self.fin.errors += 1;
        self.tick.err += 1;
        if self.fin.first_error.is_none() {
            self.fin.first_error = Some(e.to_string());
        }
    }

    /// Checks a page read after `floor` was the acknowledged generation.
    fn check(&mut self, page: u64, buf: &[u8], floor: u64) {
        self.fin.reads += 1;
        self.tick.ok += 1;
        match pattern::verify(page, buf) {
            Ok(g) if g >= floor => {}
            Ok(g) => {
                self.fin.stale += 1;
                if self.fin.first_wrong.is_none() {
                    self.fin.first_wrong = Some(format!(
                        "page {page}: generation {g}, but {floor} was acknowledged before the read"
                    ));
                }
            }
            Err(m) => {
                self.fin.wrong += 1;
                if self.fin.first_wrong.is_none() {
                    self.fin.first_wrong = Some(m.to_string());
                }
            }
        }
    }
}

/// The cluster client's settings of a bench reader or writer process:
/// one-sided over `transport` (shm, tcp, auto, verbs) or gRPC `Read`, and
/// how long one operation retries through failover.
pub(crate) fn client_config(
    transport: &str,
    grpc: bool,
    op_deadline_ms: u64,
) -> anyhow::Result<ClientConfig> {
    Ok(ClientConfig {
        transport: transport
            .parse::<TransportChoice>()
            .map_err(anyhow::Error::msg)?,
        path: if grpc {
            ReadPath::Grpc
        } else {
            ReadPath::OneSided
        },
        op_deadline: Duration::from_millis(op_deadline_ms),
        ..ClientConfig::default()
    })
}

fn emit(out: &mut impl Write, line: &Line) -> anyhow::Result<()> {
    serde_json::to_writer(&mut *out, line)?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(())
}

pub fn run(a: &ReaderArgs) -> anyhow::Result<()> {
    let shape = Shape {
        workload: a.workload,
        pages: a.pages,
        theta: a.theta,
        hot_pages: a.hot_pages,
        touch_run: a.touch_run,
    };
    let mut chooser = Chooser::new(shape, a.id, a.clients, a.seed)?;
    let acked = std::sync::Arc::new(Acked::open(&a.acked, a.pages)?);
    let mut writer = None;
    // Kept until the reader returns: the endpoint serves for the whole phase.
    let mut _metrics = None;
    let token = match &a.token_file {
        Some(f) => std::fs::read_to_string(f)
            .with_context(|| format!("reading {}", f.display()))?
            .trim()
            .to_owned(),
        None => String::new(),
    };
    let mut io = match a.path {
        Path::OneSided | Path::Grpc => {
            let follower = MapFollower::start(&a.coordinator, &token)
                .with_context(|| format!("following the map of {}", a.coordinator))?;
            let cfg = client_config(&a.transport, a.path == Path::Grpc, a.op_deadline_ms)?;
            let c = std::sync::Arc::new(ClusterClient::new(follower, &token, cfg)?);
            if let Some(addr) = &a.metrics_listen {
                _metrics = Some(crate::client_metrics::serve(addr, c.clone())?);
            }
            if a.writer_fraction > 0.0 {
                writer = Some(Writer::start(c.clone(), acked.clone())?);
            }
            Io::Cluster(c)
        }
        Path::Redis | Path::Pread if a.metrics_listen.is_some() => {
            bail!(
                "--metrics-listen: the {} path has no pagewire client",
                a.path.name()
            );
        }
        Path::Redis => {
            let addr = a.redis.as_deref().context("--redis is required")?;
            Io::Redis(Box::new(clients::Redis::connect_to(addr)?))
        }
        Path::Pread => {
            let f = a.file.as_ref().context("--file is required")?;
            let file =
                std::fs::File::open(f).with_context(|| format!("opening {}", f.display()))?;
            let len = file.metadata()?.len();
            Io::Pread(file, len)
        }
    };
    let mut st = State {
        fin: Final {
            path: Some(a.path),
            ..Final::default()
        },
        hist: Histogram::new_with_bounds(100, 120_000_000_000, 3)?,
        hit_hist: Histogram::new_with_bounds(100, 120_000_000_000, 3)?,
        miss_hist: Histogram::new_with_bounds(100, 120_000_000_000, 3)?,
        missed: false,
        tick: Tick::default(),
    };
    let mut buf = vec![0u8; clients::PAGE];
    let mut run_buf = Vec::new();
    let mut wrng = fastrand::Rng::with_seed(a.seed ^ (a.id << 32) ^ 0x5752);
    let mut stdout = std::io::stdout().lock();

    // The common start instant, then the phase.
    let start_ms = a.start_unix_ms;
    let now = now_unix_ms();
    if start_ms > now {
        std::thread::sleep(Duration::from_millis(start_ms - now));
    }
    let t0 = Instant::now();
    let end = t0 + Duration::from_millis(a.duration_ms);
    let interval = Duration::from_millis(a.interval_ms.max(10));
    let mut next_tick = t0 + interval;
    while Instant::now() < end {
        let (first, run) = chooser.next();
        if a.writer_fraction > 0.0 && wrng.f64() < a.writer_fraction {
            if let Some(w) = &writer {
                // This client writes only pages `p` with p % clients == id.
                let p = first - first % a.clients + a.id;
                if p < a.pages && !w.offer(p) {
                    st.fin.writes_dropped += 1;
                }
            }
        } else {
            let t = Instant::now();
            let mut ok = true;
            if let Io::Cluster(c) = &io {
                // The run in one read (one doorbell per batch of pages), each
                // page checked against what was acknowledged before it.
                let floors: Vec<u64> = (first..first + run).map(|p| acked.get(p)).collect();
                let need = run as usize * clients::PAGE;
                if run_buf.len() < need {
                    run_buf.resize(need, 0);
                }
                match c.read_run(first, run as usize, &mut run_buf[..need]) {
                    Ok(info) => {
                        st.missed = info.pages.iter().any(|p| p.via == Via::FaultIn);
                        for (k, floor) in floors.into_iter().enumerate() {
                            let page = &run_buf[k * clients::PAGE..(k + 1) * clients::PAGE];
                            // page-touch: the byte a page_fault4 loop touches.
                            std::hint::black_box(page[0]);
                            st.check(first + k as u64, page, floor);
                        }
                    }
                    Err(e) => {
                        ok = false;
                        st.error(format!("pages {first}..+{run}: {e:#}"));
                    }
                }
            }
            let per_page = if matches!(io, Io::Cluster(_)) { 0 } else { run };
            for p in first..first + per_page {
                let floor = acked.get(p);
                let r: anyhow::Result<()> = match &mut io {
                    Io::Cluster(_) => unreachable!("read as a run above"),
                    Io::Redis(r) => r.get(p, &mut buf),
                    Io::Pread(f, len) => {
                        let off = p * buf.len() as u64;
                        let n = (*len - off).min(buf.len() as u64) as usize;
                        buf[n..].fill(0);
                        f.read_exact_at(&mut buf[..n], off).map_err(Into::into)
                    }
                };
                match r {
                    Ok(()) => {
                        // page-touch: the byte a page_fault4 loop touches.
                        std::hint::black_box(buf[0]);
                        st.check(p, &buf, floor);
                    }
                    Err(e) => {
                        ok = false;
                        st.error(format!("page {p}: {e:#}"));
                        break;
                    }
                }
            }
            if ok {
                let ns = t.elapsed().as_nanos().clamp(100, 120_000_000_000) as u64;
                let _ = st.hist.record(ns);
                if matches!(io, Io::Cluster(_)) && a.path == Path::OneSided {
                    let h = if st.missed {
                        &mut st.miss_hist
                    } else {
                        &mut st.hit_hist
                    };
                    let _ = h.record(ns);
                }
            }
        }
        let now = Instant::now();
        if now >= next_tick {
            let iv = interval.as_millis() as u64;
            st.tick.t_ms = (now - t0).as_millis() as u64 / iv * iv;
            if let Some(w) = &writer {
                let n = w.writes.load(Ordering::Relaxed);
                st.tick.wr = n - st.fin.writes;
                st.fin.writes = n;
            }
            emit(&mut stdout, &Line::Tick(st.tick))?;
            st.tick = Tick::default();
            while next_tick <= now {
                next_tick += interval;
            }
        }
    }
    st.fin.secs = t0.elapsed().as_secs_f64();
    if let Some(w) = &mut writer {
        // Writes still in flight finish (bounded by the op deadline).
        let (errors, first, hist) = w.finish();
        let n = w.writes.load(Ordering::Relaxed);
        st.tick.wr = n - st.fin.writes;
        st.fin.writes = n;
        st.fin.write_errors = errors;
        if st.fin.first_error.is_none() {
            st.fin.first_error = first;
        }
        if let Some(h) = hist {
            st.fin.write_hist = h
                .iter_recorded()
                .map(|v| (v.value_iterated_to(), v.count_at_value()))
                .collect();
        }
    }
    st.tick.t_ms = t0.elapsed().as_millis() as u64;
    emit(&mut stdout, &Line::Tick(st.tick))?;
    if let Io::Cluster(c) = &io {
        let s = c.stats();
        st.fin.one_sided = s.one_sided;
        st.fin.one_sided_shm = s.one_sided_shm;
        st.fin.one_sided_verbs = s.one_sided_verbs;
        st.fin.one_sided_tcp = s.one_sided_tcp;
        st.fin.fallbacks = s.fault_ins;
        st.fin.retries = s.retries + s.reader.retries;
        st.fin.validation_failures = s.reader.validation_failures;
        st.fin.reconnects = s.reconnects;
        st.fin.map_refreshes = s.map_refreshes;
    }
    let pairs = |h: &Histogram<u64>| {
        h.iter_recorded()
            .map(|v| (v.value_iterated_to(), v.count_at_value()))
            .collect()
    };
    st.fin.hist = pairs(&st.hist);
    st.fin.hit_hist = pairs(&st.hit_hist);
    st.fin.miss_hist = pairs(&st.miss_hist);
    emit(&mut stdout, &Line::Final(Box::new(st.fin)))?;
    Ok(())
}
