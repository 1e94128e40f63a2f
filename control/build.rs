//! Compiles the engine/control-plane protocol. protoc comes vendored, so no build machine
//! needs it installed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    println!("cargo:rerun-if-changed=proto/fleetplane.proto");
    tonic_prost_build::configure().compile_protos(&["proto/fleetplane.proto"], &["proto"])?;
    Ok(())
}
