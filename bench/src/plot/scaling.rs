//! `local`'s scaling figure, `<bench>-<workload>.svg/.png`: for each mode
//! (zero-copy, copy-out) a row of two panels.
//!
//! - Left, "throughput": ops/s against threads, both axes logarithmic, so
//!   that series a hundred times apart both stay readable. The x ticks are
//!   exactly the thread counts measured. The dashed grey "ideal linear"
//!   line is the panel's fastest 1-thread throughput times the threads.
//!   Points are medians of the repeats; bars span their min and max.
//! - Right, "per thread": each series' ops/s per thread divided by its own
//!   1-thread ops/s. The dashed grey "ideal linear" line at 1.0 is perfect
//!   scaling; 0.5 means each thread gets half of what a lone thread gets.
//!
//! Each index keeps one colour and one marker shape on every panel.
//!
//! # The seed's mark
//!
//! The seed (BRIEF.md, benchmark 1, the Linux lockless pagecache on a
//! 64-way machine): "64-way, tree_lock version 2.5x slower than 1-way;
//! lockless scaled perfectly". Its workload is readers each reading their
//! own part of one file: our `partitioned`, so only that figure carries the
//! mark. The brief's measure is throughput per reader, and we read the
//! seed in it: each of 64 tree_lock readers ran at 1/2.5 = 0.4 of a lone
//! reader, each lockless reader at 1.0. On the per-thread panels the mark
//! is a black star at (64 threads, 0.4) when the axis reaches 64 threads;
//! on a smaller machine an arrow at 0.4 on the panel's right edge says that
//! the seed's point lies beyond the axis. It is the seed's number, not a
//! prediction: compare our `rwlock` (tree_lock's analogue) with it at 64
//! threads only. (Read as total throughput instead, the sentence would put
//! tree_lock at 0.4 / 64 ≈ 0.006 on this scale.)

use super::style::{self, Entry, Look, Marker};
use super::{Figure, header, header_height};
use crate::local::Row;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};

/// The seed's per-reader throughput of tree_lock at `SEED_THREADS`
/// readers, relative to one reader (2.5x slower).
const SEED_RATIO: f64 = 1.0 / 2.5;
const SEED_THREADS: f64 = 64.0;
/// The workload the seed measured.
const SEED_WORKLOAD: &str = "partitioned";

const WIDTH: u32 = 1400;
const ROW_H: u32 = 440;

/// Writes `<dir>/<bench>-<workload>.svg` and `.png` for every workload in
/// `rows`; returns the paths written.
pub fn scaling(dir: &Path, bench: &str, rows: &[Row]) -> anyhow::Result<Vec<PathBuf>> {
    super::fonts()?;
    let machine = crate::machine::describe();
    let about = format!(
        "{} cores, {:.0} GiB, {}",
        machine.cores,
        machine.memory_bytes as f64 / (1u64 << 30) as f64,
        machine.cpu
    );
    let mut workloads: Vec<&str> = rows.iter().map(|r| r.workload).collect();
    workloads.sort_unstable();
    workloads.dedup();
    let mut out = Vec::new();
    for w in workloads {
        let rs: Vec<&Row> = rows.iter().filter(|r| r.workload == w).collect();
        let fig = ScalingFigure::new(bench, w, &rs, &about)?;
        out.extend(super::write(dir, &format!("{bench}-{w}"), &fig)?);
    }
    Ok(out)
}

/// The x axis: logarithmic, ticks at exactly the thread counts measured.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct XAxis {
    pub lo: f64,
    pub hi: f64,
    pub ticks: Vec<f64>,
}

pub(crate) fn x_axis(threads: &[usize]) -> XAxis {
    let mut t: Vec<usize> = threads.iter().copied().filter(|&n| n > 0).collect();
    t.sort_unstable();
    t.dedup();
    if t.is_empty() {
        t.push(1);
    }
    let (a, b) = (t[0] as f64, t[t.len() - 1] as f64);
    // Room on either side, in doublings: a quarter, or more on a wide axis.
    let pad = 2f64.powf((0.06 * (b / a).log2()).max(0.25));
    XAxis {
        lo: a / pad,
        hi: b * pad,
        ticks: t.iter().map(|&n| n as f64).collect(),
    }
}

/// A thread-count tick: always a whole number.
pub(crate) fn x_label(v: f64) -> String {
    format!("{}", v.round() as u64)
}

fn mode_name(mode: &str) -> String {
    match mode {
        "zero_copy" => "zero-copy (look up, check in place)".into(),
        "zero_copy_pinned" => "zero-copy under an epoch pin (no refcount)".into(),
        "zero_copy_repinned" => "zero-copy under a kept pin, repinned per lookup".into(),
        "copy" => "copy-out (copy the page into a buffer)".into(),
        m => m.replace('_', "-"),
    }
}

/// Fixed looks for the known series, so a colour means the same index in
/// every figure; other names take the looks left over.
fn known_look(index: &str) -> Option<usize> {
    match index {
        "lockless" => Some(0),
        "rwlock" => Some(1),
        "mutex" => Some(2),
        "sharded" => Some(3),
        "linux_pread" => Some(6),
        _ => None,
    }
}

fn looks(indexes: &[String]) -> Vec<(String, Look)> {
    let mut taken: Vec<usize> = indexes.iter().filter_map(|i| known_look(i)).collect();
    let mut next = 0;
    let mut out: Vec<(String, usize)> = indexes
        .iter()
        .map(|i| {
            let n = known_look(i).unwrap_or_else(|| {
                while taken.contains(&next) {
                    next += 1;
                }
                taken.push(next);
                next
            });
            (i.clone(), n)
        })
        .collect();
    out.sort_by_key(|(_, n)| *n);
    out.into_iter().map(|(i, n)| (i, style::look(n))).collect()
}

#[derive(Clone, Debug)]
struct Pt {
    threads: usize,
    ops: f64,
    lo: f64,
    hi: f64,
}

#[derive(Clone, Debug)]
struct Series {
    index: String,
    look: Look,
    pts: Vec<Pt>,
}

impl Series {
    /// Ops/s per thread over the series' own 1-thread ops/s.
    fn per_thread(&self) -> Vec<(f64, f64)> {
        let Some(base) = self
            .pts
            .iter()
            .find(|p| p.threads == 1)
            .map(|p| p.ops)
            .filter(|&b| b > 0.0)
        else {
            return vec![];
        };
        self.pts
            .iter()
            .map(|p| (p.threads as f64, p.ops / p.threads as f64 / base))
            .filter(|p| p.1.is_finite())
            .collect()
    }
}

struct Panel {
    mode: String,
    series: Vec<Series>,
}

struct ScalingFigure {
    title: String,
    subtitle: String,
    x: XAxis,
    panels: Vec<Panel>,
    seed: bool,
    legend: Vec<Entry>,
    legend_h: u32,
}

impl ScalingFigure {
    fn new(bench: &str, workload: &str, rows: &[&Row], about: &str) -> anyhow::Result<Self> {
        let mut indexes: Vec<String> = rows.iter().map(|r| r.index.clone()).collect();
        indexes.sort();
        indexes.dedup();
        let looks = looks(&indexes);
        let mut modes: Vec<&str> = rows.iter().map(|r| r.mode).collect();
        modes.sort_by_key(|m| (!matches!(*m, "zero_copy"), !matches!(*m, "copy"), *m));
        modes.dedup();
        let panels: Vec<Panel> = modes
            .iter()
            .map(|&mode| Panel {
                mode: mode.to_owned(),
                series: looks
                    .iter()
                    .filter_map(|(index, look)| {
                        let mut pts: Vec<Pt> = rows
                            .iter()
                            .filter(|r| &r.index == index && r.mode == mode)
                            .filter(|r| r.ops_per_sec.is_finite() && r.ops_per_sec > 0.0)
                            .map(|r| {
                                let runs = r.runs.iter().copied().filter(|x| x.is_finite());
                                let lo = runs.clone().fold(r.ops_per_sec, f64::min);
                                let hi = runs.fold(r.ops_per_sec, f64::max);
                                Pt {
                                    threads: r.threads,
                                    ops: r.ops_per_sec,
                                    lo,
                                    hi,
                                }
                            })
                            .collect();
                        pts.sort_by_key(|p| p.threads);
                        (!pts.is_empty()).then(|| Series {
                            index: index.clone(),
                            look: *look,
                            pts,
                        })
                    })
                    .collect(),
            })
            .collect();
        let threads: Vec<usize> = rows.iter().map(|r| r.threads).collect();
        let seed = workload == SEED_WORKLOAD;
        let mut legend: Vec<Entry> = looks
            .iter()
            .filter(|(i, _)| {
                panels
                    .iter()
                    .any(|p| p.series.iter().any(|s| &s.index == i))
            })
            .map(|(i, l)| Entry::series(i.clone(), *l))
            .collect();
        legend.push(Entry {
            text: "ideal linear".into(),
            color: style::GREY,
            marker: None,
            line: Some(true),
        });
        if seed {
            legend.push(Entry {
                text: "seed, Linux 2.6.12 at 64 readers: tree_lock 0.4 per reader, lockless 1.0"
                    .into(),
                color: BLACK,
                marker: Some(Marker::Star),
                line: None,
            });
        }
        let legend_h = style::legend_height(&legend, WIDTH)?;
        let runs = rows.iter().map(|r| r.runs.len()).max().unwrap_or(1).max(1);
        let subtitle = if runs > 1 {
            format!("{about} · points: median of {runs} runs, bars: min to max")
        } else {
            format!("{about} · one run per point")
        };
        Ok(ScalingFigure {
            title: format!("pagewire {bench} · {workload} reads: throughput by threads"),
            subtitle,
            x: x_axis(&threads),
            panels,
            seed,
            legend,
            legend_h,
        })
    }

    /// The fastest ops/s at the fewest threads, and that thread count.
    fn ideal_base(panel: &Panel) -> Option<(f64, f64)> {
        let t0 = panel
            .series
            .iter()
            .flat_map(|s| s.pts.iter().map(|p| p.threads))
            .min()?;
        let best = panel
            .series
            .iter()
            .flat_map(|s| s.pts.iter())
            .filter(|p| p.threads == t0)
            .map(|p| p.ops)
            .fold(0.0, f64::max);
        (best > 0.0).then_some((t0 as f64, best))
    }

    fn draw_throughput<DB>(
        &self,
        area: &DrawingArea<DB, Shift>,
        panel: &Panel,
    ) -> anyhow::Result<()>
    where
        DB: DrawingBackend,
        DB::ErrorType: 'static,
    {
        let ideal: Vec<(f64, f64)> = match Self::ideal_base(panel) {
            Some((t0, b)) if self.x.ticks.len() > 1 => {
                self.x.ticks.iter().map(|&t| (t, b * t / t0)).collect()
            }
            _ => vec![],
        };
        let values = panel
            .series
            .iter()
            .flat_map(|s| s.pts.iter().flat_map(|p| [p.lo, p.hi]))
            .chain(ideal.iter().map(|p| p.1))
            .filter(|v| v.is_finite() && *v > 0.0);
        let (min, max) = values.fold((f64::INFINITY, 0.0f64), |(a, b), v| (a.min(v), b.max(v)));
        let (ylo, yhi) = if max > 0.0 {
            (style::floor_125(min / 1.15), style::ceil_125(max * 1.15))
        } else {
            (1.0, 10.0)
        };
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{}: throughput", mode_name(&panel.mode)),
                style::text(style::CAPTION),
            )
            .margin(12)
            .margin_right(28)
            .x_label_area_size(48)
            .y_label_area_size(74)
            .build_cartesian_2d(
                (self.x.lo..self.x.hi)
                    .log_scale()
                    .with_key_points(self.x.ticks.clone()),
                (ylo..yhi)
                    .log_scale()
                    .with_key_points(style::ticks_125(ylo, yhi, 9)),
            )?;
        chart
            .configure_mesh()
            .x_desc("threads (log scale)")
            .y_desc("ops/s (log scale)")
            .x_label_formatter(&|v| x_label(*v))
            .y_label_formatter(&|v| style::si_tick(*v))
            .label_style(style::text(style::TICK))
            .axis_desc_style(style::text(style::DESC))
            .bold_line_style(BLACK.mix(0.12))
            .draw()?;
        let screen = area.use_screen_coord();
        if ideal.len() > 1 {
            style::line(&mut chart, &ideal, style::GREY, 2, true)?;
            let end = chart.backend_coord(&ideal[ideal.len() - 1]);
            style::boxed_text(
                &screen,
                "ideal linear",
                (end.0 - 10, end.1 - 6),
                Pos::new(HPos::Right, VPos::Bottom),
                style::NOTE,
                &style::DARK,
            )?;
        }
        for s in &panel.series {
            for p in s.pts.iter().filter(|p| p.hi > p.lo) {
                let t = p.threads as f64;
                chart.draw_series(std::iter::once(PathElement::new(
                    vec![(t, p.lo), (t, p.hi)],
                    s.look.color.stroke_width(2),
                )))?;
            }
            let pts: Vec<(f64, f64)> = s.pts.iter().map(|p| (p.threads as f64, p.ops)).collect();
            style::line(&mut chart, &pts, s.look.color, 3, s.look.dashed)?;
            style::markers(&chart, &pts, s.look.marker, s.look.color, 6.0)?;
        }
        Ok(())
    }

    fn draw_per_thread<DB>(
        &self,
        area: &DrawingArea<DB, Shift>,
        panel: &Panel,
    ) -> anyhow::Result<()>
    where
        DB: DrawingBackend,
        DB::ErrorType: 'static,
    {
        let lines: Vec<(&Series, Vec<(f64, f64)>)> =
            panel.series.iter().map(|s| (s, s.per_thread())).collect();
        let top = lines
            .iter()
            .flat_map(|(_, l)| l.iter().map(|p| p.1))
            .fold(1.0f64, f64::max);
        let yhi = ((top * 1.12).max(1.2) * 5.0).ceil() / 5.0;
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{}: per thread, ÷ 1 thread", mode_name(&panel.mode)),
                style::text(style::CAPTION),
            )
            .margin(12)
            .margin_right(28)
            .x_label_area_size(48)
            .y_label_area_size(60)
            .build_cartesian_2d(
                (self.x.lo..self.x.hi)
                    .log_scale()
                    .with_key_points(self.x.ticks.clone()),
                0.0..yhi,
            )?;
        chart
            .configure_mesh()
            .x_desc("threads (log scale)")
            .y_desc("ops/s per thread ÷ 1-thread ops/s")
            .x_label_formatter(&|v| x_label(*v))
            .y_label_formatter(&|v| format!("{v:.1}"))
            .y_labels(8)
            .label_style(style::text(style::TICK))
            .axis_desc_style(style::text(style::DESC))
            .bold_line_style(BLACK.mix(0.12))
            .light_line_style(TRANSPARENT)
            .draw()?;
        let screen = area.use_screen_coord();
        let ideal = [(self.x.lo, 1.0), (self.x.hi, 1.0)];
        style::line(&mut chart, &ideal, style::GREY, 2, true)?;
        let right = chart.backend_coord(&ideal[1]);
        style::boxed_text(
            &screen,
            "ideal linear",
            (right.0 - 6, right.1 - 5),
            Pos::new(HPos::Right, VPos::Bottom),
            style::NOTE,
            &style::DARK,
        )?;
        // The seed's mark under the data: it must not hide a measurement.
        if self.seed {
            self.draw_seed(&chart, &screen)?;
        }
        for (s, pts) in &lines {
            style::line(&mut chart, pts, s.look.color, 3, s.look.dashed)?;
            style::markers(&chart, pts, s.look.marker, s.look.color, 6.0)?;
        }
        Ok(())
    }

    /// The seed's mark (see the module header).
    fn draw_seed<DB, X>(
        &self,
        chart: &ChartContext<'_, DB, Cartesian2d<X, plotters::coord::types::RangedCoordf64>>,
        screen: &DrawingArea<DB, Shift>,
    ) -> anyhow::Result<()>
    where
        DB: DrawingBackend,
        DB::ErrorType: 'static,
        X: Ranged<ValueType = f64>,
    {
        if self.x.hi >= SEED_THREADS {
            let at = chart.backend_coord(&(SEED_THREADS, SEED_RATIO));
            style::draw_marker(screen, at, Marker::Star, BLACK, 8.0)?;
            style::boxed_text(
                screen,
                "seed: tree_lock 0.4",
                (at.0 - 16, at.1),
                Pos::new(HPos::Right, VPos::Center),
                style::NOTE,
                &BLACK,
            )?;
        } else {
            let edge = chart.backend_coord(&(self.x.hi, SEED_RATIO));
            let (x, y) = (edge.0 - 2, edge.1);
            screen.draw(&Polygon::new(
                vec![(x, y), (x - 14, y - 8), (x - 14, y + 8)],
                BLACK.filled(),
            ))?;
            style::boxed_text(
                screen,
                "seed at 64 threads (off axis): tree_lock 0.4",
                (x - 20, y),
                Pos::new(HPos::Right, VPos::Center),
                style::NOTE,
                &BLACK,
            )?;
        }
        Ok(())
    }
}

impl Figure for ScalingFigure {
    fn size(&self) -> (u32, u32) {
        let rows = self.panels.len().max(1) as u32;
        (
            WIDTH,
            header_height(&self.subtitle) + rows * ROW_H + self.legend_h + 10,
        )
    }

    fn draw<DB>(&self, root: &DrawingArea<DB, Shift>) -> anyhow::Result<()>
    where
        DB: DrawingBackend,
        DB::ErrorType: 'static,
    {
        header(root, &self.title, &self.subtitle)?;
        let (_, body) = root.split_vertically(header_height(&self.subtitle));
        let (charts, legend) = body.split_vertically(self.panels.len().max(1) as u32 * ROW_H);
        let rows = charts.split_evenly((self.panels.len().max(1), 1));
        for (row, panel) in rows.iter().zip(&self.panels) {
            let (left, right) = row.split_horizontally(WIDTH / 2);
            self.draw_throughput(&left, panel)?;
            self.draw_per_thread(&right, panel)?;
        }
        style::legend(&legend, &self.legend)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(index: &str, mode: &'static str, workload: &'static str, t: usize, ops: f64) -> Row {
        Row {
            index: index.into(),
            threads: t,
            mode,
            workload,
            ops_per_sec: ops,
            ns_per_op: 1e9 / ops,
            ops_per_cpu_sec: ops,
            runs: vec![ops * 0.95, ops, ops * 1.04],
        }
    }

    /// A plausible 64-core run: lockless scales, rwlock collapses, copy-out
    /// ten times slower.
    fn synthetic(threads: &[usize], workload: &'static str) -> Vec<Row> {
        let mut rows = vec![];
        for &t in threads {
            let tf = t as f64;
            for (mode, k) in [("zero_copy", 1.0), ("copy", 0.1)] {
                rows.push(row("lockless", mode, workload, t, 30e6 * k * tf));
                rows.push(row("rwlock", mode, workload, t, 20e6 * k * tf.powf(0.3)));
                rows.push(row("mutex", mode, workload, t, 18e6 * k / tf.sqrt()));
                rows.push(row("sharded", mode, workload, t, 25e6 * k * tf.powf(0.8)));
            }
            rows.push(row("linux_pread", "copy", workload, t, 1.5e6 * tf));
        }
        rows
    }

    #[test]
    fn x_ticks_are_the_thread_counts_and_integers() {
        let a = x_axis(&[1, 2, 4, 8, 6, 2, 1]);
        assert_eq!(a.ticks, vec![1.0, 2.0, 4.0, 6.0, 8.0]);
        for t in &a.ticks {
            let l = x_label(*t);
            assert_eq!(l.parse::<u64>().expect("an integer"), *t as u64);
        }
        assert!(a.lo > 0.0 && a.lo < 1.0 && a.hi > 8.0);
        let one = x_axis(&[1]);
        assert_eq!(one.ticks, vec![1.0]);
        assert!(one.lo < 1.0 && one.hi > 1.0);
        assert_eq!(x_axis(&[]).ticks, vec![1.0]);
        assert_eq!(x_label(63.9999), "64");
    }

    #[test]
    fn per_thread_is_relative_to_one_thread() {
        let s = Series {
            index: "x".into(),
            look: style::look(0),
            pts: vec![
                Pt {
                    threads: 1,
                    ops: 10.0,
                    lo: 10.0,
                    hi: 10.0,
                },
                Pt {
                    threads: 4,
                    ops: 20.0,
                    lo: 20.0,
                    hi: 20.0,
                },
            ],
        };
        assert_eq!(s.per_thread(), vec![(1.0, 1.0), (4.0, 0.5)]);
    }

    #[test]
    fn renders_every_workload() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut rows = synthetic(&[1, 2, 4, 8, 16, 32, 64], "partitioned");
        rows.extend(synthetic(&[1, 2], "uniform"));
        let paths = scaling(dir.path(), "local", &rows).expect("plots");
        assert_eq!(paths.len(), 4);
        for w in ["partitioned", "uniform"] {
            let mine: Vec<PathBuf> = paths
                .iter()
                .filter(|p| p.to_string_lossy().contains(&format!("local-{w}.")))
                .cloned()
                .collect();
            super::super::test_util::check(&mine, &format!("{w} reads: throughput by threads"));
        }
    }

    #[test]
    fn one_thread_count_one_series() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rows = vec![row("lockless", "zero_copy", "hot", 1, 5e6)];
        let paths = scaling(dir.path(), "local", &rows).expect("plots");
        super::super::test_util::check(&paths, "hot reads");
    }

    #[test]
    fn no_rows_no_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(scaling(dir.path(), "local", &[]).expect("ok").is_empty());
    }

    #[test]
    fn zero_and_nan_throughput_do_not_panic() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rows = vec![
            row("lockless", "copy", "partitioned", 1, 0.0),
            row("lockless", "copy", "partitioned", 2, f64::NAN),
        ];
        let paths = scaling(dir.path(), "local", &rows).expect("plots");
        super::super::test_util::check(&paths, "partitioned reads");
    }

    /// Writes the figures into /tmp/plots-view for a person to look at.
    #[test]
    #[ignore = "writes into /tmp for viewing"]
    fn view() {
        let dir = Path::new("/tmp/plots-view");
        let mut rows = synthetic(&[1, 2, 4, 8, 16, 32, 64], "partitioned");
        rows.extend(synthetic(&[1, 2, 4, 8], "uniform"));
        let paths = scaling(dir, "local", &rows).expect("plots");
        println!("{paths:?}");
    }
}
