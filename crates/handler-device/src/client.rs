//! One client per device plugin socket: dial, read the options, then keep a ListAndWatch stream
//! open; a broken stream marks the socket's devices unhealthy and is re-dialled with back-off.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use plugreg_proto::deviceplugin::v1beta1::Empty;
use plugreg_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use plugreg_runtime::Backoff;
use tonic::transport::Channel;
use tracing::Instrument;

use crate::inventory::{Inventory, Options, RegisteredVia, Ticket};

/// Limits of the device-plugin clients.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Dialing a plugin's socket (upstream: 10 s).
    pub dial_timeout: Duration,
    /// GetDevicePluginOptions (upstream has none; a hung plugin must not hang registration).
    pub options_timeout: Duration,
    /// Waits between re-dials of a broken stream.
    pub redial: Backoff,
    /// How long a classic (kubelet.sock) endpoint whose stream broke is kept and re-dialled
    /// before it is dropped (upstream's endpointStopGracePeriod). Endpoints registered through
    /// plugins_registry stay until the plugin manager deregisters them.
    pub classic_grace: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            dial_timeout: Duration::from_secs(10),
            options_timeout: Duration::from_secs(10),
            redial: Backoff::new(Duration::from_millis(500), Duration::from_secs(30))
                .with_jitter(0.1),
            classic_grace: Duration::from_secs(300),
        }
    }
}

/// Why connecting to a device plugin failed; the texts are the kubelet's.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The socket could not be dialled.
    #[error("failed to dial device plugin: {}", plugreg_runtime::report::chain(.0))]
    Dial(#[source] plugreg_transport::Error),
    /// GetDevicePluginOptions failed.
    #[error("failed to get device plugin options: {}", plugreg_runtime::report::grpc(.0))]
    Options(#[source] tonic::Status),
}

/// A connected plugin.
pub(crate) struct Connected {
    client: DevicePluginClient<Channel>,
    pub(crate) options: Options,
}

/// Dials `path` and reads the plugin's options.
pub(crate) async fn connect(path: &Path, cfg: &ClientConfig) -> Result<Connected, ConnectError> {
    let channel = plugreg_transport::connect_path(path, cfg.dial_timeout)
        .await
        .map_err(ConnectError::Dial)?;
    let mut client = plugreg_transport::client!(DevicePluginClient, channel);
    // Bounded here, not through grpc-timeout: the plugin's own deadline would race ours and
    // make the error text depend on who fired first.
    let options = match tokio::time::timeout(
        cfg.options_timeout,
        client.get_device_plugin_options(Empty {}),
    )
    .await
    {
        Ok(Ok(r)) => Options::from(r.get_ref()),
        Ok(Err(s)) => return Err(ConnectError::Options(s)),
        Err(_) => {
            return Err(ConnectError::Options(tonic::Status::deadline_exceeded(
                "context deadline exceeded",
            )));
        }
    };
    Ok(Connected { client, options })
}

/// Puts a connected plugin into the inventory and starts its stream task.
pub(crate) fn start(
    inventory: &Arc<Inventory>,
    endpoint: &Path,
    resource: &str,
    via: RegisteredVia,
    connected: Connected,
    cfg: &ClientConfig,
) {
    let ticket = inventory.insert(endpoint, resource, via, connected.options);
    tracing::info!(resource, endpoint = %endpoint.display(), via = via.as_str(), "Device plugin connected");
    let task = StreamTask {
        inventory: inventory.clone(),
        endpoint: endpoint.to_owned(),
        via,
        ticket,
        cfg: cfg.clone(),
    };
    let span = tracing::info_span!("device_plugin", resource, endpoint = %endpoint.display());
    tokio::spawn(task.run(connected.client).instrument(span));
}

struct StreamTask {
    inventory: Arc<Inventory>,
    endpoint: PathBuf,
    via: RegisteredVia,
    ticket: Ticket,
    cfg: ClientConfig,
}

impl StreamTask {
    async fn run(self, mut client: DevicePluginClient<Channel>) {
        let token = self.ticket.token.clone();
        loop {
            let why = tokio::select! {
                // A client told to stop is not surprised by the stream's end.
                biased;
                _ = token.cancelled() => return,
                why = self.stream(&mut client) => why,
            };
            if token.is_cancelled() {
                return;
            }
            tracing::error!(error = %why, "ListAndWatch ended unexpectedly for device plugin");
            self.inventory
                .disconnected(&self.endpoint, &self.ticket, why);
            client = match self.redial().await {
                Some(c) => c,
                None => return,
            };
        }
    }

    /// Reads ListAndWatch answers until the stream ends; returns why it ended.
    async fn stream(&self, client: &mut DevicePluginClient<Channel>) -> String {
        let mut stream = match client.list_and_watch(Empty {}).await {
            Ok(r) => r.into_inner(),
            Err(s) => return plugreg_runtime::report::grpc(&s),
        };
        loop {
            match stream.message().await {
                Ok(Some(answer)) => {
                    tracing::debug!(
                        devices = answer.devices.len(),
                        "State pushed for device plugin"
                    );
                    self.inventory
                        .set_devices(&self.endpoint, &self.ticket, &answer.devices);
                }
                Ok(None) => return "the stream ended".to_owned(),
                Err(s) => return plugreg_runtime::report::grpc(&s),
            }
        }
    }

    /// Re-dials with back-off until it connects (`Some`), the client is stopped, or a classic
    /// endpoint's grace period is over (`None`, the entry dropped).
    async fn redial(&self) -> Option<DevicePluginClient<Channel>> {
        let broke = tokio::time::Instant::now();
        let mut failures = 0u32;
        loop {
            failures = failures.saturating_add(1);
            tokio::select! {
                _ = self.ticket.token.cancelled() => return None,
                _ = self.cfg.redial.sleep(failures) => {}
            }
            if self.via == RegisteredVia::KubeletSock && broke.elapsed() >= self.cfg.classic_grace {
                tracing::info!(
                    "device plugin did not come back within the grace period; dropping it"
                );
                self.inventory.remove(&self.endpoint, Some(&self.ticket));
                return None;
            }
            match connect(&self.endpoint, &self.cfg).await {
                Ok(c) => {
                    tracing::info!("Device plugin reconnected");
                    let options = c.options;
                    self.inventory.update(&self.endpoint, &self.ticket, |e| {
                        e.options = options;
                        e.connected = true;
                        e.last_error = None;
                    });
                    return Some(c.client);
                }
                Err(e) => {
                    tracing::debug!(error = %e, failures, "re-dial failed");
                    let why = e.to_string();
                    self.inventory
                        .update(&self.endpoint, &self.ticket, |e| e.last_error = Some(why));
                }
            }
        }
    }
}
