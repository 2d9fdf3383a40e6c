//! `csi-attacher`: a drop-in replacement of the Kubernetes CSI external-attacher v4.12.0.
//! This binary is thin: it parses upstream's command line (Go `flag` syntax), walks upstream's
//! start-up order (`docs/upstream/upstream-external-attacher.md` §3) with its log lines and
//! exit codes, and hands over to the controller (`plugreg-attacher`):
//!
//! - 0: `--version`, `-h`/`--help`, a clean stop (SIGTERM/SIGINT without leader election);
//! - 1: every start-up error (unknown feature gate, both HTTP flags, no Kubernetes config,
//!   `--worker-threads=0`, CSI connect, probe, name or capability failure, HTTP listen
//!   failure), the CSI connection lost later, leadership lost, a second SIGTERM/SIGINT while
//!   the first one's shutdown waits for the workers;
//! - 2: a command-line error.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use plugreg_attacher::csi::{self, Driver};
use plugreg_attacher::decide::{self, DriverCaps};
use plugreg_attacher::flags::{self, COMMAND, FeatureGates, Flags, Options};
use plugreg_attacher::service::{self, DRAIN, Service};
use plugreg_sidecar_kit::VERSION;
use plugreg_sidecar_kit::cli::Program;
use plugreg_sidecar_kit::diagnostics;
use plugreg_sidecar_kit::driver::{CapabilityReads, Identify, IdentifyError, identify};
use plugreg_sidecar_kit::leader::LeaderHealth;
use plugreg_sidecar_kit::lifecycle::{self, LeaderLostLine, Lifecycle, OnSignal, Stop};
use plugreg_sidecar_kit::metrics::Metrics;
use plugreg_sidecar_kit::ratelimit::kube_config;
use plugreg_sidecar_kit::service::Kube;
use tokio_util::sync::CancellationToken;

/// The target of this program's lines.
const LOG: &str = "plugreg_csi_attacher";
/// Target prefixes of this program's own lines (their debug lines are upstream's V(2)).
const OWN: &[&str] = &["plugreg_attacher", LOG];
/// How long a signalled process without leader election lets its workers finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

const PROGRAM: Program = Program {
    name: "csi-attacher",
    version: VERSION,
    log_targets: OWN,
    legacy_warning: "Ignoring removed klog flag: external-attacher no longer registers it and it has no effect",
};

fn main() -> ExitCode {
    // Step 1 (flags, then logging) is the kit's.
    PROGRAM.main(&COMMAND, start)
}

/// Steps 2-4 and 6's flag check, then the asynchronous rest on a runtime.
fn start(argv0: &str, flags: Flags) -> anyhow::Result<i32> {
    // Step 2.
    let gates = match FeatureGates::from_requested(&flags.options.feature_gates) {
        Ok(g) => g,
        Err(e) => {
            tracing::error!(target: LOG, err = %e, "failed to store flag gates");
            return Ok(1);
        }
    };
    // Step 3.
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
        tracing::info!(target: LOG, gate = %gate, "Ignoring feature gate: it has no effect on the attacher");
    }
    // Step 4.
    if options.controller.http_address().is_err() {
        tracing::error!(target: LOG, "Only one of `--metrics-address` and `--http-endpoint` can be set");
        return Ok(1);
    }
    // Step 6's check (and the timings upstream would panic on later).
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

/// Steps 5-16; returns the exit code.
async fn run(options: Options, gates: FeatureGates) -> i32 {
    let mut life = match Lifecycle::install() {
        Ok(l) => l,
        Err(code) => return code,
    };
    // Step 5.
    let kube_config = match kube_config(&options.controller).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, err = %e, "Failed to build a Kubernetes config");
            return 1;
        }
    };
    // Step 8.
    let channel = match life.connect(&options.csi_address).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, csiAddress = %options.csi_address, err = %e, "Failed to connect to the CSI driver");
            return 1;
        }
    };
    let startup = async {
        // Steps 7, 9-13: metrics named `unknown-driver` until the name is known; for a
        // CSI-migration target a registry with the `migrated` label and a second Probe (in-tree
        // PVs are translated, the kit's `migration`, whatever the driver); the HTTP server on
        // the driver's registry; the capabilities.
        let health = LeaderHealth::new();
        let how = Identify {
            timeout: options.timeout,
            startup_deadline: Some(csi::STARTUP_CALL_TIMEOUT),
            probe_first: true,
            migration: true,
            capabilities: CapabilityReads::PluginThenControllerService,
            grpc_log: Some(options.max_grpc_log_length),
        };
        let named = |name: &str| tracing::debug!(target: LOG, driver = %name, "CSI driver name");
        let serve = async |_: &str, metrics: &Arc<Metrics>| {
            let http = match diagnostics::spawn(&options.controller, metrics.clone(), &health).await
            {
                Ok(h) => h,
                Err(e) => {
                    tracing::error!(target: LOG, err = %e, "Failed to start HTTP server at specified address and metrics path");
                    return Err(1);
                }
            };
            if let Ok(address) = options.controller.http_address()
                && !address.is_empty()
            {
                tracing::info!(target: LOG, address = %address, metricsPath = %options.controller.metrics_path, "ServeMux listening");
            }
            Ok(http)
        };
        let found = match identify(&channel, &how, named, serve).await {
            Ok(f) => f,
            Err(IdentifyError::Ready(code)) => return Err(code),
            Err(e @ (IdentifyError::Probe(_) | IdentifyError::MigrationProbe(_))) => {
                tracing::error!(target: LOG, err = %e, "Failed to probe the CSI driver");
                return Err(1);
            }
            Err(e @ IdentifyError::Name(_)) => {
                tracing::error!(target: LOG, err = %e, "Failed to get the CSI driver name");
                return Err(1);
            }
            Err(e @ IdentifyError::PluginCapabilities(_)) => {
                tracing::error!(target: LOG, err = %e, "Failed to check if the CSI Driver supports the CONTROLLER_SERVICE");
                return Err(1);
            }
            Err(e @ IdentifyError::ControllerCapabilities(_)) => {
                tracing::error!(target: LOG, err = %e, "Failed to controller capability check");
                return Err(1);
            }
        };
        let caps = DriverCaps::from(&found.capabilities);
        // Step 14.
        if !caps.controller_service {
            tracing::debug!(target: LOG, "CSI driver does not support Plugin Controller Service, using trivial handler");
        } else if !caps.publish_unpublish {
            tracing::debug!(target: LOG, "CSI driver does not support ControllerPublishUnpublish, using trivial handler");
        } else {
            tracing::debug!(target: LOG, "CSI driver supports ControllerPublishUnpublish, using real CSI handler");
        }
        Ok(Started {
            metrics: found.client.metrics().clone(),
            name: found.name,
            driver: Driver::new(found.client),
            caps,
            health,
            http: found.ready,
        })
    };
    let started = match life.start(startup).await {
        Ok(s) => s,
        Err(code) => return code,
    };

    // Steps 15-16.
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
        config: service::config(&options, &gates, &started.name, started.caps),
    };
    let stop = Stop {
        on_signal: OnSignal::Controller {
            leading,
            release_on_exit: gates.release_leader_election_on_exit,
            grace: SHUTDOWN_GRACE,
            drain: DRAIN,
            second_signal_exits: true,
        },
        leader_lost: LeaderLostLine::ErrField,
        failed: 1,
    };
    let shutdown = CancellationToken::new();
    life.run(service.run(shutdown.clone()), shutdown, stop, started.http)
        .await
}
