//! The conformance suite, written once and run against every backend.
//!
//! A backend's test file implements [`Harness`] and invokes
//! [`conformance_tests!`], which expands to one `#[test]` per check. Every
//! check is bounded in time ([`bounded`]) and verifies every byte it reads.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use pagewire_rdma::{
    AccessFault, AsyncConnection, Chaos, Completion, Connection, LocalRegion, PostError, ReadError,
    ReadRequest, RegionDescriptor,
};

/// What the suite needs from a backend.
pub trait Harness: Send + Sync + Sized + 'static {
    /// The owner's registered region.
    type Region: LocalRegion + 'static;
    /// A reader's connection.
    type Conn: Connection + 'static;
    /// Whether the backend has a chaos mode (then torn reads must show up).
    const CHAOS: bool;
    /// A fresh owner (responder, shm owner, verbs endpoint), chaotic or not.
    fn new(chaos: Option<Chaos>) -> Self;
    /// Registers `len` bytes for remote READ.
    fn register(&self, len: usize) -> Self::Region;
    /// Opens a reader's connection to the owner.
    fn connect(&self) -> Self::Conn;
    /// Makes the owner go away (responder shut down, owner closed, peer QP
    /// destroyed); callable from another thread.
    fn kill(&self);
}

/// Runs `f` on a thread and fails the test if it takes longer than `secs`.
pub fn bounded<F: FnOnce() + Send + 'static>(secs: u64, f: F) {
    let (tx, rx) = mpsc::channel();
    let t = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => t.join().expect("test body"),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            // The body panicked: surface its panic.
            if let Err(p) = t.join() {
                std::panic::resume_unwind(p);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("test did not finish within {secs} s (a hang)")
        }
    }
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The static test pattern: byte `i` of a region.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    let mut w = 0u64;
    while v.len() < len {
        v.extend_from_slice(&splitmix64(seed ^ w).to_le_bytes());
        w += 1;
    }
    v.truncate(len);
    v
}

fn filled<H: Harness>(h: &H, len: usize, seed: u64) -> (H::Region, Vec<u8>) {
    let r = h.register(len);
    let p = pattern(len, seed);
    r.write_bytes(0, &p);
    (r, p)
}

/// Waits for the completions of `ids`, each exactly once, within `secs`.
fn collect<C: Connection>(
    conn: &mut C,
    ids: usize,
    secs: u64,
    busy_poll: bool,
) -> HashMap<u64, Result<(), ReadError>> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut got = HashMap::new();
    let mut out: Vec<Completion> = Vec::new();
    while got.len() < ids {
        assert!(
            Instant::now() < deadline,
            "only {} of {ids} completions within {secs} s",
            got.len()
        );
        out.clear();
        if busy_poll {
            conn.poll(&mut out);
            std::hint::spin_loop();
        } else {
            conn.wait(&mut out, Duration::from_millis(50));
        }
        for c in out.drain(..) {
            assert!(
                got.insert(c.id, c.result).is_none(),
                "completion {} delivered twice",
                c.id
            );
        }
    }
    assert_eq!(conn.outstanding(), 0, "outstanding after every completion");
    got
}

/// Reads `[offset, offset + len)` into a fresh buffer.
fn read<C: Connection>(
    conn: &mut C,
    d: RegionDescriptor,
    offset: u64,
    len: usize,
) -> Result<Vec<u8>, ReadError> {
    let mut buf = vec![0u8; len];
    let req = ReadRequest::new(7, d, offset, &mut buf);
    // SAFETY: `buf` lives until `collect` has returned the completion of id 7.
    unsafe { conn.post_reads(&[req]) }.expect("post");
    let got = collect(conn, 1, 30, false);
    got[&7].clone().map(|()| buf)
}

pub fn whole_region_and_edges<H: Harness>() {
    let h = H::new(None);
    let len = 64 << 10;
    let (r, p) = filled(&h, len, 1);
    let d = r.descriptor();
    assert_eq!(d.len, len as u64);
    let mut c = h.connect();
    assert_eq!(read(&mut c, d, 0, len).expect("whole region"), p);
    assert_eq!(read(&mut c, d, 0, 1).expect("first byte"), p[..1]);
    assert_eq!(
        read(&mut c, d, len as u64 - 1, 1).expect("last byte"),
        p[len - 1..]
    );
    assert_eq!(
        read(&mut c, d, 13, 1001).expect("unaligned middle"),
        p[13..1014]
    );
    assert_eq!(
        read(&mut c, d, len as u64 - 4096, 4096).expect("last page"),
        p[len - 4096..]
    );
    // The safe helper reads the same bytes.
    let mut a = vec![0u8; 4096];
    let mut b = vec![0u8; 100];
    let res = pagewire_rdma::read_blocking(&mut c, d, &mut [(4096, &mut a[..]), (7, &mut b[..])])
        .expect("post");
    assert!(res.iter().all(Result::is_ok), "{res:?}");
    assert_eq!(a, p[4096..8192]);
    assert_eq!(b, p[7..107]);
}

pub fn batches<H: Harness>() {
    let h = H::new(None);
    let len = 256 << 10;
    let (r, p) = filled(&h, len, 2);
    let d = r.descriptor();
    let mut c = h.connect();
    for round in 0..20u64 {
        // 16 pages, then 48 reads of odd sizes, as two doorbells in flight at once.
        let mut bufs: Vec<(u64, Vec<u8>)> = (0..16)
            .map(|i| (((i * 7 + round) % 64) * 4096, vec![0u8; 4096]))
            .collect();
        bufs.extend((0..48u64).map(|i| {
            let size = 1 + (splitmix64(round * 100 + i) % 3000) as usize;
            let off = splitmix64(round * 1000 + i) % (len - size) as u64;
            (off, vec![0u8; size])
        }));
        let reqs: Vec<ReadRequest> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, (off, b))| ReadRequest::new(i as u64, d, *off, b))
            .collect();
        // SAFETY: `bufs` outlives `collect`, which returns every completion.
        unsafe {
            c.post_reads(&reqs[..16]).expect("post batch of 16");
            c.post_reads(&reqs[16..]).expect("post batch of 48");
        }
        let got = collect(&mut c, reqs.len(), 30, round % 2 == 0);
        for (i, (off, b)) in bufs.iter().enumerate() {
            assert_eq!(got[&(i as u64)], Ok(()), "read {i}");
            let off = *off as usize;
            assert!(
                b[..] == p[off..off + b.len()],
                "round {round} read {i} at {off}: wrong bytes"
            );
        }
    }
}

pub fn bad_requests_fail_and_connection_survives<H: Harness>() {
    let h = H::new(None);
    let len = 16 << 10;
    let (r, p) = filled(&h, len, 3);
    let d = r.descriptor();
    let mut c = h.connect();
    let remote_access = |res: Result<Vec<u8>, ReadError>, what: &str| match res {
        Err(ReadError::RemoteAccess(_)) => {}
        other => panic!(
            "{what}: expected a remote access error, got {:?}",
            other.map(|v| v.len())
        ),
    };
    remote_access(read(&mut c, d, len as u64 - 10, 20), "past the end");
    remote_access(read(&mut c, d, u64::MAX - 5, 4), "wrapping offset");
    let mut before = d;
    before.addr -= 64;
    remote_access(read(&mut c, before, 0, 64), "before the start");
    let mut wrong = d;
    wrong.rkey ^= 0x5a5a_0001;
    remote_access(read(&mut c, wrong, 0, 64), "wrong rkey");
    // The connection still serves good READs.
    assert_eq!(
        read(&mut c, d, 100, 200).expect("after errors"),
        p[100..300]
    );
    // A deregistered region is refused, the connection survives it too.
    let r2 = h.register(4096);
    let d2 = r2.descriptor();
    drop(r2);
    remote_access(read(&mut c, d2, 0, 64), "deregistered region");
    assert_eq!(read(&mut c, d, 0, len).expect("after deregistration"), p);
    // A zero-length READ is refused at post time, nothing posted.
    let mut empty = [0u8; 0];
    // SAFETY: refused before anything is posted (asserted).
    let e = unsafe { c.post_reads(&[ReadRequest::new(1, d, 0, &mut empty)]) };
    assert!(matches!(e, Err(PostError::InvalidLength { .. })), "{e:?}");
    assert_eq!(c.outstanding(), 0);
}

pub fn stale_epoch_is_refused<H: Harness>() {
    let h = H::new(None);
    let (r, _) = filled(&h, 4096, 4);
    let mut d = r.descriptor();
    d.epoch ^= 0x100;
    let mut c = h.connect();
    assert_eq!(
        read(&mut c, d, 0, 64).map(|_| ()),
        Err(ReadError::RemoteAccess(AccessFault::StaleEpoch))
    );
}

pub const PAGE: usize = 4096;

/// A self-validating page of generation `g`: bytes 0..8 hold `g`, 8..16 an
/// xxh3 of the rest, 16.. a SplitMix64 stream of `g`.
pub fn torn_page(page: u64, g: u64) -> Vec<u8> {
    let mut v = g.to_le_bytes().to_vec();
    v.extend_from_slice(&[0; 8]);
    let body = pattern(PAGE - 16, page.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ g);
    let sum = xxhash_rust::xxh3::xxh3_64_with_seed(&body, g);
    v[8..16].copy_from_slice(&sum.to_le_bytes());
    v.extend_from_slice(&body);
    v
}

/// Whether a page read validates; panics if it validates with wrong bytes.
pub fn validate(page: u64, bytes: &[u8]) -> bool {
    let g = u64::from_le_bytes(bytes[0..8].try_into().expect("8"));
    let sum = u64::from_le_bytes(bytes[8..16].try_into().expect("8"));
    if xxhash_rust::xxh3::xxh3_64_with_seed(&bytes[16..], g) != sum {
        return false;
    }
    assert!(
        bytes == torn_page(page, g),
        "page {page}: checksum valid but bytes wrong (generation {g})"
    );
    true
}

/// Reads pages another thread keeps rewriting; torn results must be caught
/// by the checksum, and with chaos they must actually occur.
pub fn concurrent_rewrites_are_detectable<H: Harness>(chaos: Option<Chaos>) {
    let h = H::new(chaos);
    let pages = 4u64;
    let r = h.register(pages as usize * PAGE);
    for p in 0..pages {
        r.write_bytes(p as usize * PAGE, &torn_page(p, 0));
    }
    let d = r.descriptor();
    let mut c = h.connect();
    let stop = AtomicBool::new(false);
    let (mut valid, mut torn) = (0u64, 0u64);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut g = 1u64;
            while !stop.load(Ordering::Relaxed) {
                for p in 0..pages {
                    r.write_bytes(p as usize * PAGE, &torn_page(p, g));
                }
                g += 1;
                std::thread::sleep(Duration::from_micros(300));
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut bufs = vec![vec![0u8; PAGE]; pages as usize];
        for round in 0.. {
            if Instant::now() > deadline
                || (round >= 50 && valid > 0 && (torn > 0 || chaos.is_none()))
            {
                break;
            }
            let reqs: Vec<ReadRequest> = bufs
                .iter_mut()
                .enumerate()
                .map(|(i, b)| ReadRequest::new(i as u64, d, i as u64 * PAGE as u64, b))
                .collect();
            // SAFETY: `bufs` outlives `collect`, which returns every completion.
            unsafe { c.post_reads(&reqs) }.expect("post");
            let got = collect(&mut c, reqs.len(), 30, false);
            for (i, b) in bufs.iter().enumerate() {
                assert_eq!(got[&(i as u64)], Ok(()));
                if validate(i as u64, b) {
                    valid += 1
                } else {
                    torn += 1
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    eprintln!("concurrent rewrites: {valid} valid reads, {torn} torn reads caught by the checksum");
    assert!(valid > 0, "no read ever validated");
    if chaos.is_some() {
        assert!(torn > 0, "chaos mode never produced a torn read");
    }
}

/// The owner goes away while a batch is in flight: every READ completes
/// (an error for those after the loss), nothing hangs, later posts fail.
pub fn peer_disconnects_mid_batch<H: Harness>() {
    let chaos = H::CHAOS.then_some(Chaos {
        pause: Some(Duration::from_millis(2)),
    });
    let h = std::sync::Arc::new(H::new(chaos));
    let len = 128 << 10;
    let (r, p) = filled(&*h, len, 5);
    let d = r.descriptor();
    let mut c = h.connect();
    assert_eq!(read(&mut c, d, 0, 64).expect("before the loss"), p[..64]);
    let mut bufs = vec![vec![0u8; 4096]; 32];
    let reqs: Vec<ReadRequest> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| ReadRequest::new(i as u64, d, i as u64 * 4096, b))
        .collect();
    let killer = {
        let h = std::sync::Arc::clone(&h);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(15));
            h.kill();
        })
    };
    // SAFETY: `bufs` outlives `collect`, which returns every completion.
    unsafe { c.post_reads(&reqs) }.expect("post");
    let got = collect(&mut c, reqs.len(), 30, false);
    killer.join().expect("killer");
    let lost = got
        .values()
        .filter(|r| **r == Err(ReadError::ConnectionLost))
        .count();
    for (i, b) in bufs.iter().enumerate() {
        match &got[&(i as u64)] {
            Ok(()) => assert!(
                b[..] == p[i * 4096..(i + 1) * 4096],
                "read {i} completed with wrong bytes"
            ),
            Err(ReadError::ConnectionLost) => {}
            Err(e) => panic!("read {i}: unexpected {e:?}"),
        }
    }
    if H::CHAOS {
        assert!(
            lost > 0,
            "the loss happened mid-batch, yet no READ reported it"
        );
    }
    // After the loss (allow the backend its transport timeout), posts fail.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match read_or_post_error(&mut c, d) {
            Some(Err(ReadError::ConnectionLost)) | None => break,
            Some(Ok(())) => {
                assert!(
                    Instant::now() < deadline,
                    "READs still succeed long after the owner went away"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            Some(Err(e)) => panic!("after the loss: unexpected {e:?}"),
        }
    }
}

/// `None` when the post itself is refused with `ConnectionLost`.
fn read_or_post_error<C: Connection>(
    c: &mut C,
    d: RegionDescriptor,
) -> Option<Result<(), ReadError>> {
    let mut buf = vec![0u8; 64];
    let req = ReadRequest::new(99, d, 0, &mut buf);
    // SAFETY: `buf` outlives `collect`, which returns the completion.
    match unsafe { c.post_reads(&[req]) } {
        Err(PostError::ConnectionLost) => None,
        Err(e) => panic!("post after the loss: unexpected {e:?}"),
        Ok(()) => Some(collect(c, 1, 30, false).remove(&99).expect("completion 99")),
    }
}

pub fn many_concurrent_connections<H: Harness>() {
    let h = H::new(None);
    let len = 1 << 20;
    let (r, p) = filled(&h, len, 6);
    let d = r.descriptor();
    let conns: Vec<H::Conn> = (0..16).map(|_| h.connect()).collect();
    std::thread::scope(|s| {
        for (t, mut c) in conns.into_iter().enumerate() {
            let p = &p;
            s.spawn(move || {
                let mut bufs = vec![vec![0u8; 4096]; 8];
                for round in 0..100u64 {
                    let offs: Vec<u64> = (0..8)
                        .map(|i| {
                            splitmix64((t as u64) << 32 | round << 8 | i) % (len as u64 - 4096)
                        })
                        .collect();
                    let reqs: Vec<ReadRequest> = bufs
                        .iter_mut()
                        .zip(&offs)
                        .enumerate()
                        .map(|(i, (b, off))| ReadRequest::new(i as u64, d, *off, b))
                        .collect();
                    // SAFETY: `bufs` outlives `collect`, which returns every completion.
                    unsafe { c.post_reads(&reqs) }.expect("post");
                    let got = collect(&mut c, 8, 30, t % 2 == 0);
                    for (i, off) in offs.iter().enumerate() {
                        assert_eq!(got[&(i as u64)], Ok(()));
                        let off = *off as usize;
                        assert!(
                            bufs[i][..] == p[off..off + 4096],
                            "connection {t} round {round}: wrong bytes"
                        );
                    }
                }
            });
        }
    });
}

pub fn awaited_from_tokio<H: Harness>() {
    let h = H::new(None);
    let len = 64 << 10;
    let (r, p) = filled(&h, len, 7);
    let d = r.descriptor();
    let conns: Vec<H::Conn> = (0..4).map(|_| h.connect()).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut tasks = Vec::new();
        for (t, c) in conns.into_iter().enumerate() {
            let p = p.clone();
            tasks.push(tokio::spawn(async move {
                let mut c = AsyncConnection::new(c).expect("register with the reactor");
                for round in 0..50usize {
                    let mut bufs = vec![vec![0u8; 4096]; 16];
                    let reqs: Vec<ReadRequest> = bufs
                        .iter_mut()
                        .enumerate()
                        .map(|(i, b)| {
                            ReadRequest::new(i as u64, d, ((i + round + t) % 16) as u64 * 4096, b)
                        })
                        .collect();
                    // SAFETY: `bufs` lives until the loop below has received
                    // every completion.
                    unsafe { c.post_reads(&reqs) }.expect("post");
                    let mut out = Vec::new();
                    while out.len() < 16 {
                        tokio::time::timeout(Duration::from_secs(30), c.completions(&mut out))
                            .await
                            .expect("completions within 30 s");
                    }
                    for comp in &out {
                        assert_eq!(comp.result, Ok(()));
                        let i = comp.id as usize;
                        let off = ((i + round + t) % 16) * 4096;
                        assert!(bufs[i][..] == p[off..off + 4096], "task {t}: wrong bytes");
                    }
                }
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
    });
}

/// Expands to the suite's tests for harness `$h`, each bounded in time;
/// `$($attr)*` (e.g. an `#[ignore = "..."]`) is put on every test.
#[macro_export]
macro_rules! conformance_tests {
    ($h:ty $(, #[$attr:meta])*) => {
        #[test] $(#[$attr])*
        fn whole_region_and_edges() {
            conformance::bounded(60, conformance::whole_region_and_edges::<$h>);
        }
        #[test] $(#[$attr])*
        fn batches() {
            conformance::bounded(120, conformance::batches::<$h>);
        }
        #[test] $(#[$attr])*
        fn bad_requests_fail_and_connection_survives() {
            conformance::bounded(60, conformance::bad_requests_fail_and_connection_survives::<$h>);
        }
        #[test] $(#[$attr])*
        fn concurrent_rewrites_are_detectable() {
            conformance::bounded(60, || conformance::concurrent_rewrites_are_detectable::<$h>(None));
        }
        #[test] $(#[$attr])*
        fn peer_disconnects_mid_batch() {
            conformance::bounded(60, conformance::peer_disconnects_mid_batch::<$h>);
        }
        #[test] $(#[$attr])*
        fn many_concurrent_connections() {
            conformance::bounded(120, conformance::many_concurrent_connections::<$h>);
        }
        #[test] $(#[$attr])*
        fn awaited_from_tokio() {
            conformance::bounded(60, conformance::awaited_from_tokio::<$h>);
        }
    };
}
