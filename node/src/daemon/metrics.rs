//! The node's Prometheus metrics, read from the cache and the daemon's
//! counters on each scrape (no second set of counters to keep in step).

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::Node;
use super::service::ReadPath;
use pagewire_proto::auth::Refusals;

struct NodeCollector(Arc<Node>);

impl std::fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeCollector")
    }
}

fn counter(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    let m = enc.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(m)
}

fn gauge(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let g = ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX));
    let m = enc.encode_descriptor(name, help, None, g.metric_type())?;
    g.encode(m)
}

impl prometheus_client::collector::Collector for NodeCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let n = &self.0;
        let s = n.cache.stats();
        let view = n.view();
        let frames = n.cache.config().frames as u64;
        counter(
            &mut enc,
            "cache_hits",
            "Lookups that found the page",
            s.hits,
        )?;
        counter(&mut enc, "cache_misses", "Lookups that did not", s.misses)?;
        counter(
            &mut enc,
            "cache_faults",
            "Backing reads (one per run of pages)",
            s.faults,
        )?;
        counter(
            &mut enc,
            "cache_pages_read",
            "Pages read from the backing file",
            s.pages_read,
        )?;
        counter(&mut enc, "cache_evictions", "Frames evicted", s.evictions)?;
        counter(
            &mut enc,
            "cache_admissions_skipped",
            "Misses served from the backing file without caching the page",
            s.admissions_skipped,
        )?;
        counter(
            &mut enc,
            "cache_retries",
            "Lookups retried after a lost race",
            s.retries,
        )?;
        counter(&mut enc, "cache_writes", "Writes acknowledged", s.writes)?;
        counter(
            &mut enc,
            "cache_flight_waits",
            "Misses that waited for another fault of the page",
            s.flight_waits,
        )?;
        counter(
            &mut enc,
            "bytes_served",
            "Page bytes sent by FaultIn (gRPC or a tcp call) and Read",
            n.bytes_served.load(Ordering::Relaxed),
        )?;
        counter(
            &mut enc,
            "fault_calls",
            "Fault-ins answered as calls on the tcp transport's connections (not gRPC)",
            n.fault_calls.load(Ordering::Relaxed),
        )?;
        counter(
            &mut enc,
            "stale_map_rejections",
            "Calls refused because the caller's map was stale",
            n.stale_rejections.load(Ordering::Relaxed),
        )?;
        counter(
            &mut enc,
            "lease_rejections",
            "Calls refused because this node's lease had run out",
            n.lease_rejections.load(Ordering::Relaxed),
        )?;
        gauge(
            &mut enc,
            "lease_valid",
            "1 while this node's own lease holds",
            u64::from(n.lease.valid()),
        )?;
        counter(
            &mut enc,
            "heartbeat_failures",
            "Heartbeats that did not reach the coordinator",
            n.heartbeat_failures.load(Ordering::Relaxed),
        )?;
        counter(
            &mut enc,
            "registrations",
            "Registrations with the coordinator",
            n.registrations.load(Ordering::Relaxed),
        )?;
        counter(
            &mut enc,
            "older_maps_refused",
            "Maps a coordinator sent with an epoch older than the applied one (not applied)",
            n.older_maps_refused.load(Ordering::Relaxed),
        )?;
        gauge(&mut enc, "cache_frames", "Frames in the cache", frames)?;
        gauge(
            &mut enc,
            "cache_pages_resident",
            "Frames holding a page",
            frames.saturating_sub(n.cache.free_frames() as u64),
        )?;
        gauge(
            &mut enc,
            "map_epoch",
            "Epoch of the map this node applied",
            view.as_ref().map_or(0, |v| v.map.epoch),
        )?;
        gauge(
            &mut enc,
            "extents_owned",
            "Extents this node owns",
            view.as_ref().map_or(0, |v| v.owned()),
        )?;
        gauge(
            &mut enc,
            "extents_handing_off",
            "Extents this node still serves for their new owner",
            view.as_ref().map_or(0, |v| {
                v.map.previous_owner.iter().filter(|&&p| p == v.me).count() as u64
            }),
        )?;
        let (qps, refused) = n
            .served
            .as_ref()
            .map_or((0, 0), |s| (s.verbs_queue_pairs(), s.verbs_refused()));
        gauge(
            &mut enc,
            "verbs_queue_pairs",
            "RC queue pairs served over verbs (one per connected reader process)",
            qps,
        )?;
        counter(
            &mut enc,
            "verbs_refused",
            "Reader processes refused because transports.verbs_max_queue_pairs were served",
            refused,
        )?;
        let (open, accepted) = n
            .served
            .as_ref()
            .map_or((0, 0), |s| (s.tcp_connections(), s.tcp_accepted()));
        gauge(
            &mut enc,
            "tcp_connections",
            "Reader connections the tcp transport serves now (one per reader process and owner)",
            open,
        )?;
        counter(
            &mut enc,
            "tcp_connections_accepted",
            "Reader connections the tcp transport accepted since start",
            accepted,
        )?;
        if let Some(src) = &n.one_sided {
            let r = src.reader_stats();
            let st = src.stats();
            for (name, help, v) in [
                (
                    "remote_pages",
                    "Pages of other nodes' extents this node read for callers",
                    st.pages,
                ),
                (
                    "remote_one_sided_hits",
                    "Of those, read one-sidedly (no owner CPU)",
                    st.one_sided,
                ),
                (
                    "remote_fallbacks",
                    "Of those, faulted in on the owner over gRPC",
                    st.fallbacks,
                ),
                (
                    "remote_connects",
                    "One-sided connections opened to owners",
                    st.connects,
                ),
                (
                    "remote_reconnects",
                    "Of those, opened to an owner after one to it was closed (a failure, or a new region epoch)",
                    st.reconnects,
                ),
                ("remote_reads", "One-sided page reads attempted", r.reads),
                (
                    "remote_warm_hits",
                    "One-sided hits from the index cache (one round trip)",
                    r.warm_hits,
                ),
                (
                    "remote_cold_hits",
                    "One-sided hits found through the bucket index",
                    r.cold_hits,
                ),
                ("remote_bucket_reads", "Bucket READs", r.bucket_reads),
                ("remote_retries", "One-sided retries", r.retries),
                (
                    "remote_validation_failures",
                    "Copies that failed validation (frame changed under the READ)",
                    r.validation_failures,
                ),
                (
                    "remote_torn_buckets",
                    "Buckets seen locked, torn or changed during a walk",
                    r.torn_buckets,
                ),
                (
                    "remote_absent",
                    "Walks that found the page absent",
                    r.absent,
                ),
                ("remote_gave_up", "Reads that ran out of retries", r.gave_up),
                ("remote_round_trips", "READ round trips", r.round_trips),
                ("remote_bytes", "Bytes read one-sidedly", r.bytes),
            ] {
                counter(&mut enc, name, help, v)?;
            }
        }
        counter(
            &mut enc,
            "grpc_reads",
            "gRPC Read calls answered (any outcome)",
            n.grpc_reads.load(Ordering::Relaxed),
        )?;
        counter(
            &mut enc,
            "lease_losses",
            "Leases lost: every extent dropped until the node registered again",
            n.lease_losses.load(Ordering::Relaxed),
        )?;
        let mut m = enc.encode_descriptor(
            "grpc_read_seconds",
            "Latency of answered gRPC Reads (path: local = this node's cache alone, \
             one_sided = with pages read one-sidedly from their owners, fallback = with \
             a page faulted in on its owner over gRPC)",
            None,
            prometheus_client::metrics::MetricType::Histogram,
        )?;
        for (path, label) in ReadPath::ALL {
            n.grpc_read_seconds[path.index()].encode(m.encode_family(&[("path", label)])?)?;
        }
        Ok(())
    }
}

/// A latency histogram in the client library's buckets (10 µs to about
/// 1.3 s, doubling), so that a node's and a client's read latencies compare
/// bucket for bucket.
pub(crate) fn latency_histogram() -> Histogram {
    Histogram::new(pagewire_client::latency::BOUNDS_SECONDS)
}

/// The node's metrics, every sample labelled with `node_id`; `refused`:
/// the gRPC calls its token check refused.
pub(crate) fn registry(node: Arc<Node>, refused: Arc<Refusals>) -> Registry {
    let id = node.node_id.clone();
    let mut r = Registry::with_prefix_and_labels(
        "pagewire_node",
        [(Cow::Borrowed("node_id"), Cow::Owned(id))].into_iter(),
    );
    r.register_collector(Box::new(NodeCollector(node)));
    r.register_collector(refused.collector());
    r
}

pub(crate) fn render(r: &Registry) -> String {
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, r).is_err() {
        out.clear();
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use pagewire_proto::auth::{AttachToken, TokenCheck};
    use tonic::service::Interceptor;

    /// Issue 21: every sample names its node (0 of 35 did), and calls with
    /// a wrong token are counted (none was).
    #[test]
    fn every_sample_names_the_node_and_refused_tokens_are_counted() {
        let (_dir, node) = super::super::tests::node();
        let node = Arc::new(node);
        node.lose_everything("test");
        node.grpc_read_seconds[super::ReadPath::Fallback.index()].observe(0.003);
        let mut check = TokenCheck::new("right").unwrap();
        let registry = super::registry(node, check.refusals());
        for _ in 0..3 {
            let req = AttachToken::new("wrong")
                .unwrap()
                .call(tonic::Request::new(()))
                .unwrap();
            assert!(check.call(req).is_err());
        }
        let text = super::render(&registry);
        let samples: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .collect();
        assert!(samples.len() > 20, "{text}");
        for s in &samples {
            assert!(s.contains("node_id=\"t\""), "no node_id label: {s}");
        }
        let wrong = samples
            .iter()
            .find(|s| {
                s.starts_with("pagewire_node_grpc_unauthenticated_total{")
                    && s.contains("reason=\"wrong\"")
            })
            .unwrap_or_else(|| panic!("no wrong-token counter in:\n{text}"));
        assert!(wrong.ends_with(" 3"), "{wrong}");
        for want in [
            "pagewire_node_lease_losses_total{node_id=\"t\"} 1",
            "pagewire_node_grpc_reads_total{node_id=\"t\"} 0",
            "pagewire_node_grpc_read_seconds_count{node_id=\"t\",path=\"fallback\"} 1",
            "pagewire_node_grpc_read_seconds_bucket{node_id=\"t\",le=\"0.00512\",path=\"fallback\"} 1",
            "pagewire_node_grpc_read_seconds_bucket{node_id=\"t\",le=\"0.00256\",path=\"fallback\"} 0",
            "pagewire_node_grpc_read_seconds_count{node_id=\"t\",path=\"one_sided\"} 0",
            "pagewire_node_grpc_read_seconds_count{node_id=\"t\",path=\"local\"} 0",
        ] {
            assert!(samples.contains(&want), "{want:?} missing from:\n{text}");
        }
    }
}
