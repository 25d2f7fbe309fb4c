//! pagewire-bench: the seed benchmarks of the lockless page cache, the
//! transport and remote-read benchmarks, the distributed fault storm and
//! the nemesis, the FUSE mount's benchmark, and the one-command demo; its
//! hidden `node` and `coordinator` commands run the daemons themselves.
//!
//! Every subcommand prints a human table, or one JSON object with `--json`
//! ({"bench", "machine", "params", "results": [...]}), states the machine,
//! and reports medians of repeated runs.

mod bytes;
mod client_metrics;
mod genfile;
mod insert;
mod local;
mod machine;
mod mapscale;
mod miss;
mod mount;
mod nemesis;
mod plot;
mod policy;
mod readloop;
mod remote;
mod report;
mod storm;
mod transport;
mod vmexec;
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
    /// Every eviction × admission policy the node implements, side by
    /// side: a zipfian read storm through a cache smaller than the file,
    /// hit ratio and pages/s per combination.
    Policy(policy::Args),
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
    /// The distributed fault storm: a coordinator, M nodes and C reader
    /// processes; one-sided vs gRPC vs Redis vs pread side by side, then a
    /// storm with writes and a fault schedule (kill, restart, pause, cut).
    Storm(Box<storm::Args>),
    /// The whole system in one command: a 3-node cluster on loopback, a
    /// storm with a node killed and restarted, the table and the plots.
    Demo(storm::DemoArgs),
    /// A seeded random fault schedule (kill -9, restart in place, SIGSTOP
    /// past the lease, cuts, coordinator failover, drains, joins, tight
    /// follow-ups) under logged reads and writes, and a per-page
    /// linearizability check of the history.
    Nemesis(Box<nemesis::Args>),
    /// What the ownership map costs as the file and the cluster grow: an
    /// in-process coordinator, simulated members that only heartbeat and
    /// watchers on WatchMap (compact); map and delta bytes, join-to-applied
    /// time, coordinator CPU per heartbeat, beside the old expanded map.
    Mapscale(mapscale::Args),
    /// What a one-sided miss costs: faulted in by a call on the owner's
    /// tcp transport and by gRPC, beside a one-sided hit and a pread of
    /// the page, over tcp and shm, every page verified.
    Miss(miss::Args),
    /// fio through `pagewire-mount` over shm and tcp, beside the local
    /// page cache and a do-nothing FUSE file system, every read verified.
    Mount(mount::Args),
    /// Write a self-describing backing file (kept when one of that size is
    /// already there).
    Genfile(genfile::Args),
    /// Read (and write) a running cluster's pages, every byte verified;
    /// one JSON line of counts per interval (the compose scenarios' reader).
    Readloop(readloop::Args),
    /// A reader process of `storm` (started by it; not for direct use).
    #[command(hide = true)]
    StormReader(storm::reader::ReaderArgs),
    /// A worker process of `nemesis` (started by it; not for direct use).
    #[command(hide = true)]
    NemesisWorker(nemesis::worker::WorkerArgs),
    /// The owner process of `remote` (started by it; not for direct use).
    #[command(hide = true)]
    RemoteOwner(remote::owner::OwnerArgs),
    /// Runs programs it is sent, for `vm-exec` (the storm across VMs).
    #[command(hide = true)]
    VmAgent(vmexec::AgentArgs),
    /// Runs a program on a `vm-agent` (killed with this process), or
    /// signals one.
    #[command(hide = true)]
    VmExec(vmexec::ExecArgs),
}

fn main() -> std::process::ExitCode {
    // `storm` and `demo` run the cluster's daemons as children of this
    // executable: `pagewire-bench node …` is `pagewire-node …`, and
    // `pagewire-bench coordinator …` is `pagewire-coordinator …`.
    let sub = std::env::args_os().nth(1);
    let rest = || std::env::args_os().skip(2);
    if sub.as_deref() == Some("node".as_ref()) {
        return pagewire_node::daemon::cli::main_from(
            std::iter::once("pagewire-node".into()).chain(rest()),
        );
    }
    if sub.as_deref() == Some("coordinator".as_ref()) {
        return pagewire_coordinator::cli::main_from(
            std::iter::once("pagewire-coordinator".into()).chain(rest()),
        );
    }
    if sub.as_deref() == Some("vm-exec".as_ref()) {
        // Its exit code is the remote program's.
        use clap::FromArgMatches;
        let m = <vmexec::ExecArgs as clap::Args>::augment_args(clap::Command::new("vm-exec"))
            .get_matches_from(std::iter::once("vm-exec".into()).chain(rest()));
        return match vmexec::ExecArgs::from_arg_matches(&m)
            .map_err(anyhow::Error::from)
            .and_then(|a| vmexec::exec(&a))
        {
            Ok(code) => std::process::ExitCode::from(u8::try_from(code).unwrap_or(1)),
            Err(e) => {
                eprintln!("vm-exec: {e:#}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    match bench() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:?}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn bench() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::Local(a) => local::run(&a),
        Cmd::Policy(a) => policy::run(&a),
        Cmd::Bytes(a) => bytes::run(&a),
        Cmd::Insert(a) => insert::run(&a),
        Cmd::Transport(a) => transport::run(&a),
        Cmd::Remote(a) => remote::run(&a),
        Cmd::RemoteOwner(a) => remote::owner::serve(&a),
        Cmd::Storm(a) => storm::run(&a),
        Cmd::Demo(a) => storm::demo(&a),
        Cmd::Mapscale(a) => mapscale::run(&a),
        Cmd::Miss(a) => miss::run(&a),
        Cmd::Mount(a) => mount::run(&a),
        Cmd::Nemesis(a) => nemesis::run(&a),
        Cmd::NemesisWorker(a) => nemesis::worker::run(&a),
        Cmd::StormReader(a) => storm::reader::run(&a),
        Cmd::Genfile(a) => genfile::run(&a),
        Cmd::Readloop(a) => readloop::run(&a),
        Cmd::VmAgent(a) => vmexec::agent(&a),
        Cmd::VmExec(a) => vmexec::exec(&a).map(|_| ()),
    }
}
