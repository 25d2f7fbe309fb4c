//! loom models of the races the lockless cache must survive, for local
//! readers (which take references) and remote readers (which copy words in
//! any order and validate by checksum, or, ordered, bracket their copy with
//! two loads of the generation). They run
//! the shipping code of [`crate::core`] and [`crate::raw`] (loom atomics and
//! `UnsafeCell`s come in through [`crate::sync`]), so loom checks both the
//! protocol's outcomes and that no frame byte is read while it is written.
//!
//! ```text
//! RUSTFLAGS="--cfg loom --cfg crossbeam_loom" \
//!   cargo test -p pagewire-node --release --lib loom_models
//! ```

use crate::core::{Core, Lost, Sweep};
use crate::index::{Index, Lockless};
use crate::layout::RegionLayout;
use crate::raw::frames::Frames;
use crate::raw::region::Region;
use loom::sync::Arc;
use loom::thread;

const PS: usize = 16;

fn core(frames: usize) -> Core<Lockless> {
    Core::new(Frames::new(
        Region::new(RegionLayout::new(PS, frames), 16, 16 * PS as u64).unwrap(),
    ))
}

/// Fill a fresh frame with `tag` in every byte and index it as `page`.
fn insert(c: &Core<Lockless>, page: u64, tag: u8) -> Result<u32, Lost> {
    let f = c.frames.alloc().expect("a free frame");
    // SAFETY: `alloc` gave us the frame in state Filling, exclusively.
    unsafe { c.frames.region().fill(f, |b| b.fill(tag)) };
    c.insert_filled(page, f, PS as u32)
}

/// Read a held frame's bytes; every byte must be the same tag.
fn read_tag(c: &Core<Lockless>, f: u32) -> u8 {
    // SAFETY: the caller holds a reference on `f`.
    unsafe {
        c.frames.region().read(f, |b| {
            assert!(b.iter().all(|&x| x == b[0]), "torn frame {b:?}");
            b[0]
        })
    }
}

fn builder() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b
}

/// A lookup of page 1 races eviction of page 1 and reuse of its only frame
/// for page 2. The reader gets page 1's bytes or a miss, never page 2's.
#[test]
fn lookup_vs_evict_and_reuse() {
    builder().check(|| {
        let c = Arc::new(core(1));
        let f = insert(&c, 1, 0x11).unwrap();
        c.frames.put(f);
        let generation = c.index.peek(&c.frames, 1).unwrap().1;

        let reader = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                let mut retries = 0;
                if let Some(f) = c.lookup(1, &mut retries) {
                    assert_eq!(read_tag(&c, f), 0x11);
                    c.frames.put(f);
                }
            })
        };
        if c.remove_frame(1, f, generation) == Sweep::Evicted {
            let g = insert(&c, 2, 0x22).unwrap();
            assert_eq!(g, f, "the only frame is reused");
            c.frames.put(g);
        }
        reader.join().unwrap();
        let mut retries = 0;
        if let Some(f) = c.lookup(2, &mut retries) {
            assert_eq!(read_tag(&c, f), 0x22);
            c.frames.put(f);
        }
    });
}

/// Two threads insert page 7 at once: exactly one wins, the loser's frame
/// goes back to the free list, and a lookup finds the winner's bytes.
#[test]
fn insert_vs_insert_same_page() {
    builder().check(|| {
        let c = Arc::new(core(2));
        let other = {
            let c = Arc::clone(&c);
            thread::spawn(move || insert(&c, 7, 0xB).map(|f| c.frames.put(f)).is_ok())
        };
        let mine = insert(&c, 7, 0xA).map(|f| c.frames.put(f)).is_ok();
        let theirs = other.join().unwrap();
        assert!(
            mine ^ theirs,
            "exactly one insert wins (mine {mine}, theirs {theirs})"
        );
        let mut retries = 0;
        let f = c.lookup(7, &mut retries).expect("page 7 indexed");
        assert_eq!(read_tag(&c, f), if mine { 0xA } else { 0xB });
        c.frames.put(f);
        assert_eq!(c.frames.free_count(), 1, "the loser's frame is free again");
    });
}

/// A copy-on-write of page 3 races a reader. The reader sees the old or the
/// new bytes, whole; after the write every lookup sees the new bytes, and
/// the old frame is freed once the reader lets go of it.
#[test]
fn cow_publish_vs_reader() {
    builder().check(|| {
        let c = Arc::new(core(2));
        let f = insert(&c, 3, 0x30).unwrap();
        c.frames.put(f);

        let reader = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                let mut retries = 0;
                let f = c.lookup(3, &mut retries).expect("page 3 is always indexed");
                let tag = read_tag(&c, f);
                assert!(tag == 0x30 || tag == 0x31, "tag {tag:#x}");
                c.frames.put(f);
            })
        };
        let n = c.frames.alloc().expect("second frame");
        // SAFETY: `alloc` gave us the frame exclusively.
        unsafe { c.frames.region().fill(n, |b| b.fill(0x31)) };
        c.publish_cow(3, n, PS as u32).unwrap();
        // Acknowledged: from here on no lookup may return the old bytes.
        let mut retries = 0;
        let g = c.lookup(3, &mut retries).unwrap();
        assert_eq!(read_tag(&c, g), 0x31);
        c.frames.put(g);
        reader.join().unwrap();
        assert_eq!(
            c.frames.free_count(),
            1,
            "the retired frame is freed after its last reader"
        );
    });
}

/// A guard-scoped reader (no reference) looks up page 1 while the owner
/// evicts it and tries to reuse the only frame for page 2. The reader gets
/// page 1's bytes, whole, or a miss; loom's cell tracking fails the model if
/// the refill could write the frame while the pinned reader reads it. The
/// refill gets the frame only once the reader has unpinned (or before it
/// pinned).
#[test]
fn pinned_lookup_vs_evict_and_reuse() {
    pinned_reader_vs_evict_and_reuse(builder(), false);
}

/// A reader that keeps its pin and repins it (`Pin::repin`: a thread that
/// reads one page at a time) looks up page 1 after the repin, in the race
/// above. The owner's collection may move the epoch between the reader's
/// pin and its repin. With the reader unpinned after the repin instead,
/// this model fails (torn frame), found with a preemption bound of 4 (not
/// with 3, hence the bound here).
#[test]
fn repinned_lookup_vs_evict_and_reuse() {
    let mut b = builder();
    b.preemption_bound = Some(4);
    pinned_reader_vs_evict_and_reuse(b, true);
}

/// The race of the two models above: a guard-scoped reader of page 1
/// (pinned, then repinned if `repin`) against its eviction and the reuse
/// of the only frame for page 2.
fn pinned_reader_vs_evict_and_reuse(b: loom::model::Builder, repin: bool) {
    b.check(move || {
        let c = Arc::new(core(1));
        let f = insert(&c, 1, 0x11).unwrap();
        c.frames.put(f);
        let generation = c.index.peek(&c.frames, 1).unwrap().1;

        let reader = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                let mut guard = crossbeam_epoch::pin();
                if repin {
                    crate::sync::repin(&mut guard);
                }
                let mut retries = 0;
                if let Some(f) = c.lookup_pinned(1, &guard, &mut retries) {
                    assert_eq!(read_tag(&c, f), 0x11);
                }
                drop(guard);
            })
        };
        if c.remove_frame(1, f, generation) == Sweep::Evicted {
            // No frame while the reader stays pinned: the free waits for it.
            if let Some(g) = c.frames.alloc() {
                assert_eq!(g, f, "the only frame is reused");
                // SAFETY: `alloc` gave us the frame in state Filling.
                unsafe { c.frames.region().fill(g, |b| b.fill(0x22)) };
                let g = c.insert_filled(2, g, PS as u32).unwrap();
                c.frames.put(g);
            }
        }
        reader.join().unwrap();
        c.frames.settle();
        assert_eq!(
            c.frames.free_count() + c.index.peek(&c.frames, 2).map_or(0, |_| 1),
            1,
            "the frame is lost or counted twice"
        );
    });
}

/// A guard-scoped reader of page 3 races two copy-on-writes of it, the
/// second of which reuses the first copy's frame (once the grace period
/// allows). The reader sees one copy's bytes, whole, never a frame being
/// refilled; after the writes every lookup sees the last copy.
#[test]
fn pinned_lookup_vs_cow_and_reuse() {
    let mut b = builder();
    b.preemption_bound = Some(2);
    pinned_reader_vs_cow_and_reuse(b, false);
}

/// The race above with a reader that repins its pin before the lookup
/// (`Pin::repin`); the writes' collection may move the epoch between the
/// reader's pin and its repin. With the reader unpinned after the repin
/// instead, this model fails (torn frame: the first copy's frame refilled
/// by the second write) at a preemption bound of 4, not at 3. It is the
/// second longest model (about 400 s), so CI runs it beside the longest.
#[test]
fn repinned_lookup_vs_cow_and_reuse() {
    let mut b = builder();
    b.preemption_bound = Some(4);
    pinned_reader_vs_cow_and_reuse(b, true);
}

/// The race of the two models above: a guard-scoped reader of page 3
/// (pinned, then repinned if `repin`) against two copy-on-writes of it.
fn pinned_reader_vs_cow_and_reuse(b: loom::model::Builder, repin: bool) {
    b.check(move || {
        let c = Arc::new(core(2));
        let first = insert(&c, 3, 0x30).unwrap();
        c.frames.put(first);

        let reader = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                let mut guard = crossbeam_epoch::pin();
                if repin {
                    crate::sync::repin(&mut guard);
                }
                let mut retries = 0;
                let f = c
                    .lookup_pinned(3, &guard, &mut retries)
                    .expect("page 3 is always indexed");
                let tag = read_tag(&c, f);
                assert!((0x30..=0x32).contains(&tag), "tag {tag:#x}");
                drop(guard);
            })
        };
        let mut last = 0x30;
        for tag in [0x31, 0x32] {
            // The second write may find no frame: the first copy's waits
            // for the pinned reader.
            let Some(n) = c.frames.alloc() else { break };
            // SAFETY: `alloc` gave us the frame exclusively.
            unsafe { c.frames.region().fill(n, |b| b.fill(tag)) };
            c.publish_cow(3, n, PS as u32).unwrap();
            last = tag;
        }
        // Acknowledged: from here on no lookup may return an older copy.
        let guard = crossbeam_epoch::pin();
        let mut retries = 0;
        let g = c.lookup_pinned(3, &guard, &mut retries).unwrap();
        assert_eq!(read_tag(&c, g), last);
        drop(guard);
        reader.join().unwrap();
    });
}

/// A reader walking an overflow bucket races the removal that empties and
/// unlinks it and an insert that reuses it (through the epoch) for another
/// chain. Pages 0..=3 share bucket 0 of a 4-bucket index... we pick pages by
/// hash so that four of them land in one chain.
#[test]
fn overflow_unlink_vs_reader() {
    let mut b = builder();
    b.preemption_bound = Some(2);
    b.check(|| {
        let c = Arc::new(core(4));
        let buckets = c.frames.region().layout().bucket_count as u64;
        let chain: Vec<u64> = (0..1000u64)
            .filter(|&p| crate::layout::bucket_of(p, buckets) == 0)
            .take(4)
            .collect();
        for (i, &p) in chain.iter().enumerate() {
            let f = insert(&c, p, i as u8 + 1).unwrap();
            c.frames.put(f);
        }
        let last = chain[3]; // lives alone in the overflow bucket
        let reader = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                let mut retries = 0;
                if let Some(f) = c.lookup(last, &mut retries) {
                    let t = read_tag(&c, f);
                    assert!(t == 4 || t == 9, "tag {t}");
                    c.frames.put(f);
                }
            })
        };
        let (f, generation) = c.index.peek(&c.frames, last).unwrap();
        if c.remove_frame(last, f, generation) == Sweep::Evicted {
            let g = insert(&c, last, 9).unwrap();
            c.frames.put(g);
        }
        reader.join().unwrap();
        let mut retries = 0;
        let f = c.lookup(last, &mut retries);
        if let Some(f) = f {
            let t = read_tag(&c, f);
            assert!(t == 4 || t == 9);
            c.frames.put(f);
        }
    });
}

/// What a remote reader copied: the header words and the frame words, each
/// loaded once, in the order `order` names (`H` = one header word, `B` = one
/// frame word), as a NIC may copy them.
fn remote_copy(c: &Core<Lockless>, f: u32, order: &[Word]) -> (crate::layout::RawHeader, Vec<u8>) {
    use crate::sync::Ordering::Relaxed;
    let h = c.frames.header(f);
    let mut hdr = crate::layout::RawHeader {
        page: 0,
        generation: 0,
        checksum: 0,
        len: 0,
        state: 0,
    };
    let mut bytes = vec![0u8; PS];
    let mut word = vec![0u8; PS];
    for w in order {
        match w {
            Word::Page => hdr.page = h.page.load(Relaxed),
            Word::Generation => hdr.generation = h.generation.load(Relaxed),
            Word::Checksum => hdr.checksum = h.checksum.load(Relaxed),
            Word::LenState => {
                hdr.len = h.len.load(Relaxed);
                hdr.state = h.state.load(Relaxed);
            }
            Word::Byte(i) => {
                // One atomic copy of the whole frame, keeping only word i: the
                // loom arena is atomic words, so this is one load per word.
                c.frames.region().copy_frame(f, &mut word);
                bytes[i * 8..i * 8 + 8].copy_from_slice(&word[i * 8..i * 8 + 8]);
            }
        }
    }
    (hdr, bytes)
}

#[derive(Clone, Copy, Debug)]
enum Word {
    Page,
    Generation,
    Checksum,
    LenState,
    Byte(usize),
}

/// Word orders for the remote reader: header first, bytes first, and the
/// generation last (the order that defeats a validation that ignores it).
fn orders() -> Vec<Vec<Word>> {
    use Word::*;
    vec![
        vec![Generation, Page, Checksum, LenState, Byte(0), Byte(1)],
        vec![Byte(0), Byte(1), Checksum, Page, LenState, Generation],
        vec![Byte(1), Checksum, Generation, Byte(0), LenState, Page],
    ]
}

/// A remote reader: one that copies words in the order given and validates
/// by checksum (any transport), or an ordered one (`shm`: each READ's loads
/// ordered before the next READ's by an Acquire fence) that brackets its
/// copy with two loads of the generation and computes no checksum.
#[derive(Clone, Debug)]
enum Reader {
    Words(Vec<Word>),
    Ordered,
}

/// Every word order of [`orders`], and the ordered reader.
fn readers() -> Vec<Reader> {
    let mut r: Vec<Reader> = orders().into_iter().map(Reader::Words).collect();
    r.push(Reader::Ordered);
    r
}

/// What a [`Reader`] copied of a frame.
struct Copied {
    hdr: crate::layout::RawHeader,
    bytes: Vec<u8>,
    /// The ordered reader's generations before and after the copy.
    bracket: Option<(u64, u64)>,
}

impl Copied {
    /// Whether the reader accepts the copy as `page`.
    fn accepts(&self, page: u64) -> bool {
        match self.bracket {
            Some((before, after)) => self.hdr.validate_bracketed(page, before, after),
            None => self.hdr.validate(page, &self.bytes),
        }
    }
}

/// Frame `f` as `reader` copies it.
fn copy(c: &Core<Lockless>, f: u32, reader: &Reader) -> Copied {
    match reader {
        Reader::Words(order) => {
            let (hdr, bytes) = remote_copy(c, f, order);
            Copied {
                hdr,
                bytes,
                bracket: None,
            }
        }
        Reader::Ordered => ordered_copy(c, f),
    }
}

/// The ordered reader's READs: the generation, the header words (in
/// address order, as the shm copy loads them), the frame, the generation
/// again, with an Acquire fence after each READ.
fn ordered_copy(c: &Core<Lockless>, f: u32) -> Copied {
    use crate::sync::Ordering::{Acquire, Relaxed};
    use crate::sync::fence;
    let h = c.frames.header(f);
    let before = h.generation.load(Relaxed);
    fence(Acquire);
    let hdr = crate::layout::RawHeader {
        page: h.page.load(Relaxed),
        generation: h.generation.load(Relaxed),
        checksum: h.checksum.load(Relaxed),
        len: h.len.load(Relaxed),
        state: h.state.load(Relaxed),
    };
    fence(Acquire);
    let mut bytes = vec![0u8; PS];
    c.frames.region().copy_frame(f, &mut bytes);
    fence(Acquire);
    let after = h.generation.load(Relaxed);
    Copied {
        hdr,
        bytes,
        bracket: Some((before, after)),
    }
}

/// The owner of the copy-on-write races: page 1 (0x11) cached in frame 0
/// of a two-frame cache; a thread that writes page 1 (copy-on-write into
/// frame 1, 0x12), acknowledges the write, and with `reuse` then reuses
/// frame 0 for page 2 (0x22). Returns the cache, frame 0, the
/// acknowledgement and the thread.
fn cow_race(
    reuse: bool,
) -> (
    Arc<Core<Lockless>>,
    u32,
    Arc<loom::sync::atomic::AtomicBool>,
    thread::JoinHandle<()>,
) {
    let c = Arc::new(core(2));
    let f = insert(&c, 1, 0x11).unwrap();
    c.frames.put(f);
    let acked = Arc::new(loom::sync::atomic::AtomicBool::new(false));
    let owner = {
        let (c, acked) = (Arc::clone(&c), Arc::clone(&acked));
        thread::spawn(move || {
            let n = c.frames.alloc().expect("second frame");
            // SAFETY: `alloc` gave us the frame exclusively.
            unsafe { c.frames.region().fill(n, |b| b.fill(0x12)) };
            c.publish_cow(1, n, PS as u32).unwrap();
            // The acknowledgement (a reply on a socket in the daemon).
            acked.store(true, crate::sync::Ordering::Release);
            if reuse {
                let g = insert(&c, 2, 0x22).unwrap();
                assert_eq!(g, f, "the old frame is the only free one");
                c.frames.put(g);
            }
        })
    };
    (c, f, acked, owner)
}

/// A remote reader holding a stale location of page 1 (frame 0) copies it,
/// word by word in a chosen order or ordered, while the owner writes page 1
/// (copy-on-write into frame 1) and acknowledges the write. A copy that
/// validates holds page 1's old or new bytes, whole, and never the old ones
/// if the acknowledgement came before the copy began.
#[test]
fn remote_copy_vs_cow() {
    for reader in readers() {
        builder().check(move || {
            let (c, f, acked, writer) = cow_race(false);
            let after_ack = acked.load(crate::sync::Ordering::Acquire);
            let got = copy(&c, f, &reader);
            if got.accepts(1) {
                let bytes = &got.bytes;
                assert!(bytes.iter().all(|&b| b == 0x11), "torn copy {bytes:?}");
                assert!(!after_ack, "old bytes accepted after the write's ack");
            }
            writer.join().unwrap();
        });
    }
}

/// A remote reader (each word order, and the ordered reader) copies frame
/// 0, which held page 1, while the owner evicts page 1 and refills the same
/// frame with page 2. A copy that validates as
/// page 1 holds page 1's bytes, whole; page 2's bytes never validate as
/// page 1, and a mix of the two never validates at all.
#[test]
fn remote_copy_vs_evict_and_refill() {
    for reader in readers() {
        builder().check(move || {
            let c = Arc::new(core(1));
            let f = insert(&c, 1, 0x11).unwrap();
            c.frames.put(f);
            let generation = c.index.peek(&c.frames, 1).unwrap().1;
            let owner = {
                let c = Arc::clone(&c);
                thread::spawn(move || {
                    assert_eq!(c.remove_frame(1, f, generation), Sweep::Evicted);
                    let g = insert(&c, 2, 0x22).unwrap();
                    c.frames.put(g);
                })
            };
            let got = copy(&c, f, &reader);
            let bytes = &got.bytes;
            if got.accepts(1) {
                assert!(bytes.iter().all(|&b| b == 0x11), "wrong bytes {bytes:?}");
            }
            if got.accepts(2) {
                assert!(bytes.iter().all(|&b| b == 0x22), "wrong bytes {bytes:?}");
            }
            owner.join().unwrap();
        });
    }
}

/// The ABA case: a reader holding a stale location of page 1 (frame 0)
/// copies it while the owner writes page 1 (copy-on-write into frame 1),
/// acknowledges, and reuses frame 0 for page 2. The word reader copies the
/// state word last, so it may see frame 0 published again (for page 2) with
/// every other word still page 1's old copy: the generation, read after the
/// acknowledgement, must still refuse it. The ordered reader (generation
/// before and after) is run against the same owner.
#[test]
fn remote_copy_vs_cow_and_reuse() {
    use Word::*;
    let order = vec![Byte(0), Byte(1), Checksum, Page, Generation, LenState];
    for reader in [Reader::Words(order), Reader::Ordered] {
        builder().check(move || {
            let (c, f, acked, owner) = cow_race(true);
            let after_ack = acked.load(crate::sync::Ordering::Acquire);
            let got = copy(&c, f, &reader);
            let (hdr, bytes) = (&got.hdr, &got.bytes);
            if got.accepts(1) {
                assert!(bytes.iter().all(|&b| b == 0x11), "torn copy {bytes:?}");
                assert!(
                    !after_ack,
                    "old bytes accepted after the write's ack: {hdr:?} {bytes:?}"
                );
            }
            if got.accepts(2) {
                assert!(bytes.iter().all(|&b| b == 0x22), "wrong bytes {bytes:?}");
            }
            owner.join().unwrap();
        });
    }
}

/// A copy-on-write of page 3 races the eviction of page 3's current frame
/// (a reader racing a copy-on-write is `cow_publish_vs_reader`). Whatever the
/// order, page 3 ends indexed with the new bytes (an eviction of the
/// replaced frame finds it gone; a copy-on-write after an eviction inserts),
/// and the old frame is free.
#[test]
fn cow_vs_evict_same_page() {
    builder().check(|| {
        let c = Arc::new(core(2));
        let f = insert(&c, 3, 0x30).unwrap();
        c.frames.put(f);
        let generation = c.index.peek(&c.frames, 3).unwrap().1;
        let evictor = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                let _ = c.remove_frame(3, f, generation);
            })
        };
        let n = c.frames.alloc().expect("second frame");
        // SAFETY: `alloc` gave us the frame exclusively.
        unsafe { c.frames.region().fill(n, |b| b.fill(0x31)) };
        c.publish_cow(3, n, PS as u32).unwrap();
        evictor.join().unwrap();
        let mut retries = 0;
        let g = c.lookup(3, &mut retries).expect("the write's copy stays");
        assert_eq!(read_tag(&c, g), 0x31);
        c.frames.put(g);
        assert_eq!(c.frames.free_count(), 1, "the old frame is free");
    });
}

/// One chain: an evictor empties and unlinks the overflow bucket of the last
/// page while an inserter adds another page to the same chain (joining that
/// bucket, or taking one from the pool). Both pages end where they should,
/// no overflow bucket is lost or doubled, and the unlinked one comes back to
/// the pool (a reader walking an unlinked bucket is
/// `overflow_unlink_vs_reader`).
#[test]
fn insert_vs_unlink_one_chain() {
    let mut b = builder();
    b.preemption_bound = Some(2);
    b.check(|| {
        let c = Arc::new(core(6));
        let buckets = c.frames.region().layout().bucket_count as u64;
        let chain: Vec<u64> = (0..4000u64)
            .filter(|&p| crate::layout::bucket_of(p, buckets) == 0)
            .take(5)
            .collect();
        for (i, &p) in chain[..4].iter().enumerate() {
            let f = insert(&c, p, i as u8 + 1).unwrap();
            c.frames.put(f);
        }
        let pool_before = c.index.overflow_free();
        let head = &c.frames.region().buckets()[0];
        let first_overflow =
            crate::layout::ctrl::next(head.ctrl.load(crate::sync::Ordering::Relaxed))
                .expect("the fourth page overflowed");
        let (last, newcomer) = (chain[3], chain[4]);
        let inserter = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                let f = insert(&c, newcomer, 5).unwrap();
                c.frames.put(f);
            })
        };
        let (f, generation) = c.index.peek(&c.frames, last).unwrap();
        let evicted = c.remove_frame(last, f, generation) == Sweep::Evicted;
        inserter.join().unwrap();
        let mut retries = 0;
        let g = c
            .lookup(newcomer, &mut retries)
            .expect("the newcomer is indexed");
        assert_eq!(read_tag(&c, g), 5);
        c.frames.put(g);
        if evicted {
            assert!(c.lookup(last, &mut retries).is_none(), "evicted page found");
        }
        // Once no thread is pinned, the epoch can move on and the unlinked
        // bucket can return to the pool. Whether crossbeam has collected it
        // by now depends on the interleaving; it must never be lost or
        // doubled, and it must come back in some explored execution.
        for _ in 0..4 {
            crossbeam_epoch::pin().flush();
        }
        let free = c.index.overflow_free();
        // One bucket is in use at the end; at most the unlinked one can still
        // be waiting for its grace period.
        assert!(
            free == pool_before || (evicted && free + 1 == pool_before),
            "pool {free}, before {pool_before}"
        );
        if c.index.overflow_pooled(first_overflow) {
            RECYCLED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    });
    let (recycled, runs) = (
        RECYCLED.load(std::sync::atomic::Ordering::Relaxed),
        RUNS.load(std::sync::atomic::Ordering::Relaxed),
    );
    println!(
        "insert_vs_unlink_one_chain: the unlinked bucket was back in the pool in {recycled} of {runs} executions"
    );
    assert!(
        recycled > 0,
        "no explored execution recycled the unlinked bucket"
    );
}

static RECYCLED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A reader's reference-free copy of page 1 (8 bytes long) races eviction
/// of page 1 and reuse of its frame for page 2 (16 bytes). The reader's
/// buffer holds 8 bytes: it copies page 1 or sees the change, and never
/// reports "your buffer is short" from the refill's length.
#[test]
fn copy_validated_vs_refill_with_another_len() {
    use crate::raw::frames::CopyOut;
    builder().check(|| {
        let c = Arc::new(core(1));
        let f = c.frames.alloc().unwrap();
        // SAFETY: `alloc` gave us the frame in state Filling, exclusively.
        unsafe { c.frames.region().fill(f, |b| b.fill(0x11)) };
        let f = c.insert_filled(1, f, 8).unwrap();
        c.frames.put(f);
        let generation = c.index.peek(&c.frames, 1).unwrap().1;
        let owner = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                assert_eq!(c.remove_frame(1, f, generation), Sweep::Evicted);
                let g = insert(&c, 2, 0x22).unwrap();
                c.frames.put(g);
            })
        };
        let mut out = [0u8; 8];
        match c.frames.copy_validated(f, 1, generation as u32, &mut out) {
            CopyOut::Copied { len, .. } => {
                assert_eq!(len, 8);
                assert_eq!(out, [0x11; 8]);
            }
            CopyOut::Changed => {}
            CopyOut::Short(len) => panic!("Short({len}) for a page of 8 bytes"),
        }
        owner.join().unwrap();
    });
}

/// The drop of a range (`PageCache::evict_range`) races a fill of page 1
/// that began before it, run as the cache runs it: claim, fill, check the
/// close marks, publish or not, release. Whatever the order, page 1 is not
/// cached once both are done, and the filler's frame is not lost.
#[test]
fn fill_vs_drop_of_its_range() {
    use crate::flight::{Closes, Flights};
    builder().check(|| {
        let c = Arc::new(core(2));
        let flights = Arc::new(Flights::new());
        let closes = Arc::new(Closes::new());
        let began = closes.begin();
        let filler = {
            let (c, flights, closes) = (Arc::clone(&c), Arc::clone(&flights), Arc::clone(&closes));
            thread::spawn(move || {
                let _claim = flights.claim(1);
                let f = c.frames.alloc().expect("a free frame");
                // SAFETY: `alloc` gave us the frame in state Filling, exclusively.
                unsafe { c.frames.region().fill(f, |b| b.fill(0x11)) };
                if closes.closed_since(1, began) {
                    c.frames.free_unpublished(f);
                } else if let Ok(f) = c.insert_filled(1, f, PS as u32) {
                    c.frames.put(f);
                }
            })
        };
        closes.close(0, 2);
        for p in 0..2 {
            let _claim = flights.claim(p);
            let _ = c.drop_page(p);
        }
        filler.join().unwrap();
        let mut retries = 0;
        assert!(
            c.lookup(1, &mut retries).is_none(),
            "a fill that began before the drop left page 1 cached"
        );
        assert_eq!(c.frames.free_count(), 2, "a frame was lost");
    });
}

/// Dropping page 1 while a reader holds its frame: the page leaves the
/// index at once (no lookup finds it), the holder's bytes stay whole, and
/// the frame is freed by whichever of the two lets go last.
#[test]
fn drop_page_vs_holder() {
    use crate::core::Dropped;
    builder().check(|| {
        let c = Arc::new(core(1));
        let f = insert(&c, 1, 0x11).unwrap();
        c.frames.put(f);
        let reader = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                let mut retries = 0;
                if let Some(f) = c.lookup(1, &mut retries) {
                    assert_eq!(read_tag(&c, f), 0x11);
                    c.frames.put(f);
                }
            })
        };
        assert_ne!(c.drop_page(1), Dropped::NotCached);
        let mut retries = 0;
        assert!(
            c.lookup(1, &mut retries).is_none(),
            "a dropped page is found"
        );
        reader.join().unwrap();
        assert_eq!(c.frames.free_count(), 1, "the frame came back once");
    });
}
