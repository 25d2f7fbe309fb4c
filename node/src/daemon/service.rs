//! The `pagewire.v1.Node` gRPC service over the local page cache.
//!
//! Every call that names pages checks them against the map this node applied
//! (unless the caller sends epoch 0): a page of an extent this node neither
//! owns nor hands off is refused as a stale map, so a reader with an old map
//! learns it at once instead of being served by the wrong node. Cache work
//! (which may read the backing file) runs on the blocking pool.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use pagewire_proto::v1::node_server::Node as NodeRpc;
use pagewire_proto::v1::{
    FaultInRequest, FaultInResponse, FrameLocation, NodeRangeRequest, NodeRangeResponse, PageRun,
    ReadRequest, ReadResponse, StatsRequest, StatsResponse, TopologyRequest, TopologyResponse,
    TransportsRequest, TransportsResponse, WriteRequest, WriteResponse,
};
use tonic::{Request, Response, Status};

use super::{DaemonError, Node};

pub(crate) struct NodeService {
    pub(crate) node: Arc<Node>,
}

impl Node {
    /// Checks `run` against the file, the per-call limit (when `limit`), and
    /// this node's map; returns (first, count, epoch this node is at).
    fn check_run(
        &self,
        run: Option<PageRun>,
        map_epoch: u64,
        limit: bool,
    ) -> Result<(u64, u64, u64), DaemonError> {
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
        self.check_owned(run.first_page, run.page_count, map_epoch)?;
        Ok((run.first_page, run.page_count, self.applied_epoch()))
    }

    fn check_owned(&self, first: u64, count: u64, map_epoch: u64) -> Result<(), DaemonError> {
        if map_epoch == 0 {
            return Ok(());
        }
        let view = self.view().ok_or(DaemonError::NoMap)?;
        let (a, b) = (view.extent_of(first), view.extent_of(first + count - 1));
        for e in a..=b {
            if !view.serves(e) {
                self.stale_rejections.fetch_add(1, Ordering::Relaxed);
                let owner = view.map.owner.get(e).copied().unwrap_or(0);
                return Err(DaemonError::StaleMap(format!(
                    "extent {e} is served by node index {owner} at epoch {} (you sent epoch {map_epoch}); refresh the map",
                    view.map.epoch
                )));
            }
        }
        Ok(())
    }
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
        let (first, count, epoch) = node.check_run(req.run, req.map_epoch, true)?;
        let me = node.index.load(Ordering::Relaxed);
        let resp = blocking(move || {
            // One gang read for the missing part of the run, then the frames.
            node.cache.preload(first, count)?;
            let mut frames = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
            let mut data = Vec::new();
            for page in first..first + count {
                let r = node.cache.get(page)?;
                frames.push(FrameLocation {
                    page,
                    node_index: me,
                    frame_index: u64::from(r.frame()),
                    generation: r.generation(),
                });
                if req.want_data {
                    data.extend_from_slice(&r);
                }
            }
            node.bytes_served
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            Ok(FaultInResponse {
                frames,
                data,
                map_epoch: epoch,
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn read(&self, req: Request<ReadRequest>) -> Result<Response<ReadResponse>, Status> {
        let req = req.into_inner();
        let node = self.node.clone();
        let (first, count, epoch) = node.check_run(req.run, req.map_epoch, true)?;
        let resp = blocking(move || {
            let ps = node.cache.page_size();
            let mut data = Vec::with_capacity(usize::try_from(count).unwrap_or(0) * ps);
            let mut generations = Vec::new();
            for page in first..first + count {
                let r = node.cache.get(page)?;
                generations.push(r.generation());
                data.extend_from_slice(&r);
            }
            node.bytes_served
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            Ok(ReadResponse {
                data,
                generations,
                map_epoch: epoch,
            })
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn write(&self, req: Request<WriteRequest>) -> Result<Response<WriteResponse>, Status> {
        let req = req.into_inner();
        let node = self.node.clone();
        let (page, _, epoch) = node.check_run(
            Some(PageRun {
                first_page: req.page,
                page_count: 1,
            }),
            req.map_epoch,
            true,
        )?;
        let generation = blocking(move || Ok(node.cache.write(page, &req.data)?)).await?;
        Ok(Response::new(WriteResponse {
            generation,
            map_epoch: epoch,
        }))
    }

    async fn warm(
        &self,
        req: Request<NodeRangeRequest>,
    ) -> Result<Response<NodeRangeResponse>, Status> {
        let req = req.into_inner();
        let node = self.node.clone();
        let (first, count, _) = node.check_run(req.run, req.map_epoch, false)?;
        let pages = blocking(move || Ok(node.cache.preload(first, count)?)).await?;
        Ok(Response::new(NodeRangeResponse { pages }))
    }

    async fn evict(
        &self,
        req: Request<NodeRangeRequest>,
    ) -> Result<Response<NodeRangeResponse>, Status> {
        let req = req.into_inner();
        let node = self.node.clone();
        // Evicting is always safe: no ownership check beyond the file's bounds.
        let (first, count, _) = node.check_run(req.run, 0, false)?;
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
