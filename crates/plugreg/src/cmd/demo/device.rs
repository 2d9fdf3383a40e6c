//! `plugreg demo`'s device-plugin step: the example widgets register through plugins_registry,
//! the manager's DevicePlugin handler lists their devices, and a health flip shows up.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use plugreg_deviceplugin::{DevicePlugin, PluginConfig};
use plugreg_example_device_plugin::Widgets;
use plugreg_handler_device::{EndpointInfo, Health};
use tokio_util::sync::CancellationToken;

use crate::cmd::manager::device::{DeviceArgs, Devices};

const SOON: Duration = Duration::from_secs(10);

/// The device inventory the demo's manager feeds.
pub fn devices() -> Devices {
    Devices::new(&DeviceArgs::default())
}

/// Starts a device plugin of 3 widgets registering in `registry` and prints what the manager's
/// DevicePlugin handler saw, before and after one widget turns unhealthy.
pub async fn step(
    devices: &Devices,
    registry: &Path,
    base: &Path,
    token: &CancellationToken,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    writeln!(
        out,
        "3b. A device plugin (3 widgets of example.com/widget) registers through plugins_registry:"
    )?;
    let dir = base.join("device-plugins");
    std::fs::create_dir_all(&dir)?;
    let widgets = Arc::new(Widgets::new(3, 2, false));
    let config =
        PluginConfig::plugins_registry("example.com/widget", registry, dir.join("widget.sock"));
    let plugin = DevicePlugin::new(config, widgets.clone());
    let t = token.child_token();
    tokio::spawn(async move {
        if let Err(e) = plugin.run(t).await {
            tracing::error!(error = %e, "example device plugin failed");
        }
    });
    let e = wait(devices, |e| e.devices.len() == 3).await?;
    print(out, &e)?;
    widgets.flip(1);
    let e = wait(devices, |e| {
        e.devices
            .get(1)
            .is_some_and(|d| d.health == Health::Unhealthy)
    })
    .await?;
    writeln!(
        out,
        "   widget-1 turned unhealthy; its next ListAndWatch answer says so:"
    )?;
    print(out, &e)?;
    writeln!(
        out,
        "   (`plugreg manager` shows this in /plugins \"details\" and counts it in /metrics)\n"
    )?;
    Ok(())
}

async fn wait(
    devices: &Devices,
    pred: impl Fn(&EndpointInfo) -> bool,
) -> anyhow::Result<EndpointInfo> {
    let inv = devices.inventory();
    let mut changes = inv.changes();
    let deadline = tokio::time::Instant::now() + SOON;
    loop {
        if let Some(e) = inv.snapshot().into_iter().find(|e| pred(e)) {
            return Ok(e);
        }
        tokio::time::timeout_at(deadline, changes.changed())
            .await
            .context("the device plugin's devices did not arrive within 10 s")??;
    }
}

fn print(out: &mut dyn Write, e: &EndpointInfo) -> std::io::Result<()> {
    for d in &e.devices {
        let numa = d
            .topology
            .as_ref()
            .map(|t| {
                t.iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        writeln!(out, "   {:<9} {:<9} NUMA {numa}", d.id, d.health.as_str())?;
    }
    Ok(())
}
