//! `pwctl status`: the cluster summary, and which coordinators run it: the
//! store they share, the role of the one that answered, the leader (or why
//! there is none), every coordinator with its role, and what is wrong with
//! the store when something is.

use pagewire_proto::v1::{CoordinatorRole, StatusRequest, StatusResponse};
use serde_json::{Value, json};

use super::policy::{policy_json, policy_text};
use super::{Coord, Ctx, human_bytes, human_ms, print_json, req, table};

/// `pwctl status`.
pub(crate) async fn run(c: &mut Coord, ctx: &Ctx) -> anyhow::Result<bool> {
    let (s, answered) = c
        .call_at("status", |mut c| async move {
            c.status(req(ctx, StatusRequest {})).await
        })
        .await?;
    print(&s, &answered, ctx.json);
    Ok(true)
}

/// A role in words.
pub(crate) fn role_name(r: CoordinatorRole) -> &'static str {
    match r {
        CoordinatorRole::Leader => "leader",
        CoordinatorRole::Follower => "follower",
        CoordinatorRole::Candidate => "candidate",
        CoordinatorRole::Unspecified => "unspecified",
    }
}

fn role_of(raw: i32) -> &'static str {
    role_name(CoordinatorRole::try_from(raw).unwrap_or(CoordinatorRole::Unspecified))
}

/// The leader in words: its address, or "none: WHY".
fn leader_text(s: &StatusResponse) -> String {
    match (s.leader.is_empty(), s.store_problem.is_empty()) {
        (false, _) => s.leader.clone(),
        (true, false) => format!("none: {}", s.store_problem),
        (true, true) => "none known (an election may be in progress)".into(),
    }
}

fn coordinators_text(s: &StatusResponse) -> String {
    if s.coordinators.is_empty() {
        return "-".into();
    }
    s.coordinators
        .iter()
        .map(|p| format!("{} ({})", p.address, role_of(p.role)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The JSON object of `pwctl status --json`.
pub(crate) fn to_json(s: &StatusResponse, answered: &str) -> Value {
    json!({
        "cluster": s.cluster_name, "epoch": s.epoch, "file_size": s.file_size,
        "extent_size": s.extent_size, "page_size": s.page_size,
        "extents": s.extent_count, "extents_unowned": s.extents_unowned,
        "extents_in_handoff": s.extents_in_handoff, "nodes_alive": s.nodes_alive,
        "nodes_total": s.nodes_total, "lease_ms": s.lease_ms,
        "policy": s.policy.as_ref().map(policy_json), "uptime_ms": s.uptime_ms,
        "version": s.version,
        "coordinator": answered,
        "role": role_name(s.role()),
        "store": s.store,
        "leader": (!s.leader.is_empty()).then_some(&s.leader),
        "coordinators": s.coordinators.iter().map(|p| json!({
            "address": p.address, "role": role_of(p.role),
        })).collect::<Vec<_>>(),
        "store_problem": (!s.store_problem.is_empty()).then_some(&s.store_problem),
    })
}

/// The rows of the human table.
pub(crate) fn rows(s: &StatusResponse, answered: &str) -> Vec<Vec<String>> {
    let p = s.policy.unwrap_or_default();
    let mut rows = vec![
        vec!["cluster".into(), s.cluster_name.clone()],
        vec![
            "coordinator".into(),
            format!(
                "{answered} ({}, v{}, up {})",
                role_name(s.role()),
                s.version,
                human_ms(s.uptime_ms)
            ),
        ],
        vec![
            "store".into(),
            if s.store.is_empty() {
                "-".into()
            } else {
                s.store.clone()
            },
        ],
        vec!["leader".into(), leader_text(s)],
        vec!["coordinators".into(), coordinators_text(s)],
    ];
    if !s.store_problem.is_empty() {
        rows.push(vec!["store problem".into(), s.store_problem.clone()]);
    }
    rows.extend([
        vec!["epoch".into(), s.epoch.to_string()],
        vec![
            "file".into(),
            format!("{} ({} bytes)", human_bytes(s.file_size), s.file_size),
        ],
        vec![
            "extents".into(),
            format!(
                "{} of {}, {} unowned, {} in handoff",
                s.extent_count,
                human_bytes(s.extent_size),
                s.extents_unowned,
                s.extents_in_handoff
            ),
        ],
        vec!["page size".into(), human_bytes(u64::from(s.page_size))],
        vec![
            "nodes".into(),
            format!(
                "{} holding a lease, {} members",
                s.nodes_alive, s.nodes_total
            ),
        ],
        vec!["lease".into(), human_ms(s.lease_ms)],
        vec!["policy".into(), policy_text(&p)],
    ]);
    rows
}

/// Prints `pwctl status` for the answer `s` of the coordinator at `answered`.
pub(crate) fn print(s: &StatusResponse, answered: &str, as_json: bool) {
    if as_json {
        print_json(&to_json(s, answered));
    } else {
        out!("{}", table(&[], &rows(s, answered)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagewire_proto::v1::CoordinatorPeer;

    fn status() -> StatusResponse {
        let mut s = StatusResponse {
            store: "etcd://e1:2379,e2:2379".into(),
            leader: "b:7400".into(),
            coordinators: vec![
                CoordinatorPeer {
                    address: "a:7400".into(),
                    role: CoordinatorRole::Follower as i32,
                },
                CoordinatorPeer {
                    address: "b:7400".into(),
                    role: CoordinatorRole::Leader as i32,
                },
            ],
            ..Default::default()
        };
        s.set_role(CoordinatorRole::Follower);
        s
    }

    fn row(rows: &[Vec<String>], key: &str) -> Option<String> {
        rows.iter().find(|r| r[0] == key).map(|r| r[1].clone())
    }

    #[test]
    fn status_names_the_leader_and_every_coordinator() {
        let s = status();
        let r = rows(&s, "a:7400");
        assert!(
            row(&r, "coordinator")
                .unwrap()
                .starts_with("a:7400 (follower,")
        );
        assert_eq!(row(&r, "store").unwrap(), "etcd://e1:2379,e2:2379");
        assert_eq!(row(&r, "leader").unwrap(), "b:7400");
        assert_eq!(
            row(&r, "coordinators").unwrap(),
            "a:7400 (follower), b:7400 (leader)"
        );
        assert_eq!(row(&r, "store problem"), None);
        let j = to_json(&s, "a:7400");
        assert_eq!(j["role"], "follower");
        assert_eq!(j["leader"], "b:7400");
        assert_eq!(j["coordinators"][1]["role"], "leader");
        assert!(j["store_problem"].is_null());
    }

    #[test]
    fn no_leader_says_why() {
        let mut s = status();
        s.leader.clear();
        s.set_role(CoordinatorRole::Candidate);
        s.store_problem = "etcd has no quorum: 2 of 3 members down for 12 s".into();
        let r = rows(&s, "a:7400");
        assert_eq!(
            row(&r, "leader").unwrap(),
            "none: etcd has no quorum: 2 of 3 members down for 12 s"
        );
        assert_eq!(row(&r, "store problem").unwrap(), s.store_problem);
        let j = to_json(&s, "a:7400");
        assert!(j["leader"].is_null());
        assert_eq!(j["store_problem"], s.store_problem.as_str());
        assert_eq!(j["role"], "candidate");
    }
}
