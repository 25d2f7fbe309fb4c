//! The reader's side of `tcp`: a [`TcpConnection`] keeps one slot per
//! request in flight (the wire request id is the slot's index and
//! generation, so a late answer to a timed-out READ is recognised and
//! skipped), writes a batch of requests with one `send`, and parses answers
//! out of one receive buffer into the callers' buffers. A CALL
//! ([`TcpConnection::call`]) takes a slot of its own on an idle connection
//! and waits for its reply like a READ.

use std::io::{self, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use crate::spin::AdaptiveSpin;
use crate::{
    AccessFault, CallError, Completion, ConnectError, Connection, Limits, PostError, ReadError,
    ReadRequest, handshake, spin,
};

use super::wire::{
    CALL_REPLY_SLACK, MAGIC, MAX_CALL_ARG, REQUEST_LEN, RESPONSE_HEADER_LEN, ResponseHeader,
    ST_NO_HANDLER, ST_OK, ST_OUT_OF_BOUNDS, ST_STALE_EPOCH, ST_UNKNOWN_KEY, push_call, push_read,
};
use super::{DEFAULT_SPIN, HANDSHAKE_TIMEOUT};

/// Granularity of a blocking `wait`.
const WAIT_QUANTUM: Duration = Duration::from_millis(10);

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
    /// Bytes of one READ, at most (the owner may allow less).
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
    /// A CALL waiting for its reply (any length up to the reply limit).
    Call {
        deadline: Instant,
    },
    /// Timed out and completed; its late answer is still to be skipped
    /// (`None`: a CALL's, of any length).
    Abandoned {
        len: Option<usize>,
    },
}

/// A reader's connection to a [`TcpOwner`](super::TcpOwner).
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
    /// The outcome of the CALL in flight, once there is one.
    call_done: Option<Result<Vec<u8>, CallError>>,
    /// A CALL's answer arrived since the current wait began (the wait's
    /// spin, if any, caught a message though it completed no READ).
    call_answered: bool,
}

// SAFETY: the raw pointers in `slots` are the local buffers of posted READs;
// the `post_reads` contract hands them to this connection exclusively until
// their completion, and they are only dereferenced through `&mut self`, so
// moving the connection to another thread moves that exclusive use with it.
unsafe impl Send for TcpConnection {}

impl TcpConnection {
    /// Connects to a [`TcpOwner`](super::TcpOwner) and runs the handshake, each within
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
            call_done: None,
            call_answered: false,
            config,
        })
    }

    /// Sends `arg` to the owner's call handler (see the wire format in
    /// `wire.rs`) and waits up to `timeout` for its reply. `epoch` is the
    /// owner's (a region descriptor's): a call meant for an earlier
    /// incarnation is refused. Waits like [`Connection::wait`] (spinning
    /// first). The connection must be idle: a call with READs outstanding
    /// is refused ([`CallError::Busy`]) before anything is sent.
    ///
    /// # Errors
    /// [`CallError`]: `Busy` and `TooLong` sent nothing; `NoHandler` and
    /// `Refused` leave the connection usable; after `Timeout` the late
    /// reply is skipped when it comes; `ConnectionLost` is for good.
    pub fn call(
        &mut self,
        epoch: u64,
        arg: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, CallError> {
        if self.lost {
            return Err(CallError::ConnectionLost);
        }
        if self.outstanding > 0 {
            return Err(CallError::Busy(self.outstanding));
        }
        if arg.len() > MAX_CALL_ARG {
            return Err(CallError::TooLong {
                len: arg.len(),
                limit: MAX_CALL_ARG,
            });
        }
        // Every slot can be waiting for a late answer to skip.
        let Some(idx) = self.free.pop() else {
            return Err(CallError::Busy(0));
        };
        let deadline = Instant::now() + timeout;
        let (gen_, slot) = &mut self.slots[idx as usize];
        *gen_ = gen_.wrapping_add(1);
        *slot = Slot::Call { deadline };
        let wire = (u64::from(*gen_) << 32) | u64::from(idx);
        self.sbuf.clear();
        push_call(&mut self.sbuf, wire, epoch, arg);
        self.outstanding += 1;
        self.next_expiry = Some(self.next_expiry.map_or(deadline, |n| n.min(deadline)));
        self.call_done = None;
        if let Err(e) = self.stream.write_all(&self.sbuf) {
            tracing::debug!(error = %e, "tcp connection: send failed");
            self.lose();
        }
        let mut none = Vec::new();
        self.call_answered = false;
        loop {
            if let Some(r) = self.call_done.take() {
                return r;
            }
            // Returns once the call completed (nothing else is outstanding),
            // or at the deadline, when `expire` completes it.
            let left = deadline.saturating_duration_since(Instant::now());
            self.wait(&mut none, left.max(WAIT_QUANTUM));
            debug_assert!(none.is_empty(), "a call's wait completed a READ");
        }
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
                Slot::Call { .. } => {
                    self.call_done = Some(Err(CallError::ConnectionLost));
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
            match *slot {
                Slot::Pending {
                    id, len, deadline, ..
                } => {
                    if deadline <= now {
                        *slot = Slot::Abandoned { len: Some(len) };
                        self.outstanding -= 1;
                        self.ready.push(Completion {
                            id,
                            result: Err(ReadError::Timeout),
                        });
                    } else {
                        next = Some(next.map_or(deadline, |n| n.min(deadline)));
                    }
                }
                Slot::Call { deadline } => {
                    if deadline <= now {
                        *slot = Slot::Abandoned { len: None };
                        self.outstanding -= 1;
                        self.call_done = Some(Err(CallError::Timeout));
                    } else {
                        next = Some(next.map_or(deadline, |n| n.min(deadline)));
                    }
                }
                Slot::Free | Slot::Abandoned { .. } => {}
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
            let ResponseHeader {
                status,
                len,
                id: wire,
            } = ResponseHeader::decode(&self.rbuf[self.rstart..self.rstart + RESPONSE_HEADER_LEN]);
            let len = len as usize;
            let idx = (wire & 0xffff_ffff) as usize;
            let gen_ = (wire >> 32) as u32;
            // `None`: a CALL's reply, of any length up to the limit.
            let slot_len = match self.slots.get(idx) {
                Some((g, Slot::Pending { len, .. })) if *g == gen_ => Some(*len),
                Some((g, Slot::Abandoned { len })) if *g == gen_ => *len,
                Some((g, Slot::Call { .. })) if *g == gen_ => None,
                _ => {
                    tracing::warn!(
                        "tcp connection: answer for no outstanding request; dropping the connection"
                    );
                    self.lose();
                    break;
                }
            };
            let payload = if status == ST_OK { len } else { 0 };
            let reply_limit = self.config.max_read_len.saturating_add(CALL_REPLY_SLACK);
            let fits = slot_len.map_or(len <= reply_limit, |l| l == len);
            if (status == ST_OK && !fits) || (status != ST_OK && len != 0) {
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
            if let Slot::Call { .. } = slot {
                self.outstanding -= 1;
                self.call_answered = true;
                self.call_done = Some(match status {
                    ST_OK => Ok(self.rbuf[body..body + len].to_vec()),
                    ST_NO_HANDLER => Err(CallError::NoHandler),
                    ST_STALE_EPOCH => Err(CallError::Refused(AccessFault::StaleEpoch)),
                    ST_UNKNOWN_KEY => Err(CallError::Refused(AccessFault::UnknownKey)),
                    ST_OUT_OF_BOUNDS => Err(CallError::Refused(AccessFault::OutOfBounds)),
                    _ => Err(CallError::Refused(AccessFault::BadRequest)),
                });
            }
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
            push_read(
                &mut self.sbuf,
                r.len as u32,
                wire,
                r.remote_addr,
                r.region.rkey,
                r.region.epoch,
            );
        }
        self.outstanding += reads.len();
        self.next_expiry = Some(self.next_expiry.map_or(deadline, |n| n.min(deadline)));
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
                // A message caught: READs completed, or the CALL's answer
                // (which completes none). Counting only READs left a
                // connection that carries only calls (the one beside an
                // shm reader) never catching: its cooldown after a
                // preemption never shrank again, so it mostly blocked.
                let caught = n > 0 || std::mem::take(&mut self.call_answered);
                if let Some(ep) = episode.take() {
                    self.spin.end(ep, caught);
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
                        ep.pause(now);
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
    use std::sync::Arc;

    use super::*;
    use crate::spin::SpinBudget;
    use crate::tcp::{OwnerConfig, TcpOwner};
    use crate::{LocalRegion, RegionDescriptor};

    /// A spin that catches a CALL's answer counts as caught, as one that
    /// catches a READ's does: the window and the cooldown after a
    /// preemption learn from calls too.
    #[test]
    fn a_spin_that_catches_a_call_answer_counts_as_caught() {
        let owner = TcpOwner::bind("127.0.0.1:0", OwnerConfig::new(b"t".to_vec())).expect("bind");
        let r = owner.register(4096).expect("register");
        let d: RegionDescriptor = r.descriptor();
        owner.set_call_handler(Arc::new(|arg: &[u8], out: &mut Vec<u8>| {
            out.extend_from_slice(arg);
        }));
        let mut c =
            TcpConnection::connect(owner.local_addr(), ConnectionConfig::new(b"t".to_vec()))
                .expect("connect");
        // A budget of its own, so that other tests' waiters cannot take
        // the spin slot; a window far longer than a loopback call.
        let budget: &'static SpinBudget = Box::leak(Box::new(SpinBudget::new(Some(1))));
        c.spin = AdaptiveSpin::new(budget, Duration::from_millis(5));
        for i in 0..400u32 {
            let arg = i.to_le_bytes();
            let got = c
                .call(d.epoch, &arg, Duration::from_secs(10))
                .expect("call");
            assert_eq!(got, arg);
        }
        let s = budget.snapshot();
        // Each wait spins unless it cools down after a preemption; five
        // preemptions in a row without a catch between them would be
        // needed to spend 400 waits cooling.
        assert!(s.spins > 0, "no wait spun: {s:?}");
        assert!(s.caught > 0, "no spin caught a call's answer: {s:?}");
    }
}
