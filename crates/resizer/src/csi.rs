//! The CSI driver as the resizer sees it: which controllers it gets (the capability decision
//! of external-resizer's `resizer.NewResizerFromClient` and `modifier.NewModifierFromClient`),
//! and the two calls (ControllerExpandVolume, ControllerModifyVolume), each with the
//! `--timeout` deadline, made once, and reported to `csi_sidecar_operations_seconds`.
//! Connecting and probing are what every controller sidecar does ([`plugreg_sidecar_kit::driver`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use plugreg_csi_core::client::{CallError, Connection, Retry};
use plugreg_proto::csi::v1::{
    ControllerExpandVolumeRequest, ControllerExpandVolumeResponse, ControllerModifyVolumeRequest,
    controller_service_capability, node_service_capability, plugin_capability,
};
use plugreg_runtime::report;
use plugreg_sidecar_kit::metrics::Metrics;
use tonic::transport::Channel;

/// `/csi.v1.Identity/GetPluginCapabilities`.
pub const GET_PLUGIN_CAPABILITIES: &str = "/csi.v1.Identity/GetPluginCapabilities";
/// `/csi.v1.Controller/ControllerGetCapabilities`.
pub const CONTROLLER_GET_CAPABILITIES: &str = "/csi.v1.Controller/ControllerGetCapabilities";
/// `/csi.v1.Node/NodeGetCapabilities`.
pub const NODE_GET_CAPABILITIES: &str = "/csi.v1.Node/NodeGetCapabilities";
/// `/csi.v1.Controller/ControllerExpandVolume`.
pub const CONTROLLER_EXPAND_VOLUME: &str = "/csi.v1.Controller/ControllerExpandVolume";
/// `/csi.v1.Controller/ControllerModifyVolume`.
pub const CONTROLLER_MODIFY_VOLUME: &str = "/csi.v1.Controller/ControllerModifyVolume";

/// How claims are grown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resizer {
    /// ControllerExpandVolume (controller EXPAND_VOLUME).
    Csi,
    /// No controller call: the PV gets the requested size and the kubelet's NodeExpandVolume
    /// does the work (node EXPAND_VOLUME only).
    Trivial,
}

/// Why the capability decision failed. The texts are upstream's.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// No CONTROLLER_SERVICE plugin capability.
    #[error("CSI driver does not support controller service")]
    NoControllerService,
    /// A capability call failed.
    #[error("{0}")]
    Call(String),
}

/// What start-up found out about the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    /// `None`: "Resize not supported".
    pub resizer: Option<Resizer>,
    /// Controller MODIFY_VOLUME.
    pub modify: bool,
}

/// The driver's calls (cheap to clone).
#[derive(Debug, Clone)]
pub struct Driver {
    conn: Connection,
    metrics: Arc<Metrics>,
}

/// A call error as upstream words it: `rpc error: code = <Code> desc = <msg>`.
pub fn error_text(e: &CallError) -> String {
    report::grpc(&e.to_status())
}

/// The controller capabilities the resizer reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct ControllerCaps {
    expand: bool,
    modify: bool,
    single_node_multi_writer: bool,
}

impl Driver {
    /// Calls over `ch`, each within `timeout`, reported to `metrics`.
    pub fn new(ch: Channel, timeout: Duration, metrics: Arc<Metrics>) -> Self {
        Self {
            conn: Connection::from_channel(ch, "", timeout, Retry::ONCE),
            metrics,
        }
    }

    async fn controller_caps(&self) -> Result<ControllerCaps, CallError> {
        let r = timed(
            &self.metrics,
            CONTROLLER_GET_CAPABILITIES,
            self.conn.controller_get_capabilities(),
        )
        .await?;
        use controller_service_capability::rpc::Type as C;
        let mut caps = ControllerCaps::default();
        for cap in &r.capabilities {
            if let Some(controller_service_capability::Type::Rpc(rpc)) = &cap.r#type {
                match C::try_from(rpc.r#type) {
                    Ok(C::ExpandVolume) => caps.expand = true,
                    Ok(C::ModifyVolume) => caps.modify = true,
                    Ok(C::SingleNodeMultiWriter) => caps.single_node_multi_writer = true,
                    _ => {}
                }
            }
        }
        Ok(caps)
    }

    /// The resizer decision (GetPluginCapabilities, ControllerGetCapabilities, then
    /// NodeGetCapabilities for node-only drivers) and the modifier's (one more
    /// ControllerGetCapabilities), in upstream's order.
    pub async fn find(&self) -> Result<Found, StartError> {
        let call = |e: CallError| StartError::Call(error_text(&e));
        let plugin = timed(
            &self.metrics,
            GET_PLUGIN_CAPABILITIES,
            self.conn.get_plugin_capabilities(),
        )
        .await
        .map_err(call)?;
        let controller_service = plugin.capabilities.iter().any(|c| {
            matches!(&c.r#type, Some(plugin_capability::Type::Service(s))
                if s.r#type == plugin_capability::service::Type::ControllerService as i32)
        });
        if !controller_service {
            return Err(StartError::NoControllerService);
        }
        let caps = self.controller_caps().await.map_err(call)?;
        let resizer = if caps.expand {
            // Upstream reads SINGLE_NODE_MULTI_WRITER once more here.
            self.controller_caps().await.map_err(call)?;
            Some(Resizer::Csi)
        } else {
            let node = timed(
                &self.metrics,
                NODE_GET_CAPABILITIES,
                self.conn.node_get_capabilities(),
            )
            .await
            .map_err(call)?;
            let node_expand = node.capabilities.iter().any(|c| {
                matches!(&c.r#type, Some(node_service_capability::Type::Rpc(r))
                    if r.r#type == node_service_capability::rpc::Type::ExpandVolume as i32)
            });
            node_expand.then_some(Resizer::Trivial)
        };
        let modify = self.controller_caps().await.map_err(call)?.modify;
        Ok(Found { resizer, modify })
    }

    /// Whether the driver has SINGLE_NODE_MULTI_WRITER (read before every expansion, as
    /// upstream).
    pub async fn single_node_multi_writer(&self) -> Result<bool, CallError> {
        Ok(self.controller_caps().await?.single_node_multi_writer)
    }

    /// ControllerExpandVolume within the timeout; `migrated`: the volume is a translated in-tree
    /// PV (the `migrated` label, shown only for a CSI-migration target).
    pub async fn expand(
        &self,
        req: ControllerExpandVolumeRequest,
        migrated: bool,
    ) -> Result<ControllerExpandVolumeResponse, CallError> {
        let conn = &self.conn;
        self.metrics
            .timed_csi_call_as(
                CONTROLLER_EXPAND_VOLUME,
                Some(migrated),
                conn.call(CONTROLLER_EXPAND_VOLUME, &req, |r| {
                    let mut c = conn.controller();
                    async move { c.controller_expand_volume(r).await }
                }),
                CallError::code,
            )
            .await
    }

    /// ControllerModifyVolume within the timeout.
    pub async fn modify(&self, req: ControllerModifyVolumeRequest) -> Result<(), CallError> {
        let conn = &self.conn;
        timed(
            &self.metrics,
            CONTROLLER_MODIFY_VOLUME,
            conn.call(CONTROLLER_MODIFY_VOLUME, &req, |r| {
                let mut c = conn.controller();
                async move { c.controller_modify_volume(r).await }
            }),
        )
        .await
        .map(drop)
    }
}

/// Runs one call and records it in `csi_sidecar_operations_seconds` (the kit's timing).
async fn timed<T>(
    metrics: &Metrics,
    method: &str,
    call: impl Future<Output = Result<T, CallError>>,
) -> Result<T, CallError> {
    metrics.timed_csi_call(method, call, CallError::code).await
}
