//! The attacher's calls to the driver: ControllerPublishVolume, ControllerUnpublishVolume and
//! ListVolumes within `--timeout`, on the kit's timed client ([`Client`]: each counted in
//! `csi_sidecar_operations_seconds` and logged at `-v=5`), and what the capabilities read at
//! start-up mean to the attacher.
//!
//! Connecting, the start-up questions (Probe, GetPluginInfo, the capabilities, each with
//! upstream's fixed 1 s deadline, the two capability calls sharing theirs) and the exit on
//! connection loss are every controller sidecar's ([`plugreg_sidecar_kit::driver`]).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use plugreg_csi_core::client::CallError;
use plugreg_proto::csi::v1::{
    ControllerPublishVolumeRequest, ControllerUnpublishVolumeRequest, ListVolumesRequest,
    VolumeCapability,
};
use plugreg_runtime::report;
use plugreg_sidecar_kit::csi::{Capabilities, Client, ControllerRpc, PluginService, stripped};
use tokio::time::Instant;
use tonic::Code;

use crate::decide::DriverCaps;

/// The fixed deadline of GetPluginInfo, and of the two capability calls together.
pub const STARTUP_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// `/csi.v1.Controller/ControllerPublishVolume`.
pub const CONTROLLER_PUBLISH: &str = "/csi.v1.Controller/ControllerPublishVolume";
/// `/csi.v1.Controller/ControllerUnpublishVolume`.
pub const CONTROLLER_UNPUBLISH: &str = "/csi.v1.Controller/ControllerUnpublishVolume";
/// `/csi.v1.Controller/ListVolumes`.
pub const LIST_VOLUMES: &str = "/csi.v1.Controller/ListVolumes";

impl From<&Capabilities> for DriverCaps {
    /// What the capabilities read at start-up mean to the attacher.
    fn from(read: &Capabilities) -> Self {
        Self {
            controller_service: read.has_service(PluginService::ControllerService),
            publish_unpublish: read.has_rpc(ControllerRpc::PublishUnpublishVolume),
            publish_readonly: read.has_rpc(ControllerRpc::PublishReadonly),
            single_node_multi_writer: read.has_rpc(ControllerRpc::SingleNodeMultiWriter),
            list_volumes: read.has_rpc(ControllerRpc::ListVolumes),
            list_volumes_published_nodes: read.has_rpc(ControllerRpc::ListVolumesPublishedNodes),
        }
    }
}

/// A failed call in Go's words (`rpc error: code = X desc = Y`) and its gRPC code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcFailure {
    /// The text stored in `attachError` / `detachError`.
    pub message: String,
    /// The gRPC code number (for `attachError.errorCode`).
    pub code: i32,
}

impl From<&CallError> for RpcFailure {
    fn from(e: &CallError) -> Self {
        let status = e.to_status();
        Self {
            message: report::grpc(&status),
            code: status.code() as i32,
        }
    }
}

/// Whether a failed publish may still be going on in the driver (upstream's list; both kinds
/// are saved and retried the same way).
pub fn may_be_in_progress(code: i32) -> bool {
    matches!(
        Code::from_i32(code),
        Code::Cancelled
            | Code::DeadlineExceeded
            | Code::Unavailable
            | Code::ResourceExhausted
            | Code::Aborted
    )
}

/// The driver's calls. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Driver {
    client: Client,
}

impl Driver {
    /// The calls on `client` (the one [`identify`](plugreg_sidecar_kit::driver::identify)
    /// returns: `--timeout`, the metrics, `--max-grpc-log-length`).
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// ControllerPublishVolume within `--timeout`: the publish context. `migrated`: the volume
    /// is a translated in-tree PV (the metrics label).
    #[allow(clippy::too_many_arguments)]
    pub async fn publish(
        &self,
        migrated: bool,
        volume_id: &str,
        node_id: &str,
        capability: &VolumeCapability,
        readonly: bool,
        secrets: HashMap<String, String>,
        volume_context: &BTreeMap<String, String>,
    ) -> Result<BTreeMap<String, String>, CallError> {
        let req = ControllerPublishVolumeRequest {
            volume_id: volume_id.to_owned(),
            node_id: node_id.to_owned(),
            volume_capability: Some(capability.clone()),
            readonly,
            secrets,
            volume_context: volume_context
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        };
        let ctl = self.client.connection().controller();
        let call = self
            .client
            .connection()
            .call("ControllerPublishVolume", &req, |r| {
                let mut c = ctl.clone();
                async move { c.controller_publish_volume(r).await }
            });
        let shown = ControllerPublishVolumeRequest {
            secrets: stripped(&req.secrets),
            ..req.clone()
        };
        self.client
            .timed_as(CONTROLLER_PUBLISH, Some(migrated), &shown, call)
            .await
            .map(|r| r.publish_context.into_iter().collect())
    }

    /// ControllerUnpublishVolume within `--timeout`. `migrated`: as for
    /// [`publish`](Self::publish).
    pub async fn unpublish(
        &self,
        migrated: bool,
        volume_id: &str,
        node_id: &str,
        secrets: HashMap<String, String>,
    ) -> Result<(), CallError> {
        let req = ControllerUnpublishVolumeRequest {
            volume_id: volume_id.to_owned(),
            node_id: node_id.to_owned(),
            secrets,
        };
        let ctl = self.client.connection().controller();
        let call = self
            .client
            .connection()
            .call("ControllerUnpublishVolume", &req, |r| {
                let mut c = ctl.clone();
                async move { c.controller_unpublish_volume(r).await }
            });
        let shown = ControllerUnpublishVolumeRequest {
            secrets: stripped(&req.secrets),
            ..req.clone()
        };
        self.client
            .timed_as(CONTROLLER_UNPUBLISH, Some(migrated), &shown, call)
            .await
            .map(drop)
    }

    /// Every page of ListVolumes (`max_entries` per page) within `budget` in all: volume ID ->
    /// the nodes it is published to. Entries without a volume or a status are skipped.
    pub async fn published_nodes(
        &self,
        max_entries: i32,
        budget: Duration,
    ) -> Result<HashMap<String, Vec<String>>, String> {
        let deadline = Instant::now() + budget;
        let mut out = HashMap::new();
        let mut token = String::new();
        let ctl = self.client.connection().controller();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(
                    "rpc error: code = DeadlineExceeded desc = context deadline exceeded".into(),
                );
            }
            let req = ListVolumesRequest {
                max_entries,
                starting_token: token.clone(),
            };
            let conn = self.client.connection().with_timeout(left);
            let call = conn.call("ListVolumes", &req, |r| {
                let mut c = ctl.clone();
                async move { c.list_volumes(r).await }
            });
            let page = self
                .client
                .timed(LIST_VOLUMES, &req, call)
                .await
                .map_err(|e| report::grpc(&e.to_status()))?;
            for entry in page.entries {
                if let (Some(v), Some(s)) = (entry.volume, entry.status) {
                    out.insert(v.volume_id, s.published_node_ids);
                }
            }
            if page.next_token.is_empty() {
                return Ok(out);
            }
            token = page.next_token;
        }
    }
}
