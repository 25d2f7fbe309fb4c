//! Awaiting completions from tokio tasks.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::{Completion, Connection, PostError, ReadRequest};

/// Upper bound of one sleep while waiting, so operation timeouts are noticed
/// even when the descriptor never becomes readable.
const QUANTUM: Duration = Duration::from_millis(10);

struct Fd(RawFd);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// A [`Connection`] whose completions can be awaited from a tokio task.
///
/// Backends with a readiness descriptor (`tcp`) are woken by the reactor;
/// the others (`shm`, whose READs complete at post time) are polled.
pub struct AsyncConnection<C: Connection> {
    // Declared before `conn`: deregistered from the reactor before the
    // connection closes the descriptor.
    fd: Option<AsyncFd<Fd>>,
    conn: C,
}

impl<C: Connection> AsyncConnection<C> {
    /// Wraps `conn`. Must run inside a tokio runtime with I/O enabled.
    ///
    /// # Errors
    /// The descriptor could not be registered with the reactor.
    pub fn new(conn: C) -> io::Result<Self> {
        let fd = match conn.readiness_fd() {
            Some(raw) => {
                // SAFETY: the `Connection` contract: the descriptor stays open
                // and the same for the connection's lifetime; `conn` lives in
                // this struct after `fd`, so it is dropped (closing the
                // descriptor) only after the registration is dropped.
                let fd = unsafe { AsyncFd::register_with_interest(Fd(raw), Interest::READABLE) }?;
                Some(fd)
            }
            None => None,
        };
        Ok(Self { fd, conn })
    }

    /// Posts a batch, as [`Connection::post_reads`].
    ///
    /// # Errors
    /// As [`Connection::post_reads`].
    ///
    /// # Safety
    /// As [`Connection::post_reads`]: every local buffer stays valid and
    /// exclusively the connection's until its completion has been returned by
    /// [`AsyncConnection::completions`] (or the connection dropped). Dropping
    /// a `completions` future early does not end that.
    pub unsafe fn post_reads(&mut self, reads: &[ReadRequest]) -> Result<(), PostError> {
        // SAFETY: the same contract, forwarded.
        unsafe { self.conn.post_reads(reads) }
    }

    /// Waits until at least one completion is available and appends them all
    /// to `out`; returns how many. Returns 0 at once when nothing is
    /// outstanding.
    pub async fn completions(&mut self, out: &mut Vec<Completion>) -> usize {
        loop {
            let n = self.conn.poll(out);
            if n > 0 || self.conn.outstanding() == 0 {
                return n;
            }
            match &self.fd {
                None => tokio::task::yield_now().await,
                Some(fd) => {
                    self.conn.arm();
                    let n = self.conn.poll(out);
                    if n > 0 {
                        return n;
                    }
                    if let Ok(Ok(mut guard)) = tokio::time::timeout(QUANTUM, fd.readable()).await {
                        let n = self.conn.poll(out);
                        if n > 0 {
                            return n;
                        }
                        guard.clear_ready();
                    }
                }
            }
        }
    }

    /// The wrapped connection.
    pub fn get_mut(&mut self) -> &mut C {
        &mut self.conn
    }
}
