//! The `pagewire.v1.Node` gRPC service over the local page cache.
//!
//! Every call that names pages is admitted against the map this node
//! applied, whatever epoch the caller sends ([`super::ownership`] has the
//! rules): a caller ahead of this node is told to retry (stale map, this
//! node is behind); a caller behind it is answered for extents this node
//! still serves (the reply carries the newer epoch) and refused as a stale
//! map for the others. Cache work (which may read the backing file) runs on
//! the blocking pool, holding the applied map's read lock, and this node
//! checks its lease before it starts and again right before it answers,
//! after the data was read: a node whose lease ran out (frozen, cut off,
//! declared dead) answers UNAVAILABLE "lease expired", never old bytes.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pagewire_proto::v1::node_server::Node as NodeRpc;
use pagewire_proto::v1::{
    FaultInRequest, FaultInResponse, FrameLocation, MapNode, NodeRangeRequest, NodeRangeResponse,
    PageRun, ReadRequest, ReadResponse, StatsRequest, StatsResponse, TopologyRequest,
    TopologyResponse, TransportsRequest, TransportsResponse, WriteRequest, WriteResponse,
};
use tonic::{Request, Response, Status};

use super::ownership::Role;
use super::{DaemonError, MapView, Node};
use crate::policy::Admission;

pub(crate) struct NodeService {
    pub(crate) node: Arc<Node>,
}

/// What a call does with its pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// Read: from the cache, or from the page source for others' extents.
    Read,
    /// FaultIn, Warm: bring pages into this node's cache.
    Fill,
    /// Write-through.
    Write,
}

/// How a gRPC `Read` was answered: the label of its latency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadPath {
    /// From this node's cache alone.
    Local,
    /// With pages of other nodes' extents, all read one-sidedly.
    OneSided,
    /// With at least one page faulted in on its owner (a one-sided miss;
    /// a call on the owner's tcp transport, or gRPC `FaultIn`).
    Fallback,
}

impl ReadPath {
    /// Every path, in the order of `Node::grpc_read_seconds`, with its label.
    pub(crate) const ALL: [(ReadPath, &'static str); 3] = [
        (ReadPath::Local, "local"),
        (ReadPath::OneSided, "one_sided"),
        (ReadPath::Fallback, "fallback"),
    ];

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// Where a run of pages is answered from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Segment {
    Cache { first: u64, count: u64 },
    Source { owner: u32, first: u64, count: u64 },
}

impl Node {
    /// Checks `run` against the file and the per-call limit (when `limit`);
    /// returns (first, count).
    fn check_run(&self, run: Option<PageRun>, limit: bool) -> Result<(u64, u64), DaemonError> {
        let run = run.ok_or_else(|| DaemonError::InvalidArgument("run is required".into()))?;
        let pages = self.cache.pages();
        if run.page_count == 0 {
            return Err(DaemonError::InvalidArgument(
                "page_count must be > 0".into(),
            ));
        }
        if limit && run.page_count > self.max_pages_per_call {
            return Err(DaemonError::InvalidArgument(format!(
                "page_count {} is above this node's limit of {} pages per call",
                run.page_count, self.max_pages_per_call
            )));
        }
        let end = run.first_page.checked_add(run.page_count);
        if end.is_none_or(|e| e > pages) {
            return Err(DaemonError::InvalidArgument(format!(
                "pages {}..+{} go past the end of the file ({pages} pages)",
                run.first_page, run.page_count
            )));
        }
        Ok((run.first_page, run.page_count))
    }

    fn check_lease(&self) -> Result<(), DaemonError> {
        if self.lease.valid() {
            Ok(())
        } else {
            self.lease_rejections.fetch_add(1, Ordering::Relaxed);
            Err(DaemonError::LeaseExpired)
        }
    }

    fn stale(&self, e: DaemonError) -> DaemonError {
        self.stale_rejections.fetch_add(1, Ordering::Relaxed);
        e
    }

    /// Admits `first..first + count` for `access` under `view`: splits it
    /// into runs answered from the cache or from the page source, or says
    /// why it is refused.
    fn admit(
        &self,
        view: &MapView,
        first: u64,
        count: u64,
        map_epoch: u64,
        access: Access,
    ) -> Result<Vec<Segment>, DaemonError> {
        self.check_lease()?;
        let epoch = view.map.epoch;
        if map_epoch > epoch {
            return Err(self.stale(DaemonError::NodeBehind {
                node: epoch,
                yours: map_epoch,
            }));
        }
        let not_here = |e: usize, owner: u32| {
            self.stale(DaemonError::StaleMap(format!(
                "extent {e} is served by node index {owner} at epoch {epoch} (you sent epoch \
                 {map_epoch}); refresh the map"
            )))
        };
        let now = Instant::now();
        let mut out: Vec<Segment> = Vec::new();
        let end = first + count;
        let mut page = first;
        while page < end {
            let e = view.extent_of(page);
            let stop = ((e as u64 + 1) * view.pages_per_extent).min(end);
            let n = stop - page;
            let seg = match (view.role(e), access) {
                (Role::Receiving { from }, _) => {
                    return Err(DaemonError::Moving { extent: e, from });
                }
                (Role::Owner, Access::Write) => {
                    if let Some(wait) = view.write_wait(e, now) {
                        return Err(DaemonError::WritesFenced {
                            extent: e,
                            wait_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1),
                        });
                    }
                    Segment::Cache {
                        first: page,
                        count: n,
                    }
                }
                (Role::HandingOff { to }, Access::Write) => return Err(not_here(e, to)),
                (Role::Owner | Role::HandingOff { .. }, _) => Segment::Cache {
                    first: page,
                    count: n,
                },
                (Role::Other { owner }, Access::Read)
                    if self.page_source.is_some() && owner != 0 =>
                {
                    Segment::Source {
                        owner,
                        first: page,
                        count: n,
                    }
                }
                (Role::Other { owner }, _) => return Err(not_here(e, owner)),
            };
            match (out.last_mut(), seg) {
                (Some(Segment::Cache { count: c, .. }), Segment::Cache { count: more, .. }) => {
                    *c += more
                }
                _ => out.push(seg),
            }
            page = stop;
        }
        Ok(out)
    }

    /// Reads `first..first + count` for a `Read` call: the pages this node
    /// serves from its cache under the applied map's read lock, then, with
    /// no lock held, the pages of extents other nodes own from their owners
    /// (network I/O: an owner frozen or cut off must not hold up the next
    /// map, whose application takes the write lock, nor this node's lease,
    /// which needs that map applied). The lease is checked once more after
    /// everything was read, as in [`Node::serve`]: that check, not the lock,
    /// is what bounds how long the map the owners were taken from is
    /// trusted (ARCHITECTURE.md, "Ownership, leases and writes").
    /// Returns the bytes, each page's frame generation, the epoch and how
    /// the pages were read.
    pub(crate) fn read_pages(
        &self,
        first: u64,
        count: u64,
        map_epoch: u64,
    ) -> Result<(Vec<u8>, Vec<u64>, u64, ReadPath), DaemonError> {
        enum Part {
            Cached(Vec<u8>, Vec<u64>),
            Owner(MapNode, u64, u64),
        }
        let ps = self.cache.page_size();
        let (parts, epoch) = {
            let guard = self.view.read().unwrap_or_else(|e| e.into_inner());
            let view = guard.as_deref().ok_or(DaemonError::NoMap)?;
            let segments = self.admit(view, first, count, map_epoch, Access::Read)?;
            let mut parts = Vec::with_capacity(segments.len());
            for seg in segments {
                parts.push(match seg {
                    Segment::Cache { first, count } => {
                        let n = usize::try_from(count).unwrap_or(0);
                        let (mut data, mut gens) =
                            (Vec::with_capacity(n * ps), Vec::with_capacity(n));
                        for page in first..first + count {
                            let r = self.cache.get(page)?;
                            gens.push(r.frame_generation().unwrap_or(0));
                            data.extend_from_slice(&r);
                        }
                        Part::Cached(data, gens)
                    }
                    Segment::Source {
                        owner,
                        first,
                        count,
                    } => {
                        let node = view
                            .map
                            .nodes
                            .iter()
                            .find(|n| n.index == owner)
                            .ok_or_else(|| {
                                DaemonError::StaleMap(format!(
                                    "node index {owner} owns page {first} but is not in the map"
                                ))
                            })?;
                        Part::Owner(node.clone(), first, count)
                    }
                });
            }
            (parts, view.map.epoch)
        };
        let n = usize::try_from(count).unwrap_or(0);
        let (mut data, mut generations) = (Vec::with_capacity(n * ps), Vec::with_capacity(n));
        let mut path = ReadPath::Local;
        for part in parts {
            match part {
                Part::Cached(d, g) => {
                    data.extend_from_slice(&d);
                    generations.extend_from_slice(&g);
                }
                Part::Owner(owner, first, count) => {
                    let source = self.page_source.as_ref().ok_or_else(|| {
                        DaemonError::Internal("admitted a page source read without one".into())
                    })?;
                    let s = source.read(&owner, epoch, first, count)?;
                    data.extend_from_slice(&s.data);
                    generations.extend_from_slice(&s.generations);
                    path = match (path, s.faulted_in) {
                        (ReadPath::Fallback, _) | (_, true) => ReadPath::Fallback,
                        _ => ReadPath::OneSided,
                    };
                }
            }
        }
        // A node frozen or cut off past its lease must not answer from its
        // old map.
        self.check_lease()?;
        Ok((data, generations, epoch, path))
    }

    /// Runs `work` with the applied map's read lock held, once the call is
    /// admitted; checks the lease again before handing back its result.
    /// `work` must do no network I/O (see [`Node::read_pages`]).
    fn serve<T>(
        &self,
        first: u64,
        count: u64,
        map_epoch: u64,
        access: Access,
        work: impl FnOnce(&MapView, &[Segment]) -> Result<T, DaemonError>,
    ) -> Result<(T, u64), DaemonError> {
        let guard = self.view.read().unwrap_or_else(|e| e.into_inner());
        let view = guard.as_deref().ok_or(DaemonError::NoMap)?;
        let segments = self.admit(view, first, count, map_epoch, access)?;
        let out = work(view, &segments)?;
        let epoch = view.map.epoch;
        drop(guard);
        // Right before answering, after the data was read: a node frozen or
        // cut off past its lease must not answer from its old map.
        self.check_lease()?;
        Ok((out, epoch))
    }
}

impl Node {
    /// `FaultIn`: the run's pages faulted in (and their bytes when asked),
    /// with the frames' locations. Blocking (a backing read); the gRPC
    /// service and the `tcp` transport's fault calls ([`serve_calls`]) both
    /// answer with it.
    pub(crate) fn fault_in(&self, req: &FaultInRequest) -> Result<FaultInResponse, DaemonError> {
        let (first, count) = self.check_run(req.run, true)?;
        let me = self.index.load(Ordering::Relaxed);
        let ahead = self.readahead(first + count, count, req.readahead);
        // The readahead pages lie in the extent of the run's last page, so
        // admitting the longer run admits nothing the run did not.
        let ((frames, data), epoch) =
            self.serve(first, count + ahead, req.map_epoch, Access::Fill, |_, _| {
                // One gang read for the missing part of the run (and its
                // readahead), then the frames. Under second-hit admission
                // each page's miss goes through the policy instead (`get`),
                // and readahead reads nothing.
                if self.cache.policy().admission == Admission::Always {
                    // Readahead is best effort: a read ahead that fails
                    // (frames short, a backing error past the run) must not
                    // fail the run, which is then read alone.
                    match self.cache.preload(first, count + ahead) {
                        Err(e) if ahead == 0 => return Err(e.into()),
                        Err(_) => {
                            self.cache.preload(first, count)?;
                        }
                        Ok(_) => {}
                    }
                }
                let mut frames = Vec::with_capacity(usize::try_from(count + ahead).unwrap_or(0));
                let mut data = Vec::new();
                let at = |page, frame: u32, generation| FrameLocation {
                    page,
                    node_index: me,
                    frame_index: u64::from(frame),
                    frame_generation: generation,
                };
                for page in first..first + count {
                    let r = self.cache.get(page)?;
                    // A page the policy did not admit has no frame: its
                    // location is (0, generation 0), never a frame that
                    // is not published.
                    frames.push(at(
                        page,
                        r.frame().unwrap_or(0),
                        r.frame_generation().unwrap_or(0),
                    ));
                    if req.want_data {
                        data.extend_from_slice(&r);
                    }
                }
                // Readahead: locations only, up to the first page not held.
                for page in first + count..first + count + ahead {
                    let Some((frame, generation)) = self.cache.location(page) else {
                        break;
                    };
                    frames.push(at(page, frame, generation));
                }
                Ok((frames, data))
            })?;
        self.bytes_served
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(FaultInResponse {
            frames,
            data,
            map_epoch: epoch,
        })
    }

    /// How many of the `asked` readahead pages from `from` (the page after a
    /// run of `count`) a fault-in takes: they stay in the extent of the
    /// run's last page, in the file, and within the per-call page limit
    /// with the run; at most an eighth of the cache, so that what is read
    /// ahead is still cached when the reader comes to it (a window as large
    /// as the cache would evict its own start). None when the node's
    /// readahead is off (`readahead_max` 0).
    fn readahead(&self, from: u64, count: u64, asked: u32) -> u64 {
        let cfg = self.cache.config();
        if asked == 0 || from == 0 || cfg.readahead_max == 0 {
            return 0;
        }
        let end = self
            .cache
            .extent_end(from - 1)
            .min(self.cache.pages())
            .min(from.saturating_add(u64::from(asked)));
        end.saturating_sub(from)
            .min(self.max_pages_per_call.saturating_sub(count))
            .min(cfg.frames as u64 / 8)
    }
}

/// Answers fault-in calls on the node's `tcp` transport connections
/// (`pagewire_proto::call`): the same [`Node::fault_in`] as the gRPC
/// `FaultIn`, on the connection's serving thread. The handler holds the
/// node weakly (the node holds the transport): once the node is gone,
/// calls are refused as `Unavailable`.
pub(crate) fn serve_calls(node: &Arc<Node>) {
    let Some(responder) = node.served.as_ref().and_then(|s| s.tcp_responder()) else {
        return;
    };
    let weak = Arc::downgrade(node);
    responder.set_call_handler(Arc::new(move |arg: &[u8], out: &mut Vec<u8>| {
        let r = match (pagewire_proto::call::decode_request(arg), weak.upgrade()) {
            (Err(s), _) => Err(s),
            (Ok(_), None) => Err(Status::unavailable("the node is stopping")),
            (Ok(req), Some(node)) => {
                node.fault_calls.fetch_add(1, Ordering::Relaxed);
                node.fault_in(&req).map_err(Status::from)
            }
        };
        pagewire_proto::call::push_reply(out, r.as_ref());
    }));
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, DaemonError> + Send + 'static,
) -> Result<T, Status> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(Status::from),
        Err(e) => Err(DaemonError::Internal(e.to_string()).into()),
    }
}

#[tonic::async_trait]
impl NodeRpc for NodeService {
    async fn fault_in(
        &self,
        req: Request<FaultInRequest>,
    ) -> Result<Response<FaultInResponse>, Status> {
        let req = req.into_inner();
        let node = self.node.clone();
        node.check_run(req.run, true)?;
        let resp = blocking(move || node.fault_in(&req)).await?;
        Ok(Response::new(resp))
    }

    async fn read(&self, req: Request<ReadRequest>) -> Result<Response<ReadResponse>, Status> {
        let req = req.into_inner();
        let node = self.node.clone();
        let (first, count) = node.check_run(req.run, true)?;
        let resp = blocking(move || {
            let t0 = std::time::Instant::now();
            let r = node.read_pages(first, count, req.map_epoch);
            node.grpc_reads.fetch_add(1, Ordering::Relaxed);
            let (data, frame_generations, map_epoch, path) = r?;
            node.grpc_read_seconds[path.index()].observe(t0.elapsed().as_secs_f64());
            node.bytes_served
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            Ok(ReadResponse {
                data,
                frame_generations,
                map_epoch,
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn write(&self, req: Request<WriteRequest>) -> Result<Response<WriteResponse>, Status> {
        let req = req.into_inner();
        let node = self.node.clone();
        let (page, _) = node.check_run(
            Some(PageRun {
                first_page: req.page,
                page_count: 1,
            }),
            true,
        )?;
        let (generation, epoch) = blocking(move || {
            node.serve(page, 1, req.map_epoch, Access::Write, |_, _| {
                Ok(node.cache.write(page, &req.data)?)
            })
        })
        .await?;
        Ok(Response::new(WriteResponse {
            frame_generation: generation,
            map_epoch: epoch,
        }))
    }

    async fn warm(
        &self,
        req: Request<NodeRangeRequest>,
    ) -> Result<Response<NodeRangeResponse>, Status> {
        let req = req.into_inner();
        let node = self.node.clone();
        let (first, count) = node.check_run(req.run, false)?;
        let (pages, _) = blocking(move || {
            node.serve(first, count, req.map_epoch, Access::Fill, |_, _| {
                Ok(node.cache.preload(first, count)?)
            })
        })
        .await?;
        Ok(Response::new(NodeRangeResponse { pages }))
    }

    async fn evict(
        &self,
        req: Request<NodeRangeRequest>,
    ) -> Result<Response<NodeRangeResponse>, Status> {
        let req = req.into_inner();
        let node = self.node.clone();
        // Evicting is always safe: no ownership nor lease check beyond the
        // file's bounds.
        let (first, count) = node.check_run(req.run, false)?;
        let pages = blocking(move || Ok(node.cache.evict_range(first, count).0)).await?;
        Ok(Response::new(NodeRangeResponse { pages }))
    }

    async fn stats(&self, _req: Request<StatsRequest>) -> Result<Response<StatsResponse>, Status> {
        let n = &self.node;
        Ok(Response::new(StatsResponse {
            node_id: n.node_id.clone(),
            stats: Some(n.stats()),
            map_epoch: n.applied_epoch(),
            policy: Some(*n.policy.lock().unwrap_or_else(|e| e.into_inner())),
        }))
    }

    async fn topology(
        &self,
        _req: Request<TopologyRequest>,
    ) -> Result<Response<TopologyResponse>, Status> {
        Ok(Response::new(TopologyResponse {
            node_id: self.node.node_id.clone(),
            topology: Some(super::agent::topology()),
        }))
    }

    async fn transports(
        &self,
        _req: Request<TransportsRequest>,
    ) -> Result<Response<TransportsResponse>, Status> {
        Ok(Response::new(TransportsResponse {
            transports: super::agent::transports(&self.node),
        }))
    }
}

/// Applies the pushed watermarks: when the cache is fuller than the high
/// watermark, CLOCK-evicts down to the low one (the cache itself only evicts
/// when it has no free frame at all).
pub(crate) async fn watermark_loop(node: Arc<Node>, tick: Duration) {
    loop {
        tokio::time::sleep(tick).await;
        let p = *node.policy.lock().unwrap_or_else(|e| e.into_inner());
        if p.high_watermark_percent == 0 {
            continue;
        }
        let frames = node.cache.config().frames as u64;
        let used = frames.saturating_sub(node.cache.free_frames() as u64);
        if used * 100 <= frames * u64::from(p.high_watermark_percent) {
            continue;
        }
        let target = frames * u64::from(p.low_watermark_percent) / 100;
        let want = usize::try_from(used.saturating_sub(target)).unwrap_or(usize::MAX);
        let cache = node.cache.clone();
        let freed = tokio::task::spawn_blocking(move || cache.reclaim(want))
            .await
            .unwrap_or(0);
        tracing::debug!(used, target, freed, "watermark eviction");
    }
}
