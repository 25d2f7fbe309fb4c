//! Coordinator configuration: a TOML file (every option is documented in
//! `coordinator/coordinator.example.toml`), overridden by command-line flags.

use std::path::{Path, PathBuf};

// The policy names, their parsing and the implemented lists are the
// contract's (`pagewire_proto::policy`).
use pagewire_proto::policy::{
    ADMISSION, EVICTION, admission_name, check_implemented, eviction_name, one_of, parse_admission,
    parse_eviction,
};
use pagewire_proto::v1::{AdmissionPolicy, EvictionPolicy, Policy};
use serde::Deserialize;

/// Why a configuration cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("bad config file {path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("cannot read token file {path}: {source}")]
    TokenFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("bad cluster token: {0}")]
    Token(#[from] pagewire_proto::auth::TokenError),
    #[error("invalid setting `{key}`: {reason}")]
    Invalid { key: &'static str, reason: String },
}

fn invalid(key: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        reason: reason.into(),
    }
}

/// The whole configuration, as read from TOML.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub cluster_name: String,
    pub listen: String,
    pub metrics_listen: String,
    pub state_file: PathBuf,
    pub token: String,
    pub token_file: Option<PathBuf>,
    pub lease_ms: u64,
    pub heartbeat_interval_ms: u64,
    pub node_rpc_timeout_ms: u64,
    pub log: String,
    pub store: String,
    pub advertise: String,
    pub map: MapConfig,
    pub policy: PolicyConfig,
    pub tls: TlsConfig,
    pub etcd: EtcdConfig,
}

/// What a leader failover takes beyond `etcd.lease_ttl_s`: etcd's own
/// election when a member died too, the new leader reading the state back,
/// and scheduling on a loaded host.
pub const FAILOVER_SLACK_MS: u64 = 1000;

/// The `[etcd]` section: how to reach etcd when `store` is `etcd://...`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EtcdConfig {
    pub prefix: String,
    pub lease_ttl_s: u64,
    pub request_timeout_ms: u64,
    pub username: String,
    pub password_file: Option<PathBuf>,
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub domain: String,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            prefix: String::new(),
            lease_ttl_s: 3,
            request_timeout_ms: 2000,
            username: String::new(),
            password_file: None,
            ca_file: None,
            cert_file: None,
            key_file: None,
            domain: String::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MapConfig {
    pub file_size: u64,
    pub extent_size: u64,
    pub page_size: u32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    pub admission: String,
    pub eviction: String,
    pub high_watermark_percent: u32,
    pub low_watermark_percent: u32,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub client_ca_file: Option<PathBuf>,
    pub node_ca_file: Option<PathBuf>,
    pub node_domain: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            cluster_name: "pagewire".into(),
            listen: "127.0.0.1:7400".into(),
            metrics_listen: "127.0.0.1:7401".into(),
            state_file: PathBuf::from("pagewire-coordinator.state"),
            token: String::new(),
            token_file: None,
            lease_ms: 3000,
            heartbeat_interval_ms: 0,
            node_rpc_timeout_ms: 30_000,
            log: "info".into(),
            store: String::new(),
            advertise: String::new(),
            map: MapConfig::default(),
            policy: PolicyConfig::default(),
            tls: TlsConfig::default(),
            etcd: EtcdConfig::default(),
        }
    }
}

impl Default for MapConfig {
    fn default() -> Self {
        Self {
            file_size: 0,
            extent_size: 2 << 20,
            page_size: 4096,
        }
    }
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            admission: "always".into(),
            eviction: "clock".into(),
            high_watermark_percent: 95,
            low_watermark_percent: 85,
        }
    }
}

/// Checks a policy's fields (from a config file or a SetPolicy call).
pub fn validate_policy(p: &Policy) -> Result<(), String> {
    if p.admission() == AdmissionPolicy::Unspecified {
        return Err(format!("unknown admission policy {}", p.admission));
    }
    if p.eviction() == EvictionPolicy::Unspecified {
        return Err(format!("unknown eviction policy {}", p.eviction));
    }
    if p.high_watermark_percent == 0 || p.high_watermark_percent > 100 {
        return Err("high_watermark_percent must be in 1..=100".into());
    }
    if p.low_watermark_percent >= p.high_watermark_percent {
        return Err("low_watermark_percent must be below high_watermark_percent".into());
    }
    Ok(())
}

impl Config {
    /// Reads `path`, or the defaults when `path` is `None`.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source: Box::new(source),
        })
    }

    /// The policy the config asks for (version 1).
    pub fn policy(&self) -> Result<Policy, ConfigError> {
        let admission = parse_admission(&self.policy.admission).ok_or_else(|| {
            invalid(
                "policy.admission",
                format!(
                    "{:?}: expected {}",
                    self.policy.admission,
                    one_of(ADMISSION, admission_name)
                ),
            )
        })?;
        let eviction = parse_eviction(&self.policy.eviction).ok_or_else(|| {
            invalid(
                "policy.eviction",
                format!(
                    "{:?}: expected {}",
                    self.policy.eviction,
                    one_of(EVICTION, eviction_name)
                ),
            )
        })?;
        let p = Policy {
            version: 1,
            admission: admission.into(),
            eviction: eviction.into(),
            high_watermark_percent: self.policy.high_watermark_percent,
            low_watermark_percent: self.policy.low_watermark_percent,
        };
        validate_policy(&p).map_err(|r| invalid("policy", r))?;
        check_implemented(&p).map_err(|r| invalid("policy", r))?;
        Ok(p)
    }

    /// The cluster token: `token`, else the contents of `token_file`, else the
    /// `PAGEWIRE_TOKEN` environment variable (already folded in by the caller).
    pub fn resolve_token(&self) -> Result<String, ConfigError> {
        let token = if !self.token.is_empty() {
            self.token.clone()
        } else if let Some(path) = &self.token_file {
            std::fs::read_to_string(path)
                .map_err(|source| ConfigError::TokenFile {
                    path: path.clone(),
                    source,
                })?
                .trim()
                .to_owned()
        } else {
            return Err(invalid(
                "token",
                "no cluster token: set `token` or `token_file` in the config, \
                 --token-file, or PAGEWIRE_TOKEN",
            ));
        };
        pagewire_proto::auth::validate_token(&token)?;
        Ok(token)
    }

    /// Checks everything that does not need the outside world.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.lease_ms < 100 {
            return Err(invalid("lease_ms", "must be at least 100"));
        }
        if self.heartbeat_interval_ms != 0 && self.heartbeat_interval_ms >= self.lease_ms {
            return Err(invalid(
                "heartbeat_interval_ms",
                "must be shorter than lease_ms",
            ));
        }
        let ps = u64::from(self.map.page_size);
        if !self.map.page_size.is_power_of_two() || !(512..=(1 << 21)).contains(&ps) {
            return Err(invalid(
                "map.page_size",
                "must be a power of two between 512 and 2 MiB",
            ));
        }
        if self.map.extent_size == 0 || !self.map.extent_size.is_multiple_of(ps) {
            return Err(invalid(
                "map.extent_size",
                "must be a non-zero multiple of map.page_size",
            ));
        }
        if self.map.file_size != 0 && self.map.file_size.div_ceil(self.map.extent_size) > 1 << 24 {
            return Err(invalid(
                "map.extent_size",
                "too small for this file: more than 16 Mi extents",
            ));
        }
        if self.cluster_name.is_empty() {
            return Err(invalid("cluster_name", "must not be empty"));
        }
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            return Err(invalid("tls", "cert_file and key_file go together"));
        }
        if self.tls.node_ca_file.is_some() && self.tls.node_domain.is_empty() {
            return Err(invalid(
                "tls.node_domain",
                "required with tls.node_ca_file: the name the nodes' certificates carry",
            ));
        }
        self.policy()?;
        let spec = self.store_spec()?;
        if !self.advertise.is_empty()
            && !self
                .advertise
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0))
        {
            return Err(invalid(
                "advertise",
                format!("{:?} is not host:port", self.advertise),
            ));
        }
        if let crate::store::StoreSpec::Etcd(_) = spec {
            if !cfg!(feature = "etcd") {
                return Err(invalid(
                    "store",
                    "this coordinator was built without the etcd store: rebuild it with \
                     `--features etcd` (its build needs protoc: Debian's protobuf-compiler \
                     and libprotobuf-dev)",
                ));
            }
            let e = &self.etcd;
            if !(2..=3600).contains(&e.lease_ttl_s) {
                return Err(invalid(
                    "etcd.lease_ttl_s",
                    "must be 2 to 3600 seconds (etcd grants no shorter lease)",
                ));
            }
            if !(100..=60_000).contains(&e.request_timeout_ms)
                || e.request_timeout_ms >= e.lease_ttl_s * 1000
            {
                return Err(invalid(
                    "etcd.request_timeout_ms",
                    "must be 100 to 60000 and shorter than etcd.lease_ttl_s",
                ));
            }
            if e.cert_file.is_some() != e.key_file.is_some() {
                return Err(invalid("etcd", "cert_file and key_file go together"));
            }
            // TLS to etcd trusts ca_file only (no system roots): without it
            // no certificate of etcd's could be verified.
            if e.cert_file.is_some() && e.ca_file.is_none() {
                return Err(invalid(
                    "etcd.ca_file",
                    "required with etcd.cert_file: the CA that signed etcd's certificate \
                     (the coordinator trusts no other for etcd)",
                ));
            }
            if e.username.is_empty() != e.password_file.is_none() {
                return Err(invalid("etcd", "username and password_file go together"));
            }
            if self.advertise.is_empty() && self.listen_is_unspecified() {
                return Err(invalid(
                    "advertise",
                    "required with the etcd store when `listen` is a wildcard address: the \
                     address other coordinators name to clients",
                ));
            }
        }
        Ok(())
    }

    /// The store `store` names.
    pub fn store_spec(&self) -> Result<crate::store::StoreSpec, ConfigError> {
        crate::store::StoreSpec::parse(&self.store, &self.state_file)
    }

    fn listen_is_unspecified(&self) -> bool {
        self.listen
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|a| a.ip().is_unspecified())
    }

    /// The etcd key prefix: `etcd.prefix`, else `/pagewire/<cluster_name>/`.
    pub fn etcd_prefix(&self) -> String {
        if self.etcd.prefix.is_empty() {
            format!("/pagewire/{}/", self.cluster_name)
        } else {
            self.etcd.prefix.clone()
        }
    }

    /// With the etcd store, why a leader's death would cost every node its
    /// lease, or `None`. No node lease is renewed from the leader's death
    /// until another leads: up to `etcd.lease_ttl_s` (its etcd lease runs
    /// out) plus etcd's own election and the new leader's start
    /// ([`FAILOVER_SLACK_MS`]). A node's last renewal can be a heartbeat
    /// interval older than the death, so a node lease shorter than the sum
    /// runs out at every failover, and every node registers again (a new
    /// incarnation; its one-sided readers reconnect). Measured in the compose
    /// HA cluster: with `lease_ms` 3000 and `lease_ttl_s` 3, all three nodes
    /// registered again after `docker kill` of the leader; with 6000 and 2,
    /// none did.
    pub fn failover_outlasts_node_leases(&self) -> Option<String> {
        if !self.store.starts_with("etcd://") {
            return None;
        }
        let failover = self.etcd.lease_ttl_s * 1000 + FAILOVER_SLACK_MS;
        let need = failover + self.heartbeat_interval_ms();
        (self.lease_ms < need).then(|| {
            format!(
                "lease_ms {} is shorter than a leader failover (etcd.lease_ttl_s {} s + about {} \
                 ms) plus a heartbeat interval ({} ms): at a leader's death every node's lease \
                 runs out and every node registers again; make lease_ms at least {need} (or \
                 etcd.lease_ttl_s smaller)",
                self.lease_ms,
                self.etcd.lease_ttl_s,
                FAILOVER_SLACK_MS,
                self.heartbeat_interval_ms()
            )
        })
    }

    /// The heartbeat interval handed to nodes.
    pub fn heartbeat_interval_ms(&self) -> u64 {
        if self.heartbeat_interval_ms == 0 {
            (self.lease_ms / 3).max(1)
        } else {
            self.heartbeat_interval_ms
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_config_parses_and_validates() {
        let text = include_str!("../coordinator.example.toml");
        let cfg: Config = toml::from_str(text).unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.map.extent_size, 2 << 20);
    }

    #[cfg(feature = "etcd")]
    #[test]
    fn an_etcd_client_certificate_needs_the_ca() {
        let mut cfg = Config {
            store: "etcd://127.0.0.1:2379".into(),
            advertise: "127.0.0.1:7400".into(),
            ..Config::default()
        };
        cfg.etcd.cert_file = Some("client.crt".into());
        cfg.etcd.key_file = Some("client.key".into());
        let e = cfg.validate().expect_err("cert_file without ca_file");
        assert!(e.to_string().contains("etcd.ca_file"), "{e}");
        cfg.etcd.ca_file = Some("ca.crt".into());
        cfg.validate().expect("ca_file, cert_file and key_file");
    }

    #[test]
    fn a_node_lease_shorter_than_a_failover_is_named() {
        let mut cfg = Config {
            store: "etcd://127.0.0.1:2379".into(),
            advertise: "127.0.0.1:7400".into(),
            lease_ms: 3000,
            ..Config::default()
        };
        cfg.etcd.lease_ttl_s = 3;
        let w = cfg
            .failover_outlasts_node_leases()
            .expect("3 s lease, 3 s etcd lease");
        assert!(
            w.contains("lease_ms 3000") && w.contains("at least 5000"),
            "{w}"
        );
        // The HA deployment's settings (k8s/components/ha/coordinator.toml).
        cfg.lease_ms = 6000;
        cfg.etcd.lease_ttl_s = 2;
        assert_eq!(cfg.failover_outlasts_node_leases(), None);
        // One coordinator: no failover.
        cfg.store = "file".into();
        cfg.lease_ms = 1000;
        assert_eq!(cfg.failover_outlasts_node_leases(), None);
    }

    #[test]
    fn unknown_keys_are_refused() {
        assert!(toml::from_str::<Config>("leese_ms = 5").is_err());
    }

    #[test]
    fn bad_values_are_refused() {
        let mut cfg = Config::default();
        cfg.map.extent_size = 1000;
        assert!(cfg.validate().is_err());
        let mut cfg = Config::default();
        cfg.policy.eviction = "random".into();
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn unimplemented_policies_are_refused_by_name() {
        let every = ADMISSION
            .iter()
            .flat_map(|&a| EVICTION.iter().map(move |&e| (a, e)));
        for (admission, eviction) in every.map(|(a, e)| (admission_name(a), eviction_name(e))) {
            let mut cfg = Config::default();
            cfg.policy.admission = admission.into();
            cfg.policy.eviction = eviction.into();
            let p = Policy {
                version: 1,
                admission: parse_admission(admission).unwrap().into(),
                eviction: parse_eviction(eviction).unwrap().into(),
                high_watermark_percent: 95,
                low_watermark_percent: 85,
            };
            let a = pagewire_proto::policy::IMPLEMENTED_ADMISSION.contains(&p.admission());
            let e = pagewire_proto::policy::IMPLEMENTED_EVICTION.contains(&p.eviction());
            match (cfg.validate(), check_implemented(&p)) {
                (Ok(()), Ok(())) => assert!(a && e, "{admission}/{eviction} accepted"),
                (Err(ce), Err(msg)) => {
                    assert!(!(a && e), "{admission}/{eviction} refused: {msg}");
                    assert!(msg.contains("not implemented") && msg.contains("implemented: "));
                    assert!(ce.to_string().contains(&msg), "{ce}");
                }
                (c, i) => panic!("config says {c:?}, check says {i:?}"),
            }
        }
    }
}
