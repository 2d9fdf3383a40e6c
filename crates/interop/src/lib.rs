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

/// Defines one test per real Kubernetes release for each body: `async fn name(k: KubeVersion)
/// { ... }` becomes the module `name` with the tests `name::v1_20_2` and `name::v1_36_2`, each
/// calling the body with its [`KubeVersion`](plugreg_testpeers::KubeVersion) on a two-thread
/// tokio runtime. The body sees the enclosing module's items (`use super::*`).
#[macro_export]
macro_rules! for_each_kube_version {
    ($($(#[$meta:meta])* async fn $name:ident($k:ident: KubeVersion) $body:block)*) => {
        $(
            $(#[$meta])*
            mod $name {
                #[allow(unused_imports)]
                use super::*;
                // A new release in KubeVersion::ALL needs a test function here.
                const _: () = assert!(plugreg_testpeers::KubeVersion::ALL.len() == 2);

                async fn body($k: plugreg_testpeers::KubeVersion) $body

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn v1_20_2() {
                    body(plugreg_testpeers::KubeVersion::V1_20_2).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn v1_36_2() {
                    body(plugreg_testpeers::KubeVersion::V1_36_2).await
                }
            }
        )*
    };
}
