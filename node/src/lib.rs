//! pagewire-node: one node of pagewire, a distributed page cache over RDMA.
//!
//! This crate holds the node's **lockless local page cache** for its share of
//! a big file: a frame arena, a frame header table and a bucket index, all in
//! one region laid out ([`layout`]) so that a remote reader can find and read
//! a page with one-sided READs and the same read-validate-retry protocol as
//! a local reader.
//!
//! * [`PageCache`]: the safe API (lookup, fault-in, copy-out, write-through,
//!   eviction, stats), generic over an [`index::Index`] variant. A hit is a
//!   counted [`PageRef`] (`get`, `lookup`), or bytes lent under an epoch
//!   [`Pin`] with no shared store (`lookup_pinned`, for hot pages read by
//!   many threads).
//! * [`raw`] (internal): the lock-free core, each module opening with its
//!   protocol.
//! * [`daemon`]: the node daemon; it reads pages other nodes own with
//!   `pagewire-client`'s owner pool (the one-sided reader and the cluster
//!   client live in that crate, which links no cache).
//! * [`pattern`]: the self-describing page format every test and bench uses.
//! * [`numa`]: topology discovery and placement (hwloc with feature `numa`).
//!
//! Dependencies go one way: this crate may use `pagewire-layout`,
//! `pagewire-proto`, `pagewire-rdma` and `pagewire-client`, and must never
//! depend on the coordinator or the bench.

#![warn(clippy::undocumented_unsafe_blocks)]
// Under loom only the lock-free core is built and modelled (the cache, the
// daemon and the stats are left out), so much of what they use is unused
// there; CI builds the models with every other warning denied.
#![cfg_attr(loom, allow(dead_code))]

/// The region's wire layout lives in its own crate, shared with readers.
pub use pagewire_layout as layout;
pub mod pattern;
pub mod policy;
#[doc(hidden)]
pub mod raw;
pub(crate) mod sync;

pub mod index;
pub mod stats;

#[cfg(not(loom))]
mod backing;
#[cfg(not(loom))]
mod cache;
mod core;
#[cfg(not(loom))]
pub mod daemon;
pub mod error;
mod flight;
#[cfg(not(loom))]
mod ghost;
#[cfg(not(loom))]
pub mod numa;
#[cfg(not(loom))]
mod page_ref;

#[cfg(all(test, loom))]
mod loom_models;

#[cfg(not(loom))]
pub use backing::BackingFile;
#[cfg(not(loom))]
pub use cache::{CacheConfig, Evicted, PageCache, RegionView};
/// The node config file's decoder, for the fuzz targets (`fuzz/`).
#[cfg(not(loom))]
#[doc(hidden)]
pub use daemon::config::check_config_text;
pub use error::{BackingError, OpenError, ReadError, WriteError};
pub use index::{Index, IndexKind};
#[cfg(not(loom))]
pub use page_ref::{PageRef, Pin};
pub use stats::Stats;
