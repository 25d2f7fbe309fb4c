//! The rows of `pagewire-bench mount` (medians of a cell's runs), their
//! human table, and the targets checked against them.

use serde::Serialize;

use super::fio::{Job, Pattern};
use super::{Sample, Via, WarmPass};
use crate::report::{self, median};

#[derive(Clone, Debug, Serialize)]
pub(super) struct Row {
    pub(super) path: &'static str,
    pub(super) transport: &'static str,
    pub(super) job: String,
    pub(super) verified: bool,
    pub(super) iops: f64,
    pub(super) mib_per_sec: f64,
    pub(super) p50_us: f64,
    pub(super) p99_us: f64,
    /// Reads that failed verification, over every run (`None`: not verified).
    pub(super) wrong_reads: Option<u64>,
    pub(super) fio_cores: f64,
    pub(super) fuse_cores: Option<f64>,
    pub(super) node_cores: Option<f64>,
    pub(super) runs: Vec<Sample>,
}

#[derive(Clone, Debug, Serialize)]
pub(super) struct Target {
    pub(super) target: String,
    pub(super) detail: String,
    /// `None`: a path it needs was not measured.
    pub(super) met: Option<bool>,
}

pub(super) fn row(job: Job, via: Via, runs: Vec<Sample>) -> Row {
    let med = |f: &dyn Fn(&Sample) -> f64| median(runs.iter().map(f).collect());
    let med_opt = |f: &dyn Fn(&Sample) -> Option<f64>| {
        let xs: Vec<f64> = runs.iter().filter_map(f).collect();
        (!xs.is_empty()).then(|| median(xs))
    };
    Row {
        path: via.path(),
        transport: via.transport(),
        job: job.name(),
        verified: via.verify(),
        iops: med(&|s| s.fio.iops),
        mib_per_sec: med(&|s| s.fio.bytes_per_sec / 1048576.0),
        p50_us: med(&|s| s.fio.p50_us),
        p99_us: med(&|s| s.fio.p99_us),
        wrong_reads: via
            .verify()
            .then(|| runs.iter().map(|s| s.fio.wrong_reads).sum()),
        fio_cores: med(&|s| s.fio_cores),
        fuse_cores: med_opt(&|s| s.fuse_cores),
        node_cores: med_opt(&|s| s.node_cores),
        runs,
    }
}

pub(super) fn table(rows: &[Row]) -> String {
    let opt = |x: Option<f64>| x.map_or("-".to_owned(), |v| format!("{v:.2}"));
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.path.to_owned(),
                r.transport.to_owned(),
                r.job.clone(),
                if r.verified { "crc32c" } else { "no" }.to_owned(),
                report::si(r.iops),
                format!("{:.1}", r.mib_per_sec),
                format!("{:.1}", r.p50_us),
                format!("{:.1}", r.p99_us),
                r.wrong_reads.map_or("n/a".to_owned(), |w| w.to_string()),
                format!("{:.2}", r.fio_cores),
                opt(r.fuse_cores),
                opt(r.node_cores),
            ]
        })
        .collect();
    let mut s = report::table(
        &[
            "path",
            "transport",
            "job",
            "verify",
            "IOPS",
            "MiB/s",
            "p50 µs",
            "p99 µs",
            "wrong",
            "fio cores",
            "fuse cores",
            "node cores",
        ],
        &body,
    );
    s += "medians; qdN = N psync jobs; p50/p99: fio's completion latency; wrong: reads that \
          failed crc32c verification, summed over the runs (0 = 0 wrong bytes; n/a: not verified); \
          cores: CPU time / wall time of fio, of the FUSE server (pagewire-mount, or this process \
          for zero-fuse) and of the 3 nodes\n";
    s
}

fn find(rows: &[Row], job: &str, path: &str, transport: &str, verified: bool) -> Option<Row> {
    rows.iter()
        .find(|r| {
            r.job == job && r.path == path && r.transport == transport && r.verified == verified
        })
        .cloned()
}

/// The targets, from the medians.
pub(super) fn targets(rows: &[Row], warm: &[WarmPass]) -> Vec<Target> {
    let mut out = Vec::new();
    for (pattern, limit, what) in [
        (
            Pattern::Rand4k,
            1.5,
            "4 KiB random reads over shm within 1.5x of the do-nothing FUSE floor (IOPS)",
        ),
        (
            Pattern::Seq1m,
            2.0,
            "1 MiB sequential reads over shm within 2x of the do-nothing FUSE floor (MiB/s)",
        ),
    ] {
        for job in Job::ALL.iter().filter(|j| j.pattern == pattern) {
            let name = job.name();
            let zero = find(rows, &name, "zero-fuse", "-", false);
            let shm = find(rows, &name, "mount", "shm", true);
            let raw = find(rows, &name, "mount", "shm", false);
            let value = |r: &Row| match pattern {
                Pattern::Rand4k => r.iops,
                Pattern::Seq1m => r.mib_per_sec,
            };
            let fmt = |x: f64| match pattern {
                Pattern::Rand4k => format!("{} IOPS", report::si(x)),
                Pattern::Seq1m => format!("{x:.0} MiB/s"),
            };
            let t = match (&zero, &shm) {
                (Some(z), Some(s)) => {
                    let ratio = value(z) / value(s).max(f64::MIN_POSITIVE);
                    let mut detail = format!(
                        "{name}: zero FS {} / shm {} = {ratio:.2}x",
                        fmt(value(z)),
                        fmt(value(s))
                    );
                    if let Some(r) = &raw {
                        detail += &format!(
                            " (shm without fio's verification: {} = {:.2}x)",
                            fmt(value(r)),
                            value(z) / value(r).max(f64::MIN_POSITIVE)
                        );
                    }
                    Target {
                        target: what.to_owned(),
                        detail,
                        met: Some(ratio <= limit),
                    }
                }
                _ => Target {
                    target: what.to_owned(),
                    detail: format!("{name}: needs the shm and zero paths"),
                    met: None,
                },
            };
            out.push(t);
        }
    }
    let verified: Vec<&Row> = rows.iter().filter(|r| r.verified).collect();
    let wrong: u64 = verified.iter().filter_map(|r| r.wrong_reads).sum();
    let warm_wrong: u64 = warm.iter().map(|w| w.wrong_bytes).sum();
    let reads: u64 = verified
        .iter()
        .flat_map(|r| r.runs.iter())
        .map(|s| s.fio.reads)
        .sum();
    out.push(Target {
        target: "0 wrong bytes in every fio verification".into(),
        detail: format!(
            "{wrong} wrong of {reads} verified reads in {} cells; warm passes: {warm_wrong} wrong bytes",
            verified.len()
        ),
        met: (!verified.is_empty()).then_some(wrong == 0 && warm_wrong == 0),
    });
    out
}
