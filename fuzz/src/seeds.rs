//! The seed corpus, made by the real encoders: regions of real page caches,
//! a recorded handshake, the requests a real `TcpConnection` sends and the
//! answers a real `TcpOwner` gives, real compact maps and deltas, and
//! the example config files. `tests/seeds.rs` writes them under
//! `fuzz/corpus/<target>/` and checks that each target's decoder accepts
//! them.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use pagewire_node::index::{Index, Lockless, Sharded};
use pagewire_node::{CacheConfig, PageCache, pattern};
use pagewire_proto::map::{base_set, delta, relative};
use pagewire_proto::v1::{
    CompactMap, Layer, MapNode, NodeState, OwnershipMap, ReleaseGroup, SparseOverrides,
};
use pagewire_rdma::shm::{ShmConfig, ShmConnection, ShmOwner};
use pagewire_rdma::tcp::{
    ConnectionConfig, OwnerConfig, TcpConnection, TcpOwner, handshake_client,
    handshake_server,
};
use pagewire_rdma::{LocalRegion, RegionDescriptor, read_blocking};

use crate::{EPOCH, TOKEN};

/// A named seed.
pub type Seed = (String, Vec<u8>);

/// Regions of real caches (served over `shm`, read back over `shm`): a
/// lockless index with pages faulted in, written and evicted, in two page
/// sizes, and a sharded index (whose region's buckets stay empty).
pub fn regions() -> Vec<Seed> {
    vec![
        (
            "lockless-512".into(),
            region::<Lockless>(512, 16, 40, &[0, 1, 2, 9, 17, 30, 31]),
        ),
        (
            "lockless-4096".into(),
            region::<Lockless>(4096, 4, 6, &[1, 5]),
        ),
        // More pages than frames: evictions, overflow chains in use.
        (
            "lockless-full".into(),
            region::<Lockless>(512, 8, 64, &(0..64).collect::<Vec<_>>()),
        ),
        ("sharded-512".into(), region::<Sharded>(512, 8, 12, &[3, 4])),
    ]
}

fn region<I: Index>(page_size: usize, frames: usize, pages: u64, touch: &[u64]) -> Vec<u8> {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data");
    pattern::generate_file(&data, pages * page_size as u64, page_size).expect("backing file");
    let owner = ShmOwner::create_in_with_epoch(dir.path(), "seed", EPOCH).expect("shm owner");
    let len = PageCache::<I>::region_len(page_size, frames);
    let shm = owner.register(len).expect("shm region");
    let desc = shm.descriptor();
    let cache = PageCache::<I>::open_on(
        &data,
        CacheConfig {
            page_size,
            frames,
            readahead_max: 0,
            ..Default::default()
        },
        Some(Box::new(shm)),
    )
    .expect("cache");
    cache.set_epoch(EPOCH);
    for &p in touch {
        cache.get(p).expect("fault in");
    }
    if let Some(&p) = touch.first() {
        let mut page = vec![0u8; page_size];
        pattern::fill(p, 7, &mut page);
        cache.write(p, &page).expect("write through");
    }
    if let Some(&p) = touch.get(1) {
        let _ = cache.evict(p);
    }
    let mut conn = ShmConnection::connect(
        "seed",
        ShmConfig {
            dir: Some(dir.path().to_owned()),
            chaos: None,
        },
    )
    .expect("shm connect");
    let mut bytes = vec![0u8; len];
    let r = read_blocking(&mut conn, desc, &mut [(0, &mut bytes[..])]).expect("read posted");
    r[0].clone().expect("region read");
    drop(cache);
    bytes
}

/// A stream that records what it reads.
struct Recorder<S> {
    inner: S,
    seen: Vec<u8>,
}

impl<S: Read> Read for Recorder<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.seen.extend_from_slice(&buf[..n]);
        Ok(n)
    }
}

impl<S: Write> Write for Recorder<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The `handshake` target's input: a role byte (0: the target plays the
/// client, 1: the responder), then what the peer sends.
pub fn handshakes() -> Vec<Seed> {
    let (a, b) = UnixStream::pair().expect("socket pair");
    let server = std::thread::spawn(move || {
        let mut s = Recorder {
            inner: b,
            seen: Vec::new(),
        };
        assert!(handshake_server(&mut s, TOKEN).expect("server side"));
        s.seen
    });
    let mut c = Recorder {
        inner: a,
        seen: Vec::new(),
    };
    handshake_client(&mut c, TOKEN).expect("client side");
    let from_client = server.join().expect("server thread");
    let mut as_client = vec![0u8];
    as_client.extend_from_slice(&c.seen);
    let mut as_server = vec![1u8];
    as_server.extend_from_slice(&from_client);
    vec![
        ("as-client".into(), as_client),
        ("as-server".into(), as_server),
    ]
}

/// The READs the `tcp_responses` target posts on every connection (offset,
/// length), in this order, in one batch.
pub const READS: &[(u64, usize)] = &[(0, 16), (64, 64), (4096, 512), (100, 1)];

/// The descriptor the `tcp_responses` target reads (its fake responder
/// checks nothing).
pub const FAKE_REGION: RegionDescriptor = RegionDescriptor {
    addr: 0x1000_0000,
    len: 1 << 20,
    rkey: 7,
    epoch: EPOCH,
};

/// The config of the `tcp_responses` target's connections.
pub fn connection_config() -> ConnectionConfig {
    let mut c = ConnectionConfig::new(TOKEN.to_vec());
    c.op_timeout = Duration::from_millis(200);
    c.connect_timeout = Duration::from_secs(2);
    c.max_outstanding = 8;
    c.max_read_len = 64 << 10;
    c.spin = Duration::ZERO;
    c
}

/// Posts [`READS`] of [`FAKE_REGION`] on `conn` and waits for them: each
/// buffer is followed by a canary that must stay intact. Returns the
/// results.
pub fn post_fixed_reads(conn: &mut TcpConnection) -> Vec<Result<(), pagewire_rdma::ReadError>> {
    const CANARY: u8 = 0xA5;
    let mut bufs: Vec<Vec<u8>> = READS.iter().map(|&(_, l)| vec![CANARY; l + 64]).collect();
    let results = {
        let mut reads: Vec<(u64, &mut [u8])> = READS
            .iter()
            .zip(bufs.iter_mut())
            .map(|(&(o, l), b)| (o, &mut b[..l]))
            .collect();
        read_blocking(conn, FAKE_REGION, &mut reads).expect("batch posted")
    };
    for (b, &(_, l)) in bufs.iter().zip(READS) {
        assert!(
            b[l..].iter().all(|&x| x == CANARY),
            "a READ wrote past its buffer"
        );
    }
    results
}

/// The bytes a real [`TcpConnection`] sends for [`post_fixed_reads`].
fn captured_requests() -> Vec<u8> {
    let listener = TcpListener::bind("127.0.0.1:0").expect("listener");
    let addr = listener.local_addr().expect("address");
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        assert!(handshake_server(&mut s, TOKEN).expect("handshake"));
        let mut req = vec![0u8; READS.len() * pagewire_rdma::tcp::REQUEST_LEN];
        s.read_exact(&mut req).expect("requests");
        req
    });
    let mut conn = TcpConnection::connect(addr, connection_config()).expect("connect");
    let results = post_fixed_reads(&mut conn);
    assert!(
        results.iter().all(Result::is_err),
        "the fake answered nothing"
    );
    fake.join().expect("fake responder")
}

/// Rewrites the requests in `bytes` from absolute (the region's address,
/// rkey and epoch) to relative form, or back: the rkey and the epoch are
/// XORed with the region's, the address offset by its start. The
/// `tcp_requests` target's input is in relative form, so that an input
/// names the live region of whichever process runs it.
pub fn relativize(bytes: &mut [u8], region: &RegionDescriptor, to_relative: bool) {
    for r in bytes.chunks_exact_mut(pagewire_rdma::tcp::REQUEST_LEN) {
        let addr = u64::from_le_bytes(r[16..24].try_into().expect("8 bytes"));
        let addr = if to_relative {
            addr.wrapping_sub(region.addr)
        } else {
            addr.wrapping_add(region.addr)
        };
        r[16..24].copy_from_slice(&addr.to_le_bytes());
        let rkey = u32::from_le_bytes(r[24..28].try_into().expect("4 bytes")) ^ region.rkey;
        r[24..28].copy_from_slice(&rkey.to_le_bytes());
        let epoch = u64::from_le_bytes(r[32..40].try_into().expect("8 bytes")) ^ region.epoch;
        r[32..40].copy_from_slice(&epoch.to_le_bytes());
    }
}

/// The responder of the `tcp_requests` target: a real [`TcpOwner`]
/// with one 64 KiB region of [`pattern`] bytes, answering every CALL with
/// its argument.
pub struct Responder {
    pub responder: TcpOwner,
    pub region: pagewire_rdma::tcp::TcpRegion,
    pub bytes: Vec<u8>,
}

impl Responder {
    pub fn start() -> Self {
        let mut rc = OwnerConfig::new(TOKEN.to_vec());
        rc.epoch = Some(EPOCH);
        rc.max_read_len = 64 << 10;
        rc.spin = Duration::ZERO;
        let responder = TcpOwner::bind("127.0.0.1:0", rc).expect("responder");
        let len = 64 << 10;
        let region = responder.register(len).expect("region");
        // CALLs are answered with their argument.
        responder.set_call_handler(std::sync::Arc::new(|arg: &[u8], out: &mut Vec<u8>| {
            out.extend_from_slice(arg);
        }));
        let mut bytes = vec![0u8; len];
        for (p, page) in bytes.chunks_exact_mut(4096).enumerate() {
            pattern::fill(p as u64, 1, page);
        }
        region.write_bytes(0, &bytes);
        Self {
            responder,
            region,
            bytes,
        }
    }

    /// Sends `requests` (absolute form) on a fresh authenticated connection,
    /// closes the sending side, and returns everything answered.
    pub fn exchange(&self, requests: &[u8]) -> Vec<u8> {
        let mut s = TcpStream::connect(self.responder.local_addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        handshake_client(&mut s, TOKEN).expect("handshake");
        s.write_all(requests).expect("send requests");
        s.shutdown(std::net::Shutdown::Write).expect("shutdown");
        let mut out = Vec::new();
        s.read_to_end(&mut out).expect("answers");
        out
    }
}

/// The `tcp_requests` seeds (relative form) and the `tcp_responses` seeds
/// (what the real responder answered to them).
pub fn tcp() -> (Vec<Seed>, Vec<Seed>) {
    let captured = captured_requests();
    let mut relative_form = captured.clone();
    relativize(&mut relative_form, &FAKE_REGION, true);
    let responder = Responder::start();
    let live = responder.region.descriptor();
    let mut absolute = relative_form.clone();
    relativize(&mut absolute, &live, false);
    let ok_answers = responder.exchange(&absolute);
    // The same READs with every error the responder knows: a stale epoch,
    // an unknown rkey, out of bounds, a bad opcode.
    let mut bad = relative_form.clone();
    bad[32] ^= 1;
    bad[40 + 24] ^= 1;
    bad[80 + 16..80 + 24].copy_from_slice(&(1u64 << 20).to_le_bytes());
    bad[120] = 9;
    let mut bad_abs = bad.clone();
    relativize(&mut bad_abs, &live, false);
    let err_answers = responder.exchange(&bad_abs);
    (
        vec![("reads".into(), relative_form), ("errors".into(), bad)],
        vec![("ok".into(), ok_answers), ("errors".into(), err_answers)],
    )
}

fn node(index: u32, id: &str, state: NodeState, weight: u64) -> MapNode {
    MapNode {
        index,
        node_id: id.into(),
        state: state as i32,
        weight,
        ..Default::default()
    }
}

/// Compact maps as a coordinator publishes them (full maps, then deltas
/// from one to the next, the sets described with [`relative`]), each a
/// length-delimited `OwnershipMap`: the `compact_map` target's input is a
/// stream of them.
pub fn compact_maps() -> Vec<Seed> {
    let nodes3 = vec![
        node(1, "node-1", NodeState::Alive, 1 << 30),
        node(2, "node-2", NodeState::Alive, 1 << 30),
        node(3, "node-3", NodeState::Alive, 2 << 30),
    ];
    let base = base_set(&nodes3);
    let full =
        |epoch: u64, nodes: Vec<MapNode>, sets: Vec<pagewire_proto::v1::CandidateSet>| CompactMap {
            epoch,
            base_epoch: 0,
            file_size: 1 << 30,
            extent_size: 8 << 20,
            page_size: 4096,
            nodes,
            sets,
            owner_set: 0,
            ..Default::default()
        };
    let m1 = full(1, nodes3.clone(), vec![relative(0, &base, &base)]);
    // Node 4 joins: the owner set gains it, the old set hands off.
    let mut nodes4 = nodes3.clone();
    nodes4.push(node(4, "node-4", NodeState::Alive, 1 << 30));
    let base4 = base_set(&nodes4);
    let mut m2 = full(
        2,
        nodes4.clone(),
        vec![relative(0, &base4, &base4), relative(1, &base, &base4)],
    );
    m2.handoff = vec![Layer {
        set: 1,
        except: vec![],
        resume: vec![],
    }];
    // Node 2 drains: released by it, overrides on two extents.
    let mut nodes5 = nodes4.clone();
    nodes5[1].state = NodeState::Draining as i32;
    let base5 = base_set(&nodes5);
    let mut m3 = full(
        3,
        nodes5,
        vec![relative(0, &base5, &base5), relative(1, &base4, &base5)],
    );
    m3.releases = vec![ReleaseGroup {
        layers: vec![Layer {
            set: 1,
            except: vec![3],
            resume: vec![0],
        }],
        except: vec![],
        dropped_by: vec![0],
        ..Default::default()
    }];
    m3.overrides = Some(SparseOverrides {
        owner_extent: vec![0, 5],
        owner_node: vec![3, 1],
        ..Default::default()
    });
    let msg = |c: CompactMap| OwnershipMap {
        epoch: c.epoch,
        compact: Some(c),
        ..Default::default()
    };
    let stream = |maps: Vec<OwnershipMap>| -> Vec<u8> {
        let mut out = Vec::new();
        for m in maps {
            prost::Message::encode_length_delimited(&m, &mut out).expect("encode");
        }
        out
    };
    vec![
        ("full".into(), stream(vec![msg(m1.clone())])),
        (
            "deltas".into(),
            stream(vec![
                msg(m1.clone()),
                msg(delta(&m1, &m2)),
                msg(delta(&m2, &m3)),
            ]),
        ),
        ("drain".into(), stream(vec![msg(m3.clone())])),
        (
            "expanded".into(),
            stream(vec![OwnershipMap {
                epoch: 9,
                file_size: 1 << 20,
                extent_size: 1 << 16,
                page_size: 4096,
                owner: vec![1; 16],
                ..Default::default()
            }]),
        ),
    ]
}

/// The example config file of the node, as shipped, and with the one
/// option it leaves empty that the daemon requires.
pub fn node_configs() -> Vec<Seed> {
    let example = include_str!("../../node/src/daemon/pagewire-node.example.toml");
    let complete = example.replacen(
        "backing_file = \"\"",
        "backing_file = \"/data/big.file\"",
        1,
    );
    assert_ne!(complete, example, "the example names backing_file");
    vec![
        ("example".into(), example.as_bytes().to_vec()),
        ("complete".into(), complete.into_bytes()),
    ]
}

/// The example config file of the coordinator, as shipped.
pub fn coordinator_configs() -> Vec<Seed> {
    vec![(
        "example".into(),
        include_bytes!("../../coordinator/coordinator.example.toml").to_vec(),
    )]
}

/// Descriptors as the node advertises them.
pub fn descriptors() -> Vec<Seed> {
    let r = Responder::start();
    vec![("tcp".into(), r.region.descriptor().to_bytes().to_vec())]
}
