//! pwctl's exit status and messages without a cluster: a coordinator that
//! is not there (exit 1, said in words), a bad flag or RANGE (exit 2,
//! before any network).

use std::path::PathBuf;
use std::process::Command;

use pagewire_testkit::free_port;

const TOKEN: &str = "test-cluster-token";

fn pwctl_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_pwctl"))
}

#[test]
fn pwctl_against_a_stopped_coordinator_fails_clearly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).expect("token");
    let port = free_port();
    let out = Command::new(pwctl_bin())
        .args(["--coordinator", &format!("127.0.0.1:{port}")])
        .arg("--token-file")
        .arg(&token)
        .args(["--timeout-ms", "2000", "status"])
        .output()
        .expect("run pwctl");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach the coordinator"), "{err}");
    assert!(out.stdout.is_empty());

    // A wrong flag or argument is a usage error (exit 2), before any network.
    let out = Command::new(pwctl_bin())
        .arg("--no-such-flag")
        .output()
        .expect("run pwctl");
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(pwctl_bin())
        .arg("--token-file")
        .arg(&token)
        .args(["warm", "10M..1M"])
        .output()
        .expect("run pwctl");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("RANGE"));
}
