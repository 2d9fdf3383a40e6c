//! The node information a CSI driver publishes, and the pure merge logic both sinks share:
//! the `csi.volume.kubernetes.io/nodeid` annotation (a JSON map driver -> node id), the topology
//! labels with their collision check, and the CSINode driver list.
//!
//! Nothing here does I/O: the functions take the current values and return what to write, so the
//! rules are tested without a cluster.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::storage::v1::{CSINodeDriver, VolumeNodeResources};
use serde::{Deserialize, Serialize};

/// Node annotation holding a JSON object driver name -> node id (upstream's key).
pub const NODE_ID_ANNOTATION: &str = "csi.volume.kubernetes.io/nodeid";

/// What a driver reported about this node in NodeGetInfo.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverNodeInfo {
    /// Driver name.
    pub driver: String,
    /// The driver's id of this node (never empty once published).
    pub node_id: String,
    /// Topology segments; each becomes a Node label and a CSINode topology key.
    pub topology: BTreeMap<String, String>,
    /// Attach limit; 0 (or negative) means none is published.
    pub max_volumes: i64,
}

/// Why the current node information could not be merged.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// The existing annotation is not a JSON object of strings.
    #[error("failed to parse the existing {NODE_ID_ANNOTATION} annotation {value:?}")]
    AnnotationParse {
        /// The annotation's value.
        value: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The new annotation value could not be encoded.
    #[error("failed to encode the {NODE_ID_ANNOTATION} annotation")]
    AnnotationEncode(#[source] serde_json::Error),
    /// The driver's topology would add labels a kubelet may not set on its own Node
    /// ([`crate::noderestriction`]); worded as the API server's NodeRestriction refuses them.
    #[error("is not allowed to modify labels: {}", keys.join(", "))]
    ForbiddenLabels {
        /// The refused keys, sorted.
        keys: Vec<String>,
    },
    /// The driver reports a topology value different from the Node's label of the same key.
    #[error(
        "detected topology value collision: driver reported {key:?}:{reported:?} but existing label is {key:?}:{existing:?}"
    )]
    TopologyCollision {
        /// Label key.
        key: String,
        /// The driver's value.
        reported: String,
        /// The Node's value.
        existing: String,
    },
}

/// A change to a Node's metadata: one annotation and some labels. Applied to the Kubernetes API
/// as a strategic-merge patch ([`to_patch`](Self::to_patch)) or to a file's maps
/// ([`apply`](Self::apply)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetaPatch {
    /// `None`: the annotation stays as it is; `Some(None)`: delete it; `Some(Some(v))`: set it.
    pub annotation: Option<Option<String>>,
    /// Labels to set (`Some`) or delete (`None`).
    pub labels: BTreeMap<String, Option<String>>,
}

impl MetaPatch {
    /// Whether the patch changes nothing.
    pub fn is_empty(&self) -> bool {
        self.annotation.is_none() && self.labels.is_empty()
    }

    /// The strategic-merge (equally: JSON merge) patch body. With `resource_version` the API
    /// server refuses the patch with 409 Conflict if the Node changed since it was read, so a
    /// concurrent writer's annotation entry is never lost.
    pub fn to_patch(&self, resource_version: Option<&str>) -> serde_json::Value {
        let mut meta = serde_json::Map::new();
        if let Some(rv) = resource_version {
            meta.insert("resourceVersion".into(), rv.into());
        }
        if let Some(a) = &self.annotation {
            meta.insert(
                "annotations".into(),
                serde_json::json!({ NODE_ID_ANNOTATION: a }),
            );
        }
        if !self.labels.is_empty() {
            meta.insert("labels".into(), serde_json::json!(self.labels));
        }
        serde_json::json!({ "metadata": meta })
    }

    /// Applies the patch to plain maps.
    pub fn apply(
        &self,
        annotations: &mut BTreeMap<String, String>,
        labels: &mut BTreeMap<String, String>,
    ) {
        match &self.annotation {
            None => {}
            Some(None) => {
                annotations.remove(NODE_ID_ANNOTATION);
            }
            Some(Some(v)) => {
                annotations.insert(NODE_ID_ANNOTATION.to_owned(), v.clone());
            }
        }
        for (k, v) in &self.labels {
            match v {
                Some(v) => labels.insert(k.clone(), v.clone()),
                None => labels.remove(k),
            };
        }
    }
}

/// What [`plan_publish`] changed, so that it can be undone if a later step fails.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublishUndo {
    /// The driver's node id in the annotation before the change (`None`: it had no entry).
    pub previous_node_id: Option<String>,
    /// The node id written.
    pub written_node_id: String,
    /// Labels that did not exist before and were added.
    pub added_labels: BTreeMap<String, String>,
}

/// Parses the annotation value (absent means an empty map).
pub fn parse_node_ids(value: Option<&str>) -> Result<BTreeMap<String, String>, MergeError> {
    match value {
        None => Ok(BTreeMap::new()),
        Some(v) => serde_json::from_str(v).map_err(|source| MergeError::AnnotationParse {
            value: v.to_owned(),
            source,
        }),
    }
}

fn encode_node_ids(ids: &BTreeMap<String, String>) -> Result<String, MergeError> {
    // BTreeMap: keys sorted, as Go's encoding/json writes a map.
    serde_json::to_string(ids).map_err(MergeError::AnnotationEncode)
}

/// The annotation value with `driver` set to `node_id` (other drivers kept).
pub fn set_node_id(value: Option<&str>, driver: &str, node_id: &str) -> Result<String, MergeError> {
    let mut ids = parse_node_ids(value)?;
    ids.insert(driver.to_owned(), node_id.to_owned());
    encode_node_ids(&ids)
}

/// The annotation value without `driver`; `None` when no driver is left (the annotation is then
/// removed).
pub fn remove_node_id(value: Option<&str>, driver: &str) -> Result<Option<String>, MergeError> {
    let mut ids = parse_node_ids(value)?;
    ids.remove(driver);
    if ids.is_empty() {
        Ok(None)
    } else {
        encode_node_ids(&ids).map(Some)
    }
}

/// The topology labels the Node lacks. A label that exists with a different value is a
/// collision (nothing is to be written then); one with the same value needs no change.
pub fn topology_labels_to_add(
    labels: &BTreeMap<String, String>,
    topology: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, MergeError> {
    let mut add = BTreeMap::new();
    for (k, v) in topology {
        match labels.get(k) {
            Some(existing) if existing != v => {
                return Err(MergeError::TopologyCollision {
                    key: k.clone(),
                    reported: v.clone(),
                    existing: existing.clone(),
                });
            }
            Some(_) => {}
            None => {
                add.insert(k.clone(), v.clone());
            }
        }
    }
    Ok(add)
}

/// The Node change that publishes `info`, given the Node's current annotations and labels, and
/// how to undo it. An empty patch means the Node is already up to date.
///
/// Labels a kubelet may not set ([`crate::noderestriction`]) refuse the whole change: a label
/// the Node already carries with the same value is no change and passes, as with the API
/// server's NodeRestriction.
pub fn plan_publish(
    annotations: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
    info: &DriverNodeInfo,
) -> Result<(MetaPatch, PublishUndo), MergeError> {
    let current = annotations.get(NODE_ID_ANNOTATION).map(String::as_str);
    let previous_node_id = parse_node_ids(current)?.remove(&info.driver);
    let added = topology_labels_to_add(labels, &info.topology)?;
    let keys = crate::noderestriction::forbidden(added.keys().map(String::as_str));
    if !keys.is_empty() {
        return Err(MergeError::ForbiddenLabels { keys });
    }
    let annotation = if previous_node_id.as_deref() == Some(info.node_id.as_str()) {
        None
    } else {
        Some(Some(set_node_id(current, &info.driver, &info.node_id)?))
    };
    let patch = MetaPatch {
        annotation,
        labels: added
            .iter()
            .map(|(k, v)| (k.clone(), Some(v.clone())))
            .collect(),
    };
    let undo = PublishUndo {
        previous_node_id,
        written_node_id: info.node_id.clone(),
        added_labels: added,
    };
    Ok((patch, undo))
}

/// The Node change that undoes a publish, given the Node's current annotations and labels: the
/// driver's annotation entry goes back to its previous value (or goes away) if it still holds
/// the value written, and each added label goes away if it still holds the value written.
pub fn plan_undo(
    annotations: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
    driver: &str,
    undo: &PublishUndo,
) -> Result<MetaPatch, MergeError> {
    let current = annotations.get(NODE_ID_ANNOTATION).map(String::as_str);
    let ids = parse_node_ids(current)?;
    let annotation = if ids.get(driver) == Some(&undo.written_node_id) {
        match &undo.previous_node_id {
            Some(prev) if *prev == undo.written_node_id => None,
            Some(prev) => Some(Some(set_node_id(current, driver, prev)?)),
            None => Some(remove_node_id(current, driver)?),
        }
    } else {
        None
    };
    let labels = undo
        .added_labels
        .iter()
        .filter(|(k, v)| labels.get(*k) == Some(*v))
        .map(|(k, _)| (k.clone(), None))
        .collect();
    Ok(MetaPatch { annotation, labels })
}

/// The Node change that removes `driver` from the annotation (labels stay, as upstream).
pub fn plan_remove(
    annotations: &BTreeMap<String, String>,
    driver: &str,
) -> Result<MetaPatch, MergeError> {
    let current = annotations.get(NODE_ID_ANNOTATION).map(String::as_str);
    let ids = parse_node_ids(current)?;
    if !ids.contains_key(driver) {
        return Ok(MetaPatch::default());
    }
    Ok(MetaPatch {
        annotation: Some(remove_node_id(current, driver)?),
        labels: BTreeMap::new(),
    })
}

/// Largest allocatable count a CSINode holds (the field is an int32).
pub const MAX_ALLOCATABLE: i64 = i32::MAX as i64;

/// The CSINode driver entry for `info`: name, node id, sorted topology keys and, when
/// `max_volumes` is positive, `allocatable.count` (clamped to `i32::MAX` with a warning).
pub fn csinode_driver(info: &DriverNodeInfo) -> CSINodeDriver {
    let allocatable = match info.max_volumes {
        n if n > MAX_ALLOCATABLE => {
            tracing::warn!(
                driver = %info.driver,
                max_volumes = n,
                "maximum volumes per node exceeds {MAX_ALLOCATABLE}; clamped"
            );
            Some(i32::MAX)
        }
        n if n > 0 => i32::try_from(n).ok(),
        n if n < 0 => {
            tracing::warn!(
                driver = %info.driver,
                max_volumes = n,
                "negative maximum volumes per node ignored"
            );
            None
        }
        _ => None,
    };
    CSINodeDriver {
        name: info.driver.clone(),
        node_id: info.node_id.clone(),
        // BTreeMap keys are sorted. No topology: no field (what the API server returns anyway).
        topology_keys: (!info.topology.is_empty()).then(|| info.topology.keys().cloned().collect()),
        allocatable: allocatable.map(|count| VolumeNodeResources { count: Some(count) }),
    }
}

fn same_entry(a: &CSINodeDriver, b: &CSINodeDriver) -> bool {
    let keys = |d: &CSINodeDriver| -> BTreeSet<String> {
        d.topology_keys.iter().flatten().cloned().collect()
    };
    let count = |d: &CSINodeDriver| d.allocatable.as_ref().and_then(|a| a.count);
    a.name == b.name && a.node_id == b.node_id && keys(a) == keys(b) && count(a) == count(b)
}

/// The driver list with `entry` added or replacing the entry of the same name (other drivers
/// kept in order); `None` when the list already holds an equal entry (same node id, same set of
/// topology keys, same count), so no write is needed.
pub fn upsert_driver(
    drivers: &[CSINodeDriver],
    entry: CSINodeDriver,
) -> Option<Vec<CSINodeDriver>> {
    let mut same_name = drivers.iter().filter(|d| d.name == entry.name);
    if let (Some(existing), None) = (same_name.next(), same_name.next())
        && same_entry(existing, &entry)
    {
        return None;
    }
    let mut out: Vec<CSINodeDriver> = Vec::with_capacity(drivers.len() + 1);
    let mut placed = false;
    for d in drivers {
        if d.name == entry.name {
            if !placed {
                out.push(entry.clone());
                placed = true;
            }
        } else {
            out.push(d.clone());
        }
    }
    if !placed {
        out.push(entry);
    }
    Some(out)
}

/// The entry of `entry`'s driver in `drivers` when it differs from `entry` (which the API
/// server does not let an update change in place).
pub fn differing_entry<'a>(
    drivers: &'a [CSINodeDriver],
    entry: &CSINodeDriver,
) -> Option<&'a CSINodeDriver> {
    drivers
        .iter()
        .find(|d| d.name == entry.name && !same_entry(d, entry))
}

/// The driver list without `driver`; `None` when it has no such entry.
pub fn remove_driver(drivers: &[CSINodeDriver], driver: &str) -> Option<Vec<CSINodeDriver>> {
    if !drivers.iter().any(|d| d.name == driver) {
        return None;
    }
    Some(
        drivers
            .iter()
            .filter(|d| d.name != driver)
            .cloned()
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn info(driver: &str, node_id: &str, topology: &[(&str, &str)], max: i64) -> DriverNodeInfo {
        DriverNodeInfo {
            driver: driver.into(),
            node_id: node_id.into(),
            topology: map(topology),
            max_volumes: max,
        }
    }

    #[test]
    fn annotation_merge_keeps_other_drivers_and_sorts() {
        assert_eq!(set_node_id(None, "b", "n-b").unwrap(), r#"{"b":"n-b"}"#);
        let v = set_node_id(Some(r#"{"b":"n-b"}"#), "a", "n-a").unwrap();
        assert_eq!(v, r#"{"a":"n-a","b":"n-b"}"#);
        let v = set_node_id(Some(&v), "a", "n-a2").unwrap();
        assert_eq!(v, r#"{"a":"n-a2","b":"n-b"}"#);
    }

    #[test]
    fn annotation_removal_drops_the_annotation_when_empty() {
        let v = r#"{"a":"n-a","b":"n-b"}"#;
        assert_eq!(
            remove_node_id(Some(v), "a").unwrap().as_deref(),
            Some(r#"{"b":"n-b"}"#)
        );
        assert_eq!(remove_node_id(Some(r#"{"a":"n-a"}"#), "a").unwrap(), None);
        assert_eq!(remove_node_id(None, "a").unwrap(), None);
        assert_eq!(
            remove_node_id(Some(v), "zzz").unwrap().as_deref(),
            Some(v),
            "unknown driver: unchanged"
        );
    }

    #[test]
    fn unparsable_annotation_is_an_error() {
        for bad in ["not json", "[1,2]", r#"{"a":1}"#] {
            let err = set_node_id(Some(bad), "a", "n").unwrap_err();
            assert!(matches!(err, MergeError::AnnotationParse { .. }), "{bad}");
            assert!(remove_node_id(Some(bad), "a").is_err());
        }
    }

    #[test]
    fn topology_collision_is_detected_with_upstreams_message() {
        let labels = map(&[("zone", "z1"), ("other", "x")]);
        let add = topology_labels_to_add(&labels, &map(&[("zone", "z1"), ("rack", "r1")])).unwrap();
        assert_eq!(add, map(&[("rack", "r1")]));
        let err =
            topology_labels_to_add(&labels, &map(&[("rack", "r1"), ("zone", "z2")])).unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"detected topology value collision: driver reported "zone":"z2" but existing label is "zone":"z1""#
        );
    }

    #[test]
    fn publish_plan_sets_annotation_and_missing_labels() {
        let annotations = map(&[(NODE_ID_ANNOTATION, r#"{"other":"o"}"#), ("x", "y")]);
        let labels = map(&[("zone", "z1")]);
        let i = info("d", "n1", &[("zone", "z1"), ("rack", "r1")], 0);
        let (patch, undo) = plan_publish(&annotations, &labels, &i).unwrap();
        assert_eq!(
            patch.annotation,
            Some(Some(r#"{"d":"n1","other":"o"}"#.to_owned()))
        );
        assert_eq!(
            patch.labels,
            BTreeMap::from([("rack".to_owned(), Some("r1".to_owned()))])
        );
        assert_eq!(undo.previous_node_id, None);
        assert_eq!(undo.added_labels, map(&[("rack", "r1")]));
        assert_eq!(
            patch.to_patch(Some("42")),
            serde_json::json!({"metadata": {
                "resourceVersion": "42",
                "annotations": {NODE_ID_ANNOTATION: r#"{"d":"n1","other":"o"}"#},
                "labels": {"rack": "r1"},
            }})
        );

        // Applying it and planning again: nothing left to do.
        let (mut a2, mut l2) = (annotations.clone(), labels.clone());
        patch.apply(&mut a2, &mut l2);
        let (again, _) = plan_publish(&a2, &l2, &i).unwrap();
        assert!(again.is_empty(), "{again:?}");

        // Undo restores the original maps.
        let back = plan_undo(&a2, &l2, "d", &undo).unwrap();
        back.apply(&mut a2, &mut l2);
        assert_eq!((a2, l2), (annotations, labels));
    }

    #[test]
    fn undo_restores_a_previous_node_id_and_spares_foreign_changes() {
        let annotations = map(&[(NODE_ID_ANNOTATION, r#"{"d":"old"}"#)]);
        let labels = BTreeMap::new();
        let (patch, undo) =
            plan_publish(&annotations, &labels, &info("d", "new", &[("k", "v")], 0)).unwrap();
        let (mut a, mut l) = (annotations.clone(), labels.clone());
        patch.apply(&mut a, &mut l);
        plan_undo(&a, &l, "d", &undo).unwrap().apply(&mut a, &mut l);
        assert_eq!((a, l), (annotations.clone(), labels));

        // Someone else rewrote the entry and the label meanwhile: undo leaves them alone.
        let a = map(&[(NODE_ID_ANNOTATION, r#"{"d":"third"}"#)]);
        let l = map(&[("k", "other")]);
        assert!(plan_undo(&a, &l, "d", &undo).unwrap().is_empty());
    }

    #[test]
    fn labels_a_kubelet_may_not_set_plan_nothing() {
        let i = info(
            "d",
            "n",
            &[
                ("node-role.kubernetes.io/control-plane", "x"),
                ("node-restriction.kubernetes.io/pwn", "y"),
                ("topology.example.com/zone", "z"),
            ],
            0,
        );
        let err = plan_publish(&BTreeMap::new(), &BTreeMap::new(), &i).unwrap_err();
        assert_eq!(
            err.to_string(),
            "is not allowed to modify labels: node-restriction.kubernetes.io/pwn, \
             node-role.kubernetes.io/control-plane"
        );
        // Already on the Node with that value: no change, nothing to refuse (as NodeRestriction).
        let labels = map(&[
            ("node-role.kubernetes.io/control-plane", "x"),
            ("node-restriction.kubernetes.io/pwn", "y"),
        ]);
        let (patch, _) = plan_publish(&BTreeMap::new(), &labels, &i).unwrap();
        assert_eq!(
            patch.labels,
            BTreeMap::from([("topology.example.com/zone".to_owned(), Some("z".to_owned()))])
        );
        // The kubelet's own labels pass.
        let ok = info("d", "n", &[("topology.kubernetes.io/zone", "z1")], 0);
        assert!(plan_publish(&BTreeMap::new(), &BTreeMap::new(), &ok).is_ok());
    }

    #[test]
    fn collision_plans_nothing() {
        let err = plan_publish(
            &BTreeMap::new(),
            &map(&[("zone", "old")]),
            &info("d", "n", &[("zone", "new")], 0),
        )
        .unwrap_err();
        assert!(matches!(err, MergeError::TopologyCollision { .. }));
    }

    #[test]
    fn remove_plan_touches_only_the_annotation() {
        let a = map(&[(NODE_ID_ANNOTATION, r#"{"a":"1","b":"2"}"#)]);
        let p = plan_remove(&a, "a").unwrap();
        assert_eq!(p.annotation, Some(Some(r#"{"b":"2"}"#.to_owned())));
        assert!(p.labels.is_empty());
        let a = map(&[(NODE_ID_ANNOTATION, r#"{"a":"1"}"#)]);
        assert_eq!(plan_remove(&a, "a").unwrap().annotation, Some(None));
        assert!(plan_remove(&a, "zzz").unwrap().is_empty());
        assert!(plan_remove(&BTreeMap::new(), "a").unwrap().is_empty());
        assert_eq!(
            MetaPatch {
                annotation: Some(None),
                labels: BTreeMap::new()
            }
            .to_patch(None),
            serde_json::json!({"metadata": {"annotations": {NODE_ID_ANNOTATION: null}}})
        );
    }

    #[test]
    fn csinode_entry_sorts_keys_and_clamps_count() {
        let e = csinode_driver(&info("d", "n", &[("z", "1"), ("a", "2")], 0));
        assert_eq!(e.topology_keys, Some(vec!["a".to_owned(), "z".to_owned()]));
        assert_eq!(e.allocatable, None, "0: no allocatable");
        let e = csinode_driver(&info("d", "n", &[], 7));
        assert_eq!(e.topology_keys, None, "no topology: no keys");
        assert_eq!(e.allocatable.and_then(|a| a.count), Some(7));
        let e = csinode_driver(&info("d", "n", &[], i64::MAX));
        assert_eq!(e.allocatable.and_then(|a| a.count), Some(i32::MAX));
        let e = csinode_driver(&info("d", "n", &[], -3));
        assert_eq!(e.allocatable, None);
    }

    #[test]
    fn csinode_driver_list_update() {
        let a = csinode_driver(&info("a", "na", &[("k", "v")], 3));
        let b = csinode_driver(&info("b", "nb", &[], 0));

        let list = upsert_driver(&[], a.clone()).unwrap();
        assert_eq!(list, vec![a.clone()]);
        let list = upsert_driver(&list, b.clone()).unwrap();
        assert_eq!(list, vec![a.clone(), b.clone()]);
        assert_eq!(upsert_driver(&list, a.clone()), None, "unchanged: no write");

        // Same keys in another order count as unchanged.
        let mut shuffled = a.clone();
        shuffled.topology_keys = Some(vec!["k".into()]);
        assert_eq!(upsert_driver(&[shuffled], a.clone()), None);

        let a2 = csinode_driver(&info("a", "na2", &[("k", "v")], 3));
        assert_eq!(
            upsert_driver(&list, a2.clone()).unwrap(),
            vec![a2.clone(), b.clone()]
        );
        let a3 = csinode_driver(&info("a", "na", &[("k", "v")], 4));
        assert!(
            upsert_driver(&list, a3).is_some(),
            "count change is a change"
        );

        assert_eq!(differing_entry(&list, &a), None);
        assert_eq!(differing_entry(&list, &a2), Some(&a));
        assert_eq!(differing_entry(std::slice::from_ref(&b), &a2), None);

        assert_eq!(remove_driver(&list, "a").unwrap(), vec![b.clone()]);
        assert_eq!(remove_driver(&list, "zzz"), None);
        assert_eq!(remove_driver(&[], "a"), None);
    }
}
