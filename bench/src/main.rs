//! pagewire-bench: pagewire's benchmarks.
//!
//! Minimal wiring of the `transport` subcommand on the `rdma` branch; the
//! lead merges it with the other subcommands.

use clap::{Parser, Subcommand};

mod transport;

#[derive(Parser)]
#[command(name = "pagewire-bench", about = "pagewire's benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// 4 KiB READ latency and throughput of each transport, beside raw TCP, memcpy and Redis.
    Transport(transport::TransportArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Transport(args) => transport::run(&args),
    }
}
