//! The `DevicePlugin` handler: device plugins registered through the plugin manager.

use std::sync::Arc;

use plugreg_handler_api::{HandlerError, PluginHandler, async_trait};
use plugreg_proto::deviceplugin::v1beta1::VERSION;
use serde_json::{Value, json};

use crate::client::{self, ClientConfig, ConnectError};
use crate::inventory::{EndpointInfo, Inventory, RegisteredVia};
use crate::resource::is_extended_resource_name;

/// Why the handler refused or failed a plugin; the texts are the kubelet's.
#[derive(Debug, thiserror::Error)]
pub enum HandlerRefusal {
    /// `v1beta1` is not among the advertised versions.
    #[error("manager version, {VERSION}, is not among plugin supported versions [{}]", .0.join(" "))]
    Versions(Vec<String>),
    /// The name is not an extended resource name.
    #[error("invalid name of device plugin socket: the ResourceName \"{0}\" is invalid")]
    Name(String),
    /// The endpoint is not a socket path.
    #[error("invalid device plugin endpoint {endpoint:?}")]
    Endpoint {
        /// The endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: plugreg_transport::Error,
    },
    /// Dialing or GetDevicePluginOptions failed.
    #[error(transparent)]
    Connect(#[from] ConnectError),
}

/// The `DevicePlugin` handler (D9): validates as the kubelet, dials the plugin, reads its
/// options and keeps its ListAndWatch stream open, feeding the shared [`Inventory`].
#[derive(Debug, Clone)]
pub struct DevicePluginHandler {
    inventory: Arc<Inventory>,
    config: ClientConfig,
}

impl DevicePluginHandler {
    /// A handler feeding `inventory`.
    pub fn new(inventory: Arc<Inventory>, config: ClientConfig) -> Self {
        Self { inventory, config }
    }

    /// The inventory it feeds.
    pub fn inventory(&self) -> &Arc<Inventory> {
        &self.inventory
    }
}

#[async_trait]
impl PluginHandler for DevicePluginHandler {
    async fn validate(
        &self,
        name: &str,
        _endpoint: &str,
        versions: &[String],
    ) -> Result<(), HandlerError> {
        if !versions.iter().any(|v| v == VERSION) {
            return Err(HandlerRefusal::Versions(versions.to_vec()).into());
        }
        if !is_extended_resource_name(name) {
            return Err(HandlerRefusal::Name(name.to_owned()).into());
        }
        Ok(())
    }

    async fn register(
        &self,
        name: &str,
        endpoint: &str,
        _versions: &[String],
    ) -> Result<(), HandlerError> {
        let path = plugreg_transport::parse_address(endpoint).map_err(|source| {
            HandlerRefusal::Endpoint {
                endpoint: endpoint.to_owned(),
                source,
            }
        })?;
        let connected = client::connect(&path, &self.config)
            .await
            .map_err(HandlerRefusal::from)?;
        client::start(
            &self.inventory,
            &path,
            name,
            RegisteredVia::PluginsRegistry,
            connected,
            &self.config,
        );
        Ok(())
    }

    async fn deregister(&self, name: &str, endpoint: &str) {
        let Ok(path) = plugreg_transport::parse_address(endpoint) else {
            return;
        };
        // Only this socket's client, and only if it came through the plugin manager: a classic
        // registration of the same socket is not ours to drop (D6).
        if self
            .inventory
            .remove_via(&path, RegisteredVia::PluginsRegistry)
        {
            tracing::info!(resource = name, endpoint, "device plugin deregistered");
        }
    }

    /// The plugin's endpoint as the inventory holds it (registered through the plugin manager).
    /// One lookup by socket path: `/plugins` asks this for every plugin, so a copy of the whole
    /// inventory here made one page of 100 plugins x 100 devices copy a million devices.
    fn plugin_details(&self, _name: &str, endpoint: &str) -> Option<Value> {
        let path = plugreg_transport::parse_address(endpoint).ok()?;
        self.inventory
            .get(&path)
            .filter(|x| x.registered_via == RegisteredVia::PluginsRegistry)
            .as_ref()
            .map(details)
    }

    /// One entry per plugin registered through kubelet.sock (the classic way), which the
    /// plugin manager never sees.
    fn unlisted_plugins(&self) -> Vec<Value> {
        self.inventory
            .snapshot()
            .iter()
            .filter(|x| x.registered_via == RegisteredVia::KubeletSock)
            .map(|info| {
                json!({
                    "socket": info.endpoint,
                    "type": crate::PLUGIN_TYPE,
                    "name": info.resource,
                    "endpoint": info.endpoint,
                    "versions": [VERSION],
                    "state": if info.connected { "registered" } else { "failed" },
                    "desired": true,
                    "last_error": info.last_error,
                    "registered_at": humantime::format_rfc3339_nanos(info.registered_at).to_string(),
                    "details": details(info),
                })
            })
            .collect()
    }

    /// The inventory's Prometheus text: devices by resource and health, endpoints, classic
    /// Register calls.
    fn write_metrics(&self, out: &mut String) {
        out.push_str(&self.inventory.render_metrics());
    }
}

/// The `details` object of a device plugin in `/plugins` (D11).
fn details(info: &EndpointInfo) -> Value {
    json!({
        "resource": info.resource,
        "registered_via": info.registered_via,
        "connected": info.connected,
        "options": info.options,
        "devices": info.devices,
        "updates": info.updates,
        "last_error": info.last_error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn validation_texts_are_the_kubelets() {
        let h = DevicePluginHandler::new(Arc::default(), ClientConfig::default());
        let v = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let e = h
            .validate("x.com/w", "/e", &v(&["v1alpha", "v1"]))
            .await
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "manager version, v1beta1, is not among plugin supported versions [v1alpha v1]"
        );
        let e = h.validate("x.com/w", "/e", &[]).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "manager version, v1beta1, is not among plugin supported versions []"
        );
        let e = h
            .validate("gpu", "/e", &v(&["v1", "v1beta1"]))
            .await
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid name of device plugin socket: the ResourceName \"gpu\" is invalid"
        );
        h.validate("x.com/w", "/e", &v(&["v1beta1"])).await.unwrap();
    }
}
