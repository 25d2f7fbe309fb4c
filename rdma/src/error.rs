//! Error and outcome types, one enum per operation family.

use std::io;

/// Why a remote region refused a READ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AccessFault {
    /// No live region has this rkey (never registered, or deregistered).
    UnknownKey,
    /// The rkey exists but the descriptor's epoch is not the region's.
    StaleEpoch,
    /// The address range is not inside the region.
    OutOfBounds,
    /// The request was malformed (bad opcode, zero or oversized length).
    BadRequest,
    /// The device reported a remote access error without a finer reason (verbs).
    Device,
}

/// The outcome of one READ that did not deliver its bytes.
///
/// These are outcomes, not bugs: a reader is expected to handle each one
/// (refresh the descriptor, reconnect, fall back to the owner's RPC).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The remote side refused the access; the connection is still usable.
    #[error("remote access error: {0:?}")]
    RemoteAccess(AccessFault),
    /// The connection broke before the READ completed; the local buffer may
    /// hold partial data. Every later post fails with
    /// [`PostError::ConnectionLost`].
    #[error("connection lost")]
    ConnectionLost,
    /// The READ did not complete within the connection's operation timeout.
    /// The backend guarantees the local buffer is no longer written.
    #[error("timed out")]
    Timeout,
}

/// Why a CALL on a `tcp` connection
/// ([`TcpConnection::call`](crate::tcp::TcpConnection::call)) brought no
/// reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// READs are outstanding on the connection (a call waits for its own
    /// reply alone, so it needs an idle connection); nothing was sent.
    #[error("{0} requests outstanding on the connection; a call needs it idle")]
    Busy(usize),
    /// The argument is longer than the wire allows; nothing was sent.
    #[error("call argument of {len} bytes (limit {limit})")]
    TooLong {
        /// The argument's length.
        len: usize,
        /// [`crate::tcp::MAX_CALL_ARG`].
        limit: usize,
    },
    /// The owner has no call handler installed; the connection is still
    /// usable.
    #[error("the owner answers no calls")]
    NoHandler,
    /// The owner refused the call (a stale epoch: the owner restarted; a
    /// bad request); the connection is still usable.
    #[error("the owner refused the call: {0:?}")]
    Refused(AccessFault),
    /// The connection broke before the reply came.
    #[error("connection lost")]
    ConnectionLost,
    /// No reply within the call's timeout (a late one is skipped).
    #[error("timed out")]
    Timeout,
}

/// Why a batch could not be posted; nothing of the batch was posted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PostError {
    /// More outstanding requests than the connection allows.
    #[error("queue full: {outstanding} outstanding, {requested} more requested, limit {limit}")]
    QueueFull {
        /// Requests posted and not yet completed.
        outstanding: usize,
        /// Size of the refused batch.
        requested: usize,
        /// [`crate::Limits::max_outstanding`].
        limit: usize,
    },
    /// A request asks for more bytes than [`crate::Limits::max_read_len`], or zero.
    #[error("invalid read length {len} (limit {limit})")]
    InvalidLength {
        /// Requested length.
        len: usize,
        /// The connection's limit.
        limit: usize,
    },
    /// The connection is already known to be lost.
    #[error("connection lost")]
    ConnectionLost,
    /// The device refused the work requests (verbs).
    #[error("device refused the post")]
    Device(#[source] io::Error),
}

/// Why a connection could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The operating system refused (connect, open, mmap...).
    #[error("i/o error while connecting")]
    Io(#[from] io::Error),
    /// The peer does not hold the same cluster token (or we do not).
    #[error("authentication failed: the peer does not share our cluster token")]
    AuthFailed,
    /// The peer spoke something else than this protocol version.
    #[error("protocol error: {0}")]
    Protocol(&'static str),
    /// No such peer (shm: no live owner under that name).
    #[error("no live peer named {0:?}")]
    NoSuchPeer(String),
    /// The RDMA device could not be opened or configured.
    #[error("rdma device error: {0}")]
    Device(String),
    /// The peer refused the connection (verbs: it already serves as many
    /// readers as its queue-pair cap allows).
    #[error("refused by the peer: {0}")]
    Refused(String),
}

/// Why memory could not be registered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// Zero length, or too large for this backend.
    #[error("invalid region length {0}")]
    InvalidLength(usize),
    /// The operating system refused (mmap, file creation).
    #[error("i/o error while registering")]
    Io(#[from] io::Error),
    /// The device refused the registration (verbs).
    #[error("rdma device error: {0}")]
    Device(String),
    /// Registration pins the memory, and this process may not lock that
    /// much (verbs): `RLIMIT_MEMLOCK` is below the region's size and the
    /// process lacks `CAP_IPC_LOCK` in its effective set.
    #[error(
        "registering {need} bytes for RDMA pins them, but this process may lock only {limit} bytes \
         (RLIMIT_MEMLOCK) and lacks CAP_IPC_LOCK: raise the memlock limit to at least {need} bytes or \
         unlimited (`ulimit -l unlimited`; systemd LimitMEMLOCK=infinity; docker --ulimit memlock=-1:-1; \
         in Kubernetes the container runtime's default memlock ulimit); adding IPC_LOCK to a non-root \
         container does not reach its process's effective set"
    )]
    MemlockLimit {
        /// The soft `RLIMIT_MEMLOCK`, in bytes.
        limit: u64,
        /// Bytes the registration would pin.
        need: u64,
    },
    /// The owner is shut down.
    #[error("the owner is closed")]
    Closed,
}

/// Why an owner (a `tcp` owner, an `shm` owner, a `verbs` owner) could
/// not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OwnerError {
    /// Epoch 0 was asked for. It is reserved: it is what an unset field
    /// reads as (a protobuf default, a zeroed superblock), so no live owner
    /// may carry it and a descriptor with epoch 0 never matches one.
    #[error("epoch 0 is reserved (it is what an unset epoch reads as)")]
    ZeroEpoch,
    /// The operating system refused (bind, file creation, mmap).
    #[error("i/o error while starting the owner")]
    Io(#[from] io::Error),
    /// The RDMA device could not be opened or configured (verbs).
    #[error("rdma device error: {0}")]
    Device(String),
}
