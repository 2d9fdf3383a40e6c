//! `plugreg csi ...`: ask a CSI driver on its socket what it is, as an operator would.
//!
//! * `info`: Identity (GetPluginInfo, GetPluginCapabilities, Probe);
//! * `node-info`: NodeGetInfo (what the kubelet publishes for the driver);
//! * `node-capabilities`: NodeGetCapabilities;
//! * `stage`, `unstage`, `publish`, `unpublish`, `expand`, `stats`: one node call each, as the
//!   kubelet makes it; `mount` and `unmount`: the kubelet's whole sequence ([`volume`]);
//! * `check`: the driver check for driver authors (exit 0 only when every step passed).
//!
//! Output is a table for people or `--output json` for scripts. `main` mounts [`CsiCommand`] as
//! a subcommand and calls [`run`]. The identity calls are `plugreg_csi_core::client`'s, the
//! volume calls `plugreg_csi_core::node`'s.

pub mod volume;

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::PathBuf;
use std::time::Duration;

use plugreg_proto::csi::v1::node_service_capability;
use plugreg_proto::csi::v1::plugin_capability::{self, service, volume_expansion};
use plugreg_transport::PathKind;
use serde::Serialize;

pub use crate::output::Output;

use plugreg_csi_core::client::{CallError, Connection, Retry};

/// The `plugreg csi` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum CsiCommand {
    /// Show the driver's identity: name, vendor version, manifest, capabilities, readiness
    /// (GetPluginInfo, GetPluginCapabilities, Probe).
    Info(Target),
    /// Show what the driver reports for this node: node id, volume limit, topology
    /// (NodeGetInfo).
    NodeInfo(Target),
    /// Show the driver's node service capabilities (NodeGetCapabilities).
    NodeCapabilities(Target),
    /// NodeStageVolume (creates the staging directory first, as the kubelet does; skipped
    /// without STAGE_UNSTAGE_VOLUME).
    Stage(Box<volume::VolumeArgs>),
    /// NodeUnstageVolume (skipped without STAGE_UNSTAGE_VOLUME).
    Unstage(Box<volume::VolumeArgs>),
    /// NodePublishVolume (creates the target's parent first).
    Publish(Box<volume::VolumeArgs>),
    /// NodeUnpublishVolume.
    Unpublish(Box<volume::VolumeArgs>),
    /// NodeExpandVolume (only when the driver has EXPAND_VOLUME).
    Expand(Box<volume::ExpandArgs>),
    /// NodeGetVolumeStats (only when the driver has GET_VOLUME_STATS).
    Stats(Box<volume::VolumeArgs>),
    /// The kubelet's mount sequence: stage (when supported), then publish.
    Mount(Box<volume::VolumeArgs>),
    /// The kubelet's unmount sequence: unpublish, then unstage (when supported).
    Unmount(Box<volume::VolumeArgs>),
    /// Run the driver through the kubelet's sequence and the spec's error codes in a temp dir;
    /// exit 0 only when every step passed.
    Check(Box<volume::CheckArgs>),
}

/// Which driver to ask, how long to wait, how to print.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The driver's socket: a path or unix://PATH.
    #[arg(long, visible_alias = "csi-address", value_name = "SOCKET")]
    pub endpoint: String,
    /// Limit for connecting and for each call (e.g. 500ms, 5s, 1m).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// Why a `plugreg csi` command failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The endpoint is not a socket address.
    #[error("invalid endpoint {endpoint:?}")]
    Endpoint {
        /// The endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: plugreg_transport::Error,
    },
    /// Nothing is at the socket path.
    #[error("no socket at {path:?}: is the CSI driver running, and is this its socket?")]
    NoSocket {
        /// The path.
        path: PathBuf,
    },
    /// Something other than a socket is at the path.
    #[error("{path:?} is not a socket")]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// The path could not be inspected.
    #[error("cannot inspect {path:?}")]
    Inspect {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: plugreg_transport::Error,
    },
    /// Connecting failed (a stale socket nobody listens on, permissions, ...).
    #[error("cannot connect to {endpoint}")]
    Dial {
        /// The endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: plugreg_transport::Error,
    },
    /// The socket serves gRPC but not the CSI service asked for.
    #[error(
        "{endpoint} is not a CSI driver: {method} answered UNIMPLEMENTED (is it a plugin \
         registration socket or another gRPC service?)"
    )]
    NotCsi {
        /// The endpoint.
        endpoint: String,
        /// The call.
        method: &'static str,
    },
    /// No answer in time.
    #[error("{endpoint} did not answer {method} within {}", humantime::format_duration(*.timeout))]
    Timeout {
        /// The endpoint.
        endpoint: String,
        /// The call (or `connect`).
        method: &'static str,
        /// The limit.
        timeout: Duration,
    },
    /// The driver answered with an error.
    #[error("{method} on {endpoint} failed")]
    Rpc {
        /// The endpoint.
        endpoint: String,
        /// The call.
        method: &'static str,
        /// The driver's status.
        #[source]
        status: tonic::Status,
    },
    /// Writing the output failed.
    #[error("failed to write the output")]
    Output(#[source] io::Error),
    /// Encoding JSON failed.
    #[error("failed to encode JSON output")]
    Json(#[source] serde_json::Error),
    /// A node call failed or could not be made. The text carries the whole chain, the
    /// driver's status worded as grpc-go words it (`rpc error: code = NotFound desc = ...`).
    #[error("{endpoint}: {}", plugreg_runtime::report::chain(.error))]
    Node {
        /// The endpoint.
        endpoint: String,
        /// Why (with the driver's gRPC status).
        error: plugreg_csi_core::NodeError,
    },
    /// `check` found steps that do not follow the spec.
    #[error("check of {endpoint} failed: {}", failed.join("; "))]
    CheckFailed {
        /// The endpoint.
        endpoint: String,
        /// The failed steps.
        failed: Vec<String>,
    },
    /// The check's temp dir could not be made.
    #[error("cannot create {path:?}")]
    TempDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

impl CliError {
    fn from_call(endpoint: &str, e: CallError) -> Self {
        let endpoint = endpoint.to_owned();
        match e {
            CallError::Dial {
                source: plugreg_transport::Error::ConnectTimeout { timeout, .. },
                ..
            } => CliError::Timeout {
                endpoint,
                method: "connect",
                timeout,
            },
            CallError::Dial { source, .. } => CliError::Dial { endpoint, source },
            CallError::Timeout {
                method, timeout, ..
            } => CliError::Timeout {
                endpoint,
                method,
                timeout,
            },
            CallError::Rpc { method, status, .. }
                if status.code() == tonic::Code::Unimplemented =>
            {
                CliError::NotCsi { endpoint, method }
            }
            CallError::Rpc { method, status, .. } => CliError::Rpc {
                endpoint,
                method,
                status,
            },
            // A call skipped for a capability the driver lacks (the volume calls).
            e @ CallError::NotSupported { .. } => CliError::Node {
                endpoint,
                error: e.into(),
            },
        }
    }
}

/// `plugreg csi info` as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InfoOutput {
    /// The endpoint asked.
    pub endpoint: String,
    /// Driver name.
    pub name: String,
    /// Driver's own version.
    pub vendor_version: String,
    /// Free-form metadata.
    pub manifest: BTreeMap<String, String>,
    /// Plugin capabilities, e.g. `CONTROLLER_SERVICE`, `VOLUME_EXPANSION_ONLINE`.
    pub capabilities: Vec<String>,
    /// Probe's answer (an unset `ready` counts as ready).
    pub ready: bool,
}

/// `plugreg csi node-info` as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeInfoOutput {
    /// The endpoint asked.
    pub endpoint: String,
    /// The driver's id of this node.
    pub node_id: String,
    /// Attach limit (0: not reported).
    pub max_volumes_per_node: i64,
    /// Topology segments.
    pub topology: BTreeMap<String, String>,
}

/// `plugreg csi node-capabilities` as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeCapabilitiesOutput {
    /// The endpoint asked.
    pub endpoint: String,
    /// Node service capabilities, e.g. `STAGE_UNSTAGE_VOLUME`.
    pub capabilities: Vec<String>,
}

/// Runs `cmd`, writing its output to `out`.
pub async fn run(cmd: CsiCommand, out: &mut dyn Write) -> Result<(), CliError> {
    use volume::Op;
    match cmd {
        CsiCommand::Stage(a) => volume::run_volume(Op::Stage, *a, out).await,
        CsiCommand::Unstage(a) => volume::run_volume(Op::Unstage, *a, out).await,
        CsiCommand::Publish(a) => volume::run_volume(Op::Publish, *a, out).await,
        CsiCommand::Unpublish(a) => volume::run_volume(Op::Unpublish, *a, out).await,
        CsiCommand::Stats(a) => volume::run_volume(Op::Stats, *a, out).await,
        CsiCommand::Mount(a) => volume::run_volume(Op::Mount, *a, out).await,
        CsiCommand::Unmount(a) => volume::run_volume(Op::Unmount, *a, out).await,
        CsiCommand::Expand(a) => volume::run_expand(*a, out).await,
        CsiCommand::Check(a) => volume::run_check(*a, out).await,
        CsiCommand::Info(t) => {
            let c = connect(&t).await?;
            let e = |err| CliError::from_call(&t.endpoint, err);
            let info = c.get_plugin_info().await.map_err(e)?;
            let caps = c.get_plugin_capabilities().await.map_err(e)?;
            let probe = c.probe().await.map_err(e)?;
            let o = InfoOutput {
                endpoint: t.endpoint.clone(),
                name: info.name,
                vendor_version: info.vendor_version,
                manifest: info.manifest.into_iter().collect(),
                capabilities: caps
                    .capabilities
                    .iter()
                    .filter_map(|c| c.r#type.as_ref().map(plugin_capability_name))
                    .collect(),
                ready: probe.ready.unwrap_or(true),
            };
            match t.output {
                Output::Json => json(out, &o),
                Output::Table => table(
                    out,
                    &[
                        ("ENDPOINT", o.endpoint.clone()),
                        ("NAME", o.name.clone()),
                        ("VENDOR VERSION", o.vendor_version.clone()),
                        ("MANIFEST", pairs(&o.manifest)),
                        ("CAPABILITIES", list(&o.capabilities)),
                        ("READY", o.ready.to_string()),
                    ],
                ),
            }
        }
        CsiCommand::NodeInfo(t) => {
            let c = connect(&t).await?;
            let r = c
                .node_get_info()
                .await
                .map_err(|err| CliError::from_call(&t.endpoint, err))?;
            let o = NodeInfoOutput {
                endpoint: t.endpoint.clone(),
                node_id: r.node_id,
                max_volumes_per_node: r.max_volumes_per_node,
                topology: r
                    .accessible_topology
                    .map(|t| t.segments.into_iter().collect())
                    .unwrap_or_default(),
            };
            match t.output {
                Output::Json => json(out, &o),
                Output::Table => table(
                    out,
                    &[
                        ("ENDPOINT", o.endpoint.clone()),
                        ("NODE ID", o.node_id.clone()),
                        (
                            "MAX VOLUMES",
                            if o.max_volumes_per_node > 0 {
                                o.max_volumes_per_node.to_string()
                            } else {
                                "-".to_owned()
                            },
                        ),
                        ("TOPOLOGY", pairs(&o.topology)),
                    ],
                ),
            }
        }
        CsiCommand::NodeCapabilities(t) => {
            let c = connect(&t).await?;
            let r = c
                .node_get_capabilities()
                .await
                .map_err(|err| CliError::from_call(&t.endpoint, err))?;
            let o = NodeCapabilitiesOutput {
                endpoint: t.endpoint.clone(),
                capabilities: r
                    .capabilities
                    .iter()
                    .filter_map(|c| c.r#type.as_ref().map(node_capability_name))
                    .collect(),
            };
            match t.output {
                Output::Json => json(out, &o),
                Output::Table => table(
                    out,
                    &[
                        ("ENDPOINT", o.endpoint.clone()),
                        ("CAPABILITIES", list(&o.capabilities)),
                    ],
                ),
            }
        }
    }
}

/// Checks that a socket is at `endpoint`.
fn check_socket(endpoint: &str) -> Result<(), CliError> {
    let path = plugreg_transport::parse_address(endpoint).map_err(|source| CliError::Endpoint {
        endpoint: endpoint.to_owned(),
        source,
    })?;
    match plugreg_transport::path_kind(&path) {
        Ok(PathKind::Socket) => Ok(()),
        Ok(PathKind::Missing) => Err(CliError::NoSocket { path }),
        Ok(PathKind::Other) => Err(CliError::NotASocket { path }),
        Err(source) => Err(CliError::Inspect { path, source }),
    }
}

/// Checks that a socket is at the endpoint, then dials it.
async fn connect(t: &Target) -> Result<Connection, CliError> {
    check_socket(&t.endpoint)?;
    Connection::connect(&t.endpoint, t.timeout, t.timeout, Retry::ONCE)
        .await
        .map_err(|e| CliError::from_call(&t.endpoint, e))
}

fn plugin_capability_name(t: &plugin_capability::Type) -> String {
    match t {
        plugin_capability::Type::Service(s) => service::Type::try_from(s.r#type).map_or_else(
            |_| format!("SERVICE_{}", s.r#type),
            |t| t.as_str_name().to_owned(),
        ),
        plugin_capability::Type::VolumeExpansion(v) => {
            let name = volume_expansion::Type::try_from(v.r#type)
                .map_or_else(|_| v.r#type.to_string(), |t| t.as_str_name().to_owned());
            format!("VOLUME_EXPANSION_{name}")
        }
    }
}

fn node_capability_name(t: &node_service_capability::Type) -> String {
    match t {
        node_service_capability::Type::Rpc(r) => {
            node_service_capability::rpc::Type::try_from(r.r#type).map_or_else(
                |_| format!("RPC_{}", r.r#type),
                |t| t.as_str_name().to_owned(),
            )
        }
    }
}

fn pairs(m: &BTreeMap<String, String>) -> String {
    if m.is_empty() {
        return "-".to_owned();
    }
    m.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn list(items: &[String]) -> String {
    if items.is_empty() {
        "-".to_owned()
    } else {
        items.join(", ")
    }
}

fn table(out: &mut dyn Write, rows: &[(&str, String)]) -> Result<(), CliError> {
    crate::output::key_values(out, rows).map_err(CliError::Output)
}

fn json(out: &mut dyn Write, value: &impl Serialize) -> Result<(), CliError> {
    crate::output::json(out, value).map_err(|e| match e.io_error_kind() {
        Some(_) => CliError::Output(e.into()),
        None => CliError::Json(e),
    })
}

#[cfg(test)]
mod against_drivers;

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: CsiCommand,
    }

    #[test]
    fn parses_the_commands() {
        let c = Cli::try_parse_from([
            "csi",
            "info",
            "--endpoint",
            "unix:///csi/csi.sock",
            "--timeout",
            "250ms",
            "--output",
            "json",
        ])
        .unwrap();
        let CsiCommand::Info(t) = c.cmd else {
            panic!("{c:?}")
        };
        assert_eq!(t.endpoint, "unix:///csi/csi.sock");
        assert_eq!(t.timeout, Duration::from_millis(250));
        assert_eq!(t.output, Output::Json);

        let c = Cli::try_parse_from(["csi", "node-info", "--csi-address", "/x.sock"]).unwrap();
        let CsiCommand::NodeInfo(t) = c.cmd else {
            panic!("{c:?}")
        };
        assert_eq!(t.timeout, Duration::from_secs(5));
        assert_eq!(t.output, Output::Table);

        assert!(Cli::try_parse_from(["csi", "node-capabilities", "--endpoint", "/x"]).is_ok());
        assert!(
            Cli::try_parse_from(["csi", "info"]).is_err(),
            "endpoint required"
        );
        assert!(
            Cli::try_parse_from(["csi", "info", "--endpoint", "/x", "--timeout", "soon"]).is_err()
        );
    }

    #[tokio::test]
    async fn missing_socket_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.sock");
        let cmd = CsiCommand::Info(Target {
            endpoint: path.display().to_string(),
            timeout: Duration::from_secs(1),
            output: Output::Table,
        });
        let err = run(cmd, &mut Vec::new()).await.unwrap_err();
        assert!(matches!(err, CliError::NoSocket { .. }), "{err:?}");
        assert!(err.to_string().contains("no socket at"), "{err}");

        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let cmd = CsiCommand::NodeInfo(Target {
            endpoint: format!("unix://{}", file.display()),
            timeout: Duration::from_secs(1),
            output: Output::Json,
        });
        let err = run(cmd, &mut Vec::new()).await.unwrap_err();
        assert!(matches!(err, CliError::NotASocket { .. }), "{err:?}");
    }

    #[test]
    fn table_aligns_keys() {
        let mut out = Vec::new();
        table(
            &mut out,
            &[("A", "1".to_owned()), ("LONGER", "2".to_owned())],
        )
        .unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "A       1\nLONGER  2\n");
    }
}
