//! `pwctl drain` and `pwctl undrain`: move every extent off a node (for
//! good, or `--until-restart` of its running process), optionally waiting
//! for the drain to finish and saying what holds it up when it does not;
//! and let a drained node take its share again.

use std::time::Duration;

use pagewire_proto::state_name;
use pagewire_proto::v1::{DrainRequest, NodeInfo, NodeState, OwnershipMap};
use serde_json::json;

use super::{Coord, Ctx, get_map, list_nodes, print_json, req};

/// `pwctl drain NODE [--wait SECS] [--until-restart]`.
pub(crate) async fn drain(
    c: &mut Coord,
    ctx: &Ctx,
    node: &str,
    wait: u64,
    until_restart: bool,
) -> anyhow::Result<bool> {
    let incarnation = if until_restart {
        let nodes = list_nodes(c, ctx).await?;
        match nodes.iter().find(|n| n.node_id == node) {
            Some(n) if n.incarnation != 0 => n.incarnation,
            _ => {
                eprintln!("pwctl: {node} is not a registered node");
                return Ok(false);
            }
        }
    } else {
        0
    };
    let r = DrainRequest {
        node_id: node.to_owned(),
        incarnation,
    };
    let r = c
        .call("drain", |mut c| {
            let r = r.clone();
            async move { c.drain(req(ctx, r)).await }
        })
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(wait);
    let mut state = NodeState::Draining;
    while wait > 0 && state == NodeState::Draining {
        let nodes = list_nodes(c, ctx).await?;
        state = nodes
            .iter()
            .find(|n| n.node_id == node)
            .map_or(NodeState::Unspecified, NodeInfo::state);
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if ctx.json {
        print_json(
            &json!({"node": node, "epoch": r.map_epoch, "extents_moved": r.extents_moved, "state": state_name(state)}),
        );
    } else {
        outln!(
            "draining {node}: {} extents move away (epoch {})",
            r.extents_moved,
            r.map_epoch
        );
        if wait > 0 {
            outln!("{node} is {}", state_name(state));
        }
    }
    let done = wait == 0 || state == NodeState::Drained;
    if !done {
        let map = get_map(c, ctx).await?;
        let nodes = list_nodes(c, ctx).await?;
        eprintln!(
            "pwctl: gave up after {wait} s: {}",
            drain_blocker(&map, &nodes, node, state)
        );
    }
    Ok(done)
}

/// `pwctl undrain NODE`.
pub(crate) async fn undrain(c: &mut Coord, ctx: &Ctx, node: &str) -> anyhow::Result<bool> {
    let r = DrainRequest {
        node_id: node.to_owned(),
        incarnation: 0,
    };
    let r = c
        .call("undrain", |mut c| {
            let r = r.clone();
            async move { c.undrain(req(ctx, r)).await }
        })
        .await?;
    if ctx.json {
        print_json(&json!({"node": node, "epoch": r.map_epoch}));
    } else {
        outln!("{node} takes its share again (epoch {})", r.map_epoch);
    }
    Ok(true)
}

/// Why `node` is not drained yet, in words: what it still owns or hands
/// off, and which nodes have not applied the epoch that would finish it.
fn drain_blocker(map: &OwnershipMap, nodes: &[NodeInfo], node: &str, state: NodeState) -> String {
    let Some(me) = nodes.iter().find(|n| n.node_id == node) else {
        return format!("{node} is no longer a member");
    };
    if state != NodeState::Draining {
        return format!("{node} is {}, not draining", state_name(state));
    }
    let owned = map.owner.iter().filter(|&&o| o == me.index).count();
    let handing: Vec<usize> = (0..map.previous_owner.len())
        .filter(|&i| map.previous_owner[i] == me.index)
        .collect();
    let mut waiting: Vec<String> = handing
        .iter()
        .filter_map(|&i| map.owner.get(i))
        .chain(std::iter::once(&me.index))
        .filter_map(|&idx| nodes.iter().find(|n| n.index == idx))
        .filter(|n| n.applied_epoch < map.epoch)
        .map(|n| {
            format!(
                "{} ({}, applied epoch {})",
                n.node_id,
                state_name(n.state()),
                n.applied_epoch
            )
        })
        .collect();
    waiting.sort();
    waiting.dedup();
    let mut why = format!(
        "{node} is still draining at epoch {}: it owns {owned} extents and hands off {}",
        map.epoch,
        handing.len()
    );
    if owned > 0 {
        why.push_str("; no alive node takes them (start or undrain one)");
    }
    if !waiting.is_empty() {
        why.push_str(&format!(
            "; the handoff waits for {} to apply epoch {} (a frozen or partitioned node \
             holds it until its lease runs out)",
            waiting.join(", "),
            map.epoch
        ));
    }
    why
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stuck_drain_says_what_it_waits_for() {
        let node = |id: &str, index, state: NodeState, applied| {
            let mut n = NodeInfo {
                node_id: id.into(),
                index,
                applied_epoch: applied,
                ..Default::default()
            };
            n.set_state(state);
            n
        };
        let nodes = vec![
            node("a", 1, NodeState::Draining, 7),
            node("b", 2, NodeState::Alive, 6),
        ];
        let map = OwnershipMap {
            epoch: 7,
            owner: vec![2, 2],
            previous_owner: vec![1, 0],
            ..Default::default()
        };
        let why = drain_blocker(&map, &nodes, "a", NodeState::Draining);
        assert!(why.contains("hands off 1"), "{why}");
        assert!(why.contains("b (alive, applied epoch 6)"), "{why}");
        assert!(!why.contains("a ("), "{why}");
    }
}
