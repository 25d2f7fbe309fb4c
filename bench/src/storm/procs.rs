//! The storm's processes: a coordinator, the nodes and the readers, each
//! started as a child (this executable's hidden `coordinator`, `node` and
//! `storm-reader` commands, or the real binaries of `--bin-dir`), on
//! loopback or on the hosts of a `--hosts` file (network namespaces), and
//! the faults done to them.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::coordinator_client::CoordinatorClient;
use pagewire_proto::v1::{GetMapRequest, NodeState, OwnershipMap};
use serde::Deserialize;

/// One host of a `--hosts` file: the command prefix that runs a program
/// there, and its address.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Host {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub exec: Vec<String>,
    pub ip: String,
    /// Cuts the host off the network (a `--cut` event).
    #[serde(default)]
    pub cut: Vec<String>,
    /// Heals it (a `--heal` event).
    #[serde(default)]
    pub heal: Vec<String>,
    /// Signals a program this host's `exec` prefix started: the storm
    /// appends the signal's name (`STOP`, `CONT`) and runs it instead of
    /// kill(2), which would reach only the local prefix process (`vm-exec`
    /// on VM hosts). Empty: kill(2) on the child.
    #[serde(default)]
    pub signal: Vec<String>,
}

/// The hosts file (bench/scripts/storm-netns.sh writes one).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hosts {
    pub coordinator: Host,
    #[serde(default)]
    pub node: Vec<Host>,
    #[serde(default)]
    pub reader: Vec<Host>,
    /// Where this process (and Redis) is reached from the hosts.
    #[serde(default)]
    pub orchestrator: Option<Host>,
}

impl Hosts {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the hosts file {}", path.display()))?;
        let h: Hosts = toml::from_str(&text)
            .with_context(|| format!("parsing the hosts file {}", path.display()))?;
        if h.node.is_empty() || h.reader.is_empty() {
            bail!(
                "{}: needs at least one [[node]] and one [[reader]]",
                path.display()
            );
        }
        Ok(h)
    }

    /// Every process on this machine's loopback.
    pub fn loopback(nodes: usize) -> Self {
        let lo = |name: String| Host {
            name,
            ip: "127.0.0.1".into(),
            ..Host::default()
        };
        Hosts {
            coordinator: lo("coordinator".into()),
            node: (1..=nodes).map(|i| lo(format!("node-{i}"))).collect(),
            reader: vec![lo("reader".into())],
            orchestrator: Some(lo("bench".into())),
        }
    }
}

/// A command running `program` behind a host's `exec` prefix (none: here).
pub fn prefixed(exec: &[String], program: impl AsRef<std::ffi::OsStr>) -> Command {
    match exec.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// What runs the cluster's programs.
#[derive(Clone, Debug)]
pub enum Programs {
    /// This executable's hidden `coordinator` and `node` commands.
    SelfExe(PathBuf),
    /// The real binaries in a folder.
    Dir(PathBuf),
}

impl Programs {
    pub fn new(bin_dir: Option<&Path>) -> anyhow::Result<Self> {
        match bin_dir {
            Some(d) => {
                for b in ["pagewire-coordinator", "pagewire-node"] {
                    if !d.join(b).exists() {
                        bail!("--bin-dir {}: no {b} there", d.display());
                    }
                }
                Ok(Programs::Dir(d.to_owned()))
            }
            None => Ok(Programs::SelfExe(
                std::env::current_exe().context("finding this executable")?,
            )),
        }
    }

    fn command(&self, host: &Host, program: &str) -> Command {
        let (bin, sub): (PathBuf, Option<&str>) = match self {
            Programs::SelfExe(exe) => (exe.clone(), Some(program)),
            Programs::Dir(d) => (d.join(format!("pagewire-{program}")), None),
        };
        let mut c = prefixed(&host.exec, &bin);
        if let Some(s) = sub {
            c.arg(s);
        }
        c
    }

    /// A reader process on `host` (always this executable).
    pub fn reader(&self, host: &Host) -> anyhow::Result<Command> {
        let exe = std::env::current_exe().context("finding this executable")?;
        let mut c = prefixed(&host.exec, exe);
        c.arg("storm-reader");
        die_with_parent(&mut c);
        Ok(c)
    }
}

/// The child gets SIGKILL when this process dies (any way), so an
/// interrupted storm leaves no process behind.
pub fn die_with_parent(c: &mut Command) {
    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no
    // memory of the parent; it runs in the child between fork and exec.
    unsafe {
        c.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A started program, killed on drop.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    cmd_line: Vec<String>,
    log: PathBuf,
    paused: bool,
    /// The host's `signal` prefix (see [`Host::signal`]).
    remote_signal: Vec<String>,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command, log: PathBuf) -> anyhow::Result<Self> {
        let cmd_line = std::iter::once(cmd.get_program())
            .chain(cmd.get_args())
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("creating {}", log.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(f)
            .env("RUST_LOG", "warn");
        die_with_parent(&mut cmd);
        let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        Ok(Self {
            name: name.to_owned(),
            child: Some(child),
            cmd_line,
            log,
            paused: false,
            remote_signal: Vec::new(),
        })
    }

    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            if self.paused {
                // SAFETY: kill(2) on our own child's pid.
                unsafe { libc::kill(c.id() as i32, libc::SIGCONT) };
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        self.paused = false;
    }

    pub fn signal(&mut self, sig: libc::c_int) -> anyhow::Result<()> {
        let Some(pid) = self.pid() else {
            bail!("{} is not running", self.name);
        };
        if let Some((first, rest)) = self.remote_signal.split_first() {
            let name = match sig {
                libc::SIGSTOP => "STOP",
                libc::SIGCONT => "CONT",
                libc::SIGTERM => "TERM",
                libc::SIGKILL => "KILL",
                other => bail!(
                    "signal {other}: the hosts file's signal command takes STOP, CONT, TERM, KILL"
                ),
            };
            let st = Command::new(first)
                .args(rest)
                .arg(name)
                .status()
                .with_context(|| format!("running {:?}", self.remote_signal))?;
            if !st.success() {
                bail!("{:?} {name} for {}: {st}", self.remote_signal, self.name);
            }
            self.paused = sig == libc::SIGSTOP;
            return Ok(());
        }
        // SAFETY: kill(2) on our own child's pid, which we have not reaped.
        if unsafe { libc::kill(pid, sig) } != 0 {
            bail!(
                "signal {sig} to {}: {}",
                self.name,
                std::io::Error::last_os_error()
            );
        }
        self.paused = sig == libc::SIGSTOP;
        Ok(())
    }

    /// Whether it exited, and how.
    pub fn exited(&mut self) -> Option<String> {
        match self.child.as_mut().map(|c| c.try_wait()) {
            None => Some("killed by the storm".into()),
            Some(Ok(Some(s))) => Some(s.to_string()),
            Some(Ok(None)) => None,
            Some(Err(e)) => Some(e.to_string()),
        }
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    pub fn describe(&self) -> String {
        self.cmd_line.join(" ")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Everything the cluster's processes need.
pub struct ClusterSpec {
    pub programs: Programs,
    pub hosts: Hosts,
    pub dir: PathBuf,
    pub file: PathBuf,
    pub token_file: PathBuf,
    pub frames_per_node: usize,
    pub lease_ms: u64,
    pub coordinator_port: u16,
    pub shm: bool,
    /// Nodes serve their regions over verbs too.
    pub verbs: bool,
    /// Each node's gRPC port (index: node), so that a node restarted in
    /// place comes back at the same address; empty: any free port.
    pub node_ports: Vec<u16>,
    /// More coordinators (the nemesis's failover on etcd): their ports.
    pub standby_ports: Vec<u16>,
    /// The coordinators' store (`etcd://...`; `None`: a state file).
    pub store: Option<String>,
    /// More arguments for every coordinator (`--extent-size`, `--config`).
    pub coordinator_args: Vec<String>,
}

/// The coordinator and the nodes.
pub struct Cluster {
    pub spec: ClusterSpec,
    pub coordinator: Proc,
    pub nodes: Vec<Proc>,
    /// The coordinators of `spec.standby_ports`, in order.
    pub standby: Vec<Proc>,
}

pub fn free_port(ip: &str) -> anyhow::Result<u16> {
    // On a namespace host the port is picked in the root namespace: any
    // high port is as free there, and the coordinator reports a clash.
    let ip = if ip.starts_with("127.") {
        ip
    } else {
        "127.0.0.1"
    };
    Ok(std::net::TcpListener::bind((ip, 0))?.local_addr()?.port())
}

impl ClusterSpec {
    pub fn coordinator_addr(&self) -> String {
        format!("{}:{}", self.hosts.coordinator.ip, self.coordinator_port)
    }

    /// Every coordinator's address, comma-separated (what nodes and
    /// clients are given).
    pub fn coordinator_list(&self) -> String {
        std::iter::once(self.coordinator_port)
            .chain(self.standby_ports.iter().copied())
            .map(|p| format!("{}:{p}", self.hosts.coordinator.ip))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn start_coordinator(&self) -> anyhow::Result<Proc> {
        self.start_coordinator_on(0)
    }

    /// Coordinator `i`: 0 is `coordinator`, `i` the standby `i - 1`
    /// (named `coordinator-{i+1}`).
    pub fn start_coordinator_on(&self, i: usize) -> anyhow::Result<Proc> {
        let h = &self.hosts.coordinator;
        let (name, port) = match i {
            0 => ("coordinator".to_owned(), self.coordinator_port),
            _ => (
                format!("coordinator-{}", i + 1),
                *self
                    .standby_ports
                    .get(i - 1)
                    .with_context(|| format!("no standby coordinator {i}"))?,
            ),
        };
        let mut c = self.programs.command(h, "coordinator");
        c.arg("--listen")
            .arg(format!("{}:{port}", h.ip))
            .args(["--metrics-listen", ""])
            .arg("--token-file")
            .arg(&self.token_file)
            .arg("--lease-ms")
            .arg(self.lease_ms.to_string())
            .args(&self.coordinator_args);
        match &self.store {
            Some(s) => c.arg("--store").arg(s),
            None => c
                .arg("--state-file")
                .arg(self.dir.join(format!("{name}.state"))),
        };
        Proc::spawn(&name, c, self.dir.join(format!("{name}.log")))
    }

    /// Node `i` (0-based): id `node-{i+1}`.
    fn start_node(&self, i: usize) -> anyhow::Result<Proc> {
        let h = &self.hosts.node[i];
        let name = format!("node-{}", i + 1);
        let config = self.dir.join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "[transports]\nshm = {}\nshm_dir = {:?}\ntcp = true\nverbs = {}\n",
                self.shm,
                self.dir.join("shm").display().to_string(),
                self.verbs
            ),
        )?;
        std::fs::create_dir_all(self.dir.join("shm"))?;
        let mut c = self.programs.command(h, "node");
        let port = self.node_ports.get(i).copied().unwrap_or(0);
        c.arg("--config")
            .arg(&config)
            .args(["--node-id", &name])
            .arg("--backing-file")
            .arg(&self.file)
            .arg("--listen")
            .arg(format!("{}:{port}", h.ip))
            .args(["--metrics-listen", ""])
            .arg("--coordinator")
            .arg(self.coordinator_list())
            .arg("--token-file")
            .arg(&self.token_file)
            .arg("--frames")
            .arg(self.frames_per_node.to_string());
        let mut p = Proc::spawn(&name, c, self.dir.join(format!("{name}.log")))?;
        p.remote_signal.clone_from(&h.signal);
        Ok(p)
    }
}

/// A current-thread runtime for the orchestrator's own RPCs.
pub fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// `call` on each coordinator of `addrs` (host:port, or a comma-separated
/// list of coordinators sharing an etcd store) in turn, until one answers:
/// a follower refuses a write, or a read it cannot confirm, with
/// `UNAVAILABLE`, and the leader is somewhere in the list. The error names
/// every coordinator's failure.
fn on_a_coordinator<T, F, Fut>(addrs: &str, call: F) -> anyhow::Result<T>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let list = pagewire_proto::leader::parse_address_list(addrs)
        .with_context(|| format!("--coordinator {addrs:?}"))?;
    rt()?.block_on(async {
        let mut failures = Vec::new();
        for addr in list {
            match call(addr.clone()).await {
                Ok(v) => return Ok(v),
                Err(e) => failures.push(format!("{addr}: {e:#}")),
            }
        }
        bail!("no coordinator answered ({})", failures.join("; "))
    })
}

/// The coordinators' current map.
pub fn get_map(addrs: &str, token: &str) -> anyhow::Result<OwnershipMap> {
    on_a_coordinator(addrs, |addr| async move {
        let ch = pagewire_proto::net::connect(&addr, None, Duration::from_secs(1)).await?;
        let mut c = CoordinatorClient::with_interceptor(ch, AttachToken::new(token)?);
        let m = tokio::time::timeout(Duration::from_secs(2), c.get_map(GetMapRequest::default()))
            .await
            .context("GetMap timed out")??
            .into_inner();
        Ok(m)
    })
}

/// Faults the whole file in across the cluster (the coordinator's `Warm`,
/// as `pwctl warm`); returns the pages the nodes faulted in. Fails when a
/// node reported an error.
pub fn warm(addrs: &str, token: &str, file_size: u64) -> anyhow::Result<u64> {
    on_a_coordinator(addrs, |addr| async move {
        let ch = pagewire_proto::net::connect(&addr, None, Duration::from_secs(1)).await?;
        let mut c = CoordinatorClient::with_interceptor(ch, AttachToken::new(token)?);
        let r = tokio::time::timeout(
            Duration::from_secs(300),
            c.warm(pagewire_proto::v1::ClusterRangeRequest {
                range: Some(pagewire_proto::v1::ByteRange {
                    offset: 0,
                    length: file_size,
                }),
            }),
        )
        .await
        .context("Warm timed out")??
        .into_inner();
        let mut pages = 0;
        for n in &r.results {
            if !n.error.is_empty() {
                bail!("warming {}: {}", n.node_id, n.error);
            }
            pages += n.pages;
        }
        Ok(pages)
    })
}

/// Drains a node (`undrain`: undrains it) through the coordinator's admin
/// API, as `pwctl drain` does; the epoch of the map it published.
pub fn drain(addr: &str, token: &str, node_id: &str, undrain: bool) -> anyhow::Result<u64> {
    rt()?.block_on(async {
        let ch = pagewire_proto::net::connect(addr, None, Duration::from_secs(1)).await?;
        let mut c = CoordinatorClient::with_interceptor(ch, AttachToken::new(token)?);
        let req = pagewire_proto::v1::DrainRequest {
            node_id: node_id.to_owned(),
            incarnation: 0,
        };
        let r = tokio::time::timeout(Duration::from_secs(3), async {
            if undrain {
                c.undrain(req).await
            } else {
                c.drain(req).await
            }
        })
        .await
        .context("Drain timed out")??
        .into_inner();
        Ok(r.map_epoch)
    })
}

/// Evicts every page of the file from every node's cache (the
/// coordinator's `Evict`, as `pwctl evict all`); the pages evicted.
pub fn evict(addr: &str, token: &str, file_size: u64) -> anyhow::Result<u64> {
    rt()?.block_on(async {
        let ch = pagewire_proto::net::connect(addr, None, Duration::from_secs(1)).await?;
        let mut c = CoordinatorClient::with_interceptor(ch, AttachToken::new(token)?);
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            c.evict(pagewire_proto::v1::ClusterRangeRequest {
                range: Some(pagewire_proto::v1::ByteRange {
                    offset: 0,
                    length: file_size,
                }),
            }),
        )
        .await
        .context("Evict timed out")??
        .into_inner();
        Ok(r.results.iter().map(|n| n.pages).sum())
    })
}

/// Whether `m` has `nodes` live nodes, every extent owned, no handoff.
pub fn settled(m: &OwnershipMap, nodes: usize) -> bool {
    let alive = m
        .nodes
        .iter()
        .filter(|n| n.state == NodeState::Alive as i32)
        .count();
    alive == nodes
        && m.epoch > 0
        && !m.owner.is_empty()
        && m.owner.iter().all(|&o| o != 0)
        && m.previous_owner.iter().all(|&o| o == 0)
}

impl Cluster {
    /// Starts the coordinator and every node and waits (bounded) until the
    /// map has settled with all of them.
    pub fn start(spec: ClusterSpec, token: &str, stop: &dyn Fn() -> bool) -> anyhow::Result<Self> {
        let n = spec.hosts.node.len();
        Self::start_with(spec, token, n, stop)
    }

    /// [`Cluster::start`] with the first `nodes` nodes of the hosts (the
    /// others are left for [`Cluster::join`]), and every standby
    /// coordinator.
    pub fn start_with(
        spec: ClusterSpec,
        token: &str,
        nodes: usize,
        stop: &dyn Fn() -> bool,
    ) -> anyhow::Result<Self> {
        let coordinator = spec.start_coordinator()?;
        let mut standby = Vec::new();
        for i in 0..spec.standby_ports.len() {
            standby.push(spec.start_coordinator_on(i + 1)?);
        }
        let mut c = Cluster {
            coordinator,
            nodes: Vec::new(),
            standby,
            spec,
        };
        for i in 0..nodes.min(c.spec.hosts.node.len()) {
            let h = &c.spec.hosts.node[i];
            if !h.exec.is_empty() {
                eprintln!("storm: node-{} on host {} ({})", i + 1, h.name, h.ip);
            }
            let n = c.spec.start_node(i)?;
            c.nodes.push(n);
        }
        c.wait_settled(token, Duration::from_secs(60), stop)?;
        Ok(c)
    }

    pub fn wait_settled(
        &mut self,
        token: &str,
        limit: Duration,
        stop: &dyn Fn() -> bool,
    ) -> anyhow::Result<OwnershipMap> {
        let deadline = Instant::now() + limit;
        let want = self.nodes.len();
        loop {
            if stop() {
                bail!("interrupted");
            }
            for p in std::iter::once(&mut self.coordinator).chain(self.nodes.iter_mut()) {
                if let Some(how) = p.exited() {
                    bail!(
                        "{} exited ({how}) while the cluster started\n  command: {}\n{}",
                        p.name,
                        p.describe(),
                        p.log_tail()
                    );
                }
            }
            if let Ok(m) = get_map(&self.spec.coordinator_addr(), token)
                && settled(&m, want)
            {
                return Ok(m);
            }
            if Instant::now() > deadline {
                bail!(
                    "the cluster did not settle within {limit:?} (logs in {})",
                    self.spec.dir.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts the next node of the hosts (a new id): its name.
    pub fn join(&mut self) -> anyhow::Result<String> {
        let i = self.nodes.len();
        if i >= self.spec.hosts.node.len() {
            bail!("no spare node host to join");
        }
        let p = self.spec.start_node(i)?;
        let name = p.name.clone();
        self.nodes.push(p);
        Ok(name)
    }

    /// kill -9 then start again at once: the same id and (with
    /// `node_ports`) the same address, within the old lease.
    pub fn restart_in_place(&mut self, target: &str) -> anyhow::Result<()> {
        let i = self
            .nodes
            .iter()
            .position(|p| p.name == target)
            .with_context(|| format!("no node {target:?}"))?;
        self.nodes[i].kill();
        self.nodes[i] = self.spec.start_node(i)?;
        Ok(())
    }

    /// The process a fault names (`coordinator`, `coordinator-N` or
    /// `node-N`).
    pub fn proc_mut(&mut self, target: &str) -> anyhow::Result<&mut Proc> {
        if target == "coordinator" {
            return Ok(&mut self.coordinator);
        }
        if let Some(p) = self.standby.iter_mut().find(|p| p.name == target) {
            return Ok(p);
        }
        self.nodes
            .iter_mut()
            .find(|p| p.name == target)
            .with_context(|| format!("no process {target:?} in this storm"))
    }

    pub fn restart(&mut self, target: &str) -> anyhow::Result<()> {
        let fresh = if target == "coordinator" {
            self.spec.start_coordinator()?
        } else if let Some(i) = self.standby.iter().position(|p| p.name == target) {
            self.spec.start_coordinator_on(i + 1)?
        } else {
            let i = self
                .nodes
                .iter()
                .position(|p| p.name == target)
                .with_context(|| format!("no process {target:?} in this storm"))?;
            self.spec.start_node(i)?
        };
        let p = self.proc_mut(target)?;
        p.kill();
        *p = fresh;
        Ok(())
    }

    /// Runs a host's `cut` or `heal` command.
    pub fn net(&self, target: &str, heal: bool) -> anyhow::Result<()> {
        let i = self
            .nodes
            .iter()
            .position(|p| p.name == target)
            .with_context(|| format!("--cut/--heal: no node {target:?}"))?;
        let h = &self.spec.hosts.node[i];
        let cmd = if heal { &h.heal } else { &h.cut };
        let Some((first, rest)) = cmd.split_first() else {
            bail!(
                "{target}: the hosts file gives no {} command",
                if heal { "heal" } else { "cut" }
            );
        };
        let st = Command::new(first)
            .args(rest)
            .status()
            .with_context(|| format!("running {cmd:?}"))?;
        if !st.success() {
            bail!("{cmd:?}: {st}");
        }
        Ok(())
    }
}
