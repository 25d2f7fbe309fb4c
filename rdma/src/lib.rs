//! pagewire-rdma: one-sided memory access for pagewire.
//!
//! A node registers memory for remote **READ** (never remote WRITE) and hands
//! out a [`RegionDescriptor`] (address, length, rkey, epoch) over its control
//! plane. A reader opens a [`Connection`] to that node, posts a batch of READs
//! into its own buffers with one doorbell, then polls (busy-polling thread),
//! waits (blocking thread) or awaits ([`AsyncConnection`], tokio) the
//! completions. Every completion carries a typed outcome: the bytes arrived,
//! or a [`ReadError`] (remote access error, connection lost, timeout).
//!
//! Three backends implement the same [`Connection`] contract and pass one
//! shared conformance suite (`rdma/tests/conformance/`):
//!
//! * `verbs` (cargo feature `verbs`): ibverbs RC queue pairs through
//!   `sideway`; RoCE or soft-RoCE. The owner's CPU takes no part in a READ.
//! * [`tcp`]: a software NIC. The owner ([`tcp::TcpOwner`]) serves READs
//!   straight from registered regions, bounds-checked by rkey, epoch and
//!   length; pipelined, batched, authenticated with a cluster token.
//! * [`shm`]: processes on one host. Regions live in files under `/dev/shm`,
//!   mapped read-only by readers, copied with word-sized atomic loads. No
//!   owner CPU at all.
//!
//! Memory: `verbs` and `tcp` register either memory they allocate or the
//! caller's (`register_external`, served in place); `shm` serves its region
//! files' mappings, which the owner allocates through it and uses in place.
//! Every descriptor of an owner carries the owner's epoch, random or chosen
//! by the caller (the node's incarnation), never 0 ([`OwnerError::ZeroEpoch`]).
//!
//! [`SharedConnection`] lets every thread of a process read through one
//! connection per owner (one RC queue pair on `verbs`), each thread with a
//! [`SharedHandle`] of its own.
//!
//! [`Chaos`] makes the `tcp` and `shm` copies visit cache lines in random order
//! and pause mid-copy, so that torn reads really happen in tests: no RDMA NIC
//! promises that a READ observes memory in ascending address order, so a
//! reader must validate what it read (pagewire uses a 64-bit checksum).
//!
//! Atomics: the design leaves room for remote compare-and-swap and
//! fetch-and-add: the `tcp` wire carries an opcode (2 and 3 are reserved for
//! them), sideway can post `IBV_WR_ATOMIC_*` work requests for `verbs`, and
//! a future `post_atomics` would add a completion value (the old word) and
//! a region registered with atomic access. None of that is implemented yet,
//! and no method pretends otherwise.
//!
//! This crate depends on nothing else of pagewire's: `node` builds on it,
//! never the other way round, and it never calls into a page cache.

mod conn;
mod copy;
mod descriptor;
mod error;
mod handshake;
mod memory;
mod shared;
pub mod shm;
mod spin;
pub mod tcp;
#[cfg(feature = "verbs")]
pub mod verbs;

#[cfg(feature = "tokio")]
mod async_conn;

#[cfg(feature = "tokio")]
pub use async_conn::AsyncConnection;
pub use conn::{Completion, Connection, Limits, ReadRequest, read_blocking};
pub use copy::Chaos;
pub use descriptor::{DecodeError, RegionDescriptor};
pub use error::{
    AccessFault, CallError, ConnectError, OwnerError, PostError, ReadError, RegisterError,
};
pub use memory::MemoryOwner;
pub use shared::{SharedConnection, SharedHandle, WeakShared};

/// Memory registered for remote READ on the owner's side, whatever the backend.
///
/// The owner writes its own region through [`LocalRegion::write_bytes`], which
/// uses word-sized atomic stores: remote readers (a responder thread, another
/// process, a NIC) may read the same bytes at the same time.
pub trait LocalRegion: Send + Sync {
    /// What a remote reader needs to READ this region.
    fn descriptor(&self) -> RegionDescriptor;

    /// Start of the registered bytes in the owner's address space.
    ///
    /// Writes through this pointer race with remote reads: use atomic or
    /// volatile stores, or [`LocalRegion::write_bytes`].
    fn as_ptr(&self) -> *mut u8;

    /// Registered length in bytes.
    fn len(&self) -> usize;

    /// Whether the region is empty (never, for a registered region).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `data` into the region at `offset` with atomic stores.
    ///
    /// # Panics
    /// If `offset + data.len()` exceeds the region.
    fn write_bytes(&self, offset: usize, data: &[u8]) {
        assert!(
            offset
                .checked_add(data.len())
                .is_some_and(|end| end <= self.len()),
            "write_bytes out of the region"
        );
        // SAFETY: the range was checked to lie inside the region, which stays
        // mapped while `self` is borrowed; the stores are atomic, so they may
        // race with remote readers.
        unsafe { copy::copy_to_shared(data, self.as_ptr().add(offset)) }
    }

    /// Copies bytes of the region at `offset` into `out` with atomic loads.
    ///
    /// # Panics
    /// If `offset + out.len()` exceeds the region.
    fn read_bytes(&self, offset: usize, out: &mut [u8]) {
        assert!(
            offset
                .checked_add(out.len())
                .is_some_and(|end| end <= self.len()),
            "read_bytes out of the region"
        );
        // SAFETY: the range lies inside the live region (checked above) and the
        // loads are atomic.
        unsafe { copy::copy_from_shared(self.as_ptr().add(offset), out, None) }
    }
}
