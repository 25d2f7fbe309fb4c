//! The harness of the mount's tests: a loopback cluster (a
//! `pagewire-coordinator` and `pagewire-node` daemons over a backing file),
//! `pagewire-mount` processes on a directory of it, and commands run with a
//! bound on their time.
//!
//! Needs the daemons built beside `pagewire-mount` (`cargo build -p
//! pagewire-node -p pagewire-coordinator` in the same target directory;
//! `cargo test --workspace` builds them), /dev/fuse, fusermount3 (Debian
//! `fuse3`), and per test fio and python3: [`preflight`] fails the test
//! with the name of what is missing.

#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::coordinator_client::CoordinatorClient;
use pagewire_proto::v1::{GetMapRequest, ListNodesRequest, NodeInfo, NodeState, OwnershipMap};

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
    PathBuf::from(env!("CARGO_BIN_EXE_pagewire-mount"))
}

fn daemon_bin(name: &str) -> PathBuf {
    let p = mount_bin().parent().expect("binary dir").join(name);
    assert!(
        p.exists(),
        "{} is not built: run `cargo build -p pagewire-node -p pagewire-coordinator` with the same target directory (cargo test --workspace builds it)",
        p.display()
    );
    p
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(ok.success(), "kill -{signal} {}", self.name);
    }

    /// Its exit status, waiting at most `limit`; None: still running.
    pub fn wait_for_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                return Some(st);
            }
            if start.elapsed() >= limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn print_tail(&self) {
        let log = self.log_text();
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        eprintln!("--- last lines of {} ---", self.name);
        for l in tail.iter().rev() {
            eprintln!("{l}");
        }
    }
}

pub struct Cluster {
    pub dir: tempfile::TempDir,
    port: u16,
    pub lease_ms: u64,
    pub coord: Option<Proc>,
    pub nodes: Vec<Proc>,
    frames: u64,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        for p in self.coord.iter_mut().chain(self.nodes.iter_mut()) {
            p.kill9();
            if panicking {
                p.print_tail();
            }
        }
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

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

type Coord = CoordinatorClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AttachToken>,
>;

impl Cluster {
    /// A cluster of `nodes` nodes of `frames` frames each over a backing
    /// file that `make` writes (at the path it is given); waits until it is
    /// settled.
    pub fn start(nodes: usize, frames: u64, lease_ms: u64, make: impl FnOnce(&Path)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("token"), TOKEN).expect("token file");
        make(&dir.path().join("backing"));
        let mut c = Cluster {
            dir,
            port: free_port(),
            lease_ms,
            coord: None,
            nodes: Vec::new(),
            frames,
        };
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

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn backing(&self) -> PathBuf {
        self.path("backing")
    }

    pub fn coord_addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn start_coordinator(&mut self) {
        let log = self.path("coordinator.log");
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("log");
        let child = Command::new(daemon_bin("pagewire-coordinator"))
            .arg("--listen")
            .arg(self.coord_addr())
            .args(["--metrics-listen", "127.0.0.1:0"])
            .arg("--state-file")
            .arg(self.path("coordinator.state"))
            .arg("--token-file")
            .arg(self.path("token"))
            .arg("--lease-ms")
            .arg(self.lease_ms.to_string())
            .arg("--extent-size")
            .arg(EXTENT.to_string())
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .expect("spawn coordinator");
        self.coord = Some(Proc {
            name: "coordinator".into(),
            child,
            log,
        });
        self.wait_for("the coordinator to answer", |c| c.map().is_some());
    }

    pub fn start_node(&mut self, id: &str) {
        let log = self.path(&format!("{id}.log"));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("log");
        let child = Command::new(daemon_bin("pagewire-node"))
            .args(["--node-id", id])
            .arg("--backing-file")
            .arg(self.backing())
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .arg("--coordinator")
            .arg(self.coord_addr())
            .arg("--token-file")
            .arg(self.path("token"))
            .arg("--frames")
            .arg(self.frames.to_string())
            .arg("--shm-dir")
            .arg(self.path(""))
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .expect("spawn node");
        self.nodes.retain(|p| p.name != id);
        self.nodes.push(Proc {
            name: id.into(),
            child,
            log,
        });
    }

    pub fn node(&mut self, id: &str) -> &mut Proc {
        self.nodes.iter_mut().find(|p| p.name == id).expect("node")
    }

    /// kill -9 of the coordinator and every node.
    pub fn kill_all(&mut self) {
        for p in self.coord.iter_mut().chain(self.nodes.iter_mut()) {
            p.kill9();
        }
    }

    fn coord_call<T, Fut>(&self, call: impl FnOnce(Coord) -> Fut) -> Option<T>
    where
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let addr = self.coord_addr();
        rt().block_on(async move {
            let ch = pagewire_proto::net::connect(&addr, None, Duration::from_secs(2))
                .await
                .ok()?;
            let c =
                CoordinatorClient::with_interceptor(ch, AttachToken::new(TOKEN).expect("token"));
            let r = tokio::time::timeout(Duration::from_secs(5), call(c))
                .await
                .ok()?;
            r.ok().map(tonic::Response::into_inner)
        })
    }

    pub fn map(&self) -> Option<OwnershipMap> {
        self.coord_call(|mut c| async move { c.get_map(GetMapRequest::default()).await })
    }

    fn nodes_info(&self) -> Option<Vec<NodeInfo>> {
        self.coord_call(|mut c| async move { c.list_nodes(ListNodesRequest {}).await })
            .map(|r| r.nodes)
    }

    pub fn wait_for(&self, what: &str, mut ok: impl FnMut(&Self) -> bool) -> Duration {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            if ok(self) {
                return start.elapsed();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("timed out after 30 s waiting for {what}");
    }

    /// Waits until `n` nodes are alive and applied the current epoch, every
    /// extent has an owner and no handoff is in progress.
    pub fn wait_stable(&self, n: usize) -> OwnershipMap {
        let mut out = None;
        self.wait_for(&format!("{n} settled nodes"), |c| {
            let (Some(map), Some(nodes)) = (c.map(), c.nodes_info()) else {
                return false;
            };
            let alive: Vec<&NodeInfo> = nodes
                .iter()
                .filter(|x| x.state == NodeState::Alive as i32)
                .collect();
            let ok = map.epoch != 0
                && alive.len() == n
                && map.owner.iter().all(|&o| o != 0)
                && map.previous_owner.iter().all(|&p| p == 0)
                && alive.iter().all(|x| x.applied_epoch == map.epoch);
            if ok {
                out = Some(map);
            }
            ok
        });
        out.expect("map")
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

    /// kill -9: the mount point is left dead (ENOTCONN).
    pub fn crash(&mut self) {
        self.proc.kill9();
        self.stopped = true;
        self.crashed = true;
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.proc.print_tail();
        }
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
