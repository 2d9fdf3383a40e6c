//! The snapshot peers of a real cluster: external-snapshotter v8.6.0's CRDs and its Go
//! `snapshot-controller` (VolumeSnapshot -> VolumeSnapshotContent, binding, finalizers,
//! deletion policy), which stay upstream's in every cluster while csi-snapshotter is the
//! sidecar beside the driver. Both come prebuilt (`interop/build-peers.sh` unpacks them into
//! the peers' folder: `bin/snapshot-controller-v8.6.0` and `crd/*.yaml`).
//!
//! The CRDs use validation rules that need Kubernetes 1.25 or later, so they are installed on a
//! v1.36.2 API server only.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::apiserver::ApiServer;
use crate::error::Error;
use crate::kubelet::KubeVersion;
use crate::peers::{peer, peers_dir};
use crate::process::PeerProcess;

/// The snapshot-controller peer's name in the peers' `bin/`.
pub const SNAPSHOT_CONTROLLER: &str = "snapshot-controller-v8.6.0";

/// The CRDs' files in the peers' `crd/` folder, in the order a cluster applies them.
pub const SNAPSHOT_CRDS: [&str; 6] = [
    "snapshot.storage.k8s.io_volumesnapshotclasses.yaml",
    "snapshot.storage.k8s.io_volumesnapshotcontents.yaml",
    "snapshot.storage.k8s.io_volumesnapshots.yaml",
    "groupsnapshot.storage.k8s.io_volumegroupsnapshotclasses.yaml",
    "groupsnapshot.storage.k8s.io_volumegroupsnapshotcontents.yaml",
    "groupsnapshot.storage.k8s.io_volumegroupsnapshots.yaml",
];

const CRD_PATH: &str = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions";

fn crd_file(name: &str) -> PathBuf {
    peers_dir().join("crd").join(name)
}

/// Installs the snapshot CRDs on `api` (kube-apiserver reads their YAML itself) and waits, at
/// most 60 s, until each is Established. CRDs already there (an API server shared by several
/// tests) are left as they are.
pub async fn install_snapshot_crds(api: &ApiServer) -> Result<(), Error> {
    if api.version() != KubeVersion::V1_36_2 {
        return Err(Error::Unsupported(
            "the snapshot CRDs need Kubernetes 1.25 or later: use a v1.36.2 API server".into(),
        ));
    }
    let client = api.client().await?;
    let mut names = Vec::new();
    for file in SNAPSHOT_CRDS {
        let path = crd_file(file);
        let yaml = std::fs::read(&path).map_err(|e| {
            Error::io(
                format!(
                    "reading {} (interop/build-peers.sh copies the snapshot CRDs there)",
                    path.display()
                ),
                e,
            )
        })?;
        // `<group>_<plural>.yaml` holds the CRD `<plural>.<group>`.
        if let Some((group, plural)) = file.trim_end_matches(".yaml").split_once('_') {
            names.push(format!("{plural}.{group}"));
        }
        let request = http::Request::post(CRD_PATH)
            .header("Content-Type", "application/yaml")
            .body(yaml)
            .map_err(|e| Error::NotReady {
                peer: "the snapshot CRDs".into(),
                log: String::new(),
                reason: format!("building the request for {file}: {e}"),
            })?;
        match client.request_text(request).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => {
                return Err(Error::NotReady {
                    peer: "the snapshot CRDs".into(),
                    log: String::new(),
                    reason: format!("creating {file}: {e}"),
                });
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    for name in names {
        loop {
            let request = http::Request::get(format!("{CRD_PATH}/{name}"))
                .body(Vec::new())
                .map_err(|e| Error::NotReady {
                    peer: "the snapshot CRDs".into(),
                    log: String::new(),
                    reason: format!("building the request for {name}: {e}"),
                })?;
            let established = match client.request::<serde_json::Value>(request).await {
                Ok(crd) => crd["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Established" && c["status"] == "True"),
                Err(_) => false,
            };
            if established {
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::NotReady {
                    peer: "the snapshot CRDs".into(),
                    log: String::new(),
                    reason: format!("{name} not Established within 60 s"),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// A running Go snapshot-controller v8.6.0 against an [`ApiServer`] (admin credentials, no
/// leader election), its metrics endpoint on a free port of 127.0.0.1.
///
/// Dropping it kills the process.
#[derive(Debug)]
pub struct SnapshotController {
    process: PeerProcess,
    http: std::net::SocketAddr,
}

impl SnapshotController {
    /// Installs the CRDs on `api` ([`install_snapshot_crds`]), starts the controller and waits
    /// (at most 60 s) until its metrics endpoint answers.
    ///
    /// Fails with [`Error::MissingPeer`] if it is not unpacked (`interop/build-peers.sh` does
    /// it), and with [`Error::NotReady`] (holding its log) if it exits or never answers.
    pub async fn start(api: &ApiServer) -> Result<Self, Error> {
        Self::start_with(api, &[]).await
    }

    /// [`start`](Self::start) with `extra` flags after the test's own (a benchmark raises the
    /// controller's `--kube-api-qps` so that it is not the one measured).
    pub async fn start_with(api: &ApiServer, extra: &[&str]) -> Result<Self, Error> {
        let bin = peer(SNAPSHOT_CONTROLLER)?;
        install_snapshot_crds(api).await?;
        let http = std::net::SocketAddr::from((
            std::net::Ipv4Addr::LOCALHOST,
            crate::apiserver::free_port()?,
        ));
        let mut process = PeerProcess::spawn_program(
            SNAPSHOT_CONTROLLER,
            &bin,
            [
                format!("--kubeconfig={}", api.kubeconfig_path().display()),
                "--leader-election=false".to_owned(),
                format!("--http-endpoint={http}"),
            ]
            .into_iter()
            .chain(extra.iter().map(|a| (*a).to_owned())),
        )?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let answered = tokio::task::spawn_blocking(move || {
                crate::apiserver::plain_get(http, "/metrics")
                    .is_some_and(|(status, _)| status == 200)
            })
            .await
            .unwrap_or(false);
            if answered {
                return Ok(SnapshotController { process, http });
            }
            if let Ok(status) = process.wait_exit(Duration::ZERO).await {
                return Err(Error::NotReady {
                    peer: SNAPSHOT_CONTROLLER.into(),
                    log: process.stderr_tail(),
                    reason: format!("exited with {status}"),
                });
            }
            if Instant::now() > deadline {
                return Err(Error::NotReady {
                    peer: SNAPSHOT_CONTROLLER.into(),
                    log: process.stderr_tail(),
                    reason: "its metrics endpoint did not answer within 60 s".into(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Its `--http-endpoint` (metrics).
    pub fn http_endpoint(&self) -> std::net::SocketAddr {
        self.http
    }

    /// The end of its log (klog on stderr).
    pub fn log_tail(&self) -> String {
        self.process.stderr_tail()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }
}
