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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use plugreg_proto::csi::v1::{
    CreateSnapshotRequest, CreateSnapshotResponse, DeleteSnapshotRequest, DeleteSnapshotResponse,
    GetSnapshotRequest, GetSnapshotResponse, ListSnapshotsRequest, ListSnapshotsResponse, Snapshot,
    SnapshotTime, VolumeContentSource, list_snapshots_response, volume_content_source,
};
use tonic::Status;

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
}

impl SnapshotState {
    /// One more answer about it.
    fn look(&mut self) {
        self.looks = self.looks.saturating_add(1);
    }

    fn ready(&self, after: u32) -> bool {
        self.looks > after
    }

    fn wire(&self, id: &str, after: u32) -> Snapshot {
        Snapshot {
            size_bytes: self.size,
            snapshot_id: id.to_owned(),
            source_volume_id: self.source.clone(),
            creation_time: Some(SnapshotTime {
                seconds: self.created.0,
                nanos: self.created.1,
            }),
            ready_to_use: self.ready(after),
            group_snapshot_id: String::new(),
        }
    }
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

impl Driver {
    fn snapshots_dir(&self) -> PathBuf {
        self.data_dir.join(".snapshots")
    }

    fn snapshot_meta(&self, id: &str) -> PathBuf {
        self.snapshots_dir().join(format!(".{id}.meta"))
    }

    /// A persisted snapshot's record: `size\nseconds\nnanos\nsource\nname`.
    fn read_snapshot_meta(&self, id: &str) -> Option<SnapshotState> {
        if !valid_volume_id(id) || !self.snapshots_dir().join(id).is_dir() {
            return None;
        }
        let text = std::fs::read_to_string(self.snapshot_meta(id)).ok()?;
        let mut lines = text.splitn(5, '\n');
        let size = lines.next()?.parse().ok()?;
        let seconds = lines.next()?.parse().ok()?;
        let nanos = lines.next()?.parse().ok()?;
        let source = lines.next()?.to_owned();
        let name = lines.next()?.to_owned();
        Some(SnapshotState {
            name,
            source,
            size,
            created: (seconds, nanos),
            looks: u32::MAX,
        })
    }

    fn write_snapshot_meta(&self, id: &str, s: &SnapshotState) -> Result<(), Status> {
        let path = self.snapshot_meta(id);
        let temp = self.snapshots_dir().join(format!(".{id}.meta.tmp"));
        let text = format!(
            "{}\n{}\n{}\n{}\n{}",
            s.size, s.created.0, s.created.1, s.source, s.name
        );
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
            if id.starts_with('.') || state.snapshots.contains_key(id) {
                continue;
            }
            if let Some(s) = self.read_snapshot_meta(id) {
                state.snapshots.insert(id.to_owned(), s);
            }
        }
    }

    /// The snapshot `id`, loading it from the data directory when persistent.
    fn snapshot(&self, state: &mut State, id: &str) -> Option<SnapshotState> {
        if self.config.persistent
            && !state.snapshots.contains_key(id)
            && let Some(s) = self.read_snapshot_meta(id)
        {
            state.snapshots.insert(id.to_owned(), s);
        }
        state.snapshots.get(id).cloned()
    }

    pub(crate) async fn do_create_snapshot(
        &self,
        r: CreateSnapshotRequest,
    ) -> Result<CreateSnapshotResponse, Status> {
        self.config.calls.keep_create_snapshot(&r);
        self.enter(Method::CreateSnapshot).await?;
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
        if let Some((id, s)) = state.snapshots.iter_mut().find(|(_, s)| s.name == name) {
            if s.source != source {
                return Err(Status::already_exists(format!(
                    "snapshot {name:?} exists of volume {:?}, not {source:?}",
                    s.source
                )));
            }
            s.look();
            let wire = s.wire(id, self.config.snapshot_ready_after);
            return Ok(CreateSnapshotResponse {
                snapshot: Some(wire),
            });
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
                if !state.snapshots.contains_key(&id) {
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
        };
        // Copied under the lock, so that the volume cannot be deleted halfway.
        let copy = self.snapshots_dir().join(&id);
        copy_tree(&self.data_dir.join(source), &copy)
            .map_err(|e| internal("cannot copy the volume into", &copy, e))?;
        if persistent {
            self.write_snapshot_meta(&id, &snapshot)?;
        }
        let wire = snapshot.wire(&id, self.config.snapshot_ready_after);
        state.snapshots.insert(id, snapshot);
        Ok(CreateSnapshotResponse {
            snapshot: Some(wire),
        })
    }

    pub(crate) async fn do_delete_snapshot(
        &self,
        r: DeleteSnapshotRequest,
    ) -> Result<DeleteSnapshotResponse, Status> {
        self.config.calls.keep_delete_snapshot(&r);
        self.enter(Method::DeleteSnapshot).await?;
        let id = crate::volumes::required(&r.snapshot_id, "snapshot_id")?;
        let mut state = self.lock();
        state.snapshots.remove(id);
        // Deleting a missing snapshot is success (idempotency).
        if valid_volume_id(id) {
            let copy = self.snapshots_dir().join(id);
            match std::fs::remove_dir_all(&copy) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(internal("cannot remove", &copy, e)),
            }
            let meta = self.snapshot_meta(id);
            match std::fs::remove_file(&meta) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(internal("cannot remove", &meta, e)),
            }
        }
        Ok(DeleteSnapshotResponse {})
    }

    pub(crate) async fn do_list_snapshots(
        &self,
        r: ListSnapshotsRequest,
    ) -> Result<ListSnapshotsResponse, Status> {
        self.enter(Method::ListSnapshots).await?;
        if r.max_entries < 0 {
            return Err(Status::invalid_argument("max_entries must not be negative"));
        }
        let after = self.config.snapshot_ready_after;
        let mut state = self.lock();
        self.load_snapshots(&mut state);
        if let Some(s) = state.snapshots.get_mut(&r.snapshot_id) {
            s.look();
        }
        let matching: Vec<(&String, &SnapshotState)> = state
            .snapshots
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
                snapshot: Some(s.wire(id, after)),
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
        self.enter(Method::GetSnapshot).await?;
        let id = crate::volumes::required(&r.snapshot_id, "snapshot_id")?;
        let mut state = self.lock();
        let missing = || Status::not_found(format!("snapshot {id:?} does not exist"));
        self.snapshot(&mut state, id).ok_or_else(missing)?;
        let s = state.snapshots.get_mut(id).ok_or_else(missing)?;
        s.look();
        Ok(GetSnapshotResponse {
            snapshot: Some(s.wire(id, self.config.snapshot_ready_after)),
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
                if !snap.ready(self.config.snapshot_ready_after) {
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

/// The snapshots of a [`State`], by id.
pub(crate) type Snapshots = BTreeMap<String, SnapshotState>;
