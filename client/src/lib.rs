//! pagewire-client: read and write pages of a pagewire cluster's file from
//! any process.
//!
//! A pagewire cluster spreads one big file over its nodes; each node caches
//! its share in a region that readers on other hosts read one-sidedly (RDMA
//! READ over `verbs`, or its `shm` and `tcp` stand-ins), with no code
//! running on the owner. This crate is everything a program needs to do
//! that, without the node's cache, daemon or server:
//!
//! * [`MapFollower`]: one per process; polls the coordinator for the
//!   ownership map and says until when it may be trusted. It expands no
//!   map: an extent's owner is resolved the first time a read asks
//!   (`pagewire_proto::lazy::LazyMap`), so a map costs O(members) to take
//!   whatever the size of the file.
//! * [`ClusterClient`]: one per process, shared by its threads; routes each
//!   page (or run of pages) to the node that answers it, reads
//!   it one-sidedly ([`one_sided`]) or with the owner's gRPC `Read`, writes
//!   through the owner's `Write`, and retries through failover until a
//!   deadline ([`cluster`] has the freshness argument and the fallback
//!   table).
//! * [`OwnerPool`]: one-sided connections to owners with the `FaultIn`
//!   fallback, shared by threads; what the node daemon uses for pages it
//!   does not serve.
//! * [`one_sided::RemoteReader`]: the one-sided reader of one owner's region
//!   (read-validate-retry over the layout of [`pagewire_layout`]).
//! * [`clock`]: the monotonic clock of leases and trust windows, which
//!   counts time spent suspended.
//!
//! Built on this crate: `pagewire-mount` (the file over FUSE) and `pwctl
//! read`, `write` and `owner` (the command line).
//!
//! # A complete program
//!
//! Reads page 7, writes it back with its first byte changed, and reads it
//! again (`COORDINATORS` is the coordinators' `host:port` list, comma
//! separated; `TOKEN` the cluster token):
//!
//! ```no_run
//! use pagewire_client::{ClientConfig, ClientError, ClusterClient, MapFollower, Via};
//!
//! fn main() -> Result<(), ClientError> {
//!     let token = std::env::var("TOKEN").unwrap_or_default();
//!     let coordinators = std::env::var("COORDINATORS").unwrap_or("127.0.0.1:7000".into());
//!     // One follower per process: it polls the coordinator in a thread.
//!     let follower = MapFollower::start(&coordinators, &token)?;
//!     // Waits (up to ClientConfig::op_deadline) for a node to register.
//!     // One per process: share it (`Arc`) with every thread.
//!     let client = ClusterClient::new(follower, &token, ClientConfig::default())?;
//!
//!     let mut page = vec![0u8; client.page_size()];
//!     let info = client.read_page(7, &mut page)?;
//!     println!(
//!         "page 7 ({} bytes) from node {} via {:?} in {} attempt(s)",
//!         client.page_len(7),
//!         info.owner,
//!         info.via,
//!         info.attempts
//!     );
//!     if info.via == Via::OneSided {
//!         println!("no code ran on the owner");
//!     }
//!
//!     page[0] ^= 0xff;
//!     let len = client.page_len(7);
//!     let generation = client.write_page(7, &page[..len])?;
//!     println!("write acknowledged: frame generation {generation}");
//!
//!     let mut again = vec![0u8; client.page_size()];
//!     client.read_page(7, &mut again)?;
//!     assert_eq!(again[..len], page[..len]);
//!
//!     // Pages 0..16 in one batched read (one doorbell per node's part).
//!     let mut run = vec![0u8; 16 * client.page_size()];
//!     let info = client.read_run(0, 16, &mut run)?;
//!     println!("page 0 at frame generation {}", info.pages[0].generation);
//!     println!("{:?}", client.stats());
//!     Ok(())
//! }
//! ```
//!
//! # Errors
//!
//! Every operation returns [`ClientError`]. Failover conditions (a node
//! killed, frozen or cut off, a map change, an extent moving, a fenced
//! write) are retried inside the call until [`ClientConfig::op_deadline`];
//! what comes out is:
//!
//! | error | when | what to do |
//! |---|---|---|
//! | [`ClientError::Coordinator`] | no coordinator answered at start, or it refused the token | check the address list and the token |
//! | [`ClientError::Addresses`] | the coordinator list is empty, too long or not `host:port` | fix the list |
//! | [`ClientError::Token`] | the token is empty or not printable ASCII | fix the token |
//! | [`ClientError::Runtime`] | the client's runtime or the follower's thread could not start | out of threads or memory |
//! | [`ClientError::NoFile`] | no node registered within `op_deadline` | start a node, or wait longer |
//! | [`ClientError::Unavailable`] | retries through failover ran out of time; `last` says why | retry later; the cluster is down or partitioned from here |
//! | [`ClientError::BeyondEnd`] | a page past the end of the file | a bug in the caller |
//! | [`ClientError::BufferSize`] | a read buffer shorter than a page | give `page_size` bytes |
//! | [`ClientError::WriteLength`] | a write that is neither the page's valid length nor a whole page | write whole pages |
//! | [`ClientError::Rejected`] | a node refused the request for good (a bad argument, a wrong token) | not retried: fix the request |
//!
//! [`OwnerPool::read_into`] and [`OwnerPool::read_run`] return
//! [`PoolError`]: `Connect`, `Read`, `LeaseExpired` and `FaultIn` are
//! failover conditions the caller retries (the pool trusts no map: it reads
//! the owner it is told); `BufferSize` is a caller's bug, and a `FaultIn`
//! whose `refused` code is not a failover one (not `Unavailable`,
//! `ResourceExhausted`, `Aborted`, `FailedPrecondition`) is final.
//!
//! # Threads and runtimes
//!
//! A [`ClusterClient`] is `Send + Sync` and every call takes `&self`: make
//! one per process and share it (`Arc`). Its calls block (on its own tokio
//! runtime, one worker), so none may be made from inside an async runtime:
//! call them from `spawn_blocking` there. [`cluster`] says what threads
//! share and what each keeps to itself.

#![warn(clippy::undocumented_unsafe_blocks)]

pub mod clock;
pub mod cluster;
pub mod latency;
mod locations;
#[cfg(feature = "prometheus")]
pub mod metrics;
pub mod one_sided;
pub mod pool;
mod readahead;
mod slot;

/// An error and its sources, `: `-separated, for log lines and messages
/// that print an error once (`Display` alone stops at the top: "i/o error
/// while connecting" without the OS error under it).
pub use cluster::owner::chain as error_chain;
pub use cluster::{
    ClientConfig, ClientError, ClientStats, ClusterClient, FollowerConfig, MapFollower, ReadInfo,
    ReadPath, RunInfo, Transport, TransportChoice, Via, read_owner, trust_window, write_owner,
};
pub use one_sided::{Outcome, ReaderConfig, ReaderStats, RemoteError, RemoteReader};
pub use pool::{FrameCopy, OwnerPool, PageRead, PoolConfig, PoolError, PoolStats, RunOptions};

/// The README's program, compiled as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
