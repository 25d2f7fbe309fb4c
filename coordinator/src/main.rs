//! `pagewire-coordinator`: membership, leases and the ownership map of a
//! pagewire cluster. See `coordinator.example.toml` for every setting. The
//! command line is `pagewire_coordinator::cli`.

fn main() -> std::process::ExitCode {
    pagewire_coordinator::cli::main_from(std::env::args_os())
}
