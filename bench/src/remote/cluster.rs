//! A one-node cluster on loopback for the two-sided rows: a
//! `pagewire-coordinator` and one `pagewire-node` daemon (the real owner,
//! serving gRPC `Read`) over the bench's file, every page warmed.
//!
//! The binaries are looked up next to `pagewire-bench` (same target
//! directory) unless `--bin-dir` names another folder.

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

/// A running coordinator and node; both killed on drop.
pub struct Cluster {
    coordinator: Child,
    node: Child,
    pub node_addr: String,
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

/// Where `pagewire-node` and `pagewire-coordinator` are: `bin_dir`, or the
/// folder of this executable. `None` when either is missing.
pub fn binaries(bin_dir: Option<&Path>) -> Option<(PathBuf, PathBuf)> {
    let dir = match bin_dir {
        Some(d) => d.to_owned(),
        None => std::env::current_exe().ok()?.parent()?.to_owned(),
    };
    let (c, n) = (dir.join("pagewire-coordinator"), dir.join("pagewire-node"));
    (c.exists() && n.exists()).then_some((c, n))
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
        (coordinator_bin, node_bin): (PathBuf, PathBuf),
        dir: &Path,
        file: &Path,
        pages: u64,
        frames: usize,
        token: &str,
    ) -> anyhow::Result<Self> {
        let token_file = dir.join("cluster-token");
        std::fs::write(&token_file, token)?;
        let port = free_port()?;
        let coordinator = Command::new(coordinator_bin)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
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
        let node = Command::new(node_bin)
            .args(["--node-id", "bench-owner"])
            .arg("--backing-file")
            .arg(file)
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", ""])
            .arg("--coordinator")
            .arg(format!("127.0.0.1:{port}"))
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
            map_epoch: 0,
            transports: Vec::new(),
            token: token.to_owned(),
        };
        c.settle(port, pages)
            .with_context(|| format!("cluster start (logs in {})", dir.display()))?;
        Ok(c)
    }

    pub fn node_pid(&self) -> u32 {
        self.node.id()
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    fn settle(&mut self, port: u16, pages: u64) -> anyhow::Result<()> {
        let token = self.token.clone();
        let deadline = Instant::now() + Duration::from_secs(60);
        let rt = rt()?;
        let (addr, epoch) = rt.block_on(async {
            loop {
                if Instant::now() > deadline {
                    bail!("the node never came to own every extent");
                }
                if let Ok(Some(x)) = self.try_map(port, &token).await {
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
    async fn try_map(&mut self, port: u16, token: &str) -> anyhow::Result<Option<(String, u64)>> {
        if let Some(s) = self.node.try_wait()? {
            bail!("pagewire-node exited: {s}");
        }
        if let Some(s) = self.coordinator.try_wait()? {
            bail!("pagewire-coordinator exited: {s}");
        }
        let ch = pagewire_proto::net::connect(
            &format!("127.0.0.1:{port}"),
            None,
            Duration::from_secs(1),
        )
        .await?;
        let mut c = CoordinatorClient::with_interceptor(ch, AttachToken::new(token)?);
        let m = c.get_map(GetMapRequest::default()).await?.into_inner();
        let Some(node) = m.nodes.first() else {
            return Ok(None);
        };
        let all = m.epoch > 0 && !m.owner.is_empty() && m.owner.iter().all(|&o| o == node.index);
        Ok(all.then(|| (node.grpc_address.clone(), m.epoch)))
    }
}
