//! The controller logic of `csi-attacher`, a drop-in Rust replacement of the Kubernetes CSI
//! external-attacher v4.12.0: VolumeAttachments of the driver are attached with
//! ControllerPublishVolume and detached with ControllerUnpublishVolume, their status written
//! as upstream writes it.
//!
//! - [`flags`]: upstream's command line (Go `flag` syntax) on the sidecar kit's skeleton;
//! - [`decide`]: pure decisions (what to call, what to write), tested table by table;
//! - [`csi`]: the driver's calls;
//! - [`cached`]: what the watch caches keep of each object;
//! - [`controller`]: watch caches, the attach, detach and PV queues, the reconciler;
//! - [`service`]: the Kubernetes client and leader election around the controller.

pub mod cached;
pub mod controller;
pub mod csi;
pub mod decide;
pub mod flags;
pub mod service;
