//! `tcp`: a software NIC for clusters without RDMA.
//!
//! The owner runs a [`TcpResponder`]: it registers regions and serves READ
//! requests straight from them — checked against the rkey, the epoch and the
//! region's bounds, never calling into a page cache. A region is either an
//! anonymous mapping the responder allocates ([`TcpResponder::register`]) or
//! memory the caller already has ([`TcpResponder::register_external`], e.g.
//! the node's whole page-cache region), served in place, without a copy
//! beyond the one into the socket. Every region of a responder carries its
//! epoch: [`ResponderConfig::epoch`] (the node's incarnation), or a random
//! one. A bad request gets an error reply, never a byte outside the
//! region, and the connection carries on. A reader opens a [`TcpConnection`],
//! which pipelines many outstanding requests and writes a whole batch with
//! one `send`; the responder answers everything one `recv` brought in with
//! one `send`. Each connection starts with a mutual handshake over a shared
//! cluster token (HMAC-SHA256 challenge-response, see below).
//!
//! # Wire format (all integers little-endian)
//!
//! Handshake, once per connection, magic `PWTCP\0\0\x01`:
//!
//! ```text
//! client -> server  magic[8] | client_nonce[16]
//! server -> client  magic[8] | server_nonce[16] | HMAC-SHA256(token, "pagewire server" | cn | sn)[32]
//! client -> server  HMAC-SHA256(token, "pagewire client" | sn | cn)[32]
//! server -> client  status[1]   0 = accepted; anything else, then close
//! ```
//!
//! Then requests, 40 bytes each, any number back to back:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 1 | opcode: 1 = READ (2 = compare-and-swap, 3 = fetch-and-add reserved) |
//! | 1 | 1 | flags, 0 |
//! | 2 | 2 | reserved, 0 |
//! | 4 | 4 | length in bytes |
//! | 8 | 8 | request id (opaque to the responder, echoed) |
//! | 16 | 8 | remote address |
//! | 24 | 4 | rkey |
//! | 28 | 4 | reserved, 0 |
//! | 32 | 8 | epoch of the region descriptor |
//!
//! Responses, in request order, a 16-byte header then the payload:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 1 | status: 0 = ok, 1 = unknown rkey, 2 = stale epoch, 3 = out of bounds, 4 = bad request |
//! | 1 | 3 | reserved, 0 |
//! | 4 | 4 | payload length: the request's length when ok, else 0 |
//! | 8 | 8 | request id |
//! | 16 | len | the bytes read |
//!
//! A READ is valid when its rkey names a live region of this responder, its
//! epoch is that region's, `1 <= length <= max_read_len` and `[address,
//! address + length)` lies inside the region. The responder copies with
//! word-sized atomic loads (the owner may be rewriting the bytes: the reader
//! validates what it gets). Flow control: a client keeps at most
//! `max_outstanding` requests in flight (40 KiB of requests at the default
//! 1024), so neither side can block the other's progress.
//!
//! # Adaptive polling
//!
//! A serving thread that answered, and a reader that waits for answers,
//! first poll their socket without blocking for up to
//! [`ResponderConfig::spin`] / [`ConnectionConfig::spin`] (50 µs by
//! default), then block: a loopback round trip costs about 7 µs when both
//! sides spin and 60–70 µs when each answer has to wake a sleeping thread
//! on an idle core. At most `available_parallelism() - 1` serving threads,
//! and as many waiting readers, spin at once in a process, and none while
//! more than that many share the role; the others block at once, so many
//! clients on few cores do not burn them. Each waiter's
//! window adapts: it shrinks to nothing when its traffic is too sparse for a
//! spin to catch, and a waiter preempted while spinning (cores
//! oversubscribed) stops spinning for a while (see `spin.rs`). A spin of
//! zero blocks at once.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::copy::{Chaos, copy_from_shared_raw};
use crate::memory::{Memory, MemoryOwner, choose_epoch};
use crate::spin::AdaptiveSpin;
use crate::{
    AccessFault, Completion, ConnectError, Connection, Limits, LocalRegion, OwnerError, PostError,
    ReadError, ReadRequest, RegionDescriptor, RegisterError, handshake, spin,
};

const MAGIC: &[u8; 8] = b"PWTCP\0\0\x01";
/// Size of one request on the wire.
pub const REQUEST_LEN: usize = 40;
/// Size of one response header on the wire.
pub const RESPONSE_HEADER_LEN: usize = 16;
const OP_READ: u8 = 1;

const ST_OK: u8 = 0;
const ST_UNKNOWN_KEY: u8 = 1;
const ST_STALE_EPOCH: u8 = 2;
const ST_OUT_OF_BOUNDS: u8 = 3;
const ST_BAD_REQUEST: u8 = 4;

/// How long a client waits for the handshake and the responder for a hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Granularity of a blocking `wait`.
const WAIT_QUANTUM: Duration = Duration::from_millis(10);
/// Default of [`ResponderConfig::spin`] and [`ConnectionConfig::spin`].
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// The client side of this transport's handshake over any stream (the
/// decoder of the responder's challenge), for the fuzz targets and tests
/// that stand in for one end of a connection.
#[doc(hidden)]
pub fn handshake_client<S: Read + Write>(s: &mut S, token: &[u8]) -> Result<(), ConnectError> {
    handshake::client(s, MAGIC, token)
}

/// The responder side of this transport's handshake over any stream (the
/// decoder of a client's hello and answer); `Ok(true)` when the client
/// proved it holds `token`.
#[doc(hidden)]
pub fn handshake_server<S: Read + Write>(s: &mut S, token: &[u8]) -> io::Result<bool> {
    handshake::server(s, MAGIC, token)
}

/// Settings of a [`TcpResponder`].
#[derive(Debug, Clone)]
pub struct ResponderConfig {
    /// Cluster token every client must prove it holds.
    pub token: Vec<u8>,
    /// Test mode: chaotic copies (see [`Chaos`]).
    pub chaos: Option<Chaos>,
    /// Largest READ served, in bytes.
    pub max_read_len: u32,
    /// The epoch every descriptor of this responder carries (the node's
    /// incarnation); `None` picks a random one. Zero is reserved
    /// ([`OwnerError::ZeroEpoch`]).
    pub epoch: Option<u64>,
    /// How long a serving thread polls its socket without blocking after
    /// answering, before it blocks; zero blocks at once. At most
    /// `available_parallelism() - 1` threads of the process spin at once.
    pub spin: Duration,
}

impl ResponderConfig {
    /// Defaults: no chaos, READs up to 16 MiB, a random epoch, spin
    /// [`DEFAULT_SPIN`].
    #[must_use]
    pub fn new(token: impl Into<Vec<u8>>) -> Self {
        Self {
            token: token.into(),
            chaos: None,
            max_read_len: 16 << 20,
            epoch: None,
            spin: DEFAULT_SPIN,
        }
    }
}

struct RegionMem {
    mem: Memory,
    rkey: u32,
    epoch: u64,
}

struct Shared {
    config: ResponderConfig,
    epoch: u64,
    regions: RwLock<HashMap<u32, Arc<RegionMem>>>,
    closed: AtomicBool,
    next_conn: AtomicU64,
    conns: Mutex<HashMap<u64, TcpStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// The owner's side of `tcp`: registers regions and serves READs of them.
///
/// One thread accepts, one thread per connection serves. Dropping the
/// responder (or [`TcpResponder::shutdown`]) closes every connection.
pub struct TcpResponder {
    shared: Arc<Shared>,
    listener: TcpListener,
    addr: SocketAddr,
}

impl TcpResponder {
    /// Listens on `addr` (use port 0 for any free port) and starts serving.
    ///
    /// # Errors
    /// [`OwnerError::ZeroEpoch`] when the config asks for epoch 0;
    /// [`OwnerError::Io`] when the socket could not be bound.
    pub fn bind(addr: impl ToSocketAddrs, config: ResponderConfig) -> Result<Self, OwnerError> {
        let epoch = choose_epoch(config.epoch)?;
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            config,
            epoch,
            regions: RwLock::new(HashMap::new()),
            closed: AtomicBool::new(false),
            next_conn: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
        });
        let l = listener.try_clone()?;
        let s = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("pw-tcp-accept".into())
            .spawn(move || accept_loop(&l, &s))?;
        shared.threads.lock().expect("threads lock").push(accept);
        Ok(Self {
            shared,
            listener,
            addr,
        })
    }

    /// The address clients connect to.
    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The epoch every descriptor of this responder carries.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.shared.epoch
    }

    /// Connections open now (from accept until their serving thread ends;
    /// one still in its handshake counts).
    #[must_use]
    pub fn connections(&self) -> usize {
        self.shared.conns.lock().expect("conns lock").len()
    }

    /// Connections accepted since the responder started.
    #[must_use]
    pub fn accepted(&self) -> u64 {
        self.shared.next_conn.load(Ordering::Relaxed)
    }

    /// Allocates and registers `len` zeroed bytes (page-aligned) for remote READ.
    ///
    /// # Errors
    /// Zero length, a failed mapping, or a closed responder.
    pub fn register(&self, len: usize) -> Result<TcpRegion, RegisterError> {
        if len == 0 || len > isize::MAX as usize {
            return Err(RegisterError::InvalidLength(len));
        }
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(RegisterError::Closed);
        }
        self.insert(Memory::anon(len)?)
    }

    /// Registers `len` bytes the caller already has at `ptr` for remote READ,
    /// served in place exactly like a region of [`TcpResponder::register`]
    /// (same rkey, epoch and bounds checks). The region keeps `owner` alive
    /// until it is dropped; after the drop returns, the responder never
    /// touches the memory again and READs of it fail with
    /// [`AccessFault::UnknownKey`].
    ///
    /// # Safety
    /// * `ptr..ptr + len` is valid for reads and writes for as long as
    ///   `owner` is alive (it stays mapped; no `munmap`, `mremap` or
    ///   `MAP_FIXED` over it).
    /// * While the returned region lives, every write to that memory is
    ///   atomic (e.g. `AtomicU64` stores, [`LocalRegion::write_bytes`]),
    ///   volatile, or made by the kernel or a device, and nobody holds a
    ///   `&mut` to any of it: serving threads read it concurrently with
    ///   atomic loads, so a plain store would be a data race.
    ///
    /// # Errors
    /// Zero length, a range that wraps the address space, or a closed
    /// responder.
    pub unsafe fn register_external(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        owner: MemoryOwner,
    ) -> Result<TcpRegion, RegisterError> {
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(RegisterError::Closed);
        }
        // SAFETY: forwarded from this function's contract.
        let mem = unsafe { Memory::external(ptr, len, owner) }?;
        tracing::debug!(
            addr = mem.addr(),
            len,
            "tcp responder: registered external memory"
        );
        self.insert(mem)
    }

    fn insert(&self, mem: Memory) -> Result<TcpRegion, RegisterError> {
        let mut regions = self.shared.regions.write().expect("regions lock");
        let rkey = loop {
            let k = fastrand::u32(1..);
            if !regions.contains_key(&k) {
                break k;
            }
        };
        let mem = Arc::new(RegionMem {
            mem,
            rkey,
            epoch: self.shared.epoch,
        });
        regions.insert(rkey, Arc::clone(&mem));
        Ok(TcpRegion {
            mem,
            shared: Arc::downgrade(&self.shared),
        })
    }

    /// Closes the listener and every connection; in-flight READs fail on the
    /// client side with [`ReadError::ConnectionLost`].
    pub fn shutdown(&self) {
        if self.shared.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // SAFETY: `shutdown(2)` on a socket we own; wakes the accept thread
        // (accept then fails with EINVAL on Linux).
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        for s in self.shared.conns.lock().expect("conns lock").values() {
            let _ = s.shutdown(Shutdown::Both);
        }
        let threads = std::mem::take(&mut *self.shared.threads.lock().expect("threads lock"));
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for TcpResponder {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A region registered with a [`TcpResponder`]; deregistered on drop (after
/// which no serving thread reads its memory).
pub struct TcpRegion {
    mem: Arc<RegionMem>,
    shared: Weak<Shared>,
}

impl LocalRegion for TcpRegion {
    fn descriptor(&self) -> RegionDescriptor {
        RegionDescriptor {
            addr: self.mem.mem.addr(),
            len: self.mem.mem.len() as u64,
            rkey: self.mem.rkey,
            epoch: self.mem.epoch,
        }
    }

    fn as_ptr(&self) -> *mut u8 {
        self.mem.mem.ptr()
    }

    fn len(&self) -> usize {
        self.mem.mem.len()
    }
}

impl Drop for TcpRegion {
    fn drop(&mut self) {
        // Serving threads copy under the table's read lock: taking the write
        // lock waits for every copy in progress, and later requests no
        // longer find the rkey. Only then does `self.mem` (and with it an
        // external region's owner guard) go.
        if let Some(shared) = self.shared.upgrade() {
            shared
                .regions
                .write()
                .expect("regions lock")
                .remove(&self.mem.rkey);
        }
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                if shared.closed.load(Ordering::Acquire) {
                    return;
                }
                tracing::warn!(error = %e, "tcp responder: accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if shared.closed.load(Ordering::Acquire) {
            return;
        }
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        shared.conns.lock().expect("conns lock").insert(id, clone);
        let s = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name("pw-tcp-serve".into())
            .spawn(move || {
                if let Err(e) = serve(stream, &s) {
                    tracing::debug!(error = %e, "tcp responder: connection ended");
                }
                s.conns.lock().expect("conns lock").remove(&id);
            });
        let mut threads = shared.threads.lock().expect("threads lock");
        threads.retain(|t| !t.is_finished());
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => {
                tracing::warn!(error = %e, "tcp responder: cannot spawn a connection thread");
                shared.conns.lock().expect("conns lock").remove(&id);
            }
        }
    }
}

fn serve(mut stream: TcpStream, shared: &Shared) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    if !handshake::server(&mut stream, MAGIC, &shared.config.token)? {
        tracing::warn!(peer = ?stream.peer_addr().ok(), "tcp responder: refused a client without the cluster token");
        return Ok(());
    }
    stream.set_read_timeout(None)?;
    let mut input = vec![0u8; 64 << 10];
    let mut have = 0;
    let mut out: Vec<u8> = Vec::with_capacity(256 << 10);
    let mut spin = AdaptiveSpin::new(&spin::RESPONDER, shared.config.spin);
    loop {
        let n = recv_request(&mut stream, &mut input[have..], shared, &mut spin)?;
        if n == 0 || shared.closed.load(Ordering::Acquire) {
            return Ok(());
        }
        have += n;
        let whole = have - have % REQUEST_LEN;
        out.clear();
        {
            let regions = shared.regions.read().expect("regions lock");
            for req in input[..whole].chunks_exact(REQUEST_LEN) {
                answer(req, &regions, &shared.config, &mut out);
            }
        }
        input.copy_within(whole..have, 0);
        have -= whole;
        stream.write_all(&out)?;
    }
}

/// Receives the next request bytes: polls without blocking while `spin`
/// allows (its window, the process's budget), then blocks. Returns 0 at end
/// of stream or when the responder closed.
fn recv_request(
    stream: &mut TcpStream,
    buf: &mut [u8],
    shared: &Shared,
    spin: &mut AdaptiveSpin,
) -> io::Result<usize> {
    if let Some(mut ep) = spin.begin() {
        loop {
            match recv_nonblocking(stream, buf) {
                Ok(Some(n)) => {
                    spin.end(ep, true);
                    return Ok(n);
                }
                Ok(None) => {}
                Err(e) => return Err(e),
            }
            if shared.closed.load(Ordering::Acquire) {
                return Ok(0);
            }
            if Instant::now() >= ep.until {
                spin.end(ep, false);
                break;
            }
            ep.pause();
        }
    }
    let since = Instant::now();
    loop {
        match stream.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            other => {
                spin.blocked(since.elapsed());
                return other;
            }
        }
    }
}

/// One `recv(MSG_DONTWAIT)`: `Some(n)` bytes (0: end of stream), `None`
/// when nothing is there yet.
fn recv_nonblocking(stream: &TcpStream, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: `buf` is a writable slice valid for `buf.len()` bytes; the fd
    // is our connected socket, alive while `stream` is borrowed.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n >= 0 {
        return Ok(Some(n as usize));
    }
    let e = io::Error::last_os_error();
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
        _ => Err(e),
    }
}

/// Appends the response to one request to `out`.
fn answer(
    req: &[u8],
    regions: &HashMap<u32, Arc<RegionMem>>,
    config: &ResponderConfig,
    out: &mut Vec<u8>,
) {
    let u32_at = |o: usize| u32::from_le_bytes(req[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(req[o..o + 8].try_into().expect("8 bytes"));
    let (op, len, id, addr, rkey, epoch) = (
        req[0],
        u32_at(4),
        u64_at(8),
        u64_at(16),
        u32_at(24),
        u64_at(32),
    );
    let status = if op != OP_READ || len == 0 || len > config.max_read_len {
        ST_BAD_REQUEST
    } else {
        match regions.get(&rkey) {
            None => ST_UNKNOWN_KEY,
            Some(r) if r.epoch != epoch => ST_STALE_EPOCH,
            Some(r) => {
                let start = r.mem.addr();
                let end = start + r.mem.len() as u64;
                if addr < start || addr.checked_add(u64::from(len)).is_none_or(|e| e > end) {
                    ST_OUT_OF_BOUNDS
                } else {
                    push_header(out, ST_OK, len, id);
                    let len = len as usize;
                    out.reserve(len);
                    let at = out.len();
                    // SAFETY:
                    // * source: `[addr, addr + len)` was checked to lie inside
                    //   the region's memory, which the read lock on the region
                    //   table keeps registered, hence alive (our mapping, or
                    //   the caller's under `register_external`'s contract),
                    //   for this call; every other access to it is atomic;
                    // * destination: `len` bytes of spare capacity just
                    //   reserved in `out`, exclusively ours.
                    unsafe {
                        copy_from_shared_raw(
                            addr as *const u8,
                            out.as_mut_ptr().add(at),
                            len,
                            config.chaos.as_ref(),
                        );
                        out.set_len(at + len);
                    }
                    return;
                }
            }
        }
    };
    push_header(out, status, 0, id);
}

fn push_header(out: &mut Vec<u8>, status: u8, len: u32, id: u64) {
    out.extend_from_slice(&[status, 0, 0, 0]);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&id.to_le_bytes());
}

/// Settings of a [`TcpConnection`].
#[derive(Debug, Clone)]
pub struct ConnectionConfig {
    /// Cluster token to prove.
    pub token: Vec<u8>,
    /// A READ not answered within this long completes with
    /// [`ReadError::Timeout`] (a late answer is dropped).
    pub op_timeout: Duration,
    /// Requests in flight, at most.
    pub max_outstanding: usize,
    /// Bytes of one READ, at most (the responder may allow less).
    pub max_read_len: usize,
    /// How long [`Connection::wait`] polls the socket without blocking
    /// before it blocks; zero blocks at once. At most
    /// `available_parallelism() - 1` connections of the process spin at once.
    pub spin: Duration,
    /// How long the TCP connect, and then each step of the handshake, may
    /// take. A responder whose process is frozen (SIGSTOP) still completes
    /// the TCP handshake in its kernel but never answers the hello: a
    /// reader that must fail over quickly sets this short.
    pub connect_timeout: Duration,
}

impl ConnectionConfig {
    /// Defaults: 5 s operation timeout, 1024 outstanding, 16 MiB READs, spin
    /// [`DEFAULT_SPIN`], 10 s to connect.
    #[must_use]
    pub fn new(token: impl Into<Vec<u8>>) -> Self {
        Self {
            token: token.into(),
            connect_timeout: HANDSHAKE_TIMEOUT,
            op_timeout: Duration::from_secs(5),
            max_outstanding: 1024,
            max_read_len: 16 << 20,
            spin: DEFAULT_SPIN,
        }
    }
}

enum Slot {
    Free,
    Pending {
        id: u64,
        local: *mut u8,
        len: usize,
        deadline: Instant,
    },
    /// Timed out and completed; its late answer is still to be skipped.
    Abandoned {
        len: usize,
    },
}

/// A reader's connection to a [`TcpResponder`].
pub struct TcpConnection {
    stream: TcpStream,
    config: ConnectionConfig,
    slots: Vec<(u32, Slot)>,
    free: Vec<u32>,
    outstanding: usize,
    rbuf: Vec<u8>,
    rstart: usize,
    rend: usize,
    sbuf: Vec<u8>,
    ready: Vec<Completion>,
    lost: bool,
    next_expiry: Option<Instant>,
    spin: AdaptiveSpin,
}

// SAFETY: the raw pointers in `slots` are the local buffers of posted READs;
// the `post_reads` contract hands them to this connection exclusively until
// their completion, and they are only dereferenced through `&mut self`, so
// moving the connection to another thread moves that exclusive use with it.
unsafe impl Send for TcpConnection {}

impl TcpConnection {
    /// Connects to a responder and runs the handshake, each within
    /// [`ConnectionConfig::connect_timeout`].
    ///
    /// # Errors
    /// [`ConnectError::AuthFailed`] when the tokens differ; I/O and protocol
    /// errors otherwise (`TimedOut` or `WouldBlock` when the responder did
    /// not answer in time).
    pub fn connect(
        addr: impl ToSocketAddrs,
        config: ConnectionConfig,
    ) -> Result<Self, ConnectError> {
        let limit = config.connect_timeout.max(Duration::from_millis(1));
        let mut stream = handshake::connect_stream(addr, limit)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(limit))?;
        stream.set_write_timeout(Some(limit))?;
        handshake::client(&mut stream, MAGIC, &config.token)?;
        stream.set_read_timeout(Some(WAIT_QUANTUM))?;
        stream.set_write_timeout(Some(config.op_timeout))?;
        let n = config.max_outstanding.clamp(1, u32::MAX as usize);
        Ok(Self {
            stream,
            slots: (0..n).map(|_| (0, Slot::Free)).collect(),
            free: (0..n as u32).rev().collect(),
            outstanding: 0,
            rbuf: vec![0u8; 256 << 10],
            rstart: 0,
            rend: 0,
            sbuf: Vec::with_capacity(n.min(1024) * REQUEST_LEN),
            ready: Vec::new(),
            lost: false,
            next_expiry: None,
            spin: AdaptiveSpin::new(&spin::READER, config.spin),
            config,
        })
    }

    /// Marks the connection lost: every pending READ completes with
    /// [`ReadError::ConnectionLost`].
    fn lose(&mut self) {
        if self.lost {
            return;
        }
        self.lost = true;
        let _ = self.stream.shutdown(Shutdown::Both);
        for (i, (_, slot)) in self.slots.iter_mut().enumerate() {
            match std::mem::replace(slot, Slot::Free) {
                Slot::Pending { id, .. } => {
                    self.ready.push(Completion {
                        id,
                        result: Err(ReadError::ConnectionLost),
                    });
                    self.free.push(i as u32);
                }
                Slot::Abandoned { .. } => self.free.push(i as u32),
                Slot::Free => {}
            }
        }
        self.outstanding = 0;
        self.next_expiry = None;
    }

    /// Completes the READs whose operation timeout passed.
    fn expire(&mut self, now: Instant) {
        let mut next: Option<Instant> = None;
        for (_, slot) in &mut self.slots {
            if let Slot::Pending {
                id, len, deadline, ..
            } = *slot
            {
                if deadline <= now {
                    *slot = Slot::Abandoned { len };
                    self.outstanding -= 1;
                    self.ready.push(Completion {
                        id,
                        result: Err(ReadError::Timeout),
                    });
                } else {
                    next = Some(next.map_or(deadline, |n| n.min(deadline)));
                }
            }
        }
        self.next_expiry = next;
    }

    /// Moves ready completions and the complete responses in the receive
    /// buffer to `out`.
    fn drain(&mut self, out: &mut Vec<Completion>) -> usize {
        let before = out.len();
        out.append(&mut self.ready);
        while self.rend - self.rstart >= RESPONSE_HEADER_LEN {
            let h = &self.rbuf[self.rstart..self.rstart + RESPONSE_HEADER_LEN];
            let status = h[0];
            let len = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")) as usize;
            let wire = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
            let idx = (wire & 0xffff_ffff) as usize;
            let gen_ = (wire >> 32) as u32;
            let slot_len = match self.slots.get(idx) {
                Some((g, Slot::Pending { len, .. } | Slot::Abandoned { len })) if *g == gen_ => {
                    *len
                }
                _ => {
                    tracing::warn!(
                        "tcp connection: answer for no outstanding request; dropping the connection"
                    );
                    self.lose();
                    break;
                }
            };
            let payload = if status == ST_OK { len } else { 0 };
            if (status == ST_OK && len != slot_len) || (status != ST_OK && len != 0) {
                tracing::warn!("tcp connection: malformed answer; dropping the connection");
                self.lose();
                break;
            }
            let total = RESPONSE_HEADER_LEN + payload;
            if self.rend - self.rstart < total {
                if self.rstart + total > self.rbuf.len() {
                    self.rbuf.copy_within(self.rstart..self.rend, 0);
                    self.rend -= self.rstart;
                    self.rstart = 0;
                    if total > self.rbuf.len() {
                        self.rbuf.resize(total, 0);
                    }
                }
                break;
            }
            let body = self.rstart + RESPONSE_HEADER_LEN;
            let slot = std::mem::replace(&mut self.slots[idx].1, Slot::Free);
            self.free.push(idx as u32);
            if let Slot::Pending { id, local, len, .. } = slot {
                self.outstanding -= 1;
                let result = match status {
                    ST_OK => {
                        // SAFETY: `local..local + len` is the buffer of a
                        // posted, not yet completed READ (the `post_reads`
                        // contract keeps it valid and exclusively ours), and
                        // `body..body + len` lies in the receive buffer.
                        unsafe {
                            std::ptr::copy_nonoverlapping(self.rbuf.as_ptr().add(body), local, len)
                        };
                        Ok(())
                    }
                    ST_UNKNOWN_KEY => Err(ReadError::RemoteAccess(AccessFault::UnknownKey)),
                    ST_STALE_EPOCH => Err(ReadError::RemoteAccess(AccessFault::StaleEpoch)),
                    ST_OUT_OF_BOUNDS => Err(ReadError::RemoteAccess(AccessFault::OutOfBounds)),
                    _ => Err(ReadError::RemoteAccess(AccessFault::BadRequest)),
                };
                out.push(Completion { id, result });
            }
            self.rstart += total;
        }
        if self.rstart == self.rend {
            self.rstart = 0;
            self.rend = 0;
        }
        out.len() - before
    }

    /// One `recv` into the receive buffer. Returns false when it brought nothing.
    fn fill(&mut self, dontwait: bool) -> bool {
        if self.lost {
            return false;
        }
        if self.rend == self.rbuf.len() {
            self.rbuf.copy_within(self.rstart..self.rend, 0);
            self.rend -= self.rstart;
            self.rstart = 0;
            if self.rend == self.rbuf.len() {
                let n = self.rbuf.len() * 2;
                self.rbuf.resize(n, 0);
            }
        }
        let flags = if dontwait { libc::MSG_DONTWAIT } else { 0 };
        let spare = &mut self.rbuf[self.rend..];
        // SAFETY: `spare` is a writable slice of the receive buffer, valid
        // for `spare.len()` bytes; the fd is our connected socket.
        let n = unsafe {
            libc::recv(
                self.stream.as_raw_fd(),
                spare.as_mut_ptr().cast(),
                spare.len(),
                flags,
            )
        };
        if n > 0 {
            self.rend += n as usize;
            true
        } else if n == 0 {
            self.lose();
            false
        } else {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock
                | io::ErrorKind::Interrupted
                | io::ErrorKind::TimedOut => {}
                _ => {
                    tracing::debug!(error = %e, "tcp connection: recv failed");
                    self.lose();
                }
            }
            false
        }
    }

    fn check_expiry(&mut self) {
        if let Some(e) = self.next_expiry {
            let now = Instant::now();
            if now >= e {
                self.expire(now);
            }
        }
    }
}

// SAFETY: every accepted READ sits in a slot until exactly one of: its answer
// is parsed (`drain` copies into the buffer then frees the slot), its
// operation timeout passes (`expire` marks it abandoned: the late answer is
// skipped, never copied), or the connection is lost (`lose` completes it).
// Buffers are written only inside `drain`, i.e. inside `poll`/`wait`, before
// the completion is handed out.
unsafe impl Connection for TcpConnection {
    unsafe fn post_reads(&mut self, reads: &[ReadRequest]) -> Result<(), PostError> {
        if self.lost {
            return Err(PostError::ConnectionLost);
        }
        if reads.len() > self.free.len()
            || self.outstanding + reads.len() > self.config.max_outstanding
        {
            return Err(PostError::QueueFull {
                outstanding: self.outstanding,
                requested: reads.len(),
                limit: self.config.max_outstanding,
            });
        }
        let limit = self.config.max_read_len.min(u32::MAX as usize);
        if let Some(r) = reads.iter().find(|r| r.len == 0 || r.len > limit) {
            return Err(PostError::InvalidLength { len: r.len, limit });
        }
        let deadline = Instant::now() + self.config.op_timeout;
        self.sbuf.clear();
        for r in reads {
            let idx = self.free.pop().expect("checked above");
            let (gen_, slot) = &mut self.slots[idx as usize];
            *gen_ = gen_.wrapping_add(1);
            *slot = Slot::Pending {
                id: r.id,
                local: r.local,
                len: r.len,
                deadline,
            };
            let wire = (u64::from(*gen_) << 32) | u64::from(idx);
            let b = &mut self.sbuf;
            b.extend_from_slice(&[OP_READ, 0, 0, 0]);
            b.extend_from_slice(&(r.len as u32).to_le_bytes());
            b.extend_from_slice(&wire.to_le_bytes());
            b.extend_from_slice(&r.remote_addr.to_le_bytes());
            b.extend_from_slice(&r.region.rkey.to_le_bytes());
            b.extend_from_slice(&[0; 4]);
            b.extend_from_slice(&r.region.epoch.to_le_bytes());
        }
        self.outstanding += reads.len();
        if self.next_expiry.is_none() {
            self.next_expiry = Some(deadline);
        }
        if let Err(e) = self.stream.write_all(&self.sbuf) {
            tracing::debug!(error = %e, "tcp connection: send failed");
            self.lose();
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        let n = self.drain(out);
        if n > 0 || self.outstanding == 0 {
            return n;
        }
        if self.fill(true) {
            return self.drain(out);
        }
        self.check_expiry();
        self.drain(out)
    }

    fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> usize {
        if timeout.is_zero() {
            return self.poll(out);
        }
        let start = Instant::now();
        // Spin first (non-blocking recvs) while the adaptive window and the
        // process's reader budget allow, then block.
        let mut episode: Option<spin::Episode> = None;
        let mut spin_tried = false;
        let mut blocked_since: Option<Instant> = None;
        loop {
            let mut n = self.drain(out);
            let mut done = n > 0 || self.outstanding == 0;
            if !done {
                self.check_expiry();
                if !self.ready.is_empty() {
                    continue;
                }
            }
            let now = Instant::now();
            if !done && now.duration_since(start) >= timeout {
                (n, done) = (0, true);
            }
            if done {
                if let Some(ep) = episode.take() {
                    self.spin.end(ep, n > 0);
                }
                if let Some(b) = blocked_since {
                    self.spin.blocked(now.duration_since(b));
                }
                return n;
            }
            if !spin_tried {
                spin_tried = true;
                episode = self.spin.begin();
            }
            if let Some(ep) = &mut episode {
                if now < ep.until.min(start + timeout) {
                    if !self.fill(true) {
                        ep.pause();
                    }
                    continue;
                }
                let ep = episode.take().expect("just matched");
                self.spin.end(ep, false);
            }
            blocked_since.get_or_insert(now);
            // Blocking recv: returns as soon as bytes arrive, or after the
            // socket's WAIT_QUANTUM receive timeout.
            self.fill(false);
        }
    }

    fn outstanding(&self) -> usize {
        self.outstanding
    }

    fn limits(&self) -> Limits {
        Limits {
            max_outstanding: self.config.max_outstanding,
            max_read_len: self.config.max_read_len,
        }
    }

    fn readiness_fd(&self) -> Option<RawFd> {
        Some(self.stream.as_raw_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(op: u8, len: u32, id: u64, addr: u64, rkey: u32, epoch: u64) -> Vec<u8> {
        let mut b = vec![op, 0, 0, 0];
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(&id.to_le_bytes());
        b.extend_from_slice(&addr.to_le_bytes());
        b.extend_from_slice(&rkey.to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        b.extend_from_slice(&epoch.to_le_bytes());
        assert_eq!(b.len(), REQUEST_LEN);
        b
    }

    fn response(s: &mut TcpStream) -> (u8, u64, Vec<u8>) {
        let mut h = [0u8; RESPONSE_HEADER_LEN];
        s.read_exact(&mut h).expect("header");
        let len = u32::from_le_bytes(h[4..8].try_into().expect("4")) as usize;
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).expect("payload");
        (
            h[0],
            u64::from_le_bytes(h[8..16].try_into().expect("8")),
            body,
        )
    }

    /// `connections` counts open connections (handshake included) and drops
    /// one when its reader goes away; `accepted` only grows.
    #[test]
    fn connections_are_counted_while_open() {
        let resp =
            TcpResponder::bind("127.0.0.1:0", ResponderConfig::new(b"t".to_vec())).expect("bind");
        assert_eq!((resp.connections(), resp.accepted()), (0, 0));
        let until = |what: &str, ok: &dyn Fn() -> bool| {
            let t0 = std::time::Instant::now();
            while !ok() {
                assert!(t0.elapsed() < Duration::from_secs(10), "{what}");
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        let mut a = TcpStream::connect(resp.local_addr()).expect("connect");
        handshake::client(&mut a, MAGIC, b"t").expect("handshake");
        let b = TcpStream::connect(resp.local_addr()).expect("connect");
        until("two open", &|| resp.connections() == 2);
        drop(b);
        until("one open after a reader left", &|| resp.connections() == 1);
        drop(a);
        until("none open", &|| resp.connections() == 0);
        assert_eq!(resp.accepted(), 2);
    }

    /// Malformed requests on the wire get error replies, in order, and the
    /// connection keeps serving; a request split across writes is served.
    #[test]
    fn malformed_requests_get_error_replies() {
        let mut config = ResponderConfig::new(b"t".to_vec());
        config.max_read_len = 1 << 16;
        let resp = TcpResponder::bind("127.0.0.1:0", config).expect("bind");
        let r = resp.register(8192).expect("register");
        r.write_bytes(0, &(0..=255u8).cycle().take(8192).collect::<Vec<_>>());
        let d = r.descriptor();
        let mut s = TcpStream::connect(resp.local_addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        handshake::client(&mut s, MAGIC, b"t").expect("handshake");
        let mut batch = Vec::new();
        batch.extend(request(9, 16, 1, d.addr, d.rkey, d.epoch)); // unknown opcode
        batch.extend(request(OP_READ, 0, 2, d.addr, d.rkey, d.epoch)); // zero length
        batch.extend(request(OP_READ, 1 << 20, 3, d.addr, d.rkey, d.epoch)); // over max_read_len
        batch.extend(request(OP_READ, 16, 4, d.addr + 8190, d.rkey, d.epoch)); // past the end
        batch.extend(request(OP_READ, 16, 5, u64::MAX - 3, d.rkey, d.epoch)); // wraps
        batch.extend(request(OP_READ, 16, 6, d.addr, d.rkey ^ 1, d.epoch)); // wrong rkey
        batch.extend(request(OP_READ, 16, 7, d.addr, d.rkey, d.epoch ^ 1)); // stale epoch
        batch.extend(request(OP_READ, 4, 8, d.addr + 8188, d.rkey, d.epoch)); // last 4 bytes
        s.write_all(&batch).expect("send");
        let expect = [
            (ST_BAD_REQUEST, 1),
            (ST_BAD_REQUEST, 2),
            (ST_BAD_REQUEST, 3),
            (ST_OUT_OF_BOUNDS, 4),
            (ST_OUT_OF_BOUNDS, 5),
            (ST_UNKNOWN_KEY, 6),
            (ST_STALE_EPOCH, 7),
        ];
        for (st, id) in expect {
            let (got_st, got_id, body) = response(&mut s);
            assert_eq!((got_st, got_id, body.len()), (st, id, 0));
        }
        assert_eq!(response(&mut s), (ST_OK, 8, vec![252, 253, 254, 255]));
        // One request in two writes.
        let req = request(OP_READ, 3, 9, d.addr + 1, d.rkey, d.epoch);
        s.write_all(&req[..17]).expect("send part");
        std::thread::sleep(Duration::from_millis(20));
        s.write_all(&req[17..]).expect("send rest");
        assert_eq!(response(&mut s), (ST_OK, 9, vec![1, 2, 3]));
    }
}
