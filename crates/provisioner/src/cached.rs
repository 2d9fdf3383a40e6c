//! What the watch cache keeps of a PersistentVolume: only what the decisions read.
//!
//! k8s-openapi's `PersistentVolume` holds every volume source inline (about 3.4 KiB before a
//! single string), and a cluster has as many PVs as claims; this type deserialises only the
//! fields the controller reads (serde skips the others), a seventh of that.

use std::borrow::Cow;

use k8s_openapi::ClusterResourceScope;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

/// A PersistentVolume as cached: metadata, and the parts of spec and status that decide.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct CachedPv {
    /// The metadata (annotations trimmed to the ones read, see the controller's watch).
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    /// What the spec says that matters here.
    #[serde(default)]
    pub spec: Option<CachedPvSpec>,
    /// The phase.
    #[serde(default)]
    pub status: Option<CachedPvStatus>,
}

/// The parts of `spec` the controller reads.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedPvSpec {
    /// `Delete`, `Retain` or `Recycle`.
    #[serde(default)]
    pub persistent_volume_reclaim_policy: Option<String>,
    /// The class (a metrics label).
    #[serde(default)]
    pub storage_class_name: Option<String>,
    /// The CSI source.
    #[serde(default)]
    pub csi: Option<CachedCsi>,
}

/// The CSI driver and volume of a PV.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedCsi {
    /// The driver name.
    #[serde(default, deserialize_with = "null_as_default")]
    pub driver: String,
    /// The volume ID DeleteVolume gets.
    #[serde(default, deserialize_with = "null_as_default")]
    pub volume_handle: String,
}

/// The part of `status` the controller reads.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct CachedPvStatus {
    /// `Pending`, `Available`, `Bound`, `Released` or `Failed`.
    #[serde(default)]
    pub phase: Option<String>,
}

/// `null` reads as the default, as k8s-openapi reads every field of the full object: whatever
/// the full `PersistentVolume` reads, this type reads too.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

impl kube::Resource for CachedPv {
    type DynamicType = ();
    type Scope = ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "PersistentVolume".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn api_version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "persistentvolumes".into()
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

    #[test]
    fn reads_only_what_decides_and_is_small() {
        let v: CachedPv = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": "pv", "uid": "u", "finalizers": ["f"]},
            "spec": {"persistentVolumeReclaimPolicy": "Delete", "storageClassName": "fast",
                "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                "claimRef": {"name": "data"}, "nodeAffinity": {"required": {"nodeSelectorTerms": []}},
                "csi": {"driver": "d", "volumeHandle": "h", "volumeAttributes": {"a": "b"}}},
            "status": {"phase": "Bound", "message": "m"},
        }))
        .unwrap();
        assert_eq!(v.name_any(), "pv");
        assert_eq!(v.finalizers(), ["f"]);
        let spec = v.spec.as_ref().unwrap();
        assert_eq!(
            spec.persistent_volume_reclaim_policy.as_deref(),
            Some("Delete")
        );
        assert_eq!(spec.storage_class_name.as_deref(), Some("fast"));
        let csi = spec.csi.as_ref().unwrap();
        assert_eq!(
            (csi.driver.as_str(), csi.volume_handle.as_str()),
            ("d", "h")
        );
        assert_eq!(v.status.unwrap().phase.as_deref(), Some("Bound"));
        let full = std::mem::size_of::<k8s_openapi::api::core::v1::PersistentVolume>();
        assert!(std::mem::size_of::<CachedPv>() * 5 < full);
    }

    /// Found by the `claim_fields` property: `null` metadata or CSI driver read as a full PV
    /// (k8s-openapi reads `null` as the default) but not as a cached one.
    #[test]
    fn reads_nulls_as_the_full_type_does() {
        let pv = json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": null,
            "spec": {"csi": {"driver": null, "volumeHandle": null}}});
        let full: k8s_openapi::api::core::v1::PersistentVolume =
            serde_json::from_value(pv.clone()).unwrap();
        let cached: CachedPv = serde_json::from_value(pv).unwrap();
        assert_eq!(cached.metadata, full.metadata);
        let csi = cached.spec.unwrap().csi.unwrap();
        assert_eq!((csi.driver.as_str(), csi.volume_handle.as_str()), ("", ""));
    }
}
