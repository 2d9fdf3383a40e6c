//! Topology shared by the plugins: StorageClass `zone`/`zones` and `allowedTopologies`, a PV's
//! node affinity and zone labels in both directions, and the region parsers
//! (`spec/upstream-csi-migration.md` §2.2-§2.4).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PersistentVolume,
    TopologySelectorLabelRequirement, TopologySelectorTerm, VolumeNodeAffinity,
};
use k8s_openapi::api::storage::v1::StorageClass;

use super::error::{Error, RegionError, TopologyError};

/// The GA zone label.
pub(super) const GA_ZONE: &str = "topology.kubernetes.io/zone";
/// The GA region label.
pub(super) const GA_REGION: &str = "topology.kubernetes.io/region";
/// The beta zone label.
pub(super) const BETA_ZONE: &str = "failure-domain.beta.kubernetes.io/zone";
/// The beta region label.
pub(super) const BETA_REGION: &str = "failure-domain.beta.kubernetes.io/region";
/// Separates the zones of a multi-zone label value.
pub(super) const MULTI_ZONE_DELIMITER: &str = "__";

/// The StorageClass parameter `fstype` (any case).
pub(super) const FSTYPE: &str = "fstype";
/// Where the CSI provisioner reads the file system type from.
pub(super) const CSI_FSTYPE: &str = "csi.storage.k8s.io/fstype";

/// A region parser: the one region of a term's zones.
pub(super) type RegionParser = fn(&[String]) -> Result<String, RegionError>;

// --- StorageClass -------------------------------------------------------------------------

/// The one term of a `zone` or `zones` parameter.
fn generated_term(key: &str, values: Vec<String>) -> Vec<TopologySelectorTerm> {
    vec![TopologySelectorTerm {
        match_label_expressions: Some(vec![TopologySelectorLabelRequirement {
            key: key.to_owned(),
            values,
        }]),
    }]
}

/// The topology a `zone` (one value) or `zones` (split on `,`, untrimmed, empties kept: Go's
/// `strings.Split`) parameter generates under `key`; `lower` is the parameter's key lower-cased.
/// `None` for any other parameter.
pub(super) fn zone_parameter(
    lower: &str,
    value: &str,
    key: &str,
) -> Option<Vec<TopologySelectorTerm>> {
    match lower {
        "zone" => Some(generated_term(key, vec![value.to_owned()])),
        "zones" => Some(generated_term(
            key,
            value.split(',').map(str::to_owned).collect(),
        )),
        _ => None,
    }
}

/// A zoned plugin's class (EBS, GCE PD): `zone`/`zones` become its topology under `key`,
/// `fstype` the CSI fs type; `own` may take a parameter of the plugin's own (its lower-cased
/// key, key, value, the new parameters; `true` when it took it); the rest are copied.
pub(super) fn zoned_storage_class(
    sc: &mut StorageClass,
    key: &str,
    mut own: impl FnMut(&str, &str, &str, &mut BTreeMap<String, String>) -> bool,
) -> Result<(), Error> {
    let mut params = BTreeMap::new();
    let mut generated = None;
    for (k, v) in sc.parameters.iter().flatten() {
        let lower = k.to_lowercase();
        if let Some(terms) = zone_parameter(&lower, v, key) {
            generated = Some(terms);
        } else if lower == FSTYPE {
            params.insert(CSI_FSTYPE.to_owned(), v.clone());
        } else if !own(&lower, k, v, &mut params) {
            params.insert(k.clone(), v.clone());
        }
    }
    apply_class_topology(sc, generated, key)?;
    sc.parameters = Some(params);
    Ok(())
}

/// Sets `allowedTopologies` from the generated term or rewrites its zone keys to `key`.
pub(super) fn apply_class_topology(
    sc: &mut StorageClass,
    generated: Option<Vec<TopologySelectorTerm>>,
    key: &str,
) -> Result<(), Error> {
    let allowed = sc
        .allowed_topologies
        .as_ref()
        .is_some_and(|t| !t.is_empty());
    match generated {
        Some(_) if allowed => Err(Error::TopologyConflict),
        Some(terms) => {
            sc.allowed_topologies = Some(terms);
            Ok(())
        }
        None => {
            if allowed {
                rewrite_allowed_topologies(sc, key);
            }
            Ok(())
        }
    }
}

/// Expressions keyed GA or beta zone get `key`; every other key (regions too) stays.
pub(super) fn rewrite_allowed_topologies(sc: &mut StorageClass, key: &str) {
    for term in sc.allowed_topologies.iter_mut().flatten() {
        for exp in term.match_label_expressions.iter_mut().flatten() {
            if exp.key == GA_ZONE || exp.key == BETA_ZONE {
                exp.key = key.to_owned();
            }
        }
    }
}

// --- PV node affinity -----------------------------------------------------------------------

fn terms(pv: &PersistentVolume) -> &[NodeSelectorTerm] {
    pv.spec
        .as_ref()
        .and_then(|s| s.node_affinity.as_ref())
        .and_then(|a| a.required.as_ref())
        .map_or(&[], |r| r.node_selector_terms.as_slice())
}

fn terms_mut(pv: &mut PersistentVolume) -> Option<&mut Vec<NodeSelectorTerm>> {
    pv.spec
        .as_mut()
        .and_then(|s| s.node_affinity.as_mut())
        .and_then(|a| a.required.as_mut())
        .map(|r| &mut r.node_selector_terms)
}

fn expressions(pv: &PersistentVolume) -> impl Iterator<Item = &NodeSelectorRequirement> {
    terms(pv)
        .iter()
        .flat_map(|t| t.match_expressions.iter().flatten())
}

fn label<'a>(pv: &'a PersistentVolume, key: &str) -> Option<&'a String> {
    pv.metadata.labels.as_ref().and_then(|l| l.get(key))
}

fn labels_mut(pv: &mut PersistentVolume) -> &mut BTreeMap<String, String> {
    pv.metadata.labels.get_or_insert_with(BTreeMap::new)
}

/// Whether any expression of the node affinity has `key` (values or not).
fn key_exists(pv: &PersistentVolume, key: &str) -> bool {
    expressions(pv).any(|e| e.key == key)
}

/// Every value of the expressions keyed `key`, deduplicated and sorted.
pub(super) fn topology_values(pv: &PersistentVolume, key: &str) -> Vec<String> {
    let set: BTreeSet<&String> = expressions(pv)
        .filter(|e| e.key == key)
        .flat_map(|e| e.values.iter().flatten())
        .collect();
    set.into_iter().cloned().collect()
}

/// Renames every expression keyed `old` to `new` (values are not merged with an existing `new`).
fn replace_key(pv: &mut PersistentVolume, old: &str, new: &str) {
    for term in terms_mut(pv).into_iter().flatten() {
        for exp in term.match_expressions.iter_mut().flatten() {
            if exp.key == old {
                exp.key = new.to_owned();
            }
        }
    }
}

/// Appends `key In [zones]` to every term (creating one empty term if there is none); the
/// zones are trimmed, deduplicated and sorted, empties dropped. No valid zone: no change.
fn add_topology<'a>(pv: &mut PersistentVolume, key: &str, zones: impl Iterator<Item = &'a str>) {
    let zones: BTreeSet<&str> = zones.map(str::trim).filter(|z| !z.is_empty()).collect();
    if zones.is_empty() {
        return;
    }
    let required = pv
        .spec
        .get_or_insert_with(Default::default)
        .node_affinity
        .get_or_insert_with(VolumeNodeAffinity::default)
        .required
        .get_or_insert_with(NodeSelector::default);
    if required.node_selector_terms.is_empty() {
        required
            .node_selector_terms
            .push(NodeSelectorTerm::default());
    }
    let values: Vec<String> = zones.into_iter().map(str::to_owned).collect();
    for term in &mut required.node_selector_terms {
        term.match_expressions
            .get_or_insert_with(Vec::new)
            .push(requirement_in(key, values.clone()));
    }
}

fn requirement_in(key: &str, values: Vec<String>) -> NodeSelectorRequirement {
    NodeSelectorRequirement {
        key: key.to_owned(),
        operator: "In".to_owned(),
        values: Some(values),
    }
}

/// The zone and region keys a PV uses: GA zone in the node affinity, else beta zone there,
/// else a GA zone label, else a beta zone label, else GA.
pub(super) fn flavour(pv: &PersistentVolume) -> (&'static str, &'static str) {
    if key_exists(pv, GA_ZONE) {
        (GA_ZONE, GA_REGION)
    } else if key_exists(pv, BETA_ZONE) {
        (BETA_ZONE, BETA_REGION)
    } else if label(pv, GA_ZONE).is_some() {
        (GA_ZONE, GA_REGION)
    } else if label(pv, BETA_ZONE).is_some() {
        (BETA_ZONE, BETA_REGION)
    } else {
        (GA_ZONE, GA_REGION)
    }
}

/// In-tree → CSI (EBS, GCE PD, Cinder): zone expressions get `csi_key`, or without any the zone
/// label becomes `csi_key In [zones]` on every term; beta region expressions become GA. Never
/// fails; labels stay.
pub(super) fn in_tree_to_csi(pv: &mut PersistentVolume, csi_key: &str) {
    let (zone_key, region_key) = flavour(pv);
    if !topology_values(pv, zone_key).is_empty() {
        replace_key(pv, zone_key, csi_key);
    } else if let Some(value) = label(pv, zone_key).cloned() {
        add_topology(pv, csi_key, value.split(MULTI_ZONE_DELIMITER));
    }
    if region_key == BETA_REGION && !topology_values(pv, region_key).is_empty() {
        replace_key(pv, region_key, GA_REGION);
    }
}

/// CSI → in-tree (EBS and GCE PD with a region parser, Cinder without): `csi_key` expressions
/// become the zone key; with a parser every term without a region gets one and a single region
/// becomes a label; the zones become the zone label unless there is one.
pub(super) fn csi_to_in_tree(
    pv: &mut PersistentVolume,
    csi_key: &str,
    region_parser: Option<RegionParser>,
) -> Result<(), Error> {
    let (zone_key, _) = flavour(pv);
    replace_key(pv, csi_key, zone_key);
    if let Some(parser) = region_parser {
        add_regions(pv, parser).map_err(|e| Error::Topology {
            pv: pv.metadata.name.clone().unwrap_or_default(),
            reason: TopologyError::Region(e),
        })?;
    }
    let zones = topology_values(pv, zone_key);
    if !zones.is_empty() && label(pv, zone_key).is_none() {
        labels_mut(pv).insert(zone_key.to_owned(), zones.join(MULTI_ZONE_DELIMITER));
    }
    Ok(())
}

/// Upstream's region handler: flavour detected again (after the renaming), a region
/// expression for each term lacking one, the region label when exactly one region shows.
fn add_regions(pv: &mut PersistentVolume, parser: RegionParser) -> Result<(), RegionError> {
    if terms(pv).is_empty() {
        return Ok(());
    }
    let (zone_key, region_key) = flavour(pv);
    for term in terms_mut(pv).into_iter().flatten() {
        let exps = term.match_expressions.get_or_insert_with(Vec::new);
        // Upstream stops collecting at the first region expression; such a term is skipped.
        if exps.iter().any(|e| e.key == region_key) {
            continue;
        }
        let zones: Vec<String> = exps
            .iter()
            .filter(|e| e.key == zone_key)
            .flat_map(|e| e.values.iter().flatten().cloned())
            .collect();
        let region = parser(&zones)?;
        exps.push(requirement_in(region_key, vec![region]));
    }
    let regions = topology_values(pv, region_key);
    if let [region] = regions.as_slice()
        && label(pv, region_key).is_none()
    {
        labels_mut(pv).insert(region_key.to_owned(), region.clone());
    }
    Ok(())
}

/// vSphere in-tree → CSI: zone and region expressions get the CSI keys; without any, the
/// label's whole (unsplit) value becomes an expression on every term.
pub(super) fn vsphere_in_tree_to_csi(pv: &mut PersistentVolume, csi_zone: &str, csi_region: &str) {
    let (zone_key, region_key) = flavour(pv);
    for (key, csi_key) in [(zone_key, csi_zone), (region_key, csi_region)] {
        if !topology_values(pv, key).is_empty() {
            replace_key(pv, key, csi_key);
        } else if let Some(value) = label(pv, key).cloned() {
            add_topology(pv, csi_key, std::iter::once(value.as_str()));
        }
    }
}

/// vSphere CSI → in-tree: the CSI keys become the detected zone and region keys; absent labels
/// get the first (sorted) value.
pub(super) fn vsphere_csi_to_in_tree(pv: &mut PersistentVolume, csi_zone: &str, csi_region: &str) {
    let (zone_key, region_key) = flavour(pv);
    replace_key(pv, csi_zone, zone_key);
    replace_key(pv, csi_region, region_key);
    for key in [zone_key, region_key] {
        let values = topology_values(pv, key);
        if let Some(first) = values.into_iter().next()
            && label(pv, key).is_none()
        {
            labels_mut(pv).insert(key.to_owned(), first);
        }
    }
}

// --- Region parsers -----------------------------------------------------------------------------

fn one_region(regions: BTreeSet<String>) -> Result<String, RegionError> {
    if regions.len() == 1 {
        Ok(regions.into_iter().next().unwrap_or_default())
    } else {
        Err(RegionError::NotOneRegion(regions))
    }
}

/// AWS: `us-east-1a` → `us-east-1`, `us-gov-east-1a` → `us-gov-east-1`, local and wavelength
/// zones (5 or 7 parts) → their first three parts.
pub(super) fn aws_region(zones: &[String]) -> Result<String, RegionError> {
    if zones.is_empty() {
        return Err(RegionError::NoZones);
    }
    let mut regions = BTreeSet::new();
    for zone in zones {
        let mut parts: Vec<&str> = zone.split('-').collect();
        let n = parts.len();
        if (n == 3 || n == 4) && parts[n - 1].len() == 2 {
            // Go slices the byte string; a two-byte part is ASCII here or not a zone at all.
            let last = parts[n - 1];
            parts[n - 1] = last.get(..1).unwrap_or(last);
            regions.insert(parts.join("-"));
        } else if n == 5 || n == 7 {
            regions.insert(parts[..3].join("-"));
        } else {
            return Err(RegionError::AwsZone(zone.clone()));
        }
    }
    one_region(regions)
}

/// GCE: `{locale}-{region}-{zone}` → `{locale}-{region}`.
pub(super) fn gce_region(zones: &[String]) -> Result<String, RegionError> {
    if zones.is_empty() {
        return Err(RegionError::NoZones);
    }
    let mut regions = BTreeSet::new();
    for zone in zones {
        let parts: Vec<&str> = zone.split('-').collect();
        if parts.len() != 3 {
            return Err(RegionError::GceZone(zone.clone()));
        }
        regions.insert(parts[..2].join("-"));
    }
    one_region(regions)
}
