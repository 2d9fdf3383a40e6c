//! Logs that look like upstream's: klog's text layout
//! (`I1121 11:00:43.540224       1 run.rs:42] "Msg" key="value"`) or component-base's JSON
//! (`{"ts":1732186843.540224,"caller":"run.rs:42","msg":"Msg","v":0,"key":"value"}`), on
//! stderr, filtered by a klog-like `-v`.
//!
//! How `-v` maps onto tracing levels: errors, warnings and this crate's info lines always show
//! (upstream's Info and V(1) lines); this crate's debug lines need `-v=2`; debug lines of the
//! other plugreg crates and lines sent to [`V4`] need `-v=4` (upstream's V(4): GetInfo calls,
//! health-check connections); trace lines need `-v=5`. Other crates' lines (tonic, hyper) show
//! only from `-v=6`, or when they are warnings or errors.

#[cfg(feature = "cli")]
mod klog;
#[cfg(feature = "cli")]
pub use klog::{KlogFormat, init};

/// Target for this crate's lines that upstream logs at V(4).
pub const V4: &str = "plugreg_node_driver_registrar::v4";

/// The logging flags (component-base's logging configuration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogOptions {
    /// `-v`.
    pub verbosity: u32,
    /// `--vmodule` (validated, not applied: its patterns name Go files).
    pub vmodule: String,
    /// `--logging-format` as given (`text` or `json`; anything else fails validation).
    pub format: String,
    /// `--log-flush-frequency` in nanoseconds (must be > 0; lines are written unbuffered).
    pub flush_frequency_nanos: i64,
    /// `--log-text-split-stream` (alpha: setting it fails validation).
    pub text_split_stream: bool,
    /// Whether `--log-text-info-buffer-size` is non-zero (alpha: fails validation).
    pub text_info_buffer_size_set: bool,
    /// `--log-json-split-stream` (alpha: setting it fails validation).
    pub json_split_stream: bool,
    /// Whether `--log-json-info-buffer-size` is non-zero (alpha: fails validation).
    pub json_info_buffer_size_set: bool,
}

impl Default for LogOptions {
    fn default() -> Self {
        Self {
            verbosity: 0,
            vmodule: String::new(),
            format: "text".into(),
            flush_frequency_nanos: 5_000_000_000,
            text_split_stream: false,
            text_info_buffer_size_set: false,
            json_split_stream: false,
            json_info_buffer_size_set: false,
        }
    }
}

/// The log line layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// klog text.
    Text,
    /// component-base JSON.
    Json,
}
