//! A one-node cluster on loopback for the two-sided rows: a
//! `pagewire-coordinator` and one `pagewire-node` daemon (the real owner,
//! serving gRPC `Read`) over the bench's file, every page warmed.
//!
//! The binaries are looked up next to `pagewire-bench` (same target
//! directory) unless `--bin-dir` names another folder; with neither there,
//! this executable's own hidden `coordinator` and `node` commands (the same
//! code) serve.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::coordinator_client::CoordinatorClient;
use pagewire_proto::v1::node_client::NodeClient;
use pagewire_proto::v1::{
    GetMapRequest, NodeRangeRequest, PageRun, TransportDescriptor, TransportsRequest,
};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

pub type NodeRpc = NodeClient<InterceptedService<Channel, AttachToken>>;

/// Where the owner's programs run: this machine, or another one through a
/// command prefix (`pagewire-bench vm-exec ADDR NAME --`; the programs and
/// the files named must be at the same paths there), and the address they
/// listen on.
#[derive(Clone, Debug)]
pub struct Placement {
    pub exec: Vec<String>,
    pub ip: String,
    /// The node serves its region over verbs too.
    pub verbs: bool,
}

impl Placement {
    /// A command running `program` there; `exec` prefixes name the program
    /// after a `--`-ended prefix, with its name as the vm-exec NAME.
    pub fn command(&self, program: &Path) -> Command {
        crate::storm::prefixed(&self.exec, program)
    }

    /// The whole machine's busy CPU time there (user, nice, system, irq,
    /// softirq of every CPU from `/proc/stat`), µs: on soft-RoCE the
    /// owner's side of a READ runs in the kernel's softirq, not in any
    /// process.
    pub fn machine_cpu_us(&self) -> Option<f64> {
        let text = if self.exec.is_empty() {
            std::fs::read_to_string("/proc/stat").ok()?
        } else {
            let mut c = self.command(Path::new("cat"));
            let out = c
                .arg("/proc/stat")
                .stderr(Stdio::piped())
                .stdout(Stdio::null())
                .output()
                .ok()?;
            // vm-exec puts the program's output on its stderr.
            String::from_utf8_lossy(&out.stderr).into_owned()
        };
        let line = text.lines().find(|l| l.starts_with("cpu "))?;
        let f: Vec<f64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq
        let busy = f.first()? + f.get(1)? + f.get(2)? + f.get(5)? + f.get(6)?;
        Some(busy * 1e6 / super::owner::clock_ticks())
    }
}

/// A running coordinator and node; both killed on drop.
pub struct Cluster {
    coordinator: Child,
    node: Child,
    pub node_addr: String,
    /// The coordinator's `host:port`.
    pub coordinator_addr: String,
    pub map_epoch: u64,
    pub transports: Vec<TransportDescriptor>,
    token: String,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in [&mut self.node, &mut self.coordinator] {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A program and the arguments that come before its own.
pub type Program = (PathBuf, Vec<&'static str>);

/// How to run `pagewire-coordinator` and `pagewire-node`: from `bin_dir`,
/// else from the folder of this executable, else as this executable's
/// hidden `coordinator` and `node` commands. `None` only when `bin_dir`
/// lacks either.
pub fn binaries(bin_dir: Option<&Path>) -> Option<(Program, Program)> {
    let exe = std::env::current_exe().ok()?;
    let dir = match bin_dir {
        Some(d) => d.to_owned(),
        None => exe.parent()?.to_owned(),
    };
    let (c, n) = (dir.join("pagewire-coordinator"), dir.join("pagewire-node"));
    if c.exists() && n.exists() {
        return Some(((c, Vec::new()), (n, Vec::new())));
    }
    bin_dir
        .is_none()
        .then(|| ((exe.clone(), vec!["coordinator"]), (exe, vec!["node"])))
}

pub fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

pub async fn node_client(addr: &str, token: &str) -> anyhow::Result<NodeRpc> {
    let ch = pagewire_proto::net::connect(addr, None, Duration::from_secs(5)).await?;
    Ok(NodeClient::with_interceptor(ch, AttachToken::new(token)?))
}

impl Cluster {
    /// Starts the coordinator and one node with `frames` frames over `file`
    /// (in `dir`, which also receives the logs), waits until the node owns
    /// every extent, warms every page and asks the node for its transports.
    pub fn start(
        (coordinator_bin, node_bin): (Program, Program),
        dir: &Path,
        file: &Path,
        pages: u64,
        frames: usize,
        token: &str,
        on: &Placement,
    ) -> anyhow::Result<Self> {
        let token_file = dir.join("cluster-token");
        std::fs::write(&token_file, token)?;
        let port = if on.exec.is_empty() {
            free_port()?
        } else {
            // Another machine: a port free there is not ours to probe.
            fastrand::u16(20_000..30_000)
        };
        let ip = on.ip.clone();
        let coordinator = on
            .command(&coordinator_bin.0)
            .args(&coordinator_bin.1)
            .arg("--listen")
            .arg(format!("{ip}:{port}"))
            .args(["--metrics-listen", ""])
            .arg("--state-file")
            .arg(dir.join("coordinator.state"))
            .arg("--token-file")
            .arg(&token_file)
            // A long lease: a node starved by the bench's own load must not
            // be declared dead mid-measurement.
            .args(["--lease-ms", "30000"])
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("coordinator.log"))?)
            .spawn()
            .context("starting pagewire-coordinator")?;
        let mut node = on.command(&node_bin.0);
        node.args(&node_bin.1);
        if on.verbs {
            node.arg("--verbs");
        }
        let node = node
            .args(["--node-id", "bench-owner"])
            .arg("--backing-file")
            .arg(file)
            .args(["--listen", &format!("{ip}:0"), "--metrics-listen", ""])
            .arg("--coordinator")
            .arg(format!("{ip}:{port}"))
            .arg("--token-file")
            .arg(&token_file)
            .arg("--frames")
            .arg(frames.to_string())
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("node.log"))?)
            .spawn()
            .context("starting pagewire-node")?;
        let mut c = Cluster {
            coordinator,
            node,
            node_addr: String::new(),
            coordinator_addr: format!("{ip}:{port}"),
            map_epoch: 0,
            transports: Vec::new(),
            token: token.to_owned(),
        };
        c.settle(&format!("{ip}:{port}"), pages)
            .with_context(|| format!("cluster start (logs in {})", dir.display()))?;
        Ok(c)
    }

    pub fn node_pid(&self) -> u32 {
        self.node.id()
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    fn settle(&mut self, coordinator: &str, pages: u64) -> anyhow::Result<()> {
        let token = self.token.clone();
        let deadline = Instant::now() + Duration::from_secs(60);
        let rt = rt()?;
        let (addr, epoch) = rt.block_on(async {
            loop {
                if Instant::now() > deadline {
                    bail!("the node never came to own every extent");
                }
                if let Ok(Some(x)) = self.try_map(coordinator, &token).await {
                    return Ok(x);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })?;
        self.node_addr = addr;
        self.map_epoch = epoch;
        rt.block_on(async {
            let mut n = node_client(&self.node_addr, &token).await?;
            // The node may not have applied the epoch yet: retry the warm.
            let warmed = loop {
                match n
                    .warm(NodeRangeRequest {
                        run: Some(PageRun {
                            first_page: 0,
                            page_count: pages,
                        }),
                        map_epoch: epoch,
                    })
                    .await
                {
                    Ok(r) => break r.into_inner().pages,
                    Err(e) if Instant::now() < deadline => {
                        tracing::debug!("warm: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => return Err(anyhow::Error::from(e).context("warming the node")),
                }
            };
            tracing::debug!(warmed, "node warmed");
            self.transports = n
                .transports(TransportsRequest {})
                .await?
                .into_inner()
                .transports;
            Ok(())
        })
    }

    /// `(node address, epoch)` once the map gives every extent to the node.
    async fn try_map(
        &mut self,
        coordinator: &str,
        token: &str,
    ) -> anyhow::Result<Option<(String, u64)>> {
        if let Some(s) = self.node.try_wait()? {
            bail!("pagewire-node exited: {s}");
        }
        if let Some(s) = self.coordinator.try_wait()? {
            bail!("pagewire-coordinator exited: {s}");
        }
        let ch = pagewire_proto::net::connect(coordinator, None, Duration::from_secs(1)).await?;
        let mut c = CoordinatorClient::with_interceptor(ch, AttachToken::new(token)?);
        let m = c.get_map(GetMapRequest::default()).await?.into_inner();
        let Some(node) = m.nodes.first() else {
            return Ok(None);
        };
        let all = m.epoch > 0 && !m.owner.is_empty() && m.owner.iter().all(|&o| o == node.index);
        Ok(all.then(|| (node.grpc_address.clone(), m.epoch)))
    }
}
