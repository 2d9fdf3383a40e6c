//! The CreateVolume accessibility requirements (`docs/upstream/upstream-external-provisioner.md` §8): where
//! the volume must be reachable (requisite) and where the scheduler would like it (preferred),
//! from the selected node, the StorageClass's `allowedTopologies` and the cluster's CSINodes
//! and Node labels. Pure: the objects come from a [`TopologySource`] (the watch caches).
//!
//! Upstream keeps a per-claim cache of keys, labels and terms between attempts; this module
//! computes every attempt afresh, which is what upstream's first attempt does.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, TopologySelectorTerm};
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use plugreg_proto::csi::v1::{Topology, TopologyRequirement};

use crate::classify::{ProvisionError, State};
use crate::secrets::go_quote;

/// The cluster objects topology reads: CSINodes and Nodes by name and in full.
pub trait TopologySource {
    /// The CSINode named `name` (a node's CSINode has the node's name).
    fn csinode(&self, name: &str) -> Option<Arc<CSINode>>;
    /// The Node named `name`.
    fn node(&self, name: &str) -> Option<Arc<Node>>;
    /// Every CSINode.
    fn csinodes(&self) -> Vec<Arc<CSINode>>;
    /// Every Node.
    fn nodes(&self) -> Vec<Arc<Node>>;
}

/// The prefix upstream puts on every error of this step.
const CONTEXT: &str = "error generating accessibility requirements";

/// One topology term: (key, value) segments sorted by key, then value.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Term(Vec<(String, String)>);

impl Term {
    fn new(mut segments: Vec<(String, String)>) -> Self {
        segments.sort();
        Term(segments)
    }

    /// Upstream's order: fewer segments first, then segment by segment.
    fn compare(&self, other: &Term) -> Ordering {
        self.0
            .len()
            .cmp(&other.0.len())
            .then_with(|| self.0.cmp(&other.0))
    }

    /// Whether every segment of `self` is in `other`, walking both in key order (as upstream:
    /// a segment of `other` with the same key but another value fails at once).
    fn subset_of(&self, other: &Term) -> bool {
        if self.0.is_empty() {
            return true;
        }
        let mut j = 0;
        for (key, value) in &other.0 {
            let (k1, v1) = &self.0[j];
            if k1 != key {
                continue;
            }
            if v1 != value {
                return false;
            }
            j += 1;
            if j == self.0.len() {
                return true;
            }
        }
        false
    }

    fn to_csi(&self) -> Topology {
        Topology {
            segments: self.0.iter().cloned().collect::<HashMap<_, _>>(),
        }
    }

    /// Go's `%v` of the term: `[{zone z1} {rack r1}]`.
    fn go_fmt(&self) -> String {
        let parts: Vec<String> = self.0.iter().map(|(k, v)| format!("{{{k} {v}}}")).collect();
        format!("[{}]", parts.join(" "))
    }
}

/// Go's `%v` of a list of terms: `[[{zone z1}] [{zone z2}]]`.
fn go_fmt_terms(terms: &[Term]) -> String {
    let parts: Vec<String> = terms.iter().map(Term::go_fmt).collect();
    format!("[{}]", parts.join(" "))
}

/// Go's `%v` of a string list: `[a b]`.
fn go_fmt_list(items: &[String]) -> String {
    format!("[{}]", items.join(" "))
}

/// The topology keys the driver registered in this CSINode (empty when none).
fn topology_keys(csinode: &CSINode, driver: &str) -> Vec<String> {
    csinode
        .spec
        .drivers
        .iter()
        .find(|d| d.name == driver)
        .and_then(|d| d.topology_keys.clone())
        .unwrap_or_default()
}

/// The node's term for `keys`, or `None` when a label is missing.
fn node_term(node: &Node, keys: &[String]) -> Option<Term> {
    let labels = node.metadata.labels.as_ref();
    let segments = keys
        .iter()
        .map(|k| Some((k.clone(), labels?.get(k)?.clone())))
        .collect::<Option<Vec<_>>>()?;
    Some(Term::new(segments))
}

/// The most topology segments (key-value pairs, summed over all terms) `allowedTopologies` may
/// expand to. Each selector term expands to the product of its expressions' value counts, so a
/// few dozen expressions of two values each would be more terms than memory holds (upstream
/// tries, and runs out of memory). Real classes list a few zones or racks; 16,384 segments of
/// typical length keep the requisite and preferred lists of a CreateVolume near 1 MiB, well
/// inside a driver's default 4 MiB message limit.
pub const MAX_ALLOWED_SEGMENTS: usize = 16_384;

/// `allowedTopologies` expands to more than [`MAX_ALLOWED_SEGMENTS`] segments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "allowedTopologies expands to more than {MAX_ALLOWED_SEGMENTS} topology segments (each term is the product of its matchLabelExpressions' values: 3 expressions of 2 values are 8 combinations of 3 segments); list fewer values or expressions"
)]
pub struct TooManySegments;

/// How many segments [`flatten`] would make, computed with checked arithmetic and nothing
/// allocated, or [`TooManySegments`] past the bound.
fn flattened_segments(allowed: &[TopologySelectorTerm]) -> Result<usize, TooManySegments> {
    let mut total: usize = 0;
    for selector in allowed {
        // The terms so far of this selector: how many, and how many segments each.
        let (mut count, mut width) = (0usize, 0usize);
        for expr in selector.match_label_expressions.iter().flatten() {
            let values = expr.values.len();
            if values == 0 {
                // No values: no terms, and the next expression starts afresh (as upstream).
                (count, width) = (0, 0);
            } else if count == 0 {
                (count, width) = (values, 1);
            } else {
                count = count.checked_mul(values).ok_or(TooManySegments)?;
                width += 1;
            }
            if count.saturating_mul(width) > MAX_ALLOWED_SEGMENTS {
                return Err(TooManySegments);
            }
        }
        total = total
            .checked_add(count * width)
            .filter(|t| *t <= MAX_ALLOWED_SEGMENTS)
            .ok_or(TooManySegments)?;
    }
    Ok(total)
}

/// `allowedTopologies` distributed into terms: per selector term, the cartesian product of its
/// expressions' values (in upstream's order: later expressions vary slowest), or
/// [`TooManySegments`] before anything is allocated.
fn flatten(allowed: &[TopologySelectorTerm]) -> Result<Vec<Term>, TooManySegments> {
    flattened_segments(allowed)?;
    let mut out = Vec::new();
    for selector in allowed {
        let mut terms: Vec<Vec<(String, String)>> = Vec::new();
        for expr in selector.match_label_expressions.iter().flatten() {
            let mut next = Vec::new();
            for value in &expr.values {
                if terms.is_empty() {
                    next.push(vec![(expr.key.clone(), value.clone())]);
                } else {
                    for old in &terms {
                        let mut t = old.clone();
                        t.push((expr.key.clone(), value.clone()));
                        next.push(t);
                    }
                }
            }
            terms = next;
        }
        out.extend(terms.into_iter().map(Term::new));
    }
    Ok(out)
}

/// 32-bit FNV-1 (multiply, then xor; not FNV-1a), as Go's `hash/fnv.New32`.
fn fnv1_32(data: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in data {
        h = h.wrapping_mul(0x0100_0193);
        h ^= u32::from(*b);
    }
    h
}

/// The StatefulSet spreading offset of a claim name: `(hash, index)` as upstream's
/// `getPVCNameHashAndIndexOffset`. For `claim-set-3` it hashes `set` and returns index 3, so
/// the replicas of one set rotate through the terms and a pod's claims share one.
fn name_hash_and_index(claim_name: &str) -> (u32, u32) {
    let mut base = claim_name;
    let mut index = 0;
    if let Some(dash) = claim_name.rfind('-') {
        let suffix = &claim_name[dash + 1..];
        // Go's strconv.ParseUint(s, 10, 32): decimal digits only, no sign.
        if !suffix.is_empty()
            && suffix.bytes().all(|b| b.is_ascii_digit())
            && let Ok(i) = suffix.parse::<u32>()
        {
            index = i;
            base = &claim_name[..dash];
            if let Some(d2) = base.rfind('-') {
                base = &base[d2 + 1..];
            }
        }
    }
    // Upstream hashes a random number for an empty name; claims always have names, and a
    // fixed value keeps this pure.
    (fnv1_32(base.as_bytes()), index)
}

fn no_change(message: String) -> ProvisionError {
    ProvisionError::new(State::NoChange, format!("{CONTEXT}: {message}"))
}

/// The accessibility requirements of a CreateVolume (§8), or `None` for "no requirement".
/// Call it only when topology is supported (plugin capability VOLUME_ACCESSIBILITY_CONSTRAINTS
/// and the `Topology` gate).
///
/// Errors carry upstream's full text, `error generating accessibility requirements: …`, and are
/// no-change, except a missing CSINode of the selected node: [`State::Reschedule`] (the
/// scheduler should pick another node).
pub fn requirements(
    claim_name: &str,
    selected_node: Option<&str>,
    class: &StorageClass,
    driver: &str,
    strict: bool,
    immediate: bool,
    src: &dyn TopologySource,
) -> Result<Option<TopologyRequirement>, ProvisionError> {
    let allowed = class.allowed_topologies.as_deref().unwrap_or_default();
    let selected_node = selected_node.filter(|n| !n.is_empty());
    let mut keys: Vec<String> = Vec::new();
    let mut selected_term = Term(Vec::new());
    let mut requisite: Vec<Term> = Vec::new();

    // 1. The selected node's keys and term.
    if let Some(node_name) = selected_node {
        let Some(csinode) = src.csinode(node_name) else {
            return Err(ProvisionError::new(
                State::Reschedule,
                format!(
                    "{CONTEXT}: failed to get selected CSINode {node_name}: csinode.storage.k8s.io \"{node_name}\" not found"
                ),
            ));
        };
        keys = topology_keys(&csinode, driver);
        if keys.is_empty() {
            return Err(no_change(format!(
                "no topology key found for node {node_name}"
            )));
        }
        // A missing Node or label is no-change (upstream prints the labels it failed on as
        // `map[]` in both cases).
        selected_term = src
            .node(node_name)
            .and_then(|n| node_term(&n, &keys))
            .ok_or_else(|| {
                no_change(format!(
                    "topology labels from selected node map[] does not match topology keys from CSINode {}",
                    go_fmt_list(&keys)
                ))
            })?;
        if strict {
            if !allowed.is_empty() {
                let flat = flatten(allowed).map_err(|e| no_change(e.to_string()))?;
                if !flat.iter().any(|t| t.subset_of(&selected_term)) {
                    return Err(no_change(format!(
                        "selected node '{}' topology '{}' is not in allowed topologies: {}",
                        go_quote(node_name),
                        selected_term.go_fmt(),
                        go_fmt_terms(&flat)
                    )));
                }
            }
            requisite.push(selected_term.clone());
        }
    }

    // 2. The requisite terms.
    if requisite.is_empty() {
        if !allowed.is_empty() {
            requisite = flatten(allowed).map_err(|e| no_change(e.to_string()))?;
        } else {
            if selected_node.is_none() && !immediate {
                return Ok(None);
            }
            requisite = aggregate(selected_node.is_some(), keys, driver, src)?;
        }
    }

    // 3. Sorted, without duplicates; empty terms never reach the driver.
    if requisite.is_empty() {
        return Ok(None);
    }
    requisite.sort_by(Term::compare);
    requisite.dedup();

    // 4. The preferred order.
    let preferred: Vec<Term> = match selected_node {
        None => {
            let (hash, index) = name_hash_and_index(claim_name);
            let n = requisite.len() as u32;
            let first = (hash.wrapping_add(index) % n) as usize;
            rotate(&requisite, first)
        }
        Some(_) if strict => requisite.clone(),
        Some(node_name) => {
            let Some(first) = requisite.iter().position(|t| t.subset_of(&selected_term)) else {
                return Err(no_change(format!(
                    "topology {} from selected node {} is not in requisite: {}",
                    selected_term.go_fmt(),
                    go_quote(node_name),
                    go_fmt_terms(&requisite)
                )));
            };
            rotate(&requisite, first)
        }
    };

    let to_csi = |terms: &[Term]| {
        terms
            .iter()
            .filter(|t| !t.0.is_empty())
            .map(Term::to_csi)
            .collect::<Vec<_>>()
    };
    Ok(Some(TopologyRequirement {
        requisite: to_csi(&requisite),
        preferred: to_csi(&preferred),
    }))
}

fn rotate(terms: &[Term], first: usize) -> Vec<Term> {
    let mut out = terms[first..].to_vec();
    out.extend_from_slice(&terms[..first]);
    out
}

/// The cluster's terms for the driver's keys: the selected node's keys (late binding) or the
/// first CSINode's that has keys for the driver (immediate binding; the source's order stands
/// in for upstream's shuffle), then one term per Node that has every key.
fn aggregate(
    late_binding: bool,
    mut keys: Vec<String>,
    driver: &str,
    src: &dyn TopologySource,
) -> Result<Vec<Term>, ProvisionError> {
    if !late_binding {
        keys = src
            .csinodes()
            .iter()
            .map(|c| topology_keys(c, driver))
            .find(|k| !k.is_empty())
            .unwrap_or_default();
        if keys.is_empty() {
            tracing::warn!("No topology keys found on any node");
            return Err(no_change("no available topology found".to_owned()));
        }
    }
    let terms: Vec<Term> = src
        .nodes()
        .iter()
        .filter_map(|n| node_term(n, &keys))
        .filter(|t| !t.0.is_empty())
        .collect();
    if terms.is_empty() {
        let mut text = String::new();
        let _ = write!(
            text,
            "topologyKeys {} were not found on any nodes",
            go_fmt_list(&keys)
        );
        return Err(no_change(text));
    }
    Ok(terms)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::TopologySelectorLabelRequirement;
    use k8s_openapi::api::storage::v1::{CSINodeDriver, CSINodeSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use std::collections::BTreeMap;

    pub(crate) const DRIVER: &str = "csi.example.com";

    /// The cluster as plain lists: the input of a pure function, not a stand-in for a server.
    #[derive(Default)]
    pub(crate) struct Cluster {
        pub csinodes: Vec<Arc<CSINode>>,
        pub nodes: Vec<Arc<Node>>,
    }

    impl Cluster {
        /// A node with labels and a CSINode registering `keys` for [`DRIVER`].
        pub(crate) fn with_node(
            mut self,
            name: &str,
            labels: &[(&str, &str)],
            keys: &[&str],
        ) -> Self {
            self.nodes.push(Arc::new(Node {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    labels: Some(
                        labels
                            .iter()
                            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                            .collect(),
                    ),
                    ..Default::default()
                },
                ..Default::default()
            }));
            self.csinodes.push(Arc::new(CSINode {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    ..Default::default()
                },
                spec: CSINodeSpec {
                    drivers: vec![CSINodeDriver {
                        name: DRIVER.into(),
                        node_id: name.into(),
                        topology_keys: Some(keys.iter().map(|k| (*k).to_owned()).collect()),
                        ..Default::default()
                    }],
                },
            }));
            self
        }
    }

    impl TopologySource for Cluster {
        fn csinode(&self, name: &str) -> Option<Arc<CSINode>> {
            self.csinodes
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(name))
                .cloned()
        }
        fn node(&self, name: &str) -> Option<Arc<Node>> {
            self.nodes
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(name))
                .cloned()
        }
        fn csinodes(&self) -> Vec<Arc<CSINode>> {
            self.csinodes.clone()
        }
        fn nodes(&self) -> Vec<Arc<Node>> {
            self.nodes.clone()
        }
    }

    /// Three zones, one node each.
    fn zones() -> Cluster {
        Cluster::default()
            .with_node("n1", &[("zone", "z1")], &["zone"])
            .with_node("n2", &[("zone", "z2")], &["zone"])
            .with_node("n3", &[("zone", "z3")], &["zone"])
    }

    fn class(allowed: &[&[(&str, &[&str])]]) -> StorageClass {
        StorageClass {
            provisioner: DRIVER.into(),
            allowed_topologies: (!allowed.is_empty()).then(|| {
                allowed
                    .iter()
                    .map(|exprs| TopologySelectorTerm {
                        match_label_expressions: Some(
                            exprs
                                .iter()
                                .map(|(k, vs)| TopologySelectorLabelRequirement {
                                    key: (*k).into(),
                                    values: vs.iter().map(|v| (*v).to_owned()).collect(),
                                })
                                .collect(),
                        ),
                    })
                    .collect()
            }),
            ..Default::default()
        }
    }

    /// A topology list as sorted (key, value) lists, for comparing.
    fn terms(list: &[Topology]) -> Vec<Vec<(String, String)>> {
        list.iter()
            .map(|t| {
                t.segments
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect::<BTreeMap<_, _>>()
                    .into_iter()
                    .collect()
            })
            .collect()
    }

    fn t(segs: &[(&str, &str)]) -> Vec<(String, String)> {
        segs.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn req(
        claim: &str,
        node: Option<&str>,
        class: &StorageClass,
        strict: bool,
        immediate: bool,
        src: &Cluster,
    ) -> Result<Option<TopologyRequirement>, ProvisionError> {
        requirements(claim, node, class, DRIVER, strict, immediate, src)
    }

    #[test]
    fn fnv1_is_not_fnv1a() {
        // Reference values of 32-bit FNV-1: "" is the offset basis, "a" = 0x050c5d7e
        // (FNV-1a would give 0xe40c292c).
        assert_eq!(fnv1_32(b""), 0x811c9dc5);
        assert_eq!(fnv1_32(b"a"), 0x050c5d7e);
        assert_eq!(fnv1_32(b"foobar"), 0x31f0b262);
    }

    #[test]
    fn statefulset_names_hash_the_set_and_offset_by_the_index() {
        assert_eq!(name_hash_and_index("data-web-2"), (fnv1_32(b"web"), 2));
        assert_eq!(name_hash_and_index("web-7"), (fnv1_32(b"web"), 7));
        assert_eq!(name_hash_and_index("my-claim"), (fnv1_32(b"my-claim"), 0));
        assert_eq!(name_hash_and_index("claim-+1"), (fnv1_32(b"claim-+1"), 0));
        assert_eq!(
            name_hash_and_index("c-4294967296"),
            (fnv1_32(b"c-4294967296"), 0),
            "beyond u32 is not an index"
        );
        assert_eq!(name_hash_and_index("plain"), (fnv1_32(b"plain"), 0));
    }

    /// Row 1: late binding, strict: requisite = preferred = the selected node's term.
    #[test]
    fn late_strict_uses_only_the_selected_nodes_term() {
        let r = req("c", Some("n2"), &class(&[]), true, true, &zones())
            .unwrap()
            .unwrap();
        assert_eq!(terms(&r.requisite), [t(&[("zone", "z2")])]);
        assert_eq!(terms(&r.preferred), [t(&[("zone", "z2")])]);
        // Must lie inside allowedTopologies.
        let allowed = class(&[&[("zone", &["z1", "z2"])]]);
        let r = req("c", Some("n2"), &allowed, true, true, &zones())
            .unwrap()
            .unwrap();
        assert_eq!(terms(&r.requisite), [t(&[("zone", "z2")])]);
        let e = req("c", Some("n3"), &allowed, true, true, &zones()).unwrap_err();
        assert_eq!(e.state, State::NoChange);
        assert_eq!(
            e.message,
            "error generating accessibility requirements: selected node '\"n3\"' topology '[{zone z3}]' is not in allowed topologies: [[{zone z1}] [{zone z2}]]"
        );
    }

    /// Row 2: late binding, not strict, no allowedTopologies: the cluster's terms, the node's
    /// first.
    #[test]
    fn late_without_allowed_aggregates_with_the_node_first() {
        for immediate in [true, false] {
            let r = req("c", Some("n2"), &class(&[]), false, immediate, &zones())
                .unwrap()
                .unwrap();
            assert_eq!(
                terms(&r.requisite),
                [
                    t(&[("zone", "z1")]),
                    t(&[("zone", "z2")]),
                    t(&[("zone", "z3")])
                ]
            );
            assert_eq!(
                terms(&r.preferred),
                [
                    t(&[("zone", "z2")]),
                    t(&[("zone", "z3")]),
                    t(&[("zone", "z1")])
                ]
            );
        }
    }

    /// Row 3: late binding, not strict, allowedTopologies: the flattened terms, the first one
    /// inside the node's term first.
    #[test]
    fn late_with_allowed_rotates_to_the_nodes_term() {
        let cluster = Cluster::default().with_node(
            "n1",
            &[("zone", "z1"), ("rack", "r1")],
            &["zone", "rack"],
        );
        let allowed = class(&[&[("zone", &["z1", "z2"]), ("rack", &["r1", "r2"])]]);
        let r = req("c", Some("n1"), &allowed, false, true, &cluster)
            .unwrap()
            .unwrap();
        let rz = |r: &str, z: &str| t(&[("rack", r), ("zone", z)]);
        assert_eq!(
            terms(&r.requisite),
            [
                rz("r1", "z1"),
                rz("r1", "z2"),
                rz("r2", "z1"),
                rz("r2", "z2")
            ]
        );
        assert_eq!(
            terms(&r.preferred),
            [
                rz("r1", "z1"),
                rz("r1", "z2"),
                rz("r2", "z1"),
                rz("r2", "z2")
            ]
        );
        let cluster = Cluster::default().with_node(
            "n2",
            &[("zone", "z2"), ("rack", "r1")],
            &["zone", "rack"],
        );
        let r = req("c", Some("n2"), &allowed, false, true, &cluster)
            .unwrap()
            .unwrap();
        assert_eq!(terms(&r.preferred)[0], rz("r1", "z2"));
        // A node outside every allowed term.
        let cluster = Cluster::default().with_node(
            "n9",
            &[("zone", "z9"), ("rack", "r1")],
            &["zone", "rack"],
        );
        let e = req("c", Some("n9"), &allowed, false, true, &cluster).unwrap_err();
        assert_eq!(
            e.message,
            "error generating accessibility requirements: topology [{rack r1} {zone z9}] from selected node \"n9\" is not in requisite: [[{rack r1} {zone z1}] [{rack r1} {zone z2}] [{rack r2} {zone z1}] [{rack r2} {zone z2}]]"
        );
    }

    /// Row 4: immediate binding with allowedTopologies: flattened, rotated by the name hash.
    #[test]
    fn immediate_with_allowed_rotates_by_name_hash() {
        let allowed = class(&[&[("zone", &["z3", "z1"])], &[("zone", &["z2", "z1"])]]);
        for immediate in [true, false] {
            let r = req("data-web-0", None, &allowed, false, immediate, &zones())
                .unwrap()
                .unwrap();
            // Sorted and deduplicated.
            assert_eq!(
                terms(&r.requisite),
                [
                    t(&[("zone", "z1")]),
                    t(&[("zone", "z2")]),
                    t(&[("zone", "z3")])
                ]
            );
            let first = (fnv1_32(b"web") % 3) as usize;
            let zones = ["z1", "z2", "z3"];
            assert_eq!(terms(&r.preferred)[0], t(&[("zone", zones[first])]));
        }
    }

    /// Row 5: immediate binding, no allowedTopologies, --immediate-topology: the cluster's
    /// terms; StatefulSet replicas spread over them.
    #[test]
    fn immediate_aggregates_and_spreads_statefulset_replicas() {
        let firsts: Vec<Vec<(String, String)>> = (0..3)
            .map(|i| {
                let r = req(
                    &format!("data-web-{i}"),
                    None,
                    &class(&[]),
                    false,
                    true,
                    &zones(),
                )
                .unwrap()
                .unwrap();
                assert_eq!(r.requisite.len(), 3);
                assert_eq!(r.preferred.len(), 3);
                terms(&r.preferred)[0].clone()
            })
            .collect();
        let mut distinct = firsts.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 3, "three replicas, three zones: {firsts:?}");
        // Another claim of the same replica shares its zone.
        let logs = req("logs-web-1", None, &class(&[]), false, true, &zones())
            .unwrap()
            .unwrap();
        assert_eq!(terms(&logs.preferred)[0], firsts[1]);
    }

    /// Row 6: immediate binding, no allowedTopologies, --immediate-topology=false: no
    /// requirement.
    #[test]
    fn immediate_without_immediate_topology_sets_nothing() {
        assert_eq!(
            req("c", None, &class(&[]), false, false, &zones()).unwrap(),
            None
        );
        assert_eq!(
            req("c", None, &class(&[]), true, false, &zones()).unwrap(),
            None
        );
    }

    #[test]
    fn missing_csinode_of_the_selected_node_reschedules() {
        let e = req("c", Some("gone"), &class(&[]), false, true, &zones()).unwrap_err();
        assert_eq!(e.state, State::Reschedule);
        assert_eq!(
            e.message,
            "error generating accessibility requirements: failed to get selected CSINode gone: csinode.storage.k8s.io \"gone\" not found"
        );
    }

    #[test]
    fn missing_node_or_label_is_retried_without_reschedule() {
        let mut cluster = zones();
        cluster
            .nodes
            .retain(|n| n.metadata.name.as_deref() != Some("n1"));
        let e = req("c", Some("n1"), &class(&[]), false, true, &cluster).unwrap_err();
        assert_eq!(e.state, State::NoChange);
        assert_eq!(
            e.message,
            "error generating accessibility requirements: topology labels from selected node map[] does not match topology keys from CSINode [zone]"
        );
        let cluster = Cluster::default().with_node("n1", &[("other", "x")], &["zone"]);
        let e = req("c", Some("n1"), &class(&[]), false, true, &cluster).unwrap_err();
        assert_eq!(e.state, State::NoChange);
        assert!(
            e.message
                .ends_with("does not match topology keys from CSINode [zone]")
        );
    }

    #[test]
    fn selected_node_without_keys_is_retried() {
        let cluster = Cluster::default().with_node("n1", &[("zone", "z1")], &[]);
        let e = req("c", Some("n1"), &class(&[]), false, true, &cluster).unwrap_err();
        assert_eq!(e.state, State::NoChange);
        assert_eq!(
            e.message,
            "error generating accessibility requirements: no topology key found for node n1"
        );
    }

    #[test]
    fn no_keys_anywhere_or_no_labelled_node_is_retried() {
        let cluster = Cluster::default().with_node("n1", &[("zone", "z1")], &[]);
        let e = req("c", None, &class(&[]), false, true, &cluster).unwrap_err();
        assert_eq!(
            (e.state, e.message.as_str()),
            (
                State::NoChange,
                "error generating accessibility requirements: no available topology found"
            )
        );
        let cluster = Cluster::default().with_node("n1", &[("other", "z1")], &["zone", "rack"]);
        let e = req("c", None, &class(&[]), false, true, &cluster).unwrap_err();
        assert_eq!(
            (e.state, e.message.as_str()),
            (
                State::NoChange,
                "error generating accessibility requirements: topologyKeys [zone rack] were not found on any nodes"
            )
        );
    }

    #[test]
    fn nodes_without_every_key_are_left_out_of_the_aggregate() {
        let cluster = zones().with_node("half", &[("rack", "r1")], &["zone"]);
        let r = req("c", None, &class(&[]), false, true, &cluster)
            .unwrap()
            .unwrap();
        assert_eq!(r.requisite.len(), 3);
    }

    #[test]
    fn allowed_terms_without_values_mean_no_requirement() {
        let empty = class(&[&[("zone", &[])]]);
        assert_eq!(req("c", None, &empty, false, true, &zones()).unwrap(), None);
    }

    /// A class whose one selector term has `exprs` expressions of `values` values each.
    fn product_class(exprs: usize, values: usize) -> StorageClass {
        StorageClass {
            provisioner: DRIVER.into(),
            allowed_topologies: Some(vec![TopologySelectorTerm {
                match_label_expressions: Some(
                    (0..exprs)
                        .map(|e| TopologySelectorLabelRequirement {
                            key: format!("example.com/k{e}"),
                            values: (0..values).map(|v| format!("v{v}")).collect(),
                        })
                        .collect(),
                ),
            }]),
            ..Default::default()
        }
    }

    /// 64 expressions of 2 values are 2^64 terms: refused with a clear error before anything is
    /// allocated, on every path that expands allowedTopologies (immediate binding, late
    /// binding, strict).
    #[test]
    fn a_cartesian_product_past_the_bound_is_refused() {
        let huge = product_class(64, 2);
        let cluster =
            Cluster::default().with_node("n1", &[("example.com/k0", "v0")], &["example.com/k0"]);
        let want = format!(
            "error generating accessibility requirements: allowedTopologies expands to more than {MAX_ALLOWED_SEGMENTS} topology segments (each term is the product of its matchLabelExpressions' values: 3 expressions of 2 values are 8 combinations of 3 segments); list fewer values or expressions"
        );
        for (node, strict) in [(None, false), (Some("n1"), false), (Some("n1"), true)] {
            let e = req("c", node, &huge, strict, true, &cluster).unwrap_err();
            assert_eq!(
                (e.state, e.message.as_str()),
                (State::NoChange, want.as_str())
            );
        }
        // usize overflow of the count itself.
        assert_eq!(
            flatten(&product_class(200, 3).allowed_topologies.unwrap()),
            Err(TooManySegments)
        );
    }

    #[test]
    fn the_bound_counts_segments_of_every_term() {
        let allowed = |c: StorageClass| c.allowed_topologies.unwrap();
        // One expression: one segment per value.
        assert_eq!(
            flattened_segments(&allowed(product_class(1, MAX_ALLOWED_SEGMENTS))),
            Ok(MAX_ALLOWED_SEGMENTS)
        );
        assert_eq!(
            flattened_segments(&allowed(product_class(1, MAX_ALLOWED_SEGMENTS + 1))),
            Err(TooManySegments)
        );
        // 64 x 64 = 4096 terms of 2 segments; 2^14 terms of 14 segments are past the bound.
        assert_eq!(
            flattened_segments(&allowed(product_class(2, 1 << 6))),
            Ok((1 << 12) * 2)
        );
        assert_eq!(
            flattened_segments(&allowed(product_class(14, 2))),
            Err(TooManySegments)
        );
        assert_eq!(
            flattened_segments(&allowed(product_class(10, 2))),
            Ok(1024 * 10)
        );
        // Terms add up across selector terms.
        let mut two = allowed(product_class(1, MAX_ALLOWED_SEGMENTS / 2));
        two.extend(two.clone());
        assert_eq!(flattened_segments(&two), Ok(MAX_ALLOWED_SEGMENTS));
        two.extend(allowed(product_class(1, 1)));
        assert_eq!(flattened_segments(&two), Err(TooManySegments));
        // The count matches what flatten makes.
        for (e, v) in [(1, 3), (3, 2), (4, 5), (0, 0), (2, 0)] {
            let a = allowed(product_class(e, v));
            let made: usize = flatten(&a).unwrap().iter().map(|t| t.0.len()).sum();
            assert_eq!(flattened_segments(&a), Ok(made), "{e} x {v}");
        }
    }

    #[test]
    fn terms_sort_by_length_then_segments() {
        let a = Term::new(t(&[("zone", "z2")]));
        let b = Term::new(t(&[("zone", "z1"), ("rack", "r1")]));
        let c = Term::new(t(&[("zone", "z1")]));
        let mut v = vec![b.clone(), a.clone(), c.clone()];
        v.sort_by(Term::compare);
        assert_eq!(v, [c, a, b]);
    }
}
