//! `plugreg manager`'s device-plugin side (D9, D11): the `DevicePlugin` handler, the classic
//! kubelet.sock server (`--device-plugin-dir`) and the device inventory both feed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use plugreg_handler_device::{ClassicRegistration, ClientConfig, DevicePluginHandler, Inventory};
use tokio_util::sync::CancellationToken;

/// The device-plugin flags of `plugreg manager`.
#[derive(Debug, Clone, clap::Args)]
pub struct DeviceArgs {
    /// Also serve the classic device-plugin registration (v1beta1 `Register`) on
    /// DIR/kubelet.sock; plugins registered there feed the same device inventory.
    #[arg(long, value_name = "DIR")]
    pub device_plugin_dir: Option<PathBuf>,
    /// Limit for dialing a device plugin.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub device_plugin_dial_timeout: Duration,
    /// Limit for a device plugin's GetDevicePluginOptions.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub device_plugin_options_timeout: Duration,
}

impl Default for DeviceArgs {
    fn default() -> Self {
        Self {
            device_plugin_dir: None,
            device_plugin_dial_timeout: Duration::from_secs(10),
            device_plugin_options_timeout: Duration::from_secs(10),
        }
    }
}

/// The device inventory and what feeds it.
#[derive(Debug, Clone)]
pub struct Devices {
    inventory: Arc<Inventory>,
    config: ClientConfig,
}

impl Devices {
    /// An empty inventory with the flags' limits.
    pub fn new(args: &DeviceArgs) -> Self {
        let config = ClientConfig {
            dial_timeout: args.device_plugin_dial_timeout,
            options_timeout: args.device_plugin_options_timeout,
            ..ClientConfig::default()
        };
        Self {
            inventory: Arc::new(Inventory::new()),
            config,
        }
    }

    /// The handler for type `DevicePlugin`.
    pub fn handler(&self) -> Arc<DevicePluginHandler> {
        Arc::new(DevicePluginHandler::new(
            self.inventory.clone(),
            self.config.clone(),
        ))
    }

    /// Starts serving DIR/kubelet.sock when `--device-plugin-dir` is given.
    pub fn start_classic(
        &self,
        args: &DeviceArgs,
        token: &CancellationToken,
    ) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
        let Some(dir) = &args.device_plugin_dir else {
            return Ok(None);
        };
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {dir:?}"))?;
        let server = ClassicRegistration::new(dir, self.inventory.clone(), self.config.clone());
        // Bind before returning, so that a bad directory fails the start.
        let path = server.socket_path();
        plugreg_transport::check_path_len(&path)
            .with_context(|| format!("cannot serve {path:?}"))?;
        let t = token.clone();
        Ok(Some(tokio::spawn(async move {
            if let Err(e) = server.serve(t).await {
                tracing::error!(error = %plugreg_runtime::report::chain(&e), "device plugin registration server stopped");
            }
        })))
    }

    /// The inventory.
    #[cfg_attr(not(feature = "demo"), allow(dead_code))]
    pub fn inventory(&self) -> &Arc<Inventory> {
        &self.inventory
    }

    /// Stops every device plugin client.
    pub fn stop(&self) {
        self.inventory.clear();
    }
}
