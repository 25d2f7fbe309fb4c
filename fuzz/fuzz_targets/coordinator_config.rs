//! The coordinator's config file: TOML parse, validation (which parses the
//! policy and the store), and the values the coordinator derives from it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagewire_coordinator::Config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = toml::from_str::<Config>(text) else {
        return;
    };
    if cfg.validate().is_ok() {
        cfg.policy().expect("a valid config has a policy");
        cfg.store_spec().expect("a valid config has a store");
        let _ = (cfg.etcd_prefix(), cfg.heartbeat_interval_ms());
        assert!(cfg.heartbeat_interval_ms() < cfg.lease_ms);
    }
});
