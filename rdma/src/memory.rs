//! What `tcp` and `verbs` share on the owner's side: the memory a region
//! serves (a mapping the backend allocated, or memory the caller registered
//! with `register_external`) and the choice of the owner's epoch.
//!
//! `shm` has neither: its regions must be file mappings other processes can
//! map, so it always allocates them itself (`ShmOwner::register`).

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

use memmap2::MmapMut;

use crate::{OwnerError, RegisterError};

/// Keeps caller-owned memory alive while it is registered: whatever the
/// caller hands to `register_external` (its mapping, an `Arc` of its cache).
pub type MemoryOwner = Arc<dyn Any + Send + Sync>;

/// What keeps a region's bytes mapped.
enum Backing {
    /// An anonymous mapping the backend allocated (`register(len)`).
    Anon(#[allow(dead_code, reason = "held for its Drop: unmaps")] MmapMut),
    /// Caller-owned memory (`register_external`), alive while its owner is.
    External(#[allow(dead_code, reason = "held for its Drop")] MemoryOwner),
}

/// The bytes of one registered region.
pub(crate) struct Memory {
    ptr: NonNull<u8>,
    len: usize,
    _backing: Backing,
}

// SAFETY: `ptr` points into memory kept alive by `backing` (our own mapping,
// or the caller's under the `register_external` contract, whose owner guard
// is `Send + Sync`). Through it the backend only ever makes atomic loads
// (the `tcp` responder) or hands the address to the NIC (`verbs`), and the
// owner side writes only with atomic stores (`LocalRegion::write_bytes`), so
// sharing and sending it between threads races with nothing non-atomic.
unsafe impl Send for Memory {}
// SAFETY: as for `Send`.
unsafe impl Sync for Memory {}

fn check_len(len: usize) -> Result<(), RegisterError> {
    if len == 0 || len > isize::MAX as usize {
        return Err(RegisterError::InvalidLength(len));
    }
    Ok(())
}

impl Memory {
    /// `len` zeroed, page-aligned bytes of a fresh anonymous mapping.
    pub(crate) fn anon(len: usize) -> Result<Self, RegisterError> {
        check_len(len)?;
        let mut map = MmapMut::map_anon(len)?;
        let ptr = NonNull::new(map.as_mut_ptr()).ok_or(RegisterError::InvalidLength(len))?;
        Ok(Self {
            ptr,
            len,
            _backing: Backing::Anon(map),
        })
    }

    /// Caller-owned memory.
    ///
    /// # Safety
    /// `ptr..ptr + len` is valid for reads and writes for as long as `owner`
    /// is alive, and every access to it by anyone else while the returned
    /// value lives is atomic, volatile or made by the kernel or a device (the
    /// contract of `register_external`).
    pub(crate) unsafe fn external(
        ptr: NonNull<u8>,
        len: usize,
        owner: MemoryOwner,
    ) -> Result<Self, RegisterError> {
        check_len(len)?;
        if (ptr.as_ptr() as usize).checked_add(len).is_none() {
            return Err(RegisterError::InvalidLength(len));
        }
        Ok(Self {
            ptr,
            len,
            _backing: Backing::External(owner),
        })
    }

    /// First byte.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// First byte's address, as descriptors carry it.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// The epoch an owner's descriptors carry: the caller's choice, or a random
/// odd (so never zero) one.
pub(crate) fn choose_epoch(requested: Option<u64>) -> Result<u64, OwnerError> {
    match requested {
        Some(0) => Err(OwnerError::ZeroEpoch),
        Some(e) => Ok(e),
        None => {
            let mut e = [0u8; 8];
            getrandom::fill(&mut e).map_err(std::io::Error::other)?;
            Ok(u64::from_le_bytes(e) | 1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_and_lengths() {
        assert!(matches!(choose_epoch(Some(0)), Err(OwnerError::ZeroEpoch)));
        assert_eq!(choose_epoch(Some(42)).expect("chosen"), 42);
        assert_ne!(choose_epoch(None).expect("random"), 0);
        assert!(matches!(
            Memory::anon(0),
            Err(RegisterError::InvalidLength(0))
        ));
        let owner: MemoryOwner = Arc::new(());
        // SAFETY: refused before anything would read the (dangling) pointer.
        let wraps = unsafe {
            Memory::external(
                NonNull::new(usize::MAX as *mut u8).expect("non-null"),
                2,
                owner,
            )
        };
        assert!(matches!(wraps, Err(RegisterError::InvalidLength(2))));
    }
}
