//! Compiles our `.proto` files with protox (a pure-Rust protobuf compiler), so no system `protoc`
//! is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/pluginregistration.proto",
        "proto/example_v1beta1.proto",
        "proto/example_v1beta2.proto",
        "proto/csi.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
