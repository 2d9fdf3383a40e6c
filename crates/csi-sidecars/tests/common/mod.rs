//! What the `csi-sidecars` tests and its benchmark share: the real peers a controller sidecar
//! needs (kube-apiserver and kube-controller-manager v1.36.2, optionally the Go
//! snapshot-controller with the snapshot CRDs), with the namespace and the CSINode of the
//! test driver on its node, and the separate sidecars' binaries of this checkout.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::storage::v1::CSINode;
use plugreg_testpeers::sidecar::create_object;
use plugreg_testpeers::{ApiServer, ControllerManager, KubeVersion, SnapshotController};
use serde_json::json;

/// The peers of one test or benchmark side; dropped (the controllers first, then the API
/// server) when it ends.
pub struct Peers {
    _snapshots: Option<SnapshotController>,
    _kcm: ControllerManager,
    /// A client of the API server.
    pub client: kube::Client,
    /// The API server.
    pub api: ApiServer,
}

impl Peers {
    /// A fresh API server v1.36.2 with kube-controller-manager's volume controllers (given
    /// `kcm_args`), the snapshot-controller when `snapshots` gives its args, the namespace
    /// `ns`, and the CSINode of `node` listing `driver` with the node ID `node`.
    pub async fn start(
        kcm_args: &[&str],
        snapshots: Option<&[&str]>,
        ns: &str,
        driver: &str,
        node: &str,
    ) -> Peers {
        let api = ApiServer::start_version(KubeVersion::V1_36_2)
            .await
            .expect("kube-apiserver v1.36.2");
        let kcm = ControllerManager::start_volume_controllers(&api, kcm_args)
            .await
            .expect("kube-controller-manager v1.36.2");
        let snapshots = match snapshots {
            Some(args) => Some(
                SnapshotController::start_with(&api, args)
                    .await
                    .expect("snapshot-controller v8.6.0"),
            ),
            None => None,
        };
        let client = api.client().await.expect("a client");
        create_object::<Namespace>(&client, json!({"metadata": {"name": ns}})).await;
        create_object::<CSINode>(
            &client,
            json!({"metadata": {"name": node},
                   "spec": {"drivers": [{"name": driver, "nodeID": node}]}}),
        )
        .await;
        Peers {
            _snapshots: snapshots,
            _kcm: kcm,
            client,
            api,
        }
    }
}

/// The directory of this checkout's binaries of the running profile (`target/<profile>`).
pub fn binaries() -> PathBuf {
    let exe = std::env::current_exe().expect("this program's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_owned()
}

/// Builds the workspace's binaries (other packages' binaries, such as the separate sidecars)
/// with the running profile, as `cargo test --workspace` resolves features: with the tests
/// selected, so that dev-dependencies' features count. Under `cargo test --workspace` (CI) that
/// is cargo's no-op; a `-p` selection would resolve features differently and compile a second
/// copy of tokio, tonic, kube and the sidecars beside the first.
pub fn build_workspace_binaries() {
    let mut cargo = Command::new(env!("CARGO"));
    cargo.args(["build", "--workspace", "--bins", "--tests"]);
    if binaries().ends_with("release") {
        cargo.arg("--release");
    }
    let status = cargo
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("cargo");
    assert!(status.success(), "building the workspace's binaries");
}

/// Polls `f` every 100 ms until it returns `Some`, for at most `within`; on time-out the panic
/// shows the log of the csi-sidecars `process`.
pub async fn poll<T, F, Fut>(
    what: &str,
    within: std::time::Duration,
    process: &plugreg_testpeers::sidecar::LoggedSidecar,
    f: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let log = || format!("csi-sidecars' log:\n{}", process.log());
    plugreg_testpeers::sidecar::poll_showing(what, within, log, f).await
}
