//! A real kube-controller-manager (v1.20.2 or v1.36.2) against an [`ApiServer`] of the same
//! release, on loopback only.
//!
//! What differs between the two releases' command lines:
//!
//! | | v1.20.2 | v1.36.2 |
//! |---|---|---|
//! | volume controllers' names | `persistentvolume-binder`, `pvc-protection`, `pv-protection` | the same with a `-controller` suffix (`persistentvolumeclaim-protection-controller`, ...) |
//! | insecure HTTP port | on by default (`:10252`, all interfaces): `--port=0` turns it off | removed |
//! | secure port, `--bind-address`, serving certificate, `/healthz` without credentials | the same flags and defaults | the same |
//!
//! Each release refuses a controller name it does not know (it exits naming it), so the
//! names go through [`volume_controllers`] (or the two constants) rather than being written
//! out by the caller.

use std::path::Path;

use crate::apiserver::ApiServer;
use crate::component::Component;
use crate::error::Error;
use crate::kubelet::KubeVersion;

/// The controllers that bind and protect volumes, as v1.36.2 names them: with them a PVC of
/// a StorageClass with `volumeBindingMode: Immediate` gets its
/// `volume.kubernetes.io/storage-provisioner` annotation (and the beta one), which is what an
/// external provisioner waits for, and a PV pre-bound to a claim is bound. For a release
/// picked at run time use [`volume_controllers`].
pub const VOLUME_CONTROLLERS: &[&str] = &[
    "persistentvolume-binder-controller",
    "persistentvolumeclaim-protection-controller",
    "persistentvolume-protection-controller",
];

/// [`VOLUME_CONTROLLERS`] as v1.20.2 names them. Its binder writes only the beta annotation
/// `volume.beta.kubernetes.io/storage-provisioner` (the GA key came with v1.23).
pub const VOLUME_CONTROLLERS_V1_20: &[&str] =
    &["persistentvolume-binder", "pvc-protection", "pv-protection"];

/// The volume controllers (see [`VOLUME_CONTROLLERS`]) in the words of `version`'s
/// kube-controller-manager.
pub fn volume_controllers(version: KubeVersion) -> &'static [&'static str] {
    match version {
        KubeVersion::V1_20_2 => VOLUME_CONTROLLERS_V1_20,
        KubeVersion::V1_36_2 => VOLUME_CONTROLLERS,
    }
}

/// A running kube-controller-manager of the same release as its [`ApiServer`], with the
/// controllers it was given, no leader election, its own credentials
/// (the API server's admin token) and its secure port on a free port of 127.0.0.1, serving
/// with the API server's certificate (so the API server's CA verifies it).
///
/// Dropping it kills the process and removes its temporary directory.
#[derive(Debug)]
pub struct ControllerManager {
    inner: Component,
}

impl ControllerManager {
    /// Starts the kube-controller-manager of `api`'s release with `controllers` (in that
    /// release's names, e.g. `volume_controllers(api.version())`) against `api` and waits (at
    /// most 90 s) until its `/healthz` answers `ok`.
    ///
    /// Fails with [`Error::MissingPeer`] if it is not built, and with [`Error::NotReady`]
    /// (holding its log) if it exits, e.g. on a controller name its release does not know.
    pub async fn start(api: &ApiServer, controllers: &[&str]) -> Result<Self, Error> {
        Self::start_with_args(api, controllers, &[]).await
    }

    /// [`start_with_args`](Self::start_with_args) with exactly the volume controllers of
    /// `api`'s release ([`volume_controllers`]`(api.version())`) and `extra` flags added (`&[]`
    /// for none): the binder and the two protection controllers that a test of a volume
    /// sidecar needs from kube-controller-manager.
    pub async fn start_volume_controllers(api: &ApiServer, extra: &[&str]) -> Result<Self, Error> {
        Self::start_with_args(api, volume_controllers(api.version()), extra).await
    }

    /// [`start`](Self::start) with `extra` flags added (e.g. `--kube-api-qps=1000` so that
    /// its own client limit does not cap a benchmark).
    pub async fn start_with_args(
        api: &ApiServer,
        controllers: &[&str],
        extra: &[&str],
    ) -> Result<Self, Error> {
        let version = api.version();
        let inner = Component::start(api, version.controller_manager_peer(), |cmd| {
            if version == KubeVersion::V1_20_2 {
                // Its insecure port would listen on 0.0.0.0:10252: off, so that several run
                // side by side and nothing listens beyond loopback.
                cmd.arg("--port=0");
            }
            cmd.arg(format!("--controllers={}", controllers.join(",")))
                .arg("--use-service-account-credentials=false")
                .arg("--leader-elect=false")
                .args(extra);
        })
        .await?;
        Ok(ControllerManager { inner })
    }

    /// The URL of its secure port, `https://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        self.inner.url()
    }

    /// The end of its log.
    pub fn log_tail(&self) -> String {
        self.inner.log_tail()
    }

    /// The temporary directory holding its log.
    pub fn dir(&self) -> &Path {
        self.inner.dir()
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.inner.pid()
    }

    /// `GET /healthz` without credentials (allowed by the controller manager's defaults).
    pub async fn healthz(&self) -> Result<String, Error> {
        self.inner.healthz().await
    }
}
