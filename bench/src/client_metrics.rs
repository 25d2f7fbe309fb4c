//! `--metrics-listen`: a reader process's client metrics on `GET /metrics`,
//! so that a Prometheus (and `k8s/monitoring/check.sh`) sees the client
//! library's series (`pagewire_client_*`, client/src/metrics.rs) of a real
//! read load, beside the nodes' and the coordinator's.
//!
//! The endpoint is the one the node and the coordinator serve
//! (`pagewire_proto::metrics_http`: OpenMetrics text, `/healthz`,
//! `/readyz`), on a runtime of its own: the reader's loop is synchronous
//! and must not share a thread with scrapes.

use std::sync::Arc;

use anyhow::Context;
use pagewire_client::ClusterClient;
use prometheus_client::registry::Registry;

/// The prefix of every series: `pagewire_client_read_seconds`, ...
pub const PREFIX: &str = "pagewire_client";

/// A running endpoint; dropping it stops it.
pub struct Endpoint {
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // Background shutdown: a scrape in flight is not waited for.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Serves `client`'s metrics on `addr` (host:port) until the returned
/// endpoint is dropped. The address is bound before this returns, so a port
/// in use is this call's error, not a silent missing target.
pub fn serve(addr: &str, client: Arc<ClusterClient>) -> anyhow::Result<Endpoint> {
    let mut registry = Registry::with_prefix(PREFIX);
    registry.register_collector(pagewire_client::metrics::collector(client));
    let registry = Arc::new(registry);
    // One worker: a scrape renders a few dozen lines.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("client-metrics")
        .enable_io()
        .enable_time()
        .build()
        .context("starting the metrics endpoint's runtime")?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(addr))
        .with_context(|| format!("--metrics-listen {addr}: cannot listen"))?;
    rt.spawn(pagewire_proto::metrics_http::serve(
        listener,
        pagewire_proto::metrics_http::Routes {
            metrics: Arc::new(move || render(&registry)),
            // Ready as long as it serves: the client has no state a scrape
            // should wait for.
            ready: Arc::new(|| Ok(())),
        },
    ));
    Ok(Endpoint { runtime: Some(rt) })
}

fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // A collector that fails to encode (it cannot: it writes to a String)
    // would leave half a family; an empty answer fails the scrape instead.
    if prometheus_client::encoding::text::encode(&mut out, registry).is_err() {
        out.clear();
    }
    out
}
