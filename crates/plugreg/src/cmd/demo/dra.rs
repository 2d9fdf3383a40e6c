//! `plugreg demo`'s DRA step: the example DRA driver registers, and the manager's DRA handler
//! prepares and unprepares a claim through it.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use plugreg_handler_dra::DraHandler;
use plugreg_proto::dra::v1;

/// `plugreg demo`'s DRA step: the example DRA driver registers in `registry`, and `handler`
/// (the manager's DRA handler) prepares and unprepares a claim through it.
pub async fn step(
    registry: &std::path::Path,
    plugin_dir: &std::path::Path,
    handler: &DraHandler,
    token: tokio_util::sync::CancellationToken,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let driver_name = "gpu.demo.plugreg.io";
    let mut config = plugreg_dra::Config::new(driver_name);
    config.registry_dir = registry.to_owned();
    config.plugin_dir = plugin_dir.to_owned();
    std::fs::create_dir_all(plugin_dir)?;
    let driver = std::sync::Arc::new(plugreg_example_dra_driver::ExampleDriver::new(
        driver_name,
        "node-1",
        2,
        None,
    ));
    let plugin = plugreg_dra::start(driver, config, token).await?;
    writeln!(
        out,
        "   DRA driver {driver_name} advertises {:?}",
        plugin.registrar().info().supported_versions
    )?;
    let mut status = plugin.registrar().status();
    tokio::time::timeout(
        Duration::from_secs(10),
        status.wait_for(|s| s.is_registered()),
    )
    .await
    .context("the DRA driver was not registered in time")??;
    let endpoint = plugin.plugin_socket().display().to_string();
    let chosen = handler
        .details(driver_name, &endpoint)
        .map(|d| d.service)
        .unwrap_or_default();
    writeln!(out, "   [registered] {driver_name}: service {chosen}")?;
    let claim = v1::Claim {
        namespace: "default".into(),
        name: "gpu-claim".into(),
        uid: "0f1e2d3c-demo".into(),
    };
    let t0 = std::time::Instant::now();
    let r = handler
        .prepare(driver_name, vec![claim.clone()])
        .await
        .map_err(|s| {
            anyhow::anyhow!(
                "NodePrepareResources: {}",
                plugreg_runtime::report::grpc(&s)
            )
        })?;
    let took = t0.elapsed();
    for d in r
        .claims
        .get(&claim.uid)
        .map(|c| c.devices.as_slice())
        .unwrap_or_default()
    {
        writeln!(
            out,
            "   [prepared] claim default/gpu-claim -> {}/{} CDI {} ({:.1} ms)",
            d.pool_name,
            d.device_name,
            d.cdi_device_ids.join(","),
            took.as_secs_f64() * 1e3
        )?;
    }
    let r = handler
        .unprepare(driver_name, vec![claim.clone()])
        .await
        .map_err(|s| {
            anyhow::anyhow!(
                "NodeUnprepareResources: {}",
                plugreg_runtime::report::grpc(&s)
            )
        })?;
    let error = r
        .claims
        .get(&claim.uid)
        .map(|c| c.error.clone())
        .unwrap_or_default();
    writeln!(
        out,
        "   [unprepared] claim default/gpu-claim{}",
        if error.is_empty() {
            String::new()
        } else {
            format!(": {error}")
        }
    )?;
    Ok(())
}
