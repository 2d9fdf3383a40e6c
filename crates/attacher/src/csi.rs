//! The attacher's calls to the driver: GetPluginInfo and the capabilities at start (each with
//! upstream's fixed 1 s deadline, the two capability calls sharing theirs), then
//! ControllerPublishVolume, ControllerUnpublishVolume and ListVolumes within `--timeout`, each
//! counted in `csi_sidecar_operations_seconds`.
//!
//! Connecting, the Probe loop and the exit on connection loss are csi-lib-utils' code, shared
//! with every controller sidecar ([`plugreg_sidecar_kit::driver`]).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use plugreg_csi_core::client::{CallError, Connection, Retry};
use plugreg_proto::csi::v1::{
    ControllerGetCapabilitiesRequest, ControllerPublishVolumeRequest,
    ControllerUnpublishVolumeRequest, GetPluginCapabilitiesRequest, GetPluginInfoRequest,
    ListVolumesRequest, VolumeCapability, controller_service_capability, plugin_capability,
};
use plugreg_runtime::report;
use plugreg_sidecar_kit::metrics::Metrics;
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::Channel;

use crate::decide::DriverCaps;

pub use plugreg_sidecar_kit::driver::{
    CONNECT_WINDOW, Connected, ConnectionLost, CsiError, connect_watched, exit_on_connection_loss,
    probe_forever,
};

/// The fixed deadline of GetPluginInfo, and of the two capability calls together.
pub const STARTUP_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// `/csi.v1.Identity/GetPluginInfo`.
pub const GET_PLUGIN_INFO: &str = "/csi.v1.Identity/GetPluginInfo";
/// `/csi.v1.Identity/GetPluginCapabilities`.
pub const GET_PLUGIN_CAPABILITIES: &str = "/csi.v1.Identity/GetPluginCapabilities";
/// `/csi.v1.Controller/ControllerGetCapabilities`.
pub const CONTROLLER_GET_CAPABILITIES: &str = "/csi.v1.Controller/ControllerGetCapabilities";
/// `/csi.v1.Controller/ControllerPublishVolume`.
pub const CONTROLLER_PUBLISH: &str = "/csi.v1.Controller/ControllerPublishVolume";
/// `/csi.v1.Controller/ControllerUnpublishVolume`.
pub const CONTROLLER_UNPUBLISH: &str = "/csi.v1.Controller/ControllerUnpublishVolume";
/// `/csi.v1.Controller/ListVolumes`.
pub const LIST_VOLUMES: &str = "/csi.v1.Controller/ListVolumes";

/// Why a capability call failed at start (each is its own exit-1 log line).
#[derive(Debug, thiserror::Error)]
pub enum CapabilityError {
    /// GetPluginCapabilities failed.
    #[error("{0}")]
    Plugin(String),
    /// ControllerGetCapabilities failed.
    #[error("{0}")]
    Controller(String),
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

/// Where the calls are logged, at `-v=5` (csi-lib-utils' interceptor logs every call there).
pub const V5: &str = "plugreg_attacher::csi::v5";

/// What replaces each secret in a logged request (protosanitizer's text).
const STRIPPED: &str = "***stripped***";

/// `text` capped at `max` characters as csi-lib-utils caps a logged response
/// (`--max-grpc-log-length`): the first `max` characters and a note; `max` <= 0 is no cap.
pub fn cap_log(text: String, max: i64) -> String {
    let Ok(max) = usize::try_from(max) else {
        return text;
    };
    if max == 0 {
        return text;
    }
    match text.char_indices().nth(max) {
        Some((end, _)) => format!(
            "{} [response body too large, log capped to {max} chars]",
            &text[..end]
        ),
        None => text,
    }
}

/// `secrets` with every value replaced, for a log line.
fn stripped(secrets: &HashMap<String, String>) -> HashMap<String, String> {
    secrets
        .keys()
        .map(|k| (k.clone(), STRIPPED.to_owned()))
        .collect()
}

/// The driver's calls. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Driver {
    conn: Connection,
    metrics: Arc<Metrics>,
    /// `--max-grpc-log-length`.
    max_log: i64,
}

impl Driver {
    /// Calls over `ch`, each within `timeout` (`--timeout`), reported to `metrics`.
    pub fn new(ch: Channel, timeout: Duration, metrics: Arc<Metrics>) -> Self {
        Self {
            conn: Connection::from_channel(ch, "", timeout, Retry::ONCE),
            metrics,
            max_log: -1,
        }
    }

    /// Caps each logged response at `max` characters (`--max-grpc-log-length`; <= 0: no cap).
    pub fn max_grpc_log_length(mut self, max: i64) -> Self {
        self.max_log = max;
        self
    }

    /// Runs one call, logged at `-v=5` as csi-lib-utils logs it ("GRPC call" with the request,
    /// secrets stripped; "GRPC response" capped at `--max-grpc-log-length`, and the error) and
    /// recorded in `csi_sidecar_operations_seconds`.
    /// `migrated` is the `migrated` metrics label of a call for a volume (`true` for a
    /// translated in-tree PV's), `None` for the others.
    async fn timed<T: std::fmt::Debug + Default>(
        &self,
        method: &str,
        migrated: Option<bool>,
        request: &(dyn std::fmt::Debug + Sync),
        call: impl Future<Output = Result<T, CallError>>,
    ) -> Result<T, CallError> {
        tracing::debug!(target: V5, method, request = ?request, "GRPC call");
        let res = self
            .metrics
            .timed_csi_call_as(method, migrated, call, CallError::code)
            .await;
        if tracing::enabled!(target: V5, tracing::Level::DEBUG) {
            let (response, err) = match &res {
                Ok(r) => (format!("{r:?}"), "<nil>".to_owned()),
                Err(e) => (format!("{:?}", T::default()), report::grpc(&e.to_status())),
            };
            tracing::debug!(target: V5, method, response = %cap_log(response, self.max_log), err = %err, "GRPC response");
        }
        res
    }

    /// GetPluginInfo within 1 s: the driver name; empty is an error.
    pub async fn plugin_info(&self) -> Result<String, CsiError> {
        let conn = self.conn.with_timeout(STARTUP_CALL_TIMEOUT);
        let info = self
            .timed(
                GET_PLUGIN_INFO,
                None,
                &GetPluginInfoRequest {},
                conn.get_plugin_info(),
            )
            .await
            .map_err(CsiError::Call)?;
        if info.name.is_empty() {
            return Err(CsiError::EmptyName);
        }
        Ok(info.name)
    }

    /// GetPluginCapabilities, then (with CONTROLLER_SERVICE) ControllerGetCapabilities, both
    /// within one shared second.
    pub async fn capabilities(&self) -> Result<DriverCaps, CapabilityError> {
        let deadline = Instant::now() + STARTUP_CALL_TIMEOUT;
        let left = || deadline.saturating_duration_since(Instant::now());
        let grpc = |e: CallError| report::grpc(&e.to_status());
        let plugin = self
            .timed(
                GET_PLUGIN_CAPABILITIES,
                None,
                &GetPluginCapabilitiesRequest {},
                self.conn.with_timeout(left()).get_plugin_capabilities(),
            )
            .await
            .map_err(|e| CapabilityError::Plugin(grpc(e)))?;
        let mut caps = DriverCaps::default();
        use plugin_capability::service::Type as P;
        caps.controller_service = plugin.capabilities.iter().any(|c| {
            matches!(&c.r#type, Some(plugin_capability::Type::Service(s))
                if P::try_from(s.r#type) == Ok(P::ControllerService))
        });
        if !caps.controller_service {
            return Ok(caps);
        }
        let remaining = left();
        if remaining.is_zero() {
            return Err(CapabilityError::Controller(
                "rpc error: code = DeadlineExceeded desc = context deadline exceeded".into(),
            ));
        }
        let ctrl = self
            .timed(
                CONTROLLER_GET_CAPABILITIES,
                None,
                &ControllerGetCapabilitiesRequest {},
                self.conn
                    .with_timeout(remaining)
                    .controller_get_capabilities(),
            )
            .await
            .map_err(|e| CapabilityError::Controller(grpc(e)))?;
        use controller_service_capability::rpc::Type as C;
        for cap in &ctrl.capabilities {
            let Some(controller_service_capability::Type::Rpc(rpc)) = &cap.r#type else {
                continue;
            };
            match C::try_from(rpc.r#type) {
                Ok(C::PublishUnpublishVolume) => caps.publish_unpublish = true,
                Ok(C::PublishReadonly) => caps.publish_readonly = true,
                Ok(C::SingleNodeMultiWriter) => caps.single_node_multi_writer = true,
                Ok(C::ListVolumes) => caps.list_volumes = true,
                Ok(C::ListVolumesPublishedNodes) => caps.list_volumes_published_nodes = true,
                _ => {}
            }
        }
        Ok(caps)
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
        let ctl = self.conn.controller();
        let call = self.conn.call("ControllerPublishVolume", &req, |r| {
            let mut c = ctl.clone();
            async move { c.controller_publish_volume(r).await }
        });
        let shown = ControllerPublishVolumeRequest {
            secrets: stripped(&req.secrets),
            ..req.clone()
        };
        self.timed(CONTROLLER_PUBLISH, Some(migrated), &shown, call)
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
        let ctl = self.conn.controller();
        let call = self.conn.call("ControllerUnpublishVolume", &req, |r| {
            let mut c = ctl.clone();
            async move { c.controller_unpublish_volume(r).await }
        });
        let shown = ControllerUnpublishVolumeRequest {
            secrets: stripped(&req.secrets),
            ..req.clone()
        };
        self.timed(CONTROLLER_UNPUBLISH, Some(migrated), &shown, call)
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
        let ctl = self.conn.controller();
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
            let conn = self.conn.with_timeout(left);
            let call = conn.call("ListVolumes", &req, |r| {
                let mut c = ctl.clone();
                async move { c.list_volumes(r).await }
            });
            let page = self
                .timed(LIST_VOLUMES, None, &req, call)
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
