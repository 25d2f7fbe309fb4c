//! `pagewire-mount`: mounts a directory holding one file, the pagewire
//! cluster's (mount/README.md); the command line is [`pagewire_mount::cli`].

fn main() -> std::process::ExitCode {
    pagewire_mount::cli::main_from(std::env::args_os())
}
