//! Single flight: concurrent reads of the same run of pages in one process
//! share one read, without giving up freshness.
//!
//! # Protocol
//!
//! **State.** Per key `(first page, page count)`, under its shard's mutex:
//! `busy`, the reads of the key in progress, and `joinable`, at most one
//! flight that has *not started yet* and that arriving readers may join.
//! An entry exists while `busy > 0` or a flight is joinable.
//!
//! **Arrival** (all under the shard lock):
//! 1. no entry: `busy = 1`, read at once as a leader of no flight;
//! 2. a joinable flight: join it (count as a follower), wait for its result;
//! 3. otherwise (a read is in progress, none joinable): make a joinable
//!    flight and lead it: wait until `busy == 0` (or the caller's deadline),
//!    then close it to joiners (`joinable = None`), `busy += 1`, and read.
//!
//! **Finish.** The leader takes `busy -= 1` (removing an entry left with no
//! reads and no joinable flight, and waking queued leaders when `busy`
//! reaches 0), then, if its flight has followers, publishes a copy of the
//! bytes and the per-page answers, or `None` when its read failed; followers
//! then read alone (their deadlines are their own).
//!
//! **Why a follower's bytes are fresh.** A follower joins only a flight
//! whose leader has not started reading (the flight is closed under the
//! lock before the read starts), so the shared read starts after the
//! follower's call did: it returns what a read of the follower's own would
//! have been allowed to (the freshness guarantee of `crate::cluster` is
//! about reads that *start* after a write's acknowledgement). Joining a
//! read already in progress would not be: it may have copied the page
//! before a write acknowledged after the follower's call began.
//!
//! **Cost.** Reads of distinct runs take their shard's lock twice (arrive,
//! finish); shards are cache-line padded and picked by a hash of the key,
//! so threads reading different pages rarely share one. At most two reads
//! of one key are in progress at once (one running, one queued with its
//! followers), however many threads ask.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use super::ReadInfo;
use crate::slot::Padded;

/// Shards of the flight table.
const SHARDS: usize = 64;

type Key = (u64, usize);

#[derive(Default)]
struct Entry {
    busy: usize,
    joinable: Option<Arc<Flight>>,
}

#[derive(Default)]
struct Shard {
    map: Mutex<HashMap<Key, Entry>>,
    /// Signalled when a key's `busy` reaches 0.
    idle: Condvar,
}

/// What a flight's leader shares.
pub(crate) struct Answer {
    /// The run's bytes (`count * page_size`).
    pub(crate) bytes: Vec<u8>,
    pub(crate) infos: Vec<ReadInfo>,
}

#[derive(Default)]
struct Flight {
    /// Threads that joined (changed only under the shard lock, while the
    /// flight is joinable).
    followers: AtomicUsize,
    /// `None` while pending; `Some(None)` when the leader's read failed.
    result: Mutex<Option<Option<Arc<Answer>>>>,
    done: Condvar,
}

/// The process's (one client's) flights.
pub(crate) struct Flights {
    shards: Box<[Padded<Shard>]>,
}

/// What a reader does after [`Flights::begin`].
pub(crate) enum Role<'a> {
    /// Read, then [`Lead::finish`].
    Lead(Lead<'a>),
    /// Another thread's read, started after this call, answered.
    Follow(Arc<Answer>),
    /// The flight joined failed, or the deadline passed while waiting: read
    /// alone.
    Alone,
}

/// A leader's duty to finish its read (done on drop with no answer, if
/// the read panicked).
pub(crate) struct Lead<'a> {
    flights: &'a Flights,
    key: Key,
    flight: Option<Arc<Flight>>,
    finished: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Flights {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Padded(Shard::default())).collect(),
        }
    }

    fn shard(&self, key: Key) -> &Shard {
        let h = key
            .0
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(key.1 as u64)
            .rotate_left(29);
        &self.shards[(h % SHARDS as u64) as usize]
    }

    /// Arrives for the run `key`; waits (until `deadline` at most) as the
    /// module doc says.
    pub(crate) fn begin(&self, key: Key, deadline: Instant) -> Role<'_> {
        let shard = self.shard(key);
        let mut map = lock(&shard.map);
        let Some(e) = map.get_mut(&key) else {
            map.insert(
                key,
                Entry {
                    busy: 1,
                    joinable: None,
                },
            );
            return Role::Lead(Lead {
                flights: self,
                key,
                flight: None,
                finished: false,
            });
        };
        if let Some(f) = &e.joinable {
            f.followers.fetch_add(1, Ordering::Relaxed);
            let f = f.clone();
            drop(map);
            return follow(&f, deadline);
        }
        let flight = Arc::new(Flight::default());
        e.joinable = Some(flight.clone());
        // Queue behind the reads in progress. The entry cannot go while its
        // flight is joinable.
        loop {
            let e = map.get_mut(&key).expect("kept while joinable");
            let left = deadline.saturating_duration_since(Instant::now());
            if e.busy == 0 || left.is_zero() {
                e.joinable = None;
                e.busy += 1;
                break;
            }
            map = shard
                .idle
                .wait_timeout(map, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Role::Lead(Lead {
            flights: self,
            key,
            flight: Some(flight),
            finished: false,
        })
    }
}

/// Waits for `f`'s answer until `deadline`.
fn follow(f: &Flight, deadline: Instant) -> Role<'static> {
    let mut r = lock(&f.result);
    loop {
        if let Some(answer) = &*r {
            return match answer {
                Some(a) => Role::Follow(a.clone()),
                None => Role::Alone,
            };
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Role::Alone;
        }
        r = f
            .done
            .wait_timeout(r, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

impl Lead<'_> {
    /// Whether anyone waits for this read's answer (then pass it to
    /// [`Lead::finish`]).
    pub(crate) fn has_followers(&self) -> bool {
        self.flight
            .as_ref()
            .is_some_and(|f| f.followers.load(Ordering::Relaxed) > 0)
    }

    /// Ends the read: `answer` is what followers get (None: it failed).
    pub(crate) fn finish(mut self, answer: Option<Answer>) {
        self.end(answer);
    }

    fn end(&mut self, answer: Option<Answer>) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let shard = self.flights.shard(self.key);
        {
            let mut map = lock(&shard.map);
            let e = map.get_mut(&self.key).expect("an entry while busy");
            e.busy -= 1;
            if e.busy == 0 {
                if e.joinable.is_none() {
                    map.remove(&self.key);
                }
                shard.idle.notify_all();
            }
        }
        if let Some(f) = &self.flight {
            *lock(&f.result) = Some(answer.map(Arc::new));
            f.done.notify_all();
        }
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        self.end(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn answer(b: u8) -> Answer {
        Answer {
            bytes: vec![b; 4],
            infos: Vec::new(),
        }
    }

    /// A reader arriving while a read of its run is in progress does not
    /// take that read's answer: it leads (or joins) the next one, which
    /// starts after the first ends.
    #[test]
    fn a_follower_never_takes_a_read_that_started_before_it() {
        let f = Flights::new();
        let soon = Instant::now() + Duration::from_secs(5);
        let Role::Lead(first) = f.begin((7, 1), soon) else {
            panic!("the first reader leads")
        };
        std::thread::scope(|s| {
            let second = s.spawn(|| match f.begin((7, 1), soon) {
                Role::Lead(l) => {
                    // Queued behind `first`: it starts only once `first`
                    // has finished.
                    l.finish(Some(answer(2)));
                    "lead"
                }
                Role::Follow(_) => "follow",
                Role::Alone => "alone",
            });
            std::thread::sleep(Duration::from_millis(50));
            assert!(!second.is_finished(), "the second read did not wait");
            first.finish(Some(answer(1)));
            assert_eq!(second.join().expect("second"), "lead");
        });
    }

    /// Readers that arrive while one read is in progress share the one
    /// queued read behind it; a failed read sends its followers off alone.
    #[test]
    fn readers_queued_behind_a_read_share_the_next_one() {
        let f = Flights::new();
        let soon = Instant::now() + Duration::from_secs(5);
        let Role::Lead(first) = f.begin((1, 4), soon) else {
            panic!("leads")
        };
        let leads = AtomicUsize::new(0);
        let got: Mutex<Vec<u8>> = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| match f.begin((1, 4), soon) {
                    Role::Lead(l) => {
                        leads.fetch_add(1, Ordering::Relaxed);
                        // Let the others join before this read "runs".
                        std::thread::sleep(Duration::from_millis(50));
                        assert!(l.has_followers());
                        l.finish(Some(answer(9)));
                    }
                    Role::Follow(a) => lock(&got).push(a.bytes[0]),
                    Role::Alone => panic!("nothing failed"),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
            first.finish(None);
        });
        assert_eq!(leads.load(Ordering::Relaxed), 1, "one read for the four");
        assert_eq!(*lock(&got), vec![9, 9, 9]);
        // Nothing is left behind.
        assert!(f.shards.iter().all(|s| lock(&s.map).is_empty()));
        // A failed shared read: its follower reads alone.
        let Role::Lead(a) = f.begin((3, 1), soon) else {
            panic!("leads")
        };
        std::thread::scope(|s| {
            let b = s.spawn(|| match f.begin((3, 1), soon) {
                Role::Lead(l) => {
                    std::thread::sleep(Duration::from_millis(50));
                    drop(l); // a read that panicked: no answer
                    "lead"
                }
                _ => "other",
            });
            let c = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                match f.begin((3, 1), soon) {
                    Role::Alone => "alone",
                    Role::Follow(_) => "follow",
                    Role::Lead(_) => "lead",
                }
            });
            // `c` joins `b`'s flight while `b` waits for `a`.
            std::thread::sleep(Duration::from_millis(40));
            a.finish(Some(answer(1)));
            assert_eq!(b.join().expect("b"), "lead");
            assert_eq!(c.join().expect("c"), "alone");
        });
        assert!(f.shards.iter().all(|s| lock(&s.map).is_empty()));
    }
}
