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

use super::{Ctx, error_chain, human_bytes, stats_json, table};

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
