//! `pwctl`, pagewire's admin CLI; everything is in the library
//! ([`pagewire_pwctl::main_from`]).

fn main() -> std::process::ExitCode {
    pagewire_pwctl::main_from(std::env::args_os())
}
