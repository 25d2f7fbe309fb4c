//! Where the one-sided rows read: the owner's regions (the daemon's, or the
//! bench's own owner process), and the one-sided clients over `shm`,
//! `tcp` and `verbs`, primed so their index caches know every frame, plus
//! the frame-only floor client.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use pagewire_client::one_sided::{ReaderConfig, RemoteReader};
use pagewire_rdma::RegionDescriptor;
use pagewire_rdma::shm::{ShmConfig, ShmConnection};
use pagewire_rdma::tcp::{ConnectionConfig, TcpConnection};

use super::clients::{self, Client};
use super::cluster;
use super::measure::OwnerCpu;

/// How the one-sided rows reach their owner.
pub(super) struct OneSidedTarget {
    pub(super) label: &'static str,
    pub(super) cpu: OwnerCpu,
    /// The owner's shm file (folder, name), when it is on this host.
    pub(super) shm: Option<(PathBuf, String, RegionDescriptor)>,
    pub(super) tcp_addr: std::net::SocketAddr,
    pub(super) tcp: RegionDescriptor,
    /// The verbs control endpoint, when the owner serves verbs.
    pub(super) verbs: Option<(String, RegionDescriptor)>,
    /// The owner's tcp polling counters, when it can tell them.
    pub(super) spin: Option<super::owner::SpinProbe>,
}

/// A tmpfs folder for the `shm` owner (/dev/shm when there is one).
pub(super) fn shm_tempdir() -> anyhow::Result<tempfile::TempDir> {
    let b = {
        let mut b = tempfile::Builder::new();
        b.prefix("pagewire-bench-remote-");
        b
    };
    if Path::new("/dev/shm").is_dir()
        && let Ok(d) = b.tempdir_in("/dev/shm")
    {
        return Ok(d);
    }
    Ok(b.tempdir()?)
}

/// The one-sided target named by the daemon's `Transports`: its tcp
/// region, and its shm and verbs regions when it serves them.
pub(super) fn daemon_target(c: &cluster::Cluster, cpu: OwnerCpu) -> Option<OneSidedTarget> {
    let desc = |t: &pagewire_proto::v1::TransportDescriptor| RegionDescriptor {
        addr: t.address,
        len: t.length,
        rkey: u32::try_from(t.rkey).unwrap_or(0),
        epoch: t.epoch,
    };
    let kind = |k: &str| c.transports.iter().find(|t| t.kind == k);
    let tcp = kind("tcp")?;
    let shm = kind("shm").and_then(|t| {
        Some((
            PathBuf::from(String::from_utf8(t.opaque.clone()).ok()?),
            t.endpoint.clone(),
            desc(t),
        ))
    });
    Some(OneSidedTarget {
        label: "pagewire-node",
        cpu,
        shm,
        tcp_addr: tcp.endpoint.parse().ok()?,
        tcp: desc(tcp),
        verbs: kind("verbs").map(|t| (t.endpoint.clone(), desc(t))),
        // The daemon's responder counters are not exported.
        spin: None,
    })
}

pub(super) fn one_sided_clients(
    t: &OneSidedTarget,
    transport: &str,
    n: usize,
    cold: bool,
    spin: Duration,
    token: &str,
) -> anyhow::Result<Vec<Box<dyn Client>>> {
    if transport == "verbs" {
        return verbs_clients(t, n, cold, token, None);
    }
    let mut v: Vec<Box<dyn Client>> = Vec::new();
    for _ in 0..n {
        v.push(if transport == "shm" {
            let (dir, name, desc) = t
                .shm
                .clone()
                .context("the owner serves no shm region here")?;
            let conn = ShmConnection::connect(
                &name,
                ShmConfig {
                    dir: Some(dir),
                    chaos: None,
                },
            )?;
            Box::new(clients::OneSided::new(
                RemoteReader::connect(conn, desc, ReaderConfig::default())?,
                cold,
            ))
        } else {
            let conn = TcpConnection::connect(
                t.tcp_addr,
                ConnectionConfig {
                    spin,
                    ..ConnectionConfig::new(token)
                },
            )?;
            Box::new(clients::OneSided::new(
                RemoteReader::connect(conn, t.tcp, ReaderConfig::default())?,
                cold,
            ))
        });
    }
    Ok(v)
}

/// `n` readers sharing one queue pair to the owner, as the threads of a
/// reader process do (`pagewire_client::cluster`).
#[cfg(feature = "verbs")]
pub(super) fn verbs_clients(
    t: &OneSidedTarget,
    n: usize,
    cold: bool,
    token: &str,
    frame_only: Option<u64>,
) -> anyhow::Result<Vec<Box<dyn Client>>> {
    use pagewire_rdma::SharedConnection;
    use pagewire_rdma::verbs::{VerbsConfig, VerbsConnection};
    let (endpoint, desc) = t
        .verbs
        .clone()
        .context("the owner serves no verbs region")?;
    let mut cfg = VerbsConfig::new(token.as_bytes().to_vec());
    // A warm run of 16 pages is 32 READs (headers and frames) under one
    // doorbell.
    cfg.max_outstanding = 64;
    cfg.max_read_len = 64 << 10;
    let shared = SharedConnection::new(
        VerbsConnection::connect(endpoint.as_str(), cfg.with_link_tuning_from_env())
            .with_context(|| format!("verbs connection to {endpoint}"))?,
    );
    let mut v: Vec<Box<dyn Client>> = Vec::new();
    for _ in 0..n {
        v.push(Box::new(clients::OneSided::new(
            RemoteReader::connect(shared.handle(), desc, ReaderConfig::default())?,
            cold,
        )));
    }
    if let Some(pages) = frame_only {
        // A reader primed over the same queue pair names the frames.
        let mut r = RemoteReader::connect(shared.handle(), desc, ReaderConfig::default())?;
        prime_locations(&mut r, pages)?;
        v.push(Box::new(clients::FrameOnly::new(
            &r,
            shared.handle(),
            desc,
            pages,
        )?));
    }
    Ok(v)
}

/// Reads every page once, so the reader's index cache knows every frame.
pub(super) fn prime_locations<C: pagewire_rdma::Connection>(
    r: &mut RemoteReader<C>,
    pages: u64,
) -> anyhow::Result<()> {
    let mut buf = vec![0u8; r.superblock().layout.page_size];
    for p in 0..pages {
        match r.read_page(p, &mut buf)? {
            pagewire_client::one_sided::Outcome::Hit { .. } => {}
            o => bail!("priming: page {p} was not one-sided readable ({o:?})"),
        }
    }
    Ok(())
}

/// The frame-only floor of `transport` ([`clients::FrameOnly`]): one client.
pub(super) fn frame_only_client(
    t: &OneSidedTarget,
    transport: &str,
    pages: u64,
    spin: Duration,
    token: &str,
) -> anyhow::Result<Box<dyn Client>> {
    if transport == "verbs" {
        let mut v = verbs_clients(t, 0, false, token, Some(pages))?;
        return v.pop().context("no frame-only client");
    }
    let conn = || {
        TcpConnection::connect(
            t.tcp_addr,
            ConnectionConfig {
                spin,
                ..ConnectionConfig::new(token)
            },
        )
    };
    let mut r = RemoteReader::connect(conn()?, t.tcp, ReaderConfig::default())?;
    prime_locations(&mut r, pages)?;
    Ok(Box::new(clients::FrameOnly::new(
        &r,
        conn()?,
        t.tcp,
        pages,
    )?))
}

#[cfg(not(feature = "verbs"))]
pub(super) fn verbs_clients(
    _: &OneSidedTarget,
    _: usize,
    _: bool,
    _: &str,
    _: Option<u64>,
) -> anyhow::Result<Vec<Box<dyn Client>>> {
    bail!("the verbs rows need pagewire-bench built with --features verbs")
}
