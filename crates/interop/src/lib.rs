//! Support for the interop tests in `tests/`: where the workspace's own binaries are.
//!
//! The tests run plugreg's binaries (`plugreg`, `csi-node-driver-registrar`) against peers
//! nobody here wrote (see `plugreg-testpeers` and `interop/build-peers.sh`).

use std::path::PathBuf;

/// The path of a binary of this workspace, built next to the test executable (`cargo test
/// --workspace` builds them all before any test runs). Panics with the command that builds it
/// when it is missing.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test executables live in target/<profile>/deps");
    let bin = dir.join(name);
    assert!(
        bin.exists(),
        "plugreg binary {name} is not built at {}: run `cargo build --workspace --bins` (cargo test --workspace builds it)",
        bin.display()
    );
    bin
}
