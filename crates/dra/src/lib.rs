//! The plugin side of Dynamic Resource Allocation: the Rust counterpart of Go's `kubeletplugin`
//! helper, without the Kubernetes client.
//!
//! A driver implements [`Driver`] (prepare and unprepare claims, optionally device health) and
//! [`start`]s it with a [`Config`]. The helper then
//!
//! 1. serves `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin` and `...v1beta1.DRAPlugin` (a conversion
//!    over the same driver) and, when the driver has health, `v1alpha1.DRAResourceHealth`, on the
//!    DRA socket (`<plugin dir>/dra.sock`);
//! 2. only then serves the registration socket (`<registry dir>/<driver>-reg.sock`) answering
//!    `GetInfo` with type `DRAPlugin`, the DRA socket as endpoint and the enabled services in the
//!    order `v1.DRAPlugin`, `v1beta1.DRAPlugin`, `v1alpha1.DRAResourceHealth`;
//! 3. runs prepare and unprepare calls one at a time (in-process lock; with a rolling update also
//!    an exclusive `flock` on `<plugin dir>/serialize.lock` shared with the other instance).
//!
//! With [`Config::rolling_update`] the sockets are `<driver>-<uid>-reg.sock` and `dra-<uid>.sock`,
//! so an old and a new instance can be registered at once.
//!
//! With feature `kube`, [`slices::publish`] publishes the driver's ResourceSlices.
//!
//! Unlike the Go helper, the claims are handed to the driver as references
//! (namespace, name, UID): this crate does not fetch ResourceClaims.

#[cfg(feature = "kube")]
pub mod slices;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use plugreg_proto::dra::{HEALTH_V1ALPHA1_SERVICE, V1_SERVICE, V1BETA1_SERVICE};
use plugreg_proto::dra::{health_v1alpha1 as health, v1, v1beta1};
use plugreg_proto::pluginregistration::{DRA_PLUGIN, PluginInfo};
use plugreg_registrar::Registrar;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

pub use async_trait::async_trait;
pub use health::{DeviceHealth, DeviceIdentifier, HealthStatus};
pub use v1::{Claim, Device};

/// Default kubelet registry directory.
pub const DEFAULT_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// Parent of the default per-driver data directory.
pub const DEFAULT_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// Default DRA socket file name.
pub const DEFAULT_PLUGIN_SOCKET: &str = "dra.sock";
/// Lock file serialising calls across the instances of a rolling update.
pub const SERIALIZE_LOCK_FILE: &str = "serialize.lock";

/// How long calls in flight may finish once the driver is stopped.
pub const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// One claim's outcome of a prepare: its devices, or why it failed.
pub type PrepareResult = Result<Vec<Device>, String>;

/// Why a driver call failed as a whole (it becomes the gRPC error).
pub type DriverError = Box<dyn std::error::Error + Send + Sync>;

/// A DRA driver.
#[async_trait]
pub trait Driver: Send + Sync + 'static {
    /// Prepares `claims`; must answer one entry per claim UID and be idempotent.
    async fn prepare(
        &self,
        claims: Vec<Claim>,
    ) -> Result<HashMap<String, PrepareResult>, DriverError>;

    /// Unprepares `claims` (they may be gone or never prepared); one entry per claim UID.
    async fn unprepare(
        &self,
        claims: Vec<Claim>,
    ) -> Result<HashMap<String, Result<(), String>>, DriverError>;

    /// Device health, if the driver reports it: each value is the complete device list. Called
    /// once at start; `None` (the default) serves no health service.
    fn health(&self) -> Option<watch::Receiver<Vec<DeviceHealth>>> {
        None
    }
}

/// Why the helper could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No driver name.
    #[error("driver name must be set")]
    NoDriverName,
    /// Rolling update and an explicit registration socket name together.
    #[error("rolling updates and explicit registration socket filename are mutually exclusive")]
    RollingUpdateAndRegistrarSocket,
    /// Neither API enabled and no health.
    #[error("no supported DRA gRPC API is implemented and enabled")]
    NoApi,
    /// A directory the helper needs is missing.
    #[error("{what} {path:?} does not exist or is not a directory")]
    NoDir {
        /// Which directory.
        what: &'static str,
        /// Where.
        path: PathBuf,
    },
    /// Binding a socket failed.
    #[error(transparent)]
    Bind(#[from] plugreg_transport::Error),
}

/// Options; [`Config::new`] gives upstream's defaults.
#[derive(Debug, Clone)]
pub struct Config {
    /// The driver name (a DNS subdomain).
    pub driver_name: String,
    /// Where the kubelet looks for registration sockets; must exist.
    pub registry_dir: PathBuf,
    /// Explicit registration socket file name (default `<driver>-reg.sock`).
    pub registrar_socket: Option<String>,
    /// The driver's own directory (default `/var/lib/kubelet/plugins/<driver>`); must exist.
    pub plugin_dir: PathBuf,
    /// Explicit DRA socket file name (default `dra.sock`, `dra-<uid>.sock` with a rolling update).
    pub plugin_socket: Option<String>,
    /// Pod UID for rolling updates (kubelet 1.33+): per-instance socket names and a file lock.
    pub rolling_update: Option<String>,
    /// Serve and advertise `v1.DRAPlugin`.
    pub node_v1: bool,
    /// Serve and advertise `v1beta1.DRAPlugin`.
    pub node_v1beta1: bool,
    /// Run prepare and unprepare calls one at a time.
    pub serialize: bool,
}

impl Config {
    /// Upstream's defaults for `driver_name`.
    pub fn new(driver_name: impl Into<String>) -> Self {
        let driver_name = driver_name.into();
        Self {
            registry_dir: DEFAULT_REGISTRY_DIR.into(),
            registrar_socket: None,
            plugin_dir: Path::new(DEFAULT_PLUGINS_DIR).join(&driver_name),
            plugin_socket: None,
            rolling_update: None,
            node_v1: true,
            node_v1beta1: true,
            serialize: true,
            driver_name,
        }
    }

    /// The registration socket's path.
    pub fn registrar_socket_path(&self) -> PathBuf {
        let name = match (&self.registrar_socket, &self.rolling_update) {
            (Some(n), _) => n.clone(),
            (None, Some(uid)) => format!("{}-{uid}-reg.sock", self.driver_name),
            (None, None) => format!("{}-reg.sock", self.driver_name),
        };
        self.registry_dir.join(name)
    }

    /// The DRA socket's path.
    pub fn plugin_socket_path(&self) -> PathBuf {
        let name = match (&self.plugin_socket, &self.rolling_update) {
            (Some(n), _) => n.clone(),
            (None, Some(uid)) => format!("dra-{uid}.sock"),
            (None, None) => DEFAULT_PLUGIN_SOCKET.into(),
        };
        self.plugin_dir.join(name)
    }

    /// The services advertised in `GetInfo`, in upstream's order.
    pub fn services(&self, health: bool) -> Vec<String> {
        [
            (self.node_v1, V1_SERVICE),
            (self.node_v1beta1, V1BETA1_SERVICE),
            (health, HEALTH_V1ALPHA1_SERVICE),
        ]
        .into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, s)| s.to_owned())
        .collect()
    }

    fn check(&self, health: bool) -> Result<(), Error> {
        if self.driver_name.is_empty() {
            return Err(Error::NoDriverName);
        }
        if self.rolling_update.is_some() && self.registrar_socket.is_some() {
            return Err(Error::RollingUpdateAndRegistrarSocket);
        }
        if !self.node_v1 && !self.node_v1beta1 && !health {
            return Err(Error::NoApi);
        }
        for (what, path) in [
            ("registrar directory", &self.registry_dir),
            ("plugin data directory", &self.plugin_dir),
        ] {
            if !path.is_dir() {
                return Err(Error::NoDir {
                    what,
                    path: path.clone(),
                });
            }
        }
        Ok(())
    }
}

/// A running DRA driver: both sockets served until the token given to [`start`] is cancelled.
#[derive(Debug)]
pub struct Plugin {
    registrar: Registrar,
    plugin_socket: PathBuf,
    registrar_socket: PathBuf,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Plugin {
    /// The registration server: its status says whether the kubelet accepted the driver.
    pub fn registrar(&self) -> &Registrar {
        &self.registrar
    }

    /// The DRA socket (the registered endpoint).
    pub fn plugin_socket(&self) -> &Path {
        &self.plugin_socket
    }

    /// The registration socket.
    pub fn registrar_socket(&self) -> &Path {
        &self.registrar_socket
    }

    /// Waits until both servers have stopped (sockets removed).
    pub async fn stopped(self) {
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Starts serving `driver`: the DRA socket first, then the registration socket.
pub async fn start<D: Driver>(
    driver: Arc<D>,
    config: Config,
    token: CancellationToken,
) -> Result<Plugin, Error> {
    let health_rx = driver.health();
    config.check(health_rx.is_some())?;
    let plugin_socket = config.plugin_socket_path();
    let registrar_socket = config.registrar_socket_path();
    let lock_file = config
        .rolling_update
        .is_some()
        .then(|| config.plugin_dir.join(SERIALIZE_LOCK_FILE));
    let service = Service {
        driver,
        serial: config
            .serialize
            .then(|| Arc::new(Serializer::new(lock_file))),
    };

    let mut router = plugreg_transport::server().add_optional_service(config.node_v1.then(|| {
        v1::dra_plugin_server::DraPluginServer::new(service.clone())
            .max_decoding_message_size(plugreg_transport::MAX_MESSAGE_SIZE)
    }));
    router = router.add_optional_service(config.node_v1beta1.then(|| {
        v1beta1::dra_plugin_server::DraPluginServer::new(service.clone())
            .max_decoding_message_size(plugreg_transport::MAX_MESSAGE_SIZE)
    }));
    let has_health = health_rx.is_some();
    router = router.add_optional_service(health_rx.map(|rx| {
        health::dra_resource_health_server::DraResourceHealthServer::new(HealthService { rx })
    }));
    let bound = plugreg_transport::bind(&plugin_socket)?;
    let t = token.clone();
    let dra_task = tokio::spawn(async move {
        let serve = plugreg_transport::serve(router, bound, t.clone().cancelled_owned());
        // The kubelet keeps its connection open: a graceful stop would wait for it forever.
        // Dropping the server closes the connections and removes the socket.
        let grace = async {
            t.cancelled().await;
            tokio::time::sleep(STOP_GRACE).await;
        };
        tokio::select! {
            r = serve => if let Err(e) = r {
                tracing::error!(error = %e, "DRA gRPC server failed");
            },
            _ = grace => {}
        }
    });

    let registrar = Registrar::new(PluginInfo {
        r#type: DRA_PLUGIN.into(),
        name: config.driver_name.clone(),
        endpoint: plugin_socket.to_string_lossy().into_owned(),
        supported_versions: config.services(has_health),
    });
    let reg = registrar.clone();
    let socket = registrar_socket.clone();
    let reg_task = tokio::spawn(async move {
        if let Err(e) = reg.serve(&socket, Default::default(), token).await {
            tracing::error!(error = %e, "registration server failed");
        }
    });
    Ok(Plugin {
        registrar,
        plugin_socket,
        registrar_socket,
        tasks: vec![dra_task, reg_task],
    })
}

/// One-at-a-time execution of prepare and unprepare.
#[derive(Debug)]
struct Serializer {
    local: tokio::sync::Mutex<()>,
    lock_file: Option<PathBuf>,
}

impl Serializer {
    fn new(lock_file: Option<PathBuf>) -> Self {
        Self {
            local: tokio::sync::Mutex::new(()),
            lock_file,
        }
    }

    /// Holds the in-process lock and, with a rolling update, the file lock, until dropped.
    async fn lock(
        &self,
    ) -> Result<(tokio::sync::MutexGuard<'_, ()>, Option<std::fs::File>), Status> {
        let guard = self.local.lock().await;
        let Some(path) = self.lock_file.clone() else {
            return Ok((guard, None));
        };
        // flock blocks; the file lock is released when the file is closed.
        let file = tokio::task::spawn_blocking(move || {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)?;
            rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive)?;
            Ok::<_, std::io::Error>(f)
        })
        .await
        .map_err(|e| Status::internal(format!("serialize lock: {e}")))?
        .map_err(|e| Status::internal(format!("serialize lock: {e}")))?;
        Ok((guard, Some(file)))
    }
}

/// The DRAPlugin services (v1 and v1beta1) over one driver.
struct Service<D> {
    driver: Arc<D>,
    serial: Option<Arc<Serializer>>,
}

impl<D> Clone for Service<D> {
    fn clone(&self) -> Self {
        Self {
            driver: self.driver.clone(),
            serial: self.serial.clone(),
        }
    }
}

/// `req/sub` -> `req`: the kubelet matches devices to container requests by the request name.
fn strip_subrequest(name: String) -> String {
    match name.split_once('/') {
        Some((req, _)) => req.to_owned(),
        None => name,
    }
}

impl<D: Driver> Service<D> {
    async fn prepare(
        &self,
        req: v1::NodePrepareResourcesRequest,
    ) -> Result<v1::NodePrepareResourcesResponse, Status> {
        let _held = match &self.serial {
            Some(s) => Some(s.lock().await?),
            None => None,
        };
        let results = self
            .driver
            .prepare(req.claims)
            .await
            .map_err(|e| Status::internal(format!("prepare resource claims: {e}")))?;
        let claims = results
            .into_iter()
            .map(|(uid, r)| {
                let resp = match r {
                    Ok(devices) => v1::NodePrepareResourceResponse {
                        devices: devices
                            .into_iter()
                            .map(|mut d| {
                                d.request_names = std::mem::take(&mut d.request_names)
                                    .into_iter()
                                    .map(strip_subrequest)
                                    .collect();
                                d
                            })
                            .collect(),
                        error: String::new(),
                    },
                    Err(error) => v1::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    },
                };
                (uid, resp)
            })
            .collect();
        Ok(v1::NodePrepareResourcesResponse { claims })
    }

    async fn unprepare(
        &self,
        req: v1::NodeUnprepareResourcesRequest,
    ) -> Result<v1::NodeUnprepareResourcesResponse, Status> {
        let _held = match &self.serial {
            Some(s) => Some(s.lock().await?),
            None => None,
        };
        let results = self
            .driver
            .unprepare(req.claims)
            .await
            .map_err(|e| Status::internal(format!("unprepare resource claims: {e}")))?;
        let claims = results
            .into_iter()
            .map(|(uid, r)| {
                let error = r.err().unwrap_or_default();
                (uid, v1::NodeUnprepareResourceResponse { error })
            })
            .collect();
        Ok(v1::NodeUnprepareResourcesResponse { claims })
    }
}

#[async_trait]
impl<D: Driver> v1::dra_plugin_server::DraPlugin for Service<D> {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        self.prepare(request.into_inner()).await.map(Response::new)
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        self.unprepare(request.into_inner())
            .await
            .map(Response::new)
    }
}

/// v1beta1 <-> v1 conversions (v1beta1 has no `share_id`).
pub mod convert {
    use super::{v1, v1beta1};

    /// A v1beta1 claim as v1.
    pub fn claim_to_v1(c: v1beta1::Claim) -> v1::Claim {
        v1::Claim {
            namespace: c.namespace,
            uid: c.uid,
            name: c.name,
        }
    }

    /// A v1 claim as v1beta1.
    pub fn claim_to_v1beta1(c: v1::Claim) -> v1beta1::Claim {
        v1beta1::Claim {
            namespace: c.namespace,
            uid: c.uid,
            name: c.name,
        }
    }

    /// A v1 device as v1beta1 (drops `share_id`).
    pub fn device_to_v1beta1(d: v1::Device) -> v1beta1::Device {
        v1beta1::Device {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
        }
    }

    /// A v1beta1 device as v1.
    pub fn device_to_v1(d: v1beta1::Device) -> v1::Device {
        v1::Device {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: None,
        }
    }

    /// A v1 prepare answer as v1beta1.
    pub fn prepare_to_v1beta1(
        r: v1::NodePrepareResourcesResponse,
    ) -> v1beta1::NodePrepareResourcesResponse {
        v1beta1::NodePrepareResourcesResponse {
            claims: r
                .claims
                .into_iter()
                .map(|(k, v)| {
                    let v = v1beta1::NodePrepareResourceResponse {
                        devices: v.devices.into_iter().map(device_to_v1beta1).collect(),
                        error: v.error,
                    };
                    (k, v)
                })
                .collect(),
        }
    }

    /// A v1beta1 prepare answer as v1.
    pub fn prepare_to_v1(
        r: v1beta1::NodePrepareResourcesResponse,
    ) -> v1::NodePrepareResourcesResponse {
        v1::NodePrepareResourcesResponse {
            claims: r
                .claims
                .into_iter()
                .map(|(k, v)| {
                    let v = v1::NodePrepareResourceResponse {
                        devices: v.devices.into_iter().map(device_to_v1).collect(),
                        error: v.error,
                    };
                    (k, v)
                })
                .collect(),
        }
    }

    /// A v1 unprepare answer as v1beta1.
    pub fn unprepare_to_v1beta1(
        r: v1::NodeUnprepareResourcesResponse,
    ) -> v1beta1::NodeUnprepareResourcesResponse {
        v1beta1::NodeUnprepareResourcesResponse {
            claims: r
                .claims
                .into_iter()
                .map(|(k, v)| (k, v1beta1::NodeUnprepareResourceResponse { error: v.error }))
                .collect(),
        }
    }

    /// A v1beta1 unprepare answer as v1.
    pub fn unprepare_to_v1(
        r: v1beta1::NodeUnprepareResourcesResponse,
    ) -> v1::NodeUnprepareResourcesResponse {
        v1::NodeUnprepareResourcesResponse {
            claims: r
                .claims
                .into_iter()
                .map(|(k, v)| (k, v1::NodeUnprepareResourceResponse { error: v.error }))
                .collect(),
        }
    }
}

#[async_trait]
impl<D: Driver> v1beta1::dra_plugin_server::DraPlugin for Service<D> {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(convert::claim_to_v1)
            .collect();
        let r = self
            .prepare(v1::NodePrepareResourcesRequest { claims })
            .await?;
        Ok(Response::new(convert::prepare_to_v1beta1(r)))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(convert::claim_to_v1)
            .collect();
        let r = self
            .unprepare(v1::NodeUnprepareResourcesRequest { claims })
            .await?;
        Ok(Response::new(convert::unprepare_to_v1beta1(r)))
    }
}

/// `v1alpha1.DRAResourceHealth` over the driver's health channel.
struct HealthService {
    rx: watch::Receiver<Vec<DeviceHealth>>,
}

type HealthStream = Pin<
    Box<dyn tokio_stream::Stream<Item = Result<health::NodeWatchResourcesResponse, Status>> + Send>,
>;

#[async_trait]
impl health::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _request: Request<health::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        // The current list first, then every change.
        let stream = tokio_stream::wrappers::WatchStream::new(self.rx.clone())
            .map(|devices| Ok(health::NodeWatchResourcesResponse { devices }));
        Ok(Response::new(Box::pin(stream)))
    }
}

use tokio_stream::StreamExt as _;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_and_rolling_update_names() {
        let mut c = Config::new("gpu.example.com");
        assert_eq!(
            c.registrar_socket_path(),
            Path::new("/var/lib/kubelet/plugins_registry/gpu.example.com-reg.sock")
        );
        assert_eq!(
            c.plugin_socket_path(),
            Path::new("/var/lib/kubelet/plugins/gpu.example.com/dra.sock")
        );
        c.rolling_update = Some("uid1".into());
        assert_eq!(
            c.registrar_socket_path(),
            Path::new("/var/lib/kubelet/plugins_registry/gpu.example.com-uid1-reg.sock")
        );
        assert_eq!(
            c.plugin_socket_path(),
            Path::new("/var/lib/kubelet/plugins/gpu.example.com/dra-uid1.sock")
        );
        assert_eq!(
            c.services(true),
            [
                "v1.DRAPlugin",
                "v1beta1.DRAPlugin",
                "v1alpha1.DRAResourceHealth"
            ]
        );
        c.node_v1 = false;
        assert_eq!(c.services(false), ["v1beta1.DRAPlugin"]);
    }

    #[test]
    fn option_errors_are_upstreams() {
        let mut c = Config::new("");
        assert_eq!(
            c.check(false).unwrap_err().to_string(),
            "driver name must be set"
        );
        c.driver_name = "d".into();
        c.rolling_update = Some("u".into());
        c.registrar_socket = Some("x.sock".into());
        assert_eq!(
            c.check(false).unwrap_err().to_string(),
            "rolling updates and explicit registration socket filename are mutually exclusive"
        );
        c.registrar_socket = None;
        c.node_v1 = false;
        c.node_v1beta1 = false;
        assert_eq!(
            c.check(false).unwrap_err().to_string(),
            "no supported DRA gRPC API is implemented and enabled"
        );
    }

    #[test]
    fn subrequests_are_stripped() {
        assert_eq!(strip_subrequest("req/sub".into()), "req");
        assert_eq!(strip_subrequest("req".into()), "req");
    }
}
