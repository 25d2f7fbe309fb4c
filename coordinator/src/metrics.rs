//! The coordinator's Prometheus metrics (served as text on `/metrics`).

use std::sync::{Arc, Mutex};

use pagewire_proto::auth::Refusals;
use pagewire_proto::v1::{NodeState, OwnershipMap};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::error::state_name;

type Labels = Vec<(String, String)>;

pub struct Metrics {
    registry: Registry,
    epoch: Gauge,
    extents: Gauge,
    extents_in_handoff: Gauge,
    extents_unowned: Gauge,
    extents_owned: Family<Labels, Gauge>,
    nodes: Family<Labels, Gauge>,
    pub(crate) registrations: Counter,
    pub(crate) heartbeats: Counter,
    pub(crate) deaths: Counter,
    pub(crate) map_changes: Counter,
    pub(crate) rpc_errors: Family<Labels, Counter>,
    pub(crate) elections: Counter,
    pub(crate) leader_changes: Counter,
    pub(crate) leading: Gauge,
    pub(crate) store_save_seconds: Histogram,
    pub(crate) store_errors: Counter,
    /// Label sets set last time, to zero the ones that went away.
    last_owned: Mutex<Vec<Labels>>,
    /// gRPC calls the token check refused (the check counts into it).
    pub(crate) refusals: Arc<Refusals>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("pagewire_coordinator");
        let m = Self {
            epoch: Gauge::default(),
            extents: Gauge::default(),
            extents_in_handoff: Gauge::default(),
            extents_unowned: Gauge::default(),
            extents_owned: Family::default(),
            nodes: Family::default(),
            registrations: Counter::default(),
            heartbeats: Counter::default(),
            deaths: Counter::default(),
            map_changes: Counter::default(),
            rpc_errors: Family::default(),
            elections: Counter::default(),
            leader_changes: Counter::default(),
            leading: Gauge::default(),
            store_save_seconds: Histogram::new([
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
            ]),
            store_errors: Counter::default(),
            last_owned: Mutex::new(Vec::new()),
            refusals: Arc::default(),
            registry: Registry::default(),
        };
        registry.register_collector(m.refusals.clone().collector());
        registry.register(
            "map_epoch",
            "Epoch of the current ownership map",
            m.epoch.clone(),
        );
        registry.register("extents", "Extents the file is cut into", m.extents.clone());
        registry.register(
            "extents_in_handoff",
            "Extents whose previous owner still serves them",
            m.extents_in_handoff.clone(),
        );
        registry.register(
            "extents_unowned",
            "Extents no node in the map owns (readers fall back to the backing file)",
            m.extents_unowned.clone(),
        );
        registry.register(
            "extents_owned",
            "Extents owned by each node",
            m.extents_owned.clone(),
        );
        registry.register("nodes", "Members by state", m.nodes.clone());
        registry.register(
            "registrations",
            "Node registrations",
            m.registrations.clone(),
        );
        registry.register("heartbeats", "Heartbeats accepted", m.heartbeats.clone());
        registry.register(
            "nodes_declared_dead",
            "Nodes declared dead after missing their lease",
            m.deaths.clone(),
        );
        registry.register(
            "map_changes",
            "New ownership map epochs published",
            m.map_changes.clone(),
        );
        registry.register(
            "rpc_errors",
            "gRPC calls that failed, by method and code",
            m.rpc_errors.clone(),
        );
        registry.register(
            "elections",
            "Elections this coordinator won (etcd store)",
            m.elections.clone(),
        );
        registry.register(
            "leader_changes",
            "Changes of the leading coordinator seen by this one",
            m.leader_changes.clone(),
        );
        registry.register(
            "leading",
            "1 while this coordinator leads, else 0",
            m.leading.clone(),
        );
        registry.register(
            "store_save_seconds",
            "Time to save the cluster state in the store",
            m.store_save_seconds.clone(),
        );
        registry.register(
            "store_errors",
            "Saves the store refused (fenced off) or did not answer",
            m.store_errors.clone(),
        );
        Self { registry, ..m }
    }

    pub(crate) fn observe_map(&self, map: &OwnershipMap, members: &[(String, NodeState)]) {
        self.epoch.set(i64::try_from(map.epoch).unwrap_or(i64::MAX));
        self.extents
            .set(i64::try_from(map.owner.len()).unwrap_or(i64::MAX));
        self.extents_in_handoff.set(
            i64::try_from(map.previous_owner.iter().filter(|&&p| p != 0).count()).unwrap_or(0),
        );
        // One pass over the owners (not one per node: O(extents × nodes)
        // at every epoch for a big cluster).
        let mut counts = pagewire_proto::rendezvous::NodeTable::new(0usize, std::iter::empty());
        for &o in &map.owner {
            *counts.get_mut(o) += 1;
        }
        let owned: usize = map.nodes.iter().map(|n| counts.get(n.index)).sum();
        self.extents_unowned
            .set(i64::try_from(map.owner.len().saturating_sub(owned)).unwrap_or(i64::MAX));
        let mut labels_now = Vec::new();
        for n in &map.nodes {
            let count = counts.get(n.index);
            let l = vec![("node".to_owned(), n.node_id.clone())];
            self.extents_owned
                .get_or_create(&l)
                .set(i64::try_from(count).unwrap_or(i64::MAX));
            labels_now.push(l);
        }
        if let Ok(mut last) = self.last_owned.lock() {
            let now: std::collections::HashSet<&Vec<(String, String)>> =
                labels_now.iter().collect();
            for l in last.iter().filter(|l| !now.contains(l)) {
                self.extents_owned.remove(l);
            }
            *last = labels_now;
        }
        for s in [
            NodeState::Alive,
            NodeState::Draining,
            NodeState::Drained,
            NodeState::Dead,
            NodeState::Left,
        ] {
            let n = members.iter().filter(|(_, st)| *st == s).count();
            self.nodes
                .get_or_create(&vec![("state".to_owned(), state_name(s).to_owned())])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    pub(crate) fn rpc_error(&self, method: &str, code: tonic::Code) {
        self.rpc_errors
            .get_or_create(&vec![
                ("method".to_owned(), method.to_owned()),
                ("code".to_owned(), format!("{code:?}")),
            ])
            .inc();
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use pagewire_proto::v1::{MapNode, NodeState, OwnershipMap};

    use super::Metrics;

    /// Issue 21: the unowned extents were derived in the dashboard; the
    /// coordinator exports them.
    #[test]
    fn unowned_extents_are_a_gauge() {
        let m = Metrics::new();
        let map = OwnershipMap {
            epoch: 3,
            // Extent 1 has no owner, extent 3 names a node not in the map.
            owner: vec![1, 0, 1, 2],
            nodes: vec![MapNode {
                index: 1,
                node_id: "a".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        m.observe_map(&map, &[("a".into(), NodeState::Alive)]);
        let text = m.render();
        assert!(
            text.lines()
                .any(|l| l == "pagewire_coordinator_extents_unowned 2"),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l == "pagewire_coordinator_extents_owned{node=\"a\"} 2"),
            "{text}"
        );
    }
}
