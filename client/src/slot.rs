//! Per-thread slots: state that every thread of a process updates on every
//! read (counters, idle connections) is spread over [`SLOTS`] cache-line
//! aligned slots, one per thread as long as there are fewer threads, so two
//! threads reading at once never write the same cache line.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Slots per structure: threads beyond this share slots (correctly, with
/// some cache-line traffic).
pub(crate) const SLOTS: usize = 64;

/// This thread's slot, `0..SLOTS`: threads take the next one in the order
/// they first ask.
pub(crate) fn thread_slot() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SLOT: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SLOTS;
    }
    SLOT.with(|s| *s)
}

/// A value alone on its cache lines (128 bytes: adjacent-line prefetch
/// pairs lines on x86).
#[repr(align(128))]
#[derive(Default)]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// `SLOTS` padded values.
pub(crate) fn slots<T: Default>() -> Box<[Padded<T>]> {
    (0..SLOTS).map(|_| Padded(T::default())).collect()
}
