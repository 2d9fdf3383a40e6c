//! The controller logic of `csi-external-health-monitor-controller`, a drop-in Rust
//! replacement of the Kubernetes CSI external-health-monitor v0.18.0 controller sidecar: the
//! driver's volume conditions (ListVolumes page by page, or ControllerGetVolume per PV) become
//! `VolumeConditionAbnormal` and `VolumeConditionNormal` events on the claims, and failed nodes
//! `NodeFailed` and `NodeRecovered` events on the claims their pods use, with upstream's
//! reasons and messages.
//!
//! Where it differs from upstream (`decisions.md` M4): each change of a volume's condition is
//! reported once (an unchanged abnormal one again every [`decide::REFRESH`], to keep its event
//! alive), a recovery once; no Event and no claim is cached; deleted nodes, pods scheduled
//! late and PVs bound late are handled instead of crashing or being forgotten; failures back
//! off.
//!
//! - [`flags`]: upstream's command line (Go `flag` syntax) on the sidecar kit's skeleton;
//! - [`decide`]: pure decisions (the path, names, texts, the reports' and nodes' memories);
//! - [`cached`]: what the watches read and keep;
//! - [`csi`]: the driver's calls;
//! - [`controller`]: the caches, the two paths, the node watcher;
//! - [`service`]: the Kubernetes clients and leader election around the controller.

pub mod cached;
pub mod controller;
pub mod csi;
pub mod decide;
pub mod flags;
pub mod service;
