//! The wire layout of a node's registered memory, version 2.
//!
//! Everything a remote reader needs to make sense of raw bytes copied out of a
//! node by a one-sided READ lives here: offsets, encodings, the bucket hash and
//! the frame checksum. Local code uses the same constants, so the two views can
//! never drift apart. All integers are little-endian; every structure is
//! 64 bytes and 64-byte aligned (one cache line), so a READ of one bucket or one
//! header is one cache line.
//!
//! ```text
//! region offset      size                 what
//! 0                  4096                 superblock (one page; the rest is zero)
//! index_offset       64 * bucket_count    bucket index (power-of-two count)
//! overflow_offset    64 * overflow_count  overflow buckets, chained from the index
//! headers_offset     64 * frame_count     frame header table
//! arena_offset       page * frame_count   frame arena, aligned to max(page, 4096)
//! ```
//!
//! Superblock (offsets in bytes): 0 magic `b"PAGEWIRE"`, 8 layout version
//! (u32), 12 page size (u32), 16 bucket count, 24 overflow count, 32 frame
//! count, 40 node epoch, 48 pages in the file, 56 file length in bytes,
//! 64 index offset, 72 overflow offset, 80 headers offset, 88 arena offset,
//! 96 region length (all u64), 104 index kind (u32, [`IndexCode`]).
//!
//! Bucket: 0 `ctrl` (u64: bit 0 writer lock, bits 1..32 change counter, bits
//! 32..64 next overflow bucket + 1, 0 for none); then [`SLOTS_PER_BUCKET`]
//! slots of 16 bytes at 8, 24, 40: `key` (u64, page number + 1, 0 when the slot
//! is empty) and `val` (u64, frame index in bits 0..32, low 32 bits of the
//! frame's generation in bits 32..64); 56 reserved (zero).
//!
//! Frame header: 0 page number, 8 generation, 16 checksum (all u64), 24 valid
//! length (u32), 28 state (u32, see [`FrameState`]), 32 reference count (u32,
//! local only), 36 flags (u32, local only), 40..64 reserved.
//!
//! A page `p` lives in bucket [`bucket_of`]`(p, bucket_count)` or in the
//! overflow chain hanging from it: with `n = bucket_count >= 16`, bucket
//! `fib(p / 8, n / 8) * 8 + p % 8`, where
//! `fib(x, m) = (x * 0x9E3779B97F4A7C15) >> (64 - log2 m)` (wrapping
//! multiply); with fewer buckets, `fib(p, n)`. A frame's generation is odd
//! exactly while the frame is published (in the index) and even otherwise;
//! it grows by one when the frame is made visible and by one when it is
//! invalidated, so `(frame, generation)` names one immutable content (not
//! `(page, generation)`: another frame may hold the same page at the same
//! number). The checksum is xxh3-64, seed 0, over the 24-byte header prefix
//! (page, generation, length; each a little-endian u64) followed by the
//! whole frame (`page_size` bytes, zero past the valid length).

/// Magic number at offset 0 of the superblock: the bytes `PAGEWIRE`.
pub const MAGIC: u64 = u64::from_le_bytes(*b"PAGEWIRE");
/// The layout version this crate writes and reads.
pub const LAYOUT_VERSION: u32 = 2;
/// Size of the superblock area at the start of the region.
pub const SUPERBLOCK_SIZE: usize = 4096;
/// Size of a bucket, a frame header and the alignment of both.
pub const LINE: usize = 64;
/// Slots (page → frame entries) per bucket.
pub const SLOTS_PER_BUCKET: usize = 3;
/// Byte offset of slot `i`'s key inside a bucket; its value follows at +8.
pub const fn slot_offset(i: usize) -> usize {
    8 + 16 * i
}

/// Superblock field offsets.
pub mod sb {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const PAGE_SIZE: usize = 12;
    pub const BUCKET_COUNT: usize = 16;
    pub const OVERFLOW_COUNT: usize = 24;
    pub const FRAME_COUNT: usize = 32;
    pub const NODE_EPOCH: usize = 40;
    pub const FILE_PAGES: usize = 48;
    pub const FILE_LEN: usize = 56;
    pub const INDEX_OFFSET: usize = 64;
    pub const OVERFLOW_OFFSET: usize = 72;
    pub const HEADERS_OFFSET: usize = 80;
    pub const ARENA_OFFSET: usize = 88;
    pub const REGION_LEN: usize = 96;
    /// u32: which index the node runs ([`super::IndexCode`]); only
    /// [`super::IndexCode::Lockless`] keeps the region's bucket index.
    pub const INDEX_KIND: usize = 104;
}

/// The index a node runs, as the superblock records it (offset 104, u32).
/// The lock-based variants keep their map on the heap and leave the
/// region's buckets empty: a remote reader of such a node finds every page
/// absent and must fall back to the owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum IndexCode {
    Lockless = 0,
    RwLock = 1,
    Mutex = 2,
    Sharded = 3,
}

impl IndexCode {
    /// Decode the superblock's word; unknown values are `None`.
    pub const fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::Lockless),
            1 => Some(Self::RwLock),
            2 => Some(Self::Mutex),
            3 => Some(Self::Sharded),
            _ => None,
        }
    }
}

/// A superblock decoded from raw bytes and checked against the layout its
/// counts imply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub layout: RegionLayout,
    /// The node's incarnation: every descriptor of the region carries it.
    pub epoch: u64,
    pub file_pages: u64,
    pub file_len: u64,
    pub index: IndexCode,
}

/// Why bytes are not a superblock this crate can read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SuperblockError {
    #[error("superblock needs {SUPERBLOCK_HEAD} bytes, got {0}")]
    Short(usize),
    #[error("bad magic {0:#018x}: not a pagewire region")]
    Magic(u64),
    #[error("layout version {0}, this reader understands {LAYOUT_VERSION}")]
    Version(u32),
    #[error("page size {0} is not a power of two between 512 and 1 MiB")]
    PageSize(u32),
    #[error("frame count {0} out of range")]
    Frames(u64),
    #[error("field {field} is {got}, the layout of these counts needs {want}")]
    Mismatch {
        field: &'static str,
        got: u64,
        want: u64,
    },
    #[error("unknown index kind {0}")]
    Index(u32),
    #[error("the file has {pages} pages but {len} bytes")]
    FileSize { pages: u64, len: u64 },
}

/// Bytes of the superblock that carry fields (the rest of its page is zero).
pub const SUPERBLOCK_HEAD: usize = 108;

impl Superblock {
    /// Decode and check a superblock: the counts must describe exactly the
    /// offsets and length recorded beside them (so a reader that trusts the
    /// decoded layout never computes an address outside the region).
    pub fn decode(bytes: &[u8]) -> Result<Self, SuperblockError> {
        if bytes.len() < SUPERBLOCK_HEAD {
            return Err(SuperblockError::Short(bytes.len()));
        }
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        if u64_at(sb::MAGIC) != MAGIC {
            return Err(SuperblockError::Magic(u64_at(sb::MAGIC)));
        }
        if u32_at(sb::VERSION) != LAYOUT_VERSION {
            return Err(SuperblockError::Version(u32_at(sb::VERSION)));
        }
        let ps = u32_at(sb::PAGE_SIZE);
        if !ps.is_power_of_two() || !(512..=1 << 20).contains(&ps) {
            return Err(SuperblockError::PageSize(ps));
        }
        let frames = u64_at(sb::FRAME_COUNT);
        if frames == 0 || frames >= u64::from(u32::MAX) || frames > (1 << 40) / u64::from(ps) {
            return Err(SuperblockError::Frames(frames));
        }
        let layout = RegionLayout::new(ps as usize, frames as usize);
        for (field, off, want) in [
            ("bucket count", sb::BUCKET_COUNT, layout.bucket_count),
            ("overflow count", sb::OVERFLOW_COUNT, layout.overflow_count),
            ("index offset", sb::INDEX_OFFSET, layout.index_offset),
            (
                "overflow offset",
                sb::OVERFLOW_OFFSET,
                layout.overflow_offset,
            ),
            ("headers offset", sb::HEADERS_OFFSET, layout.headers_offset),
            ("arena offset", sb::ARENA_OFFSET, layout.arena_offset),
            ("region length", sb::REGION_LEN, layout.len),
        ] {
            if u64_at(off) != want as u64 {
                return Err(SuperblockError::Mismatch {
                    field,
                    got: u64_at(off),
                    want: want as u64,
                });
            }
        }
        let index = IndexCode::from_u32(u32_at(sb::INDEX_KIND))
            .ok_or(SuperblockError::Index(u32_at(sb::INDEX_KIND)))?;
        let (file_pages, file_len) = (u64_at(sb::FILE_PAGES), u64_at(sb::FILE_LEN));
        if file_len.div_ceil(u64::from(ps)) != file_pages {
            return Err(SuperblockError::FileSize {
                pages: file_pages,
                len: file_len,
            });
        }
        Ok(Self {
            layout,
            epoch: u64_at(sb::NODE_EPOCH),
            file_pages,
            file_len,
            index,
        })
    }
}

/// Frame header field offsets.
pub mod hdr {
    pub const PAGE: usize = 0;
    pub const GENERATION: usize = 8;
    pub const CHECKSUM: usize = 16;
    pub const LEN: usize = 24;
    pub const STATE: usize = 28;
    pub const REFCOUNT: usize = 32;
    pub const FLAGS: usize = 36;
}

/// Bits of a bucket's `ctrl` word.
pub mod ctrl {
    /// Writer lock (held by an inserter, evictor or writer of this chain).
    pub const LOCKED: u64 = 1;
    /// One step of the change counter (bits 1..32).
    pub const SEQ_ONE: u64 = 2;
    /// Mask of the change counter.
    pub const SEQ_MASK: u64 = 0xFFFF_FFFE;
    /// Shift of the next-overflow field (bits 32..64).
    pub const NEXT_SHIFT: u32 = 32;

    /// The overflow bucket this one chains to, if any.
    pub const fn next(ctrl: u64) -> Option<u32> {
        let n = (ctrl >> NEXT_SHIFT) as u32;
        if n == 0 { None } else { Some(n - 1) }
    }

    /// `ctrl` with its next field set to `next`.
    pub const fn with_next(ctrl: u64, next: Option<u32>) -> u64 {
        let n = match next {
            Some(i) => i as u64 + 1,
            None => 0,
        };
        (ctrl & 0xFFFF_FFFF) | (n << NEXT_SHIFT)
    }
}

/// The state of a frame, at header offset 28.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum FrameState {
    /// On the free list; its bytes mean nothing.
    Free = 0,
    /// Owned by one inserter or writer that is filling it; not yet in the index.
    Filling = 1,
    /// In the index; header and bytes are immutable until it leaves.
    Published = 2,
    /// Replaced by a newer copy (copy-on-write) or dropped; waiting for its
    /// last reader. Never valid for a remote reader.
    Retired = 3,
}

impl FrameState {
    /// Decode a state word; unknown values are `None`.
    pub const fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::Free),
            1 => Some(Self::Filling),
            2 => Some(Self::Published),
            3 => Some(Self::Retired),
            _ => None,
        }
    }
}

/// Pages per cluster: runs of this many consecutive pages land in
/// consecutive buckets (one 512-byte stretch of the index), so sequential
/// faults, gang insertions and scans touch neighbouring cache lines and one
/// TLB entry instead of scattering over the whole index.
pub const CLUSTER: u64 = 8;

/// Fibonacci hashing: the top `log2(n)` bits of `x * 2^64/φ` (`n` a power
/// of two, at least 2).
#[inline]
pub const fn fib_hash(x: u64, n: u64) -> u64 {
    x.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - n.trailing_zeros())
}

/// The bucket holding `page` in an index of `bucket_count` buckets (a power
/// of two, at least 2). With at least `2 * CLUSTER` buckets, the cluster
/// `page / CLUSTER` is Fibonacci-hashed to a group of `CLUSTER` adjacent
/// buckets and `page % CLUSTER` picks the bucket in the group; smaller
/// indexes hash the page itself.
#[inline]
pub const fn bucket_of(page: u64, bucket_count: u64) -> u64 {
    if bucket_count < 2 * CLUSTER {
        fib_hash(page, bucket_count)
    } else {
        fib_hash(page / CLUSTER, bucket_count / CLUSTER) * CLUSTER + page % CLUSTER
    }
}

/// A slot key for `page`.
#[inline]
pub const fn key_of(page: u64) -> u64 {
    page.wrapping_add(1)
}

/// A slot value: frame index and the low half of its generation.
#[inline]
pub const fn val_of(frame: u32, generation: u64) -> u64 {
    frame as u64 | ((generation as u32 as u64) << 32)
}

/// The frame index of a slot value.
#[inline]
pub const fn val_frame(val: u64) -> u32 {
    val as u32
}

/// The low 32 bits of the generation in a slot value.
#[inline]
pub const fn val_gen32(val: u64) -> u32 {
    (val >> 32) as u32
}

/// The frame checksum: xxh3-64, seed 0, over (page, generation, len) and
/// the frame bytes (the module docs; any XXH3-64 implementation gives the
/// same value, which the tests check against a second one). The hasher
/// borrows XXH3's built-in secret (seed 0) instead of allocating a copy:
/// `XxHash3_64::with_seed` boxed one per frame, a malloc and a free on
/// every page a reader validates.
pub fn checksum(page: u64, generation: u64, len: u32, frame: &[u8]) -> u64 {
    use std::hash::Hasher;
    use twox_hash::xxhash3_64::{RawHasher, SecretBuffer};
    let mut h = RawHasher::new(SecretBuffer::default());
    h.write(&page.to_le_bytes());
    h.write(&generation.to_le_bytes());
    h.write(&(len as u64).to_le_bytes());
    h.write(frame);
    h.finish()
}

/// The byte offsets of one region's parts, derived from its sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionLayout {
    pub page_size: usize,
    pub bucket_count: usize,
    pub overflow_count: usize,
    pub frame_count: usize,
    pub index_offset: usize,
    pub overflow_offset: usize,
    pub headers_offset: usize,
    pub arena_offset: usize,
    pub len: usize,
}

impl RegionLayout {
    /// Lay out a region for `frame_count` frames of `page_size` bytes.
    ///
    /// The index gets one bucket per frame rounded up to a power of two
    /// (three slots each, so at most a third full), and enough overflow
    /// buckets that an insert can never run out of them: every entry names a
    /// distinct frame, each chain wastes at most two slots of its last bucket.
    pub fn new(page_size: usize, frame_count: usize) -> Self {
        let bucket_count = frame_count.next_power_of_two().max(2);
        let overflow_count =
            frame_count.div_ceil(SLOTS_PER_BUCKET) + bucket_count.min(frame_count) + 64;
        let index_offset = SUPERBLOCK_SIZE;
        let overflow_offset = index_offset + bucket_count * LINE;
        let headers_offset = overflow_offset + overflow_count * LINE;
        let align = page_size.max(4096);
        let arena_offset = (headers_offset + frame_count * LINE).next_multiple_of(align);
        let len = arena_offset + frame_count * page_size;
        Self {
            page_size,
            bucket_count,
            overflow_count,
            frame_count,
            index_offset,
            overflow_offset,
            headers_offset,
            arena_offset,
            len,
        }
    }

    /// Offset of bucket `b` in the region.
    pub const fn bucket(&self, b: usize) -> usize {
        self.index_offset + b * LINE
    }

    /// Offset of overflow bucket `o` in the region.
    pub const fn overflow(&self, o: usize) -> usize {
        self.overflow_offset + o * LINE
    }

    /// Offset of frame `f`'s header in the region.
    pub const fn header(&self, f: usize) -> usize {
        self.headers_offset + f * LINE
    }

    /// Offset of frame `f`'s bytes in the region.
    pub const fn frame(&self, f: usize) -> usize {
        self.arena_offset + f * self.page_size
    }
}

/// A bucket decoded from raw bytes (as a remote reader copies it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawBucket {
    pub ctrl: u64,
    /// (key, val) of each slot.
    pub slots: [(u64, u64); SLOTS_PER_BUCKET],
}

impl RawBucket {
    /// Decode one 64-byte bucket; `None` if `bytes` is shorter.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let u64_at = |o: usize| -> Option<u64> {
            Some(u64::from_le_bytes(bytes.get(o..o + 8)?.try_into().ok()?))
        };
        let mut slots = [(0, 0); SLOTS_PER_BUCKET];
        for (i, s) in slots.iter_mut().enumerate() {
            *s = (u64_at(slot_offset(i))?, u64_at(slot_offset(i) + 8)?);
        }
        Some(Self {
            ctrl: u64_at(0)?,
            slots,
        })
    }

    /// The slot value for `page` in this bucket, if present.
    pub fn find(&self, page: u64) -> Option<u64> {
        self.slots.iter().find(|s| s.0 == key_of(page)).map(|s| s.1)
    }

    /// The overflow bucket this one chains to.
    pub fn next(&self) -> Option<u32> {
        ctrl::next(self.ctrl)
    }
}

/// A frame header decoded from raw bytes (as a remote reader copies it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawHeader {
    pub page: u64,
    pub generation: u64,
    pub checksum: u64,
    pub len: u32,
    pub state: u32,
}

impl RawHeader {
    /// Decode the first 32 bytes of a header. `bytes` must hold at least 32.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let u64_at = |o: usize| {
            bytes
                .get(o..o + 8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
        };
        let u32_at = |o: usize| {
            bytes
                .get(o..o + 4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap_or([0; 4])))
        };
        Some(Self {
            page: u64_at(hdr::PAGE)?,
            generation: u64_at(hdr::GENERATION)?,
            checksum: u64_at(hdr::CHECKSUM)?,
            len: u32_at(hdr::LEN)?,
            state: u32_at(hdr::STATE)?,
        })
    }

    /// Does this header, with these frame bytes, prove that the bytes were
    /// the content of `page` at some instant while they were being copied?
    /// This is the remote reader's whole validation, sound for a copy whose
    /// words were read in any order at any times (the argument is in
    /// `node/src/raw/frames.rs` and ARCHITECTURE.md): the generation is odd
    /// (published), the state is `Published`, the page matches, and the
    /// checksum over (page, generation, len, bytes) matches.
    ///
    /// `frame` must be the whole frame (`page_size` bytes). The generation
    /// accepted is `self.generation`; callers that looked the page up in a
    /// bucket may also compare its low 32 bits with the slot's, as a hint.
    pub fn validate(&self, page: u64, frame: &[u8]) -> bool {
        self.generation % 2 == 1
            && self.state == FrameState::Published as u32
            && self.page == page
            && self.checksum == checksum(self.page, self.generation, self.len, frame)
    }

    /// The validation of an *ordered* reader (a seqlock, ARCHITECTURE.md,
    /// "Ordered readers"): `before` is the frame's generation word as READ
    /// before this header and the frame's bytes, `after` as READ after
    /// them, on a connection whose READs are performed in order with an
    /// Acquire fence between them (`shm`). The copy is accepted as `page`
    /// iff the generation is odd and the same in all three reads, the state
    /// is `Published` and the page matches; the checksum is not computed.
    /// Sound only for such a reader: one that copies words in any order
    /// must use [`RawHeader::validate`].
    pub fn validate_bracketed(&self, page: u64, before: u64, after: u64) -> bool {
        self.generation % 2 == 1
            && before == self.generation
            && after == self.generation
            && self.state == FrameState::Published as u32
            && self.page == page
    }

    /// [`RawHeader::validate`], and the generation is exactly `generation`.
    pub fn validates(&self, page: u64, generation: u64, frame: &[u8]) -> bool {
        self.generation == generation && self.validate(page, frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_aligned_and_disjoint() {
        for (ps, n) in [(4096, 1), (4096, 1000), (512, 7), (65536, 33)] {
            let l = RegionLayout::new(ps, n);
            assert!(l.bucket_count.is_power_of_two());
            assert_eq!(l.index_offset % LINE, 0);
            assert_eq!(l.headers_offset % LINE, 0);
            assert_eq!(l.arena_offset % ps.max(4096), 0);
            assert!(l.overflow_offset >= l.index_offset + l.bucket_count * LINE);
            assert!(l.headers_offset >= l.overflow_offset + l.overflow_count * LINE);
            assert!(l.arena_offset >= l.headers_offset + n * LINE);
            assert_eq!(l.len, l.frame(n));
        }
    }

    #[test]
    fn bucket_hash_spreads_sequential_pages() {
        let n = 1024u64;
        let mut counts = vec![0u32; n as usize];
        for p in 0..n {
            counts[bucket_of(p, n) as usize] += 1;
        }
        // Fibonacci hashing of a run is close to a permutation.
        assert!(counts.iter().all(|&c| c <= 2), "{counts:?}");
    }

    #[test]
    fn clusters_of_pages_share_neighbouring_buckets() {
        let n = 1 << 20;
        for p in [0u64, 8, 4096, 1 << 40] {
            let b = bucket_of(p, n);
            assert_eq!(b % CLUSTER, 0);
            for i in 1..CLUSTER {
                assert_eq!(bucket_of(p + i, n), b + i);
            }
        }
        // Small indexes still use every bucket.
        let mut seen = [false; 8];
        for p in 0..64 {
            seen[bucket_of(p, 8) as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn ctrl_next_round_trips() {
        let c = ctrl::with_next(ctrl::LOCKED | 6, Some(41));
        assert_eq!(ctrl::next(c), Some(41));
        assert_eq!(c & 0xFFFF_FFFF, ctrl::LOCKED | 6);
        assert_eq!(ctrl::next(ctrl::with_next(c, None)), None);
    }

    /// The checksum is XXH3-64 of the 24-byte prefix and the frame, as a
    /// second implementation (xxhash-rust, the one this crate used before)
    /// computes it over the concatenation: every length a frame can have
    /// around the algorithm's size classes and a full page.
    #[test]
    fn the_checksum_is_xxh3_of_the_prefix_and_the_frame() {
        let bytes: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in (0..=300).chain([1023, 1024, 1025, 4095, 4096, 16384, 65536]) {
            let (page, generation) = (len as u64 * 31 + 7, (len as u64) << 1 | 1);
            let frame = &bytes[len % 97..][..len];
            let mut whole = Vec::with_capacity(24 + len);
            whole.extend_from_slice(&page.to_le_bytes());
            whole.extend_from_slice(&generation.to_le_bytes());
            whole.extend_from_slice(&(len as u64).to_le_bytes());
            whole.extend_from_slice(frame);
            assert_eq!(
                checksum(page, generation, len as u32, frame),
                xxhash_rust::xxh3::xxh3_64(&whole),
                "len {len}"
            );
        }
        // Fixed vectors: the values a reader of any version must compute.
        assert_eq!(checksum(0, 1, 0, &[]), 0xb7ae_726b_74ed_6f2e);
        let frame: Vec<u8> = (0..4096).map(|i| (i % 251) as u8).collect();
        assert_eq!(checksum(5, 3, 4096, &frame), 0x5bf1_9e6f_a9ff_33f8);
    }

    #[test]
    fn header_validation_needs_every_field() {
        let frame = vec![7u8; 64];
        let good = RawHeader {
            page: 3,
            generation: 9,
            checksum: checksum(3, 9, 64, &frame),
            len: 64,
            state: 2,
        };
        assert!(good.validates(3, 9, &frame));
        // An even generation is never published, whatever the checksum says.
        let even = RawHeader {
            generation: 10,
            checksum: checksum(3, 10, 64, &frame),
            ..good
        };
        assert!(!even.validate(3, &frame));
        assert!(!good.validates(4, 9, &frame));
        assert!(!good.validates(3, 8, &frame));
        assert!(!RawHeader { state: 3, ..good }.validates(3, 9, &frame));
        let mut torn = frame.clone();
        torn[63] = 8;
        assert!(!good.validates(3, 9, &torn));
    }

    #[test]
    fn a_bracketed_validation_needs_one_odd_generation_in_all_three_reads() {
        let good = RawHeader {
            page: 3,
            generation: 9,
            // Not consulted: an ordered reader computes no checksum.
            checksum: 0,
            len: 64,
            state: 2,
        };
        assert!(good.validate_bracketed(3, 9, 9));
        // The generation moved on during the copy (a refill began), or
        // before the header was read.
        assert!(!good.validate_bracketed(3, 9, 10));
        assert!(!good.validate_bracketed(3, 9, 11));
        assert!(!good.validate_bracketed(3, 7, 9));
        // Unpublished, another page, not the published state.
        let even = RawHeader {
            generation: 10,
            ..good
        };
        assert!(!even.validate_bracketed(3, 10, 10));
        assert!(!good.validate_bracketed(4, 9, 9));
        assert!(!RawHeader { state: 3, ..good }.validate_bracketed(3, 9, 9));
    }
}
