//! The PNG's drawing backend: plotters' bitmap backend with a text
//! rasteriser of our own.
//!
//! plotters' `ab_glyph` text drawing drops each glyph's left side bearing
//! and rounds each glyph's baseline on its own, so letters sit unevenly
//! ("on e-sided", a raised full stop), and it puts the baseline half the
//! font size below the anchor, so text rides above where the SVG puts it.
//! Here glyphs go at their pen positions with bearings and kerning, on one
//! baseline placed so that capitals fill the layout box plotters computed
//! (alignment, anchors and rotation stay plotters'). Everything else is
//! the bitmap backend's.

use ab_glyph::{Font, FontRef, PxScale, ScaleFont, point};
use plotters::prelude::BitMapBackend;
use plotters_backend::text_anchor::{HPos, VPos};
use plotters_backend::{
    BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingBackend, DrawingErrorKind,
    FontStyle,
};
use std::sync::OnceLock;

/// Where the baseline sits below the top of plotters' layout box (whose
/// height is size / 1.24), as a fraction of the font size: the middle of
/// DejaVu's capitals (0.63 of the size) at the middle of the box.
const BASELINE: f32 = 0.716;

pub(crate) struct Raster<'a>(pub BitMapBackend<'a>);

/// DejaVu Sans, regular or bold, parsed once.
fn face(style: FontStyle) -> Option<&'static FontRef<'static>> {
    static REGULAR: OnceLock<Option<FontRef<'static>>> = OnceLock::new();
    static BOLD: OnceLock<Option<FontRef<'static>>> = OnceLock::new();
    match style {
        FontStyle::Bold => BOLD.get_or_init(|| FontRef::try_from_slice(dejavu::sans::bold()).ok()),
        _ => REGULAR.get_or_init(|| FontRef::try_from_slice(dejavu::sans::regular()).ok()),
    }
    .as_ref()
}

/// The pixels of `text` laid out from the pen's origin at the top left of
/// its layout box: (x, y, coverage 0..1).
pub(crate) fn glyph_pixels(font: &FontRef<'_>, size: f32, text: &str) -> Vec<(i32, i32, f32)> {
    let sf = font.as_scaled(PxScale::from(size));
    let mut out = Vec::new();
    let mut pen = 0.0f32;
    let mut prev = None;
    for c in text.chars() {
        let id = sf.glyph_id(c);
        if let Some(p) = prev {
            pen += sf.kern(p, id);
        }
        prev = Some(id);
        let glyph = id.with_scale_and_position(sf.scale(), point(pen, size * BASELINE));
        pen += sf.h_advance(id);
        if let Some(o) = font.outline_glyph(glyph) {
            let b = o.px_bounds();
            let (x0, y0) = (b.min.x as i32, b.min.y as i32);
            o.draw(|x, y, cov| {
                if cov > 0.0 {
                    out.push((x0 + x as i32, y0 + y as i32, cov.min(1.0)));
                }
            });
        }
    }
    out
}

impl DrawingBackend for Raster<'_> {
    type ErrorType = <BitMapBackend<'static> as DrawingBackend>::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.0.get_size()
    }

    fn ensure_prepared(&mut self) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.ensure_prepared()
    }

    fn present(&mut self) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.present()
    }

    fn draw_pixel(
        &mut self,
        point: BackendCoord,
        color: BackendColor,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.draw_pixel(point, color)
    }

    fn draw_line<S: BackendStyle>(
        &mut self,
        from: BackendCoord,
        to: BackendCoord,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.draw_line(from, to, style)
    }

    fn draw_rect<S: BackendStyle>(
        &mut self,
        upper_left: BackendCoord,
        bottom_right: BackendCoord,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.draw_rect(upper_left, bottom_right, style, fill)
    }

    fn draw_path<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        path: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.draw_path(path, style)
    }

    fn draw_circle<S: BackendStyle>(
        &mut self,
        center: BackendCoord,
        radius: u32,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.draw_circle(center, radius, style, fill)
    }

    fn fill_polygon<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        vert: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.fill_polygon(vert, style)
    }

    fn blit_bitmap(
        &mut self,
        pos: BackendCoord,
        (iw, ih): (u32, u32),
        src: &[u8],
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.blit_bitmap(pos, (iw, ih), src)
    }

    fn draw_text<S: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &S,
        pos: BackendCoord,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        let color = style.color();
        if color.alpha == 0.0 {
            return Ok(());
        }
        let ((min_x, min_y), (max_x, max_y)) = style
            .layout_box(text)
            .map_err(|e| DrawingErrorKind::FontError(Box::new(e)))?;
        let (width, height) = (max_x - min_x, max_y - min_y);
        let anchor = style.anchor();
        let dx = match anchor.h_pos {
            HPos::Left => 0,
            HPos::Right => -width,
            HPos::Center => -width / 2,
        };
        let dy = match anchor.v_pos {
            VPos::Top => 0,
            VPos::Center => -height / 2,
            VPos::Bottom => -height,
        };
        let font = face(style.style()).ok_or_else(|| {
            DrawingErrorKind::FontError(Box::new(std::io::Error::other(
                "the embedded DejaVu Sans does not parse",
            )))
        })?;
        let trans = style.transform();
        let (w, h) = self.get_size();
        for (x, y, cov) in glyph_pixels(font, style.size() as f32, text) {
            let (x, y) = trans.transform(x + dx - min_x, y + dy - min_y);
            let (x, y) = (pos.0 + x, pos.1 + y);
            if x >= 0 && x < w as i32 && y >= 0 && y < h as i32 {
                self.0.draw_pixel(
                    (x, y),
                    BackendColor {
                        alpha: color.alpha * f64::from(cov),
                        rgb: color.rgb,
                    },
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glyphs_keep_their_bearings_and_one_baseline() {
        let font = face(FontStyle::Normal).expect("DejaVu parses");
        // "x" and "." share the baseline: the lowest row of ink is the same.
        let bottom = |s: &str| glyph_pixels(font, 20.0, s).iter().map(|p| p.1).max();
        assert_eq!(bottom("x"), bottom("."));
        let left = |s: &str| glyph_pixels(font, 20.0, s).iter().map(|p| p.0).min();
        assert!(left("i").expect("ink") > 0, "left bearing kept");
        // Capitals sit inside the layout box (0..size/1.24).
        let ys: Vec<i32> = glyph_pixels(font, 20.0, "H").iter().map(|p| p.1).collect();
        let (top, bot) = (ys.iter().min().copied(), ys.iter().max().copied());
        assert!(
            top >= Some(0) && bot <= Some((20.0 / 1.24) as i32),
            "{top:?}..{bot:?}"
        );
    }
}
