//! End-to-end tests with real processes on loopback: the coordinator, three
//! or four `pagewire-node` daemons over a sparse backing file, and `pwctl`.

mod common;

use std::ops::{Deref, DerefMut};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::pwctl_bin;
use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::coordinator_client::CoordinatorClient;
use pagewire_proto::v1::node_client::NodeClient;
use pagewire_proto::v1::{
    ClusterRangeRequest, FaultInRequest, GetMapRequest, NodeRangeRequest, OwnershipMap, PageRun,
    ReadRequest, RegisterRequest, StatsRequest, StatusRequest, WriteRequest,
};
use pagewire_testkit::process::Proc;
use pagewire_testkit::rt;
use serde_json::Value;

const TOKEN: &str = "test-cluster-token";
/// Lease for the tests that do not time failure detection: long enough that
/// a node starved of CPU on a busy machine is not declared dead under them.
const RELAXED_LEASE_MS: u64 = 3000;
const PAGE: u64 = 4096;
const EXTENT: u64 = 64 << 10;
/// 4096 extents of 64 KiB.
const FILE: u64 = 256 << 20;

/// The kit's loopback cluster, read through `pwctl` as well.
struct Cluster(pagewire_testkit::cluster::Cluster);

impl Deref for Cluster {
    type Target = pagewire_testkit::cluster::Cluster;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl DerefMut for Cluster {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Cluster {
    /// The `/metrics` text of node `id`.
    fn node_metrics(&self, id: &str) -> String {
        let nodes = self.json(&["nodes"]);
        let addr = nodes
            .as_array()
            .expect("nodes")
            .iter()
            .find(|n| n["node_id"] == id)
            .and_then(|n| n["metrics_address"].as_str())
            .unwrap_or_else(|| panic!("no metrics address for {id} in {nodes}"))
            .to_owned();
        http_get(&addr, "/metrics")
    }

    /// Over a sparse backing file; the coordinator started.
    fn new(lease_ms: u64) -> Self {
        let mut c = pagewire_testkit::cluster::Cluster::new(
            common::daemons(),
            TOKEN,
            lease_ms,
            EXTENT,
            "data.bin",
        );
        let f = std::fs::File::create(&c.backing).expect("backing file");
        f.set_len(FILE).expect("sparse file");
        c.start_coordinator();
        Cluster(c)
    }

    fn pwctl(&self, args: &[&str]) -> Output {
        Command::new(pwctl_bin())
            .arg("--coordinator")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--token-file")
            .arg(self.path("token"))
            .args(args)
            .output()
            .expect("run pwctl")
    }

    /// `pwctl --json ARGS` parsed, or None when it failed.
    fn try_pwctl(&self, args: &[&str]) -> Option<Value> {
        let mut a = vec!["--json"];
        a.extend_from_slice(args);
        let out = self.pwctl(&a);
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }

    fn json(&self, args: &[&str]) -> Value {
        self.try_pwctl(args)
            .unwrap_or_else(|| panic!("pwctl {args:?} failed: {:?}", self.pwctl(args)))
    }

    fn wait_for(&self, what: &str, mut ok: impl FnMut(&Self) -> bool) -> Duration {
        pagewire_testkit::wait_for(what, pagewire_testkit::cluster::WAIT, || ok(self))
    }

    /// Waits until `n` nodes are alive, own extents, have applied the
    /// current epoch, and no handoff is in progress.
    fn wait_stable(&self, n: usize) {
        self.wait_for(&format!("{n} settled nodes"), |c| {
            let Some(map) = c.try_pwctl(&["map"]) else {
                return false;
            };
            let Some(nodes) = c.try_pwctl(&["nodes"]) else {
                return false;
            };
            // Epoch 0 is the empty map before any registration: freshly
            // registered nodes report it too.
            let epoch = map["epoch"].as_u64().unwrap_or(0);
            if epoch == 0 {
                return false;
            }
            let alive: Vec<&Value> = nodes
                .as_array()
                .into_iter()
                .flatten()
                .filter(|x| x["state"] == "alive")
                .collect();
            alive.len() == n
                && map["in_handoff"] == 0
                && map["unowned"] == 0
                && alive
                    .iter()
                    .all(|x| x["applied_epoch"].as_u64() == Some(epoch))
                // Nothing changed between the two snapshots.
                && c.try_pwctl(&["status"])
                    .is_some_and(|s| s["epoch"].as_u64() == Some(epoch))
        });
    }

    /// Waits until the map gives every extent to a node other than
    /// `index`, and returns it.
    fn wait_moved(&self, index: u32) -> OwnershipMap {
        let mut moved = None;
        self.wait_for(&format!("node index {index}'s extents to move"), |c| {
            let m = c.grpc_map();
            let done = !m.owner.is_empty() && m.owner.iter().all(|&o| o != 0 && o != index);
            moved = done.then_some(m);
            done
        });
        moved.expect("map")
    }

    fn grpc_map(&self) -> OwnershipMap {
        let port = self.port;
        rt().block_on(async move {
            let mut c = coord_client(port, Some(TOKEN)).await;
            c.get_map(GetMapRequest::default())
                .await
                .expect("get_map")
                .into_inner()
        })
    }
}

/// Adds the token, or nothing (to test refusals).
type TokenFn =
    Box<dyn FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Send>;
type Intercepted =
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, TokenFn>;

fn interceptor(token: Option<&str>) -> TokenFn {
    match token {
        Some(t) => {
            let mut a = AttachToken::new(t).expect("token");
            Box::new(move |r| tonic::service::Interceptor::call(&mut a, r))
        }
        None => Box::new(Ok),
    }
}

async fn coord_client(port: u16, token: Option<&str>) -> CoordinatorClient<Intercepted> {
    let ch =
        pagewire_proto::net::connect(&format!("127.0.0.1:{port}"), None, Duration::from_secs(5))
            .await
            .expect("connect coordinator");
    CoordinatorClient::with_interceptor(ch, interceptor(token))
}

fn owned_by(map: &Value, id: &str) -> u64 {
    map["nodes"]
        .as_array()
        .and_then(|a| a.iter().find(|n| n["node_id"] == id))
        .and_then(|n| n["extents"].as_u64())
        .unwrap_or(0)
}

#[test]
fn three_nodes_balance_by_capacity_and_drain_empties_a_node() {
    let mut c = Cluster::new(RELAXED_LEASE_MS);
    // Capacities 1:2:3 (frames of 4 KiB).
    c.start_node("node-a", 1024);
    c.start_node("node-b", 2048);
    c.start_node("node-c", 3072);
    c.wait_stable(3);
    let map = c.json(&["map"]);
    assert_eq!(map["extents"], FILE / EXTENT);
    for n in map["nodes"].as_array().expect("nodes") {
        let dev = n["deviation_percent"].as_f64().expect("deviation");
        assert!(
            dev.abs() <= 10.0,
            "{} deviates {dev:.1}% from its capacity weight: {map}",
            n["node_id"]
        );
    }

    let out = c.pwctl(&["drain", "node-b", "--wait", "20"]);
    assert!(out.status.success(), "drain failed: {out:?}");
    c.wait_for("node-b drained with no extents nor handoffs", |c| {
        let map = c.grpc_map();
        let nodes = c.json(&["nodes"]);
        let b = nodes
            .as_array()
            .and_then(|a| a.iter().find(|n| n["node_id"] == "node-b"))
            .cloned()
            .unwrap_or_default();
        let idx = b["index"].as_u64().unwrap_or(0) as u32;
        b["state"] == "drained" && !map.owner.contains(&idx) && !map.previous_owner.contains(&idx)
    });
    // And the node itself applied it: it reports owning nothing.
    c.wait_for("node-b to report no extents", |c| {
        let stats = c.json(&["stats"]);
        stats
            .as_array()
            .and_then(|a| a.iter().find(|n| n["node_id"] == "node-b"))
            .is_some_and(|n| n["source"] == "node" && n["extents_owned"] == 0)
    });
    let map = c.json(&["map"]);
    assert_eq!(owned_by(&map, "node-b"), 0);
    assert_eq!(
        owned_by(&map, "node-a") + owned_by(&map, "node-c"),
        FILE / EXTENT
    );
}

#[test]
fn kill9_of_a_node_moves_its_extents_within_the_lease() {
    let lease_ms = 1000;
    let mut c = Cluster::new(lease_ms);
    for id in ["n1", "n2", "n3"] {
        c.start_node(id, 1024);
    }
    c.wait_stable(3);
    let before = c.json(&["map"]);
    let victim = owned_by(&before, "n2");
    assert!(victim > 0);
    let killed = Instant::now();
    c.node("n2").kill9();
    c.wait_for("n2's extents to move", |c| {
        c.try_pwctl(&["map"]).is_some_and(|m| {
            owned_by(&m, "n2") == 0 && owned_by(&m, "n1") + owned_by(&m, "n3") == FILE / EXTENT
        })
    });
    let took = killed.elapsed();
    eprintln!(
        "MEASURE kill -9 to reassignment of {victim} extents: {} ms (lease {lease_ms} ms)",
        took.as_millis()
    );
    // The lease runs from the victim's last heartbeat, before the kill; add
    // the coordinator's lease tick (50 ms here) and this test's polling of
    // pwctl, which is slow on a busy two-core machine.
    assert!(
        took < Duration::from_millis(lease_ms + 1500),
        "took {took:?} with a {lease_ms} ms lease"
    );
    let nodes = c.json(&["nodes"]);
    let n2 = nodes
        .as_array()
        .and_then(|a| a.iter().find(|n| n["node_id"] == "n2"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(n2["state"], "dead");
}

#[test]
fn coordinator_kill9_and_restart_gives_back_the_same_map_and_epoch() {
    let mut c = Cluster::new(RELAXED_LEASE_MS);
    for id in ["r1", "r2", "r3"] {
        c.start_node(id, 1024);
    }
    c.wait_stable(3);
    let before = c.grpc_map();
    let nodes_before = c.json(&["nodes"]);
    c.coord.as_mut().expect("coordinator").kill9();
    assert!(
        c.try_pwctl(&["status"]).is_none(),
        "coordinator still answers"
    );
    c.start_coordinator();
    let after = c.grpc_map();
    assert_eq!(after.epoch, before.epoch);
    assert_eq!(after.owner, before.owner);
    assert_eq!(after.nodes, before.nodes);
    let nodes_after = c.json(&["nodes"]);
    let ids = |v: &Value| -> Vec<(String, u64)> {
        v.as_array()
            .into_iter()
            .flatten()
            .map(|n| {
                (
                    n["node_id"].as_str().unwrap_or_default().to_owned(),
                    n["index"].as_u64().unwrap_or(0),
                )
            })
            .collect()
    };
    assert_eq!(ids(&nodes_after), ids(&nodes_before));
    // The nodes keep their leases through the restart: nothing moves.
    std::thread::sleep(Duration::from_millis(c.lease_ms + 500));
    c.wait_stable(3);
    assert_eq!(c.grpc_map().owner, before.owner);
}

#[test]
fn a_fourth_node_moves_about_a_quarter_of_the_extents() {
    let mut c = Cluster::new(RELAXED_LEASE_MS);
    for id in ["q1", "q2", "q3"] {
        c.start_node(id, 1024);
    }
    c.wait_stable(3);
    let before = c.grpc_map().owner;
    c.start_node("q4", 1024);
    c.wait_stable(4);
    let after = c.grpc_map().owner;
    let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
    let frac = moved as f64 / before.len() as f64;
    eprintln!(
        "MEASURE fourth node join moved {moved} of {} extents: {frac:.3} (ideal 0.25)",
        before.len()
    );
    assert!((0.2..=0.3).contains(&frac), "moved fraction {frac}");
}

#[test]
fn malformed_and_unauthenticated_requests_get_clear_errors() {
    let mut c = Cluster::new(RELAXED_LEASE_MS);
    c.start_node("m1", 256);
    c.wait_stable(1);
    let port = c.port;
    let node_addr = c.json(&["nodes"])[0]["grpc_address"]
        .as_str()
        .expect("address")
        .to_owned();
    let backing = c.backing.clone();
    rt().block_on(async move {
        // No token, wrong token.
        let mut anon = coord_client(port, None).await;
        let e = anon.status(StatusRequest {}).await.expect_err("no token");
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("token"), "{e:?}");
        let mut wrong = coord_client(port, Some("not-the-token")).await;
        let e = wrong
            .status(StatusRequest {})
            .await
            .expect_err("wrong token");
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(!e.message().is_empty());

        // Malformed requests.
        let mut c = coord_client(port, Some(TOKEN)).await;
        let e = c
            .register(RegisterRequest {
                node_id: "bad id!".into(),
                grpc_address: "127.0.0.1:1".into(),
                capacity_bytes: 1,
                file_size: FILE,
                page_size: PAGE as u32,
                ..Default::default()
            })
            .await
            .expect_err("bad node id");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("node_id"), "{e:?}");
        let e = c
            .register(RegisterRequest {
                node_id: "x".into(),
                grpc_address: "127.0.0.1:1".into(),
                capacity_bytes: 1,
                file_size: FILE + 1,
                page_size: PAGE as u32,
                ..Default::default()
            })
            .await
            .expect_err("wrong file size");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("byte"), "{e:?}");
        let e = c
            .warm(ClusterRangeRequest { range: None })
            .await
            .expect_err("no range");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("range"), "{e:?}");

        // The node service checks the same way.
        let ch = pagewire_proto::net::connect(&node_addr, None, Duration::from_secs(5))
            .await
            .expect("connect node");
        let mut anon = NodeClient::with_interceptor(ch.clone(), interceptor(None));
        let e = anon
            .fault_in(FaultInRequest::default())
            .await
            .expect_err("no token");
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let mut n = NodeClient::with_interceptor(ch, interceptor(Some(TOKEN)));
        let e = n
            .fault_in(FaultInRequest {
                run: Some(PageRun {
                    first_page: 0,
                    page_count: 0,
                }),
                ..Default::default()
            })
            .await
            .expect_err("empty run");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("page_count"), "{e:?}");
        let e = n
            .fault_in(FaultInRequest {
                run: Some(PageRun {
                    first_page: FILE / PAGE,
                    page_count: 1,
                }),
                ..Default::default()
            })
            .await
            .expect_err("past the end");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        // A good fault-in returns the frame and the bytes.
        let r = n
            .fault_in(FaultInRequest {
                run: Some(PageRun {
                    first_page: 3,
                    page_count: 2,
                }),
                want_data: true,
                map_epoch: 0,
                ..Default::default()
            })
            .await
            .expect("fault in")
            .into_inner();
        assert_eq!(r.frames.len(), 2);
        assert_eq!(r.data.len() as u64, 2 * PAGE);
        // Readahead: the pages after the run, up to its extent's end, as
        // locations without bytes.
        let extent_pages = EXTENT / PAGE;
        let at = extent_pages + 4;
        let r = n
            .fault_in(FaultInRequest {
                run: one(at),
                want_data: true,
                readahead: 1000,
                ..Default::default()
            })
            .await
            .expect("fault in with readahead")
            .into_inner();
        assert_eq!(r.data.len() as u64, PAGE, "bytes of the run only");
        let pages: Vec<u64> = r.frames.iter().map(|f| f.page).collect();
        assert_eq!(pages, (at..2 * extent_pages).collect::<Vec<_>>());
        assert!(
            r.frames.iter().all(|f| f.frame_generation % 2 == 1),
            "{:?}",
            r.frames
        );
        // Readahead is best effort: with the file cut short right after the
        // run, behind the node's back, the run is still answered, alone.
        let last = 3 * extent_pages + 4;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&backing)
            .expect("backing file");
        file.set_len((last + 1) * PAGE).expect("cut the file");
        let r = n
            .fault_in(FaultInRequest {
                run: one(last),
                want_data: true,
                readahead: 8,
                ..Default::default()
            })
            .await
            .expect("the run, without its readahead")
            .into_inner();
        assert_eq!((r.frames.len(), r.data.len() as u64), (1, PAGE));
        file.set_len(FILE).expect("the file's length back");
        // Three wrong tokens more: the node counts them (issue 21).
        let ch = pagewire_proto::net::connect(&node_addr, None, Duration::from_secs(5))
            .await
            .expect("connect node");
        let mut wrong = NodeClient::with_interceptor(ch, interceptor(Some("not-the-token")));
        for _ in 0..3 {
            let e = wrong
                .fault_in(FaultInRequest::default())
                .await
                .expect_err("wrong token");
            assert_eq!(e.code(), tonic::Code::Unauthenticated);
        }
    });
    // Refused calls are counted where they were refused, every node sample
    // names its node.
    let node_metrics = c.node_metrics("m1");
    for want in [
        "pagewire_node_grpc_unauthenticated_total{node_id=\"m1\",reason=\"wrong\"} 3\n",
        "pagewire_node_grpc_unauthenticated_total{node_id=\"m1\",reason=\"missing\"} 1\n",
    ] {
        assert!(
            node_metrics.contains(want),
            "{want:?} missing from:\n{node_metrics}"
        );
    }
    let log = std::fs::read_to_string(c.path("coordinator.log")).expect("coordinator log");
    let coord_metrics = log
        .lines()
        .filter(|l| l.contains("coordinator listening"))
        .find_map(|l| l.split("metrics=").nth(1)?.split_whitespace().next())
        .expect("the coordinator logs its metrics address")
        .to_owned();
    let coord = http_get(&coord_metrics, "/metrics");
    for want in [
        "pagewire_coordinator_grpc_unauthenticated_total{reason=\"wrong\"} 1\n",
        "pagewire_coordinator_grpc_unauthenticated_total{reason=\"missing\"} 1\n",
    ] {
        assert!(coord.contains(want), "{want:?} missing from:\n{coord}");
    }
}

/// The body of a plain HTTP GET of `path` at `addr` (host:port).
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read the answer");
    assert!(out.starts_with("HTTP/1.") && out.contains(" 200 "), "{out}");
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

#[test]
fn nodes_serve_their_extents_write_through_and_refuse_stale_maps() {
    let mut c = Cluster::new(RELAXED_LEASE_MS);
    c.start_node("w1", 512);
    c.start_node("w2", 512);
    c.wait_stable(2);
    let map = c.grpc_map();
    let addr_of = |index: u32| {
        map.nodes
            .iter()
            .find(|n| n.index == index)
            .map(|n| n.grpc_address.clone())
            .expect("node in map")
    };
    let ppe = EXTENT / PAGE;
    // An extent no live node released (writes to a released one wait a
    // lease), and one of the other node.
    let e1 = (0..map.owner.len())
        .find(|&e| map.released_by.get(e).copied().unwrap_or(0) == 0)
        .expect("an extent nobody released");
    let other = map
        .owner
        .iter()
        .position(|&o| o != map.owner[e1])
        .expect("extent") as u64;
    let (owner, page, foreign_page) = (map.owner[e1], e1 as u64 * ppe + 1, other * ppe);
    let epoch = map.epoch;
    let addr = addr_of(owner);
    let backing = c.path("data.bin");
    rt().block_on(async move {
        let ch = pagewire_proto::net::connect(&addr, None, Duration::from_secs(5))
            .await
            .expect("connect node");
        let mut n = NodeClient::with_interceptor(ch, interceptor(Some(TOKEN)));
        let r = n
            .read(ReadRequest {
                run: Some(PageRun {
                    first_page: page,
                    page_count: 1,
                }),
                map_epoch: epoch,
            })
            .await
            .expect("read")
            .into_inner();
        assert_eq!(
            r.data,
            vec![0u8; PAGE as usize],
            "sparse file reads as zeros"
        );
        assert_eq!(r.frame_generations.len(), 1);

        let data: Vec<u8> = (0..PAGE).map(|i| (i % 251) as u8).collect();
        // Writes wait one lease + margin after a node's first map (it cannot
        // tell a first start from a restart in place).
        let start = Instant::now();
        let w = loop {
            match n
                .write(WriteRequest {
                    page,
                    data: data.clone(),
                    map_epoch: epoch,
                })
                .await
            {
                Err(s)
                    if s.code() == tonic::Code::Unavailable
                        && start.elapsed() < Duration::from_secs(20) =>
                {
                    tokio::time::sleep(Duration::from_millis(25)).await
                }
                r => break r.expect("write").into_inner(),
            }
        };
        // The generation names the new frame's incarnation (what a remote
        // reader validates), not a per-page version: it need not grow.
        // Written through: the backing file has the bytes once acknowledged.
        let file = std::fs::read(&backing).expect("read backing file");
        let off = (page * PAGE) as usize;
        assert_eq!(&file[off..off + PAGE as usize], &data[..]);
        let r = n
            .read(ReadRequest {
                run: Some(PageRun {
                    first_page: page,
                    page_count: 1,
                }),
                map_epoch: epoch,
            })
            .await
            .expect("read back")
            .into_inner();
        assert_eq!(r.data, data);
        assert_eq!(r.frame_generations[0], w.frame_generation);

        let e = n
            .write(WriteRequest {
                page,
                data: vec![1; 10],
                map_epoch: epoch,
            })
            .await
            .expect_err("short write");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);

        // A page this node does not serve is refused as a stale map.
        let e = n
            .fault_in(FaultInRequest {
                run: Some(PageRun {
                    first_page: foreign_page,
                    page_count: 1,
                }),
                want_data: false,
                map_epoch: epoch,
                ..Default::default()
            })
            .await
            .expect_err("foreign extent");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.message().contains("stale map"), "{e:?}");
    });
}

// ---- Ownership, leases and writes (ARCHITECTURE.md) -----------------------

use pagewire_testkit::grpc::NodeRpc;

async fn node_client(map: &OwnershipMap, index: u32) -> NodeRpc {
    let addr = map
        .nodes
        .iter()
        .find(|n| n.index == index)
        .map(|n| n.grpc_address.clone())
        .expect("node in map");
    let ch = pagewire_proto::net::connect(&addr, None, Duration::from_secs(5))
        .await
        .expect("connect node");
    NodeClient::with_interceptor(ch, AttachToken::new(TOKEN).expect("token"))
}

fn index_of(map: &OwnershipMap, id: &str) -> u32 {
    map.nodes
        .iter()
        .find(|n| n.node_id == id)
        .map(|n| n.index)
        .expect("node in map")
}

fn one(page: u64) -> Option<PageRun> {
    Some(PageRun {
        first_page: page,
        page_count: 1,
    })
}

async fn read_page(n: &mut NodeRpc, page: u64, map_epoch: u64) -> Result<Vec<u8>, tonic::Status> {
    n.read(ReadRequest {
        run: one(page),
        map_epoch,
    })
    .await
    .map(|r| r.into_inner().data)
}

/// Retries `call` while the node says to (not there yet, moving, fenced,
/// behind), for up to `limit`.
async fn retrying<T, F, Fut>(limit: Duration, mut call: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let start = Instant::now();
    loop {
        match call().await {
            Ok(v) => return v,
            Err(s)
                if start.elapsed() < limit
                    && (s.code() == tonic::Code::Unavailable
                        || s.message().contains("stale map")) =>
            {
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            Err(s) => panic!("gave up after {:?}: {s:?}", start.elapsed()),
        }
    }
}

/// The first page of an extent owned by `index` (outright) in `map`.
fn page_of(map: &OwnershipMap, index: u32) -> u64 {
    let e = (0..map.owner.len())
        .find(|&e| map.owner[e] == index && map.previous_owner.get(e).copied().unwrap_or(0) == 0)
        .expect("an extent of the node");
    e as u64 * (EXTENT / PAGE) + 3
}

#[test]
fn a_non_owner_reads_from_the_owner_one_sidedly_and_caches_nothing() {
    let mut c = Cluster::new(RELAXED_LEASE_MS);
    c.start_node("o1", 512);
    c.start_node("o2", 512);
    c.wait_stable(2);
    let map = c.grpc_map();
    let (i1, i2) = (index_of(&map, "o1"), index_of(&map, "o2"));
    let page = page_of(&map, i2);
    rt().block_on(async move {
        let mut n1 = node_client(&map, i1).await;
        let mut n2 = node_client(&map, i2).await;
        let stale = |r: Result<(), tonic::Status>, what: &str| {
            let e = r.expect_err(what);
            assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{what}: {e:?}");
            assert!(e.message().contains("stale map"), "{what}: {e:?}");
        };
        let before = read_page(&mut n2, page, 0).await.expect("owner read");
        for epoch in [0, map.epoch - 1, map.epoch] {
            // Read: served from the owner's memory, one-sidedly.
            let got = read_page(&mut n1, page, epoch)
                .await
                .expect("non-owner read");
            assert_eq!(got, before, "a non-owner returns the owner's bytes");
            // Everything else that would cache or change the page: refused.
            stale(
                n1.fault_in(FaultInRequest {
                    run: one(page),
                    want_data: true,
                    map_epoch: epoch,
                    ..Default::default()
                })
                .await
                .map(drop),
                "fault_in",
            );
            stale(
                n1.warm(NodeRangeRequest {
                    run: one(page),
                    map_epoch: epoch,
                })
                .await
                .map(drop),
                "warm",
            );
            stale(
                n1.write(WriteRequest {
                    page,
                    data: vec![7; PAGE as usize],
                    map_epoch: epoch,
                })
                .await
                .map(drop),
                "write",
            );
        }
        // A caller ahead of the node is told the node is behind.
        let e = read_page(&mut n1, page, map.epoch + 1)
            .await
            .expect_err("ahead");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.message().contains("behind"), "{e:?}");
        let stats = n1
            .stats(StatsRequest {})
            .await
            .expect("stats")
            .into_inner()
            .stats
            .expect("stats");
        assert_eq!(stats.pages_resident, 0, "the non-owner cached pages");
        // A write acknowledged by the owner is what the non-owner reads next
        // (the old code cached the page here and kept serving it).
        retrying(Duration::from_secs(10), || {
            let mut n2 = n2.clone();
            async move {
                n2.write(WriteRequest {
                    page,
                    data: written(page),
                    map_epoch: 0,
                })
                .await
            }
        })
        .await;
        let got = read_page(&mut n1, page, 0).await.expect("non-owner read");
        assert_eq!(got, written(page), "the non-owner read the pre-write bytes");
    });
    // Each answered Read is timed under how it was answered: the non-owner's
    // four from the owner's memory, the owner's one from its cache.
    for (node, path, n) in [
        ("o1", "one_sided", 4),
        ("o1", "fallback", 0),
        ("o1", "local", 0),
        ("o2", "local", 1),
    ] {
        let want = format!(
            "pagewire_node_grpc_read_seconds_count{{node_id=\"{node}\",path=\"{path}\"}} {n}\n"
        );
        let text = c.node_metrics(node);
        assert!(text.contains(&want), "{want:?} missing from:\n{text}");
    }
}

/// Bytes of a page that differ from the sparse file's zeros.
fn written(page: u64) -> Vec<u8> {
    (0..PAGE).map(|i| ((i + page) % 251) as u8 + 1).collect()
}

#[test]
fn a_frozen_owner_answers_no_queued_read_with_pre_write_bytes() {
    let lease_ms = 1000;
    let mut c = Cluster::new(lease_ms);
    for id in ["f1", "f2", "f3"] {
        c.start_node(id, 1024);
    }
    c.wait_stable(3);
    let map = c.grpc_map();
    let victim = index_of(&map, "f2");
    let page = page_of(&map, victim);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut old_client = rt.block_on(node_client(&map, victim));
    let before = rt
        .block_on(read_page(&mut old_client, page, map.epoch))
        .expect("read before");
    assert_eq!(before, vec![0u8; PAGE as usize]);

    c.node("f2").signal("STOP");
    let queued: Vec<_> = (0..4)
        .map(|_| {
            let mut n = old_client.clone();
            let epoch = map.epoch;
            rt.spawn(async move {
                tokio::time::timeout(Duration::from_secs(20), read_page(&mut n, page, epoch)).await
            })
        })
        .collect();
    let moved = c.wait_moved(victim);
    let new_owner = moved.owner[(page / (EXTENT / PAGE)) as usize];
    let data = written(page);
    let acked = rt.block_on(async {
        let n = node_client(&moved, new_owner).await;
        retrying(Duration::from_secs(5), || {
            let mut n = n.clone();
            let data = data.clone();
            async move {
                n.write(WriteRequest {
                    page,
                    data,
                    map_epoch: moved.epoch,
                })
                .await
            }
        })
        .await;
        Instant::now()
    });
    c.node("f2").signal("CONT");
    let mut errors = 0;
    for q in queued {
        match rt.block_on(q).expect("task") {
            Err(_) => panic!("a queued read got no answer in 20 s"),
            Ok(Err(_)) => errors += 1,
            Ok(Ok(bytes)) => assert_eq!(
                bytes, data,
                "the frozen node answered a queued read with pre-write bytes after the write was acknowledged"
            ),
        }
    }
    // And it keeps answering nothing old after it woke.
    let fresh = rt.block_on(async {
        let mut errors = 0;
        for _ in 0..10 {
            match read_page(&mut old_client, page, 0).await {
                Ok(bytes) => assert_eq!(bytes, data, "pre-write bytes after waking"),
                Err(_) => errors += 1,
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        errors
    });
    eprintln!(
        "MEASURE frozen owner: {errors} of 4 queued reads refused, {fresh} of 10 fresh reads \
         refused; write acknowledged {} ms before SIGCONT",
        acked.elapsed().as_millis()
    );
}

/// A third node reads a page one-sidedly from its owner (gRPC `Read` on a
/// non-owner). The owner is frozen: its memory stays readable, but its
/// extents move, and the new owner acknowledges a write. Reads through the
/// third node that start after the acknowledgement never return the
/// pre-write bytes: the new owner fences writes to an extent taken from a
/// dead node for a lease, and the third node trusts its map only while its
/// own lease holds.
#[test]
fn one_sided_reads_from_a_frozen_owner_never_return_pre_write_bytes() {
    let lease_ms = 1000;
    let mut c = Cluster::new(lease_ms);
    for id in ["s1", "s2", "s3"] {
        c.start_node(id, 1024);
    }
    c.wait_stable(3);
    let map = c.grpc_map();
    let victim = index_of(&map, "s2");
    let reader = index_of(&map, "s1");
    let page = page_of(&map, victim);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut via = rt.block_on(node_client(&map, reader));
    let before = rt
        .block_on(read_page(&mut via, page, 0))
        .expect("read before");
    assert_eq!(before, vec![0u8; PAGE as usize]);

    c.node("s2").signal("STOP");
    let start = Instant::now();
    let acked_at = std::sync::Arc::new(std::sync::Mutex::new(None::<Duration>));
    // Keep reading through the third node while the extent moves and the
    // write goes through the new owner.
    let hammer = {
        let (mut via, acked_at) = (via.clone(), acked_at.clone());
        rt.spawn(async move {
            let (mut ok, mut refused, mut after_ack) = (0, 0, 0);
            while start.elapsed() < Duration::from_secs(8) {
                let began = start.elapsed();
                let ack = *acked_at.lock().unwrap();
                match read_page(&mut via, page, 0).await {
                    Ok(bytes) => {
                        ok += 1;
                        if ack.is_some_and(|a| a < began) {
                            after_ack += 1;
                            assert_eq!(
                                bytes,
                                written(page),
                                "a read begun {} ms after the write's ack returned pre-write bytes",
                                (began - ack.unwrap()).as_millis()
                            );
                        }
                    }
                    Err(_) => refused += 1,
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (ok, refused, after_ack)
        })
    };
    let moved = c.wait_moved(victim);
    let new_owner = moved.owner[(page / (EXTENT / PAGE)) as usize];
    rt.block_on(async {
        let n = node_client(&moved, new_owner).await;
        retrying(Duration::from_secs(10), || {
            let mut n = n.clone();
            async move {
                n.write(WriteRequest {
                    page,
                    data: written(page),
                    map_epoch: moved.epoch,
                })
                .await
            }
        })
        .await;
    });
    *acked_at.lock().unwrap() = Some(start.elapsed());
    let (ok, refused, after_ack) = rt.block_on(hammer).expect("reader task");
    c.node("s2").signal("CONT");
    assert!(after_ack > 0, "no read began after the ack");
    eprintln!(
        "MEASURE one-sided frozen owner: {ok} reads answered ({after_ack} begun after the ack, all \
         post-write), {refused} refused; write acknowledged {} ms after SIGSTOP",
        acked_at.lock().unwrap().unwrap().as_millis()
    );
}

#[test]
fn a_node_that_loses_extents_and_regains_them_never_serves_pre_write_bytes() {
    let lease_ms = 1000;
    let mut c = Cluster::new(lease_ms);
    for id in ["g1", "g2", "g3"] {
        c.start_node(id, 1024);
    }
    c.wait_stable(3);
    let map = c.grpc_map();
    let victim = index_of(&map, "g2");
    let page = page_of(&map, victim);
    let extent = (page / (EXTENT / PAGE)) as usize;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut g2 = rt.block_on(node_client(&map, victim));
    let before = rt
        .block_on(read_page(&mut g2, page, map.epoch))
        .expect("read before");
    assert_eq!(before, vec![0u8; PAGE as usize], "g2 caches the page");

    // g2 is frozen; the coordinator restarts meanwhile, so g2's map stream
    // is gone when the restarted coordinator declares it dead and moves its
    // extents: g2 wakes to a refused heartbeat without ever having seen the
    // epoch that dropped it (the path that once kept its cached pages).
    c.node("g2").signal("STOP");
    c.coord.as_mut().expect("coordinator").kill9();
    c.start_coordinator();
    let moved = c.wait_moved(victim);
    let data = written(page);
    rt.block_on(async {
        let n = node_client(&moved, moved.owner[extent]).await;
        retrying(Duration::from_secs(5), || {
            let mut n = n.clone();
            let data = data.clone();
            async move {
                n.write(WriteRequest {
                    page,
                    data,
                    map_epoch: moved.epoch,
                })
                .await
            }
        })
        .await;
    });
    c.node("g2").signal("CONT");
    // From the moment it wakes until it serves the extent again, whatever
    // g2 answers for the page is the written bytes.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poller = {
        let (stop, data) = (stop.clone(), data.clone());
        rt.spawn(async move {
            let (mut answered, mut refused) = (0, 0);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match read_page(&mut g2, page, 0).await {
                    Ok(bytes) => {
                        assert_eq!(bytes, data, "g2 served pre-write bytes");
                        answered += 1;
                    }
                    Err(_) => refused += 1,
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (answered, refused)
        })
    };
    c.wait_stable(3);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (answered, refused) = rt.block_on(poller).expect("g2 served pre-write bytes");
    eprintln!("MEASURE waking g2: {answered} reads answered, {refused} refused");
    let back = c.grpc_map();
    assert_eq!(back.owner[extent], victim, "g2 owns the extent again");
    rt.block_on(async {
        let mut n = node_client(&back, victim).await;
        let got = retrying(Duration::from_secs(5), || {
            let mut n = n.clone();
            async move { read_page(&mut n, page, back.epoch).await }
        })
        .await;
        assert_eq!(
            got, data,
            "g2 served pre-write bytes after regaining the extent"
        );
        // Writes through g2 go again once the node that held the extent
        // meanwhile can no longer answer from its map (one lease + margin).
        let again = written(page + 1);
        retrying(Duration::from_secs(5), || {
            let mut n = n.clone();
            let again = again.clone();
            async move {
                n.write(WriteRequest {
                    page,
                    data: again,
                    map_epoch: back.epoch,
                })
                .await
            }
        })
        .await;
        assert_eq!(
            read_page(&mut n, page, back.epoch).await.expect("read"),
            again
        );
    });
}

/// `pwctl nodes`' entry for `id`.
fn member(c: &Cluster, id: &str) -> Value {
    c.json(&["nodes"])
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["node_id"] == id)
        .cloned()
        .expect("member")
}

/// Waits up to `limit` for `p` to exit; its exit code.
fn wait_exit(p: &mut Proc, limit: Duration) -> Option<i32> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(st) = p.child.try_wait().expect("try_wait") {
            return st.code();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{} still runs after {limit:?}", p.name);
}

#[test]
fn a_second_process_with_a_live_node_id_exits_and_a_left_node_stays_left() {
    let lease_ms = 1000;
    let mut c = Cluster::new(lease_ms);
    c.start_node("m1", 256);
    c.start_node("m2", 256);
    c.wait_stable(2);
    let nodes = c.json(&["nodes"]);
    // Nodes come in registration order: find m1 by id.
    let addr = nodes
        .as_array()
        .and_then(|ns| ns.iter().find(|n| n["node_id"] == "m1"))
        .expect("m1 listed")["grpc_address"]
        .as_str()
        .expect("address")
        .to_owned();
    let epoch = c.json(&["status"])["epoch"].as_u64();

    // Same id, another port: refused (after waiting out one lease, in case
    // it was m1 restarted), and it says why.
    c.start_node_as("dup", "m1", 256);
    let code = wait_exit(c.node("dup"), Duration::from_millis(lease_ms * 3 + 5000));
    assert_eq!(code, Some(1));
    let log = std::fs::read_to_string(c.path("dup.log")).expect("log");
    assert!(log.contains("is in use") && log.contains(&addr), "{log}");
    assert_eq!(
        c.json(&["status"])["epoch"].as_u64(),
        epoch,
        "the map moved"
    );
    assert_eq!(
        member(&c, "m1")["grpc_address"].as_str(),
        Some(addr.as_str())
    );

    // SIGTERM: m2 leaves, and that is final even across a few leases.
    c.node("m2").signal("TERM");
    assert_eq!(wait_exit(c.node("m2"), Duration::from_secs(10)), Some(0));
    std::thread::sleep(Duration::from_millis(lease_ms * 2));
    let m2 = member(&c, "m2");
    assert_eq!(m2["state"], "left", "{m2}");
    assert_eq!(m2["extents_owned"], 0, "{m2}");
    let log = std::fs::read_to_string(c.path("m2.log")).expect("log");
    assert_eq!(
        log.matches("registered with the coordinator").count(),
        1,
        "{log}"
    );

    // The last alive node cannot be drained.
    let out = c.pwctl(&["drain", "m1"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no alive node"),
        "{out:?}"
    );
}

/// Issue 21: `stats --json` printed one line where every other command
/// pretty-prints, and `stats --watch 1 > file` wrote clear-screen escapes
/// into the file.
#[test]
fn pwctl_stats_json_is_pretty_and_watch_into_a_file_has_no_escape_codes() {
    let mut c = Cluster::new(RELAXED_LEASE_MS);
    c.start_node("w1", 256);
    c.wait_stable(1);
    let out = c.pwctl(&["--json", "stats"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.lines().count() > 3, "not pretty-printed: {text}");
    let v: Value = serde_json::from_str(&text).expect("one JSON array");
    assert_eq!(v[0]["node_id"], "w1", "{v}");
    // --watch into a pipe, twice: tables then JSON Lines, ~2.5 refreshes.
    for (json, check) in [(false, "table"), (true, "json")] {
        let mut args = vec!["--coordinator".to_owned(), format!("127.0.0.1:{}", c.port)];
        args.extend([
            "--token-file".to_owned(),
            c.path("token").display().to_string(),
        ]);
        if json {
            args.push("--json".into());
        }
        args.extend(["stats".into(), "--watch".into(), "1".into()]);
        let mut child = Command::new(pwctl_bin())
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("run pwctl");
        std::thread::sleep(Duration::from_millis(2500));
        child.kill().expect("stop pwctl");
        let out = child.wait_with_output().expect("pwctl output");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            !text.contains('\x1b'),
            "{check}: escape codes in a pipe: {text:?}"
        );
        if json {
            let lines: Vec<&str> = text.lines().collect();
            assert!(lines.len() >= 2, "{check}: {text}");
            for l in lines {
                let v: Value = serde_json::from_str(l).expect("a JSON array per line");
                assert_eq!(v[0]["node_id"], "w1", "{v}");
            }
        } else {
            assert!(text.matches("w1").count() >= 2, "{check}: {text}");
        }
    }
}

#[test]
fn pwctl_names_wrong_addresses_frozen_nodes_and_token_mistakes() {
    let mut c = Cluster::new(RELAXED_LEASE_MS);
    c.start_node("m1", 256);
    c.start_node("m2", 256);
    c.wait_stable(2);
    let m1 = member(&c, "m1");
    let grpc = m1["grpc_address"].as_str().expect("grpc").to_owned();
    let metrics = m1["metrics_address"].as_str().expect("metrics").to_owned();
    let pwctl_at = |addr: &str, args: &[&str]| {
        Command::new(pwctl_bin())
            .args(["--coordinator", addr, "--timeout-ms", "3000"])
            .arg("--token-file")
            .arg(c.path("token"))
            .args(args)
            .output()
            .expect("run pwctl")
    };
    let out = pwctl_at(&grpc, &["status"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is a pagewire node, not the coordinator"),
        "{err}"
    );
    let out = pwctl_at(&metrics, &["status"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("does not speak gRPC"), "{err}");

    // A frozen node costs one short deadline and is shown as such.
    c.node("m2").signal("STOP");
    let start = Instant::now();
    let stats = c.json(&["stats", "--node-timeout-ms", "500"]);
    let took = start.elapsed();
    c.node("m2").signal("CONT");
    assert!(took < Duration::from_secs(4), "stats took {took:?}");
    let rows = stats.as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{stats}");
    // Rows come in node-index order, which is registration order: find them
    // by id.
    let row = |id: &str| {
        rows.iter()
            .find(|r| r["node_id"] == id)
            .unwrap_or_else(|| panic!("no row for {id}: {stats}"))
    };
    assert_eq!(row("m1")["reachable"], true, "{stats}");
    assert_eq!(row("m2")["reachable"], false, "{stats}");
    assert!(
        row("m2")["source"]
            .as_str()
            .unwrap_or("")
            .contains("UNREACHABLE"),
        "{stats}"
    );

    // A warm past the end of the file is clipped and says so.
    let out = c.pwctl(&["warm", "0..1T"]);
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("warning") && err.contains("only 0.."), "{err}");
    assert!(err.contains("evicted again"), "{err}");

    // A missing and an empty token file are both configuration errors.
    let empty = c.path("empty-token");
    std::fs::write(&empty, "\n").expect("empty token");
    for file in [c.path("no-such-token"), empty] {
        let out = Command::new(pwctl_bin())
            .arg("--token-file")
            .arg(&file)
            .arg("status")
            .output()
            .expect("run pwctl");
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("token"),
            "{out:?}"
        );
    }
}
