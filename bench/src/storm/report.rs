//! The storm's report: a row per phase and path, a row per fault event
//! (recovery time, throughput dip), the timeline, the plots, and the
//! verdict (any wrong or stale read fails the run).

use hdrhistogram::Histogram;
use serde::Serialize;

use super::faults::FaultKind;
use super::reader::Final;
use super::{Args, BIN_MS, Phase, Summary};

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub phase: &'static str,
    pub path: String,
    pub transport: String,
    pub clients: usize,
    pub secs: f64,
    pub pages: u64,
    pub pages_per_sec: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub wrong_reads: u64,
    pub stale_reads: u64,
    pub errors: u64,
    pub retries: u64,
    pub validation_failures: u64,
    pub fallbacks: u64,
    pub one_sided: u64,
    /// Of `one_sided`, the reads over shm, verbs and tcp.
    pub one_sided_shm: u64,
    pub one_sided_verbs: u64,
    pub one_sided_tcp: u64,
    /// One-sided hits / (hits + FaultIn fallbacks): the owners' caches'
    /// hit ratio as the readers saw it.
    pub hit_ratio: Option<f64>,
    /// One-sided path: p50 of the operations (runs) whose every page was a
    /// one-sided hit, and of those with at least one page faulted in on
    /// its owner (a miss); None when there were none.
    pub hit_p50_us: Option<f64>,
    pub miss_p50_us: Option<f64>,
    pub writes: u64,
    pub write_errors: u64,
    pub writes_dropped: u64,
    pub write_p50_ms: Option<f64>,
    pub write_p99_ms: Option<f64>,
    pub reconnects: u64,
    pub map_refreshes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct EventRow {
    pub event: String,
    pub kind: FaultKind,
    pub target: String,
    pub at_s: f64,
    /// From the event to the end of the first prober sweep that began after
    /// it and read every extent; None: not within the run.
    pub recovered_after_s: Option<f64>,
    /// Median pages/s of the 200 ms bins before the event (at most 3 s,
    /// since the previous event recovered; else the bins before the first
    /// event).
    pub baseline_pages_per_sec: f64,
    /// The lowest bin from the event to its recovery (or the next event).
    pub min_pages_per_sec: f64,
    pub dip_pct: f64,
}

pub struct Report {
    pub rows: Vec<Row>,
    pub events: Vec<EventRow>,
    pub redis_benchmark: Option<f64>,
    /// (seconds, pages/s, errors/s, writes/s) of the storm, per bin.
    pub timeline: Vec<(f64, f64, f64, f64)>,
    pub notes: Vec<String>,
    pub ratios: Vec<(String, f64)>,
    hists: Vec<(String, Histogram<u64>)>,
    pages: u64,
    coordinator: String,
}

/// The sum of the readers' totals.
pub fn sum(fs: &[Final]) -> Final {
    let mut t = Final::default();
    for f in fs {
        t.reads += f.reads;
        t.writes += f.writes;
        t.wrong += f.wrong;
        t.stale += f.stale;
        t.errors += f.errors;
        t.write_errors += f.write_errors;
        t.writes_dropped += f.writes_dropped;
        t.write_hist.extend_from_slice(&f.write_hist);
        t.one_sided += f.one_sided;
        t.one_sided_shm += f.one_sided_shm;
        t.one_sided_verbs += f.one_sided_verbs;
        t.one_sided_tcp += f.one_sided_tcp;
        t.fallbacks += f.fallbacks;
        t.retries += f.retries;
        t.validation_failures += f.validation_failures;
        t.reconnects += f.reconnects;
        t.map_refreshes += f.map_refreshes;
        t.secs = t.secs.max(f.secs);
        if t.first_wrong.is_none() {
            t.first_wrong.clone_from(&f.first_wrong);
        }
        if t.first_error.is_none() {
            t.first_error.clone_from(&f.first_error);
        }
    }
    t
}

fn hist<'a>(pairs: impl Iterator<Item = &'a [(u64, u64)]>) -> Histogram<u64> {
    let mut h = Histogram::<u64>::new_with_bounds(100, 120_000_000_000, 3).expect("valid bounds");
    for p in pairs {
        for &(v, c) in p {
            let _ = h.record_n(v.clamp(100, 120_000_000_000), c);
        }
    }
    h
}

pub fn build(
    a: &Args,
    s: &Summary,
    phases: &[Phase],
    redis_benchmark: Option<f64>,
    mut notes: Vec<String>,
) -> Report {
    let mut rows = Vec::new();
    let mut hists = Vec::new();
    let mut events = Vec::new();
    let mut timeline = Vec::new();
    for ph in phases {
        let t = sum(&ph.finals);
        let h = hist(ph.finals.iter().map(|f| f.hist.as_slice()));
        let wh = hist(ph.finals.iter().map(|f| f.write_hist.as_slice()));
        let wq = |q: f64| (!wh.is_empty()).then(|| wh.value_at_quantile(q) as f64 / 1e6);
        let p50 =
            |h: Histogram<u64>| (!h.is_empty()).then(|| h.value_at_quantile(0.5) as f64 / 1e3);
        let hit_p50_us = p50(hist(ph.finals.iter().map(|f| f.hit_hist.as_slice())));
        let miss_p50_us = p50(hist(ph.finals.iter().map(|f| f.miss_hist.as_slice())));
        let us = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
        let phase = if ph.storm { "storm" } else { "compare" };
        let transport = match ph.path {
            super::reader::Path::OneSided => a.transport.clone(),
            super::reader::Path::Grpc => "grpc".into(),
            super::reader::Path::Redis => "resp".into(),
            super::reader::Path::Pread => "file".into(),
        };
        rows.push(Row {
            phase,
            path: ph.path.name().into(),
            transport,
            clients: ph.finals.len(),
            secs: ph.secs,
            pages: t.reads,
            pages_per_sec: t.reads as f64 / ph.secs,
            p50_us: us(0.5),
            p99_us: us(0.99),
            p999_us: us(0.999),
            wrong_reads: t.wrong,
            stale_reads: t.stale,
            errors: t.errors,
            retries: t.retries,
            validation_failures: t.validation_failures,
            fallbacks: t.fallbacks,
            one_sided: t.one_sided,
            one_sided_shm: t.one_sided_shm,
            one_sided_verbs: t.one_sided_verbs,
            one_sided_tcp: t.one_sided_tcp,
            hit_ratio: (ph.path == super::reader::Path::OneSided && t.one_sided + t.fallbacks > 0)
                .then(|| t.one_sided as f64 / (t.one_sided + t.fallbacks) as f64),
            hit_p50_us,
            miss_p50_us,
            writes: t.writes,
            write_errors: t.write_errors,
            writes_dropped: t.writes_dropped,
            write_p50_ms: wq(0.5),
            write_p99_ms: wq(0.99),
            reconnects: t.reconnects,
            map_refreshes: t.map_refreshes,
        });
        hists.push((format!("{} {}", phase, ph.path.name()), h));
        if let Some(w) = &t.first_wrong {
            notes.push(format!("{phase} {}: first wrong read: {w}", ph.path.name()));
        }
        if let Some(e) = &t.first_error {
            notes.push(format!("{phase} {}: first error: {e}", ph.path.name()));
        }
        if !ph.storm {
            continue;
        }
        let bin_s = BIN_MS as f64 / 1e3;
        timeline = ph
            .bins
            .iter()
            .enumerate()
            .map(|(i, &(ok, err, wr))| {
                (
                    (i as f64 + 1.0) * bin_s,
                    ok as f64 / bin_s,
                    err as f64 / bin_s,
                    wr as f64 / bin_s,
                )
            })
            .collect();
        // Bins untouched by any event: before the first one. An event's
        // baseline is the bins since the previous event recovered (at most
        // 3 s), or these when there are none.
        let first_at = ph.faults.first().map_or(ph.secs, |x| x.1);
        let calm: Vec<f64> = timeline
            .iter()
            .filter(|x| x.0 <= first_at)
            .map(|x| x.1)
            .collect();
        let mut settled_at = 0.0f64;
        for (k, (f, at)) in ph.faults.iter().enumerate() {
            let next = ph.faults.get(k + 1).map_or(ph.secs, |x| x.1);
            let recovered = ph
                .sweeps
                .iter()
                .filter(|(start, _)| *start >= *at)
                .map(|(_, end)| end - at)
                .reduce(f64::min);
            let mut before: Vec<f64> = timeline
                .iter()
                .filter(|x| x.0 > settled_at.max(at - 3.0) + bin_s && x.0 <= *at)
                .map(|x| x.1)
                .collect();
            if before.is_empty() {
                before.clone_from(&calm);
            }
            settled_at = settled_at.max(recovered.map_or(next, |r| at + r));
            let upto = recovered.map_or(next, |r| (at + r + bin_s).min(next.max(at + bin_s)));
            let after = timeline
                .iter()
                .filter(|x| x.0 > *at && x.0 <= upto + bin_s)
                .map(|x| x.1)
                .fold(f64::INFINITY, f64::min);
            let base = crate::report::median(before);
            let min = if after.is_finite() { after } else { 0.0 };
            events.push(EventRow {
                event: f.describe(),
                kind: f.kind,
                target: f.target.clone(),
                at_s: *at,
                recovered_after_s: recovered,
                baseline_pages_per_sec: base,
                min_pages_per_sec: min,
                dip_pct: if base > 0.0 {
                    (100.0 * (1.0 - min / base)).max(0.0)
                } else {
                    0.0
                },
            });
        }
    }
    let rate = |phase: &str, path: &str| {
        rows.iter()
            .find(|r| r.phase == phase && r.path == path)
            .map(|r| r.pages_per_sec)
    };
    let mut ratios = Vec::new();
    if let Some(one) = rate("compare", "one-sided") {
        if let Some(g) = rate("compare", "grpc") {
            ratios.push(("one-sided / gRPC Read".into(), one / g));
        }
        let redis_best = match (rate("compare", "redis"), redis_benchmark) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        };
        if let Some(r) = redis_best {
            ratios.push((
                "one-sided / Redis GET (the better of our client and redis-benchmark)".into(),
                one / r,
            ));
        }
        if let Some(p) = rate("compare", "pread") {
            ratios.push(("one-sided / local pread (the floor)".into(), one / p));
        }
    }
    Report {
        rows,
        events,
        redis_benchmark,
        timeline,
        notes,
        ratios,
        hists,
        pages: s.pages,
        coordinator: s.coordinator.clone(),
    }
}

impl Report {
    /// Why the run fails, if it does.
    pub fn failed(&self) -> Option<String> {
        let wrong: u64 = self
            .rows
            .iter()
            .map(|r| r.wrong_reads + r.stale_reads)
            .sum();
        (wrong > 0).then(|| format!("{wrong} wrong or stale reads (must be 0)"))
    }
}

fn f1(x: f64) -> String {
    format!("{x:.1}")
}

pub fn emit(a: &Args, r: &Report) -> anyhow::Result<()> {
    let out = &a.output.out;
    std::fs::create_dir_all(out)?;
    // Plots.
    let mut written = Vec::new();
    let series = vec![
        crate::plot::TimeSeries {
            label: "pages read / s (verified)".into(),
            points: r.timeline.iter().map(|x| (x.0, x.1)).collect(),
        },
        crate::plot::TimeSeries {
            label: "failed reads / s".into(),
            points: r.timeline.iter().map(|x| (x.0, x.2)).collect(),
        },
        crate::plot::TimeSeries {
            label: "pages written / s".into(),
            points: r.timeline.iter().map(|x| (x.0, x.3)).collect(),
        },
    ];
    let events: Vec<crate::plot::Event> = r
        .events
        .iter()
        .map(|e| crate::plot::Event {
            at_s: e.at_s,
            label: e.event.clone(),
        })
        .collect();
    let storm_path = r
        .rows
        .iter()
        .find(|x| x.phase == "storm")
        .map_or("?".to_owned(), |x| {
            format!("{} over {}", x.path, x.transport)
        });
    // No storm phase (`--duration 0s`): nothing over time to draw.
    if !r.timeline.is_empty() {
        written.extend(crate::plot::throughput_over_time(
            out,
            "storm-throughput",
            &format!(
                "pagewire storm: {} {} clients, {} over time",
                a.readers,
                a.workload.name(),
                storm_path
            ),
            &series,
            &events,
        )?);
    }
    let hs: Vec<(String, &Histogram<u64>)> = r
        .hists
        .iter()
        .filter(|(_, h)| !h.is_empty())
        .map(|(l, h)| (l.clone(), h))
        .collect();
    written.extend(crate::plot::latency_cdf(
        out,
        "storm-latency",
        &format!(
            "pagewire storm: read latency per path ({} clients)",
            a.readers
        ),
        &hs,
    )?);

    let machine = crate::machine::describe();
    let doc = serde_json::json!({
        "bench": "storm",
        "machine": machine,
        "params": {
            "args": a,
            "pages": r.pages,
            "coordinator": r.coordinator,
            "dip": "lowest 200 ms bin from the event to its recovery, against the median bin of the 3 s before it (since the previous event recovered; else before the first event)",
            "recovery": "from the event to the end of the first prober sweep (one page of every extent) begun after it that read every extent",
        },
        "results": r.rows,
        "events": r.events,
        "redis_benchmark_gets_per_sec": r.redis_benchmark,
        "ratios": r.ratios.iter().map(|(k, v)| serde_json::json!({"ratio": k, "value": v})).collect::<Vec<_>>(),
        "timeline": r.timeline,
        "notes": r.notes,
        "plots": written,
    });
    std::fs::write(out.join("storm.json"), serde_json::to_string_pretty(&doc)?)?;
    if a.output.json {
        println!("{}", serde_json::to_string(&doc)?);
        return Ok(());
    }
    println!("storm: {machine}");
    // Started here: the caches' size is known; attached: it is the cluster's.
    let caches = if a.coordinator.is_none() {
        format!(
            ", caches for {:.0} % of the file{}",
            a.cache_fraction * 100.0,
            if a.warm { " (warmed)" } else { "" }
        )
    } else {
        String::new()
    };
    let storm = if a.duration.is_zero() {
        ", no storm".to_owned()
    } else {
        format!(", {} % writes in the storm", a.writer_fraction * 100.0)
    };
    println!(
        "{} pages of 4 KiB, {} nodes{caches}, {} clients per path, {} workload{storm}",
        r.pages,
        a.nodes,
        a.readers,
        a.workload.name(),
    );
    let rows: Vec<Vec<String>> = r
        .rows
        .iter()
        .map(|x| {
            vec![
                x.phase.to_owned(),
                x.path.clone(),
                x.transport.clone(),
                crate::report::si(x.pages_per_sec),
                f1(x.p50_us),
                f1(x.p99_us),
                f1(x.p999_us),
                x.hit_p50_us.map_or("-".into(), f1),
                x.miss_p50_us.map_or("-".into(), f1),
                x.wrong_reads.to_string(),
                x.stale_reads.to_string(),
                x.retries.to_string(),
                x.validation_failures.to_string(),
                x.fallbacks.to_string(),
                x.hit_ratio
                    .map_or("-".into(), |h| format!("{:.0} %", h * 100.0)),
                x.errors.to_string(),
                x.writes.to_string(),
            ]
        })
        .chain(r.redis_benchmark.map(|v| {
            let mut row = vec![
                "compare".into(),
                "redis-benchmark".into(),
                "resp".into(),
                crate::report::si(v),
            ];
            row.extend(std::iter::repeat_n("-".to_owned(), 13));
            row
        }))
        .collect();
    print!(
        "{}",
        crate::report::table(
            &[
                "phase",
                "path",
                "transport",
                "pages/s",
                "p50 µs",
                "p99 µs",
                "p99.9 µs",
                "hit p50",
                "miss p50",
                "wrong",
                "stale",
                "retries",
                "valfail",
                "fallbacks",
                "hit",
                "errors",
                "writes",
            ],
            &rows
        )
    );
    for x in r
        .rows
        .iter()
        .filter(|x| x.writes + x.write_errors + x.writes_dropped > 0)
    {
        println!(
            "{} writes: {} acknowledged (p50 {} ms, p99 {} ms), {} failed, {} not issued while the writer was blocked",
            x.phase,
            x.writes,
            x.write_p50_ms.map_or("-".into(), |v| format!("{v:.2}")),
            x.write_p99_ms.map_or("-".into(), |v| format!("{v:.1}")),
            x.write_errors,
            x.writes_dropped
        );
    }
    if !r.events.is_empty() {
        println!();
        let rows: Vec<Vec<String>> = r
            .events
            .iter()
            .map(|e| {
                vec![
                    format!("{:.2}", e.at_s),
                    e.event.clone(),
                    e.recovered_after_s
                        .map_or("not within the run".into(), |x| format!("{x:.2} s")),
                    crate::report::si(e.baseline_pages_per_sec),
                    crate::report::si(e.min_pages_per_sec),
                    format!("{:.0} %", e.dip_pct),
                ]
            })
            .collect();
        print!(
            "{}",
            crate::report::table(
                &[
                    "at s",
                    "event",
                    "every page served again after",
                    "before /s",
                    "lowest /s",
                    "dip"
                ],
                &rows
            )
        );
    }
    if !r.ratios.is_empty() {
        println!();
        for (k, v) in &r.ratios {
            println!("{k}: {v:.2}x");
        }
    }
    for n in &r.notes {
        println!("note: {n}");
    }
    println!();
    for p in &written {
        println!("plot: {}", p.display());
    }
    println!("json: {}", out.join("storm.json").display());
    Ok(())
}
