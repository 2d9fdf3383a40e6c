//! The group snapshot API of `groupsnapshot.storage.k8s.io/v1` (external-snapshotter's CRDs):
//! VolumeGroupSnapshotContent and VolumeGroupSnapshotClass with the fields csi-snapshotter
//! reads and writes, and the annotation and finalizer names the snapshot-controller and the
//! sidecar agree on. (The VolumeGroupSnapshot itself is the snapshot-controller's: the sidecar
//! never reads it.)
//!
//! As in [`crate::snapshot`], every field is optional on the wire and unknown fields are dropped
//! on decode: these types are for reading and for building patches, never for a whole-object
//! PUT.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::{Deserialize, Serialize};

use crate::snapshot::SnapshotError;

/// The API group of the group snapshot objects.
pub const GROUP: &str = "groupsnapshot.storage.k8s.io";
/// The API version the v8.6 controllers use (v1beta2 is the CRDs' storage version).
pub const VERSION: &str = "v1";

/// Annotation the sidecar sets on a group content before each CreateVolumeGroupSnapshot and
/// removes after a success or a final error: while it is there, a create may be in flight.
pub const ANN_BEING_CREATED: &str =
    "groupsnapshot.storage.kubernetes.io/volumegroupsnapshot-being-created";
/// Annotation the snapshot-controller sets on a group content when its VolumeGroupSnapshot is
/// being deleted: it licenses the sidecar to act on the content's deletion.
pub const ANN_BEING_DELETED: &str =
    "groupsnapshot.storage.kubernetes.io/volumegroupsnapshot-being-deleted";
/// Annotation (group content) naming the Secret for CreateVolumeGroupSnapshot and
/// DeleteVolumeGroupSnapshot.
pub const ANN_DELETION_SECRET_NAME: &str =
    "groupsnapshot.storage.kubernetes.io/deletion-secret-name";
/// Annotation (group content) naming that Secret's namespace.
pub const ANN_DELETION_SECRET_NAMESPACE: &str =
    "groupsnapshot.storage.kubernetes.io/deletion-secret-namespace";
/// Finalizer (group content) the controller adds once bound; the sidecar removes it after
/// deletion.
pub const FINALIZER_CONTENT_BOUND: &str =
    "groupsnapshot.storage.kubernetes.io/volumegroupsnapshotcontent-bound-protection";

/// A VolumeGroupSnapshotClass: the driver, the deletion policy and the
/// CreateVolumeGroupSnapshot parameters.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeGroupSnapshotClass {
    /// The object's metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The CSI driver's name.
    #[serde(default)]
    pub driver: String,
    /// `Delete` or `Retain`.
    #[serde(default)]
    pub deletion_policy: String,
    /// The CreateVolumeGroupSnapshot parameters (with the reserved `csi.storage.k8s.io/` keys).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<BTreeMap<String, String>>,
}

/// A VolumeGroupSnapshotContent: a group snapshot on the storage system.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeGroupSnapshotContent {
    /// The object's metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The driver, the source and the binding.
    #[serde(default)]
    pub spec: VolumeGroupSnapshotContentSpec,
    /// What the sidecar observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<VolumeGroupSnapshotContentStatus>,
}

/// The spec of a [`VolumeGroupSnapshotContent`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeGroupSnapshotContentSpec {
    /// The CSI driver's name.
    #[serde(default)]
    pub driver: String,
    /// `Delete` or `Retain`.
    #[serde(default)]
    pub deletion_policy: String,
    /// Exactly one of volumes to snapshot and an existing group snapshot.
    #[serde(default)]
    pub source: VolumeGroupSnapshotContentSource,
    /// The VolumeGroupSnapshot it is (to be) bound to.
    #[serde(default)]
    pub volume_group_snapshot_ref: ObjectReference,
    /// The class it was made with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_group_snapshot_class_name: Option<String>,
}

/// The source of a [`VolumeGroupSnapshotContent`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeGroupSnapshotContentSource {
    /// The CSI volume IDs to snapshot together (dynamic content).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_handles: Option<Vec<String>>,
    /// An existing group snapshot (pre-provisioned content).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_snapshot_handles: Option<GroupSnapshotHandles>,
}

/// The CSI IDs of an existing group snapshot and of its members.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupSnapshotHandles {
    /// The group snapshot's CSI ID.
    #[serde(default)]
    pub volume_group_snapshot_handle: String,
    /// The members' CSI snapshot IDs.
    #[serde(default)]
    pub volume_snapshot_handles: Vec<String>,
}

/// The status of a [`VolumeGroupSnapshotContent`] (written by the sidecar).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeGroupSnapshotContentStatus {
    /// The group snapshot's CSI ID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_group_snapshot_handle: Option<String>,
    /// When the driver cut the group snapshot (RFC 3339, unlike a content's nanoseconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<Time>,
    /// Every member can be used to restore a volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_to_use: Option<bool>,
    /// The last error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<SnapshotError>,
    /// One entry per member: the source volume and its snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_info_list: Option<Vec<VolumeSnapshotInfo>>,
}

/// A member of a group snapshot, as the sidecar reports it; the snapshot-controller copies it
/// into the member's VolumeSnapshotContent status.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotInfo {
    /// The source volume's CSI ID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_handle: Option<String>,
    /// The member snapshot's CSI ID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_handle: Option<String>,
    /// When the driver cut it, in Unix nanoseconds (as a content's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<i64>,
    /// It can be used to restore a volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_to_use: Option<bool>,
    /// The smallest volume a restore needs, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_size: Option<i64>,
}

crd_resource!(
    VolumeGroupSnapshotContent,
    GROUP,
    VERSION,
    "VolumeGroupSnapshotContent",
    "volumegroupsnapshotcontents",
    k8s_openapi::ClusterResourceScope
);
crd_resource!(
    VolumeGroupSnapshotClass,
    GROUP,
    VERSION,
    "VolumeGroupSnapshotClass",
    "volumegroupsnapshotclasses",
    k8s_openapi::ClusterResourceScope
);

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource;
    use serde_json::json;

    #[test]
    fn a_group_content_reads_from_the_wire_and_names_its_api() {
        let wire = json!({
            "apiVersion": "groupsnapshot.storage.k8s.io/v1", "kind": "VolumeGroupSnapshotContent",
            "metadata": {"name": "groupsnapcontent-u", "annotations": {ANN_BEING_CREATED: "yes"}},
            "spec": {
                "driver": "d", "deletionPolicy": "Delete",
                "source": {"volumeHandles": ["vol-1", "vol-2"]},
                "volumeGroupSnapshotRef": {"name": "g", "namespace": "ns", "uid": "u"},
                "volumeGroupSnapshotClassName": "c"
            },
            "status": {"volumeGroupSnapshotHandle": "group-1", "creationTime": "2026-11-29T16:00:00Z",
                       "readyToUse": true,
                       "volumeSnapshotInfoList": [{"volumeHandle": "vol-1", "snapshotHandle": "snap-1",
                                                   "creationTime": 1_700_000_000_123_456_789_i64}]}
        });
        let c: VolumeGroupSnapshotContent = serde_json::from_value(wire).unwrap();
        assert_eq!(
            c.spec.source.volume_handles.as_deref(),
            Some(&["vol-1".to_owned(), "vol-2".to_owned()][..])
        );
        let s = c.status.unwrap();
        assert_eq!(s.volume_group_snapshot_handle.as_deref(), Some("group-1"));
        let members = s.volume_snapshot_info_list.unwrap();
        assert_eq!(members[0].creation_time, Some(1_700_000_000_123_456_789));
        assert_eq!(
            VolumeGroupSnapshotContent::api_version(&()),
            "groupsnapshot.storage.k8s.io/v1"
        );
        assert_eq!(
            VolumeGroupSnapshotClass::plural(&()),
            "volumegroupsnapshotclasses"
        );
    }
}
