//! The entry points: which plugin translates an object, and the translated copy (§2.1).

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeSpec};
use k8s_openapi::api::storage::v1::StorageClass;

use super::error::Error;
use super::{Plugin, aws_ebs, azure_disk, azure_file, cinder, gce_pd, portworx, vsphere};

/// The in-tree plugin whose source field is set in `spec`, if any (first in the table's order).
pub fn in_tree_plugin_of_pv(spec: &PersistentVolumeSpec) -> Option<Plugin> {
    Plugin::ALL.into_iter().find(|p| match p {
        Plugin::AwsEbs => spec.aws_elastic_block_store.is_some(),
        Plugin::GcePd => spec.gce_persistent_disk.is_some(),
        Plugin::AzureDisk => spec.azure_disk.is_some(),
        Plugin::AzureFile => spec.azure_file.is_some(),
        Plugin::Cinder => spec.cinder.is_some(),
        Plugin::VSphere => spec.vsphere_volume.is_some(),
        Plugin::Portworx => spec.portworx_volume.is_some(),
    })
}

/// Whether a PV has an in-tree source that translates to CSI (by source field, never by name).
pub fn is_pv_migratable(pv: &PersistentVolume) -> bool {
    pv.spec.as_ref().and_then(in_tree_plugin_of_pv).is_some()
}

/// A StorageClass of the in-tree plugin `in_tree_name` as its CSI driver takes it: parameters
/// renamed and `zone`/`zones` turned into `allowedTopologies` as the plugin does.
pub fn translate_storage_class(
    in_tree_name: &str,
    sc: &StorageClass,
) -> Result<StorageClass, Error> {
    let plugin = Plugin::from_in_tree_name(in_tree_name)
        .ok_or_else(|| Error::UnknownStorageClassPlugin(in_tree_name.to_owned()))?;
    let mut sc = sc.clone();
    match plugin {
        Plugin::AwsEbs => aws_ebs::storage_class(&mut sc)?,
        Plugin::GcePd => gce_pd::storage_class(&mut sc)?,
        Plugin::AzureDisk => azure_disk::storage_class(&mut sc)?,
        // Azure File's classes are used as they are.
        Plugin::AzureFile => {}
        Plugin::Cinder => cinder::storage_class(&mut sc)?,
        Plugin::VSphere => vsphere::storage_class(&mut sc)?,
        Plugin::Portworx => portworx::storage_class(&mut sc)?,
    }
    Ok(sc)
}

/// An in-tree PV as its CSI driver sees it: the in-tree source replaced by `spec.csi`, node
/// affinity keys and (GCE PD) access modes rewritten.
pub fn translate_in_tree_pv_to_csi(pv: &PersistentVolume) -> Result<PersistentVolume, Error> {
    let plugin = pv
        .spec
        .as_ref()
        .and_then(in_tree_plugin_of_pv)
        .ok_or_else(|| Error::NotMigratable(pv.metadata.name.clone().unwrap_or_default()))?;
    let mut pv = pv.clone();
    match plugin {
        Plugin::AwsEbs => aws_ebs::pv_to_csi(&mut pv)?,
        Plugin::GcePd => gce_pd::pv_to_csi(&mut pv)?,
        Plugin::AzureDisk => azure_disk::pv_to_csi(&mut pv)?,
        Plugin::AzureFile => azure_file::pv_to_csi(&mut pv)?,
        Plugin::Cinder => cinder::pv_to_csi(&mut pv)?,
        Plugin::VSphere => vsphere::pv_to_csi(&mut pv)?,
        Plugin::Portworx => portworx::pv_to_csi(&mut pv)?,
    }
    Ok(pv)
}

/// A CSI PV of a migration driver in its in-tree form (what csi-provisioner saves for a claim of
/// an in-tree class): `spec.csi` replaced by the plugin's source, topology written back.
pub fn translate_csi_pv_to_in_tree(pv: &PersistentVolume) -> Result<PersistentVolume, Error> {
    let driver = pv
        .spec
        .as_ref()
        .and_then(|s| s.csi.as_ref())
        .map(|c| c.driver.as_str())
        .ok_or(Error::NoCsiSource)?;
    let plugin =
        Plugin::from_csi_driver(driver).ok_or_else(|| Error::UnknownDriver(driver.to_owned()))?;
    let mut pv = pv.clone();
    match plugin {
        Plugin::AwsEbs => aws_ebs::pv_to_in_tree(&mut pv)?,
        Plugin::GcePd => gce_pd::pv_to_in_tree(&mut pv)?,
        Plugin::AzureDisk => azure_disk::pv_to_in_tree(&mut pv)?,
        Plugin::AzureFile => azure_file::pv_to_in_tree(&mut pv)?,
        Plugin::Cinder => cinder::pv_to_in_tree(&mut pv)?,
        Plugin::VSphere => vsphere::pv_to_in_tree(&mut pv)?,
        Plugin::Portworx => portworx::pv_to_in_tree(&mut pv)?,
    }
    Ok(pv)
}

/// The volume handle as published on the node `node_id`, for the CSI driver `driver`: GCE PD
/// fills an `UNSPECIFIED` project, zone or region from the node ID; every other migration
/// target keeps the handle.
pub fn repair_volume_handle(driver: &str, handle: &str, node_id: &str) -> Result<String, Error> {
    match Plugin::from_csi_driver(driver) {
        Some(Plugin::GcePd) => gce_pd::repair_volume_handle(handle, node_id),
        Some(_) => Ok(handle.to_owned()),
        None => Err(Error::NoInTreePlugin(driver.to_owned())),
    }
}
