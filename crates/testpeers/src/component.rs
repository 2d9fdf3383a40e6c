//! What kube-controller-manager and kube-scheduler have in common as the tests run them: a
//! process against an [`ApiServer`] of its release, with the API server's admin kubeconfig,
//! its secure port on a free port of 127.0.0.1 serving with the API server's certificate, and
//! `/healthz` (allowed without credentials) as its readiness.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};
use tempfile::TempDir;
use tokio::time::Instant;

use crate::apiserver::{ApiServer, free_port, tail_of, write_file};
use crate::error::Error;
use crate::peers::peer;

/// How long [`Component::start`] waits for `/healthz`.
const READY_TIMEOUT: Duration = Duration::from_secs(90);
/// How often `/healthz` is polled.
const POLL: Duration = Duration::from_millis(200);
/// How many times start-up is retried when the chosen port was taken meanwhile.
const PORT_ATTEMPTS: usize = 4;

/// A running component. Dropping it kills the process and removes its temporary directory.
#[derive(Debug)]
pub(crate) struct Component {
    name: &'static str,
    child: Option<Child>,
    url: String,
    probe_kubeconfig: PathBuf,
    log: PathBuf,
    // Dropped last (fields drop in declaration order, after Drop::drop).
    dir: TempDir,
}

impl Component {
    /// Starts peer `name` against `api` with the common flags (`--kubeconfig`,
    /// `--bind-address=127.0.0.1`, `--secure-port`, the serving certificate, `--cert-dir`,
    /// `--profiling=false`) and whatever `args` adds, and waits (at most 90 s) until its
    /// `/healthz` answers `ok`. A port taken meanwhile is retried with another.
    pub(crate) async fn start(
        api: &ApiServer,
        name: &'static str,
        args: impl Fn(&mut Command),
    ) -> Result<Self, Error> {
        let bin = peer(name)?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("plugreg-{name}-"))
            .tempdir()
            .map_err(|e| Error::io(format!("creating the temp dir of {name}"), e))?;
        let mut c = Component {
            name,
            child: None,
            url: String::new(),
            probe_kubeconfig: dir.path().join("probe.kubeconfig"),
            log: dir.path().join(format!("{name}.log")),
            dir,
        };
        let (cert, key) = api.serving_cert();
        let mut last_err = None;
        for _ in 0..PORT_ATTEMPTS {
            let port = free_port()?;
            let log = File::create(&c.log)
                .map_err(|e| Error::io(format!("creating the log of {name}"), e))?;
            let log2 = log
                .try_clone()
                .map_err(|e| Error::io("cloning a log handle", e))?;
            let mut cmd = Command::new(&bin);
            cmd.arg(format!("--kubeconfig={}", api.kubeconfig_path().display()))
                .arg("--bind-address=127.0.0.1")
                .arg(format!("--secure-port={port}"))
                .arg(format!("--tls-cert-file={}", cert.display()))
                .arg(format!("--tls-private-key-file={}", key.display()))
                .arg(format!(
                    "--cert-dir={}",
                    c.dir.path().join("cert-dir").display()
                ))
                .arg("--profiling=false");
            args(&mut cmd);
            let child = cmd
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log2)
                .spawn()
                .map_err(|e| Error::io(format!("spawning {}", bin.display()), e))?;
            c.child = Some(child);
            c.url = format!("https://127.0.0.1:{port}");
            c.write_probe_kubeconfig(api.ca_cert_path())?;
            match c.wait_healthy().await {
                Ok(()) => return Ok(c),
                Err(e) => {
                    if let Some(mut child) = c.child.take() {
                        let _ = child.kill();
                        let _ = child.wait();
                    }
                    if !tail_of(&c.log).contains("address already in use") {
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
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The end of its log.
    pub(crate) fn log_tail(&self) -> String {
        tail_of(&self.log)
    }

    /// Its temporary directory (log, certificates).
    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The process id, while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `GET /healthz` without credentials.
    pub(crate) async fn healthz(&self) -> Result<String, Error> {
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
                "name": self.name,
                "cluster": { "server": self.url, "certificate-authority": ca },
            }],
            "users": [{ "name": "anonymous", "user": {} }],
            "contexts": [{
                "name": self.name,
                "context": { "cluster": self.name, "user": "anonymous" },
            }],
            "current-context": self.name,
        });
        write_file(&self.probe_kubeconfig, &format!("{kc:#}\n"))
    }

    async fn wait_healthy(&mut self) -> Result<(), Error> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(st)) = c.try_wait()
            {
                return Err(Error::NotReady {
                    peer: self.name.to_owned(),
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
                    peer: self.name.to_owned(),
                    reason: format!("/healthz not ok within {READY_TIMEOUT:?}; last: {last}"),
                    log: tail_of(&self.log),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
