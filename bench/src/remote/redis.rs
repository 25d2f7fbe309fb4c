//! Redis, the comparison: a `redis-server` started and loaded with every
//! page, and `redis-benchmark` against it (also used by `storm`).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::clients;
use super::cluster;

/// A redis-server this process started; killed on drop.
pub struct RedisServer {
    pub(super) child: std::process::Child,
    pub(super) ip: String,
    pub(super) port: u16,
}

impl RedisServer {
    pub fn addr(&self) -> String {
        format!("{}:{}", self.ip, self.port)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts redis-server on `ip` (this host's address) and a free port, and
/// loads every page (generation 0) under [`clients::key`]; `None` when the
/// binary is missing.
pub fn start_redis_on(bin: &str, ip: &str, pages: u64) -> anyhow::Result<Option<RedisServer>> {
    let here = cluster::Placement {
        exec: Vec::new(),
        ip: ip.to_owned(),
        verbs: false,
    };
    start_redis_via(&here, bin, pages)
}

/// Starts redis-server where `on` says (on its address, a free port), and
/// loads every page (generation 0) under [`clients::key`]; `None` when the
/// binary is missing.
pub(super) fn start_redis_via(
    on: &cluster::Placement,
    bin: &str,
    pages: u64,
) -> anyhow::Result<Option<RedisServer>> {
    let ip = on.ip.as_str();
    let port = if on.exec.is_empty() {
        std::net::TcpListener::bind((ip, 0))
            .with_context(|| format!("binding a port on {ip} for redis"))?
            .local_addr()?
            .port()
    } else {
        fastrand::u16(30_000..40_000)
    };
    let mut cmd = on.command(Path::new(bin));
    cmd.args(["--bind", ip, "--port", &port.to_string()])
        .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
        .args(["--daemonize", "no", "--loglevel", "warning"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    crate::storm::die_with_parent(&mut cmd);
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).context("starting redis-server"),
    };
    let server = RedisServer {
        child,
        ip: ip.to_owned(),
        port,
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut c = loop {
        match clients::Redis::connect_to(&server.addr()) {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e).context("redis-server did not start"),
        }
    };
    c.load(pages)?;
    Ok(Some(server))
}

/// GETs per second `redis-benchmark` reaches against `addr` with `clients`
/// connections, no pipelining, random keys over the `keys` loaded pages
/// (`-r` names them `key:` and 12 digits, as [`clients::key`] does), 4 KiB
/// values, `requests` in all. `None` when the binary is missing. Fails when
/// any GET missed (the figure would be of empty replies).
pub fn redis_benchmark(
    bin: &str,
    addr: &str,
    clients: usize,
    keys: u64,
    requests: u64,
) -> anyhow::Result<Option<f64>> {
    let (host, port) = addr.rsplit_once(':').context("redis address")?;
    let misses = |c: &mut clients::Redis| c.info_field("keyspace_misses");
    let mut probe = clients::Redis::connect_to(addr)?;
    let before = misses(&mut probe)?;
    let out = match std::process::Command::new(bin)
        .args(["-h", host, "-p", port])
        .args(["-c", &clients.to_string(), "-n", &requests.to_string()])
        .args(["-t", "get", "-d", "4096", "-P", "1"])
        .args(["-r", &keys.to_string(), "--csv"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
    {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).context("running redis-benchmark"),
    };
    if !out.status.success() {
        bail!("redis-benchmark: {}", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let rps = text
        .lines()
        .find(|l| l.starts_with("\"GET"))
        .and_then(|l| l.split(',').nth(1))
        .map(|v| v.trim_matches('"').parse::<f64>())
        .context("redis-benchmark printed no GET line")?
        .context("redis-benchmark's GET figure")?;
    let missed = misses(&mut probe)? - before;
    if missed > 0 {
        bail!("redis-benchmark's GETs missed {missed} times: its keys are not the loaded pages");
    }
    Ok(Some(rps))
}
