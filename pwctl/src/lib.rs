//! `pwctl`: the pagewire admin CLI. Talks gRPC to the coordinator (and, for
//! `stats`, to each node; for `read` and `write`, to the owners through the
//! client library). Human tables by default, `--json` for machines. Built
//! on `pagewire-proto` and `pagewire-client` only, never on the
//! coordinator's server code.
//!
//! Exit status: 0 on success, 1 when the operation failed (coordinator
//! unreachable, a node refused, ...), 2 on a usage or configuration error
//! (bad flags, no token, a token file that cannot be read or is empty).
//!
//! Modules: `coord` (the `--coordinator` list and failover between
//! coordinators), `diagnose` (what a wrong `--coordinator` address is), and
//! one module per command, each with the command's `run` (or `drain` and
//! `undrain`), called from `run`'s dispatch: `status`, `nodes`, `map`,
//! `range` (warm and evict in chunks, with progress), `drain`, `stats` (the
//! fan-out to the nodes), `topology`, `owner` (which node answers a page),
//! `policy`, and `pages` (`pwctl read` and `pwctl write` through a
//! `pagewire_client::ClusterClient`, run outside pwctl's own runtime since
//! that client blocks on its own). Here: the command line ([`main_from`],
//! which `src/main.rs` runs), the token, the dispatch, and what several
//! commands share (sizes, tables, JSON out).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::anyhow;
use clap::{Parser, Subcommand};
use pagewire_client::error_chain;
use pagewire_proto::auth::AttachToken;
use pagewire_proto::net::ClientTls;
use pagewire_proto::policy::{ADMISSION, EVICTION, admission_name, eviction_name, names};
use pagewire_proto::v1::{GetMapRequest, ListNodesRequest, NodeInfo, OwnershipMap};
use serde_json::Value;

/// Writes to stdout; a closed pipe (`pwctl ... | head`) ends pwctl quietly
/// instead of panicking as `print!` would.
fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("pwctl: cannot write the output: {e}");
        std::process::exit(1);
    }
}

macro_rules! out {
    ($($t:tt)*) => { $crate::write_stdout(format_args!($($t)*)) };
}

macro_rules! outln {
    () => { $crate::write_stdout(format_args!("\n")) };
    ($($t:tt)*) => { $crate::write_stdout(format_args!("{}\n", format_args!($($t)*))) };
}

mod coord;
mod diagnose;
mod drain;
mod map;
mod nodes;
mod owner;
mod pages;
mod policy;
mod range;
mod stats;
mod status;
mod topology;

use coord::Coord;
use diagnose::CallFailed;

/// Admin CLI of a pagewire cluster.
#[derive(Debug, Parser)]
#[command(
    name = "pwctl",
    version,
    after_help = "Exit status: 0 success; 1 the operation failed (coordinator unreachable, a \
                  node refused, a drain did not finish in time, a read or write ran out of \
                  time); 2 usage or configuration error (bad flags or RANGE, no token, \
                  unreadable or empty token file, a page past the end of the file, a write \
                  file of the wrong length, page bytes to a terminal)."
)]
struct Cli {
    /// Coordinator addresses, comma-separated (host:port or URL, at most
    /// 16): reads go to the first that answers, writes follow the leader.
    #[arg(
        long,
        global = true,
        env = "PAGEWIRE_COORDINATOR",
        default_value = "127.0.0.1:7400"
    )]
    coordinator: String,
    /// File holding the cluster token (else PAGEWIRE_TOKEN).
    #[arg(long, global = true, env = "PAGEWIRE_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// CA certificate (PEM) to verify the coordinator and nodes with; turns TLS on.
    #[arg(long, global = true)]
    tls_ca: Option<PathBuf>,
    /// Name the servers' certificates carry (with --tls-ca).
    #[arg(long, global = true, default_value = "localhost")]
    tls_domain: String,
    /// Time limit of each call, in milliseconds (for `read` and `write`: of
    /// each page or run, retries through failover included).
    #[arg(long, global = true, default_value_t = 10_000)]
    timeout_ms: u64,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Cluster summary: epoch, file, extents, nodes, policy.
    Status,
    /// Members: state, address, capacity, extents, lease.
    Nodes,
    /// The ownership map: extents per node against capacity weights.
    Map {
        /// Also list which node owns each run of extents.
        #[arg(long)]
        extents: bool,
    },
    /// Fault a byte range in on its owners. RANGE: START..END, START+LEN or
    /// "all"; numbers take K, M, G, T suffixes (powers of 1024).
    Warm { range: String },
    /// Drop a byte range from its owners' caches (RANGE as for warm).
    Evict { range: String },
    /// Move every extent off NODE (it stays a member, with no extents).
    Drain {
        node: String,
        /// Wait up to this many seconds for the node to be drained.
        #[arg(long, default_value_t = 0)]
        wait: u64,
        /// Drain only the node's running process (a pre-stop hook): the
        /// drain ends when the node registers again, as its own SIGTERM
        /// drain does. Without it the drain stays across restarts until
        /// `pwctl undrain`.
        #[arg(long)]
        until_restart: bool,
    },
    /// Let a drained NODE take its share again.
    Undrain { node: String },
    /// Per-node counters (asked of each node at once; from its last
    /// heartbeat when it cannot be reached in time). Dead and departed nodes
    /// are listed as such.
    Stats {
        /// Refresh every this many seconds until interrupted (on a
        /// terminal the screen is cleared between refreshes; with --json,
        /// one compact JSON array per line).
        #[arg(long, value_name = "SECS")]
        watch: Option<u64>,
        /// How long each node gets to answer (connect included), in
        /// milliseconds; a slower node is shown as unreachable.
        #[arg(long, default_value_t = 1000, value_name = "MS")]
        node_timeout_ms: u64,
    },
    /// NUMA layout of each node.
    Topology,
    /// Which node answers reads of a page and which takes its writes.
    ///
    /// At the current map: the page, its extent, both nodes (id, index, gRPC
    /// address, state) and the map epoch. During a handoff the previous
    /// owner answers reads and the new owner takes writes (once the
    /// handoff completes).
    #[command(
        after_help = "WHERE is a byte offset in the file (`1M` is byte 1048576; K, M, \
                  G, T suffixes are powers of 1024) or `p` and a page number (`p7`, `p2K` \
                  is page 2048)."
    )]
    Owner {
        /// A byte offset (4096, 1M) or pPAGE (p7): see below.
        #[arg(value_name = "WHERE")]
        target: String,
    },
    /// Read pages as a client does, to --out FILE or stdout (PAGES in pages).
    ///
    /// Through the client library, as a client process would: one-sided
    /// from the owner's region, its FaultIn on a miss, or its gRPC Read. The
    /// bytes go to --out FILE, else to stdout when it is not a terminal. Says where each page came from: node, path, frame
    /// generation, attempts (on stderr when the bytes go to stdout).
    #[command(
        after_help = "PAGES counts pages, not bytes: N (one page), A..B (pages A to \
                  B-1) or A+COUNT; numbers take K, M, G, T suffixes (powers of 1024) and \
                  may start with `p` (p7). The bytes written are the file's bytes: a \
                  partial last page gives only its valid length."
    )]
    Read {
        /// N, A..B or A+COUNT, in pages (see below).
        #[arg(value_name = "PAGES")]
        pages: String,
        /// Write the bytes to FILE (created or truncated) instead of stdout.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
        /// Transport of the one-sided reads.
        #[arg(long, value_enum, default_value_t = pages::TransportArg::Auto)]
        transport: pages::TransportArg,
        /// Read with the owners' two-sided gRPC Read instead of one-sidedly.
        #[arg(long, conflicts_with = "transport")]
        grpc: bool,
    },
    /// Write one page through its owner, from --from FILE.
    ///
    /// Write-through: acknowledged once the backing file has it. Prints the
    /// acknowledged frame generation and the owner.
    #[command(
        after_help = "FILE holds the page's valid length (the page size, less for a \
                  partial last page), or a whole page with zeros past the valid length. \
                  PAGE is a page number (K, M, G, T suffixes; may start with `p`)."
    )]
    Write {
        /// The page number.
        #[arg(value_name = "PAGE")]
        page: String,
        /// The page's new bytes.
        #[arg(long, value_name = "FILE")]
        from: PathBuf,
    },
    /// Show the admission/eviction policy, or change it.
    Policy {
        // Help: the admission policies' names, ` | `-separated.
        #[arg(long, help = names(ADMISSION, admission_name, " | "))]
        admission: Option<String>,
        // Help: the eviction policies' names, ` | `-separated.
        #[arg(long, help = names(EVICTION, eviction_name, " | "))]
        eviction: Option<String>,
        /// Start evicting at this fill level (percent).
        #[arg(long)]
        high_watermark: Option<u32>,
        /// Evict down to this fill level (percent).
        #[arg(long)]
        low_watermark: Option<u32>,
    },
}

/// A usage or configuration problem found after parsing (exit status 2).
#[derive(Debug)]
struct Usage(String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// Runs pwctl with `args` (the first is the program's name): parses them
/// (clap exits 2 on a usage error, 0 on `--help`), runs the command,
/// returns the exit status. `src/main.rs` calls it with the process's
/// arguments; the end-to-end tests build it as their own binary.
pub fn main_from<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = Cli::parse_from(args);
    if matches!(cli.cmd, Cmd::Read { .. } | Cmd::Write { .. }) {
        // The cluster client blocks on its own runtime: not inside ours.
        return exit_code(pages::run(&cli));
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pwctl: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    exit_code(rt.block_on(async {
        let r = run(cli).await;
        match r {
            Err(e) => Err(explain(e).await),
            ok => ok,
        }
    }))
}

/// The exit status of a command's outcome (the error printed first).
fn exit_code(r: anyhow::Result<bool>) -> ExitCode {
    match r {
        Ok(ok) => {
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("pwctl: {e:#}");
            if e.downcast_ref::<Usage>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Says so when a call failed because `--coordinator` names a node or a
/// metrics port.
async fn explain(e: anyhow::Error) -> anyhow::Error {
    let Some(call) = e.downcast_ref::<CallFailed>() else {
        return e;
    };
    let address = &call.address;
    match diagnose::judge(address, &call.status).await {
        Some(wrong) => anyhow!(
            "{} failed: cannot use {address} as the coordinator: {wrong}",
            call.what
        ),
        None => e,
    }
}

struct Ctx {
    token: AttachToken,
    tls: Option<ClientTls>,
    timeout: Duration,
    json: bool,
}

fn token(cli: &Cli) -> anyhow::Result<AttachToken> {
    Ok(token_text(cli)?.1)
}

/// The cluster token as text (the client library takes it so), checked.
fn token_text(cli: &Cli) -> anyhow::Result<(String, AttachToken)> {
    let t = if let Some(path) = &cli.token_file {
        std::fs::read_to_string(path)
            .map_err(|e| Usage(format!("cannot read token file {}: {e}", path.display())))?
            .trim()
            .to_owned()
    } else if let Ok(t) = std::env::var("PAGEWIRE_TOKEN") {
        t
    } else {
        return Err(
            Usage("no cluster token: pass --token-file FILE or set PAGEWIRE_TOKEN".into()).into(),
        );
    };
    let attach = AttachToken::new(&t).map_err(|e| {
        let from = match &cli.token_file {
            Some(p) => format!("token file {}", p.display()),
            None => "PAGEWIRE_TOKEN".into(),
        };
        anyhow::Error::from(Usage(format!("bad cluster token in {from}: {e}")))
    })?;
    Ok((t, attach))
}

/// `--tls-ca` and `--tls-domain`: TLS towards the coordinator and the nodes.
fn client_tls(cli: &Cli) -> Option<ClientTls> {
    cli.tls_ca.clone().map(|ca_file| ClientTls {
        ca_file,
        domain: cli.tls_domain.clone(),
    })
}

fn req<T>(ctx: &Ctx, msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(ctx.timeout);
    r
}

/// The expanded view of a `GetMap` answer: a compact map is expanded here
/// with the shared code; an expanded one (older coordinator) passes as is.
fn expand_map(map: OwnershipMap) -> anyhow::Result<OwnershipMap> {
    Ok(pagewire_proto::map::MapApplier::new().apply(map)?)
}

async fn run(cli: Cli) -> anyhow::Result<bool> {
    let ctx = &Ctx {
        token: token(&cli)?,
        tls: client_tls(&cli),
        timeout: Duration::from_millis(cli.timeout_ms.max(1)),
        json: cli.json,
    };
    // Check arguments before touching the network.
    let range = match &cli.cmd {
        Cmd::Warm { range } | Cmd::Evict { range } => {
            Some(parse_range(range).map_err(|e| Usage(format!("bad RANGE {range:?}: {e}")))?)
        }
        _ => None,
    };
    let owner_target = match &cli.cmd {
        Cmd::Owner { target } => Some(
            owner::parse_target(target)
                .map_err(|e| Usage(format!("bad WHERE {target:?}: {e} (OFFSET or pPAGE)")))?,
        ),
        _ => None,
    };
    let policy_change = match &cli.cmd {
        Cmd::Policy {
            admission,
            eviction,
            high_watermark,
            low_watermark,
        } => policy::Change::parse(
            admission.as_deref(),
            eviction.as_deref(),
            *high_watermark,
            *low_watermark,
        )?,
        _ => None,
    };
    let mut c = Coord::new(
        &cli.coordinator,
        ctx.token.clone(),
        ctx.tls.clone(),
        ctx.timeout,
    )?;
    let c = &mut c;
    match &cli.cmd {
        Cmd::Status => status::run(c, ctx).await,
        Cmd::Nodes => nodes::run(c, ctx).await,
        Cmd::Map { extents } => map::run(c, ctx, *extents).await,
        Cmd::Warm { .. } => range::warm_or_evict(c, ctx, range::Op::Warm, range).await,
        Cmd::Evict { .. } => range::warm_or_evict(c, ctx, range::Op::Evict, range).await,
        Cmd::Drain {
            node,
            wait,
            until_restart,
        } => drain::drain(c, ctx, node, *wait, *until_restart).await,
        Cmd::Undrain { node } => drain::undrain(c, ctx, node).await,
        Cmd::Stats {
            watch,
            node_timeout_ms,
        } => stats::run(c, ctx, *watch, *node_timeout_ms).await,
        Cmd::Topology => topology::run(c, ctx).await,
        Cmd::Owner { .. } => owner::run(c, ctx, owner_target.expect("parsed above")).await,
        Cmd::Read { .. } | Cmd::Write { .. } => {
            unreachable!("main runs read and write outside the runtime")
        }
        Cmd::Policy { .. } => policy::run(c, ctx, policy_change).await,
    }
}

async fn list_nodes(c: &mut Coord, ctx: &Ctx) -> anyhow::Result<Vec<NodeInfo>> {
    Ok(c.call("nodes", |mut c| async move {
        c.list_nodes(req(ctx, ListNodesRequest {})).await
    })
    .await?
    .nodes)
}

/// The map, expanded (it travels compact).
async fn get_map(c: &mut Coord, ctx: &Ctx) -> anyhow::Result<OwnershipMap> {
    let map = c
        .call("map", |mut c| async move {
            c.get_map(req(ctx, GetMapRequest { compact: true })).await
        })
        .await?;
    expand_map(map)
}

/// Parses a size: digits with an optional K, M, G or T suffix (powers of 1024).
fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let t = s.trim_end_matches(['B', 'b']).trim_end_matches("i");
    let (digits, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1 << 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 1 << 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let n: u64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a size"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Parses a count (of pages): digits with an optional K, M, G or T suffix
/// (powers of 1024), without the byte sizes' B.
fn parse_count(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.ends_with(['b', 'B']) {
        return Err(format!(
            "{s:?} is not a page number (pages count pages, not bytes)"
        ));
    }
    parse_size(t).map_err(|_| format!("{s:?} is not a page number"))
}

/// Parses RANGE into (offset, length).
fn parse_range(s: &str) -> Result<(u64, u64), String> {
    if s == "all" {
        return Ok((0, u64::MAX));
    }
    if let Some((a, b)) = s.split_once("..") {
        let start = parse_size(a)?;
        let end = parse_size(b)?;
        if end <= start {
            return Err("END must be above START".into());
        }
        return Ok((start, end - start));
    }
    if let Some((a, b)) = s.split_once('+') {
        let len = parse_size(b)?;
        if len == 0 {
            return Err("LEN must be > 0".into());
        }
        return Ok((parse_size(a)?, len));
    }
    Err("expected START..END, START+LEN or all".into())
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    #[allow(clippy::cast_precision_loss)]
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

fn human_ms(ms: u64) -> String {
    if ms < 10_000 {
        format!("{ms} ms")
    } else if ms < 600_000 {
        format!("{:.1} s", ms as f64 / 1000.0)
    } else {
        format!("{:.1} min", ms as f64 / 60_000.0)
    }
}

fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let cols = rows
        .iter()
        .map(Vec::len)
        .chain([headers.len()])
        .max()
        .unwrap_or(0);
    let mut width = vec![0usize; cols];
    for (i, h) in headers.iter().enumerate() {
        width[i] = h.len();
    }
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, c) in cells.enumerate() {
            if i > 0 {
                l.push_str("  ");
            }
            l.push_str(c);
            l.extend(std::iter::repeat_n(
                ' ',
                width[i].saturating_sub(c.chars().count()),
            ));
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    if !headers.is_empty() {
        line(&mut headers.iter().copied());
    }
    for r in rows {
        line(&mut r.iter().map(String::as_str));
    }
    out
}

fn print_json(v: &Value) {
    outln!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_ranges() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("2MiB").unwrap(), 2 << 20);
        assert_eq!(parse_size("17").unwrap(), 17);
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999T").is_err());
        assert_eq!(parse_range("1M..3M").unwrap(), (1 << 20, 2 << 20));
        assert_eq!(parse_range("0+4K").unwrap(), (0, 4096));
        assert_eq!(parse_range("all").unwrap(), (0, u64::MAX));
        assert!(parse_range("3M..1M").is_err());
        assert!(parse_range("5").is_err());
    }

    #[test]
    fn table_aligns() {
        let t = table(&["A", "BB"], &[vec!["xxx".into(), "y".into()]]);
        assert_eq!(t, "A    BB\nxxx  y\n");
    }
}
