//! Where the cluster state lives: the state file (the default, one
//! coordinator) or etcd (several coordinators, one leading; feature `etcd`).
//!
//! [`crate::state::Cluster`] saves through [`Store::save`] before it
//! publishes anything, so a published epoch is always in the store. The
//! etcd store fences every save on the leadership it won (see
//! [`etcd`]'s header); the file store has nothing to fence.

#[cfg(feature = "etcd")]
pub mod etcd;

use std::path::{Path, PathBuf};

use crate::config::ConfigError;
use crate::persist::{self, PersistError, PersistedState};

/// Which store a `store` setting names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// The state file.
    File(PathBuf),
    /// An etcd cluster: its client endpoints (host:port).
    Etcd(Vec<String>),
}

impl StoreSpec {
    /// Parses `store`: `""` or `"file"` (the `state_file`), `"file:PATH"`,
    /// or `"etcd://host:port,host:port,..."`.
    pub fn parse(store: &str, state_file: &Path) -> Result<Self, ConfigError> {
        let bad = |reason: String| ConfigError::Invalid {
            key: "store",
            reason,
        };
        let s = store.trim();
        if s.is_empty() || s == "file" {
            return Ok(Self::File(state_file.to_owned()));
        }
        if let Some(path) = s.strip_prefix("file:") {
            if path.is_empty() {
                return Err(bad("file: needs a path".into()));
            }
            return Ok(Self::File(PathBuf::from(path)));
        }
        let Some(list) = s.strip_prefix("etcd://") else {
            return Err(bad(format!(
                "{s:?}: expected \"file\", \"file:PATH\" or \"etcd://host:port,...\""
            )));
        };
        let endpoints = pagewire_proto::leader::parse_addresses(list);
        if endpoints.is_empty() || endpoints.len() > 16 {
            return Err(bad(format!(
                "{s:?}: name 1 to 16 etcd endpoints (host:port)"
            )));
        }
        for e in &endpoints {
            let ok = e.rsplit_once(':').is_some_and(|(h, p)| {
                !h.is_empty() && !h.contains('/') && p.parse::<u16>().is_ok_and(|p| p != 0)
            });
            if !ok {
                return Err(bad(format!("etcd endpoint {e:?} is not host:port")));
            }
        }
        Ok(Self::Etcd(endpoints))
    }

    /// As `Status.store` shows it.
    pub fn describe(&self) -> String {
        match self {
            Self::File(p) => format!("file:{}", p.display()),
            Self::Etcd(e) => format!("etcd://{}", e.join(",")),
        }
    }
}

/// Why a save did not happen.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error(transparent)]
    File(#[from] PersistError),
    /// This coordinator does not lead (any more): the save was fenced off.
    #[error("this coordinator lost the leadership")]
    NotLeader { leader: Option<String> },
    /// The store did not answer, or answered with an error; whether the
    /// write happened is unknown, so the coordinator stops leading.
    #[error("the store did not take the write: {0}")]
    Unavailable(String),
}

/// Something that keeps the cluster state.
pub(crate) trait Store: Send + Sync {
    /// Saves `state` durably. `new_epoch` is the epoch this save publishes
    /// (`None`: the map did not change), with why it changed.
    fn save(
        &self,
        state: &PersistedState,
        new_epoch: Option<(u64, &str)>,
    ) -> Result<(), StoreError>;
}

/// Refuses every save: a coordinator on etcd before it is connected.
#[cfg(feature = "etcd")]
pub(crate) struct NoStore;

#[cfg(feature = "etcd")]
impl Store for NoStore {
    fn save(&self, _: &PersistedState, _: Option<(u64, &str)>) -> Result<(), StoreError> {
        Err(StoreError::NotLeader { leader: None })
    }
}

/// The state file (see [`crate::persist`]).
pub(crate) struct FileStore {
    pub(crate) path: PathBuf,
}

impl FileStore {
    pub(crate) fn load(&self) -> Result<Option<PersistedState>, PersistError> {
        persist::load(&self.path)
    }
}

impl Store for FileStore {
    fn save(&self, state: &PersistedState, _: Option<(u64, &str)>) -> Result<(), StoreError> {
        Ok(persist::save(&self.path, state)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_settings_parse_or_say_why() {
        let f = Path::new("s.state");
        assert_eq!(StoreSpec::parse("", f).unwrap(), StoreSpec::File(f.into()));
        assert_eq!(
            StoreSpec::parse("file:/x/y", f).unwrap(),
            StoreSpec::File("/x/y".into())
        );
        assert_eq!(
            StoreSpec::parse("etcd://a:1, b:2", f).unwrap(),
            StoreSpec::Etcd(vec!["a:1".into(), "b:2".into()])
        );
        for bad in [
            "etcd://",
            "etcd://a",
            "etcd://a:0",
            "etcd://http://a:1",
            "zk://a:1",
            "file:",
        ] {
            let e = StoreSpec::parse(bad, f).unwrap_err().to_string();
            assert!(e.contains("store"), "{bad}: {e}");
        }
        assert_eq!(
            StoreSpec::parse("etcd://a:1,b:2", f).unwrap().describe(),
            "etcd://a:1,b:2"
        );
    }
}
