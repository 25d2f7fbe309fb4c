//! `verbs`: RDMA READ over ibverbs RC queue pairs (RoCE, soft-RoCE,
//! InfiniBand), through `sideway`.
//!
//! The owner runs a [`VerbsOwner`]: it registers regions with
//! `IBV_ACCESS_REMOTE_READ` only (never remote write or atomics) — an
//! anonymous mapping it allocates ([`VerbsOwner::register`]) or memory the
//! caller already has ([`VerbsOwner::register_external`], e.g. the node's
//! whole page-cache region, read by the NIC in place) — and accepts
//! readers on a TCP socket, where each reader proves the cluster token (the
//! same handshake as `tcp`) and the two sides exchange queue-pair endpoints.
//! After that the owner's CPU takes no part in a READ: the reader's NIC reads
//! the owner's memory. The TCP socket stays open as the connection's control
//! channel: it carries queue-pair re-establishment and tells either side when
//! the other goes away.
//!
//! A [`VerbsConnection`] posts a batch of READs as one chain of work requests
//! (one `ibv_post_send`, one doorbell). READs land in a bounce buffer the
//! connection registered itself and are copied into the caller's buffer when
//! their completion is polled: the caller's memory never needs registering,
//! and since the NIC only ever writes the bounce buffer, a READ can be
//! completed with [`ReadError::Timeout`] or [`ReadError::ConnectionLost`]
//! at any time without the NIC writing the caller's buffer afterwards.
//!
//! Errors: a READ outside its descriptor is refused locally
//! ([`AccessFault::OutOfBounds`]) and a descriptor of another owner
//! incarnation too ([`AccessFault::StaleEpoch`]), so they never reach the
//! wire. A wrong rkey is refused by the remote NIC
//! ([`AccessFault::Device`]); in RC that moves the queue pair to the error
//! state, so the connection re-establishes a fresh queue pair over the
//! control channel and re-posts the READs that were flushed: the connection
//! survives, as on the other backends. A peer that goes away (control channel
//! closed, or the transport retry count exceeded) completes every pending
//! READ with [`ReadError::ConnectionLost`].
//!
//! # Endpoint exchange (after the handshake, magic `PWVRB\0\0\x01`)
//!
//! ```text
//! reader -> owner  qpn u32 | psn u32 | lid u16 | 0 u16 | gid[16]            (28 bytes)
//! owner -> reader  qpn u32 | psn u32 | lid u16 | 0 u16 | gid[16] | epoch u64 (36 bytes)
//! ```
//!
//! Repeated whenever the reader re-establishes; the owner then replaces its
//! queue pair for that reader. Integers are little-endian. `epoch` is the
//! owner's, carried by every descriptor of its regions:
//! [`VerbsConfig::epoch`] (the node's incarnation) or a random one.
//!
//! Waiting spins on the completion queue briefly, then arms the CQ's
//! completion channel and sleeps on its descriptor, which is also the
//! connection's [`Connection::readiness_fd`] (so tokio tasks are woken by the
//! reactor). sideway has no call to arm a CQ or read its events, so those
//! three calls (`ibv_req_notify_cq`, `ibv_get_cq_event`, `ibv_ack_cq_events`)
//! go through `rdma-mummy-sys`, the verbs layer sideway itself is built on,
//! rather than `rdma-sys`, which would link a second copy of libibverbs.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use std::ptr::NonNull;

use memmap2::MmapMut;
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid, GidType};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue, GenericCompletionQueue,
    PollCompletionQueueError, WorkCompletionStatus,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};

use crate::memory::{Memory, MemoryOwner, choose_epoch};
use crate::{
    AccessFault, Completion, ConnectError, Connection, Limits, LocalRegion, OwnerError, PostError,
    ReadError, ReadRequest, RegionDescriptor, RegisterError, handshake,
};

const MAGIC: &[u8; 8] = b"PWVRB\0\0\x01";
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a waiting reader looks at the control channel.
const CONTROL_CHECK: Duration = Duration::from_millis(10);

/// Environment variable naming the RDMA device to use (e.g. `rxe0`); the
/// first device when unset.
pub const DEVICE_ENV: &str = "PAGEWIRE_RDMA_DEVICE";

/// Settings of a [`VerbsOwner`] or a [`VerbsConnection`].
#[derive(Debug, Clone)]
pub struct VerbsConfig {
    /// RDMA device name; `None` for the first one.
    pub device: Option<String>,
    /// Port number on the device, from 1.
    pub port: u8,
    /// GID index; `None` picks a RoCE v2 IPv4-mapped GID, or the first usable.
    pub gid_index: Option<u8>,
    /// Cluster token, proven by both sides on the control channel.
    pub token: Vec<u8>,
    /// READs in flight per connection, at most.
    pub max_outstanding: usize,
    /// Bytes of one READ, at most (the bounce buffer holds
    /// `max_outstanding * max_read_len` bytes).
    pub max_read_len: usize,
    /// Local ACK timeout exponent: 4.096 µs * 2^n per try.
    pub ack_timeout: u8,
    /// Transport retries before a READ fails with `ConnectionLost`.
    pub retry_count: u8,
    /// A READ not completed within this long completes with `Timeout`.
    pub op_timeout: Duration,
    /// Owner only: the epoch every descriptor carries (the node's
    /// incarnation); `None` picks a random one. Zero is reserved
    /// ([`OwnerError::ZeroEpoch`]). Connections ignore it.
    pub epoch: Option<u64>,
}

impl VerbsConfig {
    /// Defaults: device from [`DEVICE_ENV`], port 1, 128 READs of up to 64 KiB
    /// in flight, ~67 ms ACK timeout with 3 retries, 5 s operation timeout.
    #[must_use]
    pub fn new(token: impl Into<Vec<u8>>) -> Self {
        Self {
            device: std::env::var(DEVICE_ENV).ok().filter(|d| !d.is_empty()),
            port: 1,
            gid_index: None,
            token: token.into(),
            max_outstanding: 128,
            max_read_len: 64 << 10,
            ack_timeout: 14,
            retry_count: 3,
            op_timeout: Duration::from_secs(5),
            epoch: None,
        }
    }
}

/// An opened device: context, protection domain and the port's addressing.
struct Nic {
    pd: Arc<ProtectionDomain>,
    ctx: Arc<DeviceContext>,
    port: u8,
    gid: Gid,
    gid_index: u8,
    lid: u16,
    mtu: Mtu,
    rd_atom: u8,
}

fn dev_err(what: &str, e: impl std::fmt::Display) -> String {
    format!("{what}: {e}")
}

fn open_nic(cfg: &VerbsConfig) -> Result<Nic, String> {
    let list = DeviceList::new().map_err(|e| dev_err("listing RDMA devices", e))?;
    let dev = match &cfg.device {
        Some(name) => list
            .iter()
            .find(|d| d.name() == *name)
            .ok_or_else(|| format!("no RDMA device named {name:?}"))?,
        None => list
            .iter()
            .next()
            .ok_or_else(|| "no RDMA device on this machine".to_owned())?,
    };
    let ctx = dev.open().map_err(|e| dev_err("opening the device", e))?;
    let pd = ctx
        .alloc_pd()
        .map_err(|e| dev_err("allocating a protection domain", e))?;
    let port_attr = ctx
        .query_port(cfg.port)
        .map_err(|e| dev_err("querying the port", e))?;
    let dev_attr = ctx
        .query_device()
        .map_err(|e| dev_err("querying the device", e))?;
    let gid_index = match cfg.gid_index {
        Some(i) => i,
        None => {
            let table = ctx
                .query_gid_table()
                .map_err(|e| dev_err("reading the GID table", e))?;
            let ours =
                |e: &&sideway::ibverbs::address::GidEntry| e.port_num() == u32::from(cfg.port);
            let v4 = table.iter().filter(ours).find(|e| {
                e.gid_type() == GidType::RoceV2
                    && Ipv6Addr::from(e.gid()).to_ipv4_mapped().is_some()
            });
            let any = table
                .iter()
                .filter(ours)
                .find(|e| !e.gid().is_unicast_link_local());
            let e = v4
                .or(any)
                .or_else(|| table.iter().find(ours))
                .ok_or("no GID on this port (no IP address?)")?;
            u8::try_from(e.gid_index()).map_err(|_| "GID index above 255".to_owned())?
        }
    };
    let gid = ctx
        .query_gid(cfg.port, u32::from(gid_index))
        .map_err(|e| dev_err("querying the GID", e))?;
    let rd_atom = dev_attr.max_qp_rd_atom().clamp(1, 16) as u8;
    Ok(Nic {
        pd,
        port: cfg.port,
        gid,
        gid_index,
        lid: port_attr.lid(),
        mtu: port_attr.active_mtu(),
        rd_atom,
        ctx,
    })
}

#[derive(Debug, Clone, Copy)]
struct Endpoint {
    qpn: u32,
    psn: u32,
    lid: u16,
    gid: [u8; 16],
}

impl Endpoint {
    const LEN: usize = 28;

    fn to_bytes(self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..10].copy_from_slice(&self.lid.to_le_bytes());
        b[12..28].copy_from_slice(&self.gid);
        b
    }

    fn from_bytes(b: &[u8]) -> Self {
        Self {
            qpn: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")),
            psn: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            lid: u16::from_le_bytes(b[8..10].try_into().expect("2 bytes")),
            gid: b[12..28].try_into().expect("16 bytes"),
        }
    }
}

/// A new RC queue pair in RESET, its endpoint, and its PSN.
fn create_qp(
    nic: &Nic,
    cq: &Arc<BasicCompletionQueue>,
    max_wr: u32,
) -> Result<(BasicQueuePair, Endpoint), String> {
    let mut b = nic.pd.create_qp_builder();
    b.setup_max_send_wr(max_wr)
        .setup_max_recv_wr(1)
        .setup_max_send_sge(1)
        .setup_max_recv_sge(1)
        .setup_max_inline_data(0)
        .setup_send_cq(GenericCompletionQueue::from(Arc::clone(cq)))
        .setup_recv_cq(GenericCompletionQueue::from(Arc::clone(cq)));
    let qp = b.build().map_err(|e| dev_err("creating a queue pair", e))?;
    let ep = Endpoint {
        qpn: qp.qp_number(),
        psn: fastrand::u32(..) & 0x00ff_ffff,
        lid: nic.lid,
        gid: Ipv6Addr::from(nic.gid).octets(),
    };
    Ok((qp, ep))
}

/// Moves `qp` through INIT, RTR and RTS towards `remote`.
fn connect_qp(
    qp: &mut BasicQueuePair,
    nic: &Nic,
    local: Endpoint,
    remote: Endpoint,
    cfg: &VerbsConfig,
    remote_read: bool,
) -> Result<(), String> {
    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::Init)
        .setup_pkey_index(0)
        .setup_port(nic.port)
        .setup_access_flags(if remote_read {
            AccessFlags::RemoteRead
        } else {
            AccessFlags::none()
        });
    qp.modify(&a)
        .map_err(|e| dev_err("queue pair to INIT", e))?;

    let mut av = AddressHandleAttribute::new();
    av.setup_dest_lid(remote.lid)
        .setup_port(nic.port)
        .setup_service_level(0)
        .setup_grh_src_gid_index(nic.gid_index)
        .setup_grh_dest_gid(&Gid::from(Ipv6Addr::from(remote.gid)))
        .setup_grh_hop_limit(64);
    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::ReadyToReceive)
        .setup_path_mtu(nic.mtu)
        .setup_dest_qp_num(remote.qpn)
        .setup_rq_psn(remote.psn)
        .setup_max_dest_read_atomic(nic.rd_atom)
        .setup_min_rnr_timer(12)
        .setup_address_vector(&av);
    qp.modify(&a).map_err(|e| dev_err("queue pair to RTR", e))?;

    let mut a = QueuePairAttribute::new();
    a.setup_state(QueuePairState::ReadyToSend)
        .setup_sq_psn(local.psn)
        .setup_timeout(cfg.ack_timeout)
        .setup_retry_cnt(cfg.retry_count.min(7))
        .setup_rnr_retry(7)
        .setup_max_read_atomic(nic.rd_atom);
    qp.modify(&a).map_err(|e| dev_err("queue pair to RTS", e))?;
    Ok(())
}

struct OwnerShared {
    nic: Nic,
    config: VerbsConfig,
    epoch: u64,
    closed: AtomicBool,
    next_conn: AtomicU64,
    conns: Mutex<HashMap<u64, TcpStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// The owner's side of `verbs`: registers regions for remote READ and
/// accepts readers.
pub struct VerbsOwner {
    shared: Arc<OwnerShared>,
    listener: TcpListener,
    addr: SocketAddr,
}

impl VerbsOwner {
    /// Opens the device and listens for readers on `addr` (port 0: any).
    ///
    /// # Errors
    /// [`OwnerError::ZeroEpoch`] when the config asks for epoch 0,
    /// [`OwnerError::Device`] without a usable RDMA device,
    /// [`OwnerError::Io`] when the socket could not be bound.
    pub fn bind(addr: impl ToSocketAddrs, config: VerbsConfig) -> Result<Self, OwnerError> {
        let epoch = choose_epoch(config.epoch)?;
        let nic = open_nic(&config).map_err(OwnerError::Device)?;
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(OwnerShared {
            nic,
            config,
            epoch,
            closed: AtomicBool::new(false),
            next_conn: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
        });
        let l = listener.try_clone()?;
        let s = Arc::clone(&shared);
        let t = std::thread::Builder::new()
            .name("pw-verbs-accept".into())
            .spawn(move || owner_accept(&l, &s))?;
        shared.threads.lock().expect("threads lock").push(t);
        Ok(Self {
            shared,
            listener,
            addr,
        })
    }

    /// The control address readers connect to.
    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The epoch every descriptor of this owner carries.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.shared.epoch
    }

    /// Allocates `len` zeroed bytes and registers them for remote READ only.
    ///
    /// # Errors
    /// Zero length, a failed mapping, a device refusal, or a closed owner.
    pub fn register(&self, len: usize) -> Result<VerbsRegion, RegisterError> {
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(RegisterError::Closed);
        }
        self.register_memory(Memory::anon(len)?)
    }

    /// Registers `len` bytes the caller already has at `ptr` for remote READ
    /// only (`ibv_reg_mr` with `IBV_ACCESS_REMOTE_READ`, in place, no copy).
    /// The region keeps `owner` alive until it is dropped; the drop
    /// deregisters the memory region first (`ibv_dereg_mr`: the NIC no
    /// longer reads the memory, and READs with its rkey fail), then releases
    /// `owner`. A READ in flight at that moment may complete with
    /// [`ReadError::ConnectionLost`] rather than a remote access error (seen
    /// once under soft-RoCE): the reader reconnects.
    ///
    /// # Safety
    /// * `ptr..ptr + len` is valid for reads and writes for as long as
    ///   `owner` is alive (it stays mapped; no `munmap`, `mremap` or
    ///   `MAP_FIXED` over it: the NIC keeps the registered physical pages).
    /// * While the returned region lives, every write to that memory is
    ///   atomic (e.g. `AtomicU64` stores, [`LocalRegion::write_bytes`]),
    ///   volatile, or made by the kernel or a device, and nobody holds a
    ///   `&mut` to any of it: the NIC reads it at any time.
    ///
    /// # Errors
    /// Zero length, a range that wraps the address space, a device refusal,
    /// or a closed owner.
    pub unsafe fn register_external(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        owner: MemoryOwner,
    ) -> Result<VerbsRegion, RegisterError> {
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(RegisterError::Closed);
        }
        // SAFETY: forwarded from this function's contract.
        let mem = unsafe { Memory::external(ptr, len, owner) }?;
        self.register_memory(mem)
    }

    fn register_memory(&self, mem: Memory) -> Result<VerbsRegion, RegisterError> {
        // SAFETY: `mem` is `mem.len()` bytes that stay valid while `mem`
        // lives (our mapping, or the caller's under `register_external`'s
        // contract); the returned region keeps `mem` until after the memory
        // region is deregistered (field order in `VerbsRegion`). Remote READ
        // only: the NIC never writes it.
        let mr = unsafe {
            self.shared
                .nic
                .pd
                .reg_mr(mem.addr() as usize, mem.len(), AccessFlags::RemoteRead)
        }
        .map_err(|e| RegisterError::Device(dev_err("registering memory", e)))?;
        Ok(VerbsRegion {
            mr,
            mem,
            epoch: self.shared.epoch,
        })
    }

    /// Closes the listener and every reader's queue pair and control channel.
    pub fn shutdown(&self) {
        if self.shared.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // SAFETY: `shutdown(2)` on a socket we own; wakes the accept thread.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        for s in self.shared.conns.lock().expect("conns lock").values() {
            let _ = s.shutdown(Shutdown::Both);
        }
        let threads = std::mem::take(&mut *self.shared.threads.lock().expect("threads lock"));
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for VerbsOwner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Memory registered for remote READ with a [`VerbsOwner`]; deregistered on
/// drop, before its memory (or, for external memory, its owner guard) goes.
pub struct VerbsRegion {
    // Declared before `mem`: deregistered before the memory is released.
    mr: Arc<MemoryRegion>,
    mem: Memory,
    epoch: u64,
}

impl LocalRegion for VerbsRegion {
    fn descriptor(&self) -> RegionDescriptor {
        RegionDescriptor {
            addr: self.mem.addr(),
            len: self.mem.len() as u64,
            rkey: self.mr.rkey(),
            epoch: self.epoch,
        }
    }

    fn as_ptr(&self) -> *mut u8 {
        self.mem.ptr()
    }

    fn len(&self) -> usize {
        self.mem.len()
    }
}

fn owner_accept(listener: &TcpListener, shared: &Arc<OwnerShared>) {
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                if shared.closed.load(Ordering::Acquire) {
                    return;
                }
                tracing::warn!(error = %e, "verbs owner: accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if shared.closed.load(Ordering::Acquire) {
            return;
        }
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        shared.conns.lock().expect("conns lock").insert(id, clone);
        let s = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name("pw-verbs-peer".into())
            .spawn(move || {
                if let Err(e) = owner_serve(stream, &s) {
                    tracing::debug!(error = %e, "verbs owner: reader ended");
                }
                s.conns.lock().expect("conns lock").remove(&id);
            });
        let mut threads = shared.threads.lock().expect("threads lock");
        threads.retain(|t| !t.is_finished());
        if let Ok(t) = spawned {
            threads.push(t);
        } else {
            shared.conns.lock().expect("conns lock").remove(&id);
        }
    }
}

/// One reader: handshake, then a queue pair per endpoint message, until the
/// control channel closes (which destroys the queue pair).
fn owner_serve(mut stream: TcpStream, shared: &OwnerShared) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    if !handshake::server(&mut stream, MAGIC, &shared.config.token)? {
        tracing::warn!("verbs owner: refused a reader without the cluster token");
        return Ok(());
    }
    stream.set_read_timeout(None)?;
    let cq = shared
        .nic
        .ctx
        .create_cq_builder()
        .setup_cqe(4)
        .build()
        .map_err(io::Error::other)?;
    let mut _qp: Option<BasicQueuePair> = None;
    loop {
        let mut msg = [0u8; Endpoint::LEN];
        if let Err(e) = stream.read_exact(&mut msg) {
            return if e.kind() == io::ErrorKind::UnexpectedEof {
                Ok(())
            } else {
                Err(e)
            };
        }
        let remote = Endpoint::from_bytes(&msg);
        _qp = None;
        let (mut qp, local) = create_qp(&shared.nic, &cq, 4).map_err(io::Error::other)?;
        connect_qp(&mut qp, &shared.nic, local, remote, &shared.config, true)
            .map_err(io::Error::other)?;
        _qp = Some(qp);
        let mut reply = [0u8; Endpoint::LEN + 8];
        reply[..Endpoint::LEN].copy_from_slice(&local.to_bytes());
        reply[Endpoint::LEN..].copy_from_slice(&shared.epoch.to_le_bytes());
        stream.write_all(&reply)?;
    }
}

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

/// A reader's connection to a [`VerbsOwner`].
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
    /// Connects to a [`VerbsOwner`] at its control address.
    ///
    /// # Errors
    /// No usable device, a refused handshake, or a queue pair that would not
    /// come up.
    pub fn connect(addr: impl ToSocketAddrs, config: VerbsConfig) -> Result<Self, ConnectError> {
        let nic = open_nic(&config).map_err(ConnectError::Device)?;
        let mut ctrl = TcpStream::connect(addr)?;
        ctrl.set_nodelay(true)?;
        ctrl.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        ctrl.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
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
                    self.qp_error = true;
                }
                continue;
            }
            match status {
                WorkCompletionStatus::Success => self.finish(idx, Ok(())),
                WorkCompletionStatus::WorkRequestFlushedError => {
                    // Innocent: re-posted once the queue pair is back.
                    self.qp_error = true;
                    if let Slot::Pending { posted, .. } = &mut self.slots[idx] {
                        *posted = false;
                    }
                }
                WorkCompletionStatus::RemoteAccessError
                | WorkCompletionStatus::RemoteInvalidRequestError
                | WorkCompletionStatus::RemoteOperationError => {
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
