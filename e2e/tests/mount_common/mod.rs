//! The harness of the mount's tests: a loopback cluster (a
//! `pagewire-coordinator` and `pagewire-node` daemons over a backing file),
//! `pagewire-mount` processes on a directory of it, and commands run with a
//! bound on their time.
//!
//! The cluster is the test kit's (`pagewire_testkit::cluster`). The mount
//! and the daemons are this package's own binaries (cargo builds them
//! before the tests). Needs /dev/fuse, fusermount3 (Debian `fuse3`), and
//! per test fio and python3: [`preflight`] fails the test with the name of
//! what is missing.

#![allow(dead_code)]

use std::ops::{Deref, DerefMut};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pagewire_testkit::cluster::Daemons;
use pagewire_testkit::process::Proc;

pub const TOKEN: &str = "mount-test-token";
pub const PS: usize = 4096;
/// 16 pages per extent.
pub const EXTENT: u64 = 64 << 10;

static SERIAL: Mutex<()> = Mutex::new(());

/// One test at a time: each starts a cluster and mounts (two cores in CI).
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Fails the test, naming what is missing, unless FUSE works here and each
/// of `tools` is on the PATH.
pub fn preflight(tools: &[&str]) {
    let mut missing = Vec::new();
    if !Path::new("/dev/fuse").exists() {
        missing.push("/dev/fuse (the fuse kernel module, or the device in the container)".into());
    }
    for t in std::iter::once(&"fusermount3").chain(tools) {
        let found = Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {t}"))
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            let pkg = match *t {
                "fusermount3" => "fuse3",
                "fio" => "fio",
                "python3" => "python3",
                other => other,
            };
            missing.push(format!("{t} (Debian package {pkg})"));
        }
    }
    assert!(
        missing.is_empty(),
        "the mount tests need: {}",
        missing.join(", ")
    );
}

pub fn mount_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_e2e-pagewire-mount"))
}

fn daemons() -> Daemons {
    Daemons {
        coordinator: env!("CARGO_BIN_EXE_e2e-pagewire-coordinator").into(),
        node: env!("CARGO_BIN_EXE_e2e-pagewire-node").into(),
    }
}

/// The kit's loopback cluster, with one cache size for every node, that
/// detaches the mounts a failed test left under its directory.
pub struct Cluster {
    inner: pagewire_testkit::cluster::Cluster,
    frames: u64,
}

impl Deref for Cluster {
    type Target = pagewire_testkit::cluster::Cluster;
    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

impl DerefMut for Cluster {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.inner
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Mounts still under the directory (a failed test): detach them
        // before the directory is removed.
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let dir = self.dir.path().to_string_lossy().into_owned();
        for m in info.lines().filter_map(|l| l.split(' ').nth(4)) {
            if m.starts_with(&dir) {
                let _ = Command::new("fusermount3").args(["-u", "-z", m]).status();
            }
        }
    }
}

impl Cluster {
    /// A client of the cluster (its own map follower), as another program
    /// would have: what the tests write "elsewhere" with.
    pub fn client(&self) -> pagewire_client::ClusterClient {
        let follower =
            pagewire_client::MapFollower::start(&self.coord_addr(), TOKEN).expect("follower");
        pagewire_client::ClusterClient::new(follower, TOKEN, Default::default()).expect("client")
    }

    /// A cluster of `nodes` nodes of `frames` frames each over a backing
    /// file that `make` writes (at the path it is given); waits until it is
    /// settled.
    pub fn start(nodes: usize, frames: u64, lease_ms: u64, make: impl FnOnce(&Path)) -> Self {
        let inner =
            pagewire_testkit::cluster::Cluster::new(daemons(), TOKEN, lease_ms, EXTENT, "backing");
        make(&inner.backing);
        let mut c = Cluster { inner, frames };
        c.start_coordinator();
        for i in 1..=nodes {
            c.start_node(&format!("n{i}"));
        }
        c.wait_stable(nodes);
        c
    }

    /// Over a `pattern` file of `len` bytes.
    pub fn pattern(nodes: usize, len: u64) -> Self {
        Self::start(nodes, 2048, 1000, |p| {
            pagewire_node::pattern::generate_file(p, len, PS).expect("backing file")
        })
    }

    pub fn backing(&self) -> PathBuf {
        self.inner.backing.clone()
    }

    /// Starts node `id` (again), with the cluster's cache size.
    pub fn start_node(&mut self, id: &str) {
        let frames = self.frames;
        self.inner.start_node(id, frames);
    }

    /// kill -9 of the coordinator and every node.
    pub fn kill_all(&mut self) {
        for p in self
            .inner
            .coord
            .iter_mut()
            .chain(self.inner.nodes.iter_mut())
        {
            p.kill9();
        }
    }
}

/// Whether `path` is a mount point now (/proc/self/mountinfo).
pub fn is_mounted(path: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let p = path.to_string_lossy();
    info.lines()
        .any(|l| l.split(' ').nth(4).is_some_and(|m| m == p))
}

/// A `pagewire-mount` process.
pub struct Mount {
    pub proc: Proc,
    pub dir: PathBuf,
    stopped: bool,
    /// Left dead on purpose (crash): no clean-up at drop.
    crashed: bool,
}

impl Mount {
    /// Mounts `cluster` on `<its dir>/<mnt>` with `args`, and waits (30 s
    /// at most) until the file shows the backing file's size.
    pub fn start(cluster: &Cluster, mnt: &str, args: &[&str]) -> Self {
        let dir = cluster.path(mnt);
        std::fs::create_dir_all(&dir)
            .or_else(|e| {
                // A dead mount left there (the crash test): the mount cleans it.
                if e.raw_os_error() == Some(libc::ENOTCONN) {
                    Ok(())
                } else {
                    Err(e)
                }
            })
            .expect("mount dir");
        Self::start_on(cluster, &dir, args)
    }

    pub fn start_on(cluster: &Cluster, dir: &Path, args: &[&str]) -> Self {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let log = cluster.path(&format!("{name}.log"));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("log");
        let log_from = std::fs::metadata(&log)
            .map(|m| m.len() as usize)
            .unwrap_or(0);
        let child = Command::new(mount_bin())
            .arg("--coordinator")
            .arg(cluster.coord_addr())
            .arg("--token-file")
            .arg(cluster.path("token"))
            .args(args)
            .arg(dir)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .expect("spawn pagewire-mount");
        // Not `Proc::start`, which clears RUST_LOG.
        let mut m = Mount {
            proc: Proc {
                name: format!("pagewire-mount on {name}"),
                child,
                log,
            },
            dir: dir.to_owned(),
            stopped: false,
            crashed: false,
        };
        let want = std::fs::metadata(cluster.backing()).expect("backing").len();
        let start = Instant::now();
        loop {
            if let Some(st) = m.proc.child.try_wait().expect("wait") {
                m.stopped = true;
                m.proc.print_tail();
                panic!("pagewire-mount exited at start: {st}");
            }
            // Its own "mounted on" line first: a dead mount left there may
            // still answer stat from cached attributes.
            let up = m
                .proc
                .log_text()
                .get(log_from..)
                .is_some_and(|l| l.contains("mounted on "));
            if up && is_mounted(dir) && std::fs::metadata(m.file()).is_ok_and(|md| md.len() == want)
            {
                return m;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the mount did not show the file within 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn file(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The file opened for reading and writing (a `--writable` mount).
    pub fn open_rw(&self) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.file())
            .expect("open the mount's file for reading and writing")
    }

    /// SIGTERM; the exit status (10 s at most) and whether the mount point
    /// is unmounted after it.
    pub fn stop(&mut self) -> (ExitStatus, bool) {
        self.proc.signal("TERM");
        let st = self
            .proc
            .wait_for_exit(Duration::from_secs(10))
            .unwrap_or_else(|| {
                self.proc.print_tail();
                panic!("pagewire-mount did not exit within 10 s of SIGTERM")
            });
        self.stopped = true;
        (st, !is_mounted(&self.dir))
    }

    /// [`Mount::stop`], which must exit 0 and unmount; then the first line
    /// of its log holding `needle` (one of its unmount lines).
    pub fn stop_and_find(&mut self, needle: &str) -> String {
        let (st, unmounted) = self.stop();
        assert!(st.success() && unmounted, "{st}, unmounted: {unmounted}");
        let log = self.proc.log_text();
        log.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} line in the mount's log:\n{log}"))
            .to_owned()
    }

    /// kill -9: the mount point is left dead (ENOTCONN).
    pub fn crash(&mut self) {
        self.proc.kill9();
        self.stopped = true;
        self.crashed = true;
    }
}

/// Then `proc` is dropped: killed, and its log's tail shown if the test
/// panics.
impl Drop for Mount {
    fn drop(&mut self) {
        if !self.stopped {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(self.proc.child.id().to_string())
                .status();
            if self.proc.wait_for_exit(Duration::from_secs(5)).is_none() {
                self.proc.kill9();
            }
        }
        if is_mounted(&self.dir) && !self.crashed {
            let _ = Command::new("fusermount3")
                .args(["-u", "-z"])
                .arg(&self.dir)
                .status();
        }
    }
}

/// Runs `cmd` (through `sh -c`), killing it and failing the test if it
/// takes longer than `limit`; its output.
pub fn sh_bounded(cmd: &str, limit: Duration) -> Output {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("spawn sh");
    let out = child.stdout.take().unwrap();
    let err = child.stderr.take().unwrap();
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let (o, e) = (read(Box::new(out)), read(Box::new(err)));
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if start.elapsed() > limit {
            // The whole group: sh and what it started.
            let _ = Command::new("kill")
                .arg("-KILL")
                .arg(format!("-{}", child.id()))
                .status();
            let _ = child.wait();
            panic!("`{cmd}` did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: o.join().unwrap(),
        stderr: e.join().unwrap(),
    }
}

/// [`sh_bounded`] that must succeed; its stdout.
pub fn sh_ok(cmd: &str, limit: Duration) -> String {
    let out = sh_bounded(cmd, limit);
    assert!(
        out.status.success(),
        "`{cmd}` failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
