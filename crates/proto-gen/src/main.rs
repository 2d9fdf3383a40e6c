//! `cargo run -p plugreg-proto-gen`: rewrites `crates/proto/src/gen` from the `.proto` files in
//! `crates/proto/proto`. Run it after changing a `.proto` file and commit the result.

use std::process::ExitCode;

fn main() -> ExitCode {
    match plugreg_proto_gen::regenerate() {
        Ok(changed) if changed.is_empty() => {
            println!("crates/proto/src/gen is up to date");
            ExitCode::SUCCESS
        }
        Ok(changed) => {
            println!("regenerated crates/proto/src/gen: {}", changed.join(", "));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("plugreg-proto-gen: {}", plugreg_runtime::report::chain(&e));
            ExitCode::FAILURE
        }
    }
}
