//! The controller logic of plugreg's `csi-provisioner`, a drop-in for the Kubernetes CSI
//! external-provisioner v6.3.0 (`docs/upstream/upstream-external-provisioner.md`, docs/design.md P1-P5):
//! it watches PersistentVolumeClaims, calls the driver's CreateVolume, and creates the
//! PersistentVolumes (and deletes both again).
//!
//! What every Kubernetes controller sidecar shares (leader election, events, the rate-limited
//! clients, the work queue, the metrics registry, the diagnostics server, the flag and `main`
//! skeletons, the process's lifecycle and the run under the Lease) is the sidecar kit's
//! (`plugreg_sidecar_kit`, feature `controller`); this crate is the provisioner's own
//! decisions, CSI calls and PersistentVolume rules.
//!
//! The parts, each usable on its own:
//! - [`flags`]: upstream's command line (pflag syntax) and its defaults;
//! - [`csi`]: the driver's Identity and Controller calls with `--timeout`, the start-up order;
//! - [`request`], [`secrets`], [`topology`]: the CreateVolumeRequest, pure;
//! - [`source`]: restore and clone, the checks that make CreateVolume's content source, pure;
//! - [`pv`]: the PersistentVolume made from a created volume, pure;
//! - [`quantity`]: Kubernetes resource quantities as byte counts, both ways;
//! - [`classify`]: what a failed call means (final, background, reschedule);
//! - [`metrics`]: the provisioning counters, gathered with the kit's registry;
//! - [`cached`]: what the watch cache keeps of a PersistentVolume;
//! - [`record`]: the durable record of in-flight volumes (a few Leases), written in batches;
//! - [`inflight`]: the controller's one memory of recorded volumes and recent writes;
//! - [`decide`]: what to do next with a claim, a recorded volume or a PV, pure;
//! - [`node`]: distributed provisioning (`--node-deployment`): which claims and volumes are a node's;
//! - [`controller`]: the watch caches, queues and workers that tie them together;
//! - [`start`]: the start-up steps after the driver is identified, and the [`service`] they build;
//! - [`service`]: what the binary runs after its start-up checks.

pub mod cached;
pub mod capacity;
pub mod classify;
pub mod controller;
pub mod csi;
pub mod decide;
pub mod edit;
pub mod flags;
pub mod inflight;
pub mod metrics;
pub mod node;
pub mod owner;
pub mod plan;
pub mod pv;
/// Kubernetes resource quantities as byte counts (the kit's, shared with the resizer).
pub use plugreg_sidecar_kit::quantity;
pub mod record;
pub mod request;
pub mod secrets;
pub mod service;
pub mod source;
pub mod start;
pub mod topology;
