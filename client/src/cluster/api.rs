//! What a caller of [`ClusterClient`](super::ClusterClient) sets and gets
//! back: its settings ([`ClientConfig`], [`ReadPath`]), what a read took
//! ([`Via`], [`ReadInfo`], [`RunInfo`]), its counters ([`ClientStats`]) and
//! why an operation failed ([`ClientError`]).

use std::time::Duration;

use crate::one_sided::{ReaderConfig, ReaderStats};
use pagewire_proto::auth::TokenError;
use pagewire_proto::net::ClientTls;

use super::owner::{Transport, TransportChoice};

/// How a [`ClusterClient`](super::ClusterClient) reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReadPath {
    /// One-sided READs of the owner's region, `FaultIn` on the owner when
    /// its index does not show the page.
    #[default]
    OneSided,
    /// The two-sided `Read` RPC on the owner (for comparison).
    Grpc,
}

/// Settings of a [`ClusterClient`](super::ClusterClient).
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Which transport one-sided reads use.
    pub transport: TransportChoice,
    /// One-sided reads or the gRPC `Read`.
    pub path: ReadPath,
    /// How long one read/write keeps retrying through failover before it returns Unavailable (default 10 s).
    pub op_deadline: Duration,
    /// The one-sided readers' retries.
    pub reader: ReaderConfig,
    /// Connecting to a node (gRPC, or the `tcp` transport with its
    /// handshake) gives up after this long (default 500 ms).
    pub connect_timeout: Duration,
    /// One RPC to a node, or one one-sided `tcp` READ, gives up after this
    /// long (default 1 s): a frozen node must not hold an operation.
    pub rpc_timeout: Duration,
    /// First backoff between attempts (default 1 ms); doubles each time.
    pub backoff_min: Duration,
    /// Largest backoff (default 100 ms).
    pub backoff_max: Duration,
    /// TLS for the gRPC channels to nodes (`Read`, `Write`, `FaultIn`): the
    /// CA that signs the nodes' certificates and the name they carry. None:
    /// plain text. (The coordinator's is [`FollowerConfig::tls`](super::FollowerConfig::tls).)
    pub tls: Option<ClientTls>,
    /// One `tcp` connection per owner for the whole process
    /// ([`crate::PoolConfig::tcp_shared`]; default `false`).
    pub tcp_shared: bool,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            transport: TransportChoice::Auto,
            path: ReadPath::OneSided,
            op_deadline: Duration::from_secs(10),
            reader: ReaderConfig::default(),
            connect_timeout: Duration::from_millis(500),
            rpc_timeout: Duration::from_secs(1),
            backoff_min: Duration::from_millis(1),
            backoff_max: Duration::from_millis(100),
            tls: None,
            tcp_shared: false,
        }
    }
}

/// How a read was answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// One-sided READs of the node's region.
    OneSided,
    /// The node's `FaultIn`, bytes inline (after a one-sided miss).
    FaultIn,
    /// The node's `Read` RPC.
    Grpc,
}

/// What one page of a read took.
#[derive(Clone, Copy, Debug)]
pub struct ReadInfo {
    /// The path that returned the bytes.
    pub via: Via,
    /// The node index that answered.
    pub owner: u32,
    /// Attempts this read took (1: no retry).
    pub attempts: u32,
    /// The transport of the one-sided connection to the answering node
    /// (`None` for the gRPC `Read`): a `FaultIn` read names the transport
    /// whose miss sent it to the owner.
    pub transport: Option<Transport>,
    /// The frame generation of the copy read (0: the node served the page
    /// without caching it). Compare only for equality, for one owner.
    pub generation: u64,
    /// Another thread's read of the same run answered this one (a read
    /// that started after this one was asked for).
    pub coalesced: bool,
    /// The owner's frame the bytes are a copy of (None for the gRPC `Read`
    /// and for a page the owner served without caching it): what
    /// [`ClusterClient::still_current`](super::ClusterClient::still_current)
    /// checks.
    pub copy: Option<crate::pool::FrameCopy>,
}

/// What a [`ClusterClient::read_run`](super::ClusterClient::read_run) took: one entry per page.
#[derive(Clone, Debug)]
pub struct RunInfo {
    pub pages: Vec<ReadInfo>,
}

/// Counters of one [`ClusterClient`](super::ClusterClient).
#[derive(Clone, Copy, Debug, Default)]
pub struct ClientStats {
    /// Pages read (`one_sided + fault_ins + grpc_reads + coalesced`).
    pub reads: u64,
    /// Reads answered by one-sided READs.
    pub one_sided: u64,
    /// Reads answered by `FaultIn` after a one-sided miss.
    pub fault_ins: u64,
    /// Pages faulted in by a call on the owner's tcp transport connection
    /// (no gRPC): of `fault_ins`, but for pages a call faulted in whose
    /// read was then retried.
    pub fault_calls: u64,
    /// Pages after a sequential reader's miss whose locations its fault-in
    /// brought back (readahead): read later with one READ, no index walk.
    pub readahead: u64,
    /// Reads answered by the gRPC `Read`.
    pub grpc_reads: u64,
    /// Of `one_sided`, those read over shm, verbs and tcp.
    pub one_sided_shm: u64,
    pub one_sided_verbs: u64,
    pub one_sided_tcp: u64,
    /// Writes acknowledged.
    pub writes: u64,
    /// attempts beyond the first (owner unreachable, stale map, moving extent, lease wait)
    pub retries: u64,
    /// Connections (one-sided or gRPC) opened to a node again after one to
    /// it was dropped (a failure, or a new region epoch).
    pub reconnects: u64,
    /// Polls this client asked the follower for.
    pub map_refreshes: u64,
    /// Operations that returned [`ClientError::Unavailable`].
    pub unavailable: u64,
    /// Pages answered by another thread's read of the same run (single
    /// flight); counted in `reads`, not in `one_sided`/`fault_ins`/`grpc_reads`.
    pub coalesced: u64,
    /// Attempts that found the map past its trust window (before starting,
    /// or a one-sided read's `LeaseExpired`) and waited for a poll.
    pub lease_waits: u64,
    /// the one-sided readers' totals (validation failures, torn buckets, ... as ReaderStats) over every connection so far
    pub reader: ReaderStats,
}

/// Why an operation of the client failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The coordinator could not be reached or answered an error at start.
    #[error("the coordinator at {address}: {reason}")]
    Coordinator { address: String, reason: String },
    /// The coordinator address list is empty, too long or not host:port.
    #[error("bad coordinator addresses: {0}")]
    Addresses(#[source] pagewire_proto::leader::AddressListError),
    /// The token cannot be sent (empty, or not printable ASCII).
    #[error("bad cluster token: {0}")]
    Token(#[source] TokenError),
    /// The runtime or the follower thread could not be started.
    #[error("cannot start the client's runtime or thread: {0}")]
    Runtime(#[source] std::io::Error),
    /// No node registered within `op_deadline`, so the file is unknown.
    #[error("the cluster names no file yet (no node registered within {waited:?})")]
    NoFile { waited: Duration },
    /// Retries through failover ran out of time; `last` says why the last
    /// attempt failed.
    #[error("page {page} unavailable after {waited:?}: {last}")]
    Unavailable {
        page: u64,
        waited: Duration,
        last: String,
    },
    /// The page is past the end of the file.
    #[error("page {page} is past the end of the file ({pages} pages)")]
    BeyondEnd { page: u64, pages: u64 },
    /// The read buffer is shorter than a page.
    #[error("buffer of {got} bytes for a page of {need}")]
    BufferSize { need: usize, got: usize },
    /// The write's length fits neither the page's valid length nor a whole
    /// page with zeros past it.
    #[error(
        "write of {got} bytes to page {page}, which holds {len} (or {page_size} with zeros past {len})"
    )]
    WriteLength {
        page: u64,
        got: usize,
        len: usize,
        page_size: usize,
    },
    /// A node refused the request for good (not a failover condition).
    #[error("node {node} refused page {page}: {code:?}: {message}")]
    Rejected {
        node: String,
        page: u64,
        code: tonic::Code,
        message: String,
    },
}
