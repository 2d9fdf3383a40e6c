//! `csi-snapshotter`: a drop-in replacement of the Kubernetes CSI external-snapshotter v8.6.0
//! sidecar. This binary is thin: it parses upstream's command line (Go `flag` syntax), walks
//! upstream's start-up order with its log lines and exit codes, and hands over to the
//! controller (`plugreg-snapshotter`):
//!
//! - 0: `--version`, `-h`/`--help`, a clean stop (SIGTERM/SIGINT without leader election);
//! - 1: every start-up error (node deployment with leader election, no Kubernetes config,
//!   both HTTP flags, CSI connect, name, probe or capability failure, a driver without
//!   CREATE_DELETE_SNAPSHOT, an empty name prefix (or group name prefix with the
//!   `CSIVolumeGroupSnapshot` gate), values upstream would panic on later), the CSI connection lost later, leadership lost;
//! - 2: a command-line error;
//! - 255: upstream's fatal errors: an unknown feature gate, `--node-deployment` without
//!   `NODE_NAME`, the HTTP server failing to listen.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use plugreg_sidecar_kit::VERSION;
use plugreg_sidecar_kit::cli::Program;
use plugreg_sidecar_kit::diagnostics;
use plugreg_sidecar_kit::driver::{CapabilityReads, Identify, IdentifyError, identify};
use plugreg_sidecar_kit::leader::LeaderHealth;
use plugreg_sidecar_kit::lifecycle::{self, LeaderLostLine, Lifecycle, OnSignal, Stop};
use plugreg_sidecar_kit::metrics::Metrics;
use plugreg_sidecar_kit::ratelimit::kube_config;
use plugreg_sidecar_kit::service::Kube;
use plugreg_snapshotter::csi::{Driver, DriverCaps};
use plugreg_snapshotter::decide;
use plugreg_snapshotter::flags::{self, COMMAND, FeatureGates, Flags, Options};
use plugreg_snapshotter::service::{self, DRAIN, Service};
use tokio_util::sync::CancellationToken;

/// The target of this program's lines.
const LOG: &str = "plugreg_csi_snapshotter";
/// Target prefixes of this program's own lines (their debug lines are upstream's V(2)).
const OWN: &[&str] = &["plugreg_snapshotter", LOG];
/// How long a signalled process without leader election lets its workers finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// `klog.Fatal`'s exit code.
const FATAL: i32 = 255;

const PROGRAM: Program = Program {
    name: "csi-snapshotter",
    version: VERSION,
    log_targets: OWN,
    legacy_warning: "Ignoring removed klog flag: csi-snapshotter no longer registers it and it has no effect",
};

fn main() -> ExitCode {
    // Flags, then logging, are the kit's.
    PROGRAM.main(&COMMAND, start)
}

/// The synchronous checks, then the asynchronous rest on a runtime.
fn start(argv0: &str, flags: Flags) -> anyhow::Result<i32> {
    let gates = match FeatureGates::from_requested(&flags.options.feature_gates) {
        Ok(g) => g,
        Err(e) => {
            tracing::error!(target: LOG, "Error while parsing feature gates: {e}");
            return Ok(FATAL);
        }
    };
    if PROGRAM.version(argv0, &flags) {
        return Ok(0);
    }
    tracing::info!(target: LOG, version = VERSION, "Version");
    PROGRAM.warn_legacy(&flags.legacy);
    let options = flags.options;
    if options.automaxprocs {
        tracing::warn!(target: LOG, "Ignoring --automaxprocs: it tunes the Go runtime and has no effect here");
    }
    for gate in &gates.ignored {
        tracing::info!(target: LOG, gate = %gate, "Ignoring feature gate: it has no effect on the snapshotter");
    }
    if let Err(e) = flags::validate(&options) {
        tracing::error!(target: LOG, "{e}");
        return Ok(1);
    }
    lifecycle::block_on(run(options, gates)).context("building the runtime")
}

/// What start-up found out.
struct Started {
    name: String,
    driver: Driver,
    caps: DriverCaps,
    metrics: Arc<Metrics>,
    health: LeaderHealth,
    http: Option<CancellationToken>,
}

/// The rest of the start-up, then the run; returns the exit code.
async fn run(options: Options, gates: FeatureGates) -> i32 {
    let mut life = match Lifecycle::install() {
        Ok(l) => l,
        Err(code) => return code,
    };
    let kube_config = match kube_config(&options.controller).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, err = %e, "Failed to build a Kubernetes config");
            return 1;
        }
    };
    let node = if options.node_deployment {
        match std::env::var("NODE_NAME") {
            Ok(n) if !n.is_empty() => Some(n),
            _ => {
                tracing::error!(target: LOG, "{}", flags::NO_NODE_NAME);
                return FATAL;
            }
        }
    } else {
        None
    };
    if let Err(e) = options.controller.http_address() {
        tracing::error!(target: LOG, "{e}");
        return 1;
    }
    let channel = match life.connect(&options.csi_address).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, "error connecting to CSI driver: {e}");
            return 1;
        }
    };
    let startup = async {
        // The name (counted as `unknown-driver`), the HTTP server on the driver's registry
        // (before the Probe, whatever the leadership), the Probe, then the capabilities.
        let health = LeaderHealth::new();
        let how = Identify {
            timeout: options.timeout,
            startup_deadline: None,
            probe_first: false,
            migration: false,
            capabilities: CapabilityReads::Controller,
            grpc_log: None,
        };
        let named = |name: &str| tracing::debug!(target: LOG, driver = %name, "CSI driver name");
        let serve = async |_: &str, metrics: &Arc<Metrics>| {
            diagnostics::spawn(&options.controller, metrics.clone(), &health)
                .await
                .map_err(|e| {
                    tracing::error!(
                        target: LOG,
                        "Failed to start HTTP server at specified address ({:?}) and metrics path ({:?}): {e}",
                        options.controller.http_address().unwrap_or_default(),
                        options.controller.metrics_path
                    );
                    FATAL
                })
        };
        let found = match identify(&channel, &how, named, serve).await {
            Ok(f) => f,
            Err(IdentifyError::Ready(code)) => return Err(code),
            Err(IdentifyError::Name(e)) => {
                tracing::error!(target: LOG, "error getting CSI driver name: {e}");
                return Err(1);
            }
            Err(e @ (IdentifyError::Probe(_) | IdentifyError::MigrationProbe(_))) => {
                tracing::error!(target: LOG, "error waiting for CSI driver to be ready: {e}");
                return Err(1);
            }
            Err(
                e @ (IdentifyError::PluginCapabilities(_)
                | IdentifyError::ControllerCapabilities(_)),
            ) => {
                tracing::error!(target: LOG, "error determining if driver supports create/delete snapshot operations: {e}");
                return Err(1);
            }
        };
        let (name, caps) = (found.name, DriverCaps::from(&found.capabilities));
        if let Some(refusal) = service::refusal(&options, &name, caps) {
            tracing::error!(target: LOG, "{refusal}");
            return Err(1);
        }
        let metrics = found.client.metrics().clone();
        let driver = Driver::new(found.client);
        if let Some(refusal) = service::group_check(&options, &gates, &driver, &name).await {
            tracing::error!(target: LOG, "{refusal}");
            return Err(1);
        }
        Ok(Started {
            name,
            metrics,
            driver,
            caps,
            health,
            http: found.ready,
        })
    };
    let started = match life.start(startup).await {
        Ok(s) => s,
        Err(code) => return code,
    };

    let controller = &options.controller;
    let kube = Kube::from_flags(
        controller,
        kube_config,
        &decide::lock_name(&started.name),
        gates.release_leader_election_on_exit,
        started.health.clone(),
        started.metrics.clone(),
    );
    let leading = kube.leader.is_some();
    let service = Service {
        kube,
        driver: started.driver,
        config: service::config(&options, &gates, &started.name, started.caps, node),
    };
    // With leader election and no release on exit, upstream then stays up idle (SIGINT) or is
    // killed (SIGTERM); here the process ends at once and the Lease expires by itself.
    let stop = Stop {
        on_signal: OnSignal::Controller {
            leading,
            release_on_exit: gates.release_leader_election_on_exit,
            grace: SHUTDOWN_GRACE,
            drain: DRAIN,
            second_signal_exits: false,
        },
        leader_lost: LeaderLostLine::ErrField,
        failed: 1,
    };
    let shutdown = CancellationToken::new();
    life.run(service.run(shutdown.clone()), shutdown, stop, started.http)
        .await
}
