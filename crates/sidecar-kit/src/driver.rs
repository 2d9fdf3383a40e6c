//! The CSI driver as every controller sidecar reaches it at start-up (upstream's csi-lib-utils:
//! `docs/upstream/upstream-external-provisioner.md` §2 steps 10-11, the same in the attacher,
//! resizer and snapshotter): connecting to its socket within a window, probing it until it is
//! ready, and exiting when the connection is lost later.
//!
//! Connection loss: upstream exits 1 once the driver connection is lost after start-up. Here
//! [`connect_watched`] hands back a [`ConnectionLost`] that resolves when the transport under the
//! channel ends (the driver closed it or died); `main` selects on it and calls
//! [`exit_on_connection_loss`].

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use plugreg_csi_core::client::{CallError, Connection, Retry};
use plugreg_runtime::report;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

use crate::connect::{self as kit_connect, ConnectWindow, Outcome};
use crate::metrics::Metrics;

/// How long `main` waits for the driver socket at start-up (csi-lib-utils' limit).
pub const CONNECT_WINDOW: Duration = Duration::from_secs(30);
/// Pause between connection attempts, and between Probe attempts.
const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// What the process logs (and writes to the termination log) when the driver goes away.
pub const LOST_MESSAGE: &str = "Lost connection to CSI driver, exiting";
/// Where Kubernetes reads a container's last words.
pub const TERMINATION_LOG: &str = "/dev/termination-log";

/// `/csi.v1.Identity/Probe`.
pub const PROBE: &str = "/csi.v1.Identity/Probe";
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
/// logging "Still connecting to <address>" every 10 s.
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
            || tracing::warn!("Still connecting to {shown}"),
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

/// The driver's calls over `ch`, each within `timeout` and made once (the caller retries on
/// its own terms).
pub fn connection(ch: &Channel, timeout: Duration) -> Connection {
    // The address is the channel's; the calls do not need it.
    Connection::from_channel(ch.clone(), "", timeout, Retry::ONCE)
}

/// Probes the driver until it is ready (§2 step 11): a Probe about every second, each within
/// `timeout`; `ready=false` and DeadlineExceeded are retried without limit, anything else
/// (UNIMPLEMENTED included) is [`CsiError::Probe`].
pub async fn probe_forever(
    ch: &Channel,
    timeout: Duration,
    metrics: &Metrics,
) -> Result<(), CsiError> {
    let mut ticker = tokio::time::interval(RETRY_INTERVAL);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticker.tick().await; // the first tick is immediate
    let conn = connection(ch, timeout);
    loop {
        tracing::info!("Probing CSI driver for readiness");
        match metrics
            .timed_csi_call(PROBE, conn.probe(), CallError::code)
            .await
        {
            Ok(response) if response.ready != Some(false) => return Ok(()),
            Ok(_) => tracing::info!("CSI driver is not ready"),
            Err(e) if e.code() == Some(Code::DeadlineExceeded) => {
                tracing::info!("CSI driver probe timed out")
            }
            Err(e) => return Err(CsiError::Probe(report::grpc(&e.to_status()))),
        }
        ticker.tick().await;
    }
}

/// `/csi.v1.Identity/GetPluginInfo`.
pub const GET_PLUGIN_INFO: &str = "/csi.v1.Identity/GetPluginInfo";

/// The driver's name (GetPluginInfo within `timeout`, counted in `metrics`), as every sidecar
/// asks it at start-up; an empty name is [`CsiError::EmptyName`].
pub async fn plugin_name(
    ch: &Channel,
    timeout: Duration,
    metrics: &Metrics,
) -> Result<String, CsiError> {
    let info = metrics
        .timed_csi_call(
            GET_PLUGIN_INFO,
            connection(ch, timeout).get_plugin_info(),
            CallError::code,
        )
        .await
        .map_err(CsiError::Call)?;
    if info.name.is_empty() {
        return Err(CsiError::EmptyName);
    }
    Ok(info.name)
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
