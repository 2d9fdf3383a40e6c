//! Logs that look like upstream's: klog's text layout
//! (`I1121 11:00:43.540224       1 run.rs:42] "Msg" key="value"`) or component-base's JSON
//! (`{"ts":1732186843.540224,"caller":"run.rs:42","msg":"Msg","v":0,"key":"value"}`), on
//! stderr, filtered by a klog-like `-v`.
//!
//! How `-v` maps onto tracing levels: errors, warnings and the sidecar's own info lines always
//! show (upstream's Info and V(1) lines); the sidecar's debug lines need `-v=2`; debug lines of
//! the other plugreg crates and lines sent to a target ending in `::v4` need `-v=4`, lines sent
//! to a target ending in `::v5` (and plugreg's trace lines) need `-v=5`. Other crates' lines
//! (tonic, hyper) show only from `-v=6`, or when they are warnings or errors.

#[cfg(feature = "cli")]
mod klog;
#[cfg(feature = "cli")]
pub use klog::{KlogFormat, init};

use crate::gosyntax::{
    SyntaxError, check_vmodule, parse_duration_nanos, parse_quantity_nonzero, parse_u32_decimal,
};

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

impl LogOptions {
    /// Sets the boolean logging flag `name`; `false` if `name` is not one.
    pub fn set_bool(&mut self, name: &str, value: bool) -> bool {
        match name {
            "log-text-split-stream" => self.text_split_stream = value,
            "log-json-split-stream" => self.json_split_stream = value,
            _ => return false,
        }
        true
    }

    /// Sets the valued logging flag `name` from `value`; `None` if `name` is not one.
    pub fn set_value(&mut self, name: &str, value: &str) -> Option<Result<(), SyntaxError>> {
        let result = match name {
            "v" => parse_u32_decimal(value).map(|v| self.verbosity = v),
            "vmodule" => check_vmodule(value).map(|()| self.vmodule = value.to_owned()),
            "logging-format" => {
                self.format = value.to_owned();
                Ok(())
            }
            "log-flush-frequency" => {
                parse_duration_nanos(value).map(|n| self.flush_frequency_nanos = n)
            }
            "log-text-info-buffer-size" => {
                parse_quantity_nonzero(value).map(|set| self.text_info_buffer_size_set = set)
            }
            "log-json-info-buffer-size" => {
                parse_quantity_nonzero(value).map(|set| self.json_info_buffer_size_set = set)
            }
            _ => return None,
        };
        Some(result)
    }

    /// The format to use, or the validation errors upstream reports as "LoggingConfiguration
    /// is invalid" (exit 1).
    pub fn validate(&self) -> Result<LogFormat, Vec<String>> {
        let mut errors = Vec::new();
        let format = match self.format.as_str() {
            "text" => Some(LogFormat::Text),
            "json" => Some(LogFormat::Json),
            other => {
                errors.push(format!(
                    "format: Unsupported value: {other:?}: supported values: \"json\", \"text\""
                ));
                None
            }
        };
        if self.flush_frequency_nanos <= 0 {
            errors.push(format!(
                "flushFrequency: Invalid value: {}: Must be greater than zero",
                self.flush_frequency_nanos
            ));
        }
        let gated = "Forbidden: Feature LoggingAlphaOptions is disabled";
        if self.text_split_stream {
            errors.push(format!("options.text.splitStream: {gated}"));
        }
        if self.text_info_buffer_size_set {
            errors.push(format!("options.text.infoBufferSize: {gated}"));
        }
        if self.json_split_stream {
            errors.push(format!("options.json.splitStream: {gated}"));
        }
        if self.json_info_buffer_size_set {
            errors.push(format!("options.json.infoBufferSize: {gated}"));
        }
        match format {
            Some(f) if errors.is_empty() => Ok(f),
            _ => Err(errors),
        }
    }
}
