//! The checks behind the `topology` fuzz target and its property test: the CreateVolume
//! accessibility requirements (`plugreg_provisioner::topology::requirements`) from a
//! StorageClass's `allowedTopologies`, the selected node and the cluster's Nodes and CSINodes.
//!
//! Shared by `tests/props.rs` (arbtest, in the normal suite) and `fuzz/fuzz_targets/topology.rs`
//! (libFuzzer), which include this file with `#[path]`; the including crate provides
//! `crate::arbitrary` (the `arbitrary` crate).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::arbitrary::{Result, Unstructured};
use k8s_openapi::api::core::v1::{Node, TopologySelectorLabelRequirement, TopologySelectorTerm};
use k8s_openapi::api::storage::v1::{CSINode, CSINodeDriver, CSINodeSpec, StorageClass};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use plugreg_provisioner::classify::State;
use plugreg_provisioner::topology::{self, MAX_ALLOWED_SEGMENTS, TooManySegments, TopologySource};

const DRIVER: &str = "csi.example.com";
const KEYS: [&str; 4] = ["zone", "rack", "example.com/k", ""];
const VALUES: [&str; 4] = ["z1", "z2", "r1", ""];

/// The cluster as plain lists.
#[derive(Debug, Default)]
pub struct Cluster {
    csinodes: Vec<Arc<CSINode>>,
    nodes: Vec<Arc<Node>>,
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

fn key(u: &mut Unstructured) -> Result<String> {
    Ok(if u.ratio(1, 10)? {
        u.arbitrary()?
    } else {
        (*u.choose(&KEYS)?).to_owned()
    })
}

fn value(u: &mut Unstructured) -> Result<String> {
    Ok(if u.ratio(1, 10)? {
        u.arbitrary()?
    } else {
        (*u.choose(&VALUES)?).to_owned()
    })
}

/// Up to three nodes `n0`..`n2`, each maybe with a CSINode, labels and keys.
fn cluster(u: &mut Unstructured) -> Result<Cluster> {
    let mut c = Cluster::default();
    for i in 0..u.int_in_range(0..=3)? {
        let name = format!("n{i}");
        if u.ratio(4, 5)? {
            let labels: BTreeMap<String, String> = (0..u.int_in_range(0..=3)?)
                .map(|_| Ok((key(u)?, value(u)?)))
                .collect::<Result<_>>()?;
            c.nodes.push(Arc::new(Node {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    labels: Some(labels),
                    ..Default::default()
                },
                ..Default::default()
            }));
        }
        if u.ratio(4, 5)? {
            let keys = (0..u.int_in_range(0..=3)?)
                .map(|_| key(u))
                .collect::<Result<Vec<_>>>()?;
            c.csinodes.push(Arc::new(CSINode {
                metadata: ObjectMeta {
                    name: Some(name),
                    ..Default::default()
                },
                spec: CSINodeSpec {
                    drivers: vec![CSINodeDriver {
                        name: if u.ratio(9, 10)? {
                            DRIVER.into()
                        } else {
                            "other".into()
                        },
                        node_id: "id".into(),
                        topology_keys: Some(keys),
                        ..Default::default()
                    }],
                },
            }));
        }
    }
    Ok(c)
}

/// `allowedTopologies`: small and varied, or one selector term of many expressions (the
/// cartesian product past the bound).
fn allowed(u: &mut Unstructured) -> Result<Vec<TopologySelectorTerm>> {
    let big = u.ratio(1, 4)?;
    let terms = if big {
        u.int_in_range(1..=3)?
    } else {
        u.int_in_range(0..=3)?
    };
    (0..terms)
        .map(|_| {
            let exprs = if big {
                u.int_in_range(0..=70)?
            } else {
                u.int_in_range(0..=4)?
            };
            let exprs = (0..exprs)
                .map(|e| {
                    let n = if big && u.ratio(1, 8)? {
                        u.int_in_range(0..=MAX_ALLOWED_SEGMENTS + 2)?
                    } else {
                        u.int_in_range(0..=3)?
                    };
                    Ok(TopologySelectorLabelRequirement {
                        key: if big { format!("k{e}") } else { key(u)? },
                        values: (0..n)
                            .map(|i| if big { Ok(format!("v{i}")) } else { value(u) })
                            .collect::<Result<_>>()?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(TopologySelectorTerm {
                match_label_expressions: (!exprs.is_empty() || u.arbitrary()?).then_some(exprs),
            })
        })
        .collect()
}

/// How many segments the expansion makes, as upstream's algorithm runs (an expression without
/// values empties the term and the next starts afresh), saturating; and the largest count of
/// any step on the way.
fn expansion(allowed: &[TopologySelectorTerm]) -> (u128, u128) {
    let (mut total, mut peak) = (0u128, 0u128);
    for t in allowed {
        let (mut count, mut width) = (0u128, 0u128);
        for e in t.match_label_expressions.iter().flatten() {
            let n = e.values.len() as u128;
            if n == 0 {
                (count, width) = (0, 0);
            } else if count == 0 {
                (count, width) = (n, 1);
            } else {
                count = count.saturating_mul(n);
                width += 1;
            }
            peak = peak.max(count.saturating_mul(width));
        }
        total = total.saturating_add(count.saturating_mul(width));
    }
    (total, peak)
}

/// The property: never a panic; past the bound, the bound's error wherever allowedTopologies is
/// expanded; otherwise a requirement whose preferred terms are its requisite terms reordered,
/// without duplicates or empty terms, and within the bound when made from allowedTopologies.
pub fn check(u: &mut Unstructured) -> Result<()> {
    let cluster = cluster(u)?;
    let allowed = allowed(u)?;
    let selected = match u.int_in_range(0u8..=4)? {
        0 => None,
        1 => Some(String::new()),
        2 => Some("gone".to_owned()),
        _ => Some(format!("n{}", u.int_in_range(0..=2)?)),
    };
    let strict: bool = u.arbitrary()?;
    let immediate: bool = u.arbitrary()?;
    let claim = *u.choose(&["data", "data-web-3", "web-4294967296", "-", ""])?;
    let class = StorageClass {
        provisioner: DRIVER.into(),
        allowed_topologies: (!allowed.is_empty() || u.arbitrary()?).then(|| allowed.clone()),
        ..Default::default()
    };

    let got = topology::requirements(
        claim,
        selected.as_deref(),
        &class,
        DRIVER,
        strict,
        immediate,
        &cluster,
    );

    // Whether the call gets as far as expanding allowedTopologies: the selected node (if any)
    // must have a CSINode with keys for the driver and a Node with every key's label.
    let node = selected.as_deref().filter(|n| !n.is_empty());
    let reaches = !allowed.is_empty()
        && node.is_none_or(|n| {
            let keys: Vec<String> = cluster
                .csinode(n)
                .and_then(|c| {
                    c.spec
                        .drivers
                        .iter()
                        .find(|d| d.name == DRIVER)
                        .and_then(|d| d.topology_keys.clone())
                })
                .unwrap_or_default();
            let labels = cluster.node(n).and_then(|n| n.metadata.labels.clone());
            !keys.is_empty() && labels.is_some_and(|l| keys.iter().all(|k| l.contains_key(k)))
        });
    let (total, peak) = expansion(&allowed);
    let over = total > MAX_ALLOWED_SEGMENTS as u128 || peak > MAX_ALLOWED_SEGMENTS as u128;
    let bound_error = format!("error generating accessibility requirements: {TooManySegments}");

    match &got {
        Err(e) if e.message == bound_error => {
            assert!(
                reaches && over,
                "bound error for {total} segments (peak {peak})"
            );
            assert_eq!(e.state, State::NoChange);
        }
        _ if reaches && over => panic!("{total} segments (peak {peak}) expanded: {got:?}"),
        Err(e) => {
            assert!(
                e.message
                    .starts_with("error generating accessibility requirements: "),
                "{e:?}"
            );
            assert!(matches!(e.state, State::NoChange | State::Reschedule));
        }
        Ok(None) => {}
        Ok(Some(req)) => {
            let sorted = |list: &[plugreg_proto::csi::v1::Topology]| {
                let mut v: Vec<BTreeMap<String, String>> = list
                    .iter()
                    .map(|t| t.segments.clone().into_iter().collect())
                    .collect();
                v.sort();
                v
            };
            let requisite = sorted(&req.requisite);
            assert_eq!(
                requisite,
                sorted(&req.preferred),
                "preferred is the requisite reordered"
            );
            assert!(requisite.iter().all(|t| !t.is_empty()));
            // Two terms differ only in a key given twice collapse into one topology; the API
            // server refuses such classes and CSINodes (duplicate keys), upstream collapses
            // them alike.
            let repeated_keys = allowed.iter().any(|t| {
                let keys: Vec<&String> = t
                    .match_label_expressions
                    .iter()
                    .flatten()
                    .map(|e| &e.key)
                    .collect();
                (1..keys.len()).any(|i| keys[..i].contains(&keys[i]))
            }) || cluster.csinodes.iter().flat_map(|c| &c.spec.drivers).any(
                |d| {
                    let keys = d.topology_keys.as_deref().unwrap_or_default();
                    (1..keys.len()).any(|i| keys[..i].contains(&keys[i]))
                },
            );
            if !repeated_keys {
                let mut unique = requisite.clone();
                unique.dedup();
                assert_eq!(unique.len(), requisite.len(), "no duplicates");
            }
            if reaches {
                let segments: usize = requisite.iter().map(BTreeMap::len).sum();
                assert!(segments <= MAX_ALLOWED_SEGMENTS);
            }
        }
    }
    Ok(())
}
