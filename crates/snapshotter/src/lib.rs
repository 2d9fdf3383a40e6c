//! The controller logic of `csi-snapshotter`, a drop-in Rust replacement of the Kubernetes CSI
//! external-snapshotter v8.6.0 sidecar: VolumeSnapshotContents of the driver get their
//! snapshots with CreateSnapshot (re-sent until ready), their pre-provisioned status from
//! ListSnapshots, and their deletion with DeleteSnapshot, with upstream's annotations,
//! finalizer, status fields and events, so that the real snapshot-controller and this sidecar
//! agree.
//!
//! - [`flags`]: upstream's command line (Go `flag` syntax) on the sidecar kit's skeleton;
//! - [`decide`]: pure decisions (what a sync does, names, parameters, secrets, texts);
//! - [`csi`]: the driver's calls;
//! - [`cached`]: what both controllers' caches keep, and when a change wakes a sync;
//! - [`controller`]: watch caches, the content queue, the sync;
//! - [`group`]: volume group snapshots (the `CSIVolumeGroupSnapshot` gate): the group content
//!   controller;
//! - [`writes`]: how both controllers write (merge patches remembered by resource version);
//! - [`service`]: the Kubernetes clients and leader election around the controller.

pub mod cached;
pub mod controller;
pub mod csi;
pub mod decide;
pub mod flags;
pub mod group;
pub mod service;
pub mod writes;
