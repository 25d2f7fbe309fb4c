//! A node that cannot serve what it is asked to refuses to start, with an
//! error that names the setting, the path or OS error, and the fix, before
//! it registers with the coordinator or serves anything. Verbs: built
//! without RDMA support, a memlock limit below the region, no RDMA device,
//! a GID index that does not exist. shm: a directory that cannot be
//! created, a second node of the same id on the host (a missing directory
//! is created instead).
//!
//! The coordinator address given is a port nothing listens on: a node that
//! got as far as registering would keep retrying it (and never exit), so a
//! prompt exit with the error proves the refusal came first.
//!
//! The tests that need a device are ignored here and run in the soft-RoCE
//! VM (`rdma/scripts/softroce-test.sh`, with `PAGEWIRE_NODE_BIN` naming
//! the binary on its share).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `pagewire-node` with `args` on a small cache, returns (exit code,
/// stderr); fails the test if it has not exited within 20 s.
fn run_node(dir: &Path, args: &[&str], pre: Option<fn() -> std::io::Result<()>>) -> (i32, String) {
    let mut child = spawn_node(dir, args, pre);
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            return (st.code().unwrap_or(-1), err);
        }
        if t0.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let mut err = String::new();
            let _ = child.wait();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            panic!("pagewire-node did not refuse to start within 20 s:\n{err}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `pagewire-node` with `args` (`--shm-dir dir` unless `args` name
/// one) on a small cache, its stderr piped.
fn spawn_node(
    dir: &Path,
    args: &[&str],
    pre: Option<fn() -> std::io::Result<()>>,
) -> std::process::Child {
    let file = dir.join("data.bin");
    std::fs::write(&file, vec![0u8; 1 << 20]).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, "verbs-start-test-token").unwrap();
    // Inside the soft-RoCE VM the binary is on the 9p share, not where cargo
    // built it.
    let bin = std::env::var("PAGEWIRE_NODE_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_pagewire-node").to_owned());
    let mut c = Command::new(bin);
    c.arg("--backing-file")
        .arg(&file)
        .arg("--token-file")
        .arg(&token)
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", ""])
        .args(["--coordinator", "127.0.0.1:9", "--frames", "256"]);
    if !args.contains(&"--shm-dir") {
        c.arg("--shm-dir").arg(dir);
    }
    c.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(f) = pre {
        use std::os::unix::process::CommandExt;
        // SAFETY: `f` makes only async-signal-safe system calls.
        unsafe { c.pre_exec(f) };
    }
    c.spawn().expect("start pagewire-node")
}

/// Kills the node on drop (a test that fails must not leave it running).
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until `path` exists (the node created it) or 20 s pass.
fn appears(path: &Path, node: &mut Running) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) {
        if path.exists() {
            return true;
        }
        if let Some(st) = node.0.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(node.0.stderr.as_mut().unwrap(), &mut err).unwrap();
            panic!("pagewire-node exited ({st}) before creating {path:?}:\n{err}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn a_missing_shm_dir_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let shm = dir.path().join("not/yet");
    let mut node = Running(spawn_node(
        dir.path(),
        &["--node-id", "fresh", "--shm-dir", shm.to_str().unwrap()],
        None,
    ));
    // The shm owner's control file: the node got past its start-up checks
    // (it then keeps trying to register with a coordinator that is not
    // there).
    assert!(
        appears(&shm.join("pagewire-node-fresh"), &mut node),
        "no shm owner in {shm:?}"
    );
}

#[test]
fn an_shm_dir_that_cannot_be_created_is_named_with_the_os_error_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let shm = file.join("shm");
    let (code, err) = run_node(dir.path(), &["--shm-dir", shm.to_str().unwrap()], None);
    assert_ne!(code, 0, "{err}");
    for want in [
        "transports.shm_dir",
        shm.to_str().unwrap(),
        "Not a directory (os error 20)",
        "--shm-dir",
    ] {
        assert!(err.contains(want), "{want:?} missing from: {err}");
    }
}

#[test]
fn a_second_node_with_the_same_id_on_one_host_is_told_to_pick_another_id() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = Running(spawn_node(dir.path(), &["--node-id", "twin"], None));
    assert!(
        appears(&dir.path().join("pagewire-node-twin"), &mut first),
        "the first node did not start its shm owner"
    );
    let (code, err) = run_node(dir.path(), &["--node-id", "twin"], None);
    assert_ne!(code, 0, "{err}");
    for want in [
        "transports.shm",
        "--node-id twin",
        "on this host",
        "its own --node-id",
    ] {
        assert!(err.contains(want), "{want:?} missing from: {err}");
    }
}

#[cfg(not(feature = "verbs"))]
#[test]
fn verbs_without_rdma_support_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = run_node(dir.path(), &["--verbs"], None);
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("transports.verbs") && err.contains("built without RDMA support"),
        "{err}"
    );
}

/// In the child: a 64 KiB memlock limit, and no CAP_IPC_LOCK (root would
/// be exempt from the limit otherwise).
#[cfg(feature = "verbs")]
fn low_memlock() -> std::io::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: 64 << 10,
        rlim_max: 64 << 10,
    };
    // SAFETY: setrlimit with a valid struct; async-signal-safe.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Out of the bounding set: a root child would get every bounding
    // capability back at exec.
    // SAFETY: prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK); async-signal-safe.
    if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, 14, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(feature = "verbs")]
#[test]
fn a_memlock_limit_below_the_region_is_refused_with_how_to_raise_it() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = run_node(dir.path(), &["--verbs"], Some(low_memlock));
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("RLIMIT_MEMLOCK")
            && err.contains("65536 bytes")
            && err.contains("ulimit -l unlimited")
            && err.contains("--ulimit memlock=-1:-1"),
        "{err}"
    );
    assert!(!err.contains("registered with the coordinator"), "{err}");
}

#[cfg(feature = "verbs")]
#[test]
fn no_rdma_device_is_refused() {
    if std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some()) {
        eprintln!("skipped: this host has an RDMA device");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = run_node(dir.path(), &["--verbs"], None);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("no RDMA device on this host"), "{err}");
}

#[cfg(feature = "verbs")]
#[test]
#[ignore = "needs an RDMA device: rdma/scripts/softroce-test.sh runs it"]
fn a_gid_index_that_does_not_exist_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = run_node(dir.path(), &["--verbs", "--verbs-gid-index", "200"], None);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("GID index 200 does not exist"), "{err}");
}

#[cfg(feature = "verbs")]
#[test]
#[ignore = "needs an RDMA device: rdma/scripts/softroce-test.sh runs it"]
fn a_device_that_does_not_exist_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = run_node(dir.path(), &["--verbs", "--verbs-device", "mlx5_9"], None);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("no RDMA device named \"mlx5_9\""), "{err}");
}
