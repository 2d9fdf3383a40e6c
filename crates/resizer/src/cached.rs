//! What the watch caches keep of claims, PersistentVolumes and Pods: only what the decisions
//! read, as compact JSON.
//!
//! A cluster has as many claims and PVs as it has volumes, and the resizer reads one of them
//! only when it changes. Typed, a k8s-openapi `PersistentVolume` is about 3.4 KiB before a
//! single string (every volume source inline), a claim with its conditions some 3 KiB of heap
//! (`BTreeMap` nodes of one or two entries, `None` fields), and the objects the API server
//! returns for our own patches carry their managed fields on top (a `serde_json::Value` tree
//! per field manager, which grows with every status patch). The kit's [`Compact`] keeps an
//! object's identity as boxed strings (what the store and the controller's freshness check
//! need) and the rest, trimmed by [`Claim`] and [`Pv`], as one JSON string: a few hundred bytes. A sync
//! decodes it again ([`Compact::object`]), microseconds against the writes it then makes.
//!
//! Writes never come from these copies' missing parts: every claim write is a merge patch of
//! the fields it sets (the conditions, which a patch replaces whole, are kept), every PV write
//! a merge patch too.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, PersistentVolumeSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use plugreg_sidecar_kit::compact::trim_meta;
pub use plugreg_sidecar_kit::compact::{Compact, Decoded, Trim};
use plugreg_sidecar_kit::core_v1_resource;
use plugreg_sidecar_kit::migration;
use serde::Deserialize;

use crate::kube as k;

/// What the resizer keeps of a claim: spec and status whole (the conditions are rewritten
/// whole by every status patch; the rest is small) and of its metadata only the identity and
/// the annotation the decisions read (who resizes a migrated claim).
#[derive(Debug)]
pub enum Claim {}

impl Trim for Claim {
    type Object = PersistentVolumeClaim;
    fn trim(c: &mut PersistentVolumeClaim) {
        trim_meta(&mut c.metadata, &[k::ANN_STORAGE_RESIZER], false);
    }
}

/// What the resizer keeps of a PV: what the expand and modify requests and the ownership
/// check read: capacity, CSI source (without its volume attributes and other secrets), claim
/// reference, access modes, volume mode, mount options, and the pre-resize and modify-secret
/// annotations. An in-tree PV keeps its source and what its CSI-migration translation reads
/// (the zone labels, the Azure File resource group and Portworx secret annotations).
#[derive(Debug)]
pub enum Pv {}

/// The annotations every PV keeps.
const PV_ANNOTATIONS: [&str; 3] = [
    k::ANN_PRE_RESIZE_CAPACITY,
    k::ANN_MODIFY_SECRET_NAME,
    k::ANN_MODIFY_SECRET_NAMESPACE,
];

/// The annotations an in-tree PV keeps: every PV's and what its translation reads.
const IN_TREE_PV_ANNOTATIONS: [&str; 6] = [
    PV_ANNOTATIONS[0],
    PV_ANNOTATIONS[1],
    PV_ANNOTATIONS[2],
    migration::TRANSLATION_ANNOTATIONS[0],
    migration::TRANSLATION_ANNOTATIONS[1],
    migration::TRANSLATION_ANNOTATIONS[2],
];

impl Trim for Pv {
    type Object = PersistentVolume;
    fn trim(pv: &mut PersistentVolume) {
        let in_tree = pv
            .spec
            .as_ref()
            .and_then(migration::in_tree_plugin_of_pv)
            .is_some();
        if in_tree {
            let labels = migration::translation_labels(pv.metadata.labels.take());
            trim_meta(&mut pv.metadata, &IN_TREE_PV_ANNOTATIONS, false);
            pv.metadata.labels = labels;
        } else {
            trim_meta(&mut pv.metadata, &PV_ANNOTATIONS, false);
        }
        if let Some(s) = pv.spec.take() {
            let csi = s.csi.map(|mut c| {
                c.volume_attributes = None;
                c.node_publish_secret_ref = None;
                c.node_stage_secret_ref = None;
                c.controller_publish_secret_ref = None;
                c.node_expand_secret_ref = None;
                c
            });
            let claim_ref = s
                .claim_ref
                .map(|r| k8s_openapi::api::core::v1::ObjectReference {
                    namespace: r.namespace,
                    name: r.name,
                    uid: r.uid,
                    ..Default::default()
                });
            pv.spec = Some(PersistentVolumeSpec {
                capacity: s.capacity,
                csi,
                claim_ref,
                access_modes: s.access_modes,
                volume_mode: s.volume_mode,
                mount_options: s.mount_options,
                volume_attributes_class_name: s.volume_attributes_class_name,
                aws_elastic_block_store: s.aws_elastic_block_store,
                gce_persistent_disk: s.gce_persistent_disk,
                azure_disk: s.azure_disk,
                azure_file: s.azure_file,
                cinder: s.cinder,
                vsphere_volume: s.vsphere_volume,
                portworx_volume: s.portworx_volume,
                ..Default::default()
            });
        }
        pv.status = None;
    }
}

/// A pod as the in-use check reads it: its namespace, the claims its volumes name, and
/// whether it has ended. Decoded straight from the wire by a type of its own, so that neither
/// the heap nor the binary carries k8s-openapi's whole `PodSpec` (containers, probes, every
/// volume source) for three fields.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodUse {
    /// Name, namespace and resourceVersion only.
    pub metadata: ObjectMeta,
    /// The claims its volumes name.
    pub claims: Vec<String>,
    /// Its phase is `Succeeded` or `Failed`.
    pub ended: bool,
}

#[derive(Deserialize)]
struct WirePod {
    #[serde(default)]
    metadata: Option<ObjectMeta>,
    #[serde(default)]
    spec: Option<WirePodSpec>,
    #[serde(default)]
    status: Option<WirePodStatus>,
}

#[derive(Deserialize)]
struct WirePodSpec {
    #[serde(default)]
    volumes: Option<Vec<WireVolume>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireVolume {
    #[serde(default)]
    persistent_volume_claim: Option<WireClaimSource>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireClaimSource {
    #[serde(default)]
    claim_name: Option<String>,
}

#[derive(Deserialize)]
struct WirePodStatus {
    #[serde(default)]
    phase: Option<String>,
}

impl<'de> Deserialize<'de> for PodUse {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let WirePod {
            metadata,
            spec,
            status,
        } = WirePod::deserialize(d)?;
        let mut m = metadata.unwrap_or_default();
        let claims = spec
            .and_then(|s| s.volumes)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|v| v.persistent_volume_claim?.claim_name)
            .collect();
        let phase = status.and_then(|s| s.phase);
        Ok(PodUse {
            metadata: ObjectMeta {
                name: m.name.take(),
                namespace: m.namespace.take(),
                resource_version: m.resource_version.take(),
                ..ObjectMeta::default()
            },
            claims,
            ended: matches!(phase.as_deref(), Some("Succeeded" | "Failed")),
        })
    }
}

core_v1_resource!(PodUse, k8s_openapi::NamespaceResourceScope, "Pod", "pods");

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt;
    use serde_json::json;

    #[test]
    fn a_claim_reads_back_with_what_the_decisions_read() {
        let wire = json!({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {
                "name": "data", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                "labels": {"app": "x"}, "finalizers": ["kubernetes.io/pvc-protection"],
                "annotations": {k::ANN_STORAGE_RESIZER: "d", "pv.kubernetes.io/bind-completed": "yes"},
                "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                    "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:phase": {}}}}],
            },
            "spec": {"storageClassName": "fast", "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "2Gi"}}, "volumeName": "pv-1",
                "volumeAttributesClassName": "gold"},
            "status": {"phase": "Bound", "capacity": {"storage": "1Gi"},
                "allocatedResources": {"storage": "2Gi"},
                "allocatedResourceStatuses": {"storage": "ControllerResizeInProgress"},
                "conditions": [{"type": "Resizing", "status": "True",
                    "lastTransitionTime": "2026-11-25T10:00:00Z"}],
                "currentVolumeAttributesClassName": "silver",
                "modifyVolumeStatus": {"status": "InProgress", "targetVolumeAttributesClassName": "gold"}},
        });
        let full: PersistentVolumeClaim = serde_json::from_value(wire.clone()).unwrap();
        let cached: Compact<Claim> = serde_json::from_value(wire).unwrap();
        assert_eq!(cached.resource_version(), Some("7"));
        let got = cached.object();
        assert_eq!(got.name_any(), "data");
        assert_eq!(got.namespace().as_deref(), Some("ns"));
        assert_eq!(got.uid().as_deref(), Some("u"));
        assert_eq!(got.labels().len(), 0);
        assert_eq!(got.finalizers().len(), 0);
        assert!(got.metadata.managed_fields.is_none());
        assert_eq!(
            got.annotations().keys().collect::<Vec<_>>(),
            [k::ANN_STORAGE_RESIZER]
        );
        assert_eq!(got.spec, full.spec);
        assert_eq!(got.status, full.status);
        assert_eq!(k::claim_view(&got), k::claim_view(&full));
        assert_eq!(k::modify_view(&got), k::modify_view(&full));
        assert!(cached.rest_len() < 800, "{}", cached.rest_len());
    }

    /// An in-tree PV translates from the cache as from the full object (CSI migration).
    #[test]
    fn an_in_tree_volume_keeps_what_its_translation_reads() {
        let wires = [
            json!({"metadata": {"name": "p", "labels": {"topology.kubernetes.io/zone": "us-central1-a", "x": "y"}},
                "spec": {"gcePersistentDisk": {"pdName": "disk"}, "accessModes": ["ReadWriteMany"],
                    "capacity": {"storage": "1Gi"}, "claimRef": {"name": "c", "namespace": "n"}}}),
            json!({"metadata": {"name": "p", "annotations": {"kubernetes.io/azure-file-resource-group": "rg"}},
                "spec": {"azureFile": {"secretName": "s", "shareName": "sh"},
                    "claimRef": {"name": "c", "namespace": "n", "uid": "u"}}}),
            json!({"metadata": {"name": "p", "annotations": {"openstorage.io/auth-secret-name": "s",
                    "openstorage.io/auth-secret-namespace": "n"}},
                "spec": {"portworxVolume": {"volumeID": "px"}}}),
        ];
        for wire in wires {
            let c: Compact<Pv> = serde_json::from_value(wire.clone()).unwrap();
            let full: PersistentVolume = serde_json::from_value(wire).unwrap();
            let translate = plugreg_sidecar_kit::migration::translate_in_tree_pv_to_csi;
            let (cached, full) = (translate(&c.object()).unwrap(), translate(&full).unwrap());
            let (cached, full) = (cached.spec.unwrap(), full.spec.unwrap());
            assert_eq!(cached.csi, full.csi);
            assert_eq!(cached.access_modes, full.access_modes);
        }
    }

    #[test]
    fn a_volume_keeps_what_the_requests_read_and_is_small() {
        let wire = json!({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": "pv-1", "uid": "u", "resourceVersion": "9", "labels": {"a": "b"},
                "annotations": {k::ANN_MODIFY_SECRET_NAME: "s", k::ANN_MODIFY_SECRET_NAMESPACE: "n",
                    k::ANN_PRE_RESIZE_CAPACITY: "1Gi", "pv.kubernetes.io/provisioned-by": "d"},
                "finalizers": ["kubernetes.io/pv-protection"]},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Delete", "storageClassName": "fast",
                "volumeMode": "Block", "mountOptions": ["ro"],
                "claimRef": {"kind": "PersistentVolumeClaim", "namespace": "ns", "name": "data",
                    "uid": "cu", "resourceVersion": "3", "apiVersion": "v1"},
                "nodeAffinity": {"required": {"nodeSelectorTerms": []}},
                "csi": {"driver": "d", "volumeHandle": "h", "fsType": "ext4",
                    "volumeAttributes": {"a": "b"},
                    "controllerExpandSecretRef": {"name": "x", "namespace": "y"},
                    "nodeStageSecretRef": {"name": "x", "namespace": "y"}}},
            "status": {"phase": "Bound"},
        });
        let full: PersistentVolume = serde_json::from_value(wire.clone()).unwrap();
        let cached: Compact<Pv> = serde_json::from_value(wire).unwrap();
        let got = cached.object();
        assert_eq!(got.name_any(), "pv-1");
        assert_eq!(k::pv_capacity(&got), k::pv_capacity(&full));
        assert_eq!(got.annotations().len(), 3);
        let (s, f) = (got.spec.unwrap(), full.spec.unwrap());
        let (csi, fcsi) = (s.csi.unwrap(), f.csi.unwrap());
        assert_eq!(
            (&csi.driver, &csi.volume_handle, &csi.fs_type),
            (&fcsi.driver, &fcsi.volume_handle, &fcsi.fs_type)
        );
        assert_eq!(
            csi.controller_expand_secret_ref,
            fcsi.controller_expand_secret_ref
        );
        assert_eq!(csi.volume_attributes, None);
        assert_eq!(csi.node_stage_secret_ref, None);
        let (r, fr) = (s.claim_ref.unwrap(), f.claim_ref.unwrap());
        assert_eq!((&r.namespace, &r.uid), (&fr.namespace, &fr.uid));
        assert_eq!(s.access_modes, f.access_modes);
        assert_eq!(s.volume_mode, f.volume_mode);
        assert_eq!(s.mount_options, f.mount_options);
        assert!(s.node_affinity.is_none());
        assert!(cached.rest_len() < 640, "{}", cached.rest_len());
        assert!(std::mem::size_of::<Compact<Pv>>() * 4 < std::mem::size_of::<PersistentVolume>());
    }

    #[test]
    fn a_pod_keeps_its_claims_and_whether_it_ended() {
        let wire = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "labels": {"a": "b"}, "resourceVersion": "3"},
            "spec": {"containers": [{"name": "c", "image": "i"}], "nodeName": "n",
                "volumes": [{"name": "a", "persistentVolumeClaim": {"claimName": "data"}},
                    {"name": "b", "emptyDir": {}}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1"},
        });
        let got: PodUse = serde_json::from_value(wire).unwrap();
        assert_eq!(got.namespace().as_deref(), Some("ns"));
        assert_eq!(got.resource_version().as_deref(), Some("3"));
        assert_eq!(got.metadata.labels, None);
        assert_eq!(got.claims, ["data"]);
        assert!(!got.ended);
        let done: PodUse = serde_json::from_value(json!({"metadata": {"name": "q"},
            "spec": {"volumes": null}, "status": {"phase": "Succeeded"}}))
        .unwrap();
        assert!(done.claims.is_empty());
        assert!(done.ended);
        // As the full type reads it: null metadata is the default.
        let bare: PodUse = serde_json::from_value(json!({"metadata": null})).unwrap();
        assert_eq!(bare, PodUse::default());
    }
}
