//! Readahead of locations: a reader reading on past a miss learns where the
//! owner holds the next pages, so it reads each with one READ.
//!
//! A one-sided miss faults its pages in on the owner, and the owner's own
//! readahead reads the pages after them into its cache. Without more, the
//! reader still knows nothing of those pages: each costs a cold hit, the
//! bucket walk and then the frame, two round trips. So when a reader's
//! miss continues a sequential stream (its read begins where its last read
//! on that connection ended), the fault-in asks for `readahead` pages after
//! the run: the owner faults them in as well and answers with their frames'
//! locations (not their bytes), and the reader puts them in its index
//! cache. Its next reads of them are warm hits, one round trip each, still
//! validated like any read (a location is a hint). A reader reading at
//! random asks for none, so it never makes an owner read pages nobody reads.
//!
//! The window starts at [`FIRST`] pages (or the miss's own length, if
//! longer), doubles at each sequential miss up to [`MAX_PAGES`], and drops
//! to nothing at a miss that is not sequential, like the kernel's
//! readahead. The owner cuts it at the end of the run's extent, the file
//! and its per-call page limit.

/// The window at a stream's first sequential miss, in pages.
pub(crate) const FIRST: u32 = 8;
/// The largest window, in pages (1 MiB of 4 KiB pages).
pub(crate) const MAX_PAGES: u32 = 256;

/// One connection's stream of reads.
#[derive(Debug, Default)]
pub(crate) struct Stream {
    /// The page right after the last read (None: no read yet).
    next: Option<u64>,
    window: u32,
}

impl Stream {
    /// Whether a read beginning at `first` continues the stream.
    pub(crate) fn continues(&self, first: u64) -> bool {
        self.next == Some(first)
    }

    /// The readahead to ask with a fault-in of `len` pages: the window,
    /// grown when the read is `sequential` ([`Stream::continues`]), else
    /// none (and the window closes).
    pub(crate) fn on_miss(&mut self, sequential: bool, len: u64) -> u32 {
        if !sequential {
            self.window = 0;
            return 0;
        }
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        self.window = self
            .window
            .saturating_mul(2)
            .max(len)
            .clamp(FIRST, MAX_PAGES);
        self.window
    }

    /// A read ended at `next` (exclusive).
    pub(crate) fn end(&mut self, next: u64) {
        self.next = Some(next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequential_stream_grows_its_window_and_a_jump_closes_it() {
        let mut s = Stream::default();
        assert!(!s.continues(0), "the first read continues nothing");
        assert_eq!(s.on_miss(s.continues(0), 1), 0);
        s.end(1);
        assert!(s.continues(1));
        assert_eq!(s.on_miss(true, 1), FIRST);
        assert_eq!(s.on_miss(true, 1), 2 * FIRST);
        // A long miss asks at least its own length.
        assert_eq!(s.on_miss(true, 100), 100);
        for _ in 0..8 {
            s.on_miss(true, 1);
        }
        assert_eq!(s.on_miss(true, 1), MAX_PAGES, "the window is capped");
        s.end(500);
        assert!(!s.continues(7));
        assert_eq!(s.on_miss(false, 1), 0, "a jump asks none");
        assert_eq!(s.on_miss(true, 1), FIRST, "and starts over");
    }
}
