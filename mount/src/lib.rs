//! pagewire-mount: the cluster's file as a file. A FUSE mount of a
//! directory that holds one file (default name `data`) whose bytes are the
//! cluster's file, read (and, with `--writable`, written) through one
//! shared `pagewire_client::ClusterClient`.
//!
//! This crate is a leaf: it depends on `pagewire-client` (and `proto` for
//! the TLS settings) and on nothing of the node or the coordinator; nothing
//! depends on it.
//!
//! # Request flow
//!
//! ```text
//! kernel ──/dev/fuse──▶ FUSE threads (fuser, one cloned fd each; workers + 2)
//!                         │ lookup, getattr, readdir, open, statfs, flush:
//!                         │   answered at once from what the mount knows
//!                         │ read, write, while fewer than `workers` run:
//!                         ├──▶ on this FUSE thread ──▶ Source ──▶ ClusterClient
//!                         │ read, write, when `workers` already run:
//!                         ▼
//!                       overflow queue ──▶ worker threads ──▶ Source ──▶ ClusterClient
//!                         │                      │ reply from the thread that ran it
//!                         └── watchdog ──────────┴─ or EIO at the deadline
//! ```
//!
//! * **read** `(offset, size)`: cut at the end of the file, widened to the
//!   cluster pages it covers ([`range`]), read as one `read_run` (one
//!   doorbell for the run over one-sided paths), and the requested bytes
//!   copied out of the run into the reply. The kernel sends up to
//!   [`MAX_READ`] (1 MiB) per request: the mount option `max_read`, a
//!   `max_write` of 1 MiB at FUSE init (which sets the kernel's
//!   `max_pages`), and the device's readahead raised to 1 MiB after the
//!   mount.
//! * **write** (`--writable`): split at page boundaries; a page covered
//!   whole (its valid length) is one `write_page`; a partial page is read
//!   (`read_run` of one page), patched and written whole. Pages of one
//!   stripe (page number mod 64) are written one at a time within the
//!   process, so two partial writes of one page through this mount do not
//!   lose each other's bytes; writers in other processes or on other hosts
//!   are not ordered with them (mount/README.md, "Writes").
//! * **read-ahead** (on unless `--no-read-ahead`): a read that starts
//!   where an earlier one ended has the next run of its length read on a
//!   read-ahead thread; that run answers the next read only if every page's
//!   frame still holds the generation it was copied at, one 8-byte READ
//!   per page ([`prefetch`]).
//! * Consistency ([`Consistency`]): direct I/O by default (no page cache,
//!   every read asks the cluster), or the kernel page cache with a bound
//!   on how long a changed page may still be served from it: every period
//!   the runs the kernel read are checked (one 8-byte READ per page) and
//!   only those that changed are dropped ([`revalidate`]).
//!
//! # Deadlines
//!
//! Every read and write is answered within the mount's deadline
//! (`--deadline-ms`, default 10 s) of reaching the mount: the client's
//! `op_deadline` is the same value, so the client itself gives up by then
//! (retrying through failover until it does), and a watchdog
//! ([`deadline`]) answers `EIO` at the deadline for any request the client
//! has not finished (or that is still queued for an overflow worker), with a
//! log line naming the request. A dead or unreachable cluster is therefore
//! an `EIO` after at most the deadline, never a hang. Requests that need
//! no cluster (stat, readdir, open) never wait.

#![warn(clippy::undocumented_unsafe_blocks)]

pub mod cli;
pub mod deadline;
pub mod fs;
pub mod mountpoint;
pub mod prefetch;
pub(crate) mod range;
pub mod revalidate;
pub mod source;

use std::time::Duration;

pub use fs::PageFs;
pub use prefetch::PrefetchStats;
pub use revalidate::RevalidateStats;
pub use source::{Source, SourceError};

/// The largest read or write the kernel sends in one request (bytes).
pub const MAX_READ: u32 = 1 << 20;

/// How reads relate to the kernel's page cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Consistency {
    /// Every read goes to the cluster (FOPEN_DIRECT_IO): a read that
    /// starts after a write was acknowledged returns it or newer bytes.
    Direct,
    /// The kernel caches pages, attributes and the directory entry; every
    /// this often the mount drops the cached runs that changed since they
    /// were read ([`revalidate`]).
    Cached(Duration),
}

/// Settings of a mount.
#[derive(Clone, Debug)]
pub struct MountConfig {
    /// The one file's name in the mounted directory.
    pub name: String,
    pub consistency: Consistency,
    /// Writes allowed (else the mount is read-only: EROFS).
    pub writable: bool,
    /// Every read and write is answered within this (EIO after it).
    pub deadline: Duration,
    /// Reads and writes that run on FUSE threads at once (the mount starts
    /// this many plus [`deadline::SPARE_THREADS`] FUSE threads), and the
    /// number of overflow workers for requests beyond them.
    pub workers: usize,
    /// Read ahead of sequential readers, each run checked before use
    /// ([`prefetch`]).
    pub read_ahead: bool,
}

impl Default for MountConfig {
    fn default() -> Self {
        Self {
            name: "data".into(),
            consistency: Consistency::Direct,
            writable: false,
            deadline: Duration::from_secs(10),
            workers: 16,
            read_ahead: true,
        }
    }
}
