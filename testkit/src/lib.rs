//! What pagewire's tests share, so that each test file holds its tests and
//! not another copy of the same set-up: a free loopback port
//! ([`free_port`]), polling until something holds ([`wait_for`]), tokio
//! runtimes ([`rt`], [`rt_multi`]), child processes that are killed on
//! drop and print the tail of their log when the test panics ([`process`]), signals that wait for a
//! SIGSTOP to take ([`signal`]), clients that attach the cluster token
//! ([`grpc`]), a loopback cluster of one coordinator and its nodes
//! ([`cluster`]), and a fake coordinator in-process ([`fake_coordinator`]).
//!
//! A dev-dependency only (`publish = false`). It depends on the wire
//! contract (`pagewire-proto`) and must never depend on the daemons
//! (`pagewire-node`, `pagewire-coordinator`) or the client: it starts the
//! daemons as processes, from paths its users give it.

pub mod cluster;
pub mod fake_coordinator;
pub mod grpc;
pub mod process;
pub mod signal;

use std::time::{Duration, Instant};

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then
/// released): for a server whose address the test must know before it
/// starts.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// `n` distinct TCP ports on 127.0.0.1 that were free a moment ago: all
/// `n` are held bound at once before any is released, so no two are the
/// same (separate [`free_port`] calls may return one port twice, and two
/// servers of one test then collide).
pub fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a free port"))
        .collect();
    held.iter()
        .map(|l| l.local_addr().expect("a bound address").port())
        .collect()
}

/// Polls `ok` every 20 ms until it holds, for at most `limit`; how long
/// that took. Panics, naming `what`, when it never held.
pub fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while start.elapsed() < limit {
        if ok() {
            return start.elapsed();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out after {limit:?} waiting for {what}");
}

/// A current-thread runtime with IO and time: for `block_on` of one call.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// A multi-thread runtime of `workers` threads with IO and time: for
/// servers spawned on it while the test thread blocks.
pub fn rt_multi(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime")
}
