//! Runs `csi-node-driver-registrar` (its library, the same code as the binary) in-process for
//! the demo.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use plugreg_node_driver_registrar::{Config, Sidecar};
use tokio_util::sync::CancellationToken;

/// A running sidecar.
pub struct RunningSidecar {
    token: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    /// Its registration socket.
    pub socket: PathBuf,
}

impl RunningSidecar {
    /// Stops it (as SIGTERM does): its socket is removed.
    pub async fn stop(self) {
        self.token.cancel();
        let _ = self.task.await;
    }
}

/// Starts the sidecar for the driver at `csi_socket`, registering in `dir`; returns once its
/// registration socket is listening.
pub async fn start(
    csi_socket: &Path,
    dir: &Path,
    token: CancellationToken,
) -> anyhow::Result<RunningSidecar> {
    let sidecar = Sidecar::new(Config {
        csi_address: csi_socket.display().to_string(),
        kubelet_registration_path: csi_socket.display().to_string(),
        plugin_registration_path: dir.display().to_string(),
        ..Config::default()
    });
    let mut progress = sidecar.progress();
    let t = token.clone();
    let task = tokio::spawn(async move {
        if let Err(e) = sidecar.run(t).await {
            tracing::error!(error = %e, "csi-node-driver-registrar stopped");
        }
    });
    let p = tokio::time::timeout(
        Duration::from_secs(10),
        progress.wait_for(|p| p.socket.is_some() || p.stopped),
    )
    .await
    .context("csi-node-driver-registrar did not start within 10 s")??
    .clone();
    let socket = p
        .socket
        .context("csi-node-driver-registrar stopped before listening")?;
    Ok(RunningSidecar {
        token,
        task,
        socket,
    })
}
