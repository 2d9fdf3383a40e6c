//! Operator commands: `list`, `inspect`, `watch`, `probe`. They only read: GetInfo is called,
//! NotifyRegistrationStatus never is.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use plugreg_manager::DEFAULT_REGISTRY_DIR;
use plugreg_manager::watcher::{WatchEvent, Watcher};
use plugreg_proto::pluginregistration::registration_client::RegistrationClient;
use plugreg_proto::pluginregistration::{InfoRequest, PluginInfo};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::output::{Output, json, table};

/// Flags shared by the commands that read a registry directory.
#[derive(Debug, Clone, clap::Args)]
pub struct DirArgs {
    /// The registry directory.
    #[arg(long, default_value = DEFAULT_REGISTRY_DIR)]
    pub registry_dir: PathBuf,
    /// Limit for each dial plus GetInfo.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s")]
    pub timeout: Duration,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value = "table")]
    pub output: Output,
}

/// One socket and what it says about itself.
#[derive(Debug, Clone, Serialize)]
pub struct SocketInfo {
    /// The socket.
    pub socket: PathBuf,
    /// Its GetInfo answer.
    pub info: Option<Info>,
    /// Why GetInfo failed.
    pub error: Option<String>,
}

/// A GetInfo answer.
#[derive(Debug, Clone, Serialize)]
pub struct Info {
    /// Plugin type.
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// Plugin name.
    pub name: String,
    /// Advertised endpoint.
    pub endpoint: String,
    /// Advertised versions.
    pub versions: Vec<String>,
}

impl From<PluginInfo> for Info {
    fn from(i: PluginInfo) -> Self {
        Self {
            plugin_type: i.r#type,
            name: i.name,
            endpoint: i.endpoint,
            versions: i.supported_versions,
        }
    }
}

/// Dials `socket` and calls GetInfo, all within `timeout`.
pub async fn get_info(socket: &Path, timeout: Duration) -> anyhow::Result<PluginInfo> {
    let call = async {
        let channel = plugreg_transport::connect_path(socket, timeout).await?;
        let info = plugreg_transport::client!(RegistrationClient, channel)
            .get_info(InfoRequest {})
            .await
            .context("GetInfo failed")?
            .into_inner();
        anyhow::Ok(info)
    };
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {timeout:?}"))?
}

async fn describe(socket: PathBuf, timeout: Duration) -> SocketInfo {
    match get_info(&socket, timeout).await {
        Ok(i) => SocketInfo {
            socket,
            info: Some(i.into()),
            error: None,
        },
        Err(e) => SocketInfo {
            socket,
            info: None,
            error: Some(format!("{e:#}")),
        },
    }
}

/// `plugreg list`: every socket in the registry directory and its GetInfo answer.
pub async fn list(args: DirArgs, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
    let sockets = plugreg_manager::watcher::list_sockets(&args.registry_dir)
        .with_context(|| format!("cannot read {}", args.registry_dir.display()))?;
    let mut tasks = tokio::task::JoinSet::new();
    for (i, s) in sockets.into_iter().enumerate() {
        let t = args.timeout;
        tasks.spawn(async move { (i, describe(s, t).await) });
    }
    let mut rows: Vec<(usize, SocketInfo)> = tasks.join_all().await;
    rows.sort_by_key(|(i, _)| *i);
    let rows: Vec<SocketInfo> = rows.into_iter().map(|(_, r)| r).collect();
    match args.output {
        Output::Json => json(out, &rows)?,
        Output::Table => {
            let mut lines = vec![
                ["SOCKET", "TYPE", "NAME", "ENDPOINT", "VERSIONS", "STATUS"]
                    .map(String::from)
                    .to_vec(),
            ];
            for r in &rows {
                let (t, n, e, v) = match &r.info {
                    Some(i) => (
                        i.plugin_type.clone(),
                        i.name.clone(),
                        i.endpoint.clone(),
                        i.versions.join(","),
                    ),
                    None => Default::default(),
                };
                let status = r.error.clone().unwrap_or_else(|| "ok".into());
                lines.push(vec![r.socket.display().to_string(), t, n, e, v, status]);
            }
            table(out, &lines)?;
            if rows.is_empty() {
                writeln!(out, "(no sockets in {})", args.registry_dir.display())?;
            }
        }
    }
    Ok(())
}

/// Flags of `plugreg inspect` and `plugreg probe`.
#[derive(Debug, Clone, clap::Args)]
pub struct SocketArgs {
    /// The registration socket (path or unix://path).
    pub socket: String,
    /// Limit for each call.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s")]
    pub timeout: Duration,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value = "table")]
    pub output: Output,
}

/// What `plugreg inspect` reports.
#[derive(Debug, Serialize)]
struct Inspection {
    socket: PathBuf,
    mode: String,
    uid: u32,
    gid: u32,
    inode: u64,
    info: Option<Info>,
    error: Option<String>,
    csi_driver: Option<serde_json::Value>,
}

/// `plugreg inspect SOCKET`: the file, its GetInfo answer and, for a CSI driver, what the
/// driver itself says (GetPluginInfo).
pub async fn inspect(args: SocketArgs, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
    let socket = plugreg_transport::parse_address(&args.socket)?;
    let meta = std::fs::symlink_metadata(&socket)
        .with_context(|| format!("{} does not exist", socket.display()))?;
    let d = describe(socket.clone(), args.timeout).await;
    let mut csi_driver = None;
    if let Some(i) = d
        .info
        .as_ref()
        .filter(|i| i.plugin_type == plugreg_handler_csi::PLUGIN_TYPE)
    {
        let ep = if i.endpoint.is_empty() {
            socket.display().to_string()
        } else {
            i.endpoint.clone()
        };
        csi_driver = Some(
            match plugreg_csi_core::Connection::connect(
                &ep,
                args.timeout,
                args.timeout,
                plugreg_csi_core::Retry::ONCE,
            )
            .await
            {
                Ok(c) => match c.get_plugin_info().await {
                    Ok(r) => {
                        serde_json::json!({"endpoint": ep, "name": r.name, "vendor_version": r.vendor_version})
                    }
                    Err(e) => serde_json::json!({"endpoint": ep, "error": e.to_string()}),
                },
                Err(e) => serde_json::json!({"endpoint": ep, "error": e.to_string()}),
            },
        );
    }
    let report = Inspection {
        socket,
        mode: format!("{:o}", meta.permissions().mode() & 0o7777),
        uid: meta.uid(),
        gid: meta.gid(),
        inode: meta.ino(),
        info: d.info,
        error: d.error,
        csi_driver,
    };
    match args.output {
        Output::Json => json(out, &report)?,
        Output::Table => {
            let mut rows = vec![
                vec!["socket".into(), report.socket.display().to_string()],
                vec!["mode".into(), report.mode.clone()],
                vec!["owner".into(), format!("{}:{}", report.uid, report.gid)],
            ];
            match &report.info {
                Some(i) => {
                    rows.push(vec!["type".into(), i.plugin_type.clone()]);
                    rows.push(vec!["name".into(), i.name.clone()]);
                    rows.push(vec!["endpoint".into(), i.endpoint.clone()]);
                    rows.push(vec!["versions".into(), i.versions.join(",")]);
                }
                None => rows.push(vec![
                    "error".into(),
                    report.error.clone().unwrap_or_default(),
                ]),
            }
            if let Some(c) = &report.csi_driver {
                rows.push(vec!["csi driver".into(), c.to_string()]);
            }
            table(out, &rows)?;
        }
    }
    Ok(())
}

/// `plugreg probe SOCKET`: exit 0 when the socket answers GetInfo within the timeout.
pub async fn probe(args: SocketArgs, out: &mut dyn std::io::Write) -> anyhow::Result<bool> {
    let socket = plugreg_transport::parse_address(&args.socket)?;
    let started = tokio::time::Instant::now();
    let d = describe(socket, args.timeout).await;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    match args.output {
        Output::Json => {
            let v = serde_json::json!({"socket": d.socket, "ok": d.error.is_none(), "info": d.info, "error": d.error, "ms": ms});
            writeln!(out, "{v}")?;
        }
        Output::Table => match (&d.info, &d.error) {
            (Some(i), _) => writeln!(
                out,
                "ok {} {} {} ({ms:.1} ms)",
                d.socket.display(),
                i.plugin_type,
                i.name
            )?,
            (None, e) => writeln!(
                out,
                "FAIL {}: {}",
                d.socket.display(),
                e.clone().unwrap_or_default()
            )?,
        },
    }
    Ok(d.error.is_none())
}

/// `plugreg watch`: one line per socket appearing or disappearing, until SIGINT/SIGTERM.
pub async fn watch(args: DirArgs, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
    // Installed before the first line is printed: whoever reads it may signal at once.
    let mut signals = plugreg_runtime::signal::Signals::new()?;
    let token = CancellationToken::new();
    let watcher = Watcher::new(args.registry_dir.clone())?;
    let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
    let (_rescan_tx, rescan_rx) = tokio::sync::mpsc::channel(1);
    let t = token.clone();
    let task =
        tokio::spawn(async move { watcher.run(tx, rescan_rx, Duration::from_secs(1), t).await });
    loop {
        let ev = tokio::select! {
            _ = signals.shutdown() => break,
            ev = rx.recv() => match ev { Some(ev) => ev, None => break },
        };
        let now = humantime::format_rfc3339_nanos(std::time::SystemTime::now());
        let lines: Vec<(String, PathBuf)> = match ev {
            WatchEvent::Added { path, .. } => vec![("added".into(), path)],
            WatchEvent::Removed { path } => vec![("removed".into(), path)],
            WatchEvent::RemovedUnder { dir } => vec![("removed-tree".into(), dir)],
            WatchEvent::Rescanned { sockets } => sockets
                .into_iter()
                .map(|(p, _)| ("present".into(), p))
                .collect(),
        };
        for (what, path) in lines {
            let info = if what == "added" || what == "present" {
                get_info(&path, args.timeout).await.ok().map(Info::from)
            } else {
                None
            };
            match args.output {
                Output::Json => writeln!(
                    out,
                    "{}",
                    serde_json::json!({"ts": now.to_string(), "event": what, "socket": path, "info": info})
                )?,
                Output::Table => match info {
                    Some(i) => writeln!(
                        out,
                        "{now} {what:<12} {} {} {}",
                        path.display(),
                        i.plugin_type,
                        i.name
                    )?,
                    None => writeln!(out, "{now} {what:<12} {}", path.display())?,
                },
            }
            out.flush()?;
        }
    }
    token.cancel();
    let _ = task.await;
    Ok(())
}
