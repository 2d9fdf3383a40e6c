//! What the health monitor keeps of the objects it watches, and how the watch reads them.
//!
//! Each kind has a wire type that reads only the fields the monitor uses (serde skips the
//! rest of each object, managed fields included, without building it), so a list page of 500
//! PersistentVolumes never holds 500 typed objects, and a compact form that lives in the kit's
//! [`CompactStore`](plugreg_sidecar_kit::cache::CompactStore):
//!
//! - [`Volume`]: a PV's name, its CSI driver and handle, its claim (namespace, name, UID),
//!   whether it is Bound and whether it is being deleted;
//! - [`PodClaims`] (node watcher only): a pod's node and the claims its volumes name;
//! - [`NodeHealth`] (node watcher only): a node's Ready condition and phase.
//!
//! No claim and no Event is cached: an event's involved object is the PV's `claimRef`
//! (namespace, name, UID: what `kubectl describe` and the recovery lookup match on), and the
//! recovery lookup is the monitor's own memory of what it reported ([`crate::decide::Reports`]).

use std::sync::Arc;
use std::time::SystemTime;

use k8s_openapi::ClusterResourceScope;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use plugreg_sidecar_kit::cache::Keyed;
use plugreg_sidecar_kit::compact::null_as_default;
use plugreg_sidecar_kit::core_v1_resource;
use serde::{Deserialize, Deserializer};

/// The metadata the watches read: identity, resourceVersion (the watch resumes from it) and
/// the deletion time. Everything else of `metadata` is skipped while decoding.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SlimMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    deletion_timestamp: Option<Time>,
}

fn slim_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = Option::<SlimMeta>::deserialize(d)?.unwrap_or_default();
    Ok(ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        deletion_timestamp: m.deletion_timestamp,
        ..ObjectMeta::default()
    })
}

/// A PersistentVolume as the watch reads it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct WatchedPv {
    #[serde(default, deserialize_with = "slim_meta")]
    metadata: ObjectMeta,
    #[serde(default, deserialize_with = "null_as_default")]
    spec: PvSpec,
    #[serde(default, deserialize_with = "null_as_default")]
    status: PvStatus,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PvSpec {
    #[serde(default)]
    csi: Option<PvCsi>,
    #[serde(default)]
    claim_ref: Option<ClaimRef>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PvCsi {
    #[serde(default)]
    driver: String,
    #[serde(default)]
    volume_handle: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct ClaimRef {
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    uid: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct PvStatus {
    #[serde(default)]
    phase: Option<String>,
}

core_v1_resource!(
    WatchedPv,
    ClusterResourceScope,
    "PersistentVolume",
    "persistentvolumes"
);

/// The claim a PV names (`spec.claimRef`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// Its namespace.
    pub namespace: Box<str>,
    /// Its name.
    pub name: Box<str>,
    /// Its UID (empty if the reference has none).
    pub uid: Box<str>,
}

impl Claim {
    /// The claim as the involved object of an event: kind, apiVersion, namespace, name and UID
    /// (no resourceVersion: the claim is not read).
    pub fn object_ref(&self) -> k8s_openapi::api::core::v1::ObjectReference {
        k8s_openapi::api::core::v1::ObjectReference {
            kind: Some("PersistentVolumeClaim".into()),
            api_version: Some("v1".into()),
            namespace: Some(self.namespace.to_string()),
            name: Some(self.name.to_string()),
            uid: Some(self.uid.to_string()),
            ..Default::default()
        }
    }
}

/// A PersistentVolume as cached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    /// Its name (the store's key).
    pub name: Box<str>,
    /// `spec.csi.driver` (empty: not a CSI volume).
    pub driver: Box<str>,
    /// `spec.csi.volumeHandle`.
    pub handle: Box<str>,
    /// `spec.claimRef`.
    pub claim: Option<Box<Claim>>,
    /// `status.phase` is Bound.
    pub bound: bool,
    /// It has a deletion time.
    pub deleting: bool,
}

impl Volume {
    /// What the cache keeps of `pv`; of another driver's PV or a non-CSI one only the name
    /// (it is never checked; the store needs it only to say it exists).
    pub fn new(pv: WatchedPv, driver: &str) -> Self {
        let name = pv.metadata.name.unwrap_or_default().into_boxed_str();
        let deleting = pv.metadata.deletion_timestamp.is_some();
        let bound = pv.status.phase.as_deref() == Some("Bound");
        match pv.spec.csi {
            Some(csi) if csi.driver == driver => Volume {
                name,
                driver: csi.driver.into_boxed_str(),
                handle: csi.volume_handle.into_boxed_str(),
                claim: pv.spec.claim_ref.map(|c| {
                    Box::new(Claim {
                        namespace: c.namespace.unwrap_or_default().into_boxed_str(),
                        name: c.name.unwrap_or_default().into_boxed_str(),
                        uid: c.uid.unwrap_or_default().into_boxed_str(),
                    })
                }),
                bound,
                deleting,
            },
            _ => Volume {
                name,
                driver: Box::default(),
                handle: Box::default(),
                claim: None,
                bound,
                deleting,
            },
        }
    }

    /// Whether it is a volume of the driver the cache was made for.
    pub fn is_ours(&self) -> bool {
        !self.driver.is_empty()
    }

    /// Whether it is checked: the driver's, Bound and not being deleted.
    pub fn is_checked(&self) -> bool {
        self.is_ours() && self.bound && !self.deleting
    }
}

impl Keyed for Volume {
    fn key(&self) -> &str {
        &self.name
    }
}

/// A Pod as the watch reads it (node watcher).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct WatchedPod {
    #[serde(default, deserialize_with = "slim_meta")]
    metadata: ObjectMeta,
    #[serde(default, deserialize_with = "null_as_default")]
    spec: PodSpec,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PodSpec {
    #[serde(default)]
    node_name: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    volumes: Vec<PodVolume>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PodVolume {
    #[serde(default)]
    persistent_volume_claim: Option<PodClaim>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PodClaim {
    #[serde(default)]
    claim_name: String,
}

core_v1_resource!(WatchedPod, NamespaceResourceScope, "Pod", "pods");

/// A pod as cached: its node (as it is now: a pod bound after it was first seen counts on its
/// node) and the claims its volumes name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodClaims {
    /// `namespace/name` (the store's key).
    pub key: Box<str>,
    /// `spec.nodeName` (empty: not scheduled).
    pub node: Box<str>,
    /// The claims of its `persistentVolumeClaim` volumes.
    pub claims: Box<[Box<str>]>,
}

impl PodClaims {
    /// What the cache keeps of `pod`.
    pub fn new(pod: WatchedPod) -> Self {
        let ns = pod.metadata.namespace.unwrap_or_default();
        let name = pod.metadata.name.unwrap_or_default();
        PodClaims {
            key: format!("{ns}/{name}").into_boxed_str(),
            node: pod.spec.node_name.unwrap_or_default().into_boxed_str(),
            claims: pod
                .spec
                .volumes
                .into_iter()
                .filter_map(|v| v.persistent_volume_claim)
                .map(|c| c.claim_name.into_boxed_str())
                .collect(),
        }
    }

    /// The pod's namespace.
    pub fn namespace(&self) -> &str {
        self.key.split_once('/').map_or("", |(ns, _)| ns)
    }

    /// The pod's name.
    pub fn name(&self) -> &str {
        self.key.split_once('/').map_or(&*self.key, |(_, n)| n)
    }
}

impl Keyed for PodClaims {
    fn key(&self) -> &str {
        &self.key
    }
}

/// A Node as the watch reads it (node watcher).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct WatchedNode {
    #[serde(default, deserialize_with = "slim_meta")]
    metadata: ObjectMeta,
    #[serde(default, deserialize_with = "null_as_default")]
    status: NodeStatus,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct NodeStatus {
    #[serde(default)]
    phase: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    conditions: Vec<NodeCondition>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct NodeCondition {
    #[serde(default, rename = "type")]
    type_: String,
    #[serde(default)]
    status: String,
}

core_v1_resource!(WatchedNode, ClusterResourceScope, "Node", "nodes");

/// A node's Ready condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    /// `Ready` is `True`.
    True,
    /// `Ready` is `False` or `Unknown` (or anything else but `True`).
    NotTrue,
    /// No `Ready` condition.
    Missing,
}

/// A node as cached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeHealth {
    /// Its name (the store's key).
    pub name: Box<str>,
    /// Its Ready condition.
    pub ready: Ready,
    /// `status.phase` is `Terminated` (a phase no kubelet sets any more; read as upstream does).
    pub terminated: bool,
}

impl NodeHealth {
    /// What the cache keeps of `node`.
    pub fn new(node: WatchedNode) -> Self {
        let ready = match node.status.conditions.iter().find(|c| c.type_ == "Ready") {
            None => Ready::Missing,
            Some(c) if c.status == "True" => Ready::True,
            Some(_) => Ready::NotTrue,
        };
        NodeHealth {
            name: node.metadata.name.unwrap_or_default().into_boxed_str(),
            ready,
            terminated: node.status.phase.as_deref() == Some("Terminated"),
        }
    }
}

impl Keyed for NodeHealth {
    fn key(&self) -> &str {
        &self.name
    }
}

/// An Event as the seed of the reports' memory reads it: the involved object's UID, the
/// message and when it was last written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SeenEvent {
    #[serde(default, deserialize_with = "slim_meta")]
    metadata: ObjectMeta,
    #[serde(default, deserialize_with = "null_as_default")]
    involved_object: SeenObject,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    last_timestamp: Option<Time>,
    #[serde(default)]
    event_time: Option<MicroTime>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct SeenObject {
    #[serde(default)]
    uid: Option<String>,
}

core_v1_resource!(SeenEvent, NamespaceResourceScope, "Event", "events");

impl SeenEvent {
    /// The UID of the object it is about, if any.
    pub fn claim_uid(&self) -> Option<&str> {
        self.involved_object
            .uid
            .as_deref()
            .filter(|u| !u.is_empty())
    }

    /// Its message.
    pub fn message(&self) -> &str {
        self.message.as_deref().unwrap_or_default()
    }

    /// When it was last written (`lastTimestamp`, else `eventTime`; neither: the epoch).
    pub fn written(&self) -> SystemTime {
        self.last_timestamp
            .as_ref()
            .map(|t| t.0)
            .or_else(|| self.event_time.as_ref().map(|t| t.0))
            .map_or(SystemTime::UNIX_EPOCH, SystemTime::from)
    }
}

/// The handles of the driver's volumes and the PVs that carry them (the ListVolumes path looks
/// each listed volume up here; two PVs may name one handle).
#[derive(Debug, Default)]
pub struct Handles(std::collections::HashMap<Box<str>, Vec<Box<str>>>);

impl Handles {
    /// Keeps the index in step with a watch event of `v`.
    pub fn update(&mut self, v: &Volume, deleted: bool) {
        if !v.is_ours() {
            return;
        }
        if deleted {
            if let Some(names) = self.0.get_mut(&v.handle) {
                names.retain(|n| n != &v.name);
                if names.is_empty() {
                    self.0.remove(&v.handle);
                }
            }
            return;
        }
        let names = self.0.entry(v.handle.clone()).or_default();
        if !names.contains(&v.name) {
            names.push(v.name.clone());
        }
    }

    /// The PVs that carry `handle`.
    pub fn names(&self, handle: &str) -> &[Box<str>] {
        self.0.get(handle).map_or(&[], Vec::as_slice)
    }

    /// How many handles are known.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no handle is known.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A shared [`Handles`].
pub type SharedHandles = Arc<std::sync::Mutex<Handles>>;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_pv_keeps_what_the_monitor_reads() {
        let pv: WatchedPv = serde_json::from_value(json!({
            "metadata": {"name": "pv1", "uid": "u", "resourceVersion": "7",
                "managedFields": [{"manager": "x", "fieldsV1": {"f:spec": {}}}],
                "annotations": {"a": "b"}},
            "spec": {"csi": {"driver": "d", "volumeHandle": "h1"},
                "claimRef": {"namespace": "ns", "name": "c", "uid": "cu"},
                "capacity": {"storage": "1Gi"}},
            "status": {"phase": "Bound"}
        }))
        .unwrap();
        use kube::Resource as _;
        assert_eq!(pv.meta().resource_version.as_deref(), Some("7"));
        assert!(pv.meta().managed_fields.is_none() && pv.meta().annotations.is_none());
        let v = Volume::new(pv.clone(), "d");
        assert_eq!(&*v.handle, "h1");
        assert!(v.is_checked());
        let c = v.claim.as_deref().unwrap();
        assert_eq!((&*c.namespace, &*c.name, &*c.uid), ("ns", "c", "cu"));
        let other = Volume::new(pv, "another");
        assert!(!other.is_ours() && other.claim.is_none());
    }

    #[test]
    fn nulls_and_missing_parts_read_as_empty() {
        let pv: WatchedPv = serde_json::from_value(
            json!({"metadata": {"name": "p"}, "spec": null, "status": null}),
        )
        .unwrap();
        assert!(!Volume::new(pv, "d").is_ours());
        let pod: WatchedPod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"nodeName": "n1", "volumes": [{"name": "a", "persistentVolumeClaim": {"claimName": "c1"}},
                {"name": "b", "emptyDir": {}}]}
        }))
        .unwrap();
        let p = PodClaims::new(pod);
        assert_eq!((p.namespace(), p.name(), &*p.node), ("ns", "p", "n1"));
        assert_eq!(&*p.claims, &["c1".into()] as &[Box<str>]);
        let node: WatchedNode = serde_json::from_value(json!({
            "metadata": {"name": "n1"},
            "status": {"conditions": [{"type": "MemoryPressure", "status": "False"}, {"type": "Ready", "status": "Unknown"}]}
        }))
        .unwrap();
        assert_eq!(NodeHealth::new(node).ready, Ready::NotTrue);
    }

    #[test]
    fn an_event_reads_its_claim_message_and_time() {
        let ev: SeenEvent = serde_json::from_value(json!({
            "metadata": {"name": "c.1", "namespace": "ns"},
            "involvedObject": {"uid": "u1", "kind": "PersistentVolumeClaim"},
            "message": "m", "lastTimestamp": "2026-01-01T00:00:00Z", "count": 3
        }))
        .unwrap();
        assert_eq!((ev.claim_uid(), ev.message()), (Some("u1"), "m"));
        assert!(ev.written() > SystemTime::UNIX_EPOCH);
    }

    #[test]
    fn the_handle_index_follows_adds_and_deletes() {
        let v = |name: &str, handle: &str| Volume {
            name: name.into(),
            driver: "d".into(),
            handle: handle.into(),
            claim: None,
            bound: true,
            deleting: false,
        };
        let mut h = Handles::default();
        h.update(&v("a", "h"), false);
        h.update(&v("a", "h"), false);
        h.update(&v("b", "h"), false);
        assert_eq!(h.names("h").len(), 2);
        h.update(&v("a", "h"), true);
        assert_eq!(h.names("h"), &["b".into()] as &[Box<str>]);
        h.update(&v("b", "h"), true);
        assert!(h.is_empty());
    }
}
