//! upstream's metrics (`upstream-external-provisioner.md` §17) in the Prometheus text format
//! (version 0.0.4), numbers as Go's client writes them.
//!
//! Covered: the provisioning library's six `controller_*` metrics (help texts as the library
//! writes them), `csi_sidecar_operations_seconds`, component-base's `workqueue_depth`,
//! `_adds_total`, `_retries_total`, `_queue_duration_seconds` and `_work_duration_seconds`
//! (buckets 1e-08 … 10, ten powers of ten), `leader_election_master_status`,
//! `process_start_time_seconds` and `process_resident_memory_bytes`. Not covered (the API has
//! no call for them): `workqueue_unfinished_work_seconds`,
//! `workqueue_longest_running_processor_seconds`, `leader_election_slowpath_total`, the
//! capacity gauges, Go runtime metrics, `promhttp_*`.
//!
//! Families come sorted by name and series by label values, as Go's registry gathers them; a
//! family without series is left out, as Go leaves out an empty vector. Every family holds at
//! most [`MAX_SERIES`] label sets; values of further ones are counted under [`OTHER`].

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Read as _};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use plugreg_runtime::prom::{self, Histogram};

/// Label sets one family holds at most.
pub const MAX_SERIES: usize = 1024;
/// The label value that stands for every value beyond [`MAX_SERIES`].
pub const OTHER: &str = "other";

/// component-base's work-queue latency buckets: `ExponentialBuckets(10e-9, 10, 10)`.
pub const WORKQUEUE_BUCKETS: [f64; 10] =
    [1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0];

/// Every metric the provisioner exports. Cheap to share (`Arc<Metrics>`), safe to update from
/// any task.
#[derive(Debug)]
pub struct Metrics {
    driver: String,
    /// Seconds since the epoch at which the process started.
    start: f64,
    state: Mutex<State>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new("")
    }
}

type ClassSource = (String, String);

#[derive(Debug, Default)]
struct State {
    provision_total: BTreeMap<ClassSource, u64>,
    provision_failed: BTreeMap<ClassSource, u64>,
    provision_duration: BTreeMap<ClassSource, Histogram>,
    delete_total: BTreeMap<String, u64>,
    delete_failed: BTreeMap<String, u64>,
    delete_duration: BTreeMap<String, Histogram>,
    /// (driver_name, grpc_status_code, method_name): the labels' sorted order.
    csi: BTreeMap<(String, &'static str, String), Histogram>,
    queues: BTreeMap<String, Queue>,
    leader: BTreeMap<String, bool>,
    /// Where the Kubernetes request counters come from.
    kube: Option<std::sync::Arc<crate::ratelimit::RateLimiter>>,
}

#[derive(Debug)]
struct Queue {
    depth: usize,
    adds: u64,
    retries: u64,
    waited: Histogram,
    worked: Histogram,
}

impl Default for Queue {
    fn default() -> Self {
        Self {
            depth: 0,
            adds: 0,
            retries: 0,
            waited: Histogram::new(&WORKQUEUE_BUCKETS),
            worked: Histogram::new(&WORKQUEUE_BUCKETS),
        }
    }
}

/// The entry of `key` in `map`, or of `fold(key)` when the map is full and `key` new.
fn bounded<K: Ord, V>(
    map: &mut BTreeMap<K, V>,
    key: K,
    fold: impl FnOnce(K) -> K,
    new: impl FnOnce() -> V,
) -> &mut V {
    let key = if map.len() >= MAX_SERIES && !map.contains_key(&key) {
        fold(key)
    } else {
        key
    };
    map.entry(key).or_insert_with(new)
}

fn other_class(_: ClassSource) -> ClassSource {
    (OTHER.to_owned(), OTHER.to_owned())
}

fn other(_: String) -> String {
    OTHER.to_owned()
}

impl Metrics {
    /// An empty registry for the driver `driver` (the `driver_name` label of the CSI calls).
    pub fn new(driver: &str) -> Self {
        Self {
            driver: driver.to_owned(),
            start: process_start_time().unwrap_or_else(now_seconds),
            state: Mutex::default(),
        }
    }

    /// Sets the driver name once it is known (GetPluginInfo answers after the first calls).
    pub fn set_driver(&mut self, driver: &str) {
        self.driver = driver.to_owned();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Counters stay consistent between statements; a panic elsewhere cannot break them.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One CSI call: `method` is the full gRPC path (`/csi.v1.Controller/CreateVolume`),
    /// `code` its status (`Ok` for success; `None` when the call failed without a gRPC status:
    /// `unknown-non-grpc`).
    pub fn csi_call(&self, method: &str, code: Option<tonic::Code>, elapsed: Duration) {
        let code = code.map_or("unknown-non-grpc", plugreg_runtime::report::go_code);
        let mut s = self.lock();
        bounded(
            &mut s.csi,
            (self.driver.clone(), code, method.to_owned()),
            |(d, c, _)| (d, c, OTHER.to_owned()),
            || Histogram::new(&prom::CSI_OPERATION_BUCKETS),
        )
        .observe(elapsed.as_secs_f64());
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

    fn queue<R>(&self, queue: &str, f: impl FnOnce(&mut Queue) -> R) -> R {
        let mut s = self.lock();
        f(bounded(
            &mut s.queues,
            queue.to_owned(),
            other,
            Queue::default,
        ))
    }

    /// Work-queue metrics (`workqueue_*{name="<queue>"}`): an item was added.
    pub fn queue_add(&self, queue: &str) {
        self.queue(queue, |q| q.adds += 1);
    }

    /// Work-queue metrics: the queue's current depth.
    pub fn queue_depth(&self, queue: &str, depth: usize) {
        self.queue(queue, |q| q.depth = depth);
    }

    /// Work-queue metrics: an item was re-queued after a failure (`workqueue_retries_total`).
    pub fn queue_retry(&self, queue: &str) {
        self.queue(queue, |q| q.retries += 1);
    }

    /// Work-queue metrics: an item waited `waited` in the queue and took `worked` to process.
    pub fn queue_done(&self, queue: &str, waited: Duration, worked: Duration) {
        self.queue(queue, |q| {
            q.waited.observe(waited.as_secs_f64());
            q.worked.observe(worked.as_secs_f64());
        });
    }

    /// `leader_election_master_status{name}`: 1 while this process holds the lease.
    pub fn leader(&self, name: &str, is_leader: bool) {
        *bounded(&mut self.lock().leader, name.to_owned(), other, || false) = is_leader;
    }

    /// Where `plugreg_kube_requests_total{verb,resource}` comes from: the client's limiter.
    pub fn set_kube_requests(&self, limiter: std::sync::Arc<crate::ratelimit::RateLimiter>) {
        self.lock().kube = Some(limiter);
    }

    /// Everything, in the Prometheus text format (version 0.0.4).
    pub fn render(&self) -> String {
        self.render_with(resident_memory_bytes())
    }

    /// [`render`](Self::render) with the resident memory given (`None`: left out).
    fn render_with(&self, rss: Option<u64>) -> String {
        let s = self.lock();
        let mut out = String::new();
        let o = &mut out;
        let cs = |(class, source): &ClassSource| {
            prom::labels(&[("class", class.as_str()), ("source", source.as_str())])
        };
        let c = |class: &String| prom::labels(&[("class", class.as_str())]);
        let name = |n: &String| prom::labels(&[("name", n.as_str())]);

        histograms(
            o,
            "controller_persistentvolume_delete_duration_seconds",
            "Latency in seconds to delete persistent volumes. Failed deletion attempts are ignored. Broken down by storage class name.",
            s.delete_duration.iter().map(|(k, h)| (c(k), h)),
        );
        samples(
            o,
            "controller_persistentvolume_delete_failed_total",
            "Total number of persistent volume delete failed attempts. Broken down by storage class name.",
            "counter",
            s.delete_failed.iter().map(|(k, n)| (c(k), *n as f64)),
        );
        samples(
            o,
            "controller_persistentvolume_delete_total",
            "Total number of persistent volumes deleted succesfully. Broken down by storage class name.",
            "counter",
            s.delete_total.iter().map(|(k, n)| (c(k), *n as f64)),
        );
        histograms(
            o,
            "controller_persistentvolumeclaim_provision_duration_seconds",
            "Latency in seconds to provision persistent volumes. Failed provisioning attempts are ignored. Broken down by storage class name.",
            s.provision_duration.iter().map(|(k, h)| (cs(k), h)),
        );
        samples(
            o,
            "controller_persistentvolumeclaim_provision_failed_total",
            "Total number of persistent volume provision failed attempts. Broken down by storage class name.",
            "counter",
            s.provision_failed.iter().map(|(k, n)| (cs(k), *n as f64)),
        );
        samples(
            o,
            "controller_persistentvolumeclaim_provision_total",
            "Total number of persistent volumes provisioned succesfully. Broken down by storage class name.",
            "counter",
            s.provision_total.iter().map(|(k, n)| (cs(k), *n as f64)),
        );
        histograms(
            o,
            prom::CSI_OPERATIONS,
            prom::CSI_OPERATIONS_HELP,
            s.csi.iter().map(|((driver, code, method), h)| {
                let l = prom::labels(&[
                    ("driver_name", driver.as_str()),
                    ("grpc_status_code", code),
                    ("method_name", method.as_str()),
                ]);
                (l, h)
            }),
        );
        samples(
            o,
            "leader_election_master_status",
            "[ALPHA] Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master. 'name' is the string used to identify the lease. Please make sure to group by name.",
            "gauge",
            s.leader
                .iter()
                .map(|(n, l)| (name(n), if *l { 1.0 } else { 0.0 })),
        );
        let kube = s
            .kube
            .as_ref()
            .map(|l| l.requests_by_kind())
            .unwrap_or_default();
        samples(
            o,
            "plugreg_kube_requests_total",
            "Requests sent to the Kubernetes API server (both clients), by verb and resource.",
            "counter",
            kube.iter().map(|(k, n)| {
                let (verb, resource) = k.split_once(' ').unwrap_or((k.as_str(), ""));
                (
                    prom::labels(&[("resource", resource), ("verb", verb)]),
                    *n as f64,
                )
            }),
        );
        samples(
            o,
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            "gauge",
            rss.map(|b| (String::new(), b as f64)),
        );
        samples(
            o,
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            "gauge",
            [(String::new(), self.start)],
        );
        samples(
            o,
            "workqueue_adds_total",
            "[ALPHA] Total number of adds handled by workqueue",
            "counter",
            s.queues.iter().map(|(n, q)| (name(n), q.adds as f64)),
        );
        samples(
            o,
            "workqueue_depth",
            "[ALPHA] Current depth of workqueue",
            "gauge",
            s.queues.iter().map(|(n, q)| (name(n), q.depth as f64)),
        );
        histograms(
            o,
            "workqueue_queue_duration_seconds",
            "[ALPHA] How long in seconds an item stays in workqueue before being requested.",
            s.queues.iter().map(|(n, q)| (name(n), &q.waited)),
        );
        samples(
            o,
            "workqueue_retries_total",
            "[ALPHA] Total number of retries handled by workqueue",
            "counter",
            s.queues.iter().map(|(n, q)| (name(n), q.retries as f64)),
        );
        histograms(
            o,
            "workqueue_work_duration_seconds",
            "[ALPHA] How long in seconds processing an item from workqueue takes.",
            s.queues.iter().map(|(n, q)| (name(n), &q.worked)),
        );
        out
    }
}

/// A counter or gauge family; nothing when it has no series.
fn samples(
    out: &mut String,
    name: &str,
    help: &str,
    kind: &str,
    series: impl IntoIterator<Item = (String, f64)>,
) {
    let mut series = series.into_iter().peekable();
    if series.peek().is_none() {
        return;
    }
    prom::header(out, name, help, kind);
    for (labels, v) in series {
        prom::sample(out, name, &labels, v);
    }
}

/// A histogram family; nothing when it has no series.
fn histograms<'h>(
    out: &mut String,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (String, &'h Histogram)>,
) {
    let mut series = series.into_iter().peekable();
    if series.peek().is_none() {
        return;
    }
    prom::header(out, name, help, "histogram");
    for (labels, h) in series {
        h.write(out, name, &labels);
    }
}

fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Reads at most `limit` bytes of `path`.
fn read_bounded(path: &str, limit: u64) -> Option<String> {
    let mut s = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(limit)
        .read_to_string(&mut s)
        .ok()?;
    Some(s)
}

/// As Prometheus' process collector: boot time (`btime` of `/proc/stat`) plus the process's
/// start in clock ticks (field 22 of `/proc/self/stat`) at procfs' fixed 100 ticks a second.
fn process_start_time() -> Option<f64> {
    let stat = read_bounded("/proc/self/stat", 4096)?;
    // The command name (field 2) may hold spaces and parentheses: count after the last ')'.
    let after = &stat[stat.rfind(')')? + 1..];
    let ticks: u64 = after.split_whitespace().nth(19)?.parse().ok()?;
    // /proc/stat's `intr` line can be long on big machines; `btime` follows it.
    let f = std::fs::File::open("/proc/stat").ok()?;
    let btime = BufReader::new(f.take(1 << 20))
        .lines()
        .map_while(Result::ok)
        .find_map(|l| {
            l.strip_prefix("btime ")
                .and_then(|v| v.trim().parse::<u64>().ok())
        })?;
    Some(btime as f64 + ticks as f64 / 100.0)
}

/// Resident pages (field 2 of `/proc/self/statm`) times the page size.
fn resident_memory_bytes() -> Option<u64> {
    let statm = read_bounded("/proc/self/statm", 256)?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    pages.checked_mul(rustix::param::page_size() as u64)
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
        m.start = 1_700_000_000.25;
        m.csi_call("/csi.v1.Identity/Probe", None, ms(1));
        m.provision_succeeded("fast", "", ms(30));
        m.provision_failed("slow \"x\"", "VolumeSnapshot");
        m.delete_failed("fast");
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
    fn an_empty_registry_has_only_the_process_metrics() {
        let m = Metrics::default();
        let text = m.render();
        let names: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .collect();
        assert_eq!(
            names,
            [
                "process_resident_memory_bytes gauge",
                "process_start_time_seconds gauge"
            ]
        );
        // Read from procfs: a start in the past day, a resident size above zero.
        let start: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("process_start_time_seconds "))
            .unwrap()
            .parse()
            .unwrap();
        let now = now_seconds();
        assert!(
            start <= now + 1.0 && start > now - 86_400.0,
            "{start} {now}"
        );
        let rss: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(rss > 0.0);
    }

    #[test]
    fn codes_are_grpc_gos_names_and_the_driver_is_the_one_set() {
        let mut m = Metrics::new("");
        m.csi_call(
            "/csi.v1.Identity/GetPluginInfo",
            Some(tonic::Code::Ok),
            ms(1),
        );
        m.set_driver("d");
        m.csi_call(
            "/csi.v1.Controller/CreateVolume",
            Some(tonic::Code::DeadlineExceeded),
            ms(1),
        );
        let text = m.render_with(None);
        assert!(text.contains(
            "csi_sidecar_operations_seconds_count{driver_name=\"\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/GetPluginInfo\"} 1\n"
        ));
        assert!(text.contains(
            "csi_sidecar_operations_seconds_count{driver_name=\"d\",grpc_status_code=\"DeadlineExceeded\",method_name=\"/csi.v1.Controller/CreateVolume\"} 1\n"
        ));
        assert!(!text.contains("process_resident_memory_bytes"));
    }

    #[test]
    fn label_sets_beyond_the_bound_fold_into_other() {
        let m = Metrics::new("d");
        for i in 0..MAX_SERIES + 10 {
            m.provision_failed(&format!("class-{i}"), "");
            m.delete_failed(&format!("class-{i}"));
            m.queue_add(&format!("q-{i}"));
            m.csi_call(&format!("/m/{i}"), Some(tonic::Code::Ok), ms(1));
        }
        let s = m.lock();
        assert_eq!(s.provision_failed.len(), MAX_SERIES + 1);
        assert_eq!(
            s.provision_failed[&(OTHER.to_owned(), OTHER.to_owned())],
            10
        );
        assert_eq!(s.delete_failed[OTHER], 10);
        assert_eq!(s.queues[OTHER].adds, 10);
        assert_eq!(s.csi.len(), MAX_SERIES + 1);
        assert_eq!(s.csi[&("d".to_owned(), "OK", OTHER.to_owned())].count(), 10);
        // A known label set still counts as itself.
        drop(s);
        m.provision_failed("class-0", "");
        assert_eq!(
            m.lock().provision_failed[&("class-0".to_owned(), String::new())],
            2
        );
    }
}
