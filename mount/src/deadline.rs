//! Where reads and writes run, and the deadline every request is answered
//! by.
//!
//! A FUSE read or write runs on the FUSE thread that took it from the
//! kernel, while fewer than `inline` requests run so: no hand-off to
//! another thread and back (that hand-off, a futex wake and two context
//! switches per request, was a fifth of a sequential reader's CPU). The
//! mount starts `inline` plus [`SPARE_THREADS`] FUSE threads, so when
//! `inline` requests are busy with the cluster the spare threads still
//! answer stat, open and readdir at once. A read or write that finds every
//! inline permit taken goes to a queue served by a pool of worker threads,
//! and the FUSE thread goes back to the kernel at once.
//!
//! Every request's reply sits in a [`Slot`] that exactly one party takes:
//! the thread that ran it, when the cluster answered, or the watchdog, once
//! the request's deadline passed (it then answers `EIO` and logs which
//! request timed out). Whoever comes second finds the slot empty and drops
//! its answer. So a request is answered within its deadline (plus the
//! watchdog's tick) even if the client never returns, and a request still
//! queued when its deadline passes is not started.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use fuser::{Errno, ReplyData, ReplyWrite};
use tracing::{debug, warn};

/// A reply the kernel waits for.
pub(crate) enum Reply {
    Data(ReplyData),
    Write(ReplyWrite),
}

impl Reply {
    fn error(self, e: Errno) {
        match self {
            Reply::Data(r) => r.error(e),
            Reply::Write(r) => r.error(e),
        }
    }
}

/// What a job produced.
pub(crate) enum Done {
    /// These bytes of the worker's buffer.
    Data(Range<usize>),
    /// This many bytes written.
    Written(u32),
}

/// The request, for log lines.
#[derive(Clone, Copy, Debug)]
pub(crate) struct What {
    pub op: &'static str,
    pub offset: u64,
    pub len: u64,
}

impl fmt::Display for What {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} bytes at offset {}",
            self.op, self.len, self.offset
        )
    }
}

/// FUSE threads beyond the inline permits: they answer requests that need
/// no cluster while every permit is busy.
pub const SPARE_THREADS: usize = 2;

/// A job: runs with its thread's reusable buffer.
type Work = Box<dyn FnOnce(&mut Vec<u8>) -> Result<Done, Errno> + Send>;

/// Keep no more than a few runs' worth of buffer per thread.
pub(crate) const KEEP_BUF: usize = 4 << 20;

thread_local! {
    /// The buffer of requests run on this FUSE thread.
    static INLINE_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Holds a reply until the worker or the watchdog takes it.
struct Slot(Mutex<Option<Reply>>);

impl Slot {
    fn take(&self) -> Option<Reply> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn is_taken(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_none()
    }
}

struct Job {
    id: u64,
    slot: Arc<Slot>,
    what: What,
    work: Work,
}

struct Entry {
    deadline: Instant,
    slot: Arc<Slot>,
    what: What,
}

/// Requests handed to workers and not yet answered.
struct Table {
    inflight: Mutex<HashMap<u64, Entry>>,
    /// Requests the watchdog answered with EIO.
    expired: AtomicU64,
}

/// Inline permits, the overflow worker pool and the watchdog.
pub(crate) struct Dispatcher {
    tx: mpsc::Sender<Job>,
    table: Arc<Table>,
    deadline: Duration,
    next: AtomicU64,
    /// Requests running on FUSE threads now.
    busy: AtomicUsize,
    /// At most this many run on FUSE threads at once.
    inline: usize,
}

impl Dispatcher {
    /// Allows `workers` requests at once on the FUSE threads, starts
    /// `workers` overflow threads and the watchdog; every request is
    /// answered within `deadline` of reaching the mount.
    pub(crate) fn start(workers: usize, deadline: Duration) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let table = Arc::new(Table {
            inflight: Mutex::new(HashMap::new()),
            expired: AtomicU64::new(0),
        });
        for i in 0..workers.max(1) {
            let rx = rx.clone();
            let table = table.clone();
            std::thread::Builder::new()
                .name(format!("pw-mount-{i}"))
                .spawn(move || worker(&rx, &table))?;
        }
        let weak = Arc::downgrade(&table);
        // A tenth of the deadline, between 5 ms and 100 ms.
        let tick = (deadline / 10).clamp(Duration::from_millis(5), Duration::from_millis(100));
        std::thread::Builder::new()
            .name("pw-mount-deadline".into())
            .spawn(move || watchdog(&weak, tick, deadline))?;
        Ok(Self {
            tx,
            table,
            deadline,
            next: AtomicU64::new(0),
            busy: AtomicUsize::new(0),
            inline: workers.max(1),
        })
    }

    /// Runs `work` and answers `reply` with its result, or with `EIO` once
    /// the deadline passes: on this thread if an inline permit is free,
    /// else on a worker (this thread returns at once).
    pub(crate) fn run<F>(&self, what: What, reply: Reply, work: F)
    where
        F: FnOnce(&mut Vec<u8>) -> Result<Done, Errno> + Send + 'static,
    {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot(Mutex::new(Some(reply))));
        self.table.lock().insert(
            id,
            Entry {
                deadline: Instant::now() + self.deadline,
                slot: slot.clone(),
                what,
            },
        );
        // Relaxed: the count only bounds how many FUSE threads are busy;
        // it orders nothing else.
        let inline = self
            .busy
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                (b < self.inline).then_some(b + 1)
            })
            .is_ok();
        if inline {
            INLINE_BUF.with_borrow_mut(|buf| {
                let result = work(buf);
                finish(&self.table, id, &slot, what, result, buf);
            });
            self.busy.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        if let Err(mpsc::SendError(job)) = self.tx.send(Job {
            id,
            slot,
            what,
            work: Box::new(work),
        }) {
            // Every worker is gone (they only stop when this is dropped).
            self.table.lock().remove(&job.id);
            if let Some(r) = job.slot.take() {
                r.error(Errno::EIO);
            }
        }
    }

    /// Reads and writes running on FUSE threads now (the overflow queue's
    /// are not counted).
    pub(crate) fn busy(&self) -> usize {
        self.busy.load(Ordering::Relaxed)
    }

    /// Requests answered with EIO by the watchdog so far.
    pub(crate) fn expired(&self) -> u64 {
        self.table.expired.load(Ordering::Relaxed)
    }
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.inflight.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn worker(rx: &Mutex<mpsc::Receiver<Job>>, table: &Table) {
    let mut buf = Vec::new();
    loop {
        let job = {
            let rx = rx.lock().unwrap_or_else(|e| e.into_inner());
            match rx.recv() {
                Ok(job) => job,
                Err(_) => return,
            }
        };
        if job.slot.is_taken() {
            // Answered by the watchdog while queued: not started.
            continue;
        }
        let result = (job.work)(&mut buf);
        finish(table, job.id, &job.slot, job.what, result, &mut buf);
    }
}

/// Answers request `id` with `result` unless the watchdog answered it
/// first.
fn finish(
    table: &Table,
    id: u64,
    slot: &Slot,
    what: What,
    result: Result<Done, Errno>,
    buf: &mut Vec<u8>,
) {
    table.lock().remove(&id);
    match slot.take() {
        None => debug!("{what} finished after its deadline; dropped"),
        Some(reply) => match (result, reply) {
            (Ok(Done::Data(r)), Reply::Data(reply)) => reply.data(&buf[r]),
            (Ok(Done::Written(n)), Reply::Write(reply)) => reply.written(n),
            (Ok(_), reply) => reply.error(Errno::EIO),
            (Err(e), reply) => reply.error(e),
        },
    }
    if buf.capacity() > KEEP_BUF {
        *buf = Vec::new();
    }
}

fn watchdog(table: &Weak<Table>, tick: Duration, deadline: Duration) {
    loop {
        std::thread::sleep(tick);
        let Some(table) = table.upgrade() else {
            return;
        };
        let now = Instant::now();
        let late: Vec<Entry> = {
            let mut map = table.lock();
            let ids: Vec<u64> = map
                .iter()
                .filter(|(_, e)| e.deadline <= now)
                .map(|(&id, _)| id)
                .collect();
            ids.iter().filter_map(|id| map.remove(id)).collect()
        };
        for e in late {
            if let Some(reply) = e.slot.take() {
                table.expired.fetch_add(1, Ordering::Relaxed);
                warn!(
                    "{}: the cluster did not answer within the deadline ({deadline:?}): EIO",
                    e.what
                );
                reply.error(Errno::EIO);
            }
        }
    }
}
