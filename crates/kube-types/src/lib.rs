//! Kubernetes types and names the sidecars share: resource quantities as byte counts
//! ([`quantity`]), the CSI-migration target drivers ([`migration`]) and, with the feature `k8s`
//! (kube, k8s-openapi, serde), csi-translation-lib's translation of in-tree objects to CSI and
//! back, the snapshot and group snapshot APIs' types with the annotations and finalizers their
//! controllers agree on (`snapshot`, `groupsnapshot`) and the VolumeAttributesClass type with its discovery check (`vac`).
//!
//! It is not a client: no watches, queues or controllers (those are `plugreg-sidecar-kit`'s
//! controller runtime). Without `k8s` it pulls in neither kube nor k8s-openapi, so node sidecars
//! can name migration targets and parse quantities.

/// `kube::Resource` for a custom resource type of this crate (the CRDs' types are written by
/// hand, not generated): its kind, API group and version, plural and scope.
#[cfg(feature = "k8s")]
macro_rules! crd_resource {
    ($ty:ty, $group:expr, $version:expr, $kind:literal, $plural:literal, $scope:ty) => {
        impl kube::Resource for $ty {
            type DynamicType = ();
            type Scope = $scope;

            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                $kind.into()
            }
            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                $group.into()
            }
            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                $version.into()
            }
            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                $plural.into()
            }
            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata
            }
            fn meta_mut(
                &mut self,
            ) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

#[cfg(feature = "k8s")]
pub mod groupsnapshot;
pub mod migration;
pub mod quantity;
#[cfg(feature = "k8s")]
pub mod snapshot;
#[cfg(feature = "k8s")]
pub mod vac;
