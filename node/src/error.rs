//! Typed errors, one `#[non_exhaustive]` enum per family of operations.

use std::path::PathBuf;

/// Opening a cache over a backing file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    #[error("cannot open backing file {path}: {source}")]
    Backing {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("backing file {0} is not a regular file")]
    NotAFile(PathBuf),
    #[error("backing file {0} is empty")]
    EmptyFile(PathBuf),
    #[error("cache must have at least one frame (got {0})")]
    ZeroFrames(usize),
    #[error("page size {0} is not a power of two between 512 and 1 MiB")]
    BadPageSize(usize),
    #[error("{frames} frames do not fit a frame index of 32 bits")]
    TooManyFrames { frames: usize },
    #[error("cannot allocate the cache region ({len} bytes): {source}")]
    Alloc {
        len: usize,
        #[source]
        source: std::io::Error,
    },
}

/// Reading the backing file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackingError {
    #[error("backing read at offset {offset} failed: {source}")]
    Read {
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("backing file shrank: short read at offset {offset} ({got} of {wanted} bytes)")]
    ShortRead {
        offset: u64,
        wanted: usize,
        got: usize,
    },
    #[error("backing write at offset {offset} failed: {source}")]
    Write {
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("fdatasync of the backing file failed: {source}")]
    Sync {
        #[source]
        source: std::io::Error,
    },
    #[error(
        "write of {len} bytes at offset {offset} goes past the end of the file ({file_len} bytes)"
    )]
    BeyondEnd {
        offset: u64,
        len: usize,
        file_len: u64,
    },
}

/// Reading a page through the cache.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    #[error("page {page} is beyond the end of the file ({pages} pages)")]
    BeyondEnd { page: u64, pages: u64 },
    #[error("buffer of {got} bytes cannot hold page {page} ({need} bytes)")]
    BufferSize { page: u64, need: usize, got: usize },
    #[error(transparent)]
    Backing(#[from] BackingError),
    #[error("no frame could be freed: every frame is held by a reader")]
    NoFrame,
    #[error("the index has no room left")]
    IndexFull,
}

/// Writing a page (or bytes of one) through the cache.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    #[error("page {page} is beyond the end of the file ({pages} pages)")]
    BeyondEnd { page: u64, pages: u64 },
    #[error("write of {got} bytes at offset {offset} does not fit page {page} ({len} bytes)")]
    WrongLength {
        page: u64,
        offset: usize,
        got: usize,
        len: usize,
    },
    #[error(transparent)]
    Backing(#[from] BackingError),
    #[error("no frame could be freed: every frame is held by a reader")]
    NoFrame,
    #[error("the index has no room left")]
    IndexFull,
    #[error(transparent)]
    Read(#[from] ReadError),
}
