//! The demo itself: the whole registration story in a temp dir, in a few seconds, with no root
//! and no cluster.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use plugreg_example_plugin::{ExampleConfig, ExamplePlugin};
use plugreg_handler_example::{EXAMPLE_PLUGIN, ExampleHandler};
use plugreg_manager::{HandlerRegistry, ManagerConfig, ManagerEvent, PluginManager, PluginState};
use plugreg_registrar::Status;
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::output::table;

const SOON: Duration = Duration::from_secs(10);

/// Runs the demo, printing to `out`.
pub async fn run(args: super::DemoArgs, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
    let started = Instant::now();
    let tmp = tempfile::Builder::new().prefix("plugreg-demo-").tempdir()?;
    let base = tmp.path().to_owned();
    let registry = base.join("plugins_registry");
    let node_info = base.join("node-info.json");
    let token = CancellationToken::new();

    writeln!(out, "plugreg demo: kubelet plugin registration, end to end")?;
    writeln!(out, "working in {}\n", base.display())?;

    // 1. The kubelet side.
    let devices = super::device::devices();
    let dra_handler = plugreg_handler_dra::DraHandler::new();
    let handlers = HandlerRegistry::new()
        .with(
            EXAMPLE_PLUGIN,
            Arc::new(ExampleHandler::new(vec![
                "v1beta1".into(),
                "v1beta2".into(),
            ])),
        )
        .with("DevicePlugin", devices.handler())
        .with("DRAPlugin", Arc::new(dra_handler.clone()))
        .with(
            plugreg_handler_csi::PLUGIN_TYPE,
            Arc::new(
                plugreg_handler_csi::CsiHandler::from_config(
                    &plugreg_handler_csi::CsiHandlerConfig::new(
                        plugreg_handler_csi::SinkConfig::File(node_info.clone()),
                    ),
                )
                .await?,
            ),
        );
    let mut config = ManagerConfig::new(&registry);
    config.liveness = None;
    let manager = PluginManager::start(config, handlers, token.clone()).await?;
    let mut events = manager.subscribe();
    writeln!(
        out,
        "1. Started plugreg's plugin manager, watching {}",
        registry.display()
    )?;
    writeln!(
        out,
        "   handlers: ExamplePlugin (accepts versions v1beta1,v1beta2), CSIPlugin (NodeGetInfo, node info to a file), DevicePlugin (options, ListAndWatch: devices and health)\n"
    )?;

    // 2. Three example plugins.
    writeln!(
        out,
        "2. Three example plugins create their registration sockets:"
    )?;
    let plugins = [
        ("widget", EXAMPLE_PLUGIN, &["v1beta1", "v1beta2"][..]),
        ("gadget", "GadgetPlugin", &["v1"][..]),
        ("legacy", EXAMPLE_PLUGIN, &["v1alpha1"][..]),
    ];
    let mut running = Vec::new();
    for (name, plugin_type, versions) in plugins {
        let p = ExamplePlugin::new(ExampleConfig {
            socket: registry.join(format!("{name}.sock")),
            plugin_type: plugin_type.into(),
            name: format!("example.com/{name}"),
            endpoint: None,
            versions: versions.iter().map(|v| v.to_string()).collect(),
        });
        let (pp, t) = (p.clone(), token.clone());
        tokio::spawn(async move {
            if let Err(e) = pp.serve(t).await {
                tracing::error!(error = %e, "example plugin failed");
            }
        });
        running.push((name, plugin_type, versions, p, Instant::now()));
    }
    for (name, plugin_type, versions, p, t0) in &running {
        let status = wait_status(p, |s| s.notifications() > 0).await?;
        let last = status.last.clone().unwrap_or_default();
        let what = format!(
            "example.com/{name} ({plugin_type}, versions {})",
            versions.join(",")
        );
        if last.plugin_registered {
            writeln!(
                out,
                "   [registered] {what}: the plugin was notified registered=true after {:.1} ms",
                t0.elapsed().as_secs_f64() * 1e3
            )?;
        } else {
            writeln!(
                out,
                "   [refused]    {what}: the plugin was notified registered=false:"
            )?;
            writeln!(out, "                \"{}\"", last.error)?;
        }
    }
    writeln!(
        out,
        "   (refused plugins are retried with back-off: 0.5 s, 1 s, 2 s, ... up to 2 min 2 s)\n"
    )?;

    // 3. A CSI driver through csi-node-driver-registrar.
    writeln!(
        out,
        "3. A CSI driver registers through csi-node-driver-registrar:"
    )?;
    let driver_name = "csi.demo.plugreg.io";
    let csi_dir = base.join("plugins").join(driver_name);
    std::fs::create_dir_all(&csi_dir)?;
    let csi_sock = csi_dir.join("csi.sock");
    let driver = plugreg_csi_test_driver::start(
        plugreg_csi_test_driver::DriverConfig {
            name: driver_name.into(),
            node_id: "demo-node-1".into(),
            topology: [(
                "topology.demo.plugreg.io/zone".to_string(),
                "zone-a".to_string(),
            )]
            .into(),
            max_volumes_per_node: 16,
            ..Default::default()
        },
        &csi_sock,
    )
    .await?;
    writeln!(
        out,
        "   CSI test driver {driver_name} serves {} (node id demo-node-1, zone zone-a, 16 volumes)",
        csi_sock.display()
    )?;
    let sidecar = super::sidecar::start(&csi_sock, &registry, token.child_token()).await?;
    let reg_sock = sidecar.socket.clone();
    writeln!(
        out,
        "   csi-node-driver-registrar asked the driver its name and created {}",
        reg_sock.display()
    )?;
    let registered = wait_event(
        &mut events,
        |e| matches!(e, ManagerEvent::Registered { socket, .. } if *socket == reg_sock),
    )
    .await;
    match registered {
        Ok(_) => {
            writeln!(
                out,
                "   [registered] {driver_name}: the manager called NodeGetInfo and wrote {}:",
                node_info.display()
            )?;
            let text = std::fs::read_to_string(&node_info).context("node info file")?;
            for line in text.lines() {
                writeln!(out, "     {line}")?;
            }
        }
        Err(e) => writeln!(out, "   [failed] {driver_name}: {e}")?,
    }
    writeln!(out)?;

    super::device::step(&devices, &registry, &base, &token, out).await?;

    // 4. A socket removed.
    let (name, _, _, widget, _) = &running[0];
    let widget_sock = registry.join(format!("{name}.sock"));
    writeln!(out, "4. Removing {}:", widget_sock.display())?;
    let t0 = Instant::now();
    std::fs::remove_file(&widget_sock)?;
    wait_event(
        &mut events,
        |e| matches!(e, ManagerEvent::Deregistered { socket, .. } if *socket == widget_sock),
    )
    .await?;
    writeln!(
        out,
        "   [deregistered] example.com/widget: the handler forgot it {:.1} ms later (no call to the plugin)\n",
        t0.elapsed().as_secs_f64() * 1e3
    )?;
    let _ = widget;

    // 4b. A DRA driver: registered, then a claim prepared and unprepared through it.
    writeln!(out, "4b. A DRA driver (plugreg-dra) and a claim:")?;
    super::dra::step(
        &registry,
        &base.join("plugins/gpu.demo.plugreg.io"),
        &dra_handler,
        token.clone(),
        out,
    )
    .await?;
    writeln!(out)?;

    // 5. The manager's view.
    writeln!(
        out,
        "5. What the manager reports (the same list `plugreg manager` serves at /plugins):"
    )?;
    settle(&manager).await;
    let mut rows = vec![
        ["SOCKET", "TYPE", "NAME", "STATE", "LAST ERROR"]
            .map(String::from)
            .to_vec(),
    ];
    for r in manager.snapshot() {
        let sock = r
            .socket
            .strip_prefix(&base)
            .unwrap_or(&r.socket)
            .display()
            .to_string();
        let mut err = r.last_error.unwrap_or_default();
        if err.len() > 60 {
            err.truncate(57);
            err.push_str("...");
        }
        rows.push(vec![
            sock,
            r.plugin_type,
            r.name,
            r.state.as_str().into(),
            err,
        ]);
    }
    let mut printed = Vec::new();
    table(&mut printed, &rows)?;
    for line in String::from_utf8_lossy(&printed).lines() {
        writeln!(out, "   {line}")?;
    }

    // The manager's device plugin clients stop first, as `plugreg manager` stops them at
    // shutdown: a plugin that goes away under a running client is an error worth logging.
    devices.stop();
    token.cancel();
    sidecar.stop().await;
    if let Err(e) = driver.stop().await {
        tracing::warn!(error = %e, "CSI test driver stopped with an error");
    }
    manager.stopped().await;
    writeln!(out, "\nDone in {:.2} s.", started.elapsed().as_secs_f64())?;
    if args.keep {
        let kept = tmp.keep();
        writeln!(out, "Kept {}.", kept.display())?;
    }
    Ok(())
}

async fn wait_status(p: &ExamplePlugin, pred: impl Fn(&Status) -> bool) -> anyhow::Result<Status> {
    let mut rx = p.registrar().status();
    let s = tokio::time::timeout(SOON, rx.wait_for(|s| pred(s)))
        .await
        .context("no notification within 10 s")??
        .clone();
    Ok(s)
}

async fn wait_event(
    events: &mut broadcast::Receiver<ManagerEvent>,
    pred: impl Fn(&ManagerEvent) -> bool,
) -> anyhow::Result<ManagerEvent> {
    let deadline = Instant::now() + SOON;
    loop {
        let ev = tokio::time::timeout_at(deadline, events.recv())
            .await
            .context("the manager did not report in time")?;
        match ev {
            Ok(ev) if pred(&ev) => return Ok(ev),
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(e) => bail!("manager events ended: {e}"),
        }
    }
}

/// Waits until no socket is mid-operation, so the table shows settled states.
async fn settle(manager: &PluginManager) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline
        && manager.snapshot().iter().any(|r| {
            matches!(
                r.state,
                PluginState::Registering | PluginState::Deregistering | PluginState::Pending
            )
        })
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
