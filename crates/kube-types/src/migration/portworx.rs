//! Portworx: `kubernetes.io/portworx-volume` ↔ `pxd.portworx.com` (§3.7).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, PersistentVolume, PortworxVolumeSource, SecretReference,
};
use k8s_openapi::api::storage::v1::StorageClass;

use super::error::Error;

/// The driver.
const DRIVER: &str = "pxd.portworx.com";
/// The in-tree secret name (StorageClass parameter, PV annotation).
const AUTH_SECRET_NAME: &str = "openstorage.io/auth-secret-name";
/// The in-tree secret namespace (StorageClass parameter, PV annotation).
const AUTH_SECRET_NAMESPACE: &str = "openstorage.io/auth-secret-namespace";
/// The CSI operations the in-tree secret stands for.
const SECRET_OPERATIONS: [&str; 6] = [
    "provisioner",
    "controller-publish",
    "node-publish",
    "node-stage",
    "controller-expand",
    "node-expand",
];

/// The auth secret's name and namespace become every operation's CSI secret parameters; the
/// rest is copied; the class names the CSI driver.
pub(super) fn storage_class(sc: &mut StorageClass) -> Result<(), Error> {
    let mut params = BTreeMap::new();
    for (k, v) in sc.parameters.iter().flatten() {
        let suffix = match k.as_str() {
            AUTH_SECRET_NAME => "secret-name",
            AUTH_SECRET_NAMESPACE => "secret-namespace",
            _ => {
                params.insert(k.clone(), v.clone());
                continue;
            }
        };
        for op in SECRET_OPERATIONS {
            params.insert(format!("csi.storage.k8s.io/{op}-{suffix}"), v.clone());
        }
    }
    if !params.is_empty() {
        sc.parameters = Some(params);
    }
    sc.provisioner = DRIVER.to_owned();
    Ok(())
}

/// `portworxVolume` → CSI: `volumeID` as handle (`readOnly` dropped); the PV's auth secret
/// annotations, both present, as the controller-publish, node-stage, node-publish,
/// controller-expand and node-expand secret references.
pub(super) fn pv_to_csi(pv: &mut PersistentVolume) -> Result<(), Error> {
    let annotations = pv.metadata.annotations.as_ref();
    let secret = match (
        annotations.and_then(|a| a.get(AUTH_SECRET_NAME)),
        annotations.and_then(|a| a.get(AUTH_SECRET_NAMESPACE)),
    ) {
        (Some(name), Some(namespace)) => Some(SecretReference {
            name: Some(name.clone()),
            namespace: Some(namespace.clone()),
        }),
        _ => None,
    };
    let spec = pv.spec.get_or_insert_with(Default::default);
    let Some(px) = spec.portworx_volume.take() else {
        return Ok(());
    };
    spec.csi = Some(CSIPersistentVolumeSource {
        driver: DRIVER.to_owned(),
        volume_handle: px.volume_id,
        fs_type: px.fs_type,
        volume_attributes: Some(BTreeMap::new()),
        controller_publish_secret_ref: secret.clone(),
        node_stage_secret_ref: secret.clone(),
        node_publish_secret_ref: secret.clone(),
        controller_expand_secret_ref: secret.clone(),
        node_expand_secret_ref: secret,
        ..Default::default()
    });
    Ok(())
}

/// CSI → `portworxVolume`: the handle as `volumeID`; secret references are lost.
pub(super) fn pv_to_in_tree(pv: &mut PersistentVolume) -> Result<(), Error> {
    let Some(csi) = pv.spec.as_ref().and_then(|s| s.csi.clone()) else {
        return Err(Error::NoCsiSource);
    };
    let px = PortworxVolumeSource {
        volume_id: csi.volume_handle,
        fs_type: csi.fs_type,
        read_only: csi.read_only,
    };
    let spec = pv.spec.get_or_insert_with(Default::default);
    spec.csi = None;
    spec.portworx_volume = Some(px);
    Ok(())
}
