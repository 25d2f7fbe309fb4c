//! `pagewire-coordinator`'s command line: flags over the config file,
//! logging, the runtime, and shutdown on SIGTERM or Ctrl-C.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::Config;
use clap::Parser;
use std::ffi::OsString;
use tracing_subscriber::EnvFilter;

/// The pagewire coordinator. Flags override the config file.
#[derive(Debug, Parser)]
#[command(name = "pagewire-coordinator", version)]
struct Args {
    /// TOML config file (every option: coordinator.example.toml).
    #[arg(long, short = 'c', env = "PAGEWIRE_COORDINATOR_CONFIG")]
    config: Option<PathBuf>,
    /// gRPC listen address (host:port).
    #[arg(long)]
    listen: Option<String>,
    /// Prometheus /metrics listen address (host:port); "" disables it.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// State file (members, map, epoch, policy), for the file store.
    #[arg(long)]
    state_file: Option<PathBuf>,
    /// Where the state lives: "file" (the state file, default),
    /// "file:PATH", or "etcd://host:port,..." (several coordinators, one
    /// leading; needs the `etcd` build feature).
    #[arg(long)]
    store: Option<String>,
    /// The gRPC address other coordinators name to clients (host:port;
    /// default: the address bound for --listen).
    #[arg(long)]
    advertise: Option<String>,
    /// File holding the cluster token.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Lease in milliseconds: a node silent this long is declared dead.
    #[arg(long)]
    lease_ms: Option<u64>,
    /// Size of the backing file in bytes (0: from the first node).
    #[arg(long)]
    file_size: Option<u64>,
    /// Extent size in bytes (a multiple of the page size).
    #[arg(long)]
    extent_size: Option<u64>,
    /// Log filter (e.g. "info", "pagewire_coordinator=debug").
    #[arg(long)]
    log: Option<String>,
}

/// `pagewire-coordinator`'s `main`: parses `args` (the first is the program
/// name) as its command line, runs the coordinator until SIGTERM or Ctrl-C,
/// and returns the exit code (2: a usage or config error). Other programs
/// (the bench's one-binary demo) run a coordinator through this.
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
            eprintln!("pagewire-coordinator: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(v) = args.listen {
        cfg.listen = v;
    }
    if let Some(v) = args.metrics_listen {
        cfg.metrics_listen = v;
    }
    if let Some(v) = args.state_file {
        cfg.state_file = v;
    }
    if let Some(v) = args.store {
        cfg.store = v;
    }
    if let Some(v) = args.advertise {
        cfg.advertise = v;
    }
    if let Some(v) = args.token_file {
        cfg.token = String::new();
        cfg.token_file = Some(v);
    }
    if let Some(v) = args.lease_ms {
        cfg.lease_ms = v;
    }
    if let Some(v) = args.file_size {
        cfg.map.file_size = v;
    }
    if let Some(v) = args.extent_size {
        cfg.map.extent_size = v;
    }
    if let Some(v) = args.log {
        cfg.log = v;
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
            eprintln!("pagewire-coordinator: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pagewire-coordinator: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(crate::run(cfg, token, shutdown_signal(), |_| {}));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pagewire-coordinator: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutting down");
}
