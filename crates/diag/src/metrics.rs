//! The metrics every Kubernetes-facing sidecar exports, in the Prometheus text format (version
//! 0.0.4), numbers as Go's client writes them.
//!
//! [`Metrics`] is a controller sidecar's registry: csi-lib-utils'
//! `csi_sidecar_operations_seconds`, component-base's `workqueue_depth`, `_adds_total`,
//! `_retries_total`, `_queue_duration_seconds` and `_work_duration_seconds` (buckets 1e-08 …
//! 10, ten powers of ten), `leader_election_master_status`, Prometheus' process collector
//! (`process_start_time_seconds`, `process_resident_memory_bytes`), and whatever the sidecar
//! adds through a [`Collector`] (the provisioner's `controller_*` families, the Kubernetes
//! request counter of the rate limiter). Not covered (the API has no call for them):
//! `workqueue_unfinished_work_seconds`, `workqueue_longest_running_processor_seconds`,
//! `leader_election_slowpath_total`, Go runtime metrics, `promhttp_*`.
//!
//! The pieces stand on their own for a sidecar with a smaller registry (livenessprobe):
//! [`CsiOperations`], [`process_start_time`], [`Families`].
//!
//! Families come sorted by name and series by label values, as Go's registry gathers them; a
//! family without series is left out, as Go leaves out an empty vector. Every family holds at
//! most [`MAX_SERIES`] label sets; values of further ones are counted under [`OTHER`].

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io::{BufRead as _, BufReader, Read as _};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use plugreg_runtime::prom::{self, Histogram};

/// Label sets one family holds at most.
pub const MAX_SERIES: usize = 1024;
/// The label value that stands for every value beyond [`MAX_SERIES`].
pub const OTHER: &str = "other";

/// component-base's work-queue latency buckets: `ExponentialBuckets(10e-9, 10, 10)`.
pub const WORKQUEUE_BUCKETS: [f64; 10] =
    [1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0];

/// The help text of `process_start_time_seconds` as Prometheus' process collector writes it.
pub const PROCESS_START_HELP: &str = "Start time of the process since unix epoch in seconds.";
/// The help text of `process_start_time_seconds` as component-base's registry writes it (with
/// its stability level), which csi-lib-utils' metrics manager uses.
pub const PROCESS_START_HELP_ALPHA: &str =
    "[ALPHA] Start time of the process since unix epoch in seconds.";

/// The entry of `key` in `map`, or of `fold(key)` when the map is full and `key` new.
pub fn bounded<K: Ord, V>(
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

/// Folds any key into [`OTHER`] (the `fold` of [`bounded`] for one-label families).
pub fn other(_: String) -> String {
    OTHER.to_owned()
}

/// Families being gathered for one scrape, kept sorted by name.
#[derive(Debug, Default)]
pub struct Families(BTreeMap<String, String>);

impl Families {
    /// A counter or gauge family; nothing when it has no series.
    pub fn samples(
        &mut self,
        name: &str,
        help: &str,
        kind: &str,
        series: impl IntoIterator<Item = (String, f64)>,
    ) {
        let mut series = series.into_iter().peekable();
        if series.peek().is_none() {
            return;
        }
        let out = self.0.entry(name.to_owned()).or_default();
        if out.is_empty() {
            // Two collectors may add series to one family (the controllers of one process).
            prom::header(out, name, help, kind);
        }
        for (labels, v) in series {
            prom::sample(out, name, &labels, v);
        }
    }

    /// A histogram family; nothing when it has no series.
    pub fn histograms<'h>(
        &mut self,
        name: &str,
        help: &str,
        series: impl IntoIterator<Item = (String, &'h Histogram)>,
    ) {
        let mut series = series.into_iter().peekable();
        if series.peek().is_none() {
            return;
        }
        let out = self.0.entry(name.to_owned()).or_default();
        if out.is_empty() {
            prom::header(out, name, help, "histogram");
        }
        for (labels, h) in series {
            h.write(out, name, &labels);
        }
    }

    /// The families, in name order, as one text.
    pub fn into_text(self) -> String {
        self.0.into_values().collect()
    }
}

/// Families a sidecar adds to [`Metrics`] (its own counters), rendered on each scrape.
pub trait Collector: Debug + Send + Sync {
    /// Adds this collector's families to `families`.
    fn collect(&self, families: &mut Families);
}

/// csi-lib-utils' `csi_sidecar_operations_seconds`: gRPC calls to the driver by driver, status
/// code and method, at most [`MAX_SERIES`] label sets (further methods count as [`OTHER`]).
///
/// For a CSI-migration target driver upstream's controller sidecars add the label `migrated`
/// ([`with_migrated_label`](Self::with_migrated_label)): `true`/`false` on the calls made for
/// a volume, `false` on the others too (Probe, GetPluginInfo, capabilities, ListVolumes), as
/// csi-lib-utils' interceptor records a call without migration info.
#[derive(Debug, Clone, Default)]
pub struct CsiOperations {
    /// (driver_name, grpc_status_code, method_name, migrated): the labels' sorted order.
    calls: BTreeMap<(String, &'static str, String, &'static str), Histogram>,
    /// Whether the series carry the `migrated` label.
    migrated_label: bool,
}

/// The `migrated` label's value for a call: `true` for a migrated volume's, else `false`
/// (csi-lib-utils' interceptor defaults a call without migration info to `false`).
fn migrated_value(migrated: Option<bool>) -> &'static str {
    match migrated {
        Some(true) => "true",
        Some(false) | None => "false",
    }
}

impl CsiOperations {
    /// One call of `method` (the full gRPC path, `/csi.v1.Identity/Probe`) to `driver` that
    /// ended with `code` (`Ok` for success; `None` when it failed without a gRPC status:
    /// `unknown-non-grpc`) after `elapsed`.
    pub fn record(
        &mut self,
        driver: &str,
        method: &str,
        code: Option<tonic::Code>,
        elapsed: Duration,
    ) {
        self.record_as(driver, method, None, code, elapsed);
    }

    /// [`record`](Self::record) for a call that concerns a volume migrated (`Some(true)`) or
    /// not (`Some(false)`); the value shows only [`with_migrated_label`](Self::with_migrated_label).
    pub fn record_as(
        &mut self,
        driver: &str,
        method: &str,
        migrated: Option<bool>,
        code: Option<tonic::Code>,
        elapsed: Duration,
    ) {
        let code = code.map_or("unknown-non-grpc", plugreg_runtime::report::go_code);
        let migrated = migrated_value(migrated);
        bounded(
            &mut self.calls,
            (driver.to_owned(), code, method.to_owned(), migrated),
            |(d, c, _, m)| (d, c, OTHER.to_owned(), m),
            || Histogram::new(&prom::CSI_OPERATION_BUCKETS),
        )
        .observe(elapsed.as_secs_f64());
    }

    /// Adds the `migrated` label to every series (upstream does for a CSI-migration target).
    pub fn with_migrated_label(&mut self) {
        self.migrated_label = true;
    }

    /// The label sets held.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// Whether no call was recorded.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// The histogram of one label set, if any call was recorded with it.
    pub fn get(&self, driver: &str, code: &str, method: &str) -> Option<&Histogram> {
        self.calls
            .iter()
            .find(|((d, c, m, _), _)| d == driver && *c == code && m == method)
            .map(|(_, h)| h)
    }

    /// Adds the family (nothing when no call was recorded).
    pub fn collect(&self, families: &mut Families) {
        families.histograms(
            prom::CSI_OPERATIONS,
            prom::CSI_OPERATIONS_HELP,
            self.calls
                .iter()
                .map(|((driver, code, method, migrated), h)| {
                    let mut labels = vec![
                        ("driver_name", driver.as_str()),
                        ("grpc_status_code", *code),
                        ("method_name", method.as_str()),
                    ];
                    if self.migrated_label {
                        labels.push(("migrated", *migrated));
                    }
                    (prom::labels(&labels), h)
                }),
        );
    }
}

/// Every metric a controller sidecar exports. Cheap to share (`Arc<Metrics>`), safe to update
/// from any task.
#[derive(Debug)]
pub struct Metrics {
    driver: String,
    /// Seconds since the epoch at which the process started.
    start: f64,
    state: Mutex<State>,
    /// By key: registering a key again replaces its collector (a controller restarted).
    collectors: Mutex<Vec<(String, Arc<dyn Collector>)>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new("")
    }
}

#[derive(Debug, Default)]
struct State {
    csi: CsiOperations,
    queues: BTreeMap<String, Queue>,
    leader: BTreeMap<String, bool>,
    /// `process_start_time_seconds` with component-base's HELP ([`PROCESS_START_HELP_ALPHA`]).
    alpha_process_start: bool,
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

impl Metrics {
    /// An empty registry for the driver `driver` (the `driver_name` label of the CSI calls).
    pub fn new(driver: &str) -> Self {
        Self {
            driver: driver.to_owned(),
            start: process_start_time().unwrap_or_else(now_seconds),
            state: Mutex::default(),
            collectors: Mutex::default(),
        }
    }

    /// Sets the driver name once it is known (GetPluginInfo answers after the first calls).
    pub fn set_driver(&mut self, driver: &str) {
        self.driver = driver.to_owned();
    }

    /// Adds the label `migrated` to `csi_sidecar_operations_seconds`, as upstream's controller
    /// sidecars do for a CSI-migration target driver (`plugreg_kube_types::migration`).
    pub fn with_migrated_label(&mut self) {
        self.lock().csi.with_migrated_label();
    }

    /// Sets `process_start_time_seconds` (for tests of the exact output; the default is read
    /// from procfs).
    pub fn set_start_time(&mut self, seconds: f64) {
        self.start = seconds;
    }

    /// Adds `collector`'s families to every later [`render`](Self::render), under `key`: a
    /// collector registered under the same key before is replaced (a controller that restarts
    /// inside the process registers its counters again).
    pub fn register(&self, key: &str, collector: Arc<dyn Collector>) {
        let mut all = self.collectors.lock().unwrap_or_else(|e| e.into_inner());
        match all.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = collector,
            None => all.push((key.to_owned(), collector)),
        }
    }

    /// Writes `process_start_time_seconds` with component-base's HELP
    /// ([`PROCESS_START_HELP_ALPHA`]), as a sidecar whose only registry is csi-lib-utils'
    /// metrics manager shows it (external-health-monitor); by default the Prometheus process
    /// collector's, as the sidecars that register it show it.
    pub fn alpha_process_start_help(&self) {
        self.lock().alpha_process_start = true;
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Counters stay consistent between statements; a panic elsewhere cannot break them.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One CSI call: `method` is the full gRPC path (`/csi.v1.Controller/CreateVolume`),
    /// `code` its status (`Ok` for success; `None` when the call failed without a gRPC status:
    /// `unknown-non-grpc`).
    pub fn csi_call(&self, method: &str, code: Option<tonic::Code>, elapsed: Duration) {
        self.csi_call_as(method, None, code, elapsed);
    }

    /// [`csi_call`](Self::csi_call) for a call that concerns a volume, migrated or not (the
    /// `migrated` label's value, see [`CsiOperations`]).
    pub fn csi_call_as(
        &self,
        method: &str,
        migrated: Option<bool>,
        code: Option<tonic::Code>,
        elapsed: Duration,
    ) {
        self.lock()
            .csi
            .record_as(&self.driver, method, migrated, code, elapsed);
    }

    /// Runs one CSI call and records it with [`csi_call`](Self::csi_call): `code` tells the
    /// status of a failure (`None`: it failed without a gRPC status).
    pub async fn timed_csi_call<T, E>(
        &self,
        method: &str,
        call: impl Future<Output = Result<T, E>>,
        code: impl FnOnce(&E) -> Option<tonic::Code>,
    ) -> Result<T, E> {
        self.timed_csi_call_as(method, None, call, code).await
    }

    /// [`timed_csi_call`](Self::timed_csi_call) for a call that concerns a volume, migrated or
    /// not (see [`csi_call_as`](Self::csi_call_as)).
    pub async fn timed_csi_call_as<T, E>(
        &self,
        method: &str,
        migrated: Option<bool>,
        call: impl Future<Output = Result<T, E>>,
        code: impl FnOnce(&E) -> Option<tonic::Code>,
    ) -> Result<T, E> {
        let started = std::time::Instant::now();
        let result = call.await;
        let status = match &result {
            Ok(_) => Some(tonic::Code::Ok),
            Err(e) => code(e),
        };
        self.csi_call_as(method, migrated, status, started.elapsed());
        result
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

    /// Everything, in the Prometheus text format (version 0.0.4).
    pub fn render(&self) -> String {
        self.render_with(resident_memory_bytes())
    }

    /// [`render`](Self::render) with the resident memory given (`None`: left out), for tests
    /// of the exact output.
    pub fn render_with(&self, rss: Option<u64>) -> String {
        let mut f = Families::default();
        {
            let s = self.lock();
            let name = |n: &String| prom::labels(&[("name", n.as_str())]);
            s.csi.collect(&mut f);
            f.samples(
                "leader_election_master_status",
                "[ALPHA] Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master. 'name' is the string used to identify the lease. Please make sure to group by name.",
                "gauge",
                s.leader
                    .iter()
                    .map(|(n, l)| (name(n), if *l { 1.0 } else { 0.0 })),
            );
            f.samples(
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                "gauge",
                rss.map(|b| (String::new(), b as f64)),
            );
            f.samples(
                "process_start_time_seconds",
                if s.alpha_process_start {
                    PROCESS_START_HELP_ALPHA
                } else {
                    PROCESS_START_HELP
                },
                "gauge",
                [(String::new(), self.start)],
            );
            f.samples(
                "workqueue_adds_total",
                "[ALPHA] Total number of adds handled by workqueue",
                "counter",
                s.queues.iter().map(|(n, q)| (name(n), q.adds as f64)),
            );
            f.samples(
                "workqueue_depth",
                "[ALPHA] Current depth of workqueue",
                "gauge",
                s.queues.iter().map(|(n, q)| (name(n), q.depth as f64)),
            );
            f.histograms(
                "workqueue_queue_duration_seconds",
                "[ALPHA] How long in seconds an item stays in workqueue before being requested.",
                s.queues.iter().map(|(n, q)| (name(n), &q.waited)),
            );
            f.samples(
                "workqueue_retries_total",
                "[ALPHA] Total number of retries handled by workqueue",
                "counter",
                s.queues.iter().map(|(n, q)| (name(n), q.retries as f64)),
            );
            f.histograms(
                "workqueue_work_duration_seconds",
                "[ALPHA] How long in seconds processing an item from workqueue takes.",
                s.queues.iter().map(|(n, q)| (name(n), &q.worked)),
            );
        }
        let collectors = self
            .collectors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for (_, c) in collectors {
            c.collect(&mut f);
        }
        f.into_text()
    }
}

/// Seconds since the epoch, now.
pub fn now_seconds() -> f64 {
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

/// This process's start in seconds since the epoch, as Prometheus' process collector reads it:
/// boot time (`btime` of `/proc/stat`) plus the process's start in clock ticks (field 22 of
/// `/proc/self/stat`) at procfs' fixed 100 ticks a second.
pub fn process_start_time() -> Option<f64> {
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
pub fn resident_memory_bytes() -> Option<u64> {
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
            m.queue_add(&format!("q-{i}"));
            m.csi_call(&format!("/m/{i}"), Some(tonic::Code::Ok), ms(1));
        }
        let s = m.lock();
        assert_eq!(s.queues[OTHER].adds, 10);
        assert_eq!(s.csi.len(), MAX_SERIES + 1);
        assert_eq!(s.csi.get("d", "OK", OTHER).unwrap().count(), 10);
        drop(s);
        // A known label set still counts as itself.
        m.queue_add("q-0");
        assert_eq!(m.lock().queues["q-0"].adds, 2);
    }

    #[derive(Debug)]
    struct Fixed;

    impl Collector for Fixed {
        fn collect(&self, families: &mut Families) {
            families.samples("a_first", "A.", "gauge", [(String::new(), 1.0)]);
            families.samples("zz_last", "Z.", "counter", [(String::new(), 2.0)]);
            families.samples("empty", "E.", "counter", []);
        }
    }

    #[test]
    fn collectors_are_merged_in_name_order() {
        let mut m = Metrics::new("d");
        m.set_start_time(1_700_000_000.25);
        m.leader("l", true);
        m.register("fixed", Arc::new(Fixed));
        let text = m.render_with(None);
        let names: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .collect();
        assert_eq!(
            names,
            [
                "a_first gauge",
                "leader_election_master_status gauge",
                "process_start_time_seconds gauge",
                "zz_last counter"
            ]
        );
        assert!(text.ends_with("zz_last 2\n"), "{text}");
        assert!(text.contains("\nprocess_start_time_seconds 1.70000000025e+09\n"));
    }

    #[derive(Debug)]
    struct Labelled(&'static str, f64);

    impl Collector for Labelled {
        fn collect(&self, families: &mut Families) {
            families.samples(
                "shared_total",
                "S.",
                "counter",
                [(prom::labels(&[("c", self.0)]), self.1)],
            );
        }
    }

    /// Two collectors of one family write one header; a key registered again replaces its
    /// collector instead of adding a second one.
    #[test]
    fn a_family_of_two_collectors_has_one_header_and_keys_replace() {
        let m = Metrics::new("d");
        m.register("a", Arc::new(Labelled("a", 1.0)));
        m.register("b", Arc::new(Labelled("b", 2.0)));
        m.register("a", Arc::new(Labelled("a", 3.0)));
        let text = m.render_with(None);
        assert_eq!(
            text.matches("# TYPE shared_total counter").count(),
            1,
            "{text}"
        );
        assert!(text.contains("shared_total{c=\"a\"} 3\n"), "{text}");
        assert!(text.contains("shared_total{c=\"b\"} 2\n"), "{text}");
        assert_eq!(text.matches("shared_total{").count(), 2, "{text}");
    }

    /// A migration target's series carry `migrated`: `false` for a volume's call and for the
    /// others (migration checklist 1); without the label the series are as before.
    #[test]
    fn migrated_label_only_when_asked() {
        let mut m = Metrics::new("ebs.csi.aws.com");
        m.csi_call_as(
            "/csi.v1.Controller/ControllerPublishVolume",
            Some(false),
            Some(tonic::Code::Ok),
            Duration::from_millis(1),
        );
        m.csi_call(
            "/csi.v1.Identity/Probe",
            Some(tonic::Code::Ok),
            Duration::from_millis(1),
        );
        let plain = m.render();
        assert!(!plain.contains("migrated="), "{plain}");
        m.with_migrated_label();
        let out = m.render();
        assert!(out.contains("csi_sidecar_operations_seconds_count{driver_name=\"ebs.csi.aws.com\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/ControllerPublishVolume\",migrated=\"false\"} 1"), "{out}");
        assert!(out.contains("csi_sidecar_operations_seconds_count{driver_name=\"ebs.csi.aws.com\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/Probe\",migrated=\"false\"} 1"), "{out}");
    }
}
