//! The benches' pictures, each written twice side by side: `<name>.svg`
//! (sharp at any size, text stays text) and `<name>.png` (for a chat, an
//! issue or a terminal image viewer).
//!
//! - [`scaling()`]: `local`'s throughput by threads, one figure per workload.
//! - [`throughput_over_time`]: a storm's ops/s over time, fault events as
//!   labelled vertical lines.
//! - [`latency_cdf`]: read latency distributions on a tail scale.
//!
//! Every figure is drawn by one function generic over the plotters backend,
//! once into the SVG backend and once into an RGB buffer (`raster`) that
//! `png` encodes. Text in the PNG is rasterised by `ab_glyph` from DejaVu Sans,
//! embedded in the binary by the `dejavu` crate (Bitstream Vera licence,
//! DejaVu changes public domain: free to use and redistribute), so a fresh
//! machine needs no system fonts, fontconfig or C library. The SVG names
//! the generic `sans-serif` family; its text is laid out with the same
//! font's metrics.

// The storm bench (being written) calls `cdf` and `timeline`; until it
// lands only the tests do. `allow`, not `expect`: the lint must stay quiet
// once it does.
#[allow(dead_code, reason = "called by the storm bench, being written")]
mod cdf;
mod raster;
mod scaling;
mod style;
#[allow(dead_code, reason = "called by the storm bench, being written")]
mod timeline;

#[allow(unused_imports, reason = "called by the storm bench, being written")]
pub use cdf::latency_cdf;
pub use scaling::scaling;
#[allow(unused_imports, reason = "called by the storm bench, being written")]
pub use timeline::{Event, TimeSeries, throughput_over_time};

use anyhow::Context;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A picture that can be drawn on any backend, at a size known up front.
trait Figure {
    fn size(&self) -> (u32, u32);
    fn draw<DB>(&self, root: &DrawingArea<DB, Shift>) -> anyhow::Result<()>
    where
        DB: DrawingBackend,
        DB::ErrorType: 'static;
}

/// Registers DejaVu Sans as plotters' `sans-serif`, once per process.
fn fonts() -> anyhow::Result<()> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        for (style, bytes) in [
            (FontStyle::Normal, dejavu::sans::regular()),
            (FontStyle::Bold, dejavu::sans::bold()),
        ] {
            plotters::style::register_font(style::FONT, style, bytes).map_err(|_| {
                format!(
                    "the embedded DejaVu Sans ({}) does not parse",
                    style.as_str()
                )
            })?;
        }
        Ok(())
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// Writes `fig` as `<dir>/<name>.svg` and `<dir>/<name>.png`; returns both
/// paths.
fn write(dir: &Path, name: &str, fig: &impl Figure) -> anyhow::Result<Vec<PathBuf>> {
    anyhow::ensure!(
        !name.is_empty() && !name.contains(['/', '\\']),
        "plot name {name:?} must be a plain file name"
    );
    fonts()?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (w, h) = fig.size();

    let svg = dir.join(format!("{name}.svg"));
    {
        let root = SVGBackend::new(&svg, (w, h)).into_drawing_area();
        root.fill(&WHITE)?;
        fig.draw(&root)
            .with_context(|| format!("drawing {}", svg.display()))?;
        root.present()
            .with_context(|| format!("writing {}", svg.display()))?;
    }

    let png_path = dir.join(format!("{name}.png"));
    let mut rgb = vec![0u8; w as usize * h as usize * 3];
    {
        let root = raster::Raster(BitMapBackend::with_buffer(&mut rgb, (w, h))).into_drawing_area();
        root.fill(&WHITE)?;
        fig.draw(&root)
            .with_context(|| format!("drawing {}", png_path.display()))?;
        root.present()?;
    }
    encode_png(&png_path, (w, h), &rgb)?;
    Ok(vec![svg, png_path])
}

fn encode_png(path: &Path, (w, h): (u32, u32), rgb: &[u8]) -> anyhow::Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut out = enc
        .write_header()
        .with_context(|| format!("writing {}", path.display()))?;
    out.write_image_data(rgb)
        .with_context(|| format!("writing {}", path.display()))?;
    out.finish()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Draws a title line and a smaller subtitle line at the top of `root`.
fn header<DB>(root: &DrawingArea<DB, Shift>, title: &str, subtitle: &str) -> anyhow::Result<()>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
{
    use plotters::style::text_anchor::{HPos, Pos, VPos};
    let (w, _) = root.dim_in_pixel();
    let centre = Pos::new(HPos::Center, VPos::Top);
    root.draw(&Text::new(
        title.to_owned(),
        (w as i32 / 2, 12),
        (style::FONT, style::TITLE, FontStyle::Bold)
            .into_font()
            .color(&BLACK)
            .pos(centre),
    ))?;
    if !subtitle.is_empty() {
        root.draw(&Text::new(
            subtitle.to_owned(),
            (w as i32 / 2, 44),
            (style::FONT, style::SUBTITLE)
                .into_font()
                .color(&style::DARK)
                .pos(centre),
        ))?;
    }
    Ok(())
}

/// Height of what [`header`] draws.
fn header_height(subtitle: &str) -> u32 {
    if subtitle.is_empty() { 48 } else { 70 }
}

#[cfg(test)]
mod test_util {
    use std::path::PathBuf;

    /// Both files exist and are more than a stub: the SVG names `title`, the
    /// PNG starts with the PNG signature.
    pub(crate) fn check(paths: &[PathBuf], title: &str) {
        assert_eq!(paths.len(), 2, "{paths:?}");
        let svg = paths
            .iter()
            .find(|p| p.extension().is_some_and(|e| e == "svg"))
            .expect("an svg");
        let png = paths
            .iter()
            .find(|p| p.extension().is_some_and(|e| e == "png"))
            .expect("a png");
        let s = std::fs::read_to_string(svg).expect("reading the svg");
        assert!(s.starts_with("<svg"), "{}", &s[..s.len().min(100)]);
        assert!(s.contains(title), "{} lacks {title:?}", svg.display());
        assert!(s.len() > 2000, "{} is {} bytes", svg.display(), s.len());
        let b = std::fs::read(png).expect("reading the png");
        assert!(b.starts_with(b"\x89PNG\r\n\x1a\n"), "{}", png.display());
        assert!(b.len() > 5000, "{} is {} bytes", png.display(), b.len());
    }
}
