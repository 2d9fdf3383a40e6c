//! What the watch caches keep of VolumeAttachments and PersistentVolumes: only what the
//! decisions read, as compact JSON.
//!
//! A cluster has one VolumeAttachment per attached volume and one PersistentVolume per volume,
//! and the attacher caches every one of both. k8s-openapi's types keep every volume source
//! inline: a `PersistentVolume` is about 3.4 KiB and a `VolumeAttachment` (whose
//! `inlineVolumeSpec` is a whole PV spec) about 3.5 KiB before a single string, nearly all of
//! it `None`. [`Compact`] keeps an object's name and resource version typed (what the cache
//! and the watch need) and the rest, trimmed to what the decisions read ([`Trim`]), as JSON
//! without the `None`s: a few hundred bytes. A sync decodes it again ([`Compact::full`]),
//! microseconds against the API writes and the driver call it then makes.
//!
//! Each object of a list or watch event is decoded whole, trimmed and encoded before the next
//! one is read, so a list page never holds more than one full object at a time.
//!
//! Writes never come from these copies: the attacher changes objects by patches that name
//! only what they change.

use std::borrow::Cow;
use std::marker::PhantomData;

use k8s_openapi::api::core::v1::PersistentVolume;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::decide;

/// An object that can be kept compact: what of it the decisions read.
pub trait Trim: Resource<DynamicType = ()> + serde::Serialize + DeserializeOwned + Default {
    /// Drops every field no decision reads (the name and resource version stay).
    fn trim(&mut self);
}

impl Trim for VolumeAttachment {
    /// Of the metadata the identity, finalizers, deletion time and the node-ID annotation;
    /// spec and status whole (they are small unless a migrated in-line volume is attached).
    fn trim(&mut self) {
        trim_meta(&mut self.metadata, decide::NODE_ID_ANNOTATION);
    }
}

impl Trim for PersistentVolume {
    /// Of the metadata the identity, finalizers, deletion time and the migration annotation;
    /// no status; of the spec what a publish reads (the CSI source, access modes, volume
    /// mode, mount options) and the in-tree sources (whose presence decides).
    fn trim(&mut self) {
        trim_meta(&mut self.metadata, decide::MIGRATED_TO_ANNOTATION);
        self.status = None;
        if let Some(spec) = self.spec.as_mut() {
            spec.capacity = None;
            spec.claim_ref = None;
            spec.node_affinity = None;
            spec.storage_class_name = None;
            spec.persistent_volume_reclaim_policy = None;
            spec.volume_attributes_class_name = None;
        }
    }
}

/// Keeps of `m` the name, resource version, finalizers, deletion time and the annotation
/// `annotation`.
fn trim_meta(m: &mut ObjectMeta, annotation: &str) {
    let annotations = m
        .annotations
        .take()
        .and_then(|mut a| a.remove_entry(annotation))
        .map(|(k, v)| [(k, v)].into());
    *m = ObjectMeta {
        name: m.name.take(),
        resource_version: m.resource_version.take(),
        finalizers: m.finalizers.take(),
        deletion_timestamp: m.deletion_timestamp.take(),
        annotations,
        ..ObjectMeta::default()
    };
}

/// An object as cached: its name and resource version typed, the rest trimmed ([`Trim`]) and
/// JSON-encoded (see the module docs).
#[derive(Debug)]
pub struct Compact<K> {
    /// Name and resourceVersion only.
    metadata: ObjectMeta,
    /// The trimmed rest, JSON without `apiVersion` and `kind`.
    rest: Box<str>,
    kind: PhantomData<fn() -> K>,
}

impl<K> Clone for Compact<K> {
    fn clone(&self) -> Self {
        Self {
            metadata: self.metadata.clone(),
            rest: self.rest.clone(),
            kind: PhantomData,
        }
    }
}

impl<K: Trim> Compact<K> {
    /// The cached form of `obj`.
    pub fn new(mut obj: K) -> Self {
        obj.trim();
        let m = obj.meta_mut();
        let metadata = ObjectMeta {
            name: m.name.take(),
            resource_version: m.resource_version.take(),
            ..ObjectMeta::default()
        };
        // Serialising k8s-openapi types cannot fail (no maps with non-string keys).
        let mut rest = serde_json::to_value(&obj).unwrap_or_default();
        if let Value::Object(o) = &mut rest {
            o.remove("apiVersion");
            o.remove("kind");
            if o.get("metadata")
                .is_some_and(|m| m.as_object().is_some_and(|m| m.is_empty()))
            {
                o.remove("metadata");
            }
        }
        Self {
            metadata,
            rest: rest.to_string().into_boxed_str(),
            kind: PhantomData,
        }
    }

    /// The object as the decisions read it (trimmed, see [`Trim`]).
    pub fn full(&self) -> K {
        // Written by `new` from the same type: it decodes.
        let mut obj: K = serde_json::from_str(&self.rest).unwrap_or_default();
        let m = obj.meta_mut();
        m.name.clone_from(&self.metadata.name);
        m.resource_version
            .clone_from(&self.metadata.resource_version);
        obj
    }

    /// The bytes the rest of the object takes (for tests and sizing).
    pub fn rest_len(&self) -> usize {
        self.rest.len()
    }
}

impl<'de, K: Trim> Deserialize<'de> for Compact<K> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        K::deserialize(d).map(Compact::new)
    }
}

impl<K: Resource<DynamicType = ()>> Resource for Compact<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(_: &()) -> Cow<'_, str> {
        K::kind(&())
    }
    fn group(_: &()) -> Cow<'_, str> {
        K::group(&())
    }
    fn version(_: &()) -> Cow<'_, str> {
        K::version(&())
    }
    fn api_version(_: &()) -> Cow<'_, str> {
        K::api_version(&())
    }
    fn plural(_: &()) -> Cow<'_, str> {
        K::plural(&())
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt;
    use serde_json::json;

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
        let c: Compact<VolumeAttachment> = serde_json::from_value(va_wire()).unwrap();
        assert_eq!(c.name_any(), "va-1");
        assert_eq!(c.resource_version().as_deref(), Some("42"));
        let va = c.full();
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
        assert_eq!(
            (
                &va.metadata.labels,
                &va.metadata.uid,
                &va.metadata.managed_fields
            ),
            (&None, &None, &None)
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
        let c: Compact<PersistentVolume> = serde_json::from_value(wire.clone()).unwrap();
        let pv = c.full();
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
        let size = |n: usize| n + std::mem::size_of::<Compact<PersistentVolume>>();
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
        let c: Compact<VolumeAttachment> = serde_json::from_value(w.clone()).unwrap();
        let full: VolumeAttachment = serde_json::from_value(w).unwrap();
        assert_eq!(c.full().spec, full.spec);
        let pv = json!({"metadata": {"name": "p"},
            "spec": {"gcePersistentDisk": {"pdName": "disk"}}});
        let c: Compact<PersistentVolume> = serde_json::from_value(pv).unwrap();
        assert!(decide::in_tree(c.full().spec.as_ref().unwrap()));
    }

    /// `null` metadata and missing fields read as the full type reads them.
    #[test]
    fn reads_nulls_as_the_full_type_does() {
        let w = json!({"metadata": null, "spec": {"attacher": "d", "nodeName": null,
            "source": {}}});
        let c: Compact<VolumeAttachment> = serde_json::from_value(w.clone()).unwrap();
        let full: VolumeAttachment = serde_json::from_value(w).unwrap();
        assert_eq!(c.full(), full);
    }
}
