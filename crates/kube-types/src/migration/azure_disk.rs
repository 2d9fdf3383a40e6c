//! Azure Disk: `kubernetes.io/azure-disk` ↔ `disk.csi.azure.com` (§3.3).

use std::collections::BTreeMap;
use std::sync::LazyLock;

use k8s_openapi::api::core::v1::{
    AzureDiskVolumeSource, CSIPersistentVolumeSource, PersistentVolume,
};
use k8s_openapi::api::storage::v1::StorageClass;
use regex::Regex;

use super::error::Error;
use super::topology;

/// The driver.
const DRIVER: &str = "disk.csi.azure.com";
/// The driver's zone key (StorageClasses only).
pub(super) const TOPOLOGY_KEY: &str = "topology.disk.csi.azure.com/zone";
/// The only `kind` that translates.
const MANAGED: &str = "Managed";

const MANAGED_PATTERN: &str =
    ".*/subscriptions/(?:.*)/resourceGroups/(?:.*)/providers/Microsoft.Compute/disks/(.+)";
const UNMANAGED_PATTERN: &str = "http(?:.*)://(?:.*)/vhds/(.+)";

static MANAGED_RE: LazyLock<Regex> = LazyLock::new(|| regex(MANAGED_PATTERN));
static UNMANAGED_RE: LazyLock<Regex> = LazyLock::new(|| regex(UNMANAGED_PATTERN));

fn regex(pattern: &str) -> Regex {
    // The patterns are constants, compiled by the unit tests.
    Regex::new(pattern).unwrap_or_else(|e| unreachable!("{pattern}: {e}"))
}

/// `zone`/`zones` into topology, everything else (`fsType` too) copied; then digits-only zone
/// values (fault domains of non-zonal regions) become `""`.
pub(super) fn storage_class(sc: &mut StorageClass) -> Result<(), Error> {
    let mut params = BTreeMap::new();
    let mut generated = None;
    for (k, v) in sc.parameters.iter().flatten() {
        match topology::zone_parameter(&k.to_lowercase(), v, TOPOLOGY_KEY) {
            Some(terms) => generated = Some(terms),
            None => {
                params.insert(k.clone(), v.clone());
            }
        }
    }
    topology::apply_class_topology(sc, generated, TOPOLOGY_KEY)?;
    for term in sc.allowed_topologies.iter_mut().flatten() {
        for exp in term.match_label_expressions.iter_mut().flatten() {
            if exp.key != TOPOLOGY_KEY {
                continue;
            }
            for v in &mut exp.values {
                if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
                    v.clear();
                }
            }
        }
    }
    sc.parameters = Some(params);
    Ok(())
}

/// `azureDisk` → CSI: only `kind: Managed` (or none); the URI as handle, `kind`,
/// `cachingmode` and `fstype` as attributes. Topology and access modes stay.
pub(super) fn pv_to_csi(pv: &mut PersistentVolume) -> Result<(), Error> {
    let spec = pv.spec.get_or_insert_with(Default::default);
    let Some(disk) = spec.azure_disk.take() else {
        return Ok(());
    };
    if let Some(kind) = &disk.kind
        && !kind.eq_ignore_ascii_case(MANAGED)
    {
        return Err(Error::AzureDiskKind(kind.clone()));
    }
    let mut attributes = BTreeMap::from([("kind".to_owned(), MANAGED.to_owned())]);
    if let Some(mode) = disk.caching_mode {
        attributes.insert("cachingmode".to_owned(), mode);
    }
    if let Some(fs) = &disk.fs_type {
        attributes.insert("fstype".to_owned(), fs.clone());
    }
    spec.csi = Some(CSIPersistentVolumeSource {
        driver: DRIVER.to_owned(),
        volume_handle: disk.disk_uri,
        fs_type: disk.fs_type,
        read_only: disk.read_only,
        volume_attributes: Some(attributes),
        ..Default::default()
    });
    Ok(())
}

/// The disk name of a managed (`/subscriptions/…/disks/<name>`) or unmanaged
/// (`http…://…/vhds/<name>`) URI.
fn disk_name(uri: &str) -> Result<String, Error> {
    let unmanaged = uri.len() > 4 && uri.get(..4).is_some_and(|p| p.eq_ignore_ascii_case("http"));
    let (re, pattern) = if unmanaged {
        (&*UNMANAGED_RE, UNMANAGED_PATTERN)
    } else {
        (&*MANAGED_RE, MANAGED_PATTERN)
    };
    re.captures(uri)
        .and_then(|c| c.get(1))
        .map(|m| m.as_str().to_owned())
        .ok_or_else(|| Error::AzureDiskName {
            uri: uri.to_owned(),
            pattern,
        })
}

/// CSI → `azureDisk` (always `kind: Managed`): the name from the handle, the CSI `fsType`
/// unless an `fstype` attribute says otherwise, a non-empty `cachingmode`.
pub(super) fn pv_to_in_tree(pv: &mut PersistentVolume) -> Result<(), Error> {
    let Some(csi) = pv.spec.as_ref().and_then(|s| s.csi.clone()) else {
        return Err(Error::NoCsiSource);
    };
    let name = disk_name(&csi.volume_handle)?;
    let mut disk = AzureDiskVolumeSource {
        disk_name: name,
        disk_uri: csi.volume_handle,
        kind: Some(MANAGED.to_owned()),
        read_only: Some(csi.read_only.unwrap_or(false)),
        fs_type: Some(csi.fs_type.unwrap_or_default()),
        caching_mode: None,
    };
    for (k, v) in csi.volume_attributes.iter().flatten() {
        match k.to_lowercase().as_str() {
            "fstype" if !v.is_empty() => disk.fs_type = Some(v.clone()),
            "cachingmode" if !v.is_empty() => disk.caching_mode = Some(v.clone()),
            _ => {}
        }
    }
    let spec = pv.spec.get_or_insert_with(Default::default);
    spec.csi = None;
    spec.azure_disk = Some(disk);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_names_come_from_managed_and_unmanaged_uris() {
        let ok = [
            (
                "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/disks/d1",
                "d1",
            ),
            ("https://acct.blob.core.windows.net/vhds/d1.vhd", "d1.vhd"),
            ("httpx://a://b/vhds/c/vhds/d3", "d3"),
        ];
        for (uri, want) in ok {
            assert_eq!(disk_name(uri).as_deref(), Ok(want), "{uri}");
        }
        assert_eq!(
            disk_name("vol-1").map_err(|e| e.to_string()),
            Err(format!(
                "could not get disk name from vol-1, correct format: {MANAGED_PATTERN}"
            ))
        );
        // `HTTPS` picks the unmanaged pattern, which is case-sensitive.
        assert_eq!(
            disk_name("HTTPS://acct/vhds/d.vhd").map_err(|e| e.to_string()),
            Err(format!(
                "could not get disk name from HTTPS://acct/vhds/d.vhd, correct format: {UNMANAGED_PATTERN}"
            ))
        );
    }
}
