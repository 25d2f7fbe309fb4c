//! `pagewire-node` for the end-to-end tests: the daemon's own entry point.

fn main() -> std::process::ExitCode {
    pagewire_node::daemon::cli::main_from(
        std::iter::once("pagewire-node".into()).chain(std::env::args_os().skip(1)),
    )
}
