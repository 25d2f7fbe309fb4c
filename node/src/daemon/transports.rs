//! The node's region, served for one-sided READs.
//!
//! At start the node picks its **region epoch**, a random non-zero u64 that
//! changes on every start, writes it into the superblock, and gives it to
//! every backend, so every descriptor of the region carries the same epoch
//! and a reader holding a descriptor of an earlier start is refused (stale
//! epoch or unknown key) and refetches. (The coordinator's registration
//! incarnation is a membership number; it is not this.)
//!
//! * `shm` (default on): the region *is* an `shm` file under `shm_dir`, so
//!   readers on this host map it read-only and copy it with no CPU of ours.
//!   Its descriptor: kind `shm`, endpoint = the owner name, `opaque` = the
//!   directory (UTF-8).
//! * `tcp` (default on): the `tcp` software NIC registers the same memory
//!   in place (`register_external`) and serves READs from it. Descriptor:
//!   kind `tcp`, endpoint = host:port.
//!
//! * `verbs` (default off; cargo feature `verbs`): an RDMA `VerbsOwner`
//!   registers the same memory in place for remote READ only, on the
//!   device, port and GID `gid` chooses (the RoCE v2 GID of the advertised
//!   address unless the config names one). Before registering, the region
//!   is prefaulted writable (`MADV_POPULATE_WRITE`, else an atomic
//!   read-modify-write of a word per page): a read-only registration of
//!   untouched anonymous memory would pin the shared zero page, and the
//!   cache's later stores would land in fresh pages the NIC never reads.
//!   RLIMIT_MEMLOCK is checked first (`pagewire_rdma::verbs::check_memlock`):
//!   a too-low limit stops the start with the limit, the size and how to
//!   raise it. Descriptor: kind `verbs`, endpoint = the control socket's
//!   host:port, `opaque` = the 16 bytes of the owner's GID.
//!
//! With every transport off the region is anonymous private memory (transparent huge
//! pages where the kernel gives them) and no descriptor is published:
//! readers fall back to gRPC. The shm region gets huge pages from a
//! hugetlbfs `shm_dir` (its files sized in the huge page size; the pool,
//! `vm.nr_hugepages`, must hold the region) or, as transparent huge pages,
//! from a tmpfs mounted `huge=always` (or `within_size`/`advise`) or where
//! `/sys/kernel/mm/transparent_hugepage/shmem_enabled` says `force`;
//! `/dev/shm` with its default `huge=never` gives none.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::PageCache;
use pagewire_client::error_chain as chain;
use pagewire_proto::v1::TransportDescriptor;
use pagewire_rdma::shm::ShmOwner;
use pagewire_rdma::tcp::{OwnerConfig, TcpOwner, TcpRegion};
use pagewire_rdma::{LocalRegion, OwnerError, RegionDescriptor};

use super::{Config, DaemonError};

/// What serves the region; dropping it revokes every registration.
pub(crate) struct Served {
    pub(crate) epoch: u64,
    shm: Option<(ShmOwner, RegionDescriptor, PathBuf)>,
    // Field order: the tcp registration goes before its responder.
    tcp: Option<(TcpRegion, TcpOwner, String)>,
    #[cfg(feature = "verbs")]
    verbs: Option<verbs::Served>,
}

/// A random non-zero epoch.
fn new_epoch() -> Result<u64, DaemonError> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).map_err(|e| DaemonError::Internal(format!("no randomness: {e}")))?;
    Ok(u64::from_le_bytes(b) | 1)
}

/// The shm owner name of a node: its id, kept to the characters shm allows.
fn shm_name(node_id: &str) -> String {
    let mut n: String = node_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(56)
        .collect();
    if n.is_empty() || n.starts_with('.') {
        n.insert(0, 'n');
    }
    format!("node-{n}")
}

fn cfg_err(key: &'static str, reason: impl std::fmt::Display) -> DaemonError {
    DaemonError::Config {
        key,
        reason: reason.to_string(),
    }
}

/// Creates the shm directory (and its parents) when it is missing; an
/// error names it, the OS error and what to do.
fn ensure_shm_dir(dir: &Path) -> Result<(), DaemonError> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(cfg_err(
            "transports.shm_dir",
            format!(
                "{} is not a directory; point --shm-dir (transports.shm_dir) at a \
                 directory, on a tmpfs such as /dev/shm",
                dir.display()
            ),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir).map_err(|e| {
                cfg_err(
                    "transports.shm_dir",
                    format!(
                        "{} does not exist and could not be created: {e}; create it, or \
                         point --shm-dir (transports.shm_dir) at a writable directory on \
                         a tmpfs such as /dev/shm",
                        dir.display()
                    ),
                )
            })?;
            tracing::info!(dir = %dir.display(), "created the shm directory");
            Ok(())
        }
        Err(e) => Err(cfg_err(
            "transports.shm_dir",
            format!(
                "cannot use {}: {e}; point --shm-dir (transports.shm_dir) at a writable \
                 directory on a tmpfs such as /dev/shm",
                dir.display()
            ),
        )),
    }
}

/// Why the shm owner did not start, with the fix: another node of the
/// same id on this host, a directory this process cannot write, or
/// another OS error.
fn shm_owner_error(dir: &Path, name: &str, node_id: &str, e: OwnerError) -> DaemonError {
    let dir = dir.display();
    let reason = match e {
        OwnerError::Io(io) if io.kind() == std::io::ErrorKind::AlreadyExists => format!(
            "another running process serves shm owner {name:?} in {dir} ({io}): a second \
             node with --node-id {node_id} on this host; give each node on a host its own \
             --node-id (or its own --shm-dir)"
        ),
        OwnerError::Io(io) if io.kind() == std::io::ErrorKind::PermissionDenied => format!(
            "cannot create the shm owner's files in {dir}: {io}; give the node a \
             directory it can write (--shm-dir, transports.shm_dir)"
        ),
        other => format!("shm owner {name:?} in {dir}: {}", chain(&other)),
    };
    cfg_err("transports.shm", reason)
}

/// Open the cache on the memory the configured transports serve, and start
/// them. Blocking (it faults the region's metadata in).
pub(crate) fn open(
    cfg: &Config,
    node_id: &str,
    token: &str,
) -> Result<(Arc<PageCache>, Served), DaemonError> {
    let t = &cfg.transports;
    let epoch = new_epoch()?;
    let cache_cfg = cfg.cache_config();
    let len =
        PageCache::<crate::index::Lockless>::region_len(cache_cfg.page_size, cache_cfg.frames);
    // Everything verbs can refuse (memlock, device, GID, control socket)
    // is checked before anything is created or served.
    #[cfg(feature = "verbs")]
    let verbs_owner = if t.verbs {
        Some(verbs::preflight(cfg, len, epoch, token)?)
    } else {
        None
    };
    let mut shm = None;
    let shared: Option<Box<dyn LocalRegion>> = if t.shm {
        let name = shm_name(node_id);
        let dir = &t.shm_dir;
        ensure_shm_dir(dir)?;
        let owner = ShmOwner::create_in_with_epoch(dir, &name, epoch)
            .map_err(|e| shm_owner_error(dir, &name, node_id, e))?;
        let region = owner.register(len).map_err(|e| {
            cfg_err(
                "transports.shm",
                format!(
                    "shm region of {len} bytes in {}: {}; the directory's file system \
                     needs room for the whole cache (a tmpfs: check its size=)",
                    dir.display(),
                    chain(&e)
                ),
            )
        })?;
        shm = Some((owner, region.descriptor(), t.shm_dir.clone()));
        Some(Box::new(region))
    } else {
        None
    };
    let cache = Arc::new(PageCache::open_on(&cfg.backing_file, cache_cfg, shared)?);
    cache.set_epoch(epoch);
    let mut tcp = None;
    if t.tcp {
        let listen = listen_addr(cfg, &t.tcp_listen);
        let mut rc = OwnerConfig::new(token.as_bytes().to_vec());
        rc.epoch = Some(epoch);
        rc.spin = std::time::Duration::from_micros(t.tcp_spin_us);
        let responder = TcpOwner::bind(listen.as_str(), rc)
            .map_err(|e| cfg_err("transports.tcp_listen", format!("{listen}: {}", chain(&e))))?;
        let (ptr, len) = region_of(&cache)?;
        let keep: pagewire_rdma::MemoryOwner = cache.clone();
        // SAFETY:
        // - `ptr..ptr + r.len` is the cache's region, mapped for as long as
        //   the cache lives, and `keep` keeps the cache alive as long as the
        //   registration;
        // - the cache writes its region only with atomic stores, by the
        //   kernel (`preadv`), or through the inline-assembly copy, and holds
        //   no `&mut` over it (see `raw::region`), so the responder's atomic
        //   loads race with no plain store.
        let region = unsafe { responder.register_external(ptr, len, keep) }
            .map_err(|e| DaemonError::Internal(format!("tcp registration: {e}")))?;
        let advertise = advertised(cfg, &t.tcp_advertise, responder.local_addr().port());
        tcp = Some((region, responder, advertise));
    }
    #[cfg(feature = "verbs")]
    let verbs = match verbs_owner {
        Some(owner) => Some(verbs::serve(cfg, &cache, owner)?),
        None => None,
    };
    Ok((
        cache,
        Served {
            epoch,
            shm,
            tcp,
            #[cfg(feature = "verbs")]
            verbs,
        },
    ))
}

/// The node's own memory for a registration that keeps the cache alive.
fn region_of(cache: &Arc<PageCache>) -> Result<(std::ptr::NonNull<u8>, usize), DaemonError> {
    let r = cache.region();
    let ptr = std::ptr::NonNull::new(r.addr.cast_mut())
        .ok_or_else(|| DaemonError::Internal("region at null".into()))?;
    Ok((ptr, r.len))
}

/// Where a transport listens: `explicit` if set, else the host of
/// `listen`, any port.
fn listen_addr(cfg: &Config, explicit: &str) -> String {
    if explicit.is_empty() {
        format!("{}:0", host_of(&cfg.listen))
    } else {
        explicit.to_owned()
    }
}

/// The advertised `host:port` of a transport listening on `bound` port:
/// `explicit` if set, else the host of `advertise` (or `listen`).
fn advertised(cfg: &Config, explicit: &str, port: u16) -> String {
    if !explicit.is_empty() {
        return explicit.to_owned();
    }
    let host = if cfg.advertise.is_empty() {
        host_of(&cfg.listen)
    } else {
        host_of(&cfg.advertise)
    };
    format!("{host}:{port}")
}

#[cfg(feature = "verbs")]
mod verbs {
    //! The region over RDMA verbs.

    use std::net::{IpAddr, ToSocketAddrs};
    use std::sync::Arc;

    use pagewire_rdma::LocalRegion;
    use pagewire_rdma::verbs::{VerbsConfig, VerbsOwner, VerbsRegion, check_memlock};

    use super::super::gid;
    use super::{
        Config, DaemonError, PageCache, advertised, cfg_err, chain, host_of, listen_addr, region_of,
    };

    /// Field order: the registration goes before its owner.
    pub(crate) struct Served {
        pub(crate) region: VerbsRegion,
        pub(crate) owner: VerbsOwner,
        pub(crate) advertise: String,
        pub(crate) gid: [u8; 16],
    }

    /// The IP readers reach this node at: the host of `advertise` (a name
    /// is resolved).
    fn advertised_ip(cfg: &Config) -> Result<IpAddr, DaemonError> {
        let addr = if cfg.advertise.is_empty() {
            &cfg.listen
        } else {
            &cfg.advertise
        };
        let host = host_of(addr);
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Ok(ip);
        }
        (bare, 0)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .map(|a| a.ip())
            .ok_or_else(|| {
                cfg_err(
                    "transports.verbs",
                    format!("cannot resolve the advertised host {bare:?} to pick a GID"),
                )
            })
    }

    /// Faults every page of `ptr..ptr + len` in, writable, without changing
    /// a byte.
    fn prefault(ptr: std::ptr::NonNull<u8>, len: usize) {
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        // SAFETY: `ptr..ptr + len` is the cache's live mapping (the caller's
        // registration keeps the cache alive); MADV_POPULATE_WRITE only
        // populates page tables, it changes no byte.
        let r = unsafe { libc::madvise(ptr.as_ptr().cast(), len, MADV_POPULATE_WRITE) };
        if r == 0 {
            return;
        }
        // Kernels before 5.14: an atomic add of 0 to one word per page is a
        // write fault that leaves the contents as they are, and atomic, so
        // it races with nothing (the region is written only atomically).
        let page = 4096usize;
        let mut off = 0;
        while off < len {
            // SAFETY: `off < len` and both the region and 4096 are
            // multiples of 8, so this is an aligned word of the live
            // mapping; only atomic accesses touch the region's words.
            let w = unsafe { &*ptr.as_ptr().add(off).cast::<std::sync::atomic::AtomicU64>() };
            w.fetch_add(0, std::sync::atomic::Ordering::Relaxed);
            off += page;
        }
    }

    /// The checks and the device, before the cache exists: the memlock
    /// limit against the region's `len`, the GID, the control socket.
    pub(crate) fn preflight(
        cfg: &Config,
        len: usize,
        epoch: u64,
        token: &str,
    ) -> Result<(VerbsOwner, [u8; 16]), DaemonError> {
        let t = &cfg.transports;
        // First the limit: a refusal here costs nothing, and ibv_reg_mr's
        // own would be a bare ENOMEM.
        check_memlock(len as u64).map_err(|e| cfg_err("transports.verbs", e))?;
        let ip = advertised_ip(cfg)?;
        let device = (!t.verbs_device.is_empty()).then_some(t.verbs_device.as_str());
        let index = u8::try_from(t.verbs_gid_index).ok();
        let choice = gid::choose(
            std::path::Path::new(gid::SYSFS_IB),
            device,
            t.verbs_port,
            index,
            ip,
        )
        .map_err(|e| cfg_err("transports.verbs", e))?;
        tracing::info!(
            device = %choice.device,
            port = choice.port,
            gid_index = choice.index,
            gid = %choice.gid,
            gid_type = %choice.kind,
            netdev = %choice.netdev,
            why = %choice.why,
            "verbs: serving the region on this RDMA port and GID"
        );
        let mut vc = VerbsConfig::new(token.as_bytes().to_vec());
        vc.device = Some(choice.device.clone());
        vc.port = choice.port;
        vc.gid_index = Some(choice.index);
        vc.epoch = Some(epoch);
        vc.max_queue_pairs = t.verbs_max_queue_pairs;
        let listen = listen_addr(cfg, &t.verbs_listen);
        let owner = VerbsOwner::bind(listen.as_str(), vc)
            .map_err(|e| cfg_err("transports.verbs", format!("{listen}: {}", chain(&e))))?;
        Ok((owner, choice.gid.octets()))
    }

    /// Registers the cache's region with the owner `preflight` opened.
    pub(crate) fn serve(
        cfg: &Config,
        cache: &Arc<PageCache>,
        (owner, gid): (VerbsOwner, [u8; 16]),
    ) -> Result<Served, DaemonError> {
        let t = &cfg.transports;
        let (ptr, len) = region_of(cache)?;
        prefault(ptr, len);
        let keep: pagewire_rdma::MemoryOwner = cache.clone();
        // SAFETY:
        // - `ptr..ptr + len` is the cache's region, mapped (never remapped)
        //   for as long as the cache lives, and `keep` keeps the cache alive
        //   as long as the registration;
        // - the cache writes its region only with atomic stores, by the
        //   kernel (`preadv`), or through the inline-assembly copy, and
        //   holds no `&mut` over it (see `raw::region`): the NIC may read it
        //   at any time.
        let region = unsafe { owner.register_external(ptr, len, keep) }.map_err(|e| {
            cfg_err(
                "transports.verbs",
                format!("registering {len} bytes: {}", chain(&e)),
            )
        })?;
        let advertise = advertised(cfg, &t.verbs_advertise, owner.local_addr().port());
        tracing::info!(
            endpoint = %advertise,
            bytes = len,
            rkey = region.descriptor().rkey,
            max_queue_pairs = t.verbs_max_queue_pairs,
            "verbs: region registered for remote READ"
        );
        Ok(Served {
            region,
            owner,
            advertise,
            gid,
        })
    }
}

/// The host part of host:port (brackets kept for IPv6).
fn host_of(addr: &str) -> String {
    match addr.rsplit_once(':') {
        Some((h, _)) => h.to_owned(),
        None => addr.to_owned(),
    }
}

impl Served {
    /// The descriptors the node registers and `Transports` returns.
    pub(crate) fn descriptors(&self) -> Vec<TransportDescriptor> {
        let wire = |kind: &str, endpoint: &str, d: &RegionDescriptor, opaque: Vec<u8>| {
            TransportDescriptor {
                // The node answers fault calls on its tcp connections
                // (`service::serve_calls`).
                calls: kind == "tcp",
                kind: kind.into(),
                endpoint: endpoint.to_owned(),
                address: d.addr,
                length: d.len,
                rkey: u64::from(d.rkey),
                epoch: d.epoch,
                opaque,
            }
        };
        let mut out = Vec::new();
        if let Some((owner, d, dir)) = &self.shm {
            let dir = dir.to_string_lossy().into_owned().into_bytes();
            out.push(wire("shm", owner.name(), d, dir));
        }
        if let Some((region, _, advertise)) = &self.tcp {
            out.push(wire("tcp", advertise, &region.descriptor(), Vec::new()));
        }
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            out.push(wire(
                "verbs",
                &v.advertise,
                &v.region.descriptor(),
                v.gid.to_vec(),
            ));
        }
        out
    }

    /// The tcp responder, when the node serves tcp.
    pub(crate) fn tcp_responder(&self) -> Option<&TcpOwner> {
        self.tcp.as_ref().map(|(_, responder, _)| responder)
    }

    /// Reader processes holding a verbs queue pair of this node now.
    pub(crate) fn verbs_queue_pairs(&self) -> u64 {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            return v.owner.queue_pairs() as u64;
        }
        0
    }

    /// Reader connections the tcp responder serves now.
    pub(crate) fn tcp_connections(&self) -> u64 {
        self.tcp
            .as_ref()
            .map_or(0, |(_, r, _)| r.connections() as u64)
    }

    /// Reader connections the tcp responder accepted since start.
    pub(crate) fn tcp_accepted(&self) -> u64 {
        self.tcp.as_ref().map_or(0, |(_, r, _)| r.accepted())
    }

    /// Reader processes refused at `transports.verbs_max_queue_pairs`.
    pub(crate) fn verbs_refused(&self) -> u64 {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            return v.owner.refused();
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shm_names_are_what_shm_accepts() {
        assert_eq!(shm_name("node-1"), "node-node-1");
        assert_eq!(shm_name("a b/c"), "node-a_b_c");
        assert_eq!(shm_name(".x"), "node-n.x");
        assert!(shm_name(&"x".repeat(300)).len() <= 64);
        assert_eq!(host_of("127.0.0.1:7500"), "127.0.0.1");
        assert_eq!(host_of("[::1]:7500"), "[::1]");
    }
}
