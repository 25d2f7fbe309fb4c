//! `pwctl stats`: asks every node holding a lease for its counters, all at
//! once, each within a short deadline, so a frozen node costs one deadline,
//! not the whole command. A node that does not answer in time, and every
//! dead or departed member, is a row that says so (with the counters of its
//! last heartbeat where the coordinator has them).

use std::time::Duration;

use pagewire_proto::net;
use pagewire_proto::state_name;
use pagewire_proto::v1::node_client::NodeClient;
use pagewire_proto::v1::{NodeInfo, NodeState, NodeStats, StatsRequest};
use serde_json::{Value, json};

use super::{Coord, Ctx, error_chain, human_bytes, list_nodes, table};

/// `pwctl stats [--watch SECS] [--node-timeout-ms MS]`: once, or every
/// `watch` seconds until interrupted.
pub(crate) async fn run(
    c: &mut Coord,
    ctx: &Ctx,
    watch: Option<u64>,
    node_timeout_ms: u64,
) -> anyhow::Result<bool> {
    loop {
        let nodes = list_nodes(c, ctx).await?;
        let per_node = Duration::from_millis(node_timeout_ms.max(1));
        let rows = collect(&nodes, ctx, per_node).await;
        // Clear the screen between refreshes only on a terminal: a
        // file or a pipe gets the tables one after another.
        if watch.is_some() && !ctx.json && std::io::IsTerminal::is_terminal(&std::io::stdout()) {
            out!("\x1b[2J\x1b[H");
        }
        print(&rows, ctx.json, watch.is_some());
        match watch {
            Some(secs) => tokio::time::sleep(Duration::from_secs(secs.max(1))).await,
            None => return Ok(true),
        }
    }
}

pub(crate) struct Row {
    node: String,
    state: &'static str,
    /// Whether the counters came from the node just now.
    live: bool,
    source: String,
    stats: NodeStats,
}

fn holds_lease(s: NodeState) -> bool {
    matches!(
        s,
        NodeState::Alive | NodeState::Draining | NodeState::Drained
    )
}

/// One node's counters, asked within `limit` (connect included).
async fn ask(
    address: String,
    ctx_token: pagewire_proto::auth::AttachToken,
    tls: Option<net::ClientTls>,
    limit: Duration,
) -> Result<NodeStats, String> {
    let call = async {
        let ch = net::connect(&address, tls.as_ref(), limit)
            .await
            .map_err(|e| error_chain(&e))?;
        let mut client = NodeClient::with_interceptor(ch, ctx_token);
        let mut r = tonic::Request::new(StatsRequest {});
        r.set_timeout(limit);
        client
            .stats(r)
            .await
            .map(|r| r.into_inner().stats.unwrap_or_default())
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
    };
    match tokio::time::timeout(limit, call).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "no answer within {} ms (frozen or overloaded?)",
            limit.as_millis()
        )),
    }
}

/// A row per member: live counters from nodes holding a lease, in node
/// order, asked concurrently.
pub(crate) async fn collect(nodes: &[NodeInfo], ctx: &Ctx, limit: Duration) -> Vec<Row> {
    let mut calls = tokio::task::JoinSet::new();
    for (i, n) in nodes.iter().enumerate() {
        if holds_lease(n.state()) {
            let (address, token, tls) =
                (n.grpc_address.clone(), ctx.token.clone(), ctx.tls.clone());
            calls.spawn(async move { (i, ask(address, token, tls, limit).await) });
        }
    }
    let mut answers: Vec<Option<Result<NodeStats, String>>> = vec![None; nodes.len()];
    while let Some(r) = calls.join_next().await {
        if let Ok((i, r)) = r {
            answers[i] = Some(r);
        }
    }
    nodes
        .iter()
        .zip(answers)
        .map(|(n, answer)| {
            let last = n.stats.unwrap_or_default();
            let state = state_name(n.state());
            let (live, source, stats) = match answer {
                Some(Ok(s)) => (true, "node".to_owned(), s),
                Some(Err(e)) => (
                    false,
                    format!("UNREACHABLE: {e}; counters of its last heartbeat"),
                    last,
                ),
                None if holds_lease(n.state()) => (
                    false,
                    "UNREACHABLE: the query failed; counters of its last heartbeat".into(),
                    last,
                ),
                None => (
                    false,
                    format!("{}: not asked (holds no lease)", state.to_uppercase()),
                    last,
                ),
            };
            Row {
                node: n.node_id.clone(),
                state,
                live,
                source,
                stats,
            }
        })
        .collect()
}

/// Prints the rows: a table, or with `as_json` a JSON array, pretty like
/// every other command's unless `lines` (`--watch --json`: one compact
/// line per refresh, JSON Lines).
pub(crate) fn print(rows: &[Row], as_json: bool, lines: bool) {
    if as_json {
        let v: Vec<Value> = rows
            .iter()
            .map(|r| {
                let mut s = stats_json(&r.stats);
                s["node_id"] = json!(r.node);
                s["state"] = json!(r.state);
                s["reachable"] = json!(r.live);
                s["source"] = json!(r.source);
                s
            })
            .collect();
        let text = if lines {
            serde_json::to_string(&v)
        } else {
            serde_json::to_string_pretty(&v)
        };
        outln!("{}", text.unwrap_or_default());
        return;
    }
    let t: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let s = &r.stats;
            vec![
                r.node.clone(),
                r.state.into(),
                s.hits.to_string(),
                s.misses.to_string(),
                s.faults.to_string(),
                s.evictions.to_string(),
                s.retries.to_string(),
                human_bytes(s.bytes_served),
                format!("{}/{}", s.pages_resident, s.capacity_pages),
                s.extents_owned.to_string(),
                format!(
                    "{}/{}/{}",
                    s.remote_pages, s.remote_one_sided, s.remote_fallbacks
                ),
                s.remote_validation_failures.to_string(),
                format!("{}/{}", s.verbs_queue_pairs, s.verbs_refused),
                r.source.clone(),
            ]
        })
        .collect();
    out!(
        "{}",
        table(
            &[
                "NODE",
                "STATE",
                "HITS",
                "MISSES",
                "FAULTS",
                "EVICTIONS",
                "RETRIES",
                "SERVED",
                "RESIDENT",
                "EXTENTS",
                "REMOTE(ALL/1-SIDED/FALLBACK)",
                "VALIDATION_FAILS",
                "QPS/REFUSED",
                "SOURCE"
            ],
            &t
        )
    );
}
pub(crate) fn stats_json(s: &NodeStats) -> Value {
    json!({
        "hits": s.hits, "misses": s.misses, "faults": s.faults, "evictions": s.evictions,
        "retries": s.retries, "bytes_served": s.bytes_served, "writes": s.writes,
        "pages_resident": s.pages_resident, "capacity_pages": s.capacity_pages,
        "extents_owned": s.extents_owned, "stale_map_rejections": s.stale_map_rejections,
        "remote_pages": s.remote_pages, "remote_one_sided": s.remote_one_sided,
        "remote_fallbacks": s.remote_fallbacks, "remote_round_trips": s.remote_round_trips,
        "remote_retries": s.remote_retries,
        "remote_validation_failures": s.remote_validation_failures,
        "verbs_queue_pairs": s.verbs_queue_pairs, "verbs_refused": s.verbs_refused,
    })
}
