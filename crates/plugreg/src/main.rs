//! The `plugreg` binary: the commands are in the library (`src/lib.rs`).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    plugreg::main().await
}
