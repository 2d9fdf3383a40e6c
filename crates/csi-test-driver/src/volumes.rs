//! The driver's volumes and the Node and Controller RPCs that act on them.
//!
//! A volume is a directory `<data dir>/<volume id>`. NodeStageVolume bind-mounts it on the
//! staging path, NodePublishVolume bind-mounts the staging path (or, without
//! STAGE_UNSTAGE_VOLUME, the volume) on the target path, read-only when asked: real mounts when
//! the driver runs as root ([`MountMode::Auto`]), plain directories otherwise. The checks follow
//! the error codes the CSI spec requires (docs/upstream/csi-wire.md §1.12): a missing argument is
//! INVALID_ARGUMENT, an unknown volume NOT_FOUND, a second stage or publish with another
//! capability ALREADY_EXISTS, publishing without the staging path a stage-capable driver needs
//! FAILED_PRECONDITION; repeated calls with the same arguments succeed (idempotency).
//!
//! With [`DriverConfig::volume_condition`](crate::DriverConfig::volume_condition),
//! ControllerGetVolume, ListVolumes and NodeGetVolumeStats report each volume's condition from
//! the shared [`Conditions`](crate::Conditions), so a test can turn a volume abnormal and back.
//!
//! With [`DriverConfig::persistent`](crate::DriverConfig::persistent) the data directory is the
//! record, as a real driver's backing store is: a volume created by one instance (a controller
//! plugin) is known to every other instance sharing the directory (the node plugins, a restarted
//! driver), its id is its CreateVolume name, its name and capacity sit beside it in
//! `<data dir>/.<id>.meta`, unpublish and unstage unmount a target that another instance
//! mounted, and stopping leaves the mounts to the container orchestrator.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use plugreg_proto::csi::v1::controller_server::Controller;
use plugreg_proto::csi::v1::node_server::Node;
use plugreg_proto::csi::v1::{
    ControllerExpandVolumeRequest, ControllerExpandVolumeResponse,
    ControllerGetCapabilitiesRequest, ControllerGetCapabilitiesResponse,
    ControllerGetVolumeRequest, ControllerGetVolumeResponse, ControllerModifyVolumeRequest,
    ControllerModifyVolumeResponse, ControllerPublishVolumeRequest,
    ControllerPublishVolumeResponse, ControllerServiceCapability, ControllerUnpublishVolumeRequest,
    ControllerUnpublishVolumeResponse, CreateSnapshotRequest, CreateSnapshotResponse,
    CreateVolumeRequest, CreateVolumeResponse, DeleteSnapshotRequest, DeleteSnapshotResponse,
    DeleteVolumeRequest, DeleteVolumeResponse, GetCapacityRequest, GetCapacityResponse,
    GetSnapshotRequest, GetSnapshotResponse, ListSnapshotsRequest, ListSnapshotsResponse,
    ListVolumesRequest, ListVolumesResponse, NodeExpandVolumeRequest, NodeExpandVolumeResponse,
    NodeGetCapabilitiesRequest, NodeGetCapabilitiesResponse, NodeGetInfoRequest,
    NodeGetInfoResponse, NodeGetVolumeStatsRequest, NodeGetVolumeStatsResponse,
    NodePublishVolumeRequest, NodePublishVolumeResponse, NodeServiceCapability,
    NodeStageVolumeRequest, NodeStageVolumeResponse, NodeUnpublishVolumeRequest,
    NodeUnpublishVolumeResponse, NodeUnstageVolumeRequest, NodeUnstageVolumeResponse, Topology,
    ValidateVolumeCapabilitiesRequest, ValidateVolumeCapabilitiesResponse, Volume,
    VolumeCapability, VolumeCondition, VolumeUsage, controller_get_volume_response,
    controller_service_capability, list_volumes_response, node_service_capability, volume_usage,
};
use tonic::{Request, Response, Status};

use crate::{Driver, Method, NodeCapability, SmallerThanSource, to_map};

/// Longest id, name or path accepted (the spec's string limit is 128 bytes; paths get more room
/// since a kubelet root can be deep).
const MAX_PATH_LEN: usize = 4096;

/// How NodeStageVolume and NodePublishVolume expose a volume.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MountMode {
    /// Bind mounts when the driver runs as root, directories otherwise.
    #[default]
    Auto,
    /// Always bind mounts (fails without the privilege).
    Bind,
    /// Never mount: stage and publish only create directories.
    Directory,
}

/// One volume the driver knows.
#[derive(Debug, Clone)]
pub(crate) struct VolumeState {
    /// The CreateVolume name (empty for a pre-provisioned volume).
    name: String,
    pub(crate) capacity: i64,
    /// Where it is staged, with the capability used.
    staged: Option<(PathBuf, VolumeCapability)>,
    /// Where it is published: target → (capability, readonly).
    published: BTreeMap<PathBuf, (VolumeCapability, bool)>,
    /// Nodes it is ControllerPublished to (with `controller_publish`).
    attached: BTreeSet<String>,
}

/// Everything that changes while the driver runs.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub(crate) volumes: BTreeMap<String, VolumeState>,
    next_id: u64,
    /// Snapshots by id (see the `snapshots` module).
    pub(crate) snapshots: crate::snapshots::Snapshots,
    pub(crate) next_snapshot: u64,
    /// Paths this driver mounted, in mount order (unmounted in reverse on stop).
    mounts: Vec<PathBuf>,
    /// Bytes of the node's pool promised to CreateVolume calls still copying their source.
    reserved: i64,
}

impl State {
    /// Bytes of this node's pool in use: volumes made by CreateVolume (pre-provisioned ones
    /// have no name and come from elsewhere) and those being made.
    fn used(&self) -> i64 {
        self.volumes
            .values()
            .filter(|v| !v.name.is_empty())
            .map(|v| v.capacity)
            .sum::<i64>()
            .saturating_add(self.reserved)
    }
}

impl State {
    /// A state with the pre-provisioned `volumes`.
    pub(crate) fn with_volumes(volumes: &[String], capacity: i64) -> Self {
        let mut s = State::default();
        for id in volumes {
            s.volumes.insert(
                id.clone(),
                VolumeState {
                    name: String::new(),
                    capacity,
                    staged: None,
                    published: BTreeMap::new(),
                    attached: BTreeSet::new(),
                },
            );
        }
        s
    }
}

/// Whether `id` can name a directory: not empty, no `/`, not `.` or `..`, no NUL, ≤128 bytes.
pub fn valid_volume_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id != "." && id != ".." && !id.contains(['/', '\0'])
}

pub(crate) fn required<'a>(value: &'a str, field: &str) -> Result<&'a str, Status> {
    if value.is_empty() {
        Err(Status::invalid_argument(format!("{field} is required")))
    } else if value.len() > MAX_PATH_LEN {
        Err(Status::invalid_argument(format!("{field} is too long")))
    } else {
        Ok(value)
    }
}

fn required_path(value: &str, field: &str) -> Result<PathBuf, Status> {
    let p = Path::new(required(value, field)?);
    if !p.is_absolute() || value.contains('\0') {
        return Err(Status::invalid_argument(format!(
            "{field} must be an absolute path"
        )));
    }
    Ok(p.to_owned())
}

fn capability(c: Option<&VolumeCapability>, field: &str) -> Result<VolumeCapability, Status> {
    let c = c.ok_or_else(|| Status::invalid_argument(format!("{field} is required")))?;
    if c.access_type.is_none() {
        return Err(Status::invalid_argument(format!(
            "{field}: access type (block or mount) is required"
        )));
    }
    if c.access_mode.is_none() {
        return Err(Status::invalid_argument(format!(
            "{field}: access mode is required"
        )));
    }
    if matches!(
        c.access_type,
        Some(plugreg_proto::csi::v1::volume_capability::AccessType::Block(_))
    ) {
        // The capability is valid but this driver keeps volumes as directories.
        return Err(Status::failed_precondition(
            "block volumes are not supported by this driver",
        ));
    }
    Ok(c.clone())
}

/// The device ControllerPublishVolume reports in publish_context.
pub const PUBLISHED_DEVICE: &str = "/dev/plugreg-test";

fn not_found(id: &str) -> Status {
    Status::not_found(format!("volume {id:?} does not exist"))
}

fn internal(what: &str, path: &Path, e: impl std::fmt::Display) -> Status {
    Status::internal(format!("{what} {}: {e}", path.display()))
}

impl Driver {
    fn has(&self, cap: NodeCapability) -> bool {
        self.config.node_capabilities.contains(&cap)
    }

    /// Whether the Node reports volume conditions (and advertises VOLUME_CONDITION): only
    /// through NodeGetVolumeStats, so only with GET_VOLUME_STATS.
    fn node_reports_condition(&self) -> bool {
        self.has(NodeCapability::GetVolumeStats)
            && (self.config.volume_condition || self.has(NodeCapability::VolumeCondition))
    }

    /// The condition reported for volume `id` (see `DriverConfig::omit_healthy_condition`).
    fn condition(&self, id: &str) -> Option<VolumeCondition> {
        self.config
            .conditions
            .report(id, self.config.omit_healthy_condition)
    }

    /// With `controller_publish`, NodeStageVolume and NodePublishVolume need what
    /// ControllerPublishVolume returned, as csi-test's mock driver does.
    fn require_device(
        &self,
        publish_context: &std::collections::HashMap<String, String>,
    ) -> Result<(), Status> {
        if self.config.controller_publish && !publish_context.contains_key("device") {
            return Err(Status::invalid_argument(
                "stage volume info 'device' key required",
            ));
        }
        Ok(())
    }

    /// With `strict_paths`, `path` must exist, as the mock driver checks before the volume.
    fn require_existing(&self, path: &Path, what: &str) -> Result<(), Status> {
        if self.config.strict_paths && !path.exists() {
            return Err(Status::internal(format!(
                "{what} {} does not exist",
                path.display()
            )));
        }
        Ok(())
    }

    fn volume_dir(&self, id: &str) -> Result<PathBuf, Status> {
        let dir = self.data_dir.join(id);
        std::fs::create_dir_all(&dir).map_err(|e| internal("cannot create", &dir, e))?;
        Ok(dir)
    }

    fn binds(&self) -> bool {
        match self.config.mount {
            MountMode::Auto => rustix::process::geteuid().is_root(),
            MountMode::Bind => true,
            MountMode::Directory => false,
        }
    }

    /// Exposes `source` at `target` (an existing directory): a bind mount, remounted read-only
    /// when asked, or nothing in directory mode.
    fn expose(
        &self,
        state: &mut State,
        source: &Path,
        target: &Path,
        readonly: bool,
    ) -> Result<(), Status> {
        if !self.binds() {
            return Ok(());
        }
        rustix::mount::mount_bind(source, target)
            .map_err(|e| internal("cannot bind-mount onto", target, e))?;
        state.mounts.push(target.to_owned());
        if readonly {
            use rustix::mount::MountFlags;
            if let Err(e) =
                rustix::mount::mount_remount(target, MountFlags::BIND | MountFlags::RDONLY, "")
            {
                let _ = self.conceal(state, target);
                return Err(internal("cannot remount read-only", target, e));
            }
        }
        Ok(())
    }

    /// Undoes [`expose`](Self::expose).
    fn conceal(&self, state: &mut State, target: &Path) -> Result<(), Status> {
        let Some(i) = state.mounts.iter().rposition(|m| m == target) else {
            return Ok(());
        };
        match rustix::mount::unmount(target, rustix::mount::UnmountFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => {
                state.mounts.remove(i);
                Ok(())
            }
            Err(e) => Err(internal("cannot unmount", target, e)),
        }
    }

    /// Unmounts everything this driver mounted (on stop), newest first. A persistent driver
    /// keeps them: the volumes it staged and published belong to the pods using them, and a
    /// restarted or newer instance serves them on.
    pub(crate) fn unmount_all(&self) {
        if self.config.persistent {
            return;
        }
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(target) = state.mounts.last().cloned() {
            if let Err(e) = self.conceal(&mut state, &target) {
                tracing::warn!(target = %target.display(), error = %e.message(), "unmount on stop failed; detaching");
                let _ = rustix::mount::unmount(&target, rustix::mount::UnmountFlags::DETACH);
                state.mounts.pop();
            }
        }
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a volume of CreateVolume name `name` exists (for a persistent driver, also one
    /// another instance created).
    fn has_volume_named(&self, name: &str) -> bool {
        let state = if self.config.persistent {
            self.lock_with(name)
        } else {
            self.lock()
        };
        state.volumes.values().any(|v| v.name == name)
    }

    /// [`lock`](Self::lock), having loaded volume `id` from the data directory first when
    /// the driver is persistent and does not know it yet (another instance created it).
    pub(crate) fn lock_with(&self, id: &str) -> std::sync::MutexGuard<'_, State> {
        let mut state = self.lock();
        if self.config.persistent
            && !state.volumes.contains_key(id)
            && let Some((name, capacity)) = self.read_meta(id)
        {
            state.volumes.insert(
                id.to_owned(),
                VolumeState {
                    name,
                    capacity,
                    staged: None,
                    published: BTreeMap::new(),
                    attached: BTreeSet::new(),
                },
            );
        }
        state
    }

    /// `<data dir>/.<id>.meta`: the volume's record beside its directory.
    fn meta_path(&self, id: &str) -> PathBuf {
        self.data_dir.join(format!(".{id}.meta"))
    }

    /// A persisted volume's name and capacity, if `id` names one (its directory and record).
    fn read_meta(&self, id: &str) -> Option<(String, i64)> {
        if !valid_volume_id(id) || !self.data_dir.join(id).is_dir() {
            return None;
        }
        let text = std::fs::read_to_string(self.meta_path(id)).ok()?;
        let (capacity, name) = text.split_once('\n')?;
        Some((name.to_owned(), capacity.parse().ok()?))
    }

    /// Writes the record of a new persisted volume (atomically: a reader sees all or nothing).
    fn write_meta(&self, id: &str, name: &str, capacity: i64) -> Result<(), Status> {
        let path = self.meta_path(id);
        let temp = self.data_dir.join(format!(".{id}.meta.tmp"));
        std::fs::write(&temp, format!("{capacity}\n{name}"))
            .and_then(|()| std::fs::rename(&temp, &path))
            .map_err(|e| internal("cannot write", &path, e))
    }

    /// In persistent mode, unmounts `path` if another instance left a mount there (an instance
    /// only records its own mounts). Not a mount point, or gone: nothing to do.
    fn unmount_foreign(&self, path: &Path) -> Result<(), Status> {
        if !self.config.persistent || !self.binds() {
            return Ok(());
        }
        match rustix::mount::unmount(path, rustix::mount::UnmountFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => Ok(()),
            Err(e) => Err(internal("cannot unmount", path, e)),
        }
    }
}

#[tonic::async_trait]
impl Node for Driver {
    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        let _call = self.enter(Method::NodeGetCapabilities).await?;
        let mut types = self.config.node_capabilities.clone();
        if self.node_reports_condition() && !types.contains(&NodeCapability::VolumeCondition) {
            types.push(NodeCapability::VolumeCondition);
        }
        let capabilities = types
            .into_iter()
            .map(|t| NodeServiceCapability {
                r#type: Some(node_service_capability::Type::Rpc(
                    node_service_capability::Rpc { r#type: t as i32 },
                )),
            })
            .collect();
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        let _call = self.enter(Method::NodeGetInfo).await?;
        let accessible_topology = (!self.config.topology.is_empty()).then(|| Topology {
            segments: to_map(&self.config.topology),
        });
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.config.node_id.clone(),
            max_volumes_per_node: self.config.max_volumes_per_node,
            accessible_topology,
        }))
    }

    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let _call = self.enter(Method::NodeStageVolume).await?;
        if !self.has(NodeCapability::StageUnstageVolume) {
            return Err(Status::unimplemented(
                "NodeStageVolume: STAGE_UNSTAGE_VOLUME is not advertised",
            ));
        }
        let r = request.into_inner();
        let id = required(&r.volume_id, "volume_id")?;
        let path = required_path(&r.staging_target_path, "staging_target_path")?;
        let cap = capability(r.volume_capability.as_ref(), "volume_capability")?;
        self.require_device(&r.publish_context)?;
        self.require_existing(&path, "staging target path")?;
        let dir = {
            let state = self.lock_with(id);
            let v = state.volumes.get(id).ok_or_else(|| not_found(id))?;
            match &v.staged {
                Some((p, c)) if *p == path && *c == cap => {
                    return Ok(Response::new(NodeStageVolumeResponse {}));
                }
                Some((p, _)) if *p == path => {
                    return Err(Status::already_exists(format!(
                        "volume {id:?} is staged at {} with another capability",
                        p.display()
                    )));
                }
                Some((p, _)) => {
                    return Err(Status::failed_precondition(format!(
                        "volume {id:?} is already staged at {}",
                        p.display()
                    )));
                }
                None => {}
            }
            drop(state);
            self.volume_dir(id)?
        };
        // The CO creates the staging directory (docs/upstream/csi-wire.md §1.13).
        if !path.is_dir() {
            return Err(Status::failed_precondition(format!(
                "staging path {} is not a directory",
                path.display()
            )));
        }
        let mut state = self.lock();
        let Some(v) = state.volumes.get(id).cloned() else {
            return Err(not_found(id));
        };
        if v.staged.is_some() {
            return Err(Status::aborted(format!(
                "volume {id:?}: a concurrent NodeStageVolume won"
            )));
        }
        self.expose(&mut state, &dir, &path, false)?;
        if let Some(v) = state.volumes.get_mut(id) {
            v.staged = Some((path, cap));
        }
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let _call = self.enter(Method::NodeUnstageVolume).await?;
        if !self.has(NodeCapability::StageUnstageVolume) {
            return Err(Status::unimplemented(
                "NodeUnstageVolume: STAGE_UNSTAGE_VOLUME is not advertised",
            ));
        }
        let r = request.into_inner();
        let id = required(&r.volume_id, "volume_id")?;
        let path = required_path(&r.staging_target_path, "staging_target_path")?;
        let mut state = self.lock_with(id);
        let v = state.volumes.get(id).ok_or_else(|| not_found(id))?;
        // Not staged there by this instance: nothing to do (the spec wants OK), unless another
        // instance of a persistent driver staged it.
        if !matches!(&v.staged, Some((p, _)) if *p == path) {
            self.unmount_foreign(&path)?;
            return Ok(Response::new(NodeUnstageVolumeResponse {}));
        }
        if !v.published.is_empty() {
            return Err(Status::failed_precondition(format!(
                "volume {id:?} is still published at {} target(s)",
                v.published.len()
            )));
        }
        self.conceal(&mut state, &path)?;
        if let Some(v) = state.volumes.get_mut(id) {
            v.staged = None;
        }
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let _call = self.enter(Method::NodePublishVolume).await?;
        let r = request.into_inner();
        let id = required(&r.volume_id, "volume_id")?;
        let target = required_path(&r.target_path, "target_path")?;
        let cap = capability(r.volume_capability.as_ref(), "volume_capability")?;
        let staging = self.has(NodeCapability::StageUnstageVolume);
        let staging_path = if staging {
            if r.staging_target_path.is_empty() {
                return Err(Status::failed_precondition(
                    "staging_target_path is required: the driver advertises STAGE_UNSTAGE_VOLUME",
                ));
            }
            Some(required_path(
                &r.staging_target_path,
                "staging_target_path",
            )?)
        } else {
            None
        };
        self.require_device(&r.publish_context)?;
        if let Some(parent) = target.parent() {
            self.require_existing(parent, "the parent of target path")?;
        }
        if let Some(p) = &staging_path {
            self.require_existing(p, "staging target path")?;
        }
        let source = {
            let state = self.lock_with(id);
            let v = state.volumes.get(id).ok_or_else(|| not_found(id))?;
            if let Some((c, ro)) = v.published.get(&target) {
                if *c == cap && *ro == r.readonly {
                    return Ok(Response::new(NodePublishVolumeResponse {}));
                }
                return Err(Status::already_exists(format!(
                    "volume {id:?} is published at {} with another capability or readonly flag",
                    target.display()
                )));
            }
            match (&staging_path, &v.staged) {
                (Some(want), Some((p, _))) if p == want => p.clone(),
                (Some(want), _) => {
                    return Err(Status::failed_precondition(format!(
                        "volume {id:?} is not staged at {}",
                        want.display()
                    )));
                }
                (None, _) => {
                    drop(state);
                    self.volume_dir(id)?
                }
            }
        };
        // The plugin creates the target; its parent must exist (docs/upstream/csi-wire.md §1.6).
        match std::fs::create_dir(&target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && target.is_dir() => {}
            Err(e) => return Err(internal("cannot create", &target, e)),
        }
        let mut state = self.lock();
        if state
            .volumes
            .get(id)
            .is_none_or(|v| v.published.contains_key(&target))
        {
            return Err(Status::aborted(format!(
                "volume {id:?}: a concurrent call changed it"
            )));
        }
        self.expose(&mut state, &source, &target, r.readonly)?;
        if let Some(v) = state.volumes.get_mut(id) {
            v.published.insert(target, (cap, r.readonly));
        }
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let _call = self.enter(Method::NodeUnpublishVolume).await?;
        let r = request.into_inner();
        let id = required(&r.volume_id, "volume_id")?;
        let target = required_path(&r.target_path, "target_path")?;
        let mut state = self.lock_with(id);
        let v = state.volumes.get(id).ok_or_else(|| not_found(id))?;
        if v.published.contains_key(&target) {
            self.conceal(&mut state, &target)?;
            if let Some(v) = state.volumes.get_mut(id) {
                v.published.remove(&target);
            }
        } else {
            self.unmount_foreign(&target)?;
        }
        // The plugin removes the target it created; a repeat finds it gone.
        match std::fs::remove_dir(&target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(internal("cannot remove", &target, e)),
        }
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let _call = self.enter(Method::NodeGetVolumeStats).await?;
        if !self.has(NodeCapability::GetVolumeStats) {
            return Err(Status::unimplemented(
                "NodeGetVolumeStats: GET_VOLUME_STATS is not advertised",
            ));
        }
        let r = request.into_inner();
        let id = required(&r.volume_id, "volume_id")?;
        let path = required_path(&r.volume_path, "volume_path")?;
        let dir = {
            let state = self.lock_with(id);
            let v = state.volumes.get(id).ok_or_else(|| not_found(id))?;
            if !is_at(v, &path) {
                return Err(Status::not_found(format!(
                    "volume {id:?} is not staged or published at {}",
                    path.display()
                )));
            }
            self.data_dir.join(id)
        };
        let s = rustix::fs::statvfs(&dir).map_err(|e| internal("statvfs", &dir, e))?;
        let clamp = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
        let bytes = |blocks: u64| clamp(blocks.saturating_mul(s.f_frsize));
        Ok(Response::new(NodeGetVolumeStatsResponse {
            usage: vec![
                VolumeUsage {
                    available: bytes(s.f_bavail),
                    total: bytes(s.f_blocks),
                    used: bytes(s.f_blocks.saturating_sub(s.f_bfree)),
                    unit: volume_usage::Unit::Bytes as i32,
                },
                VolumeUsage {
                    available: clamp(s.f_favail),
                    total: clamp(s.f_files),
                    used: clamp(s.f_files.saturating_sub(s.f_ffree)),
                    unit: volume_usage::Unit::Inodes as i32,
                },
            ],
            volume_condition: self
                .node_reports_condition()
                .then(|| self.condition(id))
                .flatten(),
        }))
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let _call = self.enter(Method::NodeExpandVolume).await?;
        if !self.has(NodeCapability::ExpandVolume) {
            return Err(Status::unimplemented(
                "NodeExpandVolume: EXPAND_VOLUME is not advertised",
            ));
        }
        let r = request.into_inner();
        let id = required(&r.volume_id, "volume_id")?;
        // The volume is looked up before volume_path is checked, as csi-driver-host-path
        // does: the spec does not order the two, so a check must not depend on the order.
        let mut state = self.lock_with(id);
        let v = state.volumes.get_mut(id).ok_or_else(|| not_found(id))?;
        let path = required_path(&r.volume_path, "volume_path")?;
        if !is_at(v, &path) {
            return Err(Status::not_found(format!(
                "volume {id:?} is not staged or published at {}",
                path.display()
            )));
        }
        if let Some(range) = r.capacity_range {
            if range.required_bytes < 0
                || range.limit_bytes < 0
                || (range.limit_bytes > 0 && range.required_bytes > range.limit_bytes)
            {
                return Err(Status::out_of_range("invalid capacity range"));
            }
            v.capacity = v.capacity.max(range.required_bytes);
        }
        Ok(Response::new(NodeExpandVolumeResponse {
            capacity_bytes: v.capacity,
        }))
    }
}

impl Driver {
    /// Whether GetCapacity is served.
    fn tracks_capacity(&self) -> bool {
        self.config.capacity.is_tracked() || self.config.capacity_file.is_some()
    }

    /// The size of the pool of `segment`: for this driver's own segment the capacity file's
    /// number when it has one, else the configured pools.
    fn pool(&self, segment: &BTreeMap<String, String>) -> Option<i64> {
        if *segment == self.config.topology
            && let Some(bytes) = self
                .config
                .capacity_file
                .as_ref()
                .and_then(|f| std::fs::read_to_string(f).ok())
                .and_then(|t| t.trim().parse::<i64>().ok())
        {
            return Some(bytes);
        }
        self.config.capacity.pool(segment)
    }

    /// What the pool of `segment` has left: its size less the volumes CreateVolume made in it
    /// (this driver's volumes live on its own node's segment); 0 for a segment without a pool.
    fn available(&self, segment: &BTreeMap<String, String>) -> i64 {
        let Some(pool) = self.pool(segment) else {
            return 0;
        };
        let used = if *segment == self.config.topology {
            self.lock().used()
        } else {
            0
        };
        pool.saturating_sub(used).max(0)
    }
}

/// Whether `v` is staged or published at `path`.
fn is_at(v: &VolumeState, path: &Path) -> bool {
    v.published.contains_key(path) || v.staged.as_ref().is_some_and(|(p, _)| p == path)
}

fn unimplemented<T>(method: &str) -> Result<Response<T>, Status> {
    Err(Status::unimplemented(format!(
        "{method} is not implemented by the test driver"
    )))
}

#[tonic::async_trait]
impl Controller for Driver {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let r = request.into_inner();
        // Kept before the fault plan runs, so that a hanging call can be inspected too.
        self.config.calls.keep_create(&r);
        let _call = self.enter(Method::CreateVolume).await?;
        let name = required(&r.name, "name")?;
        if name.len() > 128 || name.chars().any(char::is_control) {
            return Err(Status::invalid_argument(
                "name must be at most 128 bytes without control characters",
            ));
        }
        if r.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities is required"));
        }
        for c in &r.volume_capabilities {
            capability(Some(c), "volume_capabilities")?;
        }
        // A restore or a clone starts as a copy of its source, and is at least as large.
        // A volume of this name answers for itself, whatever became of its source since: the
        // spec matches a repeated CreateVolume by name (and capacity, capabilities and
        // parameters), so a caller repeating its request after the source is gone still learns
        // the volume's id.
        let source = match &r.volume_content_source {
            Some(c) => match self.content_source(c) {
                Ok(s) => Some(s),
                Err(_) if self.has_volume_named(name) => None,
                Err(e) => return Err(e),
            },
            None => None,
        };
        let (required_bytes, limit) = r
            .capacity_range
            .map_or((0, 0), |c| (c.required_bytes, c.limit_bytes));
        if required_bytes < 0 || limit < 0 || (limit > 0 && required_bytes > limit) {
            return Err(Status::out_of_range("invalid capacity range"));
        }
        let max = self.config.max_capacity;
        if max > 0 && required_bytes > max {
            return Err(Status::out_of_range(format!(
                "{required_bytes} bytes requested, at most {max} allowed"
            )));
        }
        let capacity = if required_bytes > 0 {
            required_bytes
        } else if limit > 0 {
            limit.min(self.config.default_capacity)
        } else {
            self.config.default_capacity
        };
        let capacity = match &source {
            Some((_, least, what)) if capacity < *least => {
                if limit > 0 && *least > limit {
                    return Err(Status::out_of_range(format!(
                        "the source holds {least} bytes, more than the limit of {limit}"
                    )));
                }
                match self.config.smaller_than_source {
                    // A request that names a size below the source's is refused with the code
                    // the spec names for it (OUT_OF_RANGE: "trying to create a volume smaller
                    // than the source snapshot"); no size at all leaves it to the driver.
                    SmallerThanSource::Refuse if required_bytes > 0 => {
                        return Err(Status::out_of_range(format!(
                            "requested {required_bytes} bytes, less than the {least} bytes of \
                             the source {what}"
                        )));
                    }
                    SmallerThanSource::Refuse | SmallerThanSource::Grow => *least,
                    SmallerThanSource::Accept => capacity,
                }
            }
            _ => capacity,
        };
        let (minimum, maximum) = self.config.capacity.limits();
        if maximum.is_some_and(|m| capacity > m) || minimum.is_some_and(|m| capacity < m) {
            return Err(Status::out_of_range(format!(
                "{capacity} bytes are outside the volume sizes this driver makes ({} to {})",
                minimum.unwrap_or(0),
                maximum.map_or("any".to_owned(), |m| m.to_string())
            )));
        }
        // Topology: the volume lives on this driver's node; a requirement that excludes it
        // cannot be met here.
        let topology = &self.config.topology;
        let accessible_topology = if topology.is_empty() {
            Vec::new()
        } else {
            if let Some(req) = &r.accessibility_requirements {
                let fits = |t: &Topology| {
                    t.segments
                        .iter()
                        .all(|(k, v)| topology.get(k).is_some_and(|mine| mine == v))
                };
                let listed = if req.requisite.is_empty() {
                    &req.preferred
                } else {
                    &req.requisite
                };
                if !listed.is_empty() && !listed.iter().any(fits) {
                    return Err(Status::resource_exhausted(
                        "no requested topology segment is served by this driver",
                    ));
                }
            }
            vec![Topology {
                segments: to_map(topology),
            }]
        };
        // A persistent driver's volume id is its name, so every instance agrees on it.
        let persistent = self.config.persistent;
        if persistent && !valid_volume_id(name) {
            return Err(Status::invalid_argument(
                "a persistent driver uses the name as the volume id: it must not contain '/' \
                 or be '.' or '..'",
            ));
        }
        let mut state = if persistent {
            self.lock_with(name)
        } else {
            self.lock()
        };
        if let Some((id, v)) = state.volumes.iter().find(|(_, v)| v.name == name) {
            if v.capacity < required_bytes || (limit > 0 && v.capacity > limit) {
                return Err(Status::already_exists(format!(
                    "volume {name:?} exists with {} bytes, incompatible with the request",
                    v.capacity
                )));
            }
            return Ok(Response::new(CreateVolumeResponse {
                volume: Some(Volume {
                    capacity_bytes: self.config.reported_capacity.unwrap_or(v.capacity),
                    volume_id: id.clone(),
                    volume_context: Default::default(),
                    content_source: r
                        .volume_content_source
                        .clone()
                        .filter(|_| !self.config.omit_content_source),
                    accessible_topology,
                }),
            }));
        }
        // Never an id a pre-provisioned volume already has.
        let id = if persistent {
            name.to_owned()
        } else {
            loop {
                state.next_id += 1;
                let id = format!("pv-{}", state.next_id);
                if !state.volumes.contains_key(&id) {
                    break id;
                }
            }
        };
        // With capacity tracking the volume comes out of this node's pool, which must hold it;
        // the bytes stay reserved while the source is copied.
        let reserved = match self.pool(&self.config.topology) {
            Some(pool) => {
                let left = pool.saturating_sub(state.used()).max(0);
                if capacity > left {
                    return Err(Status::resource_exhausted(format!(
                        "not enough capacity: {capacity} bytes requested, {left} bytes left"
                    )));
                }
                state.reserved += capacity;
                capacity
            }
            None => 0,
        };
        drop(state);
        let made = (|| {
            let dir = self.volume_dir(&id)?;
            if let Some((from, _, _)) = &source {
                crate::snapshots::copy_tree(from, &dir)
                    .map_err(|e| internal("cannot copy the content source into", &dir, e))?;
            }
            if persistent {
                self.write_meta(&id, name, capacity)?;
            }
            Ok::<_, Status>(())
        })();
        let mut state = self.lock();
        state.reserved -= reserved;
        made?;
        state.volumes.insert(
            id.clone(),
            VolumeState {
                name: name.to_owned(),
                capacity,
                staged: None,
                published: BTreeMap::new(),
                attached: BTreeSet::new(),
            },
        );
        Ok(Response::new(CreateVolumeResponse {
            volume: Some(Volume {
                capacity_bytes: self.config.reported_capacity.unwrap_or(capacity),
                volume_id: id,
                volume_context: Default::default(),
                content_source: r
                    .volume_content_source
                    .filter(|_| !self.config.omit_content_source),
                accessible_topology,
            }),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let r = request.into_inner();
        self.config.calls.keep_delete(&r);
        let _call = self.enter(Method::DeleteVolume).await?;
        let id = required(&r.volume_id, "volume_id")?;
        let mut state = self.lock_with(id);
        let Some(v) = state.volumes.get(id) else {
            // Deleting a missing volume is success (idempotency).
            return Ok(Response::new(DeleteVolumeResponse {}));
        };
        if v.staged.is_some() || !v.published.is_empty() {
            return Err(Status::failed_precondition(format!(
                "volume {id:?} is still staged or published"
            )));
        }
        if !v.attached.is_empty() {
            return Err(Status::failed_precondition(format!(
                "volume {id:?} is still ControllerPublished to {} node(s)",
                v.attached.len()
            )));
        }
        state.volumes.remove(id);
        drop(state);
        let dir = self.data_dir.join(id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(internal("cannot remove", &dir, e)),
        }
        if self.config.persistent {
            let meta = self.meta_path(id);
            match std::fs::remove_file(&meta) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(internal("cannot remove", &meta, e)),
            }
        }
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        let _call = self.enter(Method::ControllerGetCapabilities).await?;
        use controller_service_capability::rpc::Type;
        let mut types = vec![Type::CreateDeleteVolume];
        if self.config.controller_publish {
            types.push(Type::PublishUnpublishVolume);
        }
        if self.config.list_volumes {
            types.extend([Type::ListVolumes, Type::ListVolumesPublishedNodes]);
        }
        if self.config.controller_expand {
            types.push(Type::ExpandVolume);
        }
        if self.config.controller_modify {
            types.push(Type::ModifyVolume);
        }
        if self.config.single_node_multi_writer {
            types.push(Type::SingleNodeMultiWriter);
        }
        if self.config.publish_readonly {
            types.push(Type::PublishReadonly);
        }
        if self.config.snapshots {
            types.push(Type::CreateDeleteSnapshot);
            if !self.config.no_list_snapshots {
                types.push(Type::ListSnapshots);
            }
            types.push(Type::GetSnapshot);
        }
        if self.config.clone_volume {
            types.push(Type::CloneVolume);
        }
        if self.tracks_capacity() {
            types.push(Type::GetCapacity);
        }
        if self.config.volume_condition {
            types.push(Type::VolumeCondition);
            if !self.config.no_get_volume {
                types.push(Type::GetVolume);
            }
        }
        let capabilities = types
            .into_iter()
            .map(|t| ControllerServiceCapability {
                r#type: Some(controller_service_capability::Type::Rpc(
                    controller_service_capability::Rpc { r#type: t as i32 },
                )),
            })
            .collect();
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn controller_publish_volume(
        &self,
        request: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        if !self.config.controller_publish {
            return unimplemented("ControllerPublishVolume");
        }
        let _call = self.enter(Method::ControllerPublishVolume).await?;
        let r = request.into_inner();
        self.config.calls.keep_publish(&r);
        let id = required(&r.volume_id, "volume_id")?;
        let node = required(&r.node_id, "node_id")?;
        capability(r.volume_capability.as_ref(), "volume_capability")?;
        if node != self.config.node_id {
            return Err(Status::not_found(format!("node {node:?} does not exist")));
        }
        let mut state = self.lock_with(id);
        let v = state.volumes.get_mut(id).ok_or_else(|| not_found(id))?;
        // Publishing again to the same node is success (idempotency).
        v.attached.insert(node.to_owned());
        let publish_context = [("device".to_owned(), PUBLISHED_DEVICE.to_owned())]
            .into_iter()
            .collect();
        Ok(Response::new(ControllerPublishVolumeResponse {
            publish_context,
        }))
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        if !self.config.controller_publish {
            return unimplemented("ControllerUnpublishVolume");
        }
        let _call = self.enter(Method::ControllerUnpublishVolume).await?;
        let r = request.into_inner();
        self.config.calls.keep_unpublish(&r);
        let id = required(&r.volume_id, "volume_id")?;
        let mut state = self.lock_with(id);
        // A volume this driver does not know is not published anywhere: OK, as the spec asks
        // (the attacher takes every error as "may still be attached" and retries forever).
        let Some(v) = state.volumes.get_mut(id) else {
            return Ok(Response::new(ControllerUnpublishVolumeResponse {}));
        };
        // An empty node_id means every node; a volume not published there is already done.
        if r.node_id.is_empty() {
            v.attached.clear();
        } else {
            v.attached.remove(&r.node_id);
        }
        Ok(Response::new(ControllerUnpublishVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        _: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        unimplemented("ValidateVolumeCapabilities")
    }

    async fn list_volumes(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        if !self.config.list_volumes {
            return unimplemented("ListVolumes");
        }
        let _call = self.enter(Method::ListVolumes).await?;
        let r = request.into_inner();
        if r.max_entries < 0 {
            return Err(Status::invalid_argument("max_entries must not be negative"));
        }
        let start: usize = if r.starting_token.is_empty() {
            0
        } else {
            r.starting_token.parse().map_err(|_| {
                Status::aborted(format!("invalid starting_token {:?}", r.starting_token))
            })?
        };
        let state = self.lock();
        if start > state.volumes.len() {
            return Err(Status::aborted(format!("invalid starting_token {start}")));
        }
        let asked = if r.max_entries == 0 {
            usize::MAX
        } else {
            r.max_entries as usize
        };
        let page = asked.min(self.config.list_volumes_page.unwrap_or(usize::MAX));
        let entries: Vec<list_volumes_response::Entry> = state
            .volumes
            .iter()
            .skip(start)
            .take(page)
            .map(|(id, v)| list_volumes_response::Entry {
                volume: Some(Volume {
                    volume_id: id.clone(),
                    capacity_bytes: v.capacity,
                    ..Volume::default()
                }),
                status: Some(list_volumes_response::VolumeStatus {
                    published_node_ids: v.attached.iter().cloned().collect(),
                    volume_condition: self
                        .config
                        .volume_condition
                        .then(|| self.condition(id))
                        .flatten(),
                }),
            })
            .collect();
        let next = start + entries.len();
        let next_token = if next < state.volumes.len() {
            next.to_string()
        } else {
            String::new()
        };
        Ok(Response::new(ListVolumesResponse {
            entries,
            next_token,
        }))
    }

    async fn get_capacity(
        &self,
        request: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        let r = request.into_inner();
        if !self.tracks_capacity() {
            return unimplemented("GetCapacity");
        }
        self.config.calls.keep_get_capacity(&r);
        let _call = self.enter(Method::GetCapacity).await?;
        for c in &r.volume_capabilities {
            capability(Some(c), "volume_capabilities")?;
        }
        // No topology asks about the pool of this driver's own node.
        let segment: BTreeMap<String, String> = match &r.accessible_topology {
            Some(t) if !t.segments.is_empty() => t.segments.clone().into_iter().collect(),
            _ => self.config.topology.clone(),
        };
        let available = self.available(&segment);
        let (minimum_volume_size, maximum_volume_size) = self.config.capacity.limits();
        Ok(Response::new(GetCapacityResponse {
            available_capacity: available,
            maximum_volume_size,
            minimum_volume_size,
        }))
    }

    async fn create_snapshot(
        &self,
        request: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        if !self.config.snapshots {
            return unimplemented("CreateSnapshot");
        }
        self.do_create_snapshot(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn delete_snapshot(
        &self,
        request: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        if !self.config.snapshots {
            return unimplemented("DeleteSnapshot");
        }
        self.do_delete_snapshot(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn list_snapshots(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        if !self.config.snapshots || self.config.no_list_snapshots {
            return unimplemented("ListSnapshots");
        }
        self.do_list_snapshots(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn get_snapshot(
        &self,
        request: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        if !self.config.snapshots {
            return unimplemented("GetSnapshot");
        }
        self.do_get_snapshot(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        if !self.config.controller_expand {
            return unimplemented("ControllerExpandVolume");
        }
        let r = request.into_inner();
        // Kept before the fault plan runs, so that a failing call can be inspected too.
        self.config.calls.keep_expand(&r);
        let _call = self.enter(Method::ControllerExpandVolume).await?;
        let id = required(&r.volume_id, "volume_id")?;
        let (required_bytes, limit) = r
            .capacity_range
            .map_or((0, 0), |c| (c.required_bytes, c.limit_bytes));
        if required_bytes < 0 || limit < 0 || (limit > 0 && required_bytes > limit) {
            return Err(Status::out_of_range("invalid capacity range"));
        }
        let max = self.config.max_capacity;
        if max > 0 && required_bytes > max {
            return Err(Status::out_of_range(format!(
                "{required_bytes} bytes requested, at most {max} allowed"
            )));
        }
        if let Some(c) = &r.volume_capability {
            capability(Some(c), "volume_capability")?;
        }
        let mut state = self.lock_with(id);
        let v = state.volumes.get_mut(id).ok_or_else(|| not_found(id))?;
        // Expanding to a size the volume has is success (idempotency); it never shrinks.
        v.capacity = v.capacity.max(required_bytes);
        Ok(Response::new(ControllerExpandVolumeResponse {
            capacity_bytes: v.capacity,
            node_expansion_required: self.config.node_expansion_required,
        }))
    }

    async fn controller_get_volume(
        &self,
        request: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        if !self.config.volume_condition || self.config.no_get_volume {
            return unimplemented("ControllerGetVolume");
        }
        let _call = self.enter(Method::ControllerGetVolume).await?;
        let r = request.into_inner();
        self.config.calls.keep_get_volume(&r.volume_id);
        let id = required(&r.volume_id, "volume_id")?;
        let state = self.lock_with(id);
        let v = state.volumes.get(id).ok_or_else(|| not_found(id))?;
        Ok(Response::new(ControllerGetVolumeResponse {
            volume: Some(Volume {
                volume_id: id.to_owned(),
                capacity_bytes: v.capacity,
                // What CreateVolume returned: this driver gives its volumes no context.
                volume_context: Default::default(),
                ..Volume::default()
            }),
            status: Some(controller_get_volume_response::VolumeStatus {
                published_node_ids: v.attached.iter().cloned().collect(),
                volume_condition: self.condition(id),
            }),
        }))
    }

    async fn controller_modify_volume(
        &self,
        request: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        if !self.config.controller_modify {
            return unimplemented("ControllerModifyVolume");
        }
        let r = request.into_inner();
        self.config.calls.keep_modify(&r);
        let _call = self.enter(Method::ControllerModifyVolume).await?;
        let id = required(&r.volume_id, "volume_id")?;
        if r.mutable_parameters.contains_key("invalid") {
            return Err(Status::invalid_argument(
                "mutable parameter \"invalid\" cannot be applied",
            ));
        }
        let state = self.lock_with(id);
        if !state.volumes.contains_key(id) {
            return Err(not_found(id));
        }
        Ok(Response::new(ControllerModifyVolumeResponse {}))
    }
}
