//! A real kube-controller-manager (v1.36.2) against an [`ApiServer`], on loopback only.

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

/// The controllers that bind and protect volumes: with them a PVC of a StorageClass with
/// `volumeBindingMode: Immediate` gets its `volume.kubernetes.io/storage-provisioner`
/// annotation, which is what an external provisioner waits for.
pub const VOLUME_CONTROLLERS: &[&str] = &[
    "persistentvolume-binder-controller",
    "persistentvolumeclaim-protection-controller",
    "persistentvolume-protection-controller",
];

/// A running kube-controller-manager of the same release as its [`ApiServer`] (only v1.36.2
/// is built), with the controllers it was given, no leader election, its own credentials
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
    /// Starts kube-controller-manager with `controllers` (e.g. [`VOLUME_CONTROLLERS`])
    /// against `api` and waits (at most 90 s) until its `/healthz` answers `ok`.
    ///
    /// Fails with [`Error::Unsupported`] for an API server of a release without a built
    /// controller manager, and with [`Error::MissingPeer`] if it is not built.
    pub async fn start(api: &ApiServer, controllers: &[&str]) -> Result<Self, Error> {
        let name = api.version().controller_manager_peer().ok_or_else(|| {
            Error::Unsupported(format!(
                "no kube-controller-manager {} is built; only {} is",
                api.version(),
                KubeVersion::V1_36_2
            ))
        })?;
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
            let child = Command::new(&bin)
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
