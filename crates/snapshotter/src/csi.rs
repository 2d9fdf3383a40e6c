//! The snapshotter's calls to the driver: GetPluginInfo and ControllerGetCapabilities at start
//! (each within `--timeout`), then CreateSnapshot, ListSnapshots and DeleteSnapshot within
//! `--timeout` each, every call counted in `csi_sidecar_operations_seconds`.
//!
//! Upstream also calls GetPluginInfo before every CreateSnapshot and ControllerGetCapabilities
//! before every ListSnapshots; their answers cannot change while the driver runs (a new driver
//! process means a new connection, and this process exits on connection loss), so this one
//! asks once at start. Only the counts in the metric differ.
//!
//! Connecting, the Probe loop and the exit on connection loss are csi-lib-utils' code, shared
//! with every controller sidecar ([`plugreg_sidecar_kit::driver`]).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use plugreg_csi_core::client::{CallError, Connection, Retry};
use plugreg_proto::csi::v1::{
    CreateSnapshotRequest, DeleteSnapshotRequest, ListSnapshotsRequest, Snapshot,
    controller_service_capability,
};
use plugreg_runtime::report;
use plugreg_sidecar_kit::metrics::Metrics;
use tonic::transport::Channel;

use crate::decide::Taken;

pub use plugreg_sidecar_kit::driver::{
    CONNECT_WINDOW, Connected, ConnectionLost, CsiError, connect_watched, exit_on_connection_loss,
    probe_forever,
};

/// `/csi.v1.Identity/GetPluginInfo`.
pub const GET_PLUGIN_INFO: &str = "/csi.v1.Identity/GetPluginInfo";
/// `/csi.v1.Controller/ControllerGetCapabilities`.
pub const CONTROLLER_GET_CAPABILITIES: &str = "/csi.v1.Controller/ControllerGetCapabilities";
/// `/csi.v1.Controller/CreateSnapshot`.
pub const CREATE_SNAPSHOT: &str = "/csi.v1.Controller/CreateSnapshot";
/// `/csi.v1.Controller/ListSnapshots`.
pub const LIST_SNAPSHOTS: &str = "/csi.v1.Controller/ListSnapshots";
/// `/csi.v1.Controller/DeleteSnapshot`.
pub const DELETE_SNAPSHOT: &str = "/csi.v1.Controller/DeleteSnapshot";

/// What the driver can do, of what the snapshotter asks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverCaps {
    /// CREATE_DELETE_SNAPSHOT (required: without it the process exits 1).
    pub create_delete_snapshot: bool,
    /// LIST_SNAPSHOTS (without it a pre-provisioned content is ready at once).
    pub list_snapshots: bool,
}

/// A failed snapshot call: Go's text of it (`rpc error: code = X desc = Y`) and its code
/// (`None` without a gRPC status: treated as possibly still in progress).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failed {
    /// grpc-go's text.
    pub message: String,
    /// The gRPC code.
    pub code: Option<tonic::Code>,
}

impl From<CallError> for Failed {
    fn from(e: CallError) -> Self {
        let code = match &e {
            CallError::Rpc { status, .. } => Some(status.code()),
            CallError::Timeout { .. } => Some(tonic::Code::DeadlineExceeded),
            _ => None,
        };
        Self {
            message: report::grpc(&e.to_status()),
            code,
        }
    }
}

/// The driver's calls. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Driver {
    conn: Connection,
    metrics: Arc<Metrics>,
}

fn taken(s: Snapshot) -> Taken {
    let creation_time = s.creation_time.map_or(0, |t| {
        t.seconds
            .saturating_mul(1_000_000_000)
            .saturating_add(i64::from(t.nanos))
    });
    Taken {
        handle: s.snapshot_id,
        creation_time,
        size: s.size_bytes,
        ready: s.ready_to_use,
        group_handle: s.group_snapshot_id,
    }
}

/// `secrets` with every value replaced, for a log line.
fn stripped(secrets: &HashMap<String, String>) -> Vec<&str> {
    secrets.keys().map(String::as_str).collect()
}

impl Driver {
    /// Calls over `ch`, each within `timeout` (`--timeout`), reported to `metrics`.
    pub fn new(ch: Channel, timeout: Duration, metrics: Arc<Metrics>) -> Self {
        Self {
            conn: Connection::from_channel(ch, "", timeout, Retry::ONCE),
            metrics,
        }
    }

    async fn timed<T>(
        &self,
        method: &str,
        call: impl Future<Output = Result<T, CallError>>,
    ) -> Result<T, CallError> {
        self.metrics
            .timed_csi_call(method, call, CallError::code)
            .await
    }

    /// GetPluginInfo: the driver name; empty is an error.
    pub async fn plugin_info(&self) -> Result<String, CsiError> {
        let info = self
            .timed(GET_PLUGIN_INFO, self.conn.get_plugin_info())
            .await
            .map_err(CsiError::Call)?;
        if info.name.is_empty() {
            return Err(CsiError::EmptyName);
        }
        Ok(info.name)
    }

    /// ControllerGetCapabilities (no GetPluginCapabilities, as upstream).
    pub async fn capabilities(&self) -> Result<DriverCaps, String> {
        let ctrl = self
            .timed(
                CONTROLLER_GET_CAPABILITIES,
                self.conn.controller_get_capabilities(),
            )
            .await
            .map_err(|e| report::grpc(&e.to_status()))?;
        use controller_service_capability::rpc::Type as C;
        let mut caps = DriverCaps::default();
        for cap in &ctrl.capabilities {
            let Some(controller_service_capability::Type::Rpc(rpc)) = &cap.r#type else {
                continue;
            };
            match C::try_from(rpc.r#type) {
                Ok(C::CreateDeleteSnapshot) => caps.create_delete_snapshot = true,
                Ok(C::ListSnapshots) => caps.list_snapshots = true,
                _ => {}
            }
        }
        Ok(caps)
    }

    /// CreateSnapshot of `source_volume_id` named `name`. An answer without a snapshot is an
    /// error without a gRPC code (upstream crashes on it).
    pub async fn create_snapshot(
        &self,
        source_volume_id: &str,
        name: &str,
        parameters: HashMap<String, String>,
        secrets: HashMap<String, String>,
    ) -> Result<Taken, Failed> {
        let req = CreateSnapshotRequest {
            source_volume_id: source_volume_id.to_owned(),
            name: name.to_owned(),
            secrets,
            parameters,
        };
        tracing::debug!(
            source_volume_id,
            name,
            parameters = ?req.parameters,
            secrets = ?stripped(&req.secrets),
            "CreateSnapshot"
        );
        let ctl = self.conn.controller();
        let call = self.conn.call("CreateSnapshot", &req, |r| {
            let mut c = ctl.clone();
            async move { c.create_snapshot(r).await }
        });
        let resp = self.timed(CREATE_SNAPSHOT, call).await?;
        resp.snapshot.map(taken).ok_or_else(|| Failed {
            message: "the driver answered CreateSnapshot without a snapshot".into(),
            code: None,
        })
    }

    /// ListSnapshots of the one `snapshot_id`: its first entry, or `None` when there is none.
    pub async fn list_snapshot(
        &self,
        snapshot_id: &str,
        secrets: HashMap<String, String>,
    ) -> Result<Option<Taken>, Failed> {
        let req = ListSnapshotsRequest {
            snapshot_id: snapshot_id.to_owned(),
            secrets,
            ..ListSnapshotsRequest::default()
        };
        let ctl = self.conn.controller();
        let call = self.conn.call("ListSnapshots", &req, |r| {
            let mut c = ctl.clone();
            async move { c.list_snapshots(r).await }
        });
        let resp = self.timed(LIST_SNAPSHOTS, call).await?;
        Ok(resp
            .entries
            .into_iter()
            .next()
            .and_then(|e| e.snapshot)
            .map(taken))
    }

    /// DeleteSnapshot of `snapshot_id`.
    pub async fn delete_snapshot(
        &self,
        snapshot_id: &str,
        secrets: HashMap<String, String>,
    ) -> Result<(), Failed> {
        let req = DeleteSnapshotRequest {
            snapshot_id: snapshot_id.to_owned(),
            secrets,
        };
        let ctl = self.conn.controller();
        let call = self.conn.call("DeleteSnapshot", &req, |r| {
            let mut c = ctl.clone();
            async move { c.delete_snapshot(r).await }
        });
        self.timed(DELETE_SNAPSHOT, call).await?;
        Ok(())
    }
}
