//! The four ways of reading a run of pages (one-sided, gRPC `Read`, Redis,
//! and the raw TCP ping-pong floor), each verifying every page it gets.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use pagewire_client::one_sided::{Outcome, RemoteReader};
use pagewire_client::{ClusterClient, Via};
use pagewire_node::pattern;
use pagewire_proto::v1::{PageRun, ReadRequest};
use pagewire_rdma::Connection;

use super::cluster::NodeRpc;

pub const PAGE: usize = 4096;

/// What a client counted; the bench reports deltas over a measurement.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counters {
    /// Pages read (each verified, or counted as a fallback).
    pub pages: u64,
    pub round_trips: u64,
    pub wrong_reads: u64,
    pub retries: u64,
    pub validation_failures: u64,
    pub fallbacks: u64,
}

impl std::ops::Sub for Counters {
    type Output = Counters;
    fn sub(self, o: Counters) -> Counters {
        Counters {
            pages: self.pages - o.pages,
            round_trips: self.round_trips - o.round_trips,
            wrong_reads: self.wrong_reads - o.wrong_reads,
            retries: self.retries - o.retries,
            validation_failures: self.validation_failures - o.validation_failures,
            fallbacks: self.fallbacks - o.fallbacks,
        }
    }
}

impl std::ops::AddAssign for Counters {
    fn add_assign(&mut self, o: Counters) {
        self.pages += o.pages;
        self.round_trips += o.round_trips;
        self.wrong_reads += o.wrong_reads;
        self.retries += o.retries;
        self.validation_failures += o.validation_failures;
        self.fallbacks += o.fallbacks;
    }
}

/// One client (one connection, one thread at a time).
pub trait Client: Send {
    /// Reads pages `first .. first + run`, verifying each.
    fn op(&mut self, first: u64, run: usize) -> anyhow::Result<()>;
    fn counters(&self) -> Counters;
    /// Before the measurements: read every page once (fills an index cache).
    fn prime(&mut self, _pages: u64) -> anyhow::Result<()> {
        Ok(())
    }
}

/// Verifies `buf` as page `page`; counts a wrong read instead of failing, so
/// the row shows how many (the run fails at the end when any).
fn verify(page: u64, buf: &[u8], c: &mut Counters) {
    c.pages += 1;
    if pattern::verify(page, buf).is_err() {
        c.wrong_reads += 1;
    }
}

/// One thread's use of a [`ClusterClient`] shared by every client of its
/// group (the library as a program uses it: one per process). A run of
/// pages is one `read_run`.
pub struct SharedCluster {
    pub client: Arc<ClusterClient>,
    buf: Vec<u8>,
    own: Counters,
}

impl SharedCluster {
    pub fn new(client: Arc<ClusterClient>) -> Self {
        Self {
            client,
            buf: Vec::new(),
            own: Counters::default(),
        }
    }
}

impl Client for SharedCluster {
    fn op(&mut self, first: u64, run: usize) -> anyhow::Result<()> {
        self.buf.resize(run * PAGE, 0);
        let info = self.client.read_run(first, run, &mut self.buf)?;
        for (i, r) in info.pages.iter().enumerate() {
            if r.via == Via::FaultIn {
                self.own.fallbacks += 1;
            }
            self.own.retries += u64::from(r.attempts - 1);
            verify(
                first + i as u64,
                &self.buf[i * PAGE..(i + 1) * PAGE],
                &mut self.own,
            );
        }
        Ok(())
    }

    fn counters(&self) -> Counters {
        Counters {
            // The client's readers count round trips and validation failures
            // for the whole group: shown on the group's first client only.
            ..self.own
        }
    }

    fn prime(&mut self, pages: u64) -> anyhow::Result<()> {
        // Every thread's reader learns every page's frame.
        let mut p = 0;
        while p < pages {
            let n = (pages - p).min(16) as usize;
            self.op(p, n)?;
            p += n as u64;
        }
        self.own = Counters::default();
        Ok(())
    }
}

/// One-sided reads through a [`RemoteReader`]. A run of pages is one
/// `read_run` (its READs batched under one doorbell per round). `cold`
/// forgets the pages' locations before each op, so every read walks its
/// bucket.
pub struct OneSided<C: Connection> {
    pub reader: RemoteReader<C>,
    pub cold: bool,
    buf: Vec<u8>,
    run_buf: Vec<u8>,
    own: Counters,
}

impl<C: Connection> OneSided<C> {
    pub fn new(reader: RemoteReader<C>, cold: bool) -> Self {
        Self {
            reader,
            cold,
            buf: vec![0u8; PAGE],
            run_buf: Vec::new(),
            own: Counters::default(),
        }
    }
}

impl<C: Connection + Send> Client for OneSided<C> {
    fn op(&mut self, first: u64, run: usize) -> anyhow::Result<()> {
        if run > 1 {
            if self.cold {
                for p in first..first + run as u64 {
                    self.reader.forget(p);
                }
            }
            self.run_buf.resize(run * PAGE, 0);
            let outcomes = self.reader.read_run(first, run, &mut self.run_buf)?;
            for (i, o) in outcomes.iter().enumerate() {
                let p = first + i as u64;
                match o {
                    Outcome::Hit { .. } => {
                        verify(p, &self.run_buf[i * PAGE..(i + 1) * PAGE], &mut self.own)
                    }
                    Outcome::Absent | Outcome::GaveUp => {
                        self.own.pages += 1;
                        self.own.fallbacks += 1;
                    }
                }
            }
            return Ok(());
        }
        for p in first..first + run as u64 {
            if self.cold {
                self.reader.forget(p);
            }
            match self.reader.read_page(p, &mut self.buf)? {
                Outcome::Hit { .. } => verify(p, &self.buf, &mut self.own),
                // The owner has every page cached and nothing changes, so
                // this should not happen; a real reader would ask the owner
                // (gRPC FaultIn). Counted, not served.
                Outcome::Absent | Outcome::GaveUp => {
                    self.own.pages += 1;
                    self.own.fallbacks += 1;
                }
            }
        }
        Ok(())
    }

    fn counters(&self) -> Counters {
        let s = self.reader.stats();
        Counters {
            round_trips: s.round_trips,
            retries: s.retries,
            validation_failures: s.validation_failures,
            ..self.own
        }
    }

    fn prime(&mut self, pages: u64) -> anyhow::Result<()> {
        if self.cold {
            return Ok(());
        }
        for p in 0..pages {
            match self.reader.read_page(p, &mut self.buf)? {
                Outcome::Hit { .. } => {}
                o => bail!("priming page {p}: {o:?} (the owner does not hold every page)"),
            }
        }
        Ok(())
    }
}

/// The two-sided path: gRPC `Read` of the run (one call), on its own
/// connection and runtime.
pub struct Grpc {
    rt: tokio::runtime::Runtime,
    client: NodeRpc,
    map_epoch: u64,
    own: Counters,
}

impl Grpc {
    pub fn connect(addr: &str, token: &str, map_epoch: u64) -> anyhow::Result<Self> {
        let rt = super::cluster::rt()?;
        let client = rt.block_on(super::cluster::node_client(addr, token))?;
        Ok(Self {
            rt,
            client,
            map_epoch,
            own: Counters::default(),
        })
    }
}

impl Client for Grpc {
    fn op(&mut self, first: u64, run: usize) -> anyhow::Result<()> {
        let req = ReadRequest {
            run: Some(PageRun {
                first_page: first,
                page_count: run as u64,
            }),
            map_epoch: self.map_epoch,
        };
        let r = self
            .rt
            .block_on(self.client.read(req))
            .context("gRPC Read")?
            .into_inner();
        self.own.round_trips += 1;
        if r.data.len() != run * PAGE {
            bail!("gRPC Read returned {} bytes for {run} pages", r.data.len());
        }
        for (i, page) in r.data.chunks_exact(PAGE).enumerate() {
            verify(first + i as u64, page, &mut self.own);
        }
        Ok(())
    }

    fn counters(&self) -> Counters {
        self.own
    }
}

/// Redis GET (a run of 1) or MGET (longer runs) through a minimal RESP
/// client.
pub struct Redis {
    w: TcpStream,
    r: BufReader<TcpStream>,
    req: Vec<u8>,
    val: Vec<u8>,
    line: String,
    own: Counters,
}

/// The key of a page: `key:` and 12 digits, the names `redis-benchmark -r`
/// generates for `key:__rand_int__`, so it reads the same values.
pub fn key(p: u64) -> String {
    format!("key:{p:012}")
}

impl Redis {
    /// Connects to `host:port`.
    pub fn connect_to(addr: &str) -> anyhow::Result<Self> {
        let w =
            TcpStream::connect(addr).with_context(|| format!("connecting to redis at {addr}"))?;
        w.set_nodelay(true)?;
        let r = BufReader::with_capacity(256 << 10, w.try_clone()?);
        Ok(Self {
            w,
            r,
            req: Vec::new(),
            val: vec![0u8; PAGE],
            line: String::new(),
            own: Counters::default(),
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

    fn line(&mut self) -> anyhow::Result<&str> {
        self.line.clear();
        if self.r.read_line(&mut self.line)? == 0 {
            bail!("redis closed the connection");
        }
        Ok(self.line.trim_end())
    }

    /// Reads one bulk reply of a page into `self.val`.
    fn bulk(&mut self) -> anyhow::Result<()> {
        let l = self.line()?.to_owned();
        let Some(n) = l.strip_prefix('$') else {
            bail!("unexpected redis reply {l:?}");
        };
        let n: usize = n.parse().context("bulk length")?;
        if n != PAGE {
            bail!("redis returned {n} bytes, expected {PAGE}");
        }
        self.r.read_exact(&mut self.val)?;
        let mut crlf = [0u8; 2];
        self.r.read_exact(&mut crlf)?;
        Ok(())
    }

    /// A numeric field of `INFO` (e.g. `keyspace_misses`).
    pub fn info_field(&mut self, field: &str) -> anyhow::Result<u64> {
        self.req.clear();
        Self::push_cmd(&mut self.req, &[b"INFO", b"stats"]);
        self.w.write_all(&self.req)?;
        let l = self.line()?.to_owned();
        let n: usize = l
            .strip_prefix('$')
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("unexpected INFO reply {l:?}"))?;
        let mut body = vec![0u8; n + 2];
        self.r.read_exact(&mut body)?;
        let text = String::from_utf8_lossy(&body);
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("INFO has no {field}"))
    }

    /// GET of one page into `out` (unverified: the caller verifies).
    pub fn get(&mut self, page: u64, out: &mut [u8]) -> anyhow::Result<()> {
        self.req.clear();
        let k = key(page);
        Self::push_cmd(&mut self.req, &[b"GET", k.as_bytes()]);
        self.w.write_all(&self.req)?;
        self.bulk()?;
        out[..PAGE].copy_from_slice(&self.val);
        Ok(())
    }

    /// SETs every page of the file (generation 0), pipelined.
    pub fn load(&mut self, pages: u64) -> anyhow::Result<()> {
        let mut buf = vec![0u8; PAGE];
        let all: Vec<u64> = (0..pages).collect();
        for chunk in all.chunks(256) {
            self.req.clear();
            for &p in chunk {
                pattern::fill(p, 0, &mut buf);
                Self::push_cmd(&mut self.req, &[b"SET", key(p).as_bytes(), &buf]);
            }
            self.w.write_all(&self.req)?;
            for _ in chunk {
                let l = self.line()?;
                if l != "+OK" {
                    bail!("redis SET: {l:?}");
                }
            }
        }
        Ok(())
    }
}

impl Client for Redis {
    fn op(&mut self, first: u64, run: usize) -> anyhow::Result<()> {
        self.req.clear();
        let keys: Vec<String> = (first..first + run as u64).map(key).collect();
        let mut args: Vec<&[u8]> = vec![if run == 1 { b"GET" } else { b"MGET" }];
        args.extend(keys.iter().map(|k| k.as_bytes()));
        Self::push_cmd(&mut self.req, &args);
        self.w.write_all(&self.req)?;
        self.own.round_trips += 1;
        if run > 1 {
            let l = self.line()?.to_owned();
            if l != format!("*{run}") {
                bail!("unexpected MGET reply {l:?}");
            }
        }
        for p in first..first + run as u64 {
            self.bulk()?;
            let mut c = self.own;
            verify(p, &self.val, &mut c);
            self.own = c;
        }
        Ok(())
    }

    fn counters(&self) -> Counters {
        self.own
    }
}

/// The floor of one-sided `tcp`: a raw TCP ping-pong of a 40-byte request
/// (a `tcp` READ's size) for one 4 KiB page, both sides polling their
/// sockets for up to `spin` before blocking, as the `tcp` transport does.
pub struct RawTcp {
    s: TcpStream,
    spin: Duration,
    resp: Vec<u8>,
    own: Counters,
}

/// Reads exactly `buf.len()` bytes from the non-blocking `s`, spinning for
/// up to `spin` before each blocking `poll`.
fn read_spin(s: &mut TcpStream, buf: &mut [u8], spin: Duration) -> std::io::Result<()> {
    let mut have = 0;
    let mut since = Instant::now();
    while have < buf.len() {
        match s.read(&mut buf[have..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                have += n;
                since = Instant::now();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if since.elapsed() < spin {
                    std::hint::spin_loop();
                } else {
                    let mut fd = libc::pollfd {
                        fd: s.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd for the duration of the call.
                    unsafe { libc::poll(&mut fd, 1, 1000) };
                    since = Instant::now();
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_all_nb(s: &mut TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

const RAW_REQ: usize = 40;

/// Starts the ping-pong server (a thread per connection) over `file`'s
/// pages; returns its address.
pub fn raw_tcp_server(pages: Arc<Vec<u8>>, spin: Duration) -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let addr = l.local_addr()?;
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let pages = Arc::clone(&pages);
            std::thread::spawn(move || {
                if s.set_nodelay(true).is_err() || s.set_nonblocking(true).is_err() {
                    return;
                }
                let mut req = [0u8; RAW_REQ];
                loop {
                    if read_spin(&mut s, &mut req, spin).is_err() {
                        return;
                    }
                    let p = u64::from_le_bytes(req[..8].try_into().expect("8 bytes")) as usize;
                    let Some(page) = pages.get(p * PAGE..(p + 1) * PAGE) else {
                        return;
                    };
                    if write_all_nb(&mut s, page).is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(addr)
}

impl RawTcp {
    pub fn connect(addr: SocketAddr, spin: Duration) -> anyhow::Result<Self> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        s.set_nonblocking(true)?;
        Ok(Self {
            s,
            spin,
            resp: vec![0u8; PAGE],
            own: Counters::default(),
        })
    }
}

impl Client for RawTcp {
    fn op(&mut self, first: u64, run: usize) -> anyhow::Result<()> {
        for p in first..first + run as u64 {
            let mut req = [0u8; RAW_REQ];
            req[..8].copy_from_slice(&p.to_le_bytes());
            write_all_nb(&mut self.s, &req)?;
            read_spin(&mut self.s, &mut self.resp, self.spin)?;
            self.own.round_trips += 1;
            let mut c = self.own;
            verify(p, &self.resp, &mut c);
            self.own = c;
        }
        Ok(())
    }

    fn counters(&self) -> Counters {
        self.own
    }
}

/// The floor of a one-sided page read on a transport: one READ of the
/// page's frame bytes alone, at the frame a primed reader's index cache
/// names (no header READ, no checksum, no retry), verified against the
/// self-describing pattern like every other path (nothing in this bench
/// evicts or writes, so the frame still holds its page). Beside the
/// one-sided rows it shows what the protocol (a header READ under the same
/// doorbell, the checksum) costs over one bare READ of 4 KiB.
pub struct FrameOnly<C: Connection> {
    conn: C,
    desc: pagewire_rdma::RegionDescriptor,
    /// Region offset of each page's frame.
    frames: Vec<u64>,
    buf: Vec<u8>,
    own: Counters,
}

impl<C: Connection> FrameOnly<C> {
    /// `reader` must have read every page (`prime`): its index cache gives
    /// the frames. `conn` reads them.
    pub fn new<R: Connection>(
        reader: &RemoteReader<R>,
        conn: C,
        desc: pagewire_rdma::RegionDescriptor,
        pages: u64,
    ) -> anyhow::Result<Self> {
        let layout = reader.superblock().layout;
        let frames = (0..pages)
            .map(|p| {
                reader
                    .location(p)
                    .map(|(f, _)| layout.frame(f as usize) as u64)
                    .with_context(|| format!("page {p} was not primed"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self {
            conn,
            desc,
            frames,
            buf: vec![0u8; layout.page_size],
            own: Counters::default(),
        })
    }
}

impl<C: Connection> Client for FrameOnly<C> {
    fn op(&mut self, first: u64, run: usize) -> anyhow::Result<()> {
        for p in first..first + run as u64 {
            let off = self.frames[p as usize];
            let r = pagewire_rdma::read_blocking(
                &mut self.conn,
                self.desc,
                &mut [(off, &mut self.buf[..])],
            )?;
            r[0].clone()
                .map_err(|e| anyhow::anyhow!("READ of page {p}'s frame: {e}"))?;
            self.own.round_trips += 1;
            let mut c = self.own;
            verify(p, &self.buf[..PAGE], &mut c);
            self.own = c;
        }
        Ok(())
    }

    fn counters(&self) -> Counters {
        self.own
    }
}
