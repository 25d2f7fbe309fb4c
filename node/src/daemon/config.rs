//! Node daemon configuration: a TOML file (every option is documented in
//! `node/src/daemon/pagewire-node.example.toml`), overridden by flags.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::error::DaemonError;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct Config {
    pub(crate) node_id: String,
    pub(crate) backing_file: PathBuf,
    pub(crate) listen: String,
    pub(crate) advertise: String,
    pub(crate) metrics_listen: String,
    pub(crate) coordinator: String,
    pub(crate) token: String,
    pub(crate) token_file: Option<PathBuf>,
    pub(crate) capacity_bytes: u64,
    pub(crate) max_pages_per_call: u64,
    pub(crate) clock_drift_margin_ms: u64,
    pub(crate) leave_on_shutdown: bool,
    pub(crate) shutdown_drain_timeout_ms: u64,
    pub(crate) log: String,
    pub(crate) cache: CacheSection,
    pub(crate) tls: TlsSection,
    pub(crate) transports: TransportsSection,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct CacheSection {
    pub(crate) page_size: usize,
    pub(crate) frames: usize,
    pub(crate) direct_io: bool,
    pub(crate) sync_writes: bool,
    pub(crate) readahead_max: usize,
    pub(crate) evict_batch: usize,
    pub(crate) numa_node: Option<usize>,
}

/// How the node serves its region for one-sided READs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct TransportsSection {
    /// Put the region in an `shm` file that readers on this host map.
    pub(crate) shm: bool,
    /// Directory of the `shm` files (memory-backed), created when missing.
    pub(crate) shm_dir: PathBuf,
    /// Serve the region with the `tcp` software NIC.
    pub(crate) tcp: bool,
    /// Where the `tcp` responder listens; empty: the host of `listen`, any port.
    pub(crate) tcp_listen: String,
    /// Address advertised for `tcp`; empty: the host of `advertise` (or of
    /// `listen`) with the port `tcp_listen` bound.
    pub(crate) tcp_advertise: String,
    /// How long a `tcp` serving thread spins for the next request before it
    /// blocks, in microseconds (0: block at once).
    pub(crate) tcp_spin_us: u64,
    /// Serve the region over RDMA verbs (RC queue pairs; needs the `verbs`
    /// cargo feature and an RDMA device).
    pub(crate) verbs: bool,
    /// RDMA device; empty: the one whose RoCE v2 GID's netdev carries the
    /// advertised address.
    pub(crate) verbs_device: String,
    /// Port of the device, from 1.
    pub(crate) verbs_port: u8,
    /// GID index; -1: chosen at start (the RoCE v2 GID of the advertised
    /// address, from sysfs).
    pub(crate) verbs_gid_index: i32,
    /// Where the verbs control socket (queue-pair exchange) listens; empty:
    /// the host of `listen`, any port.
    pub(crate) verbs_listen: String,
    /// Address advertised for verbs; empty: the host of `advertise` (or of
    /// `listen`) with the port `verbs_listen` bound.
    pub(crate) verbs_advertise: String,
    /// Reader processes served at once (one RC queue pair each), at most.
    pub(crate) verbs_max_queue_pairs: usize,
}

impl Default for TransportsSection {
    fn default() -> Self {
        Self {
            shm: true,
            shm_dir: PathBuf::from(pagewire_rdma::shm::DEFAULT_DIR),
            tcp: true,
            tcp_listen: String::new(),
            tcp_advertise: String::new(),
            tcp_spin_us: 50,
            verbs: false,
            verbs_device: String::new(),
            verbs_port: 1,
            verbs_gid_index: -1,
            verbs_listen: String::new(),
            verbs_advertise: String::new(),
            verbs_max_queue_pairs: 1024,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct TlsSection {
    pub(crate) cert_file: Option<PathBuf>,
    pub(crate) key_file: Option<PathBuf>,
    pub(crate) client_ca_file: Option<PathBuf>,
    pub(crate) coordinator_ca_file: Option<PathBuf>,
    pub(crate) coordinator_domain: String,
    /// CA and name of the other nodes' certificates, for the `FaultIn`
    /// calls of pages this node reads from them (default: the
    /// coordinator's).
    pub(crate) peer_ca_file: Option<PathBuf>,
    pub(crate) peer_domain: String,
}

impl TlsSection {
    /// How this node checks its peers' gRPC servers (None: plain text).
    pub(crate) fn peer(&self) -> Option<pagewire_proto::net::ClientTls> {
        let (ca, domain) = match &self.peer_ca_file {
            Some(ca) => (ca, &self.peer_domain),
            None => (self.coordinator_ca_file.as_ref()?, &self.coordinator_domain),
        };
        Some(pagewire_proto::net::ClientTls {
            ca_file: ca.clone(),
            domain: domain.clone(),
        })
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            node_id: String::new(),
            backing_file: PathBuf::new(),
            listen: "127.0.0.1:7500".into(),
            advertise: String::new(),
            metrics_listen: "127.0.0.1:7501".into(),
            coordinator: "127.0.0.1:7400".into(),
            token: String::new(),
            token_file: None,
            capacity_bytes: 0,
            max_pages_per_call: 1024,
            clock_drift_margin_ms: 100,
            leave_on_shutdown: true,
            shutdown_drain_timeout_ms: 20_000,
            log: "info".into(),
            cache: CacheSection::default(),
            tls: TlsSection::default(),
            transports: TransportsSection::default(),
        }
    }
}

impl Default for CacheSection {
    fn default() -> Self {
        let d = crate::CacheConfig::default();
        Self {
            page_size: d.page_size,
            frames: d.frames,
            direct_io: d.direct_io,
            sync_writes: d.sync_writes,
            readahead_max: d.readahead_max,
            evict_batch: d.evict_batch,
            numa_node: d.numa_node,
        }
    }
}

fn invalid(key: &'static str, reason: impl Into<String>) -> DaemonError {
    DaemonError::Config {
        key,
        reason: reason.into(),
    }
}

/// What the daemon does with the text of a config file before it uses it:
/// parse, validate, and derive the cache's config and the node's capacity.
/// The entry of the fuzz target of this decoder; the error is the message.
#[doc(hidden)]
pub fn check_config_text(text: &str) -> Result<(), String> {
    let c = Config::parse(text, Path::new("<fuzz>")).map_err(|e| e.to_string())?;
    c.validate().map_err(|e| e.to_string())?;
    let _ = (c.cache_config(), c.capacity());
    Ok(())
}

impl Config {
    pub(crate) fn load(path: Option<&Path>) -> Result<Self, DaemonError> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let text = std::fs::read_to_string(path).map_err(|source| DaemonError::ReadFile {
            what: "the config file (--config, PAGEWIRE_NODE_CONFIG)",
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses the text of the config file at `path`.
    fn parse(text: &str, path: &Path) -> Result<Self, DaemonError> {
        toml::from_str(text).map_err(|e| DaemonError::ConfigParse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    pub(crate) fn cache_config(&self) -> crate::CacheConfig {
        let c = &self.cache;
        // Fields the cache gains later keep their defaults.
        #[allow(clippy::needless_update)]
        crate::CacheConfig {
            page_size: c.page_size,
            frames: c.frames,
            direct_io: c.direct_io,
            sync_writes: c.sync_writes,
            readahead_max: c.readahead_max,
            evict_batch: c.evict_batch,
            numa_node: c.numa_node,
            ..Default::default()
        }
    }

    /// Bytes of cache this node offers the cluster (its rendezvous weight).
    pub(crate) fn capacity(&self) -> u64 {
        if self.capacity_bytes != 0 {
            self.capacity_bytes
        } else {
            (self.cache.frames as u64).saturating_mul(self.cache.page_size as u64)
        }
    }

    pub(crate) fn validate(&self) -> Result<(), DaemonError> {
        if self.backing_file.as_os_str().is_empty() {
            return Err(invalid(
                "backing_file",
                "required (the big file this cluster caches)",
            ));
        }
        self.coordinators()?;
        if self.max_pages_per_call == 0 || self.max_pages_per_call > 1 << 16 {
            return Err(invalid("max_pages_per_call", "must be in 1..=65536"));
        }
        if self.clock_drift_margin_ms > 60_000 {
            return Err(invalid(
                "clock_drift_margin_ms",
                "must be at most 60000 (and below the coordinator's lease)",
            ));
        }
        if self.shutdown_drain_timeout_ms > 3_600_000 {
            return Err(invalid(
                "shutdown_drain_timeout_ms",
                "must be at most 3600000 (an hour)",
            ));
        }
        let t = &self.transports;
        if t.verbs {
            if !cfg!(feature = "verbs") {
                return Err(invalid(
                    "transports.verbs",
                    "this pagewire-node was built without RDMA support (cargo feature `verbs` of pagewire-node)",
                ));
            }
            if t.verbs_port == 0 {
                return Err(invalid("transports.verbs_port", "ports count from 1"));
            }
            if !(-1..=255).contains(&t.verbs_gid_index) {
                return Err(invalid(
                    "transports.verbs_gid_index",
                    "-1 (chosen at start) or a GID index 0..=255",
                ));
            }
            if t.verbs_max_queue_pairs == 0 {
                return Err(invalid(
                    "transports.verbs_max_queue_pairs",
                    "must be at least 1",
                ));
            }
        }
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            return Err(invalid("tls", "cert_file and key_file go together"));
        }
        if self.tls.peer_ca_file.is_some() && self.tls.peer_domain.is_empty() {
            return Err(invalid(
                "tls.peer_domain",
                "required with tls.peer_ca_file: the name the other nodes' certificates carry",
            ));
        }
        if self.tls.cert_file.is_some() && self.tls.peer().is_none() {
            // The nodes of a cluster serve alike: a node serving TLS reads
            // its peers' pages (FaultIn) from TLS servers.
            return Err(invalid(
                "tls.peer_ca_file",
                "this node serves TLS (tls.cert_file), so its peers do: set tls.peer_ca_file \
                 (or tls.coordinator_ca_file) to verify them with",
            ));
        }
        if self.tls.coordinator_ca_file.is_some() && self.tls.coordinator_domain.is_empty() {
            return Err(invalid(
                "tls.coordinator_domain",
                "required with tls.coordinator_ca_file: the name the coordinator's certificate carries",
            ));
        }
        Ok(())
    }

    /// The coordinator addresses (`coordinator`, comma-separated), checked.
    pub(crate) fn coordinators(&self) -> Result<Vec<String>, DaemonError> {
        pagewire_proto::leader::parse_address_list(&self.coordinator)
            .map_err(|e| invalid("coordinator", e.to_string()))
    }

    pub(crate) fn resolve_token(&self) -> Result<String, DaemonError> {
        let token = if !self.token.is_empty() {
            self.token.clone()
        } else if let Some(path) = &self.token_file {
            std::fs::read_to_string(path)
                .map_err(|source| DaemonError::ReadFile {
                    what: "the token file (--token-file, `token_file`)",
                    path: path.clone(),
                    source,
                })?
                .trim()
                .to_owned()
        } else {
            return Err(invalid(
                "token",
                "no cluster token: set `token` or `token_file`, --token-file, or PAGEWIRE_TOKEN",
            ));
        };
        pagewire_proto::auth::validate_token(&token)
            .map_err(|e| invalid("token", e.to_string()))?;
        Ok(token)
    }

    /// The node id: configured, else the host name.
    pub(crate) fn node_id(&self) -> String {
        if !self.node_id.is_empty() {
            return self.node_id.clone();
        }
        hostname().unwrap_or_else(|| "pagewire-node".into())
    }
}

pub(crate) fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::{Config, DaemonError};

    fn coordinator_error(list: &str) -> Option<String> {
        let cfg = Config {
            backing_file: "/data.bin".into(),
            coordinator: list.into(),
            ..Config::default()
        };
        match cfg.validate() {
            Ok(()) => None,
            Err(DaemonError::Config {
                key: "coordinator",
                reason,
            }) => Some(reason),
            Err(e) => panic!("{list:?}: another error: {e}"),
        }
    }

    #[test]
    fn coordinator_lists_are_validated() {
        assert_eq!(coordinator_error("127.0.0.1:7400"), None);
        assert_eq!(coordinator_error(" a:7400, b:7400 ,https://c:7400"), None);
        let cfg = Config {
            coordinator: "a:1, b:2,a:1".into(),
            ..Config::default()
        };
        assert_eq!(cfg.coordinators().unwrap(), vec!["a:1", "b:2"]);
        let r = coordinator_error("").expect("empty");
        assert!(r.contains("no coordinator address"), "{r}");
        let r = coordinator_error("a:7400,b").expect("no port");
        assert!(r.contains("\"b\"") && r.contains("host:port"), "{r}");
        let r = coordinator_error("a:7400,b:0").expect("port 0");
        assert!(r.contains("port 0"), "{r}");
        let many: Vec<String> = (0..17).map(|i| format!("c{i}:7400")).collect();
        let r = coordinator_error(&many.join(",")).expect("too many");
        assert!(r.contains("17") && r.contains("at most 16"), "{r}");
        assert_eq!(coordinator_error(&many[..16].join(",")), None);
    }

    /// A file that cannot be read is named with the setting that names it.
    #[test]
    fn an_unreadable_token_or_config_file_names_its_setting() {
        let cfg = Config {
            token_file: Some("/nonexistent/pagewire-token".into()),
            ..Config::default()
        };
        let e = cfg.resolve_token().unwrap_err().to_string();
        for want in ["--token-file", "/nonexistent/pagewire-token", "os error 2"] {
            assert!(e.contains(want), "{want:?} missing from: {e}");
        }
        let e = Config::load(Some(std::path::Path::new("/nonexistent/node.toml")))
            .unwrap_err()
            .to_string();
        for want in ["--config", "/nonexistent/node.toml", "os error 2"] {
            assert!(e.contains(want), "{want:?} missing from: {e}");
        }
    }

    /// A node serving TLS must be able to verify its peers (whose pages it
    /// faults in over gRPC): the peers' CA, or the coordinator's.
    #[test]
    fn a_node_serving_tls_needs_a_ca_for_its_peers() {
        let mut cfg = Config {
            backing_file: "/tmp/data".into(),
            ..Config::default()
        };
        cfg.tls.cert_file = Some("/tls/node.pem".into());
        cfg.tls.key_file = Some("/tls/node.key".into());
        match cfg.validate() {
            Err(DaemonError::Config { key, .. }) => assert_eq!(key, "tls.peer_ca_file"),
            other => panic!("no CA for the peers: {other:?}"),
        }
        assert!(cfg.tls.peer().is_none());
        cfg.tls.coordinator_ca_file = Some("/tls/ca.pem".into());
        cfg.tls.coordinator_domain = "coord".into();
        cfg.validate()
            .expect("the coordinator's CA serves for the peers");
        let p = cfg.tls.peer().expect("peer TLS");
        assert_eq!(
            (p.ca_file.to_str(), p.domain.as_str()),
            (Some("/tls/ca.pem"), "coord")
        );
        cfg.tls.peer_ca_file = Some("/tls/peers.pem".into());
        match cfg.validate() {
            Err(DaemonError::Config { key, .. }) => assert_eq!(key, "tls.peer_domain"),
            other => panic!("a peer CA without a name: {other:?}"),
        }
        cfg.tls.peer_domain = "nodes".into();
        cfg.validate().expect("valid");
        let p = cfg.tls.peer().expect("peer TLS");
        assert_eq!(
            (p.ca_file.to_str(), p.domain.as_str()),
            (Some("/tls/peers.pem"), "nodes")
        );
    }

    #[test]
    fn example_config_parses() {
        let cfg: super::Config =
            toml::from_str(include_str!("pagewire-node.example.toml")).unwrap();
        assert_eq!(cfg.coordinators().unwrap(), vec!["127.0.0.1:7400"]);
        assert!(
            cfg.validate().is_err(),
            "the example leaves backing_file empty"
        );
    }
}
