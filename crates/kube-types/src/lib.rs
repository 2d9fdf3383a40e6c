//! Kubernetes types and names the sidecars share: resource quantities as byte counts
//! ([`quantity`]), the CSI-migration target drivers ([`migration`]) and, with the feature `k8s`
//! (kube, k8s-openapi, serde), csi-translation-lib's translation of in-tree objects to CSI and
//! back, the snapshot and group snapshot APIs' types with the annotations and finalizers their
//! controllers agree on (`snapshot`, `groupsnapshot`) and the VolumeAttributesClass type with its discovery check (`vac`).
//!
//! It is not a client: no watches, queues or controllers (those are `plugreg-sidecar-kit`'s
//! controller runtime). Without `k8s` it pulls in neither kube nor k8s-openapi, so node sidecars
//! can name migration targets and parse quantities.

#[cfg(feature = "k8s")]
pub mod groupsnapshot;
pub mod migration;
pub mod quantity;
#[cfg(feature = "k8s")]
pub mod snapshot;
#[cfg(feature = "k8s")]
pub mod vac;
