//! The reader's side: a queue pair, a bounce buffer, a completion channel.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap2::MmapMut;
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue, PollCompletionQueueError,
    WorkCompletionStatus,
};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};

use crate::{
    AccessFault, Completion, ConnectError, Connection, Limits, PostError, ReadError, ReadRequest,
    handshake,
};

use super::nic::{Endpoint, Nic, connect_qp, create_qp, dev_err, open_nic};
use super::{MAGIC, VerbsConfig};

/// How often a waiting reader looks at the control channel.
const CONTROL_CHECK: Duration = Duration::from_millis(10);

enum Slot {
    Free,
    Pending {
        id: u64,
        local: *mut u8,
        len: usize,
        rkey: u32,
        raddr: u64,
        deadline: Instant,
        posted: bool,
    },
    /// Completed for the caller (timeout, loss); its work request is still
    /// with the NIC, so the bounce slot waits for its completion.
    Abandoned,
}

/// A reader's connection to a [`VerbsOwner`](super::VerbsOwner).
pub struct VerbsConnection {
    // Drop order: the queue pair first (no more DMA), then the CQ, the bounce
    // memory region, the bounce mapping, the device.
    qp: BasicQueuePair,
    cq: Arc<BasicCompletionQueue>,
    // After `cq`: a CQ is destroyed before its channel.
    channel: Arc<CompletionChannel>,
    bounce_mr: Arc<MemoryRegion>,
    bounce: MmapMut,
    nic: Nic,
    ctrl: TcpStream,
    config: VerbsConfig,
    owner_epoch: u64,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Work requests posted on the current queue pair and not yet completed.
    inflight: usize,
    outstanding: usize,
    qp_gen: u32,
    qp_error: bool,
    lost: bool,
    ready: Vec<Completion>,
    next_ctrl_check: Instant,
    next_expiry: Option<Instant>,
    /// The CQ is armed: its next completion raises a channel event.
    armed: bool,
}

// SAFETY: the raw pointers in `slots` are the caller's buffers of posted
// READs, handed to this connection exclusively by the `post_reads` contract
// and only dereferenced through `&mut self`; the ibverbs objects are
// thread-safe (and `Send` in sideway).
unsafe impl Send for VerbsConnection {}

impl VerbsConnection {
    /// Connects to a [`VerbsOwner`](super::VerbsOwner) at its control address.
    ///
    /// # Errors
    /// No usable device, a refused handshake, or a queue pair that would not
    /// come up.
    pub fn connect(addr: impl ToSocketAddrs, config: VerbsConfig) -> Result<Self, ConnectError> {
        let nic = open_nic(&config).map_err(ConnectError::Device)?;
        let limit = config.connect_timeout.max(Duration::from_millis(1));
        let mut ctrl = handshake::connect_stream(addr, limit)?;
        ctrl.set_nodelay(true)?;
        ctrl.set_read_timeout(Some(limit))?;
        ctrl.set_write_timeout(Some(limit))?;
        handshake::client(&mut ctrl, MAGIC, &config.token)?;
        let n = config.max_outstanding.clamp(1, 1 << 14);
        let slot_len = config.max_read_len.max(1);
        let bounce = MmapMut::map_anon(n * slot_len)?;
        // SAFETY: `bounce` is a live mapping that outlives the memory region
        // (field order); local write only, the NIC writes READ results there.
        let bounce_mr = unsafe {
            nic.pd.reg_mr(
                bounce.as_ptr() as usize,
                bounce.len(),
                AccessFlags::LocalWrite,
            )
        }
        .map_err(|e| ConnectError::Device(dev_err("registering the bounce buffer", e)))?;
        let channel = nic
            .ctx
            .create_comp_channel()
            .map_err(|e| ConnectError::Device(dev_err("creating a completion channel", e)))?;
        channel.set_nonblocking(true)?;
        let cq = nic
            .ctx
            .create_cq_builder()
            .setup_cqe(n as u32 * 2)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| ConnectError::Device(dev_err("creating a completion queue", e)))?;
        let (qp, owner_epoch) = Self::establish(&nic, &cq, &mut ctrl, &config, n as u32)?;
        Ok(Self {
            qp,
            cq,
            channel,
            armed: false,
            bounce_mr,
            bounce,
            nic,
            ctrl,
            owner_epoch,
            slots: (0..n).map(|_| Slot::Free).collect(),
            free: (0..n as u32).rev().collect(),
            inflight: 0,
            outstanding: 0,
            qp_gen: 0,
            qp_error: false,
            lost: false,
            ready: Vec::new(),
            next_ctrl_check: Instant::now() + CONTROL_CHECK,
            next_expiry: None,
            config,
        })
    }

    /// Creates a queue pair and connects it to a fresh one of the owner's.
    fn establish(
        nic: &Nic,
        cq: &Arc<BasicCompletionQueue>,
        ctrl: &mut TcpStream,
        config: &VerbsConfig,
        max_wr: u32,
    ) -> Result<(BasicQueuePair, u64), ConnectError> {
        let (mut qp, local) = create_qp(nic, cq, max_wr).map_err(ConnectError::Device)?;
        ctrl.write_all(&local.to_bytes())?;
        let mut reply = [0u8; Endpoint::LEN + 8];
        ctrl.read_exact(&mut reply)?;
        let remote = Endpoint::from_bytes(&reply[..Endpoint::LEN]);
        let epoch = u64::from_le_bytes(reply[Endpoint::LEN..].try_into().expect("8 bytes"));
        if remote.qpn == 0 {
            return Err(ConnectError::Refused(format!(
                "the owner already serves its most queue pairs ({}); \
                 raise its transports.verbs_max_queue_pairs or read over tcp",
                remote.psn
            )));
        }
        connect_qp(&mut qp, nic, local, remote, config, false).map_err(ConnectError::Device)?;
        Ok((qp, epoch))
    }

    fn slot_addr(&self, idx: u32) -> u64 {
        self.bounce.as_ptr() as u64 + u64::from(idx) * self.config.max_read_len.max(1) as u64
    }

    fn wr_id(&self, idx: u32) -> u64 {
        (u64::from(self.qp_gen) << 32) | u64::from(idx)
    }

    /// Posts the given slots' READs as one chain. On failure the slots stay
    /// unposted.
    fn post_slots(&mut self, idxs: &[u32]) -> Result<(), io::Error> {
        if idxs.is_empty() {
            return Ok(());
        }
        let lkey = self.bounce_mr.lkey();
        let wrs: Vec<(u64, u32, u64, u64, u32)> = idxs
            .iter()
            .filter_map(|&i| match self.slots[i as usize] {
                Slot::Pending {
                    rkey, raddr, len, ..
                } => Some((self.wr_id(i), rkey, raddr, self.slot_addr(i), len as u32)),
                _ => None,
            })
            .collect();
        let mut guard = self.qp.start_post_send();
        for &(wr_id, rkey, raddr, laddr, len) in &wrs {
            let h = guard
                .construct_wr(wr_id, WorkRequestFlags::Signaled)
                .setup_read(rkey, raddr);
            // SAFETY: `laddr..laddr + len` is this slot's part of the bounce
            // buffer, registered under `lkey` and alive as long as the queue
            // pair (field order); the slot is not reused before the work
            // request's completion is polled.
            unsafe { h.setup_sge(lkey, laddr, len) };
        }
        guard.post().map_err(io::Error::other)?;
        self.inflight += wrs.len();
        for &i in idxs {
            if let Slot::Pending { posted, .. } = &mut self.slots[i as usize] {
                *posted = true;
            }
        }
        Ok(())
    }

    fn lose(&mut self) {
        if self.lost {
            return;
        }
        self.lost = true;
        let _ = self.ctrl.shutdown(Shutdown::Both);
        // Flush whatever the NIC still holds; the flush completions free the
        // bounce slots.
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Error);
        let _ = self.qp.modify(&a);
        for i in 0..self.slots.len() {
            if let Slot::Pending { id, posted, .. } = self.slots[i] {
                self.ready.push(Completion {
                    id,
                    result: Err(ReadError::ConnectionLost),
                });
                if posted {
                    self.slots[i] = Slot::Abandoned;
                } else {
                    self.slots[i] = Slot::Free;
                    self.free.push(i as u32);
                }
            }
        }
        self.outstanding = 0;
    }

    fn finish(&mut self, idx: usize, result: Result<(), ReadError>) {
        if let Slot::Pending { id, local, len, .. } =
            std::mem::replace(&mut self.slots[idx], Slot::Free)
        {
            if result.is_ok() {
                // SAFETY: the bounce slot holds the READ's `len` bytes (its
                // work request completed successfully); `local..local + len`
                // is the caller's buffer, valid and exclusively ours until
                // this completion is handed out (the `post_reads` contract).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.slot_addr(idx as u32) as *const u8,
                        local,
                        len,
                    )
                };
            }
            self.outstanding -= 1;
            self.ready.push(Completion { id, result });
        }
        self.free.push(idx as u32);
    }

    fn poll_cq(&mut self) {
        let mut wcs: Vec<(u64, u32)> = Vec::new();
        match self.cq.start_poll() {
            Ok(poller) => wcs.extend(poller.map(|wc| (wc.wr_id(), wc.status()))),
            Err(PollCompletionQueueError::CompletionQueueEmpty) => {}
            Err(e) => {
                tracing::warn!(error = %e, "verbs connection: polling the CQ failed");
                self.lose();
                return;
            }
        }
        for (wr_id, status) in wcs {
            let idx = (wr_id & 0xffff_ffff) as usize;
            self.inflight = self.inflight.saturating_sub(1);
            let status = WorkCompletionStatus::from(status);
            if matches!(self.slots[idx], Slot::Abandoned) {
                self.slots[idx] = Slot::Free;
                self.free.push(idx as u32);
                if status != WorkCompletionStatus::Success {
                    tracing::debug!(
                        ?status,
                        "verbs connection: a READ already answered (timed out or lost) failed"
                    );
                    self.qp_error = true;
                }
                continue;
            }
            match status {
                WorkCompletionStatus::Success => self.finish(idx, Ok(())),
                WorkCompletionStatus::WorkRequestFlushedError => {
                    // Innocent: re-posted once the queue pair is back.
                    if !self.qp_error {
                        tracing::debug!("verbs connection: READs flushed");
                    }
                    self.qp_error = true;
                    if let Slot::Pending { posted, .. } = &mut self.slots[idx] {
                        *posted = false;
                    }
                }
                WorkCompletionStatus::RemoteAccessError
                | WorkCompletionStatus::RemoteInvalidRequestError
                | WorkCompletionStatus::RemoteOperationError => {
                    tracing::debug!(?status, "verbs connection: a READ was refused");
                    self.qp_error = true;
                    self.finish(idx, Err(ReadError::RemoteAccess(AccessFault::Device)));
                }
                other => {
                    tracing::debug!(status = ?other, "verbs connection: transport failure");
                    self.finish(idx, Err(ReadError::ConnectionLost));
                    self.lose();
                }
            }
        }
        if self.qp_error && self.inflight == 0 && !self.lost {
            self.reestablish();
        }
    }

    /// After an error moved the queue pair to ERR and every work request of
    /// it has completed: a fresh queue pair, then re-post the flushed READs.
    fn reestablish(&mut self) {
        let n = self.slots.len() as u32;
        match Self::establish(&self.nic, &self.cq, &mut self.ctrl, &self.config, n) {
            Ok((qp, epoch)) => {
                self.qp = qp;
                self.owner_epoch = epoch;
                self.qp_gen = self.qp_gen.wrapping_add(1);
                self.qp_error = false;
                let again: Vec<u32> = (0..n)
                    .filter(|&i| {
                        matches!(self.slots[i as usize], Slot::Pending { posted: false, .. })
                    })
                    .collect();
                tracing::debug!(
                    again = again.len(),
                    "verbs connection: a fresh queue pair; re-posting its flushed READs"
                );
                if let Err(e) = self.post_slots(&again) {
                    tracing::warn!(error = %e, "verbs connection: re-posting after re-establishment failed");
                    self.lose();
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "verbs connection: cannot re-establish the queue pair");
                self.lose();
            }
        }
    }

    /// Reads and acknowledges the channel's pending events, then arms the CQ
    /// (once per event: a CQ raises one event per arming).
    fn arm_cq(&mut self) {
        let mut events = 0u32;
        loop {
            let mut cq: *mut rdma_mummy_sys::ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is live (held by `self`) and non-blocking;
            // the out-pointers are valid locals.
            let r = unsafe {
                rdma_mummy_sys::ibv_get_cq_event(
                    self.channel.comp_channel().as_ptr(),
                    &mut cq,
                    &mut ctx,
                )
            };
            if r != 0 {
                break;
            }
            events += 1;
        }
        if events > 0 {
            // SAFETY: our live CQ; acknowledges exactly the events read above
            // (a CQ with unacknowledged events could not be destroyed).
            unsafe { rdma_mummy_sys::ibv_ack_cq_events(self.cq.cq().as_ptr(), events) };
            self.armed = false;
        }
        if !self.armed {
            // SAFETY: our live CQ; requests an event for the next completion.
            let r = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
            self.armed = r == 0;
        }
    }

    fn check_control(&mut self) {
        let now = Instant::now();
        if now < self.next_ctrl_check {
            return;
        }
        self.next_ctrl_check = now + CONTROL_CHECK;
        let mut b = [0u8; 1];
        // SAFETY: a one-byte peek into a local buffer on our socket.
        let r = unsafe {
            libc::recv(
                self.ctrl.as_raw_fd(),
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        let gone =
            r == 0 || (r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock);
        if gone && !self.lost {
            tracing::debug!("verbs connection: the owner closed the control channel");
            self.lose();
        }
        if let Some(e) = self.next_expiry
            && now >= e
        {
            let mut next = None;
            for i in 0..self.slots.len() {
                if let Slot::Pending {
                    id,
                    deadline,
                    posted,
                    ..
                } = self.slots[i]
                {
                    if deadline <= now {
                        tracing::debug!(
                            posted,
                            qp_error = self.qp_error,
                            inflight = self.inflight,
                            "verbs connection: a READ timed out"
                        );
                        self.ready.push(Completion {
                            id,
                            result: Err(ReadError::Timeout),
                        });
                        self.outstanding -= 1;
                        if posted {
                            self.slots[i] = Slot::Abandoned;
                        } else {
                            self.slots[i] = Slot::Free;
                            self.free.push(i as u32);
                        }
                    } else {
                        next = Some(next.map_or(deadline, |n: Instant| n.min(deadline)));
                    }
                }
            }
            self.next_expiry = next;
        }
    }
}

// SAFETY: every accepted READ occupies a slot until exactly one completion is
// queued for it (`finish` after its work request succeeded or failed, `lose`,
// or the operation timeout); the caller's buffer is written only in `finish`,
// from `poll`/`wait`, before that completion is handed out. The NIC only ever
// writes the bounce buffer, whose slot is reused only after the work
// request's own completion.
unsafe impl Connection for VerbsConnection {
    unsafe fn post_reads(&mut self, reads: &[ReadRequest]) -> Result<(), PostError> {
        if self.lost {
            return Err(PostError::ConnectionLost);
        }
        let limit = self.config.max_read_len.min(u32::MAX as usize);
        if let Some(r) = reads.iter().find(|r| r.len == 0 || r.len > limit) {
            return Err(PostError::InvalidLength { len: r.len, limit });
        }
        if reads.len() > self.free.len() {
            return Err(PostError::QueueFull {
                outstanding: self.outstanding,
                requested: reads.len(),
                limit: self.slots.len(),
            });
        }
        let deadline = Instant::now() + self.config.op_timeout;
        let mut idxs = Vec::with_capacity(reads.len());
        for r in reads {
            if r.region.epoch != self.owner_epoch {
                self.ready.push(Completion {
                    id: r.id,
                    result: Err(ReadError::RemoteAccess(AccessFault::StaleEpoch)),
                });
                continue;
            }
            if !r.region.contains(r.remote_addr, r.len as u64) {
                self.ready.push(Completion {
                    id: r.id,
                    result: Err(ReadError::RemoteAccess(AccessFault::OutOfBounds)),
                });
                continue;
            }
            let idx = self.free.pop().expect("checked above");
            self.slots[idx as usize] = Slot::Pending {
                id: r.id,
                local: r.local,
                len: r.len,
                rkey: r.region.rkey,
                raddr: r.remote_addr,
                deadline,
                posted: false,
            };
            self.outstanding += 1;
            idxs.push(idx);
        }
        if self.next_expiry.is_none() && !idxs.is_empty() {
            self.next_expiry = Some(deadline);
        }
        if self.qp_error {
            // Posted after re-establishment.
            return Ok(());
        }
        if let Err(e) = self.post_slots(&idxs) {
            for &i in &idxs {
                self.slots[i as usize] = Slot::Free;
                self.free.push(i);
                self.outstanding -= 1;
            }
            let n = idxs.len();
            self.ready
                .truncate(self.ready.len().saturating_sub(reads.len() - n));
            return Err(PostError::Device(e));
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        self.poll_cq();
        if self.outstanding > 0 {
            self.check_control();
        }
        let n = self.ready.len();
        out.append(&mut self.ready);
        n
    }

    fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> usize {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let n = self.poll(out);
            if n > 0 || self.outstanding == 0 || start.elapsed() >= timeout {
                return n;
            }
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
                continue;
            }
            // Sleep on the completion channel: arm, re-poll (a completion may
            // have landed before the arming), then wait for an event, at most
            // until the next control-channel check.
            self.arm_cq();
            let n = self.poll(out);
            if n > 0 {
                return n;
            }
            let left = timeout.saturating_sub(start.elapsed()).min(CONTROL_CHECK);
            let mut pfd = libc::pollfd {
                fd: self.channel.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the channel's descriptor.
            unsafe { libc::poll(&mut pfd, 1, left.as_millis().max(1) as libc::c_int) };
        }
    }

    fn outstanding(&self) -> usize {
        self.outstanding
    }

    fn limits(&self) -> Limits {
        Limits {
            max_outstanding: self.slots.len(),
            max_read_len: self.config.max_read_len,
        }
    }

    fn readiness_fd(&self) -> Option<RawFd> {
        Some(self.channel.as_raw_fd())
    }

    fn arm(&mut self) {
        self.arm_cq();
    }
}
