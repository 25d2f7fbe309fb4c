//! `pagewire-mount` for the end-to-end tests: the mount's own entry point.

fn main() -> std::process::ExitCode {
    pagewire_mount::cli::main_from(
        std::iter::once("pagewire-mount".into()).chain(std::env::args_os().skip(1)),
    )
}
