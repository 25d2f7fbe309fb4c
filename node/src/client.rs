//! Clients of the cluster outside the node daemon.
//!
//! * `owner`: connections to one owner's region and the gRPC fault-in on
//!   the owner, shared by the node daemon (`daemon::remote_source`).

pub(crate) mod owner;

pub use owner::TransportChoice;
