//! The process: the controllers' start-up checks, the one driver connection and identification,
//! the HTTP server, and each controller's run under its own Lease, restarted in the process
//! when the Lease is lost.

use std::sync::Arc;
use std::time::Duration;

use plugreg_sidecar_kit::diagnostics;
use plugreg_sidecar_kit::driver::{CapabilityReads, Identify, IdentifyError, identify};
use plugreg_sidecar_kit::flags::ControllerFlags;
use plugreg_sidecar_kit::leader::{LeaderError, LeaderHealth};
use plugreg_sidecar_kit::lifecycle::{self, LeaderLostLine, Lifecycle, OnSignal, Stop};
use plugreg_sidecar_kit::ratelimit::{self, kube_config};
use plugreg_sidecar_kit::service::{Kube, ServiceError};
use plugreg_sidecar_kit::shared::Hub;
use plugreg_sidecar_kit::vac;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::LOG;
use crate::flags::{Controller, Parsed};

use plugreg_attacher as attacher;
use plugreg_health_monitor as health_monitor;
use plugreg_provisioner as provisioner;
use plugreg_resizer as resizer;
use plugreg_snapshotter as snapshotter;

/// How long a signalled process lets its controllers finish their current calls.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// One controller's command line, its feature gates checked.
enum Part {
    Provisioner(
        Box<provisioner::flags::Options>,
        provisioner::flags::FeatureGates,
    ),
    Attacher(Box<attacher::flags::Options>, attacher::flags::FeatureGates),
    Resizer(Box<resizer::flags::Options>, resizer::flags::FeatureGates),
    Snapshotter(
        Box<snapshotter::flags::Options>,
        snapshotter::flags::FeatureGates,
    ),
    HealthMonitor(Box<health_monitor::flags::Options>),
}

impl Part {
    fn controller(&self) -> Controller {
        match self {
            Part::Provisioner(..) => Controller::Provisioner,
            Part::Attacher(..) => Controller::Attacher,
            Part::Resizer(..) => Controller::Resizer,
            Part::Snapshotter(..) => Controller::Snapshotter,
            Part::HealthMonitor(..) => Controller::HealthMonitor,
        }
    }

    /// The process's flags, as this controller got them.
    fn process(&self) -> (&ControllerFlags, &str) {
        match self {
            Part::Provisioner(o, _) => (&o.controller, &o.csi_address),
            Part::Attacher(o, _) => (&o.controller, &o.csi_address),
            Part::Resizer(o, _) => (&o.controller, &o.csi_address),
            Part::Snapshotter(o, _) => (&o.controller, &o.csi_address),
            Part::HealthMonitor(o) => (&o.controller, &o.csi_address),
        }
    }

    fn timeout(&self) -> Duration {
        match self {
            Part::Provisioner(o, _) => o.timeout,
            Part::Attacher(o, _) => o.timeout,
            Part::Resizer(o, _) => o.timeout,
            Part::Snapshotter(o, _) => o.timeout,
            Part::HealthMonitor(o) => o.timeout,
        }
    }
}

/// The synchronous checks of each controller (its feature gates, its flags' combinations),
/// then the rest on a runtime; returns the exit code.
pub fn start(parsed: Parsed) -> i32 {
    let parts = match checked(parsed) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(target: LOG, "{e}");
            return 1;
        }
    };
    if let Err(e) = parts[0].process().0.http_address() {
        tracing::error!(target: LOG, "{e}");
        return 1;
    }
    if let Err(e) = parts[0].process().0.validate() {
        tracing::error!(target: LOG, "{e}");
        return 1;
    }
    // The provisioner's throughput was measured on a multi-thread runtime; the others do not
    // mind one.
    match lifecycle::block_on_multi_thread(run(parts)) {
        Ok(code) => code,
        Err(e) => {
            tracing::error!(target: LOG, err = %e, "Failed to start");
            1
        }
    }
}

/// Each selected controller's options and gates, or the first refusal, named after its
/// controller.
fn checked(parsed: Parsed) -> Result<Vec<Part>, String> {
    let mut parts = Vec::new();
    let node_name = || std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty());
    if let Some(f) = parsed.provisioner {
        let gates = provisioner::flags::FeatureGates::from_requested(&f.options.feature_gates)
            .map_err(|e| format!("provisioner: {e}"))?;
        if let Some(refusal) = provisioner::start::unsupported(&gates) {
            return Err(format!("provisioner: {refusal}"));
        }
        if f.options.node_deployment && node_name().is_none() {
            return Err(format!("provisioner: {}", provisioner::flags::NO_NODE_NAME));
        }
        provisioner::flags::validate(&f.options).map_err(|e| format!("provisioner: {e}"))?;
        parts.push(Part::Provisioner(Box::new(f.options), gates));
    }
    if let Some(f) = parsed.attacher {
        let gates = attacher::flags::FeatureGates::from_requested(&f.options.feature_gates)
            .map_err(|e| format!("attacher: {e}"))?;
        attacher::flags::validate(&f.options).map_err(|e| format!("attacher: {e}"))?;
        parts.push(Part::Attacher(Box::new(f.options), gates));
    }
    if let Some(f) = parsed.resizer {
        let gates = resizer::flags::FeatureGates::from_requested(&f.options.feature_gates)
            .map_err(|e| format!("resizer: {e}"))?;
        parts.push(Part::Resizer(Box::new(f.options), gates));
    }
    if let Some(f) = parsed.snapshotter {
        let gates = snapshotter::flags::FeatureGates::from_requested(&f.options.feature_gates)
            .map_err(|e| format!("snapshotter: {e}"))?;
        if f.options.node_deployment && node_name().is_none() {
            return Err(format!("snapshotter: {}", snapshotter::flags::NO_NODE_NAME));
        }
        snapshotter::flags::validate(&f.options).map_err(|e| format!("snapshotter: {e}"))?;
        parts.push(Part::Snapshotter(Box::new(f.options), gates));
    }
    if let Some(f) = parsed.health_monitor {
        if f.options.worker_threads == 0 {
            return Err(format!(
                "health-monitor: {}",
                health_monitor::flags::NO_WORKERS
            ));
        }
        health_monitor::flags::validate(&f.options).map_err(|e| format!("health-monitor: {e}"))?;
        parts.push(Part::HealthMonitor(Box::new(f.options)));
    }
    if parts.is_empty() {
        return Err("no controller to run".into());
    }
    Ok(parts)
}

/// One controller ready to run: a run of it from its settings, cloned for each campaign.
enum Ready {
    Provisioner(Box<provisioner::service::Service>),
    Attacher(Box<attacher::service::Service>),
    Resizer(Box<resizer::service::Service>),
    Snapshotter(Box<snapshotter::service::Service>),
    HealthMonitor(Box<health_monitor::service::Service>),
}

/// Why a controller does not run.
enum NotRun {
    /// The driver cannot serve it (a separate sidecar would exit and restart for ever): it is
    /// left out, the others run.
    Driver(String),
    /// A start-up error: the process ends (exit 1).
    Fatal(String),
}

/// How a controller failed for good (not a lost Lease).
#[derive(Debug, thiserror::Error)]
#[error("{controller}: {message}")]
pub struct Failed {
    controller: &'static str,
    message: String,
}

/// The asynchronous start-up and the run; returns the exit code.
async fn run(parts: Vec<Part>) -> i32 {
    let mut life = match Lifecycle::install() {
        Ok(l) => l,
        Err(code) => return code,
    };
    let (flags, csi_address) = {
        let (f, a) = parts[0].process();
        (f.clone(), a.to_owned())
    };
    let kube_config = match kube_config(&flags).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, err = %e, "Failed to build a Kubernetes config");
            return 1;
        }
    };
    let vac = vac_discovered(&parts, &kube_config).await;
    let channel = match life.connect(&csi_address).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(target: LOG, csiAddress = %csi_address, err = %e, "Failed to connect to the CSI driver");
            return 1;
        }
    };
    let startup = async {
        // One identification for all: the provisioner's and snapshotter's reads of both
        // capability sets when they run, else the attacher's and resizer's (controller
        // capabilities only from a plugin with CONTROLLER_SERVICE).
        let both = parts
            .iter()
            .any(|p| matches!(p, Part::Provisioner(..) | Part::Snapshotter(..)));
        let how = Identify {
            timeout: parts.iter().map(Part::timeout).max().unwrap_or_default(),
            startup_deadline: None,
            probe_first: true,
            migration: true,
            capabilities: if both {
                CapabilityReads::PluginAndController
            } else {
                CapabilityReads::PluginThenControllerService
            },
            // The controllers' calls carry secrets; none of them is logged whole.
            grpc_log: None,
        };
        let named = |name: &str| tracing::info!(target: LOG, driver = %name, "CSI driver name");
        let found = match identify(&channel, &how, named, async |_, _| Ok::<_, i32>(())).await {
            Ok(f) => f,
            Err(IdentifyError::Ready(code)) => return Err(code),
            Err(e) => {
                tracing::error!(target: LOG, err = %e, "Failed to identify the CSI driver");
                return Err(1);
            }
        };
        let metrics = found.client.metrics().clone();
        let le_client = if flags.leader_election {
            // One client for every controller's Lease, with a bucket of its own: renewing a
            // Lease never waits behind any controller's work.
            let (qps, burst) = flags.rate_limit();
            match ratelimit::own_client(kube_config.clone(), qps.max(5.0), burst.max(10)) {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::error!(target: LOG, err = %e, "Failed to build the leader election client");
                    return Err(1);
                }
            }
        } else {
            None
        };
        // One watch per kind for every controller, on a client of its own whose bucket is the
        // sum of the controllers' (each sidecar's informers would take from its own).
        let (qps, burst) = parts.iter().fold((0.0, 0), |(q, b), p| {
            let (pq, pb) = p.process().0.rate_limit();
            (q + pq, b + pb)
        });
        // One connection for every controller's requests and the shared watches (HTTP/2);
        // the Leases keep the leader election client's own.
        let transport = match ratelimit::Transport::new(kube_config.clone()) {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(target: LOG, err = %e, "Failed to build the Kubernetes transport");
                return Err(1);
            }
        };
        let hub = match ratelimit::own_client_on(&transport, qps, burst) {
            Ok(c) => Hub::new(c),
            Err(e) => {
                tracing::error!(target: LOG, err = %e, "Failed to build the watch client");
                return Err(1);
            }
        };
        metrics.register("shared-watches", hub.clone());
        let mut ready = Vec::new();
        let mut healths = Vec::new();
        for part in &parts {
            let health = LeaderHealth::new();
            let kube = |controller_flags: &ControllerFlags, lock_name: String| {
                let mut k = Kube::from_flags(
                    controller_flags,
                    kube_config.clone(),
                    &lock_name,
                    // A controller that stopped on a signal gives its Lease up at once (as
                    // ReleaseLeaderElectionOnExit=true does), whatever the gate: its work has
                    // ended, and the next replica of a rolling update need not wait for the
                    // Lease to expire while this process drains its other controllers.
                    true,
                    health.clone(),
                    metrics.clone(),
                );
                k.controller = Some(part.controller().name());
                k.leader_client = le_client.clone();
                k.hub = Some(hub.clone());
                k.transport = Some(transport.clone());
                if let Some(le) = &mut k.leader {
                    // client-go's Name: the `name` label of leader_election_master_status,
                    // which tells the controllers' series apart.
                    le.name = le.lease_name.clone();
                }
                k
            };
            let client = found.client.with_timeout(part.timeout());
            let made = match part {
                Part::Provisioner(o, g) => {
                    provisioner_ready(o, g, vac, client, &found, &transport, kube)
                        .await
                        .map_err(NotRun::Fatal)
                }
                Part::Attacher(o, g) => {
                    let caps = attacher::decide::DriverCaps::from(&found.capabilities);
                    let k = kube(&o.controller, attacher::decide::lock_name(&found.name));
                    Ok(Ready::Attacher(Box::new(attacher::service::Service {
                        kube: k,
                        driver: attacher::csi::Driver::new(client),
                        config: attacher::service::config(o, g, &found.name, caps),
                    })))
                }
                Part::Resizer(o, g) => {
                    let driver = resizer::csi::Driver::new(client);
                    match driver.find_in(&found.capabilities).await {
                        Err(e) => Err(NotRun::Fatal(e.to_string())),
                        Ok(f) if f.resizer.is_none() && !f.modify => Err(NotRun::Driver(
                            "CSI driver does not support resize nor modify".to_owned(),
                        )),
                        Ok(f) => {
                            let mut gates = g.clone();
                            gates.volume_attributes_class = vac::gate(
                                g.volume_attributes_class,
                                g.volume_attributes_class_explicit,
                                vac,
                            );
                            let k = kube(&o.controller, resizer::flags::lock_name(&found.name));
                            Ok(Ready::Resizer(Box::new(resizer::service::Service {
                                kube: k,
                                config: resizer::service::config(o, &gates, &found.name, f),
                                driver,
                            })))
                        }
                    }
                }
                Part::Snapshotter(o, g) => {
                    let caps = snapshotter::csi::DriverCaps::from(&found.capabilities);
                    match snapshotter::service::refusal(o, &found.name, caps) {
                        Some(refusal) if !caps.create_delete_snapshot => {
                            Err(NotRun::Driver(refusal))
                        }
                        Some(refusal) => Err(NotRun::Fatal(refusal)),
                        None => {
                            let driver = snapshotter::csi::Driver::new(client);
                            match snapshotter::service::group_check(o, g, &driver, &found.name)
                                .await
                            {
                                Some(refusal) => Err(NotRun::Fatal(refusal)),
                                None => {
                                    let node = o
                                        .node_deployment
                                        .then(|| std::env::var("NODE_NAME").unwrap_or_default());
                                    let k = kube(
                                        &o.controller,
                                        snapshotter::decide::lock_name(&found.name),
                                    );
                                    Ok(Ready::Snapshotter(Box::new(
                                        snapshotter::service::Service {
                                            kube: k,
                                            driver,
                                            config: snapshotter::service::config(
                                                o,
                                                g,
                                                &found.name,
                                                caps,
                                                node,
                                            ),
                                        },
                                    )))
                                }
                            }
                        }
                    }
                }
                Part::HealthMonitor(o) => match health_monitor::csi::mode(&found.capabilities) {
                    Err(refusal) => Err(NotRun::Driver(refusal.to_owned())),
                    Ok(mode) => {
                        let k = kube(
                            &o.controller,
                            health_monitor::decide::lock_name(&found.name),
                        );
                        Ok(Ready::HealthMonitor(Box::new(
                            health_monitor::service::Service {
                                kube: k,
                                driver: health_monitor::csi::Driver::new(client),
                                config: health_monitor::service::config(o, &found.name, mode),
                            },
                        )))
                    }
                },
            };
            match made {
                Ok(r) => ready.push(r),
                Err(NotRun::Driver(e)) => {
                    // As a separate sidecar would crash-loop beside the others: the others run.
                    tracing::error!(target: LOG, controller = part.controller().name(), "{e}; this controller does not run, the others do");
                    continue;
                }
                Err(NotRun::Fatal(e)) => {
                    tracing::error!(target: LOG, controller = part.controller().name(), "{e}");
                    return Err(1);
                }
            }
            healths.push(health);
        }
        if ready.is_empty() {
            tracing::error!(target: LOG, "No controller can run with this CSI driver");
            return Err(1);
        }
        let health = LeaderHealth::joined(healths);
        let http = match diagnostics::spawn(&flags, metrics.clone(), &health).await {
            Ok(h) => h,
            Err(e) => {
                tracing::error!(target: LOG, err = %e, "Failed to start HTTP server at specified address and metrics path");
                return Err(1);
            }
        };
        Ok((ready, http))
    };
    let (ready, http) = match life.start(startup).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let stop = Stop {
        on_signal: OnSignal::Drain {
            grace: SHUTDOWN_GRACE,
        },
        leader_lost: LeaderLostLine::InMessage,
        failed: 1,
    };
    let shutdown = CancellationToken::new();
    life.run(all(ready, shutdown.clone()), shutdown, stop, http)
        .await
}

/// The VolumeAttributesClass discovery check, once for the provisioner and the resizer: `None`
/// when neither needs it or discovery failed (the gates stay as they are).
async fn vac_discovered(parts: &[Part], config: &kube::Config) -> Option<bool> {
    let needed = parts.iter().any(|p| match p {
        Part::Provisioner(_, g) => g.volume_attributes_class && !g.volume_attributes_class_explicit,
        Part::Resizer(_, g) => g.volume_attributes_class && !g.volume_attributes_class_explicit,
        _ => false,
    });
    if !needed {
        return None;
    }
    let client = plugreg_sidecar_kit::ratelimit::unlimited_client(config.clone()).ok()?;
    let available = vac::api_available(&client).await;
    if available == Some(false) {
        tracing::info!(
            target: LOG,
            "Disabling VolumeAttributesClass feature gate because the VolumeAttributesClass v1 API is not available"
        );
    }
    available
}

/// The provisioner's start-up after identification (its `csi-provisioner` steps 14-17).
async fn provisioner_ready(
    o: &provisioner::flags::Options,
    g: &provisioner::flags::FeatureGates,
    vac: Option<bool>,
    client: plugreg_sidecar_kit::csi::Client,
    found: &plugreg_sidecar_kit::driver::Identified<()>,
    transport: &ratelimit::Transport,
    kube: impl Fn(&ControllerFlags, String) -> Kube,
) -> Result<Ready, String> {
    use provisioner::start;
    let capabilities = provisioner::csi::Capabilities::from(&found.capabilities);
    let driver = provisioner::csi::Driver::new(client);
    let local = match (o.node_deployment, std::env::var("NODE_NAME")) {
        (true, Ok(node)) => Some(start::local_node(&driver, &node).await?),
        _ => None,
    };
    let node = local.as_ref().map(|l| l.node.as_str());
    let identity = start::identity(&found.name, node);
    let capacity = if o.enable_capacity {
        Some(start::capacity(o, transport, &found.name, local.as_ref()).await?)
    } else {
        None
    };
    let volume_attributes_class = vac::gate(
        g.volume_attributes_class,
        g.volume_attributes_class_explicit,
        vac,
    );
    let started = start::Started {
        name: found.name.clone(),
        identity,
        driver: Arc::new(driver),
        capabilities,
        capacity,
        local,
    };
    let k = kube(&o.controller, provisioner::flags::lock_name(&found.name));
    Ok(Ready::Provisioner(Box::new(start::service(
        o,
        g,
        volume_attributes_class,
        k,
        started,
    ))))
}

/// Every controller, each in a task of its own, until `shutdown` (Ok) or until one fails for
/// good (the first failure; the others are stopped).
async fn all(ready: Vec<Ready>, shutdown: CancellationToken) -> Result<(), ServiceError<Failed>> {
    let mut tasks = JoinSet::new();
    for r in ready {
        let token = shutdown.clone();
        match r {
            Ready::Provisioner(s) => tasks.spawn(keep(Controller::Provisioner, token, move |t| {
                s.clone().run(t)
            })),
            Ready::Attacher(s) => {
                tasks.spawn(keep(Controller::Attacher, token, move |t| s.clone().run(t)))
            }
            Ready::Resizer(s) => {
                tasks.spawn(keep(Controller::Resizer, token, move |t| s.clone().run(t)))
            }
            Ready::Snapshotter(s) => tasks.spawn(keep(Controller::Snapshotter, token, move |t| {
                s.clone().run(t)
            })),
            Ready::HealthMonitor(s) => {
                tasks.spawn(keep(Controller::HealthMonitor, token, move |t| {
                    s.clone().run(t)
                }))
            }
        };
    }
    while let Some(done) = tasks.join_next().await {
        let result = done.unwrap_or_else(|e| {
            Err(Failed {
                controller: "csi-sidecars",
                message: format!("a controller's task ended: {e}"),
            })
        });
        if let Err(e) = result {
            return Err(ServiceError::Controller(e));
        }
    }
    Ok(())
}

/// One controller, run again each time it loses its Lease (it stops, drops its state and
/// campaigns again), until `shutdown` or a failure that is not a lost Lease.
async fn keep<E, F, Fut>(
    controller: Controller,
    shutdown: CancellationToken,
    run: F,
) -> Result<(), Failed>
where
    E: std::error::Error + 'static,
    F: Fn(CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), ServiceError<E>>>,
{
    let name = controller.name();
    loop {
        match run(shutdown.clone()).await {
            Ok(()) => return Ok(()),
            Err(ServiceError::Leader(e @ LeaderError::Lost { .. })) => {
                tracing::error!(target: LOG, controller = name, err = %e, "Stopped leading; the controller stopped and campaigns again");
                if shutdown.is_cancelled() {
                    return Ok(());
                }
            }
            Err(e) => {
                return Err(Failed {
                    controller: name,
                    message: e.to_string(),
                });
            }
        }
    }
}
