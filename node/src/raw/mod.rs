//! The raw lock-free core: the registered region and what lives in it.
//!
//! * [`region`]: one allocation holding superblock, index, headers and arena,
//!   laid out as [`crate::layout`] documents.
//! * [`frames`]: the frame table and its reference-count protocol (Piggin's
//!   `get_page_unless_zero` / `page_freeze_refs`).
//! * [`index`]: the lockless bucket index, searched with plain atomic loads.
//!
//! Nothing here does I/O or policy; [`crate::cache`] builds the page cache on
//! top. Types are `pub(crate)`: the safe API is the cache's.

pub(crate) mod frames;
pub(crate) mod index;
pub(crate) mod region;

use crate::sync::{AtomicU32, AtomicU64};

/// One index slot: page number + 1 (0 = empty) and frame | generation.
#[repr(C)]
pub(crate) struct Slot {
    pub(crate) key: AtomicU64,
    pub(crate) val: AtomicU64,
}

/// A bucket of the index, one cache line (see [`crate::layout`]).
#[repr(C, align(64))]
pub(crate) struct Bucket {
    pub(crate) ctrl: AtomicU64,
    pub(crate) slots: [Slot; crate::layout::SLOTS_PER_BUCKET],
    pub(crate) reserved: AtomicU64,
}

/// A frame header, one cache line (see [`crate::layout`]).
#[repr(C, align(64))]
pub(crate) struct Header {
    pub(crate) page: AtomicU64,
    pub(crate) generation: AtomicU64,
    pub(crate) checksum: AtomicU64,
    pub(crate) len: AtomicU32,
    pub(crate) state: AtomicU32,
    pub(crate) refcount: AtomicU32,
    pub(crate) flags: AtomicU32,
    pub(crate) reserved: [AtomicU64; 3],
}

impl Bucket {
    #[cfg(loom)]
    pub(crate) fn new() -> Self {
        Self {
            ctrl: AtomicU64::new(0),
            slots: std::array::from_fn(|_| Slot {
                key: AtomicU64::new(0),
                val: AtomicU64::new(0),
            }),
            reserved: AtomicU64::new(0),
        }
    }
}

impl Header {
    #[cfg(loom)]
    pub(crate) fn new() -> Self {
        Self {
            page: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            checksum: AtomicU64::new(0),
            len: AtomicU32::new(0),
            state: AtomicU32::new(0),
            refcount: AtomicU32::new(0),
            flags: AtomicU32::new(0),
            reserved: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

// The in-memory types must match the documented wire layout byte for byte.
#[cfg(not(loom))]
const _: () = {
    use crate::layout::{LINE, hdr, slot_offset};
    use std::mem::{offset_of, size_of};
    assert!(size_of::<Bucket>() == LINE);
    assert!(size_of::<Header>() == LINE);
    assert!(offset_of!(Bucket, slots) == slot_offset(0));
    assert!(size_of::<Slot>() == 16);
    assert!(offset_of!(Header, page) == hdr::PAGE);
    assert!(offset_of!(Header, generation) == hdr::GENERATION);
    assert!(offset_of!(Header, checksum) == hdr::CHECKSUM);
    assert!(offset_of!(Header, len) == hdr::LEN);
    assert!(offset_of!(Header, state) == hdr::STATE);
    assert!(offset_of!(Header, refcount) == hdr::REFCOUNT);
    assert!(offset_of!(Header, flags) == hdr::FLAGS);
};
