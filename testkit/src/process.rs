//! A child process of a test: killed (SIGKILL) when dropped, and when the
//! test is panicking the last lines of its log go to stderr first, so a
//! failed test shows what each of its daemons said last.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How many lines of a log [`Proc`] prints when a test fails.
const TAIL_LINES: usize = 15;
/// Longer log lines are cut to this many characters in the tail.
const TAIL_LINE_CHARS: usize = 400;

pub struct Proc {
    /// The name in messages (`coordinator`, a node id, `etcd-0`).
    pub name: String,
    pub child: Child,
    /// Where its output goes.
    pub log: PathBuf,
}

/// Opens `log` for appending (a restarted process adds to its log).
fn append(log: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap_or_else(|e| panic!("open {}: {e}", log.display()))
}

impl Proc {
    /// Starts `cmd` as `name`, its stderr appended to `log`, its stdout
    /// discarded, without `RUST_LOG` (the daemons' own defaults).
    pub fn start(name: impl Into<String>, cmd: &mut Command, log: PathBuf) -> Proc {
        let out = append(&log);
        Self::spawn(
            name.into(),
            cmd.env_remove("RUST_LOG").stdout(Stdio::null()).stderr(out),
            log,
        )
    }

    /// Starts `cmd` as `name` with stdout and stderr both appended to `log`.
    pub fn start_all_output(name: impl Into<String>, cmd: &mut Command, log: PathBuf) -> Proc {
        let out = append(&log);
        let err = out.try_clone().expect("log");
        Self::spawn(name.into(), cmd.stdout(out).stderr(err), log)
    }

    fn spawn(name: String, cmd: &mut Command, log: PathBuf) -> Proc {
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name} ({:?}): {e}", cmd.get_program()));
        Proc { name, child, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (a `kill -SIGNAL` name such as STOP, CONT or TERM);
    /// with STOP, returns once every thread of the process is stopped.
    pub fn signal(&self, signal: &str) {
        crate::signal::signal(self.pid(), &self.name, signal);
    }

    /// Its exit status if it exited, waiting at most `limit`; None: it
    /// still runs.
    pub fn wait_for_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                return Some(st);
            }
            if start.elapsed() >= limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILL, and reaps it (nothing when it exited already).
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last lines of its log on stderr, under its name.
    pub fn print_tail(&self) {
        let log = self.log_text();
        let tail: Vec<&str> = log.lines().rev().take(TAIL_LINES).collect();
        eprintln!("--- last lines of {} ---", self.name);
        for l in tail.iter().rev() {
            eprintln!("{}", l.chars().take(TAIL_LINE_CHARS).collect::<String>());
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGKILL ends a SIGSTOPped process too.
        self.kill9();
        if std::thread::panicking() {
            self.print_tail();
        }
    }
}
