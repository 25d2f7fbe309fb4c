//! The backing file: the source of truth, read with `pread` (optionally
//! `O_DIRECT`) and written through with `pwrite` (+ `fdatasync` when
//! configured) before a write is acknowledged.

use crate::error::{BackingError, OpenError};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Linux's limit on iovecs per call.
const IOV_MAX: usize = 1024;

#[cfg(test)]
thread_local! {
    /// (file offset, first buffer address) of every `preadv` this thread
    /// made: the unit tests check O_DIRECT's alignment with it, since some
    /// kernels and file systems answer an unaligned read at the end of the
    /// file with 0 and others with EINVAL.
    static PREADS: std::cell::RefCell<Vec<(u64, usize)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The file a node caches a share of.
#[derive(Debug)]
pub struct BackingFile {
    file: File,
    /// Buffered descriptor for write-through (O_DIRECT would need aligned
    /// buffers and offsets for partial-page writes).
    wfile: File,
    path: PathBuf,
    len: u64,
    page_size: usize,
    direct: bool,
    sync: bool,
}

impl BackingFile {
    /// Open `path` for reading and writing.
    pub fn open(
        path: &Path,
        page_size: usize,
        direct: bool,
        sync: bool,
    ) -> Result<Self, OpenError> {
        let mut opts = OpenOptions::new();
        opts.read(true).write(true);
        if direct {
            opts.custom_flags(libc::O_DIRECT);
        }
        let file = opts.open(path).map_err(|source| OpenError::Backing {
            path: path.to_owned(),
            source,
        })?;
        let meta = file.metadata().map_err(|source| OpenError::Backing {
            path: path.to_owned(),
            source,
        })?;
        if !meta.is_file() {
            return Err(OpenError::NotAFile(path.to_owned()));
        }
        if meta.len() == 0 {
            return Err(OpenError::EmptyFile(path.to_owned()));
        }
        let wfile = if direct {
            OpenOptions::new().write(true).open(path)
        } else {
            file.try_clone()
        }
        .map_err(|source| OpenError::Backing {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self {
            file,
            wfile,
            path: path.to_owned(),
            len: meta.len(),
            page_size,
            direct,
            sync,
        })
    }

    /// Length of the file when it was opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file is empty (never: `open` refuses empty files).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of pages, the last one possibly partial.
    pub fn pages(&self) -> u64 {
        self.len.div_ceil(self.page_size as u64)
    }

    /// Valid bytes of `page` (page_size except maybe for the last page).
    #[inline]
    pub fn page_len(&self, page: u64) -> usize {
        let start = page * self.page_size as u64;
        (self.len - start).min(self.page_size as u64) as usize
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Read the pages from `first` into `bufs`, one whole frame each, with as
    /// few `preadv` calls as the kernel allows. Bytes past the end of the file
    /// are zeroed; a file that shrank under us is an error.
    pub fn read_frames(&self, first: u64, bufs: &mut [&mut [u8]]) -> Result<(), BackingError> {
        let spans: Vec<(*mut u8, usize)> =
            bufs.iter_mut().map(|b| (b.as_mut_ptr(), b.len())).collect();
        // SAFETY: each span is a distinct buffer exclusively borrowed through
        // `bufs` for this whole call.
        unsafe { self.read_spans(first, &spans) }
    }

    /// [`BackingFile::read_frames`] into raw spans (the frames of a shared
    /// region). The bytes past the end of the file are zeroed with atomic
    /// byte stores and the rest is written by the kernel, so no plain store
    /// races with a transport responder that copies the same memory with
    /// atomic loads; no Rust reference to the spans is created.
    ///
    /// # Safety
    /// Each `(ptr, len)` span is valid for writes for the whole call, the
    /// spans do not overlap, and nobody else writes them or holds a
    /// reference to them during the call (atomic loads are fine).
    pub unsafe fn read_spans(
        &self,
        first: u64,
        spans: &[(*mut u8, usize)],
    ) -> Result<(), BackingError> {
        let offset = first * self.page_size as u64;
        let total: usize = spans.iter().map(|b| b.1).sum();
        let want = (self.len.saturating_sub(offset)).min(total as u64) as usize;
        // O_DIRECT needs an aligned length, offset and buffer: ask for the
        // whole frames (the last page of an unaligned file included) and
        // take the short count the kernel returns at the end of the file.
        let ask = if self.direct { total } else { want };
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(spans.len());
        let mut left = ask;
        for &(ptr, len) in spans {
            if left == 0 {
                break;
            }
            let n = len.min(left);
            iov.push(libc::iovec {
                iov_base: ptr.cast(),
                iov_len: n,
            });
            left -= n;
        }
        let mut done = 0usize;
        let mut at = 0usize; // first iovec not yet full
        // Until `want`: once the file's bytes are in, a further O_DIRECT read
        // would start at an unaligned offset (EINVAL) only to find the end.
        while done < want && at < iov.len() {
            let cnt = (iov.len() - at).min(IOV_MAX) as libc::c_int;
            #[cfg(test)]
            PREADS.with(|r| {
                r.borrow_mut()
                    .push((offset + done as u64, iov[at].iov_base as usize))
            });
            // SAFETY: every iovec points into a distinct span the caller
            // vouches for, with a length inside it; the fd is open for reading.
            let n = unsafe {
                libc::preadv(
                    std::os::fd::AsRawFd::as_raw_fd(&self.file),
                    iov[at..].as_ptr(),
                    cnt,
                    (offset + done as u64) as libc::off_t,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(BackingError::Read {
                    offset: offset + done as u64,
                    source: e,
                });
            }
            if n == 0 {
                break;
            }
            let mut n = n as usize;
            done += n;
            if self.direct && done < want && !done.is_multiple_of(self.page_size) {
                // Short of `want` at an unaligned point: the file shrank
                // under us (reported below); reading on would be EINVAL.
                break;
            }
            while n > 0 && at < iov.len() {
                let v = &mut iov[at];
                if n >= v.iov_len {
                    n -= v.iov_len;
                    at += 1;
                } else {
                    v.iov_base = v.iov_base.wrapping_byte_add(n);
                    v.iov_len -= n;
                    n = 0;
                }
            }
        }
        if done < want {
            return Err(BackingError::ShortRead {
                offset,
                wanted: want,
                got: done,
            });
        }
        let mut skip = want;
        for &(ptr, len) in spans {
            let keep = skip.min(len);
            for k in keep..len {
                // SAFETY: `ptr + k` lies inside the caller's span, valid for
                // writes; an atomic store races with no concurrent atomic load.
                unsafe { std::sync::atomic::AtomicU8::from_ptr(ptr.add(k)) }
                    .store(0, std::sync::atomic::Ordering::Relaxed);
            }
            skip -= keep;
        }
        Ok(())
    }

    /// Write `data` at byte `offset` of the file, then `fdatasync` if
    /// configured. Returns only once the bytes are in the file.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackingError> {
        if offset + data.len() as u64 > self.len {
            return Err(BackingError::BeyondEnd {
                offset,
                len: data.len(),
                file_len: self.len,
            });
        }
        self.wfile
            .write_all_at(data, offset)
            .map_err(|source| BackingError::Write { offset, source })?;
        if self.sync {
            self.wfile
                .sync_data()
                .map_err(|source| BackingError::Sync { source })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PS: usize = 4096;

    /// O_DIRECT reads of the last page of a file whose size is not a multiple
    /// of the page size: the page comes back short, and every `preadv` is
    /// aligned in offset and buffer (an unaligned one past the file's bytes
    /// is EINVAL on kernels that check alignment before the end of file).
    #[test]
    fn direct_reads_of_the_partial_last_page_stay_aligned() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("data");
        crate::pattern::generate_file(&path, 3 * PS as u64 + 100, PS).unwrap();
        let file = match BackingFile::open(&path, PS, true, false) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("O_DIRECT refused by the file system of {path:?} ({e}); skipped");
                return;
            }
        };
        let mut buf = vec![0u8; 4 * PS];
        let off = buf.as_ptr().align_offset(PS);
        let frames = &mut buf[off..off + 3 * PS];
        // The last page alone, then a run of two whole pages and the last.
        for (first, n) in [(3u64, 1usize), (1, 3)] {
            PREADS.with(|r| r.borrow_mut().clear());
            let mut bufs: Vec<&mut [u8]> = frames[..n * PS].chunks_mut(PS).collect();
            file.read_frames(first, &mut bufs).unwrap();
            let last = &frames[(n - 1) * PS..n * PS];
            assert_eq!(crate::pattern::verify(3, &last[..100]).map(|_| ()), Ok(()));
            assert!(last[100..].iter().all(|&b| b == 0), "the tail is zeroed");
            PREADS.with(|r| {
                for &(at, addr) in r.borrow().iter() {
                    assert!(
                        at.is_multiple_of(512) && addr.is_multiple_of(512),
                        "read of pages {first}..{}: an unaligned O_DIRECT preadv at offset {at}, buffer {addr:#x} ({:?})",
                        first + n as u64,
                        r.borrow()
                    );
                }
            });
        }
    }
}
