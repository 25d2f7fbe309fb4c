//! A reader's index cache: where it last found each page in its owner's
//! region, `page → (frame, generation)`.
//!
//! Every entry is a hint. A read through it is validated like any other
//! (the frame's header must name the page, an odd generation and a matching
//! checksum), so an entry that went stale (the owner evicted the page and
//! reused the frame) or one that was overwritten by another page costs a
//! cold read (the bucket walk: one more round trip), never a wrong byte.
//!
//! It is direct-mapped: slot `page mod capacity`, one entry per slot, a new
//! entry replacing whatever the slot held. So its memory is bounded by its
//! capacity whatever the file's size (a map keyed by page grew with every
//! distinct page a reader ever read, pages the owner had long evicted
//! included), and a lookup is one load with no hashing. An owner holds at
//! most `frame_count` pages at once, so the capacity is `frame_count`
//! rounded up to a power of two (at most [`MAX_SLOTS`]); pages of one
//! extent are consecutive, so an owner's extents collide only where their
//! page numbers agree modulo the capacity.
//!
//! The table is allocated zeroed on the first insert (the kernel commits
//! its memory page by page as slots are used), so a reader that never hits
//! costs nothing.

/// The most slots one reader's cache has: 24 B each, 6 MiB at most.
pub(crate) const MAX_SLOTS: usize = 1 << 18;

/// `[page + 1 (0: empty), generation, frame]`: all zero is empty, so the
/// table can be allocated zeroed.
type Entry = [u64; 3];

/// The direct-mapped cache (module docs).
pub(crate) struct Locations {
    slots: Vec<Entry>,
    capacity: usize,
}

impl Locations {
    /// A cache for an owner with `frame_count` frames.
    pub(crate) fn new(frame_count: usize) -> Self {
        Self {
            slots: Vec::new(),
            capacity: frame_count.clamp(1, MAX_SLOTS).next_power_of_two(),
        }
    }

    fn slot(&self, page: u64) -> usize {
        (page as usize) & (self.capacity - 1)
    }

    /// Where `page` was last seen: `(frame, generation)`.
    #[inline]
    pub(crate) fn get(&self, page: u64) -> Option<(u32, u64)> {
        let e = self.slots.get(self.slot(page))?;
        (e[0] == page.wrapping_add(1)).then_some((e[2] as u32, e[1]))
    }

    /// Remember `page` at `(frame, generation)`, replacing what its slot held.
    #[inline]
    pub(crate) fn insert(&mut self, page: u64, frame: u32, generation: u64) {
        if self.slots.is_empty() {
            // Zeroed: `vec!` of an all-zero array allocates with calloc.
            self.slots = vec![[0u64; 3]; self.capacity];
        }
        let i = self.slot(page);
        let e = [page.wrapping_add(1), generation, u64::from(frame)];
        // A warm hit finds its entry there already: no store.
        if self.slots[i] != e {
            self.slots[i] = e;
        }
    }

    /// Forget `page` (if its slot still holds it).
    #[inline]
    pub(crate) fn remove(&mut self, page: u64) {
        let i = self.slot(page);
        if let Some(e) = self.slots.get_mut(i)
            && e[0] == page.wrapping_add(1)
        {
            *e = [0; 3];
        }
    }

    /// Slots in the table (the most entries it can hold).
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Entries held now (counts the table: for tests and diagnostics).
    pub(crate) fn len(&self) -> usize {
        self.slots.iter().filter(|e| e[0] != 0).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_found_replaced_and_forgotten() {
        let mut l = Locations::new(100);
        assert_eq!(l.capacity(), 128);
        assert_eq!(l.get(5), None);
        l.insert(5, 7, 9);
        assert_eq!(l.get(5), Some((7, 9)));
        // Page 0 is a key like any other (stored as 1: 0 is empty).
        l.insert(0, 1, 3);
        assert_eq!(l.get(0), Some((1, 3)));
        // 133 shares 5's slot: it replaces it, and 5 is a miss.
        l.insert(133, 8, 11);
        assert_eq!(l.get(133), Some((8, 11)));
        assert_eq!(l.get(5), None);
        // Removing 5 (no longer held) leaves 133 alone.
        l.remove(5);
        assert_eq!(l.get(133), Some((8, 11)));
        l.remove(133);
        assert_eq!(l.get(133), None);
        assert_eq!(l.len(), 1);
        // The largest page number is a key too.
        l.insert(u64::MAX, 2, 4);
        assert_eq!(l.get(u64::MAX), Some((2, 4)));
    }

    #[test]
    fn the_table_never_outgrows_its_capacity() {
        let mut l = Locations::new(64);
        for page in 0..100_000u64 {
            l.insert(page * 3, page as u32, 1);
        }
        assert!(l.len() <= 64, "{} entries", l.len());
        assert!(Locations::new(usize::MAX).capacity() == MAX_SLOTS);
        assert!(Locations::new(0).capacity() == 1);
    }
}
