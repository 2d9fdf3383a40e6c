//! `csi-test-driver`: the fake CSI driver of `plugreg-csi-test-driver` as a process.
//!
//! Prints one JSON line per event on stdout: `{"event":"listening","socket":...}` once the
//! socket accepts connections, `{"event":"call","method":...}` per call. SIGTERM or SIGINT
//! removes the socket and exits 0.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use plugreg_csi_test_driver::{
    CallLog, Capacity, Code, Conditions, DriverConfig, Failure, Fault, Method, MountMode,
    NodeCapability, SmallerThanSource, parse_topology, valid_volume_id,
};
use plugreg_runtime::signal::Signals;
use tokio_util::sync::CancellationToken;

/// A fake CSI driver (Identity, Node, optionally Controller) on a Unix socket, for tests and
/// demos. Stage and publish make bind mounts when run as root.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Socket path to serve on.
    #[arg(long, conflicts_with = "endpoint")]
    socket: Option<PathBuf>,
    /// Socket address to serve on: `unix://PATH` or an absolute path.
    #[arg(long)]
    endpoint: Option<String>,
    /// Driver name returned by GetPluginInfo (may be empty).
    #[arg(long, default_value = "csi.plugreg.test")]
    name: String,
    /// vendor_version returned by GetPluginInfo.
    #[arg(long, default_value = "0.1.0")]
    vendor_version: String,
    /// List VOLUME_ACCESSIBILITY_CONSTRAINTS in GetPluginCapabilities.
    #[arg(long)]
    accessibility_constraints: bool,
    /// node_id returned by NodeGetInfo (may be empty).
    #[arg(long, default_value = "node-1")]
    node_id: String,
    /// Topology segments returned by NodeGetInfo: `k=v,k2=v2`.
    #[arg(long, default_value = "")]
    topology: String,
    /// max_volumes_per_node returned by NodeGetInfo.
    #[arg(long, default_value_t = 0)]
    max_volumes: i64,
    /// Delay GetPluginInfo answers by this long (e.g. `2s`).
    #[arg(long, value_parser = humantime::parse_duration)]
    get_plugin_info_delay: Option<Duration>,
    /// Delay only the first N GetPluginInfo calls.
    #[arg(long)]
    get_plugin_info_delay_first: Option<u64>,
    /// Fail the first N GetPluginInfo calls.
    #[arg(long)]
    get_plugin_info_fail_first: Option<u64>,
    /// Fail GetPluginInfo with this message (every call, or the first N with --get-plugin-info-fail-first).
    #[arg(long)]
    get_plugin_info_error: Option<String>,
    /// gRPC status code of the GetPluginInfo failure.
    #[arg(long, default_value_t = Code::Unavailable as i32)]
    get_plugin_info_error_code: i32,
    /// Delay NodeGetInfo answers by this long.
    #[arg(long, value_parser = humantime::parse_duration)]
    node_get_info_delay: Option<Duration>,
    /// Fail NodeGetInfo with this message.
    #[arg(long)]
    node_get_info_error: Option<String>,
    /// gRPC status code of the NodeGetInfo failure.
    #[arg(long, default_value_t = Code::Internal as i32)]
    node_get_info_error_code: i32,
    /// Never answer NodeGetInfo.
    #[arg(long)]
    node_get_info_hang: bool,
    /// Advertise this node capability (repeatable): STAGE_UNSTAGE_VOLUME, GET_VOLUME_STATS,
    /// EXPAND_VOLUME, VOLUME_CONDITION, SINGLE_NODE_MULTI_WRITER, VOLUME_MOUNT_GROUP.
    #[arg(long = "node-capability", value_name = "NAME", value_parser = parse_node_capability)]
    node_capabilities: Vec<NodeCapability>,
    /// Serve the Controller service (CreateVolume, DeleteVolume, ControllerGetCapabilities).
    #[arg(long)]
    controller: bool,
    /// NodeStageVolume and NodePublishVolume require publish_context["device"], as csi-test's
    /// mock driver does; with --controller also advertise PUBLISH_UNPUBLISH_VOLUME and serve
    /// ControllerPublishVolume (which returns it) and ControllerUnpublishVolume.
    #[arg(long)]
    controller_publish: bool,
    /// With --controller: advertise LIST_VOLUMES and LIST_VOLUMES_PUBLISHED_NODES and serve
    /// ListVolumes.
    #[arg(long)]
    list_volumes: bool,
    /// With --list-volumes: at most this many entries a ListVolumes page, whatever
    /// max_entries asks.
    #[arg(long, value_name = "N")]
    list_volumes_page: Option<usize>,
    /// Report volume conditions: with --controller advertise VOLUME_CONDITION and GET_VOLUME,
    /// serve ControllerGetVolume and put conditions into ListVolumes; with the node capability
    /// GET_VOLUME_STATS advertise the node's VOLUME_CONDITION and put them into
    /// NodeGetVolumeStats.
    #[arg(long)]
    volume_condition: bool,
    /// Leave the condition out for a healthy volume instead of reporting abnormal: false.
    #[arg(long)]
    omit_healthy_condition: bool,
    /// A volume reported abnormal with this message (repeatable): `ID=MESSAGE`.
    #[arg(long = "abnormal-volume", value_name = "ID=MESSAGE", value_parser = parse_abnormal)]
    abnormal_volumes: Vec<(String, String)>,
    /// Volume conditions from this file, read again every second while the driver runs: one
    /// `ID=MESSAGE` line per abnormal volume, every other volume healthy (a missing file: all
    /// healthy; volumes of --abnormal-volume stay abnormal until the file names them or stops
    /// naming them). Turns volumes abnormal and back from outside, in a cluster.
    #[arg(long, value_name = "PATH")]
    conditions_file: Option<PathBuf>,
    /// With --controller: advertise EXPAND_VOLUME and serve ControllerExpandVolume.
    #[arg(long)]
    controller_expand: bool,
    /// ControllerExpandVolume answers node_expansion_required = true.
    #[arg(long)]
    node_expansion_required: bool,
    /// With --controller: advertise MODIFY_VOLUME and serve ControllerModifyVolume (a mutable
    /// parameter named `invalid` is INVALID_ARGUMENT).
    #[arg(long)]
    controller_modify: bool,
    /// With --controller: advertise CREATE_DELETE_SNAPSHOT, LIST_SNAPSHOTS and GET_SNAPSHOT,
    /// serve them (a snapshot copies its volume's directory) and restore volumes from them.
    #[arg(long)]
    snapshots: bool,
    /// A new snapshot answers ready_to_use: false this many times before it is ready.
    #[arg(long, default_value_t = 0)]
    snapshot_ready_after: u32,
    /// Serve the GroupController (volume group snapshots) and list GROUP_CONTROLLER_SERVICE;
    /// with --snapshots the members show in ListSnapshots and restore like any snapshot.
    #[arg(long)]
    group_snapshots: bool,
    /// A new volume group snapshot (and its members) answers ready_to_use: false this many
    /// times (CreateVolumeGroupSnapshot or GetVolumeGroupSnapshot) before it is ready.
    #[arg(long, value_name = "N", default_value_t = 0)]
    group_snapshot_ready_after: u32,
    /// With --controller: advertise CLONE_VOLUME and clone volumes (copying their directory).
    #[arg(long)]
    clone_volume: bool,
    /// A restore or clone asking for less than its source holds: refuse (OUT_OF_RANGE), grow
    /// (the volume quietly gets the source's size) or accept (the volume gets the smaller size:
    /// wrong, like csi-test's mock driver).
    #[arg(long, value_enum, default_value_t = SmallerThan::Refuse)]
    smaller_than_source: SmallerThan,
    /// Check the paths the CO must provide before the volume, as csi-test's mock driver and
    /// csi-driver-host-path do: a staging_target_path that does not exist, or a target_path whose
    /// parent does not exist, is INTERNAL.
    #[arg(long)]
    strict_paths: bool,
    /// A pre-provisioned volume id (repeatable).
    #[arg(long = "volume", value_name = "ID", value_parser = parse_volume_id)]
    volumes: Vec<String>,
    /// Where volumes live [default: the socket path + ".volumes"].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Keep the volumes in the data dir, as a real driver's backing store: instances sharing it
    /// (controller and node plugins, a restarted driver) see the same volumes, the volume id is
    /// the CreateVolume name, and stopping leaves the mounts to the container orchestrator.
    #[arg(long)]
    persistent: bool,
    /// bind: bind mounts; directory: plain directories; auto: bind mounts when root.
    #[arg(long, value_enum, default_value_t = Mount::Auto)]
    mount: Mount,
    /// CreateVolume refuses more bytes than this with OUT_OF_RANGE (0: no limit).
    #[arg(long, default_value_t = 0)]
    max_capacity: i64,
    /// With --controller: a storage pool of this many bytes for the node's --topology segment;
    /// advertise GET_CAPACITY, answer what the pool has left, and refuse a CreateVolume the
    /// pool cannot hold (RESOURCE_EXHAUSTED).
    #[arg(long)]
    capacity: Option<i64>,
    /// A file holding the size in bytes of the node's pool, read at every GetCapacity and
    /// CreateVolume (overrides --capacity while it is readable); advertises GET_CAPACITY.
    #[arg(long)]
    capacity_file: Option<PathBuf>,
    /// GetCapacity's maximum_volume_size; CreateVolume refuses larger volumes (OUT_OF_RANGE).
    #[arg(long)]
    maximum_volume_size: Option<i64>,
    /// Make a method misbehave (repeatable): `METHOD:KEY=VALUE,...` with keys
    /// `delay` (e.g. 200ms), `delay-first` (N), `code` (name or number), `message`,
    /// `fail-first` (N) and the flag `hang`. Example: `NodeStageVolume:code=RESOURCE_EXHAUSTED,fail-first=2`.
    #[arg(long = "fault", value_name = "SPEC", value_parser = parse_fault)]
    faults: Vec<(Method, Fault)>,
    /// Wait this long before creating the socket.
    #[arg(long, value_parser = humantime::parse_duration)]
    start_delay: Option<Duration>,
    /// Append a line for every call answered to this file: `<start µs> <end µs> <method>`
    /// (microseconds since the Unix epoch), for a benchmark that lines the driver's time up
    /// with the API server's audit log. Drivers may share the file.
    #[arg(long, value_name = "PATH")]
    call_log: Option<PathBuf>,
}

impl Args {
    fn socket(&self) -> anyhow::Result<PathBuf> {
        match (&self.socket, &self.endpoint) {
            (Some(path), None) => Ok(path.clone()),
            (None, Some(address)) => Ok(plugreg_transport::parse_address(address)?),
            _ => bail!("one of --socket or --endpoint is required"),
        }
    }

    fn config(&self) -> anyhow::Result<DriverConfig> {
        let failure = |msg: &Option<String>, code| {
            msg.as_ref()
                .map(|m| Failure::new(Code::from_i32(code), m.clone()))
        };
        Ok(DriverConfig {
            name: self.name.clone(),
            vendor_version: self.vendor_version.clone(),
            accessibility_constraints: self.accessibility_constraints,
            node_id: self.node_id.clone(),
            topology: parse_topology(&self.topology)?,
            max_volumes_per_node: self.max_volumes,
            get_plugin_info: Fault {
                delay: self.get_plugin_info_delay,
                delay_first: self.get_plugin_info_delay_first,
                error: failure(&self.get_plugin_info_error, self.get_plugin_info_error_code),
                fail_first: self.get_plugin_info_fail_first,
                ..Fault::default()
            },
            node_get_info: Fault {
                delay: self.node_get_info_delay,
                error: failure(&self.node_get_info_error, self.node_get_info_error_code),
                hang: self.node_get_info_hang,
                ..Fault::default()
            },
            node_capabilities: self.node_capabilities.clone(),
            controller: self.controller,
            controller_publish: self.controller_publish,
            list_volumes: self.list_volumes,
            list_volumes_page: self.list_volumes_page,
            volume_condition: self.volume_condition,
            omit_healthy_condition: self.omit_healthy_condition,
            conditions: {
                let c = Conditions::default();
                for (id, message) in &self.abnormal_volumes {
                    c.set(id.clone(), Some(message));
                }
                c
            },
            strict_paths: self.strict_paths,
            volumes: self.volumes.clone(),
            data_dir: self.data_dir.clone(),
            persistent: self.persistent,
            mount: match self.mount {
                Mount::Auto => MountMode::Auto,
                Mount::Bind => MountMode::Bind,
                Mount::Directory => MountMode::Directory,
            },
            max_capacity: self.max_capacity,
            faults: self.faults.iter().cloned().collect(),
            controller_expand: self.controller_expand,
            node_expansion_required: self.node_expansion_required,
            controller_modify: self.controller_modify,
            snapshots: self.snapshots,
            snapshot_ready_after: self.snapshot_ready_after,
            group_snapshots: self.group_snapshots,
            group_ready_after: self.group_snapshot_ready_after,
            clone_volume: self.clone_volume,
            smaller_than_source: match self.smaller_than_source {
                SmallerThan::Refuse => SmallerThanSource::Refuse,
                SmallerThan::Grow => SmallerThanSource::Grow,
                SmallerThan::Accept => SmallerThanSource::Accept,
            },
            capacity: {
                let c = Capacity::default();
                if let Some(bytes) = self.capacity {
                    c.set(parse_topology(&self.topology)?, bytes);
                }
                c.set_volume_size_limits(None, self.maximum_volume_size);
                c
            },
            capacity_file: self.capacity_file.clone(),
            call_log: match &self.call_log {
                Some(path) => Some(
                    CallLog::open(path)
                        .with_context(|| format!("opening the call log {}", path.display()))?,
                ),
                None => None,
            },
            ..DriverConfig::default()
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SmallerThan {
    Refuse,
    Grow,
    Accept,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Mount {
    Auto,
    Bind,
    Directory,
}

fn parse_node_capability(s: &str) -> Result<NodeCapability, String> {
    NodeCapability::from_str_name(s)
        .filter(|c| *c != NodeCapability::Unknown)
        .ok_or_else(|| format!("unknown node capability {s:?}"))
}

fn parse_volume_id(s: &str) -> Result<String, String> {
    if valid_volume_id(s) {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "invalid volume id {s:?}: 1-128 bytes, no '/', not '.' or '..'"
        ))
    }
}

/// `ID=MESSAGE` (see `--abnormal-volume`); the message may be empty.
fn parse_abnormal(s: &str) -> Result<(String, String), String> {
    let (id, message) = s
        .split_once('=')
        .ok_or_else(|| format!("expected ID=MESSAGE, got {s:?}"))?;
    Ok((parse_volume_id(id)?, message.to_owned()))
}

const CODES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

fn parse_code(s: &str) -> Result<Code, String> {
    let n = match s.parse::<i32>() {
        Ok(n) => n,
        Err(_) => CODES
            .iter()
            .position(|c| c.eq_ignore_ascii_case(s))
            .map(|i| i as i32)
            .ok_or_else(|| format!("unknown gRPC code {s:?}"))?,
    };
    if (1..=16).contains(&n) {
        Ok(Code::from_i32(n))
    } else {
        Err(format!("gRPC code {s:?} is not an error code (1-16)"))
    }
}

/// `METHOD:KEY=VALUE,...` (see `--fault`).
fn parse_fault(s: &str) -> Result<(Method, Fault), String> {
    let (name, spec) = s.split_once(':').unwrap_or((s, ""));
    let method = Method::from_name(name).ok_or_else(|| format!("unknown method {name:?}"))?;
    let mut fault = Fault::default();
    let mut code = None;
    let mut message = None;
    let number = |v: &str| v.parse::<u64>().map_err(|e| format!("{v:?}: {e}"));
    for item in spec.split(',').filter(|i| !i.is_empty()) {
        let (k, v) = item.split_once('=').unwrap_or((item, ""));
        match k {
            "delay" => {
                fault.delay = Some(humantime::parse_duration(v).map_err(|e| format!("{v:?}: {e}"))?)
            }
            "delay-first" => fault.delay_first = Some(number(v)?),
            "fail-first" => fault.fail_first = Some(number(v)?),
            "code" => code = Some(parse_code(v)?),
            "message" => message = Some(v.to_owned()),
            "hang" if v.is_empty() => fault.hang = true,
            _ => return Err(format!("unknown fault setting {item:?}")),
        }
    }
    if code.is_some() || message.is_some() {
        fault.error = Some(Failure::new(
            code.unwrap_or(Code::Internal),
            message.unwrap_or_else(|| format!("injected {name} failure")),
        ));
    }
    Ok((method, fault))
}

/// Prints one JSON line; a closed stdout is not an error (the reader may be gone).
fn emit(value: serde_json::Value) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}").and_then(|()| out.flush());
}

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let result = runtime.block_on(run());
    // A connection a client kept open past the grace period still has its stream tasks on the
    // runtime; dropping the runtime drops them in an order h2 asserts against ("assertion
    // failed: self.slab.is_empty()", hyperium/h2#417: a panic at exit). The socket is gone
    // and the mounts are undone by now; the process ends here, so the runtime is left to it.
    std::mem::forget(runtime);
    result
}

async fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let socket = args.socket()?;
    let config = args.config()?;
    let token = CancellationToken::new();

    let mut signals = Signals::new().context("SIGTERM/SIGINT handlers")?;
    tokio::spawn({
        let token = token.clone();
        async move {
            signals.shutdown().await;
            token.cancel();
        }
    });

    if let Some(delay) = args.start_delay {
        tokio::select! {
            _ = token.cancelled() => return Ok(()),
            _ = tokio::time::sleep(delay) => {}
        }
    }

    let mut calls = config.calls.subscribe();
    tokio::spawn(async move {
        while let Ok(call) = calls.recv().await {
            emit(serde_json::json!({
                "event": "call",
                "method": call.method.as_str(),
                "number": call.number,
                "delay_ms": call.delay.map(|d| d.as_millis() as u64),
                "error": call.error.as_ref().map(|e| e.message.clone()),
                "code": call.error.map(|e| e.code as i32),
                "hang": call.hang,
            }));
        }
    });

    if let Some(path) = args.conditions_file.clone() {
        tokio::spawn(follow_conditions(
            path,
            config.conditions.clone(),
            token.clone(),
        ));
    }

    let bound = plugreg_transport::bind(&socket)
        .with_context(|| format!("creating {}", socket.display()))?;
    emit(serde_json::json!({"event": "listening", "socket": socket}));
    plugreg_csi_test_driver::serve_bound(config, bound, token).await?;
    emit(serde_json::json!({"event": "stopped", "socket": socket}));
    Ok(())
}

/// The abnormal volumes a conditions file names (`ID=MESSAGE` lines; blank lines and lines
/// without `=` are skipped).
fn read_conditions(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(id, m)| (id.trim().to_owned(), m.to_owned()))
        .filter(|(id, _)| !id.is_empty())
        .collect()
}

/// Applies `path` to `conditions` every second until `stop`: what it names turns abnormal,
/// what it stopped naming turns healthy.
async fn follow_conditions(path: PathBuf, conditions: Conditions, stop: CancellationToken) {
    let mut applied: BTreeMap<String, String> = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        let wanted = match tokio::fs::read_to_string(&path).await {
            Ok(text) => read_conditions(&text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => {
                emit(serde_json::json!({"event": "conditions-file", "error": e.to_string()}));
                continue;
            }
        };
        for id in applied.keys().filter(|id| !wanted.contains_key(*id)) {
            conditions.set(id.clone(), None);
        }
        for (id, message) in &wanted {
            if applied.get(id) != Some(message) {
                conditions.set(id.clone(), Some(message));
            }
        }
        applied = wanted;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conditions_file_names_the_abnormal_volumes() {
        let c = read_conditions("vol-a=disk gone\n\nno equals sign\n vol-b =x=y\n=orphan\n");
        assert_eq!(
            c.into_iter().collect::<Vec<_>>(),
            [
                ("vol-a".to_owned(), "disk gone".to_owned()),
                ("vol-b".to_owned(), "x=y".to_owned()),
            ]
        );
    }

    #[test]
    fn parses_fault_specs() {
        let (m, f) = parse_fault("NodeStageVolume:code=RESOURCE_EXHAUSTED,fail-first=2").unwrap();
        assert_eq!(m, Method::NodeStageVolume);
        assert_eq!(f.fail_first, Some(2));
        assert_eq!(f.error.unwrap().code, Code::ResourceExhausted);

        let (m, f) = parse_fault("CreateVolume:delay=250ms,delay-first=1,hang").unwrap();
        assert_eq!(m, Method::CreateVolume);
        assert_eq!(f.delay, Some(Duration::from_millis(250)));
        assert_eq!(f.delay_first, Some(1));
        assert!(f.hang);
        assert_eq!(f.error, None);

        let (_, f) = parse_fault("Probe:code=9,message=not yet").unwrap();
        let e = f.error.unwrap();
        assert_eq!(
            (e.code, e.message.as_str()),
            (Code::FailedPrecondition, "not yet")
        );
        // A message alone fails with INTERNAL.
        let (_, f) = parse_fault("NodeGetInfo:message=x").unwrap();
        assert_eq!(f.error.unwrap().code, Code::Internal);
        // The GroupController's methods misbehave the same way.
        let (m, f) = parse_fault("CreateVolumeGroupSnapshot:code=ABORTED,fail-first=1").unwrap();
        assert_eq!(m, Method::CreateVolumeGroupSnapshot);
        assert_eq!(f.fail_first, Some(1));
        // A method alone: no misbehaviour.
        assert_eq!(parse_fault("Probe").unwrap().1, Fault::default());

        for bad in [
            "NoSuchMethod:hang",
            "Probe:code=OK",
            "Probe:code=17",
            "Probe:code=NOPE",
            "Probe:delay=soon",
            "Probe:fail-first=-1",
            "Probe:hang=yes",
            "Probe:colour=blue",
        ] {
            assert!(parse_fault(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn parses_capabilities_and_volume_ids() {
        assert_eq!(
            parse_node_capability("STAGE_UNSTAGE_VOLUME").unwrap(),
            NodeCapability::StageUnstageVolume
        );
        assert!(parse_node_capability("UNKNOWN").is_err());
        assert!(parse_node_capability("stage").is_err());
        assert_eq!(parse_volume_id("vol-1").unwrap(), "vol-1");
        assert_eq!(
            parse_abnormal("vol-1=disk gone").unwrap(),
            ("vol-1".to_owned(), "disk gone".to_owned())
        );
        assert_eq!(parse_abnormal("vol-1=").unwrap().1, "");
        for bad in ["vol-1", "=x", "a/b=x"] {
            assert!(parse_abnormal(bad).is_err(), "{bad:?}");
        }
        for bad in ["", ".", "..", "a/b", &"x".repeat(129)] {
            assert!(parse_volume_id(bad).is_err(), "{bad:?}");
        }
    }
}
