//! What the watch caches keep of claims and PersistentVolumes: only what the decisions read.
//!
//! A cluster has as many of both as it has volumes, and a claim waits in the cache far longer
//! than it is read (10,000 claims created at once wait minutes for kube-controller-manager to
//! bind them).
//!
//! - [`CachedPv`]: k8s-openapi's `PersistentVolume` holds every volume source inline (about
//!   3.4 KiB before a single string); this type deserialises only the fields the controller
//!   reads (serde skips the others), a seventh of that. The annotations read (who provisioned
//!   it, its deletion secret) are kept outside the metadata: a `BTreeMap` of one entry costs a
//!   whole node (over 500 bytes).
//! - [`CachedClaim`]: a claim's decisions read much of it (its spec makes the CreateVolume
//!   request; any annotation may name a secret), but typed it costs about 3 KiB of heap, most
//!   of it `BTreeMap` nodes of one or two entries and `None` fields. The cache keeps its
//!   identity and the rest, trimmed to what the decisions read ([`trim_claim`]), as compact
//!   JSON: a few hundred bytes. A sync decodes it again ([`CachedClaim::claim`]), microseconds
//!   against the writes it then makes.
//!
//! Both are kept in the kit's compact store (`cache::watch_compact`), keyed by themselves:
//! their identity (name, namespace, UID, resourceVersion) is a few strings (a claim's packed
//! with its rest in one allocation, the kit's `compact::Packed`), not an `ObjectMeta` of 360
//! bytes beside a reflector's key of four more strings.
//!
//! Writes never come from these copies: a claim is changed by a read-modify-write of its
//! whole JSON (so fields this build does not know survive), a PV's finalizer by a patch.

use k8s_openapi::ClusterResourceScope;
use k8s_openapi::api::core::v1::{
    AWSElasticBlockStoreVolumeSource, AzureDiskVolumeSource, AzureFilePersistentVolumeSource,
    CinderPersistentVolumeSource, GCEPersistentDiskVolumeSource, ObjectReference, PersistentVolume,
    PersistentVolumeClaim, PersistentVolumeClaimSpec, PersistentVolumeClaimStatus,
    PersistentVolumeSpec, PortworxVolumeSource, VolumeNodeAffinity, VsphereVirtualDiskVolumeSource,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use plugreg_sidecar_kit::cache;
use plugreg_sidecar_kit::compact::{Packed, null_as_default};
use plugreg_sidecar_kit::core_v1_resource;
use plugreg_sidecar_kit::migration;
use serde::{Deserialize, Serialize};

use crate::{decide, request};

/// kubectl's copy of the applied object: large, and read by no decision.
pub const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// A claim as cached: its identity and the rest as compact JSON, packed in one allocation (see
/// the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CachedClaim {
    /// `namespace/name` (the compact store's key; a namespace's name has no `/`), its UID and
    /// resourceVersion (empty if it had none), and the trimmed rest of the claim ([`Rest`]),
    /// JSON-encoded: one allocation.
    packed: Packed,
}

/// What a cached claim keeps besides its identity.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Rest {
    #[serde(default, skip_serializing_if = "is_empty_meta")]
    metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    spec: Option<PersistentVolumeClaimSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<PersistentVolumeClaimStatus>,
}

fn is_empty_meta(m: &ObjectMeta) -> bool {
    *m == ObjectMeta::default()
}

impl CachedClaim {
    /// The cached form of `claim`, trimmed to what the decisions read ([`trim_claim`]).
    pub fn new(mut claim: PersistentVolumeClaim) -> Self {
        trim_claim(&mut claim);
        let m = &mut claim.metadata;
        let key = cache::store_key(m);
        let uid = m.uid.take().unwrap_or_default();
        let resource_version = m.resource_version.take().unwrap_or_default();
        let rest = Rest {
            metadata: ObjectMeta {
                annotations: m.annotations.take(),
                finalizers: m.finalizers.take(),
                deletion_timestamp: m.deletion_timestamp.take(),
                ..ObjectMeta::default()
            },
            spec: claim.spec,
            status: claim.status,
        };
        // Serialising these types into a string cannot fail (no maps with non-string keys).
        let rest = serde_json::to_string(&rest).unwrap_or_default();
        CachedClaim {
            packed: Packed::new(&key, Some(&uid), Some(&resource_version), &rest),
        }
    }

    /// The claim as the decisions read it (trimmed, see [`trim_claim`]).
    pub fn claim(&self) -> PersistentVolumeClaim {
        // Written by `new` from the same types: it decodes.
        let rest: Rest = serde_json::from_str(self.packed.rest()).unwrap_or_default();
        let mut metadata = rest.metadata;
        metadata.name = Some(self.name().to_owned());
        metadata.namespace = Some(self.namespace().to_owned());
        metadata.uid = non_empty(self.uid());
        metadata.resource_version = non_empty(self.resource_version());
        PersistentVolumeClaim {
            metadata,
            spec: rest.spec,
            status: rest.status,
        }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        self.packed.name()
    }

    /// Its namespace.
    pub fn namespace(&self) -> &str {
        self.packed.namespace().unwrap_or_default()
    }

    /// Its UID (empty if it had none).
    pub fn uid(&self) -> &str {
        self.packed.uid().unwrap_or_default()
    }

    /// Its resourceVersion (empty if it had none).
    pub fn resource_version(&self) -> &str {
        self.packed.resource_version().unwrap_or_default()
    }

    /// Whether the trimmed rest of the claim contains `text` (a cheap filter before
    /// [`CachedClaim::claim`] decodes it).
    pub fn mentions(&self, text: &str) -> bool {
        self.packed.rest().contains(text)
    }

    /// The bytes the rest of the claim takes (for tests and sizing).
    pub fn rest_len(&self) -> usize {
        self.packed.rest().len()
    }
}

impl cache::Keyed for CachedClaim {
    fn key(&self) -> &str {
        self.packed.key()
    }
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

/// A claim as the decisions read it: no labels, no owner references, no managed fields, no
/// kubectl copy, no finalizer but a previous version's and the cloning protection, only the
/// phase of its status. A Bound claim (without a previous version's
/// intent) needs nothing more than its identity, volume and class: a later change comes as a
/// new object anyway.
pub fn trim_claim(c: &mut PersistentVolumeClaim) {
    let bound = c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
        && !decide::has_legacy_intent(c);
    let m = &mut c.metadata;
    *m = ObjectMeta {
        name: m.name.take(),
        namespace: m.namespace.take(),
        uid: m.uid.take(),
        resource_version: m.resource_version.take(),
        annotations: m.annotations.take(),
        // Only a previous version's finalizer and the cloning protection are read (and
        // released by a read-modify-write).
        finalizers: m
            .finalizers
            .take()
            .map(|f| {
                f.into_iter()
                    .filter(|f| {
                        f == decide::LEGACY_FINALIZER || f == crate::source::CLONE_FINALIZER
                    })
                    .collect::<Vec<_>>()
            })
            .filter(|f| !f.is_empty()),
        deletion_timestamp: m.deletion_timestamp.take(),
        ..ObjectMeta::default()
    };
    if let Some(a) = &mut m.annotations {
        if bound {
            a.retain(|k, _| k == request::ANN_BETA_STORAGE_CLASS);
        } else {
            a.remove(LAST_APPLIED);
        }
        if a.is_empty() {
            m.annotations = None;
        }
    }
    if bound && let Some(spec) = &mut c.spec {
        *spec = PersistentVolumeClaimSpec {
            volume_name: spec.volume_name.take(),
            storage_class_name: spec.storage_class_name.take(),
            ..Default::default()
        };
    }
    if let Some(s) = &mut c.status {
        *s = PersistentVolumeClaimStatus {
            phase: s.phase.take(),
            ..Default::default()
        };
    }
}

/// A PersistentVolume as cached: its identity, its finalizer and deletion time, the annotations
/// read, and the parts of spec and status that decide.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CachedPv {
    /// Its name (the compact store's key).
    pub name: Box<str>,
    /// Its UID (empty if it had none).
    pub uid: Box<str>,
    /// Its resourceVersion (empty if it had none).
    pub resource_version: Box<str>,
    /// Whether it carries the provisioner's finalizer (`pv::FINALIZER`), the only one read:
    /// a list of the others would cost a `Vec` and a string each per PV.
    pub has_finalizer: bool,
    /// When its deletion was asked for.
    pub deletion_timestamp: Option<Time>,
    /// What the spec says that matters here.
    pub spec: Option<CachedPvSpec>,
    /// The phase.
    pub status: Option<CachedPvStatus>,
    /// Its `pv.kubernetes.io/provisioned-by` annotation.
    pub provisioned_by: Option<Box<str>>,
    /// Where DeleteVolume's secrets come from.
    pub deletion_secret: DeletionSecret,
}

/// Where a PV's DeleteVolume secrets come from (upstream's Delete, provisioner spec §12).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeletionSecret {
    /// Both deletion-secret annotations are there: the Secret they name (name, namespace), or
    /// none when either is empty.
    Annotated(Option<Box<(String, String)>>),
    /// Not both (a PV of an older provisioner, or a static one): the class's provisioner secret,
    /// resolved again with the claim of `spec.claimRef` (name, namespace; none: no secret).
    FromClass(Option<Box<(String, String)>>),
}

impl Default for DeletionSecret {
    fn default() -> Self {
        DeletionSecret::Annotated(None)
    }
}

/// A PV as the watch decodes it: the fields [`CachedPv`] keeps, with the whole metadata (the
/// watch reads its resourceVersion; the annotations read become fields of the cached form).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct WatchedPv {
    #[serde(default, deserialize_with = "null_as_default")]
    metadata: ObjectMeta,
    #[serde(default)]
    spec: Option<WatchedPvSpec>,
    #[serde(default)]
    status: Option<CachedPvStatus>,
}

/// A PV's spec as the watch decodes it: what [`CachedPvSpec`] keeps, and the in-tree sources
/// (with the claim's namespace, which Azure File's translation reads) that CSI migration
/// turns into its CSI volume.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatchedPvSpec {
    #[serde(default)]
    persistent_volume_reclaim_policy: Option<String>,
    #[serde(default)]
    storage_class_name: Option<String>,
    #[serde(default)]
    csi: Option<CachedCsi>,
    #[serde(default)]
    claim_ref: Option<Box<ObjectReference>>,
    #[serde(default)]
    node_affinity: Option<Box<VolumeNodeAffinity>>,
    #[serde(default)]
    aws_elastic_block_store: Option<Box<AWSElasticBlockStoreVolumeSource>>,
    #[serde(default)]
    gce_persistent_disk: Option<Box<GCEPersistentDiskVolumeSource>>,
    #[serde(default)]
    azure_disk: Option<Box<AzureDiskVolumeSource>>,
    #[serde(default)]
    azure_file: Option<Box<AzureFilePersistentVolumeSource>>,
    #[serde(default)]
    cinder: Option<Box<CinderPersistentVolumeSource>>,
    #[serde(default)]
    vsphere_volume: Option<Box<VsphereVirtualDiskVolumeSource>>,
    #[serde(default)]
    portworx_volume: Option<Box<PortworxVolumeSource>>,
}

impl WatchedPvSpec {
    /// The spec as cached; an in-tree PV's CSI volume is its translation (`meta`: the PV's
    /// metadata, whose name, zone labels and annotations the translation reads).
    fn cached(self, meta: &ObjectMeta) -> CachedPvSpec {
        let spec = PersistentVolumeSpec {
            claim_ref: self.claim_ref.map(|r| *r),
            aws_elastic_block_store: self.aws_elastic_block_store.map(|s| *s),
            gce_persistent_disk: self.gce_persistent_disk.map(|s| *s),
            azure_disk: self.azure_disk.map(|s| *s),
            azure_file: self.azure_file.map(|s| *s),
            cinder: self.cinder.map(|s| *s),
            vsphere_volume: self.vsphere_volume.map(|s| *s),
            portworx_volume: self.portworx_volume.map(|s| *s),
            ..Default::default()
        };
        let mut cached = CachedPvSpec {
            persistent_volume_reclaim_policy: self.persistent_volume_reclaim_policy,
            storage_class_name: self.storage_class_name,
            csi: self.csi,
            in_tree: None,
            node_affinity: self.node_affinity,
        };
        if migration::in_tree_plugin_of_pv(&spec).is_none() {
            return cached;
        }
        let pv = PersistentVolume {
            metadata: ObjectMeta {
                name: meta.name.clone(),
                labels: meta.labels.clone(),
                annotations: meta.annotations.clone(),
                ..Default::default()
            },
            spec: Some(spec),
            status: None,
        };
        let translated =
            migration::translate_in_tree_pv_to_csi(&pv).map(|t| t.spec.and_then(|s| s.csi));
        cached.in_tree = Some(Box::new(match translated {
            Ok(csi) => {
                cached.csi = csi.map(|c| CachedCsi {
                    driver: c.driver,
                    volume_handle: c.volume_handle,
                });
                InTree { error: None }
            }
            Err(e) => InTree {
                error: Some(e.to_string()),
            },
        }));
        cached
    }
}

/// What CSI migration made of an in-tree PV.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InTree {
    /// Why it does not translate (a deletion fails with it); none: `csi` is its translation.
    pub error: Option<String>,
}

impl<'de> Deserialize<'de> for CachedPv {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        WatchedPv::deserialize(d).map(CachedPv::from)
    }
}

impl From<WatchedPv> for CachedPv {
    fn from(pv: WatchedPv) -> Self {
        let WatchedPv {
            metadata: mut m,
            spec,
            status,
        } = pv;
        let mut annotations = m.annotations.take().unwrap_or_default();
        let deletion_secret = match (
            annotations.remove(crate::pv::ANN_DELETION_SECRET_NAME),
            annotations.remove(crate::pv::ANN_DELETION_SECRET_NAMESPACE),
        ) {
            (Some(n), Some(ns)) => DeletionSecret::Annotated(
                (!n.is_empty() && !ns.is_empty()).then(|| Box::new((n, ns))),
            ),
            _ => DeletionSecret::FromClass(spec.as_ref().and_then(|s| s.claim_ref.as_deref()).map(
                |r| {
                    Box::new((
                        r.name.clone().unwrap_or_default(),
                        r.namespace.clone().unwrap_or_default(),
                    ))
                },
            )),
        };
        CachedPv {
            name: m.name.take().unwrap_or_default().into_boxed_str(),
            uid: m.uid.take().unwrap_or_default().into_boxed_str(),
            resource_version: m
                .resource_version
                .take()
                .unwrap_or_default()
                .into_boxed_str(),
            has_finalizer: m
                .finalizers
                .iter()
                .flatten()
                .any(|f| f == crate::pv::FINALIZER),
            deletion_timestamp: m.deletion_timestamp.take(),
            spec: spec.map(|s| s.cached(&m)),
            status,
            provisioned_by: annotations
                .remove(crate::pv::ANN_PROVISIONED_BY)
                .map(String::into_boxed_str),
            deletion_secret,
        }
    }
}

impl decide::AsPvFacts for CachedPv {
    fn pv_facts(&self) -> decide::PvFacts<'_> {
        let spec = self.spec.as_ref();
        decide::PvFacts {
            provisioned_by: self.provisioned_by.as_deref(),
            csi_driver: spec.and_then(|s| s.csi.as_ref()).map(|c| c.driver.as_str()),
            in_tree: spec.is_some_and(|s| s.in_tree.is_some()),
            reclaim_policy: spec.and_then(|s| s.persistent_volume_reclaim_policy.as_deref()),
            phase: self.status.as_ref().and_then(|s| s.phase.as_deref()),
            deleting: self.deletion_timestamp.is_some(),
            has_finalizer: self.has_finalizer,
        }
    }
}

impl cache::Keyed for CachedPv {
    fn key(&self) -> &str {
        &self.name
    }
}

/// The parts of `spec` the controller reads.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CachedPvSpec {
    /// `Delete`, `Retain` or `Recycle`.
    pub persistent_volume_reclaim_policy: Option<String>,
    /// The class (a metrics label).
    pub storage_class_name: Option<String>,
    /// The CSI source (an in-tree PV's translation).
    pub csi: Option<CachedCsi>,
    /// For an in-tree PV (CSI migration): whether it translated.
    pub in_tree: Option<Box<InTree>>,
    /// Where the volume can be used (`--node-deployment` deletes only the volumes its node's
    /// segment matches).
    pub node_affinity: Option<Box<VolumeNodeAffinity>>,
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

core_v1_resource!(
    WatchedPv,
    ClusterResourceScope,
    "PersistentVolume",
    "persistentvolumes"
);

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt;
    use serde_json::json;

    #[test]
    fn reads_only_what_decides_and_is_small() {
        let v: CachedPv = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": "pv", "uid": "u", "finalizers": ["f", crate::pv::FINALIZER], "labels": {"a": "b"},
                "annotations": {crate::pv::ANN_PROVISIONED_BY: "d", "pv.kubernetes.io/bound-by-controller": "yes",
                    crate::pv::ANN_DELETION_SECRET_NAME: "s", crate::pv::ANN_DELETION_SECRET_NAMESPACE: "n"}},
            "spec": {"persistentVolumeReclaimPolicy": "Delete", "storageClassName": "fast",
                "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                "claimRef": {"name": "data"}, "nodeAffinity": {"required": {"nodeSelectorTerms": []}},
                "csi": {"driver": "d", "volumeHandle": "h", "volumeAttributes": {"a": "b"}}},
            "status": {"phase": "Bound", "message": "m"},
        }))
        .unwrap();
        assert_eq!((&*v.name, &*v.uid), ("pv", "u"));
        assert!(v.has_finalizer);
        assert_eq!(v.provisioned_by.as_deref(), Some("d"));
        assert_eq!(
            v.deletion_secret,
            DeletionSecret::Annotated(Some(Box::new(("s".to_owned(), "n".to_owned()))))
        );
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
        // A deletion secret needs both its name and its namespace.
        let half: CachedPv = serde_json::from_value(json!({"metadata": {"name": "pv",
            "annotations": {crate::pv::ANN_DELETION_SECRET_NAME: "s", crate::pv::ANN_DELETION_SECRET_NAMESPACE: ""}}}))
        .unwrap();
        assert_eq!(
            (half.deletion_secret, half.provisioned_by),
            (DeletionSecret::Annotated(None), None)
        );
        // Without both annotations the class's secret is resolved with the claim's name and
        // namespace.
        let old: CachedPv = serde_json::from_value(json!({"metadata": {"name": "pv",
            "annotations": {crate::pv::ANN_DELETION_SECRET_NAME: "s"}},
            "spec": {"claimRef": {"name": "data", "namespace": "ns"}}}))
        .unwrap();
        assert_eq!(
            old.deletion_secret,
            DeletionSecret::FromClass(Some(Box::new(("data".to_owned(), "ns".to_owned()))))
        );
        let full = std::mem::size_of::<k8s_openapi::api::core::v1::PersistentVolume>();
        assert!(std::mem::size_of::<CachedPv>() * 5 < full);
    }

    /// Found by the `claim_fields` property: `null` metadata or CSI driver read as a full PV
    /// (k8s-openapi reads `null` as the default) but not as a cached one.
    /// CSI migration: an in-tree PV is cached with its translated CSI volume (GCE's handle
    /// from the zone label), or the translation's error.
    #[test]
    fn an_in_tree_pv_is_cached_translated() {
        let gce: CachedPv = serde_json::from_value(json!({
            "metadata": {"name": "p", "labels": {"topology.kubernetes.io/zone": "us-central1-a"},
                "annotations": {"pv.kubernetes.io/provisioned-by": "kubernetes.io/gce-pd"}},
            "spec": {"persistentVolumeReclaimPolicy": "Delete", "gcePersistentDisk": {"pdName": "pvc-x"}},
        }))
        .unwrap();
        let spec = gce.spec.unwrap();
        assert_eq!(
            spec.csi,
            Some(CachedCsi {
                driver: "pd.csi.storage.gke.io".into(),
                volume_handle: "projects/UNSPECIFIED/zones/us-central1-a/disks/pvc-x".into(),
            })
        );
        assert_eq!(spec.in_tree, Some(Box::new(InTree { error: None })));
        let file: CachedPv = serde_json::from_value(json!({
            "metadata": {"name": "f"},
            "spec": {"azureFile": {"secretName": "s", "shareName": "sh"}},
        }))
        .unwrap();
        let spec = file.spec.unwrap();
        assert_eq!(spec.csi, None);
        assert_eq!(
            spec.in_tree.unwrap().error.as_deref(),
            Some("could not find a secret namespace in PersistentVolumeSource or ClaimRef")
        );
        let csi: CachedPv = serde_json::from_value(json!({
            "metadata": {"name": "c"},
            "spec": {"csi": {"driver": "d", "volumeHandle": "h"}},
        }))
        .unwrap();
        assert_eq!(csi.spec.unwrap().in_tree, None);
    }

    /// The volume's worker reads the cached PV's facts: an in-tree PV as in-tree, with its
    /// translation's driver.
    #[test]
    fn a_cached_pv_reads_as_its_facts() {
        use decide::{AsPvFacts, PvFacts};
        let released: CachedPv = serde_json::from_value(json!({
            "metadata": {"name": "p", "finalizers": [crate::pv::FINALIZER],
                "deletionTimestamp": "2026-11-25T10:01:00Z",
                "annotations": {crate::pv::ANN_PROVISIONED_BY: "d"}},
            "spec": {"persistentVolumeReclaimPolicy": "Retain",
                "csi": {"driver": "d", "volumeHandle": "h"}},
            "status": {"phase": "Released"},
        }))
        .unwrap();
        assert_eq!(
            released.pv_facts(),
            PvFacts {
                provisioned_by: Some("d"),
                csi_driver: Some("d"),
                in_tree: false,
                reclaim_policy: Some("Retain"),
                phase: Some("Released"),
                deleting: true,
                has_finalizer: true,
            }
        );
        // §5.1: a static in-tree PV (no provisioned-by) stays kube-controller-manager's.
        let static_pv: CachedPv = serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"persistentVolumeReclaimPolicy": "Delete",
                "gcePersistentDisk": {"pdName": "d"}},
            "status": {"phase": "Released"},
        }))
        .unwrap();
        let f = static_pv.pv_facts();
        assert_eq!(
            (f.provisioned_by, f.csi_driver, f.in_tree),
            (None, Some("pd.csi.storage.gke.io"), true)
        );
        let view = decide::VolumeView {
            pv: &static_pv,
            driver: "pd.csi.storage.gke.io",
            deleted: None,
        };
        assert_eq!(decide::volume(&view), decide::VolumeAction::Nothing);
        assert_eq!(CachedPv::default().pv_facts(), PvFacts::default());
    }

    #[test]
    fn reads_nulls_as_the_full_type_does() {
        let pv = json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": null,
            "spec": {"csi": {"driver": null, "volumeHandle": null}}});
        let full: k8s_openapi::api::core::v1::PersistentVolume =
            serde_json::from_value(pv.clone()).unwrap();
        let cached: CachedPv = serde_json::from_value(pv).unwrap();
        assert_eq!(cached.name, full.metadata.name.unwrap_or_default().into());
        assert!(!cached.has_finalizer);
        let csi = cached.spec.unwrap().csi.unwrap();
        assert_eq!((csi.driver.as_str(), csi.volume_handle.as_str()), ("", ""));
    }

    #[test]
    fn a_cached_claim_reads_back_as_trimmed() {
        let wire = json!({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {
                "name": "data", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                "creationTimestamp": "2026-11-25T10:00:00Z", "labels": {"app": "x"},
                "annotations": {LAST_APPLIED: "{...}", "volume.kubernetes.io/selected-node": "n1",
                    "volume.kubernetes.io/storage-provisioner": "d"},
                "finalizers": ["kubernetes.io/pvc-protection", decide::LEGACY_FINALIZER],
                "deletionTimestamp": "2026-11-25T10:01:00Z",
                "managedFields": [{"manager": "kubectl", "operation": "Update"}],
            },
            "spec": {"storageClassName": "fast", "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}}, "volumeMode": "Filesystem",
                "dataSourceRef": {"kind": "Snap", "name": "s", "apiGroup": "g"},
                "someFutureField": {"x": 1}},
            "status": {"phase": "Pending", "conditions": [{"type": "Resizing", "status": "True"}]},
        });
        let cached = CachedClaim::new(serde_json::from_value(wire.clone()).unwrap());
        assert_eq!((cached.name(), cached.namespace()), ("data", "ns"));
        assert_eq!(cache::Keyed::key(&cached), "ns/data");
        assert_eq!((cached.uid(), cached.resource_version()), ("u", "7"));
        let mut want: PersistentVolumeClaim = serde_json::from_value(wire).unwrap();
        trim_claim(&mut want);
        let got = cached.claim();
        assert_eq!(got, want);
        assert_eq!(got.uid().as_deref(), Some("u"));
        assert_eq!(got.finalizers(), [decide::LEGACY_FINALIZER]);
        assert!(got.metadata.deletion_timestamp.is_some());
        assert_eq!(got.metadata.creation_timestamp, None);
        assert_eq!(
            got.annotations().keys().collect::<Vec<_>>(),
            [
                "volume.kubernetes.io/selected-node",
                "volume.kubernetes.io/storage-provisioner"
            ]
        );
        let spec = got.spec.unwrap();
        assert_eq!(spec.data_source_ref.unwrap().name, "s");
        assert_eq!(spec.storage_class_name.as_deref(), Some("fast"));
        // The rest is a few hundred bytes of JSON, not kilobytes of typed fields.
        assert!(cached.rest_len() < 512, "{}", cached.rest_len());
        assert!(
            std::mem::size_of::<CachedClaim>() * 2 < std::mem::size_of::<PersistentVolumeClaim>()
        );
    }
}
