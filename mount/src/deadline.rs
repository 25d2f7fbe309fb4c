//! Workers that talk to the cluster, and the deadline every request is
//! answered by.
//!
//! A FUSE read or write is handed to a pool of worker threads with its
//! reply; the FUSE threads go back to the kernel for the next request at
//! once, so as many cluster operations run at a time as there are workers.
//!
//! Every job's reply sits in a [`Slot`] that exactly one party takes: the
//! worker, when the cluster answered, or the watchdog, once the job's
//! deadline passed (it then answers `EIO` and logs which request timed
//! out). Whoever comes second finds the slot empty and drops its answer. So
//! a request is answered within its deadline (plus the watchdog's tick)
//! even if the client never returns, and a job still queued when its
//! deadline passes is not started.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// A job: runs on a worker with the worker's reusable buffer.
pub(crate) type Work = Box<dyn FnOnce(&mut Vec<u8>) -> Result<Done, Errno> + Send>;

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

/// The worker pool and its watchdog.
pub(crate) struct Dispatcher {
    tx: mpsc::Sender<Job>,
    table: Arc<Table>,
    deadline: Duration,
    next: AtomicU64,
}

impl Dispatcher {
    /// Starts `workers` threads and the watchdog; every job is answered
    /// within `deadline` of its submission.
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
        })
    }

    /// Runs `work` on a worker and answers `reply` with its result, or with
    /// `EIO` once the deadline passes.
    pub(crate) fn submit(&self, what: What, reply: Reply, work: Work) {
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
        if let Err(mpsc::SendError(job)) = self.tx.send(Job {
            id,
            slot,
            what,
            work,
        }) {
            // Every worker is gone (they only stop when this is dropped).
            self.table.lock().remove(&job.id);
            if let Some(r) = job.slot.take() {
                r.error(Errno::EIO);
            }
        }
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
        table.lock().remove(&job.id);
        let Some(reply) = job.slot.take() else {
            debug!("{} finished after its deadline; dropped", job.what);
            continue;
        };
        match (result, reply) {
            (Ok(Done::Data(r)), Reply::Data(reply)) => reply.data(&buf[r]),
            (Ok(Done::Written(n)), Reply::Write(reply)) => reply.written(n),
            (Ok(_), reply) => reply.error(Errno::EIO),
            (Err(e), reply) => reply.error(e),
        }
        if buf.capacity() > 4 << 20 {
            // Keep no more than a few runs' worth per worker.
            buf = Vec::new();
        }
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
