//! pagewire-bench: the seed benchmarks of the lockless page cache (and,
//! as the project grows, the transport and distributed fault-storm benches).
//!
//! Every subcommand prints a human table, or one JSON object with `--json`
//! ({"bench", "machine", "params", "results": [...]}), states the machine,
//! and reports medians of repeated runs.

mod bytes;
mod insert;
mod local;
mod machine;
mod plot;
mod report;
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
    }
}
