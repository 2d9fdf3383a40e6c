//! `csi-external-health-monitor-controller`: a drop-in replacement of the Kubernetes CSI
//! external-health-monitor v0.18.0 controller sidecar. This binary is thin: it parses
//! upstream's command line (Go `flag` syntax), walks upstream's start-up order with its log
//! lines and exit codes, and hands over to the controller (`plugreg-health-monitor`):
//!
//! - 0: `--version`, `-h`/`--help`, a clean stop (SIGTERM/SIGINT without leader election);
//! - 1: every start-up error (both HTTP flags, no Kubernetes config, `--worker-threads=0`, CSI
//!   connect, probe, name or capability failure, a driver without the controller service or
//!   without VOLUME_CONDITION and one of LIST_VOLUMES and GET_VOLUME, the HTTP server failing
//!   to listen), the CSI connection lost later, leadership lost;
//! - 2: a command-line error.
//!
//! Upstream logs the two "..., exiting" refusals at V(2), so at the default `-v=0` it exits 1
//! without a word; here they are errors, seen at every verbosity.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use plugreg_health_monitor::controller::Config;
use plugreg_health_monitor::csi::{self, Driver};
use plugreg_health_monitor::decide;
use plugreg_health_monitor::flags::{self, COMMAND, Flags, Options};
use plugreg_health_monitor::service::{self, DRAIN, Service};
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
const LOG: &str = "plugreg_csi_health_monitor";
/// Target prefixes of this program's own lines (their debug lines are upstream's V(2)).
const OWN: &[&str] = &["plugreg_health_monitor", LOG];
/// How long a signalled process without leader election lets its checks finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// The deadline of GetPluginInfo, and the one the capability reads share (upstream's fixed
/// 1 s, there shared by all five calls).
const STARTUP_DEADLINE: Duration = Duration::from_secs(1);

const PROGRAM: Program = Program {
    name: "csi-external-health-monitor-controller",
    version: VERSION,
    log_targets: OWN,
    legacy_warning: "Ignoring removed klog flag: csi-external-health-monitor-controller no longer registers it and it has no effect",
};

fn main() -> ExitCode {
    // Flags, then logging, are the kit's.
    PROGRAM.main(&COMMAND, start)
}

/// The synchronous checks, then the asynchronous rest on a runtime.
fn start(argv0: &str, flags: Flags) -> anyhow::Result<i32> {
    if PROGRAM.version(argv0, &flags) {
        return Ok(0);
    }
    tracing::info!(target: LOG, version = VERSION, "Version");
    PROGRAM.warn_legacy(&flags.legacy);
    let options = flags.options;
    if options.automaxprocs {
        tracing::warn!(target: LOG, "Ignoring --automaxprocs: it tunes the Go runtime and has no effect here");
    }
    if options.controller.http_address().is_err() {
        tracing::error!(target: LOG, "Only one of `--metrics-address` and `--http-endpoint` can be set.");
        return Ok(1);
    }
    if let Err(e) = flags::validate(&options) {
        tracing::error!(target: LOG, "{e}");
        return Ok(1);
    }
    lifecycle::block_on(run(options)).context("building the runtime")
}

/// What start-up found out.
struct Started {
    driver: Driver,
    config: Config,
    metrics: Arc<Metrics>,
    health: LeaderHealth,
    http: Option<CancellationToken>,
}

/// The rest of the start-up, then the run; returns the exit code.
async fn run(options: Options) -> i32 {
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
    if options.worker_threads == 0 {
        tracing::error!(target: LOG, "{}", flags::NO_WORKERS);
        return 1;
    }
    let channel = match life.connect(&options.csi_address).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, err = %e, "Failed to connect to the CSI driver");
            return 1;
        }
    };
    let startup = async {
        let health = LeaderHealth::new();
        let how = Identify {
            timeout: options.timeout,
            startup_deadline: Some(STARTUP_DEADLINE),
            probe_first: true,
            migration: false,
            capabilities: CapabilityReads::PluginThenControllerService,
            grpc_log: None,
        };
        let named = |name: &str| tracing::debug!(target: LOG, driver = %name, "CSI driver name");
        let serve = async |_: &str, metrics: &Arc<Metrics>| {
            // Upstream's one registry is csi-lib-utils' (component-base's HELP texts).
            metrics.alpha_process_start_help();
            let address = options.controller.http_address().unwrap_or_default();
            let http = diagnostics::spawn(&options.controller, metrics.clone(), &health)
                .await
                .map_err(|e| {
                    tracing::error!(
                        target: LOG,
                        address = %address,
                        path = %options.controller.metrics_path,
                        err = %e,
                        "Failed to start HTTP server at specified address and metrics path"
                    );
                    1
                })?;
            if http.is_some() {
                // Upstream's line (csi-lib-utils v0.24): the address, no path.
                tracing::info!(target: LOG, address = %address, "ServeMux listening");
            }
            Ok(http)
        };
        let found = match identify(&channel, &how, named, serve).await {
            Ok(f) => f,
            Err(IdentifyError::Ready(code)) => return Err(code),
            Err(IdentifyError::Name(e)) => {
                tracing::error!(target: LOG, err = %e, "Failed to get the CSI driver name");
                return Err(1);
            }
            Err(e @ (IdentifyError::Probe(_) | IdentifyError::MigrationProbe(_))) => {
                tracing::error!(target: LOG, err = %e, "Failed to probe the CSI driver");
                return Err(1);
            }
            Err(e @ IdentifyError::PluginCapabilities(_)) => {
                tracing::error!(target: LOG, err = %e, "Failed to check whether the CSI driver supports the Plugin Controller Service");
                return Err(1);
            }
            Err(e @ IdentifyError::ControllerCapabilities(_)) => {
                tracing::error!(target: LOG, err = %format!("failed to get controller capabilities: {e}"), "Failed to check whether the CSI driver supports the Controller Service ListVolumes");
                return Err(1);
            }
        };
        let mode = match csi::mode(&found.capabilities) {
            Ok(m) => m,
            Err(refusal) => {
                tracing::error!(target: LOG, "{refusal}, exiting");
                return Err(1);
            }
        };
        tracing::debug!(target: LOG, mode = ?mode, "Checking volume conditions");
        Ok(Started {
            config: service::config(&options, &found.name, mode),
            metrics: found.client.metrics().clone(),
            driver: Driver::new(found.client),
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
        &decide::lock_name(&started.config.driver),
        false,
        started.health.clone(),
        started.metrics.clone(),
    );
    let leading = kube.leader.is_some();
    let service = Service {
        kube,
        driver: started.driver,
        config: started.config,
    };
    let stop = Stop {
        on_signal: OnSignal::Controller {
            leading,
            release_on_exit: false,
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
