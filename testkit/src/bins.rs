//! Binaries the tests start. A test finds its own package's binaries with
//! `env!("CARGO_BIN_EXE_<name>")` (cargo builds them before the tests);
//! [`beside`] finds another package's in the same target directory, which
//! cargo builds only when asked to.

use std::path::PathBuf;

/// `name` in the directory of the binaries cargo built with this test
/// (`target/<profile>/`, the parent of the test's `deps/`). Panics, saying
/// how to build it, when it is not there.
pub fn beside(name: &str, build: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the target directory");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is not built: run `{build}` (same profile and target directory as the tests)",
        p.display()
    );
    p
}
