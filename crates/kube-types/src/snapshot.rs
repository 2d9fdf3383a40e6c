//! The snapshot API of `snapshot.storage.k8s.io/v1` (the external-snapshotter CRDs, not part of
//! the generated Kubernetes types): VolumeSnapshot, VolumeSnapshotContent and
//! VolumeSnapshotClass, with the fields the sidecars read and write, and the annotation and
//! finalizer names the snapshot-controller, csi-snapshotter and csi-provisioner agree on.
//!
//! Every field is optional on the wire, as the CRDs' schemas allow objects that the
//! controllers then refuse; fields this crate does not know are dropped on decode, so these
//! types are for reading and for building patches, never for a whole-object PUT.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::{Deserialize, Serialize};

/// The API group of the snapshot objects.
pub const GROUP: &str = "snapshot.storage.k8s.io";
/// The API version every controller of v8 uses.
pub const VERSION: &str = "v1";

/// Annotation the sidecar sets on a content before each CreateSnapshot and removes after a
/// success or a final error: while it is there, a create may be in flight.
pub const ANN_BEING_CREATED: &str = "snapshot.storage.kubernetes.io/volumesnapshot-being-created";
/// Annotation the snapshot-controller sets on a content when its bound VolumeSnapshot is being
/// deleted: it licenses the sidecar to act on the content's deletion.
pub const ANN_BEING_DELETED: &str = "snapshot.storage.kubernetes.io/volumesnapshot-being-deleted";
/// Annotation (content) naming the Secret for CreateSnapshot and DeleteSnapshot.
pub const ANN_DELETION_SECRET_NAME: &str = "snapshot.storage.kubernetes.io/deletion-secret-name";
/// Annotation (content) naming that Secret's namespace.
pub const ANN_DELETION_SECRET_NAMESPACE: &str =
    "snapshot.storage.kubernetes.io/deletion-secret-namespace";
/// Annotation (content) an administrator sets to let a restore change the volume mode.
pub const ANN_ALLOW_VOLUME_MODE_CHANGE: &str =
    "snapshot.storage.kubernetes.io/allow-volume-mode-change";
/// Annotation (content) marking a member of a group snapshot: never CreateSnapshot for it.
pub const ANN_GROUP_SNAPSHOT_HANDLE: &str =
    "groupsnapshot.storage.k8s.io/volumeGroupSnapshotHandle";
/// Annotation (class) marking the default class of its driver (value exactly `true`).
pub const ANN_IS_DEFAULT_CLASS: &str = "snapshot.storage.kubernetes.io/is-default-class";
/// Label (content) naming the node whose sidecar handles it (distributed snapshotting).
pub const LABEL_MANAGED_BY: &str = "snapshot.storage.kubernetes.io/managed-by";

/// Finalizer (content) the controller adds once bound; the sidecar removes it after deletion.
pub const FINALIZER_CONTENT_BOUND: &str =
    "snapshot.storage.kubernetes.io/volumesnapshotcontent-bound-protection";
/// Finalizer (snapshot) the controller keeps while the snapshot may be a data source.
pub const FINALIZER_SNAPSHOT_AS_SOURCE: &str =
    "snapshot.storage.kubernetes.io/volumesnapshot-as-source-protection";
/// Finalizer (snapshot) the controller keeps while a bound content with policy Delete exists.
pub const FINALIZER_SNAPSHOT_BOUND: &str =
    "snapshot.storage.kubernetes.io/volumesnapshot-bound-protection";
/// Finalizer (claim) the controller keeps on the source claim of a snapshot not yet ready.
pub const FINALIZER_PVC_AS_SOURCE: &str = "snapshot.storage.kubernetes.io/pvc-as-source-protection";
/// Finalizer (snapshot) csi-provisioner keeps while it restores a volume from the snapshot.
pub const FINALIZER_PROVISIONER_SNAPSHOT_SOURCE: &str =
    "provisioner.storage.kubernetes.io/volumesnapshot-as-source-protection";
/// Finalizer (claim) csi-provisioner keeps on a claim while it is being cloned.
pub const FINALIZER_PROVISIONER_CLONING: &str =
    "provisioner.storage.kubernetes.io/cloning-protection";

/// The error a controller records in a status.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotError {
    /// When it happened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<Time>,
    /// What happened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// A VolumeSnapshotClass: the driver, the deletion policy and the CreateSnapshot parameters.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotClass {
    /// The object's metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The CSI driver's name.
    #[serde(default)]
    pub driver: String,
    /// `Delete` or `Retain`.
    #[serde(default)]
    pub deletion_policy: String,
    /// The CreateSnapshot parameters (with the reserved `csi.storage.k8s.io/` keys).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<BTreeMap<String, String>>,
}

/// A VolumeSnapshot: a user's request for a snapshot, or its binding to a pre-made content.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeSnapshot {
    /// The object's metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// What to snapshot, and with which class.
    #[serde(default)]
    pub spec: VolumeSnapshotSpec,
    /// What the controller observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<VolumeSnapshotStatus>,
}

/// The spec of a [`VolumeSnapshot`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotSpec {
    /// Exactly one of a claim to snapshot and a pre-made content.
    #[serde(default)]
    pub source: VolumeSnapshotSource,
    /// The class (the driver's default class when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_class_name: Option<String>,
}

/// The source of a [`VolumeSnapshot`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotSource {
    /// A claim in the snapshot's namespace (dynamic snapshot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim_name: Option<String>,
    /// A pre-made content (static snapshot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_content_name: Option<String>,
}

/// The status of a [`VolumeSnapshot`] (written by the snapshot-controller).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotStatus {
    /// The content it is bound to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_volume_snapshot_content_name: Option<String>,
    /// When the driver cut the snapshot (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<Time>,
    /// The snapshot can be used to restore a volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_to_use: Option<bool>,
    /// The smallest volume a restore needs, as a quantity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_size: Option<k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    /// The last error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<SnapshotError>,
    /// The group snapshot it belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_group_snapshot_name: Option<String>,
}

/// A VolumeSnapshotContent: a snapshot on the storage system.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeSnapshotContent {
    /// The object's metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The driver, the source and the binding.
    #[serde(default)]
    pub spec: VolumeSnapshotContentSpec,
    /// What the sidecar observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<VolumeSnapshotContentStatus>,
}

/// The spec of a [`VolumeSnapshotContent`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotContentSpec {
    /// The CSI driver's name.
    #[serde(default)]
    pub driver: String,
    /// `Delete` or `Retain`.
    #[serde(default)]
    pub deletion_policy: String,
    /// Exactly one of a volume to snapshot and an existing snapshot.
    #[serde(default)]
    pub source: VolumeSnapshotContentSource,
    /// The VolumeSnapshot it is (to be) bound to.
    #[serde(default)]
    pub volume_snapshot_ref: ObjectReference,
    /// The class it was made with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_class_name: Option<String>,
    /// The source volume's mode (`Filesystem` or `Block`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_volume_mode: Option<String>,
}

/// The source of a [`VolumeSnapshotContent`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotContentSource {
    /// The CSI volume ID to snapshot (dynamic content).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_handle: Option<String>,
    /// The CSI snapshot ID of an existing snapshot (pre-provisioned content).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_handle: Option<String>,
}

/// The status of a [`VolumeSnapshotContent`] (written by the sidecar).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotContentStatus {
    /// The CSI snapshot ID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_handle: Option<String>,
    /// When the driver cut the snapshot, in Unix nanoseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<i64>,
    /// The snapshot can be used to restore a volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_to_use: Option<bool>,
    /// The smallest volume a restore needs, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_size: Option<i64>,
    /// The last error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<SnapshotError>,
    /// The group snapshot's CSI ID, for a member of a group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_group_snapshot_handle: Option<String>,
}

crd_resource!(
    VolumeSnapshot,
    GROUP,
    VERSION,
    "VolumeSnapshot",
    "volumesnapshots",
    k8s_openapi::NamespaceResourceScope
);
crd_resource!(
    VolumeSnapshotContent,
    GROUP,
    VERSION,
    "VolumeSnapshotContent",
    "volumesnapshotcontents",
    k8s_openapi::ClusterResourceScope
);
crd_resource!(
    VolumeSnapshotClass,
    GROUP,
    VERSION,
    "VolumeSnapshotClass",
    "volumesnapshotclasses",
    k8s_openapi::ClusterResourceScope
);

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource;
    use serde_json::json;

    #[test]
    fn a_content_reads_from_the_wire_and_names_its_api() {
        let wire = json!({
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotContent",
            "metadata": {"name": "snapcontent-u", "annotations": {ANN_BEING_CREATED: "yes"}},
            "spec": {
                "driver": "d", "deletionPolicy": "Delete",
                "source": {"volumeHandle": "vol-1"},
                "volumeSnapshotRef": {"name": "s", "namespace": "ns", "uid": "u"},
                "volumeSnapshotClassName": "c", "sourceVolumeMode": "Filesystem",
                "unknownField": 1
            },
            "status": {"snapshotHandle": "snap-1", "creationTime": 1_700_000_000_123_456_789_i64,
                       "readyToUse": true, "restoreSize": 1024}
        });
        let c: VolumeSnapshotContent = serde_json::from_value(wire).unwrap();
        assert_eq!(c.spec.source.volume_handle.as_deref(), Some("vol-1"));
        assert_eq!(c.spec.volume_snapshot_ref.uid.as_deref(), Some("u"));
        let s = c.status.unwrap();
        assert_eq!(s.creation_time, Some(1_700_000_000_123_456_789));
        assert_eq!(s.restore_size, Some(1024));
        assert_eq!(
            VolumeSnapshotContent::api_version(&()),
            "snapshot.storage.k8s.io/v1"
        );
        assert_eq!(VolumeSnapshot::plural(&()), "volumesnapshots");
    }

    #[test]
    fn a_snapshot_writes_only_what_it_has() {
        let s = VolumeSnapshot {
            metadata: ObjectMeta {
                name: Some("s".into()),
                ..ObjectMeta::default()
            },
            spec: VolumeSnapshotSpec {
                source: VolumeSnapshotSource {
                    persistent_volume_claim_name: Some("data".into()),
                    ..VolumeSnapshotSource::default()
                },
                volume_snapshot_class_name: Some("c".into()),
            },
            status: None,
        };
        assert_eq!(
            serde_json::to_value(&s).unwrap(),
            json!({"metadata": {"name": "s"},
                   "spec": {"source": {"persistentVolumeClaimName": "data"},
                            "volumeSnapshotClassName": "c"}})
        );
    }
}
