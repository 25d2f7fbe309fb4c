//! Copies to and from memory that other threads, processes or devices access
//! at the same time.
//!
//! A plain `memcpy` of memory that someone else writes concurrently is a data
//! race, undefined behaviour in Rust. Every copy here uses word-sized
//! `Relaxed` atomic loads and stores (plain `mov`s on x86-64 and aarch64), so
//! a racing copy returns a mix of old and new words — a *torn* read, which the
//! reader detects with its own validation (pagewire's frame checksum) — and
//! never undefined behaviour. No ordering is implied: like an RDMA READ, a
//! copy guarantees nothing about the order in which it observes the words;
//! [`Chaos`] makes that visible in tests.
//!
//! Atomic loads from read-only mappings are allowed for lock-free atomics
//! (`AtomicU64` and `AtomicU8` are lock-free on every supported target).
//!
//! On x86-64 a copy of [`BULK`] bytes or more (a page frame) is one
//! `rep movsb` in inline assembly instead: the processor's fast string copy,
//! 1.3–2.4x faster than the word loop on a 4 KiB frame in cache here (the same
//! when the source comes from memory). An `asm!` block is sound when what
//! it does could be written in Rust: `rep movsb` reads each source byte
//! once and writes each destination byte once, in an order the processor
//! chooses, and a byte load racing a store returns the old or the new
//! byte; that is a sequence of `Relaxed` `AtomicU8` loads and plain stores
//! to `dst`, which is what the word loop does at a coarser grain. Torn
//! copies are caught by validation exactly as before (the checksum covers
//! every byte; nothing relies on the frame's words being copied whole).
//! Headers and bucket lines (64 B) keep the word loop: the header's fields
//! are decoded from single-copy-atomic words.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

/// Cache-line granularity of a chaotic copy.
const LINE: usize = 64;

/// Copies this long or longer use the processor's string copy on x86-64.
pub(crate) const BULK: usize = 256;

/// Test mode for the `tcp` responder and the `shm` reader: copy the cache
/// lines of each READ in random order and, optionally, pause halfway, so that
/// concurrent writers produce torn reads for real.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Chaos {
    /// Sleep this long after copying half of the lines of a READ.
    pub pause: Option<Duration>,
}

/// Copies `len` bytes from shared memory at `src` to `dst`.
///
/// # Safety
/// * `src..src + len` is mapped and readable for the whole call (other
///   parties may write it, with atomic or hardware stores).
/// * `dst..dst + len` is valid for writes and nobody else accesses it during
///   the call.
pub(crate) unsafe fn copy_from_shared_raw(
    src: *const u8,
    dst: *mut u8,
    len: usize,
    chaos: Option<&Chaos>,
) {
    match chaos {
        None if len >= BULK => {
            // SAFETY: forwarded from this function's contract.
            unsafe { copy_bulk(src, dst, len) }
        }
        None => {
            // SAFETY: forwarded from this function's contract.
            unsafe { copy_words(src, dst, len) }
        }
        Some(chaos) => {
            let mut chunks = Vec::with_capacity(len / LINE + 2);
            let mut start = 0;
            while start < len {
                let addr = src as usize + start;
                let end = ((addr / LINE + 1) * LINE - src as usize).min(len);
                chunks.push((start, end));
                start = end;
            }
            fastrand::shuffle(&mut chunks);
            let half = chunks.len() / 2;
            for (i, &(s, e)) in chunks.iter().enumerate() {
                if i == half
                    && let Some(pause) = chaos.pause
                {
                    std::thread::sleep(pause);
                }
                // SAFETY: `s..e` is a sub-range of `0..len`, so the contract
                // carries over.
                unsafe { copy_words(src.add(s), dst.add(s), e - s) }
            }
        }
    }
}

/// Safe form of [`copy_from_shared_raw`] into an owned slice.
///
/// # Safety
/// `src..src + out.len()` is mapped and readable for the whole call.
pub(crate) unsafe fn copy_from_shared(src: *const u8, out: &mut [u8], chaos: Option<&Chaos>) {
    // SAFETY: `out` is exclusively borrowed; the source part is the caller's.
    unsafe { copy_from_shared_raw(src, out.as_mut_ptr(), out.len(), chaos) }
}

/// A long copy: `rep movsb` on x86-64 (module docs), the word loop
/// elsewhere and under Miri or loom.
///
/// # Safety
/// As [`copy_from_shared_raw`].
#[inline]
unsafe fn copy_bulk(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(all(target_arch = "x86_64", not(miri), not(loom)))]
    {
        // SAFETY: `src..src + len` is readable and `dst..dst + len`
        // writable and ours (the contract); the block reads and writes
        // exactly those bytes, as Relaxed byte loads and plain stores would
        // (module docs). Rust clears the direction flag on entry to an asm
        // block and `rep movsb` leaves it clear, so the copy runs upwards.
        unsafe {
            std::arch::asm!(
                "rep movsb",
                inout("rcx") len => _,
                inout("rsi") src => _,
                inout("rdi") dst => _,
                options(nostack, preserves_flags)
            );
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri), not(loom))))]
    {
        // SAFETY: forwarded from this function's contract.
        unsafe { copy_words(src, dst, len) }
    }
}

/// # Safety
/// As [`copy_from_shared_raw`].
#[inline]
unsafe fn copy_words(src: *const u8, dst: *mut u8, len: usize) {
    let head = src.align_offset(8).min(len);
    let mut i = 0;
    while i < head {
        // SAFETY: `src + i` is in the readable range; AtomicU8 has alignment 1.
        let b = unsafe { AtomicU8::from_ptr(src.add(i).cast_mut()) }.load(Ordering::Relaxed);
        // SAFETY: `dst + i` is in the writable range.
        unsafe { dst.add(i).write(b) };
        i += 1;
    }
    // Eight independent word loads per step, then their stores: atomics are
    // never merged into vector loads, so this keeps the load ports busy.
    while i + 64 <= len {
        let mut line = [0u64; 8];
        for (k, w) in line.iter_mut().enumerate() {
            // SAFETY: `src + i + 8k` is 8-aligned (past the head) and the
            // whole step lies below `src + len`.
            *w = unsafe { AtomicU64::from_ptr(src.add(i + 8 * k).cast::<u64>().cast_mut()) }
                .load(Ordering::Relaxed);
        }
        // SAFETY: `dst + i .. + 64` is in the writable range; unaligned write.
        unsafe { dst.add(i).cast::<[u64; 8]>().write_unaligned(line) };
        i += 64;
    }
    while i + 8 <= len {
        // SAFETY: `src + i` is 8-aligned (past the head) and `src + i + 8 <=
        // src + len` is readable.
        let w = unsafe { AtomicU64::from_ptr(src.add(i).cast::<u64>().cast_mut()) }
            .load(Ordering::Relaxed);
        // SAFETY: `dst + i .. + 8` is in the writable range; unaligned write.
        unsafe { dst.add(i).cast::<u64>().write_unaligned(w) };
        i += 8;
    }
    while i < len {
        // SAFETY: as in the head loop.
        let b = unsafe { AtomicU8::from_ptr(src.add(i).cast_mut()) }.load(Ordering::Relaxed);
        // SAFETY: as in the head loop.
        unsafe { dst.add(i).write(b) };
        i += 1;
    }
}

/// Copies `data` into shared memory at `dst` with atomic stores.
///
/// # Safety
/// `dst..dst + data.len()` is mapped writable for the whole call; everybody
/// else accessing it uses atomic (or hardware) accesses.
pub(crate) unsafe fn copy_to_shared(data: &[u8], dst: *mut u8) {
    let len = data.len();
    let src = data.as_ptr();
    let head = dst.align_offset(8).min(len);
    let mut i = 0;
    while i < head {
        // SAFETY: `dst + i` is in the writable range; `src + i` in `data`.
        unsafe { AtomicU8::from_ptr(dst.add(i)).store(src.add(i).read(), Ordering::Relaxed) };
        i += 1;
    }
    while i + 8 <= len {
        // SAFETY: `dst + i` is 8-aligned past the head, in range; the source
        // read is an unaligned read inside `data`.
        unsafe {
            AtomicU64::from_ptr(dst.add(i).cast::<u64>())
                .store(src.add(i).cast::<u64>().read_unaligned(), Ordering::Relaxed)
        };
        i += 8;
    }
    while i < len {
        // SAFETY: as in the head loop.
        unsafe { AtomicU8::from_ptr(dst.add(i)).store(src.add(i).read(), Ordering::Relaxed) };
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_alignment_and_length_with_and_without_chaos() {
        let src: Vec<u8> = (0..1024u32).map(|i| (i * 7 + 3) as u8).collect();
        let chaos = Chaos { pause: None };
        for off in 0..9 {
            for len in [0, 1, 7, 8, 9, 63, 64, 65, 200, 255, 256, 257, 1000] {
                if off + len > src.len() {
                    continue;
                }
                for c in [None, Some(&chaos)] {
                    let mut out = vec![0u8; len];
                    // SAFETY: `src` is a live vector, nobody writes it.
                    unsafe { copy_from_shared(src.as_ptr().add(off), &mut out, c) };
                    assert_eq!(out, src[off..off + len]);
                }
                let mut dst = vec![0u8; 1024];
                // SAFETY: `dst` is a live vector, exclusively ours.
                unsafe { copy_to_shared(&src[..len], dst.as_mut_ptr().add(off)) };
                assert_eq!(dst[off..off + len], src[..len]);
            }
        }
    }
}
