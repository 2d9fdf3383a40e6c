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

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};
use tempfile::TempDir;
use tokio::time::Instant;

use crate::apiserver::{ApiServer, free_port, tail_of, write_file};
use crate::error::Error;
use crate::kubelet::KubeVersion;
use crate::peers::peer;

/// How long [`ControllerManager::start`] waits for `/healthz`.
const READY_TIMEOUT: Duration = Duration::from_secs(90);
/// How often `/healthz` is polled.
const POLL: Duration = Duration::from_millis(200);
/// How many times start-up is retried when the chosen port was taken meanwhile.
const PORT_ATTEMPTS: usize = 4;

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
    child: Option<Child>,
    url: String,
    probe_kubeconfig: PathBuf,
    log: PathBuf,
    // Dropped last (fields drop in declaration order, after Drop::drop).
    dir: TempDir,
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

    /// [`start`](Self::start) with `extra` flags added (e.g. `--kube-api-qps=1000` so that
    /// its own client limit does not cap a benchmark).
    pub async fn start_with_args(
        api: &ApiServer,
        controllers: &[&str],
        extra: &[&str],
    ) -> Result<Self, Error> {
        let version = api.version();
        let name = version.controller_manager_peer();
        let bin = peer(name)?;
        let dir = tempfile::Builder::new()
            .prefix("plugreg-kcm-")
            .tempdir()
            .map_err(|e| Error::io("creating the controller manager's temp dir", e))?;
        let mut kcm = ControllerManager {
            child: None,
            url: String::new(),
            probe_kubeconfig: dir.path().join("probe.kubeconfig"),
            log: dir.path().join("kube-controller-manager.log"),
            dir,
        };
        let (cert, key) = api.serving_cert();
        let mut last_err = None;
        for _ in 0..PORT_ATTEMPTS {
            let port = free_port()?;
            let log = File::create(&kcm.log).map_err(|e| Error::io("creating the KCM log", e))?;
            let log2 = log
                .try_clone()
                .map_err(|e| Error::io("cloning a log handle", e))?;
            let mut cmd = Command::new(&bin);
            if version == KubeVersion::V1_20_2 {
                // Its insecure port would listen on 0.0.0.0:10252: off, so that several run
                // side by side and nothing listens beyond loopback.
                cmd.arg("--port=0");
            }
            let child = cmd
                .arg(format!("--kubeconfig={}", api.kubeconfig_path().display()))
                .arg(format!("--controllers={}", controllers.join(",")))
                .arg("--use-service-account-credentials=false")
                .arg("--leader-elect=false")
                .arg("--bind-address=127.0.0.1")
                .arg(format!("--secure-port={port}"))
                .arg(format!("--tls-cert-file={}", cert.display()))
                .arg(format!("--tls-private-key-file={}", key.display()))
                .arg(format!(
                    "--cert-dir={}",
                    kcm.dir.path().join("cert-dir").display()
                ))
                .arg("--profiling=false")
                .args(extra)
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log2)
                .spawn()
                .map_err(|e| Error::io(format!("spawning {}", bin.display()), e))?;
            kcm.child = Some(child);
            kcm.url = format!("https://127.0.0.1:{port}");
            kcm.write_probe_kubeconfig(api.ca_cert_path())?;
            match kcm.wait_healthy(name).await {
                Ok(()) => return Ok(kcm),
                Err(e) => {
                    if let Some(mut c) = kcm.child.take() {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    if !tail_of(&kcm.log).contains("address already in use") {
                        return Err(e);
                    }
                    last_err = Some(e);
                }
            }
        }
        Err(last_err.unwrap_or_else(|| Error::NotReady {
            peer: name.to_owned(),
            reason: "no free port".to_owned(),
            log: String::new(),
        }))
    }

    /// The URL of its secure port, `https://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The end of its log.
    pub fn log_tail(&self) -> String {
        tail_of(&self.log)
    }

    /// The temporary directory holding its log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `GET /healthz` without credentials (allowed by the controller manager's defaults).
    pub async fn healthz(&self) -> Result<String, Error> {
        let kc = Kubeconfig::read_from(&self.probe_kubeconfig)?;
        let mut config =
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
        config.connect_timeout = Some(Duration::from_secs(5));
        config.read_timeout = Some(Duration::from_secs(10));
        let client = kube::Client::try_from(config)?;
        let req = kube::core::Request::new("")
            .get("healthz", &Default::default())
            .map_err(|e| Error::Kube(kube::Error::BuildRequest(e)))?;
        Ok(client.request_text(req).await?)
    }

    /// An anonymous kubeconfig for its secure port, trusting the API server's CA.
    fn write_probe_kubeconfig(&self, ca: &Path) -> Result<(), Error> {
        let kc = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{
                "name": "kcm",
                "cluster": { "server": self.url, "certificate-authority": ca },
            }],
            "users": [{ "name": "anonymous", "user": {} }],
            "contexts": [{ "name": "kcm", "context": { "cluster": "kcm", "user": "anonymous" } }],
            "current-context": "kcm",
        });
        write_file(&self.probe_kubeconfig, &format!("{kc:#}\n"))
    }

    async fn wait_healthy(&mut self, name: &str) -> Result<(), Error> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(st)) = c.try_wait()
            {
                return Err(Error::NotReady {
                    peer: name.to_owned(),
                    reason: format!("exited ({st})"),
                    log: tail_of(&self.log),
                });
            }
            let last = match self.healthz().await {
                Ok(body) if body.trim() == "ok" => return Ok(()),
                Ok(body) => format!("/healthz: {body}"),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                return Err(Error::NotReady {
                    peer: name.to_owned(),
                    reason: format!("/healthz not ok within {READY_TIMEOUT:?}; last: {last}"),
                    log: tail_of(&self.log),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

impl Drop for ControllerManager {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
