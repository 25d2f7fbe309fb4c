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
//! coordinators), `status` (`pwctl status`), `diagnose` (what a wrong
//! `--coordinator` address is), `stats` (the fan-out to the nodes), `range`
//! (warm and evict in chunks, with progress), `owner` (`pwctl owner`: which
//! node answers a page), `pages` (`pwctl read` and `pwctl write` through a
//! `pagewire_client::ClusterClient`, run outside pwctl's own runtime since
//! that client blocks on its own).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::anyhow;
use clap::{Parser, Subcommand};
use pagewire_client::error_chain;
use pagewire_proto::auth::AttachToken;
use pagewire_proto::net::ClientTls;
use pagewire_proto::policy::{
    ADMISSION, EVICTION, admission_name, eviction_name, names, one_of, parse_admission,
    parse_eviction,
};
use pagewire_proto::state_name;
use pagewire_proto::v1::{
    ClusterRangeResponse, DrainRequest, GetMapRequest, ListNodesRequest, NodeInfo, NodeState,
    NodeStats, OwnershipMap, Policy, SetPolicyRequest, StatusRequest, Topology,
};
use serde_json::{Value, json};

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
mod owner;
mod pages;
mod range;
mod stats;
mod status;

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

fn main() -> ExitCode {
    let cli = Cli::parse();
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
        } => {
            let a = admission
                .as_deref()
                .map(|a| {
                    parse_admission(a).ok_or_else(|| {
                        Usage(format!(
                            "bad --admission {a:?}: expected {}",
                            one_of(ADMISSION, admission_name)
                        ))
                    })
                })
                .transpose()?;
            let e = eviction
                .as_deref()
                .map(|e| {
                    parse_eviction(e).ok_or_else(|| {
                        Usage(format!(
                            "bad --eviction {e:?}: expected {}",
                            one_of(EVICTION, eviction_name)
                        ))
                    })
                })
                .transpose()?;
            (a.is_some() || e.is_some() || high_watermark.is_some() || low_watermark.is_some())
                .then_some((a, e, *high_watermark, *low_watermark))
        }
        _ => None,
    };
    let mut c = Coord::new(
        &cli.coordinator,
        ctx.token.clone(),
        ctx.tls.clone(),
        ctx.timeout,
    )?;
    match &cli.cmd {
        Cmd::Status => {
            let (s, answered) = c
                .call_at("status", |mut c| async move {
                    c.status(req(ctx, StatusRequest {})).await
                })
                .await?;
            status::print(&s, &answered, ctx.json);
            Ok(true)
        }
        Cmd::Nodes => {
            let nodes = list_nodes(&mut c, ctx).await?;
            if ctx.json {
                print_json(&Value::Array(nodes.iter().map(node_json).collect()));
            } else {
                let rows = nodes
                    .iter()
                    .map(|n| {
                        vec![
                            n.node_id.clone(),
                            n.index.to_string(),
                            state_name(n.state()).into(),
                            n.grpc_address.clone(),
                            human_bytes(n.capacity_bytes),
                            n.extents_owned.to_string(),
                            if n.lease_remaining_ms > 0 {
                                human_ms(n.lease_remaining_ms)
                            } else {
                                "-".into()
                            },
                            n.applied_epoch.to_string(),
                            n.transports
                                .iter()
                                .map(|t| t.kind.clone())
                                .collect::<Vec<_>>()
                                .join(","),
                        ]
                    })
                    .collect::<Vec<_>>();
                out!(
                    "{}",
                    table(
                        &[
                            "NODE",
                            "INDEX",
                            "STATE",
                            "ADDRESS",
                            "CAPACITY",
                            "EXTENTS",
                            "LEASE LEFT",
                            "APPLIED EPOCH",
                            "TRANSPORTS"
                        ],
                        &rows
                    )
                );
            }
            Ok(true)
        }
        Cmd::Map { extents } => {
            let map = get_map(&mut c, ctx).await?;
            let nodes = list_nodes(&mut c, ctx).await?;
            print_map(&map, &nodes, *extents, ctx.json);
            Ok(true)
        }
        Cmd::Warm { .. } | Cmd::Evict { .. } => {
            let (offset, length) = range.unwrap_or((0, u64::MAX));
            let op = if matches!(cli.cmd, Cmd::Warm { .. }) {
                range::Op::Warm
            } else {
                range::Op::Evict
            };
            let resp = range::run(&mut c, ctx, op, offset, length).await?;
            Ok(print_range_result(op.name(), &resp, ctx.json))
        }
        Cmd::Drain {
            node,
            wait,
            until_restart,
        } => {
            let incarnation = if *until_restart {
                let nodes = list_nodes(&mut c, ctx).await?;
                match nodes.iter().find(|n| &n.node_id == node) {
                    Some(n) if n.incarnation != 0 => n.incarnation,
                    _ => {
                        eprintln!("pwctl: {node} is not a registered node");
                        return Ok(false);
                    }
                }
            } else {
                0
            };
            let r = DrainRequest {
                node_id: node.clone(),
                incarnation,
            };
            let r = c
                .call("drain", |mut c| {
                    let r = r.clone();
                    async move { c.drain(req(ctx, r)).await }
                })
                .await?;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(*wait);
            let mut state = NodeState::Draining;
            while *wait > 0 && state == NodeState::Draining {
                let nodes = list_nodes(&mut c, ctx).await?;
                state = nodes
                    .iter()
                    .find(|n| &n.node_id == node)
                    .map_or(NodeState::Unspecified, NodeInfo::state);
                if tokio::time::Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if ctx.json {
                print_json(
                    &json!({"node": node, "epoch": r.map_epoch, "extents_moved": r.extents_moved, "state": state_name(state)}),
                );
            } else {
                outln!(
                    "draining {node}: {} extents move away (epoch {})",
                    r.extents_moved,
                    r.map_epoch
                );
                if *wait > 0 {
                    outln!("{node} is {}", state_name(state));
                }
            }
            let done = *wait == 0 || state == NodeState::Drained;
            if !done {
                let map = get_map(&mut c, ctx).await?;
                let nodes = list_nodes(&mut c, ctx).await?;
                eprintln!(
                    "pwctl: gave up after {wait} s: {}",
                    drain_blocker(&map, &nodes, node, state)
                );
            }
            Ok(done)
        }
        Cmd::Undrain { node } => {
            let r = DrainRequest {
                node_id: node.clone(),
                incarnation: 0,
            };
            let r = c
                .call("undrain", |mut c| {
                    let r = r.clone();
                    async move { c.undrain(req(ctx, r)).await }
                })
                .await?;
            if ctx.json {
                print_json(&json!({"node": node, "epoch": r.map_epoch}));
            } else {
                outln!("{node} takes its share again (epoch {})", r.map_epoch);
            }
            Ok(true)
        }
        Cmd::Stats {
            watch,
            node_timeout_ms,
        } => loop {
            let nodes = list_nodes(&mut c, ctx).await?;
            let per_node = Duration::from_millis((*node_timeout_ms).max(1));
            let rows = stats::collect(&nodes, ctx, per_node).await;
            // Clear the screen between refreshes only on a terminal: a
            // file or a pipe gets the tables one after another.
            if watch.is_some() && !ctx.json && std::io::IsTerminal::is_terminal(&std::io::stdout())
            {
                out!("\x1b[2J\x1b[H");
            }
            stats::print(&rows, ctx.json, watch.is_some());
            match watch {
                Some(secs) => tokio::time::sleep(Duration::from_secs((*secs).max(1))).await,
                None => return Ok(true),
            }
        },
        Cmd::Topology => {
            let nodes = list_nodes(&mut c, ctx).await?;
            print_topology(&nodes, ctx.json);
            Ok(true)
        }
        Cmd::Owner { .. } => {
            let map = get_map(&mut c, ctx).await?;
            let target = owner_target.expect("parsed above");
            owner::locate(&map, target)?.print(ctx.json);
            Ok(true)
        }
        Cmd::Read { .. } | Cmd::Write { .. } => {
            unreachable!("main runs read and write outside the runtime")
        }
        Cmd::Policy { .. } => {
            let current = c
                .call("status", |mut c| async move {
                    c.status(req(ctx, StatusRequest {})).await
                })
                .await?
                .policy
                .unwrap_or_default();
            let p = if let Some((a, e, hi, lo)) = policy_change {
                let mut p = current;
                if let Some(a) = a {
                    p.set_admission(a);
                }
                if let Some(e) = e {
                    p.set_eviction(e);
                }
                if let Some(hi) = hi {
                    p.high_watermark_percent = hi;
                }
                if let Some(lo) = lo {
                    p.low_watermark_percent = lo;
                }
                let r = SetPolicyRequest { policy: Some(p) };
                c.call(
                    "policy",
                    |mut c| async move { c.set_policy(req(ctx, r)).await },
                )
                .await?
                .policy
                .unwrap_or_default()
            } else {
                current
            };
            if ctx.json {
                print_json(&policy_json(&p));
            } else {
                outln!("{}", policy_text(&p));
            }
            Ok(true)
        }
    }
}

/// Why `node` is not drained yet, in words: what it still owns or hands
/// off, and which nodes have not applied the epoch that would finish it.
fn drain_blocker(map: &OwnershipMap, nodes: &[NodeInfo], node: &str, state: NodeState) -> String {
    let Some(me) = nodes.iter().find(|n| n.node_id == node) else {
        return format!("{node} is no longer a member");
    };
    if state != NodeState::Draining {
        return format!("{node} is {}, not draining", state_name(state));
    }
    let owned = map.owner.iter().filter(|&&o| o == me.index).count();
    let handing: Vec<usize> = (0..map.previous_owner.len())
        .filter(|&i| map.previous_owner[i] == me.index)
        .collect();
    let mut waiting: Vec<String> = handing
        .iter()
        .filter_map(|&i| map.owner.get(i))
        .chain(std::iter::once(&me.index))
        .filter_map(|&idx| nodes.iter().find(|n| n.index == idx))
        .filter(|n| n.applied_epoch < map.epoch)
        .map(|n| {
            format!(
                "{} ({}, applied epoch {})",
                n.node_id,
                state_name(n.state()),
                n.applied_epoch
            )
        })
        .collect();
    waiting.sort();
    waiting.dedup();
    let mut why = format!(
        "{node} is still draining at epoch {}: it owns {owned} extents and hands off {}",
        map.epoch,
        handing.len()
    );
    if owned > 0 {
        why.push_str("; no alive node takes them (start or undrain one)");
    }
    if !waiting.is_empty() {
        why.push_str(&format!(
            "; the handoff waits for {} to apply epoch {} (a frozen or partitioned node \
             holds it until its lease runs out)",
            waiting.join(", "),
            map.epoch
        ));
    }
    why
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

fn policy_json(p: &Policy) -> Value {
    json!({
        "version": p.version,
        "admission": admission_name(p.admission()),
        "eviction": eviction_name(p.eviction()),
        "high_watermark_percent": p.high_watermark_percent,
        "low_watermark_percent": p.low_watermark_percent,
    })
}

fn policy_text(p: &Policy) -> String {
    format!(
        "admission {}, eviction {}, watermarks {}%/{}% (version {})",
        admission_name(p.admission()),
        eviction_name(p.eviction()),
        p.high_watermark_percent,
        p.low_watermark_percent,
        p.version
    )
}

fn topology_json(t: &Topology) -> Value {
    json!({
        "source": t.source,
        "hostname": t.hostname,
        "numa_nodes": t.numa_nodes.iter().map(|n| json!({
            "os_index": n.os_index, "memory_bytes": n.memory_bytes, "cpus": n.cpus,
        })).collect::<Vec<_>>(),
    })
}

fn stats_json(s: &NodeStats) -> Value {
    json!({
        "hits": s.hits, "misses": s.misses, "faults": s.faults, "evictions": s.evictions,
        "retries": s.retries, "bytes_served": s.bytes_served, "writes": s.writes,
        "pages_resident": s.pages_resident, "capacity_pages": s.capacity_pages,
        "extents_owned": s.extents_owned, "stale_map_rejections": s.stale_map_rejections,
        "remote_pages": s.remote_pages, "remote_one_sided": s.remote_one_sided,
        "remote_fallbacks": s.remote_fallbacks, "remote_round_trips": s.remote_round_trips,
        "remote_retries": s.remote_retries,
        "remote_validation_failures": s.remote_validation_failures,
        "verbs_queue_pairs": s.verbs_queue_pairs, "verbs_refused": s.verbs_refused,
    })
}

fn node_json(n: &NodeInfo) -> Value {
    json!({
        "node_id": n.node_id, "index": n.index, "state": state_name(n.state()),
        "grpc_address": n.grpc_address, "metrics_address": n.metrics_address,
        "capacity_bytes": n.capacity_bytes, "extents_owned": n.extents_owned,
        "lease_remaining_ms": n.lease_remaining_ms, "applied_epoch": n.applied_epoch,
        "incarnation": n.incarnation,
        "topology": n.topology.as_ref().map(topology_json),
        "transports": n.transports.iter().map(|t| json!({
            "kind": t.kind, "endpoint": t.endpoint, "address": t.address, "length": t.length,
            "rkey": t.rkey, "epoch": t.epoch,
        })).collect::<Vec<_>>(),
    })
}

fn print_map(map: &OwnershipMap, nodes: &[NodeInfo], extents: bool, as_json: bool) {
    let total = map.owner.len() as u64;
    let weight_total: u64 = nodes
        .iter()
        .filter(|n| n.state() == NodeState::Alive)
        .map(|n| n.capacity_bytes)
        .sum();
    let mut max_dev: f64 = 0.0;
    let mut rows = Vec::new();
    let mut per_node = Vec::new();
    for n in nodes {
        let owned = map.owner.iter().filter(|&&o| o == n.index).count() as u64;
        let handing = map.previous_owner.iter().filter(|&&p| p == n.index).count() as u64;
        let weight = if n.state() == NodeState::Alive && weight_total > 0 {
            n.capacity_bytes as f64 / weight_total as f64
        } else {
            0.0
        };
        let share = if total > 0 {
            owned as f64 / total as f64
        } else {
            0.0
        };
        let dev = (weight > 0.0).then(|| (share - weight) / weight * 100.0);
        if let Some(d) = dev {
            max_dev = max_dev.max(d.abs());
        }
        rows.push(vec![
            n.node_id.clone(),
            n.index.to_string(),
            state_name(n.state()).into(),
            human_bytes(n.capacity_bytes),
            format!("{:.1}%", weight * 100.0),
            owned.to_string(),
            format!("{:.1}%", share * 100.0),
            dev.map_or("-".into(), |d| format!("{d:+.1}%")),
            handing.to_string(),
        ]);
        per_node.push(json!({
            "node_id": n.node_id, "index": n.index, "state": state_name(n.state()),
            "capacity_bytes": n.capacity_bytes, "weight": weight, "extents": owned,
            "share": share, "deviation_percent": dev, "handing_off": handing,
        }));
    }
    let runs = extent_runs(map, nodes);
    if as_json {
        let mut v = json!({
            "epoch": map.epoch, "file_size": map.file_size, "extent_size": map.extent_size,
            "page_size": map.page_size, "extents": total,
            "unowned": map.owner.iter().filter(|&&o| o == 0).count(),
            "in_handoff": map.previous_owner.iter().filter(|&&p| p != 0).count(),
            "max_deviation_percent": max_dev, "nodes": per_node,
        });
        if extents {
            v["runs"] = Value::Array(
                runs.iter()
                    .map(|(a, b, n)| json!({"first": a, "last": b, "node": n}))
                    .collect(),
            );
        }
        print_json(&v);
        return;
    }
    outln!(
        "epoch {}  {} extents of {}  file {}  in handoff {}  unowned {}",
        map.epoch,
        total,
        human_bytes(map.extent_size),
        human_bytes(map.file_size),
        map.previous_owner.iter().filter(|&&p| p != 0).count(),
        map.owner.iter().filter(|&&o| o == 0).count()
    );
    out!(
        "{}",
        table(
            &[
                "NODE",
                "INDEX",
                "STATE",
                "CAPACITY",
                "WEIGHT",
                "EXTENTS",
                "SHARE",
                "DEVIATION",
                "HANDING OFF"
            ],
            &rows
        )
    );
    outln!("balance: largest deviation from capacity weight {max_dev:.1}%");
    if extents {
        let rows: Vec<Vec<String>> = runs
            .iter()
            .map(|(a, b, n)| {
                vec![
                    if a == b {
                        a.to_string()
                    } else {
                        format!("{a}-{b}")
                    },
                    n.clone(),
                ]
            })
            .collect();
        out!("{}", table(&["EXTENTS", "OWNER"], &rows));
    }
}

fn extent_runs(map: &OwnershipMap, nodes: &[NodeInfo]) -> Vec<(u64, u64, String)> {
    let name = |i: u32| {
        nodes.iter().find(|n| n.index == i).map_or_else(
            || {
                if i == 0 {
                    "-".to_owned()
                } else {
                    format!("#{i}")
                }
            },
            |n| n.node_id.clone(),
        )
    };
    let mut runs: Vec<(u64, u64, String)> = Vec::new();
    let mut last = None;
    for (e, &o) in map.owner.iter().enumerate() {
        let e = e as u64;
        match (last, runs.last_mut()) {
            (Some(l), Some(r)) if l == o => r.1 = e,
            _ => runs.push((e, e, name(o))),
        }
        last = Some(o);
    }
    runs
}

fn print_range_result(what: &str, r: &ClusterRangeResponse, as_json: bool) -> bool {
    let ok = r.results.iter().all(|n| n.error.is_empty());
    if as_json {
        print_json(&json!({
            "operation": what, "epoch": r.map_epoch, "ok": ok,
            "nodes": r.results.iter().map(|n| json!({"node_id": n.node_id, "pages": n.pages, "error": n.error})).collect::<Vec<_>>(),
        }));
    } else {
        let rows: Vec<Vec<String>> = r
            .results
            .iter()
            .map(|n| {
                vec![
                    if n.node_id.is_empty() {
                        "-".into()
                    } else {
                        n.node_id.clone()
                    },
                    n.pages.to_string(),
                    if n.error.is_empty() {
                        "ok".into()
                    } else {
                        n.error.clone()
                    },
                ]
            })
            .collect();
        outln!("{what} at epoch {}", r.map_epoch);
        out!("{}", table(&["NODE", "PAGES", "RESULT"], &rows));
    }
    if !ok {
        eprintln!("pwctl: {what} failed on some nodes");
    }
    ok
}

fn cpu_list(cpus: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

fn print_topology(nodes: &[NodeInfo], as_json: bool) {
    if as_json {
        print_json(&Value::Array(
            nodes
                .iter()
                .map(|n| json!({"node_id": n.node_id, "topology": n.topology.as_ref().map(topology_json)}))
                .collect(),
        ));
        return;
    }
    let mut rows = Vec::new();
    for n in nodes {
        let t = n.topology.clone().unwrap_or_default();
        if t.numa_nodes.is_empty() {
            rows.push(vec![
                n.node_id.clone(),
                t.hostname.clone(),
                "-".into(),
                "-".into(),
                "-".into(),
                t.source.clone(),
            ]);
        }
        for numa in &t.numa_nodes {
            rows.push(vec![
                n.node_id.clone(),
                t.hostname.clone(),
                numa.os_index.to_string(),
                cpu_list(&numa.cpus),
                if numa.memory_bytes > 0 {
                    human_bytes(numa.memory_bytes)
                } else {
                    "?".into()
                },
                t.source.clone(),
            ]);
        }
    }
    out!(
        "{}",
        table(&["NODE", "HOST", "NUMA", "CPUS", "MEMORY", "SOURCE"], &rows)
    );
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
    fn cpu_lists_compress() {
        assert_eq!(cpu_list(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }

    #[test]
    fn a_stuck_drain_says_what_it_waits_for() {
        let node = |id: &str, index, state: NodeState, applied| {
            let mut n = NodeInfo {
                node_id: id.into(),
                index,
                applied_epoch: applied,
                ..Default::default()
            };
            n.set_state(state);
            n
        };
        let nodes = vec![
            node("a", 1, NodeState::Draining, 7),
            node("b", 2, NodeState::Alive, 6),
        ];
        let map = OwnershipMap {
            epoch: 7,
            owner: vec![2, 2],
            previous_owner: vec![1, 0],
            ..Default::default()
        };
        let why = drain_blocker(&map, &nodes, "a", NodeState::Draining);
        assert!(why.contains("hands off 1"), "{why}");
        assert!(why.contains("b (alive, applied epoch 6)"), "{why}");
        assert!(!why.contains("a ("), "{why}");
    }

    #[test]
    fn table_aligns() {
        let t = table(&["A", "BB"], &[vec!["xxx".into(), "y".into()]]);
        assert_eq!(t, "A    BB\nxxx  y\n");
    }
}
