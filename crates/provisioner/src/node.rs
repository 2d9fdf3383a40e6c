//! Distributed provisioning (`--node-deployment`,
//! `docs/upstream/upstream-capacity-and-node-deployment.md` §B): one provisioner per node, in
//! the driver's DaemonSet, provisioning only the claims of its node and deleting only the
//! volumes on its node.
//!
//! What a node takes (§B.3): a claim whose `volume.kubernetes.io/selected-node` names it; a
//! claim selected for another node never; a claim without a selected node only when its class
//! binds immediately and `--node-deployment-immediate-binding` is on, and then only after this
//! node has become its owner by writing its own name into the annotation (§B.4). Every node
//! waits a random delay first ([`delay`]), checks that it has the capacity, and the first
//! Update wins: the others' Updates conflict, or they see the annotation in their cache.
//!
//! The pure parts live here (which claims, the wait, the PV affinity match); the controller
//! does the waiting and writing.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Node, NodeSelectorRequirement, PersistentVolumeClaim, VolumeNodeAffinity,
};
use k8s_openapi::api::storage::v1::{CSINode, CSINodeDriver, CSINodeSpec, StorageClass};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::request::ANN_SELECTED_NODE;

/// This node as its driver describes it (`NodeGetInfo`, read once at start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Local {
    /// `NODE_NAME`: the Kubernetes node this provisioner runs on.
    pub node: String,
    /// NodeGetInfo's `node_id`.
    pub node_id: String,
    /// NodeGetInfo's `accessible_topology`, sorted by key (upstream keeps Go's map order, which
    /// makes its refresh by topology miss with two keys or more: §A.11 quirk 3); `None` when
    /// the driver reports none.
    pub segment: Option<BTreeMap<String, String>>,
}

impl Local {
    /// The Node the topology code reads in place of the watched ones (§B.2 step 4): named
    /// `NODE_NAME`, labelled with the reported segment and nothing else.
    pub fn node_object(&self) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(self.node.clone()),
                labels: self.segment.clone(),
                ..ObjectMeta::default()
            },
            ..Node::default()
        }
    }

    /// The CSINode the topology code reads in place of the watched ones: one entry, the
    /// driver, with the reported node ID and the segment's keys.
    pub fn csinode_object(&self, driver: &str) -> CSINode {
        CSINode {
            metadata: ObjectMeta {
                name: Some(self.node.clone()),
                ..ObjectMeta::default()
            },
            spec: CSINodeSpec {
                drivers: vec![CSINodeDriver {
                    name: driver.to_owned(),
                    node_id: self.node_id.clone(),
                    topology_keys: self.segment.as_ref().map(|s| s.keys().cloned().collect()),
                    allocatable: None,
                }],
            },
        }
    }
}

/// What `--node-deployment` and its flags ask of the controller.
#[derive(Debug, Clone)]
pub struct NodeDeployment {
    /// This node.
    pub local: Local,
    /// `--node-deployment-immediate-binding`.
    pub immediate_binding: bool,
    /// `--node-deployment-base-delay`.
    pub base_delay: Duration,
    /// `--node-deployment-max-delay`.
    pub max_delay: Duration,
}

/// The name of this node's in-flight record (`<base>-volumes-<n>` Leases, labelled with it):
/// the driver's `lease` name joined to the node's, within the 63 characters of a label value
/// (a longer one keeps its first part and an FNV-1a hash of the whole, so that two nodes never
/// share a record).
pub fn record_base(lease: &str, node: &str) -> String {
    let joined = format!("{lease}-{node}");
    if joined.len() <= 63 {
        return joined;
    }
    let hash = crate::capacity::fnv1a32(&joined);
    // Names are ASCII (DNS subdomains); a cut must not end in a separator.
    let head = joined[..54].trim_end_matches(['-', '.']);
    format!("{head}-{hash:08x}")
}

/// The node the claim's GA `volume.kubernetes.io/selected-node` annotation names (the only key
/// a node deployment reads; an empty value is no node).
pub fn selected(claim: &PersistentVolumeClaim) -> Option<&str> {
    crate::request::annotation(claim, ANN_SELECTED_NODE).filter(|n| !n.is_empty())
}

/// Whether this node takes a claim the provisioner would take (§B.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Selected for this node: provision it.
    Provision,
    /// Another node's, a WaitForFirstConsumer claim not scheduled yet, or an Immediate claim
    /// left to an external controller: leave it, silently.
    Skip,
    /// An Immediate claim without a node: try to become its owner (§B.4).
    TryOwner,
}

/// §B.3's table. Only the GA annotation counts; an empty value is no node. A class whose
/// `volumeBindingMode` is unset counts as not immediate, as upstream's node check reads it
/// (the API server sets the field on every class it stores, so this only matters for classes
/// written before the field existed).
pub fn take(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    node: &str,
    immediate_binding: bool,
) -> Take {
    match selected(claim) {
        Some(n) if n == node => Take::Provision,
        Some(_) => Take::Skip,
        None if class.volume_binding_mode.as_deref() != Some("Immediate") => Take::Skip,
        None if !immediate_binding => Take::Skip,
        None => Take::TryOwner,
    }
}

/// What a node waiting to become a claim's owner makes of the claim as cached now (§B.4
/// step 2; the claim's deletion is the caller's: it is no longer cached).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Waiting {
    /// Still nobody's: wait on.
    Free,
    /// Another claim of the same name (another UID).
    Replaced,
    /// Bound to a volume already: somebody provisioned it. (The cache trims a Bound claim to
    /// what its provisioning needs, its annotations included, so a Bound claim must not read
    /// as free: found by the race benchmark, where losers rewrote the winner's annotation.)
    Bound,
    /// Its selected node is set: this node's own (its event brings the claim back) or another's.
    Taken {
        /// Whether it is this node.
        ours: bool,
    },
}

/// [`Waiting`] of `claim` (as cached) for the node `node` that started waiting for the claim
/// with `uid`.
pub fn waiting(claim: &PersistentVolumeClaim, uid: &str, node: &str) -> Waiting {
    if claim.metadata.uid.as_deref() != Some(uid) {
        return Waiting::Replaced;
    }
    let bound = claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .is_some_and(|v| !v.is_empty())
        || claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    if bound {
        return Waiting::Bound;
    }
    match selected(claim) {
        Some(n) => Waiting::Taken { ours: n == node },
        None => Waiting::Free,
    }
}

/// The wait before attempt `n` (from 0) to become a claim's owner (§B.4 step 1):
/// `max(0, min(base * 2^n, max) - u * base)` with `u` uniform in [0, 1). With the defaults
/// (20 s, 60 s): (0, 20 s], then (20 s, 40 s], then (40 s, 60 s] for every later attempt.
pub fn delay(base: Duration, max: Duration, n: u32, u: f64) -> Duration {
    let grown = base
        .checked_mul(1_u32.checked_shl(n.min(31)).unwrap_or(u32::MAX))
        .unwrap_or(Duration::MAX)
        .min(max);
    grown.saturating_sub(base.mul_f64(u.clamp(0.0, 1.0)))
}

/// Whether the PV with `affinity` is on this node (§B.6): its required node selector matches a
/// node labelled only with this node's segment. A PV without a required selector, or a driver
/// that reports no topology, is on every node. An invalid requirement (an unknown operator, a
/// `Gt`/`Lt` value that is no integer) is an error, as the API server's selector parsing makes
/// it upstream.
pub fn on_this_node(affinity: Option<&VolumeNodeAffinity>, local: &Local) -> Result<bool, String> {
    let Some(required) = affinity.and_then(|a| a.required.as_ref()) else {
        return Ok(true);
    };
    let Some(labels) = &local.segment else {
        return Ok(true);
    };
    for term in &required.node_selector_terms {
        let exprs = term.match_expressions.as_deref().unwrap_or_default();
        let fields = term.match_fields.as_deref().unwrap_or_default();
        // An empty term matches nothing; fields never match the pseudo-node.
        if (exprs.is_empty() && fields.is_empty()) || !fields.is_empty() {
            // Still validate the expressions, as the selector is built before matching.
            for e in exprs {
                requirement_matches(e, labels)?;
            }
            continue;
        }
        let mut all = true;
        for e in exprs {
            if !requirement_matches(e, labels)? {
                all = false;
            }
        }
        if all {
            return Ok(true);
        }
    }
    Ok(false)
}

fn requirement_matches(
    r: &NodeSelectorRequirement,
    labels: &BTreeMap<String, String>,
) -> Result<bool, String> {
    let values = r.values.as_deref().unwrap_or_default();
    let value = labels.get(&r.key);
    let number = |what: &str| -> Result<(i64, Option<i64>), String> {
        let [v] = values else {
            return Err(format!(
                "{}: for '{what}' operator, exactly one value is required",
                r.key
            ));
        };
        let bound = v.parse::<i64>().map_err(|e| {
            format!(
                "{}: for '{what}' operator, the value must be an integer: {e}",
                r.key
            )
        })?;
        Ok((bound, value.and_then(|v| v.parse::<i64>().ok())))
    };
    match r.operator.as_str() {
        "In" | "NotIn" if values.is_empty() => Err(format!(
            "{}: for 'in', 'notin' operators, values set can't be empty",
            r.key
        )),
        "In" => Ok(value.is_some_and(|v| values.contains(v))),
        "NotIn" => Ok(!value.is_some_and(|v| values.contains(v))),
        "Exists" => Ok(value.is_some()),
        "DoesNotExist" => Ok(value.is_none()),
        "Gt" => number("gt").map(|(b, v)| v.is_some_and(|v| v > b)),
        "Lt" => number("lt").map(|(b, v)| v.is_some_and(|v| v < b)),
        op => Err(format!("{op:?} is not a valid node selector operator")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorTerm};
    use serde_json::json;

    fn local(segment: Option<&[(&str, &str)]>) -> Local {
        Local {
            node: "worker-1".into(),
            node_id: "id-1".into(),
            segment: segment.map(|s| {
                s.iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect()
            }),
        }
    }

    fn claim(selected: Option<&str>) -> PersistentVolumeClaim {
        let mut c = PersistentVolumeClaim::default();
        if let Some(n) = selected {
            c.metadata.annotations = Some(BTreeMap::from([(
                ANN_SELECTED_NODE.to_owned(),
                n.to_owned(),
            )]));
        }
        c
    }

    fn class(mode: Option<&str>) -> StorageClass {
        StorageClass {
            volume_binding_mode: mode.map(str::to_owned),
            ..StorageClass::default()
        }
    }

    #[test]
    fn a_node_takes_its_own_claims_and_competes_for_immediate_ones() {
        let wffc = class(Some("WaitForFirstConsumer"));
        let imm = class(Some("Immediate"));
        let unset = class(None);
        for c in [&wffc, &imm, &unset] {
            assert_eq!(
                take(&claim(Some("worker-1")), c, "worker-1", true),
                Take::Provision
            );
            assert_eq!(
                take(&claim(Some("worker-2")), c, "worker-1", true),
                Take::Skip
            );
        }
        assert_eq!(take(&claim(None), &wffc, "worker-1", true), Take::Skip);
        assert_eq!(take(&claim(Some("")), &wffc, "worker-1", true), Take::Skip);
        assert_eq!(take(&claim(None), &unset, "worker-1", true), Take::Skip);
        assert_eq!(take(&claim(None), &imm, "worker-1", true), Take::TryOwner);
        assert_eq!(
            take(&claim(Some("")), &imm, "worker-1", true),
            Take::TryOwner
        );
        assert_eq!(take(&claim(None), &imm, "worker-1", false), Take::Skip);
        // The alpha key is not read.
        let mut alpha = claim(None);
        alpha.metadata.annotations = Some(BTreeMap::from([(
            "volume.alpha.kubernetes.io/selected-node".to_owned(),
            "worker-1".to_owned(),
        )]));
        assert_eq!(take(&alpha, &wffc, "worker-1", true), Take::Skip);
    }

    #[test]
    fn a_bound_claim_is_nobody_s_to_take_even_trimmed() {
        let mut c = claim(None);
        c.metadata.uid = Some("u1".into());
        assert_eq!(waiting(&c, "u1", "worker-1"), Waiting::Free);
        assert_eq!(waiting(&c, "u2", "worker-1"), Waiting::Replaced);
        let mut mine = claim(Some("worker-1"));
        mine.metadata.uid = Some("u1".into());
        assert_eq!(
            waiting(&mine, "u1", "worker-1"),
            Waiting::Taken { ours: true }
        );
        assert_eq!(
            waiting(&mine, "u1", "worker-2"),
            Waiting::Taken { ours: false }
        );
        // Bound, as the cache keeps it: the annotation trimmed away.
        let mut bound = crate::request::tests::claim_with("u1");
        bound.metadata.annotations = Some(BTreeMap::from([(
            ANN_SELECTED_NODE.to_owned(),
            "worker-2".to_owned(),
        )]));
        bound.spec.as_mut().unwrap().volume_name = Some("pv-1".into());
        bound.status = Some(k8s_openapi::api::core::v1::PersistentVolumeClaimStatus {
            phase: Some("Bound".into()),
            ..Default::default()
        });
        crate::cached::trim_claim(&mut bound);
        assert_eq!(selected(&bound), None, "the cache drops it");
        assert_eq!(waiting(&bound, "u1", "worker-1"), Waiting::Bound);
        // Its volume named, KCM's status not written yet.
        let mut named = claim(None);
        named.metadata.uid = Some("u1".into());
        named.spec = Some(Default::default());
        named.spec.as_mut().unwrap().volume_name = Some("pv-1".into());
        assert_eq!(waiting(&named, "u1", "worker-1"), Waiting::Bound);
    }

    #[test]
    fn the_wait_doubles_to_the_cap_and_is_jittered_down_by_up_to_one_base() {
        let (b, m) = (Duration::from_secs(20), Duration::from_secs(60));
        assert_eq!(delay(b, m, 0, 0.0), Duration::from_secs(20));
        assert_eq!(delay(b, m, 0, 0.5), Duration::from_secs(10));
        assert_eq!(delay(b, m, 1, 0.0), Duration::from_secs(40));
        assert_eq!(delay(b, m, 1, 0.75), Duration::from_secs(25));
        assert_eq!(delay(b, m, 2, 0.0), Duration::from_secs(60));
        assert_eq!(delay(b, m, 2, 0.5), Duration::from_secs(50));
        assert_eq!(delay(b, m, 40, 0.0), Duration::from_secs(60));
        assert!(delay(b, m, 0, 0.999_999) > Duration::ZERO);
        // A cap under the base: never negative.
        assert_eq!(delay(b, Duration::from_secs(5), 0, 0.5), Duration::ZERO);
    }

    #[test]
    fn each_node_has_a_record_of_its_own_within_a_label_value() {
        assert_eq!(
            record_base("hostpath-csi-k8s-io", "worker-1"),
            "hostpath-csi-k8s-io-worker-1"
        );
        let long = "n".repeat(60);
        let a = record_base("hostpath-csi-k8s-io", &long);
        let b = record_base("hostpath-csi-k8s-io", &format!("{long}x"));
        assert!(a.len() <= 63 && b.len() <= 63, "{a} {b}");
        assert_ne!(a, b);
        assert!(a.starts_with("hostpath-csi-k8s-io-nnn"));
        let dotted = record_base(&format!("{}.", "a".repeat(53)), &long);
        assert!(!dotted.contains(".-"), "{dotted}");
    }

    #[test]
    fn the_local_objects_feed_the_topology_code() {
        let l = local(Some(&[("zone", "a"), ("node", "worker-1")]));
        let n = l.node_object();
        assert_eq!(n.metadata.name.as_deref(), Some("worker-1"));
        assert_eq!(n.metadata.labels.unwrap().len(), 2);
        let c = l.csinode_object("d.example");
        let entry = &c.spec.drivers[0];
        assert_eq!(entry.name, "d.example");
        assert_eq!(entry.node_id, "id-1");
        assert_eq!(
            entry.topology_keys.as_deref(),
            Some(&["node".to_owned(), "zone".to_owned()][..])
        );
        assert_eq!(
            local(None).csinode_object("d").spec.drivers[0].topology_keys,
            None
        );
    }

    fn affinity(terms: serde_json::Value) -> VolumeNodeAffinity {
        VolumeNodeAffinity {
            required: Some(NodeSelector {
                node_selector_terms: serde_json::from_value::<Vec<NodeSelectorTerm>>(terms)
                    .unwrap(),
            }),
        }
    }

    #[test]
    fn a_volume_is_deleted_by_the_node_its_affinity_selects() {
        let l = local(Some(&[("topology.hostpath.csi/node", "worker-1")]));
        let mine = affinity(json!([{"matchExpressions": [
            {"key": "topology.hostpath.csi/node", "operator": "In", "values": ["worker-1"]}]}]));
        let theirs = affinity(json!([{"matchExpressions": [
            {"key": "topology.hostpath.csi/node", "operator": "In", "values": ["worker-2"]}]}]));
        assert_eq!(on_this_node(Some(&mine), &l), Ok(true));
        assert_eq!(on_this_node(Some(&theirs), &l), Ok(false));
        // Terms are ORed, expressions ANDed.
        let either = affinity(json!([
            {"matchExpressions": [{"key": "topology.hostpath.csi/node", "operator": "In", "values": ["worker-2"]}]},
            {"matchExpressions": [{"key": "topology.hostpath.csi/node", "operator": "Exists"}]}]));
        assert_eq!(on_this_node(Some(&either), &l), Ok(true));
        let both = affinity(json!([{"matchExpressions": [
            {"key": "topology.hostpath.csi/node", "operator": "Exists"},
            {"key": "zone", "operator": "In", "values": ["a"]}]}]));
        assert_eq!(on_this_node(Some(&both), &l), Ok(false));
        let not = affinity(json!([{"matchExpressions": [
            {"key": "zone", "operator": "DoesNotExist"},
            {"key": "topology.hostpath.csi/node", "operator": "NotIn", "values": ["worker-2"]}]}]));
        assert_eq!(on_this_node(Some(&not), &l), Ok(true));
        // Fields never match the pseudo-node; an empty term matches nothing.
        let fields = affinity(json!([{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["worker-1"]}]}]));
        assert_eq!(on_this_node(Some(&fields), &l), Ok(false));
        assert_eq!(on_this_node(Some(&affinity(json!([{}]))), &l), Ok(false));
        // No affinity, no required selector, or no local topology: every node deletes.
        assert_eq!(on_this_node(None, &l), Ok(true));
        assert_eq!(
            on_this_node(Some(&VolumeNodeAffinity { required: None }), &l),
            Ok(true)
        );
        assert_eq!(on_this_node(Some(&theirs), &local(None)), Ok(true));
    }

    #[test]
    fn invalid_requirements_are_errors() {
        let l = local(Some(&[("n", "5")]));
        let gt = affinity(
            json!([{"matchExpressions": [{"key": "n", "operator": "Gt", "values": ["4"]}]}]),
        );
        assert_eq!(on_this_node(Some(&gt), &l), Ok(true));
        let lt = affinity(
            json!([{"matchExpressions": [{"key": "n", "operator": "Lt", "values": ["4"]}]}]),
        );
        assert_eq!(on_this_node(Some(&lt), &l), Ok(false));
        let bad = affinity(
            json!([{"matchExpressions": [{"key": "n", "operator": "Gt", "values": ["x"]}]}]),
        );
        assert!(
            on_this_node(Some(&bad), &l)
                .unwrap_err()
                .contains("integer")
        );
        let op = affinity(
            json!([{"matchExpressions": [{"key": "n", "operator": "Near", "values": ["x"]}]}]),
        );
        assert!(on_this_node(Some(&op), &l).unwrap_err().contains("Near"));
        let empty =
            affinity(json!([{"matchExpressions": [{"key": "n", "operator": "In", "values": []}]}]));
        assert!(on_this_node(Some(&empty), &l).is_err());
    }
}
