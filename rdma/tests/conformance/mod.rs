//! The conformance suite, written once and run against every backend.
//!
//! A backend's test file implements [`Harness`] and invokes
//! [`conformance_tests!`], which expands to one `#[test]` per check. Every
//! check is bounded in time ([`bounded`]) and verifies every byte it reads.

#![allow(dead_code)]

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use memmap2::MmapMut;
use pagewire_rdma::{
    AccessFault, AsyncConnection, Chaos, Completion, Connection, LocalRegion, MemoryOwner,
    PostError, ReadError, ReadRequest, RegionDescriptor,
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

/// A backend whose owner takes a caller-chosen epoch (the node's incarnation).
pub trait EpochHarness: Harness {
    /// A fresh owner whose descriptors carry `epoch` (non-zero).
    fn with_epoch(epoch: u64) -> Self;
}

/// A backend that serves memory the caller already has.
pub trait ExternalHarness: Harness {
    /// Registers `len` bytes at `ptr`, kept alive by `owner`.
    ///
    /// # Safety
    /// The backend's `register_external` contract: the memory stays valid
    /// while `owner` lives and is only written atomically while registered.
    unsafe fn register_external(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        owner: MemoryOwner,
    ) -> Self::Region;
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

/// A random non-zero epoch, different in every run.
fn some_epoch() -> u64 {
    splitmix64(
        u64::from(std::process::id())
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
    ) | 1
}

/// The caller's epoch is the one every descriptor carries, and the only one
/// a READ may name.
pub fn chosen_epoch_is_carried_and_enforced<H: EpochHarness>() {
    let epoch = some_epoch();
    let h = H::with_epoch(epoch);
    let (r1, p1) = filled(&h, 8192, 11);
    let (r2, p2) = filled(&h, 4096, 12);
    let (d1, d2) = (r1.descriptor(), r2.descriptor());
    assert_eq!(d1.epoch, epoch, "descriptor epoch is not the chosen one");
    assert_eq!(d2.epoch, epoch, "every region carries the owner's epoch");
    let mut c = h.connect();
    assert_eq!(read(&mut c, d1, 0, 8192).expect("chosen epoch"), p1);
    assert_eq!(
        read(&mut c, d2, 100, 50).expect("chosen epoch"),
        p2[100..150]
    );
    for wrong in [epoch + 1, epoch ^ (1 << 40), 0] {
        let mut d = d1;
        d.epoch = wrong;
        assert_eq!(
            read(&mut c, d, 0, 64).map(|_| ()),
            Err(ReadError::RemoteAccess(AccessFault::StaleEpoch)),
            "epoch {wrong:#x} instead of {epoch:#x}"
        );
    }
    assert_eq!(
        read(&mut c, d1, 8000, 192).expect("still served"),
        p1[8000..]
    );
}

/// Stores `data` at `ptr` with atomic word stores, as an owner writing its
/// own registered memory must.
///
/// # Safety
/// `ptr..ptr + data.len()` is writable, 8-aligned, and `data.len()` is a
/// multiple of 8.
unsafe fn store_words(ptr: *mut u8, data: &[u8]) {
    for (i, w) in data.chunks_exact(8).enumerate() {
        // SAFETY: in range and 8-aligned (the caller's contract); every
        // access to the registered memory is atomic.
        unsafe { AtomicU64::from_ptr(ptr.add(i * 8).cast::<u64>()) }.store(
            u64::from_le_bytes(w.try_into().expect("8")),
            Ordering::Relaxed,
        );
    }
}

/// Memory the caller owns, registered in place: READs see what the owner
/// writes after registration, bounds and epoch are checked as for an
/// allocated region, and dropping the registration revokes it and releases
/// the owner guard (after which the memory is unmapped: a backend that still
/// touched it would crash the test).
pub fn external_memory_is_served_in_place<H: ExternalHarness>() {
    let h = H::new(None);
    let len = 256 << 10;
    let mut map = MmapMut::map_anon(len).expect("map");
    let ptr = NonNull::new(map.as_mut_ptr()).expect("non-null");
    let guard = Arc::new(map);
    let weak = Arc::downgrade(&guard);
    // SAFETY: the mapping lives as long as `guard`, which the region keeps;
    // from here on it is written only with atomic stores (`store_words`).
    let r = unsafe { h.register_external(ptr, len, guard) };
    assert!(weak.upgrade().is_some(), "the registration keeps its owner");
    let d = r.descriptor();
    assert_eq!(d.addr, ptr.as_ptr() as u64, "served in place, not copied");
    assert_eq!(d.len, len as u64);
    assert_eq!(r.as_ptr(), ptr.as_ptr());
    let mut c = h.connect();
    // Zeroes until the owner writes.
    assert_eq!(read(&mut c, d, 0, 4096).expect("fresh"), vec![0u8; 4096]);
    let p = pattern(len, 21);
    // SAFETY: inside the mapping, page-aligned, a multiple of 8 bytes.
    unsafe { store_words(ptr.as_ptr(), &p) };
    // In 32 KiB READs: a backend may limit one READ's length (verbs: 64 KiB).
    for off in (0..len).step_by(32 << 10) {
        assert!(
            read(&mut c, d, off as u64, 32 << 10).expect("whole region")[..]
                == p[off..off + (32 << 10)],
            "wrong bytes at {off}"
        );
    }
    assert_eq!(read(&mut c, d, 4097, 3000).expect("middle"), p[4097..7097]);
    // The owner rewrites a page; the next READ sees the new bytes.
    let q = pattern(4096, 22);
    // SAFETY: as above.
    unsafe { store_words(ptr.as_ptr().add(8192), &q) };
    assert_eq!(read(&mut c, d, 8192, 4096).expect("rewritten page"), q);
    // Bounds and epoch, as for any region.
    let remote_access = |res: Result<Vec<u8>, ReadError>, what: &str| match res {
        Err(ReadError::RemoteAccess(_)) => {}
        other => panic!(
            "{what}: expected a remote access error, got {:?}",
            other.map(|v| v.len())
        ),
    };
    remote_access(read(&mut c, d, len as u64 - 8, 16), "past the end");
    let mut longer = d;
    longer.len += 4096;
    remote_access(
        read(&mut c, longer, len as u64, 64),
        "past the registered end",
    );
    let mut stale = d;
    stale.epoch ^= 0x40;
    assert_eq!(
        read(&mut c, stale, 0, 64).map(|_| ()),
        Err(ReadError::RemoteAccess(AccessFault::StaleEpoch))
    );
    assert_eq!(read(&mut c, d, 0, 64).expect("after errors"), p[..64]);

    // Revocation while another connection keeps reading: every READ either
    // returns the right bytes or is refused, and the guard is released. A
    // READ in flight at the revocation may also lose its connection (verbs:
    // the owner's queue pair may go to the error state); the reader then
    // reconnects, as a real one would.
    let counts = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
    std::thread::scope(|s| {
        let (counts, p, q, h) = (&counts, &p, &q, &h);
        s.spawn(move || {
            let mut c2 = h.connect();
            // Until a few READs were refused after the revocation.
            while counts[1].load(Ordering::Relaxed) < 3 {
                match read(&mut c2, d, 0, 16 << 10) {
                    Ok(b) => {
                        assert!(
                            b[..8192] == p[..8192]
                                && b[8192..12288] == q[..]
                                && b[12288..] == p[12288..16384],
                            "wrong bytes from external memory"
                        );
                        counts[0].fetch_add(1, Ordering::Relaxed);
                    }
                    Err(ReadError::RemoteAccess(_)) => {
                        counts[1].fetch_add(1, Ordering::Relaxed);
                    }
                    Err(ReadError::ConnectionLost) if counts[2].load(Ordering::Relaxed) < 3 => {
                        counts[2].fetch_add(1, Ordering::Relaxed);
                        c2 = h.connect();
                    }
                    Err(e) => panic!("unexpected {e:?}"),
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        while counts[0].load(Ordering::Relaxed) < 3 {
            assert!(
                Instant::now() < deadline,
                "no READ of external memory succeeded"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(r);
        assert!(
            weak.upgrade().is_none(),
            "dropping the registration releases its owner (and unmaps)"
        );
    });
    let [ok, refused, lost] = counts.map(AtomicU64::into_inner);
    eprintln!(
        "revocation under load: {ok} READs before, {refused} refused after, {lost} connections lost"
    );
    remote_access(read(&mut c, d, 0, 64), "revoked region");
    // The connection and the owner carry on.
    let (r3, p3) = filled(&h, 4096, 23);
    assert_eq!(
        read(&mut c, r3.descriptor(), 0, 4096).expect("new region"),
        p3
    );
}

/// Expands to the caller-chosen epoch check for harness `$h`.
#[macro_export]
macro_rules! epoch_tests {
    ($h:ty $(, #[$attr:meta])*) => {
        #[test] $(#[$attr])*
        fn chosen_epoch_is_carried_and_enforced() {
            conformance::bounded(60, conformance::chosen_epoch_is_carried_and_enforced::<$h>);
        }
    };
}

/// Expands to the external-memory check for harness `$h`.
#[macro_export]
macro_rules! external_memory_tests {
    ($h:ty $(, #[$attr:meta])*) => {
        #[test] $(#[$attr])*
        fn external_memory_is_served_in_place() {
            conformance::bounded(60, conformance::external_memory_is_served_in_place::<$h>);
        }
    };
}

/// Any backend's connections shared the way a reader process shares one
/// per owner among its threads: every `connect` is a new
/// [`SharedHandle`](pagewire_rdma::SharedHandle) of one
/// [`SharedConnection`](pagewire_rdma::SharedConnection) (a new one once it
/// broke), so the suite's concurrent connections are handles multiplexed
/// onto one connection, and each must still get exactly its own
/// completions. `FD`: shared with `SharedConnection::waiting_on_fd`
/// (handles sleep on the readiness descriptor without the lock).
pub struct Shared<H: Harness, const FD: bool = false> {
    inner: H,
    conn: std::sync::Mutex<Option<pagewire_rdma::SharedConnection<H::Conn>>>,
}

impl<H: Harness, const FD: bool> Harness for Shared<H, FD> {
    type Region = H::Region;
    type Conn = pagewire_rdma::SharedHandle<H::Conn>;
    const CHAOS: bool = H::CHAOS;

    fn new(chaos: Option<Chaos>) -> Self {
        Self {
            inner: H::new(chaos),
            conn: std::sync::Mutex::new(None),
        }
    }

    fn register(&self, len: usize) -> Self::Region {
        self.inner.register(len)
    }

    fn connect(&self) -> Self::Conn {
        let mut g = self.conn.lock().expect("lock");
        if g.as_ref()
            .is_none_or(pagewire_rdma::SharedConnection::is_broken)
        {
            let c = self.inner.connect();
            *g = Some(if FD {
                pagewire_rdma::SharedConnection::waiting_on_fd(c, Duration::from_micros(50))
            } else {
                pagewire_rdma::SharedConnection::new(c)
            });
        }
        g.as_ref().expect("set above").handle()
    }

    fn kill(&self) {
        self.inner.kill();
    }
}
