//! CSI migration: the in-tree volume plugins that Kubernetes hands to CSI drivers, and (with the
//! feature `k8s`) the translation between their objects and CSI's, as
//! k8s.io/csi-translation-lib v0.36.1 does it for the controller sidecars
//! (`spec/upstream-csi-migration.md`).
//!
//! Written once for csi-provisioner, csi-attacher and csi-resizer. Every translation is a pure
//! function over k8s-openapi objects: it takes the object by reference and returns a translated
//! copy or upstream's error text. Selection follows upstream: an in-tree PV is chosen by its
//! source field (never by name), a CSI PV by `spec.csi.driver`, a StorageClass by the in-tree
//! plugin name it is translated for.
//!
//! Where Go iterates a map and the outcome depends on the order (colliding parameter keys such
//! as `fsType` beside `csi.storage.k8s.io/fstype`, or `zone` beside `zones`), we iterate in the
//! keys' sorted order, so the last key in that order wins; upstream's result is random there.

#[cfg(feature = "k8s")]
mod aws_ebs;
#[cfg(feature = "k8s")]
mod azure_disk;
#[cfg(feature = "k8s")]
mod azure_file;
#[cfg(feature = "k8s")]
mod cinder;
#[cfg(feature = "k8s")]
mod error;
#[cfg(feature = "k8s")]
mod gce_pd;
#[cfg(feature = "k8s")]
mod portworx;
#[cfg(all(test, feature = "k8s"))]
mod tests_translate;
#[cfg(feature = "k8s")]
mod topology;
#[cfg(feature = "k8s")]
mod translate;
#[cfg(feature = "k8s")]
mod vsphere;

#[cfg(feature = "k8s")]
pub use error::{Error, RegionError, TopologyError};
#[cfg(feature = "k8s")]
pub use translate::{
    in_tree_plugin_of_pv, is_pv_migratable, repair_volume_handle, translate_csi_pv_to_in_tree,
    translate_in_tree_pv_to_csi, translate_storage_class,
};

/// The CSI drivers csi-translation-lib knows, each with the in-tree plugin it replaces.
pub const TARGETS: &[(&str, &str)] = &[
    ("ebs.csi.aws.com", "kubernetes.io/aws-ebs"),
    ("pd.csi.storage.gke.io", "kubernetes.io/gce-pd"),
    ("disk.csi.azure.com", "kubernetes.io/azure-disk"),
    ("file.csi.azure.com", "kubernetes.io/azure-file"),
    ("cinder.csi.openstack.org", "kubernetes.io/cinder"),
    ("csi.vsphere.vmware.com", "kubernetes.io/vsphere-volume"),
    ("pxd.portworx.com", "kubernetes.io/portworx-volume"),
];

/// The PV labels a translation reads (a GCE PD handle is made of the zones): what a watch
/// cache that trims labels keeps of an in-tree PV.
pub const TRANSLATION_LABELS: [&str; 2] = [
    "topology.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/zone",
];

/// The PV annotations a translation reads (Azure File's resource group, Portworx's secret):
/// what a watch cache that trims annotations keeps of an in-tree PV.
pub const TRANSLATION_ANNOTATIONS: [&str; 3] = [
    "kubernetes.io/azure-file-resource-group",
    "openstorage.io/auth-secret-name",
    "openstorage.io/auth-secret-namespace",
];

/// Of `labels`, those a translation reads ([`TRANSLATION_LABELS`]); none left: `None`.
pub fn translation_labels(
    labels: Option<std::collections::BTreeMap<String, String>>,
) -> Option<std::collections::BTreeMap<String, String>> {
    labels
        .map(|mut l| {
            l.retain(|k, _| TRANSLATION_LABELS.contains(&k.as_str()));
            l
        })
        .filter(|l| !l.is_empty())
}

/// The in-tree plugin that the CSI driver `driver` replaces, if it is a migration target.
pub fn in_tree_plugin(driver: &str) -> Option<&'static str> {
    TARGETS
        .iter()
        .find(|(d, _)| *d == driver)
        .map(|(_, in_tree)| *in_tree)
}

/// The CSI driver that replaces the in-tree plugin `in_tree`, if it is migrated.
pub fn csi_driver(in_tree: &str) -> Option<&'static str> {
    TARGETS
        .iter()
        .find(|(_, p)| *p == in_tree)
        .map(|(driver, _)| *driver)
}

/// One in-tree volume plugin of [`TARGETS`] (the table's order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plugin {
    /// `kubernetes.io/aws-ebs` → `ebs.csi.aws.com`.
    AwsEbs,
    /// `kubernetes.io/gce-pd` → `pd.csi.storage.gke.io`.
    GcePd,
    /// `kubernetes.io/azure-disk` → `disk.csi.azure.com`.
    AzureDisk,
    /// `kubernetes.io/azure-file` → `file.csi.azure.com`.
    AzureFile,
    /// `kubernetes.io/cinder` → `cinder.csi.openstack.org`.
    Cinder,
    /// `kubernetes.io/vsphere-volume` → `csi.vsphere.vmware.com`.
    VSphere,
    /// `kubernetes.io/portworx-volume` → `pxd.portworx.com`.
    Portworx,
}

impl Plugin {
    /// Every plugin, in the table's order.
    pub const ALL: [Plugin; 7] = [
        Plugin::AwsEbs,
        Plugin::GcePd,
        Plugin::AzureDisk,
        Plugin::AzureFile,
        Plugin::Cinder,
        Plugin::VSphere,
        Plugin::Portworx,
    ];

    fn row(self) -> (&'static str, &'static str) {
        TARGETS[self as usize]
    }

    /// The CSI driver's name.
    pub fn csi_driver(self) -> &'static str {
        self.row().0
    }

    /// The in-tree plugin's name (`kubernetes.io/...`).
    pub fn in_tree_name(self) -> &'static str {
        self.row().1
    }

    /// The plugin replaced by the CSI driver `driver` (exact, case-sensitive).
    pub fn from_csi_driver(driver: &str) -> Option<Plugin> {
        Plugin::ALL.into_iter().find(|p| p.csi_driver() == driver)
    }

    /// The plugin named `in_tree` (exact, case-sensitive).
    pub fn from_in_tree_name(in_tree: &str) -> Option<Plugin> {
        Plugin::ALL
            .into_iter()
            .find(|p| p.in_tree_name() == in_tree)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knows_the_targets_and_nothing_else() {
        assert_eq!(
            in_tree_plugin("ebs.csi.aws.com"),
            Some("kubernetes.io/aws-ebs")
        );
        assert_eq!(in_tree_plugin("hostpath.csi.k8s.io"), None);
        assert_eq!(
            csi_driver("kubernetes.io/gce-pd"),
            Some("pd.csi.storage.gke.io")
        );
        assert_eq!(csi_driver("kubernetes.io/rbd"), None);
        assert_eq!(in_tree_plugin("EBS.csi.aws.com"), None, "case-sensitive");
    }

    #[test]
    fn plugins_follow_the_table_both_ways() {
        assert_eq!(Plugin::ALL.len(), TARGETS.len());
        for (plugin, (driver, in_tree)) in Plugin::ALL.into_iter().zip(TARGETS) {
            assert_eq!(plugin.csi_driver(), *driver);
            assert_eq!(plugin.in_tree_name(), *in_tree);
            assert_eq!(Plugin::from_csi_driver(driver), Some(plugin));
            assert_eq!(Plugin::from_in_tree_name(in_tree), Some(plugin));
        }
    }
}
