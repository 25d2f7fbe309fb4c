//! `pwctl warm` and `pwctl evict`: the range is clipped to the file (with a
//! warning when it ran past its end), a warm larger than the cluster's cache
//! is warned about, and the range goes to the coordinator in chunks so a long
//! run shows progress on stderr (one line updated in place on a terminal, a
//! line per chunk otherwise) and no single call runs into the deadline.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};

use pagewire_proto::v1::{
    ByteRange, ClusterRangeRequest, ClusterRangeResponse, NodeRangeResult, NodeState, StatusRequest,
};

use serde_json::json;

use super::{Coord, Ctx, human_bytes, list_nodes, print_json, req, table};

/// Bytes asked of the coordinator per call (rounded to whole extents).
const CHUNK: u64 = 1 << 30;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Warm,
    Evict,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::Warm => "warm",
            Op::Evict => "evict",
        }
    }
}

/// What to tell the user about `offset + length` against the file and the
/// cache, before anything is sent: the clipped length and the warnings.
pub(crate) fn plan(
    op: Op,
    offset: u64,
    length: u64,
    file_size: u64,
    cache_bytes: u64,
    whole_file: bool,
) -> (u64, Vec<String>) {
    let mut warnings = Vec::new();
    if offset >= file_size {
        // The coordinator refuses it with a clear error.
        return (length, warnings);
    }
    let end = offset.saturating_add(length);
    let clipped = end.min(file_size) - offset;
    if end > file_size && !whole_file {
        warnings.push(format!(
            "the range ends at {} but the file is {} ({file_size} bytes): only {}..{} ({}) is {}ed",
            human_bytes(end),
            human_bytes(file_size),
            offset,
            file_size,
            human_bytes(clipped),
            op.name()
        ));
    }
    if op == Op::Warm && clipped > cache_bytes {
        warnings.push(format!(
            "warming {} but the alive nodes cache at most {} together: most of it will be \
             evicted again while it is warmed",
            human_bytes(clipped),
            human_bytes(cache_bytes)
        ));
    }
    (clipped, warnings)
}

/// Adds one chunk's per-node results to `total`.
fn merge(total: &mut BTreeMap<String, NodeRangeResult>, chunk: Vec<NodeRangeResult>) {
    for r in chunk {
        let t = total
            .entry(r.node_id.clone())
            .or_insert_with(|| NodeRangeResult {
                node_id: r.node_id.clone(),
                ..Default::default()
            });
        t.pages += r.pages;
        if !r.error.is_empty() && t.error.is_empty() {
            t.error = r.error;
        }
    }
}

/// One Warm or Evict call, on whichever coordinator leads.
async fn send(
    c: &mut Coord,
    ctx: &Ctx,
    op: Op,
    r: ClusterRangeRequest,
) -> anyhow::Result<ClusterRangeResponse> {
    c.call(op.name(), |mut c| async move {
        match op {
            Op::Warm => c.warm(req(ctx, r)).await,
            Op::Evict => c.evict(req(ctx, r)).await,
        }
    })
    .await
}

/// `pwctl warm RANGE` and `pwctl evict RANGE` (`range` parsed, `None`:
/// the whole file).
pub(crate) async fn warm_or_evict(
    c: &mut Coord,
    ctx: &Ctx,
    op: Op,
    range: Option<(u64, u64)>,
) -> anyhow::Result<bool> {
    let (offset, length) = range.unwrap_or((0, u64::MAX));
    let resp = run(c, ctx, op, offset, length).await?;
    Ok(print_range_result(op.name(), &resp, ctx.json))
}

pub(crate) async fn run(
    c: &mut Coord,
    ctx: &Ctx,
    op: Op,
    offset: u64,
    length: u64,
) -> anyhow::Result<ClusterRangeResponse> {
    let what = op.name();
    let status = c
        .call("status", |mut c| async move {
            c.status(req(ctx, StatusRequest {})).await
        })
        .await?;
    let cache_bytes = if op == Op::Warm {
        list_nodes(c, ctx)
            .await?
            .iter()
            .filter(|n| n.state() == NodeState::Alive)
            .map(|n| n.capacity_bytes)
            .sum()
    } else {
        u64::MAX
    };
    let whole_file = offset == 0 && length == u64::MAX;
    let (length, warnings) = plan(
        op,
        offset,
        length,
        status.file_size,
        cache_bytes,
        whole_file,
    );
    for w in warnings {
        eprintln!("pwctl: warning: {w}");
    }
    let extent = status.extent_size.max(1);
    let chunk = (CHUNK / extent).max(1) * extent;
    let chunks = length.div_ceil(chunk);
    if status.file_size == 0 || offset >= status.file_size || chunks <= 1 {
        let r = ClusterRangeRequest {
            range: Some(ByteRange { offset, length }),
        };
        return send(c, ctx, op, r).await;
    }
    let tty = std::io::stderr().is_terminal();
    let mut total = BTreeMap::new();
    let mut epoch = 0;
    let mut done = 0u64;
    while done < length {
        let n = chunk.min(length - done);
        let r = ClusterRangeRequest {
            range: Some(ByteRange {
                offset: offset + done,
                length: n,
            }),
        };
        let resp = match send(c, ctx, op, r).await {
            Ok(r) => r,
            Err(e) => {
                if tty {
                    eprintln!();
                }
                return Err(e.context(format!(
                    "after {} of {}",
                    human_bytes(done),
                    human_bytes(length)
                )));
            }
        };
        epoch = resp.map_epoch;
        merge(&mut total, resp.results);
        done += n;
        let line = format!(
            "pwctl: {what}: {} of {} ({}%)",
            human_bytes(done),
            human_bytes(length),
            done * 100 / length
        );
        let mut err = std::io::stderr().lock();
        let _ = if tty {
            write!(err, "\r{line}\x1b[K")
        } else {
            writeln!(err, "{line}")
        };
        let _ = err.flush();
    }
    if tty {
        eprintln!();
    }
    Ok(ClusterRangeResponse {
        map_epoch: epoch,
        results: total.into_values().collect(),
    })
}

fn print_range_result(what: &str, r: &ClusterRangeResponse, as_json: bool) -> bool {
    let ok = r.results.iter().all(|n| n.error.is_empty());
    if as_json {
        print_json(&json!({
            "operation": what, "epoch": r.map_epoch, "ok": ok,
            "nodes": r.results.iter().map(|n| json!({"node_id": n.node_id, "pages": n.pages, "error": n.error})).collect::<Vec<_>>(),
        }));
    } else {
        let rows: Vec<Vec<String>> = r
            .results
            .iter()
            .map(|n| {
                vec![
                    if n.node_id.is_empty() {
                        "-".into()
                    } else {
                        n.node_id.clone()
                    },
                    n.pages.to_string(),
                    if n.error.is_empty() {
                        "ok".into()
                    } else {
                        n.error.clone()
                    },
                ]
            })
            .collect();
        outln!("{what} at epoch {}", r.map_epoch);
        out!("{}", table(&["NODE", "PAGES", "RESULT"], &rows));
    }
    if !ok {
        eprintln!("pwctl: {what} failed on some nodes");
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_past_the_file_or_the_cache_are_warned_about() {
        let (len, w) = plan(Op::Warm, 0, 1 << 40, 1 << 30, 1 << 32, false);
        assert_eq!(len, 1 << 30);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("only 0..1073741824"), "{w:?}");
        let (len, w) = plan(Op::Warm, 0, u64::MAX, 1 << 30, 1 << 32, true);
        assert_eq!((len, w.len()), (1 << 30, 0), "{w:?}");
        let (_, w) = plan(Op::Warm, 0, 1 << 30, 1 << 30, 1 << 20, false);
        assert!(w.len() == 1 && w[0].contains("evicted again"), "{w:?}");
        let (_, w) = plan(Op::Evict, 0, 1 << 30, 1 << 30, 0, false);
        assert!(w.is_empty(), "{w:?}");
    }
}
