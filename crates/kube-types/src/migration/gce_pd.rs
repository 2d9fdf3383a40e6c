//! GCE PD: `kubernetes.io/gce-pd` ↔ `pd.csi.storage.gke.io` (§3.2), with its access-mode
//! rewrite and `RepairVolumeHandle`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, GCEPersistentDiskVolumeSource, PersistentVolume,
};
use k8s_openapi::api::storage::v1::StorageClass;

use super::error::Error;
use super::topology::{self, BETA_ZONE, GA_ZONE, MULTI_ZONE_DELIMITER};
use plugreg_goflag::gotext;

/// The driver.
const DRIVER: &str = "pd.csi.storage.gke.io";
/// The driver's zone key.
pub(super) const TOPOLOGY_KEY: &str = "topology.gke.io/zone";
/// What a handle says where the project, zone or region is unknown.
const UNSPECIFIED: &str = "UNSPECIFIED";
/// A handle's parts: `projects/<project>/<zones|regions>/<where>/disks/<name>`.
const HANDLE_PARTS: usize = 6;

/// `fstype` renamed, `zone`/`zones` into topology, the rest copied.
pub(super) fn storage_class(sc: &mut StorageClass) -> Result<(), Error> {
    topology::zoned_storage_class(sc, TOPOLOGY_KEY, |_, _, _, _| false)
}

/// In-tree access modes as the CSI driver accepts them: RWX counts as RWO; RWO present →
/// `[RWO]`; else ROX → `[ROX]`; else `[RWO]`. None stays none.
pub(super) fn access_modes(modes: Option<Vec<String>>) -> Option<Vec<String>> {
    let modes = modes?;
    let has = |m: &str| {
        modes
            .iter()
            .any(|x| x == m || (m == "ReadWriteOnce" && x == "ReadWriteMany"))
    };
    let mode = if has("ReadWriteOnce") {
        "ReadWriteOnce"
    } else if has("ReadOnlyMany") {
        "ReadOnlyMany"
    } else {
        "ReadWriteOnce"
    };
    Some(vec![mode.to_owned()])
}

/// `gcePersistentDisk` → CSI: the handle from the zone labels (beta first), the partition, the
/// topology and the access modes.
pub(super) fn pv_to_csi(pv: &mut PersistentVolume) -> Result<(), Error> {
    let labels = pv.metadata.labels.as_ref();
    let label = |k: &str| labels.and_then(|l| l.get(k)).map_or("", String::as_str);
    let zones_label = match label(BETA_ZONE) {
        "" => label(GA_ZONE),
        beta => beta,
    }
    .to_owned();
    let spec = pv.spec.get_or_insert_with(Default::default);
    let Some(pd) = spec.gce_persistent_disk.take() else {
        return Ok(());
    };
    let zones: Vec<String> = zones_label
        .split(MULTI_ZONE_DELIMITER)
        .map(str::to_owned)
        .collect();
    let handle = match zones.as_slice() {
        [zone] if !zone.is_empty() => zonal_handle(UNSPECIFIED, zone, &pd.pd_name),
        [_, _, ..] => {
            let region = topology::gce_region(&zones).map_err(Error::GceRegionFromZones)?;
            regional_handle(UNSPECIFIED, &region, &pd.pd_name)
        }
        _ => zonal_handle(UNSPECIFIED, UNSPECIFIED, &pd.pd_name),
    };
    let partition = match pd.partition.unwrap_or(0) {
        0 => String::new(),
        n => n.to_string(),
    };
    spec.csi = Some(CSIPersistentVolumeSource {
        driver: DRIVER.to_owned(),
        volume_handle: handle,
        read_only: pd.read_only,
        fs_type: pd.fs_type,
        volume_attributes: Some(BTreeMap::from([("partition".to_owned(), partition)])),
        ..Default::default()
    });
    spec.access_modes = access_modes(spec.access_modes.take());
    topology::in_tree_to_csi(pv, TOPOLOGY_KEY);
    Ok(())
}

fn zonal_handle(project: &str, zone: &str, disk: &str) -> String {
    format!("projects/{project}/zones/{zone}/disks/{disk}")
}

fn regional_handle(project: &str, region: &str, disk: &str) -> String {
    format!("projects/{project}/regions/{region}/disks/{disk}")
}

/// CSI → `gcePersistentDisk`: the disk name from the handle, a non-empty `partition` parsed,
/// topology with GCE regions.
pub(super) fn pv_to_in_tree(pv: &mut PersistentVolume) -> Result<(), Error> {
    let Some(csi) = pv.spec.as_ref().and_then(|s| s.csi.clone()) else {
        return Err(Error::NoCsiSource);
    };
    let parts: Vec<&str> = csi.volume_handle.split('/').collect();
    if parts.len() < HANDLE_PARTS {
        return Err(Error::GceVolumeId(parts.len()));
    }
    let mut pd = GCEPersistentDiskVolumeSource {
        pd_name: parts[5].to_owned(),
        fs_type: csi.fs_type.clone(),
        read_only: csi.read_only,
        partition: None,
    };
    if let Some(p) = csi
        .volume_attributes
        .as_ref()
        .and_then(|a| a.get("partition"))
        .filter(|p| !p.is_empty())
    {
        let n = gotext::atoi32(p).map_err(|reason| Error::GcePartition {
            value: p.clone(),
            reason,
        })?;
        pd.partition = Some(n);
    }
    topology::csi_to_in_tree(pv, TOPOLOGY_KEY, Some(topology::gce_region))?;
    let spec = pv.spec.get_or_insert_with(Default::default);
    spec.csi = None;
    spec.gce_persistent_disk = Some(pd);
    Ok(())
}

/// Fills an `UNSPECIFIED` project (and zone or region) of a handle from the node's ID
/// (`projects/<p>/zones/<z>/instances/<n>`); a handle with a project is returned unchanged.
pub(super) fn repair_volume_handle(handle: &str, node_id: &str) -> Result<String, Error> {
    let tok: Vec<&str> = handle.split('/').collect();
    if tok.len() < HANDLE_PARTS {
        return Err(Error::RepairVolumeHandle(tok.len()));
    }
    if tok[1] != UNSPECIFIED {
        return Ok(handle.to_owned());
    }
    let node: Vec<&str> = node_id.split('/').collect();
    if node.len() < HANDLE_PARTS {
        return Err(Error::RepairNodeId(node.len()));
    }
    match tok[2] {
        "zones" => {
            let zone = if tok[3] == UNSPECIFIED {
                node[3]
            } else {
                tok[3]
            };
            Ok(zonal_handle(node[1], zone, tok[5]))
        }
        "regions" => {
            let region = if tok[3] == UNSPECIFIED {
                topology::gce_region(&[node[3].to_owned()]).map_err(|reason| {
                    Error::RepairRegion {
                        zone: node[3].to_owned(),
                        reason,
                    }
                })?
            } else {
                tok[3].to_owned()
            };
            Ok(regional_handle(node[1], &region, tok[5]))
        }
        other => Err(Error::RepairRegionality(other.to_owned())),
    }
}
