//! The provisioner's metrics: the sidecar kit's registry ([`Metrics`]: CSI calls, work queues,
//! leader election, process) plus the provisioning library's six `controller_*` families
//! ([`ProvisionMetrics`], help texts as the library writes them), gathered into one text.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use plugreg_runtime::prom::{self, Histogram};
use plugreg_sidecar_kit::metrics::{Collector, Families, OTHER, bounded, other};

pub use plugreg_sidecar_kit::metrics::{MAX_SERIES, Metrics, WORKQUEUE_BUCKETS};

type ClassSource = (String, String);

/// `controller_persistentvolumeclaim_provision_*` and `controller_persistentvolume_delete_*`.
/// Cheap to share, safe to update from any task.
#[derive(Debug, Default)]
pub struct ProvisionMetrics {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    provision_total: BTreeMap<ClassSource, u64>,
    provision_failed: BTreeMap<ClassSource, u64>,
    provision_duration: BTreeMap<ClassSource, Histogram>,
    delete_total: BTreeMap<String, u64>,
    delete_failed: BTreeMap<String, u64>,
    delete_duration: BTreeMap<String, Histogram>,
}

fn other_class(_: ClassSource) -> ClassSource {
    (OTHER.to_owned(), OTHER.to_owned())
}

impl ProvisionMetrics {
    /// New counters, gathered with the rest of `metrics`.
    pub fn registered(metrics: &Metrics) -> Arc<Self> {
        let this = Arc::new(Self::default());
        metrics.register("provision", this.clone());
        this
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Counters stay consistent between statements; a panic elsewhere cannot break them.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A claim provisioned (`controller_persistentvolumeclaim_provision_total` and `_duration_seconds`).
    pub fn provision_succeeded(&self, class: &str, source: &str, elapsed: Duration) {
        let key = (class.to_owned(), source.to_owned());
        let mut s = self.lock();
        *bounded(&mut s.provision_total, key.clone(), other_class, || 0) += 1;
        bounded(&mut s.provision_duration, key, other_class, || {
            Histogram::new(&prom::DEFAULT_BUCKETS)
        })
        .observe(elapsed.as_secs_f64());
    }

    /// A provisioning attempt that did not succeed (`..._provision_failed_total`).
    pub fn provision_failed(&self, class: &str, source: &str) {
        let key = (class.to_owned(), source.to_owned());
        *bounded(&mut self.lock().provision_failed, key, other_class, || 0) += 1;
    }

    /// A volume deleted (`controller_persistentvolume_delete_total` and `_duration_seconds`).
    pub fn delete_succeeded(&self, class: &str, elapsed: Duration) {
        let mut s = self.lock();
        *bounded(&mut s.delete_total, class.to_owned(), other, || 0) += 1;
        bounded(&mut s.delete_duration, class.to_owned(), other, || {
            Histogram::new(&prom::DEFAULT_BUCKETS)
        })
        .observe(elapsed.as_secs_f64());
    }

    /// A failed deletion attempt (`controller_persistentvolume_delete_failed_total`).
    pub fn delete_failed(&self, class: &str) {
        *bounded(
            &mut self.lock().delete_failed,
            class.to_owned(),
            other,
            || 0,
        ) += 1;
    }
}

impl Collector for ProvisionMetrics {
    fn collect(&self, f: &mut Families) {
        let s = self.lock();
        let cs = |(class, source): &ClassSource| {
            prom::labels(&[("class", class.as_str()), ("source", source.as_str())])
        };
        let c = |class: &String| prom::labels(&[("class", class.as_str())]);
        f.histograms(
            "controller_persistentvolume_delete_duration_seconds",
            "Latency in seconds to delete persistent volumes. Failed deletion attempts are ignored. Broken down by storage class name.",
            s.delete_duration.iter().map(|(k, h)| (c(k), h)),
        );
        f.samples(
            "controller_persistentvolume_delete_failed_total",
            "Total number of persistent volume delete failed attempts. Broken down by storage class name.",
            "counter",
            s.delete_failed.iter().map(|(k, n)| (c(k), *n as f64)),
        );
        f.samples(
            "controller_persistentvolume_delete_total",
            "Total number of persistent volumes deleted succesfully. Broken down by storage class name.",
            "counter",
            s.delete_total.iter().map(|(k, n)| (c(k), *n as f64)),
        );
        f.histograms(
            "controller_persistentvolumeclaim_provision_duration_seconds",
            "Latency in seconds to provision persistent volumes. Failed provisioning attempts are ignored. Broken down by storage class name.",
            s.provision_duration.iter().map(|(k, h)| (cs(k), h)),
        );
        f.samples(
            "controller_persistentvolumeclaim_provision_failed_total",
            "Total number of persistent volume provision failed attempts. Broken down by storage class name.",
            "counter",
            s.provision_failed.iter().map(|(k, n)| (cs(k), *n as f64)),
        );
        f.samples(
            "controller_persistentvolumeclaim_provision_total",
            "Total number of persistent volumes provisioned succesfully. Broken down by storage class name.",
            "counter",
            s.provision_total.iter().map(|(k, n)| (cs(k), *n as f64)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }
    /// What the scenario below renders; checked line by line against component-base's and
    /// client_golang's output format (families by name, series by label values, Go numbers).
    const EXACT: &str = r#"# HELP controller_persistentvolume_delete_failed_total Total number of persistent volume delete failed attempts. Broken down by storage class name.
# TYPE controller_persistentvolume_delete_failed_total counter
controller_persistentvolume_delete_failed_total{class="fast"} 1
# HELP controller_persistentvolumeclaim_provision_duration_seconds Latency in seconds to provision persistent volumes. Failed provisioning attempts are ignored. Broken down by storage class name.
# TYPE controller_persistentvolumeclaim_provision_duration_seconds histogram
controller_persistentvolumeclaim_provision_duration_seconds_bucket{class="fast",source="",le="0.005"} 0
controller_persistentvolumeclaim_provision_duration_seconds_bucket{class="fast",source="",le="0.01"} 0
controller_persistentvolumeclaim_provision_duration_seconds_bucket{class="fast",source="",le="0.025"} 0
controller_persistentvolumeclaim_provision_duration_seconds_bucket{class="fast",source="",le="0.05"} 1
controller_persistentvolumeclaim_provision_duration_seconds_bucket{class="fast",source="",le="0.1"} 1
controller_persistentvolumeclaim_provision_duration_seconds_bucket{class="fast",source="",le="0.25"} 1
controller_persistentvolumeclaim_provision_duration_seconds_bucket{class="fast",source="",le="0.5"} 1
controller_persistentvolumeclaim_provision_duration_seconds_bucket{class="fast",source="",le="1"} 1
controller_persistentvolumeclaim_provision_duration_seconds_bucket{class="fast",source="",le="2.5"} 1
controller_persistentvolumeclaim_provision_duration_seconds_bucket{class="fast",source="",le="5"} 1
controller_persistentvolumeclaim_provision_duration_seconds_bucket{class="fast",source="",le="10"} 1
controller_persistentvolumeclaim_provision_duration_seconds_bucket{class="fast",source="",le="+Inf"} 1
controller_persistentvolumeclaim_provision_duration_seconds_sum{class="fast",source=""} 0.03
controller_persistentvolumeclaim_provision_duration_seconds_count{class="fast",source=""} 1
# HELP controller_persistentvolumeclaim_provision_failed_total Total number of persistent volume provision failed attempts. Broken down by storage class name.
# TYPE controller_persistentvolumeclaim_provision_failed_total counter
controller_persistentvolumeclaim_provision_failed_total{class="slow \"x\"",source="VolumeSnapshot"} 1
# HELP controller_persistentvolumeclaim_provision_total Total number of persistent volumes provisioned succesfully. Broken down by storage class name.
# TYPE controller_persistentvolumeclaim_provision_total counter
controller_persistentvolumeclaim_provision_total{class="fast",source=""} 1
# HELP csi_sidecar_operations_seconds [ALPHA] Container Storage Interface operation duration with gRPC error code status total
# TYPE csi_sidecar_operations_seconds histogram
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="0.1"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="0.25"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="0.5"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="1"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="2.5"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="5"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="10"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="15"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="25"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="50"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="120"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="300"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="600"} 1
csi_sidecar_operations_seconds_bucket{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe",le="+Inf"} 1
csi_sidecar_operations_seconds_sum{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe"} 0.001
csi_sidecar_operations_seconds_count{driver_name="hostpath.csi.k8s.io",grpc_status_code="unknown-non-grpc",method_name="/csi.v1.Identity/Probe"} 1
# HELP leader_election_master_status [ALPHA] Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master. 'name' is the string used to identify the lease. Please make sure to group by name.
# TYPE leader_election_master_status gauge
leader_election_master_status{name="hostpath-csi-k8s-io"} 1
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.2345678e+07
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.70000000025e+09
# HELP workqueue_adds_total [ALPHA] Total number of adds handled by workqueue
# TYPE workqueue_adds_total counter
workqueue_adds_total{name="claims"} 1
# HELP workqueue_depth [ALPHA] Current depth of workqueue
# TYPE workqueue_depth gauge
workqueue_depth{name="claims"} 1
# HELP workqueue_queue_duration_seconds [ALPHA] How long in seconds an item stays in workqueue before being requested.
# TYPE workqueue_queue_duration_seconds histogram
workqueue_queue_duration_seconds_bucket{name="claims",le="1e-08"} 0
workqueue_queue_duration_seconds_bucket{name="claims",le="1e-07"} 0
workqueue_queue_duration_seconds_bucket{name="claims",le="1e-06"} 0
workqueue_queue_duration_seconds_bucket{name="claims",le="1e-05"} 0
workqueue_queue_duration_seconds_bucket{name="claims",le="0.0001"} 1
workqueue_queue_duration_seconds_bucket{name="claims",le="0.001"} 1
workqueue_queue_duration_seconds_bucket{name="claims",le="0.01"} 1
workqueue_queue_duration_seconds_bucket{name="claims",le="0.1"} 1
workqueue_queue_duration_seconds_bucket{name="claims",le="1"} 1
workqueue_queue_duration_seconds_bucket{name="claims",le="10"} 1
workqueue_queue_duration_seconds_bucket{name="claims",le="+Inf"} 1
workqueue_queue_duration_seconds_sum{name="claims"} 5e-05
workqueue_queue_duration_seconds_count{name="claims"} 1
# HELP workqueue_retries_total [ALPHA] Total number of retries handled by workqueue
# TYPE workqueue_retries_total counter
workqueue_retries_total{name="claims"} 1
# HELP workqueue_work_duration_seconds [ALPHA] How long in seconds processing an item from workqueue takes.
# TYPE workqueue_work_duration_seconds histogram
workqueue_work_duration_seconds_bucket{name="claims",le="1e-08"} 0
workqueue_work_duration_seconds_bucket{name="claims",le="1e-07"} 0
workqueue_work_duration_seconds_bucket{name="claims",le="1e-06"} 0
workqueue_work_duration_seconds_bucket{name="claims",le="1e-05"} 0
workqueue_work_duration_seconds_bucket{name="claims",le="0.0001"} 0
workqueue_work_duration_seconds_bucket{name="claims",le="0.001"} 0
workqueue_work_duration_seconds_bucket{name="claims",le="0.01"} 0
workqueue_work_duration_seconds_bucket{name="claims",le="0.1"} 0
workqueue_work_duration_seconds_bucket{name="claims",le="1"} 1
workqueue_work_duration_seconds_bucket{name="claims",le="10"} 1
workqueue_work_duration_seconds_bucket{name="claims",le="+Inf"} 1
workqueue_work_duration_seconds_sum{name="claims"} 0.25
workqueue_work_duration_seconds_count{name="claims"} 1
"#;

    #[test]
    fn renders_the_exact_text() {
        let mut m = Metrics::new("unknown");
        m.set_driver("hostpath.csi.k8s.io");
        m.set_start_time(1_700_000_000.25);
        let p = ProvisionMetrics::registered(&m);
        m.csi_call("/csi.v1.Identity/Probe", None, ms(1));
        p.provision_succeeded("fast", "", ms(30));
        p.provision_failed("slow \"x\"", "VolumeSnapshot");
        p.delete_failed("fast");
        m.queue_add("claims");
        m.queue_depth("claims", 1);
        m.queue_retry("claims");
        m.queue_done("claims", Duration::from_micros(50), ms(250));
        m.leader("hostpath-csi-k8s-io", true);
        let text = m.render_with(Some(12_345_678));
        for (i, (got, want)) in text.lines().zip(EXACT.lines()).enumerate() {
            assert_eq!(got, want, "line {}", i + 1);
        }
        assert_eq!(text, EXACT);
    }

    #[test]
    fn label_sets_beyond_the_bound_fold_into_other() {
        let p = ProvisionMetrics::default();
        for i in 0..MAX_SERIES + 10 {
            p.provision_failed(&format!("class-{i}"), "");
            p.delete_failed(&format!("class-{i}"));
        }
        let s = p.lock();
        assert_eq!(s.provision_failed.len(), MAX_SERIES + 1);
        assert_eq!(
            s.provision_failed[&(OTHER.to_owned(), OTHER.to_owned())],
            10
        );
        assert_eq!(s.delete_failed[OTHER], 10);
        // A known label set still counts as itself.
        drop(s);
        p.provision_failed("class-0", "");
        assert_eq!(
            p.lock().provision_failed[&("class-0".to_owned(), String::new())],
            2
        );
    }
}
