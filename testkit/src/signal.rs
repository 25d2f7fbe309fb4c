//! Signals to the daemons that end-to-end tests start, for tests that
//! freeze a process and assert on what it answered while frozen.
//!
//! `kill -STOP` returns before the process has stopped: the signal goes to
//! the process, one of its threads takes it and only then stops the others,
//! so on a loaded machine, where that thread waits for a CPU, the others go
//! on serving calls for milliseconds after `kill` returned. A test that
//! sends a request "to a frozen node" right after `kill -STOP` may have it
//! answered before the freeze (seen in CI: a read queued "behind the
//! freeze" was answered, correctly, before the write it was then compared
//! with). [`signal`] with `STOP` therefore waits until every thread of the
//! process is stopped.

use std::process::Command;
use std::time::{Duration, Instant};

/// Sends `signal` (a `kill -SIGNAL` name such as STOP, CONT or TERM) to
/// `pid` (`name` in messages); after `STOP`, returns only once every thread
/// of the process is stopped.
pub fn signal(pid: u32, name: &str, signal: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(ok.success(), "kill -{signal} {name}");
    if signal == "STOP" {
        wait_stopped(pid, name);
    }
}

/// Waits (up to 10 s) until every thread of `pid` is in the stopped state
/// (`T` in `/proc/PID/task/TID/stat`).
pub fn wait_stopped(pid: u32, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let running = running_threads(pid);
        if running.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} (pid {pid}) not stopped 10 s after SIGSTOP: threads {running:?} still run"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The threads of `pid` not in the stopped state (a thread that exits
/// meanwhile counts as stopped).
fn running_threads(pid: u32) -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            // "TID (comm) STATE ...": comm may hold spaces and parentheses.
            let state = stat.rsplit_once(") ")?.1.chars().next()?;
            (state != 'T').then(|| t.file_name().to_string_lossy().into_owned())
        })
        .collect()
}
