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
//! With both off the region is anonymous private memory (transparent huge
//! pages where the kernel gives them) and no descriptor is published:
//! readers fall back to gRPC. Shared memory gets huge pages only where
//! `/sys/kernel/mm/transparent_hugepage/shmem_enabled` allows them.

use std::path::PathBuf;
use std::sync::Arc;

use crate::PageCache;
use pagewire_proto::v1::TransportDescriptor;
use pagewire_rdma::shm::ShmOwner;
use pagewire_rdma::tcp::{ResponderConfig, TcpRegion, TcpResponder};
use pagewire_rdma::{LocalRegion, RegionDescriptor};

use super::{Config, DaemonError};

/// What serves the region; dropping it revokes every registration.
pub(crate) struct Served {
    pub(crate) epoch: u64,
    shm: Option<(ShmOwner, RegionDescriptor, PathBuf)>,
    // Field order: the tcp registration goes before its responder.
    tcp: Option<(TcpRegion, TcpResponder, String)>,
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
    let mut shm = None;
    let shared: Option<Box<dyn LocalRegion>> = if t.shm {
        let name = shm_name(node_id);
        let owner = ShmOwner::create_in_with_epoch(&t.shm_dir, &name, epoch)
            .map_err(|e| cfg_err("transports.shm", format!("shm owner {name:?}: {e}")))?;
        let region = owner
            .register(len)
            .map_err(|e| cfg_err("transports.shm", format!("shm region of {len} bytes: {e}")))?;
        shm = Some((owner, region.descriptor(), t.shm_dir.clone()));
        Some(Box::new(region))
    } else {
        None
    };
    let cache = Arc::new(PageCache::open_on(&cfg.backing_file, cache_cfg, shared)?);
    cache.set_epoch(epoch);
    let mut tcp = None;
    if t.tcp {
        let listen = if t.tcp_listen.is_empty() {
            format!("{}:0", host_of(&cfg.listen))
        } else {
            t.tcp_listen.clone()
        };
        let mut rc = ResponderConfig::new(token.as_bytes().to_vec());
        rc.epoch = Some(epoch);
        rc.spin = std::time::Duration::from_micros(t.tcp_spin_us);
        let responder = TcpResponder::bind(listen.as_str(), rc)
            .map_err(|e| cfg_err("transports.tcp_listen", format!("{listen}: {e}")))?;
        let r = cache.region();
        let ptr = std::ptr::NonNull::new(r.addr.cast_mut())
            .ok_or_else(|| DaemonError::Internal("region at null".into()))?;
        let keep: pagewire_rdma::MemoryOwner = cache.clone();
        // SAFETY:
        // - `ptr..ptr + r.len` is the cache's region, mapped for as long as
        //   the cache lives, and `keep` keeps the cache alive as long as the
        //   registration;
        // - the cache writes its region only with atomic stores, by the
        //   kernel (`preadv`), or through the inline-assembly copy, and holds
        //   no `&mut` over it (see `raw::region`), so the responder's atomic
        //   loads race with no plain store.
        let region = unsafe { responder.register_external(ptr, r.len, keep) }
            .map_err(|e| DaemonError::Internal(format!("tcp registration: {e}")))?;
        let port = responder.local_addr().port();
        let advertise = if !t.tcp_advertise.is_empty() {
            t.tcp_advertise.clone()
        } else {
            let host = if cfg.advertise.is_empty() {
                host_of(&cfg.listen)
            } else {
                host_of(&cfg.advertise)
            };
            format!("{host}:{port}")
        };
        tcp = Some((region, responder, advertise));
    }
    Ok((cache, Served { epoch, shm, tcp }))
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
        let mut out = Vec::new();
        if let Some((owner, d, dir)) = &self.shm {
            out.push(TransportDescriptor {
                kind: "shm".into(),
                endpoint: owner.name().to_owned(),
                address: d.addr,
                length: d.len,
                rkey: u64::from(d.rkey),
                epoch: d.epoch,
                opaque: dir.to_string_lossy().into_owned().into_bytes(),
            });
        }
        if let Some((region, _, advertise)) = &self.tcp {
            let d = region.descriptor();
            out.push(TransportDescriptor {
                kind: "tcp".into(),
                endpoint: advertise.clone(),
                address: d.addr,
                length: d.len,
                rkey: u64::from(d.rkey),
                epoch: d.epoch,
                opaque: Vec::new(),
            });
        }
        out
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
