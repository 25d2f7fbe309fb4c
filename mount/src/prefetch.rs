//! Read-ahead of sequential readers, checked before use.
//!
//! With direct I/O the kernel reads nothing ahead, so a sequential reader
//! at depth 1 waits for every run's transfer from the owner. When a read
//! starts where an earlier read ended, came (in part) over the network or
//! through a fault-in ([`worth_reading_ahead`]: not for runs this process
//! copied out of shm itself), and a core is free, the mount reads the next
//! run of the same length on a read-ahead thread while the kernel hands
//! the current one to the reader. When that next read arrives, the run read ahead is
//! used only if [`Source::still_current`] says every page's frame still
//! holds the generation it was copied at (one READ of an 8-byte word per
//! page, no copy): the same bytes a read would return now, coherent with
//! every write acknowledged before the read arrived (the argument is
//! [`pagewire_client::RemoteReader::still_current`]'s). A run that fails
//! the check, or was read over gRPC, is read again as if there were no
//! read-ahead. So read-ahead changes when bytes are copied, never which
//! bytes a read returns.
//!
//! # State
//!
//! * `recent`: where the last [`RECENT`] reads ended (a read starting at
//!   one of them is sequential).
//! * `table`: at most [`STREAMS`] runs read ahead or queued, each an
//!   [`Ahead`] in state `Queued` → `Reading` → `Ready`/`Failed`, or
//!   `Queued` → `Claimed` when the reader came first (it then reads the
//!   run itself and the read-ahead thread skips it). The oldest entry
//!   makes room for a new one.
//! * `spare`: buffers handed back by readers, reused for the next runs
//!   (a fresh 1 MiB buffer costs its page faults).
//!
//! A reader that finds its run `Reading` waits for it, at most half the
//! mount's deadline (the other half is left for reading the run itself);
//! a run `Queued` it takes over at once.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use pagewire_client::{ReadInfo, Transport, Via};
use tracing::debug;

use crate::source::Source;

/// Read ends remembered for detecting sequential readers.
const RECENT: usize = 64;
/// Runs read ahead at once, at most (one per sequential stream).
const STREAMS: usize = 16;
/// Spare buffers kept.
const SPARE: usize = 4;

/// What happened to runs read ahead, since the mount started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Runs read ahead.
    pub read: u64,
    /// Reads answered from a run read ahead that passed its check.
    pub used: u64,
    /// Runs read ahead that failed their check (a page changed since):
    /// read again.
    pub stale: u64,
    /// Runs read ahead that failed to read (the read then read them).
    pub failed: u64,
    /// Runs queued that the reader reached first (it read them itself).
    pub claimed: u64,
    /// Runs read ahead nobody asked for (pushed out by newer streams).
    pub unused: u64,
}

enum State {
    Queued,
    Reading,
    Ready { buf: Vec<u8>, pages: Vec<ReadInfo> },
    Failed,
    Claimed,
}

/// One run read ahead.
struct Ahead {
    first: u64,
    count: usize,
    state: Mutex<State>,
    done: Condvar,
}

impl Ahead {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Default)]
struct Counters {
    read: AtomicU64,
    used: AtomicU64,
    stale: AtomicU64,
    failed: AtomicU64,
    claimed: AtomicU64,
    unused: AtomicU64,
}

struct Shared {
    source: Arc<Source>,
    table: Mutex<VecDeque<Arc<Ahead>>>,
    recent: Mutex<VecDeque<u64>>,
    spare: Mutex<Vec<Vec<u8>>>,
    counters: Counters,
}

/// Reads ahead of sequential readers on its own threads.
pub(crate) struct Prefetcher {
    shared: Arc<Shared>,
    tx: Mutex<mpsc::Sender<Arc<Ahead>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Prefetcher {
    /// Starts `threads` read-ahead threads over `source`.
    pub(crate) fn start(source: Arc<Source>, threads: usize) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            source,
            table: Mutex::new(VecDeque::new()),
            recent: Mutex::new(VecDeque::new()),
            spare: Mutex::new(Vec::new()),
            counters: Counters::default(),
        });
        let (tx, rx) = mpsc::channel::<Arc<Ahead>>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let (rx, shared) = (rx.clone(), Arc::downgrade(&shared));
            std::thread::Builder::new()
                .name(format!("pw-mount-ahead-{i}"))
                .spawn(move || {
                    loop {
                        let next = lock(&rx).recv();
                        let (Ok(ahead), Some(shared)) = (next, shared.upgrade()) else {
                            return;
                        };
                        shared.read_ahead(&ahead);
                    }
                })?;
        }
        Ok(Self {
            shared,
            tx: Mutex::new(tx),
        })
    }

    /// Reads pages `first..first + count` into `buf` (grown to the run's
    /// size, never shrunk): from the run read ahead when there is one and
    /// it is still current, else from the cluster. Then, if the read
    /// continued an earlier one and `ahead` allows, queues the run after
    /// it. `wait`: the longest a read waits for a run being read ahead
    /// (then it reads the run itself). Returns how each page was read.
    pub(crate) fn read(
        &self,
        first: u64,
        count: usize,
        buf: &mut Vec<u8>,
        wait: Duration,
        ahead: bool,
    ) -> Result<Vec<ReadInfo>, crate::SourceError> {
        let s = &self.shared;
        let taken = self.take(first, count, wait);
        let sequential = taken.is_some() || s.continues(first, first + count as u64);
        let mut read = None;
        if let Some((mut ahead, pages)) = taken {
            if s.source.still_current(first, &pages) {
                std::mem::swap(buf, &mut ahead);
                bump(&s.counters.used);
                read = Some(pages);
            } else {
                bump(&s.counters.stale);
            }
            s.give_back(ahead);
        }
        let pages = match read {
            Some(pages) => pages,
            None => s.source.read_run_into(first, count, buf)?,
        };
        if sequential && ahead && pages.iter().any(worth_reading_ahead) {
            self.queue(first + count as u64, count);
        }
        Ok(pages)
    }

    /// What happened to runs read ahead so far.
    pub(crate) fn stats(&self) -> PrefetchStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PrefetchStats {
            read: get(&c.read),
            used: get(&c.used),
            stale: get(&c.stale),
            failed: get(&c.failed),
            claimed: get(&c.claimed),
            unused: get(&c.unused),
        }
    }

    /// The run `first..+count` read ahead, out of the table: its buffer
    /// and how each page was read. None when there is none, it failed, or
    /// it was still queued (then claimed: the caller reads it).
    fn take(&self, first: u64, count: usize, wait: Duration) -> Option<(Vec<u8>, Vec<ReadInfo>)> {
        let s = &self.shared;
        let ahead = {
            let mut t = lock(&s.table);
            let i = t
                .iter()
                .position(|a| a.first == first && a.count == count)?;
            t.remove(i)?
        };
        let mut until = None;
        let mut st = ahead.lock();
        loop {
            match std::mem::replace(&mut *st, State::Claimed) {
                State::Queued => {
                    bump(&s.counters.claimed);
                    return None;
                }
                State::Reading => {
                    *st = State::Reading;
                    let until = *until.get_or_insert_with(|| Instant::now() + wait);
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        // Slow: read it here; the read-ahead thread drops
                        // its result.
                        *st = State::Claimed;
                        return None;
                    }
                    st = ahead
                        .done
                        .wait_timeout(st, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                State::Ready { buf, pages } => return Some((buf, pages)),
                State::Failed | State::Claimed => return None,
            }
        }
    }

    /// Queues the read-ahead of `first..+count` (cut at the file's end),
    /// unless it is already there.
    fn queue(&self, first: u64, count: usize) {
        let s = &self.shared;
        let pages = s.source.file_pages();
        if first >= pages {
            return;
        }
        let count = count.min((pages - first) as usize);
        let ahead = Arc::new(Ahead {
            first,
            count,
            state: Mutex::new(State::Queued),
            done: Condvar::new(),
        });
        {
            let mut t = lock(&s.table);
            if t.iter().any(|a| a.first == first && a.count == count) {
                return;
            }
            if t.len() >= STREAMS
                && let Some(old) = t.pop_front()
            {
                // Queued or being read: the thread finds it claimed and
                // drops it.
                let old = std::mem::replace(&mut *old.lock(), State::Claimed);
                if let State::Ready { buf, .. } = old {
                    bump(&s.counters.unused);
                    s.give_back(buf);
                }
            }
            t.push_back(ahead.clone());
        }
        if lock(&self.tx).send(ahead).is_err() {
            debug!("the read-ahead threads are gone");
        }
    }
}

impl Shared {
    /// Whether a read of `first..end` continues an earlier one; remembers
    /// where it ends.
    fn continues(&self, first: u64, end: u64) -> bool {
        let mut r = lock(&self.recent);
        let hit = match r.iter().position(|&e| e == first) {
            Some(i) => {
                r.remove(i);
                true
            }
            None => false,
        };
        if r.len() >= RECENT {
            r.pop_front();
        }
        r.push_back(end);
        hit
    }

    fn read_ahead(&self, ahead: &Ahead) {
        {
            let mut st = ahead.lock();
            if !matches!(*st, State::Queued) {
                return;
            }
            *st = State::Reading;
        }
        let mut buf = lock(&self.spare).pop().unwrap_or_default();
        let r = self
            .source
            .read_run_into(ahead.first, ahead.count, &mut buf);
        bump(&self.counters.read);
        let mut st = ahead.lock();
        if !matches!(*st, State::Reading) {
            // Pushed out of the table or given up on by its reader.
            bump(&self.counters.unused);
            drop(st);
            self.give_back(buf);
            return;
        }
        *st = match r {
            Ok(pages) => State::Ready { buf, pages },
            Err(e) => {
                debug!("read-ahead of pages {}..+{}: {e}", ahead.first, ahead.count);
                bump(&self.counters.failed);
                State::Failed
            }
        };
        ahead.done.notify_all();
    }

    fn give_back(&self, buf: Vec<u8>) {
        let mut spare = lock(&self.spare);
        if spare.len() < SPARE && buf.capacity() <= crate::deadline::KEEP_BUF {
            spare.push(buf);
        }
    }
}

/// Whether reading ahead hides anything for a run with a page read like
/// `p`: a page this process copied out of an owner's shm region itself is
/// a copy by this process's CPU, which read-ahead only moves to another
/// core, where it competes for memory bandwidth and leaves the reply a
/// buffer written by another core (1 MiB sequential reads at depth 1 over
/// shm on a 2-core VM, read-ahead forced on against this rule, 3
/// alternations: 6% slower unverified, 3% faster with fio's crc32c
/// verification using a core, 0.2 cores more in the mount); a page from the
/// network (tcp, verbs, gRPC) or faulted in by its owner is a wait that
/// read-ahead overlaps with the reader's turn.
fn worth_reading_ahead(p: &ReadInfo) -> bool {
    !(p.via == Via::OneSided && p.transport == Some(Transport::Shm))
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}
