//! Compiles the `.proto` files with protox (pure Rust: no system `protoc`
//! needed) and generates the tonic/prost code from the descriptors.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/pagewire/v1/common.proto",
        "proto/pagewire/v1/coordinator.proto",
        "proto/pagewire/v1/node.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        // Servers only with feature `server` (a client links no router).
        .build_server(std::env::var_os("CARGO_FEATURE_SERVER").is_some())
        .build_client(true)
        .emit_rerun_if_changed(false)
        .compile_fds(fds)?;
    Ok(())
}
