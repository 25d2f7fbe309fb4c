//! `pagewire-bench transport`: 4 KiB READ latency and throughput of the
//! `shm` and `tcp` transports, side by side in one run with their floors (a
//! raw TCP ping-pong of the same sizes for `tcp`, a 4 KiB `memcpy` for `shm`)
//! and with what users would otherwise pick (Redis GET of 4 KiB values,
//! pipelined for batches).
//!
//! Every row reads random 4 KiB pages of one region (`--region-mib`); each
//! page starts with its page number, which every transport's reader checks
//! (a wrong page fails the run). Latency is per READ: from the post of its
//! batch to its completion, one clock read per completion. Each row runs
//! `--runs` times for `--seconds`; the table shows medians over the runs.
//!
//! `tcp` runs with adaptive polling (responder and reader spin on their
//! sockets for `--spin-us` before blocking), `tcp_nospin` with spin 0 (both
//! block at once), side by side, so the latency a spin buys and the CPU it
//! costs are visible together.
//!
//! CPU per READ is this process's user + system CPU time (`getrusage`,
//! `RUSAGE_SELF`) over the measurement, divided by the READs completed. It
//! counts every thread of this process: for `tcp`/`tcp_nospin` and
//! `raw_tcp` on loopback that is the readers **and** the responder (server)
//! threads, both sides of the transport; for `shm` and `memcpy` the readers
//! alone (there is no other side); for `redis` only the clients, since
//! `redis-server` is another process.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use pagewire_rdma::shm::{ShmConfig, ShmConnection, ShmOwner};
use pagewire_rdma::tcp::{ConnectionConfig, OwnerConfig, TcpConnection, TcpOwner};
use pagewire_rdma::{Completion, Connection, LocalRegion, ReadRequest, RegionDescriptor};
use serde::Serialize;

const PAGE: usize = 4096;
const TOKEN: &[u8] = b"pagewire-bench transport token";

/// Options of `pagewire-bench transport`.
#[derive(clap::Args, Debug, Clone)]
pub struct TransportArgs {
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Smoke run: 0.2 s per measurement, one run, an 8 MiB region.
    #[arg(long)]
    pub quick: bool,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Runs per row (the table shows medians).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Size of the region the pages are read from, MiB.
    #[arg(long, default_value_t = 64)]
    pub region_mib: usize,
    /// Concurrent readers, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub clients: Vec<usize>,
    /// READs per batch (one doorbell; a Redis pipeline), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub batch: Vec<usize>,
    /// Transports to run, comma-separated: shm, tcp, tcp_nospin (tcp with
    /// spin 0 on both sides), raw_tcp, memcpy, redis.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "shm,memcpy,tcp,tcp_nospin,raw_tcp,redis"
    )]
    pub transports: Vec<String>,
    /// Adaptive polling of the `tcp` rows: how long the responder and the
    /// reader spin on their sockets before blocking, microseconds.
    #[arg(long, default_value_t = 50)]
    pub spin_us: u64,
    /// The redis-server binary.
    #[arg(long, default_value = "redis-server")]
    pub redis_server: String,
}

#[derive(Serialize, Clone, Debug)]
struct Row {
    transport: String,
    clients: usize,
    batch: usize,
    ops_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    /// User + system CPU of this whole process per READ, µs (see the module
    /// doc for which sides of a transport that includes).
    cpu_us_per_read: f64,
}

#[derive(Serialize)]
struct Machine {
    cores: usize,
    memory: u64,
}

#[derive(Serialize)]
struct Params {
    seconds: f64,
    runs: usize,
    region_mib: usize,
    page_bytes: usize,
    clients: Vec<usize>,
    batch: Vec<usize>,
    transports: Vec<String>,
    spin_us: u64,
}

#[derive(Serialize)]
struct Target {
    target: String,
    ratio: f64,
    bound: f64,
    met: bool,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    machine: Machine,
    params: Params,
    results: Vec<Row>,
    targets: Vec<Target>,
    skipped: Vec<String>,
}

/// One client's loop: `op(batch, pages, hist)` performs one batch of READs of
/// `pages` and records one latency per READ.
trait Client: Send {
    fn batch(&mut self, pages: &[u64], hist: &mut Histogram<u64>) -> anyhow::Result<()>;
}

fn page_bytes(page: u64) -> Vec<u8> {
    let mut v = vec![0u8; PAGE];
    v[..8].copy_from_slice(&page.to_le_bytes());
    let mut x = page.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for w in v[8..].chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
    v
}

fn check(page: u64, bytes: &[u8]) -> anyhow::Result<()> {
    let got = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if got != page {
        bail!("wrong read: asked page {page}, got page {got}");
    }
    Ok(())
}

/// Records the latency of one READ: from the start of its batch to now.
fn record(hist: &mut Histogram<u64>, since: Instant) {
    let _ = hist.record(since.elapsed().as_nanos() as u64);
}

/// A [`Connection`]-based client (shm, tcp).
struct ConnClient<C: Connection> {
    conn: C,
    region: RegionDescriptor,
    bufs: Vec<Vec<u8>>,
    reqs: Vec<ReadRequest>,
    done: Vec<Completion>,
}

impl<C: Connection> Client for ConnClient<C> {
    fn batch(&mut self, pages: &[u64], hist: &mut Histogram<u64>) -> anyhow::Result<()> {
        self.reqs.clear();
        for (i, (b, &p)) in self.bufs.iter_mut().zip(pages).enumerate() {
            self.reqs
                .push(ReadRequest::new(i as u64, self.region, p * PAGE as u64, b));
        }
        let t = Instant::now();
        // SAFETY: `self.bufs` is not touched until every completion of this
        // batch has been returned below (or the call fails and we bail, after
        // which the connection is dropped with the client before the buffers
        // could be reused: they are dropped together).
        unsafe { self.conn.post_reads(&self.reqs) }.context("post")?;
        let mut left = pages.len();
        while left > 0 {
            self.done.clear();
            self.conn.wait(&mut self.done, Duration::from_secs(10));
            for c in &self.done {
                c.result.clone().with_context(|| format!("read {}", c.id))?;
                record(hist, t);
                check(pages[c.id as usize], &self.bufs[c.id as usize])?;
                left -= 1;
            }
        }
        Ok(())
    }
}

/// `memcpy` of 4 KiB pages of a plain buffer.
struct MemcpyClient {
    region: Arc<Vec<u8>>,
    buf: Vec<u8>,
}

impl Client for MemcpyClient {
    fn batch(&mut self, pages: &[u64], hist: &mut Histogram<u64>) -> anyhow::Result<()> {
        let t = Instant::now();
        for &p in pages {
            let at = p as usize * PAGE;
            self.buf.copy_from_slice(&self.region[at..at + PAGE]);
            std::hint::black_box(&mut self.buf);
            record(hist, t);
            check(p, &self.buf)?;
        }
        Ok(())
    }
}

/// Raw TCP ping-pong: the request bytes a `tcp` batch would send, answered
/// by a thread that writes `batch` 4 KiB pages from a buffer.
struct RawTcpClient {
    stream: TcpStream,
    req: Vec<u8>,
    resp: Vec<u8>,
}

impl Client for RawTcpClient {
    fn batch(&mut self, pages: &[u64], hist: &mut Histogram<u64>) -> anyhow::Result<()> {
        let n = pages.len();
        self.req.clear();
        for &p in pages {
            let mut r = [0u8; pagewire_rdma::tcp::REQUEST_LEN];
            r[..8].copy_from_slice(&p.to_le_bytes());
            self.req.extend_from_slice(&r);
        }
        let t = Instant::now();
        self.stream.write_all(&self.req)?;
        self.resp.resize(n * PAGE, 0);
        self.stream.read_exact(&mut self.resp)?;
        for (i, &p) in pages.iter().enumerate() {
            record(hist, t);
            check(p, &self.resp[i * PAGE..(i + 1) * PAGE])?;
        }
        Ok(())
    }
}

fn raw_tcp_server(region: Arc<Vec<u8>>) -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let addr = l.local_addr()?;
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let region = Arc::clone(&region);
            std::thread::spawn(move || {
                let _ = s.set_nodelay(true);
                let mut inbuf = vec![0u8; 64 << 10];
                let mut have = 0;
                let mut out = Vec::with_capacity(1 << 20);
                loop {
                    match s.read(&mut inbuf[have..]) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => have += n,
                    }
                    let whole = have - have % pagewire_rdma::tcp::REQUEST_LEN;
                    out.clear();
                    for r in inbuf[..whole].chunks_exact(pagewire_rdma::tcp::REQUEST_LEN) {
                        let p = u64::from_le_bytes(r[..8].try_into().expect("8")) as usize;
                        out.extend_from_slice(&region[p * PAGE..(p + 1) * PAGE]);
                    }
                    inbuf.copy_within(whole..have, 0);
                    have -= whole;
                    if s.write_all(&out).is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(addr)
}

/// Redis GET through a minimal RESP client; a batch is one pipeline.
struct RedisClient {
    w: TcpStream,
    r: BufReader<TcpStream>,
    req: Vec<u8>,
    val: Vec<u8>,
    line: String,
}

impl RedisClient {
    fn connect(port: u16) -> anyhow::Result<Self> {
        let w = TcpStream::connect((Ipv4Addr::LOCALHOST, port))?;
        w.set_nodelay(true)?;
        let r = BufReader::with_capacity(256 << 10, w.try_clone()?);
        Ok(Self {
            w,
            r,
            req: Vec::new(),
            val: vec![0u8; PAGE],
            line: String::new(),
        })
    }

    fn push_cmd(req: &mut Vec<u8>, args: &[&[u8]]) {
        req.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            req.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            req.extend_from_slice(a);
            req.extend_from_slice(b"\r\n");
        }
    }

    /// Reads one reply; returns the bulk length (or 0 for a status reply).
    fn reply(&mut self) -> anyhow::Result<usize> {
        self.line.clear();
        self.r.read_line(&mut self.line)?;
        match self.line.as_bytes().first() {
            Some(b'+') => Ok(0),
            Some(b'$') => {
                let n: usize = self.line[1..].trim_end().parse().context("bulk length")?;
                if n != PAGE {
                    bail!("redis returned {n} bytes, expected {PAGE}");
                }
                self.r.read_exact(&mut self.val)?;
                let mut crlf = [0u8; 2];
                self.r.read_exact(&mut crlf)?;
                Ok(n)
            }
            _ => bail!("unexpected redis reply {:?}", self.line),
        }
    }
}

impl Client for RedisClient {
    fn batch(&mut self, pages: &[u64], hist: &mut Histogram<u64>) -> anyhow::Result<()> {
        self.req.clear();
        for p in pages {
            Self::push_cmd(&mut self.req, &[b"GET", format!("page:{p}").as_bytes()]);
        }
        let t = Instant::now();
        self.w.write_all(&self.req)?;
        for &p in pages {
            self.reply()?;
            record(hist, t);
            check(p, &self.val)?;
        }
        Ok(())
    }
}

struct Redis {
    child: Child,
    port: u16,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_redis(bin: &str, pages: u64) -> anyhow::Result<Option<Redis>> {
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port();
    let child = match Command::new(bin)
        .args([
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args([
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).context("starting redis-server"),
    };
    let redis = Redis { child, port };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut c = loop {
        match RedisClient::connect(port) {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e).context("redis-server did not start"),
        }
    };
    for chunk in (0..pages).collect::<Vec<_>>().chunks(256) {
        c.req.clear();
        for &p in chunk {
            RedisClient::push_cmd(
                &mut c.req,
                &[b"SET", format!("page:{p}").as_bytes(), &page_bytes(p)],
            );
        }
        c.w.write_all(&c.req)?;
        for _ in chunk {
            c.reply()?;
        }
    }
    Ok(Some(redis))
}

/// User + system CPU time of this process so far, µs.
fn process_cpu_us() -> f64 {
    // SAFETY: `getrusage` fills the zeroed struct we pass; RUSAGE_SELF is
    // always valid.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let us = |t: libc::timeval| t.tv_sec as f64 * 1e6 + t.tv_usec as f64;
    us(ru.ru_utime) + us(ru.ru_stime)
}

/// Runs `clients` clients for `secs`, each reading random batches.
fn measure(
    clients: Vec<Box<dyn Client>>,
    batch: usize,
    pages: u64,
    secs: f64,
) -> anyhow::Result<Row> {
    let n = clients.len();
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(n + 1));
    let handles: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            let (stop, start) = (Arc::clone(&stop), Arc::clone(&start));
            std::thread::spawn(move || -> anyhow::Result<(Histogram<u64>, u64)> {
                let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)
                    .expect("histogram bounds");
                let mut rng = fastrand::Rng::with_seed(i as u64 + 1);
                let mut ps = vec![0u64; batch];
                let mut ops = 0u64;
                start.wait();
                while !stop.load(Ordering::Relaxed) {
                    for p in &mut ps {
                        *p = rng.u64(..pages);
                    }
                    c.batch(&ps, &mut hist)?;
                    ops += batch as u64;
                }
                Ok((hist, ops))
            })
        })
        .collect();
    let cpu0 = process_cpu_us();
    start.wait();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    stop.store(true, Ordering::Relaxed);
    let mut total =
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds");
    let mut ops = 0;
    for h in handles {
        let (hist, o) = h.join().map_err(|_| anyhow::anyhow!("client panicked"))??;
        total.add(&hist).expect("same bounds");
        ops += o;
    }
    let el = t0.elapsed().as_secs_f64();
    let cpu = process_cpu_us() - cpu0;
    Ok(Row {
        transport: String::new(),
        clients: n,
        batch,
        ops_per_sec: ops as f64 / el,
        p50_us: total.value_at_quantile(0.5) as f64 / 1000.0,
        p99_us: total.value_at_quantile(0.99) as f64 / 1000.0,
        cpu_us_per_read: cpu / ops.max(1) as f64,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn machine() -> Machine {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024);
    Machine { cores, memory }
}

/// Runs the bench and prints the table (or JSON).
///
/// # Errors
/// A transport failed, or a READ returned a wrong page.
pub fn run(args: &TransportArgs) -> anyhow::Result<()> {
    let (secs, runs, region_mib) = if args.quick {
        (0.2, 1, args.region_mib.min(8))
    } else {
        (args.seconds, args.runs.max(1), args.region_mib)
    };
    const KNOWN: [&str; 6] = ["shm", "tcp", "tcp_nospin", "raw_tcp", "memcpy", "redis"];
    if let Some(t) = args
        .transports
        .iter()
        .find(|t| !KNOWN.contains(&t.as_str()))
    {
        bail!("unknown transport {t:?} (known: {})", KNOWN.join(", "));
    }
    if args.clients.contains(&0) || args.batch.contains(&0) {
        bail!("--clients and --batch take positive numbers");
    }
    if args.batch.iter().any(|&b| b > 1024) {
        bail!("--batch is at most 1024 (a tcp connection's outstanding limit)");
    }
    if !(secs > 0.0 && secs.is_finite()) {
        bail!("--seconds must be a positive number");
    }
    let spin = Duration::from_micros(args.spin_us);
    let spin_of = |t: &str| if t == "tcp" { spin } else { Duration::ZERO };
    let pages = (region_mib.max(1) * (1 << 20) / PAGE) as u64;
    let len = pages as usize * PAGE;
    let mut plain = vec![0u8; len];
    for p in 0..pages {
        plain[p as usize * PAGE..(p as usize + 1) * PAGE].copy_from_slice(&page_bytes(p));
    }
    let plain = Arc::new(plain);
    let mut rows = Vec::new();
    let mut skipped = Vec::new();

    for t in &args.transports {
        // Per-transport setup kept alive for its rows.
        let mut shm_owner = None;
        let mut shm_region = None;
        let mut responder = None;
        let mut tcp_region = None;
        let mut raw_addr = None;
        let mut redis = None;
        match t.as_str() {
            "shm" => {
                let owner = ShmOwner::create(&format!("bench-{}", std::process::id()))?;
                let r = owner.register(len)?;
                r.write_bytes(0, &plain);
                shm_region = Some(r);
                shm_owner = Some(owner);
            }
            "tcp" | "tcp_nospin" => {
                let mut config = OwnerConfig::new(TOKEN);
                config.spin = spin_of(t);
                let resp = TcpOwner::bind((Ipv4Addr::LOCALHOST, 0), config)?;
                let r = resp.register(len)?;
                r.write_bytes(0, &plain);
                tcp_region = Some(r);
                responder = Some(resp);
            }
            "raw_tcp" => raw_addr = Some(raw_tcp_server(Arc::clone(&plain))?),
            "memcpy" => {}
            "redis" => match start_redis(&args.redis_server, pages)? {
                Some(r) => redis = Some(r),
                None => {
                    let msg = format!("redis: {} not found, Redis rows skipped", args.redis_server);
                    eprintln!("{msg}");
                    skipped.push(msg);
                    continue;
                }
            },
            other => {
                bail!("unknown transport {other:?} (shm, tcp, tcp_nospin, raw_tcp, memcpy, redis)")
            }
        }
        for &clients in &args.clients {
            for &batch in &args.batch {
                let mut samples = Vec::new();
                for _ in 0..runs {
                    let mut cs: Vec<Box<dyn Client>> = Vec::new();
                    for _ in 0..clients {
                        cs.push(match t.as_str() {
                            "shm" => Box::new(ConnClient {
                                conn: ShmConnection::connect(
                                    shm_owner.as_ref().expect("shm owner").name(),
                                    ShmConfig::default(),
                                )?,
                                region: shm_region.as_ref().expect("shm region").descriptor(),
                                bufs: vec![vec![0u8; PAGE]; batch],
                                reqs: Vec::with_capacity(batch),
                                done: Vec::new(),
                            }),
                            "tcp" | "tcp_nospin" => Box::new(ConnClient {
                                conn: TcpConnection::connect(
                                    responder.as_ref().expect("responder").local_addr(),
                                    ConnectionConfig {
                                        spin: spin_of(t),
                                        ..ConnectionConfig::new(TOKEN)
                                    },
                                )?,
                                region: tcp_region.as_ref().expect("tcp region").descriptor(),
                                bufs: vec![vec![0u8; PAGE]; batch],
                                reqs: Vec::with_capacity(batch),
                                done: Vec::new(),
                            }),
                            "raw_tcp" => {
                                let s = TcpStream::connect(raw_addr.expect("raw server"))?;
                                s.set_nodelay(true)?;
                                Box::new(RawTcpClient {
                                    stream: s,
                                    req: Vec::new(),
                                    resp: Vec::new(),
                                })
                            }
                            "memcpy" => Box::new(MemcpyClient {
                                region: Arc::clone(&plain),
                                buf: vec![0u8; PAGE],
                            }),
                            "redis" => {
                                Box::new(RedisClient::connect(redis.as_ref().expect("redis").port)?)
                            }
                            _ => unreachable!("checked above"),
                        });
                    }
                    samples.push(
                        measure(cs, batch, pages, secs)
                            .with_context(|| format!("{t} {clients}x{batch}"))?,
                    );
                }
                rows.push(Row {
                    transport: t.clone(),
                    clients,
                    batch,
                    ops_per_sec: median(samples.iter().map(|r| r.ops_per_sec).collect()),
                    p50_us: median(samples.iter().map(|r| r.p50_us).collect()),
                    p99_us: median(samples.iter().map(|r| r.p99_us).collect()),
                    cpu_us_per_read: median(samples.iter().map(|r| r.cpu_us_per_read).collect()),
                });
            }
        }
        drop(redis);
    }

    let targets = targets(&rows);
    let report = Report {
        bench: "transport",
        machine: machine(),
        params: Params {
            seconds: secs,
            runs,
            region_mib,
            page_bytes: PAGE,
            clients: args.clients.clone(),
            batch: args.batch.clone(),
            transports: args.transports.clone(),
            spin_us: args.spin_us,
        },
        results: rows,
        targets,
        skipped,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

fn find<'a>(rows: &'a [Row], t: &str, clients: usize, batch: usize) -> Option<&'a Row> {
    rows.iter()
        .find(|r| r.transport == t && r.clients == clients && r.batch == batch)
}

/// The targets, computed from the medians (higher ratio is better
/// for throughput targets; lower for latency ones).
fn targets(rows: &[Row]) -> Vec<Target> {
    let mut out = Vec::new();
    let mut tput = |name: &str, a: Option<&Row>, b: Option<&Row>, bound: f64| {
        if let (Some(a), Some(b)) = (a, b) {
            let ratio = a.ops_per_sec / b.ops_per_sec;
            out.push(Target {
                target: name.into(),
                ratio,
                bound,
                met: ratio >= bound,
            });
        }
    };
    tput(
        "tcp/redis ops, 1 client, batch 1 (>= 2x)",
        find(rows, "tcp", 1, 1),
        find(rows, "redis", 1, 1),
        2.0,
    );
    tput(
        "tcp/redis ops, 8 clients, batch 1 (>= 1.5x)",
        find(rows, "tcp", 8, 1),
        find(rows, "redis", 8, 1),
        1.5,
    );
    tput(
        "tcp/redis ops, 1 client, batch 16 (>= 1x)",
        find(rows, "tcp", 1, 16),
        find(rows, "redis", 1, 16),
        1.0,
    );
    tput(
        "tcp/redis ops, 8 clients, batch 16 (>= 1x)",
        find(rows, "tcp", 8, 16),
        find(rows, "redis", 8, 16),
        1.0,
    );
    let mut lat = |name: &str, a: Option<&Row>, b: Option<&Row>, bound: f64| {
        if let (Some(a), Some(b)) = (a, b) {
            let ratio = a.p50_us / b.p50_us;
            out.push(Target {
                target: name.into(),
                ratio,
                bound,
                met: ratio <= bound,
            });
        }
    };
    lat(
        "tcp/raw_tcp p50, 1 client, batch 1 (<= 1.5x)",
        find(rows, "tcp", 1, 1),
        find(rows, "raw_tcp", 1, 1),
        1.5,
    );
    lat(
        "shm/memcpy p50, 1 client, batch 1 (<= 2x)",
        find(rows, "shm", 1, 1),
        find(rows, "memcpy", 1, 1),
        2.0,
    );
    if let (Some(a), Some(b)) = (find(rows, "shm", 1, 1), find(rows, "memcpy", 1, 1)) {
        let ratio = b.ops_per_sec / a.ops_per_sec;
        out.push(Target {
            target: "memcpy/shm ops, 1 client, batch 1 (shm time <= 2x)".into(),
            ratio,
            bound: 2.0,
            met: ratio <= 2.0,
        });
    }
    out
}

fn print_table(r: &Report) {
    println!(
        "transport bench: {} cores, {:.1} GiB; {} s x {} runs per row (medians), random 4 KiB pages of a {} MiB region",
        r.machine.cores,
        r.machine.memory as f64 / (1u64 << 30) as f64,
        r.params.seconds,
        r.params.runs,
        r.params.region_mib
    );
    println!(
        "tcp spins {} us before blocking, tcp_nospin 0; cpu us/read: user+sys CPU of this process per READ (tcp, raw_tcp: readers and responder together; redis: clients only)",
        r.params.spin_us
    );
    println!(
        "{:<10} {:>7} {:>5} {:>14} {:>10} {:>10} {:>12}",
        "transport", "clients", "batch", "ops/s", "p50 us", "p99 us", "cpu us/read"
    );
    for row in &r.results {
        println!(
            "{:<10} {:>7} {:>5} {:>14.0} {:>10.2} {:>10.2} {:>12.2}",
            row.transport,
            row.clients,
            row.batch,
            row.ops_per_sec,
            row.p50_us,
            row.p99_us,
            row.cpu_us_per_read
        );
    }
    for s in &r.skipped {
        println!("skipped: {s}");
    }
    for t in &r.targets {
        println!(
            "target {}: {:.2}x -> {}",
            t.target,
            t.ratio,
            if t.met { "met" } else { "MISSED" }
        );
    }
}
