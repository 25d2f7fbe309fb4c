//! The owner's side: registered regions, and a queue pair per reader.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::BasicQueuePair;

use crate::memory::{Memory, MemoryOwner, choose_epoch};
use crate::{LocalRegion, OwnerError, RegionDescriptor, RegisterError, handshake};

use super::nic::{Endpoint, Nic, connect_qp, create_qp, dev_err, open_nic};
use super::{HANDSHAKE_TIMEOUT, MAGIC, VerbsConfig};

struct OwnerShared {
    nic: Nic,
    config: VerbsConfig,
    epoch: u64,
    closed: AtomicBool,
    next_conn: AtomicU64,
    /// Readers holding a queue pair now.
    queue_pairs: AtomicUsize,
    /// Readers refused at the cap.
    refused: AtomicU64,
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
            queue_pairs: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
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

    /// Readers holding a queue pair of this owner now.
    #[must_use]
    pub fn queue_pairs(&self) -> usize {
        self.shared.queue_pairs.load(Ordering::Relaxed)
    }

    /// Readers refused so far because [`VerbsConfig::max_queue_pairs`]
    /// were already served.
    #[must_use]
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
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
    /// [`ReadError::ConnectionLost`](crate::ReadError::ConnectionLost) rather than a remote access error (seen
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
        check_memlock(mem.len() as u64)?;
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

/// Whether this process may pin `need` more bytes: the soft
/// `RLIMIT_MEMLOCK` covers them (with what it already locked), or it holds
/// `CAP_IPC_LOCK` in its effective set (which the kernel's pinning checks
/// instead of the limit). Checked before `ibv_reg_mr`, whose own refusal
/// is a bare `ENOMEM` that names neither.
///
/// # Errors
/// [`RegisterError::MemlockLimit`] naming the limit and the size.
pub fn check_memlock(need: u64) -> Result<(), RegisterError> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes one `rlimit` into a valid local.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return Ok(()); // cannot tell: let the device decide
    }
    if lim.rlim_cur == libc::RLIM_INFINITY {
        return Ok(());
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
    };
    // CAP_IPC_LOCK (bit 14) in the effective set.
    if field("CapEff:")
        .and_then(|v| u64::from_str_radix(v, 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
    {
        return Ok(());
    }
    // What this process locked or pinned already.
    let kib = |name: &str| {
        field(name)
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let locked = (kib("VmLck:") + kib("VmPin:")) * 1024;
    if locked.saturating_add(need) > lim.rlim_cur {
        return Err(RegisterError::MemlockLimit {
            limit: lim.rlim_cur,
            need: locked.saturating_add(need),
        });
    }
    Ok(())
}

/// One of the owner's `max_queue_pairs` places, held by a reader.
struct QpPlace<'a>(&'a OwnerShared);

impl<'a> QpPlace<'a> {
    fn take(shared: &'a OwnerShared) -> Option<Self> {
        let cap = shared.config.max_queue_pairs;
        shared
            .queue_pairs
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < cap).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(shared))
    }
}

impl Drop for QpPlace<'_> {
    fn drop(&mut self) {
        self.0.queue_pairs.fetch_sub(1, Ordering::Relaxed);
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
    // Holds one of the owner's queue-pair places from the first endpoint
    // on; gives it back when the reader goes.
    let mut place: Option<QpPlace<'_>> = None;
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
        if place.is_none() {
            match QpPlace::take(shared) {
                Some(p) => place = Some(p),
                None => {
                    shared.refused.fetch_add(1, Ordering::Relaxed);
                    let cap = shared.config.max_queue_pairs;
                    tracing::warn!(
                        cap,
                        "verbs owner: refused a reader: it already serves the most queue pairs allowed (transports.verbs_max_queue_pairs)"
                    );
                    let mut reply = [0u8; Endpoint::LEN + 8];
                    let refusal = Endpoint {
                        qpn: 0,
                        psn: u32::try_from(cap).unwrap_or(u32::MAX),
                        lid: 0,
                        gid: [0; 16],
                    };
                    reply[..Endpoint::LEN].copy_from_slice(&refusal.to_bytes());
                    stream.write_all(&reply)?;
                    return Ok(());
                }
            }
        }
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
