//! OpenStack Cinder: `kubernetes.io/cinder` ↔ `cinder.csi.openstack.org` (§3.5).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, CinderPersistentVolumeSource, PersistentVolume,
};
use k8s_openapi::api::storage::v1::StorageClass;

use super::error::Error;
use super::topology::{self, CSI_FSTYPE, FSTYPE};

/// The driver.
const DRIVER: &str = "cinder.csi.openstack.org";
/// The driver's zone key.
pub(super) const TOPOLOGY_KEY: &str = "topology.cinder.csi.openstack.org/zone";

/// `fstype` renamed; everything else copied, `availability`, `zone` and `zones` included (no
/// topology is generated); `allowedTopologies` zone keys rewritten.
pub(super) fn storage_class(sc: &mut StorageClass) -> Result<(), Error> {
    let mut params = BTreeMap::new();
    for (k, v) in sc.parameters.iter().flatten() {
        if k.to_lowercase() == FSTYPE {
            params.insert(CSI_FSTYPE.to_owned(), v.clone());
        } else {
            params.insert(k.clone(), v.clone());
        }
    }
    topology::apply_class_topology(sc, None, TOPOLOGY_KEY)?;
    sc.parameters = Some(params);
    Ok(())
}

/// `cinder` → CSI: `volumeID` as handle, no attributes, topology.
pub(super) fn pv_to_csi(pv: &mut PersistentVolume) -> Result<(), Error> {
    let spec = pv.spec.get_or_insert_with(Default::default);
    let Some(cinder) = spec.cinder.take() else {
        return Ok(());
    };
    spec.csi = Some(CSIPersistentVolumeSource {
        driver: DRIVER.to_owned(),
        volume_handle: cinder.volume_id,
        read_only: cinder.read_only,
        fs_type: cinder.fs_type,
        volume_attributes: Some(BTreeMap::new()),
        ..Default::default()
    });
    topology::in_tree_to_csi(pv, TOPOLOGY_KEY);
    Ok(())
}

/// CSI → `cinder`: the handle as `volumeID`, topology without regions.
pub(super) fn pv_to_in_tree(pv: &mut PersistentVolume) -> Result<(), Error> {
    let Some(csi) = pv.spec.as_ref().and_then(|s| s.csi.clone()) else {
        return Err(Error::NoCsiSource);
    };
    let cinder = CinderPersistentVolumeSource {
        volume_id: csi.volume_handle,
        fs_type: csi.fs_type,
        read_only: csi.read_only,
        secret_ref: None,
    };
    topology::csi_to_in_tree(pv, TOPOLOGY_KEY, None)?;
    let spec = pv.spec.get_or_insert_with(Default::default);
    spec.csi = None;
    spec.cinder = Some(cinder);
    Ok(())
}
