//! A storm's throughput over time: one line per series, each fault event a
//! dashed vertical line whose label sits in a band above the chart, joined
//! to its line. Labels go right or left of their line and up into further
//! lanes so that none touches another and, where it can be helped, no
//! event's line runs through another's label ([`place_labels`]). When more
//! than `MAX_LANES` lanes would be needed, the labels become numbers and a
//! key under the legend spells them out.

use super::style::{self, Entry};
use super::{Figure, header, header_height};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};

/// One line of a throughput-over-time plot.
#[derive(Clone, Debug, PartialEq)]
pub struct TimeSeries {
    pub label: String,
    /// (seconds since start, ops per second)
    pub points: Vec<(f64, f64)>,
}

/// A fault event drawn as a vertical line with its label (e.g. "kill
/// node-2").
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub at_s: f64,
    pub label: String,
}

/// Writes `<dir>/<name>.svg` and `<dir>/<name>.png`: throughput over time,
/// one line per series, every event marked as a labelled vertical line;
/// returns the paths written.
pub fn throughput_over_time(
    dir: &Path,
    name: &str,
    title: &str,
    series: &[TimeSeries],
    events: &[Event],
) -> anyhow::Result<Vec<PathBuf>> {
    super::fonts()?;
    let fig = Timeline::new(title, series, events)?;
    super::write(dir, name, &fig)
}

const WIDTH: u32 = 1400;
const CHART_H: u32 = 560;
const MARGIN: i32 = 15;
const MARGIN_RIGHT: i32 = 30;
const Y_LABELS: i32 = 84;
const LANE_H: i32 = 22;
/// Lanes of full labels before they turn into numbers.
const MAX_LANES: usize = 4;
/// Lanes of numbers before numbers may overlap.
const MAX_NUMBER_LANES: usize = 8;
/// Least room between two labels in one lane, in pixels.
const GAP: i32 = 12;

/// Room between a line and its label, in pixels.
const PAD: i32 = 4;

/// Two labels' spans, each with whether it hangs left of its line, are far
/// enough apart for one lane: `GAP` between them, or nothing when they
/// hang back to back from their lines (the lines are between them then).
fn apart((a, a_left): ((i32, i32), bool), (b, b_left): ((i32, i32), bool)) -> bool {
    if a.1 <= b.0 {
        a.1 + if a_left && !b_left { 0 } else { GAP } <= b.0
    } else if b.1 <= a.0 {
        b.1 + if b_left && !a_left { 0 } else { GAP } <= a.0
    } else {
        false
    }
}

/// Where each event's label goes: (lane, left of its line?), for events at
/// pixel `xs` (sorted) with labels `widths` wide, inside `0..right_edge`.
///
/// Labels are placed from the rightmost event leftwards. Each takes the
/// lowest lane and side (right first) where it keeps `GAP` from the labels
/// of that lane and is "clean": its line, rising through the lower lanes,
/// crosses no label there, and no other event's line rises through it (the
/// lines of events already placed lower may). A cluster of events so
/// becomes a staircase, and a close pair shares a lane back to back. With
/// no clean place it takes the lowest lane where it fits; the crossing line
/// then passes behind the label's white box.
pub(crate) fn place_labels(xs: &[i32], widths: &[i32], right_edge: i32) -> Vec<(usize, bool)> {
    let n = xs.len().min(widths.len());
    /// (lane, hangs left, span) of a placed label.
    type Slot = (usize, bool, (i32, i32));
    let mut placed: Vec<Option<Slot>> = vec![None; n];
    let near = |x: i32, s: (i32, i32)| s.0 < x && x < s.1;
    for i in (0..n).rev() {
        let span = |left: bool| {
            if left {
                (xs[i] - PAD - widths[i], xs[i])
            } else {
                (xs[i], xs[i] + PAD + widths[i])
            }
        };
        let fits = |lane: usize, left: bool, s: (i32, i32)| {
            placed
                .iter()
                .flatten()
                .all(|&(l, o_left, o)| l != lane || apart((o, o_left), (s, left)))
        };
        let clean = |lane: usize, s: (i32, i32)| {
            placed
                .iter()
                .flatten()
                .all(|&(l, _, o)| l >= lane || !near(xs[i], o))
                && (0..n)
                    .filter(|&j| j != i)
                    .all(|j| !near(xs[j], s) || matches!(placed[j], Some((l, _, _)) if l < lane))
        };
        let inside = |s: (i32, i32)| s.0 >= 0 && s.1 <= right_edge;
        let lanes = placed.iter().flatten().map(|p| p.0 + 1).max().unwrap_or(0);
        let candidates = || (0..=lanes).flat_map(|l| [(l, false), (l, true)]);
        let pick = candidates()
            .find(|&(l, left)| {
                inside(span(left)) && fits(l, left, span(left)) && clean(l, span(left))
            })
            .or_else(|| {
                candidates().find(|&(l, left)| inside(span(left)) && fits(l, left, span(left)))
            })
            .unwrap_or((lanes, false));
        placed[i] = Some((pick.0, pick.1, span(pick.1)));
    }
    placed
        .into_iter()
        .map(|p| p.map(|(l, left, _)| (l, left)).unwrap_or((0, false)))
        .collect()
}

/// One placed event label.
#[derive(Clone, Debug)]
struct Placed {
    at_s: f64,
    text: String,
    lane: usize,
    /// Left of the line (the label would run off the right edge).
    left: bool,
}

struct Timeline {
    title: String,
    subtitle: String,
    series: Vec<(String, Vec<(f64, f64)>)>,
    x: (f64, f64),
    y_hi: f64,
    labels: Vec<Placed>,
    lanes: usize,
    /// "n: label (t s)" for numbered labels.
    key: Vec<String>,
    key_rows: i32,
    legend: Vec<Entry>,
    legend_h: u32,
}

impl Timeline {
    fn new(title: &str, series: &[TimeSeries], events: &[Event]) -> anyhow::Result<Self> {
        let series: Vec<(String, Vec<(f64, f64)>)> = series
            .iter()
            .map(|s| {
                let mut pts: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .copied()
                    .filter(|(t, v)| t.is_finite() && v.is_finite())
                    .collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                (s.label.clone(), pts)
            })
            .collect();
        let mut events: Vec<&Event> = events.iter().filter(|e| e.at_s.is_finite()).collect();
        events.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));

        let times = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|p| p.0))
            .chain(events.iter().map(|e| e.at_s));
        let (t0, t1) = times.fold((0.0f64, f64::NEG_INFINITY), |(a, b), t| {
            (a.min(t), b.max(t))
        });
        let t1 = if t1 > t0 {
            t1 + (t1 - t0) * 0.01
        } else {
            t0 + 1.0
        };
        let y_max = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|p| p.1))
            .fold(0.0f64, f64::max);
        let y_hi = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };

        // Where the plot area will be, as ChartBuilder lays it out below.
        let (px0, px1) = (MARGIN + Y_LABELS, WIDTH as i32 - MARGIN_RIGHT);
        let to_px = |t: f64| px0 + ((t - t0) / (t1 - t0) * (px1 - px0) as f64).round() as i32;
        let xs: Vec<i32> = events.iter().map(|e| to_px(e.at_s)).collect();
        let place = |texts: &[String]| -> anyhow::Result<(Vec<Placed>, usize)> {
            let widths: Vec<i32> = texts
                .iter()
                .map(|t| Ok(style::text_size(t, style::NOTE)?.0 as i32))
                .collect::<anyhow::Result<_>>()?;
            let at = place_labels(&xs, &widths, WIDTH as i32 - 4);
            let n = at.iter().map(|a| a.0 + 1).max().unwrap_or(0);
            let placed = events
                .iter()
                .zip(texts)
                .zip(at)
                .map(|((e, s), (lane, left))| Placed {
                    at_s: e.at_s,
                    text: s.clone(),
                    lane,
                    left,
                })
                .collect();
            Ok((placed, n))
        };
        let full: Vec<String> = events.iter().map(|e| e.label.clone()).collect();
        let (mut labels, mut lanes) = place(&full)?;
        let mut key = Vec::new();
        if lanes > MAX_LANES {
            let numbers: Vec<String> = (1..=events.len()).map(|i| i.to_string()).collect();
            (labels, lanes) = place(&numbers)?;
            if lanes > MAX_NUMBER_LANES {
                for l in &mut labels {
                    l.lane %= MAX_NUMBER_LANES;
                }
                lanes = MAX_NUMBER_LANES;
            }
            key = events
                .iter()
                .enumerate()
                .map(|(i, e)| format!("{}: {} ({} s)", i + 1, e.label, style::short(e.at_s)))
                .collect();
        }
        let key_widths: Vec<i32> = key
            .iter()
            .map(|k| Ok(style::text_size(k, style::NOTE)?.0 as i32))
            .collect::<anyhow::Result<_>>()?;
        let (_, key_rows) = style::flow(&key_widths, WIDTH as i32 - 40);

        let mut legend: Vec<Entry> = series
            .iter()
            .enumerate()
            .map(|(i, (l, _))| Entry::series(l.clone(), style::look(i)))
            .collect();
        if !events.is_empty() {
            legend.push(Entry {
                text: "fault event".into(),
                color: style::DARK,
                marker: None,
                line: Some(true),
            });
        }
        let legend_h = style::legend_height(&legend, WIDTH)?;
        let subtitle = if events.is_empty() {
            "ops/s over time".to_owned()
        } else {
            format!(
                "ops/s over time · dashed verticals: {} fault event{}",
                events.len(),
                if events.len() == 1 { "" } else { "s" }
            )
        };
        Ok(Timeline {
            title: title.to_owned(),
            subtitle,
            series,
            x: (t0, t1),
            y_hi,
            labels,
            lanes,
            key,
            key_rows,
            legend,
            legend_h,
        })
    }

    fn band_h(&self) -> u32 {
        if self.lanes == 0 {
            10
        } else {
            (self.lanes as i32 * LANE_H + 10) as u32
        }
    }

    fn key_h(&self) -> u32 {
        if self.key_rows == 0 {
            0
        } else {
            (self.key_rows * 20 + 10) as u32
        }
    }
}

impl Figure for Timeline {
    fn size(&self) -> (u32, u32) {
        (
            WIDTH,
            header_height(&self.subtitle)
                + self.band_h()
                + CHART_H
                + self.legend_h
                + self.key_h()
                + 10,
        )
    }

    fn draw<DB>(&self, root: &DrawingArea<DB, Shift>) -> anyhow::Result<()>
    where
        DB: DrawingBackend,
        DB::ErrorType: 'static,
    {
        header(root, &self.title, &self.subtitle)?;
        let (_, rest) = root.split_vertically(header_height(&self.subtitle));
        let (band, rest) = rest.split_vertically(self.band_h());
        let (chart_area, rest) = rest.split_vertically(CHART_H);
        let (legend_area, key_area) = rest.split_vertically(self.legend_h);

        let mut chart = ChartBuilder::on(&chart_area)
            .margin(MARGIN)
            .margin_right(MARGIN_RIGHT)
            .margin_top(0)
            .x_label_area_size(50)
            .y_label_area_size(Y_LABELS)
            .build_cartesian_2d(self.x.0..self.x.1, 0.0..self.y_hi)?;
        chart
            .configure_mesh()
            .x_desc("seconds since start")
            .y_desc("ops/s")
            .x_label_formatter(&|v| style::short(*v))
            .y_label_formatter(&|v| style::si_tick(*v))
            .x_labels(12)
            .y_labels(8)
            .label_style(style::text(style::TICK))
            .axis_desc_style(style::text(style::DESC))
            .bold_line_style(BLACK.mix(0.12))
            .light_line_style(TRANSPARENT)
            .draw()?;

        // Events under the data, so lines cross them.
        let screen = root.use_screen_coord();
        let band_bottom = band.get_base_pixel().1 + self.band_h() as i32;
        let lane_y = |lane: usize| band_bottom - 4 - lane as i32 * LANE_H - LANE_H / 2;
        for p in &self.labels {
            style::line(
                &mut chart,
                &[(p.at_s, 0.0), (p.at_s, self.y_hi)],
                style::DARK,
                1,
                true,
            )?;
            let (x, top) = chart.backend_coord(&(p.at_s, self.y_hi));
            screen.draw(&PathElement::new(
                vec![(x, lane_y(p.lane)), (x, top)],
                style::DARK.stroke_width(1),
            ))?;
        }
        // Labels over every line: where a line must cross a label, it
        // passes behind the label's box.
        for p in &self.labels {
            let (x, _) = chart.backend_coord(&(p.at_s, self.y_hi));
            let (at, h) = if p.left {
                ((x - PAD, lane_y(p.lane)), HPos::Right)
            } else {
                ((x + PAD, lane_y(p.lane)), HPos::Left)
            };
            style::boxed_text(
                &screen,
                &p.text,
                at,
                Pos::new(h, VPos::Center),
                style::NOTE,
                &BLACK,
            )?;
        }

        for (i, (_, pts)) in self.series.iter().enumerate() {
            let look = style::look(i);
            style::line(&mut chart, pts, look.color, 2, look.dashed)?;
            // Sparse markers, shifted per series so that they do not sit on
            // each other.
            let step = pts.len().div_ceil(14).max(1);
            let shift = i * step / self.series.len().max(1);
            let marks: Vec<(f64, f64)> = pts.iter().skip(shift).step_by(step).copied().collect();
            style::markers(&chart, &marks, look.marker, look.color, 5.0)?;
        }
        if self.series.iter().all(|(_, p)| p.is_empty()) {
            let mid = chart.backend_coord(&((self.x.0 + self.x.1) / 2.0, self.y_hi / 2.0));
            screen.draw(&Text::new(
                "no samples",
                mid,
                style::text(style::CAPTION).pos(Pos::new(HPos::Center, VPos::Center)),
            ))?;
        }

        style::legend(&legend_area, &self.legend)?;
        if !self.key.is_empty() {
            let widths: Vec<i32> = self
                .key
                .iter()
                .map(|k| Ok(style::text_size(k, style::NOTE)?.0 as i32))
                .collect::<anyhow::Result<_>>()?;
            let (pos, _) = style::flow(&widths, WIDTH as i32 - 40);
            for (k, &(row, x)) in self.key.iter().zip(&pos) {
                key_area.draw(&Text::new(
                    k.clone(),
                    (20 + x, 4 + row * 20),
                    style::text(style::NOTE),
                ))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two nodes' readers at about 2M ops/s each, node-2 killed at 20 s and
    /// restarted at 21.5 s, a pause and resume later.
    fn storm() -> (Vec<TimeSeries>, Vec<Event>) {
        let wobble = |t: f64, k: f64| 1.0 + 0.04 * (t * k).sin();
        let mk = |label: &str, base: f64, k: f64, dip: bool| TimeSeries {
            label: label.into(),
            points: (0..=600)
                .map(|i| {
                    let t = i as f64 * 0.1;
                    let mut v = base * wobble(t, k);
                    if dip && (20.0..21.5).contains(&t) {
                        v = 0.0;
                    } else if dip && (21.5..26.0).contains(&t) {
                        v *= (t - 21.5) / 4.5;
                    }
                    (t, v)
                })
                .collect(),
        };
        let series = vec![
            mk("one-sided shm", 2.1e6, 1.3, true),
            mk("one-sided tcp", 1.2e6, 0.7, true),
            mk("gRPC Read", 0.35e6, 2.1, false),
            mk("Redis GET", 0.5e6, 0.4, false),
        ];
        let events = vec![
            Event {
                at_s: 20.0,
                label: "kill node-2".into(),
            },
            Event {
                at_s: 21.5,
                label: "restart node-2".into(),
            },
            Event {
                at_s: 40.0,
                label: "pause node-1".into(),
            },
            Event {
                at_s: 40.4,
                label: "resume node-1".into(),
            },
            Event {
                at_s: 59.5,
                label: "kill coordinator".into(),
            },
        ];
        (series, events)
    }

    /// Labels that overlap in a lane, and lines that cross labels.
    fn faults(xs: &[i32], widths: &[i32], at: &[(usize, bool)]) -> (usize, usize) {
        let span = |i: usize| {
            if at[i].1 {
                (xs[i] - PAD - widths[i], xs[i])
            } else {
                (xs[i], xs[i] + PAD + widths[i])
            }
        };
        let (mut overlaps, mut crossings) = (0, 0);
        for i in 0..xs.len() {
            for j in 0..xs.len() {
                let (a, b) = (span(i), span(j));
                if i < j && at[i].0 == at[j].0 && !apart((a, at[i].1), (b, at[j].1)) {
                    overlaps += 1;
                }
                // j's line rises through lanes below its own.
                if i != j && at[i].0 < at[j].0 && a.0 < xs[j] && xs[j] < a.1 {
                    crossings += 1;
                }
            }
        }
        (overlaps, crossings)
    }

    #[test]
    fn labels_take_sides_and_lanes_without_crossing() {
        // Far apart: one lane, all to the right.
        let far = place_labels(&[100, 400, 700], &[100, 100, 100], 1400);
        assert_eq!(far, vec![(0, false); 3]);
        // Two close (kill, restart): one lane, the first hung left.
        let two = place_labels(&[500, 520], &[100, 100], 1400);
        assert_eq!(two, vec![(0, true), (0, false)]);
        // Three and more close: lanes, and no line through a label.
        for xs in [
            vec![500, 510, 520],
            vec![500, 505, 510, 515, 520],
            vec![100, 150, 180, 600, 640, 1350],
            vec![300, 300, 300, 420],
        ] {
            let w = vec![110; xs.len()];
            let at = place_labels(&xs, &w, 1400);
            assert_eq!(faults(&xs, &w, &at), (0, 0), "{xs:?} -> {at:?}");
        }
        // At the right edge: hung left.
        assert_eq!(place_labels(&[1350], &[120], 1400), vec![(0, true)]);
        assert!(place_labels(&[], &[], 1400).is_empty());
    }

    #[test]
    fn renders_a_storm() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (s, e) = storm();
        let paths =
            throughput_over_time(dir.path(), "storm", "Storm A over time", &s, &e).expect("plot");
        super::super::test_util::check(&paths, "Storm A over time");
        let svg = std::fs::read_to_string(&paths[0]).expect("svg");
        assert!(svg.contains("kill node-2") && svg.contains("restart node-2"));
    }

    #[test]
    fn labels_that_touch_go_to_other_lanes() {
        super::super::fonts().expect("fonts");
        let (s, e) = storm();
        let t = Timeline::new("x", &s, &e).expect("layout");
        let at = |l: &str| {
            let p = t.labels.iter().find(|p| p.text == l).expect(l);
            (p.lane, p.left)
        };
        // Close pairs share the lane, back to back.
        assert_eq!(at("kill node-2"), (0, true));
        assert_eq!(at("restart node-2"), (0, false));
        assert_eq!(at("pause node-1"), (0, true));
        assert_eq!(at("resume node-1"), (0, false));
        assert!(t.key.is_empty());
        // The last label hangs left of its line, inside the figure.
        assert!(t.labels.iter().find(|p| p.at_s == 59.5).expect("last").left);
    }

    #[test]
    fn crowded_events_become_numbers_with_a_key() {
        super::super::fonts().expect("fonts");
        let (s, _) = storm();
        let e: Vec<Event> = (0..40)
            .map(|i| Event {
                at_s: 10.0 + i as f64 * 0.05,
                label: format!("kill node-{i}"),
            })
            .collect();
        let t = Timeline::new("x", &s, &e).expect("layout");
        assert_eq!(t.key.len(), 40);
        assert!(t.lanes <= MAX_NUMBER_LANES);
        let dir = tempfile::tempdir().expect("tempdir");
        let paths = throughput_over_time(dir.path(), "crowd", "Crowded", &s, &e).expect("plot");
        super::super::test_util::check(&paths, "Crowded");
    }

    #[test]
    fn one_series_no_events_and_nothing_at_all() {
        let dir = tempfile::tempdir().expect("tempdir");
        let one = [TimeSeries {
            label: "only".into(),
            points: vec![(0.0, 10.0), (1.0, 12.0), (2.0, f64::NAN), (3.0, 11.0)],
        }];
        let paths =
            throughput_over_time(dir.path(), "one", "Just one line", &one, &[]).expect("plot");
        super::super::test_util::check(&paths, "Just one line");
        let paths =
            throughput_over_time(dir.path(), "none", "Nothing yet", &[], &[]).expect("empty plot");
        super::super::test_util::check(&paths, "Nothing yet");
        let empty = [TimeSeries {
            label: "empty".into(),
            points: vec![],
        }];
        let ev = [Event {
            at_s: 5.0,
            label: "kill node-1".into(),
        }];
        let paths =
            throughput_over_time(dir.path(), "ev", "Events only", &empty, &ev).expect("plot");
        super::super::test_util::check(&paths, "Events only");
    }

    #[test]
    fn a_bad_name_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(throughput_over_time(dir.path(), "a/b", "t", &[], &[]).is_err());
    }

    /// Writes the figure into /tmp/plots-view for a person to look at.
    #[test]
    #[ignore = "writes into /tmp for viewing"]
    fn view() {
        let (s, e) = storm();
        let dir = Path::new("/tmp/plots-view");
        let p = throughput_over_time(
            dir,
            "storm-throughput",
            "Storm: 4 KiB reads, uniform, node-2 killed",
            &s,
            &e,
        )
        .expect("plot");
        println!("{p:?}");
        let mut cluster = e.clone();
        for (t, l) in [
            (45.0, "pause node-3"),
            (45.3, "kill node-4"),
            (45.6, "restart node-4"),
            (46.0, "resume node-3"),
            (30.0, "kill node-1"),
            (30.0, "kill node-3"),
        ] {
            cluster.push(Event {
                at_s: t,
                label: l.into(),
            });
        }
        let p = throughput_over_time(
            dir,
            "storm-cluster",
            "Storm: clustered events",
            &s,
            &cluster,
        )
        .expect("plot");
        println!("{p:?}");
        let crowd: Vec<Event> = (0..30)
            .map(|i| Event {
                at_s: 15.0 + i as f64 * 0.4,
                label: format!("kill node-{}", i % 5),
            })
            .collect();
        let p = throughput_over_time(dir, "storm-crowded", "Storm: many events", &s, &crowd)
            .expect("plot");
        println!("{p:?}");
    }
}
