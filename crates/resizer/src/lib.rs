//! The controller logic of `csi-resizer`, a drop-in replacement of the Kubernetes CSI
//! external-resizer v2.2.1, on the sidecar kit:
//!
//! - [`flags`]: upstream's command line (Go `flag` syntax) and feature gates;
//! - [`decide`]: the pure decisions (which updates start a sync, the target size with and
//!   without RecoverVolumeExpansionFailure, error classes, the VolumeAttributesClass steps);
//! - [`cached`]: what the watch caches keep of claims, volumes and pods;
//! - [`kube`]: the claim's view, conditions, and the `storage.k8s.io/v1` VolumeAttributesClass;
//! - [`csi`]: the capability decision and the two driver calls;
//! - [`controller`]: the resize and modify controllers;
//! - [`service`]: the clients, events and leader election around them.
//!
//! `crates/resizer/README.md` lists what differs from upstream.

pub mod cached;
pub mod controller;
pub mod csi;
pub mod decide;
pub mod flags;
pub mod kube;
pub mod service;
