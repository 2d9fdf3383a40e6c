//! csi-node-driver-registrar: a drop-in replacement of the Kubernetes CSI node-driver-registrar
//! sidecar (v2.17.0), as a library so other programs can run it in-process.
//!
//! [`run`] follows upstream's start-up order, log messages and exit codes: check the
//! required flags, connect to the CSI driver, learn its name with GetPluginInfo, create
//! `<plugin-registration-path>/<name>-reg.sock`, answer the kubelet's GetInfo with
//! `CSIPlugin`/name/`--kubelet-registration-path`/`["1.0.0"]`, and wait for the kubelet's
//! verdict. Where plugreg does better (docs/design.md R1-R5): GetPluginInfo is retried within the
//! connect window, the name is validated before it becomes a path, the socket is re-created if
//! it vanishes or dies, a surge rollout hands the listening socket from the old instance to the
//! new one (the kubelet never sees the socket change, so it never drops the driver), the socket
//! is removed on every other exit path, `/healthz` never takes longer than `--timeout`, concurrent probes share
//! one check, and `/metrics` shows the kubelet's verdict.
//!
//! ```no_run
//! # async fn demo() -> Result<(), plugreg_node_driver_registrar::RunError> {
//! use plugreg_node_driver_registrar::{Config, run};
//! let config = Config {
//!     csi_address: "/csi/csi.sock".into(),
//!     kubelet_registration_path: "/var/lib/kubelet/plugins/csi.example.com/csi.sock".into(),
//!     plugin_registration_path: "/var/lib/kubelet/plugins_registry".into(),
//!     ..Config::default()
//! };
//! run(config, tokio_util::sync::CancellationToken::new()).await
//! # }
//! ```

pub mod flags;
pub use plugreg_sidecar_kit::gosyntax;
pub mod http;
pub mod logging;
pub mod name;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use plugreg_proto::csi::v1::GetPluginInfoRequest;
use plugreg_proto::csi::v1::identity_client::IdentityClient;
use plugreg_registrar::{PluginInfo, Registrar, ServeOptions};
use plugreg_runtime::Backoff;
use plugreg_runtime::report;
use plugreg_sidecar_kit::connect::{self, ConnectWindow, Retry};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

pub use name::{NameError, check_driver_name};

/// The version reported by `--version` and the `Version` log line (the sidecar kit's).
pub use plugreg_sidecar_kit::VERSION;

/// The `--mode` value that makes the program exit 0 at once.
pub const PROBE_MODE: &str = "kubelet-registration-probe";

/// The versions GetInfo reports: the CSI spec version, hard-coded as upstream.
pub const SUPPORTED_VERSIONS: &[&str] = &["1.0.0"];

/// Retries of the first connection to the CSI driver: 50 ms doubling to 1 s, as csi-lib-utils.
const CONNECT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));

/// Retries of GetPluginInfo within the connect window (R3): 100 ms doubling to 2 s.
const GET_PLUGIN_INFO_BACKOFF: Backoff =
    Backoff::new(Duration::from_millis(100), Duration::from_secs(2));

/// How long a shutdown waits for in-flight registration RPCs before dropping them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// What the sidecar does; one field per flag (see [`flags`]), with upstream's defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `--csi-address`: the CSI driver socket (a path or `unix://PATH`).
    pub csi_address: String,
    /// `--kubelet-registration-path`: the driver socket as the kubelet sees it; returned
    /// verbatim as GetInfo's `endpoint`. Required.
    pub kubelet_registration_path: String,
    /// `--plugin-registration-path`: the directory of the registration socket.
    pub plugin_registration_path: String,
    /// `--timeout`: each GetPluginInfo call at start-up, and each whole /healthz check.
    pub timeout: Duration,
    /// `--http-endpoint`: listen address of /healthz and /metrics; empty: no HTTP server.
    pub http_endpoint: String,
    /// `--health-port` (deprecated): > 0 means `--http-endpoint=:<port>`.
    pub health_port: i64,
    /// `--enable-pprof`: accepted; there are no pprof handlers here.
    pub enable_pprof: bool,
    /// `--mode` (deprecated): [`PROBE_MODE`] exits 0 at once; anything else runs normally.
    pub mode: String,
    /// `--connection-timeout` (deprecated, no effect; a non-zero value logs so).
    pub connection_timeout: Duration,
    /// `--csi-connect-window` (plugreg): how long start-up may take to connect to the CSI
    /// driver and get its name, GetPluginInfo retries included.
    pub csi_connect_window: Duration,
    /// `--automaxprocs`: accepted; the runtime is single-threaded.
    pub automaxprocs: bool,
    /// `--registration-socket-check-period` (plugreg): how often the registration socket is
    /// checked and re-created if the path is empty or dead (R3); zero turns the check off.
    pub socket_check_period: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            csi_address: "/run/csi/socket".into(),
            kubelet_registration_path: String::new(),
            plugin_registration_path: "/registration".into(),
            timeout: Duration::from_secs(1),
            http_endpoint: String::new(),
            health_port: 0,
            enable_pprof: false,
            mode: String::new(),
            connection_timeout: Duration::ZERO,
            csi_connect_window: Duration::from_secs(30),
            automaxprocs: false,
            socket_check_period: Duration::from_millis(500),
        }
    }
}

impl Config {
    /// The HTTP listen address, from `--health-port` or `--http-endpoint` (empty: none).
    pub fn http_address(&self) -> String {
        if self.health_port > 0 {
            format!(":{}", self.health_port)
        } else {
            self.http_endpoint.clone()
        }
    }

    /// The registration socket of `driver`: directory and name joined with `/` by plain
    /// concatenation, as upstream does.
    pub fn socket_path(&self, driver: &str) -> PathBuf {
        PathBuf::from(format!(
            "{}/{driver}-reg.sock",
            self.plugin_registration_path
        ))
    }
}

/// Why [`run`] failed. Every variant is exit code 1, as upstream; each names the step.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// `--kubelet-registration-path` is empty.
    #[error("kubelet-registration-path is a required parameter")]
    MissingRegistrationPath,
    /// Both `--health-port` and `--http-endpoint` are set.
    #[error("only one of `--health-port` and `--http-endpoint` can be set")]
    HttpConflict,
    /// `--csi-address` is not a Unix socket address.
    #[error("invalid --csi-address")]
    Address(#[source] plugreg_transport::Error),
    /// The CSI driver could not be reached within the connect window.
    #[error("error connecting to CSI driver: context deadline exceeded")]
    Connect,
    /// GetPluginInfo kept failing until the connect window closed.
    #[error("error retrieving CSI driver name: {0}")]
    GetPluginInfo(String),
    /// The driver name is empty or unsafe (R2); nothing was created.
    #[error(transparent)]
    DriverName(#[from] NameError),
    /// The HTTP listener could not be bound.
    #[error("failed to listen on HTTP endpoint {endpoint:?}")]
    HttpBind {
        /// The address.
        endpoint: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP server failed.
    #[error("HTTP server failed")]
    HttpServe(#[source] std::io::Error),
    /// The registration socket could not be created or served.
    #[error(transparent)]
    Registration(#[from] plugreg_registrar::Error),
    /// The kubelet answered NotifyRegistrationStatus(false).
    #[error("registration rejected by the kubelet: {0}")]
    Rejected(String),
}

impl RunError {
    /// The process exit code for this error (always 1, as upstream).
    pub fn exit_code(&self) -> i32 {
        1
    }
}

/// How far [`Sidecar::run`] has got, for in-process users (tests, `plugreg demo`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// The driver name, once GetPluginInfo answered.
    pub driver_name: Option<String>,
    /// The registration socket, once it is listening.
    pub socket: Option<PathBuf>,
    /// The HTTP server's address, once it is listening.
    pub http_address: Option<SocketAddr>,
    /// Whether the latest kubelet notification accepted the registration.
    pub registered: bool,
    /// Whether the run has ended (the socket is removed by then).
    pub stopped: bool,
}

/// The sidecar with a [`Progress`] channel; [`run`] is the short form.
#[derive(Debug)]
pub struct Sidecar {
    config: Config,
    progress: watch::Sender<Progress>,
}

/// Runs the sidecar until `token` is cancelled (`Ok`, the socket removed) or a step fails.
/// `--mode=kubelet-registration-probe` returns `Ok` at once, after the required-flag check.
pub async fn run(config: Config, token: CancellationToken) -> Result<(), RunError> {
    Sidecar::new(config).run(token).await
}

impl Sidecar {
    /// A sidecar for `config`.
    pub fn new(config: Config) -> Self {
        Self {
            config,
            progress: watch::Sender::new(Progress::default()),
        }
    }

    /// Watches how far the run has got.
    pub fn progress(&self) -> watch::Receiver<Progress> {
        self.progress.subscribe()
    }

    /// Runs until `token` is cancelled or a step fails; see [`run`].
    pub async fn run(self, token: CancellationToken) -> Result<(), RunError> {
        let result = self.run_inner(&token).await;
        self.progress.send_modify(|p| p.stopped = true);
        result
    }

    async fn run_inner(&self, token: &CancellationToken) -> Result<(), RunError> {
        let config = &self.config;
        if config.kubelet_registration_path.is_empty() {
            tracing::error!("kubelet-registration-path is a required parameter");
            return Err(RunError::MissingRegistrationPath);
        }
        if config.mode == PROBE_MODE {
            return Ok(());
        }
        tracing::info!(version = VERSION, "Version");
        tracing::info!(mode = %config.mode, "Running node-driver-registrar");
        if config.health_port > 0 && !config.http_endpoint.is_empty() {
            tracing::error!("Only one of `--health-port` and `--http-endpoint` can be set");
            return Err(RunError::HttpConflict);
        }
        let http_address = config.http_address();
        if !config.connection_timeout.is_zero() {
            tracing::info!("--connection-timeout is deprecated and will have no effect");
        }
        if config.enable_pprof {
            tracing::info!(
                "--enable-pprof has no effect: this build has no pprof handlers (use /metrics)"
            );
        }
        if config.automaxprocs {
            tracing::info!("--automaxprocs has no effect: the runtime is single-threaded");
        }

        let window_end = Instant::now() + config.csi_connect_window;
        tracing::info!(csiAddress = %config.csi_address, "Attempting to open a gRPC connection");
        let Some(channel) = connect_csi(&config.csi_address, window_end, token).await? else {
            return Ok(());
        };
        tracing::info!("Calling CSI driver to discover driver name");
        let Some(driver) = driver_name(channel, config.timeout, window_end, token).await? else {
            return Ok(());
        };
        tracing::debug!(csiDriverName = %driver, "CSI driver name");
        if let Err(e) = check_driver_name(&driver) {
            tracing::error!(err = %e, "Error retreiving CSI driver name");
            return Err(e.into());
        }
        self.progress
            .send_modify(|p| p.driver_name = Some(driver.clone()));
        let socket = config.socket_path(&driver);

        // Bind the HTTP listener before the socket exists, so a bad address leaves nothing
        // behind for the kubelet to see.
        let listener = if http_address.is_empty() {
            None
        } else {
            match http::bind(&http_address).await {
                Ok(l) => Some(l),
                Err(source) => {
                    tracing::error!(err = %source, endpoint = %http_address, "Failed to start HTTP server");
                    return Err(RunError::HttpBind {
                        endpoint: http_address,
                        source,
                    });
                }
            }
        };

        let registrar = Registrar::new(PluginInfo {
            r#type: plugreg_proto::pluginregistration::CSI_PLUGIN.into(),
            name: driver.clone(),
            endpoint: config.kubelet_registration_path.clone(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|s| s.to_string()).collect(),
        });
        // Subscribed before the socket exists, so no verdict can slip by unseen.
        let mut status = registrar.status();
        let serving = token.child_token();
        tracing::info!(socketPath = %socket.display(), "Starting Registration Server");
        let mut server = spawn_registration(&registrar, &socket, config, serving.clone());
        // The socket exists as soon as the server task has bound it; wait for that (or for
        // the bind to fail) before reporting it.
        if let Some(result) = wait_for_socket(&socket, &mut server).await {
            return registration_ended(result, &socket);
        }
        self.progress
            .send_modify(|p| p.socket = Some(socket.clone()));

        let mut http_task: Option<JoinHandle<std::io::Result<()>>> = None;
        match listener {
            None => tracing::info!("Skipping HTTP server"),
            Some(listener) => {
                let local = http::local_addr(&listener);
                tracing::info!(
                    endpoint = %http_address,
                    address = %local.map(|a| a.to_string()).unwrap_or_default(),
                    "Starting HTTP server"
                );
                self.progress.send_modify(|p| p.http_address = local);
                let diagnostics = http::Diagnostics::new(
                    socket.clone(),
                    driver.clone(),
                    config.timeout,
                    registrar.clone(),
                );
                http_task = Some(tokio::spawn(http::serve(
                    listener,
                    diagnostics,
                    serving.clone(),
                )));
            }
        }

        let outcome = loop {
            tokio::select! {
                biased;
                _ = token.cancelled() => break Outcome::Stopped,
                result = &mut server => break Outcome::Registration(result),
                result = join_optional(&mut http_task) => break Outcome::Http(result),
                changed = status.changed() => {
                    if changed.is_err() {
                        continue;
                    }
                    let s = status.borrow_and_update().clone();
                    self.progress.send_modify(|p| p.registered = s.is_registered());
                    if let Some(last) = s.last.filter(|l| !l.plugin_registered) {
                        break Outcome::Rejected(last.error);
                    }
                }
            }
        };
        serving.cancel();
        let result = match outcome {
            Outcome::Stopped => Ok(()),
            Outcome::Registration(result) => registration_ended(result, &socket),
            Outcome::Http(result) => {
                let err = match result {
                    Ok(Ok(())) => std::io::Error::other("the HTTP server stopped"),
                    Ok(Err(e)) => e,
                    Err(join) => std::io::Error::other(join),
                };
                tracing::error!(err = %err, "HTTP server stopped");
                Err(RunError::HttpServe(err))
            }
            Outcome::Rejected(error) => {
                tracing::error!(
                    err = %error,
                    "Registration process failed with error, restarting registration container"
                );
                Err(RunError::Rejected(error))
            }
        };
        // Bounded shutdown: in-flight RPCs get a moment, then the server is dropped; either
        // way its socket is removed (the registrar removes the file it bound).
        if !server.is_finished()
            && tokio::time::timeout(SHUTDOWN_GRACE, &mut server)
                .await
                .is_err()
        {
            server.abort();
            let _ = server.await;
        }
        if let Some(mut h) = http_task.filter(|h| !h.is_finished())
            && tokio::time::timeout(SHUTDOWN_GRACE, &mut h).await.is_err()
        {
            h.abort();
        }
        if result.is_ok() {
            // The server removes only the socket it created, and not one it handed over: one
            // still at the path is served by another instance now (a rolling update).
            if plugreg_transport::path_kind(&socket).ok()
                == Some(plugreg_transport::PathKind::Socket)
            {
                tracing::info!(socketPath = %socket.display(), "Registration socket left to the instance that serves it now");
            } else {
                tracing::info!(socketPath = %socket.display(), "Registration socket removed");
            }
        }
        result
    }
}

/// Awaits the task if there is one; never completes otherwise.
async fn join_optional<T>(task: &mut Option<JoinHandle<T>>) -> Result<T, tokio::task::JoinError> {
    match task {
        Some(t) => t.await,
        None => std::future::pending().await,
    }
}

/// Why the serving phase ended.
enum Outcome {
    Stopped,
    Registration(Result<Result<(), plugreg_registrar::Error>, tokio::task::JoinError>),
    Http(Result<std::io::Result<()>, tokio::task::JoinError>),
    Rejected(String),
}

fn spawn_registration(
    registrar: &Registrar,
    socket: &Path,
    config: &Config,
    token: CancellationToken,
) -> JoinHandle<Result<(), plugreg_registrar::Error>> {
    let registrar = registrar.clone();
    let socket = socket.to_owned();
    let options = ServeOptions {
        recreate_check: Some(config.socket_check_period).filter(|p| !p.is_zero()),
    };
    tokio::spawn(async move { registrar.serve(&socket, options, token).await })
}

/// Waits until the server task has bound `socket`; returns the task's result if it ended
/// first (a bind failure).
async fn wait_for_socket(
    socket: &Path,
    server: &mut JoinHandle<Result<(), plugreg_registrar::Error>>,
) -> Option<Result<Result<(), plugreg_registrar::Error>, tokio::task::JoinError>> {
    const POLL: Backoff = Backoff::new(Duration::from_micros(200), Duration::from_millis(20));
    let mut polls = 0;
    loop {
        if server.is_finished() {
            return Some(server.await);
        }
        if plugreg_transport::path_kind(socket).ok() == Some(plugreg_transport::PathKind::Socket) {
            return None;
        }
        polls += 1;
        POLL.sleep(polls).await;
    }
}

fn registration_ended(
    result: Result<Result<(), plugreg_registrar::Error>, tokio::task::JoinError>,
    socket: &Path,
) -> Result<(), RunError> {
    match result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e @ plugreg_registrar::Error::Bind(_))) => {
            let msg = match &e {
                plugreg_registrar::Error::Bind(
                    plugreg_transport::Error::Listen { .. }
                    | plugreg_transport::Error::PathTooLong { .. },
                ) => "Failed to listen on socket",
                // Upstream logs the stale-socket clean-up failure with an empty message.
                _ => "",
            };
            tracing::error!(err = %report::chain(&e), socketPath = %socket.display(), "{msg}");
            Err(e.into())
        }
        Ok(Err(e)) => {
            tracing::error!(err = %report::chain(&e), "Registration Server stopped serving");
            Err(e.into())
        }
        Err(join) => {
            tracing::error!(err = %join, "Registration Server stopped serving");
            Err(RunError::HttpServe(std::io::Error::other(join)))
        }
    }
}

/// Connects to the CSI driver, retrying ([`CONNECT_BACKOFF`]) until `window_end`; logs
/// "Still connecting" every 10 s as csi-lib-utils does. `None` when `token` was cancelled.
async fn connect_csi(
    address: &str,
    window_end: Instant,
    token: &CancellationToken,
) -> Result<Option<Channel>, RunError> {
    let path = match plugreg_transport::parse_address(address) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(err = %report::chain(&e), "Error connecting to CSI driver");
            return Err(RunError::Address(e));
        }
    };
    let shown = format!("unix://{}", path.display());
    let window = ConnectWindow {
        end: Some(window_end),
        attempt: Duration::from_secs(10),
        retry: Retry::Backoff(CONNECT_BACKOFF),
    };
    let dial = |timeout| {
        tracing::trace!(address = %shown, "Connecting");
        let attempt = plugreg_transport::connect_path(&path, timeout);
        async {
            let result = attempt.await;
            if let Err(e) = &result {
                tracing::debug!(err = %report::chain(e), address = %shown, "CSI driver not reachable yet");
            }
            result
        }
    };
    match window.connect(&shown, token, dial).await {
        connect::Outcome::Connected(channel) => Ok(Some(channel)),
        connect::Outcome::Stopped => Ok(None),
        connect::Outcome::Closed(_) => {
            tracing::error!(
                err = "context deadline exceeded",
                "Error connecting to CSI driver"
            );
            Err(RunError::Connect)
        }
    }
}

/// Asks the driver its name with GetPluginInfo: each call under `timeout`, failures retried
/// ([`GET_PLUGIN_INFO_BACKOFF`]) while the connect window is open (R3). The first call always gets
/// the full `timeout`, so `--timeout` values larger than the window work as upstream.
/// `None` when `token` was cancelled.
async fn driver_name(
    channel: Channel,
    timeout: Duration,
    window_end: Instant,
    token: &CancellationToken,
) -> Result<Option<String>, RunError> {
    let mut client = plugreg_transport::client!(IdentityClient, channel);
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let call = tokio::time::timeout(timeout, client.get_plugin_info(GetPluginInfoRequest {}));
        let result = tokio::select! {
            _ = token.cancelled() => return Ok(None),
            r = call => r,
        };
        let err = match result {
            Ok(Ok(response)) => {
                let name = response.into_inner().name;
                if name.is_empty() {
                    tracing::error!(
                        err = "driver name is empty",
                        "Error retreiving CSI driver name"
                    );
                    return Err(NameError::Empty.into());
                }
                return Ok(Some(name));
            }
            Ok(Err(status)) => report::grpc(&status),
            Err(_) => "rpc error: code = DeadlineExceeded desc = context deadline exceeded".into(),
        };
        let retry_at = Instant::now() + GET_PLUGIN_INFO_BACKOFF.delay(attempt);
        if retry_at >= window_end {
            tracing::error!(err = %err, attempts = attempt, "Error retreiving CSI driver name");
            return Err(RunError::GetPluginInfo(err));
        }
        tracing::warn!(err = %err, attempt, "GetPluginInfo failed, retrying");
        tokio::select! {
            _ = token.cancelled() => return Ok(None),
            _ = tokio::time::sleep_until(retry_at) => {}
        }
    }
}
