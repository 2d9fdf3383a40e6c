//! The driver check for driver authors (decision C2): runs a driver's Identity and Node
//! services through the kubelet's sequence in a directory of the caller's (a temp dir), and
//! reports each step: pass, fail with the gRPC status, or skipped by capability.
//!
//! The check follows the CSI spec (v1.12.0, docs/upstream/csi-wire.md §1.12) strictly, no more: a missing
//! required argument must be INVALID_ARGUMENT, an unknown volume NOT_FOUND, stage, publish,
//! unpublish, unstage and DeleteVolume must succeed when repeated, unstaging or unpublishing
//! something no longer there must be OK. Every call is made once (no retry), so a driver's
//! transient errors show. The volume comes from the driver's Controller service when it
//! offers CREATE_DELETE_VOLUME (and is deleted after), otherwise from the caller.
//!
//! When the Controller offers CREATE_DELETE_SNAPSHOT (and LIST_SNAPSHOTS, GET_SNAPSHOT,
//! CLONE_VOLUME), the check snapshots its volume, repeats CreateSnapshot until the snapshot is
//! ready (a few seconds at most), as csi-snapshotter polls, lists and gets it, restores a volume
//! from it and clones one from the volume (each response must name its content source, which
//! csi-provisioner requires), and deletes them all. The restore and the clone ask for what a
//! claim must: at least what the source holds (the snapshot's `size_bytes`, the volume's
//! capacity after the expansion step), as csi-provisioner refuses smaller claims. A request
//! smaller than the source is checked as its own step: the driver must refuse it (OUT_OF_RANGE,
//! the spec's code for it, or INVALID_ARGUMENT); growing the volume quietly, or making it
//! smaller than its data, fails.
//!
//! When the Controller offers GET_CAPACITY, the check asks GetCapacity as csi-provisioner's
//! capacity tracking does, for the whole driver and for the node's topology segment: OK, no
//! negative size, the minimum volume size no larger than the maximum.
//!
//! When the driver offers VOLUME_CONDITION, the check asks for its volume's condition as
//! csi-external-health-monitor-controller (Controller) and the kubelet's volume health (Node) do:
//! ControllerGetVolume (with GET_VOLUME) must return the volume asked for with a status, an
//! empty volume_id being INVALID_ARGUMENT and an unknown one NOT_FOUND; ListVolumes (with
//! LIST_VOLUMES) must list the volume, every entry with a volume and a status, its pages ending;
//! NodeGetVolumeStats (with GET_VOLUME_STATS) of the published volume must answer. A missing
//! condition passes (the health monitor takes it as healthy) and shows as "no condition"; an
//! abnormal one passes too, with its message: the check cannot know the volume's health.
//!
//! When the Controller offers PUBLISH_UNPUBLISH_VOLUME, the check calls ControllerPublishVolume
//! before any node call with the volume and ControllerUnpublishVolume after NodeUnstageVolume,
//! as the spec makes the CO do, and hands the publish_context to the node calls. The
//! missing-argument probes use the real volume's id, so only the argument under test is
//! missing: the spec does not order "argument missing" before "volume unknown".
//!
//! Every call is made as the kubelet (`pkg/volume/csi`, v1.20 to v1.36) makes it, so that only
//! a wrong driver fails:
//! * the paths are the kubelet's ([`KubeletLayout`]) under the check's directory;
//! * before NodeStageVolume the staging directory exists (`MountDevice` makes it, mode 0750, and
//!   writes `vol_data.json` above it, whether or not the driver stages), and before
//!   NodePublishVolume the target's parent exists (`SetUp` makes it, with its `vol_data.json`);
//!   the target itself is the driver's to make. The error-code probes get such paths too: a
//!   driver may look at the paths before the volume (csi-test's mock and csi-driver-host-path
//!   do), and the kubelet never sends a staging path that does not exist;
//! * after NodeUnpublishVolume the target, its `vol_data.json` and its parent are removed, after
//!   NodeUnstageVolume (or without STAGE_UNSTAGE_VOLUME, at the same point) the staging directory
//!   and its parent (`removeMountDir`); a target still mounted then fails the step;
//! * NodeStageVolume and NodeUnstageVolume only with STAGE_UNSTAGE_VOLUME (publish then gets no
//!   staging path), NodeGetVolumeStats only with GET_VOLUME_STATS and with the target as
//!   volume_path and no staging path, NodeExpandVolume only with EXPAND_VOLUME, with the target
//!   and (when staging) the staging path;
//! * a ReadWriteOnce volume is SINGLE_NODE_MULTI_WRITER for a driver whose Node (for node calls)
//!   or Controller (for CreateVolume and ControllerPublishVolume, as the provisioner and attacher
//!   map it) advertises SINGLE_NODE_MULTI_WRITER, SINGLE_NODE_WRITER otherwise; no
//!   volume_mount_group (a pod without fsGroup).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use plugreg_proto::csi::v1::{
    CapacityRange, ControllerExpandVolumeRequest, ControllerGetVolumeRequest,
    ControllerModifyVolumeRequest, ControllerPublishVolumeRequest,
    ControllerUnpublishVolumeRequest, CreateSnapshotRequest, CreateVolumeRequest,
    DeleteSnapshotRequest, DeleteVolumeRequest, GetCapacityRequest, GetSnapshotRequest,
    ListSnapshotsRequest, ListVolumesRequest, NodeExpandVolumeRequest, NodeGetVolumeStatsRequest,
    NodePublishVolumeRequest, NodeStageVolumeRequest, NodeUnpublishVolumeRequest,
    NodeUnstageVolumeRequest, Topology, VolumeCapability, VolumeCondition, VolumeContentSource,
    controller_service_capability, node_service_capability, plugin_capability,
    volume_content_source, volume_usage,
};
use serde::Serialize;
use tonic::Code;

use crate::client::{CallError, Connection, Retry};
use crate::layout::{KubeletLayout, make_volume_dir, remove_mount_dir};
use crate::node::{AccessMode, NodeCapability, VolumeSpec};

/// The pod and volume names of the check's publish paths.
const CHECK_POD: &str = "plugreg-check-pod";
const CHECK_VOLUME: &str = "plugreg-check-volume";
const PROBE_POD: &str = "plugreg-check-probe-pod";
/// The node name written into `vol_data.json`, as the kubelet writes its own.
const CHECK_NODE: &str = "plugreg-check";

/// What the check runs against.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// The driver's socket (Identity and Node).
    pub endpoint: String,
    /// The Controller's socket, when not `endpoint`.
    pub controller_endpoint: Option<String>,
    /// The volume to use when the driver cannot create one.
    pub volume_id: Option<String>,
    /// A directory of the caller's, used as the kubelet root (it should be empty).
    pub root: PathBuf,
    /// Limit for dialing.
    pub dial_timeout: Duration,
    /// Limit for each call.
    pub call_timeout: Duration,
    /// Size asked of CreateVolume; NodeExpandVolume asks for twice as much.
    pub capacity_bytes: i64,
    /// The volume_context of `volume_id` (a created volume uses CreateVolume's).
    pub volume_context: BTreeMap<String, String>,
    /// publish_context for the node calls when no Controller publishes the volume; what
    /// ControllerPublishVolume returns is added over it.
    pub publish_context: BTreeMap<String, String>,
}

/// How one step went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// As the spec requires.
    Pass,
    /// Not as the spec requires.
    Fail,
    /// Not run: the driver does not advertise what it needs.
    Skip,
}

/// One step's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StepReport {
    /// What was done, e.g. `NodeStageVolume repeated`.
    pub step: String,
    /// Pass, fail or skip.
    pub outcome: Outcome,
    /// The gRPC code the driver answered with (`OK` for success), when a call was made.
    pub code: Option<String>,
    /// Why it failed or was skipped, or what was found.
    pub detail: String,
}

/// The whole check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The endpoint checked.
    pub endpoint: String,
    /// The driver's name, once known.
    pub driver: Option<String>,
    /// The steps in order.
    pub steps: Vec<StepReport>,
}

impl Report {
    /// Whether every step passed or was skipped, and at least one passed.
    pub fn passed(&self) -> bool {
        self.steps.iter().all(|s| s.outcome != Outcome::Fail)
            && self.steps.iter().any(|s| s.outcome == Outcome::Pass)
    }

    /// The steps that failed.
    pub fn failures(&self) -> impl Iterator<Item = &StepReport> {
        self.steps.iter().filter(|s| s.outcome == Outcome::Fail)
    }

    fn push(
        &mut self,
        step: impl Into<String>,
        outcome: Outcome,
        code: Option<Code>,
        detail: impl Into<String>,
    ) {
        self.steps.push(StepReport {
            step: step.into(),
            outcome,
            code: code.map(code_name),
            detail: detail.into(),
        });
    }

    fn skip(&mut self, step: impl Into<String>, why: impl Into<String>) {
        self.push(step, Outcome::Skip, None, why);
    }

    /// Records a call that had to succeed; returns its answer when it did.
    fn expect_ok<T>(&mut self, step: impl Into<String>, r: Result<T, CallError>) -> Option<T> {
        match r {
            Ok(v) => {
                self.push(step, Outcome::Pass, Some(Code::Ok), "");
                Some(v)
            }
            Err(e) => {
                let code = e.code();
                self.push(step, Outcome::Fail, code, error_text(&e));
                None
            }
        }
    }

    /// Records a call that had to fail with `want`.
    fn expect_code<T>(&mut self, step: impl Into<String>, want: Code, r: Result<T, CallError>) {
        self.expect_any(step, &[want], r);
    }

    /// Records a call that had to fail with one of `want`.
    fn expect_any<T>(&mut self, step: impl Into<String>, want: &[Code], r: Result<T, CallError>) {
        let step = step.into();
        let wanted = want
            .iter()
            .map(|&c| code_name(c))
            .collect::<Vec<_>>()
            .join(" or ");
        match r {
            Ok(_) => self.push(
                step,
                Outcome::Fail,
                Some(Code::Ok),
                format!("succeeded; the spec requires {wanted}"),
            ),
            Err(e) if e.code().is_some_and(|c| want.contains(&c)) => {
                let code = e.code();
                self.push(step, Outcome::Pass, code, "")
            }
            Err(e) => {
                let code = e.code();
                self.push(
                    step,
                    Outcome::Fail,
                    code,
                    format!("the spec requires {wanted}; got: {}", error_text(&e)),
                )
            }
        }
    }
}

/// The spec's name of a gRPC code, e.g. `INVALID_ARGUMENT`.
pub fn code_name(c: Code) -> String {
    let s = format!("{c:?}");
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if ch.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    if c == Code::Ok { "OK".into() } else { out }
}

fn error_text(e: &CallError) -> String {
    match e {
        CallError::Rpc { status, .. } => plugreg_runtime::report::grpc(status),
        other => other.to_string(),
    }
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Runs the check. Never panics on what a driver answers; every problem becomes a failed step.
pub async fn run(opts: &CheckOptions) -> Report {
    let mut report = Report {
        endpoint: opts.endpoint.clone(),
        driver: None,
        steps: Vec::new(),
    };
    let conn = match Connection::connect(
        &opts.endpoint,
        opts.dial_timeout,
        opts.call_timeout,
        Retry::ONCE,
    )
    .await
    {
        Ok(c) => c,
        Err(e) => {
            report.push("connect", Outcome::Fail, None, error_text(&e));
            return report;
        }
    };
    let mut checker = Checker {
        conn: conn.clone(),
        controller: None,
        create: false,
        publish: false,
        controller_multi_writer: false,
        expand: false,
        modify: false,
        snapshots: SnapshotCaps::default(),
        opts,
        node_caps: Vec::new(),
        node_id: None,
        node_topology: std::collections::HashMap::new(),
        get_capacity: false,
        volume_condition: false,
        get_volume: false,
        list_volumes: false,
        volume_bytes: opts.capacity_bytes,
        volume_floor: opts.capacity_bytes,
    };
    checker.identity(&mut report).await;
    checker.node_info(&mut report).await;
    checker.controller(&mut report).await;
    checker.capacity(&mut report).await;
    let mut volume = checker.volume(&mut report).await;
    // The CO publishes before any node call with the volume (docs/upstream/csi-wire.md §1.12).
    let published = match &mut volume {
        Some((spec, _)) => checker.controller_publish(&mut report, spec).await,
        None => false,
    };
    if let Some((spec, _)) = &volume {
        checker.controller_conditions(&mut report, spec).await;
    }
    let driver = path_driver_name(report.driver.as_deref());
    checker
        .required_codes(&mut report, volume.as_ref().map(|(s, _)| s), &driver)
        .await;
    if let Some((spec, created)) = volume {
        if published {
            checker.sequence(&mut report, &spec, &driver).await;
            checker.controller_unpublish(&mut report, &spec).await;
        } else {
            report.skip(
                "NodeStageVolume to NodeUnstageVolume",
                "ControllerPublishVolume failed; the spec requires it first",
            );
        }
        checker.expand_and_modify(&mut report, &spec).await;
        checker.snapshots_and_clones(&mut report, &spec).await;
        if created {
            checker.delete(&mut report, &spec.volume_id).await;
        }
    }
    remove_empty_parents(&opts.root, &driver);
    report
}

/// The driver name for paths: a driver with an invalid name already failed GetPluginInfo, and
/// its paths still need one.
fn path_driver_name(name: Option<&str>) -> String {
    match name {
        Some(n) if crate::name::check_driver_name(n).is_ok() => n.to_owned(),
        _ => "unnamed.driver".into(),
    }
}

/// The directories above the volumes' own, which the kubelet keeps for the node's life (the
/// driver's directory) or removes with the pod: gone once empty, so the check leaves its
/// directory as it found it.
fn remove_empty_parents(root: &Path, driver: &str) {
    let csi = root.join("plugins/kubernetes.io/csi");
    let mut dirs = vec![
        csi.join(driver),
        csi,
        root.join("plugins/kubernetes.io"),
        root.join("plugins"),
    ];
    for pod in [CHECK_POD, PROBE_POD] {
        let pod = root.join("pods").join(pod);
        dirs.splice(
            0..0,
            [
                pod.join("volumes/kubernetes.io~csi"),
                pod.join("volumes"),
                pod,
            ],
        );
    }
    dirs.push(root.join("pods"));
    for d in dirs {
        let _ = std::fs::remove_dir(d);
    }
}

/// The snapshot and clone capabilities a Controller offers.
#[derive(Debug, Clone, Copy, Default)]
struct SnapshotCaps {
    create: bool,
    list: bool,
    get: bool,
    clone: bool,
}

struct Checker<'a> {
    conn: Connection,
    /// The Controller connection, when it offers CREATE_DELETE_VOLUME or
    /// PUBLISH_UNPUBLISH_VOLUME.
    controller: Option<Connection>,
    /// The Controller offers CREATE_DELETE_VOLUME.
    create: bool,
    /// The Controller offers PUBLISH_UNPUBLISH_VOLUME.
    publish: bool,
    /// The Controller offers SINGLE_NODE_MULTI_WRITER.
    controller_multi_writer: bool,
    /// The Controller offers EXPAND_VOLUME.
    expand: bool,
    /// The Controller offers MODIFY_VOLUME.
    modify: bool,
    /// The Controller offers CREATE_DELETE_SNAPSHOT, LIST_SNAPSHOTS, GET_SNAPSHOT and
    /// CLONE_VOLUME.
    snapshots: SnapshotCaps,
    opts: &'a CheckOptions,
    node_caps: Vec<i32>,
    /// NodeGetInfo's node_id, when valid.
    node_id: Option<String>,
    /// NodeGetInfo's accessible_topology segments (empty: none reported).
    node_topology: std::collections::HashMap<String, String>,
    /// The Controller offers GET_CAPACITY.
    get_capacity: bool,
    /// The Controller offers VOLUME_CONDITION, GET_VOLUME and LIST_VOLUMES.
    volume_condition: bool,
    get_volume: bool,
    list_volumes: bool,
    /// The size a claim restored or cloned from the check's volume asks for: the most that was
    /// asked of it or reported for it (CreateVolume, ControllerExpandVolume, NodeExpandVolume),
    /// as a claim asks for at least its source's request.
    volume_bytes: i64,
    /// The least the check's volume surely holds: CreateVolume's `capacity_bytes` (or what was
    /// asked, when it reports none), raised by ControllerExpandVolume. A request for half of
    /// it is surely smaller than the volume, whatever the driver did with NodeExpandVolume.
    volume_floor: i64,
}

/// A ReadWriteOnce volume's capability as the kubelet (`multi_writer`: the Node advertises
/// SINGLE_NODE_MULTI_WRITER) or the provisioner and attacher (the Controller does) send it.
fn rwo_capability(multi_writer: bool) -> VolumeCapability {
    let mut spec = VolumeSpec::new("x");
    spec.access_mode = rwo_mode(multi_writer);
    spec.capability(false)
}

fn rwo_mode(multi_writer: bool) -> AccessMode {
    if multi_writer {
        AccessMode::SingleNodeMultiWriter
    } else {
        AccessMode::SingleNodeWriter
    }
}

impl Checker<'_> {
    fn has(&self, c: NodeCapability) -> bool {
        self.node_caps.contains(&(c as i32))
    }

    /// The capability of the node calls for the volume `spec`.
    fn node_capability(&self, spec: &VolumeSpec) -> VolumeCapability {
        let mut spec = spec.clone();
        spec.access_mode = rwo_mode(self.has(NodeCapability::SingleNodeMultiWriter));
        spec.capability(false)
    }

    /// The capability of the probes' node calls.
    fn probe_capability(&self) -> VolumeCapability {
        rwo_capability(self.has(NodeCapability::SingleNodeMultiWriter))
    }

    async fn identity(&mut self, report: &mut Report) {
        let c = &self.conn;
        let r = c.probe().await;
        if let Some(p) = report.expect_ok("Probe", r)
            && p.ready == Some(false)
        {
            let last = report.steps.last_mut().expect("just pushed");
            last.outcome = Outcome::Fail;
            last.detail = "ready is false: the driver is still starting".into();
        }
        let r = c.get_plugin_info().await;
        if let Some(info) = report.expect_ok("GetPluginInfo", r) {
            let last = report.steps.last_mut().expect("just pushed");
            if let Err(e) = crate::name::check_driver_name(&info.name) {
                last.outcome = Outcome::Fail;
                last.detail = e.to_string();
            } else if info.vendor_version.is_empty() {
                last.outcome = Outcome::Fail;
                last.detail = "vendor_version is required".into();
            } else {
                last.detail = format!("{} {}", info.name, info.vendor_version);
                report.driver = Some(info.name);
            }
        }
        let r = c.get_plugin_capabilities().await;
        if let Some(caps) = report.expect_ok("GetPluginCapabilities", r) {
            let controller = caps.capabilities.iter().any(|c| {
                matches!(&c.r#type, Some(plugin_capability::Type::Service(s))
                    if s.r#type == plugin_capability::service::Type::ControllerService as i32)
            });
            if controller && self.opts.controller_endpoint.is_none() {
                self.controller = Some(self.conn.clone());
            }
        }
    }

    async fn node_info(&mut self, report: &mut Report) {
        let c = &self.conn;
        let r = c.node_get_capabilities().await;
        if let Some(caps) = report.expect_ok("NodeGetCapabilities", r) {
            self.node_caps = caps
                .capabilities
                .iter()
                .filter_map(|c| {
                    c.r#type
                        .as_ref()
                        .map(|node_service_capability::Type::Rpc(r)| r.r#type)
                })
                .collect();
            let names: Vec<String> = self
                .node_caps
                .iter()
                .map(|&n| {
                    NodeCapability::try_from(n)
                        .map_or_else(|_| n.to_string(), |c| c.as_str_name().to_owned())
                })
                .collect();
            report.steps.last_mut().expect("just pushed").detail = names.join(", ");
        }
        let r = c.node_get_info().await;
        if let Some(info) = report.expect_ok("NodeGetInfo", r) {
            let last = report.steps.last_mut().expect("just pushed");
            if info.node_id.is_empty() || info.node_id.len() > 256 {
                last.outcome = Outcome::Fail;
                last.detail = "node_id is required (1-256 bytes)".into();
            } else {
                last.detail = format!("node_id {}", info.node_id);
                self.node_id = Some(info.node_id);
                self.node_topology = info
                    .accessible_topology
                    .map(|t| t.segments)
                    .unwrap_or_default();
            }
        }
    }

    async fn controller(&mut self, report: &mut Report) {
        if let Some(ep) = &self.opts.controller_endpoint {
            match Connection::connect(
                ep,
                self.opts.dial_timeout,
                self.opts.call_timeout,
                Retry::ONCE,
            )
            .await
            {
                Ok(c) => self.controller = Some(c),
                Err(e) => {
                    report.push("connect controller", Outcome::Fail, None, error_text(&e));
                    return;
                }
            }
        }
        let Some(c) = self.controller.take() else {
            report.skip(
                "ControllerGetCapabilities",
                "no CONTROLLER_SERVICE plugin capability",
            );
            return;
        };
        let r = c.controller_get_capabilities().await;
        if let Some(caps) = report.expect_ok("ControllerGetCapabilities", r) {
            use controller_service_capability::rpc::Type;
            let has = |t: Type| {
                caps.capabilities.iter().any(|c| {
                    matches!(&c.r#type, Some(controller_service_capability::Type::Rpc(r))
                        if r.r#type == t as i32)
                })
            };
            self.create = has(Type::CreateDeleteVolume);
            self.publish = has(Type::PublishUnpublishVolume);
            self.controller_multi_writer = has(Type::SingleNodeMultiWriter);
            self.expand = has(Type::ExpandVolume);
            self.modify = has(Type::ModifyVolume);
            self.get_capacity = has(Type::GetCapacity);
            self.volume_condition = has(Type::VolumeCondition);
            self.get_volume = has(Type::GetVolume);
            self.list_volumes = has(Type::ListVolumes);
            self.snapshots = SnapshotCaps {
                create: has(Type::CreateDeleteSnapshot),
                list: has(Type::ListSnapshots),
                get: has(Type::GetSnapshot),
                clone: has(Type::CloneVolume),
            };
            let names: Vec<&str> = [
                Type::CreateDeleteVolume,
                Type::PublishUnpublishVolume,
                Type::ExpandVolume,
                Type::ModifyVolume,
                Type::CreateDeleteSnapshot,
                Type::ListSnapshots,
                Type::GetSnapshot,
                Type::CloneVolume,
                Type::ListVolumes,
                Type::VolumeCondition,
                Type::GetVolume,
                Type::GetCapacity,
            ]
            .into_iter()
            .filter(|&t| has(t))
            .map(|t| t.as_str_name())
            .collect();
            report.steps.last_mut().expect("just pushed").detail = if names.is_empty() {
                "neither CREATE_DELETE_VOLUME nor PUBLISH_UNPUBLISH_VOLUME".into()
            } else {
                names.join(", ")
            };
            if self.create
                || self.publish
                || self.expand
                || self.modify
                || self.snapshots.create
                || self.snapshots.clone
                || self.get_capacity
                || self.volume_condition
            {
                self.controller = Some(c);
            }
        }
    }

    /// GetCapacity, when the Controller offers GET_CAPACITY, as csi-provisioner's capacity
    /// tracking asks it: for the whole driver (no topology, no parameters) and for the node's
    /// segment (NodeGetInfo's accessible_topology) with a ReadWriteOnce capability. Each answer
    /// must be OK with no negative size and a `minimum_volume_size` no larger than the
    /// `maximum_volume_size`.
    async fn capacity(&mut self, report: &mut Report) {
        let Some(c) = self.controller.clone().filter(|_| self.get_capacity) else {
            return;
        };
        let ctl = c.controller();
        let ask = |msg: GetCapacityRequest| {
            let (ctl, c) = (ctl.clone(), c.clone());
            async move {
                c.call("GetCapacity", &msg, |r| {
                    let mut ctl = ctl.clone();
                    async move { ctl.get_capacity(r).await }
                })
                .await
            }
        };
        let node = GetCapacityRequest {
            volume_capabilities: vec![rwo_capability(self.controller_multi_writer)],
            accessible_topology: (!self.node_topology.is_empty()).then(|| Topology {
                segments: self.node_topology.clone(),
            }),
            ..Default::default()
        };
        for (step, msg) in [
            ("GetCapacity", GetCapacityRequest::default()),
            ("GetCapacity of the node's segment", node),
        ] {
            let Some(r) = report.expect_ok(step, ask(msg).await) else {
                continue;
            };
            let last = report.steps.last_mut().expect("just pushed");
            let (min, max) = (r.minimum_volume_size, r.maximum_volume_size);
            if r.available_capacity < 0 || min.is_some_and(|m| m < 0) || max.is_some_and(|m| m < 0)
            {
                last.outcome = Outcome::Fail;
                last.detail = format!(
                    "negative size: available_capacity {}, minimum_volume_size {min:?}, \
                     maximum_volume_size {max:?}",
                    r.available_capacity
                );
            } else if let (Some(min), Some(max)) = (min, max)
                && min > max
            {
                last.outcome = Outcome::Fail;
                last.detail =
                    format!("minimum_volume_size {min} is larger than maximum_volume_size {max}");
            } else {
                last.detail = format!(
                    "available_capacity {}{}",
                    r.available_capacity,
                    max.map(|m| format!(", maximum_volume_size {m}"))
                        .unwrap_or_default()
                );
            }
        }
    }

    /// The volume to test with, and whether the check created it.
    async fn volume(&mut self, report: &mut Report) -> Option<(VolumeSpec, bool)> {
        let Some(c) = self.controller.clone().filter(|_| self.create) else {
            report.skip(
                "CreateVolume",
                "no CREATE_DELETE_VOLUME controller capability",
            );
            return match &self.opts.volume_id {
                Some(id) => {
                    let mut spec = VolumeSpec::new(id.clone());
                    spec.volume_context = self.opts.volume_context.clone();
                    Some((spec, false))
                }
                None => {
                    report.push(
                        "volume",
                        Outcome::Fail,
                        None,
                        "no volume to test with: the driver cannot create one and no --volume-id was given",
                    );
                    None
                }
            };
        };
        let name = format!("plugreg-check-{}-{}", std::process::id(), unique());
        let msg = CreateVolumeRequest {
            name,
            capacity_range: Some(CapacityRange {
                required_bytes: self.opts.capacity_bytes,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![rwo_capability(self.controller_multi_writer)],
            ..Default::default()
        };
        let call = || c.create_volume(&msg);
        let first = report.expect_ok("CreateVolume", call().await)?;
        let Some(vol) = first.volume.filter(|v| !v.volume_id.is_empty()) else {
            let last = report.steps.last_mut().expect("just pushed");
            last.outcome = Outcome::Fail;
            last.detail = "the response has no volume id".into();
            return None;
        };
        report.steps.last_mut().expect("just pushed").detail = format!("volume {}", vol.volume_id);
        self.volume_bytes = self.volume_bytes.max(vol.capacity_bytes);
        self.volume_floor = self.volume_floor.max(vol.capacity_bytes);
        let mut spec = VolumeSpec::new(vol.volume_id.clone());
        spec.volume_context = vol.volume_context.into_iter().collect();
        if let Some(again) = report.expect_ok("CreateVolume repeated (same name)", call().await) {
            let got = again.volume.map(|v| v.volume_id).unwrap_or_default();
            if got != spec.volume_id {
                let last = report.steps.last_mut().expect("just pushed");
                last.outcome = Outcome::Fail;
                last.detail = format!(
                    "returned volume {got:?}, not {:?}: not idempotent",
                    spec.volume_id
                );
            }
        }
        Some((spec, true))
    }

    /// ControllerPublishVolume to NodeGetInfo's node, and its repeat, when the Controller
    /// offers PUBLISH_UNPUBLISH_VOLUME; its publish_context goes into `spec`. Returns whether
    /// the node calls may go ahead.
    async fn controller_publish(&mut self, report: &mut Report, spec: &mut VolumeSpec) -> bool {
        spec.publish_context = self.opts.publish_context.clone();
        // Without the capability there is no step: ControllerGetCapabilities lists what is
        // offered.
        let Some(c) = self.controller.clone().filter(|_| self.publish) else {
            return true;
        };
        let Some(node_id) = self.node_id.clone() else {
            report.push(
                "ControllerPublishVolume",
                Outcome::Fail,
                None,
                "not called: NodeGetInfo gave no node_id",
            );
            return false;
        };
        let mut controller_spec = spec.clone();
        controller_spec.access_mode = rwo_mode(self.controller_multi_writer);
        let msg = ControllerPublishVolumeRequest {
            volume_id: spec.volume_id.clone(),
            node_id,
            volume_capability: Some(controller_spec.capability(false)),
            readonly: false,
            volume_context: spec.volume_context.clone().into_iter().collect(),
            ..Default::default()
        };
        let ctl = c.controller();
        let call = || {
            c.call("ControllerPublishVolume", &msg, |r| {
                let mut ctl = ctl.clone();
                async move { ctl.controller_publish_volume(r).await }
            })
        };
        let Some(first) = report.expect_ok("ControllerPublishVolume", call().await) else {
            return false;
        };
        let mut keys: Vec<&str> = first.publish_context.keys().map(String::as_str).collect();
        keys.sort_unstable();
        report.steps.last_mut().expect("just pushed").detail =
            format!("publish_context keys: {}", keys.join(", "));
        report.expect_ok("ControllerPublishVolume repeated", call().await);
        self.controller_publish_codes(report, &msg).await;
        spec.publish_context.extend(first.publish_context);
        true
    }

    /// The error codes the spec requires of ControllerPublishVolume (what the attacher stores
    /// in `attachError` and retries): each required argument missing from an otherwise good
    /// request is INVALID_ARGUMENT, an unknown volume or node NOT_FOUND.
    async fn controller_publish_codes(
        &mut self,
        report: &mut Report,
        good: &ControllerPublishVolumeRequest,
    ) {
        let Some(c) = self.controller.clone() else {
            return;
        };
        let ctl = c.controller();
        let unknown = format!("plugreg-check-unknown-{}", unique());
        let probes: [(&str, Code, ControllerPublishVolumeRequest); 5] = [
            (
                "ControllerPublishVolume without volume_id",
                Code::InvalidArgument,
                ControllerPublishVolumeRequest {
                    volume_id: String::new(),
                    ..good.clone()
                },
            ),
            (
                "ControllerPublishVolume without node_id",
                Code::InvalidArgument,
                ControllerPublishVolumeRequest {
                    node_id: String::new(),
                    ..good.clone()
                },
            ),
            (
                "ControllerPublishVolume without volume_capability",
                Code::InvalidArgument,
                ControllerPublishVolumeRequest {
                    volume_capability: None,
                    ..good.clone()
                },
            ),
            (
                "ControllerPublishVolume of an unknown volume",
                Code::NotFound,
                ControllerPublishVolumeRequest {
                    volume_id: unknown.clone(),
                    ..good.clone()
                },
            ),
            (
                "ControllerPublishVolume to an unknown node",
                Code::NotFound,
                ControllerPublishVolumeRequest {
                    node_id: unknown,
                    ..good.clone()
                },
            ),
        ];
        for (step, want, msg) in probes {
            let r = c
                .call("ControllerPublishVolume", &msg, |r| {
                    let mut ctl = ctl.clone();
                    async move { ctl.controller_publish_volume(r).await }
                })
                .await;
            report.expect_code(step, want, r);
        }
    }

    /// ControllerUnpublishVolume from NodeGetInfo's node, and its repeat, after the node is
    /// done with the volume.
    async fn controller_unpublish(&mut self, report: &mut Report, spec: &VolumeSpec) {
        let Some(c) = self.controller.clone().filter(|_| self.publish) else {
            return;
        };
        let msg = ControllerUnpublishVolumeRequest {
            volume_id: spec.volume_id.clone(),
            node_id: self.node_id.clone().unwrap_or_default(),
            ..Default::default()
        };
        let ctl = c.controller();
        for step in [
            "ControllerUnpublishVolume",
            "ControllerUnpublishVolume repeated",
        ] {
            let r = c
                .call("ControllerUnpublishVolume", &msg, |r| {
                    let mut ctl = ctl.clone();
                    async move { ctl.controller_unpublish_volume(r).await }
                })
                .await;
            report.expect_ok(step, r);
        }
        // Every error of ControllerUnpublishVolume means "may still be attached" to the
        // attacher, which keeps retrying: a volume the driver does not know is unpublished.
        let probes = [
            (
                "ControllerUnpublishVolume without volume_id",
                Some(Code::InvalidArgument),
                ControllerUnpublishVolumeRequest {
                    volume_id: String::new(),
                    ..msg.clone()
                },
            ),
            (
                "ControllerUnpublishVolume of an unknown volume",
                None,
                ControllerUnpublishVolumeRequest {
                    volume_id: format!("plugreg-check-unknown-{}", unique()),
                    ..msg.clone()
                },
            ),
        ];
        for (step, want, msg) in probes {
            let r = c
                .call("ControllerUnpublishVolume", &msg, |r| {
                    let mut ctl = ctl.clone();
                    async move { ctl.controller_unpublish_volume(r).await }
                })
                .await;
            match want {
                Some(code) => report.expect_code(step, code, r),
                None => {
                    report.expect_ok(step, r);
                }
            }
        }
    }

    /// The kubelet's directories for a probe or the sequence: `dirs` made as `MountDevice`
    /// and `SetUp` make them (see [`make_volume_dir`]); a failure is a failed step.
    fn make_dirs(report: &mut Report, dirs: &[(&Path, Vec<(&str, &str)>)]) -> bool {
        for (dir, data) in dirs {
            if let Err(e) = make_volume_dir(dir, data) {
                report.push(
                    format!("create {}", dir.display()),
                    Outcome::Fail,
                    None,
                    e.to_string(),
                );
                return false;
            }
        }
        true
    }

    /// The codes the spec requires for missing arguments and unknown volumes. The
    /// missing-argument probes name `volume` (only the argument under test is missing); without
    /// a volume they name an unknown one and also accept NOT_FOUND, since the spec does not
    /// say which check a driver makes first. The paths are the kubelet's for the volume named,
    /// made as the kubelet makes them, and removed after.
    async fn required_codes(
        &mut self,
        report: &mut Report,
        volume: Option<&VolumeSpec>,
        driver: &str,
    ) {
        let node = self.conn.node();
        let c = &self.conn;
        let layout = KubeletLayout::new(&self.opts.root);
        let unknown = format!("plugreg-check-unknown-{}", unique());
        let stages = self.has(NodeCapability::StageUnstageVolume);
        let cap = Some(self.probe_capability());
        let (real, missing_codes, suffix): (String, &[Code], &str) = match volume {
            Some(v) => (v.volume_id.clone(), &[Code::InvalidArgument], ""),
            None => (
                unknown.clone(),
                &[Code::InvalidArgument, Code::NotFound],
                " (unknown volume: NOT_FOUND accepted)",
            ),
        };
        let paths = layout
            .staging_path(driver, &real)
            .and_then(|r| Ok((r, layout.staging_path(driver, &unknown)?)))
            .and_then(|(r, u)| Ok((r, u, layout.publish_path(PROBE_POD, CHECK_VOLUME)?)));
        let (real_staging, unknown_staging, target) = match paths {
            Ok(p) => p,
            Err(e) => {
                report.push("paths", Outcome::Fail, None, e.to_string());
                return;
            }
        };
        let target_dir = target.parent().unwrap_or(&target).to_owned();
        if !Self::make_dirs(
            report,
            &[
                (
                    &real_staging,
                    vec![("driverName", driver), ("volumeHandle", &real)],
                ),
                (
                    &unknown_staging,
                    vec![("driverName", driver), ("volumeHandle", &unknown)],
                ),
                (
                    &target_dir,
                    vec![
                        ("driverName", driver),
                        ("nodeName", CHECK_NODE),
                        ("specVolID", CHECK_VOLUME),
                        ("volumeHandle", &unknown),
                        ("volumeLifecycleMode", "Persistent"),
                    ],
                ),
            ],
        ) {
            return;
        }
        let real_staging = s(&real_staging);
        let unknown_staging = s(&unknown_staging);
        let publish_context: HashMap<String, String> = volume
            .map_or(&self.opts.publish_context, |v| &v.publish_context)
            .clone()
            .into_iter()
            .collect();
        // A probe whose missing argument is not volume_id.
        macro_rules! missing {
            ($step:literal, $r:expr) => {
                report.expect_any(format!("{}{suffix}", $step), missing_codes, $r)
            };
        }

        macro_rules! call {
            ($method:literal, $rpc:ident, $msg:expr) => {{
                let msg = $msg;
                c.call($method, &msg, |r| {
                    let mut n = node.clone();
                    async move { n.$rpc(r).await }
                })
                .await
            }};
        }

        if stages {
            let stage = |volume_id: &str, staging: &str, cap: Option<VolumeCapability>| {
                NodeStageVolumeRequest {
                    volume_id: volume_id.to_owned(),
                    staging_target_path: staging.to_owned(),
                    volume_capability: cap,
                    publish_context: publish_context.clone(),
                    ..Default::default()
                }
            };
            report.expect_code(
                "NodeStageVolume without volume_id",
                Code::InvalidArgument,
                call!(
                    "NodeStageVolume",
                    node_stage_volume,
                    stage("", &real_staging, cap.clone())
                ),
            );
            missing!(
                "NodeStageVolume without staging_target_path",
                call!(
                    "NodeStageVolume",
                    node_stage_volume,
                    stage(&real, "", cap.clone())
                )
            );
            missing!(
                "NodeStageVolume without volume_capability",
                call!(
                    "NodeStageVolume",
                    node_stage_volume,
                    stage(&real, &real_staging, None)
                )
            );
            report.expect_code(
                "NodeStageVolume of an unknown volume",
                Code::NotFound,
                call!(
                    "NodeStageVolume",
                    node_stage_volume,
                    stage(&unknown, &unknown_staging, cap.clone())
                ),
            );
            let unstage = |volume_id: &str, staging: &str| NodeUnstageVolumeRequest {
                volume_id: volume_id.to_owned(),
                staging_target_path: staging.to_owned(),
            };
            report.expect_code(
                "NodeUnstageVolume without volume_id",
                Code::InvalidArgument,
                call!(
                    "NodeUnstageVolume",
                    node_unstage_volume,
                    unstage("", &real_staging)
                ),
            );
            missing!(
                "NodeUnstageVolume without staging_target_path",
                call!("NodeUnstageVolume", node_unstage_volume, unstage(&real, ""))
            );
            report.expect_code(
                "NodeUnstageVolume of an unknown volume",
                Code::NotFound,
                call!(
                    "NodeUnstageVolume",
                    node_unstage_volume,
                    unstage(&unknown, &unknown_staging)
                ),
            );
        } else {
            report.skip(
                "NodeStageVolume/NodeUnstageVolume error codes",
                "no STAGE_UNSTAGE_VOLUME",
            );
        }

        // The staging path of the volume named, as the kubelet sends it (only when staging).
        let staging_of = |volume_id: &str| {
            if !stages {
                String::new()
            } else if volume_id == unknown {
                unknown_staging.clone()
            } else {
                real_staging.clone()
            }
        };
        let publish = |volume_id: &str, target: &str, cap: Option<VolumeCapability>| {
            NodePublishVolumeRequest {
                volume_id: volume_id.to_owned(),
                staging_target_path: staging_of(if volume_id.is_empty() {
                    &real
                } else {
                    volume_id
                }),
                target_path: target.to_owned(),
                volume_capability: cap,
                publish_context: publish_context.clone(),
                ..Default::default()
            }
        };
        let target = s(&target);
        report.expect_code(
            "NodePublishVolume without volume_id",
            Code::InvalidArgument,
            call!(
                "NodePublishVolume",
                node_publish_volume,
                publish("", &target, cap.clone())
            ),
        );
        missing!(
            "NodePublishVolume without target_path",
            call!(
                "NodePublishVolume",
                node_publish_volume,
                publish(&real, "", cap.clone())
            )
        );
        missing!(
            "NodePublishVolume without volume_capability",
            call!(
                "NodePublishVolume",
                node_publish_volume,
                publish(&real, &target, None)
            )
        );
        report.expect_code(
            "NodePublishVolume of an unknown volume",
            Code::NotFound,
            call!(
                "NodePublishVolume",
                node_publish_volume,
                publish(&unknown, &target, cap.clone())
            ),
        );
        let unpublish = |volume_id: &str, target: &str| NodeUnpublishVolumeRequest {
            volume_id: volume_id.to_owned(),
            target_path: target.to_owned(),
        };
        report.expect_code(
            "NodeUnpublishVolume without volume_id",
            Code::InvalidArgument,
            call!(
                "NodeUnpublishVolume",
                node_unpublish_volume,
                unpublish("", &target)
            ),
        );
        missing!(
            "NodeUnpublishVolume without target_path",
            call!(
                "NodeUnpublishVolume",
                node_unpublish_volume,
                unpublish(&real, "")
            )
        );
        report.expect_code(
            "NodeUnpublishVolume of an unknown volume",
            Code::NotFound,
            call!(
                "NodeUnpublishVolume",
                node_unpublish_volume,
                unpublish(&unknown, &target)
            ),
        );

        // The kubelet asks for stats and expansion of a published volume: its target exists.
        let stats_or_expand =
            self.has(NodeCapability::GetVolumeStats) || self.has(NodeCapability::ExpandVolume);
        if stats_or_expand && let Err(e) = std::fs::create_dir_all(&target) {
            report.push(
                format!("create {target}"),
                Outcome::Fail,
                None,
                e.to_string(),
            );
            return;
        }
        if self.has(NodeCapability::GetVolumeStats) {
            let stats = |volume_id: &str, p: &str| NodeGetVolumeStatsRequest {
                volume_id: volume_id.to_owned(),
                volume_path: p.to_owned(),
                staging_target_path: String::new(),
            };
            report.expect_code(
                "NodeGetVolumeStats without volume_id",
                Code::InvalidArgument,
                call!(
                    "NodeGetVolumeStats",
                    node_get_volume_stats,
                    stats("", &target)
                ),
            );
            missing!(
                "NodeGetVolumeStats without volume_path",
                call!(
                    "NodeGetVolumeStats",
                    node_get_volume_stats,
                    stats(&real, "")
                )
            );
            report.expect_code(
                "NodeGetVolumeStats of an unknown volume",
                Code::NotFound,
                call!(
                    "NodeGetVolumeStats",
                    node_get_volume_stats,
                    stats(&unknown, &target)
                ),
            );
        } else {
            report.skip("NodeGetVolumeStats error codes", "no GET_VOLUME_STATS");
        }
        if self.has(NodeCapability::ExpandVolume) {
            let expand = |volume_id: &str, p: &str| NodeExpandVolumeRequest {
                volume_id: volume_id.to_owned(),
                volume_path: p.to_owned(),
                staging_target_path: staging_of(volume_id),
                ..Default::default()
            };
            report.expect_code(
                "NodeExpandVolume without volume_id",
                Code::InvalidArgument,
                call!("NodeExpandVolume", node_expand_volume, expand("", &target)),
            );
            missing!(
                "NodeExpandVolume without volume_path",
                call!("NodeExpandVolume", node_expand_volume, expand(&real, ""))
            );
            report.expect_code(
                "NodeExpandVolume of an unknown volume",
                Code::NotFound,
                call!(
                    "NodeExpandVolume",
                    node_expand_volume,
                    expand(&unknown, &target)
                ),
            );
        } else {
            report.skip("NodeExpandVolume error codes", "no EXPAND_VOLUME");
        }
        // As the kubelet after TearDown and UnmountDevice; a probe that a driver wrongly
        // obeyed may leave something mounted, which then stays (and shows as a failed step).
        for dir in [&target, &unknown_staging, &real_staging] {
            let dir = Path::new(dir);
            if let Err(e) = remove_mount_dir(dir) {
                report.push(
                    format!("remove {}", dir.display()),
                    Outcome::Fail,
                    None,
                    format!("{e}: a probe left something there"),
                );
            }
        }
    }

    /// Stage, publish, stats, expand, unpublish, unstage, each repeated where the spec wants
    /// idempotency, on the kubelet's paths under the check's directory, with the kubelet's
    /// directories made before and removed after.
    async fn sequence(&mut self, report: &mut Report, spec: &VolumeSpec, driver: &str) {
        let layout = KubeletLayout::new(&self.opts.root);
        let stages = self.has(NodeCapability::StageUnstageVolume);
        let paths = layout
            .staging_path(driver, &spec.volume_id)
            .and_then(|st| Ok((st, layout.publish_path(CHECK_POD, CHECK_VOLUME)?)));
        let (staging, target) = match paths {
            Ok(p) => p,
            Err(e) => {
                report.push("paths", Outcome::Fail, None, e.to_string());
                return;
            }
        };
        let node = self.conn.node();
        let c = &self.conn;
        let cap = Some(self.node_capability(spec));
        let ctx: HashMap<String, String> = spec.volume_context.clone().into_iter().collect();
        let publish_ctx: HashMap<String, String> =
            spec.publish_context.clone().into_iter().collect();
        macro_rules! call {
            ($method:literal, $rpc:ident, $msg:expr) => {{
                let msg = $msg;
                c.call($method, &msg, |r| {
                    let mut n = node.clone();
                    async move { n.$rpc(r).await }
                })
                .await
            }};
        }
        // The kubelet's clean-up after NodeUnpublishVolume and NodeUnstageVolume.
        let clean = |report: &mut Report, after: &str, dir: &Path| {
            if let Err(e) = remove_mount_dir(dir) {
                report.push(
                    format!("remove {} after {after}", dir.display()),
                    Outcome::Fail,
                    None,
                    format!("{e}: the driver left it mounted or not empty"),
                );
            }
        };

        // MountDevice: the staging directory, whether or not the driver stages.
        if !Self::make_dirs(
            report,
            &[(
                &staging,
                vec![("driverName", driver), ("volumeHandle", &spec.volume_id)],
            )],
        ) {
            return;
        }
        let stage_msg = NodeStageVolumeRequest {
            volume_id: spec.volume_id.clone(),
            staging_target_path: s(&staging),
            volume_capability: cap.clone(),
            volume_context: ctx.clone(),
            publish_context: publish_ctx.clone(),
            ..Default::default()
        };
        if stages {
            report.expect_ok(
                "NodeStageVolume",
                call!("NodeStageVolume", node_stage_volume, stage_msg.clone()),
            );
            report.expect_ok(
                "NodeStageVolume repeated",
                call!("NodeStageVolume", node_stage_volume, stage_msg.clone()),
            );
        } else {
            report.skip("NodeStageVolume", "no STAGE_UNSTAGE_VOLUME");
        }

        // SetUp: the target's parent; the target is the driver's to make.
        let target_dir = target.parent().unwrap_or(&target).to_owned();
        if !Self::make_dirs(
            report,
            &[(
                &target_dir,
                vec![
                    ("driverName", driver),
                    ("nodeName", CHECK_NODE),
                    ("specVolID", CHECK_VOLUME),
                    ("volumeHandle", &spec.volume_id),
                    ("volumeLifecycleMode", "Persistent"),
                ],
            )],
        ) {
            return;
        }
        let publish_msg = NodePublishVolumeRequest {
            volume_id: spec.volume_id.clone(),
            staging_target_path: if stages { s(&staging) } else { String::new() },
            target_path: s(&target),
            volume_capability: cap.clone(),
            volume_context: ctx.clone(),
            publish_context: publish_ctx,
            ..Default::default()
        };
        if report
            .expect_ok(
                "NodePublishVolume",
                call!(
                    "NodePublishVolume",
                    node_publish_volume,
                    publish_msg.clone()
                ),
            )
            .is_some()
            && !target.exists()
        {
            let last = report.steps.last_mut().expect("just pushed");
            last.outcome = Outcome::Fail;
            last.detail = format!("the driver did not create the target {}", target.display());
        }
        report.expect_ok(
            "NodePublishVolume repeated",
            call!(
                "NodePublishVolume",
                node_publish_volume,
                publish_msg.clone()
            ),
        );

        if self.has(NodeCapability::GetVolumeStats) {
            // The kubelet's volume metrics: the target, no staging path.
            let msg = NodeGetVolumeStatsRequest {
                volume_id: spec.volume_id.clone(),
                volume_path: s(&target),
                staging_target_path: String::new(),
            };
            if let Some(stats) = report.expect_ok(
                "NodeGetVolumeStats",
                call!("NodeGetVolumeStats", node_get_volume_stats, msg),
            ) {
                let last = report.steps.last_mut().expect("just pushed");
                let bytes = stats
                    .usage
                    .iter()
                    .find(|u| u.unit == volume_usage::Unit::Bytes as i32);
                match bytes {
                    None if stats.usage.is_empty() => {
                        last.outcome = Outcome::Fail;
                        last.detail = "no usage reported".into();
                    }
                    Some(u) if u.total < 0 || u.used < 0 || u.available < 0 => {
                        last.outcome = Outcome::Fail;
                        last.detail = "negative usage".into();
                    }
                    Some(u) => last.detail = format!("{} of {} bytes used", u.used, u.total),
                    None => {}
                }
            }
        } else {
            report.skip("NodeGetVolumeStats", "no GET_VOLUME_STATS");
        }
        // The kubelet's volume health: the same call, read for its volume_condition.
        const NODE_CONDITION: &str = "NodeGetVolumeStats volume_condition";
        if !self.has(NodeCapability::VolumeCondition) {
            report.skip(NODE_CONDITION, "no VOLUME_CONDITION node capability");
        } else if !self.has(NodeCapability::GetVolumeStats) {
            report.skip(NODE_CONDITION, "no GET_VOLUME_STATS");
        } else {
            let msg = NodeGetVolumeStatsRequest {
                volume_id: spec.volume_id.clone(),
                volume_path: s(&target),
                staging_target_path: String::new(),
            };
            if let Some(stats) = report.expect_ok(
                NODE_CONDITION,
                call!("NodeGetVolumeStats", node_get_volume_stats, msg),
            ) {
                report.steps.last_mut().expect("just pushed").detail =
                    condition_text(stats.volume_condition.as_ref());
            }
        }
        if self.has(NodeCapability::ExpandVolume) {
            let msg = NodeExpandVolumeRequest {
                volume_id: spec.volume_id.clone(),
                volume_path: s(&target),
                capacity_range: Some(CapacityRange {
                    required_bytes: self.opts.capacity_bytes.saturating_mul(2),
                    limit_bytes: 0,
                }),
                staging_target_path: if stages { s(&staging) } else { String::new() },
                volume_capability: cap.clone(),
                ..Default::default()
            };
            if report
                .expect_ok(
                    "NodeExpandVolume",
                    call!("NodeExpandVolume", node_expand_volume, msg.clone()),
                )
                .is_some()
            {
                let asked = msg.capacity_range.as_ref().map_or(0, |r| r.required_bytes);
                self.volume_bytes = self.volume_bytes.max(asked);
            }
            report.expect_ok(
                "NodeExpandVolume repeated",
                call!("NodeExpandVolume", node_expand_volume, msg),
            );
        } else {
            report.skip("NodeExpandVolume", "no EXPAND_VOLUME");
        }

        let unpublish_msg = NodeUnpublishVolumeRequest {
            volume_id: spec.volume_id.clone(),
            target_path: s(&target),
        };
        report.expect_ok(
            "NodeUnpublishVolume",
            call!(
                "NodeUnpublishVolume",
                node_unpublish_volume,
                unpublish_msg.clone()
            ),
        );
        report.expect_ok(
            "NodeUnpublishVolume repeated",
            call!("NodeUnpublishVolume", node_unpublish_volume, unpublish_msg),
        );
        clean(report, "NodeUnpublishVolume", &target);
        if stages {
            let msg = NodeUnstageVolumeRequest {
                volume_id: spec.volume_id.clone(),
                staging_target_path: s(&staging),
            };
            report.expect_ok(
                "NodeUnstageVolume",
                call!("NodeUnstageVolume", node_unstage_volume, msg.clone()),
            );
            report.expect_ok(
                "NodeUnstageVolume repeated",
                call!("NodeUnstageVolume", node_unstage_volume, msg),
            );
        } else {
            report.skip("NodeUnstageVolume", "no STAGE_UNSTAGE_VOLUME");
        }
        clean(report, "NodeUnstageVolume", &staging);
    }

    /// The Controller's volume-condition calls, when it offers VOLUME_CONDITION, as
    /// csi-external-health-monitor-controller makes them: ControllerGetVolume of the check's
    /// volume (with GET_VOLUME; it, with a status), without volume_id (INVALID_ARGUMENT) and of
    /// an unknown volume (NOT_FOUND), and ListVolumes from the first page to the last (with
    /// LIST_VOLUMES; every entry a volume with a status, the check's volume among them).
    async fn controller_conditions(&mut self, report: &mut Report, spec: &VolumeSpec) {
        const GET: &str = "ControllerGetVolume";
        const LIST: &str = "ListVolumes";
        let Some(c) = self.controller.clone().filter(|_| self.volume_condition) else {
            for step in [GET, LIST] {
                report.skip(step, "no VOLUME_CONDITION controller capability");
            }
            return;
        };
        let ctl = c.controller();
        let id = &spec.volume_id;
        if self.get_volume {
            let get = |volume_id: &str| {
                let msg = ControllerGetVolumeRequest {
                    volume_id: volume_id.to_owned(),
                };
                let (ctl, c) = (ctl.clone(), c.clone());
                async move {
                    c.call("ControllerGetVolume", &msg, |r| {
                        let mut ctl = ctl.clone();
                        async move { ctl.controller_get_volume(r).await }
                    })
                    .await
                }
            };
            if let Some(r) = report.expect_ok(GET, get(id).await) {
                let last = report.steps.last_mut().expect("just pushed");
                let got = r.volume.map(|v| v.volume_id).unwrap_or_default();
                match r.status {
                    _ if got != *id => {
                        last.outcome = Outcome::Fail;
                        last.detail = format!("returned volume {got:?}, not {id:?}");
                    }
                    None => {
                        last.outcome = Outcome::Fail;
                        last.detail = "the response has no status, which the spec requires".into();
                    }
                    Some(status) => {
                        let nodes = if status.published_node_ids.is_empty() {
                            "no node".to_owned()
                        } else {
                            status.published_node_ids.join(", ")
                        };
                        last.detail = format!(
                            "{}; published to {nodes}",
                            condition_text(status.volume_condition.as_ref())
                        );
                    }
                }
            }
            let r = get("").await;
            report.expect_code(
                "ControllerGetVolume without volume_id",
                Code::InvalidArgument,
                r,
            );
            let r = get(&format!("plugreg-check-unknown-{}", unique())).await;
            report.expect_code(
                "ControllerGetVolume of an unknown volume",
                Code::NotFound,
                r,
            );
        } else {
            report.skip(GET, "no GET_VOLUME");
        }
        if !self.list_volumes {
            report.skip(LIST, "no LIST_VOLUMES");
            return;
        }
        // Every page, as the health monitor reads them in one pass; a token seen before
        // would loop forever, so it fails the step.
        const MAX_PAGES: usize = 1000;
        let (mut token, mut tokens) = (String::new(), std::collections::HashSet::new());
        let (mut pages, mut entries) = (0usize, 0usize);
        let mut found: Option<Option<VolumeCondition>> = None;
        let mut wrong: Option<String> = None;
        loop {
            let msg = ListVolumesRequest {
                max_entries: 0,
                starting_token: token.clone(),
            };
            let r = c
                .call("ListVolumes", &msg, |r| {
                    let mut ctl = ctl.clone();
                    async move { ctl.list_volumes(r).await }
                })
                .await;
            let page = match r {
                Ok(page) => page,
                Err(e) => {
                    report.expect_ok(LIST, Err::<(), _>(e));
                    if pages > 0 {
                        let last = report.steps.last_mut().expect("just pushed");
                        last.detail = format!("page {}: {}", pages + 1, last.detail);
                    }
                    return;
                }
            };
            pages += 1;
            entries += page.entries.len();
            for e in page.entries {
                match (e.volume, e.status) {
                    (None, _) => {
                        wrong.get_or_insert_with(|| "an entry has no volume".into());
                    }
                    (Some(v), None) => {
                        wrong.get_or_insert_with(|| {
                            format!(
                                "the entry of volume {:?} has no status, which the spec                                  requires with VOLUME_CONDITION",
                                v.volume_id
                            )
                        });
                    }
                    (Some(v), Some(status)) if v.volume_id == *id => {
                        found = Some(status.volume_condition);
                    }
                    _ => {}
                }
            }
            if page.next_token.is_empty() {
                break;
            }
            if !tokens.insert(page.next_token.clone()) {
                wrong.get_or_insert_with(|| {
                    format!(
                        "next_token {:?} came back: the pages never end",
                        page.next_token
                    )
                });
                break;
            }
            if pages == MAX_PAGES {
                wrong.get_or_insert_with(|| format!("still more after {MAX_PAGES} pages"));
                break;
            }
            token = page.next_token;
        }
        let (outcome, detail) = match (wrong, found) {
            (Some(why), _) => (Outcome::Fail, why),
            (None, None) => (
                Outcome::Fail,
                format!("volume {id:?} is not among the {entries} entries listed"),
            ),
            (None, Some(condition)) => (
                Outcome::Pass,
                format!(
                    "{} in {}; volume {id}: {}",
                    count(entries, "entry", "entries"),
                    count(pages, "page", "pages"),
                    condition_text(condition.as_ref())
                ),
            ),
        };
        report.push(LIST, outcome, Some(Code::Ok), detail);
    }

    /// ControllerExpandVolume (to twice the check's size, and repeated: the same size again is
    /// success) and ControllerModifyVolume, when the Controller offers them, each also with an
    /// empty volume_id (INVALID_ARGUMENT) and an unknown one (NOT_FOUND), as the resizer's
    /// error classes rely on them.
    async fn expand_and_modify(&mut self, report: &mut Report, spec: &VolumeSpec) {
        let Some(c) = self.controller.clone() else {
            return;
        };
        let ctl = c.controller();
        let unknown = format!("plugreg-check-unknown-{}", unique());
        if self.expand {
            let required = self.opts.capacity_bytes.saturating_mul(2);
            let expand = |volume_id: &str| {
                let msg = ControllerExpandVolumeRequest {
                    volume_id: volume_id.to_owned(),
                    capacity_range: Some(CapacityRange {
                        required_bytes: required,
                        limit_bytes: 0,
                    }),
                    volume_capability: Some(rwo_capability(self.controller_multi_writer)),
                    ..Default::default()
                };
                let ctl = ctl.clone();
                let c = c.clone();
                async move {
                    c.call("ControllerExpandVolume", &msg, |r| {
                        let mut ctl = ctl.clone();
                        async move { ctl.controller_expand_volume(r).await }
                    })
                    .await
                }
            };
            for step in ["ControllerExpandVolume", "ControllerExpandVolume repeated"] {
                if let Some(r) = report.expect_ok(step, expand(&spec.volume_id).await) {
                    let last = report.steps.last_mut().expect("just pushed");
                    if r.capacity_bytes != 0 && r.capacity_bytes < required {
                        last.outcome = Outcome::Fail;
                        last.detail = format!(
                            "capacity_bytes {} is less than the required {required}",
                            r.capacity_bytes
                        );
                    } else {
                        last.detail = format!(
                            "capacity_bytes {}, node_expansion_required {}",
                            r.capacity_bytes, r.node_expansion_required
                        );
                        self.volume_bytes = self.volume_bytes.max(required).max(r.capacity_bytes);
                        self.volume_floor = self.volume_floor.max(required).max(r.capacity_bytes);
                    }
                }
            }
            let r = expand("").await;
            report.expect_code(
                "ControllerExpandVolume without volume_id",
                Code::InvalidArgument,
                r,
            );
            let r = expand(&unknown).await;
            report.expect_code(
                "ControllerExpandVolume of an unknown volume",
                Code::NotFound,
                r,
            );
        }
        if self.modify {
            let modify = |volume_id: &str| {
                let msg = ControllerModifyVolumeRequest {
                    volume_id: volume_id.to_owned(),
                    ..Default::default()
                };
                let ctl = ctl.clone();
                let c = c.clone();
                async move {
                    c.call("ControllerModifyVolume", &msg, |r| {
                        let mut ctl = ctl.clone();
                        async move { ctl.controller_modify_volume(r).await }
                    })
                    .await
                }
            };
            let r = modify("").await;
            report.expect_code(
                "ControllerModifyVolume without volume_id",
                Code::InvalidArgument,
                r,
            );
            let r = modify(&unknown).await;
            report.expect_code(
                "ControllerModifyVolume of an unknown volume",
                Code::NotFound,
                r,
            );
        }
    }

    /// Snapshots and clones, when the Controller offers them, as csi-snapshotter and
    /// csi-provisioner call them: CreateSnapshot of the check's volume (repeated: the same
    /// snapshot), without name or source (INVALID_ARGUMENT), ListSnapshots by its id (it, and
    /// nothing for an unknown id), GetSnapshot (it; an unknown id NOT_FOUND), a volume restored
    /// from it once it is ready and one cloned from the check's volume (each as large as its
    /// source, and naming its content source, which the provisioner requires), each also asked
    /// for at half its source's size (refused), then DeleteSnapshot (repeated: OK).
    async fn snapshots_and_clones(&mut self, report: &mut Report, spec: &VolumeSpec) {
        let Some(c) = self.controller.clone() else {
            return;
        };
        let ctl = c.controller();
        let caps = self.snapshots;
        if caps.create {
            let create = |name: &str, source: &str| {
                let msg = CreateSnapshotRequest {
                    source_volume_id: source.to_owned(),
                    name: name.to_owned(),
                    ..Default::default()
                };
                let (ctl, c) = (ctl.clone(), c.clone());
                async move {
                    c.call("CreateSnapshot", &msg, |r| {
                        let mut ctl = ctl.clone();
                        async move { ctl.create_snapshot(r).await }
                    })
                    .await
                }
            };
            let name = format!("plugreg-check-snapshot-{}", unique());
            let first = report
                .expect_ok("CreateSnapshot", create(&name, &spec.volume_id).await)
                .and_then(|r| r.snapshot);
            let Some(mut snap) = first else {
                return;
            };
            {
                let last = report.steps.last_mut().expect("just pushed");
                if snap.snapshot_id.is_empty() || snap.source_volume_id != spec.volume_id {
                    last.outcome = Outcome::Fail;
                    last.detail = format!(
                        "snapshot_id {:?}, source_volume_id {:?} (want {:?})",
                        snap.snapshot_id, snap.source_volume_id, spec.volume_id
                    );
                } else {
                    last.detail = format!(
                        "snapshot {}, ready_to_use {}",
                        snap.snapshot_id, snap.ready_to_use
                    );
                }
            }
            // Repeated, as the snapshotter polls a snapshot that is not ready yet; a few
            // times, a second apart, until it is.
            for attempt in 0..5 {
                let step = if attempt == 0 {
                    "CreateSnapshot repeated (same name)".to_owned()
                } else {
                    format!("CreateSnapshot repeated, until ready ({})", attempt + 1)
                };
                let Some(again) = report
                    .expect_ok(step, create(&name, &spec.volume_id).await)
                    .and_then(|r| r.snapshot)
                else {
                    break;
                };
                let last = report.steps.last_mut().expect("just pushed");
                if again.snapshot_id != snap.snapshot_id {
                    last.outcome = Outcome::Fail;
                    last.detail = format!(
                        "returned snapshot {:?}, not {:?}: not idempotent",
                        again.snapshot_id, snap.snapshot_id
                    );
                    break;
                }
                last.detail = format!("ready_to_use {}", again.ready_to_use);
                snap = again;
                if snap.ready_to_use {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            let r = create("", &spec.volume_id).await;
            report.expect_code("CreateSnapshot without name", Code::InvalidArgument, r);
            let r = create(&format!("plugreg-check-snapshot-{}", unique()), "").await;
            report.expect_code(
                "CreateSnapshot without source_volume_id",
                Code::InvalidArgument,
                r,
            );
            let id = snap.snapshot_id.clone();
            let unknown = format!("plugreg-check-unknown-{}", unique());
            if caps.list {
                let list = |snapshot_id: &str| {
                    let msg = ListSnapshotsRequest {
                        snapshot_id: snapshot_id.to_owned(),
                        ..Default::default()
                    };
                    let (ctl, c) = (ctl.clone(), c.clone());
                    async move {
                        c.call("ListSnapshots", &msg, |r| {
                            let mut ctl = ctl.clone();
                            async move { ctl.list_snapshots(r).await }
                        })
                        .await
                    }
                };
                if let Some(r) = report.expect_ok("ListSnapshots by snapshot_id", list(&id).await) {
                    let found = r
                        .entries
                        .iter()
                        .filter_map(|e| e.snapshot.as_ref())
                        .filter(|s| s.snapshot_id == id)
                        .count();
                    let last = report.steps.last_mut().expect("just pushed");
                    if found != 1 || r.entries.len() != 1 {
                        last.outcome = Outcome::Fail;
                        last.detail = format!(
                            "{} entries, {found} of them snapshot {id:?}: want exactly it",
                            r.entries.len()
                        );
                    }
                }
                if let Some(r) = report.expect_ok(
                    "ListSnapshots by an unknown snapshot_id",
                    list(&unknown).await,
                ) && !r.entries.is_empty()
                {
                    let last = report.steps.last_mut().expect("just pushed");
                    last.outcome = Outcome::Fail;
                    last.detail = format!("{} entries; want none", r.entries.len());
                }
            } else {
                report.skip("ListSnapshots", "no LIST_SNAPSHOTS");
            }
            if caps.get {
                let get = |snapshot_id: &str| {
                    let msg = GetSnapshotRequest {
                        snapshot_id: snapshot_id.to_owned(),
                        ..Default::default()
                    };
                    let (ctl, c) = (ctl.clone(), c.clone());
                    async move {
                        c.call("GetSnapshot", &msg, |r| {
                            let mut ctl = ctl.clone();
                            async move { ctl.get_snapshot(r).await }
                        })
                        .await
                    }
                };
                if let Some(r) = report.expect_ok("GetSnapshot", get(&id).await) {
                    let got = r.snapshot.map(|s| s.snapshot_id).unwrap_or_default();
                    if got != id {
                        let last = report.steps.last_mut().expect("just pushed");
                        last.outcome = Outcome::Fail;
                        last.detail = format!("returned snapshot {got:?}, not {id:?}");
                    }
                }
                let r = get(&unknown).await;
                report.expect_code("GetSnapshot of an unknown snapshot", Code::NotFound, r);
            } else {
                report.skip("GetSnapshot", "no GET_SNAPSHOT");
            }
            if !self.create {
                report.skip("CreateVolume from the snapshot", "no CREATE_DELETE_VOLUME");
            } else if !snap.ready_to_use {
                report.skip(
                    "CreateVolume from the snapshot",
                    "the snapshot was not ready within 5 s",
                );
            } else {
                let source = VolumeContentSource {
                    r#type: Some(volume_content_source::Type::Snapshot(
                        volume_content_source::SnapshotSource {
                            snapshot_id: id.clone(),
                        },
                    )),
                };
                // What the snapshot holds: its size_bytes, or, when it reports none, at least
                // what its volume surely held when it was cut.
                let held = if snap.size_bytes > 0 {
                    snap.size_bytes
                } else {
                    self.volume_floor
                };
                let required = held.max(self.volume_bytes);
                self.create_from(
                    report,
                    "CreateVolume from the snapshot",
                    "restored",
                    source.clone(),
                    required,
                    &c,
                )
                .await;
                self.create_smaller(
                    report,
                    "CreateVolume from the snapshot, smaller than it",
                    source,
                    held,
                    &c,
                )
                .await;
            }
            let msg = DeleteSnapshotRequest {
                snapshot_id: id,
                ..Default::default()
            };
            let delete = |msg: DeleteSnapshotRequest| {
                let (ctl, c) = (ctl.clone(), c.clone());
                async move {
                    c.call("DeleteSnapshot", &msg, |r| {
                        let mut ctl = ctl.clone();
                        async move { ctl.delete_snapshot(r).await }
                    })
                    .await
                }
            };
            for step in ["DeleteSnapshot", "DeleteSnapshot repeated"] {
                let r = delete(msg.clone()).await;
                report.expect_ok(step, r);
            }
            let r = delete(DeleteSnapshotRequest::default()).await;
            report.expect_code(
                "DeleteSnapshot without snapshot_id",
                Code::InvalidArgument,
                r,
            );
        }
        if caps.clone && self.create {
            let source = VolumeContentSource {
                r#type: Some(volume_content_source::Type::Volume(
                    volume_content_source::VolumeSource {
                        volume_id: spec.volume_id.clone(),
                    },
                )),
            };
            let (required, held) = (self.volume_bytes, self.volume_floor);
            self.create_from(
                report,
                "CreateVolume cloned from the volume",
                "cloned",
                source.clone(),
                required,
                &c,
            )
            .await;
            self.create_smaller(
                report,
                "CreateVolume cloned from the volume, smaller than it",
                source,
                held,
                &c,
            )
            .await;
        }
    }

    /// CreateVolume of a new volume of at least `required_bytes` (what a claim from it must
    /// ask for: csi-provisioner refuses a claim smaller than its source) from `source` (it must
    /// name its content source, as csi-provisioner requires), then DeleteVolume of it.
    async fn create_from(
        &mut self,
        report: &mut Report,
        step: &str,
        what: &str,
        source: VolumeContentSource,
        required_bytes: i64,
        c: &Connection,
    ) {
        let msg = CreateVolumeRequest {
            name: format!("plugreg-check-{}-{}", std::process::id(), unique()),
            capacity_range: Some(CapacityRange {
                required_bytes,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![rwo_capability(self.controller_multi_writer)],
            volume_content_source: Some(source.clone()),
            ..Default::default()
        };
        let Some(vol) = report
            .expect_ok(step.to_owned(), c.create_volume(&msg).await)
            .and_then(|r| r.volume)
        else {
            return;
        };
        let last = report.steps.last_mut().expect("just pushed");
        if vol.content_source.is_none() {
            last.outcome = Outcome::Fail;
            last.detail = format!(
                "volume {} names no content source: csi-provisioner refuses such a volume \
                 (\"volume content source missing\")",
                vol.volume_id
            );
        } else {
            last.detail = format!("volume {}, {required_bytes} bytes asked", vol.volume_id);
        }
        if !vol.volume_id.is_empty() {
            let del = DeleteVolumeRequest {
                volume_id: vol.volume_id,
                ..Default::default()
            };
            let r = c.delete_volume(&del).await;
            report.expect_ok(format!("DeleteVolume of the {what} volume"), r);
        }
    }

    /// CreateVolume from `source` asking for half of the `held` bytes it surely holds, as only
    /// `required_bytes` (as csi-provisioner would send it): a volume made from a source is
    /// never smaller than the source, so the driver must refuse. The CSI spec names
    /// OUT_OF_RANGE for this ("trying to create a volume smaller than the source snapshot");
    /// INVALID_ARGUMENT ("source incompatible") is accepted too, as csi-driver-host-path answers
    /// it. A volume made anyway fails the step, whether it was quietly grown to the source's
    /// size or made smaller than its data, and is deleted.
    async fn create_smaller(
        &mut self,
        report: &mut Report,
        step: &str,
        source: VolumeContentSource,
        held: i64,
        c: &Connection,
    ) {
        let required_bytes = (held / 2).max(1);
        if held < 2 {
            report.skip(step, "the source's size is unknown");
            return;
        }
        let msg = CreateVolumeRequest {
            name: format!("plugreg-check-{}-{}", std::process::id(), unique()),
            capacity_range: Some(CapacityRange {
                required_bytes,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![rwo_capability(self.controller_multi_writer)],
            volume_content_source: Some(source),
            ..Default::default()
        };
        let created = match c.create_volume(&msg).await {
            Ok(r) => r.volume,
            Err(e) => {
                let want = [Code::OutOfRange, Code::InvalidArgument];
                report.expect_any(step, &want, Err::<(), _>(e));
                let last = report.steps.last_mut().expect("just pushed");
                if last.outcome == Outcome::Pass {
                    last.detail = format!("{required_bytes} bytes asked of a source of {held}");
                }
                return;
            }
        };
        let vol = created.unwrap_or_default();
        let why = if vol.capacity_bytes >= held {
            format!(
                "made volume {} of {} bytes for a request of {required_bytes} bytes from a \
                 source of {held}: it grew the volume instead of refusing a request smaller \
                 than the source (OUT_OF_RANGE, or INVALID_ARGUMENT)",
                vol.volume_id, vol.capacity_bytes
            )
        } else {
            format!(
                "made volume {} of {} bytes from a source of {held} bytes: a volume is never \
                 smaller than its source; the request must be refused (OUT_OF_RANGE, or \
                 INVALID_ARGUMENT)",
                vol.volume_id, vol.capacity_bytes
            )
        };
        report.push(step, Outcome::Fail, Some(Code::Ok), why);
        if !vol.volume_id.is_empty() {
            let del = DeleteVolumeRequest {
                volume_id: vol.volume_id,
                ..Default::default()
            };
            if let Err(e) = c.delete_volume(&del).await {
                report.push(
                    format!("DeleteVolume of the volume of \"{step}\""),
                    Outcome::Fail,
                    e.code(),
                    error_text(&e),
                );
            }
        }
    }

    async fn delete(&mut self, report: &mut Report, volume_id: &str) {
        let Some(c) = &self.controller else { return };
        let msg = DeleteVolumeRequest {
            volume_id: volume_id.to_owned(),
            ..Default::default()
        };
        for step in ["DeleteVolume", "DeleteVolume repeated"] {
            let r = c.delete_volume(&msg).await;
            report.expect_ok(step, r);
        }
    }
}

/// A volume condition as a step's detail: `condition normal`, `condition abnormal: "why"`, or
/// `no condition` when the driver left it out (which the spec allows and the health monitor
/// takes as healthy).
fn condition_text(c: Option<&VolumeCondition>) -> String {
    match c {
        None => "no condition".into(),
        Some(c) if c.abnormal => format!("condition abnormal: {:?}", c.message),
        Some(c) if c.message.is_empty() => "condition normal".into(),
        Some(c) => format!("condition normal: {:?}", c.message),
    }
}

/// `1 entry`, `2 entries`.
fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// A number that differs between runs and calls (names of test volumes).
fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as u64);
    nanos ^ (N.fetch_add(1, Ordering::Relaxed) << 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_as_step_details() {
        assert_eq!(condition_text(None), "no condition");
        let c = |abnormal: bool, message: &str| VolumeCondition {
            abnormal,
            message: message.into(),
        };
        assert_eq!(condition_text(Some(&c(false, ""))), "condition normal");
        assert_eq!(
            condition_text(Some(&c(false, "fine"))),
            "condition normal: \"fine\""
        );
        assert_eq!(
            condition_text(Some(&c(true, "disk gone"))),
            "condition abnormal: \"disk gone\""
        );
    }

    #[test]
    fn code_names_as_in_the_spec() {
        assert_eq!(code_name(Code::Ok), "OK");
        assert_eq!(code_name(Code::InvalidArgument), "INVALID_ARGUMENT");
        assert_eq!(code_name(Code::NotFound), "NOT_FOUND");
        assert_eq!(code_name(Code::ResourceExhausted), "RESOURCE_EXHAUSTED");
    }
}
