//! CSI migration: the CSI drivers that csi-translation-lib translates in-tree volume plugins
//! to. plugreg's sidecars translate nothing (an in-tree volume keeps failing with upstream's
//! error for an untranslated one), but for these drivers they log that at start-up and label
//! their CSI call metrics with `migrated`, as upstream's sidecars do.

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

/// The in-tree plugin that the CSI driver `driver` replaces, if it is a migration target.
pub fn in_tree_plugin(driver: &str) -> Option<&'static str> {
    TARGETS
        .iter()
        .find(|(d, _)| *d == driver)
        .map(|(_, in_tree)| *in_tree)
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
    }
}
