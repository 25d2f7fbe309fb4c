//! The daemon's errors, and their one conversion to `tonic::Status`.

use std::path::PathBuf;

/// Why the daemon could not start, or why a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum DaemonError {
    /// `what` names the file's setting ("the token file (--token-file)").
    #[error("cannot read {what} {path}: {source}")]
    ReadFile {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("bad config file {path}: {message}")]
    ConfigParse { path: PathBuf, message: String },
    #[error("invalid setting `{key}`: {reason}")]
    Config { key: &'static str, reason: String },
    #[error("cannot open the cache: {0}")]
    Open(#[from] crate::OpenError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Net(#[from] pagewire_proto::net::NetError),
    #[error("gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("the coordinator refused this node: {0}")]
    Refused(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("stale map: {0}")]
    StaleMap(String),
    #[error(
        "stale map: this node has applied epoch {node}, behind your epoch {yours}; retry shortly"
    )]
    NodeBehind { node: u64, yours: u64 },
    #[error("this node has no ownership map yet; retry")]
    NoMap,
    #[error(
        "lease expired: this node may no longer answer for its extents; refresh the map and retry"
    )]
    LeaseExpired,
    #[error(
        "extent {extent} is moving to this node; its previous owner (node index {from}) answers it until the handoff completes"
    )]
    Moving { extent: usize, from: u32 },
    #[error(
        "writes to extent {extent} wait {wait_ms} ms more: a node that served it before may still answer reads from an older map"
    )]
    WritesFenced { extent: usize, wait_ms: u64 },
    #[error(transparent)]
    Read(#[from] crate::ReadError),
    #[error(transparent)]
    Write(#[from] crate::WriteError),
    #[error("the owner of page {page} cannot be read now: {reason}; retry")]
    OwnerUnavailable { page: u64, reason: String },
    #[error("internal: {0}")]
    Internal(String),
}

impl From<DaemonError> for tonic::Status {
    fn from(e: DaemonError) -> Self {
        use crate::{ReadError, WriteError};
        let msg = e.to_string();
        match &e {
            DaemonError::InvalidArgument(_)
            | DaemonError::Read(ReadError::BeyondEnd { .. } | ReadError::BufferSize { .. })
            | DaemonError::Write(WriteError::BeyondEnd { .. } | WriteError::WrongLength { .. }) => {
                tonic::Status::invalid_argument(msg)
            }
            DaemonError::StaleMap(_) | DaemonError::NodeBehind { .. } => {
                tonic::Status::failed_precondition(msg)
            }
            DaemonError::NoMap
            | DaemonError::LeaseExpired
            | DaemonError::Moving { .. }
            | DaemonError::OwnerUnavailable { .. }
            | DaemonError::WritesFenced { .. } => tonic::Status::unavailable(msg),
            DaemonError::Read(ReadError::NoFrame)
            | DaemonError::Write(WriteError::NoFrame | WriteError::Read(ReadError::NoFrame)) => {
                tonic::Status::resource_exhausted(msg)
            }
            _ => {
                tracing::warn!(error = %msg, "call failed");
                tonic::Status::internal(msg)
            }
        }
    }
}
