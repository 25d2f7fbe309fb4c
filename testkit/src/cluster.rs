//! A loopback cluster for end-to-end tests: one `pagewire-coordinator` and
//! `pagewire-node` daemons over a backing file in a temporary directory,
//! with a token file, each process's log in that directory
//! ([`Proc`]: killed on drop, its log's tail shown when the test fails),
//! and the coordinator's view read over gRPC.
//!
//! The command lines of the daemons are here once ([`coordinator_command`],
//! [`node_command`]) for the tests that run their own layouts (several
//! coordinators over etcd).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use pagewire_proto::net::ClientTls;
use pagewire_proto::v1::{GetMapRequest, ListNodesRequest, NodeInfo, NodeState, OwnershipMap};

use crate::grpc::CoordinatorRpc;
use crate::process::Proc;

/// How long [`Cluster::wait_for`] waits.
pub const WAIT: Duration = Duration::from_secs(30);

/// The daemons' binaries.
#[derive(Clone, Debug)]
pub struct Daemons {
    pub coordinator: PathBuf,
    pub node: PathBuf,
}

/// A coordinator on `listen` (metrics on a free port) checking the token in
/// `token_file`, with `lease_ms` leases and extents of `extent` bytes.
pub fn coordinator_command(
    bin: &Path,
    listen: &str,
    token_file: &Path,
    lease_ms: u64,
    extent: u64,
) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args(["--listen", listen, "--metrics-listen", "127.0.0.1:0"])
        .arg("--token-file")
        .arg(token_file)
        .arg("--lease-ms")
        .arg(lease_ms.to_string())
        .arg("--extent-size")
        .arg(extent.to_string());
    cmd
}

/// Node `id` over `backing`, registering with `coordinators` (a list), on
/// free ports, with `frames` cache frames and its shm region in `shm_dir`
/// (a test's own directory: a node killed with -9 leaves its region file
/// there, not in /dev/shm).
pub fn node_command(
    bin: &Path,
    id: &str,
    backing: &Path,
    coordinators: &str,
    token_file: &Path,
    frames: u64,
    shm_dir: &Path,
) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args(["--node-id", id])
        .arg("--backing-file")
        .arg(backing)
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .args(["--coordinator", coordinators])
        .arg("--token-file")
        .arg(token_file)
        .arg("--frames")
        .arg(frames.to_string())
        .arg("--shm-dir")
        .arg(shm_dir);
    cmd
}

pub struct Cluster {
    pub bins: Daemons,
    pub token: String,
    /// The coordinator's gRPC port (fixed, so that a restart keeps it).
    pub port: u16,
    pub lease_ms: u64,
    /// Extent size in bytes.
    pub extent: u64,
    /// The nodes' backing file (the test writes it).
    pub backing: PathBuf,
    /// Every gRPC server serves TLS only, with a certificate for
    /// `localhost` signed by `dir/ca.pem`; the coordinator reads
    /// `dir/coordinator.toml`, the nodes `dir/node.toml` (the test writes
    /// them).
    pub tls: bool,
    pub coord: Option<Proc>,
    pub nodes: Vec<Proc>,
    /// Last: removed after every process above was killed.
    pub dir: tempfile::TempDir,
}

impl Cluster {
    /// A temporary directory holding the token file; the backing file is
    /// `dir/backing` (not written). Nothing runs yet.
    pub fn new(bins: Daemons, token: &str, lease_ms: u64, extent: u64, backing: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("token"), token).expect("token file");
        Cluster {
            bins,
            token: token.to_owned(),
            port: crate::free_port(),
            lease_ms,
            extent,
            backing: dir.path().join(backing),
            tls: false,
            coord: None,
            nodes: Vec::new(),
            dir,
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn coord_addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// How clients check the servers' certificates (None: plain text).
    pub fn client_tls(&self) -> Option<ClientTls> {
        self.tls.then(|| ClientTls {
            ca_file: self.path("ca.pem"),
            domain: "localhost".into(),
        })
    }

    /// Starts the coordinator (its state in `dir/coordinator.state`, its
    /// log `coordinator.log`) and waits until it answers GetMap.
    pub fn start_coordinator(&mut self) {
        let mut cmd = coordinator_command(
            &self.bins.coordinator,
            &self.coord_addr(),
            &self.path("token"),
            self.lease_ms,
            self.extent,
        );
        cmd.arg("--state-file").arg(self.path("coordinator.state"));
        if self.tls {
            cmd.arg("--config").arg(self.path("coordinator.toml"));
        }
        let log = self.path("coordinator.log");
        self.coord = Some(Proc::start("coordinator", &mut cmd, log));
        self.wait_for("the coordinator to answer", |c| c.map().is_some());
    }

    /// Starts node `id` with `frames` frames (log `dir/ID.log`), replacing
    /// any process of that name.
    pub fn start_node(&mut self, id: &str, frames: u64) {
        self.start_node_as(id, id, frames);
    }

    /// Starts a node process called `name` here, with node id `id`; when
    /// the two differ it gets its own shm directory, `dir/shm-NAME`.
    pub fn start_node_as(&mut self, name: &str, id: &str, frames: u64) {
        let shm = if name == id {
            self.path("")
        } else {
            let d = self.path(&format!("shm-{name}"));
            std::fs::create_dir_all(&d).expect("shm dir");
            d
        };
        let mut cmd = node_command(
            &self.bins.node,
            id,
            &self.backing,
            &self.coord_addr(),
            &self.path("token"),
            frames,
            &shm,
        );
        if self.tls {
            cmd.arg("--config").arg(self.path("node.toml"));
        }
        let log = self.path(&format!("{name}.log"));
        self.nodes.retain(|p| p.name != name);
        self.nodes.push(Proc::start(name, &mut cmd, log));
    }

    /// The node process called `name`.
    pub fn node(&mut self, name: &str) -> &mut Proc {
        self.nodes
            .iter_mut()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no node process {name}"))
    }

    /// Runs `call` on a fresh connection to the coordinator (None: it
    /// failed, or took over 5 s).
    pub fn coord_call<T, Fut>(&self, call: impl FnOnce(CoordinatorRpc) -> Fut) -> Option<T>
    where
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let addr = self.coord_addr();
        let tls = self.client_tls();
        crate::rt().block_on(async move {
            let c =
                crate::grpc::coordinator(&addr, tls.as_ref(), &self.token, Duration::from_secs(2))
                    .await?;
            let r = tokio::time::timeout(Duration::from_secs(5), call(c))
                .await
                .ok()?;
            r.ok().map(tonic::Response::into_inner)
        })
    }

    pub fn map(&self) -> Option<OwnershipMap> {
        self.coord_call(|mut c| async move { c.get_map(GetMapRequest::default()).await })
    }

    pub fn nodes_info(&self) -> Option<Vec<NodeInfo>> {
        self.coord_call(|mut c| async move { c.list_nodes(ListNodesRequest {}).await })
            .map(|r| r.nodes)
    }

    /// [`crate::wait_for`] with [`WAIT`], `ok` given the cluster.
    pub fn wait_for(&self, what: &str, mut ok: impl FnMut(&Self) -> bool) -> Duration {
        crate::wait_for(what, WAIT, || ok(self))
    }

    /// Waits until `n` nodes are alive and applied the current epoch, every
    /// extent has an owner and no handoff is in progress; that map.
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
