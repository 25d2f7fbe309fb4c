//! The coordinator's errors, and their one conversion to `tonic::Status`.

use pagewire_proto::v1::NodeState;

use crate::persist::PersistError;

/// Why a coordinator operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoordError {
    #[error("{0}")]
    InvalidArgument(String),
    /// A feature the API names that the nodes do not implement.
    #[error("{0}")]
    Unimplemented(String),
    #[error("unknown node {0:?}")]
    UnknownNode(String),
    #[error("stale incarnation for node {node_id:?}: it registered again since; register anew")]
    StaleIncarnation { node_id: String },
    #[error("node {node_id:?} is {state}")]
    NotAlive {
        node_id: String,
        state: &'static str,
    },
    #[error("node reports a {node} byte backing file but the cluster's is {cluster} bytes")]
    FileSizeMismatch { cluster: u64, node: u64 },
    #[error("node uses {node} byte pages but the cluster uses {cluster} byte pages")]
    PageSizeMismatch { cluster: u32, node: u32 },
    #[error("the cluster has no file size yet: no node has registered")]
    NoFile,
    #[error("cannot save the coordinator state: {0}")]
    Persist(#[from] PersistError),
}

/// Human name of a node state, as `pwctl` shows it.
pub fn state_name(state: NodeState) -> &'static str {
    match state {
        NodeState::Unspecified => "unknown",
        NodeState::Alive => "alive",
        NodeState::Draining => "draining",
        NodeState::Drained => "drained",
        NodeState::Dead => "dead",
        NodeState::Left => "left",
    }
}

impl From<CoordError> for tonic::Status {
    fn from(e: CoordError) -> Self {
        let msg = e.to_string();
        match e {
            CoordError::InvalidArgument(_)
            | CoordError::FileSizeMismatch { .. }
            | CoordError::PageSizeMismatch { .. } => tonic::Status::invalid_argument(msg),
            CoordError::Unimplemented(_) => tonic::Status::unimplemented(msg),
            CoordError::UnknownNode(_) => tonic::Status::not_found(msg),
            CoordError::StaleIncarnation { .. } | CoordError::NotAlive { .. } => {
                tonic::Status::failed_precondition(msg)
            }
            CoordError::NoFile => tonic::Status::failed_precondition(msg),
            CoordError::Persist(_) => {
                tracing::error!(error = %msg, "persisting state failed");
                tonic::Status::internal(msg)
            }
        }
    }
}
