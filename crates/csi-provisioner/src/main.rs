//! `csi-provisioner`: a drop-in replacement of the Kubernetes CSI external-provisioner v6.3.0.
//! This binary is thin: it parses upstream's command line (pflag syntax), then walks upstream's
//! start-up order (`docs/upstream/upstream-external-provisioner.md` §2 steps 1-18) with its log lines and exit
//! codes, and hands over to the controller:
//!
//! - 0: `--version`, `-h`/`--help`, a clean stop (SIGTERM/SIGINT);
//! - 1: invalid logging configuration, both HTTP address flags, CSI connect or probe failure,
//!   the CSI connection lost later, a feature switched on that is not supported yet
//!   (the `CrossNamespaceVolumeDataSource` gate);
//! - 2: a command-line error;
//! - 255: upstream's `klog.Fatal` cases (unknown feature gate, no kube config, no driver name,
//!   no capabilities, HTTP listen failure, `--node-deployment` without `NODE_NAME` or without
//!   NodeGetInfo's answer).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use plugreg_provisioner::csi::{Capabilities, Driver};
use plugreg_provisioner::flags::{self, COMMAND, FATAL_EXIT, FeatureGates, Flags, Options};
use plugreg_provisioner::start::{self, Started};
use plugreg_sidecar_kit::VERSION;
use plugreg_sidecar_kit::cli::Program;
use plugreg_sidecar_kit::diagnostics;
use plugreg_sidecar_kit::driver::{CapabilityReads, Identify, IdentifyError, identify};
use plugreg_sidecar_kit::leader::LeaderHealth;
use plugreg_sidecar_kit::lifecycle::{self, LeaderLostLine, Lifecycle, OnSignal, Stop};
use plugreg_sidecar_kit::migration;
use plugreg_sidecar_kit::ratelimit::{self, kube_config};
use plugreg_sidecar_kit::service::Kube;
use tokio_util::sync::CancellationToken;

/// The target of this program's lines (the log filter shows plugreg's info lines at `-v=0`).
const LOG: &str = "plugreg_csi_provisioner";
/// How long a signalled process lets its workers finish (and the lease go) before it exits.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Target prefixes of this program's own lines (their debug lines are upstream's V(2)).
const OWN: &[&str] = &["plugreg_provisioner", LOG];

/// The binary, for the kit's `main` skeleton.
const PROGRAM: Program = Program {
    name: "csi-provisioner",
    version: VERSION,
    log_targets: OWN,
    legacy_warning: "Ignoring removed klog flag: external-provisioner no longer registers it and it has no effect",
};

fn main() -> ExitCode {
    // Step 1 (flags, then logging) is the kit's.
    PROGRAM.main(&COMMAND, start)
}

/// Steps 2-5, then the asynchronous rest on a runtime; returns the exit code.
fn start(argv0: &str, flags: Flags) -> anyhow::Result<i32> {
    // Step 2: feature gates (upstream: klog.Fatal).
    let gates = match FeatureGates::from_requested(&flags.options.feature_gates) {
        Ok(g) => g,
        Err(e) => {
            tracing::error!(target: LOG, "{e}");
            return Ok(FATAL_EXIT);
        }
    };
    // Step 3.
    let node_name = std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty());
    if flags.options.node_deployment && node_name.is_none() {
        tracing::error!(target: LOG, "{}", flags::NO_NODE_NAME);
        return Ok(FATAL_EXIT);
    }
    // Step 4.
    if PROGRAM.version(argv0, &flags) {
        return Ok(0);
    }
    tracing::info!(target: LOG, version = VERSION, "Version");
    PROGRAM.warn_legacy(&flags.legacy);
    let options = flags.options;
    warn_ignored(&options, &gates);
    if let Some(refusal) = start::unsupported(&gates) {
        tracing::error!(target: LOG, "{refusal}");
        return Ok(1);
    }
    // Step 5.
    if let Err(e) = options.controller.http_address() {
        tracing::error!(target: LOG, "{e}");
        return Ok(1);
    }
    // Upstream panics on these later (on the first claim, at election start).
    if let Err(e) = flags::validate(&options) {
        tracing::error!(target: LOG, "{e}");
        return Ok(1);
    }
    // Not yet on the kit's one thread: the provisioner's throughput and timings (a hundred claim
    // and a hundred volume workers by default) were measured on a multi-thread runtime.
    lifecycle::block_on_multi_thread(run(options, gates, node_name)).context("building the runtime")
}

/// Logs what is accepted but has no effect here.
fn warn_ignored(options: &Options, gates: &FeatureGates) {
    if options.automaxprocs {
        tracing::warn!(target: LOG, "Ignoring --automaxprocs: it tunes the Go runtime and has no effect here");
    }
    if options.enable_pprof {
        tracing::warn!(target: LOG, "Ignoring --enable-pprof: Go's pprof handlers do not exist here");
    }
    if options.node_deployment && options.controller.leader_election {
        // Upstream accepts this too: every node competes for the driver's one Lease.
        tracing::warn!(
            target: LOG,
            "--leader-election with --node-deployment: the provisioners of all nodes compete for one Lease, so only the leader's node provisions and deletes volumes; remove --leader-election"
        );
    }
    for gate in &gates.ignored {
        tracing::info!(target: LOG, gate = %gate, "Ignoring feature gate: it has no effect on the provisioner");
    }
}

/// Steps 6-18, then the controller; returns the exit code.
async fn run(options: Options, gates: FeatureGates, node_name: Option<String>) -> i32 {
    let mut life = match Lifecycle::install() {
        Ok(l) => l,
        Err(code) => return code,
    };
    // Step 6.
    let kube_config = match kube_config(&options.controller).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, "Failed to create config: {e}");
            return FATAL_EXIT;
        }
    };
    // Steps 7 and 9 (the rate-limited clients) are the run's (the kit's `Kube`): `kube_config`
    // is handed over below. Step 8: the VolumeAttributesClass discovery check, as upstream: a gate not
    // set explicitly is switched off when the API server serves no v1 VolumeAttributesClass.
    let mut volume_attributes_class = gates.volume_attributes_class;
    if volume_attributes_class && !gates.volume_attributes_class_explicit {
        let available = match plugreg_sidecar_kit::ratelimit::unlimited_client(kube_config.clone())
        {
            Ok(client) => plugreg_sidecar_kit::vac::api_available(&client).await,
            Err(_) => None,
        };
        if available == Some(false) {
            tracing::info!(
                target: LOG,
                "Disabling VolumeAttributesClass feature gate because the VolumeAttributesClass v1 API is not available"
            );
            volume_attributes_class = false;
        }
    }

    // Step 10.
    let channel = match life.connect(&options.csi_address).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, "{e}");
            return 1;
        }
    };
    let startup = async {
        // Steps 11-14: metrics named `unknown-driver` until the name is known; for a
        // CSI-migration target a registry with the `migrated` label and a second Probe (claims
        // of the in-tree plugin's classes are provisioned translated); the capabilities.
        let how = Identify {
            timeout: options.timeout,
            startup_deadline: None,
            probe_first: true,
            migration: true,
            capabilities: CapabilityReads::PluginAndController,
            grpc_log: None,
        };
        let named = |name: &str| {
            tracing::debug!(target: LOG, "Detected CSI driver {name}");
            if let Some(in_tree) = migration::in_tree_plugin(name) {
                tracing::debug!(target: LOG, "Supports migration from in-tree plugin: {in_tree}");
            }
        };
        let found = match identify(&channel, &how, named, async |_, _| Ok::<_, i32>(())).await {
            Ok(f) => f,
            Err(IdentifyError::Ready(code)) => return Err(code),
            Err(e @ (IdentifyError::Probe(_) | IdentifyError::MigrationProbe(_))) => {
                tracing::error!(target: LOG, "{e}");
                return Err(1);
            }
            Err(IdentifyError::Name(e)) => {
                tracing::error!(target: LOG, "Error getting CSI driver name: {e}");
                return Err(FATAL_EXIT);
            }
            Err(
                e @ (IdentifyError::PluginCapabilities(_)
                | IdentifyError::ControllerCapabilities(_)),
            ) => {
                tracing::error!(target: LOG, "Error getting CSI driver capabilities: {e}");
                return Err(FATAL_EXIT);
            }
        };
        let (name, capabilities) = (found.name, Capabilities::from(&found.capabilities));
        let metrics = found.client.metrics().clone();
        let driver = Driver::new(found.client);
        // Node deployment (§B.2 step 3): this node as the driver sees it, always asked.
        let local = match (&options.node_deployment, &node_name) {
            (true, Some(node)) => match start::local_node(&driver, node).await {
                Ok(local) => Some(local),
                Err(e) => {
                    tracing::error!(target: LOG, "{e}");
                    return Err(FATAL_EXIT);
                }
            },
            _ => None,
        };
        // Step 15.
        let identity = start::identity(&name, local.as_ref().map(|l| l.node.as_str()));
        // Step 16 (the informers themselves are the controller's).
        if capabilities.publish_unpublish_volume {
            tracing::info!(
            target: LOG,
                "CSI driver supports PUBLISH_UNPUBLISH_VOLUME, watching VolumeAttachments"
            );
        } else {
            tracing::info!(
            target: LOG,
                "CSI driver does not support PUBLISH_UNPUBLISH_VOLUME, not watching VolumeAttachments"
            );
        }
        // Step 17: capacity tracking's client, owner, manager and API version, on the
        // connection the work will share (built here, handed to the service below).
        let (capacity, transport) = if options.enable_capacity {
            let transport = match ratelimit::Transport::new(kube_config.clone()) {
                Ok(t) => t,
                Err(e) => {
                    tracing::error!(target: LOG, "Failed to create client: {e}");
                    return Err(FATAL_EXIT);
                }
            };
            match start::capacity(&options, &transport, &name, local.as_ref()).await {
                Ok(c) => (Some(c), Some(transport)),
                Err(e) => {
                    tracing::error!(target: LOG, "{e}");
                    return Err(FATAL_EXIT);
                }
            }
        } else {
            (None, None)
        };
        // Step 18.
        let health = LeaderHealth::new();
        let http = match diagnostics::spawn(&options.controller, metrics.clone(), &health).await {
            Ok(h) => h,
            Err(e) => {
                tracing::error!(target: LOG, "{e}");
                return Err(FATAL_EXIT);
            }
        };
        let started = Started {
            capacity,
            local,
            name,
            identity,
            driver: Arc::new(driver),
            capabilities,
        };
        Ok((started, metrics, health, http, transport))
    };
    let (started, metrics, health, http, transport) = match life.start(startup).await {
        Ok(s) => s,
        Err(code) => return code,
    };

    // Steps 19-20: the controller, directly or under the Lease.
    let mut kube = Kube::from_flags(
        &options.controller,
        kube_config,
        &flags::lock_name(&started.name),
        gates.release_leader_election_on_exit,
        health,
        metrics,
    );
    kube.transport = transport;
    let service = start::service(&options, &gates, volume_attributes_class, kube, started);
    // Workers finish their current call on a signal; the Lease is released when the gate asks.
    // A failed run is upstream's klog.Fatal.
    let stop = Stop {
        on_signal: OnSignal::Drain {
            grace: SHUTDOWN_GRACE,
        },
        leader_lost: LeaderLostLine::InMessage,
        failed: FATAL_EXIT,
    };
    let shutdown = CancellationToken::new();
    life.run(service.run(shutdown.clone()), shutdown, stop, http)
        .await
}
