//! The client's metrics for a program's own Prometheus endpoint (feature
//! `prometheus`): register [`collector`] in the `prometheus_client`
//! registry the program serves, under the prefix it chooses:
//!
//! ```no_run
//! # fn demo(client: std::sync::Arc<pagewire_client::ClusterClient>) {
//! let mut registry = prometheus_client::registry::Registry::with_prefix("pagewire_client");
//! registry.register_collector(pagewire_client::metrics::collector(client));
//! let mut text = String::new();
//! prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
//! // serve `text` on /metrics
//! # }
//! ```
//!
//! With the prefix `pagewire_client` the series are
//! `pagewire_client_read_seconds{path}` (a histogram of answered reads,
//! labels as [`ReadPathLabel::as_str`](crate::latency::ReadPathLabel::as_str)) and the counters of
//! [`ClientStats`](crate::ClientStats): `reads_total`,
//! `one_sided_total{transport}`, `fault_ins_total`, `grpc_reads_total`,
//! `coalesced_total`, `writes_total`, `retries_total`, `reconnects_total`,
//! `map_refreshes_total`, `lease_waits_total`, `unavailable_total`. Every
//! value is read from the client on each scrape.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;

use crate::ClusterClient;
use crate::latency::BOUNDS_SECONDS;

/// The collector of `client`'s metrics (see the module doc).
pub fn collector(client: Arc<ClusterClient>) -> Box<dyn Collector> {
    Box::new(ClientCollector(client))
}

struct ClientCollector(Arc<ClusterClient>);

impl std::fmt::Debug for ClientCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientCollector")
    }
}

fn counter(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    let m = enc.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(m)
}

impl Collector for ClientCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s = self.0.stats();
        for (name, help, v) in [
            ("reads", "Pages read", s.reads),
            (
                "fault_ins",
                "Pages read by FaultIn after a one-sided miss",
                s.fault_ins,
            ),
            (
                "readahead",
                "Pages whose locations a sequential reader's fault-in brought back",
                s.readahead,
            ),
            ("grpc_reads", "Pages read by the gRPC Read", s.grpc_reads),
            (
                "coalesced",
                "Pages answered by another thread's read of the same run",
                s.coalesced,
            ),
            ("writes", "Writes acknowledged", s.writes),
            (
                "retries",
                "Attempts beyond the first (owner unreachable, stale map, moving extent, lease wait)",
                s.retries,
            ),
            (
                "reconnects",
                "Connections opened to a node again after one to it was dropped",
                s.reconnects,
            ),
            ("map_refreshes", "Map polls asked for", s.map_refreshes),
            (
                "lease_waits",
                "Attempts that waited for a map within its trust window",
                s.lease_waits,
            ),
            (
                "unavailable",
                "Operations that failed as unavailable",
                s.unavailable,
            ),
        ] {
            counter(&mut enc, name, help, v)?;
        }
        {
            let mut m = enc.encode_descriptor(
                "one_sided",
                "Pages read one-sidedly, by transport",
                None,
                MetricType::Counter,
            )?;
            for (t, v) in [
                ("shm", s.one_sided_shm),
                ("tcp", s.one_sided_tcp),
                ("verbs", s.one_sided_verbs),
            ] {
                ConstCounter::new(v).encode(m.encode_family(&[("transport", t)])?)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "read_seconds",
            "Time from a read call to its answer, retries included, by path (one_sided: \
             every page one-sided; fallback: a page faulted in after a one-sided miss; \
             grpc: a page by the gRPC Read; coalesced: answered by another thread's read)",
            None,
            MetricType::Histogram,
        )?;
        for (path, h) in self.0.read_latency() {
            let buckets: Vec<(f64, u64)> = BOUNDS_SECONDS
                .iter()
                .copied()
                .chain([f64::MAX])
                .zip(h.buckets.iter().copied())
                .collect();
            m.encode_family(&[("path", path.as_str())])?
                .encode_histogram::<NoLabelSet>(h.sum_seconds, h.count, &buckets, None)?;
        }
        Ok(())
    }
}
