//! The metrics upstream's registry holds (csi-lib-utils' metrics manager, subsystem
//! `csi_sidecar`): the `csi_sidecar_operations_seconds` histogram of gRPC calls to the driver by
//! driver, method and status code, and `process_start_time_seconds`; rendered in the
//! Prometheus text format by the sidecar kit's pieces. The label sets are bounded: two
//! methods, seventeen codes, the driver name (and `unknown-driver` for the start-up
//! GetPluginInfo).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use plugreg_runtime::prom;
use plugreg_sidecar_kit::metrics::{
    CsiOperations, Families, PROCESS_START_HELP_ALPHA, now_seconds, process_start_time,
};

/// The driver label before the driver's name is known.
pub const UNKNOWN_DRIVER: &str = "unknown-driver";

/// Histogram bucket bounds in seconds, as csi-lib-utils.
pub const BUCKETS: [f64; 13] = prom::CSI_OPERATION_BUCKETS;

/// The registry (cheap to clone; clones share it).
#[derive(Debug, Clone)]
pub struct Metrics {
    start: f64,
    operations: Arc<Mutex<CsiOperations>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// An empty registry; the process start time is read from procfs (now, if it cannot be).
    pub fn new() -> Self {
        Self {
            start: process_start_time().unwrap_or_else(now_seconds),
            operations: Arc::default(),
        }
    }

    /// Records one call of `method` to `driver` that ended with `code` after `took`.
    pub fn record(&self, driver: &str, method: &'static str, code: tonic::Code, took: Duration) {
        self.operations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(driver, method, Some(code), took);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut families = Families::default();
        self.operations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .collect(&mut families);
        families.samples(
            "process_start_time_seconds",
            PROCESS_START_HELP_ALPHA,
            "gauge",
            [(String::new(), self.start)],
        );
        families.into_text()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_lines_are_cumulative_with_sorted_labels() {
        let m = Metrics::new();
        m.record(
            "d",
            "/csi.v1.Identity/Probe",
            tonic::Code::Ok,
            Duration::from_millis(200),
        );
        m.record(
            "d",
            "/csi.v1.Identity/Probe",
            tonic::Code::Ok,
            Duration::from_secs(2),
        );
        m.record(
            UNKNOWN_DRIVER,
            "/csi.v1.Identity/GetPluginInfo",
            tonic::Code::Cancelled,
            Duration::from_millis(1),
        );
        let text = m.render();
        let probe =
            "driver_name=\"d\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/Probe\"";
        for line in [
            "# TYPE csi_sidecar_operations_seconds histogram".to_owned(),
            format!("csi_sidecar_operations_seconds_bucket{{{probe},le=\"0.1\"}} 0"),
            format!("csi_sidecar_operations_seconds_bucket{{{probe},le=\"0.25\"}} 1"),
            format!("csi_sidecar_operations_seconds_bucket{{{probe},le=\"2.5\"}} 2"),
            format!("csi_sidecar_operations_seconds_bucket{{{probe},le=\"+Inf\"}} 2"),
            format!("csi_sidecar_operations_seconds_count{{{probe}}} 2"),
            "csi_sidecar_operations_seconds_count{driver_name=\"unknown-driver\",grpc_status_code=\"Canceled\",method_name=\"/csi.v1.Identity/GetPluginInfo\"} 1".to_owned(),
            "# TYPE process_start_time_seconds gauge".to_owned(),
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        assert_eq!(
            plugreg_runtime::prom::escape_label("a\"b\\c\n"),
            "a\\\"b\\\\c\\n"
        );
    }
}
