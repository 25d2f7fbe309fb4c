//! The fault schedule: `--kill node-2@10s`, `--restart node-2@20s`,
//! `--pause node-1@5s+4s` (SIGSTOP, then SIGCONT 4 s later), `--cut
//! node-2@10s` and `--heal node-2@16s` (a `--hosts` host's network), with
//! `coordinator` as a target of kill, restart and pause.

use std::time::Duration;

use anyhow::{Context, bail};

use super::Args;
use super::procs::Cluster;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    Kill,
    Restart,
    Pause,
    Resume,
    Cut,
    Heal,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Fault {
    pub kind: FaultKind,
    pub target: String,
    /// Seconds after the storm phase starts.
    pub at_s: f64,
}

impl Fault {
    pub fn describe(&self) -> String {
        let what = match self.kind {
            FaultKind::Kill => "kill -9",
            FaultKind::Restart => "restart",
            FaultKind::Pause => "SIGSTOP",
            FaultKind::Resume => "SIGCONT",
            FaultKind::Cut => "cut off",
            FaultKind::Heal => "heal",
        };
        format!("{what} {}", self.target)
    }
}

/// `1500ms`, `10s`, `2.5s`, or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, scale) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 10s, 1500ms)"))?;
    if !v.is_finite() || v < 0.0 || v * scale > 86_400.0 {
        return Err(format!("{s:?} is not a duration between 0 and a day"));
    }
    Ok(Duration::from_secs_f64(v * scale))
}

/// `target@time`, with `+length` when `pause`.
fn parse_one(flag: &str, spec: &str, pause: bool) -> anyhow::Result<(String, f64, Option<f64>)> {
    let (target, when) = spec
        .split_once('@')
        .with_context(|| format!("--{flag} {spec:?}: expected TARGET@TIME, e.g. node-2@10s"))?;
    let (at, len) = match (pause, when.split_once('+')) {
        (true, Some((at, len))) => (at, Some(len)),
        (true, None) => bail!("--{flag} {spec:?}: expected TARGET@TIME+LENGTH, e.g. node-1@5s+4s"),
        (false, Some(_)) => bail!("--{flag} {spec:?}: only --pause takes +LENGTH"),
        (false, None) => (when, None),
    };
    let at = parse_duration(at).map_err(|e| anyhow::anyhow!("--{flag}: {e}"))?;
    let len = len
        .map(parse_duration)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--{flag}: {e}"))?;
    let target = target.trim();
    let ok = target == "coordinator"
        || target
            .strip_prefix("node-")
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|n| n >= 1);
    if !ok {
        bail!("--{flag} {spec:?}: the target is `coordinator` or `node-N` (N from 1)");
    }
    Ok((
        target.to_owned(),
        at.as_secs_f64(),
        len.map(|d| d.as_secs_f64()),
    ))
}

/// Every fault of the command line, in time order, checked against the
/// cluster's shape and the storm's length.
pub fn schedule(a: &Args) -> anyhow::Result<Vec<Fault>> {
    let mut v = Vec::new();
    let mut push = |flag: &str, specs: &[String], kind: FaultKind| -> anyhow::Result<()> {
        for s in specs {
            let (target, at, len) = parse_one(flag, s, kind == FaultKind::Pause)?;
            if matches!(kind, FaultKind::Cut | FaultKind::Heal) {
                if a.hosts.is_none() {
                    bail!("--{flag}: cutting a host off needs --hosts (network-namespace hosts)");
                }
                if target == "coordinator" {
                    bail!("--{flag}: only a node's host can be cut");
                }
            }
            if let Some(len) = len {
                v.push(Fault {
                    kind: FaultKind::Resume,
                    target: target.clone(),
                    at_s: at + len,
                });
            }
            v.push(Fault {
                kind,
                target,
                at_s: at,
            });
        }
        Ok(())
    };
    push("kill", &a.kill, FaultKind::Kill)?;
    push("restart", &a.restart, FaultKind::Restart)?;
    push("pause", &a.pause, FaultKind::Pause)?;
    push("cut", &a.cut, FaultKind::Cut)?;
    push("heal", &a.heal, FaultKind::Heal)?;
    v.sort_by(|x, y| x.at_s.total_cmp(&y.at_s));
    if a.duration.is_zero() && !v.is_empty() {
        bail!("--duration 0s runs no storm, so it takes no faults");
    }
    let nodes = if a.hosts.is_some() {
        usize::MAX
    } else {
        a.nodes
    };
    for f in &v {
        if let Some(n) = f
            .target
            .strip_prefix("node-")
            .and_then(|n| n.parse::<usize>().ok())
            && n > nodes
        {
            bail!("{}: the storm has {} nodes", f.describe(), a.nodes);
        }
        if f.at_s > a.duration.as_secs_f64() && !a.quick {
            bail!(
                "{} at {} s is after the storm's end ({} s)",
                f.describe(),
                f.at_s,
                a.duration.as_secs_f64()
            );
        }
    }
    Ok(v)
}

/// Does `f` to the cluster.
pub fn fire(c: &mut Cluster, f: &Fault) -> anyhow::Result<()> {
    match f.kind {
        FaultKind::Kill => {
            c.proc_mut(&f.target)?.kill();
            Ok(())
        }
        FaultKind::Restart => c.restart(&f.target),
        FaultKind::Pause => c.proc_mut(&f.target)?.signal(libc::SIGSTOP),
        FaultKind::Resume => c.proc_mut(&f.target)?.signal(libc::SIGCONT),
        FaultKind::Cut => c.net(&f.target, false),
        FaultKind::Heal => c.net(&f.target, true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2.5"), Ok(Duration::from_millis(2500)));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("1e9s").is_err());
    }

    #[test]
    fn faults_parse_and_refuse_nonsense() {
        assert_eq!(
            parse_one("kill", "node-2@10s", false).unwrap(),
            ("node-2".into(), 10.0, None)
        );
        assert_eq!(
            parse_one("pause", "node-1@5s+4s", true).unwrap(),
            ("node-1".into(), 5.0, Some(4.0))
        );
        assert!(parse_one("kill", "node-2", false).is_err());
        assert!(parse_one("kill", "node-0@1s", false).is_err());
        assert!(parse_one("kill", "redis@1s", false).is_err());
        assert!(parse_one("kill", "node-1@1s+2s", false).is_err());
        assert!(parse_one("pause", "node-1@1s", true).is_err());
    }

    #[test]
    fn a_run_without_a_storm_takes_no_faults() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let args = |extra: &[&str]| {
            let mut v = vec!["storm"];
            v.extend_from_slice(extra);
            <Cli as clap::Parser>::try_parse_from(v).unwrap().args
        };
        assert!(schedule(&args(&["--duration", "0s"])).unwrap().is_empty());
        let e = schedule(&args(&["--duration", "0s", "--kill", "node-1@1s"])).unwrap_err();
        assert!(e.to_string().contains("no storm"), "{e}");
        assert_eq!(
            schedule(&args(&["--duration", "5s", "--kill", "node-1@1s"]))
                .unwrap()
                .len(),
            1
        );
    }
}
