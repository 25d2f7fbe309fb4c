//! The connection contract every backend implements.

use std::os::fd::RawFd;
use std::time::Duration;

use crate::{PostError, ReadError, RegionDescriptor};

/// One READ: `len` bytes at remote address `remote_addr` (inside the region
/// `region`) into the local bytes at `local`.
#[derive(Debug, Clone, Copy)]
pub struct ReadRequest {
    /// Caller's id, echoed by the completion. Ids of outstanding requests on
    /// one connection need not be unique, but then the caller cannot tell
    /// their completions apart.
    pub id: u64,
    /// The region the READ targets (its rkey and epoch authorize it).
    pub region: RegionDescriptor,
    /// Absolute remote address of the first byte (`region.addr + offset`).
    pub remote_addr: u64,
    /// First local byte written.
    pub local: *mut u8,
    /// Number of bytes.
    pub len: usize,
}

// SAFETY: a request is plain data; its pointer is dereferenced only by a
// backend under the `post_reads` contract, which the poster upholds wherever
// the request value travelled.
unsafe impl Send for ReadRequest {}
// SAFETY: as for `Send`: shared references to the request expose only data.
unsafe impl Sync for ReadRequest {}

impl ReadRequest {
    /// A READ of `local.len()` bytes at `offset` in `region` into `local`.
    #[must_use]
    pub fn new(id: u64, region: RegionDescriptor, offset: u64, local: &mut [u8]) -> Self {
        Self {
            id,
            region,
            remote_addr: region.addr_at(offset),
            local: local.as_mut_ptr(),
            len: local.len(),
        }
    }
}

/// The completion of one posted request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The request's [`ReadRequest::id`].
    pub id: u64,
    /// `Ok` when all the bytes were written to the local buffer.
    pub result: Result<(), ReadError>,
}

/// What one connection accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Requests posted and not yet completed, at most.
    pub max_outstanding: usize,
    /// Bytes of one READ, at most.
    pub max_read_len: usize,
}

/// A connection to one peer, on which READs are posted and completed.
///
/// Single poster: every method takes `&mut self`. Move the connection into a
/// busy-polling thread, or wrap it in [`crate::AsyncConnection`] for tokio.
///
/// # Safety
/// Implementors guarantee that every accepted request completes exactly once
/// (through [`Connection::poll`] or [`Connection::wait`], possibly with an
/// error), that its local buffer is written only between the post and the
/// return of the call that hands out its completion, and never after. Safe
/// helpers such as [`read_blocking`] rely on this.
pub unsafe trait Connection: Send {
    /// Posts a batch of READs with one doorbell (one `send` for `tcp`, one
    /// `ibv_post_send` chain for `verbs`). Either the whole batch is accepted
    /// or none of it.
    ///
    /// # Errors
    /// [`PostError`] when the batch is refused; nothing was posted.
    ///
    /// # Safety
    /// For every request, `local..local + len` must be valid for writes, not
    /// accessed by anyone else, and stay so until the completion carrying its
    /// id has been returned by `poll` or `wait` (or the connection dropped).
    unsafe fn post_reads(&mut self, reads: &[ReadRequest]) -> Result<(), PostError>;

    /// Appends the completions available now to `out` without blocking;
    /// returns how many were appended.
    fn poll(&mut self, out: &mut Vec<Completion>) -> usize;

    /// Like [`Connection::poll`], but blocks up to `timeout` until at least
    /// one completion is available. Returns 0 on timeout or when nothing is
    /// outstanding.
    fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> usize;

    /// Requests posted and not yet completed.
    fn outstanding(&self) -> usize;

    /// This connection's limits.
    fn limits(&self) -> Limits;

    /// Whether the READs of one batch are performed in the order given, as
    /// a reader thread's own loads would be: every load of a READ is
    /// ordered before every load of the READs after it in the batch, as by
    /// an Acquire fence between them, and the memory read is the owner's
    /// own memory (coherent with its CPUs' stores). A reader that gets
    /// `true` may validate a frame by bracketing its copy with two READs of
    /// its generation (a seqlock; ARCHITECTURE.md, "Ordered readers")
    /// instead of by its checksum. `shm` says yes (the reader's thread
    /// copies, with a fence after each READ); `tcp` and `verbs` say no (a
    /// NIC, soft or real, promises no order between the words of READs).
    fn ordered_reads(&self) -> bool {
        false
    }

    /// A file descriptor that becomes readable when `poll` may make progress,
    /// for event loops; `None` when completions are ready as soon as posted
    /// (`shm`) or there is no such descriptor. The descriptor stays open and
    /// the same for the connection's whole lifetime.
    fn readiness_fd(&self) -> Option<RawFd> {
        None
    }

    /// Prepares the readiness descriptor before the caller sleeps on it:
    /// after `arm`, any completion that `poll` has not returned yet makes the
    /// descriptor readable (verbs arms its completion channel here). Callers
    /// poll once more after arming, then wait. A no-op by default.
    fn arm(&mut self) {}
}

/// Reads each `(offset, buffer)` of `region` and waits for all of them: the
/// safe, blocking way to READ.
///
/// Requests are posted in batches of at most the connection's
/// `max_outstanding`. Returns one result per entry, in order. Call it with
/// nothing else outstanding on `conn`: completions of other requests would be
/// consumed here.
///
/// # Errors
/// A [`PostError`] when a batch is refused (earlier entries may have been
/// read, and their results are lost).
pub fn read_blocking<C: Connection + ?Sized>(
    conn: &mut C,
    region: RegionDescriptor,
    reads: &mut [(u64, &mut [u8])],
) -> Result<Vec<Result<(), ReadError>>, PostError> {
    debug_assert_eq!(
        conn.outstanding(),
        0,
        "read_blocking needs an idle connection"
    );
    let mut results: Vec<Option<Result<(), ReadError>>> = vec![None; reads.len()];
    let chunk = conn.limits().max_outstanding.max(1);
    let mut done = Vec::new();
    for (chunk_no, part) in reads.chunks_mut(chunk).enumerate() {
        let base = chunk_no * chunk;
        let reqs: Vec<ReadRequest> = part
            .iter_mut()
            .enumerate()
            .map(|(i, (offset, buf))| ReadRequest::new((base + i) as u64, region, *offset, buf))
            .collect();
        // SAFETY: the buffers are exclusively borrowed through `reads` for this
        // whole call, and we return only after every request of the batch has
        // completed: by the trait's contract each accepted request completes
        // exactly once (the backend's operation timeout bounds the wait) and
        // its buffer is not touched afterwards.
        unsafe { conn.post_reads(&reqs)? };
        let mut pending = part.len();
        while pending > 0 {
            done.clear();
            conn.wait(&mut done, Duration::from_millis(100));
            for c in &done {
                if let Some(slot) = results.get_mut(c.id as usize)
                    && slot.is_none()
                {
                    *slot = Some(c.result.clone());
                    pending -= 1;
                }
            }
        }
    }
    Ok(results
        .into_iter()
        .map(|r| r.expect("every request completed"))
        .collect())
}
