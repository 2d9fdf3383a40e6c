//! Logs that look like upstream's (klog text or component-base JSON, `plugreg_sidecar_kit::logging`),
//! filtered by a klog-like `-v`: errors, warnings and this crate's info lines always show
//! (upstream's Info and V(1) lines); this crate's debug lines need `-v=2`; debug lines of the
//! other plugreg crates and lines sent to [`V4`] need `-v=4` (upstream's V(4): GetInfo calls,
//! health-check connections); trace lines need `-v=5`. Other crates' lines (tonic, hyper) show
//! only from `-v=6`, or when they are warnings or errors.

pub use plugreg_sidecar_kit::logging::{LogFormat, LogOptions};

/// Target for this crate's lines that upstream logs at V(4).
pub const V4: &str = "plugreg_node_driver_registrar::v4";

/// Target prefixes of this sidecar's own lines.
pub const OWN_TARGETS: &[&str] = &["plugreg_node_driver_registrar", "csi_node_driver_registrar"];

/// Installs the global subscriber (stderr, `format`, `-v` = `verbosity`). Does nothing if a
/// global subscriber is already set.
#[cfg(feature = "cli")]
pub fn init(format: LogFormat, verbosity: u32) {
    plugreg_sidecar_kit::logging::init(format, verbosity, OWN_TARGETS);
}
