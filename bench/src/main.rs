//! pagewire-bench: the seed benchmarks of the lockless page cache, the
//! transport benchmark, and (as the project grows) the distributed fault
//! storms.
//!
//! Every subcommand prints a human table, or one JSON object with `--json`
//! ({"bench", "machine", "params", "results": [...]}), states the machine,
//! and reports medians of repeated runs.

mod bytes;
mod insert;
mod local;
mod machine;
mod plot;
mod remote;
mod report;
mod transport;
mod workers;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "pagewire-bench", version, about = "pagewire's benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Read-fault storm on one node: N threads reading a file preloaded in
    /// the cache, every index variant and Linux pread side by side.
    Local(local::Args),
    /// 1-byte reads and writes through each index variant (`dd bs=1`).
    Bytes(bytes::Args),
    /// 2^23 sequential page insertions: single and gang, global lock and
    /// fine-grained.
    Insert(insert::Args),
    /// 4 KiB READ latency and throughput of each transport, beside raw TCP,
    /// memcpy and Redis GET.
    Transport(transport::TransportArgs),
    /// The same pages of one owner read four ways: one-sided over `shm` and
    /// `tcp`, the two-sided gRPC `Read`, and Redis GET; owner CPU per read.
    Remote(remote::Args),
    /// The owner process of `remote` (started by it; not for direct use).
    #[command(hide = true)]
    RemoteOwner(remote::owner::OwnerArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::Local(a) => local::run(&a),
        Cmd::Bytes(a) => bytes::run(&a),
        Cmd::Insert(a) => insert::run(&a),
        Cmd::Transport(a) => transport::run(&a),
        Cmd::Remote(a) => remote::run(&a),
        Cmd::RemoteOwner(a) => remote::owner::serve(&a),
    }
}
