//! The owner's side of `tcp`: [`TcpOwner`] registers regions and serves
//! READs of them, one accept thread and one serving thread per connection.
//! A serving thread answers every whole request one `recv` brought in, under
//! the region table's read lock, with one `send`; dropping a [`TcpRegion`]
//! takes the write lock, so no serving thread reads its memory afterwards.
//! A CALL runs the process's [`CallHandler`] on the serving thread, with no
//! lock held, after the answers before it have been sent.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::copy::{Chaos, copy_from_shared_raw};
use crate::memory::{Memory, MemoryOwner, choose_epoch};
use crate::spin::AdaptiveSpin;
use crate::{LocalRegion, OwnerError, RegionDescriptor, RegisterError, handshake, spin};

use super::wire::{
    CALL_REPLY_SLACK, MAGIC, MAX_CALL_ARG, OP_CALL, OP_READ, REQUEST_LEN, RESPONSE_HEADER_LEN,
    Request, ST_BAD_REQUEST, ST_NO_HANDLER, ST_OK, ST_OUT_OF_BOUNDS, ST_STALE_EPOCH,
    ST_UNKNOWN_KEY, push_header,
};
use super::{DEFAULT_SPIN, HANDSHAKE_TIMEOUT};

/// Settings of a [`TcpOwner`].
#[derive(Debug, Clone)]
pub struct OwnerConfig {
    /// Cluster token every client must prove it holds.
    pub token: Vec<u8>,
    /// Test mode: chaotic copies (see [`Chaos`]).
    pub chaos: Option<Chaos>,
    /// Largest READ served, in bytes.
    pub max_read_len: u32,
    /// The epoch every descriptor of this owner carries (the node's
    /// incarnation); `None` picks a random one. Zero is reserved
    /// ([`OwnerError::ZeroEpoch`]).
    pub epoch: Option<u64>,
    /// How long a serving thread polls its socket without blocking after
    /// answering, before it blocks; zero blocks at once. At most
    /// `available_parallelism() - 1` threads of the process spin at once.
    pub spin: Duration,
}

impl OwnerConfig {
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

/// What a [`TcpOwner`] runs for each CALL: the argument, and the reply
/// to append to the vector (which holds other answers before it: append
/// only). It runs on the serving thread of the caller's connection, which
/// answers nothing else meanwhile.
pub type CallHandler = Arc<dyn Fn(&[u8], &mut Vec<u8>) + Send + Sync>;

struct RegionMem {
    mem: Memory,
    rkey: u32,
    epoch: u64,
}

struct Shared {
    config: OwnerConfig,
    /// The spin serving threads use now, ns: `config.spin` until
    /// [`TcpOwner::set_spin`].
    spin_ns: AtomicU64,
    epoch: u64,
    regions: RwLock<HashMap<u32, Arc<RegionMem>>>,
    handler: RwLock<Option<CallHandler>>,
    closed: AtomicBool,
    next_conn: AtomicU64,
    conns: Mutex<HashMap<u64, TcpStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// The owner's side of `tcp`: registers regions and serves READs of them.
///
/// One thread accepts, one thread per connection serves. Dropping the
/// owner (or [`TcpOwner::shutdown`]) closes every connection.
pub struct TcpOwner {
    shared: Arc<Shared>,
    listener: TcpListener,
    addr: SocketAddr,
}

impl TcpOwner {
    /// Listens on `addr` (use port 0 for any free port) and starts serving.
    ///
    /// # Errors
    /// [`OwnerError::ZeroEpoch`] when the config asks for epoch 0;
    /// [`OwnerError::Io`] when the socket could not be bound.
    pub fn bind(addr: impl ToSocketAddrs, config: OwnerConfig) -> Result<Self, OwnerError> {
        let epoch = choose_epoch(config.epoch)?;
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            spin_ns: AtomicU64::new(duration_ns(config.spin)),
            config,
            epoch,
            regions: RwLock::new(HashMap::new()),
            handler: RwLock::new(None),
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

    /// Changes the adaptive polling of every serving thread (see
    /// [`OwnerConfig::spin`]); each takes it up at its next request.
    pub fn set_spin(&self, spin: Duration) {
        self.shared
            .spin_ns
            .store(duration_ns(spin), Ordering::Relaxed);
    }

    /// Installs the handler every later CALL runs (replacing any earlier
    /// one). Until one is installed, CALLs are answered `no handler`
    /// ([`CallError::NoHandler`](crate::CallError::NoHandler)).
    pub fn set_call_handler(&self, handler: CallHandler) {
        *self.shared.handler.write().expect("handler lock") = Some(handler);
    }

    /// The epoch every descriptor of this owner carries.
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

    /// Connections accepted since the owner started.
    #[must_use]
    pub fn accepted(&self) -> u64 {
        self.shared.next_conn.load(Ordering::Relaxed)
    }

    /// Allocates and registers `len` zeroed bytes (page-aligned) for remote READ.
    ///
    /// # Errors
    /// Zero length, a failed mapping, or a closed owner.
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
    /// served in place exactly like a region of [`TcpOwner::register`]
    /// (same rkey, epoch and bounds checks). The region keeps `owner` alive
    /// until it is dropped; after the drop returns, the owner never
    /// touches the memory again and READs of it fail with
    /// [`AccessFault::UnknownKey`](crate::AccessFault::UnknownKey).
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
    /// owner.
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
    /// client side with [`ReadError::ConnectionLost`](crate::ReadError::ConnectionLost).
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
        let me = std::thread::current().id();
        for t in threads {
            // A call handler may drop the last owner of this responder (the
            // node daemon's handler holds its node for the call): its own
            // serving thread then runs this, and ends right after.
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}

impl Drop for TcpOwner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A region registered with a [`TcpOwner`]; deregistered on drop (after
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
    // Room for a whole CALL (40 bytes and its argument) behind the partial
    // request a `recv` may leave.
    let mut input = vec![0u8; 64 << 10];
    const _: () = assert!(2 * (REQUEST_LEN + MAX_CALL_ARG) <= 64 << 10);
    let mut have = 0;
    // Bytes of a refused CALL's argument still to skip.
    let mut discard = 0usize;
    let mut out: Vec<u8> = Vec::with_capacity(256 << 10);
    let mut spin_ns = shared.spin_ns.load(Ordering::Relaxed);
    let mut spin = AdaptiveSpin::new(&spin::RESPONDER, Duration::from_nanos(spin_ns));
    loop {
        let now_ns = shared.spin_ns.load(Ordering::Relaxed);
        if now_ns != spin_ns {
            spin_ns = now_ns;
            spin = AdaptiveSpin::new(&spin::RESPONDER, Duration::from_nanos(spin_ns));
        }
        let n = recv_request(&mut stream, &mut input[have..], shared, &mut spin)?;
        if n == 0 || shared.closed.load(Ordering::Acquire) {
            return Ok(());
        }
        have += n;
        out.clear();
        let mut at = 0;
        {
            // Taken at the first READ, let go before a CALL's handler runs.
            let mut regions = None;
            loop {
                if discard > 0 {
                    let d = discard.min(have - at);
                    (at, discard) = (at + d, discard - d);
                    if discard > 0 {
                        break;
                    }
                }
                if have - at < REQUEST_LEN {
                    break;
                }
                let req = Request::decode(&input[at..at + REQUEST_LEN]);
                if req.op != OP_CALL {
                    let r =
                        regions.get_or_insert_with(|| shared.regions.read().expect("regions lock"));
                    answer(req, r, &shared.config, &mut out);
                    at += REQUEST_LEN;
                    continue;
                }
                let (len, id) = (req.len as usize, req.id);
                if len > MAX_CALL_ARG {
                    // Refused, and its argument skipped as it comes in.
                    push_header(&mut out, ST_BAD_REQUEST, 0, id);
                    (at, discard) = (at + REQUEST_LEN, len);
                    continue;
                }
                if have - at < REQUEST_LEN + len {
                    break;
                }
                regions = None;
                // The answers before the call go out first: the handler may
                // take a while (a backing read).
                if !out.is_empty() {
                    stream.write_all(&out)?;
                    out.clear();
                }
                let arg = &input[at + REQUEST_LEN..at + REQUEST_LEN + len];
                call(arg, id, req.epoch, shared, &mut out);
                at += REQUEST_LEN + len;
            }
        }
        input.copy_within(at..have, 0);
        have -= at;
        if !out.is_empty() {
            stream.write_all(&out)?;
        }
    }
}

/// Appends the answer to one CALL: the handler's reply, or why there is
/// none.
fn call(arg: &[u8], id: u64, epoch: u64, shared: &Shared, out: &mut Vec<u8>) {
    if epoch != shared.epoch {
        push_header(out, ST_STALE_EPOCH, 0, id);
        return;
    }
    let handler = shared.handler.read().expect("handler lock").clone();
    let Some(handler) = handler else {
        push_header(out, ST_NO_HANDLER, 0, id);
        return;
    };
    let at = out.len();
    push_header(out, ST_OK, 0, id);
    handler(arg, out);
    let len = out.len() - at - RESPONSE_HEADER_LEN;
    let limit = (shared.config.max_read_len as usize).saturating_add(CALL_REPLY_SLACK);
    match u32::try_from(len) {
        Ok(l) if len <= limit => out[at + 4..at + 8].copy_from_slice(&l.to_le_bytes()),
        _ => {
            tracing::warn!(
                len,
                limit,
                "tcp responder: a call handler's reply is too long; answering bad request"
            );
            out.truncate(at);
            push_header(out, ST_BAD_REQUEST, 0, id);
        }
    }
}

/// Receives the next request bytes: polls without blocking while `spin`
/// allows (its window, the process's budget), then blocks. Returns 0 at end
/// of stream or when the owner closed.
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
            let now = Instant::now();
            if now >= ep.until {
                spin.end(ep, false);
                break;
            }
            ep.pause(now);
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
    req: Request,
    regions: &HashMap<u32, Arc<RegionMem>>,
    config: &OwnerConfig,
    out: &mut Vec<u8>,
) {
    let Request {
        op,
        len,
        id,
        addr,
        rkey,
        epoch,
    } = req;
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

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::super::wire::RESPONSE_HEADER_LEN;
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
        let resp = TcpOwner::bind("127.0.0.1:0", OwnerConfig::new(b"t".to_vec())).expect("bind");
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
        let mut config = OwnerConfig::new(b"t".to_vec());
        config.max_read_len = 1 << 16;
        let resp = TcpOwner::bind("127.0.0.1:0", config).expect("bind");
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

    /// A CALL whose argument is longer than the wire allows is refused and
    /// its argument skipped, even when it comes in pieces; a CALL split
    /// across writes, and the READ behind it, are served.
    #[test]
    fn an_oversized_call_is_refused_and_skipped() {
        let resp = TcpOwner::bind("127.0.0.1:0", OwnerConfig::new(b"t".to_vec())).expect("bind");
        let r = resp.register(4096).expect("register");
        r.write_bytes(0, &[9; 4096]);
        let d = r.descriptor();
        resp.set_call_handler(Arc::new(|arg: &[u8], out: &mut Vec<u8>| {
            out.extend_from_slice(arg);
        }));
        let mut s = TcpStream::connect(resp.local_addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        handshake::client(&mut s, MAGIC, b"t").expect("handshake");
        let big = vec![0xAB; MAX_CALL_ARG + 5000];
        let mut req = Vec::new();
        super::super::wire::push_call(&mut req, 1, d.epoch, &big);
        req.extend(request(OP_READ, 2, 2, d.addr, d.rkey, d.epoch));
        super::super::wire::push_call(&mut req, 3, d.epoch, b"abc");
        for part in req.chunks(7000) {
            s.write_all(part).expect("send");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(response(&mut s), (ST_BAD_REQUEST, 1, vec![]));
        assert_eq!(response(&mut s), (ST_OK, 2, vec![9, 9]));
        assert_eq!(response(&mut s), (ST_OK, 3, b"abc".to_vec()));
    }
}
