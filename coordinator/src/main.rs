//! `pagewire-coordinator`: membership, leases and the ownership map of a
//! pagewire cluster. See `coordinator.example.toml` for every setting.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use pagewire_coordinator::Config;
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
    /// State file (members, map, epoch, policy).
    #[arg(long)]
    state_file: Option<PathBuf>,
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

fn main() -> ExitCode {
    let args = Args::parse();
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
        .init();
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
    let result = rt.block_on(pagewire_coordinator::run(
        cfg,
        token,
        shutdown_signal(),
        |_| {},
    ));
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
