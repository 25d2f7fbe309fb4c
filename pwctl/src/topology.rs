//! `pwctl topology`: the NUMA layout each node reports (NUMA nodes, their
//! CPUs and memory), and the JSON form `pwctl nodes` shares.

use pagewire_proto::v1::{NodeInfo, Topology};
use serde_json::{Value, json};

use super::{Coord, Ctx, human_bytes, list_nodes, print_json, table};

/// `pwctl topology`.
pub(crate) async fn run(c: &mut Coord, ctx: &Ctx) -> anyhow::Result<bool> {
    let nodes = list_nodes(c, ctx).await?;
    print_topology(&nodes, ctx.json);
    Ok(true)
}

pub(crate) fn topology_json(t: &Topology) -> Value {
    json!({
        "source": t.source,
        "hostname": t.hostname,
        "numa_nodes": t.numa_nodes.iter().map(|n| json!({
            "os_index": n.os_index, "memory_bytes": n.memory_bytes, "cpus": n.cpus,
        })).collect::<Vec<_>>(),
    })
}

fn cpu_list(cpus: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

fn print_topology(nodes: &[NodeInfo], as_json: bool) {
    if as_json {
        print_json(&Value::Array(
            nodes
                .iter()
                .map(|n| json!({"node_id": n.node_id, "topology": n.topology.as_ref().map(topology_json)}))
                .collect(),
        ));
        return;
    }
    let mut rows = Vec::new();
    for n in nodes {
        let t = n.topology.clone().unwrap_or_default();
        if t.numa_nodes.is_empty() {
            rows.push(vec![
                n.node_id.clone(),
                t.hostname.clone(),
                "-".into(),
                "-".into(),
                "-".into(),
                t.source.clone(),
            ]);
        }
        for numa in &t.numa_nodes {
            rows.push(vec![
                n.node_id.clone(),
                t.hostname.clone(),
                numa.os_index.to_string(),
                cpu_list(&numa.cpus),
                if numa.memory_bytes > 0 {
                    human_bytes(numa.memory_bytes)
                } else {
                    "?".into()
                },
                t.source.clone(),
            ]);
        }
    }
    out!(
        "{}",
        table(&["NODE", "HOST", "NUMA", "CPUS", "MEMORY", "SOURCE"], &rows)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_compress() {
        assert_eq!(cpu_list(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }
}
