//! `pagewire-coordinator` for the end-to-end tests: the coordinator's own
//! entry point.

fn main() -> std::process::ExitCode {
    pagewire_coordinator::cli::main_from(
        std::iter::once("pagewire-coordinator".into()).chain(std::env::args_os().skip(1)),
    )
}
