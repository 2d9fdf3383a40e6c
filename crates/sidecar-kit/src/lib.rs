//! The sidecar kit: what plugreg's drop-ins for the Go CSI sidecars (csi-node-driver-registrar,
//! livenessprobe, csi-provisioner, and the controller sidecars to come) share, so that a sidecar
//! is its own decisions plus a thin binary.
//!
//! The kit keeps the sidecar skeleton ([`flags`], [`compat`], [`cli`]), [`connect`] and the
//! controller runtime; what stands on its own lives in three crates it re-exports at its root:
//! `plugreg-goflag` (Go flag syntax and klog logging: [`gotext`], [`gosyntax`], [`goflag`],
//! [`pflag`], [`logging`]), `plugreg-kube-types` (Kubernetes types and names: [`quantity`],
//! [`migration`], `snapshot`, `vac`) and `plugreg-diag` (the diagnostics HTTP server and the
//! metrics registry: [`http`], [`metrics`]).
//!
//! # What a new sidecar writes, and what the kit gives it
//!
//! A sidecar crate writes:
//! - its own flags: a type implementing [`flags::SidecarFlags`] (its [`goflag::Spec`]s and where
//!   their values go; a controller sidecar embeds [`flags::ControllerFlags`] in it), and a
//!   [`flags::Command`] naming the syntax (Go's `flag` or pflag), its help texts and the
//!   upstream sidecar it replaces;
//! - its decide/act code, on the kit's parts below;
//! - a thin `main`: a [`cli::Program`] (name, version, log targets) whose
//!   [`main`](cli::Program::main) parses, answers `--help`, sets up logging and exits with
//!   upstream's codes, calling the sidecar's start-up.
//!
//! The kit gives it:
//! - the command line: [`flags`] (the skeleton: logging flags, removed klog flags, `--version`,
//!   the controller block of `--kubeconfig`, `--master`, `--kube-api-qps`/`--kube-api-burst`,
//!   `--leader-election*`, `--http-endpoint`/`--metrics-address`/`--metrics-path`) over Go's
//!   `flag` and spf13/pflag syntax and value parsers ([`goflag`], [`pflag`], [`gosyntax`]), and
//!   the flags and feature gates of older upstream releases that manifests still pass
//!   ([`compat`]: accepted with a warning where safe);
//! - the binary: [`cli`] (feature `cli`), component-base's logging flags and klog-style log
//!   lines ([`logging`]);
//! - [`connect`]: reaching the driver within a window, logging "Still connecting";
//! - [`metrics`]: the registry with `csi_sidecar_operations_seconds`, the work-queue, leader and
//!   process metrics, and the sidecar's own families through a [`metrics::Collector`];
//! - [`quantity`]: Kubernetes resource quantities as byte counts, both ways;
//! - [`gotext`]: Go's quoted strings and `strconv.Atoi` errors, as upstream's texts show them;
//! - [`migration`]: the CSI-migration target drivers and (with `controller`) the translation of
//!   in-tree StorageClasses and PVs to CSI and back (csi-translation-lib's);
//! - [`http`]: a small HTTP/1 diagnostics server with the bounds a network endpoint needs and one
//!   shared health check in flight;
//! - with the feature `controller` (kube and k8s-openapi; node sidecars leave it out):
//!   [`driver`] (the CSI driver reached, identified and watched at start-up, as csi-lib-utils
//!   and the sidecars' `main`s do), [`csi`] (the one timed CSI client the sidecars' drivers
//!   wrap), [`leader`] (leader election on a Lease, [`leader::run_elected`] for a controller that
//!   works only while it leads), [`cache`] (trimmed watch caches), [`compact`] (their compact entries), [`events`] (client-go's
//!   event recorder),
//!   [`lifecycle`] (a controller sidecar's process: signals, the watched driver connection,
//!   start-up raced against both, the run and its upstream way of stopping),
//!   [`ratelimit`] (the rate-limited kube clients with two priorities), [`queue`] (client-go's
//!   work queue), [`runtime`] (the controller runtime: workers, per-key serialisation,
//!   back-off, resync and the memory of our own writes, over the queue), [`diagnostics`] (`/metrics` and `/healthz/leader-election`), [`service`] (the clients, the
//!   election and the controllers of a run), [`shared`] (one watch per kind for the
//!   controllers of one process), [`vac`] (the
//!   VolumeAttributesClass type and its discovery check), [`snapshot`] (the snapshot API's
//!   types and the annotations and finalizers its controllers agree on).

#[cfg(feature = "controller")]
pub mod cache;
#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "controller")]
pub mod compact;
pub mod compat;
pub mod connect;
#[cfg(feature = "controller")]
pub mod csi;
#[cfg(feature = "controller")]
pub mod diagnostics;
#[cfg(feature = "controller")]
pub mod driver;
#[cfg(feature = "controller")]
pub mod events;
pub mod flags;
#[cfg(feature = "controller")]
pub mod leader;
#[cfg(feature = "controller")]
pub mod lifecycle;
#[cfg(feature = "controller")]
pub mod queue;
#[cfg(feature = "controller")]
pub mod ratelimit;
#[cfg(feature = "controller")]
pub mod runtime;
#[cfg(feature = "controller")]
pub mod service;
#[cfg(feature = "controller")]
pub mod shared;

pub use plugreg_diag::{http, metrics};
pub use plugreg_goflag::{goflag, gosyntax, gotext, logging, pflag};
#[cfg(feature = "controller")]
pub use plugreg_kube_types::{groupsnapshot, snapshot, vac};
pub use plugreg_kube_types::{migration, quantity};

/// The version every sidecar reports (`--version`, the `Version` log line):
/// `PLUGREG_VERSION` at build time, else `v` + the workspace version.
pub const VERSION: &str = match option_env!("PLUGREG_VERSION") {
    Some(v) => v,
    None => concat!("v", env!("CARGO_PKG_VERSION")),
};
