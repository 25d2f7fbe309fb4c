//! Connections to one owner's region, and the gRPC fault-in on the owner:
//! what the [`crate::pool::OwnerPool`] (the node daemon's reads of pages it
//! does not serve) and the standalone [`crate::cluster::ClusterClient`]
//! share.
//!
//! An owner publishes its region in the ownership map (`MapNode.transports`):
//! one descriptor per transport, all of one region epoch, which changes
//! when the owner restarts. A connection remembers the epoch it was opened
//! with; the caller compares it with the map's ([`region_epoch`]) and
//! reconnects when they differ. The reader itself refuses a descriptor of
//! an earlier incarnation ([`crate::one_sided::RemoteError::Stale`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::one_sided::{Outcome, ReaderConfig, ReaderStats, RemoteError, RemoteReader};
use pagewire_proto::auth::AttachToken;
use pagewire_proto::net::ClientTls;
use pagewire_proto::v1::node_client::NodeClient;
use pagewire_proto::v1::{FaultInRequest, FaultInResponse, MapNode, PageRun, TransportDescriptor};
use pagewire_rdma::shm::{ShmConfig, ShmConnection};
use pagewire_rdma::tcp::{ConnectionConfig, TcpConnection};
use pagewire_rdma::{RegionDescriptor, SharedConnection, SharedHandle, WeakShared};

/// A node's gRPC client with the cluster token attached.
pub(crate) type NodeRpc = NodeClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AttachToken>,
>;

/// Which transport one-sided reads of an owner may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransportChoice {
    /// `shm` when the owner's shm file is reachable from this host (a live
    /// owner under that name in the directory its descriptor names), else
    /// `verbs` when the owner publishes it and this process has a usable
    /// RDMA device (and was built with the `verbs` feature), else `tcp`.
    #[default]
    Auto,
    /// `shm` only: an owner on another host cannot be read.
    Shm,
    /// `tcp` only, even for an owner on this host.
    Tcp,
    /// `verbs` only: an owner without a verbs descriptor, or a process
    /// without an RDMA device, cannot be read one-sidedly.
    Verbs,
}

impl std::str::FromStr for TransportChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "shm" => Ok(Self::Shm),
            "tcp" => Ok(Self::Tcp),
            "verbs" => Ok(Self::Verbs),
            other => Err(format!("transport {other:?}: one of auto, shm, verbs, tcp")),
        }
    }
}

/// The transport a one-sided read went over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    Shm,
    Verbs,
    Tcp,
}

/// A one-sided reader over one of the transports. `shm` readers each map
/// the owner's file (no state on the owner); `verbs` readers are handles on
/// the process's one queue pair to the owner (`verbs::handle`); `tcp`
/// readers each have their own connection, or are handles on the process's
/// one connection to the owner when asked ([`tcp_handle`]).
pub(crate) enum Reader {
    Shm(RemoteReader<ShmConnection>),
    /// A tcp connection of the reader's own.
    TcpOwn(RemoteReader<TcpConnection>),
    /// A handle on the process's one tcp connection to the owner.
    Tcp(RemoteReader<SharedHandle<TcpConnection>>),
    #[cfg(feature = "verbs")]
    Verbs(RemoteReader<verbs::Handle>),
}

/// The same call on whichever reader it is.
macro_rules! each {
    ($self:expr, $r:ident => $e:expr) => {
        match $self {
            Reader::Shm($r) => $e,
            Reader::TcpOwn($r) => $e,
            Reader::Tcp($r) => $e,
            #[cfg(feature = "verbs")]
            Reader::Verbs($r) => $e,
        }
    };
}

impl Reader {
    pub(crate) fn read_page(&mut self, page: u64, out: &mut [u8]) -> Result<Outcome, RemoteError> {
        each!(self, r => r.read_page(page, out))
    }

    pub(crate) fn read_run(
        &mut self,
        first: u64,
        n: usize,
        out: &mut [u8],
    ) -> Result<Vec<Outcome>, RemoteError> {
        each!(self, r => r.read_run(first, n, out))
    }

    pub(crate) fn batch_pages(&self) -> usize {
        each!(self, r => r.batch_pages())
    }

    pub(crate) fn learn(&mut self, page: u64, frame: u32, generation: u64) {
        each!(self, r => r.learn(page, frame, generation));
    }

    pub(crate) fn current_each(&mut self, frames: &[(u32, u64)]) -> Result<Vec<bool>, RemoteError> {
        each!(self, r => r.current_each(frames))
    }

    pub(crate) fn trust(&mut self, until: Option<Instant>) {
        each!(self, r => r.set_trust(until));
    }

    pub(crate) fn stats(&self) -> ReaderStats {
        each!(self, r => r.stats())
    }

    pub(crate) fn file_len(&self) -> u64 {
        each!(self, r => r.superblock().file_len)
    }

    /// The transport under it.
    pub(crate) fn transport(&self) -> Transport {
        match self {
            Reader::Shm(_) => Transport::Shm,
            Reader::Tcp(_) | Reader::TcpOwn(_) => Transport::Tcp,
            #[cfg(feature = "verbs")]
            Reader::Verbs(_) => Transport::Verbs,
        }
    }
}

/// An open connection to one owner's region.
pub(crate) struct OwnerConn {
    /// The region epoch of the descriptor this reader was opened with.
    pub(crate) epoch: u64,
    pub(crate) reader: Reader,
    /// Where the owner answers fault calls (`pagewire_proto::call`): its
    /// tcp responder, when its descriptor says so. None: `FaultIn` over
    /// gRPC.
    pub(crate) calls: Option<Calls>,
    /// Its reads as a stream, for readahead of locations.
    pub(crate) stream: crate::readahead::Stream,
}

/// The owner's tcp responder as the target of fault calls. A reader over
/// a tcp connection of its own calls on that connection; an shm or verbs
/// reader opens a tcp connection of its own for calls at its first miss
/// and keeps it while it works. A handle on the process's one shared tcp
/// connection takes no calls (a call needs its connection idle, and a
/// connection beside it per reader would undo the sharing): its misses
/// go over gRPC.
pub(crate) struct Calls {
    endpoint: String,
    /// Settings (token included) of the connection opened for calls.
    cfg: ConnectionConfig,
    side: Option<TcpConnection>,
}

impl OwnerConn {
    fn new(epoch: u64, reader: Reader) -> Self {
        Self {
            epoch,
            reader,
            calls: None,
            stream: crate::readahead::Stream::default(),
        }
    }

    /// Faults `first..first + count` in on the owner with a call on its tcp
    /// transport, within `limit`. None: the owner takes no calls (or
    /// said it has no handler, and is not asked again): use gRPC. The
    /// error is as [`refusal`] reads a gRPC status: the owner's refusal
    /// code, or None when the call was lost (the side connection is then
    /// closed; a reader's own connection fails its next READ if it broke).
    pub(crate) fn fault_call(
        &mut self,
        first: u64,
        count: u64,
        readahead: u32,
        map_epoch: u64,
        limit: Duration,
    ) -> Option<Result<Faulted, (Option<tonic::Code>, String)>> {
        let calls = self.calls.as_mut()?;
        let arg = pagewire_proto::call::fault_in_request(&fault_request(
            first, count, readahead, map_epoch,
        ));
        let started = Instant::now();
        let conn = match &mut self.reader {
            Reader::TcpOwn(r) => r.connection_mut(),
            _ => {
                if calls.side.is_none() {
                    let cfg = ConnectionConfig {
                        connect_timeout: calls.cfg.connect_timeout.min(limit),
                        ..calls.cfg.clone()
                    };
                    match TcpConnection::connect(calls.endpoint.as_str(), cfg) {
                        Ok(c) => calls.side = Some(c),
                        Err(e) => {
                            return Some(Err((
                                None,
                                format!(
                                    "cannot connect to {} for a fault call: {}",
                                    calls.endpoint,
                                    chain(&e)
                                ),
                            )));
                        }
                    }
                }
                calls.side.as_mut().expect("just opened")
            }
        };
        let left = limit.saturating_sub(started.elapsed());
        match conn.call(self.epoch, &arg, left.max(Duration::from_millis(1))) {
            Ok(reply) => Some(
                pagewire_proto::call::decode_reply(&reply)
                    .and_then(|r| faulted(r, first, count, readahead))
                    .map_err(|s| (refusal(&s), format!("{:?}: {}", s.code(), s.message()))),
            ),
            Err(pagewire_rdma::CallError::NoHandler) => {
                self.calls = None;
                None
            }
            Err(e) => {
                calls.side = None;
                Some(Err((
                    None,
                    format!("fault call to {}: {}", calls.endpoint, chain(&e)),
                )))
            }
        }
    }
}

/// How [`connect`] opens a connection.
pub(crate) struct ConnectHow<'a> {
    pub(crate) token: &'a str,
    pub(crate) transport: TransportChoice,
    pub(crate) reader: ReaderConfig,
    /// The tcp connection's settings (token, timeouts); the token is
    /// overwritten with `token`.
    pub(crate) tcp: ConnectionConfig,
    /// One tcp connection per (process, owner), readers its handles;
    /// `false`: each reader its own connection.
    pub(crate) tcp_shared: bool,
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
/// else its verbs queue pair (shared by the process) when allowed and
/// usable, else its tcp responder when allowed. The error says why each
/// descriptor tried failed.
pub(crate) fn connect(owner: &MapNode, how: &ConnectHow<'_>) -> Result<OwnerConn, String> {
    let mut c = connect_reader(owner, how)?;
    if matches!(c.reader, Reader::Tcp(_)) {
        return Ok(c);
    }
    c.calls = owner
        .transports
        .iter()
        .find(|t| t.kind == "tcp" && t.calls && t.epoch == c.epoch)
        .map(|t| Calls {
            endpoint: t.endpoint.clone(),
            cfg: tcp_config(how),
            side: None,
        });
    Ok(c)
}

fn connect_reader(owner: &MapNode, how: &ConnectHow<'_>) -> Result<OwnerConn, String> {
    let mut why = Vec::new();
    if matches!(how.transport, TransportChoice::Auto | TransportChoice::Shm) {
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
                    Ok(r) => return Ok(OwnerConn::new(d.epoch, Reader::Shm(r))),
                    Err(e) => why.push(format!("shm: {e}")),
                },
                Err(e) => why.push(format!("shm: {e}")),
            }
        }
    }
    if matches!(
        how.transport,
        TransportChoice::Auto | TransportChoice::Verbs
    ) {
        match verbs::connect(owner, how) {
            Ok(Some(c)) => return Ok(c),
            Ok(None) => {}
            Err(e) => why.push(format!("verbs: {e}")),
        }
    }
    if matches!(how.transport, TransportChoice::Auto | TransportChoice::Tcp) {
        for t in owner.transports.iter().filter(|t| t.kind == "tcp") {
            let Some(d) = descriptor(t) else { continue };
            let reader = if how.tcp_shared {
                tcp_handle(&t.endpoint, d.epoch, how)
                    .map(|c| RemoteReader::connect(c, d, how.reader.clone()).map(Reader::Tcp))
            } else {
                // A connection of its own, read without a lock.
                TcpConnection::connect(t.endpoint.as_str(), tcp_config(how))
                    .map(|c| RemoteReader::connect(c, d, how.reader.clone()).map(Reader::TcpOwn))
            };
            match reader {
                Ok(Ok(r)) => return Ok(OwnerConn::new(d.epoch, r)),
                Ok(Err(e)) => why.push(format!("tcp: {e}")),
                Err(e) => why.push(format!("tcp: {}", chain(&e))),
            }
        }
    }
    if why.is_empty() {
        why.push(match how.transport {
            TransportChoice::Auto => "it publishes no shm, verbs or tcp descriptor".into(),
            TransportChoice::Shm => "it publishes no shm descriptor".into(),
            TransportChoice::Tcp => "it publishes no tcp descriptor".into(),
            TransportChoice::Verbs => "it publishes no verbs descriptor".into(),
        });
    }
    Err(why.join("; "))
}

/// The settings of a tcp connection `how` opens: its own, with the pool's
/// token.
fn tcp_config(how: &ConnectHow<'_>) -> ConnectionConfig {
    ConnectionConfig {
        token: how.token.as_bytes().to_vec(),
        ..how.tcp.clone()
    }
}

type TcpRegistry = Mutex<HashMap<(String, u64, String), WeakShared<TcpConnection>>>;

/// The process's tcp connections, by (owner endpoint, region epoch,
/// token). Weak: a connection closes when its last reader goes.
fn tcp_registry() -> &'static TcpRegistry {
    static R: OnceLock<TcpRegistry> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// A handle on the process's one tcp connection to `endpoint` at `epoch`
/// (`how.tcp_shared`), connecting it if there is none (or it broke). The
/// connect runs with no
/// lock held, so a frozen owner holds up only the readers of that owner;
/// two threads that connect at once keep the first connection registered
/// and drop the other.
fn tcp_handle(
    endpoint: &str,
    epoch: u64,
    how: &ConnectHow<'_>,
) -> Result<SharedHandle<TcpConnection>, pagewire_rdma::ConnectError> {
    let cfg = tcp_config(how);
    let key = (endpoint.to_owned(), epoch, how.token.to_owned());
    let live = |reg: &mut std::sync::MutexGuard<'_, _>| {
        let reg: &mut HashMap<_, WeakShared<TcpConnection>> = reg;
        reg.retain(|_, w| w.upgrade().is_some_and(|c| !c.is_broken()));
        reg.get(&key).and_then(WeakShared::upgrade)
    };
    if let Some(c) = live(&mut tcp_registry().lock().unwrap_or_else(|e| e.into_inner())) {
        return Ok(c.handle());
    }
    // Handles wait on the socket without the lock (the polling one spins
    // first, with the connection's spin): several threads keep several
    // READs in flight on the one connection.
    let spin = cfg.spin;
    let conn = SharedConnection::waiting_on_fd(TcpConnection::connect(endpoint, cfg)?, spin);
    let mut reg = tcp_registry().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = live(&mut reg) {
        return Ok(c.handle());
    }
    reg.insert(key, conn.downgrade());
    Ok(conn.handle())
}

/// An error and its sources, `: `-separated (a source whose text the
/// message already shows is left out: several errors print their source).
/// Exported as [`crate::error_chain`].
pub fn chain(e: &dyn std::error::Error) -> String {
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

/// The node's own refusal in a gRPC status, or `None` when the call was
/// lost: a status with a source comes from the transport, and `Internal`,
/// `Unknown`, `Cancelled` and `DeadlineExceeded` mean a malformed reply or
/// no reply. After a lost call the channel may be broken (callers drop it);
/// after a refusal it is fine. The one place the client tells the two
/// apart, for `FaultIn` (the owner pool) and for `Read` and `Write` (the
/// cluster client) alike.
pub(crate) fn refusal(s: &tonic::Status) -> Option<tonic::Code> {
    use tonic::Code;
    let lost = std::error::Error::source(s).is_some()
        || matches!(
            s.code(),
            Code::Internal | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded
        );
    (!lost).then_some(s.code())
}

/// What a fault-in on the owner returned for a run of pages.
pub(crate) struct Faulted {
    /// The pages' bytes (each page's valid length), concatenated.
    pub(crate) data: Vec<u8>,
    /// Where the owner holds each page: frame and frame generation; `None`
    /// for a page the owner served without caching it (generation 0 on the
    /// wire).
    pub(crate) locations: Vec<Option<(u32, u64)>>,
    /// Readahead: where the owner holds the pages right after the run,
    /// from the first on (no bytes): `(frame, generation)` of page
    /// `first + count + k` at `k`.
    pub(crate) ahead: Vec<(u32, u64)>,
}

/// Faults pages `first..first + count` in on their owner (`FaultIn` with
/// `want_data`, and `readahead` pages after them) and takes the bytes and
/// the frames' locations from the reply. `map_epoch` is the caller's map
/// epoch (0: none).
pub(crate) async fn fault_in(
    client: &mut NodeRpc,
    first: u64,
    count: u64,
    readahead: u32,
    map_epoch: u64,
) -> Result<Faulted, tonic::Status> {
    let r = client
        .fault_in(fault_request(first, count, readahead, map_epoch))
        .await?
        .into_inner();
    faulted(r, first, count, readahead)
}

/// A fault-in of `first..first + count` with the bytes inline and
/// `readahead` pages after it, for the caller's `map_epoch`: what a call
/// and the gRPC `FaultIn` both send.
fn fault_request(first: u64, count: u64, readahead: u32, map_epoch: u64) -> FaultInRequest {
    FaultInRequest {
        run: Some(PageRun {
            first_page: first,
            page_count: count,
        }),
        want_data: true,
        map_epoch,
        readahead,
    }
}

/// The bytes and frame locations of a fault-in's response for the `count`
/// pages from `first` and at most `readahead` after them (from gRPC or a
/// call), checked: every location names the page it stands for.
fn faulted(
    r: FaultInResponse,
    first: u64,
    count: u64,
    readahead: u32,
) -> Result<Faulted, tonic::Status> {
    let n = r.frames.len() as u64;
    if n < count || n - count > u64::from(readahead) {
        return Err(tonic::Status::internal(format!(
            "the owner returned {n} frame locations for {count} pages and {readahead} of readahead",
        )));
    }
    let mut locations = Vec::with_capacity(r.frames.len());
    for (k, loc) in r.frames.iter().enumerate() {
        let page = first + k as u64;
        if loc.page != page {
            return Err(tonic::Status::internal(format!(
                "the owner's frame location {k} is for page {}, not {page}",
                loc.page
            )));
        }
        let frame =
            u32::try_from(loc.frame_index).map_err(|e| tonic::Status::internal(e.to_string()))?;
        locations.push((loc.frame_generation != 0).then_some((frame, loc.frame_generation)));
    }
    let ahead = locations
        .split_off(usize::try_from(count).unwrap_or(usize::MAX))
        .into_iter()
        .map(|l| {
            l.ok_or_else(|| {
                tonic::Status::internal("the owner returned a readahead page it does not hold")
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(Faulted {
        data: r.data,
        locations,
        ahead,
    })
}

/// A gRPC client of the node at `address`, connected now (fails within
/// `connect_timeout` when nothing answers).
pub(crate) async fn node_client(
    address: &str,
    token: &AttachToken,
    tls: Option<&ClientTls>,
    connect_timeout: Duration,
) -> Result<NodeRpc, String> {
    let ch = pagewire_proto::net::connect(address, tls, connect_timeout)
        .await
        .map_err(|e| chain(&e))?;
    Ok(NodeClient::with_interceptor(ch, token.clone()))
}

/// One-sided reads over RDMA verbs: one RC queue pair per (this process,
/// owner), shared by every reader of the process.
#[cfg(feature = "verbs")]
pub(crate) mod verbs {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    use pagewire_proto::v1::MapNode;
    use pagewire_rdma::verbs::{VerbsConfig, VerbsConnection};
    use pagewire_rdma::{ConnectError, SharedConnection, SharedHandle, WeakShared};

    use super::{ConnectHow, OwnerConn, Reader, TransportChoice, chain, descriptor};
    use crate::one_sided::RemoteReader;

    /// One thread's share of the process's queue pair to an owner.
    pub(crate) type Handle = SharedHandle<VerbsConnection>;

    type Registry = Mutex<HashMap<(String, u64), WeakShared<VerbsConnection>>>;

    /// The process's verbs connections, by (owner endpoint, region epoch).
    /// Weak: a connection closes when its last reader goes.
    fn registry() -> &'static Registry {
        static R: OnceLock<Registry> = OnceLock::new();
        R.get_or_init(|| Mutex::new(HashMap::new()))
    }

    /// Why this process cannot use verbs (no device, no libibverbs), once
    /// known: then `auto` goes straight to tcp.
    static UNUSABLE: OnceLock<String> = OnceLock::new();

    fn config(how: &ConnectHow<'_>) -> VerbsConfig {
        let mut c = VerbsConfig::new(how.token.as_bytes().to_vec());
        // Header + page, a bucket or a run: 64 KiB READs, 32 in flight. The
        // bounce buffer (2 MiB) is pinned, so it counts against the
        // reader's RLIMIT_MEMLOCK once per owner.
        c.max_outstanding = 32;
        c.max_read_len = 64 << 10;
        c.op_timeout = how.tcp.op_timeout;
        c.connect_timeout = how.tcp.connect_timeout;
        c.with_link_tuning_from_env()
    }

    /// A handle on the process's connection to `endpoint` at `epoch`,
    /// connecting it if there is none (or it broke).
    fn handle(endpoint: &str, epoch: u64, how: &ConnectHow<'_>) -> Result<Handle, ConnectError> {
        let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
        reg.retain(|_, w| w.upgrade().is_some_and(|c| !c.is_broken()));
        let key = (endpoint.to_owned(), epoch);
        if let Some(c) = reg.get(&key).and_then(WeakShared::upgrade) {
            return Ok(c.handle());
        }
        // Connecting under the lock: two threads of a process never open
        // two queue pairs to one owner (bounded by the connect timeout).
        let conn = VerbsConnection::connect(endpoint, config(how))?;
        let shared = SharedConnection::new(conn);
        reg.insert(key, shared.downgrade());
        Ok(shared.handle())
    }

    /// A verbs reader of `owner`; `Ok(None)` when `auto` should go on to
    /// tcp without complaint (the owner publishes no verbs, or this
    /// process has no usable device: said once in the log).
    pub(crate) fn connect(
        owner: &MapNode,
        how: &ConnectHow<'_>,
    ) -> Result<Option<OwnerConn>, String> {
        let auto = how.transport == TransportChoice::Auto;
        let Some(t) = owner.transports.iter().find(|t| t.kind == "verbs") else {
            return Ok(None);
        };
        if let Some(why) = UNUSABLE.get() {
            return if auto { Ok(None) } else { Err(why.clone()) };
        }
        let Some(d) = descriptor(t) else {
            return Err("an rkey above 32 bits".into());
        };
        let h = match handle(&t.endpoint, d.epoch, how) {
            Ok(h) => h,
            Err(ConnectError::Device(e)) => {
                let why = format!("no usable RDMA device in this process: {e}");
                // The first thread to find out says so.
                if UNUSABLE.set(why.clone()).is_ok() {
                    tracing::warn!(
                        reason = %why,
                        "verbs: this process cannot read over RDMA; reading over tcp instead"
                    );
                }
                return if auto { Ok(None) } else { Err(why) };
            }
            Err(e) => {
                let why = chain(&e);
                if auto {
                    tracing::info!(
                        node = %owner.node_id,
                        reason = %why,
                        "verbs: cannot connect to this node; reading it over tcp"
                    );
                }
                return Err(why);
            }
        };
        let r = RemoteReader::connect(h, d, how.reader.clone()).map_err(|e| e.to_string())?;
        Ok(Some(OwnerConn::new(d.epoch, Reader::Verbs(r))))
    }
}

/// Without the `verbs` feature: `auto` skips verbs, `verbs` is refused.
#[cfg(not(feature = "verbs"))]
pub(crate) mod verbs {
    use super::{ConnectHow, OwnerConn, TransportChoice};
    use pagewire_proto::v1::MapNode;

    pub(crate) fn connect(
        owner: &MapNode,
        how: &ConnectHow<'_>,
    ) -> Result<Option<OwnerConn>, String> {
        if how.transport == TransportChoice::Verbs
            && owner.transports.iter().any(|t| t.kind == "verbs")
        {
            return Err(
                "this program was built without RDMA support (cargo feature `verbs` of pagewire-node)"
                    .into(),
            );
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagewire_proto::v1::FrameLocation;

    fn answer(first: u64, gens: &[u64]) -> FaultInResponse {
        FaultInResponse {
            frames: gens
                .iter()
                .enumerate()
                .map(|(k, &g)| FrameLocation {
                    page: first + k as u64,
                    node_index: 1,
                    frame_index: 100 + k as u64,
                    frame_generation: g,
                })
                .collect(),
            data: vec![7; 4096],
            map_epoch: 3,
        }
    }

    #[test]
    fn a_fault_in_answer_with_readahead_is_checked_page_by_page() {
        // The run (one page), then two pages ahead.
        let f = faulted(answer(10, &[1, 3, 5]), 10, 1, 4).expect("a good answer");
        assert_eq!(f.locations, vec![Some((100, 1))]);
        assert_eq!(f.ahead, vec![(101, 3), (102, 5)]);
        // None ahead is fine (an owner that predates readahead).
        let f = faulted(answer(10, &[1]), 10, 1, 4).expect("no readahead");
        assert!(f.ahead.is_empty());
        // More than asked, a location for another page, a page ahead the
        // owner does not hold, or too few for the run: refused.
        for (r, count, ra, what) in [
            (answer(10, &[1, 3, 5]), 1, 1, "frame locations"),
            (answer(10, &[1]), 2, 4, "frame locations"),
            (answer(10, &[1, 0]), 1, 4, "does not hold"),
        ] {
            let e = match faulted(r, 10, count, ra) {
                Ok(_) => panic!("accepted: {what}"),
                Err(e) => e,
            };
            assert!(e.message().contains(what), "{e:?}");
        }
        let mut r = answer(10, &[1, 3]);
        r.frames[1].page = 12;
        let e = faulted(r, 10, 1, 4)
            .err()
            .expect("a location of another page");
        assert!(e.message().contains("not 11"), "{e:?}");
    }

    #[test]
    fn a_status_is_a_refusal_only_when_the_node_itself_answered() {
        use tonic::{Code, Status};
        for code in [
            Code::FailedPrecondition,
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::Aborted,
            Code::PermissionDenied,
            Code::OutOfRange,
        ] {
            assert_eq!(refusal(&Status::new(code, "no")), Some(code), "{code:?}");
        }
        for code in [
            Code::Internal,
            Code::Unknown,
            Code::Cancelled,
            Code::DeadlineExceeded,
        ] {
            assert_eq!(refusal(&Status::new(code, "lost")), None, "{code:?}");
        }
        // From the transport (it carries its cause): lost, whatever the code.
        let mut s = Status::unavailable("connection reset");
        s.set_source(std::sync::Arc::new(std::io::Error::other("reset")));
        assert_eq!(refusal(&s), None);
    }

    fn owner_with(kinds: &[&str]) -> MapNode {
        MapNode {
            index: 1,
            node_id: "n1".into(),
            // Nothing listens on the discard port: every connect fails fast.
            transports: kinds
                .iter()
                .map(|k| TransportDescriptor {
                    kind: (*k).into(),
                    endpoint: "127.0.0.1:9".into(),
                    address: 1 << 20,
                    length: 1 << 20,
                    rkey: 7,
                    epoch: 3,
                    opaque: Vec::new(),
                    calls: false,
                })
                .collect(),
            ..MapNode::default()
        }
    }

    /// A reader that cannot use verbs (no device here, or built without the
    /// feature) goes on to tcp under `auto` without a verbs error, and
    /// `verbs` alone says why it cannot.
    #[test]
    fn auto_goes_on_to_tcp_when_verbs_is_not_usable_here() {
        if std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some()) {
            eprintln!("skipped: this host has an RDMA device");
            return;
        }
        let token = "auto-fallback-test-token";
        let mut how = ConnectHow {
            token,
            transport: TransportChoice::Auto,
            reader: ReaderConfig::default(),
            tcp: ConnectionConfig::new(token.as_bytes().to_vec()),
            tcp_shared: false,
        };
        how.tcp.connect_timeout = Duration::from_millis(200);
        let e = connect(&owner_with(&["verbs", "tcp"]), &how)
            .err()
            .expect("nothing listens");
        assert!(
            e.starts_with("tcp: "),
            "auto tried tcp and only tcp failed: {e}"
        );
        how.transport = TransportChoice::Verbs;
        let e = connect(&owner_with(&["verbs", "tcp"]), &how)
            .err()
            .expect("no verbs here");
        assert!(
            e.contains("built without RDMA support") || e.contains("no usable RDMA device"),
            "{e}"
        );
        assert!(!e.contains("tcp"), "verbs alone never tries tcp: {e}");
        let e = connect(&owner_with(&["tcp"]), &how)
            .err()
            .expect("no verbs descriptor");
        assert_eq!(e, "it publishes no verbs descriptor");
        assert_eq!(
            "verbs".parse::<TransportChoice>(),
            Ok(TransportChoice::Verbs)
        );
        assert!("rdma".parse::<TransportChoice>().is_err());
    }
}
