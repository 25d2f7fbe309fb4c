//! fio, as `pagewire-bench mount` runs it: the command lines of the fill
//! and of each measured job, and the parse of its JSON output and stderr.
//!
//! Every measured job uses the `psync` engine (`pread(2)`), so "queue depth
//! 16" is 16 jobs (`numjobs=16`), each over its own sixteenth of the file
//! (`offset_increment`), and their results are merged (`group_reporting`).
//! `psync` works the same on all four paths: libaio's depth would need
//! `direct=1`, which on the local file would read the disk instead of the
//! page cache that path is meant to measure.
//!
//! Verification (`--verify=crc32c --verify_interval=4096`) is inside the
//! timed job: fio checks every 4 KiB block of every read as it completes,
//! against the header the fill wrote in it (its offset, and a crc32c of the
//! whole block); `time_based` jobs loop over their slice and verify every
//! loop. `--continue_on_error=verify` keeps a job running past a wrong
//! block so that they can be counted.
//!
//! Counting them needs fio's stderr: fio 3.33 reports a crc mismatch inside
//! a read larger than the verify interval on stderr only (its JSON then says
//! `"error": 0, "total_err": 0`; the sample in `testdata/` is one). A read
//! counts as wrong once however many of its blocks are wrong (fio stops
//! checking a read at its first wrong block), so the count is of reads
//! that failed, and 0 of them means 0 wrong bytes.

use std::path::Path;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

/// The access pattern of a measured job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Pattern {
    /// 4 KiB random reads.
    Rand4k,
    /// 1 MiB sequential reads.
    Seq1m,
}

/// One measured job: a pattern at a queue depth (jobs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Job {
    pub pattern: Pattern,
    /// psync jobs reading at once: 1 or 16.
    pub depth: u32,
}

impl Job {
    pub const ALL: [Job; 4] = [
        Job {
            pattern: Pattern::Rand4k,
            depth: 1,
        },
        Job {
            pattern: Pattern::Rand4k,
            depth: 16,
        },
        Job {
            pattern: Pattern::Seq1m,
            depth: 1,
        },
        Job {
            pattern: Pattern::Seq1m,
            depth: 16,
        },
    ];

    pub fn name(&self) -> String {
        match self.pattern {
            Pattern::Rand4k => format!("rand4k-qd{}", self.depth),
            Pattern::Seq1m => format!("seq1m-qd{}", self.depth),
        }
    }

    /// fio's arguments for this job over `file` of `size` bytes for
    /// `seconds`, verified or not.
    pub fn args(&self, file: &Path, size: u64, seconds: f64, verify: bool) -> Vec<String> {
        let jobs = u64::from(self.depth.max(1));
        let slice = size / jobs;
        let (rw, bs) = match self.pattern {
            Pattern::Rand4k => ("randread", "4k"),
            Pattern::Seq1m => ("read", "1M"),
        };
        let mut a = vec![
            format!("--name={}", self.name()),
            format!("--filename={}", file.display()),
            format!("--rw={rw}"),
            format!("--bs={bs}"),
            format!("--size={slice}"),
            format!("--offset_increment={slice}"),
            format!("--numjobs={jobs}"),
            "--ioengine=psync".into(),
            // The local path is the page cache: fio must not drop it first.
            "--invalidate=0".into(),
            "--time_based".into(),
            format!("--runtime={}ms", (seconds * 1000.0).round().max(1.0) as u64),
            "--group_reporting".into(),
            "--output-format=json".into(),
        ];
        if verify {
            a.extend([
                "--verify=crc32c".into(),
                "--verify_interval=4096".into(),
                "--continue_on_error=verify".into(),
                "--verify_state_save=0".into(),
            ]);
        }
        a
    }
}

/// fio's arguments that write `file` (`size` bytes) in 4 KiB blocks, each
/// with a crc32c verify header.
pub fn fill_args(file: &Path, size: u64) -> Vec<String> {
    vec![
        "--name=fill".into(),
        format!("--filename={}", file.display()),
        "--rw=write".into(),
        "--bs=4k".into(),
        format!("--size={size}"),
        "--ioengine=psync".into(),
        "--verify=crc32c".into(),
        "--do_verify=0".into(),
        "--verify_state_save=0".into(),
        "--end_fsync=1".into(),
        "--output-format=json".into(),
    ]
}

/// What one fio run measured (its jobs merged).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Measured {
    pub iops: f64,
    pub bytes_per_sec: f64,
    pub reads: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Reads that failed verification (fio's count or its stderr lines,
    /// the larger).
    pub wrong_reads: u64,
    /// The first few verification messages.
    pub wrong_examples: Vec<String>,
}

#[derive(Deserialize)]
struct Out {
    jobs: Vec<JobOut>,
}

#[derive(Deserialize)]
struct JobOut {
    jobname: String,
    error: i64,
    #[serde(default)]
    total_err: Option<u64>,
    read: Dir,
}

#[derive(Deserialize)]
struct Dir {
    total_ios: u64,
    bw_bytes: f64,
    iops: f64,
    clat_ns: Clat,
}

#[derive(Deserialize)]
struct Clat {
    #[serde(default)]
    percentile: std::collections::BTreeMap<String, f64>,
}

const EILSEQ: i64 = 84;

/// Parses fio's `--output-format=json` stdout (fio may print error lines
/// before the JSON) and its stderr (the verification messages).
pub fn parse(stdout: &str, stderr: &str) -> anyhow::Result<Measured> {
    let at = stdout
        .find("\n{")
        .map(|i| i + 1)
        .or_else(|| stdout.starts_with('{').then_some(0))
        .context("no JSON object in fio's output")?;
    let out: Out = serde_json::Deserializer::from_str(&stdout[at..])
        .into_iter()
        .next()
        .context("empty fio output")?
        .context("parsing fio's JSON")?;
    let [job] = &out.jobs[..] else {
        bail!(
            "fio reported {} jobs, expected one (group_reporting)",
            out.jobs.len()
        );
    };
    if job.error != 0 && job.error != EILSEQ {
        bail!(
            "fio job {} failed: error {} ({})",
            job.jobname,
            job.error,
            std::io::Error::from_raw_os_error(job.error as i32)
        );
    }
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("verify failed") || l.starts_with("verify: bad"))
        .collect();
    let mut wrong = (lines.len() as u64).max(job.total_err.unwrap_or(0));
    if job.error == EILSEQ {
        wrong = wrong.max(1);
    }
    let pct = |p: &str| job.read.clat_ns.percentile.get(p).copied().unwrap_or(0.0) / 1000.0;
    Ok(Measured {
        iops: job.read.iops,
        bytes_per_sec: job.read.bw_bytes,
        reads: job.read.total_ios,
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        wrong_reads: wrong,
        wrong_examples: lines.iter().take(5).map(|l| (*l).to_owned()).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Real fio 3.33 output (Debian bookworm): 16 psync jobs of 4 KiB random
    // reads over 16 MiB, merged, all verified.
    const CLEAN: &str = include_str!("testdata/fio-randread-clean.json");
    // One byte flipped in block 5 of the file; 1 MiB sequential reads that
    // pass it 20 times in 0.3 s. fio's JSON says no error at all: only its
    // stderr has the 20 failures.
    const BAD_OUT: &str = include_str!("testdata/fio-seqread-one-bad-block.json");
    const BAD_ERR: &str = include_str!("testdata/fio-seqread-one-bad-block.stderr");

    #[test]
    fn parses_merged_jobs_with_their_percentiles() {
        let m = parse(CLEAN, "").unwrap();
        assert_eq!(m.reads, 298_010);
        assert!((m.iops - 922_631.578_947).abs() < 1e-3, "{}", m.iops);
        assert_eq!(m.bytes_per_sec, 3_779_098_947.0);
        assert_eq!(m.p50_us, 0.788);
        assert_eq!(m.p99_us, 1.848);
        assert_eq!(m.wrong_reads, 0);
    }

    #[test]
    fn counts_wrong_reads_that_only_stderr_reports() {
        assert!(BAD_OUT.contains("\"total_err\" : 0,"));
        let m = parse(BAD_OUT, BAD_ERR).unwrap();
        assert_eq!(m.wrong_reads, 20);
        assert_eq!(m.reads, 310);
        assert!(m.wrong_examples[0].contains("verify failed at file"));
        assert_eq!(m.p50_us, 230.4);
        // The same output without stderr would pass as clean: stderr is
        // required.
        assert_eq!(parse(BAD_OUT, "").unwrap().wrong_reads, 0);
    }

    #[test]
    fn error_lines_before_the_json_and_fio_errors() {
        let pre =
            format!("fio: pid=5909, err=84/file:io_u.c:2152, func=io_u_sync_complete\n{CLEAN}");
        assert_eq!(parse(&pre, "").unwrap().reads, 298_010);
        let eio = CLEAN.replacen("\"error\" : 0,", "\"error\" : 5,", 1);
        let e = parse(&eio, "").unwrap_err().to_string();
        assert!(e.contains("error 5"), "{e}");
        let ilseq = CLEAN.replacen("\"error\" : 0,", "\"error\" : 84,", 1);
        assert_eq!(parse(&ilseq, "").unwrap().wrong_reads, 1);
        assert!(parse("fio: no such file\n", "").is_err());
    }

    /// The bench's own fio command lines, run for real: clean on the file
    /// fio filled, and one flipped byte caught by every verified job.
    /// Needs fio (Debian package fio).
    #[test]
    fn every_verified_job_catches_one_wrong_byte() {
        let fio = "fio";
        let found = std::process::Command::new(fio)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(found, "this test needs fio (Debian package fio)");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("data");
        let size = 16 << 20;
        let limit = std::time::Duration::from_secs(60);
        super::super::run_fio(fio, &fill_args(&f, size), limit).unwrap();
        let run = |job: &Job, verify: bool| {
            let (out, err) =
                super::super::run_fio(fio, &job.args(&f, size, 0.3, verify), limit).unwrap();
            parse(&out, &err).unwrap()
        };
        for job in &Job::ALL {
            let m = run(job, true);
            assert_eq!(m.wrong_reads, 0, "{}: {m:?}", job.name());
            assert!(m.reads > 0 && m.iops > 0.0 && m.p50_us > 0.0, "{m:?}");
        }
        // In the middle of a block, past its header; in the slice of job 3
        // of 16, and of the one job.
        let mut bytes = std::fs::read(&f).unwrap();
        bytes[(3 << 20) + 5 * 4096 + 2000] ^= 0x5a;
        std::fs::write(&f, &bytes).unwrap();
        for job in &Job::ALL {
            let m = run(job, true);
            assert!(m.wrong_reads > 0, "{} missed the wrong byte", job.name());
            assert!(m.wrong_examples[0].contains("verify failed"), "{m:?}");
            assert_eq!(run(job, false).wrong_reads, 0);
        }
    }

    #[test]
    fn queue_depth_16_is_16_jobs_over_their_own_slices() {
        let j = Job {
            pattern: Pattern::Seq1m,
            depth: 16,
        };
        let a = j.args(Path::new("/x/data"), 256 << 20, 5.0, true);
        for want in [
            "--numjobs=16",
            "--size=16777216",
            "--offset_increment=16777216",
            "--bs=1M",
            "--rw=read",
            "--runtime=5000ms",
            "--verify=crc32c",
            "--verify_interval=4096",
            "--invalidate=0",
        ] {
            assert!(a.iter().any(|x| x == want), "{want} missing from {a:?}");
        }
        let a = Job::ALL[0].args(Path::new("/x/data"), 256 << 20, 1.0, false);
        assert!(a.iter().all(|x| !x.starts_with("--verify")), "{a:?}");
        assert!(a.iter().any(|x| x == "--numjobs=1"));
    }
}
