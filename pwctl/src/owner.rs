//! `pwctl owner OFFSET|pPAGE`: which node answers reads of a page and which
//! takes its writes, at the coordinator's current map.
//!
//! The answer is computed here from the expanded map with the client's own
//! routing rules ([`pagewire_client::cluster::read_owner`] and
//! [`pagewire_client::cluster::write_owner`]), so it is what a
//! `ClusterClient` would do at that epoch: reads go to the previous owner
//! while the page's extent is handed off, writes to the owner (which refuses
//! them until the handoff completes).

use pagewire_client::cluster::{read_owner, write_owner};
use pagewire_proto::state_name;
use pagewire_proto::v1::{MapNode, OwnershipMap};
use serde_json::{Value, json};

use super::{Coord, Ctx, Usage, get_map, human_bytes, parse_count, parse_size, print_json, table};

/// `pwctl owner WHERE` (`target` parsed).
pub(crate) async fn run(c: &mut Coord, ctx: &Ctx, target: Target) -> anyhow::Result<bool> {
    let map = get_map(c, ctx).await?;
    locate(&map, target)?.print(ctx.json);
    Ok(true)
}

/// What `owner` was asked about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// A byte offset in the file.
    Offset(u64),
    /// A page number.
    Page(u64),
}

/// Parses `OFFSET` (bytes, K/M/G/T suffixes) or `pPAGE` (a page number
/// after a `p`, K/M/G/T suffixes too).
pub(crate) fn parse_target(s: &str) -> Result<Target, String> {
    let s = s.trim();
    match s.strip_prefix(['p', 'P']) {
        Some(page) => Ok(Target::Page(parse_count(page)?)),
        None => Ok(Target::Offset(parse_size(s)?)),
    }
}

/// The page, its extent and its two owners under `map`, or a usage error
/// when the target is past the end of the file.
pub(crate) struct Answer<'a> {
    target: Target,
    map: &'a OwnershipMap,
    page: u64,
    extent: u64,
    read: Option<u32>,
    write: Option<u32>,
}

pub(crate) fn locate(map: &OwnershipMap, target: Target) -> anyhow::Result<Answer<'_>> {
    if map.page_size == 0 || map.extent_size == 0 || map.file_size == 0 {
        // Not a usage error: the cluster is not ready (no node registered).
        anyhow::bail!(
            "the cluster names no file yet (map epoch {}: no node has registered)",
            map.epoch
        );
    }
    let ps = u64::from(map.page_size);
    let pages = map.file_size.div_ceil(ps);
    let page = match target {
        Target::Offset(o) if o >= map.file_size => {
            return Err(Usage(format!(
                "offset {o} is past the end of the file ({} bytes, {})",
                map.file_size,
                human_bytes(map.file_size)
            ))
            .into());
        }
        Target::Offset(o) => o / ps,
        Target::Page(p) if p >= pages => {
            return Err(Usage(format!(
                "page {p} is past the end of the file ({pages} pages of {ps} bytes, pages 0..{pages})"
            ))
            .into());
        }
        Target::Page(p) => p,
    };
    Ok(Answer {
        target,
        map,
        page,
        extent: page * ps / map.extent_size,
        read: read_owner(map, page),
        write: write_owner(map, page),
    })
}

impl Answer<'_> {
    fn page_bytes(&self) -> (u64, u64) {
        let ps = u64::from(self.map.page_size);
        let start = self.page * ps;
        (start, (start + ps).min(self.map.file_size))
    }

    fn extent_bytes(&self) -> (u64, u64) {
        let start = self.extent * self.map.extent_size;
        (
            start,
            (start + self.map.extent_size).min(self.map.file_size),
        )
    }

    fn node(&self, index: Option<u32>) -> Option<&MapNode> {
        index.and_then(|i| self.map.nodes.iter().find(|n| n.index == i))
    }

    fn in_handoff(&self) -> bool {
        usize::try_from(self.extent)
            .ok()
            .and_then(|e| self.map.previous_owner.get(e))
            .is_some_and(|&p| p != 0)
    }

    fn node_json(&self, index: Option<u32>) -> Value {
        match (index, self.node(index)) {
            (None, _) => Value::Null,
            (Some(i), None) => {
                json!({"index": i, "node_id": null, "grpc_address": null, "state": null})
            }
            (Some(_), Some(n)) => json!({
                "index": n.index, "node_id": n.node_id, "grpc_address": n.grpc_address,
                "state": state_name(n.state()),
            }),
        }
    }

    fn node_row(&self, role: &str, index: Option<u32>) -> Vec<String> {
        match (index, self.node(index)) {
            (None, _) => vec![
                role.into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "none".into(),
            ],
            (Some(i), None) => vec![
                role.into(),
                "?".into(),
                i.to_string(),
                "-".into(),
                "not in the map's node list".into(),
            ],
            (Some(_), Some(n)) => vec![
                role.into(),
                n.node_id.clone(),
                n.index.to_string(),
                n.grpc_address.clone(),
                state_name(n.state()).into(),
            ],
        }
    }

    pub(crate) fn print(&self, as_json: bool) {
        let (ps, pe) = self.page_bytes();
        let (es, ee) = self.extent_bytes();
        if as_json {
            print_json(&json!({
                "offset": match self.target { Target::Offset(o) => Some(o), Target::Page(_) => None },
                "page": self.page,
                "page_bytes": {"start": ps, "end": pe},
                "extent": self.extent,
                "extent_bytes": {"start": es, "end": ee},
                "epoch": self.map.epoch,
                "page_size": self.map.page_size,
                "extent_size": self.map.extent_size,
                "file_size": self.map.file_size,
                "in_handoff": self.in_handoff(),
                "read_owner": self.node_json(self.read),
                "write_owner": self.node_json(self.write),
            }));
            return;
        }
        if let Target::Offset(o) = self.target {
            outln!("offset {o} is in page {}", self.page);
        }
        outln!(
            "page {} (bytes {ps}..{pe}), extent {} (bytes {es}..{ee}), map epoch {}",
            self.page,
            self.extent,
            self.map.epoch
        );
        out!(
            "{}",
            table(
                &["ROLE", "NODE", "INDEX", "ADDRESS", "STATE"],
                &[
                    self.node_row("reads", self.read),
                    self.node_row("writes", self.write),
                ]
            )
        );
        if self.in_handoff() {
            outln!(
                "extent {} is being handed off: the previous owner answers reads until the \
                 handoff completes; the new owner refuses writes until then",
                self.extent
            );
        }
        if self.read.is_none() {
            outln!("no node answers this page at this epoch (is any node alive?)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map() -> OwnershipMap {
        OwnershipMap {
            epoch: 9,
            file_size: 10 * 4096 - 100,
            extent_size: 4 * 4096,
            page_size: 4096,
            owner: vec![1, 2, 2],
            previous_owner: vec![0, 1, 0],
            nodes: vec![
                MapNode {
                    index: 1,
                    node_id: "a".into(),
                    grpc_address: "127.0.0.1:1".into(),
                    ..Default::default()
                },
                MapNode {
                    index: 2,
                    node_id: "b".into(),
                    grpc_address: "127.0.0.1:2".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn targets_parse_as_offsets_or_pages() {
        assert_eq!(parse_target("4096").unwrap(), Target::Offset(4096));
        assert_eq!(parse_target("1M").unwrap(), Target::Offset(1 << 20));
        assert_eq!(parse_target("p7").unwrap(), Target::Page(7));
        assert_eq!(parse_target("p2K").unwrap(), Target::Page(2048));
        assert!(parse_target("p").is_err());
        assert!(parse_target("p4KB").is_err(), "pages take no byte suffix");
        assert!(parse_target("x").is_err());
    }

    #[test]
    fn owners_follow_the_handoff_and_the_end_of_the_file_is_a_usage_error() {
        let m = map();
        let a = locate(&m, Target::Offset(5 * 4096 + 3)).unwrap();
        assert_eq!((a.page, a.extent), (5, 1));
        assert_eq!((a.read, a.write), (Some(1), Some(2)), "handoff 1 -> 2");
        assert!(a.in_handoff());
        let a = locate(&m, Target::Page(9)).unwrap();
        assert_eq!(
            (a.page, a.extent, a.read, a.write),
            (9, 2, Some(2), Some(2))
        );
        assert_eq!(
            a.page_bytes(),
            (9 * 4096, 10 * 4096 - 100),
            "partial last page"
        );
        let e = locate(&m, Target::Page(10)).err().unwrap();
        assert!(e.downcast_ref::<Usage>().is_some());
        assert!(e.to_string().contains("past the end"), "{e}");
        assert!(locate(&m, Target::Offset(10 * 4096 - 100)).is_err());
        let e = locate(&OwnershipMap::default(), Target::Page(0))
            .err()
            .unwrap();
        assert!(
            e.downcast_ref::<Usage>().is_none(),
            "not ready is not a usage error"
        );
    }
}
