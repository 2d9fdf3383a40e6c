//! [`CsiHandler`]: the plugin manager's handler for plugin type `CSIPlugin`.
//!
//! * validate: driver name and endpoint checks (D7), then upstream's version rules (highest
//!   supported version 1.x; a name registered already needs a strictly higher version).
//! * register: validate again, NodeGetInfo on the driver's endpoint (bounded by a timeout),
//!   publish the node information to the sink, and only then record the driver. Any failure
//!   leaves nothing recorded and nothing published by this call (the sink undoes a partial
//!   write); the manager then calls deregister and retries with back-off (D2).
//! * deregister: only when the endpoint is the one registered now for the name (D6) is the
//!   driver forgotten and its node id and CSINode entry withdrawn; topology labels stay.
//!
//! Calls for one driver name are serialised (a deregistration waits for a registration of the
//! same name in flight); calls for different names run concurrently.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use plugreg_handler_api::{HandlerError, PluginHandler, async_trait};

use plugreg_csi_core::client::{CallError, Connection, Retry};
use plugreg_proto::csi::v1::NodeGetInfoResponse;

use crate::names::{self, NameError};
use crate::nodeinfo::DriverNodeInfo;
use crate::report::{self, Reported};
use crate::sink::{self, NodeInfoSink, SinkConfig, SinkError};
use crate::version::{self, Version, VersionError};

/// Upstream's default timeout of the CSI calls the kubelet makes (NodeGetInfo included).
pub const DEFAULT_NODE_GET_INFO_TIMEOUT: Duration = Duration::from_secs(120);

/// Plugin type this handler serves.
pub const PLUGIN_TYPE: &str = plugreg_proto::pluginregistration::CSI_PLUGIN;

/// What a daemon configures for the CSI handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CsiHandlerConfig {
    /// Limit for dialing the driver and its NodeGetInfo answer together.
    pub node_get_info_timeout: Duration,
    /// Where node information goes.
    pub sink: SinkConfig,
}

impl CsiHandlerConfig {
    /// A configuration with the default NodeGetInfo timeout.
    pub fn new(sink: SinkConfig) -> Self {
        Self {
            node_get_info_timeout: DEFAULT_NODE_GET_INFO_TIMEOUT,
            sink,
        }
    }
}

/// Why a driver was refused before anything was done with it.
#[derive(Debug, thiserror::Error)]
pub enum Invalid {
    /// The driver name or the endpoint is unusable.
    #[error(transparent)]
    Name(#[from] NameError),
    /// The versions are unusable, or not higher than the registered ones.
    #[error(transparent)]
    Versions(#[from] VersionError),
}

/// Why validate or register failed. Handed to the plugin manager wrapped in [`Reported`], whose
/// text is the whole chain, worded as upstream.
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    /// Validate refused the driver.
    #[error("validation failed for CSI Driver {name} at endpoint {endpoint}")]
    Validate {
        /// Driver name.
        name: String,
        /// Endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: Invalid,
    },
    /// Register's own check refused the driver (upstream returns this as it is).
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// NodeGetInfo could not be called or failed.
    #[error("error getting node info from CSI driver {name} at endpoint {endpoint}")]
    NodeGetInfo {
        /// Driver name.
        name: String,
        /// Endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: CallError,
    },
    /// The driver reported an empty node id.
    #[error("error adding CSI driver node info: driverNodeID must not be empty")]
    EmptyNodeId,
    /// The sink refused the node information (nothing of it stays written).
    #[error(transparent)]
    Publish(#[from] SinkError),
}

impl CsiError {
    /// The error as the plugin manager takes it.
    fn into_handler_error(self) -> HandlerError {
        Box::new(Reported::new(self))
    }
}

/// A driver the handler has registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredDriver {
    /// Endpoint as the plugin gave it.
    pub endpoint: String,
    /// The highest supported version, parsed.
    pub highest_version: Version,
    /// What was published.
    pub node_info: DriverNodeInfo,
}

/// The CSI plugin handler (see the module docs).
#[derive(Debug)]
pub struct CsiHandler {
    sink: Arc<dyn NodeInfoSink>,
    node_get_info_timeout: Duration,
    drivers: std::sync::Mutex<HashMap<String, RegisteredDriver>>,
    name_locks: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl CsiHandler {
    /// A handler publishing to `sink`, dialing and calling NodeGetInfo within
    /// `node_get_info_timeout`.
    pub fn new(sink: Arc<dyn NodeInfoSink>, node_get_info_timeout: Duration) -> Self {
        Self {
            sink,
            node_get_info_timeout,
            drivers: Default::default(),
            name_locks: Default::default(),
        }
    }

    /// Builds the sink `cfg` describes and a handler on it.
    pub async fn from_config(cfg: &CsiHandlerConfig) -> Result<Self, SinkError> {
        let sink = sink::build_sink(&cfg.sink).await?;
        Ok(Self::new(sink, cfg.node_get_info_timeout))
    }

    /// The sink.
    pub fn sink(&self) -> &Arc<dyn NodeInfoSink> {
        &self.sink
    }

    /// The driver registered under `name`.
    pub fn driver(&self, name: &str) -> Option<RegisteredDriver> {
        self.store().get(name).cloned()
    }

    /// Every registered driver, by name.
    pub fn drivers(&self) -> BTreeMap<String, RegisteredDriver> {
        self.store()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    fn store(&self) -> std::sync::MutexGuard<'_, HashMap<String, RegisteredDriver>> {
        self.drivers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn registered_version(&self, name: &str) -> Option<Version> {
        self.store().get(name).map(|d| d.highest_version.clone())
    }

    /// Name, endpoint and versions checks shared by validate and register.
    fn check(
        &self,
        caller: &'static str,
        name: &str,
        endpoint: &str,
        versions: &[String],
    ) -> Result<Version, Invalid> {
        names::check_driver_name(name)?;
        names::check_endpoint(endpoint)?;
        let registered = self.registered_version(name);
        Ok(version::check_versions(
            caller,
            name,
            versions,
            registered.as_ref(),
        )?)
    }

    fn name_lock(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self
            .name_locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        locks.entry(name.to_owned()).or_default().clone()
    }

    fn release_name_lock(&self, name: &str, lock: Arc<tokio::sync::Mutex<()>>) {
        let mut locks = self
            .name_locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Clones are only made under this mutex: two references (the map's and ours) mean
        // nobody else waits for it.
        if Arc::strong_count(&lock) == 2 {
            locks.remove(name);
        }
    }

    async fn register_locked(
        &self,
        name: &str,
        endpoint: &str,
        versions: &[String],
    ) -> Result<(), CsiError> {
        let highest = self.check("RegisterPlugin", name, endpoint, versions)?;
        let reply = node_get_info(endpoint, self.node_get_info_timeout)
            .await
            .map_err(|source| CsiError::NodeGetInfo {
                name: name.to_owned(),
                endpoint: endpoint.to_owned(),
                source,
            })?;
        if reply.node_id.is_empty() {
            return Err(CsiError::EmptyNodeId);
        }
        let info = DriverNodeInfo {
            driver: name.to_owned(),
            node_id: reply.node_id,
            topology: reply
                .accessible_topology
                .map(|t| t.segments.into_iter().collect())
                .unwrap_or_default(),
            max_volumes: reply.max_volumes_per_node,
        };
        self.sink.publish(&info).await?;
        tracing::info!(
            driver = name,
            endpoint,
            node_id = %info.node_id,
            version = %highest,
            "registered CSI driver"
        );
        self.store().insert(
            name.to_owned(),
            RegisteredDriver {
                endpoint: endpoint.to_owned(),
                highest_version: highest,
                node_info: info,
            },
        );
        Ok(())
    }

    async fn deregister_locked(&self, name: &str, endpoint: &str) {
        let registered = self.store().get(name).cloned();
        match registered {
            Some(d) if same_endpoint(&d.endpoint, endpoint) => {
                self.store().remove(name);
                let removed = self.sink.remove(name).await;
                if let Err(e) = &removed {
                    tracing::error!(
                        driver = name,
                        endpoint,
                        error = %report::chain(e),
                        "failed to withdraw the node info of a deregistered CSI driver"
                    );
                }
                tracing::info!(
                    driver = name,
                    endpoint,
                    node_id = %d.node_info.node_id,
                    "deregistered CSI driver"
                );
            }
            Some(d) => {
                tracing::info!(
                    driver = name,
                    endpoint,
                    registered_endpoint = %d.endpoint,
                    "not deregistering CSI driver: another instance is registered now"
                );
            }
            None => {
                // Nothing recorded: a failed registration (already rolled back) or a stale
                // socket. Withdraw anyway, in case a rollback could not reach the sink.
                tracing::debug!(
                    driver = name,
                    endpoint,
                    "deregistering a CSI driver that is not registered; withdrawing leftovers"
                );
                if let Err(e) = self.sink.remove(name).await {
                    tracing::warn!(
                        driver = name,
                        endpoint,
                        error = %report::chain(&e),
                        "failed to withdraw leftover node info of a CSI driver"
                    );
                }
            }
        }
    }
}

/// Whether two endpoints name the same socket (`unix:///x` and `/x` do).
fn same_endpoint(a: &str, b: &str) -> bool {
    let path = |e: &str| -> Option<PathBuf> { plugreg_transport::parse_address(e).ok() };
    match (path(a), path(b)) {
        (Some(pa), Some(pb)) => pa == pb,
        _ => a == b,
    }
}

#[async_trait]
impl PluginHandler for CsiHandler {
    async fn validate(
        &self,
        name: &str,
        endpoint: &str,
        versions: &[String],
    ) -> Result<(), HandlerError> {
        self.check("ValidatePlugin", name, endpoint, versions)
            .map(drop)
            .map_err(|source| {
                CsiError::Validate {
                    name: name.to_owned(),
                    endpoint: endpoint.to_owned(),
                    source,
                }
                .into_handler_error()
            })
    }

    async fn register(
        &self,
        name: &str,
        endpoint: &str,
        versions: &[String],
    ) -> Result<(), HandlerError> {
        let lock = self.name_lock(name);
        let guard = lock.lock().await;
        let result = self.register_locked(name, endpoint, versions).await;
        drop(guard);
        self.release_name_lock(name, lock);
        result.map_err(|e| {
            tracing::warn!(driver = name, endpoint, error = %report::chain(&e), "CSI driver registration failed");
            e.into_handler_error()
        })
    }

    async fn deregister(&self, name: &str, endpoint: &str) {
        let lock = self.name_lock(name);
        let guard = lock.lock().await;
        self.deregister_locked(name, endpoint).await;
        drop(guard);
        self.release_name_lock(name, lock);
    }
}

/// Dials `endpoint` and calls NodeGetInfo once, the dial and the call sharing `timeout`.
async fn node_get_info(
    endpoint: &str,
    timeout: Duration,
) -> Result<NodeGetInfoResponse, CallError> {
    let work = async {
        Connection::connect(endpoint, timeout, timeout, Retry::ONCE)
            .await?
            .node_get_info()
            .await
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(CallError::Timeout {
            method: "NodeGetInfo",
            timeout,
            attempts: 1,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default)]
    struct NullSink;

    #[async_trait]
    impl NodeInfoSink for NullSink {
        async fn publish(&self, _: &DriverNodeInfo) -> Result<(), SinkError> {
            Ok(())
        }
        async fn remove(&self, _: &str) -> Result<(), SinkError> {
            Ok(())
        }
    }

    fn handler() -> CsiHandler {
        CsiHandler::new(Arc::new(NullSink), Duration::from_secs(1))
    }

    fn v(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[tokio::test]
    async fn validate_wraps_errors_like_upstream() {
        let h = handler();
        let err = h
            .validate("d.example.com", "/p/csi.sock", &[])
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "validation failed for CSI Driver d.example.com at endpoint /p/csi.sock: \
             csi: ValidatePlugin for CSI driver \"d.example.com\" failed. \
             Plugin returned an empty list for supported versions"
        );
        let err = h
            .validate("d.example.com", "/p/csi.sock", &v(&["2.0.0"]))
            .await
            .unwrap_err();
        assert!(err.to_string().starts_with(
            "validation failed for CSI Driver d.example.com at endpoint /p/csi.sock: csi: ValidatePlugin for CSI driver \"d.example.com\" failed. None of the versions specified"
        ), "{err}");
        h.validate("d.example.com", "/p/csi.sock", &v(&["1.0.0"]))
            .await
            .unwrap();
        h.validate("d.example.com", "unix:///p/csi.sock", &v(&["v1.2"]))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn validate_refuses_bad_names_and_endpoints() {
        let h = handler();
        for (name, endpoint, want) in [
            ("../evil", "/p/csi.sock", "invalid CSI driver name"),
            ("", "/p/csi.sock", "driver name is empty"),
            (&*"a".repeat(64), "/p/csi.sock", "more than 63"),
            ("d", "", "endpoint is empty"),
            ("d", "relative.sock", "invalid endpoint \"relative.sock\""),
            ("d", "unix://rel.sock", "must be absolute"),
        ] {
            let err = h
                .validate(name, endpoint, &v(&["1.0.0"]))
                .await
                .unwrap_err()
                .to_string();
            assert!(
                err.starts_with("validation failed for CSI Driver") && err.contains(want),
                "{name:?} {endpoint:?}: {err}"
            );
        }
    }

    #[test]
    fn endpoints_compare_as_socket_paths() {
        assert!(same_endpoint("/a/b.sock", "unix:///a/b.sock"));
        assert!(!same_endpoint("/a/b.sock", "/a/c.sock"));
        assert!(same_endpoint("weird", "weird"));
    }
}
