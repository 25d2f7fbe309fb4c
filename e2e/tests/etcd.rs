//! Several coordinators over a real three-member etcd cluster (Debian's
//! `etcd-server`), with real `pagewire-node` daemons and a reader that
//! verifies every byte it reads against the self-describing file format.
//!
//! Needs the `etcd` feature and `etcd` on the PATH (and `openssl` for the
//! TLS test). Without the etcd binary the tests print why and pass, unless
//! `PAGEWIRE_REQUIRE_ETCD=1` (CI sets it), which makes a missing binary a
//! failure.
//!
//! Each test prints what it measured (failover times, epochs per leader,
//! how long map changes stalled) for the closing notes of the work.

#![cfg(feature = "etcd")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pagewire_coordinator::store::etcd::{EpochRecord, epoch_history};
use pagewire_node::pattern;
use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::coordinator_client::CoordinatorClient;
use pagewire_proto::v1::node_client::NodeClient;
use pagewire_proto::v1::{
    CoordinatorRole, DrainRequest, GetMapRequest, ListNodesRequest, NodeState, OwnershipMap,
    PageRun, ReadRequest, RegisterRequest, StatusRequest, StatusResponse, WatchMapRequest,
};
use pagewire_testkit::cluster::{coordinator_command, node_command};
use pagewire_testkit::grpc::CoordinatorRpc as Coord;
use pagewire_testkit::process::Proc;
use pagewire_testkit::{free_ports, rt};

const TOKEN: &str = "test-cluster-token";
const PAGE: u64 = 4096;
const EXTENT: u64 = 64 << 10;
/// 512 extents of 64 KiB.
const FILE: u64 = 32 << 20;
/// The etcd lease of each coordinator (the default): failover takes about
/// this long. With the default request timeout (2 s) a write rides over an
/// election inside etcd (about 1 s with etcd's defaults) when one member dies.
const TTL_S: u64 = 3;
/// The nodes' lease: long, so that the tests see the coordinators' own
/// behaviour and not nodes declared dead on a loaded 2-core machine.
const NODE_LEASE_MS: u64 = 20_000;

fn etcd_available() -> bool {
    let found = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var_os("PAGEWIRE_REQUIRE_ETCD").is_none(),
            "PAGEWIRE_REQUIRE_ETCD is set but there is no `etcd` binary on the PATH \
             (Debian: apt-get install etcd-server)"
        );
        eprintln!("skipped: no `etcd` binary on the PATH (Debian: etcd-server)");
    }
    found
}

struct World {
    etcd_client: Vec<u16>,
    etcd_peer: Vec<u16>,
    etcd: Vec<Proc>,
    coord_ports: Vec<u16>,
    coords: Vec<Proc>,
    nodes: Vec<Proc>,
    prefix: String,
    /// Set: etcd serves its clients over TLS and requires client
    /// certificates (see [`EtcdTls`]).
    tls: Option<EtcdTls>,
    /// Last: removed after every process above was killed (coordinators,
    /// nodes, then etcd).
    dir: tempfile::TempDir,
}

/// `etcdctl` (API v3) with exactly `args`.
fn etcdctl(args: &[String]) -> std::process::Output {
    Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(args)
        .output()
        .expect("run etcdctl")
}

/// The certificates of the TLS test, made with the `openssl` CLI (P-256
/// keys, valid two days): a CA; etcd's server certificate from it, for
/// IP:127.0.0.1 and DNS:localhost (server and client use: etcd's gateway
/// dials etcd with it); a client certificate from it; and a client
/// certificate from a second CA, which etcd must refuse.
struct EtcdTls {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    other_client_cert: PathBuf,
    other_client_key: PathBuf,
}

/// Runs `openssl` with `args` in `dir`; panics with its output if it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run openssl (Debian: apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl EtcdTls {
    fn generate(dir: &Path) -> Self {
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
        for ca in ["ca", "other-ca"] {
            let mut args = vec!["req", "-x509", "-nodes", "-days", "2"];
            args.extend(ec);
            let (key, crt, subj) = (
                format!("{ca}.key"),
                format!("{ca}.crt"),
                format!("/CN=pagewire test {ca}"),
            );
            args.extend([
                "-keyout",
                &key,
                "-out",
                &crt,
                "-subj",
                &subj,
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign",
            ]);
            openssl(dir, &args);
        }
        for (name, ca, ext) in [
            (
                "etcd-server",
                "ca",
                "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
            ),
            ("client", "ca", "extendedKeyUsage=clientAuth\n"),
            ("other-client", "other-ca", "extendedKeyUsage=clientAuth\n"),
        ] {
            let (key, csr, crt, extfile, subj) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.crt"),
                format!("{name}.ext"),
                format!("/CN=pagewire test {name}"),
            );
            std::fs::write(dir.join(&extfile), ext).expect("extensions file");
            let mut args = vec!["req", "-nodes"];
            args.extend(ec);
            args.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
            openssl(dir, &args);
            let (ca_crt, ca_key) = (format!("{ca}.crt"), format!("{ca}.key"));
            openssl(
                dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    &ca_crt,
                    "-CAkey",
                    &ca_key,
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-out",
                    &crt,
                    "-extfile",
                    &extfile,
                ],
            );
        }
        Self {
            ca: dir.join("ca.crt"),
            server_cert: dir.join("etcd-server.crt"),
            server_key: dir.join("etcd-server.key"),
            client_cert: dir.join("client.crt"),
            client_key: dir.join("client.key"),
            other_client_cert: dir.join("other-client.crt"),
            other_client_key: dir.join("other-client.key"),
        }
    }

    /// `[etcd]` lines: `ca_file` and `cert_file`/`key_file`, each when given.
    fn config(&self, ca: Option<&Path>, identity: Option<(&Path, &Path)>) -> String {
        let mut s = String::new();
        if let Some(ca) = ca {
            s += &format!("ca_file = \"{}\"\n", ca.display());
        }
        if let Some((cert, key)) = identity {
            s += &format!(
                "cert_file = \"{}\"\nkey_file = \"{}\"\n",
                cert.display(),
                key.display()
            );
        }
        s
    }
}

/// Slot `i` of `procs` (a restart) or the next one (a first start).
fn put(procs: &mut Vec<Proc>, i: usize, proc: Proc) {
    if i < procs.len() {
        procs[i] = proc;
    } else {
        procs.push(proc);
    }
}

async fn coord(port: u16) -> Option<Coord> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .ok()?
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(3))
        .connect()
        .await
        .ok()?;
    Some(CoordinatorClient::with_interceptor(
        ch,
        AttachToken::new(TOKEN).expect("token"),
    ))
}

impl World {
    fn new(name: &str) -> Self {
        Self::start(name, false)
    }

    /// Three etcd members that serve their clients over TLS only and
    /// require a client certificate signed by the test's CA; the
    /// coordinators' config holds the CA, the client certificate and key.
    fn with_tls(name: &str) -> Self {
        Self::start(name, true)
    }

    fn start(name: &str, tls: bool) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("token"), TOKEN).expect("token file");
        // The self-describing file, generation 0.
        pattern::generate_file(&dir.path().join("data.bin"), FILE, PAGE as usize)
            .expect("backing file");
        let tls = tls.then(|| EtcdTls::generate(dir.path()));
        // Nine distinct ports: one picked twice made a member's peer URL
        // reach another member's client listener (404 on /raft/probing),
        // and the cluster never formed (seen once in CI).
        let ports = free_ports(9);
        let mut w = World {
            etcd_client: ports[0..3].to_vec(),
            etcd_peer: ports[3..6].to_vec(),
            etcd: Vec::new(),
            coord_ports: ports[6..9].to_vec(),
            coords: Vec::new(),
            nodes: Vec::new(),
            prefix: format!("/pagewire-test/{name}-{}/", std::process::id()),
            tls,
            dir,
        };
        for i in 0..3 {
            w.start_etcd(i);
        }
        w.wait_for("etcd to answer", Duration::from_secs(30), |w| {
            w.etcdctl(&["endpoint", "health"]).status.success()
        });
        let extra = w.tls.as_ref().map_or_else(String::new, |t| {
            t.config(Some(&t.ca), Some((&t.client_cert, &t.client_key)))
        });
        std::fs::write(w.path("coordinator.toml"), w.config(&extra)).expect("config");
        w
    }

    /// The coordinator's config: the `[etcd]` section every test uses,
    /// then `extra` (more lines of that section).
    fn config(&self, extra: &str) -> String {
        format!(
            "[etcd]\nprefix = \"{}\"\nlease_ttl_s = {TTL_S}\nrequest_timeout_ms = 2000\n{extra}",
            self.prefix
        )
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn endpoints(&self) -> String {
        self.etcd_client
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn coordinator_list(&self) -> String {
        self.coord_ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `https` when etcd serves its clients over TLS, else `http`.
    fn client_scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }

    fn start_etcd(&mut self, i: usize) {
        let cluster = (0..3)
            .map(|j| format!("e{j}=http://127.0.0.1:{}", self.etcd_peer[j]))
            .collect::<Vec<_>>()
            .join(",");
        let log = self.path(&format!("etcd-{i}.log"));
        let (c, p) = (self.etcd_client[i], self.etcd_peer[i]);
        let scheme = self.client_scheme();
        let mut cmd = Command::new("etcd");
        if let Some(t) = &self.tls {
            cmd.arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(&t.ca)
                .arg("--cert-file")
                .arg(&t.server_cert)
                .arg("--key-file")
                .arg(&t.server_key);
        }
        cmd.arg("--name")
            .arg(format!("e{i}"))
            .arg("--data-dir")
            .arg(self.path(&format!("etcd-{i}")))
            .arg(format!("--listen-client-urls={scheme}://127.0.0.1:{c}"))
            .arg(format!("--advertise-client-urls={scheme}://127.0.0.1:{c}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{p}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{p}"
            ))
            .arg(format!("--initial-cluster={cluster}"))
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "pagewire-test"]);
        let proc = Proc::start_all_output(format!("etcd-{i}"), &mut cmd, log);
        put(&mut self.etcd, i, proc);
    }

    /// `etcdctl` on every member, with the test's CA and client
    /// certificate when etcd serves TLS.
    fn etcdctl(&self, args: &[&str]) -> std::process::Output {
        let urls = self
            .etcd_client
            .iter()
            .map(|p| format!("{}://127.0.0.1:{p}", self.client_scheme()))
            .collect::<Vec<_>>()
            .join(",");
        let mut all = vec![format!("--endpoints={urls}")];
        if let Some(t) = &self.tls {
            all.push(format!("--cacert={}", t.ca.display()));
            all.push(format!("--cert={}", t.client_cert.display()));
            all.push(format!("--key={}", t.client_key.display()));
        }
        all.extend(args.iter().map(|a| (*a).to_owned()));
        etcdctl(&all)
    }

    fn start_coordinator(&mut self, i: usize) {
        let endpoints = self.endpoints();
        self.start_coordinator_on(i, &endpoints);
    }

    /// Starts coordinator `i` reaching etcd through `endpoints` only.
    fn start_coordinator_on(&mut self, i: usize, endpoints: &str) {
        let config = self.path("coordinator.toml");
        self.start_coordinator_with(i, endpoints, &config);
    }

    /// Starts coordinator `i` with the config file `config`.
    fn start_coordinator_with(&mut self, i: usize, endpoints: &str, config: &Path) {
        let mut cmd = coordinator_command(
            &common::daemons().coordinator,
            &format!("127.0.0.1:{}", self.coord_ports[i]),
            &self.path("token"),
            NODE_LEASE_MS,
            EXTENT,
        );
        cmd.arg("--config")
            .arg(config)
            .arg("--store")
            .arg(format!("etcd://{endpoints}"))
            .args(["--log", "info"]);
        let log = self.path(&format!("coordinator-{i}.log"));
        let proc = Proc::start(format!("coordinator-{i}"), &mut cmd, log);
        put(&mut self.coords, i, proc);
    }

    /// Starts coordinator `i` again and waits until it follows, with its
    /// copy of the state confirmed.
    fn restart_coordinator(&mut self, i: usize) {
        self.start_coordinator(i);
        self.wait_for(
            "the restarted coordinator to follow",
            Duration::from_secs(30),
            |w| {
                w.status(i).is_some_and(|s| {
                    s.role() == CoordinatorRole::Follower && s.store_problem.is_empty()
                })
            },
        );
    }

    fn start_node(&mut self, id: &str) {
        let mut cmd = node_command(
            &common::daemons().node,
            id,
            &self.path("data.bin"),
            &self.coordinator_list(),
            &self.path("token"),
            2048,
            &self.path(""),
        );
        let log = self.path(&format!("{id}.log"));
        self.nodes.push(Proc::start(id, &mut cmd, log));
    }

    fn wait_for(&self, what: &str, limit: Duration, mut ok: impl FnMut(&Self) -> bool) -> Duration {
        pagewire_testkit::wait_for(what, limit, || ok(self))
    }

    /// Status from coordinator `i`, if it answers.
    fn status(&self, i: usize) -> Option<StatusResponse> {
        let port = self.coord_ports[i];
        rt().block_on(async move {
            let mut c = coord(port).await?;
            c.status(StatusRequest {})
                .await
                .ok()
                .map(|r| r.into_inner())
        })
    }

    /// The index of the coordinator that says it leads (among `among`).
    fn leader(&self, among: &[usize]) -> Option<usize> {
        among.iter().copied().find(|&i| {
            self.status(i)
                .is_some_and(|s| s.role() == CoordinatorRole::Leader)
        })
    }

    fn map(&self, i: usize) -> Option<OwnershipMap> {
        let port = self.coord_ports[i];
        rt().block_on(async move {
            let mut c = coord(port).await?;
            c.get_map(GetMapRequest::default())
                .await
                .ok()
                .map(|r| r.into_inner())
        })
    }

    /// Registers a node that is never started (no heartbeat: its lease, of
    /// `NODE_LEASE_MS`, outlasts the test) through coordinator `i`; returns
    /// the epoch of the map it got.
    fn register_absent(&self, i: usize, node: &str) -> Result<u64, tonic::Status> {
        let port = self.coord_ports[i];
        let node = node.to_owned();
        rt().block_on(async move {
            let mut c = coord(port)
                .await
                .ok_or_else(|| tonic::Status::unavailable("no connection"))?;
            let r = c
                .register(RegisterRequest {
                    node_id: node,
                    grpc_address: "127.0.0.1:9".into(),
                    capacity_bytes: 1 << 30,
                    file_size: FILE,
                    page_size: PAGE as u32,
                    ..Default::default()
                })
                .await?
                .into_inner();
            Ok(r.map.map_or(0, |m| m.epoch))
        })
    }

    /// The epoch of the first map coordinator `i` streams to a watcher.
    fn first_watched(&self, i: usize) -> Result<u64, tonic::Status> {
        let port = self.coord_ports[i];
        rt().block_on(async move {
            let mut c = coord(port)
                .await
                .ok_or_else(|| tonic::Status::unavailable("no connection"))?;
            let mut maps = c.watch_map(WatchMapRequest::default()).await?.into_inner();
            match maps.message().await? {
                Some(m) => Ok(m.epoch),
                None => Err(tonic::Status::aborted("the stream ended with no map")),
            }
        })
    }

    /// Drain (or undrain) `node` through coordinator `i`.
    fn drain(&self, i: usize, node: &str, undrain: bool) -> Result<u64, tonic::Status> {
        let port = self.coord_ports[i];
        let node = node.to_owned();
        rt().block_on(async move {
            let mut c = coord(port)
                .await
                .ok_or_else(|| tonic::Status::unavailable("no connection"))?;
            let req = DrainRequest {
                node_id: node,
                incarnation: 0,
            };
            let r = if undrain {
                c.undrain(req).await?
            } else {
                c.drain(req).await?
            };
            Ok(r.into_inner().map_epoch)
        })
    }

    /// Waits until `n` nodes are alive, every extent is owned and no
    /// handoff is in progress, as coordinator `i` sees it.
    fn wait_settled(&self, i: usize, n: usize) -> OwnershipMap {
        let mut last = None;
        self.wait_for(
            &format!("{n} settled nodes"),
            Duration::from_secs(60),
            |w| {
                let Some(m) = w.map(i) else { return false };
                let alive = m
                    .nodes
                    .iter()
                    .filter(|x| x.state() == NodeState::Alive)
                    .count();
                let ok = m.epoch > 0
                    && alive == n
                    && !m.owner.is_empty()
                    && m.owner.iter().all(|&o| o != 0)
                    && m.previous_owner.iter().all(|&p| p == 0);
                if ok {
                    last = Some(m);
                }
                ok
            },
        );
        last.expect("map")
    }

    fn history(&self) -> Vec<(u64, EpochRecord)> {
        let eps: Vec<String> = self
            .etcd_client
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let prefix = self.prefix.clone();
        rt().block_on(async move { epoch_history(&eps, &prefix).await })
            .expect("epoch history")
    }
}

/// Every epoch from the first to the last is recorded exactly once (the
/// keys are unique; this checks there is no gap) and by the leader whose
/// fence was current. Returns the epochs per fence, in order.
fn check_history(h: &[(u64, EpochRecord)]) -> Vec<(String, i64, usize)> {
    assert!(!h.is_empty(), "no epoch recorded");
    for w in h.windows(2) {
        assert_eq!(
            w[1].0,
            w[0].0 + 1,
            "a gap in the epochs: {:?}",
            (w[0].0, w[1].0)
        );
        assert!(
            w[1].1.fence >= w[0].1.fence,
            "epoch {} carries an older fence ({}) than epoch {} ({}): a stale leader published",
            w[1].0,
            w[1].1.fence,
            w[0].0,
            w[0].1.fence
        );
    }
    let mut per: Vec<(String, i64, usize)> = Vec::new();
    for (_, r) in h {
        match per.last_mut() {
            Some((_, f, n)) if *f == r.fence => *n += 1,
            _ => per.push((r.leader.clone(), r.fence, 1)),
        }
    }
    per
}

/// Reads random pages from random nodes over gRPC and verifies every byte
/// until stopped; counts reads, errors and wrong reads.
struct Reader {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    wrong: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Reader {
    fn start(coordinators: String) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(AtomicU64::new(0));
        let wrong = Arc::new(AtomicU64::new(0));
        let (s, o, e, wr) = (stop.clone(), ok.clone(), errors.clone(), wrong.clone());
        let thread = std::thread::spawn(move || {
            let rt = rt();
            rt.block_on(async move {
                let ports: Vec<u16> = coordinators
                    .split(',')
                    .filter_map(|a| a.rsplit_once(':')?.1.parse().ok())
                    .collect();
                let mut rng = 0x1234_5678_9abc_def0u64;
                let mut nodes: Vec<String> = Vec::new();
                let mut want = vec![0u8; PAGE as usize];
                while !s.load(Ordering::Relaxed) {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    if nodes.is_empty() || rng.is_multiple_of(64) {
                        for &p in &ports {
                            if let Some(mut c) = coord(p).await
                                && let Ok(r) = c.list_nodes(ListNodesRequest {}).await
                            {
                                nodes = r
                                    .into_inner()
                                    .nodes
                                    .into_iter()
                                    .filter(|n| n.state() == NodeState::Alive)
                                    .map(|n| n.grpc_address)
                                    .collect();
                                break;
                            }
                        }
                        if nodes.is_empty() {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    }
                    let addr = &nodes[(rng as usize / 7) % nodes.len()];
                    let page = (rng >> 20) % (FILE / PAGE);
                    let read = async {
                        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                            .ok()?
                            .connect_timeout(Duration::from_millis(500))
                            .timeout(Duration::from_secs(3))
                            .connect()
                            .await
                            .ok()?;
                        let mut n = NodeClient::with_interceptor(ch, AttachToken::new(TOKEN).ok()?);
                        n.read(ReadRequest {
                            run: Some(PageRun {
                                first_page: page,
                                page_count: 1,
                            }),
                            map_epoch: 0,
                        })
                        .await
                        .ok()
                    };
                    match read.await {
                        Some(r) => {
                            pattern::fill(page, 0, &mut want);
                            if r.into_inner().data == want {
                                o.fetch_add(1, Ordering::Relaxed);
                            } else {
                                wr.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        None => {
                            e.fetch_add(1, Ordering::Relaxed);
                            nodes.clear();
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            });
        });
        Reader {
            stop,
            ok,
            errors,
            wrong,
            thread: Some(thread),
        }
    }

    fn ok(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }

    /// Stops; returns (verified reads, errors, wrong reads).
    fn finish(mut self) -> (u64, u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("reader");
        }
        (
            self.ok.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
            self.wrong.load(Ordering::Relaxed),
        )
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn log_has(p: &Proc, text: &str) -> bool {
    p.log_text().contains(text)
}

fn since(p: &Path) -> usize {
    std::fs::read_to_string(p).map_or(0, |s| s.len())
}

/// Three etcd members, three coordinators, two settled nodes, and a reader
/// that has read.
fn started(name: &str) -> (World, Reader) {
    let mut w = World::new(name);
    for i in 0..3 {
        w.start_coordinator(i);
    }
    let all = [0, 1, 2];
    w.wait_for("a leader", Duration::from_secs(30), |w| {
        w.leader(&all).is_some()
    });
    w.start_node("node-a");
    w.start_node("node-b");
    w.wait_settled(w.leader(&all).expect("leader"), 2);
    let reader = Reader::start(w.coordinator_list());
    w.wait_for("the reader to read", Duration::from_secs(30), |_| {
        reader.ok() > 20
    });
    (w, reader)
}

#[test]
fn killing_the_leader_fails_over_and_the_map_goes_on() {
    if !etcd_available() {
        return;
    }
    let (mut w, reader) = started("kill");
    let all = [0, 1, 2];

    let mut failover = Vec::new();
    for round in 0..5 {
        let old = w.leader(&all).expect("a leader");
        let epoch_before = w.status(old).expect("status").epoch;
        let others: Vec<usize> = all.iter().copied().filter(|&i| i != old).collect();
        let t0 = Instant::now();
        w.coords[old].kill9();
        if round == 0 {
            // A node joins while there is no leader.
            w.start_node("node-c");
        }
        w.wait_for("a new leader", Duration::from_secs(30), |w| {
            w.leader(&others).is_some()
        });
        let took = t0.elapsed();
        failover.push(took.as_secs_f64());
        let new = w.leader(&others).expect("new leader");
        let st = w.status(new).expect("status");
        assert!(
            st.epoch >= epoch_before,
            "the epoch went back across the failover: {} -> {}",
            epoch_before,
            st.epoch
        );
        assert_eq!(st.leader, format!("127.0.0.1:{}", w.coord_ports[new]));
        if round == 0 {
            let m = w.wait_settled(new, 3);
            eprintln!(
                "node-c, started with no leader, is serving at epoch {} {:.2} s after the kill",
                m.epoch,
                t0.elapsed().as_secs_f64()
            );
        }
        eprintln!(
            "round {round}: coordinator-{old} killed at epoch {epoch_before}; coordinator-{new} \
             leads after {:.2} s at epoch {}",
            took.as_secs_f64(),
            st.epoch
        );
        w.restart_coordinator(old);
    }
    // A leader stopped on purpose hands over at once: it revokes its lease.
    let old = w.leader(&all).expect("a leader");
    let others: Vec<usize> = all.iter().copied().filter(|&i| i != old).collect();
    let t0 = Instant::now();
    w.coords[old].signal("TERM");
    w.wait_for("a leader after SIGTERM", Duration::from_secs(30), |w| {
        w.leader(&others).is_some()
    });
    let handover = t0.elapsed();
    assert!(
        handover < Duration::from_secs(TTL_S),
        "a SIGTERMed leader made the others wait out its lease ({handover:?})"
    );
    let exited = Instant::now();
    let status = loop {
        let child = &mut w.coords[old].child;
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            exited.elapsed() < Duration::from_secs(10),
            "the SIGTERMed coordinator did not exit within 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "SIGTERM exit: {status:?}");
    eprintln!(
        "SIGTERM of the leader: another led after {:.2} s",
        handover.as_secs_f64()
    );
    w.restart_coordinator(old);
    let leader = w.leader(&all).expect("leader");
    let map = w.wait_settled(leader, 3);
    assert!(
        map.owner.iter().all(|&o| o != 0),
        "an extent is left unowned"
    );
    // A follower sends ListNodes to the leader, which alone has the
    // heartbeat fields.
    let follower = all
        .iter()
        .copied()
        .find(|&i| i != leader)
        .expect("a follower");
    let port = w.coord_ports[follower];
    let refused = rt()
        .block_on(async move {
            let mut c = coord(port).await.expect("connect");
            c.list_nodes(ListNodesRequest {}).await
        })
        .expect_err("a follower answered ListNodes while a leader is known");
    assert_eq!(
        pagewire_proto::leader::leader_hint(&refused),
        Some(format!("127.0.0.1:{}", w.coord_ports[leader])),
        "{refused:?}"
    );
    // Every coordinator serves the same map.
    for i in all {
        let m = w.map(i).expect("a follower's map");
        assert_eq!(
            (m.epoch, &m.owner),
            (map.epoch, &map.owner),
            "coordinator-{i}"
        );
    }
    let (ok, errors, wrong) = reader.finish();
    let h = w.history();
    let per = check_history(&h);
    assert_eq!(h.last().map(|(e, _)| *e), Some(map.epoch));
    eprintln!(
        "failover after kill -9 of the leader (etcd lease {TTL_S} s), 5 kills: median {:.2} s, \
         all {:?}",
        median(&mut failover.clone()),
        failover
            .iter()
            .map(|t| format!("{t:.2}"))
            .collect::<Vec<_>>()
    );
    eprintln!(
        "epochs per leader (address, fence, epochs): {per:?}; reads verified {ok}, errors \
         {errors}, wrong {wrong}"
    );
    assert_eq!(wrong, 0, "wrong reads");
    assert!(ok > 0);
}

#[test]
fn a_leader_paused_past_its_lease_never_publishes_again() {
    if !etcd_available() {
        return;
    }
    let (w, reader) = started("pause");
    let all = [0, 1, 2];
    let old = w.leader(&all).expect("leader");
    let old_fence = w.history().last().expect("an epoch").1.fence;

    w.coords[old].signal("STOP");
    let others: Vec<usize> = all.iter().copied().filter(|&i| i != old).collect();
    let took = w.wait_for("a new leader", Duration::from_secs(30), |w| {
        w.leader(&others).is_some()
    });
    let new = w.leader(&others).expect("new leader");
    // The new leader publishes: node-b drains.
    let drained_at = w
        .drain(new, "node-b", false)
        .expect("drain through the new leader");
    let log_mark = since(&w.coords[old].log);
    w.coords[old].signal("CONT");
    // Give the old leader time to wake up and try.
    std::thread::sleep(Duration::from_secs(3));
    let st = w.status(old).expect("the old leader answers");
    assert_ne!(
        st.role(),
        CoordinatorRole::Leader,
        "the old leader still says it leads"
    );
    // A write through it goes to the new leader (or is refused naming it).
    match w.drain(old, "node-b", true) {
        Ok(_) => panic!("the old leader served a write"),
        Err(s) => {
            assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
            assert_eq!(
                pagewire_proto::leader::leader_hint(&s).as_deref(),
                Some(format!("127.0.0.1:{}", w.coord_ports[new]).as_str()),
                "{s:?}"
            );
        }
    }
    let woke = w.coords[old].log_text()[log_mark..].to_owned();
    assert!(
        !woke.contains("new ownership map"),
        "the old leader published after waking:\n{woke}"
    );
    let h = w.history();
    let per = check_history(&h);
    let new_fence = h
        .iter()
        .find(|(e, _)| *e == drained_at)
        .expect("the drain's epoch")
        .1
        .fence;
    assert!(new_fence > old_fence);
    for (e, r) in &h {
        if *e >= drained_at {
            assert_eq!(
                r.fence, new_fence,
                "epoch {e} was written under fence {} (the old leader's is {old_fence})",
                r.fence
            );
        }
    }
    let (ok, errors, wrong) = reader.finish();
    eprintln!(
        "SIGSTOP of the leader: coordinator-{new} led after {:.2} s; the old leader woke as \
         {:?}; epochs per leader: {per:?}; reads verified {ok}, errors {errors}, wrong {wrong}",
        took.as_secs_f64(),
        st.role()
    );
    assert_eq!(wrong, 0, "wrong reads");
}

#[test]
fn losing_etcd_quorum_stalls_map_changes_and_they_resume() {
    if !etcd_available() {
        return;
    }
    let (mut w, reader) = started("quorum");
    let all = [0, 1, 2];

    // One member of three down: the coordinators keep working. If it was
    // etcd's own leader, etcd elects another (about a second), and a write
    // meanwhile may wait or be refused: retry for a while.
    let before = w.leader(&all).expect("leader");
    w.etcd[2].kill9();
    let t1 = Instant::now();
    let mut e1 = 0;
    w.wait_for(
        "a map change with one etcd member down",
        Duration::from_secs(15),
        |w| {
            let Some(l) = w.leader(&all) else {
                return false;
            };
            match w.drain(l, "node-b", false) {
                Ok(e) => {
                    e1 = e;
                    true
                }
                Err(_) => false,
            }
        },
    );
    let one_down = t1.elapsed();
    let l = w.leader(&all).expect("leader");
    let e2 = w
        .drain(l, "node-b", true)
        .expect("undrain with one etcd member down");
    assert!(e2 > e1);
    std::thread::sleep(Duration::from_secs(TTL_S + 1));
    let after = w.leader(&all).expect("a leader with one etcd member down");
    eprintln!(
        "one etcd member of three down: the first map change took {:.2} s; the leader {}",
        one_down.as_secs_f64(),
        if after == before { "stayed" } else { "moved" }
    );
    let l = after;

    // Two down: no quorum.
    let epoch = w.status(l).expect("status").epoch;
    let ok_before = reader.ok();
    let t_lost = Instant::now();
    w.etcd[1].kill9();
    w.wait_for(
        "every coordinator to report the store problem",
        Duration::from_secs(30),
        |w| {
            all.iter().all(|&i| {
                w.status(i).is_some_and(|s| {
                    !s.store_problem.is_empty() && s.role() != CoordinatorRole::Leader
                })
            })
        },
    );
    eprintln!(
        "two etcd members down: every coordinator reported it after {:.2} s: {:?}",
        t_lost.elapsed().as_secs_f64(),
        w.status(0).map(|s| s.store_problem)
    );
    w.wait_for("the logs to say why", Duration::from_secs(30), |w| {
        w.coords.iter().any(|c| log_has(c, "etcd does not answer"))
    });
    let mut refused = 0;
    for _ in 0..5 {
        for i in all {
            match w.drain(i, "node-b", false) {
                Ok(e) => panic!("a map change was published without quorum (epoch {e})"),
                Err(s) => {
                    assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
                    refused += 1;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    for i in all {
        if let Some(s) = w.status(i) {
            assert_eq!(
                s.epoch, epoch,
                "coordinator-{i} moved the epoch without quorum"
            );
        }
    }
    // The nodes keep serving the map they have.
    let before = reader.ok();
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        reader.ok() > before,
        "the nodes stopped serving reads without etcd quorum"
    );
    let stalled_reads = reader.ok() - ok_before;

    // A member comes back: a leader again, and map changes resume.
    let t_back = Instant::now();
    w.start_etcd(1);
    w.wait_for(
        "a leader after quorum returned",
        Duration::from_secs(60),
        |w| w.leader(&all).is_some(),
    );
    let leader_after = t_back.elapsed();
    let l = w.leader(&all).expect("leader");
    let mut changed = None;
    w.wait_for("a map change to succeed", Duration::from_secs(30), |w| {
        changed = w.drain(l, "node-b", false).ok();
        changed.is_some()
    });
    let resumed = t_back.elapsed();
    let stall = t_lost.elapsed();
    assert!(changed.expect("epoch") > epoch);
    w.drain(l, "node-b", true).expect("undrain");
    let (ok, errors, wrong) = reader.finish();
    let h = w.history();
    let per = check_history(&h);
    eprintln!(
        "map changes stalled {:.2} s from the second etcd kill to the first change after a member \
         returned ({refused} refused meanwhile, {stalled_reads} reads served); after it returned: \
         a leader in {:.2} s, the first map change in {:.2} s; epochs per leader: {per:?}; reads \
         verified {ok}, errors {errors}, wrong {wrong}",
        stall.as_secs_f64(),
        leader_after.as_secs_f64(),
        resumed.as_secs_f64()
    );
    assert_eq!(wrong, 0, "wrong reads");
}

#[test]
fn etcd_with_authentication_needs_the_user_and_password() {
    if !etcd_available() {
        return;
    }
    let mut w = World::new("auth");
    for args in [
        &["user", "add", "root", "--new-user-password=root-secret"][..],
        &["user", "add", "pagewire", "--new-user-password=pw-secret"][..],
        &["role", "add", "pagewire"][..],
        &[
            "role",
            "grant-permission",
            "pagewire",
            "--prefix=true",
            "readwrite",
            "/pagewire-test/",
        ][..],
        &["user", "grant-role", "pagewire", "pagewire"][..],
        &["auth", "enable"][..],
    ] {
        let out = w.etcdctl(args);
        assert!(out.status.success(), "etcdctl {args:?}: {out:?}");
    }
    // Without credentials: it cannot campaign, and says why.
    w.start_coordinator(0);
    w.wait_for("the refusal in the log", Duration::from_secs(30), |w| {
        let log = w.coords[0].log_text();
        log.contains("etcd does not answer") || log.contains("cannot connect to etcd")
    });
    assert!(
        w.status(0)
            .is_none_or(|s| s.role() != CoordinatorRole::Leader)
    );
    w.coords[0].kill9();
    // With them: it leads, and a node registers.
    std::fs::write(w.path("etcd-password"), "pw-secret\n").expect("password file");
    let cfg = w.config(&format!(
        "username = \"pagewire\"\npassword_file = \"{}\"\n",
        w.path("etcd-password").display()
    ));
    std::fs::write(w.path("coordinator.toml"), cfg).expect("config");
    w.start_coordinator(0);
    w.wait_for("a leader with credentials", Duration::from_secs(30), |w| {
        w.leader(&[0]).is_some()
    });
    w.start_node("node-a");
    let m = w.wait_settled(0, 1);
    assert!(m.epoch >= 1);
    eprintln!(
        "etcd with authentication: led and published epoch {}",
        m.epoch
    );
}

/// A follower whose copy of the state lags (it reaches etcd through one
/// member only, which dies) streams no map to a node: its copy may be older
/// than one the node applied. It refuses, as GetMap does, and a follower
/// that can confirm its copy streams the current map.
#[test]
fn a_follower_cut_off_from_etcd_streams_no_stale_map() {
    if !etcd_available() {
        return;
    }
    let mut w = World::new("watch");
    w.start_coordinator(0);
    w.wait_for("coordinator-0 to lead", Duration::from_secs(30), |w| {
        w.leader(&[0]).is_some()
    });
    w.start_coordinator(1);
    let only = format!("127.0.0.1:{}", w.etcd_client[2]);
    w.start_coordinator_on(2, &only);
    let e1 = w
        .register_absent(0, "absent-a")
        .expect("register through the leader");
    assert!(e1 > 0);
    for i in [1, 2] {
        w.wait_for(
            "the followers to hold the map",
            Duration::from_secs(30),
            |w| {
                w.status(i).is_some_and(|s| {
                    s.role() == CoordinatorRole::Follower && s.store_problem.is_empty()
                }) && w.map(i).is_some_and(|m| m.epoch == e1)
            },
        );
    }
    assert_eq!(
        w.first_watched(2).expect("a confirmed follower streams"),
        e1
    );

    // Killing etcd member 2 may kill etcd's own leader: the write in flight
    // during etcd's election can time out, and coordinator-0 then resigns
    // and coordinator-1 may take over. So the change goes through whichever
    // of the two leads (coordinator-2 reaches etcd only through member 2).
    w.etcd[2].kill9();
    let mut e2 = 0;
    w.wait_for(
        "a map change with etcd member 2 down",
        Duration::from_secs(15),
        |w| {
            let Some(l) = w.leader(&[0, 1]) else {
                return false;
            };
            match w.register_absent(l, "absent-b") {
                Ok(e) => {
                    e2 = e;
                    true
                }
                Err(_) => false,
            }
        },
    );
    assert!(e2 > e1);
    match w.first_watched(2) {
        Ok(epoch) => panic!(
            "coordinator-2, cut off from etcd, streamed epoch {epoch} while the cluster is at {e2}"
        ),
        Err(s) => {
            // Refused as not leading, naming the leader if it knows it
            // still (its etcd session may have ended meanwhile).
            assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
            assert!(s.message().contains("cannot confirm"), "{s:?}");
            // The hint is the leader it last saw: coordinator-0, or
            // coordinator-1 had it taken over before member 2 died.
            if let Some(l) = pagewire_proto::leader::leader_hint(&s) {
                let known = [0, 1].map(|i| format!("127.0.0.1:{}", w.coord_ports[i]));
                assert!(known.contains(&l), "{s:?}");
            }
            eprintln!(
                "coordinator-2, cut off from etcd, refused WatchMap: {}",
                s.message()
            );
        }
    }
    w.wait_for(
        "coordinator-1 to stream the current map",
        Duration::from_secs(15),
        |w| w.first_watched(1).is_ok_and(|e| e == e2),
    );
}

/// etcd over TLS with client certificates, made at test time with the
/// `openssl` CLI ([`EtcdTls`]). The three members serve their clients over
/// https only and require a certificate from the test's CA
/// (`--client-cert-auth`); they talk to each other over plain http on
/// loopback. First etcdctl shows that etcd refuses a plain connection, one
/// without a client certificate and one with another CA's, so a coordinator
/// that leads here went through TLS with its certificate. Coordinators with
/// those three configs do not lead, and their logs and Status say which
/// endpoints refused them and why; one with `cert_file` but no `ca_file`
/// does not start. With `ca_file`, `cert_file` and `key_file` two
/// coordinators elect a leader, a node registers and the map is published;
/// after kill -9 of the leader the other leads within about the lease.
#[test]
fn etcd_over_tls_needs_the_ca_and_a_client_certificate() {
    if !etcd_available() {
        return;
    }
    let t0 = Instant::now();
    let mut w = World::with_tls("tls");
    let t = w.tls.as_ref().expect("TLS files");
    let (ca, other) = (
        t.ca.clone(),
        (t.other_client_cert.clone(), t.other_client_key.clone()),
    );
    let member = format!("127.0.0.1:{}", w.etcd_client[0]);
    let no_cert = t.config(Some(&ca), None);
    let other_cert = t.config(Some(&ca), Some((&other.0, &other.1)));

    // etcd itself refuses what is not TLS with a certificate of the CA.
    let quick = ["--dial-timeout=1s", "--command-timeout=2s", "get", "probe"];
    for (what, mut args) in [
        ("plain http", vec![format!("--endpoints=http://{member}")]),
        (
            "no client certificate",
            vec![
                format!("--endpoints=https://{member}"),
                format!("--cacert={}", ca.display()),
            ],
        ),
        (
            "another CA's client certificate",
            vec![
                format!("--endpoints=https://{member}"),
                format!("--cacert={}", ca.display()),
                format!("--cert={}", other.0.display()),
                format!("--key={}", other.1.display()),
            ],
        ),
    ] {
        args.extend(quick.map(String::from));
        let out = etcdctl(&args);
        assert!(
            !out.status.success(),
            "etcd answered etcdctl with {what}: TLS is not enforced"
        );
    }
    assert!(
        w.etcdctl(&quick).status.success(),
        "etcdctl with the CA's client certificate"
    );
    eprintln!(
        "TLS: certificates made and etcd up, refusing plain, anonymous and other-CA clients, \
         after {:.2} s",
        t0.elapsed().as_secs_f64()
    );

    // The three configs etcd refuses: none leads, and each says which
    // endpoints refused it and why, in its log and in Status.
    let endpoints = w.endpoints();
    let cases = [
        (
            String::new(),
            "etcd serves TLS (https) but this coordinator speaks plain http: set etcd.ca_file",
        ),
        (
            no_cert,
            "it requires a client certificate; set etcd.cert_file and etcd.key_file",
        ),
        (
            other_cert,
            "etcd refused this coordinator's client certificate etcd.cert_file",
        ),
    ];
    for (i, (extra, _)) in cases.iter().enumerate() {
        let cfg = w.path(&format!("coordinator-{i}-refused.toml"));
        std::fs::write(&cfg, w.config(extra)).expect("config");
        w.start_coordinator_with(i, &endpoints, &cfg);
    }
    let named = |text: &str| text.contains(&format!("etcd {}", endpoints.replace(',', ", ")));
    for (i, (_, why)) in cases.iter().enumerate() {
        w.wait_for("the refusal in the log", Duration::from_secs(20), |w| {
            let log = w.coords[i].log_text();
            log.contains(why) && named(&log)
        });
        let st = w.status(i).expect("a refused coordinator answers Status");
        assert_ne!(st.role(), CoordinatorRole::Leader, "coordinator-{i}");
        assert!(
            st.store_problem.contains(why) && named(&st.store_problem),
            "coordinator-{i}: {}",
            st.store_problem
        );
        eprintln!("refused config {i}: {}", st.store_problem);
    }
    for c in &mut w.coords {
        c.kill9();
    }
    // A client certificate without ca_file is refused at start.
    let no_ca = w.path("coordinator-no-ca.toml");
    let t = w.tls.as_ref().expect("TLS files");
    let identity = t.config(None, Some((&t.client_cert, &t.client_key)));
    std::fs::write(&no_ca, w.config(&identity)).expect("config");
    w.start_coordinator_with(0, &endpoints, &no_ca);
    let exit = w.coords[0].child.wait().expect("wait");
    let log = w.coords[0].log_text();
    assert!(
        !exit.success() && log.contains("etcd.ca_file"),
        "{exit:?}: {log}"
    );

    // With the CA's client certificate: a leader, a node, a map.
    w.start_coordinator(0);
    w.start_coordinator(1);
    let both = [0, 1];
    w.wait_for("a leader over TLS", Duration::from_secs(30), |w| {
        w.leader(&both).is_some()
    });
    w.start_node("node-a");
    let old = w.leader(&both).expect("leader");
    let m = w.wait_settled(old, 1);
    let other = 1 - old;
    w.wait_for("the other to follow", Duration::from_secs(30), |w| {
        w.status(other)
            .is_some_and(|s| s.role() == CoordinatorRole::Follower && s.store_problem.is_empty())
    });

    // kill -9 of the leader: the other leads after its lease ran out.
    let t1 = Instant::now();
    w.coords[old].kill9();
    let took = w.wait_for("a new leader over TLS", Duration::from_secs(30), |w| {
        w.leader(&[other]).is_some()
    });
    assert!(
        took < Duration::from_secs(2 * TTL_S),
        "failover took {took:?}, the lease is {TTL_S} s"
    );
    let e = w
        .register_absent(other, "absent-a")
        .expect("a map change through the new leader");
    assert!(e > m.epoch, "{e} after {}", m.epoch);
    eprintln!(
        "etcd over TLS: coordinator-{old} led and published epoch {}; after its kill -9 \
         coordinator-{other} led in {:.2} s (etcd lease {TTL_S} s) and published epoch {e}; \
         {:.2} s in all",
        m.epoch,
        t1.elapsed().as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}
