//! Read latency distributions, one line per path, on a tail scale.
//!
//! x is the latency on a log axis. y is the fraction of reads at or below
//! it, drawn as −log10(1 − fraction): p50, p90, p99, p99.9 are evenly
//! spaced steps, so the tail (where one-sided reads, gRPC and Redis differ
//! most) gets as much room as the median. A curve ends at the largest
//! fraction its sample count resolves (1 − 1/n), at the slowest read. Each
//! curve carries its marker at p50, p99 and p99.9 (where the count
//! resolves them), and its legend entry states them.

use super::style::{self, Entry};
use super::{Figure, header, header_height};
use hdrhistogram::Histogram;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};

/// Writes `<dir>/<name>.svg` and `.png`: latency CDF per path (x: latency
/// on a log axis in µs, y: fraction of reads on a tail scale showing
/// p50/p99/p99.9 clearly), one line per (label, histogram of latencies in
/// nanoseconds); returns the paths written. An empty histogram draws no
/// line, and its legend entry says so.
pub fn latency_cdf(
    dir: &Path,
    name: &str,
    title: &str,
    paths: &[(String, &Histogram<u64>)],
) -> anyhow::Result<Vec<PathBuf>> {
    super::fonts()?;
    let fig = Cdf::new(title, paths)?;
    super::write(dir, name, &fig)
}

const WIDTH: u32 = 1400;
const CHART_H: u32 = 620;
/// Tail coordinates are only drawn this deep (p99.9999).
const DEEPEST: f64 = 6.0;
/// Fractions marked on each curve.
const MARKS: [f64; 3] = [0.5, 0.99, 0.999];

/// The tail coordinate of fraction `q`: 0 at 0, 1 at 0.9, 2 at 0.99 …
pub(crate) fn tail(q: f64) -> f64 {
    -(1.0 - q).log10()
}

/// The tick label of tail coordinate `y`.
pub(crate) fn tail_label(y: f64) -> String {
    if y < 1e-9 {
        return "p0".into();
    }
    let pct = 100.0 * (1.0 - 10f64.powf(-y));
    // Round to the digits the step needs: 50, 90, 99, 99.9, 99.99 …
    let digits = (y.ceil() as usize).saturating_sub(2);
    format!("p{}", style::short_digits(pct, digits))
}

struct Curve {
    label: String,
    pts: Vec<(f64, f64)>,
    marks: Vec<(f64, f64)>,
}

/// The curve of one histogram, in (µs, tail) points.
fn curve(label: &str, h: &Histogram<u64>) -> Curve {
    let label = legend_text(label, h);
    let n = h.len();
    if n == 0 {
        return Curve {
            label,
            pts: vec![],
            marks: vec![],
        };
    }
    let us = |ns: u64| (ns as f64 / 1e3).max(1e-3);
    let deepest = (n as f64).log10().min(DEEPEST);
    let steps = (deepest / 0.02).ceil() as usize;
    let mut pts: Vec<(f64, f64)> = (0..steps)
        .map(|i| {
            let y = i as f64 * 0.02;
            (us(h.value_at_quantile(1.0 - 10f64.powf(-y))), y)
        })
        .collect();
    pts.push((us(h.max()), deepest));
    let marks = MARKS
        .iter()
        .filter(|&&q| tail(q) <= deepest + 1e-9)
        .map(|&q| (us(h.value_at_quantile(q)), tail(q)))
        .collect();
    Curve { label, pts, marks }
}

fn legend_text(label: &str, h: &Histogram<u64>) -> String {
    let n = h.len();
    if n == 0 {
        return format!("{label}: no samples");
    }
    let mut s = label.to_owned();
    for q in MARKS {
        if tail(q) <= (n as f64).log10() + 1e-9 {
            let v = h.value_at_quantile(q) as f64 / 1e3;
            s += &format!("  {} {}", tail_label(tail(q)), style::latency(v));
        }
    }
    s + &format!("  (n={})", style::si_tick(n as f64))
}

struct Cdf {
    title: String,
    subtitle: String,
    curves: Vec<Curve>,
    x: (f64, f64),
    y_hi: f64,
    legend: Vec<Entry>,
    legend_h: u32,
}

impl Cdf {
    fn new(title: &str, paths: &[(String, &Histogram<u64>)]) -> anyhow::Result<Self> {
        let curves: Vec<Curve> = paths.iter().map(|(label, h)| curve(label, h)).collect();
        let xs = curves.iter().flat_map(|c| c.pts.iter().map(|p| p.0));
        let (lo, hi) = xs.fold((f64::INFINITY, 0.0f64), |(a, b), v| (a.min(v), b.max(v)));
        let x = if hi > 0.0 {
            (style::floor_125(lo / 1.1), style::ceil_125(hi * 1.1))
        } else {
            (1.0, 1000.0)
        };
        let deepest = curves
            .iter()
            .flat_map(|c| c.pts.last().map(|p| p.1))
            .fold(0.0f64, f64::max);
        // At least to p99, so that the scale reads as one.
        let y_hi = deepest.clamp(2.0, DEEPEST).ceil() + 0.15;
        let legend: Vec<Entry> = curves
            .iter()
            .enumerate()
            .map(|(i, c)| Entry::series(c.label.clone(), style::look(i)))
            .collect();
        let legend_h = style::legend_height(&legend, WIDTH)?;
        Ok(Cdf {
            title: title.to_owned(),
            subtitle: "latency on a log axis · fraction of reads on a tail scale (p90, p99, \
                       p99.9 equally spaced) · markers at p50, p99, p99.9"
                .to_owned(),
            curves,
            x,
            y_hi,
            legend,
            legend_h,
        })
    }
}

impl Figure for Cdf {
    fn size(&self) -> (u32, u32) {
        (
            WIDTH,
            header_height(&self.subtitle) + CHART_H + self.legend_h + 10,
        )
    }

    fn draw<DB>(&self, root: &DrawingArea<DB, Shift>) -> anyhow::Result<()>
    where
        DB: DrawingBackend,
        DB::ErrorType: 'static,
    {
        header(root, &self.title, &self.subtitle)?;
        let (_, rest) = root.split_vertically(header_height(&self.subtitle));
        let (chart_area, legend_area) = rest.split_vertically(CHART_H);
        let mut y_ticks: Vec<f64> = vec![0.0, tail(0.5)];
        y_ticks.extend((1..=self.y_hi.floor() as i32).map(f64::from));
        let mut chart = ChartBuilder::on(&chart_area)
            .margin(15)
            .margin_right(30)
            .x_label_area_size(50)
            .y_label_area_size(84)
            .build_cartesian_2d(
                (self.x.0..self.x.1)
                    .log_scale()
                    .with_key_points(style::ticks_125(self.x.0, self.x.1, 16)),
                style::TickedAxis {
                    lo: 0.0,
                    hi: self.y_hi,
                    ticks: y_ticks,
                },
            )?;
        chart
            .configure_mesh()
            .x_desc("latency (log scale)")
            .y_desc("reads at or below (tail scale)")
            .x_label_formatter(&|v| style::latency(*v))
            .y_label_formatter(&|v| tail_label(*v))
            .label_style(style::text(style::TICK))
            .axis_desc_style(style::text(style::DESC))
            .bold_line_style(BLACK.mix(0.15))
            .draw()?;
        for (i, c) in self.curves.iter().enumerate() {
            let look = style::look(i);
            style::line(&mut chart, &c.pts, look.color, 3, look.dashed)?;
            style::markers(&chart, &c.marks, look.marker, look.color, 7.0)?;
        }
        if self.curves.iter().all(|c| c.pts.is_empty()) {
            let mid = chart.backend_coord(&((self.x.0 * self.x.1).sqrt(), self.y_hi / 2.0));
            root.use_screen_coord().draw(&Text::new(
                "no samples",
                mid,
                style::text(style::CAPTION).pos(Pos::new(HPos::Center, VPos::Center)),
            ))?;
        }
        style::legend(&legend_area, &self.legend)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log-normal-ish latency histogram around `median_ns`, with a slow
    /// tail of one read in `tail_every` at `tail_x` times the median.
    fn hist(median_ns: f64, n: u64, tail_every: u64, tail_x: f64) -> Histogram<u64> {
        let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
        let mut rng = fastrand::Rng::with_seed(7);
        for i in 0..n {
            // Sum of uniforms: a bell in log space.
            let z: f64 = (0..4).map(|_| rng.f64()).sum::<f64>() - 2.0;
            let mut v = median_ns * (z * 0.6).exp();
            if i % tail_every == 0 {
                v *= tail_x * (1.0 + rng.f64());
            }
            h.record(v.max(1.0) as u64).expect("record");
        }
        h
    }

    #[test]
    fn tail_scale() {
        assert!((tail(0.99) - 2.0).abs() < 1e-9);
        assert_eq!(tail_label(0.0), "p0");
        assert_eq!(tail_label(tail(0.5)), "p50");
        assert_eq!(tail_label(1.0), "p90");
        assert_eq!(tail_label(2.0), "p99");
        assert_eq!(tail_label(3.0), "p99.9");
        assert_eq!(tail_label(5.0), "p99.999");
    }

    #[test]
    fn renders_paths_and_states_percentiles() {
        let dir = tempfile::tempdir().expect("tempdir");
        let shm = hist(2_000.0, 200_000, 500, 8.0);
        let grpc = hist(60_000.0, 50_000, 200, 5.0);
        let paths = [
            ("one-sided shm".to_owned(), &shm),
            ("gRPC Read".to_owned(), &grpc),
        ];
        let out = latency_cdf(dir.path(), "cdf", "Read latency, storm A", &paths).expect("plot");
        super::super::test_util::check(&out, "Read latency, storm A");
        let svg = std::fs::read_to_string(&out[0]).expect("svg");
        assert!(
            svg.contains("p50") && svg.contains("p99.9"),
            "percentiles named"
        );
    }

    #[test]
    fn empty_and_tiny_histograms() {
        let dir = tempfile::tempdir().expect("tempdir");
        let empty = Histogram::<u64>::new(3).expect("hist");
        let mut one = Histogram::<u64>::new(3).expect("hist");
        one.record(0).expect("record");
        let out = latency_cdf(
            dir.path(),
            "empty",
            "Nothing measured",
            &[("redis".to_owned(), &empty)],
        )
        .expect("empty plot");
        super::super::test_util::check(&out, "Nothing measured");
        let out = latency_cdf(
            dir.path(),
            "tiny",
            "One read",
            &[("redis".to_owned(), &empty), ("shm".to_owned(), &one)],
        )
        .expect("plot");
        super::super::test_util::check(&out, "One read");
        let out = latency_cdf(dir.path(), "nopaths", "No paths", &[]).expect("plot");
        super::super::test_util::check(&out, "No paths");
    }

    /// Writes the figure into /tmp/plots-view for a person to look at.
    #[test]
    #[ignore = "writes into /tmp for viewing"]
    fn view() {
        let shm = hist(2_500.0, 1_000_000, 300, 10.0);
        let tcp = hist(18_000.0, 500_000, 300, 6.0);
        let grpc = hist(70_000.0, 200_000, 100, 4.0);
        let redis = hist(45_000.0, 200_000, 1000, 20.0);
        let paths = [
            ("one-sided shm".to_owned(), &shm),
            ("one-sided tcp".to_owned(), &tcp),
            ("gRPC Read".to_owned(), &grpc),
            ("Redis GET".to_owned(), &redis),
        ];
        let p = latency_cdf(
            Path::new("/tmp/plots-view"),
            "storm-latency",
            "Storm: 4 KiB read latency by path",
            &paths,
        )
        .expect("plot");
        println!("{p:?}");
    }
}
