//! vSphere: `kubernetes.io/vsphere-volume` ↔ `csi.vsphere.vmware.com` (§3.6).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, PersistentVolume, VsphereVirtualDiskVolumeSource,
};
use k8s_openapi::api::storage::v1::StorageClass;

use super::error::Error;
use super::topology::{self, CSI_FSTYPE, FSTYPE};

/// The driver.
const DRIVER: &str = "csi.vsphere.vmware.com";
/// The driver's zone key.
pub(super) const TOPOLOGY_ZONE_KEY: &str = "topology.csi.vmware.com/zone";
/// The driver's region key.
pub(super) const TOPOLOGY_REGION_KEY: &str = "topology.csi.vmware.com/region";
/// The storage policy, as parameter and volume attribute.
const STORAGE_POLICY_NAME: &str = "storagepolicyname";
/// Where the driver tells a migrated volume's path.
const INITIAL_VOLUME_FILE_PATH: &str = "initialvolumefilepath";
/// The in-tree parameters the driver takes as `<name>-migrationparam`.
const MIGRATION_PARAMS: [&str; 8] = [
    "datastore",
    "diskformat",
    "hostfailurestotolerate",
    "forceprovisioning",
    "cachereservation",
    "diskstripes",
    "objectspacereservation",
    "iopslimit",
];

/// Known keys lower-cased and renamed, every other key dropped (upstream logs each at V(2)),
/// `csimigration: "true"`, `allowedTopologies` zone keys rewritten.
pub(super) fn storage_class(sc: &mut StorageClass) -> Result<(), Error> {
    let mut params = BTreeMap::new();
    for (k, v) in sc.parameters.iter().flatten() {
        let lower = k.to_lowercase();
        let key = match lower.as_str() {
            FSTYPE => CSI_FSTYPE.to_owned(),
            STORAGE_POLICY_NAME => lower,
            known if MIGRATION_PARAMS.contains(&known) => format!("{known}-migrationparam"),
            _ => {
                tracing::debug!(name = %k, value = %v, "StorageClass parameter is not supported");
                continue;
            }
        };
        params.insert(key, v.clone());
    }
    params.insert("csimigration".to_owned(), "true".to_owned());
    topology::apply_class_topology(sc, None, TOPOLOGY_ZONE_KEY)?;
    sc.parameters = Some(params);
    Ok(())
}

/// `vsphereVolume` → CSI: the path as handle, `{storagepolicyname}` when set, zone and region
/// topology.
pub(super) fn pv_to_csi(pv: &mut PersistentVolume) -> Result<(), Error> {
    let spec = pv.spec.get_or_insert_with(Default::default);
    let Some(vs) = spec.vsphere_volume.take() else {
        return Ok(());
    };
    let mut attributes = BTreeMap::new();
    if let Some(policy) = vs.storage_policy_name.filter(|p| !p.is_empty()) {
        attributes.insert(STORAGE_POLICY_NAME.to_owned(), policy);
    }
    spec.csi = Some(CSIPersistentVolumeSource {
        driver: DRIVER.to_owned(),
        volume_handle: vs.volume_path,
        fs_type: vs.fs_type,
        volume_attributes: Some(attributes),
        ..Default::default()
    });
    topology::vsphere_in_tree_to_csi(pv, TOPOLOGY_ZONE_KEY, TOPOLOGY_REGION_KEY);
    Ok(())
}

/// CSI → `vsphereVolume`: `volumePath` from `initialvolumefilepath` (empty when absent),
/// zone and region topology back.
pub(super) fn pv_to_in_tree(pv: &mut PersistentVolume) -> Result<(), Error> {
    let Some(csi) = pv.spec.as_ref().and_then(|s| s.csi.clone()) else {
        return Err(Error::NoCsiSource);
    };
    let path = csi
        .volume_attributes
        .as_ref()
        .and_then(|a| a.get(INITIAL_VOLUME_FILE_PATH))
        .cloned()
        .unwrap_or_default();
    let vs = VsphereVirtualDiskVolumeSource {
        volume_path: path,
        fs_type: csi.fs_type,
        ..Default::default()
    };
    topology::vsphere_csi_to_in_tree(pv, TOPOLOGY_ZONE_KEY, TOPOLOGY_REGION_KEY);
    let spec = pv.spec.get_or_insert_with(Default::default);
    spec.csi = None;
    spec.vsphere_volume = Some(vs);
    Ok(())
}
