//! Pages of extents another node owns, read from that node one-sidedly.
//!
//! A node asked (gRPC `Read`) for a page it does not serve reads it from the
//! owner's region with the one-sided reader ([`crate::remote`]):
//! over `shm` when the owner's shm file is on this host, else over `tcp`;
//! nothing is cached here. A page the owner's index does not show (or that
//! keeps moving) is faulted in on the owner with gRPC `FaultIn`, whose reply
//! carries the bytes and the frame's location, so the next read of it is one
//! round trip again. The caller (`Node::serve`) holds the map's read guard
//! and checks this node's own lease before and after, so a map is trusted
//! only while that lease holds (ARCHITECTURE.md, "Ownership, leases and
//! writes").

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::remote::{Outcome, ReaderConfig, ReaderStats, RemoteError, RemoteReader};
use pagewire_proto::auth::AttachToken;
use pagewire_proto::v1::node_client::NodeClient;
use pagewire_proto::v1::{FaultInRequest, MapNode, PageRun, TransportDescriptor};
use pagewire_rdma::RegionDescriptor;
use pagewire_rdma::shm::{ShmConfig, ShmConnection};
use pagewire_rdma::tcp::{ConnectionConfig, TcpConnection};

use super::DaemonError;
use super::ownership::PageSource;

enum Reader {
    Shm(RemoteReader<ShmConnection>),
    Tcp(RemoteReader<TcpConnection>),
}

impl Reader {
    fn read_page(&mut self, page: u64, out: &mut [u8]) -> Result<Outcome, RemoteError> {
        match self {
            Reader::Shm(r) => r.read_page(page, out),
            Reader::Tcp(r) => r.read_page(page, out),
        }
    }

    fn learn(&mut self, page: u64, frame: u32, generation: u64) {
        match self {
            Reader::Shm(r) => r.learn(page, frame, generation),
            Reader::Tcp(r) => r.learn(page, frame, generation),
        }
    }

    fn stats(&self) -> ReaderStats {
        match self {
            Reader::Shm(r) => r.stats(),
            Reader::Tcp(r) => r.stats(),
        }
    }

    fn file_len(&self) -> u64 {
        match self {
            Reader::Shm(r) => r.superblock().file_len,
            Reader::Tcp(r) => r.superblock().file_len,
        }
    }
}

struct Owner {
    /// The region epoch of the descriptor this reader was opened with.
    epoch: u64,
    reader: Reader,
}

/// Counters of the one-sided path, exported on `/metrics`.
#[derive(Default)]
pub(crate) struct SourceStats {
    pub(crate) pages: AtomicU64,
    pub(crate) one_sided: AtomicU64,
    pub(crate) fallbacks: AtomicU64,
    pub(crate) reconnects: AtomicU64,
}

/// The one-sided [`PageSource`].
pub(crate) struct OneSided {
    token: String,
    page_size: usize,
    owners: Mutex<HashMap<u32, Owner>>,
    pub(crate) stats: SourceStats,
    /// Reader counters of connections since closed, so totals only grow.
    retired: Mutex<ReaderStats>,
}

fn descriptor(t: &TransportDescriptor) -> Option<RegionDescriptor> {
    Some(RegionDescriptor {
        addr: t.address,
        len: t.length,
        rkey: u32::try_from(t.rkey).ok()?,
        epoch: t.epoch,
    })
}

impl OneSided {
    pub(crate) fn new(token: String, page_size: usize) -> Self {
        Self {
            token,
            page_size,
            owners: Mutex::new(HashMap::new()),
            stats: SourceStats::default(),
            retired: Mutex::new(ReaderStats::default()),
        }
    }

    /// The one-sided reader's counters, over every connection so far.
    pub(crate) fn reader_stats(&self) -> ReaderStats {
        let mut total = *self.retired.lock().unwrap_or_else(|e| e.into_inner());
        for o in self
            .owners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            add(&mut total, &o.reader.stats());
        }
        total
    }

    /// Open a reader to `owner`: its shm file when it is on this host, else
    /// its tcp responder.
    fn connect(&self, owner: &MapNode) -> Result<Owner, String> {
        let mut why = Vec::new();
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
                Ok(c) => match RemoteReader::connect(c, d, ReaderConfig::default()) {
                    Ok(r) => {
                        return Ok(Owner {
                            epoch: d.epoch,
                            reader: Reader::Shm(r),
                        });
                    }
                    Err(e) => why.push(format!("shm: {e}")),
                },
                Err(e) => why.push(format!("shm: {e}")),
            }
        }
        for t in owner.transports.iter().filter(|t| t.kind == "tcp") {
            let Some(d) = descriptor(t) else { continue };
            match TcpConnection::connect(
                t.endpoint.as_str(),
                ConnectionConfig::new(self.token.as_bytes().to_vec()),
            ) {
                Ok(c) => match RemoteReader::connect(c, d, ReaderConfig::default()) {
                    Ok(r) => {
                        return Ok(Owner {
                            epoch: d.epoch,
                            reader: Reader::Tcp(r),
                        });
                    }
                    Err(e) => why.push(format!("tcp: {e}")),
                },
                Err(e) => why.push(format!("tcp: {e}")),
            }
        }
        if why.is_empty() {
            why.push("it publishes no shm or tcp descriptor".into());
        }
        Err(why.join("; "))
    }

    /// Fault `page` in on its owner over gRPC and take the bytes from the
    /// reply. Returns the bytes and the frame's location.
    fn fault_in(&self, owner: &MapNode, page: u64) -> Result<(Vec<u8>, u32, u64), String> {
        let handle = tokio::runtime::Handle::try_current().map_err(|e| e.to_string())?;
        let token = self.token.clone();
        let addr = owner.grpc_address.clone();
        handle.block_on(async move {
            let ch = pagewire_proto::net::connect(&addr, None, Duration::from_secs(5))
                .await
                .map_err(|e| e.to_string())?;
            let attach = AttachToken::new(&token).map_err(|e| e.to_string())?;
            let r = NodeClient::with_interceptor(ch, attach)
                .fault_in(FaultInRequest {
                    run: Some(PageRun {
                        first_page: page,
                        page_count: 1,
                    }),
                    want_data: true,
                    map_epoch: 0,
                })
                .await
                .map_err(|s| s.message().to_owned())?
                .into_inner();
            let loc = r.frames.first().ok_or("the owner returned no frame")?;
            let frame = u32::try_from(loc.frame_index).map_err(|e| e.to_string())?;
            Ok((r.data, frame, loc.frame_generation))
        })
    }
}

fn add(total: &mut ReaderStats, s: &ReaderStats) {
    total.reads += s.reads;
    total.warm_hits += s.warm_hits;
    total.cold_hits += s.cold_hits;
    total.bucket_reads += s.bucket_reads;
    total.overflow_hops += s.overflow_hops;
    total.ctrl_rereads += s.ctrl_rereads;
    total.retries += s.retries;
    total.validation_failures += s.validation_failures;
    total.torn_buckets += s.torn_buckets;
    total.absent += s.absent;
    total.gave_up += s.gave_up;
    total.round_trips += s.round_trips;
    total.bytes += s.bytes;
}

impl PageSource for OneSided {
    fn read(
        &self,
        owner: &MapNode,
        _epoch: u64,
        first: u64,
        count: u64,
    ) -> Result<(Vec<u8>, Vec<u64>), DaemonError> {
        let unavailable = |page, reason: String| DaemonError::OwnerUnavailable { page, reason };
        let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        let want_epoch = owner.transports.first().map(|t| t.epoch);
        if owners
            .get(&owner.index)
            .is_some_and(|o| Some(o.epoch) != want_epoch)
        {
            // The owner restarted (the map names a new region epoch).
            if let Some(old) = owners.remove(&owner.index) {
                add(
                    &mut self.retired.lock().unwrap_or_else(|e| e.into_inner()),
                    &old.reader.stats(),
                );
            }
        }
        let o = match owners.entry(owner.index) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let o = self.connect(owner).map_err(|why| unavailable(first, why))?;
                self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                v.insert(o)
            }
        };
        let mut data = Vec::with_capacity(count as usize * self.page_size);
        let mut gens = Vec::with_capacity(count as usize);
        let mut buf = vec![0u8; self.page_size];
        let file_len = o.reader.file_len();
        for page in first..first.saturating_add(count) {
            let len = (file_len.saturating_sub(page * self.page_size as u64) as usize)
                .min(self.page_size);
            self.stats.pages.fetch_add(1, Ordering::Relaxed);
            match o.reader.read_page(page, &mut buf) {
                Ok(Outcome::Hit { generation, .. }) => {
                    self.stats.one_sided.fetch_add(1, Ordering::Relaxed);
                    data.extend_from_slice(&buf[..len]);
                    gens.push(generation);
                }
                Ok(Outcome::Absent | Outcome::GaveUp) => {
                    self.stats.fallbacks.fetch_add(1, Ordering::Relaxed);
                    let (bytes, frame, generation) = self
                        .fault_in(owner, page)
                        .map_err(|why| unavailable(page, why))?;
                    if bytes.len() != len {
                        return Err(unavailable(
                            page,
                            format!(
                                "the owner's FaultIn returned {} bytes, not {len}",
                                bytes.len()
                            ),
                        ));
                    }
                    o.reader.learn(page, frame, generation);
                    data.extend_from_slice(&bytes);
                    gens.push(generation);
                }
                Err(e) => {
                    // Stale descriptor (owner restarted) or a lost connection:
                    // drop the reader; the caller retries with a fresh map.
                    let why = e.to_string();
                    if let Some(old) = owners.remove(&owner.index) {
                        add(
                            &mut self.retired.lock().unwrap_or_else(|e| e.into_inner()),
                            &old.reader.stats(),
                        );
                    }
                    return Err(unavailable(page, why));
                }
            }
        }
        Ok((data, gens))
    }
}
