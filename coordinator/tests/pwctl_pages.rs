//! `pwctl owner` against real processes on loopback: a coordinator and two
//! `pagewire-node` daemons over a self-describing file with a partial last
//! page, and the real `pwctl` binary.
//!
//! `pagewire-node` is another package's binary: `cargo test --workspace`
//! builds it; with `-p pagewire-coordinator` alone, build it first with
//! `cargo build -p pagewire-node`.
//!
//! The file is written here in the brief's page format (a few lines below)
//! rather than with `pagewire_node::pattern`: the coordinator then needs no
//! dev-dependency on the node crate, and the tests compare with the backing
//! file's bytes anyway, so the pattern only has to make every page distinct.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::coordinator_client::CoordinatorClient;
use pagewire_proto::v1::{GetMapRequest, ListNodesRequest, NodeInfo, NodeState, OwnershipMap};
use serde_json::Value;

const TOKEN: &str = "pwctl-pages-token";
const PS: u64 = 4096;
/// 40 pages, the last one 3096 bytes long.
const FILE_LEN: u64 = 40 * PS - 1000;
const PAGES: u64 = FILE_LEN.div_ceil(PS);
/// 4 pages per extent: 10 extents, over both nodes.
const EXTENT: u64 = 4 * PS;

static SERIAL: Mutex<()> = Mutex::new(());

/// One cluster at a time (three processes each, on two cores in CI).
fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn coordinator_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_pagewire-coordinator"))
}

fn pwctl_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_pwctl"))
}

fn node_bin() -> PathBuf {
    let p = coordinator_bin()
        .parent()
        .expect("binary dir")
        .join("pagewire-node");
    assert!(
        p.exists(),
        "{} is not built: run `cargo build -p pagewire-node` (cargo test --workspace builds it)",
        p.display()
    );
    p
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port")
}

/// The page format of the brief: page number and generation (u64 LE), then
/// SplitMix64 seeded with `page * GOLDEN ^ generation`, each u64 LE.
fn pattern(page: u64, generation: u64, len: usize) -> Vec<u8> {
    const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut state = page.wrapping_mul(GOLDEN) ^ generation;
    let mut v = Vec::with_capacity(len + 8);
    v.extend_from_slice(&page.to_le_bytes());
    v.extend_from_slice(&generation.to_le_bytes());
    while v.len() < len {
        state = state.wrapping_add(GOLDEN);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        v.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    v.truncate(len);
    v
}

fn page_len(page: u64) -> usize {
    (FILE_LEN - page * PS).min(PS) as usize
}

struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

struct Cluster {
    dir: tempfile::TempDir,
    port: u16,
    procs: Vec<Proc>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        for p in &mut self.procs {
            let _ = p.child.kill();
            let _ = p.child.wait();
            if panicking {
                let log = std::fs::read_to_string(&p.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(12).collect();
                eprintln!("--- last lines of {} ---", p.name);
                for l in tail.iter().rev() {
                    eprintln!("{l}");
                }
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

impl Cluster {
    /// A coordinator and nodes n1 and n2, settled (both own extents, no
    /// handoff, both applied the epoch).
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("token"), TOKEN).expect("token file");
        let data: Vec<u8> = (0..PAGES)
            .flat_map(|p| pattern(p, 0, page_len(p)))
            .collect();
        std::fs::write(dir.path().join("data"), &data).expect("data file");
        let mut c = Cluster {
            dir,
            port: free_port(),
            procs: Vec::new(),
        };
        let log = c.path("coordinator.log");
        let child = Command::new(coordinator_bin())
            .arg("--listen")
            .arg(c.addr())
            .args(["--metrics-listen", "127.0.0.1:0"])
            .arg("--state-file")
            .arg(c.path("coordinator.state"))
            .arg("--token-file")
            .arg(c.path("token"))
            .args(["--lease-ms", "3000"])
            .arg("--extent-size")
            .arg(EXTENT.to_string())
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn coordinator");
        c.procs.push(Proc {
            name: "coordinator".into(),
            child,
            log,
        });
        for id in ["n1", "n2"] {
            let log = c.path(&format!("{id}.log"));
            let child = Command::new(node_bin())
                .args(["--node-id", id])
                .arg("--backing-file")
                .arg(c.path("data"))
                .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
                .arg("--coordinator")
                .arg(c.addr())
                .arg("--token-file")
                .arg(c.path("token"))
                .args(["--frames", "256"])
                .arg("--shm-dir")
                .arg(c.path(""))
                .env_remove("RUST_LOG")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("log"))
                .spawn()
                .expect("spawn node");
            c.procs.push(Proc {
                name: id.into(),
                child,
                log,
            });
        }
        c.wait_stable();
        c
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `GetMap` (expanded) and `ListNodes`, or None while the coordinator
    /// does not answer.
    fn state(&self) -> Option<(OwnershipMap, Vec<NodeInfo>)> {
        let addr = self.addr();
        rt().block_on(async move {
            let ch = pagewire_proto::net::connect(&addr, None, Duration::from_secs(2))
                .await
                .ok()?;
            let mut c =
                CoordinatorClient::with_interceptor(ch, AttachToken::new(TOKEN).expect("token"));
            let map = c.get_map(GetMapRequest::default()).await.ok()?.into_inner();
            let nodes = c.list_nodes(ListNodesRequest {}).await.ok()?.into_inner();
            Some((map, nodes.nodes))
        })
    }

    fn wait_stable(&self) {
        let start = Instant::now();
        loop {
            if let Some((map, nodes)) = self.state() {
                let alive: Vec<&NodeInfo> = nodes
                    .iter()
                    .filter(|n| n.state() == NodeState::Alive)
                    .collect();
                if map.epoch != 0
                    && map.file_size == FILE_LEN
                    && alive.len() == 2
                    && map.previous_owner.iter().all(|&p| p == 0)
                    && map.owner.iter().all(|&o| o != 0)
                    && alive.iter().all(|n| n.applied_epoch == map.epoch)
                {
                    return;
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the cluster did not settle in 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn map(&self) -> OwnershipMap {
        self.state().expect("the coordinator answers").0
    }

    fn pwctl(&self, args: &[&str]) -> Output {
        Command::new(pwctl_bin())
            .arg("--coordinator")
            .arg(self.addr())
            .arg("--token-file")
            .arg(self.path("token"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run pwctl")
    }

    /// `pwctl ARGS`, which must succeed.
    fn ok(&self, args: &[&str]) -> Output {
        let out = self.pwctl(args);
        assert!(
            out.status.success(),
            "pwctl {args:?}: {:?}\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// `pwctl --json ARGS` parsed from stdout (the report of a read to a file).
    fn json(&self, args: &[&str]) -> Value {
        let mut a = vec!["--json"];
        a.extend_from_slice(args);
        let out = self.ok(&a);
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "pwctl {a:?}: not JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }
}

/// The node the map names (index, id, address) for `index`.
fn map_node(map: &OwnershipMap, index: u32) -> (u64, String, String) {
    let n = map
        .nodes
        .iter()
        .find(|n| n.index == index)
        .expect("the map names its owners");
    (
        u64::from(n.index),
        n.node_id.clone(),
        n.grpc_address.clone(),
    )
}

fn json_node(v: &Value) -> (u64, String, String) {
    (
        v["index"].as_u64().expect("index"),
        v["node_id"].as_str().expect("node_id").to_owned(),
        v["grpc_address"].as_str().expect("grpc_address").to_owned(),
    )
}

#[test]
fn owner_names_the_node_the_map_does() {
    let _s = serial();
    let c = Cluster::start();
    let map = c.map();
    let mut seen = std::collections::HashSet::new();
    for page in [0, 3, 4, 17, PAGES - 1] {
        // Extents of 4 pages; no handoff: both roles are owner[extent].
        let want = map_node(&map, map.owner[(page * PS / EXTENT) as usize]);
        seen.insert(want.1.clone());
        for target in [format!("p{page}"), (page * PS + 5).to_string()] {
            let v = c.json(&["owner", &target]);
            assert_eq!(v["page"], page, "owner {target}");
            assert_eq!(v["extent"], page * PS / EXTENT, "owner {target}");
            assert_eq!(v["epoch"], map.epoch, "owner {target}");
            assert_eq!(v["in_handoff"], false);
            assert_eq!(json_node(&v["read_owner"]), want, "owner {target}");
            assert_eq!(json_node(&v["write_owner"]), want, "owner {target}");
            assert_eq!(v["read_owner"]["state"], "alive");
        }
    }
    assert_eq!(seen.len(), 2, "the pages checked span both nodes");
    assert_eq!(
        c.json(&["owner", "1K"])["page_bytes"],
        serde_json::json!({"start": 0, "end": PS})
    );
    assert_eq!(
        c.json(&["owner", &format!("p{}", PAGES - 1)])["page_bytes"]["end"],
        FILE_LEN
    );
    // The table names the node too.
    let want = map_node(&map, map.owner[0]);
    let out = c.ok(&["owner", "p1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&want.1) && text.contains(&want.2), "{text}");
    assert!(text.contains(&format!("map epoch {}", map.epoch)), "{text}");
}
