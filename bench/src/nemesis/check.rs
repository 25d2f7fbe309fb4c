//! The history checker: per page, single-register linearizability.
//!
//! **What a page's history is.** Each page has one writer (one thread of
//! one worker writes it, one write at a time), and each write puts a new content generation in the
//! page (the previous one plus one), so a generation names one write and
//! the writes' invocation order is their generation order. Generation 0 is
//! the file as generated: a write acknowledged before everything.
//!
//! **What it checks.** A read must return the latest write acknowledged
//! before the read began, or a write concurrent with it. Three direct
//! checks name the usual ways to break that, with the operations that show
//! it:
//! - *future read*: the read returned a write that began after the read
//!   completed;
//! - *stale read*: the read returned write `a`, but a later write `b` (after
//!   `a` in every linearization: `a` was acknowledged before `b` began) was
//!   acknowledged before the read began;
//! - *new-old inversion*: a read that began after another read completed
//!   returned an older write than that one did;
//! - *unknown* / *corrupt*: a generation nobody wrote, bytes that are no
//!   generation of the page.
//!
//! A failed write (an error or a timeout: it may or may not have taken
//! effect) may be linearized anywhere after its invocation, or not at all;
//! the direct checks only name orders that hold whatever it did. The
//! complete decision is Gibbons and Korach's zone test for registers whose
//! writes have distinct values (also in Golab, Li and Shah, "Analyzing
//! consistency properties for fun and profit", PODC 2011): a write and the
//! reads of it form a cluster; with `f` the earliest completion and `s` the
//! latest invocation in it, the cluster's zone is forward `[f, s]` when
//! `f < s`, backward `[s, f]` otherwise. The page's history is linearizable
//! iff no read returns a write that began after it completed, no two
//! forward zones overlap, and no backward zone lies inside a forward one.
//! A failed write with no reads is left out; one with reads gets the
//! completion time +∞. The zone test runs after the direct checks and
//! reports what they did not name ("not linearizable").

use std::collections::HashMap;

use super::history::Op;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    Corrupt,
    Unknown,
    FutureRead,
    StaleRead,
    NewOldInversion,
    NotLinearizable,
    /// Two writes of one generation: the history breaks its own rules.
    Malformed,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Corrupt => "corrupt read",
            Kind::Unknown => "read of a generation never written",
            Kind::FutureRead => "future read",
            Kind::StaleRead => "stale read",
            Kind::NewOldInversion => "new-old inversion",
            Kind::NotLinearizable => "not linearizable",
            Kind::Malformed => "malformed history",
        }
    }
}

/// One violation: what, on which page, and the operations that show it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Violation {
    pub kind: Kind,
    pub page: u64,
    pub message: String,
    /// The operations named in `message` (indices into the page's ops as
    /// handed to [`check_page`]).
    #[serde(skip)]
    pub witnesses: Vec<Op>,
}

/// The result of checking a whole history.
#[derive(Debug, Default, serde::Serialize)]
pub struct Outcome {
    pub pages: u64,
    pub pages_written: u64,
    pub reads_checked: u64,
    pub writes: u64,
    pub writes_failed: u64,
    /// The first violation of each page that has one.
    pub violations: Vec<Violation>,
}

const INF: u64 = u64::MAX;

/// A write of the page: generation, invocation, completion (INF: failed).
#[derive(Clone, Copy, Debug)]
struct W {
    generation: u64,
    inv: u64,
    resp: u64,
    ok: bool,
    op: Option<Op>,
}

fn ms(t0: u64, t: u64) -> String {
    if t == INF {
        "∞".into()
    } else {
        format!("{:.3} ms", t.saturating_sub(t0) as f64 / 1e6)
    }
}

/// Checks every page of `ops` (all processes' records together); `t0` is
/// the run's start (times in messages are relative to it).
pub fn check(ops: &[Op], t0: u64) -> Outcome {
    let mut by_page: HashMap<u64, Vec<Op>> = HashMap::new();
    for op in ops {
        by_page.entry(op.page).or_default().push(*op);
    }
    let mut out = Outcome::default();
    let mut pages: Vec<_> = by_page.into_iter().collect();
    pages.sort_unstable_by_key(|(p, _)| *p);
    for (page, v) in pages {
        out.pages += 1;
        let writes = v.iter().filter(|o| o.write).count() as u64;
        if writes > 0 {
            out.pages_written += 1;
        }
        out.writes += writes;
        out.writes_failed += v.iter().filter(|o| o.write && !o.ok).count() as u64;
        out.reads_checked += v.iter().filter(|o| !o.write && o.ok).count() as u64;
        if let Some(x) = check_page(page, &v, t0) {
            out.violations.push(x);
        }
    }
    out
}

/// Checks one page's operations; the first violation found, if any.
pub fn check_page(page: u64, ops: &[Op], t0: u64) -> Option<Violation> {
    let viol = |kind: Kind, message: String, witnesses: Vec<Op>| {
        Some(Violation {
            kind,
            page,
            message,
            witnesses,
        })
    };
    // The writes in generation order, generation 0 first.
    let mut writes = vec![W {
        generation: 0,
        inv: 0,
        resp: 0,
        ok: true,
        op: None,
    }];
    for o in ops.iter().filter(|o| o.page == page && o.write) {
        writes.push(W {
            generation: o.generation,
            inv: o.inv_ns,
            resp: if o.ok { o.resp_ns } else { INF },
            ok: o.ok,
            op: Some(*o),
        });
    }
    writes.sort_unstable_by_key(|w| w.generation);
    for pair in writes.windows(2) {
        if pair[0].generation == pair[1].generation {
            return viol(
                Kind::Malformed,
                format!("two writes of generation {}", pair[0].generation),
                pair.iter().filter_map(|w| w.op).collect(),
            );
        }
    }
    let index: HashMap<u64, usize> = writes
        .iter()
        .enumerate()
        .map(|(i, w)| (w.generation, i))
        .collect();
    let mut reads: Vec<Op> = ops
        .iter()
        .filter(|o| o.page == page && !o.write && o.ok)
        .copied()
        .collect();
    reads.sort_unstable_by_key(|r| r.resp_ns);

    // Corrupt, unknown and future reads.
    for r in &reads {
        if r.corrupt {
            return viol(
                Kind::Corrupt,
                format!(
                    "a read ({} .. {}) returned bytes that are no generation of page {page}",
                    ms(t0, r.inv_ns),
                    ms(t0, r.resp_ns)
                ),
                vec![*r],
            );
        }
        let Some(&i) = index.get(&r.generation) else {
            return viol(
                Kind::Unknown,
                format!(
                    "a read ({} .. {}) returned generation {}, which no write wrote",
                    ms(t0, r.inv_ns),
                    ms(t0, r.resp_ns),
                    r.generation
                ),
                vec![*r],
            );
        };
        let w = writes[i];
        if w.inv > r.resp_ns {
            return viol(
                Kind::FutureRead,
                format!(
                    "a read ({} .. {}) returned generation {}, whose write began later ({})",
                    ms(t0, r.inv_ns),
                    ms(t0, r.resp_ns),
                    r.generation,
                    ms(t0, w.inv)
                ),
                [*r].into_iter().chain(w.op).collect(),
            );
        }
    }

    // Stale reads: the latest acknowledged write before the read began is
    // after the one it returned in every linearization (the returned one
    // was acknowledged: the single writer began the next only after it).
    // Acknowledged writes complete in generation order.
    let acked: Vec<usize> = (0..writes.len()).filter(|&i| writes[i].ok).collect();
    for r in &reads {
        let i = index[&r.generation];
        if !writes[i].ok {
            continue;
        }
        let k = acked.partition_point(|&j| writes[j].resp < r.inv_ns);
        if k == 0 {
            continue;
        }
        let j = acked[k - 1];
        if j > i {
            return viol(
                Kind::StaleRead,
                format!(
                    "a read ({} .. {}) returned generation {}, but generation {} was acknowledged \
                     before it began ({} .. {})",
                    ms(t0, r.inv_ns),
                    ms(t0, r.resp_ns),
                    r.generation,
                    writes[j].generation,
                    ms(t0, writes[j].inv),
                    ms(t0, writes[j].resp)
                ),
                [*r].into_iter().chain(writes[j].op).collect(),
            );
        }
    }

    // New-old inversions: reads by completion; the newest write any read
    // completed before `r` began returned, against what `r` returned.
    let mut best: Vec<usize> = Vec::with_capacity(reads.len());
    for (n, r) in reads.iter().enumerate() {
        let prev = best.last().copied();
        best.push(match prev {
            Some(p) if reads[p].generation >= r.generation => p,
            _ => n,
        });
    }
    for r in &reads {
        let i = index[&r.generation];
        if !writes[i].ok {
            continue;
        }
        let k = reads.partition_point(|x| x.resp_ns < r.inv_ns);
        if k == 0 {
            continue;
        }
        let e = reads[best[k - 1]];
        if e.generation > r.generation {
            return viol(
                Kind::NewOldInversion,
                format!(
                    "a read ({} .. {}) returned generation {}, but a read that completed before \
                     it began ({} .. {}) returned generation {}",
                    ms(t0, r.inv_ns),
                    ms(t0, r.resp_ns),
                    r.generation,
                    ms(t0, e.inv_ns),
                    ms(t0, e.resp_ns),
                    e.generation
                ),
                vec![e, *r],
            );
        }
    }

    zones(page, &writes, &reads, t0)
}

/// The zone test (see the module header).
fn zones(page: u64, writes: &[W], reads: &[Op], t0: u64) -> Option<Violation> {
    // (first completion, last invocation) of each cluster, with its write.
    let mut f = vec![INF; writes.len()];
    let mut s = vec![0u64; writes.len()];
    let mut has_read = vec![false; writes.len()];
    let index: HashMap<u64, usize> = writes
        .iter()
        .enumerate()
        .map(|(i, w)| (w.generation, i))
        .collect();
    for r in reads {
        let i = index[&r.generation];
        has_read[i] = true;
        f[i] = f[i].min(r.resp_ns);
        s[i] = s[i].max(r.inv_ns);
    }
    let mut forward = Vec::new();
    let mut backward = Vec::new();
    for (i, w) in writes.iter().enumerate() {
        if !w.ok && !has_read[i] {
            continue;
        }
        f[i] = f[i].min(w.resp);
        s[i] = s[i].max(w.inv);
        if f[i] < s[i] {
            forward.push((f[i], s[i], i));
        } else {
            backward.push((s[i], f[i], i));
        }
    }
    forward.sort_unstable();
    let say = |a: usize, b: usize, what: &str| {
        let d = |i: usize| {
            format!(
                "generation {} (write {} .. {}, {} reads)",
                writes[i].generation,
                ms(t0, writes[i].inv),
                ms(t0, writes[i].resp),
                reads
                    .iter()
                    .filter(|r| r.generation == writes[i].generation)
                    .count()
            )
        };
        Some(Violation {
            kind: Kind::NotLinearizable,
            page,
            message: format!("{} and {} {what}", d(a), d(b)),
            witnesses: [writes[a].op, writes[b].op].into_iter().flatten().collect(),
        })
    };
    for p in forward.windows(2) {
        if p[1].0 < p[0].1 {
            return say(
                p[0].2,
                p[1].2,
                "cannot both be linearized: each has a read after the other's first completion",
            );
        }
    }
    for &(bs, bf, b) in &backward {
        let k = forward.partition_point(|z| z.0 < bs);
        if k > 0 {
            let (ff, fs, a) = forward[k - 1];
            if ff < bs && bf < fs {
                return say(
                    a,
                    b,
                    "cannot both be linearized: the second lies wholly between the first's \
                     earliest completion and latest invocation",
                );
            }
        }
    }
    None
}

/// The page's operations in the window around a violation's witnesses
/// (`margin_ns` either side), in invocation order, at most `max` lines,
/// each line marked `>>` when it is a witness.
pub fn window(ops: &[Op], v: &Violation, margin_ns: u64, max: usize, t0: u64) -> Vec<String> {
    let lo = v
        .witnesses
        .iter()
        .map(|o| o.inv_ns)
        .min()
        .unwrap_or(0)
        .saturating_sub(margin_ns);
    let hi = v
        .witnesses
        .iter()
        .map(|o| o.resp_ns)
        .max()
        .unwrap_or(INF)
        .saturating_add(margin_ns);
    let mut w: Vec<&Op> = ops
        .iter()
        .filter(|o| o.page == v.page && o.resp_ns >= lo && o.inv_ns <= hi)
        .collect();
    w.sort_unstable_by_key(|o| (o.inv_ns, o.resp_ns));
    // Keep the witnesses and the operations nearest them.
    if w.len() > max {
        let keep: Vec<usize> = (0..w.len())
            .filter(|&i| v.witnesses.contains(w[i]))
            .collect();
        let centre = keep.first().copied().unwrap_or(0);
        let start = centre.saturating_sub(max / 2).min(w.len() - max);
        w = w[start..start + max].to_vec();
    }
    w.iter()
        .map(|o| {
            format!(
                "{} p{:<3} {:<5} gen {:<6} {:>12} .. {:<12} {}",
                if v.witnesses.contains(o) { ">>" } else { "  " },
                o.process,
                if o.write { "write" } else { "read" },
                o.generation,
                ms(t0, o.inv_ns),
                if o.write && !o.ok {
                    "(failed)".to_owned()
                } else {
                    ms(t0, o.resp_ns)
                },
                if o.corrupt { "corrupt" } else { "" }
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 7;

    fn w(generation: u64, inv: u64, resp: u64) -> Op {
        Op {
            write: true,
            ok: true,
            corrupt: false,
            page: P,
            generation,
            inv_ns: inv,
            resp_ns: resp,
            process: 0,
        }
    }

    fn wf(generation: u64, inv: u64, resp: u64) -> Op {
        Op {
            ok: false,
            ..w(generation, inv, resp)
        }
    }

    fn r(generation: u64, inv: u64, resp: u64) -> Op {
        Op {
            write: false,
            process: 1,
            ..w(generation, inv, resp)
        }
    }

    fn kind(ops: &[Op]) -> Option<Kind> {
        check_page(P, ops, 0).map(|v| v.kind)
    }

    #[test]
    fn linearizable_histories_pass() {
        // Sequential: each read sees the last acknowledged write.
        assert_eq!(
            kind(&[r(0, 1, 2), w(1, 3, 4), r(1, 5, 6), w(2, 7, 8), r(2, 9, 10)]),
            None
        );
        // Reads concurrent with a write may see either value, in an order
        // consistent with one point for the write.
        assert_eq!(
            kind(&[w(1, 10, 20), r(0, 11, 12), r(1, 13, 14), r(1, 15, 25)]),
            None
        );
        // Two overlapping reads seeing old and new: fine.
        assert_eq!(kind(&[w(1, 10, 20), r(1, 11, 15), r(0, 12, 16)]), None);
        // A failed write may have taken effect, late...
        assert_eq!(
            kind(&[w(1, 1, 2), wf(2, 3, 4), r(2, 100, 101), r(2, 102, 103)]),
            None
        );
        // ... or never.
        assert_eq!(kind(&[w(1, 1, 2), wf(2, 3, 4), r(1, 100, 101)]), None);
        // A failed write that lands after the next acknowledged one.
        assert_eq!(
            kind(&[wf(1, 1, 2), w(2, 3, 4), r(2, 5, 6), r(1, 7, 8), r(1, 9, 10)]),
            None
        );
        // Nothing written: every read of generation 0 passes.
        assert_eq!(kind(&[r(0, 1, 2), r(0, 1, 2), r(0, 5, 9)]), None);
    }

    #[test]
    fn a_stale_read_fails() {
        let v = check_page(P, &[w(1, 1, 2), w(2, 3, 4), r(1, 5, 6)], 0).unwrap();
        assert_eq!(v.kind, Kind::StaleRead);
        assert!(
            v.message.contains("generation 2 was acknowledged"),
            "{}",
            v.message
        );
        // The initial content after an acknowledged write.
        assert_eq!(kind(&[w(1, 1, 2), r(0, 3, 4)]), Some(Kind::StaleRead));
    }

    #[test]
    fn a_future_read_fails() {
        assert_eq!(kind(&[r(1, 1, 2), w(1, 3, 4)]), Some(Kind::FutureRead));
        // Even when that write failed.
        assert_eq!(kind(&[r(1, 1, 2), wf(1, 3, 4)]), Some(Kind::FutureRead));
    }

    #[test]
    fn a_new_old_inversion_fails() {
        // Both reads concurrent with the write; the second began after the
        // first completed and saw the older value.
        let v = check_page(P, &[w(1, 1, 100), r(1, 2, 3), r(0, 4, 5)], 0).unwrap();
        assert_eq!(v.kind, Kind::NewOldInversion);
        assert_eq!(v.witnesses.len(), 2);
    }

    #[test]
    fn unknown_and_corrupt_reads_fail() {
        assert_eq!(kind(&[w(1, 1, 2), r(5, 3, 4)]), Some(Kind::Unknown));
        let mut c = r(0, 1, 2);
        c.corrupt = true;
        assert_eq!(kind(&[c]), Some(Kind::Corrupt));
        assert_eq!(kind(&[w(1, 1, 2), w(1, 3, 4)]), Some(Kind::Malformed));
    }

    #[test]
    fn the_zone_test_catches_what_the_direct_checks_cannot_name() {
        // Failed write 1 read, then acknowledged write 2 read, then 1 again
        // by a read that began after a read of 2 completed: 1 can float
        // after 2 (it failed), but then the read of 2 at 5..6 and the read
        // of 1 at 3..4 put 1 before 2 as well.
        let ops = [wf(1, 1, 2), r(1, 3, 4), w(2, 5, 6), r(2, 7, 8), r(1, 9, 10)];
        assert_eq!(kind(&ops), Some(Kind::NotLinearizable));
    }

    #[test]
    fn check_sums_and_windows() {
        let ops = [w(1, 1, 2), w(2, 3, 4), r(1, 5, 6), r(2, 7, 8)];
        let o = check(&ops, 0);
        assert_eq!(o.pages, 1);
        assert_eq!(o.writes, 2);
        assert_eq!(o.reads_checked, 2);
        assert_eq!(o.violations.len(), 1);
        let lines = window(&ops, &o.violations[0], 10, 40, 0);
        assert_eq!(lines.len(), 4);
        assert_eq!(lines.iter().filter(|l| l.starts_with(">>")).count(), 2);
    }
}
