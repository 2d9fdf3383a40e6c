//! `csi-resizer`: a drop-in replacement of the Kubernetes CSI external-resizer v2.2.1. This
//! binary is thin: it parses upstream's command line (Go `flag` syntax), then walks upstream's
//! start-up order with its log lines and exit codes, and hands over to the controllers:
//!
//! - 0: `--version` (answered before the feature gates are checked), `-h`/`--help`, a clean
//!   stop (SIGTERM/SIGINT);
//! - 1: invalid logging configuration, both HTTP address flags, an unknown feature gate, no
//!   cluster configuration, CSI connect or probe failure, no driver name, a driver without the
//!   CONTROLLER_SERVICE capability, a failed capability call, an HTTP listen failure, the CSI
//!   connection lost later, the Lease lost;
//! - 2: a command-line error;
//! - 255: upstream's `klog.Fatalf`: a driver that can neither resize nor modify.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use plugreg_resizer::csi::{Driver, Resizer, StartError};
use plugreg_resizer::flags::{self, COMMAND, FATAL_EXIT, FeatureGates, Flags, Options};
use plugreg_resizer::service::{self, Service};
use plugreg_sidecar_kit::VERSION;
use plugreg_sidecar_kit::cli::Program;
use plugreg_sidecar_kit::diagnostics;
use plugreg_sidecar_kit::driver::{CapabilityReads, Identify, IdentifyError, identify};
use plugreg_sidecar_kit::leader::LeaderHealth;
use plugreg_sidecar_kit::lifecycle::{self, LeaderLostLine, Lifecycle, OnSignal, Stop};
use plugreg_sidecar_kit::ratelimit::kube_config;
use plugreg_sidecar_kit::service::Kube;
use tokio_util::sync::CancellationToken;

/// The target of this program's lines (the log filter shows plugreg's info lines at `-v=0`).
const LOG: &str = "plugreg_csi_resizer";
/// How long a signalled process lets its workers finish (and the lease go) before it exits.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Target prefixes of this program's own lines.
const OWN: &[&str] = &["plugreg_resizer", LOG];

/// The binary, for the kit's `main` skeleton.
const PROGRAM: Program = Program {
    name: "csi-resizer",
    version: VERSION,
    log_targets: OWN,
    legacy_warning: "Ignoring removed klog flag: external-resizer no longer registers it and it has no effect",
};

fn main() -> ExitCode {
    // Step 1 (flags, then logging) is the kit's.
    PROGRAM.main(&COMMAND, start)
}

/// Steps 2-4, then the asynchronous rest on a runtime; returns the exit code.
fn start(argv0: &str, flags: Flags) -> anyhow::Result<i32> {
    // Step 2: the version comes before the feature gates.
    if PROGRAM.version(argv0, &flags) {
        return Ok(0);
    }
    tracing::info!(target: LOG, version = VERSION, "Version");
    PROGRAM.warn_legacy(&flags.legacy);
    let options = flags.options;
    // Step 3.
    if options.controller.http_address().is_err() {
        tracing::error!(
            target: LOG,
            "Only one of `--metrics-address` and `--http-endpoint` can be set."
        );
        return Ok(1);
    }
    // Step 4.
    let gates = match FeatureGates::from_requested(&options.feature_gates) {
        Ok(g) => g,
        Err(e) => {
            tracing::error!(target: LOG, err = %e, "Failed to set feature gates");
            return Ok(1);
        }
    };
    for gate in &gates.ga_disabled {
        tracing::warn!(target: LOG, "Setting GA feature gate {gate}=false. It will be removed in a future release.");
    }
    for gate in &gates.ignored {
        tracing::info!(target: LOG, gate = %gate, "Ignoring feature gate: it has no effect on the resizer");
    }
    if options.automaxprocs {
        tracing::warn!(target: LOG, "Ignoring --automaxprocs: it tunes the Go runtime and has no effect here");
    }
    // Upstream panics on these at election start.
    if let Err(e) = options.controller.validate() {
        tracing::error!(target: LOG, "{e}");
        return Ok(1);
    }
    lifecycle::block_on(run(options, gates)).context("building the runtime")
}

/// Whether the API server serves `storage.k8s.io/v1` VolumeAttributesClasses (step 6):
/// `Ok(false)` for a 404 or a list without them (the kit's discovery, shared with csi-provisioner
/// and csi-sidecars).
async fn vac_available(config: &kube::Config) -> Result<bool, String> {
    let client = plugreg_sidecar_kit::ratelimit::unlimited_client(config.clone())
        .map_err(|e| e.to_string())?;
    plugreg_sidecar_kit::vac::discover(&client)
        .await
        .map_err(|e| e.to_string())
}

/// Steps 5-17; returns the exit code.
async fn run(options: Options, mut gates: FeatureGates) -> i32 {
    let mut life = match Lifecycle::install() {
        Ok(l) => l,
        Err(code) => return code,
    };
    // Step 5.
    let kube_config = match kube_config(&options.controller).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, err = %e, "Failed to create cluster config");
            return 1;
        }
    };
    // Step 6.
    if !gates.volume_attributes_class_explicit {
        match vac_available(&kube_config).await {
            Ok(true) => tracing::info!(target: LOG, "VolumeAttributesClass v1 API is available"),
            Ok(false) => {
                tracing::info!(target: LOG, "Disabling VolumeAttributesClass feature gate because the VolumeAttributesClass v1 API is not available");
                gates.volume_attributes_class = false;
            }
            Err(e) => {
                tracing::error!(target: LOG, err = %e, "Failed to check VolumeAttributesClass V1 API availability");
            }
        }
    }
    // Steps 7-8.
    let channel = match life.connect(&options.csi_address).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, err = %format!("failed to connect to CSI driver: {e}"), "Failed to create CSI client");
            return 1;
        }
    };
    let startup = async {
        // Steps 8-11: metrics named `unknown-driver` until the name is known; for a
        // CSI-migration target a registry with the `migrated` label and a second Probe (in-tree
        // PVs are translated, the kit's `migration`); the capabilities.
        let how = Identify {
            timeout: options.timeout,
            startup_deadline: None,
            probe_first: true,
            migration: true,
            capabilities: CapabilityReads::PluginThenControllerService,
            grpc_log: None,
        };
        let named =
            |name: &str| tracing::debug!(target: LOG, driverName = %name, "CSI driver name");
        let found = match identify(&channel, &how, named, async |_, _| Ok::<_, i32>(())).await {
            Ok(f) => f,
            Err(IdentifyError::Ready(code)) => return Err(code),
            Err(IdentifyError::Probe(e)) => {
                tracing::error!(target: LOG, err = %format!("failed probing CSI driver: {e}"), "Failed to create CSI client");
                return Err(1);
            }
            Err(IdentifyError::Name(e)) => {
                tracing::error!(target: LOG, err = %e, "Get driver name failed");
                return Err(1);
            }
            Err(IdentifyError::MigrationProbe(e)) => {
                tracing::error!(target: LOG, err = %format!("failed probing CSI driver: {e}"), "Failed to create MigratedCSI client");
                return Err(1);
            }
            Err(
                e @ (IdentifyError::PluginCapabilities(_)
                | IdentifyError::ControllerCapabilities(_)),
            ) => {
                tracing::error!(target: LOG, err = %e, "Failed to create CSI resizer");
                return Err(1);
            }
        };
        let (name, metrics) = (found.name, found.client.metrics().clone());
        // Step 12.
        let driver = Driver::new(found.client);
        let found = match driver.find(&found.capabilities).await {
            Ok(f) => f,
            Err(e @ StartError::NoControllerService) | Err(e @ StartError::Call(_)) => {
                tracing::error!(target: LOG, err = %e, "Failed to create CSI resizer");
                return Err(1);
            }
        };
        match found.resizer {
            None => {
                tracing::info!(target: LOG, reason = "CSI driver neither supports controller resize nor node resize", "Resize not supported")
            }
            Some(Resizer::Trivial) => {
                tracing::info!(target: LOG, "The CSI driver supports node resize only, using trivial resizer to handle resize requests")
            }
            Some(Resizer::Csi) => {}
        }
        if !found.modify {
            tracing::info!(target: LOG, reason = "CSI driver does not support controller modify", "Modify not supported");
        }
        // Step 13.
        if found.resizer.is_none() && !found.modify {
            tracing::error!(target: LOG, "CSI driver does not support resize nor modify");
            return Err(FATAL_EXIT);
        }
        // Step 14.
        let health = LeaderHealth::new();
        let http = match diagnostics::spawn(&options.controller, metrics.clone(), &health).await {
            Ok(h) => h,
            Err(e) => {
                tracing::error!(target: LOG, err = %e, "Failed to start HTTP server");
                return Err(1);
            }
        };
        Ok((name, driver, found, metrics, health, http))
    };
    let (name, driver, found, metrics, health, http) = match life.start(startup).await {
        Ok(s) => s,
        Err(code) => return code,
    };

    // Steps 15-17.
    let kube = Kube::from_flags(
        &options.controller,
        kube_config,
        &flags::lock_name(&name),
        gates.release_leader_election_on_exit,
        health,
        metrics,
    );
    let service = Service {
        kube,
        config: service::config(&options, &gates, &name, found),
        driver,
    };
    let stop = Stop {
        on_signal: OnSignal::Drain {
            grace: SHUTDOWN_GRACE,
        },
        leader_lost: LeaderLostLine::InMessage,
        failed: 1,
    };
    let shutdown = CancellationToken::new();
    life.run(service.run(shutdown.clone()), shutdown, stop, http)
        .await
}
