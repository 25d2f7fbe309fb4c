//! pagewire-proto: the wire contract of pagewire.
//!
//! The gRPC services of the coordinator and of the nodes (package
//! `pagewire.v1`, in `proto/pagewire/v1/*.proto`, usable from any language),
//! the Rust code tonic/prost generate from them, and the plumbing every
//! pagewire endpoint shares: the cluster token carried on every call
//! ([`auth`]), TLS-aware channels ([`net`]), finding the leading coordinator and failing
//! over between several ([`leader`]), the cache policies by name and which
//! of them the nodes implement ([`policy`]), node states by name
//! ([`state_name`]), the plain-HTTP Prometheus endpoint
//! (`metrics_http`, feature `server`), and the ownership map's shared code: weighted
//! rendezvous hashing ([`rendezvous`]) and compact maps ([`map`]), and the
//! encoding of a page fault sent as a transport CALL ([`call`]).
//!
//! Feature `server` adds the server side (the generated servers, server
//! TLS, `metrics_http`); clients build without it, and without axum.
//!
//! This crate depends on nothing of ours: the node, the coordinator, `pwctl`
//! and the bench all build on it, never the other way round.

pub mod auth;
pub mod call;
pub mod lazy;
pub mod leader;
pub mod map;
#[cfg(feature = "server")]
pub mod metrics_http;
pub mod net;
pub mod policy;
pub mod rendezvous;

/// Human name of a node state, as `pwctl`, the coordinator's messages and
/// its metrics' `state` label show it.
pub fn state_name(state: v1::NodeState) -> &'static str {
    use v1::NodeState;
    match state {
        NodeState::Unspecified => "unknown",
        NodeState::Alive => "alive",
        NodeState::Draining => "draining",
        NodeState::Drained => "drained",
        NodeState::Dead => "dead",
        NodeState::Left => "left",
    }
}

/// Generated code of package `pagewire.v1`.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("pagewire.v1");
}
