//! `pagewire-node`'s command line: flags over the config file, logging,
//! the runtime, and shutdown on SIGTERM or Ctrl-C (the first drains and
//! leaves, a second exits at once).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use crate::daemon::{self, Config};
use std::ffi::OsString;

/// A pagewire node: serves its share of the file from a lockless page
/// cache. Flags override the config file.
#[derive(Debug, Parser)]
#[command(name = "pagewire-node", version)]
struct Args {
    /// TOML config file (every option: node/src/daemon/pagewire-node.example.toml).
    #[arg(long, short = 'c', env = "PAGEWIRE_NODE_CONFIG")]
    config: Option<PathBuf>,
    /// Node id (default: the host name).
    #[arg(long, env = "PAGEWIRE_NODE_ID")]
    node_id: Option<String>,
    /// The backing file this cluster caches.
    #[arg(long)]
    backing_file: Option<PathBuf>,
    /// gRPC listen address (host:port).
    #[arg(long)]
    listen: Option<String>,
    /// Address registered with the coordinator (default: the bound listen
    /// address; for a wildcard listen, this host's address towards the
    /// coordinator).
    #[arg(long, env = "PAGEWIRE_ADVERTISE")]
    advertise: Option<String>,
    /// Prometheus /metrics listen address; "" disables it.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Coordinator addresses, comma-separated (host:port,...): calls follow
    /// the leader among them.
    #[arg(long, env = "PAGEWIRE_COORDINATOR")]
    coordinator: Option<String>,
    /// File holding the cluster token.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Cache frames (capacity in pages).
    #[arg(long)]
    frames: Option<usize>,
    /// Page size in bytes.
    #[arg(long)]
    page_size: Option<usize>,
    /// Capacity announced to the coordinator (default: frames x page size).
    #[arg(long)]
    capacity_bytes: Option<u64>,
    /// Milliseconds this node takes off its lease against clock drift.
    #[arg(long)]
    clock_drift_margin_ms: Option<u64>,
    /// Directory of the shm file the region lives in (transports.shm_dir).
    #[arg(long)]
    shm_dir: Option<std::path::PathBuf>,
    /// Serve the region over RDMA verbs too (transports.verbs = true).
    #[arg(long)]
    verbs: bool,
    /// RDMA device for verbs (transports.verbs_device; default: chosen by
    /// the advertised address).
    #[arg(long)]
    verbs_device: Option<String>,
    /// GID index for verbs (transports.verbs_gid_index; -1: chosen at start).
    #[arg(long, allow_hyphen_values = true)]
    verbs_gid_index: Option<i32>,
    /// Log filter.
    #[arg(long)]
    log: Option<String>,
}

/// `pagewire-node`'s `main`: parses `args` (the first is the program name)
/// as its command line, runs the daemon until SIGTERM or Ctrl-C, and returns
/// the exit code (2: a usage or config error). Other programs (the bench's
/// one-binary demo) run a node through this.
pub fn main_from<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args = match Args::try_parse_from(args) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let mut cfg = match Config::load(args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("pagewire-node: {e}");
            return ExitCode::from(2);
        }
    };
    macro_rules! set {
        ($($field:ident).+ = $arg:expr) => {
            if let Some(v) = $arg {
                cfg.$($field).+ = v;
            }
        };
    }
    set!(node_id = args.node_id);
    set!(backing_file = args.backing_file);
    set!(listen = args.listen);
    set!(advertise = args.advertise);
    set!(metrics_listen = args.metrics_listen);
    set!(coordinator = args.coordinator);
    set!(cache.frames = args.frames);
    set!(cache.page_size = args.page_size);
    set!(capacity_bytes = args.capacity_bytes);
    set!(clock_drift_margin_ms = args.clock_drift_margin_ms);
    set!(transports.shm_dir = args.shm_dir);
    if args.verbs {
        cfg.transports.verbs = true;
    }
    set!(transports.verbs_device = args.verbs_device);
    set!(transports.verbs_gid_index = args.verbs_gid_index);
    set!(log = args.log);
    if let Some(v) = args.token_file {
        cfg.token = String::new();
        cfg.token_file = Some(v);
    }
    if cfg.token.is_empty()
        && cfg.token_file.is_none()
        && let Ok(t) = std::env::var("PAGEWIRE_TOKEN")
    {
        cfg.token = t;
    }
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&cfg.log))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init()
        .ok();
    let token = match cfg.validate().and_then(|()| cfg.resolve_token()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("pagewire-node: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pagewire-node: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(async {
        let signals = shutdown_signals();
        daemon::run(cfg, token, signals).await
    }) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pagewire-node: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One message per SIGTERM or Ctrl-C. Must be called inside the runtime.
fn shutdown_signals() -> tokio::sync::mpsc::UnboundedReceiver<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut term = signal(SignalKind::terminate()).ok();
    let mut int = signal(SignalKind::interrupt()).ok();
    tokio::spawn(async move {
        loop {
            let got = tokio::select! {
                Some(()) = async { term.as_mut()?.recv().await } => "SIGTERM",
                Some(()) = async { int.as_mut()?.recv().await } => "SIGINT",
                else => return,
            };
            tracing::info!(signal = got, "signal received");
            if tx.send(()).is_err() {
                return;
            }
        }
    });
    rx
}
