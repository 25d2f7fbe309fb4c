//! Connections to one owner's region, and the gRPC fault-in on the owner:
//! what the node daemon (`daemon::remote_source`) and the standalone
//! [`crate::client::ClusterClient`] share.
//!
//! An owner publishes its region in the ownership map (`MapNode.transports`):
//! one descriptor per transport, all of one region epoch, which changes
//! when the owner restarts. A connection remembers the epoch it was opened
//! with; the caller compares it with the map's ([`region_epoch`]) and
//! reconnects when they differ. The reader itself refuses a descriptor of
//! an earlier incarnation ([`crate::remote::RemoteError::Stale`]).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::remote::{Outcome, ReaderConfig, ReaderStats, RemoteError, RemoteReader};
use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::node_client::NodeClient;
use pagewire_proto::v1::{FaultInRequest, MapNode, PageRun, TransportDescriptor};
use pagewire_rdma::RegionDescriptor;
use pagewire_rdma::shm::{ShmConfig, ShmConnection};
use pagewire_rdma::tcp::{ConnectionConfig, TcpConnection};

/// A node's gRPC client with the cluster token attached.
pub(crate) type NodeRpc = NodeClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AttachToken>,
>;

/// Which transport one-sided reads of an owner may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransportChoice {
    /// `shm` when the owner's shm file is reachable from this host (a live
    /// owner under that name in the directory its descriptor names), else
    /// `tcp`.
    #[default]
    Auto,
    /// `shm` only: an owner on another host cannot be read.
    Shm,
    /// `tcp` only, even for an owner on this host.
    Tcp,
}

/// A one-sided reader over one of the transports.
pub(crate) enum Reader {
    Shm(RemoteReader<ShmConnection>),
    Tcp(RemoteReader<TcpConnection>),
}

impl Reader {
    pub(crate) fn read_page(&mut self, page: u64, out: &mut [u8]) -> Result<Outcome, RemoteError> {
        match self {
            Reader::Shm(r) => r.read_page(page, out),
            Reader::Tcp(r) => r.read_page(page, out),
        }
    }

    pub(crate) fn learn(&mut self, page: u64, frame: u32, generation: u64) {
        match self {
            Reader::Shm(r) => r.learn(page, frame, generation),
            Reader::Tcp(r) => r.learn(page, frame, generation),
        }
    }

    pub(crate) fn trust_until(&mut self, until: Instant) {
        match self {
            Reader::Shm(r) => r.trust_until(until),
            Reader::Tcp(r) => r.trust_until(until),
        }
    }

    pub(crate) fn stats(&self) -> ReaderStats {
        match self {
            Reader::Shm(r) => r.stats(),
            Reader::Tcp(r) => r.stats(),
        }
    }

    pub(crate) fn file_len(&self) -> u64 {
        match self {
            Reader::Shm(r) => r.superblock().file_len,
            Reader::Tcp(r) => r.superblock().file_len,
        }
    }
}

/// An open connection to one owner's region.
pub(crate) struct OwnerConn {
    /// The region epoch of the descriptor this reader was opened with.
    pub(crate) epoch: u64,
    pub(crate) reader: Reader,
}

/// How [`connect`] opens a connection.
pub(crate) struct ConnectHow<'a> {
    pub(crate) token: &'a str,
    pub(crate) transport: TransportChoice,
    pub(crate) reader: ReaderConfig,
    /// The tcp connection's settings (token, timeouts); the token is
    /// overwritten with `token`.
    pub(crate) tcp: ConnectionConfig,
}

impl<'a> ConnectHow<'a> {
    /// What the node daemon uses: shm if reachable, else tcp, with the
    /// transports' default settings.
    pub(crate) fn daemon(token: &'a str) -> Self {
        Self {
            token,
            transport: TransportChoice::Auto,
            reader: ReaderConfig::default(),
            tcp: ConnectionConfig::new(token.as_bytes().to_vec()),
        }
    }
}

/// The map's transport descriptor as the rdma crate names a region (None:
/// an rkey that does not fit, so the descriptor cannot be used).
pub(crate) fn descriptor(t: &TransportDescriptor) -> Option<RegionDescriptor> {
    Some(RegionDescriptor {
        addr: t.address,
        len: t.length,
        rkey: u32::try_from(t.rkey).ok()?,
        epoch: t.epoch,
    })
}

/// The region epoch the map names for `owner` (every transport of one
/// region carries the same one); a connection opened with another epoch is
/// of an earlier incarnation of the owner.
pub(crate) fn region_epoch(owner: &MapNode) -> Option<u64> {
    owner.transports.first().map(|t| t.epoch)
}

/// Opens a reader to `owner`: its shm file when allowed and on this host,
/// else its tcp responder when allowed. The error says why each descriptor
/// tried failed.
pub(crate) fn connect(owner: &MapNode, how: &ConnectHow<'_>) -> Result<OwnerConn, String> {
    let mut why = Vec::new();
    if how.transport != TransportChoice::Tcp {
        for t in owner.transports.iter().filter(|t| t.kind == "shm") {
            let Some(d) = descriptor(t) else { continue };
            let dir = PathBuf::from(String::from_utf8_lossy(&t.opaque).into_owned());
            match ShmConnection::connect(
                &t.endpoint,
                ShmConfig {
                    dir: Some(dir),
                    chaos: None,
                },
            ) {
                Ok(c) => match RemoteReader::connect(c, d, how.reader.clone()) {
                    Ok(r) => {
                        return Ok(OwnerConn {
                            epoch: d.epoch,
                            reader: Reader::Shm(r),
                        });
                    }
                    Err(e) => why.push(format!("shm: {e}")),
                },
                Err(e) => why.push(format!("shm: {e}")),
            }
        }
    }
    if how.transport != TransportChoice::Shm {
        for t in owner.transports.iter().filter(|t| t.kind == "tcp") {
            let Some(d) = descriptor(t) else { continue };
            let cfg = ConnectionConfig {
                token: how.token.as_bytes().to_vec(),
                ..how.tcp.clone()
            };
            match TcpConnection::connect(t.endpoint.as_str(), cfg) {
                Ok(c) => match RemoteReader::connect(c, d, how.reader.clone()) {
                    Ok(r) => {
                        return Ok(OwnerConn {
                            epoch: d.epoch,
                            reader: Reader::Tcp(r),
                        });
                    }
                    Err(e) => why.push(format!("tcp: {e}")),
                },
                Err(e) => why.push(format!("tcp: {}", chain(&e))),
            }
        }
    }
    if why.is_empty() {
        why.push(match how.transport {
            TransportChoice::Auto => "it publishes no shm or tcp descriptor".into(),
            TransportChoice::Shm => "it publishes no shm descriptor".into(),
            TransportChoice::Tcp => "it publishes no tcp descriptor".into(),
        });
    }
    Err(why.join("; "))
}

/// An error and its sources, `: `-separated (a source whose text the
/// message already shows is left out: several errors print their source).
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

/// What a fault-in on the owner returned for one page.
pub(crate) struct Faulted {
    /// The page's bytes (its valid length).
    pub(crate) data: Vec<u8>,
    /// Where the owner holds it: frame and frame generation; `None` when
    /// the owner served it without caching it (generation 0 on the wire).
    pub(crate) location: Option<(u32, u64)>,
}

/// Faults `page` in on its owner (`FaultIn` with `want_data`) and takes the
/// bytes and the frame's location from the reply. `map_epoch` is the
/// caller's map epoch (0: none).
pub(crate) async fn fault_in(
    client: &mut NodeRpc,
    page: u64,
    map_epoch: u64,
) -> Result<Faulted, tonic::Status> {
    let r = client
        .fault_in(FaultInRequest {
            run: Some(PageRun {
                first_page: page,
                page_count: 1,
            }),
            want_data: true,
            map_epoch,
        })
        .await?
        .into_inner();
    let loc = r
        .frames
        .first()
        .ok_or_else(|| tonic::Status::internal("the owner returned no frame"))?;
    let frame =
        u32::try_from(loc.frame_index).map_err(|e| tonic::Status::internal(e.to_string()))?;
    Ok(Faulted {
        data: r.data,
        location: (loc.frame_generation != 0).then_some((frame, loc.frame_generation)),
    })
}

/// A gRPC client of the node at `address`, connected now (fails within
/// `connect_timeout` when nothing answers).
pub(crate) async fn node_client(
    address: &str,
    token: &AttachToken,
    connect_timeout: Duration,
) -> Result<NodeRpc, String> {
    let ch = pagewire_proto::net::connect(address, None, connect_timeout)
        .await
        .map_err(|e| chain(&e))?;
    Ok(NodeClient::with_interceptor(ch, token.clone()))
}
