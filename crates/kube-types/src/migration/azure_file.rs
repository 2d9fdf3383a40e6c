//! Azure File: `kubernetes.io/azure-file` ↔ `file.csi.azure.com` (§3.4), with its secret
//! rules. StorageClasses pass unchanged.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use k8s_openapi::api::core::v1::{
    AzureFilePersistentVolumeSource, CSIPersistentVolumeSource, PersistentVolume, SecretReference,
};
use regex::Regex;

use super::error::Error;

/// The driver.
const DRIVER: &str = "file.csi.azure.com";
/// The PV annotation naming the share's resource group.
pub(super) const RESOURCE_GROUP_ANNOTATION: &str = "kubernetes.io/azure-file-resource-group";
/// The secret namespace when none is known on the way back.
const DEFAULT_SECRET_NAMESPACE: &str = "default";

static SECRET_NAME_RE: LazyLock<Regex> = LazyLock::new(|| {
    // A constant pattern, compiled by the unit tests.
    Regex::new("azure-storage-account-(.+)-secret").unwrap_or_else(|e| unreachable!("{e}"))
});

/// The storage account a secret name stands for: `azure-storage-account-<account>-secret`
/// anywhere in it, else the whole name.
fn account(secret_name: &str) -> &str {
    SECRET_NAME_RE
        .captures(secret_name)
        .and_then(|c| c.get(1))
        .map_or(secret_name, |m| m.as_str())
}

/// `azureFile` → CSI: handle `<rg>#<account>#<share>#<pv>#<namespace>`, the secret as the
/// node-stage secret, `{sharename}`.
pub(super) fn pv_to_csi(pv: &mut PersistentVolume) -> Result<(), Error> {
    let name = pv.metadata.name.clone().unwrap_or_default();
    let resource_group = pv
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(RESOURCE_GROUP_ANNOTATION))
        .cloned()
        .unwrap_or_default();
    let spec = pv.spec.get_or_insert_with(Default::default);
    let Some(file) = spec.azure_file.take() else {
        return Ok(());
    };
    let namespace = match (&file.secret_namespace, &spec.claim_ref) {
        (Some(ns), _) => ns.clone(),
        (None, Some(claim)) => claim.namespace.clone().unwrap_or_default(),
        (None, None) => return Err(Error::AzureFileSecretNamespace),
    };
    let handle = format!(
        "{resource_group}#{}#{}#{name}#{namespace}",
        account(&file.secret_name),
        file.share_name
    );
    spec.csi = Some(CSIPersistentVolumeSource {
        driver: DRIVER.to_owned(),
        volume_handle: handle,
        read_only: file.read_only,
        node_stage_secret_ref: Some(SecretReference {
            name: Some(file.secret_name),
            namespace: Some(namespace),
        }),
        volume_attributes: Some(BTreeMap::from([("sharename".to_owned(), file.share_name)])),
        ..Default::default()
    });
    Ok(())
}

/// CSI → `azureFile`: share and secret from the attributes or the node-stage secret, else from
/// the handle (whose resource group becomes the annotation); namespace `default` when none.
pub(super) fn pv_to_in_tree(pv: &mut PersistentVolume) -> Result<(), Error> {
    let Some(csi) = pv.spec.as_ref().and_then(|s| s.csi.clone()) else {
        return Err(Error::NoCsiSource);
    };
    let mut file = AzureFilePersistentVolumeSource {
        read_only: csi.read_only,
        ..Default::default()
    };
    for (k, v) in csi.volume_attributes.iter().flatten() {
        match k.to_lowercase().as_str() {
            "sharename" => file.share_name = v.clone(),
            "secretname" => file.secret_name = v.clone(),
            "secretnamespace" => file.secret_namespace = Some(v.clone()),
            _ => {}
        }
    }
    if let Some(secret) = &csi.node_stage_secret_ref
        && secret.name.as_deref().is_some_and(|n| !n.is_empty())
    {
        file.secret_name = secret.name.clone().unwrap_or_default();
        file.secret_namespace = Some(secret.namespace.clone().unwrap_or_default());
    }
    let mut resource_group = String::new();
    if file.share_name.is_empty() || file.secret_name.is_empty() {
        let parts: Vec<&str> = csi.volume_handle.split('#').collect();
        if parts.len() < 3 {
            return Err(Error::AzureFileVolumeId(csi.volume_handle));
        }
        if file.share_name.is_empty() {
            file.share_name = parts[2].to_owned();
        }
        if file.secret_name.is_empty() {
            file.secret_name = format!("azure-storage-account-{}-secret", parts[1]);
        }
        resource_group = parts[0].to_owned();
    }
    if file.secret_namespace.is_none() {
        file.secret_namespace = Some(DEFAULT_SECRET_NAMESPACE.to_owned());
    }
    if !resource_group.is_empty() {
        pv.metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(RESOURCE_GROUP_ANNOTATION.to_owned(), resource_group);
    }
    let spec = pv.spec.get_or_insert_with(Default::default);
    spec.csi = None;
    spec.azure_file = Some(file);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_account_is_the_secret_names_middle_or_the_whole_name() {
        assert_eq!(account("azure-storage-account-acct-secret"), "acct");
        assert_eq!(
            account("x-azure-storage-account-a-b-secret-secret"),
            "a-b-secret"
        );
        assert_eq!(account("my-secret"), "my-secret");
        assert_eq!(
            account("azure-storage-account--secret"),
            "azure-storage-account--secret"
        );
    }
}
