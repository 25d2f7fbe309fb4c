//! Where the cluster state lives: the state file (the default, one
//! coordinator) or etcd (several coordinators, one leading; feature `etcd`).
//!
//! # The invariant: nothing is published before it is durable
//!
//! No epoch is served and no call acknowledged before the state it shows is
//! in the store. That holds because:
//!
//! 1. [`crate::state::ClusterState`] saves through [`Store::save`] inside every
//!    change, and only after it returned `Ok` publishes the map (the watch
//!    channel `GetMap`, `WatchMap` and `Warm`/`Evict` read) and the status
//!    (`Status`); a change whose save failed is undone whole and its call
//!    answers the error.
//! 2. A change returns its answer only after its save (the service awaits
//!    the change, save included, before it replies).
//! 3. The reads that do not take the cluster lock read only those two
//!    published values, never the cluster itself, so a save in progress
//!    (which holds the lock) shows nowhere until it has succeeded.
//! 4. The etcd store fences every save on the leadership it won (see
//!    [`etcd`]'s header); the file store has nothing to fence.
//!
//! # What the service asks of a store
//!
//! [`Store`] is all of it: `save`, and for a store shared by several
//! coordinators `start` (its election and state watch), `confirm` (a
//! follower's read is current), `peers` (`Status.coordinators`) and
//! `resign` (on shutdown). The file store has one coordinator, which leads
//! for ever: it keeps the defaults, which do nothing. [`connect_etcd`] is
//! the one place that knows whether the etcd store is built in.

#[cfg(feature = "etcd")]
pub mod etcd;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::config::{Config, ConfigError};
use crate::follow::Event;
use crate::ha::Leadership;
use crate::metrics::Metrics;
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

/// A future a [`Store`] returns (the trait is used as `dyn Store`).
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Something that keeps the cluster state.
pub(crate) trait Store: Send + Sync {
    /// Saves `state` durably. `new_epoch` is the epoch this save publishes
    /// (`None`: the map did not change), with why it changed.
    fn save(
        &self,
        state: &PersistedState,
        new_epoch: Option<(u64, &str)>,
    ) -> Result<(), StoreError>;

    /// Starts the store's own tasks (an election, a watch of the state).
    /// None by default.
    fn start(self: Arc<Self>) {}

    /// Confirms that a follower's copy of the state is the store's current
    /// one; only a follower asks (a leader wrote its copy). By default
    /// there are no followers: refused.
    fn confirm(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Err("this coordinator does not lead".to_owned()) })
    }

    /// The addresses of the coordinators sharing the store; empty (by
    /// default) when the store keeps no list: then it is this one alone.
    fn peers(&self) -> BoxFuture<'_, Result<Vec<String>, String>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    /// Stops leading and lets another coordinator lead at once (on
    /// shutdown). Nothing by default.
    fn resign(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// Connects to the etcd store at `endpoints` (the `[etcd]` settings from
/// `cfg`), returning it with the receiver of its events, for
/// [`crate::follow::apply_events`]. Refused when built without the
/// `etcd` feature (the config's validation says so first).
pub(crate) async fn connect_etcd(
    cfg: &Config,
    endpoints: &[String],
    ha: Arc<Leadership>,
    metrics: Arc<Metrics>,
) -> Result<(Arc<dyn Store>, mpsc::UnboundedReceiver<Event>), crate::StartError> {
    #[cfg(feature = "etcd")]
    {
        let opts = etcd::EtcdOptions::from_config(cfg, endpoints.to_vec())?;
        let (store, events) = etcd::EtcdStore::connect(opts, ha, metrics)
            .await
            .map_err(crate::StartError::Store)?;
        Ok((store, events))
    }
    #[cfg(not(feature = "etcd"))]
    {
        let _ = (cfg, endpoints, ha, metrics);
        Err(ConfigError::Invalid {
            key: "store",
            reason: "built without the etcd store".into(),
        }
        .into())
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
