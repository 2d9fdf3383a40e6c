//! `csi-provisioner`: a drop-in replacement of the Kubernetes CSI external-provisioner v6.3.0.
//! This binary is thin: it parses upstream's command line (pflag syntax), then walks upstream's
//! start-up order (`upstream-external-provisioner.md` §2 steps 1-18) with its log lines and exit
//! codes, and hands over to the controller:
//!
//! - 0: `--version`, `-h`/`--help`, a clean stop (SIGTERM/SIGINT);
//! - 1: invalid logging configuration, both HTTP address flags, CSI connect or probe failure,
//!   the CSI connection lost later, a feature switched on that is not supported yet;
//! - 2: a command-line error;
//! - 255: upstream's `klog.Fatal` cases (unknown feature gate, no kube config, no driver name,
//!   no capabilities, HTTP listen failure).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use plugreg_provisioner::csi::{self, Capabilities, Driver};
use plugreg_provisioner::flags::{
    self, FATAL_EXIT, FLAG_ERROR_EXIT, FeatureGates, Flags, Options, Parsed,
};
use plugreg_provisioner::http as diagnostics;
use plugreg_provisioner::leader::{LeaderElection, LeaderHealth};
use plugreg_provisioner::metrics::Metrics;
use plugreg_provisioner::request::RequestOptions;
use plugreg_provisioner::service::{Service, ServiceError};
use plugreg_runtime::report;
use plugreg_sidecar_kit::logging::{self, LogFormat};
use tokio_util::sync::CancellationToken;

/// The version reported by `--version` and the `Version` log line: `PLUGREG_VERSION` at build
/// time, else `v` + the crate version.
const VERSION: &str = match option_env!("PLUGREG_VERSION") {
    Some(v) => v,
    None => concat!("v", env!("CARGO_PKG_VERSION")),
};

/// The target of this program's lines (the log filter shows plugreg's info lines at `-v=0`).
const LOG: &str = "plugreg_csi_provisioner";
/// How long a signalled process lets its workers finish (and the lease go) before it exits.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Target prefixes of this program's own lines (their debug lines are upstream's V(2)).
const OWN: &[&str] = &["plugreg_provisioner", LOG];

/// How csi-lib-utils' metrics name the driver before GetPluginInfo has answered.
const UNKNOWN_DRIVER: &str = "unknown-driver";

/// In-tree volume plugins whose CSI drivers csi-translation-lib lists (§2 step 13): the driver
/// name and the in-tree provisioner name.
const MIGRATION_TARGETS: &[(&str, &str)] = &[
    ("ebs.csi.aws.com", "kubernetes.io/aws-ebs"),
    ("pd.csi.storage.gke.io", "kubernetes.io/gce-pd"),
    ("disk.csi.azure.com", "kubernetes.io/azure-disk"),
    ("file.csi.azure.com", "kubernetes.io/azure-file"),
    ("cinder.csi.openstack.org", "kubernetes.io/cinder"),
    ("csi.vsphere.vmware.com", "kubernetes.io/vsphere-volume"),
    ("pxd.portworx.com", "kubernetes.io/portworx-volume"),
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let argv0 = args.first().map_or("csi-provisioner", String::as_str);
    // Step 1: flags, then logging.
    let flags = match flags::parse(args.get(1..).unwrap_or_default()) {
        Ok(Parsed::Run(flags)) => flags,
        Ok(Parsed::Help) => {
            eprint!("{}", flags::usage(argv0));
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{e}");
            eprint!("{}", flags::usage(argv0));
            return exit(FLAG_ERROR_EXIT);
        }
    };
    let format = match flags.logging.validate() {
        Ok(format) => format,
        Err(errors) => {
            logging::init(LogFormat::Text, 0, OWN);
            tracing::error!(target: LOG, err = %errors.join(", "), "LoggingConfiguration is invalid");
            return exit(1);
        }
    };
    logging::init(format, flags.logging.verbosity, OWN);
    match start(argv0, *flags) {
        Ok(code) => exit(code),
        Err(e) => {
            tracing::error!(target: LOG, err = %format!("{e:#}"), "Failed to start");
            exit(1)
        }
    }
}

/// Steps 2-5, then the asynchronous rest on a runtime; returns the exit code.
fn start(argv0: &str, flags: Flags) -> anyhow::Result<i32> {
    // Step 2: feature gates (upstream: klog.Fatal).
    let gates = match FeatureGates::from_requested(&flags.feature_gates) {
        Ok(g) => g,
        Err(e) => {
            tracing::error!(target: LOG, "{e}");
            return Ok(FATAL_EXIT);
        }
    };
    let options = flags.options;
    // Step 3.
    let node_name = std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty());
    if options.node_deployment && node_name.is_none() {
        tracing::error!(
            target: LOG,
            "The NODE_NAME environment variable must be set when using --enable-node-deployment."
        );
        return Ok(FATAL_EXIT);
    }
    // Step 4.
    if flags.version {
        println!("{argv0} {VERSION}");
        return Ok(0);
    }
    tracing::info!(target: LOG, version = VERSION, "Version");
    warn_ignored(&flags.legacy, &options, &gates);
    if let Some(refusal) = unsupported(&options, &gates) {
        tracing::error!(target: LOG, "{refusal}");
        return Ok(1);
    }
    // Step 5.
    if !options.metrics_address.is_empty() && !options.http_endpoint.is_empty() {
        tracing::error!(target: LOG, "only one of `--metrics-address` and `--http-endpoint` can be set.");
        return Ok(1);
    }
    // Upstream panics on these later (on the first claim, at election start).
    if let Err(e) = flags::validate(&options) {
        tracing::error!(target: LOG, "{e}");
        return Ok(1);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("building the runtime")?;
    Ok(runtime.block_on(run(options, gates)))
}

/// Logs what is accepted but has no effect here.
fn warn_ignored(legacy: &[String], options: &Options, gates: &FeatureGates) {
    for flag in legacy {
        tracing::warn!(
            target: LOG,
            flag = %flag,
            "Ignoring removed klog flag: external-provisioner no longer registers it and it has no effect"
        );
    }
    if options.automaxprocs {
        tracing::warn!(target: LOG, "Ignoring --automaxprocs: it tunes the Go runtime and has no effect here");
    }
    if options.enable_pprof {
        tracing::warn!(target: LOG, "Ignoring --enable-pprof: Go's pprof handlers do not exist here");
    }
    for gate in &gates.ignored {
        tracing::info!(target: LOG, gate = %gate, "Ignoring feature gate: it has no effect on the provisioner");
    }
}

/// The first feature switched on that this provisioner does not implement yet (exit 1, rather
/// than silently doing nothing).
fn unsupported(options: &Options, gates: &FeatureGates) -> Option<&'static str> {
    if options.enable_capacity {
        return Some(
            "--enable-capacity is not supported by this csi-provisioner yet (storage capacity tracking); remove the flag or use the upstream image",
        );
    }
    if options.node_deployment {
        return Some(
            "--node-deployment is not supported by this csi-provisioner yet (distributed provisioning); remove the flag or use the upstream image",
        );
    }
    if gates.cross_namespace_volume_data_source {
        return Some(
            "the CrossNamespaceVolumeDataSource feature gate is not supported by this csi-provisioner yet; remove it or use the upstream image",
        );
    }
    None
}

/// Step 6: the REST config from `--master`, `--kubeconfig` (or `KUBECONFIG`) or the in-cluster
/// environment, with upstream's Info lines. QPS and burst are the lead's rate limiter's
/// (`--kube-api-qps`, `--kube-api-burst`), not part of `kube::Config`.
async fn kube_config(options: &Options) -> Result<kube::Config, String> {
    let env = std::env::var("KUBECONFIG").ok();
    let (kubeconfig, from_env) = flags::kubeconfig_path(&options.kubeconfig, env.as_deref());
    if from_env {
        tracing::info!(target: LOG, "Found KUBECONFIG environment variable set, using that..");
    }
    let master = &options.master;
    if master.is_empty() && kubeconfig.is_empty() {
        tracing::info!(target: LOG, "Building kube configs for running in cluster...");
        return kube::Config::incluster_env().map_err(|e| report::chain(&e));
    }
    tracing::info!(target: LOG, "Either master or kubeconfig specified. building kube config from that..");
    let mut config = if kubeconfig.is_empty() {
        kube::Config::new(parse_master(master)?)
    } else {
        let file =
            kube::config::Kubeconfig::read_from(&kubeconfig).map_err(|e| report::chain(&e))?;
        kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| report::chain(&e))?
    };
    if !master.is_empty() {
        config.cluster_url = parse_master(master)?;
    }
    // A plain-HTTP API server needs no CA; without one, the TLS set-up would look for the
    // system's roots, which a scratch image does not have, and fail although TLS is never used.
    if config.cluster_url.scheme_str() == Some("http") && config.root_cert.is_none() {
        config.root_cert = Some(Vec::new());
    }
    Ok(config)
}

fn parse_master(master: &str) -> Result<http::Uri, String> {
    master
        .parse()
        .map_err(|e| format!("invalid --master {master:?}: {e}"))
}

/// Steps 6-18, then the controller; returns the exit code.
async fn run(options: Options, gates: FeatureGates) -> i32 {
    // Handlers first: a SIGTERM during start-up must not kill the process half-way.
    let mut signals = match plugreg_runtime::signal::Signals::new() {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(target: LOG, "installing signal handlers: {e}");
            return 1;
        }
    };
    // Step 6.
    let kube_config = match kube_config(&options).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, "Failed to create config: {e}");
            return FATAL_EXIT;
        }
    };
    // Steps 7-9 (the rate-limited clients, the VolumeAttributesClass discovery check) are the
    // controller's: `kube_config` and `gates` are handed over below.

    // Step 10.
    let connected = match csi::connect_watched(&options.csi_address, csi::CONNECT_WINDOW).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, "{e}");
            return 1;
        }
    };
    let lost = connected.lost.clone();
    let channel = connected.channel;
    let startup = async {
        // Step 11.
        let mut metrics = Metrics::new(UNKNOWN_DRIVER);
        if let Err(e) = csi::probe_forever(&channel, options.timeout, &metrics).await {
            tracing::error!(target: LOG, "{e}");
            return Err(1);
        }
        // Step 12.
        let metrics_arc = Arc::new(metrics);
        let name = Driver::new(channel.clone(), options.timeout, metrics_arc.clone())
            .plugin_info()
            .await;
        metrics = Arc::into_inner(metrics_arc).expect("the temporary driver is gone");
        let name = match name {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(target: LOG, "Error getting CSI driver name: {e}");
                return Err(FATAL_EXIT);
            }
        };
        tracing::debug!(target: LOG, "Detected CSI driver {name}");
        metrics.set_driver(&name);
        // Step 13: CSI migration is not supported; say so for the drivers it concerns.
        if let Some((_, in_tree)) = MIGRATION_TARGETS.iter().find(|(d, _)| *d == name) {
            tracing::warn!(
            target: LOG,
                "CSI driver {name} is the migration target of the in-tree plugin {in_tree}; migrated claims are not provisioned by this csi-provisioner"
            );
        }
        // Step 14.
        let metrics = Arc::new(metrics);
        let driver = Driver::new(channel.clone(), options.timeout, metrics.clone());
        let capabilities = match driver.capabilities().await {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(target: LOG, "Error getting CSI driver capabilities: {e}");
                return Err(FATAL_EXIT);
            }
        };
        // Step 15.
        let identity = flags::provisioner_identity(unix_millis(), random(), &name, None);
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
        // Step 17 (--enable-capacity) was refused at start.
        // Step 18.
        let health = LeaderHealth::new();
        let http = match start_http(&options, metrics.clone(), &health).await {
            Ok(h) => h,
            Err(code) => return Err(code),
        };
        Ok(Started {
            name,
            identity,
            driver,
            capabilities,
            metrics,
            health,
            http,
        })
    };
    let started = tokio::select! {
        started = startup => started,
        code = csi::exit_on_connection_loss(lost.clone()) => Err(code),
        signal = signals.shutdown() => {
            tracing::info!(target: LOG, signal = signal.name(), "Shutting down");
            Err(0)
        }
    };
    let started = match started {
        Ok(s) => s,
        Err(code) => return code,
    };

    // Steps 19-20: the controller, directly or under the Lease.
    let host = hostname();
    let leader = options.leader_election.then(|| {
        let mut le = LeaderElection::new(
            &leader_namespace(&options.leader_election_namespace),
            &flags::lease_name(&started.name),
            &flags::leader_identity(&host),
        );
        le.lease_duration = options.leader_election_lease_duration;
        le.renew_deadline = options.leader_election_renew_deadline;
        le.retry_period = options.leader_election_retry_period;
        le.labels = options.leader_election_labels.clone();
        le.release_on_cancel = gates.release_leader_election_on_exit;
        le.metrics = Some(started.metrics.clone());
        le
    });
    let service = Service {
        kube_config,
        qps: options.kube_api_qps,
        burst: u32::try_from(options.kube_api_burst.max(0)).unwrap_or(u32::MAX),
        driver: Arc::new(started.driver),
        driver_name: started.name.clone(),
        identity: started.identity.clone(),
        host,
        capabilities: started.capabilities,
        request: RequestOptions {
            volume_name_prefix: options.volume_name_prefix.clone(),
            volume_name_uuid_length: options.volume_name_uuid_length,
            extra_create_metadata: options.extra_create_metadata,
            default_fstype: options.default_fstype.clone(),
            controller_publish_readonly: options.controller_publish_readonly,
            strict_topology: options.strict_topology,
            immediate_topology: options.immediate_topology,
            topology: gates.topology && started.capabilities.accessibility_constraints,
            single_node_multi_writer: started.capabilities.single_node_multi_writer,
        },
        workers: usize::try_from(options.worker_threads).unwrap_or(usize::MAX),
        retry_start: options.retry_interval_start,
        retry_max: options.retry_interval_max,
        timeout: options.timeout,
        record_namespace: leader_namespace(&options.leader_election_namespace),
        leader,
        health: started.health.clone(),
        metrics: started.metrics.clone(),
    };
    let shutdown = CancellationToken::new();
    let run = service.run(shutdown.clone());
    tokio::pin!(run);
    let code = tokio::select! {
        result = &mut run => match result {
            Ok(()) => 0,
            Err(ServiceError::Leader(e)) => {
                tracing::error!(target: LOG, "Stopped leading: {e}");
                1
            }
            Err(e) => {
                tracing::error!(target: LOG, "{e}");
                FATAL_EXIT
            }
        },
        signal = signals.shutdown() => {
            tracing::info!(target: LOG, signal = signal.name(), "Shutting down");
            // Workers finish their current call; the lease is released when the gate asks.
            shutdown.cancel();
            let _ = tokio::time::timeout(SHUTDOWN_GRACE, &mut run).await;
            0
        }
        code = csi::exit_on_connection_loss(lost) => code,
    };
    // ---- end of the lead's hook.
    if let Some(token) = started.http {
        token.cancel();
    }
    code
}

/// What start-up found out, for the controller.
struct Started {
    /// The driver (= provisioner) name.
    name: String,
    /// The provisioner identity (§2 step 15).
    identity: String,
    /// The driver's calls.
    driver: Driver,
    /// What the driver can do.
    capabilities: Capabilities,
    /// The metrics registry, named after the driver.
    metrics: Arc<Metrics>,
    /// Behind `/healthz/leader-election`.
    health: LeaderHealth,
    /// Stops the HTTP server, if one runs.
    http: Option<CancellationToken>,
}

/// Step 18: the HTTP server, if an address is set (regardless of leadership). A listen failure
/// is upstream's Fatal (exit 255). Serves the metrics path and, with `--leader-election` and
/// `--http-endpoint`, `/healthz/leader-election` from the election's health.
async fn start_http(
    options: &Options,
    metrics: Arc<Metrics>,
    health: &LeaderHealth,
) -> Result<Option<CancellationToken>, i32> {
    let address = if options.http_endpoint.is_empty() {
        &options.metrics_address
    } else {
        &options.http_endpoint
    };
    if address.is_empty() {
        return Ok(None);
    }
    let server = match diagnostics::Server::bind(address, &options.metrics_path).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(target: LOG, "{e}");
            return Err(FATAL_EXIT);
        }
    };
    let leader =
        (options.leader_election && !options.http_endpoint.is_empty()).then(|| health.clone());
    let token = CancellationToken::new();
    let stop = token.clone();
    tokio::spawn(async move {
        if let Err(e) = server.serve(metrics, leader, stop).await {
            tracing::error!(target: LOG, "{e}");
        }
    });
    Ok(Some(token))
}

/// The Lease's namespace: the flag, else `$POD_NAMESPACE`, else the service account's
/// namespace file, else `default` (csi-lib-utils' order).
fn leader_namespace(flag: &str) -> String {
    if !flag.is_empty() {
        return flag.to_owned();
    }
    if let Ok(ns) = std::env::var("POD_NAMESPACE")
        && !ns.is_empty()
    {
        return ns;
    }
    read_small("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        .filter(|ns| !ns.is_empty())
        .unwrap_or_else(|| "default".to_owned())
}

/// This host's name (the kernel's, as Go's `os.Hostname`).
fn hostname() -> String {
    read_small("/proc/sys/kernel/hostname").unwrap_or_else(|| "localhost".to_owned())
}

/// The first line of a small file (at most 4 KiB read), trimmed.
fn read_small(path: &str) -> Option<String> {
    use std::io::Read as _;
    let mut buf = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(4096)
        .read_to_end(&mut buf)
        .ok()?;
    let text = String::from_utf8_lossy(&buf);
    Some(text.lines().next().unwrap_or_default().trim().to_owned())
}

fn unix_millis() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// A number in 0..10000 that differs between processes (upstream: `rand.Intn(10000)`).
fn random() -> u32 {
    (plugreg_runtime::backoff::random_u64() % 10_000) as u32
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_features_are_named() {
        let gates = FeatureGates::default();
        assert!(unsupported(&Options::default(), &gates).is_none());
        let o = Options {
            enable_capacity: true,
            ..Options::default()
        };
        assert!(
            unsupported(&o, &gates)
                .unwrap()
                .contains("--enable-capacity")
        );
        let o = Options {
            node_deployment: true,
            ..Options::default()
        };
        assert!(
            unsupported(&o, &gates)
                .unwrap()
                .contains("--node-deployment")
        );
        let g = FeatureGates {
            cross_namespace_volume_data_source: true,
            ..FeatureGates::default()
        };
        assert!(
            unsupported(&Options::default(), &g)
                .unwrap()
                .contains("CrossNamespaceVolumeDataSource")
        );
    }
}
