//! `verbs`: RDMA READ over ibverbs RC queue pairs (RoCE, soft-RoCE,
//! InfiniBand), through `sideway`.
//!
//! The owner runs a [`VerbsOwner`]: it registers regions with
//! `IBV_ACCESS_REMOTE_READ` only (never remote write or atomics) — an
//! anonymous mapping it allocates ([`VerbsOwner::register`]) or memory the
//! caller already has ([`VerbsOwner::register_external`], e.g. the node's
//! whole page-cache region, read by the NIC in place) — and accepts
//! readers on a TCP socket, where each reader proves the cluster token (the
//! same handshake as `tcp`) and the two sides exchange queue-pair endpoints.
//! After that the owner's CPU takes no part in a READ: the reader's NIC reads
//! the owner's memory. The TCP socket stays open as the connection's control
//! channel: it carries queue-pair re-establishment and tells either side when
//! the other goes away.
//!
//! A [`VerbsConnection`] posts a batch of READs as one chain of work requests
//! (one `ibv_post_send`, one doorbell). READs land in a bounce buffer the
//! connection registered itself and are copied into the caller's buffer when
//! their completion is polled: the caller's memory never needs registering,
//! and since the NIC only ever writes the bounce buffer, a READ can be
//! completed with [`ReadError::Timeout`](crate::ReadError::Timeout) or [`ReadError::ConnectionLost`](crate::ReadError::ConnectionLost)
//! at any time without the NIC writing the caller's buffer afterwards.
//!
//! Errors: a READ outside its descriptor is refused locally
//! ([`AccessFault::OutOfBounds`](crate::AccessFault::OutOfBounds)) and a descriptor of another owner
//! incarnation too ([`AccessFault::StaleEpoch`](crate::AccessFault::StaleEpoch)), so they never reach the
//! wire. A wrong rkey is refused by the remote NIC
//! ([`AccessFault::Device`](crate::AccessFault::Device)); in RC that moves the queue pair to the error
//! state, so the connection re-establishes a fresh queue pair over the
//! control channel and re-posts the READs that were flushed: the connection
//! survives, as on the other backends. A peer that goes away (control channel
//! closed, or the transport retry count exceeded) completes every pending
//! READ with [`ReadError::ConnectionLost`](crate::ReadError::ConnectionLost).
//!
//! # Endpoint exchange (after the handshake, magic `PWVRB\0\0\x01`)
//!
//! ```text
//! reader -> owner  qpn u32 | psn u32 | lid u16 | 0 u16 | gid[16]            (28 bytes)
//! owner -> reader  qpn u32 | psn u32 | lid u16 | 0 u16 | gid[16] | epoch u64 (36 bytes)
//! ```
//!
//! Repeated whenever the reader re-establishes; the owner then replaces its
//! queue pair for that reader. An owner that already serves
//! [`VerbsConfig::max_queue_pairs`] readers answers a new reader's first
//! endpoint with `qpn` 0 (never a real RC queue pair: QP0 is the subnet
//! management QP), the cap in `psn` and epoch 0, and closes the channel:
//! the reader fails with [`ConnectError::Refused`](crate::ConnectError::Refused). Integers are little-endian. `epoch` is the
//! owner's, carried by every descriptor of its regions:
//! [`VerbsConfig::epoch`] (the node's incarnation) or a random one.
//!
//! Waiting spins on the completion queue briefly, then arms the CQ's
//! completion channel and sleeps on its descriptor, which is also the
//! connection's [`Connection::readiness_fd`](crate::Connection::readiness_fd) (so tokio tasks are woken by the
//! reactor). sideway has no call to arm a CQ or read its events, so those
//! three calls (`ibv_req_notify_cq`, `ibv_get_cq_event`, `ibv_ack_cq_events`)
//! go through `rdma-mummy-sys`, the verbs layer sideway itself is built on,
//! rather than `rdma-sys`, which would link a second copy of libibverbs.

mod conn;
mod nic;
mod owner;

use std::time::Duration;

pub use conn::VerbsConnection;
pub use owner::{VerbsOwner, VerbsRegion, check_memlock};

const MAGIC: &[u8; 8] = b"PWVRB\0\0\x01";
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Environment variable naming the RDMA device to use (e.g. `rxe0`); the
/// first device when unset.
pub const DEVICE_ENV: &str = "PAGEWIRE_RDMA_DEVICE";

/// Environment variables that tune a reader's queue pairs for slow links
/// (soft-RoCE under an emulated CPU), read by
/// [`VerbsConfig::with_link_tuning_from_env`]: the local ACK timeout
/// exponent (4.096 µs × 2^n), the transport retry count and the operation
/// timeout in milliseconds.
pub const ACK_TIMEOUT_ENV: &str = "PAGEWIRE_VERBS_ACK_TIMEOUT";
/// See [`ACK_TIMEOUT_ENV`].
pub const RETRY_ENV: &str = "PAGEWIRE_VERBS_RETRY";
/// See [`ACK_TIMEOUT_ENV`]: [`VerbsConfig::op_timeout`] in milliseconds
/// (at least 1).
pub const OP_TIMEOUT_ENV: &str = "PAGEWIRE_VERBS_OP_TIMEOUT_MS";

/// Settings of a [`VerbsOwner`] or a [`VerbsConnection`].
#[derive(Debug, Clone)]
pub struct VerbsConfig {
    /// RDMA device name; `None` for the first one.
    pub device: Option<String>,
    /// Port number on the device, from 1.
    pub port: u8,
    /// GID index; `None` picks a RoCE v2 IPv4-mapped GID, or the first usable.
    pub gid_index: Option<u8>,
    /// Cluster token, proven by both sides on the control channel.
    pub token: Vec<u8>,
    /// READs in flight per connection, at most.
    pub max_outstanding: usize,
    /// Bytes of one READ, at most (the bounce buffer holds
    /// `max_outstanding * max_read_len` bytes).
    pub max_read_len: usize,
    /// Local ACK timeout exponent: 4.096 µs * 2^n per try.
    pub ack_timeout: u8,
    /// Transport retries before a READ fails with `ConnectionLost`.
    pub retry_count: u8,
    /// A READ not completed within this long completes with `Timeout`.
    pub op_timeout: Duration,
    /// Reader only: connecting the control socket and each step of the
    /// handshake and endpoint exchange gives up after this long.
    pub connect_timeout: Duration,
    /// Owner only: the epoch every descriptor carries (the node's
    /// incarnation); `None` picks a random one. Zero is reserved
    /// ([`OwnerError::ZeroEpoch`](crate::OwnerError::ZeroEpoch)). Connections ignore it.
    pub epoch: Option<u64>,
    /// Owner only: readers served at once, at most (one RC queue pair each);
    /// a reader past it is refused ([`VerbsOwner::refused`] counts them).
    pub max_queue_pairs: usize,
}

impl VerbsConfig {
    /// This config with `ack_timeout`, `retry_count` and `op_timeout` taken
    /// from [`ACK_TIMEOUT_ENV`], [`RETRY_ENV`] and [`OP_TIMEOUT_ENV`] where
    /// they are set (clamped to 31 and 7, what the queue pair takes, and to
    /// at least 1 ms). A link slow enough to need a longer ACK timeout may
    /// need a longer operation timeout too: under soft-RoCE on an emulated
    /// CPU, READs whose p50 is about 1 ms have run past the default 5 s.
    #[must_use]
    pub fn with_link_tuning_from_env(mut self) -> Self {
        fn env<T: std::str::FromStr>(k: &str) -> Option<T> {
            std::env::var(k).ok()?.parse().ok()
        }
        if let Some(v) = env::<u8>(ACK_TIMEOUT_ENV) {
            self.ack_timeout = v.min(31);
        }
        if let Some(v) = env::<u8>(RETRY_ENV) {
            self.retry_count = v.min(7);
        }
        if let Some(v) = env::<u64>(OP_TIMEOUT_ENV) {
            self.op_timeout = Duration::from_millis(v.max(1));
        }
        self
    }

    /// Defaults: device from [`DEVICE_ENV`], port 1, 128 READs of up to 64 KiB
    /// in flight, ~67 ms ACK timeout with 3 retries, 5 s operation timeout,
    /// at most 1024 readers per owner.
    #[must_use]
    pub fn new(token: impl Into<Vec<u8>>) -> Self {
        Self {
            device: std::env::var(DEVICE_ENV).ok().filter(|d| !d.is_empty()),
            port: 1,
            gid_index: None,
            token: token.into(),
            max_outstanding: 128,
            max_read_len: 64 << 10,
            ack_timeout: 14,
            retry_count: 3,
            op_timeout: Duration::from_secs(5),
            connect_timeout: HANDSHAKE_TIMEOUT,
            epoch: None,
            max_queue_pairs: 1024,
        }
    }
}
