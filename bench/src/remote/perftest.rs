//! The RDMA floor: perftest's `ib_read_lat` and `ib_read_bw` between this
//! machine and the owner's, as rows beside pagewire's.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::{Row, cluster};

/// perftest's 4 KiB READ latency and bandwidth on the RDMA link between
/// this machine and the owner's (one run of each): the server on the
/// owner's machine, the client here. Rows `perftest`/`ib_read_lat` (p50 = t_typical, p99 = its
/// 99 % percentile, ops/s = 1/t_avg) and `perftest`/`ib_read_bw`
/// (ops/s = its message rate; no latency).
pub(super) fn perftest_rows(
    on: &cluster::Placement,
    device: &str,
    iters: u64,
    skipped: &mut Vec<String>,
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for tool in ["ib_read_lat", "ib_read_bw"] {
        let port = fastrand::u16(18_000..19_000).to_string();
        let common = [
            "-d",
            device,
            "-s",
            "4096",
            "-n",
            &iters.to_string(),
            "-F",
            "-p",
            &port,
        ];
        let mut server = on.command(Path::new(tool));
        server
            .args(common)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        crate::storm::die_with_parent(&mut server);
        let mut server = match server.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                skipped.push(format!("perftest: {tool} not found, its row skipped"));
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("starting the {tool} server")),
        };
        // The server needs a moment to listen (seconds under an emulated CPU).
        let deadline = Instant::now() + Duration::from_secs(60);
        let out = loop {
            std::thread::sleep(Duration::from_millis(500));
            let o = std::process::Command::new(tool)
                .args(common)
                .arg(&on.ip)
                .stdin(std::process::Stdio::null())
                .output()
                .with_context(|| format!("running {tool}"))?;
            if o.status.success() || Instant::now() > deadline {
                break o;
            }
        };
        let _ = server.kill();
        let _ = server.wait();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            skipped.push(format!(
                "perftest: {tool} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
            continue;
        }
        let row = |(ops, p50, p99, max): Parsed| Row {
            path: "perftest",
            transport: tool,
            index_cache: "-",
            owner: "-",
            clients: 1,
            run: 1,
            spin_us: None,
            ops_per_sec: ops,
            p50_us: p50,
            p99_us: p99,
            max_us: max,
            owner_cpu_us_per_read: None,
            reader_cpu_us_per_read: None,
            round_trips_per_read: 1.0,
            wrong_reads: 0,
            retries: 0,
            validation_failures: 0,
            fallbacks: 0,
            repeats_ops_per_sec: vec![ops],
            reader_spin: None,
            owner_spin: None,
        };
        match parse(tool, &text) {
            Ok(parsed) => rows.push(row(parsed)),
            Err(why) => {
                let note = format!("perftest: {tool}: {why}, its row skipped");
                // Once, however many repeats hit it.
                if !skipped.contains(&note) {
                    skipped.push(note);
                }
            }
        }
    }
    Ok(rows)
}

/// `(ops/s, p50 us, p99 us, max us)` of one perftest run.
type Parsed = (f64, f64, f64, f64);

/// [`Parsed`] from `tool`'s output: the line that starts with the message
/// size. `ib_read_lat`: `bytes iters t_min t_max t_typical t_avg t_stdev
/// p99 p99.9` (ops/s = 1/t_avg); `ib_read_bw`: `bytes iters bw_peak bw_avg
/// msg_rate(Mpps)` (no latency: 0).
fn parse(tool: &str, text: &str) -> Result<Parsed, String> {
    let nums: Vec<f64> = text
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("4096 "))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|v| v.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    // Under an emulated CPU its cycle clock can read `inf`, which Rust
    // parses: a row of inf would beat (or divide) anything beside it.
    let usable = |v: &f64| v.is_finite() && *v > 0.0;
    match (tool, nums.as_slice()) {
        ("ib_read_lat", [_, _, _, max, typical, avg, _, p99, ..]) => {
            if [typical, avg, p99].into_iter().all(usable) {
                Ok((
                    1e6 / avg,
                    *typical,
                    *p99,
                    if usable(max) { *max } else { 0.0 },
                ))
            } else {
                Err(format!(
                    "no usable latency (typical {typical}, avg {avg}, p99 {p99} us: its clock under emulation)"
                ))
            }
        }
        ("ib_read_bw", [_, _, _, _, mpps, ..]) if usable(mpps) => Ok((mpps * 1e6, 0.0, 0.0, 0.0)),
        _ => Err(format!("cannot read its output: {}", text.trim())),
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn reads_perftest_lines() {
        let lat = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n 4096       1000          366.19         3375.73      524.18            579.81       295.26          2584.95                 3375.73\n";
        let (ops, p50, p99, max) = parse("ib_read_lat", lat).expect("a good line");
        assert_eq!((p50, p99, max), (524.18, 2584.95, 3375.73));
        assert!((ops - 1e6 / 579.81).abs() < 1e-6);
        let bw = " 4096       2000             24.66              17.29 \t\t   0.004425\n";
        assert_eq!(parse("ib_read_bw", bw), Ok((4425.0, 0.0, 0.0, 0.0)));
    }

    /// What CI's soft-RoCE VM printed once: its clock gave `inf`.
    #[test]
    fn an_inf_latency_is_no_row() {
        let lat = " 4096 1000 inf inf inf \t inf \t-nan \t\tinf \t\tinf \n";
        let e = parse("ib_read_lat", lat).expect_err("inf is no latency");
        assert!(e.contains("no usable latency"), "{e}");
        assert!(parse("ib_read_lat", "nothing here").is_err());
    }
}
