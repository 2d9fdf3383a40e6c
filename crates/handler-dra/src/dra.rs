//! The kubelet-side `DRAPlugin` handler (D10): validates the advertised DRA services as the
//! kubelet 1.36 does, keeps every registered instance of a driver (rolling updates), watches each
//! instance's connection, follows its device health stream, and calls NodePrepareResources /
//! NodeUnprepareResources on the newest connected instance with a 45 s limit.
//!
//! Each instance has a supervisor task that holds one HTTP/2 connection to the DRA socket
//! (`plugreg_transport::connect_direct_driven`, whose driver ends with the connection): the
//! instance is connected while that connection lives, and a lost connection is dialled again at
//! once (then with gRPC's back-off, 1 s x1.6 up to 120 s), so a dead socket is noticed without a
//! call. A call waits while the first dial is in flight and fails at once (Unavailable) while the
//! instance is disconnected, as a non-blocking gRPC client does.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use plugreg_handler_api::{HandlerError, PluginHandler, async_trait};
use plugreg_proto::dra::{HEALTH_V1ALPHA1_SERVICE, V1_SERVICE, V1BETA1_SERVICE};
use plugreg_proto::dra::{health_v1alpha1 as health, v1, v1beta1};
use plugreg_runtime::backoff::Backoff;
use plugreg_transport::Connection;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};

/// The services the kubelet (and plugreg) can call, in the kubelet's order.
pub const DRA_SERVICES: [&str; 2] = [V1_SERVICE, V1BETA1_SERVICE];
/// The limit of each NodePrepareResources / NodeUnprepareResources call (kubelet: 45 s).
pub const DRA_CALL_TIMEOUT: Duration = Duration::from_secs(45);
/// Pause before the health stream is opened again after it failed or ended (kubelet: 5 s).
pub const HEALTH_RETRY: Duration = Duration::from_secs(5);
/// A device's health counts as Unknown this long after its last update when the plugin gives no
/// timeout of its own (kubelet: 30 s).
pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest health message kept (longer ones are cut to 1021 bytes plus "...").
pub const MAX_HEALTH_MESSAGE: usize = 1024;
/// Limit for one dial of a DRA socket.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// gRPC's reconnect back-off.
const RECONNECT: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(120));

/// Why the DRA handler refused a plugin or a call failed.
#[derive(Debug, thiserror::Error)]
pub enum DraError {
    /// The advertised services are unusable.
    #[error(
        "invalid supported gRPC versions of DRA driver plugin {driver} at endpoint {endpoint}: {reason}"
    )]
    InvalidVersions {
        /// Driver name.
        driver: String,
        /// Endpoint.
        endpoint: String,
        /// The inner text.
        reason: String,
    },
    /// This (driver, endpoint) pair is already registered.
    #[error("endpoint {endpoint} already registered for DRA driver plugin {driver}")]
    AlreadyRegistered {
        /// Driver name.
        driver: String,
        /// Endpoint.
        endpoint: String,
    },
    /// A call named no driver.
    #[error("DRA driver name is empty")]
    EmptyName,
    /// A call named a driver with no instance.
    #[error("DRA driver {0} is not registered")]
    NotRegistered(String),
}

/// Which DRAPlugin API an instance is called with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraService {
    /// `v1.DRAPlugin`.
    V1,
    /// `v1beta1.DRAPlugin`.
    V1beta1,
}

impl DraService {
    /// The advertised string.
    pub fn as_str(self) -> &'static str {
        match self {
            DraService::V1 => V1_SERVICE,
            DraService::V1beta1 => V1BETA1_SERVICE,
        }
    }

    /// Parses an advertised string.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            V1_SERVICE => Some(DraService::V1),
            V1BETA1_SERVICE => Some(DraService::V1beta1),
            _ => None,
        }
    }
}

/// Go's `%q` of a string list: `["a" "b"]`.
fn go_quoted(list: &[impl AsRef<str>]) -> String {
    let items: Vec<String> = list.iter().map(|s| format!("{:?}", s.as_ref())).collect();
    format!("[{}]", items.join(" "))
}

/// The service the kubelet picks: the first entry of the plugin's own list it supports.
pub fn choose_service(
    driver: &str,
    endpoint: &str,
    versions: &[String],
) -> Result<DraService, DraError> {
    let invalid = |reason: String| DraError::InvalidVersions {
        driver: driver.to_owned(),
        endpoint: endpoint.to_owned(),
        reason,
    };
    if versions.is_empty() {
        return Err(invalid(
            "empty list of supported gRPC services (aka supported versions)".into(),
        ));
    }
    versions
        .iter()
        .find_map(|v| DraService::parse(v))
        .ok_or_else(|| {
            invalid(format!(
                "none of services supported by the plugin ({}) are supported by the kubelet ({})",
                go_quoted(versions),
                go_quoted(&DRA_SERVICES)
            ))
        })
}

/// An instance's connection state.
#[derive(Debug, Clone)]
enum Link {
    /// The first dial is in flight.
    Connecting,
    /// Connected.
    Ready(Connection),
    /// The last dial failed or the connection ended; being retried.
    Down(String),
}

/// One device's health as last reported.
#[derive(Debug, Clone)]
struct DeviceState {
    pool: String,
    device: String,
    health: i32,
    message: String,
    updated: i64,
    timeout: Duration,
}

/// One registered (driver, endpoint).
#[derive(Debug)]
struct Instance {
    endpoint: String,
    service: DraService,
    seq: u64,
    link: watch::Receiver<Link>,
    health: Arc<Mutex<Vec<DeviceState>>>,
    cancel: CancellationToken,
}

impl Instance {
    fn connected(&self) -> bool {
        matches!(*self.link.borrow(), Link::Ready(_))
    }
}

/// Details of one DRA instance for `/plugins` (D11).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DraDetails {
    /// The chosen service, e.g. `v1.DRAPlugin`.
    pub service: String,
    /// `connecting`, `connected` or `disconnected`.
    pub connection: String,
    /// Whether calls for the driver go to this instance now.
    pub serving: bool,
    /// Device health from the health stream.
    pub devices: Vec<DeviceDetails>,
}

/// One device's health for `/plugins`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceDetails {
    /// Pool name.
    pub pool: String,
    /// Device name.
    pub device: String,
    /// `Healthy`, `Unhealthy` or `Unknown` (also when the report is older than its timeout).
    pub health: String,
    /// The plugin's message.
    pub message: String,
}

type CallKey = (String, &'static str, &'static str);

#[derive(Debug, Default)]
struct Shared {
    drivers: Mutex<HashMap<String, Vec<Arc<Instance>>>>,
    calls: Mutex<BTreeMap<CallKey, (u64, f64)>>,
    seq: AtomicU64,
}

/// The `DRAPlugin` handler. Cheap to clone; all clones share state.
#[derive(Debug, Clone)]
pub struct DraHandler {
    shared: Arc<Shared>,
    call_timeout: Duration,
    health_retry: Duration,
}

impl Default for DraHandler {
    fn default() -> Self {
        Self::new()
    }
}

/// Cuts a health message as the kubelet does.
fn truncate_message(mut m: String) -> String {
    if m.len() > MAX_HEALTH_MESSAGE {
        let mut cut = MAX_HEALTH_MESSAGE - 3;
        while !m.is_char_boundary(cut) {
            cut -= 1;
        }
        m.truncate(cut);
        m.push_str("...");
    }
    m
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl DraHandler {
    /// The kubelet's limits: 45 s calls, health stream retried every 5 s.
    pub fn new() -> Self {
        Self::with_timeouts(DRA_CALL_TIMEOUT, HEALTH_RETRY)
    }

    /// Other limits (tests).
    pub fn with_timeouts(call_timeout: Duration, health_retry: Duration) -> Self {
        Self {
            shared: Arc::default(),
            call_timeout,
            health_retry,
        }
    }

    /// The instance calls go to: the newest connected one, else the newest.
    fn pick(&self, driver: &str) -> Result<Arc<Instance>, DraError> {
        if driver.is_empty() {
            return Err(DraError::EmptyName);
        }
        let drivers = self
            .shared
            .drivers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let list = drivers
            .get(driver)
            .filter(|l| !l.is_empty())
            .ok_or_else(|| DraError::NotRegistered(driver.to_owned()))?;
        let newest = list.iter().max_by_key(|i| i.seq).cloned();
        Ok(list
            .iter()
            .filter(|i| i.connected())
            .max_by_key(|i| i.seq)
            .cloned()
            .or(newest)
            .expect("the list is not empty"))
    }

    /// The endpoint calls for `driver` go to now.
    pub fn serving_endpoint(&self, driver: &str) -> Result<String, DraError> {
        self.pick(driver).map(|i| i.endpoint.clone())
    }

    /// Waits for the instance's connection: while the first dial is in flight, up to `deadline`.
    async fn connection(
        inst: &Instance,
        deadline: tokio::time::Instant,
    ) -> Result<Connection, Status> {
        let mut link = inst.link.clone();
        let wait = link.wait_for(|l| !matches!(l, Link::Connecting));
        let l = match tokio::time::timeout_at(deadline, wait).await {
            Ok(Ok(l)) => l.clone(),
            Ok(Err(_)) => return Err(Status::unavailable("DRA plugin instance was removed")),
            Err(_) => return Err(Status::deadline_exceeded("context deadline exceeded")),
        };
        match l {
            Link::Ready(c) => Ok(c),
            Link::Down(why) => Err(Status::unavailable(format!(
                "connection to {} is not established: {why}",
                inst.endpoint
            ))),
            Link::Connecting => unreachable!("waited for another state"),
        }
    }

    fn record(&self, driver: &str, method: &'static str, code: Code, took: Duration) {
        let mut calls = self.shared.calls.lock().unwrap_or_else(|e| e.into_inner());
        let e = calls
            .entry((
                driver.to_owned(),
                method,
                plugreg_runtime::report::go_code(code),
            ))
            .or_default();
        e.0 += 1;
        e.1 += took.as_secs_f64();
    }

    /// Runs `call` on the driver's serving instance (its service, its connection) within the
    /// call timeout, and counts it under `method`.
    async fn on_serving<T, F, Fut>(
        &self,
        driver: &str,
        method: &'static str,
        call: F,
    ) -> Result<T, Status>
    where
        F: FnOnce(DraService, Connection) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let inst = self
            .pick(driver)
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + self.call_timeout;
        let call = async {
            let conn = Self::connection(&inst, deadline).await?;
            call(inst.service, conn).await
        };
        let result = match tokio::time::timeout_at(deadline, call).await {
            Ok(r) => r,
            Err(_) => Err(Status::deadline_exceeded("context deadline exceeded")),
        };
        let code = result.as_ref().map_or_else(|s| s.code(), |_| Code::Ok);
        self.record(driver, method, code, start.elapsed());
        result
    }

    /// A request that carries the call timeout as `grpc-timeout`, so the driver sees it too.
    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        req.set_timeout(self.call_timeout);
        req
    }

    /// NodePrepareResources on the driver's serving instance (v1 answer also for v1beta1).
    pub async fn prepare(
        &self,
        driver: &str,
        claims: Vec<v1::Claim>,
    ) -> Result<v1::NodePrepareResourcesResponse, Status> {
        self.on_serving(driver, "NodePrepareResources", |service, conn| async move {
            match service {
                DraService::V1 => {
                    let mut c =
                        plugreg_transport::client!(v1::dra_plugin_client::DraPluginClient, conn);
                    let req = self.request(v1::NodePrepareResourcesRequest { claims });
                    c.node_prepare_resources(req).await.map(|r| r.into_inner())
                }
                DraService::V1beta1 => {
                    let mut c = plugreg_transport::client!(
                        v1beta1::dra_plugin_client::DraPluginClient,
                        conn
                    );
                    let claims = claims.into_iter().map(claim_to_v1beta1).collect();
                    let req = self.request(v1beta1::NodePrepareResourcesRequest { claims });
                    c.node_prepare_resources(req)
                        .await
                        .map(|r| prepare_to_v1(r.into_inner()))
                }
            }
        })
        .await
    }

    /// NodeUnprepareResources on the driver's serving instance.
    pub async fn unprepare(
        &self,
        driver: &str,
        claims: Vec<v1::Claim>,
    ) -> Result<v1::NodeUnprepareResourcesResponse, Status> {
        self.on_serving(
            driver,
            "NodeUnprepareResources",
            |service, conn| async move {
                match service {
                    DraService::V1 => {
                        let mut c = plugreg_transport::client!(
                            v1::dra_plugin_client::DraPluginClient,
                            conn
                        );
                        let req = self.request(v1::NodeUnprepareResourcesRequest { claims });
                        c.node_unprepare_resources(req)
                            .await
                            .map(|r| r.into_inner())
                    }
                    DraService::V1beta1 => {
                        let mut c = plugreg_transport::client!(
                            v1beta1::dra_plugin_client::DraPluginClient,
                            conn
                        );
                        let claims = claims.into_iter().map(claim_to_v1beta1).collect();
                        let req = self.request(v1beta1::NodeUnprepareResourcesRequest { claims });
                        c.node_unprepare_resources(req).await.map(|r| {
                            let r = r.into_inner();
                            v1::NodeUnprepareResourcesResponse {
                                claims: r
                                    .claims
                                    .into_iter()
                                    .map(|(k, v)| {
                                        (k, v1::NodeUnprepareResourceResponse { error: v.error })
                                    })
                                    .collect(),
                            }
                        })
                    }
                }
            },
        )
        .await
    }

    /// `/plugins` details of the instance registered under (driver, endpoint).
    pub fn details(&self, driver: &str, endpoint: &str) -> Option<DraDetails> {
        let serving = self.pick(driver).ok().map(|i| i.seq);
        let drivers = self
            .shared
            .drivers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let inst = drivers
            .get(driver)?
            .iter()
            .find(|i| i.endpoint == endpoint)?;
        let connection = match &*inst.link.borrow() {
            Link::Connecting => "connecting",
            Link::Ready(_) => "connected",
            Link::Down(_) => "disconnected",
        };
        let now = now_secs();
        let devices = inst
            .health
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|d| {
                let stale = now.saturating_sub(d.updated) > d.timeout.as_secs() as i64;
                let h = if stale {
                    health::HealthStatus::Unknown
                } else {
                    health::HealthStatus::try_from(d.health)
                        .unwrap_or(health::HealthStatus::Unknown)
                };
                DeviceDetails {
                    pool: d.pool.clone(),
                    device: d.device.clone(),
                    health: match h {
                        health::HealthStatus::Healthy => "Healthy",
                        health::HealthStatus::Unhealthy => "Unhealthy",
                        health::HealthStatus::Unknown => "Unknown",
                    }
                    .into(),
                    message: d.message.clone(),
                }
            })
            .collect();
        Some(DraDetails {
            service: inst.service.as_str().into(),
            connection: connection.into(),
            serving: serving == Some(inst.seq),
            devices,
        })
    }

    /// Prometheus text: `plugreg_dra_calls_total` and `plugreg_dra_call_duration_seconds_sum`
    /// by driver, method and gRPC code; `plugreg_dra_instances` by driver and connection.
    pub fn render_metrics(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let calls = self.shared.calls.lock().unwrap_or_else(|e| e.into_inner());
        out.push_str("# HELP plugreg_dra_calls_total DRA calls by driver, method and gRPC code.\n");
        out.push_str("# TYPE plugreg_dra_calls_total counter\n");
        // Debug quoting is not the text format's escaping: one escaper for every endpoint.
        let e = plugreg_runtime::prom::escape_label;
        for ((d, m, c), (n, _)) in calls.iter() {
            let (d, m, c) = (e(d), e(m), e(c));
            let _ = writeln!(
                out,
                "plugreg_dra_calls_total{{driver_name=\"{d}\",method_name=\"{m}\",grpc_status_code=\"{c}\"}} {n}"
            );
        }
        out.push_str("# HELP plugreg_dra_call_duration_seconds_sum Time spent in DRA calls.\n");
        out.push_str("# TYPE plugreg_dra_call_duration_seconds_sum counter\n");
        for ((d, m, c), (_, s)) in calls.iter() {
            let (d, m, c) = (e(d), e(m), e(c));
            let _ = writeln!(
                out,
                "plugreg_dra_call_duration_seconds_sum{{driver_name=\"{d}\",method_name=\"{m}\",grpc_status_code=\"{c}\"}} {s}"
            );
        }
        drop(calls);
        out.push_str(
            "# HELP plugreg_dra_instances Registered DRA instances by connection state.\n",
        );
        out.push_str("# TYPE plugreg_dra_instances gauge\n");
        let drivers = self
            .shared
            .drivers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<&String> = drivers.keys().collect();
        names.sort();
        for d in names {
            let list = &drivers[d];
            let up = list.iter().filter(|i| i.connected()).count();
            let d = e(d);
            let _ = writeln!(
                out,
                "plugreg_dra_instances{{driver_name=\"{d}\",connected=\"true\"}} {up}"
            );
            let _ = writeln!(
                out,
                "plugreg_dra_instances{{driver_name=\"{d}\",connected=\"false\"}} {}",
                list.len() - up
            );
        }
        out
    }
}

fn claim_to_v1beta1(c: v1::Claim) -> v1beta1::Claim {
    v1beta1::Claim {
        namespace: c.namespace,
        uid: c.uid,
        name: c.name,
    }
}

fn prepare_to_v1(r: v1beta1::NodePrepareResourcesResponse) -> v1::NodePrepareResourcesResponse {
    v1::NodePrepareResourcesResponse {
        claims: r
            .claims
            .into_iter()
            .map(|(k, v)| {
                let devices = v
                    .devices
                    .into_iter()
                    .map(|d| v1::Device {
                        request_names: d.request_names,
                        pool_name: d.pool_name,
                        device_name: d.device_name,
                        cdi_device_ids: d.cdi_device_ids,
                        share_id: None,
                    })
                    .collect();
                (
                    k,
                    v1::NodePrepareResourceResponse {
                        devices,
                        error: v.error,
                    },
                )
            })
            .collect(),
    }
}

/// Holds one connection to `path` until cancelled: dials, publishes it, waits for it to end,
/// dials again (at once after a lost connection, with back-off after failed dials).
async fn supervise(path: PathBuf, link: watch::Sender<Link>, cancel: CancellationToken) {
    let mut failures = 0u32;
    loop {
        let dialled = tokio::select! {
            _ = cancel.cancelled() => return,
            r = plugreg_transport::connect_direct_driven(&path, DIAL_TIMEOUT) => r,
        };
        match dialled {
            Ok((conn, ended)) => {
                failures = 0;
                link.send_replace(Link::Ready(conn));
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = ended => {}
                }
                tracing::debug!(path = %path.display(), "DRA connection ended");
                link.send_replace(Link::Down("connection closed".into()));
                continue;
            }
            Err(plugreg_transport::Error::ConnectTimeout { .. }) => {
                link.send_replace(Link::Down(format!("dial timed out after {DIAL_TIMEOUT:?}")));
            }
            // The socket's own error, as a gRPC client reports it (the path is in the text
            // around it already).
            Err(plugreg_transport::Error::Dial { source, .. }) => {
                link.send_replace(Link::Down(source.to_string()));
            }
            Err(e) => {
                link.send_replace(Link::Down(e.to_string()));
            }
        }
        failures = failures.saturating_add(1);
        let wait = RECONNECT.with_factor(2).with_jitter(0.2).delay(failures);
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Follows the instance's health stream until cancelled: each answer replaces the device list,
/// the list is cleared when the stream ends, and it is opened again after `retry`. A plugin that
/// answers Unimplemented is not asked again.
async fn watch_health(
    link: watch::Receiver<Link>,
    devices: Arc<Mutex<Vec<DeviceState>>>,
    retry: Duration,
    cancel: CancellationToken,
) {
    loop {
        let mut l = link.clone();
        let conn = tokio::select! {
            _ = cancel.cancelled() => return,
            r = l.wait_for(|l| matches!(l, Link::Ready(_))) => match r {
                Ok(l) => match &*l { Link::Ready(c) => c.clone(), _ => unreachable!() },
                Err(_) => return,
            }
        };
        let mut client = plugreg_transport::client!(
            health::dra_resource_health_client::DraResourceHealthClient,
            conn
        );
        let run = async {
            let mut stream = client
                .node_watch_resources(health::NodeWatchResourcesRequest {})
                .await?
                .into_inner();
            while let Some(resp) = stream.message().await? {
                let list = resp
                    .devices
                    .into_iter()
                    .map(|d| {
                        let id = d.device.unwrap_or_default();
                        DeviceState {
                            pool: id.pool_name,
                            device: id.device_name,
                            health: d.health,
                            message: truncate_message(d.message),
                            updated: d.last_updated_time,
                            timeout: if d.health_check_timeout_seconds > 0 {
                                Duration::from_secs(d.health_check_timeout_seconds as u64)
                            } else {
                                DEFAULT_HEALTH_TIMEOUT
                            },
                        }
                    })
                    .collect();
                *devices.lock().unwrap_or_else(|e| e.into_inner()) = list;
            }
            Ok::<(), Status>(())
        };
        let result = tokio::select! {
            _ = cancel.cancelled() => return,
            r = run => r,
        };
        devices.lock().unwrap_or_else(|e| e.into_inner()).clear();
        match result {
            Err(s) if s.code() == Code::Unimplemented => return,
            Err(s) => tracing::debug!(status = %s, "DRA health stream failed"),
            Ok(()) => tracing::debug!("DRA health stream ended"),
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(retry) => {}
        }
    }
}

#[async_trait]
impl PluginHandler for DraHandler {
    async fn validate(
        &self,
        name: &str,
        endpoint: &str,
        versions: &[String],
    ) -> Result<(), HandlerError> {
        choose_service(name, endpoint, versions)?;
        Ok(())
    }

    async fn register(
        &self,
        name: &str,
        endpoint: &str,
        versions: &[String],
    ) -> Result<(), HandlerError> {
        let service = choose_service(name, endpoint, versions)?;
        let mut drivers = self
            .shared
            .drivers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let list = drivers.entry(name.to_owned()).or_default();
        if list.iter().any(|i| i.endpoint == endpoint) {
            return Err(DraError::AlreadyRegistered {
                driver: name.to_owned(),
                endpoint: endpoint.to_owned(),
            }
            .into());
        }
        let cancel = CancellationToken::new();
        let (tx, rx) = watch::channel(Link::Connecting);
        let health = Arc::new(Mutex::new(Vec::new()));
        match plugreg_transport::parse_address(endpoint) {
            Ok(path) => {
                tokio::spawn(supervise(path, tx, cancel.clone()));
            }
            // Registered anyway, as upstream; it simply never connects.
            Err(e) => {
                tx.send_replace(Link::Down(e.to_string()));
                // Keep the sender alive with the instance so that waiters see no closed channel.
                let c = cancel.clone();
                tokio::spawn(async move {
                    c.cancelled().await;
                    drop(tx);
                });
            }
        }
        if versions.iter().any(|v| v == HEALTH_V1ALPHA1_SERVICE) {
            tokio::spawn(watch_health(
                rx.clone(),
                health.clone(),
                self.health_retry,
                cancel.clone(),
            ));
        }
        list.push(Arc::new(Instance {
            endpoint: endpoint.to_owned(),
            service,
            seq: self.shared.seq.fetch_add(1, Ordering::Relaxed),
            link: rx,
            health,
            cancel,
        }));
        tracing::info!(
            driver = name,
            endpoint,
            service = service.as_str(),
            "DRA plugin registered"
        );
        Ok(())
    }

    async fn deregister(&self, name: &str, endpoint: &str) {
        let mut drivers = self
            .shared
            .drivers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(list) = drivers.get_mut(name) {
            list.retain(|i| {
                let keep = i.endpoint != endpoint;
                if !keep {
                    i.cancel.cancel();
                }
                keep
            });
            if list.is_empty() {
                drivers.remove(name);
            }
        }
    }

    /// The instance's service, connection, whether it is the one serving, its device health.
    fn plugin_details(&self, name: &str, endpoint: &str) -> Option<serde_json::Value> {
        serde_json::to_value(self.details(name, endpoint)?).ok()
    }

    /// Calls by driver, method and result; instances by connection state.
    fn write_metrics(&self, out: &mut String) {
        out.push_str(&self.render_metrics());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn service_choice_and_texts_are_upstreams() {
        assert_eq!(
            choose_service("d", "/e", &v(&["v1beta1.DRAPlugin", "v1.DRAPlugin"])).unwrap(),
            DraService::V1beta1
        );
        assert_eq!(
            choose_service("d", "/e", &v(&["x", "v1.DRAPlugin"])).unwrap(),
            DraService::V1
        );
        assert_eq!(
            choose_service("d", "/e", &[]).unwrap_err().to_string(),
            "invalid supported gRPC versions of DRA driver plugin d at endpoint /e: empty list of supported gRPC services (aka supported versions)"
        );
        assert_eq!(
            choose_service("d", "/e", &v(&["1.0.0", "v1alpha1.DRAResourceHealth"]))
                .unwrap_err()
                .to_string(),
            r#"invalid supported gRPC versions of DRA driver plugin d at endpoint /e: none of services supported by the plugin (["1.0.0" "v1alpha1.DRAResourceHealth"]) are supported by the kubelet (["v1.DRAPlugin" "v1beta1.DRAPlugin"])"#
        );
    }

    #[test]
    fn long_health_messages_are_cut_to_1024() {
        assert_eq!(truncate_message("ok".into()), "ok");
        let m = truncate_message("x".repeat(1025));
        assert_eq!(m.len(), 1024);
        assert!(m.ends_with("x..."));
        assert_eq!(truncate_message("y".repeat(1024)).len(), 1024);
    }
}
