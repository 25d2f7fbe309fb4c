//! One connection shared by every thread of a process.
//!
//! RC queue pairs are a scarce resource on the owner's NIC (each one is
//! state the NIC caches; see ARCHITECTURE.md, "Connections"), so a reader
//! process opens one connection per owner and every thread reads through
//! it. [`SharedConnection`] wraps any [`Connection`] (single poster, `&mut
//! self`) and hands out [`SharedHandle`]s, each a [`Connection`] of its
//! own that a thread owns. The handles post into the one connection and
//! each gets back exactly the completions of its own requests.
//!
//! # Protocol
//!
//! **State.** One mutex holds the inner connection and, per live handle, a
//! queue of completions that arrived for it. A handle owns a slab of the
//! caller ids it has outstanding.
//!
//! **Ids.** A handle posts request `i` of its slab with the wire id
//! `handle << 32 | i`; the caller's own id stays in the slab. Whoever polls
//! the inner connection (any handle, under the mutex) files each completion
//! in the queue of the handle its id names; a handle takes its own queue
//! and translates slab indexes back to its caller's ids.
//!
//! **Buffers.** The inner connection writes a request's local buffer when
//! its completion is polled, possibly by another handle's thread. That is
//! inside the `post_reads` contract: the poster keeps the buffer valid and
//! untouched until its handle returns the completion, which is after the
//! write (the mutex orders the inner poll before the queue is taken). A
//! handle dropped with requests outstanding waits for their completions
//! first (every accepted request completes, with an error at worst after
//! the inner connection's operation timeout), so no buffer is written after
//! its handle is gone.
//!
//! **Broken.** A `ConnectionLost` completion or post marks the shared
//! connection broken ([`SharedConnection::is_broken`]): whoever hands out
//! handles opens a fresh connection for new readers instead.
//!
//! **Waiting.** By default a waiting handle runs the inner connection's
//! blocking wait under the mutex, for at most [`WAIT_SLICE`] at a time, so
//! a thread posting waits at most that long behind another thread's wait.
//! A connection shared with [`SharedConnection::waiting_on_fd`] is waited
//! on without the mutex instead. One handle at a time polls (`polling`):
//! under the mutex it polls the inner connection (non-blocking), arms its
//! readiness descriptor, polls once more, marks itself the poller and lets
//! go of the mutex; then it spins on the descriptor (`poll(2)` with no
//! timeout) within the connection's adaptive window and the process's
//! budget of spinning readers (`spin`, as a `tcp` connection's own wait),
//! and sleeps on it for the rest of [`WAIT_SLICE`]. It then takes the
//! mutex, stops being the poller, and files what arrived. Every other
//! waiting handle records its thread in its queue and parks (at most
//! [`WAIT_SLICE`]); filing a completion unparks exactly the handle it
//! belongs to, and a poller that returns unparks one handle still waiting
//! with nothing filed, which polls next. So a round trip wakes only the
//! threads it completed, never every waiter. A parked handle woken by a
//! stale unpark or its slice re-checks and parks again. A completion that
//! arrives between the last poll and the spin leaves the descriptor
//! readable (the arm contract), so nothing is missed; an unpark that comes
//! between recording the thread and parking makes the park return at once
//! (the thread's token). Posting never waits behind a wait, so several
//! threads keep several READs in flight on the one connection (`tcp`,
//! whose own wait would otherwise hold the mutex for each round trip).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::spin::{self, AdaptiveSpin};
use crate::{Completion, Connection, Limits, PostError, ReadError, ReadRequest};

/// The longest a waiting handle holds the shared connection's lock.
pub const WAIT_SLICE: Duration = Duration::from_micros(200);

/// How long a handle whose batch does not fit (other threads' READs fill
/// the connection) keeps polling for room before it reports `QueueFull`.
const ROOM_WAIT: Duration = Duration::from_secs(1);

struct Inner<C> {
    conn: C,
    /// Each live handle's completions and, while it sleeps, its thread.
    queues: HashMap<u32, Queue>,
    scratch: Vec<Completion>,
    /// A handle reads the connection now without the mutex (`waiting_on_fd`:
    /// it spins on, then sleeps on, the readiness descriptor); the others
    /// sleep until it files theirs or hands the polling on.
    polling: bool,
}

/// One handle's place in [`Inner`].
#[derive(Default)]
struct Queue {
    /// Completions filed for the handle, with wire ids.
    done: Vec<Completion>,
    /// The handle's thread while it sleeps waiting for them: unparked by
    /// whoever files one, or by a poller that stops polling.
    sleeper: Option<std::thread::Thread>,
}

struct Shared<C> {
    inner: Mutex<Inner<C>>,
    next_handle: AtomicU32,
    broken: AtomicBool,
    limits: Limits,
    /// The inner connection's [`Connection::ordered_reads`].
    ordered: bool,
    /// Handles sleep on this descriptor without the mutex (None: they wait
    /// on the inner connection under it).
    fd: Option<std::os::fd::RawFd>,
    /// The polling handle's spin window (with `fd`): one per connection,
    /// used only by the handle that polls, so never contended.
    spin: Mutex<AdaptiveSpin>,
}

impl<C: Connection> Shared<C> {
    fn lock(&self) -> MutexGuard<'_, Inner<C>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes what the inner connection completed (waiting up to `wait`
    /// for something when it is not zero) and files it into the handles'
    /// queues.
    fn pump(&self, inner: &mut Inner<C>, wait: Duration) {
        if wait.is_zero() {
            inner.conn.poll(&mut inner.scratch);
        } else {
            inner.conn.wait(&mut inner.scratch, wait);
        }
        self.file(inner);
    }

    /// Files the completions in `inner.scratch` into their handles' queues,
    /// waking each sleeping handle that got one (and no other).
    fn file(&self, inner: &mut Inner<C>) {
        let Inner {
            queues, scratch, ..
        } = inner;
        for c in scratch.drain(..) {
            if matches!(c.result, Err(ReadError::ConnectionLost)) {
                self.broken.store(true, Ordering::Relaxed);
            }
            let h = (c.id >> 32) as u32;
            // A handle's queue lives until the handle is gone, and a handle
            // goes only after its last completion: every id finds its queue.
            if let Some(q) = queues.get_mut(&h) {
                q.done.push(c);
                if let Some(t) = q.sleeper.take() {
                    t.unpark();
                }
            } else {
                debug_assert!(false, "a completion for handle {h}, which is gone");
            }
        }
    }

    /// A poller that stops polling wakes one sleeping handle that has
    /// nothing yet, which then polls in its place: without it, handles
    /// woken only by their own completions would wait out their sleep
    /// with nobody reading the connection.
    fn hand_off(inner: &mut Inner<C>) {
        if let Some(t) = inner
            .queues
            .values_mut()
            .find(|q| q.done.is_empty() && q.sleeper.is_some())
            .and_then(|q| q.sleeper.take())
        {
            t.unpark();
        }
    }

    /// The polling handle's wait (without the lock): spins on `fd` while
    /// the connection's window and the process's budget allow, then
    /// sleeps on it for what is left of `slice`.
    fn await_readable(&self, fd: std::os::fd::RawFd, slice: Duration) {
        let start = Instant::now();
        let mut spin = self.spin.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mut ep) = spin.begin() {
            let until = ep.until.min(start + slice);
            loop {
                if readable(fd) {
                    spin.end(ep, true);
                    return;
                }
                let now = Instant::now();
                if now >= until {
                    break;
                }
                ep.pause(now);
            }
            spin.end(ep, false);
        }
        let slept = Instant::now();
        sleep_readable(fd, slice.saturating_sub(start.elapsed()));
        spin.blocked(slept.elapsed());
    }
}

/// Whether `fd` is readable now (no wait).
fn readable(fd: std::os::fd::RawFd) -> bool {
    poll_readable(fd, 0)
}

/// Sleeps until `fd` is readable or `limit` passes (a signal ends it early,
/// which the caller's loop absorbs).
fn sleep_readable(fd: std::os::fd::RawFd, limit: Duration) {
    let ms = limit.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128) as i32;
    poll_readable(fd, ms);
}

/// One `poll(2)` for `fd` readable, waiting up to `ms` milliseconds (0: not
/// at all): whether it is.
fn poll_readable(fd: std::os::fd::RawFd, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `p` is one valid pollfd for the duration of the call. The
    // descriptor stays open while any handle lives (the connection owns it
    // and outlives its handles); poll(2) on it touches no memory of ours.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

/// A connection shared by the threads of a process; see the module doc.
pub struct SharedConnection<C: Connection> {
    shared: Arc<Shared<C>>,
}

impl<C: Connection> Clone for SharedConnection<C> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<C: Connection> SharedConnection<C> {
    /// Shares `conn`, which must have nothing outstanding.
    #[must_use]
    pub fn new(conn: C) -> Self {
        Self::with_fd(conn, None, Duration::ZERO)
    }

    /// Shares `conn` (nothing outstanding); handles wait on its readiness
    /// descriptor without holding the shared lock (the module doc's
    /// "Waiting"), the polling one spinning on it for up to `spin` first
    /// (adaptively, within the process's budget of spinning readers, as
    /// a `tcp` connection's own wait does; zero: never). A connection
    /// without a descriptor is shared as [`SharedConnection::new`] does.
    #[must_use]
    pub fn waiting_on_fd(conn: C, spin: Duration) -> Self {
        let fd = conn.readiness_fd();
        Self::with_fd(conn, fd, spin)
    }

    fn with_fd(conn: C, fd: Option<std::os::fd::RawFd>, spin: Duration) -> Self {
        debug_assert_eq!(conn.outstanding(), 0);
        let (limits, ordered) = (conn.limits(), conn.ordered_reads());
        Self {
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner {
                    conn,
                    queues: HashMap::new(),
                    scratch: Vec::new(),
                    polling: false,
                }),
                next_handle: AtomicU32::new(0),
                broken: AtomicBool::new(false),
                limits,
                ordered,
                fd,
                spin: Mutex::new(AdaptiveSpin::new(
                    &spin::READER,
                    if fd.is_some() { spin } else { Duration::ZERO },
                )),
            }),
        }
    }

    /// A new handle: a [`Connection`] of its own, for one thread.
    #[must_use]
    pub fn handle(&self) -> SharedHandle<C> {
        let mut inner = self.shared.lock();
        // Skip an id still in use (after 2^32 handles the counter wraps).
        let id = loop {
            let id = self.shared.next_handle.fetch_add(1, Ordering::Relaxed);
            if !inner.queues.contains_key(&id) {
                break id;
            }
        };
        inner.queues.insert(id, Queue::default());
        SharedHandle {
            shared: Arc::clone(&self.shared),
            id,
            slab: Vec::new(),
            free: Vec::new(),
            outstanding: 0,
        }
    }

    /// Whether the connection was lost (a `ConnectionLost` completion or
    /// post): open a fresh one for new readers.
    #[must_use]
    pub fn is_broken(&self) -> bool {
        self.shared.broken.load(Ordering::Relaxed)
    }

    /// A reference that does not keep the connection open: once the last
    /// [`SharedConnection`] and [`SharedHandle`] of it are gone, the
    /// connection closes and [`WeakShared::upgrade`] returns `None`.
    #[must_use]
    pub fn downgrade(&self) -> WeakShared<C> {
        WeakShared(Arc::downgrade(&self.shared))
    }

    /// Handles alive now.
    #[must_use]
    pub fn handles(&self) -> usize {
        self.shared.lock().queues.len()
    }
}

/// A [`SharedConnection`] that is not kept open by this reference (for a
/// process-wide registry of connections).
pub struct WeakShared<C: Connection>(std::sync::Weak<Shared<C>>);

impl<C: Connection> WeakShared<C> {
    /// The connection, if anyone still holds it.
    #[must_use]
    pub fn upgrade(&self) -> Option<SharedConnection<C>> {
        self.0.upgrade().map(|shared| SharedConnection { shared })
    }
}

/// One thread's use of a [`SharedConnection`].
pub struct SharedHandle<C: Connection> {
    shared: Arc<Shared<C>>,
    id: u32,
    /// Caller ids of this handle's outstanding requests, by slab index.
    slab: Vec<Option<u64>>,
    free: Vec<u32>,
    outstanding: usize,
}

impl<C: Connection> SharedHandle<C> {
    /// Polls the inner connection (filing what arrived) and moves this
    /// handle's completions to `out`, with the caller's ids.
    fn collect(&mut self, inner: &mut Inner<C>, out: &mut Vec<Completion>) -> usize {
        // While a handle sleeps on the descriptor, only it reads the
        // connection: bytes taken from under it would leave it asleep with
        // its completions filed.
        if !inner.polling {
            self.shared.pump(inner, Duration::ZERO);
        }
        self.take(inner, out)
    }

    fn take(&mut self, inner: &mut Inner<C>, out: &mut Vec<Completion>) -> usize {
        let q = inner
            .queues
            .get_mut(&self.id)
            .expect("a live handle's queue");
        let n = q.done.len();
        for c in q.done.drain(..) {
            let slot = (c.id & 0xffff_ffff) as u32;
            let id = self.slab[slot as usize]
                .take()
                .expect("one completion per request");
            self.free.push(slot);
            self.outstanding -= 1;
            out.push(Completion {
                id,
                result: c.result,
            });
        }
        n
    }

    /// `wait` of a connection shared with `waiting_on_fd` (the module
    /// doc's "Waiting"): one handle at a time reads the connection without
    /// the lock (spinning, then sleeping on the descriptor) and files what
    /// arrives; the others sleep until it files theirs or hands on.
    fn wait_fd(
        &mut self,
        shared: &Shared<C>,
        fd: std::os::fd::RawFd,
        out: &mut Vec<Completion>,
        start: Instant,
        timeout: Duration,
    ) -> usize {
        let mut inner = shared.lock();
        loop {
            let n = self.collect(&mut inner, out);
            if n > 0 || self.outstanding == 0 {
                return n;
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return 0;
            }
            let slice = left.min(WAIT_SLICE);
            if inner.polling {
                // Somebody polls: sleep until it files ours or hands on.
                inner.queues.get_mut(&self.id).expect("own queue").sleeper =
                    Some(std::thread::current());
                drop(inner);
                std::thread::park_timeout(slice);
                inner = shared.lock();
                inner.queues.get_mut(&self.id).expect("own queue").sleeper = None;
                continue;
            }
            // This handle polls: arm, poll once more, then wait without
            // the lock.
            inner.conn.arm();
            let n = self.collect(&mut inner, out);
            if n > 0 {
                return n;
            }
            inner.polling = true;
            drop(inner);
            shared.await_readable(fd, slice);
            inner = shared.lock();
            inner.polling = false;
            shared.pump(&mut inner, Duration::ZERO);
            let n = self.take(&mut inner, out);
            if n > 0 || self.outstanding == 0 {
                Shared::hand_off(&mut inner);
                return n;
            }
        }
    }

    fn slot(&mut self, caller: u64) -> u32 {
        if let Some(s) = self.free.pop() {
            self.slab[s as usize] = Some(caller);
            s
        } else {
            self.slab.push(Some(caller));
            (self.slab.len() - 1) as u32
        }
    }
}

// SAFETY: every request a handle accepts is posted on the inner connection
// (which completes it exactly once) under a wire id naming this handle, and
// its completion is handed out only by this handle's `poll`/`wait`, after
// the inner connection wrote its buffer. A rejected batch rolls its slab
// entries back, so nothing is reported for it. Drop waits for every
// outstanding completion, so no buffer is written after the handle is gone.
unsafe impl<C: Connection> Connection for SharedHandle<C> {
    unsafe fn post_reads(&mut self, reads: &[ReadRequest]) -> Result<(), PostError> {
        if self.shared.broken.load(Ordering::Relaxed) {
            return Err(PostError::ConnectionLost);
        }
        let limit = self.shared.limits.max_outstanding;
        if reads.len() > limit {
            return Err(PostError::QueueFull {
                outstanding: self.outstanding,
                requested: reads.len(),
                limit,
            });
        }
        let slots: Vec<u32> = reads.iter().map(|r| self.slot(r.id)).collect();
        let wire: Vec<ReadRequest> = reads
            .iter()
            .zip(&slots)
            .map(|(r, &s)| ReadRequest {
                id: (u64::from(self.id) << 32) | u64::from(s),
                ..*r
            })
            .collect();
        let start = Instant::now();
        let shared = Arc::clone(&self.shared);
        loop {
            let mut inner = shared.lock();
            // SAFETY: forwarded from this function's contract; the buffers
            // stay the caller's until this handle returns their completions.
            match unsafe { inner.conn.post_reads(&wire) } {
                Ok(()) => {
                    self.outstanding += reads.len();
                    return Ok(());
                }
                Err(PostError::QueueFull { .. }) if start.elapsed() < ROOM_WAIT => {
                    // Other threads' READs fill the connection: make room by
                    // polling (filing theirs; unless a handle sleeps on the
                    // descriptor, which will), then try again.
                    if !inner.polling {
                        shared.pump(&mut inner, Duration::ZERO);
                    }
                    drop(inner);
                    std::thread::yield_now();
                }
                Err(e) => {
                    drop(inner);
                    if matches!(e, PostError::ConnectionLost) {
                        shared.broken.store(true, Ordering::Relaxed);
                    }
                    for s in slots {
                        self.slab[s as usize] = None;
                        self.free.push(s);
                    }
                    return Err(match e {
                        PostError::QueueFull {
                            requested, limit, ..
                        } => PostError::QueueFull {
                            outstanding: self.outstanding,
                            requested,
                            limit,
                        },
                        e => e,
                    });
                }
            }
        }
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        let shared = Arc::clone(&self.shared);
        let mut inner = shared.lock();
        self.collect(&mut inner, out)
    }

    fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> usize {
        let start = Instant::now();
        let shared = Arc::clone(&self.shared);
        if let Some(fd) = shared.fd {
            return self.wait_fd(&shared, fd, out, start, timeout);
        }
        loop {
            {
                let mut inner = shared.lock();
                let n = self.take(&mut inner, out);
                if n > 0 || self.outstanding == 0 {
                    return n;
                }
                let left = timeout.saturating_sub(start.elapsed());
                if left.is_zero() {
                    return 0;
                }
                shared.pump(&mut inner, left.min(WAIT_SLICE));
                let n = self.take(&mut inner, out);
                if n > 0 {
                    return n;
                }
            }
            // Let a thread that wants to post or collect have the lock.
            std::thread::yield_now();
        }
    }

    fn outstanding(&self) -> usize {
        self.outstanding
    }

    fn limits(&self) -> Limits {
        self.shared.limits
    }

    fn ordered_reads(&self) -> bool {
        // A batch goes to the inner connection whole, in one post.
        self.shared.ordered
    }
}

impl<C: Connection> Drop for SharedHandle<C> {
    fn drop(&mut self) {
        // The inner connection may still write the buffers of outstanding
        // requests: wait for them (each completes, at worst with its
        // timeout), then remove the queue.
        let mut sink = Vec::new();
        while self.outstanding > 0 {
            sink.clear();
            self.wait(&mut sink, Duration::from_millis(100));
        }
        self.shared.lock().queues.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LocalRegion, tcp};

    const TOKEN: &[u8] = b"shared-connection-test";

    #[test]
    fn threads_share_one_connection_and_each_gets_its_own_completions() {
        let responder =
            tcp::TcpOwner::bind("127.0.0.1:0", tcp::OwnerConfig::new(TOKEN)).expect("bind");
        let region = responder.register(1 << 16).expect("register");
        let bytes: Vec<u8> = (0..1 << 16).map(|i| (i * 7 + i / 251) as u8).collect();
        region.write_bytes(0, &bytes);
        let desc = region.descriptor();
        let mut cfg = tcp::ConnectionConfig::new(TOKEN);
        cfg.max_outstanding = 8;
        let conn = tcp::TcpConnection::connect(responder.local_addr(), cfg).expect("connect");
        let shared = SharedConnection::new(conn);
        let bytes = Arc::new(bytes);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let mut h = shared.handle();
                let bytes = Arc::clone(&bytes);
                s.spawn(move || {
                    for round in 0..300u64 {
                        // Batches of 3 from 4 threads overflow 8 slots: the
                        // handles wait for room instead of failing.
                        let mut bufs = [[0u8; 64]; 3];
                        let offs: Vec<u64> = (0..3)
                            .map(|i| ((t * 977 + round * 131 + i * 4099) % 1000) * 64)
                            .collect();
                        let mut reads: Vec<(u64, &mut [u8])> = offs
                            .iter()
                            .zip(bufs.iter_mut())
                            .map(|(&o, b)| (o, &mut b[..]))
                            .collect();
                        let r = crate::read_blocking(&mut h, desc, &mut reads).expect("post");
                        assert!(r.iter().all(Result::is_ok), "{r:?}");
                        for (o, b) in offs.iter().zip(bufs.iter()) {
                            assert_eq!(&b[..], &bytes[*o as usize..*o as usize + 64]);
                        }
                    }
                });
            }
        });
        assert_eq!(shared.handles(), 0);
        assert!(!shared.is_broken());
    }

    #[test]
    fn a_lost_peer_breaks_the_shared_connection() {
        let responder =
            tcp::TcpOwner::bind("127.0.0.1:0", tcp::OwnerConfig::new(TOKEN)).expect("bind");
        let region = responder.register(4096).expect("register");
        let desc = region.descriptor();
        let conn =
            tcp::TcpConnection::connect(responder.local_addr(), tcp::ConnectionConfig::new(TOKEN))
                .expect("connect");
        let shared = SharedConnection::new(conn);
        let mut h = shared.handle();
        let mut b = [0u8; 64];
        let r = crate::read_blocking(&mut h, desc, &mut [(0, &mut b[..])]).expect("post");
        assert!(r[0].is_ok());
        responder.shutdown();
        drop(region);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !shared.is_broken() && Instant::now() < deadline {
            // Errors are what this waits for; only the flag matters.
            let _ = crate::read_blocking(&mut h, desc, &mut [(0, &mut b[..])]);
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(shared.is_broken(), "a lost peer must mark it broken");
    }
}
