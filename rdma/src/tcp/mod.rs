//! `tcp`: a software NIC for clusters without RDMA.
//!
//! The owner runs a [`TcpOwner`]: it registers regions and serves READ
//! requests straight from them — checked against the rkey, the epoch and the
//! region's bounds, never calling into a page cache. A region is either an
//! anonymous mapping the owner allocates ([`TcpOwner::register`]) or
//! memory the caller already has ([`TcpOwner::register_external`], e.g.
//! the node's whole page-cache region), served in place, without a copy
//! beyond the one into the socket. Every region of an owner carries its
//! epoch: [`OwnerConfig::epoch`] (the node's incarnation), or a random
//! one. A bad request gets an error reply, never a byte outside the
//! region, and the connection carries on. A reader opens a [`TcpConnection`],
//! which pipelines many outstanding requests and writes a whole batch with
//! one `send`; the owner answers everything one `recv` brought in with
//! one `send`. Besides READs, a connection carries CALLs: an argument
//! the owner's process hands to a handler it installed, whose reply comes
//! back on the same connection ([`TcpConnection::call`],
//! [`TcpOwner::set_call_handler`]); the node daemon answers page faults
//! there, so a miss costs one round trip of this transport instead of a
//! gRPC call. Each connection starts with a mutual handshake over a shared
//! cluster token (HMAC-SHA256 challenge-response, see `wire.rs`).
//!
//! The files: `wire.rs` (the byte layout of the handshake, requests and
//! responses, and their encoders), `owner.rs` (the [`TcpOwner`]: regions, the
//! accept thread, one serving thread per connection), `conn.rs` (the
//! reader's [`TcpConnection`]: request slots, the receive buffer, timeouts).
//!
//! # Adaptive polling
//!
//! A serving thread that answered, and a reader that waits for answers,
//! first poll their socket without blocking for up to
//! [`OwnerConfig::spin`] / [`ConnectionConfig::spin`] (50 µs by
//! default), then block: a loopback round trip costs about 7 µs when both
//! sides spin and 60–70 µs when each answer has to wake a sleeping thread
//! on an idle core. At most `available_parallelism() - 1` serving threads,
//! and as many waiting readers, spin at once in a process, and none while
//! more than that many share the role; the others block at once, so many
//! clients on few cores do not burn them. Each waiter's
//! window adapts: it shrinks to nothing when its traffic is too sparse for a
//! spin to catch, and a waiter preempted while spinning (cores
//! oversubscribed) stops spinning for a while (see `spin.rs`). A spin of
//! zero blocks at once.

mod conn;
mod owner;
mod wire;

use std::io::{self, Read, Write};
use std::time::Duration;

use crate::{ConnectError, handshake};

/// How this process's readers and responders polled: `(reader, responder)`.
pub use crate::spin::{SpinStats, stats as spin_stats};
pub use conn::{ConnectionConfig, TcpConnection};
pub use owner::{CallHandler, OwnerConfig, TcpOwner, TcpRegion};
pub use wire::{MAX_CALL_ARG, REQUEST_LEN, RESPONSE_HEADER_LEN};

use wire::MAGIC;

/// How long a client waits for the handshake and the owner for a hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default of [`OwnerConfig::spin`] and [`ConnectionConfig::spin`].
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// The client side of this transport's handshake over any stream (the
/// decoder of the owner's challenge), for the fuzz targets and tests
/// that stand in for one end of a connection.
#[doc(hidden)]
pub fn handshake_client<S: Read + Write>(s: &mut S, token: &[u8]) -> Result<(), ConnectError> {
    handshake::client(s, MAGIC, token)
}

/// The owner's side of this transport's handshake over any stream (the
/// decoder of a client's hello and answer); `Ok(true)` when the client
/// proved it holds `token`.
#[doc(hidden)]
pub fn handshake_server<S: Read + Write>(s: &mut S, token: &[u8]) -> io::Result<bool> {
    handshake::server(s, MAGIC, token)
}
