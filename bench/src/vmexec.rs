//! Running the storm's processes on other machines that share no process
//! table with it: soft-RoCE VMs (`rdma/scripts/softroce-cluster.sh`).
//!
//! `vm-agent --listen IP:PORT` runs on each machine; `vm-exec ADDR NAME --
//! PROGRAM ARGS…` runs on the storm's machine as the storm's child (the
//! `exec` prefix of a hosts-file host). One TCP connection per program:
//!
//! ```text
//! client -> agent   one JSON line {"name", "argv" | "signal", "env"}
//! agent  -> client  run:    the program's stdout and stderr, then the
//!                           line "\n--vm-exec exit N\n" when it exits
//!                   signal: "ok\n" or "error: ...\n"
//! ```
//!
//! The connection is the program's lifeline: when it closes (the storm
//! killed `vm-exec`, even with SIGKILL, or the storm itself died), the
//! agent kills the program with SIGKILL. So `kill -9` of the local child is
//! `kill -9` of the remote program, and a restart is a new `vm-exec`. A
//! signal (`--signal STOP`) goes to the program started under `NAME` (the
//! hosts file's `signal` prefix: a pause past the lease is a real SIGSTOP
//! of the remote process).
//!
//! The agent runs what it is sent, as whoever started it: it is a test
//! harness for machines that exist only for the test, and listens only on
//! the address it is given (inside the VMs' private network).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

/// Where `vm-agent` listens.
#[derive(clap::Args, Debug)]
pub struct AgentArgs {
    /// IP:PORT to listen on (a private test network's address).
    #[arg(long)]
    pub listen: String,
}

/// Runs a program on a `vm-agent`, or signals one it runs.
#[derive(clap::Args, Debug)]
pub struct ExecArgs {
    /// The agent's IP:PORT.
    pub agent: String,
    /// The program's name there (what `--signal` names).
    pub name: String,
    /// Send this signal (STOP, CONT, TERM, KILL, INT) to the program
    /// running under NAME instead of starting one.
    #[arg(long)]
    pub signal: Option<String>,
    /// Give up connecting after this many milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub connect_timeout_ms: u64,
    /// The program and its arguments.
    #[arg(last = true)]
    pub argv: Vec<String>,
}

/// Environment variables every `vm-exec` forwards, beside those named in
/// [`ENV_LIST`].
const ALWAYS_ENV: &[&str] = &["RUST_LOG"];
/// A comma-separated list of more variables to forward.
pub const ENV_LIST: &str = "PAGEWIRE_VM_EXEC_ENV";
const EXIT_MARK: &str = "\n--vm-exec exit ";

#[derive(Serialize, Deserialize)]
struct Request {
    name: String,
    #[serde(default)]
    argv: Vec<String>,
    #[serde(default)]
    signal: Option<String>,
    #[serde(default)]
    env: Vec<(String, String)>,
}

fn signal_number(name: &str) -> Option<libc::c_int> {
    Some(match name.trim_start_matches("SIG") {
        "STOP" => libc::SIGSTOP,
        "CONT" => libc::SIGCONT,
        "TERM" => libc::SIGTERM,
        "KILL" => libc::SIGKILL,
        "INT" => libc::SIGINT,
        _ => return None,
    })
}

/// `vm-agent`: serves until killed.
pub fn agent(a: &AgentArgs) -> anyhow::Result<()> {
    let l = TcpListener::bind(&a.listen).with_context(|| format!("listening on {}", a.listen))?;
    eprintln!("vm-agent: listening on {}", l.local_addr()?);
    // (name, pid) of every program running, newest last: a name started
    // again while its old program still dies has two entries.
    let pids: Arc<Mutex<Vec<(String, i32)>>> = Arc::default();
    for s in l.incoming() {
        let Ok(s) = s else { continue };
        let pids = Arc::clone(&pids);
        std::thread::spawn(move || {
            if let Err(e) = serve(s, &pids) {
                eprintln!("vm-agent: {e:#}");
            }
        });
    }
    Ok(())
}

fn serve(mut s: TcpStream, pids: &Arc<Mutex<Vec<(String, i32)>>>) -> anyhow::Result<()> {
    s.set_nodelay(true)?;
    let mut line = String::new();
    BufReader::new(s.try_clone()?).read_line(&mut line)?;
    let req: Request = serde_json::from_str(&line).context("a request line")?;
    if let Some(sig) = &req.signal {
        let table = pids.lock().unwrap_or_else(|e| e.into_inner());
        let pid = table
            .iter()
            .rev()
            .find(|(n, _)| *n == req.name)
            .map(|&(_, p)| p);
        let reply = match (pid, signal_number(sig)) {
            (_, None) => format!("error: unknown signal {sig:?}\n"),
            (None, _) => format!("error: nothing runs under {:?}\n", req.name),
            // SAFETY: kill(2) on a pid this agent started and has not reaped:
            // it is in the table (lock held), which it leaves before it is
            // reaped.
            (Some(pid), Some(n)) => match unsafe { libc::kill(pid, n) } {
                0 => "ok\n".to_owned(),
                _ => format!("error: {}\n", std::io::Error::last_os_error()),
            },
        };
        drop(table);
        s.write_all(reply.as_bytes())?;
        return Ok(());
    }
    let Some((prog, args)) = req.argv.split_first() else {
        bail!("an empty command");
    };
    let out = s.try_clone()?;
    let err = s.try_clone()?;
    let mut child = match Command::new(prog)
        .args(args)
        .envs(req.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::from(std::os::fd::OwnedFd::from(out)))
        .stderr(Stdio::from(std::os::fd::OwnedFd::from(err)))
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            s.write_all(
                format!("vm-agent: cannot start {prog:?}: {e}{EXIT_MARK}127\n").as_bytes(),
            )?;
            return Ok(());
        }
    };
    let pid = child.id() as i32;
    pids.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((req.name.clone(), pid));
    // The lifeline: the client sends nothing more, so a read returns only
    // when the connection closes; then the program dies. Every kill(2)
    // here and in the signal path happens under the table's lock while the
    // pid is in the table, and the pid leaves the table before the child
    // is reaped (`waitid` with WNOWAIT first): no signal can reach a pid
    // the kernel has given to another process.
    let mut watch = s.try_clone()?;
    let table = Arc::clone(pids);
    std::thread::spawn(move || {
        let mut b = [0u8; 64];
        while matches!(watch.read(&mut b), Ok(n) if n > 0) {}
        let t = table.lock().unwrap_or_else(|e| e.into_inner());
        if t.iter().any(|&(_, p)| p == pid) {
            // SAFETY: kill(2) on our child, not yet reaped (it is in the
            // table, which it leaves before it is reaped).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    // SAFETY: waitid(2) on our own child with a zeroed out-struct; WNOWAIT
    // leaves it a zombie for `child.wait` below.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        while libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOWAIT,
        ) != 0
            && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
        {}
    }
    pids.lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|&(_, p)| p != pid);
    let status = child.wait()?;
    let code = status
        .code()
        .unwrap_or(128 + std::os::unix::process::ExitStatusExt::signal(&status).unwrap_or(0));
    let _ = s.write_all(format!("{EXIT_MARK}{code}\n").as_bytes());
    let _ = s.shutdown(Shutdown::Both);
    Ok(())
}

/// `vm-exec`: returns the remote program's exit code.
pub fn exec(a: &ExecArgs) -> anyhow::Result<i32> {
    let addr: std::net::SocketAddr = a
        .agent
        .parse()
        .with_context(|| format!("agent address {:?} (IP:PORT)", a.agent))?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(a.connect_timeout_ms))
        .with_context(|| format!("connecting to the vm-agent at {addr}"))?;
    s.set_nodelay(true)?;
    let mut names: Vec<String> = ALWAYS_ENV.iter().map(|s| (*s).to_owned()).collect();
    if let Ok(list) = std::env::var(ENV_LIST) {
        names.extend(list.split(',').filter(|n| !n.is_empty()).map(str::to_owned));
        names.push(ENV_LIST.to_owned());
    }
    let env = names
        .into_iter()
        .filter_map(|k| std::env::var(&k).ok().map(|v| (k, v)))
        .collect();
    if a.signal.is_none() && a.argv.is_empty() {
        bail!("vm-exec: give a program after `--`, or --signal");
    }
    let req = Request {
        name: a.name.clone(),
        argv: a.argv.clone(),
        signal: a.signal.clone(),
        env,
    };
    let mut line = serde_json::to_string(&req)?;
    line.push('\n');
    s.write_all(line.as_bytes())?;
    if a.signal.is_some() {
        let mut reply = String::new();
        BufReader::new(s).read_line(&mut reply)?;
        if reply.trim() != "ok" {
            bail!("vm-exec --signal: {}", reply.trim());
        }
        return Ok(0);
    }
    // Copy the program's output to stderr, holding back what could be the
    // start of the exit line.
    let mut stderr = std::io::stderr();
    let mut pending: Vec<u8> = Vec::new();
    let mut b = [0u8; 8192];
    loop {
        let n = match s.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&b[..n]);
        let keep = EXIT_MARK.len() + 8;
        if pending.len() > keep {
            let cut = pending.len() - keep;
            let _ = stderr.write_all(&pending[..cut]);
            pending.drain(..cut);
        }
    }
    let text = String::from_utf8_lossy(&pending).into_owned();
    match text.rfind(EXIT_MARK) {
        Some(i) => {
            let _ = stderr.write_all(&pending[..i]);
            Ok(text[i + EXIT_MARK.len()..].trim().parse().unwrap_or(1))
        }
        None => {
            let _ = stderr.write_all(&pending);
            eprintln!(
                "vm-exec: the agent at {addr} went away before {:?} exited",
                a.name
            );
            Ok(255)
        }
    }
}
