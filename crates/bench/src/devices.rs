//! `plugreg-bench devices`: runs a real `plugreg manager` process and device plugins (the
//! plugin-side library with the example widgets, in this process, registering through
//! plugins_registry) and measures:
//!
//! 1. a device's health change -> the change visible in the manager's `/plugins` (p50, p99);
//! 2. 100 device plugins of 100 devices each started at once -> all 10,000 devices listed in
//!    `/plugins`, and the manager's RSS then (VmRSS, VmHWM) and once it has settled (12 s later,
//!    with the plugins still serving and nobody polling: the daemon gives freed heap pages back
//!    every 10 s).
//!
//! Prints a Markdown section for BENCHMARKS.md.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use plugreg_deviceplugin::{DevicePlugin, PluginConfig};
use plugreg_example_device_plugin::Widgets;
use plugreg_testpeers::{LinesFrom, PeerProcess};

/// How long the bench waits after the last poll before it reads the settled RSS: longer than
/// the daemon's 10 s period of giving freed heap pages back.
const SETTLE: Duration = Duration::from_secs(12);
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::stats::Summary;

/// Flags of `plugreg-bench devices`.
#[derive(Debug, clap::Args)]
pub struct DevicesArgs {
    /// The plugreg binary (default: beside this one).
    #[arg(long)]
    plugreg: Option<PathBuf>,
    /// Health flips to time.
    #[arg(long, default_value_t = 200)]
    flips: usize,
    /// Device plugins in the scale run.
    #[arg(long, default_value_t = 100)]
    plugins: usize,
    /// Devices per plugin in the scale run.
    #[arg(long, default_value_t = 100)]
    devices: usize,
}

/// The daemon's `/plugins`.
fn plugins(addr: SocketAddr) -> anyhow::Result<Vec<Value>> {
    let (code, body) = crate::http::get(addr, "/plugins", Duration::from_secs(30))?;
    anyhow::ensure!(code == 200, "/plugins answered {code}");
    let v: Value = serde_json::from_str(&body)?;
    Ok(v.as_array().cloned().unwrap_or_default())
}

async fn manager(bin: &Path, registry: &Path) -> anyhow::Result<(PeerProcess, SocketAddr)> {
    let mut cmd = Command::new(bin);
    cmd.args(["manager", "--registry-dir"]).arg(registry).args([
        "--http-endpoint",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--plugin-types",
        "DevicePlugin",
    ]);
    let mut m = PeerProcess::spawn_command("plugreg manager", cmd, LinesFrom::Stderr)?;
    let v = m
        .next_matching(
            |v| v["message"] == "Starting HTTP server",
            Duration::from_secs(30),
        )
        .await?;
    let addr = v["endpoint"]
        .as_str()
        .unwrap_or_default()
        .parse()
        .context("the manager's HTTP endpoint")?;
    Ok((m, addr))
}

fn start_plugin(
    dir: &Path,
    registry: &Path,
    i: usize,
    devices: usize,
    token: &CancellationToken,
) -> Arc<Widgets> {
    let widgets = Arc::new(Widgets::new(devices, 2, false));
    let resource = format!("bench.example.com/w{i}");
    let config =
        PluginConfig::plugins_registry(&resource, registry, dir.join(format!("w{i}.sock")));
    let plugin = DevicePlugin::new(config, widgets.clone());
    let t = token.clone();
    tokio::spawn(async move {
        if let Err(e) = plugin.run(t).await {
            eprintln!("device plugin {i} failed: {e}");
        }
    });
    widgets
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// Runs the device-plugin benchmark and prints its Markdown section.
pub fn main(args: DevicesArgs) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: DevicesArgs) -> anyhow::Result<()> {
    let bin = crate::daemon_bin(args.plugreg.as_deref())?;
    if !bin.exists() {
        bail!(
            "{} is missing: cargo build --release -p plugreg",
            bin.display()
        );
    }

    // 1. Health change -> /plugins.
    let tmp = tempfile::tempdir()?;
    let registry = tmp.path().join("plugins_registry");
    let (m, addr) = manager(&bin, &registry).await?;
    let token = CancellationToken::new();
    let widgets = start_plugin(tmp.path(), &registry, 0, 8, &token);
    let listed = |v: &[Value]| -> Option<Vec<String>> {
        let e = v.iter().find(|e| {
            e["details"]["devices"]
                .as_array()
                .is_some_and(|d| d.len() == 8)
        })?;
        Some(
            e["details"]["devices"]
                .as_array()?
                .iter()
                .map(|d| d["health"].as_str().unwrap_or_default().to_owned())
                .collect(),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while listed(&plugins(addr)?).is_none() {
        if Instant::now() > deadline {
            bail!("the device plugin never showed up in /plugins");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut samples = Vec::with_capacity(args.flips);
    for n in 0..args.flips {
        let (_, health) = widgets.flip(n % 8).context("flip")?;
        let t0 = Instant::now();
        let idx = n % 8;
        // Polls /plugins back to back until the device shows the new health.
        let seen = tokio::task::spawn_blocking(move || -> anyhow::Result<Duration> {
            loop {
                let v = plugins(addr)?;
                if let Some(h) = listed(&v)
                    && h[idx] == health
                {
                    return Ok(t0.elapsed());
                }
                if t0.elapsed() > Duration::from_secs(10) {
                    bail!("health change not visible within 10 s");
                }
            }
        })
        .await??;
        samples.push(seen);
    }
    let flips = Summary::of(&samples).context("no health flips measured")?;
    token.cancel();
    drop(m);

    // 2. 100 plugins x 100 devices at once.
    let tmp2 = tempfile::tempdir()?;
    let registry = tmp2.path().join("plugins_registry");
    let (m, addr) = manager(&bin, &registry).await?;
    let idle = crate::procfs::memory(&m.pid().to_string())?;
    let token = CancellationToken::new();
    let t0 = Instant::now();
    let _w: Vec<_> = (0..args.plugins)
        .map(|i| start_plugin(tmp2.path(), &registry, i, args.devices, &token))
        .collect();
    let want = args.plugins * args.devices;
    let all_listed = tokio::task::spawn_blocking(move || -> anyhow::Result<Duration> {
        loop {
            let v = plugins(addr)?;
            let n: usize = v
                .iter()
                .filter_map(|e| e["details"]["devices"].as_array())
                .map(|d| d.iter().filter(|d| d["health"] == "Healthy").count())
                .sum();
            if n == want {
                return Ok(t0.elapsed());
            }
            if t0.elapsed() > Duration::from_secs(120) {
                bail!("only {n} of {want} devices listed after 120 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    })
    .await??;
    let listed_all = crate::procfs::memory(&m.pid().to_string())?;
    // What the daemon keeps once the page renders and the first answers are done with: the
    // figure at the moment of the last poll is mostly transient (the pages being rendered).
    tokio::time::sleep(SETTLE).await;
    let settled = crate::procfs::memory(&m.pid().to_string())?;
    token.cancel();
    drop(m);

    println!("## Device plugins (issue 10)\n");
    println!(
        "A real `plugreg manager` process (`--plugin-types DevicePlugin`); device plugins are the plugin-side library with the example widgets, in the bench process, registering through plugins_registry; `/plugins` polled back to back over HTTP.\n"
    );
    println!("| measure | value |\n|---|---|");
    println!(
        "| health change -> visible in `/plugins` ({} flips, plugin of 8 devices): p50 / p99 / max | {} / {} / {} |",
        flips.count,
        ms(flips.p50),
        ms(flips.p99),
        ms(flips.max)
    );
    println!(
        "| {} plugins x {} devices started at once -> all {} devices listed healthy in `/plugins` | {:.2} s |",
        args.plugins,
        args.devices,
        want,
        all_listed.as_secs_f64()
    );
    println!(
        "| manager RSS: idle / with {} devices (VmRSS when all are listed; {} s later) / peak (VmHWM) | {:.1} / {:.1}; {:.1} / {:.1} MiB |",
        want,
        SETTLE.as_secs(),
        idle.rss_kib as f64 / 1024.0,
        listed_all.rss_kib as f64 / 1024.0,
        settled.rss_kib as f64 / 1024.0,
        settled.hwm_kib.max(listed_all.hwm_kib) as f64 / 1024.0
    );
    Ok(())
}
