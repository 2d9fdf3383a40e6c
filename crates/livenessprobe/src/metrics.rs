//! The metrics upstream's registry holds (csi-lib-utils' metrics manager, subsystem
//! `csi_sidecar`): the `csi_sidecar_operations_seconds` histogram of gRPC calls to the driver by
//! driver, method and status code, and `process_start_time_seconds`; rendered in the
//! Prometheus text format. The label sets are bounded: two methods, seventeen codes, the driver
//! name (and `unknown-driver` for the start-up GetPluginInfo).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use plugreg_runtime::prom::{self, Histogram};

/// The driver label before the driver's name is known.
pub const UNKNOWN_DRIVER: &str = "unknown-driver";

/// Histogram bucket bounds in seconds, as csi-lib-utils.
pub const BUCKETS: [f64; 13] = prom::CSI_OPERATION_BUCKETS;

/// (driver_name, method_name, grpc_status_code)
type Key = (String, &'static str, &'static str);

/// The registry (cheap to clone; clones share it).
#[derive(Debug, Clone)]
pub struct Metrics {
    start: f64,
    operations: Arc<Mutex<BTreeMap<Key, Histogram>>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// An empty registry; the process start time is now.
    pub fn new() -> Self {
        let start = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Self {
            start,
            operations: Arc::default(),
        }
    }

    /// Records one call of `method` to `driver` that ended with `code` after `took`.
    pub fn record(&self, driver: &str, method: &'static str, code: tonic::Code, took: Duration) {
        let seconds = took.as_secs_f64();
        let mut ops = self.operations.lock().unwrap_or_else(|e| e.into_inner());
        ops.entry((
            driver.to_owned(),
            method,
            plugreg_runtime::report::go_code(code),
        ))
        .or_insert_with(|| Histogram::new(&BUCKETS))
        .observe(seconds);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let ops = self
            .operations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut out = String::new();
        prom::header(
            &mut out,
            prom::CSI_OPERATIONS,
            prom::CSI_OPERATIONS_HELP,
            "histogram",
        );
        for ((driver, method, code), h) in &ops {
            let labels = prom::labels(&[
                ("driver_name", driver),
                ("grpc_status_code", code),
                ("method_name", method),
            ]);
            h.write(&mut out, prom::CSI_OPERATIONS, &labels);
        }
        let _ = writeln!(
            out,
            "# HELP process_start_time_seconds [ALPHA] Start time of the process since unix epoch in seconds."
        );
        let _ = writeln!(out, "# TYPE process_start_time_seconds gauge");
        prom::sample(&mut out, "process_start_time_seconds", "", self.start);
        out
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
