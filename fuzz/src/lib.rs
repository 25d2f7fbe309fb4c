//! What the fuzz targets share: a region served over `shm` whose bytes the
//! fuzzer writes, the token of the tcp targets, and the builders of the seed
//! corpus (`tests/seeds.rs` writes it with the real encoders).

use std::path::Path;
use std::sync::OnceLock;

use pagewire_rdma::shm::{ShmConfig, ShmConnection, ShmOwner, ShmRegion};
use pagewire_rdma::{LocalRegion, RegionDescriptor};

pub mod seeds;

/// The owner epoch of the fuzzed region and of the seed regions: a
/// superblock must carry its descriptor's epoch for the reader to go on.
pub const EPOCH: u64 = 0x5eed_0001;

/// Bytes of the fuzzed region: the seed regions fit, and a superblock may
/// describe a layout up to this long (the rest reads as zeros).
pub const REGION_LEN: usize = 1 << 20;

/// The cluster token of the tcp targets.
pub const TOKEN: &[u8] = b"pagewire-fuzz-token";

/// An `shm` owner with one region, in a private directory under /dev/shm.
pub struct ShmTarget {
    _dir: tempfile::TempDir,
    dir: std::path::PathBuf,
    owner: ShmOwner,
    region: ShmRegion,
    /// Bytes written by the last [`ShmTarget::load`] (zeroed by the next).
    dirty: std::sync::atomic::AtomicUsize,
}

impl ShmTarget {
    /// The process's target, created on first use.
    pub fn get() -> &'static ShmTarget {
        static T: OnceLock<ShmTarget> = OnceLock::new();
        T.get_or_init(|| {
            let base = if Path::new("/dev/shm").is_dir() {
                Path::new("/dev/shm").to_owned()
            } else {
                std::env::temp_dir()
            };
            let dir = tempfile::Builder::new()
                .prefix("pagewire-fuzz")
                .tempdir_in(base)
                .expect("a directory for the shm owner");
            let path = dir.path().to_owned();
            let owner = ShmOwner::create_in_with_epoch(&path, "fuzz", EPOCH).expect("shm owner");
            let region = owner.register(REGION_LEN).expect("shm region");
            ShmTarget {
                _dir: dir,
                dir: path,
                owner,
                region,
                dirty: 0.into(),
            }
        })
    }

    /// Makes the region `bytes` followed by zeros (at most
    /// [`REGION_LEN`] bytes are used).
    pub fn load(&self, bytes: &[u8]) {
        let bytes = &bytes[..bytes.len().min(REGION_LEN)];
        let before = self
            .dirty
            .swap(bytes.len(), std::sync::atomic::Ordering::Relaxed);
        self.region.write_bytes(0, bytes);
        if before > bytes.len() {
            self.region
                .write_bytes(bytes.len(), &vec![0u8; before - bytes.len()]);
        }
    }

    /// A fresh reader's connection to the owner.
    pub fn connect(&self) -> ShmConnection {
        ShmConnection::connect(
            self.owner.name(),
            ShmConfig {
                dir: Some(self.dir.clone()),
                chaos: None,
            },
        )
        .expect("connect to the fuzz shm owner")
    }

    /// The region's descriptor.
    pub fn descriptor(&self) -> RegionDescriptor {
        self.region.descriptor()
    }
}
