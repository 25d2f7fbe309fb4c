//! The coordinator's state file: members, ownership map, epoch and policy,
//! encoded as a protobuf message between a header and a checksum, replaced
//! atomically on every change (write a temporary file, fsync it, rename it
//! over the old one, fsync the directory), so that a crash at any point leaves
//! either the old state or the new one.
//!
//! Layout: `b"PWCS"`, format version (u32 LE), payload length (u64 LE),
//! payload (`PersistedState`), FNV-1a 64 of the payload (u64 LE).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use pagewire_proto::v1::{CompactMap, NodeInfo, OwnershipMap, Policy};
use prost::Message;

const MAGIC: &[u8; 4] = b"PWCS";
/// Format 2 stores the compact map (`compact`); format 1 stored the
/// expanded one (`map`) and is still read (converted on load).
const FORMAT: u32 = 2;
const OLDEST_FORMAT: u32 = 1;

/// What survives a restart.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PersistedState {
    #[prost(string, tag = "1")]
    pub(crate) cluster_name: String,
    /// Members with their persistent fields (runtime fields are zero).
    #[prost(message, repeated, tag = "2")]
    pub(crate) members: Vec<NodeInfo>,
    /// The expanded map: format 1 only (format 2 leaves it empty).
    #[prost(message, optional, tag = "3")]
    pub(crate) map: Option<OwnershipMap>,
    #[prost(message, optional, tag = "4")]
    pub(crate) policy: Option<Policy>,
    #[prost(uint32, tag = "5")]
    pub(crate) next_index: u32,
    #[prost(uint64, tag = "6")]
    pub(crate) next_incarnation: u64,
    /// The map in compact form (format 2).
    #[prost(message, optional, tag = "7")]
    pub(crate) compact: Option<CompactMap>,
}

/// Why the state file could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PersistError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a pagewire coordinator state file (or is damaged): {reason}")]
    Corrupt { path: PathBuf, reason: String },
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> PersistError + 'a {
    move |source| PersistError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Reads the state file; `Ok(None)` when there is none.
pub(crate) fn load(path: &Path) -> Result<Option<PersistedState>, PersistError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("cannot read", path)(e)),
    };
    let corrupt = |reason: &str| PersistError::Corrupt {
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    if bytes.len() < 24 || &bytes[..4] != MAGIC {
        return Err(corrupt("bad magic"));
    }
    let format = u32::from_le_bytes(bytes[4..8].try_into().unwrap_or_default());
    if !(OLDEST_FORMAT..=FORMAT).contains(&format) {
        return Err(corrupt(&format!(
            "format {format}, expected {OLDEST_FORMAT} to {FORMAT}"
        )));
    }
    let len = u64::from_le_bytes(bytes[8..16].try_into().unwrap_or_default());
    let Some(end) = usize::try_from(len).ok().and_then(|l| l.checked_add(16)) else {
        return Err(corrupt("bad length"));
    };
    if bytes.len() != end + 8 {
        return Err(corrupt("length does not match the file size"));
    }
    let payload = &bytes[16..end];
    let sum = u64::from_le_bytes(bytes[end..end + 8].try_into().unwrap_or_default());
    if sum != fnv1a(payload) {
        return Err(corrupt("checksum mismatch"));
    }
    PersistedState::decode(payload)
        .map(Some)
        .map_err(|e| corrupt(&e.to_string()))
}

/// Replaces the state file atomically and durably.
pub(crate) fn save(path: &Path, state: &PersistedState) -> Result<(), PersistError> {
    save_as(path, state, FORMAT)
}

/// [`save`] with a given format number (tests write format 1 files).
pub(crate) fn save_as(
    path: &Path,
    state: &PersistedState,
    format: u32,
) -> Result<(), PersistError> {
    let payload = state.encode_to_vec();
    let mut bytes = Vec::with_capacity(payload.len() + 24);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&format.to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&payload);
    bytes.extend_from_slice(&fnv1a(&payload).to_le_bytes());

    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    let mut tmp_name = path.file_name().unwrap_or_default().to_owned();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(io("cannot create", &tmp))?;
        f.write_all(&bytes).map_err(io("cannot write", &tmp))?;
        f.sync_all().map_err(io("cannot fsync", &tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io("cannot rename over", path))?;
    File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(io("cannot fsync directory", &dir))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        assert!(load(&path).unwrap().is_none());
        let st = PersistedState {
            cluster_name: "c".into(),
            members: vec![NodeInfo {
                node_id: "a".into(),
                index: 1,
                ..Default::default()
            }],
            map: Some(OwnershipMap {
                epoch: 7,
                owner: vec![1, 1, 0],
                ..Default::default()
            }),
            policy: None,
            next_index: 2,
            next_incarnation: 3,
            compact: None,
        };
        save(&path, &st).unwrap();
        assert_eq!(load(&path).unwrap().unwrap(), st);
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 10] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(load(&path), Err(PersistError::Corrupt { .. })));
    }
}
