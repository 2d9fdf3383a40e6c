//! A real kube-scheduler (v1.20.2 or v1.36.2) against an [`ApiServer`] of the same release, on
//! loopback only.
//!
//! What differs between the two releases' command lines: v1.20.2 still opens an insecure HTTP
//! port (`:10251` on all interfaces) unless told `--port=0`; v1.36.2 has no such flag. Both
//! serve `/healthz` on the secure port without credentials.

use std::path::Path;

use crate::apiserver::ApiServer;
use crate::component::Component;
use crate::error::Error;
use crate::kubelet::KubeVersion;

/// A running kube-scheduler of the same release as its [`ApiServer`], with its default
/// plugins, no leader election, the API server's admin credentials, and its secure port on a
/// free port of 127.0.0.1 (serving with the API server's certificate).
///
/// Dropping it kills the process and removes its temporary directory.
#[derive(Debug)]
pub struct Scheduler {
    inner: Component,
}

impl Scheduler {
    /// Starts the kube-scheduler of `api`'s release against `api` and waits (at most 90 s)
    /// until its `/healthz` answers `ok`.
    ///
    /// Fails with [`Error::MissingPeer`] if it is not built (`interop/build-peers.sh` builds
    /// it), and with [`Error::NotReady`] (holding its log) if it exits.
    pub async fn start(api: &ApiServer) -> Result<Self, Error> {
        let version = api.version();
        let inner = Component::start(api, version.scheduler_peer(), |cmd| {
            if version == KubeVersion::V1_20_2 {
                // Its insecure port would listen on 0.0.0.0:10251: off, so that several run
                // side by side and nothing listens beyond loopback.
                cmd.arg("--port=0");
            }
            cmd.arg("--leader-elect=false");
        })
        .await?;
        Ok(Scheduler { inner })
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

    /// `GET /healthz` without credentials.
    pub async fn healthz(&self) -> Result<String, Error> {
        self.inner.healthz().await
    }
}
