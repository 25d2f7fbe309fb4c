//! Byte ranges of the file as runs of the cluster's pages: which pages a
//! FUSE read covers, and how a FUSE write splits into whole-page writes
//! and partial pages (read-modify-write).

use std::ops::Range;

/// The pages a read covers: `count` pages from `first`; the caller's bytes
/// are `skip..skip + len` of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReadSpan {
    pub first: u64,
    pub count: usize,
    pub skip: usize,
    pub len: usize,
}

/// The span of a read of `size` bytes at `offset`, cut at the end of the
/// file (None: nothing to read, at or past the end, or `size` 0).
pub(crate) fn read_span(
    offset: u64,
    size: u32,
    file_size: u64,
    page_size: usize,
) -> Option<ReadSpan> {
    let ps = page_size as u64;
    if offset >= file_size || size == 0 || ps == 0 {
        return None;
    }
    let end = offset.saturating_add(u64::from(size)).min(file_size);
    let first = offset / ps;
    let last = (end - 1) / ps;
    Some(ReadSpan {
        first,
        count: (last - first + 1) as usize,
        skip: (offset - first * ps) as usize,
        len: (end - offset) as usize,
    })
}

/// One page's share of a write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PageWrite {
    pub page: u64,
    /// Where in the page the written bytes go.
    pub at: usize,
    /// Which bytes of the write's data.
    pub data: Range<usize>,
    /// The write covers the page's whole valid length: no read needed.
    pub whole: bool,
}

/// How a write of `len` bytes at `offset` splits into pages, cut at the end
/// of the file (the file's size is fixed). None: it starts at or past the
/// end. An empty write gives no pages.
pub(crate) fn write_pages(
    offset: u64,
    len: usize,
    file_size: u64,
    page_size: usize,
) -> Option<Vec<PageWrite>> {
    let ps = page_size as u64;
    if offset >= file_size || ps == 0 {
        return None;
    }
    let end = offset.saturating_add(len as u64).min(file_size);
    let mut out = Vec::new();
    let mut pos = offset;
    while pos < end {
        let page = pos / ps;
        let page_start = page * ps;
        let page_end = (page_start + ps).min(file_size);
        let stop = end.min(page_end);
        out.push(PageWrite {
            page,
            at: (pos - page_start) as usize,
            data: (pos - offset) as usize..(stop - offset) as usize,
            whole: pos == page_start && stop == page_end,
        });
        pos = stop;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PS: usize = 4096;
    /// Three pages, the last holding 100 bytes.
    const SIZE: u64 = 2 * 4096 + 100;

    #[test]
    fn a_read_covers_exactly_the_pages_of_its_bytes_and_stops_at_the_end() {
        assert_eq!(
            read_span(0, 4096, SIZE, PS),
            Some(ReadSpan {
                first: 0,
                count: 1,
                skip: 0,
                len: 4096
            })
        );
        assert_eq!(
            read_span(4095, 2, SIZE, PS),
            Some(ReadSpan {
                first: 0,
                count: 2,
                skip: 4095,
                len: 2
            })
        );
        // Past the end: cut to the file.
        assert_eq!(
            read_span(4096, 1 << 20, SIZE, PS),
            Some(ReadSpan {
                first: 1,
                count: 2,
                skip: 0,
                len: 4196
            })
        );
        assert_eq!(
            read_span(SIZE - 1, 10, SIZE, PS),
            Some(ReadSpan {
                first: 2,
                count: 1,
                skip: 99,
                len: 1
            })
        );
        assert_eq!(read_span(SIZE, 10, SIZE, PS), None);
        assert_eq!(read_span(0, 0, SIZE, PS), None);
        assert_eq!(read_span(u64::MAX, u32::MAX, SIZE, PS), None);
    }

    #[test]
    fn a_write_splits_into_whole_pages_and_partial_ones() {
        // Two whole pages.
        let w = write_pages(0, 8192, SIZE, PS).unwrap();
        assert_eq!(w.len(), 2);
        assert!(w.iter().all(|p| p.whole && p.at == 0));
        assert_eq!(w[1].data, 4096..8192);
        // Straddling a page boundary: two partial pages.
        let w = write_pages(4000, 200, SIZE, PS).unwrap();
        assert_eq!(
            w,
            vec![
                PageWrite {
                    page: 0,
                    at: 4000,
                    data: 0..96,
                    whole: false
                },
                PageWrite {
                    page: 1,
                    at: 0,
                    data: 96..200,
                    whole: false
                },
            ]
        );
        // The last page's valid length is the whole page.
        let w = write_pages(8192, 100, SIZE, PS).unwrap();
        assert_eq!(
            w,
            vec![PageWrite {
                page: 2,
                at: 0,
                data: 0..100,
                whole: true
            }]
        );
        // Cut at the end of the file.
        let w = write_pages(8192, 4096, SIZE, PS).unwrap();
        assert_eq!(
            w,
            vec![PageWrite {
                page: 2,
                at: 0,
                data: 0..100,
                whole: true
            }]
        );
        assert_eq!(write_pages(SIZE, 1, SIZE, PS), None);
        assert_eq!(write_pages(0, 0, SIZE, PS), Some(vec![]));
    }
}
