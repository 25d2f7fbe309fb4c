//! Output: a human table or one JSON object, and medians.

use serde::Serialize;
use std::path::PathBuf;

/// Output flags shared by every bench.
#[derive(clap::Args, Clone, Debug)]
pub struct Output {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Folder for the JSON (and, for scaling benches, the plots: SVG and PNG).
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
}

pub fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Print `{"bench", "machine", "params", "results"}` as JSON, or a table.
pub fn emit<P: Serialize, R: Serialize>(
    bench: &str,
    output: &Output,
    params: &P,
    results: &[R],
    table: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    let machine = crate::machine::describe();
    let doc = serde_json::json!({ "bench": bench, "machine": machine, "params": params, "results": results });
    std::fs::create_dir_all(&output.out)?;
    std::fs::write(
        output.out.join(format!("{bench}.json")),
        serde_json::to_string_pretty(&doc)?,
    )?;
    if output.json {
        println!("{}", serde_json::to_string(&doc)?);
    } else {
        println!("{bench}: {machine}");
        println!("params: {}", serde_json::to_string(&params_only(params)?)?);
        print!("{}", table());
    }
    Ok(())
}

/// A plain text table with right-aligned columns.
pub fn table(head: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let line = |cells: Vec<&str>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:>width$}", width = w[i]))
            .collect::<Vec<_>>()
            .join("  ")
    };
    let mut s = line(head.to_vec()) + "\n";
    for r in rows {
        s += &line(r.iter().map(String::as_str).collect());
        s.push('\n');
    }
    s
}

pub fn si(x: f64) -> String {
    if x >= 1e9 {
        format!("{:.2}G", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// The `args` part of a params object, when it has one (the summary is
/// printed under the table in human mode).
fn params_only<P: Serialize>(params: &P) -> anyhow::Result<serde_json::Value> {
    let v = serde_json::to_value(params)?;
    Ok(v.get("args").cloned().unwrap_or(v))
}
