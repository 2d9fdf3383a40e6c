//! What the watch caches keep of VolumeAttachments and PersistentVolumes: only what the
//! decisions read, as compact JSON.
//!
//! A cluster has one VolumeAttachment per attached volume and one PersistentVolume per volume,
//! and the attacher caches every one of both. k8s-openapi's types keep every volume source
//! inline: a `PersistentVolume` is about 3.4 KiB and a `VolumeAttachment` (whose
//! `inlineVolumeSpec` is a whole PV spec) about 3.5 KiB before a single string, nearly all of
//! it `None`. The kit's [`Compact`] keeps an object's identity as boxed strings and the rest,
//! trimmed to what the decisions read ([`Va`], [`Pv`]), as JSON without the `None`s: a few
//! hundred bytes, in the kit's compact store keyed by itself.
//!
//! Writes never come from these copies: the attacher changes objects by patches that name
//! only what they change.

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume};
use k8s_openapi::api::storage::v1::VolumeAttachment;
pub use plugreg_sidecar_kit::compact::{Compact, Decoded};
use plugreg_sidecar_kit::compact::{Trim, trim_meta};
use plugreg_sidecar_kit::migration;

use crate::decide;

/// What the attacher keeps of a VolumeAttachment: of the metadata the identity, finalizers,
/// deletion time and the node-ID annotation; spec and status whole (they are small unless a
/// migrated in-line volume is attached).
#[derive(Debug)]
pub enum Va {}

impl Trim for Va {
    type Object = VolumeAttachment;
    fn trim(va: &mut VolumeAttachment) {
        trim_meta(&mut va.metadata, &[decide::NODE_ID_ANNOTATION], true);
    }
}

/// What the attacher keeps of a PersistentVolume: of the metadata the identity, finalizers,
/// deletion time and the migration annotation; no status; of the spec what a publish reads
/// (the CSI source, access modes, volume mode, mount options) and the in-tree sources (whose
/// presence decides). An in-tree PV keeps what its translation reads too: the zone labels
/// (a GCE PD handle), the Azure File resource group and Portworx secret annotations, and the
/// claim's namespace (an Azure File secret's).
#[derive(Debug)]
pub enum Pv {}

/// The PV annotations the translation of an in-tree PV reads, with the migration annotation.
const TRANSLATION_ANNOTATIONS: [&str; 4] = [
    decide::MIGRATED_TO_ANNOTATION,
    migration::TRANSLATION_ANNOTATIONS[0],
    migration::TRANSLATION_ANNOTATIONS[1],
    migration::TRANSLATION_ANNOTATIONS[2],
];

impl Trim for Pv {
    type Object = PersistentVolume;
    fn trim(pv: &mut PersistentVolume) {
        let in_tree = pv.spec.as_ref().is_some_and(decide::in_tree);
        if !in_tree {
            trim_meta(&mut pv.metadata, &[decide::MIGRATED_TO_ANNOTATION], true);
        } else {
            let labels = migration::translation_labels(pv.metadata.labels.take());
            trim_meta(&mut pv.metadata, &TRANSLATION_ANNOTATIONS, true);
            pv.metadata.labels = labels;
        }
        pv.status = None;
        if let Some(spec) = pv.spec.as_mut() {
            spec.capacity = None;
            spec.claim_ref = spec
                .claim_ref
                .take()
                .filter(|_| in_tree)
                .map(|c| ObjectReference {
                    namespace: c.namespace,
                    ..ObjectReference::default()
                });
            spec.node_affinity = None;
            spec.storage_class_name = None;
            spec.persistent_volume_reclaim_policy = None;
            spec.volume_attributes_class_name = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn va_wire() -> Value {
        json!({
            "apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment",
            "metadata": {"name": "va-1", "uid": "u", "resourceVersion": "42", "generation": 1,
                "creationTimestamp": "2026-11-26T02:00:00Z", "labels": {"a": "b"},
                "finalizers": ["external-attacher/d", "other"],
                "deletionTimestamp": "2026-11-26T02:01:00Z",
                "annotations": {decide::NODE_ID_ANNOTATION: "node-1", "x": "y"},
                "managedFields": [{"manager": "kcm", "operation": "Update"}]},
            "spec": {"attacher": "d", "nodeName": "n", "source": {"persistentVolumeName": "pv-1"}},
            "status": {"attached": true, "attachmentMetadata": {"k": "v"},
                "attachError": {"message": "m", "time": "2026-11-26T02:00:30Z", "errorCode": 8},
                "detachError": {"message": "d"}},
        })
    }

    #[test]
    fn a_volume_attachment_keeps_what_decides() {
        let c: Compact<Va> = serde_json::from_value(va_wire()).unwrap();
        assert_eq!(c.name(), "va-1");
        assert_eq!(c.resource_version(), Some("42"));
        let va = c.object();
        let full: VolumeAttachment = serde_json::from_value(va_wire()).unwrap();
        assert_eq!(va.spec, full.spec);
        assert_eq!(va.status, full.status);
        assert_eq!(va.metadata.name, full.metadata.name);
        assert_eq!(va.metadata.resource_version, full.metadata.resource_version);
        assert_eq!(va.metadata.finalizers, full.metadata.finalizers);
        assert_eq!(
            va.metadata.deletion_timestamp,
            full.metadata.deletion_timestamp
        );
        assert_eq!(
            va.metadata.annotations,
            Some([(decide::NODE_ID_ANNOTATION.to_owned(), "node-1".to_owned())].into())
        );
        assert_eq!(va.metadata.uid, full.metadata.uid);
        assert_eq!(
            (&va.metadata.labels, &va.metadata.managed_fields),
            (&None, &None)
        );
        // What the decisions read of it is the same as of the full object.
        assert_eq!(decide::sync_fingerprint(&va), {
            let mut f = full.clone();
            f.metadata = va.metadata.clone();
            decide::sync_fingerprint(&f)
        });
        // Both errors, metadata and finalizers: still a ninth of the typed object.
        assert!(c.rest_len() < 450, "{}", c.rest_len());
    }

    #[test]
    fn a_persistent_volume_keeps_what_decides() {
        let wire = json!({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": "pv-1", "resourceVersion": "7", "uid": "u", "finalizers": ["f"],
                "annotations": {decide::MIGRATED_TO_ANNOTATION: "d", "pv.kubernetes.io/provisioned-by": "d"}},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain", "volumeMode": "Filesystem",
                "mountOptions": ["ro"], "claimRef": {"name": "c", "namespace": "n"},
                "csi": {"driver": "d", "volumeHandle": "vol-1", "fsType": "xfs", "readOnly": true,
                    "volumeAttributes": {"a": "b"},
                    "controllerPublishSecretRef": {"name": "s", "namespace": "ns"}}},
            "status": {"phase": "Bound"},
        });
        let c: Compact<Pv> = serde_json::from_value(wire.clone()).unwrap();
        let pv = c.object();
        let full: PersistentVolume = serde_json::from_value(wire).unwrap();
        let (spec, fspec) = (pv.spec.as_ref().unwrap(), full.spec.as_ref().unwrap());
        assert_eq!(spec.csi, fspec.csi);
        assert_eq!(spec.access_modes, fspec.access_modes);
        assert_eq!(spec.volume_mode, fspec.volume_mode);
        assert_eq!(spec.mount_options, fspec.mount_options);
        assert_eq!((&spec.capacity, &spec.claim_ref), (&None, &None));
        assert_eq!(pv.status, None);
        assert_eq!(pv.metadata.finalizers, full.metadata.finalizers);
        assert_eq!(pv.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(
            pv.metadata.annotations,
            Some([(decide::MIGRATED_TO_ANNOTATION.to_owned(), "d".to_owned())].into())
        );
        let size = |n: usize| n + std::mem::size_of::<Compact<Pv>>();
        assert!(
            size(c.rest_len()) * 4 < std::mem::size_of::<PersistentVolume>(),
            "{}",
            c.rest_len()
        );
    }

    #[test]
    fn an_in_line_volume_and_an_in_tree_pv_survive() {
        let mut w = va_wire();
        w["spec"]["source"] = json!({"inlineVolumeSpec": {"accessModes": ["ReadWriteOnce"],
            "csi": {"driver": "d", "volumeHandle": "h"}}});
        let c: Compact<Va> = serde_json::from_value(w.clone()).unwrap();
        let full: VolumeAttachment = serde_json::from_value(w).unwrap();
        assert_eq!(c.object().spec, full.spec);
        let pv = json!({"metadata": {"name": "p"},
            "spec": {"gcePersistentDisk": {"pdName": "disk"}}});
        let c: Compact<Pv> = serde_json::from_value(pv).unwrap();
        assert!(decide::in_tree(c.object().spec.as_ref().unwrap()));
    }

    /// An in-tree PV translates from the cache as from the full object.
    #[test]
    fn an_in_tree_pv_keeps_what_its_translation_reads() {
        let wires = [
            json!({"metadata": {"name": "p", "labels": {"topology.kubernetes.io/zone": "us-central1-a", "x": "y"}},
                "spec": {"gcePersistentDisk": {"pdName": "disk"}, "accessModes": ["ReadWriteMany"],
                    "claimRef": {"name": "c", "namespace": "n"}}}),
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
            let cached =
                plugreg_sidecar_kit::migration::translate_in_tree_pv_to_csi(&c.object()).unwrap();
            let full = plugreg_sidecar_kit::migration::translate_in_tree_pv_to_csi(&full).unwrap();
            let (cached, full) = (cached.spec.unwrap(), full.spec.unwrap());
            assert_eq!(cached.csi, full.csi);
            assert_eq!(cached.access_modes, full.access_modes);
        }
    }

    /// `null` metadata and missing fields read as the full type reads them.
    #[test]
    fn reads_nulls_as_the_full_type_does() {
        let w = json!({"metadata": null, "spec": {"attacher": "d", "nodeName": null,
            "source": {}}});
        let c: Compact<Va> = serde_json::from_value(w.clone()).unwrap();
        let full: VolumeAttachment = serde_json::from_value(w).unwrap();
        assert_eq!(c.object(), full);
    }
}
