//! `pwctl` for the end-to-end tests: pwctl's own entry point.

fn main() -> std::process::ExitCode {
    pagewire_pwctl::main_from(std::iter::once("pwctl".into()).chain(std::env::args_os().skip(1)))
}
