//! What every end-to-end test file takes from this package: its builds of
//! the daemons and pwctl.

#![allow(dead_code)]

use std::path::PathBuf;

use pagewire_testkit::cluster::Daemons;

/// The coordinator and node binaries this package built for its tests.
pub fn daemons() -> Daemons {
    Daemons {
        coordinator: env!("CARGO_BIN_EXE_e2e-pagewire-coordinator").into(),
        node: env!("CARGO_BIN_EXE_e2e-pagewire-node").into(),
    }
}

pub fn pwctl_bin() -> PathBuf {
    env!("CARGO_BIN_EXE_e2e-pwctl").into()
}
