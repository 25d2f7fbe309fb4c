//! `pagewire-node`: the node daemon around the local page cache. See
//! `node/src/daemon/pagewire-node.example.toml` for every setting. The
//! daemon is `pagewire_node::daemon`; this is its command line.

#[cfg(not(loom))]
fn main() -> std::process::ExitCode {
    pagewire_node::daemon::cli::main_from(std::env::args_os())
}

// Loom builds (`--cfg loom`) compile the cache's models only; tokio, which
// the daemon needs, does not build under that cfg.
#[cfg(loom)]
fn main() {}
