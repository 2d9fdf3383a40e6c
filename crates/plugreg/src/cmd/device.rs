//! `plugreg device ...`: call a device plugin on its socket exactly as the kubelet would, so a
//! plugin author can exercise a plugin without a cluster (D11).
//!
//! Each command dials the socket and reads GetDevicePluginOptions first, as the kubelet does on
//! every connection; `preferred` and `prestart` are refused (unless `--force`) when the plugin
//! does not advertise them, since the kubelet would not call them. Allocate, preferred and
//! prestart send one container request, as the kubelet does. Table or `-o json`.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use plugreg_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use plugreg_proto::deviceplugin::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, Device, DevicePluginOptions, Empty,
    PreStartContainerRequest, PreferredAllocationRequest,
};
use serde_json::{Value, json};
use tonic::transport::Channel;

use crate::output::{Output, table};

/// The `plugreg device` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DeviceCommand {
    /// Show the plugin's options (GetDevicePluginOptions).
    Options(Target),
    /// Show the plugin's devices: the first ListAndWatch answer (`--watch`: every answer).
    Devices {
        #[command(flatten)]
        target: Target,
        /// Keep streaming: print every answer until the stream ends or SIGINT.
        #[arg(long)]
        watch: bool,
    },
    /// Allocate devices for one container (Allocate).
    Allocate {
        #[command(flatten)]
        target: Target,
        /// Device ids, comma-separated.
        #[arg(long = "devices", value_delimiter = ',', required = true)]
        devices: Vec<String>,
    },
    /// Ask the plugin's preferred pick (GetPreferredAllocation).
    Preferred {
        #[command(flatten)]
        target: Target,
        /// Candidate device ids, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        available: Vec<String>,
        /// Ids that must be in the pick, comma-separated.
        #[arg(long, value_delimiter = ',')]
        must_include: Vec<String>,
        /// How many devices to pick.
        #[arg(long)]
        size: i32,
        /// Call it even when the plugin does not advertise it.
        #[arg(long)]
        force: bool,
    },
    /// Tell the plugin a container with these devices is about to start (PreStartContainer).
    Prestart {
        #[command(flatten)]
        target: Target,
        /// Device ids, comma-separated.
        #[arg(long = "devices", value_delimiter = ',', required = true)]
        devices: Vec<String>,
        /// Call it even when the plugin does not ask for it.
        #[arg(long)]
        force: bool,
    },
}

/// Which plugin, how long to wait, how to print.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The plugin's socket: a path or unix://PATH.
    #[arg(long, value_name = "SOCKET")]
    pub endpoint: String,
    /// Limit for connecting and for each call (the kubelet's PreStartContainer limit is 30s;
    /// ListAndWatch with `--watch` has none).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value = "table")]
    pub output: Output,
}

/// A connected plugin and its options.
struct Plugin {
    client: DevicePluginClient<Channel>,
    options: DevicePluginOptions,
    target: Target,
}

impl Plugin {
    async fn connect(target: &Target) -> anyhow::Result<Self> {
        let channel = plugreg_transport::connect(&target.endpoint, target.timeout)
            .await
            .with_context(|| format!("cannot connect to device plugin {}", target.endpoint))?;
        let mut client = plugreg_transport::client!(DevicePluginClient, channel);
        let options = call(
            target,
            "GetDevicePluginOptions",
            client.get_device_plugin_options(Empty {}),
        )
        .await?;
        Ok(Self {
            client,
            options,
            target: target.clone(),
        })
    }
}

/// Runs one call within the target's timeout; the error names the call and the gRPC status.
async fn call<T>(
    target: &Target,
    method: &str,
    fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(target.timeout, fut).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => bail!(
            "{method} on {} failed: {}",
            target.endpoint,
            plugreg_runtime::report::grpc(&s)
        ),
        Err(_) => bail!(
            "{} did not answer {method} within {}",
            target.endpoint,
            humantime::format_duration(target.timeout)
        ),
    }
}

/// Runs a `plugreg device` command.
pub async fn run(command: DeviceCommand, out: &mut dyn Write) -> anyhow::Result<()> {
    match command {
        DeviceCommand::Options(target) => {
            let p = Plugin::connect(&target).await?;
            let o = p.options;
            match target.output {
                Output::Json => writeln!(out, "{}", options_json(&o))?,
                Output::Table => table(
                    out,
                    &[
                        vec![
                            "PRE_START_REQUIRED".into(),
                            o.pre_start_required.to_string(),
                        ],
                        vec![
                            "GET_PREFERRED_ALLOCATION_AVAILABLE".into(),
                            o.get_preferred_allocation_available.to_string(),
                        ],
                    ],
                )?,
            }
        }
        DeviceCommand::Devices { target, watch } => {
            let mut p = Plugin::connect(&target).await?;
            let mut stream =
                call(&target, "ListAndWatch", p.client.list_and_watch(Empty {})).await?;
            let mut first = true;
            loop {
                let next = if first && !watch {
                    match tokio::time::timeout(target.timeout, stream.message()).await {
                        Ok(r) => r,
                        Err(_) => bail!(
                            "{} sent no device list within {}",
                            target.endpoint,
                            humantime::format_duration(target.timeout)
                        ),
                    }
                } else {
                    stream.message().await
                };
                let answer = match next {
                    Ok(Some(a)) => a,
                    Ok(None) if first => bail!(
                        "{} ended ListAndWatch without a device list",
                        target.endpoint
                    ),
                    Ok(None) => return Ok(()),
                    Err(s) => bail!(
                        "ListAndWatch on {} failed: {}",
                        target.endpoint,
                        plugreg_runtime::report::grpc(&s)
                    ),
                };
                print_devices(out, &answer.devices, target.output, !first)?;
                out.flush()?;
                first = false;
                if !watch {
                    return Ok(());
                }
            }
        }
        DeviceCommand::Allocate { target, devices } => {
            let mut p = Plugin::connect(&target).await?;
            let req = AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: devices,
                }],
            };
            let resp = call(&target, "Allocate", p.client.allocate(req)).await?;
            // The kubelet uses entry 0 and treats none as an error.
            let Some(c) = resp.container_responses.first() else {
                bail!("no containers return in allocation response {resp:?}");
            };
            print_allocation(out, c, target.output)?;
        }
        DeviceCommand::Preferred {
            target,
            available,
            must_include,
            size,
            force,
        } => {
            let mut p = Plugin::connect(&target).await?;
            if !p.options.get_preferred_allocation_available && !force {
                bail!(
                    "{} does not advertise get_preferred_allocation_available: the kubelet would not call GetPreferredAllocation (--force calls it anyway)",
                    p.target.endpoint
                );
            }
            let req = PreferredAllocationRequest {
                container_requests: vec![ContainerPreferredAllocationRequest {
                    available_device_ids: available,
                    must_include_device_ids: must_include,
                    allocation_size: size,
                }],
            };
            let resp = call(
                &target,
                "GetPreferredAllocation",
                p.client.get_preferred_allocation(req),
            )
            .await?;
            let ids: Vec<String> = resp
                .container_responses
                .first()
                .map(|c| c.device_ids.clone())
                .unwrap_or_default();
            match target.output {
                Output::Json => writeln!(out, "{}", json!({"device_ids": ids}))?,
                Output::Table => {
                    let mut rows = vec![vec!["ID".to_owned()]];
                    rows.extend(ids.into_iter().map(|i| vec![i]));
                    table(out, &rows)?;
                }
            }
        }
        DeviceCommand::Prestart {
            target,
            devices,
            force,
        } => {
            let mut p = Plugin::connect(&target).await?;
            if !p.options.pre_start_required && !force {
                bail!(
                    "{} does not set pre_start_required: the kubelet would not call PreStartContainer (--force calls it anyway)",
                    p.target.endpoint
                );
            }
            let req = PreStartContainerRequest {
                devices_ids: devices,
            };
            call(
                &target,
                "PreStartContainer",
                p.client.pre_start_container(req),
            )
            .await?;
            match target.output {
                Output::Json => writeln!(out, "{}", json!({"ok": true}))?,
                Output::Table => writeln!(out, "PreStartContainer ok")?,
            }
        }
    }
    Ok(())
}

fn options_json(o: &DevicePluginOptions) -> Value {
    json!({
        "pre_start_required": o.pre_start_required,
        "get_preferred_allocation_available": o.get_preferred_allocation_available,
    })
}

fn print_devices(
    out: &mut dyn Write,
    devices: &[Device],
    output: Output,
    separate: bool,
) -> std::io::Result<()> {
    match output {
        Output::Json => {
            let list: Vec<Value> = devices
                .iter()
                .map(|d| {
                    json!({
                        "id": d.id,
                        "health": d.health,
                        "topology": d.topology.as_ref().map(|t| t.nodes.iter().map(|n| n.id).collect::<Vec<_>>()),
                    })
                })
                .collect();
            writeln!(out, "{}", json!({"devices": list}))
        }
        Output::Table => {
            if separate {
                writeln!(out)?;
            }
            let mut rows = vec![vec!["ID".to_owned(), "HEALTH".into(), "NUMA".into()]];
            for d in devices {
                let numa = d
                    .topology
                    .as_ref()
                    .map(|t| {
                        t.nodes
                            .iter()
                            .map(|n| n.id.to_string())
                            .collect::<Vec<_>>()
                            .join(",")
                    })
                    .unwrap_or_else(|| "-".into());
                rows.push(vec![d.id.clone(), d.health.clone(), numa]);
            }
            table(out, &rows)
        }
    }
}

fn print_allocation(
    out: &mut dyn Write,
    c: &ContainerAllocateResponse,
    output: Output,
) -> std::io::Result<()> {
    let mut envs: Vec<_> = c.envs.iter().collect();
    envs.sort();
    let mut annotations: Vec<_> = c.annotations.iter().collect();
    annotations.sort();
    match output {
        Output::Json => {
            let v = json!({
                "envs": c.envs,
                "mounts": c.mounts.iter().map(|m| json!({"container_path": m.container_path, "host_path": m.host_path, "read_only": m.read_only})).collect::<Vec<_>>(),
                "devices": c.devices.iter().map(|d| json!({"container_path": d.container_path, "host_path": d.host_path, "permissions": d.permissions})).collect::<Vec<_>>(),
                "annotations": c.annotations,
                "cdi_devices": c.cdi_devices.iter().map(|d| d.name.clone()).collect::<Vec<_>>(),
            });
            writeln!(out, "{v}")
        }
        Output::Table => {
            let mut rows = vec![vec!["KIND".to_owned(), "VALUE".into()]];
            rows.extend(
                envs.iter()
                    .map(|(k, v)| vec!["env".into(), format!("{k}={v}")]),
            );
            rows.extend(c.mounts.iter().map(|m| {
                let ro = if m.read_only { " (ro)" } else { "" };
                vec![
                    "mount".into(),
                    format!("{} -> {}{ro}", m.host_path, m.container_path),
                ]
            }));
            rows.extend(c.devices.iter().map(|d| {
                vec![
                    "device".into(),
                    format!("{} -> {} {}", d.host_path, d.container_path, d.permissions),
                ]
            }));
            rows.extend(
                annotations
                    .iter()
                    .map(|(k, v)| vec!["annotation".into(), format!("{k}={v}")]),
            );
            rows.extend(
                c.cdi_devices
                    .iter()
                    .map(|d| vec!["cdi".into(), d.name.clone()]),
            );
            table(out, &rows)
        }
    }
}
