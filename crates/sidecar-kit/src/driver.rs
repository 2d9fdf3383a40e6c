//! The CSI driver as every controller sidecar reaches it at start-up (upstream's csi-lib-utils:
//! `docs/upstream/upstream-external-provisioner.md` §2 steps 10-14, the same in the attacher,
//! resizer and snapshotter): connecting to its socket within a window, [`identify`]ing it
//! (probing it until it is ready, its name and the metrics named after it, its capabilities),
//! and exiting when the connection is lost later.
//!
//! Connection loss: upstream exits 1 once the driver connection is lost after start-up. Here
//! [`connect_watched`] hands back a [`ConnectionLost`] that resolves when the transport under the
//! channel ends (the driver closed it or died); `main` selects on it and calls
//! [`exit_on_connection_loss`].

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use plugreg_csi_core::client::CallError;
use plugreg_runtime::report;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::connect::{self as kit_connect, ConnectWindow, Outcome};
use crate::csi::{Capabilities, Client, PluginService};
use crate::metrics::Metrics;
use crate::migration;

/// How long `main` waits for the driver socket at start-up (csi-lib-utils' limit).
pub const CONNECT_WINDOW: Duration = Duration::from_secs(30);
/// Pause between connection attempts.
const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// What the process logs (and writes to the termination log) when the driver goes away.
pub const LOST_MESSAGE: &str = "Lost connection to CSI driver, exiting";
/// Where Kubernetes reads a container's last words.
pub const TERMINATION_LOG: &str = "/dev/termination-log";

/// Why talking to the driver failed at start-up. The texts are what `main` logs.
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    /// `--csi-address` is not a Unix socket address.
    #[error(
        "invalid --csi-address {address:?}: only Unix socket addresses (/path or unix://path) are supported: {reason}"
    )]
    Address {
        /// The flag's value.
        address: String,
        /// Why it was refused.
        reason: String,
    },
    /// The socket did not answer within the window.
    #[error("failed to connect to CSI driver at {address} within {window:?}: {last}")]
    Connect {
        /// The address as logged (`unix://...`).
        address: String,
        /// The window.
        window: Duration,
        /// The last attempt's error.
        last: String,
    },
    /// Probe failed with something other than "not ready" or a timeout.
    #[error("CSI driver probe failed: {0}")]
    Probe(String),
    /// A call failed (its gRPC status, worded as grpc-go words it).
    #[error("{}", report::grpc(&.0.to_status()))]
    Call(CallError),
    /// GetPluginInfo answered an empty name.
    #[error("driver name is empty")]
    EmptyName,
}

/// Resolves once the transport under a channel from [`connect_watched`] has ended. Cheap to
/// clone.
pub type ConnectionLost = plugreg_transport::Closed;

/// A channel to the driver and its loss signal.
#[derive(Debug, Clone)]
pub struct Connected {
    /// The gRPC channel (reconnects by itself, but the process exits on loss anyway).
    pub channel: Channel,
    /// Fires when the channel's transport ends.
    pub lost: ConnectionLost,
}

/// The address as upstream logs it: a bare path gets `unix://`.
pub fn shown_address(address: &str) -> String {
    if address.starts_with('/') {
        format!("unix://{address}")
    } else {
        address.to_owned()
    }
}

/// The socket path of `address` (`/abs` or `unix://path`), or a clear refusal (upstream would
/// also dial a TCP target; plugreg's sidecars talk to drivers on Unix sockets only).
pub fn socket_path(address: &str) -> Result<PathBuf, CsiError> {
    plugreg_transport::parse_address(address).map_err(|e| CsiError::Address {
        address: address.to_owned(),
        reason: report::chain(&e),
    })
}

/// Connects to the driver at `address`, an attempt about every second within `window`,
/// logging csi-lib-utils' Info `"Still connecting" address="<address>"` every 10 s.
pub async fn connect(address: &str, window: Duration) -> Result<Channel, CsiError> {
    connect_watched(address, window).await.map(|c| c.channel)
}

/// [`connect`], plus a signal that fires when the connection is lost later.
pub async fn connect_watched(address: &str, window: Duration) -> Result<Connected, CsiError> {
    let path = socket_path(address)?;
    let shown = shown_address(address);
    tracing::debug!(target: "plugreg_sidecar_kit::driver::v5", address = %shown, "Connecting");
    let connecting = ConnectWindow {
        end: Some(Instant::now() + window),
        attempt: RETRY_INTERVAL,
        retry: kit_connect::Retry::Every(RETRY_INTERVAL),
    };
    // Each attempt has a signal of its own: a stream dropped by a failed handshake does not
    // count as the loss of the connection that succeeds later.
    let outcome = connecting
        .connect_reporting(
            &CancellationToken::new(),
            |timeout| {
                let (path, shown) = (&path, &shown);
                async move {
                    let r = dial(path, timeout).await;
                    if let Err(e) = &r {
                        tracing::debug!(target: "plugreg_sidecar_kit::driver::v4", address = %shown, err = %e, "CSI driver not reachable yet");
                    }
                    r
                }
            },
            || tracing::info!(address = %shown, "Still connecting"),
        )
        .await;
    match outcome {
        Outcome::Connected(w) => Ok(Connected {
            channel: w.channel,
            lost: w.closed,
        }),
        Outcome::Closed(last) => Err(CsiError::Connect {
            address: shown,
            window,
            last,
        }),
        // The token above is never cancelled.
        Outcome::Stopped => Err(CsiError::Connect {
            address: shown,
            window,
            last: "stopped".into(),
        }),
    }
}

/// One dial within `timeout`, its failure worded as the log line wants it (Go's context text
/// for a timeout).
async fn dial(path: &Path, timeout: Duration) -> Result<plugreg_transport::WatchedChannel, String> {
    if timeout.is_zero() {
        return Err(plugreg_csi_core::client::DEADLINE_TEXT.into());
    }
    plugreg_transport::connect_path_watched(path, timeout)
        .await
        .map_err(|e| match e {
            plugreg_transport::Error::Connect { source, .. } => report::chain(&source),
            plugreg_transport::Error::ConnectTimeout { .. } => {
                plugreg_csi_core::client::DEADLINE_TEXT.into()
            }
            other => report::chain(&other),
        })
}

/// What upstream's `ExitOnConnectionLoss` does, minus the exit: writes [`LOST_MESSAGE`] to
/// `termination_log` if that file exists (the kubelet creates it in a container; this never
/// creates one on a host) and logs it. The caller exits 1.
pub fn report_connection_loss(termination_log: &Path) {
    use std::io::Write as _;
    match std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(termination_log)
    {
        Ok(mut f) => {
            if let Err(e) = f.write_all(LOST_MESSAGE.as_bytes()) {
                tracing::error!("{}: {e}", termination_log.display());
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => tracing::error!("{}: {e}", termination_log.display()),
    }
    tracing::error!("{LOST_MESSAGE}");
}

/// Waits for `lost`, reports it as upstream does ([`report_connection_loss`] on
/// [`TERMINATION_LOG`]) and returns the exit code, 1. For `main` to select on.
pub async fn exit_on_connection_loss(lost: ConnectionLost) -> i32 {
    lost.wait().await;
    report_connection_loss(Path::new(TERMINATION_LOG));
    1
}

/// How csi-lib-utils' metrics name the driver before GetPluginInfo has answered.
pub const UNKNOWN_DRIVER: &str = "unknown-driver";

/// Which capabilities [`identify`] reads, in each sidecar's upstream order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapabilityReads {
    /// ControllerGetCapabilities only (the snapshotter).
    Controller,
    /// GetPluginCapabilities, then ControllerGetCapabilities (the provisioner).
    PluginAndController,
    /// GetPluginCapabilities, then ControllerGetCapabilities only for a plugin with
    /// CONTROLLER_SERVICE (the attacher, the resizer).
    PluginThenControllerService,
}

/// How a sidecar walks [`identify`]: the steps are every sidecar's, their order and deadlines
/// its upstream's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identify {
    /// Each Probe's deadline (`--timeout`), and each other call's unless `startup_deadline`.
    pub timeout: Duration,
    /// GetPluginInfo's deadline, and one shared by the capability reads together (the
    /// attacher's fixed 1 s); `None`: each call within `timeout`.
    pub startup_deadline: Option<Duration>,
    /// Probe first (`false`: after the `ready` step, as the snapshotter, whose HTTP server
    /// serves the metrics while the driver is not ready yet).
    pub probe_first: bool,
    /// For a CSI-migration target ([`migration::in_tree_plugin`]): a registry with the
    /// `migrated` label (the calls so far stay with the old one) and a second Probe loop.
    pub migration: bool,
    /// The capability reads at the end.
    pub capabilities: CapabilityReads,
    /// `--max-grpc-log-length` of a sidecar that logs its calls ([`Client::logging_calls`]).
    pub grpc_log: Option<i64>,
}

/// What [`identify`] found out.
#[derive(Debug)]
pub struct Identified<R> {
    /// The driver's name (GetPluginInfo).
    pub name: String,
    /// The client for the run: its metrics registry is named after the driver (and has the
    /// `migrated` label for a CSI-migration target).
    pub client: Client,
    /// The capability reads' answers.
    pub capabilities: Capabilities,
    /// What the `ready` step returned.
    pub ready: R,
}

/// Which step of [`identify`] failed; the sidecar logs it in its own words. The texts are the
/// failures' own.
#[derive(Debug, thiserror::Error)]
pub enum IdentifyError<E> {
    /// The Probe loop (the one before the name, or after `ready`).
    #[error(transparent)]
    Probe(CsiError),
    /// GetPluginInfo failed or answered an empty name.
    #[error(transparent)]
    Name(CsiError),
    /// The second Probe loop of a CSI-migration target.
    #[error(transparent)]
    MigrationProbe(CsiError),
    /// The `ready` step.
    #[error("{0}")]
    Ready(E),
    /// GetPluginCapabilities.
    #[error("{}", report::grpc(&.0.to_status()))]
    PluginCapabilities(#[source] CallError),
    /// ControllerGetCapabilities.
    #[error("{}", report::grpc(&.0.to_status()))]
    ControllerCapabilities(#[source] CallError),
}

/// What every controller sidecar asks the driver before it starts (csi-lib-utils' and each
/// sidecar's `main`): Probe until ready; GetPluginInfo's name, counted as `unknown-driver`
/// until it is known; `named` (the sidecar's lines about the name); for a CSI-migration
/// target a registry with the `migrated` label and a second Probe loop; the registry named
/// after the driver; `ready` (e.g. the sidecar's HTTP server on that registry); then the
/// capability reads. Each failure ends it with the step that failed.
pub async fn identify<R, E>(
    channel: &Channel,
    how: &Identify,
    named: impl FnOnce(&str),
    ready: impl AsyncFnOnce(&str, &Arc<Metrics>) -> Result<R, E>,
) -> Result<Identified<R>, IdentifyError<E>> {
    let client_on = |metrics: Metrics| {
        let client = Client::new(channel.clone(), how.timeout, Arc::new(metrics));
        match how.grpc_log {
            Some(max) => client.logging_calls(max),
            None => client,
        }
    };
    let client = client_on(Metrics::new(UNKNOWN_DRIVER));
    if how.probe_first {
        client.probe_forever().await.map_err(IdentifyError::Probe)?;
    }
    let name = client
        .with_timeout(how.startup_deadline.unwrap_or(how.timeout))
        .plugin_name()
        .await
        .map_err(IdentifyError::Name)?;
    named(&name);
    let migrated = how.migration && migration::in_tree_plugin(&name).is_some();
    let mut metrics = if migrated {
        let mut m = Metrics::new(&name);
        m.with_migrated_label();
        m
    } else {
        // set_driver needs the registry alone: the client goes first.
        let unknown = Arc::clone(client.metrics());
        drop(client);
        Arc::into_inner(unknown).expect("identify holds the only client")
    };
    metrics.set_driver(&name);
    let client = client_on(metrics);
    if migrated {
        client
            .probe_forever()
            .await
            .map_err(IdentifyError::MigrationProbe)?;
    }
    let ready = ready(&name, client.metrics())
        .await
        .map_err(IdentifyError::Ready)?;
    if !how.probe_first {
        client.probe_forever().await.map_err(IdentifyError::Probe)?;
    }
    let capabilities = read_capabilities(&client, how).await?;
    Ok(Identified {
        name,
        client,
        capabilities,
        ready,
    })
}

/// The capability reads of [`identify`].
async fn read_capabilities<E>(
    client: &Client,
    how: &Identify,
) -> Result<Capabilities, IdentifyError<E>> {
    let deadline = how.startup_deadline.map(|d| Instant::now() + d);
    // Each call gets what is left of the shared deadline, and none is made once it has passed.
    let within = |method: &'static str| match deadline {
        None => Ok(client.clone()),
        Some(deadline) => match deadline.saturating_duration_since(Instant::now()) {
            left if left.is_zero() => Err(CallError::Timeout {
                method,
                timeout: Duration::ZERO,
                attempts: 0,
            }),
            left => Ok(client.with_timeout(left)),
        },
    };
    let mut caps = Capabilities::default();
    if how.capabilities != CapabilityReads::Controller {
        caps.plugin = async { within("GetPluginCapabilities")?.plugin_capabilities().await }
            .await
            .map_err(IdentifyError::PluginCapabilities)?;
        if how.capabilities == CapabilityReads::PluginThenControllerService
            && !caps.has_service(PluginService::ControllerService)
        {
            return Ok(caps);
        }
    }
    caps.controller = async {
        within("ControllerGetCapabilities")?
            .controller_capabilities()
            .await
    }
    .await
    .map_err(IdentifyError::ControllerCapabilities)?;
    Ok(caps)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checklist (attacher 2, snapshotter 2): the text goes into an existing termination log,
    /// replacing what was there; a missing one is not created.
    #[test]
    fn connection_loss_writes_an_existing_termination_log_only() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("termination-log");
        std::fs::write(&log, "an older, longer message from before").unwrap();
        report_connection_loss(&log);
        assert_eq!(std::fs::read_to_string(&log).unwrap(), LOST_MESSAGE);
        let missing = dir.path().join("missing");
        report_connection_loss(&missing);
        assert!(!missing.exists());
    }
}
