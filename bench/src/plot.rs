//! Scaling plots (SVG) with plotters: ops/s against threads, one line per
//! index and mode, one picture per workload.

use plotters::prelude::*;
use std::path::Path;

pub fn scaling(dir: &Path, bench: &str, rows: &[crate::local::Row]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut workloads: Vec<&str> = rows.iter().map(|r| r.workload).collect();
    workloads.dedup();
    workloads.sort();
    workloads.dedup();
    for w in workloads {
        let rs: Vec<&crate::local::Row> = rows.iter().filter(|r| r.workload == w).collect();
        let max_t = rs.iter().map(|r| r.threads).max().unwrap_or(1) as f64;
        let max_y = rs.iter().map(|r| r.ops_per_sec).fold(0.0, f64::max) * 1.1 / 1e6;
        let path = dir.join(format!("{bench}-{w}.svg"));
        let root = SVGBackend::new(&path, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("pagewire {bench}: {w} reads, ops/s by threads (medians)"),
                ("sans-serif", 20),
            )
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.5..max_t + 0.5, 0.0..max_y.max(0.001))?;
        chart
            .configure_mesh()
            .x_desc("threads")
            .y_desc("million ops/s")
            .draw()?;
        let mut series: Vec<(String, &str)> =
            rs.iter().map(|r| (r.index.clone(), r.mode)).collect();
        series.sort();
        series.dedup();
        for (i, (index, mode)) in series.iter().enumerate() {
            let mut pts: Vec<(f64, f64)> = rs
                .iter()
                .filter(|r| &r.index == index && r.mode == *mode)
                .map(|r| (r.threads as f64, r.ops_per_sec / 1e6))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                .label(format!("{index} {mode}"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()?;
        root.present()?;
    }
    Ok(())
}
