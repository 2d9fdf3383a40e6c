//! Runs csi-node-driver-registrar's registration flow in-process for the demo.

use std::path::Path;
use std::time::Duration;

use plugreg_registrar::{PluginInfo, Registrar, ServeOptions};
use tokio_util::sync::CancellationToken;

/// A registrar serving on behalf of a CSI driver.
pub struct Sidecar {
    token: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Sidecar {
    /// Stops it; its socket is removed.
    pub async fn stop(self) {
        self.token.cancel();
        let _ = self.task.await;
    }
}

/// Asks the driver at `csi_socket` for its name and serves `<dir>/<name>-reg.sock` for it.
pub async fn start(
    csi_socket: &Path,
    dir: &Path,
    token: CancellationToken,
) -> anyhow::Result<Sidecar> {
    let endpoint = csi_socket.display().to_string();
    let client = plugreg_csi::client::CsiClient::connect(&endpoint, Duration::from_secs(5)).await?;
    let name = client.get_plugin_info().await?.name;
    let socket = dir.join(format!("{name}-reg.sock"));
    let registrar = Registrar::new(PluginInfo {
        r#type: plugreg_csi::PLUGIN_TYPE.into(),
        name,
        endpoint,
        supported_versions: vec!["1.0.0".into()],
    });
    let t = token.clone();
    let task = tokio::spawn(async move {
        if let Err(e) = registrar.serve(&socket, ServeOptions::default(), t).await {
            tracing::error!(error = %e, "registrar failed");
        }
    });
    Ok(Sidecar { token, task })
}
