//! The snapshotter's calls to the driver: CreateSnapshot, ListSnapshots and DeleteSnapshot
//! within `--timeout` each, on the kit's timed client ([`Client`]: every call counted in
//! `csi_sidecar_operations_seconds`), and what the capabilities read at start-up (GetPluginInfo
//! and ControllerGetCapabilities, each within `--timeout`) mean to the snapshotter.
//!
//! Upstream also calls GetPluginInfo before every CreateSnapshot and ControllerGetCapabilities
//! before every ListSnapshots; their answers cannot change while the driver runs (a new driver
//! process means a new connection, and this process exits on connection loss), so this one
//! asks once at start. Only the counts in the metric differ.
//!
//! Connecting, the start-up questions and the exit on connection loss are every controller
//! sidecar's ([`plugreg_sidecar_kit::driver`]).

use std::collections::HashMap;

use plugreg_csi_core::client::CallError;
use plugreg_proto::csi::v1::{
    CreateSnapshotRequest, CreateVolumeGroupSnapshotRequest, DeleteSnapshotRequest,
    DeleteVolumeGroupSnapshotRequest, GetVolumeGroupSnapshotRequest,
    GroupControllerGetCapabilitiesRequest, ListSnapshotsRequest, Snapshot, VolumeGroupSnapshot,
    group_controller_service_capability,
};
use plugreg_runtime::report;
use plugreg_sidecar_kit::csi::{Capabilities, Client, ControllerRpc};
use plugreg_sidecar_kit::groupsnapshot::VolumeSnapshotInfo;

use crate::decide::Taken;
use crate::group::decide::GroupTaken;

/// `/csi.v1.Controller/CreateSnapshot`.
pub const CREATE_SNAPSHOT: &str = "/csi.v1.Controller/CreateSnapshot";
/// `/csi.v1.Controller/ListSnapshots`.
pub const LIST_SNAPSHOTS: &str = "/csi.v1.Controller/ListSnapshots";
/// `/csi.v1.Controller/DeleteSnapshot`.
pub const DELETE_SNAPSHOT: &str = "/csi.v1.Controller/DeleteSnapshot";
/// `/csi.v1.GroupController/GroupControllerGetCapabilities`.
pub const GROUP_CAPABILITIES: &str = "/csi.v1.GroupController/GroupControllerGetCapabilities";
/// `/csi.v1.GroupController/CreateVolumeGroupSnapshot`.
pub const CREATE_GROUP: &str = "/csi.v1.GroupController/CreateVolumeGroupSnapshot";
/// `/csi.v1.GroupController/GetVolumeGroupSnapshot`.
pub const GET_GROUP: &str = "/csi.v1.GroupController/GetVolumeGroupSnapshot";
/// `/csi.v1.GroupController/DeleteVolumeGroupSnapshot`.
pub const DELETE_GROUP: &str = "/csi.v1.GroupController/DeleteVolumeGroupSnapshot";

/// What the driver can do, of what the snapshotter asks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverCaps {
    /// CREATE_DELETE_SNAPSHOT (required: without it the process exits 1).
    pub create_delete_snapshot: bool,
    /// LIST_SNAPSHOTS (without it a pre-provisioned content is ready at once).
    pub list_snapshots: bool,
}

impl From<&Capabilities> for DriverCaps {
    /// What ControllerGetCapabilities (no GetPluginCapabilities, as upstream) means to the
    /// snapshotter.
    fn from(read: &Capabilities) -> Self {
        Self {
            create_delete_snapshot: read.has_rpc(ControllerRpc::CreateDeleteSnapshot),
            list_snapshots: read.has_rpc(ControllerRpc::ListSnapshots),
        }
    }
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
    client: Client,
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

/// The group as the status records it: a missing creation time is now (upstream stores the
/// epoch), each member with its own time, readiness and size (upstream leaves them to a later
/// ListSnapshots of each member).
fn group_taken(g: VolumeGroupSnapshot) -> GroupTaken {
    let now = k8s_openapi::jiff::Timestamp::now();
    let creation_time = g
        .creation_time
        .and_then(|t| k8s_openapi::jiff::Timestamp::new(t.seconds, t.nanos).ok())
        .filter(|t| t.as_second() != 0)
        .unwrap_or(now);
    let creation_time = creation_time
        .round(k8s_openapi::jiff::Unit::Second)
        .unwrap_or(creation_time);
    GroupTaken {
        handle: g.group_snapshot_id,
        ready: g.ready_to_use,
        creation_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(creation_time),
        members: g
            .snapshots
            .into_iter()
            .map(|s| {
                let source = s.source_volume_id.clone();
                let t = taken(s);
                VolumeSnapshotInfo {
                    volume_handle: Some(source),
                    snapshot_handle: Some(t.handle),
                    creation_time: (t.creation_time != 0).then_some(t.creation_time),
                    ready_to_use: Some(t.ready),
                    restore_size: (t.size > 0).then_some(t.size),
                }
            })
            .collect(),
    }
}

/// `secrets` with every value replaced, for a log line.
fn stripped(secrets: &HashMap<String, String>) -> Vec<&str> {
    secrets.keys().map(String::as_str).collect()
}

impl Driver {
    /// The calls on `client` (the one [`identify`](plugreg_sidecar_kit::driver::identify)
    /// returns: `--timeout`, the metrics).
    pub fn new(client: Client) -> Self {
        Self { client }
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
        let ctl = self.client.connection().controller();
        let call = self.client.connection().call("CreateSnapshot", &req, |r| {
            let mut c = ctl.clone();
            async move { c.create_snapshot(r).await }
        });
        let resp = self.client.timed(CREATE_SNAPSHOT, &req, call).await?;
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
        let ctl = self.client.connection().controller();
        let call = self.client.connection().call("ListSnapshots", &req, |r| {
            let mut c = ctl.clone();
            async move { c.list_snapshots(r).await }
        });
        let resp = self.client.timed(LIST_SNAPSHOTS, &req, call).await?;
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
        let ctl = self.client.connection().controller();
        let call = self.client.connection().call("DeleteSnapshot", &req, |r| {
            let mut c = ctl.clone();
            async move { c.delete_snapshot(r).await }
        });
        self.client.timed(DELETE_SNAPSHOT, &req, call).await?;
        Ok(())
    }

    /// GroupControllerGetCapabilities: whether the driver offers
    /// CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT.
    pub async fn group_snapshots(&self) -> Result<bool, Failed> {
        let req = GroupControllerGetCapabilitiesRequest::default();
        let ctl = self.client.connection().group_controller();
        let call = self
            .client
            .connection()
            .call("GroupControllerGetCapabilities", &req, |r| {
                let mut c = ctl.clone();
                async move { c.group_controller_get_capabilities(r).await }
            });
        let resp = self.client.timed(GROUP_CAPABILITIES, &req, call).await?;
        use group_controller_service_capability::{Type, rpc};
        Ok(resp.capabilities.iter().any(|c| {
            matches!(&c.r#type, Some(Type::Rpc(r)) if r.r#type == rpc::Type::CreateDeleteGetVolumeGroupSnapshot as i32)
        }))
    }

    /// CreateVolumeGroupSnapshot of `source_volume_ids` named `name`. An answer without a
    /// group is an error without a gRPC code (upstream crashes on it).
    pub async fn create_group(
        &self,
        source_volume_ids: &[String],
        name: &str,
        parameters: HashMap<String, String>,
        secrets: HashMap<String, String>,
    ) -> Result<GroupTaken, Failed> {
        let req = CreateVolumeGroupSnapshotRequest {
            name: name.to_owned(),
            source_volume_ids: source_volume_ids.to_vec(),
            secrets,
            parameters,
        };
        tracing::debug!(
            ?source_volume_ids,
            name,
            parameters = ?req.parameters,
            secrets = ?stripped(&req.secrets),
            "CreateVolumeGroupSnapshot"
        );
        let ctl = self.client.connection().group_controller();
        let call = self
            .client
            .connection()
            .call("CreateVolumeGroupSnapshot", &req, |r| {
                let mut c = ctl.clone();
                async move { c.create_volume_group_snapshot(r).await }
            });
        let resp = self.client.timed(CREATE_GROUP, &req, call).await?;
        resp.group_snapshot.map(group_taken).ok_or_else(|| Failed {
            message: "the driver answered CreateVolumeGroupSnapshot without a group snapshot"
                .into(),
            code: None,
        })
    }

    /// GetVolumeGroupSnapshot of `group_snapshot_id` with its members `snapshot_ids`.
    pub async fn get_group(
        &self,
        group_snapshot_id: &str,
        snapshot_ids: Vec<String>,
        secrets: HashMap<String, String>,
    ) -> Result<GroupTaken, Failed> {
        let req = GetVolumeGroupSnapshotRequest {
            group_snapshot_id: group_snapshot_id.to_owned(),
            snapshot_ids,
            secrets,
        };
        let ctl = self.client.connection().group_controller();
        let call = self
            .client
            .connection()
            .call("GetVolumeGroupSnapshot", &req, |r| {
                let mut c = ctl.clone();
                async move { c.get_volume_group_snapshot(r).await }
            });
        let resp = self.client.timed(GET_GROUP, &req, call).await?;
        resp.group_snapshot.map(group_taken).ok_or_else(|| Failed {
            message: "the driver answered GetVolumeGroupSnapshot without a group snapshot".into(),
            code: None,
        })
    }

    /// DeleteVolumeGroupSnapshot of `group_snapshot_id` and its members `snapshot_ids`.
    pub async fn delete_group(
        &self,
        group_snapshot_id: &str,
        snapshot_ids: Vec<String>,
        secrets: HashMap<String, String>,
    ) -> Result<(), Failed> {
        let req = DeleteVolumeGroupSnapshotRequest {
            group_snapshot_id: group_snapshot_id.to_owned(),
            snapshot_ids,
            secrets,
        };
        let ctl = self.client.connection().group_controller();
        let call = self
            .client
            .connection()
            .call("DeleteVolumeGroupSnapshot", &req, |r| {
                let mut c = ctl.clone();
                async move { c.delete_volume_group_snapshot(r).await }
            });
        self.client.timed(DELETE_GROUP, &req, call).await?;
        Ok(())
    }
}
