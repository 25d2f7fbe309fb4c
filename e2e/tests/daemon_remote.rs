//! A real `pagewire-node` under a real coordinator serves its cache's region
//! one-sidedly: its `Transports` RPC returns `shm` and `tcp` descriptors
//! with one epoch, and a reader in this process finds and reads pages with
//! READs alone, sees a write acknowledged over gRPC through a stale index
//! cache entry, and gets a clear error (then recovers) when the node
//! restarts under it or is given a bad descriptor.

mod common;

use pagewire_client::one_sided::{Outcome, ReaderConfig, RemoteError, RemoteReader};
use pagewire_node::pattern;
use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::node_client::NodeClient;
use pagewire_proto::v1::{
    PageRun, ReadRequest, TransportDescriptor, TransportsRequest, WriteRequest,
};
use pagewire_rdma::shm::{ShmConfig, ShmConnection};
use pagewire_rdma::tcp::{ConnectionConfig, TcpConnection};
use pagewire_rdma::{Connection, RegionDescriptor};
use pagewire_testkit::cluster::coordinator_command;
use pagewire_testkit::free_port;
use pagewire_testkit::grpc::NodeRpc;
use pagewire_testkit::process::Proc;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const TOKEN: &str = "daemon-remote-token";
const PS: usize = 4096;
const PAGES: u64 = 2048;

fn start_node(dir: &Path, port: u16, grpc: u16) -> Proc {
    let mut cmd = Command::new(common::daemons().node);
    cmd.args(["--node-id", "n1", "--listen"])
        .arg(format!("127.0.0.1:{grpc}"))
        .args(["--metrics-listen", ""])
        .arg("--backing-file")
        .arg(dir.join("data"))
        .arg("--coordinator")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--token-file")
        .arg(dir.join("token"))
        .args(["--frames", "1024", "--shm-dir"])
        .arg(dir);
    Proc::start("node", &mut cmd, dir.join("node.log"))
}

async fn client(grpc: u16) -> NodeRpc {
    pagewire_testkit::grpc::node(&format!("127.0.0.1:{grpc}"), TOKEN, Duration::from_secs(5))
        .await
        .expect("connect node")
}

/// Reads `first..first+count` over gRPC until the node serves them (it
/// must first register and apply the map); faults them into its cache.
async fn warm(grpc: u16, first: u64, count: u64) -> Vec<u8> {
    let t = Instant::now();
    loop {
        let Ok(ch) = pagewire_proto::net::connect(
            &format!("127.0.0.1:{grpc}"),
            None,
            Duration::from_secs(5),
        )
        .await
        else {
            assert!(t.elapsed() < Duration::from_secs(30), "node never listened");
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut c = NodeClient::with_interceptor(ch, AttachToken::new(TOKEN).unwrap());
        let r = c
            .read(ReadRequest {
                run: Some(PageRun {
                    first_page: first,
                    page_count: count,
                }),
                map_epoch: 0,
            })
            .await;
        match r {
            Ok(r) => return r.into_inner().data,
            Err(e) => {
                assert!(
                    t.elapsed() < Duration::from_secs(30),
                    "node never served: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn desc(t: &TransportDescriptor) -> RegionDescriptor {
    RegionDescriptor {
        addr: t.address,
        len: t.length,
        rkey: u32::try_from(t.rkey).unwrap(),
        epoch: t.epoch,
    }
}

fn shm_reader(t: &TransportDescriptor) -> Result<RemoteReader<ShmConnection>, RemoteError> {
    let conn = ShmConnection::connect(
        &t.endpoint,
        ShmConfig {
            dir: Some(PathBuf::from(String::from_utf8(t.opaque.clone()).unwrap())),
            chaos: None,
        },
    )
    .expect("shm connect");
    RemoteReader::connect(conn, desc(t), ReaderConfig::default())
}

fn tcp_reader(
    t: &TransportDescriptor,
    d: RegionDescriptor,
) -> Result<RemoteReader<TcpConnection>, RemoteError> {
    let conn = TcpConnection::connect(
        t.endpoint.as_str(),
        ConnectionConfig::new(TOKEN.as_bytes().to_vec()),
    )
    .expect("tcp connect");
    RemoteReader::connect(conn, d, ReaderConfig::default())
}

/// Reads `pages` one-sidedly, verifying each, and returns how many took
/// one round trip.
fn read_all<C: Connection>(r: &mut RemoteReader<C>, pages: std::ops::Range<u64>) -> usize {
    let mut buf = vec![0u8; PS];
    let mut warm = 0;
    for p in pages {
        match r.read_page(p, &mut buf).unwrap() {
            Outcome::Hit { round_trips, .. } => {
                pattern::verify(p, &buf).unwrap_or_else(|e| panic!("page {p}: {e:?}"));
                warm += usize::from(round_trips == 1);
            }
            other => panic!("page {p} cached by the node, but the read said {other:?}"),
        }
    }
    warm
}

#[test]
fn a_node_serves_its_region_one_sidedly_over_shm_and_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("token"), TOKEN).unwrap();
    pattern::generate_file(&d.join("data"), PAGES * PS as u64, PS).unwrap();
    let port = free_port();
    let mut coord = coordinator_command(
        &common::daemons().coordinator,
        &format!("127.0.0.1:{port}"),
        &d.join("token"),
        3000,
        65536,
    );
    coord.arg("--state-file").arg(d.join("state"));
    let _coord = Proc::start("coordinator", &mut coord, d.join("coordinator.log"));
    let grpc = free_port();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut node = start_node(d, port, grpc);
    rt.block_on(warm(grpc, 0, 64));
    let ts = rt
        .block_on(async { client(grpc).await.transports(TransportsRequest {}).await })
        .unwrap()
        .into_inner()
        .transports;
    let shm = ts
        .iter()
        .find(|t| t.kind == "shm")
        .expect("an shm descriptor")
        .clone();
    let tcp = ts
        .iter()
        .find(|t| t.kind == "tcp")
        .expect("a tcp descriptor")
        .clone();
    assert_eq!(shm.epoch, tcp.epoch, "one epoch for every transport");
    assert_ne!(shm.epoch, 0);

    // Cold, then warm: the second pass is one round trip per page.
    let mut rs = shm_reader(&shm).unwrap();
    assert_eq!(rs.superblock().epoch, shm.epoch);
    read_all(&mut rs, 0..64);
    assert_eq!(
        read_all(&mut rs, 0..64),
        64,
        "warm reads take one round trip"
    );
    let mut rt_tcp = tcp_reader(&tcp, desc(&tcp)).unwrap();
    read_all(&mut rt_tcp, 0..64);
    assert_eq!(read_all(&mut rt_tcp, 0..64), 64);
    let st = rt_tcp.stats();
    assert_eq!(st.warm_hits, 64);
    assert_eq!(st.validation_failures, 0);

    // Runs of 16 pages: a cold run is two rounds (one READ per cluster of 8
    // buckets, then every frame under one doorbell), a warm run one.
    rt.block_on(warm(grpc, 64, 64));
    let mut runs = tcp_reader(&tcp, desc(&tcp)).unwrap();
    let mut buf16 = vec![0u8; 16 * PS];
    for warm_pass in [false, true] {
        for run in 0..4u64 {
            let first = 64 + run * 16;
            let before = runs.stats().round_trips;
            let outcomes = runs.read_run(first, 16, &mut buf16).unwrap();
            for (i, o) in outcomes.iter().enumerate() {
                assert!(
                    matches!(o, Outcome::Hit { .. }),
                    "page {}: {o:?}",
                    first + i as u64
                );
                pattern::verify(first + i as u64, &buf16[i * PS..(i + 1) * PS]).unwrap();
            }
            let rounds = runs.stats().round_trips - before;
            if warm_pass {
                assert_eq!(rounds, 1, "a warm run of 16 is one round trip");
            } else {
                // Pages in overflow buckets take their own walk.
                assert!(rounds >= 2, "a cold run: {rounds} rounds");
            }
        }
    }

    // A write acknowledged over gRPC is seen through the stale index cache.
    let mut page = vec![0u8; PS];
    pattern::fill(5, 1, &mut page);
    // A node's writes wait one lease + margin after its first map (it
    // cannot tell a first start from a restart in place): retry until then.
    rt.block_on(async {
        let mut c = client(grpc).await;
        let end = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let r = c
                .write(WriteRequest {
                    page: 5,
                    data: page.clone(),
                    map_epoch: 0,
                })
                .await;
            match r {
                Err(s)
                    if s.code() == tonic::Code::Unavailable
                        && s.message().contains("wait")
                        && std::time::Instant::now() < end =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await
                }
                r => return r,
            }
        }
    })
    .unwrap();
    let mut buf = vec![0u8; PS];
    for r in [&mut rs as &mut dyn ReadOne, &mut rt_tcp] {
        match r.read_one(5, &mut buf) {
            Outcome::Hit { .. } => {
                assert_eq!(pattern::verify(5, &buf).unwrap(), 1, "a read after the ack")
            }
            other => panic!("page 5 after the write: {other:?}"),
        }
    }

    // A reader whose map lease ran out refuses to read; renewed, it reads.
    rt_tcp.trust_until(Instant::now() - Duration::from_millis(1));
    assert!(matches!(
        rt_tcp.read_page(3, &mut buf),
        Err(RemoteError::LeaseExpired(_))
    ));
    rt_tcp.trust_until(Instant::now() + Duration::from_secs(60));
    assert!(matches!(
        rt_tcp.read_page(3, &mut buf),
        Ok(Outcome::Hit { .. })
    ));

    // A wrong rkey or epoch is refused by the transport, cleanly.
    let mut bad = desc(&tcp);
    bad.epoch ^= 2;
    assert!(matches!(tcp_reader(&tcp, bad), Err(RemoteError::Stale(_))));
    let mut bad = desc(&tcp);
    bad.rkey ^= 1;
    assert!(matches!(tcp_reader(&tcp, bad), Err(RemoteError::Stale(_))));

    // The node restarts under the readers: a new epoch; the old descriptor
    // fails cleanly, the new one reads again.
    drop(node);
    node = start_node(d, port, grpc);
    rt.block_on(warm(grpc, 0, 64));
    match rt_tcp.read_page(1, &mut buf) {
        Err(_) => {}
        Ok(o) => panic!("a read through the dead node's connection said {o:?}"),
    }
    let ts = rt
        .block_on(async { client(grpc).await.transports(TransportsRequest {}).await })
        .unwrap()
        .into_inner()
        .transports;
    let tcp2 = ts.iter().find(|t| t.kind == "tcp").unwrap().clone();
    assert_ne!(tcp2.epoch, tcp.epoch, "a restart is a new epoch");
    let mut r2 = tcp_reader(&tcp2, desc(&tcp2)).unwrap();
    read_all(&mut r2, 0..64);
    drop(node);
}

trait ReadOne {
    fn read_one(&mut self, page: u64, buf: &mut [u8]) -> Outcome;
}

impl<C: Connection> ReadOne for RemoteReader<C> {
    fn read_one(&mut self, page: u64, buf: &mut [u8]) -> Outcome {
        self.read_page(page, buf).unwrap()
    }
}
