//! `pwctl nodes`: the members, with state, address, capacity, extents,
//! lease left, applied epoch and transports.

use pagewire_proto::state_name;
use pagewire_proto::v1::NodeInfo;
use serde_json::{Value, json};

use super::topology::topology_json;
use super::{Coord, Ctx, human_bytes, human_ms, list_nodes, print_json, table};

/// `pwctl nodes`.
pub(crate) async fn run(c: &mut Coord, ctx: &Ctx) -> anyhow::Result<bool> {
    let nodes = list_nodes(c, ctx).await?;
    if ctx.json {
        print_json(&Value::Array(nodes.iter().map(node_json).collect()));
    } else {
        let rows = nodes
            .iter()
            .map(|n| {
                vec![
                    n.node_id.clone(),
                    n.index.to_string(),
                    state_name(n.state()).into(),
                    n.grpc_address.clone(),
                    human_bytes(n.capacity_bytes),
                    n.extents_owned.to_string(),
                    if n.lease_remaining_ms > 0 {
                        human_ms(n.lease_remaining_ms)
                    } else {
                        "-".into()
                    },
                    n.applied_epoch.to_string(),
                    n.transports
                        .iter()
                        .map(|t| t.kind.clone())
                        .collect::<Vec<_>>()
                        .join(","),
                ]
            })
            .collect::<Vec<_>>();
        out!(
            "{}",
            table(
                &[
                    "NODE",
                    "INDEX",
                    "STATE",
                    "ADDRESS",
                    "CAPACITY",
                    "EXTENTS",
                    "LEASE LEFT",
                    "APPLIED EPOCH",
                    "TRANSPORTS"
                ],
                &rows
            )
        );
    }
    Ok(true)
}

pub(crate) fn node_json(n: &NodeInfo) -> Value {
    json!({
        "node_id": n.node_id, "index": n.index, "state": state_name(n.state()),
        "grpc_address": n.grpc_address, "metrics_address": n.metrics_address,
        "capacity_bytes": n.capacity_bytes, "extents_owned": n.extents_owned,
        "lease_remaining_ms": n.lease_remaining_ms, "applied_epoch": n.applied_epoch,
        "incarnation": n.incarnation,
        "topology": n.topology.as_ref().map(topology_json),
        "transports": n.transports.iter().map(|t| json!({
            "kind": t.kind, "endpoint": t.endpoint, "address": t.address, "length": t.length,
            "rkey": t.rkey, "epoch": t.epoch,
        })).collect::<Vec<_>>(),
    })
}
