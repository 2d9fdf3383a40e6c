//! The CSI plugin handler of plugreg's plugin manager.
//!
//! * [`handler`]: [`CsiHandler`], the `CSIPlugin` handler: upstream's version rules, driver
//!   name and endpoint checks, NodeGetInfo with a timeout, publication of the node information
//!   and D6-aware deregistration.
//! * [`version`]: the version rules as pure functions (from `plugreg-csi-core`).
//! * [`names`]: driver name (the rule is `plugreg-csi-core`'s) and endpoint checks.
//! * [`nodeinfo`]: [`DriverNodeInfo`] and the pure merge logic (nodeid annotation, topology
//!   labels, CSINode driver list).
//! * [`noderestriction`]: the labels a kubelet may set on its Node (NodeRestriction's rule),
//!   checked before any write.
//! * [`sink`]: where node information goes: `KubeSink` (Node + CSINode; cargo feature `kube`)
//!   or [`FileSink`].
//! * [`report`]: one-line error text for plugins and operators.
//!
//! Cargo feature `kube` (off by default) adds the Kubernetes API sink and with it the `kube`
//! client; without it the crate pulls no Kubernetes client, only `k8s-openapi`'s types.
//!
//! A daemon builds the handler from a [`CsiHandlerConfig`] and registers it for
//! [`PLUGIN_TYPE`]:
//!
//! ```no_run
//! # async fn wire() -> Result<(), plugreg_handler_csi::SinkError> {
//! use std::sync::Arc;
//! use plugreg_handler_csi::{CsiHandler, CsiHandlerConfig, SinkConfig, PLUGIN_TYPE};
//! use plugreg_handler_api::HandlerRegistry;
//!
//! let cfg = CsiHandlerConfig::new(SinkConfig::File("/run/plugreg/node-info.json".into()));
//! let handler = Arc::new(CsiHandler::from_config(&cfg).await?);
//! let registry = HandlerRegistry::new().with(PLUGIN_TYPE, handler);
//! # let _ = registry;
//! # Ok(())
//! # }
//! ```

pub mod handler;
pub mod names;
pub mod nodeinfo;
pub mod noderestriction;
pub mod report;
pub mod sink;

pub use plugreg_csi_core::version;

pub use handler::{
    CsiError, CsiHandler, CsiHandlerConfig, DEFAULT_NODE_GET_INFO_TIMEOUT, PLUGIN_TYPE,
    RegisteredDriver,
};
pub use nodeinfo::{DriverNodeInfo, NODE_ID_ANNOTATION};
#[cfg(feature = "kube")]
pub use sink::KubeSink;
pub use sink::{FileSink, NodeInfoSink, SinkConfig, SinkError, build_sink};
