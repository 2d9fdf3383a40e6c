//! Snapshots and volume content sources of the test driver.
//!
//! A snapshot is a copy of its source volume's directory, taken when CreateSnapshot first sees
//! its name, kept in `<data dir>/.snapshots/<id>`. A volume created from a snapshot or cloned
//! from another volume starts as a copy of that directory, so a file written into a volume can
//! be read back from a restore or a clone. As a real driver's are, the calls are idempotent by
//! name (CreateSnapshot) and id (DeleteSnapshot). A persistent driver keeps each snapshot's
//! record beside its copy (`.snapshots/.<id>.meta`), so every instance sharing the data
//! directory knows it; otherwise snapshots live in this instance's memory (ids `snap-1`, ...).
//!
//! [`DriverConfig::snapshot_ready_after`](crate::DriverConfig::snapshot_ready_after) makes a
//! new snapshot answer `ready_to_use: false` that many times before it is ready, as a driver
//! that uploads its snapshots does: each CreateSnapshot of its name, and each GetSnapshot or
//! ListSnapshots asking for its id, is one answer (the calls a sidecar polls with). A restore
//! from a snapshot not yet ready is UNAVAILABLE.
//!
//! With [`DriverConfig::group_snapshots`](crate::DriverConfig::group_snapshots) the driver also
//! serves the CSI GroupController: CreateVolumeGroupSnapshot copies every source volume under
//! one lock (one point in time) into member snapshots of this same store, which carry the
//! group's id, show in ListSnapshots and GetSnapshot and restore like any other snapshot. A
//! member cannot be deleted on its own (DeleteSnapshot is INVALID_ARGUMENT, as the spec's
//! "Snapshot is part of a group" row says); DeleteVolumeGroupSnapshot deletes the group with all
//! its members. [`DriverConfig::group_ready_after`](crate::DriverConfig::group_ready_after) keeps
//! a new group, and so its members, not ready for that many answers about the group (each
//! CreateVolumeGroupSnapshot of its name and each GetVolumeGroupSnapshot of its id is one).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use plugreg_proto::csi::v1::group_controller_server::GroupController;
use plugreg_proto::csi::v1::{
    CreateSnapshotRequest, CreateSnapshotResponse, CreateVolumeGroupSnapshotRequest,
    CreateVolumeGroupSnapshotResponse, DeleteSnapshotRequest, DeleteSnapshotResponse,
    DeleteVolumeGroupSnapshotRequest, DeleteVolumeGroupSnapshotResponse, GetSnapshotRequest,
    GetSnapshotResponse, GetVolumeGroupSnapshotRequest, GetVolumeGroupSnapshotResponse,
    GroupControllerGetCapabilitiesRequest, GroupControllerGetCapabilitiesResponse,
    GroupControllerServiceCapability, ListSnapshotsRequest, ListSnapshotsResponse, Snapshot,
    SnapshotTime, VolumeContentSource, VolumeGroupSnapshot, group_controller_service_capability,
    list_snapshots_response, volume_content_source,
};
use tonic::{Request, Response, Status};

use crate::volumes::{State, valid_volume_id};
use crate::{Driver, Method};

/// One snapshot the driver knows.
#[derive(Debug, Clone)]
pub(crate) struct SnapshotState {
    /// The CreateSnapshot name.
    name: String,
    /// The volume it was taken of.
    source: String,
    /// The source volume's capacity when it was taken: the least a restore may ask for.
    size: i64,
    /// When it was taken (seconds and nanoseconds since the epoch).
    created: (i64, i32),
    /// Answers about it so far (see the module's docs).
    looks: u32,
    /// The id of the volume group snapshot it belongs to; empty for a snapshot of its own.
    group: String,
}

impl SnapshotState {
    /// One more answer about it.
    fn look(&mut self) {
        self.looks = self.looks.saturating_add(1);
    }

    fn ready(&self, after: u32) -> bool {
        self.looks > after
    }

    fn wire(&self, id: &str, ready: bool) -> Snapshot {
        Snapshot {
            size_bytes: self.size,
            snapshot_id: id.to_owned(),
            source_volume_id: self.source.clone(),
            creation_time: Some(SnapshotTime {
                seconds: self.created.0,
                nanos: self.created.1,
            }),
            ready_to_use: ready,
            group_snapshot_id: self.group.clone(),
        }
    }
}

/// One volume group snapshot the driver knows.
#[derive(Debug, Clone)]
pub(crate) struct GroupState {
    /// The CreateVolumeGroupSnapshot name.
    name: String,
    /// Each member as (source volume, snapshot id), in the order the volumes were asked for.
    members: Vec<(String, String)>,
    /// The CreateVolumeGroupSnapshot parameters (a repeat with others is ALREADY_EXISTS).
    parameters: BTreeMap<String, String>,
    /// When it was cut (seconds and nanoseconds since the epoch), the same for every member.
    created: (i64, i32),
    /// Answers about it so far (see the module's docs).
    looks: u32,
}

impl GroupState {
    /// One more answer about it.
    fn look(&mut self) {
        self.looks = self.looks.saturating_add(1);
    }

    fn ready(&self, after: u32) -> bool {
        self.looks > after
    }

    /// The source volumes, as a set: what a repeated create must ask for again.
    fn sources(&self) -> BTreeSet<&str> {
        self.members.iter().map(|(v, _)| v.as_str()).collect()
    }

    /// Whether `ids` names exactly the group's snapshots (in any order).
    fn has_exactly(&self, ids: &[String]) -> bool {
        let mut asked: Vec<&str> = ids.iter().map(String::as_str).collect();
        let mut own: Vec<&str> = self.members.iter().map(|(_, s)| s.as_str()).collect();
        asked.sort_unstable();
        own.sort_unstable();
        asked == own
    }
}

/// The snapshots and volume group snapshots of a [`State`].
#[derive(Debug, Default)]
pub(crate) struct Snapshots {
    /// Snapshots (members of groups too), by id.
    by_id: BTreeMap<String, SnapshotState>,
    /// Volume group snapshots, by id.
    groups: BTreeMap<String, GroupState>,
    next_group: u64,
}

impl Snapshots {
    /// Whether snapshot `s` is ready: a member when its group is, any other after
    /// `snapshot_after` answers.
    fn ready(&self, s: &SnapshotState, snapshot_after: u32, group_after: u32) -> bool {
        match self.groups.get(&s.group) {
            Some(g) => g.ready(group_after),
            None => s.ready(snapshot_after),
        }
    }
}

/// Fields as `<length>:<bytes>` one after another: a record whose values may hold any
/// character (parameters, names), read back by [`decode_fields`].
fn encode_fields<'a>(fields: impl IntoIterator<Item = &'a str>) -> String {
    fields
        .into_iter()
        .map(|f| format!("{}:{f}", f.len()))
        .collect()
}

fn decode_fields(mut text: &str) -> Option<Vec<String>> {
    let mut fields = Vec::new();
    while !text.is_empty() {
        let (len, rest) = text.split_once(':')?;
        let len: usize = len.parse().ok()?;
        fields.push(rest.get(..len)?.to_owned());
        text = &rest[len..];
    }
    Some(fields)
}

/// Whether `name` holds a character the spec bans from a group snapshot name: the control
/// characters other than tab, line feed and carriage return.
fn has_banned_char(name: &str) -> bool {
    name.chars()
        .any(|c| c.is_control() && !matches!(c, '\t' | '\n' | '\r'))
}

fn now() -> (i64, i32) {
    let d = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() as i64, d.subsec_nanos() as i32)
}

/// Copies the tree at `from` into `to` (created; files, directories and symbolic links).
pub(crate) fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        let kind = entry.file_type()?;
        if kind.is_dir() {
            copy_tree(&src, &dst)?;
        } else if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&src)?, &dst)?;
        } else if kind.is_file() {
            std::fs::copy(&src, &dst)?;
        }
    }
    Ok(())
}

fn internal(what: &str, path: &Path, e: impl std::fmt::Display) -> Status {
    Status::internal(format!("{what} {}: {e}", path.display()))
}

fn remove_file_if_present(path: &Path) -> Result<(), Status> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(internal("cannot remove", path, e)),
    }
}

impl Driver {
    fn snapshots_dir(&self) -> PathBuf {
        self.data_dir.join(".snapshots")
    }

    fn snapshot_meta(&self, id: &str) -> PathBuf {
        self.snapshots_dir().join(format!(".{id}.meta"))
    }

    /// A persisted snapshot's record: `size\nseconds\nnanos\nsource\nname`, then
    /// `\ngroup id` for a member of a group.
    fn read_snapshot_meta(&self, id: &str) -> Option<SnapshotState> {
        if !valid_volume_id(id) || !self.snapshots_dir().join(id).is_dir() {
            return None;
        }
        let text = std::fs::read_to_string(self.snapshot_meta(id)).ok()?;
        let mut lines = text.splitn(6, '\n');
        let size = lines.next()?.parse().ok()?;
        let seconds = lines.next()?.parse().ok()?;
        let nanos = lines.next()?.parse().ok()?;
        let source = lines.next()?.to_owned();
        let name = lines.next()?.to_owned();
        let group = lines.next().unwrap_or_default().to_owned();
        Some(SnapshotState {
            name,
            source,
            size,
            created: (seconds, nanos),
            looks: u32::MAX,
            group,
        })
    }

    fn write_snapshot_meta(&self, id: &str, s: &SnapshotState) -> Result<(), Status> {
        let path = self.snapshot_meta(id);
        let temp = self.snapshots_dir().join(format!(".{id}.meta.tmp"));
        let mut text = format!(
            "{}\n{}\n{}\n{}\n{}",
            s.size, s.created.0, s.created.1, s.source, s.name
        );
        if !s.group.is_empty() {
            text.push('\n');
            text.push_str(&s.group);
        }
        std::fs::write(&temp, text)
            .and_then(|()| std::fs::rename(&temp, &path))
            .map_err(|e| internal("cannot write", &path, e))
    }

    /// In persistent mode, learns every snapshot another instance recorded.
    fn load_snapshots(&self, state: &mut State) {
        if !self.config.persistent {
            return;
        }
        let Ok(entries) = std::fs::read_dir(self.snapshots_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(id) = name.to_str() else { continue };
            if id.starts_with('.') || state.snapshots.by_id.contains_key(id) {
                continue;
            }
            if let Some(s) = self.read_snapshot_meta(id) {
                state.snapshots.by_id.insert(id.to_owned(), s);
            }
        }
    }

    /// The snapshot `id`, loading it from the data directory when persistent.
    fn snapshot(&self, state: &mut State, id: &str) -> Option<SnapshotState> {
        if self.config.persistent
            && !state.snapshots.by_id.contains_key(id)
            && let Some(s) = self.read_snapshot_meta(id)
        {
            state.snapshots.by_id.insert(id.to_owned(), s);
        }
        state.snapshots.by_id.get(id).cloned()
    }

    pub(crate) async fn do_create_snapshot(
        &self,
        r: CreateSnapshotRequest,
    ) -> Result<CreateSnapshotResponse, Status> {
        self.config.calls.keep_create_snapshot(&r);
        let _call = self.enter(Method::CreateSnapshot).await?;
        let name = crate::volumes::required(&r.name, "name")?;
        let source = crate::volumes::required(&r.source_volume_id, "source_volume_id")?;
        if name.len() > 128 || name.chars().any(char::is_control) {
            return Err(Status::invalid_argument(
                "name must be at most 128 bytes without control characters",
            ));
        }
        let persistent = self.config.persistent;
        if persistent && !valid_volume_id(name) {
            return Err(Status::invalid_argument(
                "a persistent driver uses the name as the snapshot id: it must not contain '/' \
                 or be '.' or '..'",
            ));
        }
        let mut state = self.lock_with(source);
        self.load_snapshots(&mut state);
        if let Some((id, s)) = state
            .snapshots
            .by_id
            .iter_mut()
            .find(|(_, s)| s.name == name)
        {
            if s.source != source {
                return Err(Status::already_exists(format!(
                    "snapshot {name:?} exists of volume {:?}, not {source:?}",
                    s.source
                )));
            }
            s.look();
            // A named snapshot is never a member of a group (members have no name).
            let wire = s.wire(id, s.ready(self.config.snapshot_ready_after));
            return Ok(CreateSnapshotResponse {
                snapshot: Some(wire),
            });
        }
        if persistent && let Some(other) = state.snapshots.by_id.get(name) {
            return Err(Status::already_exists(format!(
                "snapshot id {name:?} is taken by a member of volume group snapshot {:?}",
                other.group
            )));
        }
        let size = state
            .volumes
            .get(source)
            .map(|v| v.capacity)
            .ok_or_else(|| Status::not_found(format!("volume {source:?} does not exist")))?;
        let id = if persistent {
            name.to_owned()
        } else {
            loop {
                state.next_snapshot += 1;
                let id = format!("snap-{}", state.next_snapshot);
                if !state.snapshots.by_id.contains_key(&id) {
                    break id;
                }
            }
        };
        let snapshot = SnapshotState {
            name: name.to_owned(),
            source: source.to_owned(),
            size,
            created: now(),
            looks: 1,
            group: String::new(),
        };
        // Copied under the lock, so that the volume cannot be deleted halfway.
        let copy = self.snapshots_dir().join(&id);
        copy_tree(&self.data_dir.join(source), &copy)
            .map_err(|e| internal("cannot copy the volume into", &copy, e))?;
        if persistent {
            self.write_snapshot_meta(&id, &snapshot)?;
        }
        let wire = snapshot.wire(&id, snapshot.ready(self.config.snapshot_ready_after));
        state.snapshots.by_id.insert(id, snapshot);
        Ok(CreateSnapshotResponse {
            snapshot: Some(wire),
        })
    }

    pub(crate) async fn do_delete_snapshot(
        &self,
        r: DeleteSnapshotRequest,
    ) -> Result<DeleteSnapshotResponse, Status> {
        self.config.calls.keep_delete_snapshot(&r);
        let _call = self.enter(Method::DeleteSnapshot).await?;
        let id = crate::volumes::required(&r.snapshot_id, "snapshot_id")?;
        let mut state = self.lock();
        // The spec's "Snapshot is part of a group" row: a member goes only with its group.
        if let Some(s) = self.snapshot(&mut state, id)
            && !s.group.is_empty()
        {
            return Err(Status::invalid_argument(format!(
                "snapshot {id:?} is part of volume group snapshot {:?} and cannot be deleted \
                 stand alone: delete the group (DeleteVolumeGroupSnapshot)",
                s.group
            )));
        }
        state.snapshots.by_id.remove(id);
        // Deleting a missing snapshot is success (idempotency).
        self.remove_snapshot_files(id)?;
        Ok(DeleteSnapshotResponse {})
    }

    /// Removes snapshot `id`'s copy and record from the data directory; missing ones are fine.
    fn remove_snapshot_files(&self, id: &str) -> Result<(), Status> {
        if !valid_volume_id(id) {
            return Ok(());
        }
        let copy = self.snapshots_dir().join(id);
        match std::fs::remove_dir_all(&copy) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(internal("cannot remove", &copy, e)),
        }
        remove_file_if_present(&self.snapshot_meta(id))
    }

    /// Whether snapshot `s` is ready to restore from (see [`Snapshots::ready`]).
    fn is_ready(&self, snapshots: &Snapshots, s: &SnapshotState) -> bool {
        snapshots.ready(
            s,
            self.config.snapshot_ready_after,
            self.config.group_ready_after,
        )
    }

    pub(crate) async fn do_list_snapshots(
        &self,
        r: ListSnapshotsRequest,
    ) -> Result<ListSnapshotsResponse, Status> {
        let _call = self.enter(Method::ListSnapshots).await?;
        if r.max_entries < 0 {
            return Err(Status::invalid_argument("max_entries must not be negative"));
        }
        let mut state = self.lock();
        self.load_snapshots(&mut state);
        if let Some(s) = state.snapshots.by_id.get_mut(&r.snapshot_id) {
            s.look();
        }
        let matching: Vec<(&String, &SnapshotState)> = state
            .snapshots
            .by_id
            .iter()
            .filter(|(id, s)| {
                (r.snapshot_id.is_empty() || **id == r.snapshot_id)
                    && (r.source_volume_id.is_empty() || s.source == r.source_volume_id)
            })
            .collect();
        let start: usize = if r.starting_token.is_empty() {
            0
        } else {
            r.starting_token
                .parse()
                .ok()
                .filter(|&s| s <= matching.len())
                .ok_or_else(|| {
                    Status::aborted(format!("invalid starting_token {:?}", r.starting_token))
                })?
        };
        let page = if r.max_entries == 0 {
            usize::MAX
        } else {
            r.max_entries as usize
        };
        let entries: Vec<list_snapshots_response::Entry> = matching
            .iter()
            .skip(start)
            .take(page)
            .map(|(id, s)| list_snapshots_response::Entry {
                snapshot: Some(s.wire(id, self.is_ready(&state.snapshots, s))),
            })
            .collect();
        let next = start + entries.len();
        let next_token = if next < matching.len() {
            next.to_string()
        } else {
            String::new()
        };
        Ok(ListSnapshotsResponse {
            entries,
            next_token,
        })
    }

    pub(crate) async fn do_get_snapshot(
        &self,
        r: GetSnapshotRequest,
    ) -> Result<GetSnapshotResponse, Status> {
        let _call = self.enter(Method::GetSnapshot).await?;
        let id = crate::volumes::required(&r.snapshot_id, "snapshot_id")?;
        let mut state = self.lock();
        let missing = || Status::not_found(format!("snapshot {id:?} does not exist"));
        self.snapshot(&mut state, id).ok_or_else(missing)?;
        state
            .snapshots
            .by_id
            .get_mut(id)
            .ok_or_else(missing)?
            .look();
        let s = state.snapshots.by_id.get(id).ok_or_else(missing)?;
        Ok(GetSnapshotResponse {
            snapshot: Some(s.wire(id, self.is_ready(&state.snapshots, s))),
        })
    }

    /// Checks a CreateVolume content source against what this driver offers and holds, and
    /// returns the directory the new volume starts as a copy of, with the least capacity it
    /// may have (the snapshot's size or the source volume's capacity) and the source's name
    /// for messages (`snapshot "snap-1"`).
    pub(crate) fn content_source(
        &self,
        source: &VolumeContentSource,
    ) -> Result<(PathBuf, i64, String), Status> {
        match &source.r#type {
            Some(volume_content_source::Type::Snapshot(s)) => {
                if !self.config.snapshots {
                    return Err(Status::invalid_argument(
                        "snapshot content sources are not supported (no CREATE_DELETE_SNAPSHOT)",
                    ));
                }
                let id = crate::volumes::required(&s.snapshot_id, "snapshot_id")?;
                let mut state = self.lock();
                let snap = self
                    .snapshot(&mut state, id)
                    .ok_or_else(|| Status::not_found(format!("snapshot {id:?} does not exist")))?;
                if !self.is_ready(&state.snapshots, &snap) {
                    return Err(Status::unavailable(format!(
                        "snapshot {id:?} is not ready to use yet"
                    )));
                }
                Ok((
                    self.snapshots_dir().join(id),
                    snap.size,
                    format!("snapshot {id:?}"),
                ))
            }
            Some(volume_content_source::Type::Volume(v)) => {
                if !self.config.clone_volume {
                    return Err(Status::invalid_argument(
                        "volume content sources are not supported (no CLONE_VOLUME)",
                    ));
                }
                let id = crate::volumes::required(&v.volume_id, "volume_id")?;
                let state = self.lock_with(id);
                let capacity =
                    state.volumes.get(id).map(|v| v.capacity).ok_or_else(|| {
                        Status::not_found(format!("volume {id:?} does not exist"))
                    })?;
                Ok((self.data_dir.join(id), capacity, format!("volume {id:?}")))
            }
            None => Err(Status::invalid_argument(
                "volume_content_source has neither a snapshot nor a volume",
            )),
        }
    }
}

/// How long a persistent driver's group name may be: its members' ids are `<name>-<index>`,
/// which must stay ids (at most 128 bytes).
const MAX_PERSISTENT_GROUP_NAME: usize = 100;

/// The capability GroupControllerGetCapabilities answers.
fn group_capability() -> GroupControllerServiceCapability {
    use group_controller_service_capability::{Rpc, Type, rpc};
    GroupControllerServiceCapability {
        r#type: Some(Type::Rpc(Rpc {
            r#type: rpc::Type::CreateDeleteGetVolumeGroupSnapshot as i32,
        })),
    }
}

/// The `snapshot_ids` of a Delete or GetVolumeGroupSnapshot request: required, and each one an
/// id.
fn required_ids(ids: &[String]) -> Result<(), Status> {
    if ids.is_empty() {
        return Err(Status::invalid_argument("snapshot_ids is required"));
    }
    for id in ids {
        crate::volumes::required(id, "snapshot_ids")?;
    }
    Ok(())
}

fn mismatch(group: &str, g: &GroupState) -> Status {
    let own: Vec<&str> = g.members.iter().map(|(_, s)| s.as_str()).collect();
    Status::invalid_argument(format!(
        "snapshot_ids do not match the snapshots of volume group snapshot {group:?}: {own:?}"
    ))
}

impl Driver {
    /// `.snapshots/.<id>.group`: a persistent driver's record of a volume group snapshot.
    fn group_meta(&self, id: &str) -> PathBuf {
        self.snapshots_dir().join(format!(".{id}.group"))
    }

    fn read_group_meta(&self, id: &str) -> Option<GroupState> {
        if !valid_volume_id(id) {
            return None;
        }
        let text = std::fs::read_to_string(self.group_meta(id)).ok()?;
        let fields = decode_fields(&text)?;
        let [name, seconds, nanos, count, rest @ ..] = fields.as_slice() else {
            return None;
        };
        let count: usize = count.parse().ok()?;
        let (members, parameters) = rest.split_at_checked(2 * count)?;
        if parameters.len() % 2 != 0 {
            return None;
        }
        Some(GroupState {
            name: name.clone(),
            members: members
                .chunks(2)
                .map(|m| (m[0].clone(), m[1].clone()))
                .collect(),
            parameters: parameters
                .chunks(2)
                .map(|p| (p[0].clone(), p[1].clone()))
                .collect(),
            created: (seconds.parse().ok()?, nanos.parse().ok()?),
            looks: u32::MAX,
        })
    }

    fn write_group_meta(&self, id: &str, g: &GroupState) -> Result<(), Status> {
        let path = self.group_meta(id);
        let temp = self.snapshots_dir().join(format!(".{id}.group.tmp"));
        let (seconds, nanos, count) = (
            g.created.0.to_string(),
            g.created.1.to_string(),
            g.members.len().to_string(),
        );
        let text = encode_fields(
            [g.name.as_str(), &seconds, &nanos, &count]
                .into_iter()
                .chain(g.members.iter().flat_map(|(v, s)| [v.as_str(), s.as_str()]))
                .chain(
                    g.parameters
                        .iter()
                        .flat_map(|(k, v)| [k.as_str(), v.as_str()]),
                ),
        );
        std::fs::create_dir_all(self.snapshots_dir())
            .and_then(|()| std::fs::write(&temp, text))
            .and_then(|()| std::fs::rename(&temp, &path))
            .map_err(|e| internal("cannot write", &path, e))
    }

    /// The group `id`, loading it (and its members) from the data directory when persistent.
    fn group(&self, state: &mut State, id: &str) -> Option<GroupState> {
        if self.config.persistent
            && !state.snapshots.groups.contains_key(id)
            && let Some(g) = self.read_group_meta(id)
        {
            for (_, member) in &g.members {
                self.snapshot(state, member);
            }
            state.snapshots.groups.insert(id.to_owned(), g);
        }
        state.snapshots.groups.get(id).cloned()
    }

    /// In persistent mode, learns every group another instance recorded (with its members).
    fn load_groups(&self, state: &mut State) {
        if !self.config.persistent {
            return;
        }
        let Ok(entries) = std::fs::read_dir(self.snapshots_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(id) = name
                .to_str()
                .and_then(|n| n.strip_prefix('.')?.strip_suffix(".group"))
            else {
                continue;
            };
            self.group(state, id);
        }
    }

    /// The group as the wire shows it, its members with it.
    fn group_wire(&self, state: &State, id: &str, g: &GroupState) -> VolumeGroupSnapshot {
        let ready = g.ready(self.config.group_ready_after);
        VolumeGroupSnapshot {
            group_snapshot_id: id.to_owned(),
            snapshots: g
                .members
                .iter()
                .filter_map(|(_, sid)| {
                    let s = state.snapshots.by_id.get(sid)?;
                    Some(s.wire(sid, ready))
                })
                .collect(),
            creation_time: Some(SnapshotTime {
                seconds: g.created.0,
                nanos: g.created.1,
            }),
            ready_to_use: ready,
        }
    }

    /// Removes the members' copies made so far for a group that could not be completed.
    fn discard_members(&self, members: &[(String, SnapshotState)]) {
        for (id, _) in members {
            if let Err(e) = self.remove_snapshot_files(id) {
                tracing::warn!(snapshot = %id, error = %e.message(), "cleanup failed");
            }
        }
    }

    async fn do_create_group(
        &self,
        r: CreateVolumeGroupSnapshotRequest,
    ) -> Result<CreateVolumeGroupSnapshotResponse, Status> {
        self.config.calls.keep_create_group_snapshot(&r);
        let _call = self.enter(Method::CreateVolumeGroupSnapshot).await?;
        let name = crate::volumes::required(&r.name, "name")?;
        if name.len() > 128 || has_banned_char(name) {
            return Err(Status::invalid_argument(
                "name must be at most 128 bytes without control characters other than \
                 whitespace",
            ));
        }
        let persistent = self.config.persistent;
        if persistent && (!valid_volume_id(name) || name.len() > MAX_PERSISTENT_GROUP_NAME) {
            return Err(Status::invalid_argument(format!(
                "a persistent driver uses the name as the group snapshot id: it must be at most \
                 {MAX_PERSISTENT_GROUP_NAME} bytes, not contain '/' or be '.' or '..'"
            )));
        }
        if r.source_volume_ids.is_empty() {
            return Err(Status::invalid_argument("source_volume_ids is required"));
        }
        let mut sources = BTreeSet::new();
        for id in &r.source_volume_ids {
            let id = crate::volumes::required(id, "source_volume_ids")?;
            if !sources.insert(id) {
                return Err(Status::invalid_argument(format!(
                    "source_volume_ids names volume {id:?} twice"
                )));
            }
        }
        let parameters: BTreeMap<String, String> = r.parameters.clone().into_iter().collect();
        if persistent {
            // Another instance's volumes become known to this one.
            for id in &sources {
                drop(self.lock_with(id));
            }
        }
        let mut state = self.lock();
        self.load_snapshots(&mut state);
        self.load_groups(&mut state);
        if let Some((id, g)) = state
            .snapshots
            .groups
            .iter_mut()
            .find(|(_, g)| g.name == name)
        {
            if g.sources() != sources || g.parameters != parameters {
                return Err(Status::already_exists(format!(
                    "volume group snapshot {name:?} exists of volumes {:?} with parameters \
                     {:?}, not of {sources:?} with {parameters:?}",
                    g.sources(),
                    g.parameters
                )));
            }
            g.look();
            let (id, g) = (id.clone(), g.clone());
            let wire = self.group_wire(&state, &id, &g);
            return Ok(CreateVolumeGroupSnapshotResponse {
                group_snapshot: Some(wire),
            });
        }
        // The spec names no code for an unknown source volume in this call; its general
        // rule for a field with an invalid value is INVALID_ARGUMENT.
        let mut sizes = Vec::with_capacity(sources.len());
        for id in &r.source_volume_ids {
            let capacity = state.volumes.get(id).map(|v| v.capacity).ok_or_else(|| {
                Status::invalid_argument(format!("source_volume_ids: volume {id:?} does not exist"))
            })?;
            sizes.push((id.clone(), capacity));
        }
        let gid = if persistent {
            name.to_owned()
        } else {
            loop {
                state.snapshots.next_group += 1;
                let id = format!("group-{}", state.snapshots.next_group);
                if !state.snapshots.groups.contains_key(&id) {
                    break id;
                }
            }
        };
        let created = now();
        // Every member is copied under one lock: the same point in time for all volumes.
        let mut members: Vec<(String, SnapshotState)> = Vec::with_capacity(sizes.len());
        for (index, (source, size)) in sizes.into_iter().enumerate() {
            let sid = if persistent {
                let sid = format!("{gid}-{index}");
                if state.snapshots.by_id.contains_key(&sid)
                    || self.snapshots_dir().join(&sid).exists()
                {
                    self.discard_members(&members);
                    return Err(Status::already_exists(format!(
                        "the id {sid:?} of the group's snapshot of volume {source:?} is taken \
                         by another snapshot"
                    )));
                }
                sid
            } else {
                loop {
                    state.next_snapshot += 1;
                    let id = format!("snap-{}", state.next_snapshot);
                    if !state.snapshots.by_id.contains_key(&id) {
                        break id;
                    }
                }
            };
            let member = SnapshotState {
                name: String::new(),
                source: source.clone(),
                size,
                created,
                looks: 1,
                group: gid.clone(),
            };
            let copy = self.snapshots_dir().join(&sid);
            let made = copy_tree(&self.data_dir.join(&source), &copy)
                .map_err(|e| internal("cannot copy the volume into", &copy, e))
                .and_then(|()| {
                    if persistent {
                        self.write_snapshot_meta(&sid, &member)
                    } else {
                        Ok(())
                    }
                });
            members.push((sid, member));
            if let Err(e) = made {
                // No group id reached the CO, so nothing may be left behind.
                self.discard_members(&members);
                return Err(e);
            }
        }
        let group = GroupState {
            name: name.to_owned(),
            members: members
                .iter()
                .map(|(sid, m)| (m.source.clone(), sid.clone()))
                .collect(),
            parameters,
            created,
            looks: 1,
        };
        if persistent && let Err(e) = self.write_group_meta(&gid, &group) {
            self.discard_members(&members);
            return Err(e);
        }
        state.snapshots.by_id.extend(members);
        let wire = self.group_wire(&state, &gid, &group);
        state.snapshots.groups.insert(gid, group);
        Ok(CreateVolumeGroupSnapshotResponse {
            group_snapshot: Some(wire),
        })
    }

    async fn do_delete_group(
        &self,
        r: DeleteVolumeGroupSnapshotRequest,
    ) -> Result<DeleteVolumeGroupSnapshotResponse, Status> {
        self.config.calls.keep_delete_group_snapshot(&r);
        let _call = self.enter(Method::DeleteVolumeGroupSnapshot).await?;
        let id = crate::volumes::required(&r.group_snapshot_id, "group_snapshot_id")?;
        required_ids(&r.snapshot_ids)?;
        let mut state = self.lock();
        // Deleting a missing group is success (idempotency).
        let Some(g) = self.group(&mut state, id) else {
            return Ok(DeleteVolumeGroupSnapshotResponse {});
        };
        if !g.has_exactly(&r.snapshot_ids) {
            return Err(mismatch(id, &g));
        }
        for (_, sid) in &g.members {
            self.remove_snapshot_files(sid)?;
            state.snapshots.by_id.remove(sid);
        }
        if valid_volume_id(id) {
            remove_file_if_present(&self.group_meta(id))?;
        }
        state.snapshots.groups.remove(id);
        Ok(DeleteVolumeGroupSnapshotResponse {})
    }

    async fn do_get_group(
        &self,
        r: GetVolumeGroupSnapshotRequest,
    ) -> Result<GetVolumeGroupSnapshotResponse, Status> {
        let _call = self.enter(Method::GetVolumeGroupSnapshot).await?;
        let id = crate::volumes::required(&r.group_snapshot_id, "group_snapshot_id")?;
        required_ids(&r.snapshot_ids)?;
        let mut state = self.lock();
        let mut g = self.group(&mut state, id).ok_or_else(|| {
            Status::not_found(format!("volume group snapshot {id:?} does not exist"))
        })?;
        if !g.has_exactly(&r.snapshot_ids) {
            return Err(mismatch(id, &g));
        }
        g.look();
        state.snapshots.groups.insert(id.to_owned(), g.clone());
        Ok(GetVolumeGroupSnapshotResponse {
            group_snapshot: Some(self.group_wire(&state, id, &g)),
        })
    }
}

#[tonic::async_trait]
impl GroupController for Driver {
    async fn group_controller_get_capabilities(
        &self,
        _: Request<GroupControllerGetCapabilitiesRequest>,
    ) -> Result<Response<GroupControllerGetCapabilitiesResponse>, Status> {
        let _call = self.enter(Method::GroupControllerGetCapabilities).await?;
        Ok(Response::new(GroupControllerGetCapabilitiesResponse {
            capabilities: vec![group_capability()],
        }))
    }

    async fn create_volume_group_snapshot(
        &self,
        request: Request<CreateVolumeGroupSnapshotRequest>,
    ) -> Result<Response<CreateVolumeGroupSnapshotResponse>, Status> {
        self.do_create_group(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn delete_volume_group_snapshot(
        &self,
        request: Request<DeleteVolumeGroupSnapshotRequest>,
    ) -> Result<Response<DeleteVolumeGroupSnapshotResponse>, Status> {
        self.do_delete_group(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn get_volume_group_snapshot(
        &self,
        request: Request<GetVolumeGroupSnapshotRequest>,
    ) -> Result<Response<GetVolumeGroupSnapshotResponse>, Status> {
        self.do_get_group(request.into_inner())
            .await
            .map(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_whatever_they_hold() {
        let fields = ["", "a:b", "line\nbreak", "12:", "ü"];
        let text = encode_fields(fields);
        assert_eq!(decode_fields(&text).unwrap(), fields);
        assert!(decode_fields("3:ab").is_none());
        assert!(decode_fields("x:ab").is_none());
    }

    #[test]
    fn group_names_may_hold_whitespace_but_no_other_control_character() {
        assert!(!has_banned_char("a b\tc\nd\re"));
        for bad in [
            "a\u{0}", "a\u{b}", "a\u{c}", "a\u{1f}", "a\u{7f}", "a\u{9f}",
        ] {
            assert!(has_banned_char(bad), "{bad:?}");
        }
    }
}
