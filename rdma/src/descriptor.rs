//! The descriptor of a registered region, as it travels over the control plane.

use serde::{Deserialize, Serialize};

/// What a remote reader needs to READ a registered region.
///
/// `addr` is the region's start in the owner's address space (every backend
/// addresses remote memory the way verbs does: a READ names an absolute
/// remote address and the rkey that covers it). `epoch` is the owner's
/// registration lease: a descriptor from an earlier registration, or from an
/// owner that restarted, is refused with [`crate::AccessFault::StaleEpoch`]
/// or [`crate::AccessFault::UnknownKey`] instead of reading someone else's
/// bytes.
///
/// It serializes with serde, or to a fixed 28-byte little-endian form
/// ([`RegionDescriptor::to_bytes`]) for a protobuf `bytes` field:
///
/// | offset | size | field |
/// | --- | --- | --- |
/// | 0 | 8 | addr |
/// | 8 | 8 | len |
/// | 16 | 4 | rkey |
/// | 20 | 8 | epoch |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionDescriptor {
    /// Start of the region in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key that grants READ (never WRITE) on the region.
    pub rkey: u32,
    /// Registration lease; changes whenever the owner re-registers or restarts.
    pub epoch: u64,
}

/// A byte form that is not a descriptor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Not exactly [`RegionDescriptor::ENCODED_LEN`] bytes.
    #[error("a region descriptor is {expected} bytes, got {got}")]
    Length {
        /// Expected length.
        expected: usize,
        /// Given length.
        got: usize,
    },
    /// `addr + len` overflows.
    #[error("region end overflows the address space")]
    Overflow,
}

impl RegionDescriptor {
    /// Length of [`RegionDescriptor::to_bytes`].
    pub const ENCODED_LEN: usize = 28;

    /// The fixed little-endian byte form (see the type's doc for the layout).
    #[must_use]
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[0..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..20].copy_from_slice(&self.rkey.to_le_bytes());
        out[20..28].copy_from_slice(&self.epoch.to_le_bytes());
        out
    }

    /// Parses [`RegionDescriptor::to_bytes`]'s form.
    ///
    /// # Errors
    /// A wrong length, or a range that overflows.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DecodeError> {
        let b: &[u8; Self::ENCODED_LEN] = bytes.try_into().map_err(|_| DecodeError::Length {
            expected: Self::ENCODED_LEN,
            got: bytes.len(),
        })?;
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let d = Self {
            addr: u64_at(0),
            len: u64_at(8),
            rkey: u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")),
            epoch: u64_at(20),
        };
        d.addr.checked_add(d.len).ok_or(DecodeError::Overflow)?;
        Ok(d)
    }

    /// Remote address of byte `offset` of the region (no bounds check: the
    /// remote side checks).
    #[must_use]
    pub fn addr_at(&self, offset: u64) -> u64 {
        self.addr.wrapping_add(offset)
    }

    /// Whether `[addr, addr + len)` lies inside the region.
    #[must_use]
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr.saturating_add(self.len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_reject_garbage() {
        let d = RegionDescriptor {
            addr: 0x7f00_0000_1000,
            len: 1 << 20,
            rkey: 0xdead_beef,
            epoch: 7,
        };
        assert_eq!(RegionDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);
        assert!(RegionDescriptor::from_bytes(&d.to_bytes()[..27]).is_err());
        let mut bad = d;
        bad.addr = u64::MAX;
        assert_eq!(
            RegionDescriptor::from_bytes(&bad.to_bytes()),
            Err(DecodeError::Overflow)
        );
        assert!(d.contains(d.addr, d.len));
        assert!(!d.contains(d.addr + 1, d.len));
        assert!(!d.contains(d.addr - 1, 1));
    }
}
