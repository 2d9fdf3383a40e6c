//! `plugreg csi stage|unstage|publish|unpublish|expand|stats|mount|unmount|check`: a CSI
//! driver's node side, called as the kubelet calls it (`plugreg_csi_core::node`), and the
//! driver check (`plugreg_csi_core::check`).
//!
//! Paths default to the kubelet's layout under `--kubelet-root`, from the driver's name (asked
//! with GetPluginInfo unless `--driver` is given), `--pod-uid` and `--volume-name`; each can be
//! given directly (`--staging-path`, `--target-path`). Every command prints the paths it used.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use plugreg_csi_core::check::{self, CheckOptions, Outcome};
use plugreg_csi_core::client::{Connection, Retry};
use plugreg_csi_core::node::{AccessMode, Step};
use plugreg_csi_core::{KubeletLayout, NodeClient, NodeError, VolumeMode, VolumePaths, VolumeSpec};
use plugreg_proto::csi::v1::{GetPluginInfoRequest, volume_usage};
use plugreg_runtime::backoff::Backoff;
use plugreg_runtime::procfs::mount_points_under;
use serde::Serialize;

use super::{CliError, Output, json, table};

/// Which driver, how long to wait, how often to repeat a transient failure, how to print.
#[derive(Debug, Clone, clap::Args)]
pub struct NodeTarget {
    /// The driver's socket: a path or unix://PATH.
    #[arg(long, visible_alias = "csi-address", value_name = "SOCKET")]
    pub endpoint: String,
    /// Limit for each call (the kubelet's is 2 minutes).
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Limit for connecting.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub connect_timeout: Duration,
    /// Calls at most when the driver answers UNAVAILABLE, ABORTED, RESOURCE_EXHAUSTED or does
    /// not answer in time (it must be idempotent); 1 = no repeat.
    #[arg(long, default_value_t = 3)]
    pub attempts: u32,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// The volume and where it goes.
#[derive(Debug, Clone, clap::Args)]
pub struct VolumeArgs {
    #[command(flatten)]
    pub target: NodeTarget,
    /// The volume handle (CSI volume_id).
    #[arg(long)]
    pub volume_id: String,
    /// The kubelet's root directory (paths are made under it).
    #[arg(long, default_value = plugreg_csi_core::DEFAULT_KUBELET_ROOT)]
    pub kubelet_root: PathBuf,
    /// The driver name used in the staging path [default: GetPluginInfo's].
    #[arg(long)]
    pub driver: Option<String>,
    /// The pod UID used in the target path.
    #[arg(long, default_value = "plugreg")]
    pub pod_uid: String,
    /// The volume name used in the paths [default: the volume id].
    #[arg(long)]
    pub volume_name: Option<String>,
    /// Use this staging path instead of the kubelet's.
    #[arg(long)]
    pub staging_path: Option<PathBuf>,
    /// Use this target path instead of the kubelet's.
    #[arg(long)]
    pub target_path: Option<PathBuf>,
    /// Access mode.
    #[arg(long, value_enum, default_value_t = Access::SingleNodeWriter)]
    pub access_mode: Access,
    /// Filesystem or block.
    #[arg(long, value_enum, default_value_t = Mode::Filesystem)]
    pub volume_mode: Mode,
    /// Filesystem type ("" = the driver's default).
    #[arg(long, default_value = "")]
    pub fs_type: String,
    /// A mount option (repeatable).
    #[arg(long = "mount-flag", value_name = "FLAG")]
    pub mount_flags: Vec<String>,
    /// Group to mount with (sent only when the driver has VOLUME_MOUNT_GROUP).
    #[arg(long)]
    pub mount_group: Option<String>,
    /// Publish read-only.
    #[arg(long)]
    pub readonly: bool,
    /// volume_context entry `KEY=VALUE` (repeatable).
    #[arg(long = "volume-context", value_name = "KEY=VALUE", value_parser = key_value)]
    pub volume_context: Vec<(String, String)>,
    /// publish_context entry `KEY=VALUE` (repeatable).
    #[arg(long = "publish-context", value_name = "KEY=VALUE", value_parser = key_value)]
    pub publish_context: Vec<(String, String)>,
    /// Secret `KEY=VALUE` sent with stage and publish (repeatable).
    #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = key_value)]
    pub secrets: Vec<(String, String)>,
}

/// `expand`: the volume and the size wanted.
#[derive(Debug, Clone, clap::Args)]
pub struct ExpandArgs {
    #[command(flatten)]
    pub volume: VolumeArgs,
    /// Size wanted in bytes (0: the driver decides).
    #[arg(long, default_value_t = 0)]
    pub required_bytes: i64,
}

/// Which driver `check` asks (every call is made once: the check shows what the driver says).
#[derive(Debug, Clone, clap::Args)]
pub struct CheckTarget {
    /// The driver's socket: a path or unix://PATH.
    #[arg(long, visible_alias = "csi-address", value_name = "SOCKET")]
    pub endpoint: String,
    /// Limit for each call (the kubelet's is 2 minutes).
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Limit for connecting.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub connect_timeout: Duration,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// `check`: the driver and where the volume comes from.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub target: CheckTarget,
    /// The Controller's socket, when it is not --endpoint.
    #[arg(long, value_name = "SOCKET")]
    pub controller_endpoint: Option<String>,
    /// The volume to use when the driver cannot create one (no CREATE_DELETE_VOLUME).
    #[arg(long)]
    pub volume_id: Option<String>,
    /// Size asked of CreateVolume, in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub capacity_bytes: i64,
    /// volume_context entry `KEY=VALUE` for --volume-id (repeatable; a created volume
    /// uses what CreateVolume returned).
    #[arg(long = "volume-context", value_name = "KEY=VALUE", value_parser = key_value)]
    pub volume_context: Vec<(String, String)>,
    /// publish_context entry `KEY=VALUE` (repeatable), for a driver whose Controller does
    /// not publish (what ControllerPublishVolume returns is added over these).
    #[arg(long = "publish-context", value_name = "KEY=VALUE", value_parser = key_value)]
    pub publish_context: Vec<(String, String)>,
}

/// Access modes, as the CSI spec names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Access {
    /// SINGLE_NODE_WRITER
    SingleNodeWriter,
    /// SINGLE_NODE_READER_ONLY
    SingleNodeReaderOnly,
    /// MULTI_NODE_READER_ONLY
    MultiNodeReaderOnly,
    /// MULTI_NODE_SINGLE_WRITER
    MultiNodeSingleWriter,
    /// MULTI_NODE_MULTI_WRITER
    MultiNodeMultiWriter,
    /// SINGLE_NODE_SINGLE_WRITER
    SingleNodeSingleWriter,
    /// SINGLE_NODE_MULTI_WRITER
    SingleNodeMultiWriter,
}

impl From<Access> for AccessMode {
    fn from(a: Access) -> Self {
        match a {
            Access::SingleNodeWriter => AccessMode::SingleNodeWriter,
            Access::SingleNodeReaderOnly => AccessMode::SingleNodeReaderOnly,
            Access::MultiNodeReaderOnly => AccessMode::MultiNodeReaderOnly,
            Access::MultiNodeSingleWriter => AccessMode::MultiNodeSingleWriter,
            Access::MultiNodeMultiWriter => AccessMode::MultiNodeMultiWriter,
            Access::SingleNodeSingleWriter => AccessMode::SingleNodeSingleWriter,
            Access::SingleNodeMultiWriter => AccessMode::SingleNodeMultiWriter,
        }
    }
}

/// Volume modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// A mounted filesystem.
    Filesystem,
    /// A raw block device.
    Block,
}

fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// Which single call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// NodeStageVolume.
    Stage,
    /// NodeUnstageVolume.
    Unstage,
    /// NodePublishVolume.
    Publish,
    /// NodeUnpublishVolume.
    Unpublish,
    /// NodeGetVolumeStats.
    Stats,
    /// Stage (when supported), then publish.
    Mount,
    /// Unpublish, then unstage (when supported).
    Unmount,
}

/// What a volume command did, as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VolumeOutput {
    /// The endpoint.
    pub endpoint: String,
    /// The driver name used in the paths.
    pub driver: String,
    /// The volume.
    pub volume_id: String,
    /// The staging path (absent when the driver does not stage).
    pub staging_path: Option<PathBuf>,
    /// The publish target.
    pub target_path: PathBuf,
    /// What was done, e.g. `["NodeStageVolume", "NodePublishVolume"]`.
    pub calls: Vec<String>,
    /// Calls not made for lack of a capability.
    pub skipped: Vec<String>,
    /// NodeExpandVolume's answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity_bytes: Option<i64>,
    /// NodeGetVolumeStats's answer: unit → (available, total, used).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<BTreeMap<String, Usage>>,
    /// NodeGetVolumeStats's volume condition, when reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub abnormal: Option<bool>,
}

/// One usage entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Free.
    pub available: i64,
    /// Total.
    pub total: i64,
    /// Used.
    pub used: i64,
}

fn spec(a: &VolumeArgs) -> VolumeSpec {
    let secrets: BTreeMap<_, _> = a.secrets.iter().cloned().collect();
    VolumeSpec {
        volume_id: a.volume_id.clone(),
        access_mode: a.access_mode.into(),
        mode: match a.volume_mode {
            Mode::Block => VolumeMode::Block,
            Mode::Filesystem => VolumeMode::Filesystem {
                fs_type: a.fs_type.clone(),
                mount_flags: a.mount_flags.clone(),
                mount_group: a.mount_group.clone(),
            },
        },
        readonly: a.readonly,
        volume_context: a.volume_context.iter().cloned().collect(),
        publish_context: a.publish_context.iter().cloned().collect(),
        stage_secrets: secrets.clone(),
        publish_secrets: secrets,
    }
}

fn retry(t: &NodeTarget) -> Retry {
    Retry {
        attempts: t.attempts.max(1),
        backoff: Backoff::new(Duration::from_millis(500), Duration::from_secs(5)),
    }
}

fn node_err(endpoint: &str, e: NodeError) -> CliError {
    CliError::Node {
        endpoint: endpoint.to_owned(),
        error: e,
    }
}

async fn connect(t: &NodeTarget) -> Result<NodeClient, CliError> {
    super::check_socket(&t.endpoint)?;
    NodeClient::connect(&t.endpoint, t.connect_timeout, t.timeout, retry(t))
        .await
        .map_err(|e| node_err(&t.endpoint, e))
}

async fn driver_name(c: &NodeClient, a: &VolumeArgs) -> Result<String, CliError> {
    if let Some(d) = &a.driver {
        return Ok(d.clone());
    }
    let conn: &Connection = c.connection();
    let id = conn.identity();
    let info = conn
        .call("GetPluginInfo", &GetPluginInfoRequest {}, |r| {
            let mut id = id.clone();
            async move { id.get_plugin_info(r).await }
        })
        .await
        .map_err(|e| node_err(&a.target.endpoint, e.into()))?;
    Ok(info.name)
}

async fn paths(c: &NodeClient, a: &VolumeArgs) -> Result<(String, VolumePaths), CliError> {
    let needs_name = a.staging_path.is_none() && c.stages() && a.volume_mode == Mode::Filesystem;
    let driver = if needs_name || a.driver.is_some() {
        driver_name(c, a).await?
    } else {
        String::new()
    };
    let layout = KubeletLayout::new(&a.kubelet_root);
    let name = a.volume_name.as_deref().unwrap_or(&a.volume_id);
    let s = spec(a);
    // With an explicit staging path the layout is asked only for the target.
    let driver_for_layout = if driver.is_empty() {
        "unused.invalid"
    } else {
        &driver
    };
    let mut p = c
        .paths(&layout, driver_for_layout, &s, &a.pod_uid, name)
        .map_err(|e| node_err(&a.target.endpoint, e))?;
    if let Some(sp) = &a.staging_path
        && c.stages()
    {
        p.staging = Some(sp.clone());
    }
    if let Some(tp) = &a.target_path {
        p.target = tp.clone();
    }
    Ok((driver, p))
}

/// Runs one volume command.
pub async fn run_volume(op: Op, a: VolumeArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let ep = a.target.endpoint.clone();
    let c = connect(&a.target).await?;
    let (driver, p) = paths(&c, &a).await?;
    let s = spec(&a);
    let e = |err| node_err(&ep, err);
    let mut o = VolumeOutput {
        endpoint: ep.clone(),
        driver,
        volume_id: a.volume_id.clone(),
        staging_path: p.staging.clone(),
        target_path: p.target.clone(),
        calls: Vec::new(),
        skipped: Vec::new(),
        capacity_bytes: None,
        usage: None,
        abnormal: None,
    };
    let stage_call = |o: &mut VolumeOutput, step: Step, name: &str| match step {
        Step::Done => o.calls.push(name.to_owned()),
        Step::Skipped => o.skipped.push(name.to_owned()),
    };
    match op {
        Op::Stage => match &p.staging {
            Some(staging) => {
                // The kubelet creates the staging directory.
                std::fs::create_dir_all(staging).map_err(|source| {
                    e(NodeError::Dir {
                        action: "create",
                        path: staging.clone(),
                        source,
                    })
                })?;
                let step = c.stage(&s, staging).await.map_err(e)?;
                stage_call(&mut o, step, "NodeStageVolume");
            }
            None => o.skipped.push("NodeStageVolume".into()),
        },
        Op::Unstage => match &p.staging {
            Some(staging) => {
                let step = c.unstage(&a.volume_id, staging).await.map_err(e)?;
                stage_call(&mut o, step, "NodeUnstageVolume");
            }
            None => o.skipped.push("NodeUnstageVolume".into()),
        },
        Op::Publish => {
            if let Some(parent) = p.target.parent() {
                std::fs::create_dir_all(parent).map_err(|source| {
                    e(NodeError::Dir {
                        action: "create",
                        path: parent.to_owned(),
                        source,
                    })
                })?;
            }
            c.publish(&s, p.staging.as_deref(), &p.target)
                .await
                .map_err(e)?;
            o.calls.push("NodePublishVolume".into());
        }
        Op::Unpublish => {
            c.unpublish(&a.volume_id, &p.target).await.map_err(e)?;
            o.calls.push("NodeUnpublishVolume".into());
        }
        Op::Stats => {
            let r = c
                .stats(&a.volume_id, &p.target, p.staging.as_deref())
                .await
                .map_err(e)?;
            o.calls.push("NodeGetVolumeStats".into());
            o.usage = Some(
                r.usage
                    .iter()
                    .map(|u| {
                        let unit = volume_usage::Unit::try_from(u.unit)
                            .map_or_else(|_| u.unit.to_string(), |x| x.as_str_name().to_owned());
                        (
                            unit,
                            Usage {
                                available: u.available,
                                total: u.total,
                                used: u.used,
                            },
                        )
                    })
                    .collect(),
            );
            o.abnormal = r.volume_condition.map(|c| c.abnormal);
        }
        Op::Mount => {
            c.mount(&s, &p).await.map_err(e)?;
            if p.staging.is_some() {
                o.calls.push("NodeStageVolume".into());
            } else {
                o.skipped.push("NodeStageVolume".into());
            }
            o.calls.push("NodePublishVolume".into());
        }
        Op::Unmount => {
            c.unmount(&a.volume_id, &p).await.map_err(e)?;
            o.calls.push("NodeUnpublishVolume".into());
            if p.staging.is_some() {
                o.calls.push("NodeUnstageVolume".into());
            } else {
                o.skipped.push("NodeUnstageVolume".into());
            }
        }
    }
    print_volume(&o, out, a.target.output)
}

/// Runs `expand`.
pub async fn run_expand(a: ExpandArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let v = &a.volume;
    let ep = v.target.endpoint.clone();
    let c = connect(&v.target).await?;
    let (driver, p) = paths(&c, v).await?;
    let size = c
        .expand(&spec(v), &p.target, p.staging.as_deref(), a.required_bytes)
        .await
        .map_err(|e| node_err(&ep, e))?;
    let o = VolumeOutput {
        endpoint: ep,
        driver,
        volume_id: v.volume_id.clone(),
        staging_path: p.staging,
        target_path: p.target,
        calls: vec!["NodeExpandVolume".into()],
        skipped: Vec::new(),
        capacity_bytes: Some(size),
        usage: None,
        abnormal: None,
    };
    print_volume(&o, out, v.target.output)
}

fn print_volume(o: &VolumeOutput, out: &mut dyn Write, format: Output) -> Result<(), CliError> {
    if format == Output::Json {
        return json(out, o);
    }
    let path = |p: Option<&Path>| p.map_or_else(|| "-".to_owned(), |p| p.display().to_string());
    let list = |l: &[String]| {
        if l.is_empty() {
            "-".to_owned()
        } else {
            l.join(", ")
        }
    };
    let mut rows = vec![
        ("ENDPOINT", o.endpoint.clone()),
        ("VOLUME", o.volume_id.clone()),
        ("STAGING PATH", path(o.staging_path.as_deref())),
        ("TARGET PATH", path(Some(&o.target_path))),
        ("CALLED", list(&o.calls)),
        ("SKIPPED", list(&o.skipped)),
    ];
    if let Some(c) = o.capacity_bytes {
        rows.push(("CAPACITY BYTES", c.to_string()));
    }
    if let Some(u) = &o.usage {
        for (unit, u) in u {
            rows.push((
                if unit == "BYTES" {
                    "BYTES"
                } else if unit == "INODES" {
                    "INODES"
                } else {
                    "OTHER"
                },
                format!(
                    "{} used, {} available, {} total",
                    u.used, u.available, u.total
                ),
            ));
        }
    }
    if let Some(a) = o.abnormal {
        rows.push(("ABNORMAL", a.to_string()));
    }
    table(out, &rows)
}

/// Runs `check`: exit status through [`CliError::CheckFailed`].
pub async fn run_check(a: CheckArgs, out: &mut dyn Write) -> Result<(), CliError> {
    super::check_socket(&a.target.endpoint)?;
    let root = CheckDir::create()?;
    let opts = CheckOptions {
        endpoint: a.target.endpoint.clone(),
        controller_endpoint: a.controller_endpoint.clone(),
        volume_id: a.volume_id.clone(),
        root: root.path.clone(),
        dial_timeout: a.target.connect_timeout,
        call_timeout: a.target.timeout,
        capacity_bytes: a.capacity_bytes,
        volume_context: a.volume_context.iter().cloned().collect(),
        publish_context: a.publish_context.iter().cloned().collect(),
    };
    let report = check::run(&opts).await;
    drop(root);
    match a.target.output {
        Output::Json => json(out, &report)?,
        Output::Table => {
            let w = report
                .steps
                .iter()
                .map(|s| s.step.len())
                .max()
                .unwrap_or(4)
                .max(4);
            let io = |e| CliError::Output(e);
            writeln!(
                out,
                "{:<w$}  {:<6}  {:<19}  DETAIL",
                "STEP", "RESULT", "CODE"
            )
            .map_err(io)?;
            for s in &report.steps {
                let result = match s.outcome {
                    Outcome::Pass => "pass",
                    Outcome::Fail => "FAIL",
                    Outcome::Skip => "skip",
                };
                writeln!(
                    out,
                    "{:<w$}  {:<6}  {:<19}  {}",
                    s.step,
                    result,
                    s.code.as_deref().unwrap_or("-"),
                    s.detail
                )
                .map_err(io)?;
            }
            let n = |o| report.steps.iter().filter(|s| s.outcome == o).count();
            writeln!(
                out,
                "{} passed, {} failed, {} skipped",
                n(Outcome::Pass),
                n(Outcome::Fail),
                n(Outcome::Skip)
            )
            .map_err(io)?;
        }
    }
    if report.passed() {
        Ok(())
    } else {
        Err(CliError::CheckFailed {
            endpoint: a.target.endpoint,
            failed: report.failures().map(|s| s.step.clone()).collect(),
        })
    }
}

/// The check's kubelet root: a fresh directory under the temp dir, removed after. Only empty
/// directories are removed, and nothing below a mount point a driver left behind, so a
/// forgotten bind mount never costs a volume its data.
struct CheckDir {
    path: PathBuf,
}

impl CheckDir {
    fn create() -> Result<Self, CliError> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path =
            std::env::temp_dir().join(format!("plugreg-csi-check-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&path).map_err(|source| CliError::TempDir {
            path: path.clone(),
            source,
        })?;
        Ok(Self { path })
    }
}

fn remove_empty_dirs(dir: &Path, mounts: &[PathBuf]) {
    if mounts.iter().any(|m| m == dir) {
        eprintln!(
            "plugreg: {} is still mounted (the driver did not unmount it); left in place",
            dir.display()
        );
        return;
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_empty_dirs(&entry.path(), mounts);
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

impl Drop for CheckDir {
    fn drop(&mut self) {
        let mounts = mount_points_under(&self.path);
        remove_empty_dirs(&self.path, &mounts);
    }
}
