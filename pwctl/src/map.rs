//! `pwctl map`: the ownership map against the capacity weights (extents,
//! share and deviation per node, extents in handoff), and with `--extents`
//! which node owns each run of extents.

use pagewire_proto::state_name;
use pagewire_proto::v1::{NodeInfo, NodeState, OwnershipMap};
use serde_json::{Value, json};

use super::{Coord, Ctx, get_map, human_bytes, list_nodes, print_json, table};

/// `pwctl map [--extents]`.
pub(crate) async fn run(c: &mut Coord, ctx: &Ctx, extents: bool) -> anyhow::Result<bool> {
    let map = get_map(c, ctx).await?;
    let nodes = list_nodes(c, ctx).await?;
    print_map(&map, &nodes, extents, ctx.json);
    Ok(true)
}

fn print_map(map: &OwnershipMap, nodes: &[NodeInfo], extents: bool, as_json: bool) {
    let total = map.owner.len() as u64;
    let weight_total: u64 = nodes
        .iter()
        .filter(|n| n.state() == NodeState::Alive)
        .map(|n| n.capacity_bytes)
        .sum();
    let mut max_dev: f64 = 0.0;
    let mut rows = Vec::new();
    let mut per_node = Vec::new();
    for n in nodes {
        let owned = map.owner.iter().filter(|&&o| o == n.index).count() as u64;
        let handing = map.previous_owner.iter().filter(|&&p| p == n.index).count() as u64;
        let weight = if n.state() == NodeState::Alive && weight_total > 0 {
            n.capacity_bytes as f64 / weight_total as f64
        } else {
            0.0
        };
        let share = if total > 0 {
            owned as f64 / total as f64
        } else {
            0.0
        };
        let dev = (weight > 0.0).then(|| (share - weight) / weight * 100.0);
        if let Some(d) = dev {
            max_dev = max_dev.max(d.abs());
        }
        rows.push(vec![
            n.node_id.clone(),
            n.index.to_string(),
            state_name(n.state()).into(),
            human_bytes(n.capacity_bytes),
            format!("{:.1}%", weight * 100.0),
            owned.to_string(),
            format!("{:.1}%", share * 100.0),
            dev.map_or("-".into(), |d| format!("{d:+.1}%")),
            handing.to_string(),
        ]);
        per_node.push(json!({
            "node_id": n.node_id, "index": n.index, "state": state_name(n.state()),
            "capacity_bytes": n.capacity_bytes, "weight": weight, "extents": owned,
            "share": share, "deviation_percent": dev, "handing_off": handing,
        }));
    }
    let runs = extent_runs(map, nodes);
    if as_json {
        let mut v = json!({
            "epoch": map.epoch, "file_size": map.file_size, "extent_size": map.extent_size,
            "page_size": map.page_size, "extents": total,
            "unowned": map.owner.iter().filter(|&&o| o == 0).count(),
            "in_handoff": map.previous_owner.iter().filter(|&&p| p != 0).count(),
            "max_deviation_percent": max_dev, "nodes": per_node,
        });
        if extents {
            v["runs"] = Value::Array(
                runs.iter()
                    .map(|(a, b, n)| json!({"first": a, "last": b, "node": n}))
                    .collect(),
            );
        }
        print_json(&v);
        return;
    }
    outln!(
        "epoch {}  {} extents of {}  file {}  in handoff {}  unowned {}",
        map.epoch,
        total,
        human_bytes(map.extent_size),
        human_bytes(map.file_size),
        map.previous_owner.iter().filter(|&&p| p != 0).count(),
        map.owner.iter().filter(|&&o| o == 0).count()
    );
    out!(
        "{}",
        table(
            &[
                "NODE",
                "INDEX",
                "STATE",
                "CAPACITY",
                "WEIGHT",
                "EXTENTS",
                "SHARE",
                "DEVIATION",
                "HANDING OFF"
            ],
            &rows
        )
    );
    outln!("balance: largest deviation from capacity weight {max_dev:.1}%");
    if extents {
        let rows: Vec<Vec<String>> = runs
            .iter()
            .map(|(a, b, n)| {
                vec![
                    if a == b {
                        a.to_string()
                    } else {
                        format!("{a}-{b}")
                    },
                    n.clone(),
                ]
            })
            .collect();
        out!("{}", table(&["EXTENTS", "OWNER"], &rows));
    }
}

fn extent_runs(map: &OwnershipMap, nodes: &[NodeInfo]) -> Vec<(u64, u64, String)> {
    let name = |i: u32| {
        nodes.iter().find(|n| n.index == i).map_or_else(
            || {
                if i == 0 {
                    "-".to_owned()
                } else {
                    format!("#{i}")
                }
            },
            |n| n.node_id.clone(),
        )
    };
    let mut runs: Vec<(u64, u64, String)> = Vec::new();
    let mut last = None;
    for (e, &o) in map.owner.iter().enumerate() {
        let e = e as u64;
        match (last, runs.last_mut()) {
            (Some(l), Some(r)) if l == o => r.1 = e,
            _ => runs.push((e, e, name(o))),
        }
        last = Some(o);
    }
    runs
}
