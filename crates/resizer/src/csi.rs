//! The CSI driver as the resizer sees it: which controllers it gets (the capability decision
//! of external-resizer's `resizer.NewResizerFromClient` and `modifier.NewModifierFromClient`),
//! and the two calls (ControllerExpandVolume, ControllerModifyVolume), each with the
//! `--timeout` deadline, made once, and reported to `csi_sidecar_operations_seconds`, on the
//! kit's timed client ([`Client`]). Connecting, probing, the name and the first capability
//! reads are what every controller sidecar does ([`plugreg_sidecar_kit::driver`]).

use plugreg_csi_core::client::CallError;
use plugreg_proto::csi::v1::{
    ControllerExpandVolumeRequest, ControllerExpandVolumeResponse, ControllerModifyVolumeRequest,
    NodeGetCapabilitiesRequest, node_service_capability,
};
use plugreg_runtime::report;
use plugreg_sidecar_kit::csi::{Capabilities, Client, ControllerRpc, PluginService};

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
    client: Client,
}

/// A call error as upstream words it: `rpc error: code = <Code> desc = <msg>`.
pub fn error_text(e: &CallError) -> String {
    report::grpc(&e.to_status())
}

impl Driver {
    /// The calls on `client` (the one [`identify`](plugreg_sidecar_kit::driver::identify)
    /// returns: `--timeout`, the metrics).
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// The resizer decision on what [`identify`](plugreg_sidecar_kit::driver::identify) read
    /// (GetPluginCapabilities, then ControllerGetCapabilities for a driver with
    /// CONTROLLER_SERVICE): one more ControllerGetCapabilities for an expanding driver,
    /// NodeGetCapabilities for the others, then the modifier's ControllerGetCapabilities, in
    /// upstream's order.
    pub async fn find(&self, read: &Capabilities) -> Result<Found, StartError> {
        self.decide(read, true).await
    }

    /// [`find`](Self::find) without reading the controller capabilities again (`csi-sidecars`,
    /// whose one identification read them for every controller): only a driver that does not
    /// expand is asked for its node capabilities.
    pub async fn find_in(&self, read: &Capabilities) -> Result<Found, StartError> {
        self.decide(read, false).await
    }

    async fn decide(&self, read: &Capabilities, again: bool) -> Result<Found, StartError> {
        let call = |e: CallError| StartError::Call(error_text(&e));
        if !read.has_service(PluginService::ControllerService) {
            return Err(StartError::NoControllerService);
        }
        let resizer = if read.has_rpc(ControllerRpc::ExpandVolume) {
            if again {
                // Upstream reads SINGLE_NODE_MULTI_WRITER once more here.
                self.client.controller_capabilities().await.map_err(call)?;
            }
            Some(Resizer::Csi)
        } else {
            let node = self
                .client
                .timed(
                    NODE_GET_CAPABILITIES,
                    &NodeGetCapabilitiesRequest {},
                    self.client.connection().node_get_capabilities(),
                )
                .await
                .map_err(call)?;
            let node_expand = node.capabilities.iter().any(|c| {
                matches!(&c.r#type, Some(node_service_capability::Type::Rpc(r))
                    if r.r#type == node_service_capability::rpc::Type::ExpandVolume as i32)
            });
            node_expand.then_some(Resizer::Trivial)
        };
        let modify = if again {
            self.client
                .controller_capabilities()
                .await
                .map_err(call)?
                .contains(&ControllerRpc::ModifyVolume)
        } else {
            read.has_rpc(ControllerRpc::ModifyVolume)
        };
        Ok(Found { resizer, modify })
    }

    /// Whether the driver has SINGLE_NODE_MULTI_WRITER (read before every expansion, as
    /// upstream).
    pub async fn single_node_multi_writer(&self) -> Result<bool, CallError> {
        Ok(self
            .client
            .controller_capabilities()
            .await?
            .contains(&ControllerRpc::SingleNodeMultiWriter))
    }

    /// ControllerExpandVolume within the timeout; `migrated`: the volume is a translated in-tree
    /// PV (the `migrated` label, shown only for a CSI-migration target).
    pub async fn expand(
        &self,
        req: ControllerExpandVolumeRequest,
        migrated: bool,
    ) -> Result<ControllerExpandVolumeResponse, CallError> {
        let conn = self.client.connection();
        let call = conn.call(CONTROLLER_EXPAND_VOLUME, &req, |r| {
            let mut c = conn.controller();
            async move { c.controller_expand_volume(r).await }
        });
        self.client
            .timed_as(CONTROLLER_EXPAND_VOLUME, Some(migrated), &req, call)
            .await
    }

    /// ControllerModifyVolume within the timeout.
    pub async fn modify(&self, req: ControllerModifyVolumeRequest) -> Result<(), CallError> {
        let conn = self.client.connection();
        let call = conn.call(CONTROLLER_MODIFY_VOLUME, &req, |r| {
            let mut c = conn.controller();
            async move { c.controller_modify_volume(r).await }
        });
        self.client
            .timed(CONTROLLER_MODIFY_VOLUME, &req, call)
            .await
            .map(drop)
    }
}
