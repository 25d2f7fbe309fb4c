//! The coordinator's errors, and their one conversion to `tonic::Status`.

use crate::persist::PersistError;
use crate::store::StoreError;

/// Why a coordinator operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoordError {
    #[error("{0}")]
    InvalidArgument(String),
    /// A feature the API names that the nodes do not implement.
    #[error("{0}")]
    Unimplemented(String),
    #[error("unknown node {}", quoted(.0))]
    UnknownNode(String),
    #[error(
        "stale incarnation for node {}: it registered again since; register anew",
        quoted(.node_id)
    )]
    StaleIncarnation { node_id: String },
    #[error("node {} is {state}", quoted(.node_id))]
    NotAlive {
        node_id: String,
        state: &'static str,
    },
    #[error(
        "node id {} is in use: incarnation {incarnation} at {address} holds a live lease that \
         ends in {lease_remaining_ms} ms; stop that process or pick another --node-id (a node \
         restarted at a new address may register once that lease has run out)",
        quoted(.node_id)
    )]
    NodeIdInUse {
        node_id: String,
        address: String,
        incarnation: u64,
        lease_remaining_ms: u64,
    },
    #[error(
        "incarnation {incarnation} of node {} left the cluster: leaving is final for a process; \
         start a new one to rejoin",
        quoted(.node_id)
    )]
    Left { node_id: String, incarnation: u64 },
    #[error(
        "draining node {} would leave no alive node to take its {extents} extents: start or \
         undrain another node first",
        quoted(.node_id)
    )]
    NoNodeLeft { node_id: String, extents: u64 },
    #[error("node reports a {node} byte backing file but the cluster's is {cluster} bytes")]
    FileSizeMismatch { cluster: u64, node: u64 },
    #[error("node uses {node} byte pages but the cluster uses {cluster} byte pages")]
    PageSizeMismatch { cluster: u32, node: u32 },
    #[error("the cluster has no file size yet: no node has registered")]
    NoFile,
    #[error("cannot save the coordinator state: {0}")]
    Persist(#[from] PersistError),
    #[error("{}", not_leading_message(.leader.as_deref(), .problem.as_deref()))]
    NotLeading {
        leader: Option<String>,
        problem: Option<String>,
    },
    #[error("the state store did not take the change, which is not published: {0}")]
    StoreUnavailable(String),
    /// A change that could not run to its end (its task panicked).
    #[error("{0}")]
    Internal(String),
}

fn not_leading_message(leader: Option<&str>, problem: Option<&str>) -> String {
    match (leader, problem) {
        (Some(l), _) => format!("this coordinator does not lead; the leader is {l}"),
        (None, Some(p)) => {
            format!("this coordinator does not lead and no leader is known now: {p}")
        }
        (None, None) => "this coordinator does not lead and no leader is known now (an \
                         election in progress, or the store without quorum)"
            .to_owned(),
    }
}

impl From<StoreError> for CoordError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::File(p) => Self::Persist(p),
            StoreError::NotLeader { leader } => Self::NotLeading {
                leader,
                problem: None,
            },
            StoreError::Unavailable(why) => Self::StoreUnavailable(why),
        }
    }
}

/// Longest piece of a request echoed into an error message.
pub const ECHO_MAX: usize = 64;

/// `s`, cut to [`ECHO_MAX`] characters with an ellipsis: a request field
/// echoed into a status message, which must stay small whatever was sent
/// (gRPC metadata is limited to 16 KiB).
pub fn clip(s: &str) -> String {
    match s.char_indices().nth(ECHO_MAX) {
        None => s.to_owned(),
        Some((cut, _)) => format!("{}…", &s[..cut]),
    }
}

/// `s` clipped (see [`clip`]) and quoted as `{:?}` does.
pub fn quoted(s: &str) -> String {
    format!("{:?}", clip(s))
}

/// Metadata entry of an ALREADY_EXISTS registration refusal: milliseconds
/// until the live lease holding the node id runs out.
pub const LEASE_REMAINING_KEY: &str = "pagewire-lease-remaining-ms";

/// Human name of a node state (the contract's, shared with `pwctl`).
pub use pagewire_proto::state_name;

impl From<CoordError> for tonic::Status {
    fn from(e: CoordError) -> Self {
        let msg = e.to_string();
        match e {
            CoordError::InvalidArgument(_)
            | CoordError::FileSizeMismatch { .. }
            | CoordError::PageSizeMismatch { .. } => tonic::Status::invalid_argument(msg),
            CoordError::Unimplemented(_) => tonic::Status::unimplemented(msg),
            CoordError::UnknownNode(_) => tonic::Status::not_found(msg),
            CoordError::StaleIncarnation { .. }
            | CoordError::NotAlive { .. }
            | CoordError::Left { .. }
            | CoordError::NoNodeLeft { .. } => tonic::Status::failed_precondition(msg),
            CoordError::NodeIdInUse {
                lease_remaining_ms, ..
            } => {
                let mut s = tonic::Status::already_exists(msg);
                if let Ok(v) = lease_remaining_ms.to_string().parse() {
                    s.metadata_mut().insert(LEASE_REMAINING_KEY, v);
                }
                s
            }
            CoordError::NoFile => tonic::Status::failed_precondition(msg),
            CoordError::NotLeading { ref leader, .. } => {
                pagewire_proto::leader::not_leading(msg, leader.as_deref())
            }
            CoordError::StoreUnavailable(_) => {
                tracing::warn!(error = %msg, "a change was not stored");
                tonic::Status::unavailable(msg)
            }
            CoordError::Internal(_) => {
                tracing::error!(error = %msg, "a change failed");
                tonic::Status::internal(msg)
            }
            CoordError::Persist(_) => {
                tracing::error!(error = %msg, "persisting state failed");
                tonic::Status::internal(msg)
            }
        }
    }
}
