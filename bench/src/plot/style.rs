//! The look every plot shares: Okabe–Ito colours paired with distinct
//! marker shapes (so series differ in greyscale print and for colour-blind
//! readers), text sizes, a legend drawn under the charts, and the number
//! formats of axis ticks.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// The font family every text uses; `super::fonts` registers it.
pub(crate) const FONT: &str = "sans-serif";
pub(crate) const TITLE: u32 = 24;
pub(crate) const SUBTITLE: u32 = 15;
pub(crate) const CAPTION: u32 = 18;
pub(crate) const TICK: u32 = 15;
pub(crate) const DESC: u32 = 16;
pub(crate) const LEGEND: u32 = 15;
pub(crate) const NOTE: u32 = 14;

/// Reference lines (ideal scaling) and event lines.
pub(crate) const GREY: RGBColor = RGBColor(0x80, 0x80, 0x80);
pub(crate) const DARK: RGBColor = RGBColor(0x40, 0x40, 0x40);

/// Okabe & Ito (2008), "Color Universal Design": eight colours told apart
/// by readers with any common colour-vision deficiency.
pub(crate) const OKABE_ITO: [RGBColor; 8] = [
    RGBColor(0x00, 0x00, 0x00), // black
    RGBColor(0xE6, 0x9F, 0x00), // orange
    RGBColor(0x56, 0xB4, 0xE9), // sky blue
    RGBColor(0x00, 0x9E, 0x73), // bluish green
    RGBColor(0xF0, 0xE4, 0x42), // yellow
    RGBColor(0x00, 0x72, 0xB2), // blue
    RGBColor(0xD5, 0x5E, 0x00), // vermillion
    RGBColor(0xCC, 0x79, 0xA7), // reddish purple
];

/// The order series take the palette in: strongest contrast on white first,
/// yellow (faint on white) last.
const ORDER: [usize; 8] = [5, 6, 3, 7, 1, 2, 0, 4];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Marker {
    Circle,
    Square,
    TriangleUp,
    Diamond,
    Cross,
    TriangleDown,
    Plus,
    Star,
}

impl Marker {
    pub(crate) const ALL: [Marker; 8] = [
        Marker::Circle,
        Marker::Square,
        Marker::TriangleUp,
        Marker::Diamond,
        Marker::Cross,
        Marker::TriangleDown,
        Marker::Plus,
        Marker::Star,
    ];

    /// The outline of the marker centred on `c` (backend pixels), `r` its
    /// radius; every shape is a filled polygon of about the same area.
    pub(crate) fn polygon(self, c: (i32, i32), r: f64) -> Vec<(i32, i32)> {
        let pts: Vec<(f64, f64)> = match self {
            Marker::Circle => (0..24)
                .map(|i| {
                    let a = i as f64 * std::f64::consts::TAU / 24.0;
                    (r * a.cos(), r * a.sin())
                })
                .collect(),
            Marker::Square => {
                let h = r * 0.85;
                vec![(-h, -h), (h, -h), (h, h), (-h, h)]
            }
            Marker::TriangleUp => vec![(0.0, -1.25 * r), (1.1 * r, 0.8 * r), (-1.1 * r, 0.8 * r)],
            Marker::TriangleDown => {
                vec![(0.0, 1.25 * r), (1.1 * r, -0.8 * r), (-1.1 * r, -0.8 * r)]
            }
            Marker::Diamond => vec![(0.0, -1.3 * r), (r, 0.0), (0.0, 1.3 * r), (-r, 0.0)],
            Marker::Plus => plus(r * 1.2, r * 0.38, 0.0),
            Marker::Cross => plus(r * 1.3, r * 0.38, std::f64::consts::FRAC_PI_4),
            Marker::Star => (0..10)
                .map(|i| {
                    let a = i as f64 * std::f64::consts::PI / 5.0 - std::f64::consts::FRAC_PI_2;
                    let rr = if i % 2 == 0 { 1.35 * r } else { 0.55 * r };
                    (rr * a.cos(), rr * a.sin())
                })
                .collect(),
        };
        pts.into_iter()
            .map(|(x, y)| (c.0 + x.round() as i32, c.1 + y.round() as i32))
            .collect()
    }
}

/// A plus sign of half-length `l` and half-width `w`, turned by `turn`.
fn plus(l: f64, w: f64, turn: f64) -> Vec<(f64, f64)> {
    let (s, c) = turn.sin_cos();
    [
        (-w, -l),
        (w, -l),
        (w, -w),
        (l, -w),
        (l, w),
        (w, w),
        (w, l),
        (-w, l),
        (-w, w),
        (-l, w),
        (-l, -w),
        (-w, -w),
    ]
    .into_iter()
    .map(|(x, y)| (x * c - y * s, x * s + y * c))
    .collect()
}

/// How one series is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Look {
    pub color: RGBColor,
    pub marker: Marker,
    pub dashed: bool,
}

/// The look of the `i`-th series: colour and marker both change from one
/// series to the next; past eight series the line turns dashed and the
/// markers shift, so no two of the first sixteen look alike.
pub(crate) fn look(i: usize) -> Look {
    let round = i / 8;
    Look {
        color: OKABE_ITO[ORDER[i % 8]],
        marker: Marker::ALL[(i + round) % 8],
        dashed: round % 2 == 1,
    }
}

pub(crate) fn text(size: u32) -> TextStyle<'static> {
    (FONT, size).into_font().color(&BLACK)
}

/// The width and height of `s` in pixels, as the backends will lay it out.
pub(crate) fn text_size(s: &str, size: u32) -> anyhow::Result<(u32, u32)> {
    (FONT, size)
        .into_font()
        .box_size(s)
        .map_err(|e| anyhow::anyhow!("measuring {s:?} in {FONT}: {e}"))
}

/// A line through `pts`, solid or dashed.
pub(crate) fn line<DB, X, Y>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<X, Y>>,
    pts: &[(f64, f64)],
    color: RGBColor,
    width: u32,
    dashed: bool,
) -> anyhow::Result<()>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let style = color.stroke_width(width);
    if dashed {
        chart.draw_series(DashedLineSeries::new(pts.iter().copied(), 10, 6, style))?;
    } else {
        chart.draw_series(LineSeries::new(pts.iter().copied(), style))?;
    }
    Ok(())
}

/// A marker at each of `pts`, with a white rim so that overlapping markers
/// stay apart.
pub(crate) fn markers<DB, X, Y>(
    chart: &ChartContext<'_, DB, Cartesian2d<X, Y>>,
    pts: &[(f64, f64)],
    marker: Marker,
    color: RGBColor,
    r: f64,
) -> anyhow::Result<()>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let screen = chart.plotting_area().use_screen_coord();
    for p in pts {
        let c = chart.backend_coord(p);
        draw_marker(&screen, c, marker, color, r)?;
    }
    Ok(())
}

/// One marker at `c` in screen pixels of `screen`.
pub(crate) fn draw_marker<DB>(
    screen: &DrawingArea<DB, Shift>,
    c: (i32, i32),
    marker: Marker,
    color: RGBColor,
    r: f64,
) -> anyhow::Result<()>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
{
    screen.draw(&Polygon::new(marker.polygon(c, r + 1.5), WHITE.filled()))?;
    screen.draw(&Polygon::new(marker.polygon(c, r), color.filled()))?;
    Ok(())
}

/// Text with a white box behind it, so that it stays legible over lines.
pub(crate) fn boxed_text<DB>(
    screen: &DrawingArea<DB, Shift>,
    s: &str,
    at: (i32, i32),
    pos: Pos,
    size: u32,
    color: &RGBColor,
) -> anyhow::Result<()>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
{
    let (w, h) = text_size(s, size)?;
    let (w, h) = (w as i32, h as i32);
    let x0 = match pos.h_pos {
        HPos::Left => at.0,
        HPos::Right => at.0 - w,
        HPos::Center => at.0 - w / 2,
    };
    let y0 = match pos.v_pos {
        VPos::Top => at.1,
        VPos::Bottom => at.1 - h,
        VPos::Center => at.1 - h / 2,
    };
    screen.draw(&Rectangle::new(
        [(x0 - 3, y0 - 2), (x0 + w + 3, y0 + h + 2)],
        WHITE.mix(0.85).filled(),
    ))?;
    screen.draw(&Text::new(
        s.to_owned(),
        (x0, y0),
        (FONT, size).into_font().color(color),
    ))?;
    Ok(())
}

/// One legend entry: a sample of the line and/or marker, then the text.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub text: String,
    pub color: RGBColor,
    pub marker: Option<Marker>,
    /// `None`: no line; `Some(dashed)`: a solid or dashed line.
    pub line: Option<bool>,
}

impl Entry {
    pub(crate) fn series(text: impl Into<String>, look: Look) -> Entry {
        Entry {
            text: text.into(),
            color: look.color,
            marker: Some(look.marker),
            line: Some(look.dashed),
        }
    }
}

const SAMPLE_W: i32 = 44;
const ENTRY_GAP: i32 = 30;
const ROW_H: i32 = 26;

/// Where each entry of a legend goes, flowing left to right and wrapping
/// at `width`: (row, x offset) per entry, and the number of rows. Each row
/// is centred.
pub(crate) fn flow(widths: &[i32], width: i32) -> (Vec<(i32, i32)>, i32) {
    let mut rows: Vec<Vec<(usize, i32)>> = vec![vec![]];
    let mut x = 0;
    for (i, &w) in widths.iter().enumerate() {
        let need = w + if x > 0 { ENTRY_GAP } else { 0 };
        if x > 0 && x + need > width {
            rows.push(vec![]);
            x = 0;
        }
        let start = if x > 0 { x + ENTRY_GAP } else { 0 };
        if let Some(r) = rows.last_mut() {
            r.push((i, start));
        }
        x = start + w;
    }
    let mut out = vec![(0, 0); widths.len()];
    for (ri, r) in rows.iter().enumerate() {
        let used = r.last().map(|&(i, s)| s + widths[i]).unwrap_or(0);
        let shift = ((width - used) / 2).max(0);
        for &(i, s) in r {
            out[i] = (ri as i32, s + shift);
        }
    }
    let n = if widths.is_empty() {
        0
    } else {
        rows.len() as i32
    };
    (out, n)
}

fn entry_widths(entries: &[Entry]) -> anyhow::Result<Vec<i32>> {
    entries
        .iter()
        .map(|e| Ok(SAMPLE_W + 8 + text_size(&e.text, LEGEND)?.0 as i32))
        .collect()
}

/// The height a legend of `entries` takes in `width` pixels.
pub(crate) fn legend_height(entries: &[Entry], width: u32) -> anyhow::Result<u32> {
    let (_, rows) = flow(&entry_widths(entries)?, width as i32 - 40);
    Ok(if rows == 0 {
        0
    } else {
        (rows * ROW_H + 16) as u32
    })
}

/// Draws the legend in `area` (as tall as `legend_height` said).
pub(crate) fn legend<DB>(area: &DrawingArea<DB, Shift>, entries: &[Entry]) -> anyhow::Result<()>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
{
    let (w, _) = area.dim_in_pixel();
    let widths = entry_widths(entries)?;
    let (pos, _) = flow(&widths, w as i32 - 40);
    let screen = area.strip_coord_spec();
    for (e, &(row, x)) in entries.iter().zip(&pos) {
        let x = x + 20;
        let y = 8 + row * ROW_H + ROW_H / 2;
        if let Some(dashed) = e.line {
            let style = e.color.stroke_width(2);
            let pts = [(x, y), (x + SAMPLE_W, y)];
            if dashed {
                screen.draw(&plotters::element::DashedPathElement::new(pts, 8, 5, style))?;
            } else {
                screen.draw(&PathElement::new(pts.to_vec(), style))?;
            }
        }
        if let Some(m) = e.marker {
            draw_marker(&screen, (x + SAMPLE_W / 2, y), m, e.color, 5.0)?;
        }
        screen.draw(&Text::new(
            e.text.clone(),
            (x + SAMPLE_W + 8, y),
            text(LEGEND).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }
    Ok(())
}

/// A linear axis over `lo..hi` whose ticks are exactly `ticks`.
/// (`with_key_points` on a plain `f64` range leaves no default formatter
/// for the mesh; this one has it.)
#[derive(Clone, Debug)]
#[allow(
    dead_code,
    reason = "used by `cdf`, whose caller (storm) is being written"
)]
pub(crate) struct TickedAxis {
    pub lo: f64,
    pub hi: f64,
    pub ticks: Vec<f64>,
}

impl Ranged for TickedAxis {
    type FormatOption = plotters::coord::ranged1d::DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let f = (v - self.lo) / (self.hi - self.lo);
        limit.0 + ((limit.1 - limit.0) as f64 * f + 1e-3).floor() as i32
    }

    fn key_points<Hint: plotters::coord::ranged1d::KeyPointHint>(&self, _: Hint) -> Vec<f64> {
        self.ticks.clone()
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

/// Key points of a log axis over `lo..hi`: 1, 2, 5 times powers of ten;
/// powers of ten alone where that gives more than `most`; every integer
/// mantissa where it gives fewer than three.
pub(crate) fn ticks_125(lo: f64, hi: f64, most: usize) -> Vec<f64> {
    let pick = |mantissas: &[f64]| -> Vec<f64> {
        if !(lo > 0.0 && hi >= lo && hi.is_finite()) {
            return vec![];
        }
        let (d0, d1) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
        (d0..=d1)
            .flat_map(|d| mantissas.iter().map(move |m| m * 10f64.powi(d)))
            .filter(|v| *v >= lo * (1.0 - 1e-9) && *v <= hi * (1.0 + 1e-9))
            .collect()
    };
    let t = pick(&[1.0, 2.0, 5.0]);
    if t.len() > most {
        // Many decades: powers of ten only.
        pick(&[1.0])
    } else if t.len() >= 3 {
        t
    } else {
        pick(&[1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    }
}

/// The largest 1-2-5 value at or below `v` (v > 0).
pub(crate) fn floor_125(v: f64) -> f64 {
    let d = 10f64.powi(v.log10().floor() as i32);
    [5.0, 2.0, 1.0]
        .into_iter()
        .map(|m| m * d)
        .find(|&x| x <= v * (1.0 + 1e-9))
        .unwrap_or(d)
}

/// The smallest 1-2-5 value at or above `v` (v > 0).
pub(crate) fn ceil_125(v: f64) -> f64 {
    let d = 10f64.powi(v.log10().floor() as i32);
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * d)
        .find(|&x| x >= v * (1.0 - 1e-9))
        .unwrap_or(10.0 * d)
}

/// `v` with up to three significant digits and no trailing zeros.
pub(crate) fn short(v: f64) -> String {
    let digits = if v.abs() >= 100.0 {
        0
    } else if v.abs() >= 10.0 {
        1
    } else {
        2
    };
    short_digits(v, digits)
}

/// `v` with `digits` decimals, trailing zeros dropped.
pub(crate) fn short_digits(v: f64, digits: usize) -> String {
    let s = format!("{v:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

/// An axis tick in SI units: 500k, 1.5M, 2G.
pub(crate) fn si_tick(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{}G", short(v / 1e9))
    } else if a >= 1e6 {
        format!("{}M", short(v / 1e6))
    } else if a >= 1e3 {
        format!("{}k", short(v / 1e3))
    } else {
        short(v)
    }
}

/// A latency given in microseconds, in the unit that reads best.
#[allow(
    dead_code,
    reason = "used by `cdf`, whose caller (storm) is being written"
)]
pub(crate) fn latency(us: f64) -> String {
    if us < 1.0 {
        format!("{} ns", short(us * 1e3))
    } else if us < 1e3 {
        format!("{} µs", short(us))
    } else if us < 1e6 {
        format!("{} ms", short(us / 1e3))
    } else {
        format!("{} s", short(us / 1e6))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looks_differ_in_colour_and_marker() {
        for i in 0..8 {
            for j in 0..i {
                assert_ne!(look(i).color, look(j).color);
                assert_ne!(look(i).marker, look(j).marker);
            }
        }
        for i in 0..16 {
            for j in 0..i {
                assert_ne!(look(i), look(j), "{i} and {j}");
            }
        }
    }

    #[test]
    fn ticks_are_1_2_5() {
        assert_eq!(
            ticks_125(0.8, 60.0, 9),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0]
        );
        assert_eq!(ticks_125(1.0, 1e4, 9), vec![1.0, 10.0, 100.0, 1e3, 1e4]);
        assert_eq!(ticks_125(3.0, 4.0, 9), vec![3.0, 4.0]);
        assert!(ticks_125(0.0, 1.0, 9).is_empty());
        assert_eq!(floor_125(3.7e6), 2e6);
        assert_eq!(ceil_125(3.7e6), 5e6);
        assert_eq!(ceil_125(6e6), 1e7);
        assert_eq!(floor_125(1e3), 1e3);
    }

    #[test]
    fn numbers_read_short() {
        assert_eq!(si_tick(2e6), "2M");
        assert_eq!(si_tick(1.5e6), "1.5M");
        assert_eq!(si_tick(500e3), "500k");
        assert_eq!(si_tick(0.0), "0");
        assert_eq!(latency(0.5), "500 ns");
        assert_eq!(latency(12.34), "12.3 µs");
        assert_eq!(latency(2500.0), "2.5 ms");
    }

    #[test]
    fn legend_flows_and_wraps() {
        let (pos, rows) = flow(&[100, 100, 100], 250);
        assert_eq!(rows, 2);
        assert_eq!(pos[0].0, 0);
        assert_eq!(pos[1].0, 0);
        assert_eq!(pos[2].0, 1);
        assert!(pos[1].1 >= pos[0].1 + 100 + ENTRY_GAP);
        assert_eq!(flow(&[], 100).1, 0);
    }
}
