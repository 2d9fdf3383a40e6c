//! The controller: watch caches of VolumeSnapshotContents and VolumeSnapshotClasses, the work
//! queue `csi-snapshotter-content`, and the sync of one content (create, readiness,
//! pre-provisioned status, deletion), run by the sidecar kit's [`Runner`] with
//! `--worker-threads` workers and the `--resync-period` resync. Decisions are
//! [`crate::decide`]'s; this module carries them out.
//!
//! The caches keep of each content only what the decisions read: name, UID, resource version,
//! finalizers, deletion time, labels and the snapshot annotations, spec and status (a few
//! hundred bytes); of each class its driver and parameters.
//!
//! Writes are JSON merge patches that name only what they change (one annotation, the status
//! fields, the finalizer list with the resource version it was read at), never a whole
//! object. The sidecar's own writes do not wake it (upstream's `ShouldEnqueueContentChange`);
//! a sync that finds the cache older than its own last write of the content ([`Writes`])
//! looks again shortly instead of acting on what it already changed.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt};
use plugreg_sidecar_kit::cache::{self, CompactStore};
use plugreg_sidecar_kit::compact::Trim;
use plugreg_sidecar_kit::events::{EventType, Recorder};
use plugreg_sidecar_kit::metrics::Metrics;
use plugreg_sidecar_kit::queue::WorkQueue;
use plugreg_sidecar_kit::runtime::{Action, Lane, Runner, Writes};
use plugreg_sidecar_kit::snapshot::{
    ANN_BEING_CREATED, ANN_BEING_DELETED, ANN_DELETION_SECRET_NAME, ANN_DELETION_SECRET_NAMESPACE,
    ANN_GROUP_SNAPSHOT_HANDLE, FINALIZER_CONTENT_BOUND, VolumeSnapshotClass, VolumeSnapshotContent,
};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info};

use crate::cached::{self, CACHE_CATCH_UP, Cached};
use crate::csi::{Driver, DriverCaps, Failed};
use crate::decide::{self, Taken};
use crate::writes::{Writer, api_message, now_rfc3339};

/// The content queue's name (upstream's).
pub const CONTENT_QUEUE: &str = "csi-snapshotter-content";

/// What the controller needs to know.
#[derive(Debug, Clone)]
pub struct Config {
    /// The driver name (GetPluginInfo).
    pub driver: String,
    /// What the driver can do.
    pub caps: DriverCaps,
    /// `--snapshot-name-prefix`.
    pub name_prefix: String,
    /// `--snapshot-name-uuid-length`.
    pub uuid_length: i64,
    /// `--extra-create-metadata`.
    pub extra_create_metadata: bool,
    /// `--worker-threads`.
    pub workers: usize,
    /// `--retry-interval-start`.
    pub retry_start: Duration,
    /// `--retry-interval-max`.
    pub retry_max: Duration,
    /// `--resync-period`.
    pub resync: Duration,
    /// With `--node-deployment`: this node's name (`NODE_NAME`); only contents labelled
    /// `snapshot.storage.kubernetes.io/managed-by=<node>` are watched.
    pub node: Option<String>,
    /// With the `CSIVolumeGroupSnapshot` gate: the group content controller's settings.
    pub group: Option<crate::group::controller::GroupConfig>,
}

/// Who the controller talks to.
#[derive(Clone)]
pub struct Clients {
    /// Where the watch caches get their events.
    pub watches: cache::Watches,
    /// The rate-limited Kubernetes client of the work.
    pub kube: Client,
    /// The client events are written with (lower priority than the work).
    pub events: Client,
    /// The driver.
    pub driver: Driver,
    /// Where the queue metrics go.
    pub metrics: Arc<Metrics>,
}

/// How the controller ended badly.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A watch cache never filled.
    #[error("Cannot sync caches")]
    Sync,
}

/// A failed create or check: the content as last written (its status decides whether the
/// error is written again) and the error.
type SyncFailure = Box<(VolumeSnapshotContent, String)>;

/// The annotations a decision reads; the rest of a content's are dropped from the cache.
const KEPT_ANNOTATIONS: [&str; 5] = [
    ANN_BEING_CREATED,
    ANN_BEING_DELETED,
    ANN_DELETION_SECRET_NAME,
    ANN_DELETION_SECRET_NAMESPACE,
    ANN_GROUP_SNAPSHOT_HANDLE,
];

/// What the content cache keeps of a content: what the decisions and the events read.
pub enum ContentTrim {}

impl Trim for ContentTrim {
    type Object = VolumeSnapshotContent;

    fn trim(c: &mut VolumeSnapshotContent) {
        // Contents are cluster-scoped: the kit's trim with the lifecycle fields (finalizers,
        // deletion time) the decisions read.
        plugreg_sidecar_kit::compact::trim_meta(&mut c.metadata, &KEPT_ANNOTATIONS, true);
        cached::trim_ref(&mut c.spec.volume_snapshot_ref);
    }
}

struct Controller {
    cfg: Config,
    clients: Clients,
    recorder: Recorder,
    contents: CompactStore<Cached<ContentTrim>>,
    classes: Store<VolumeSnapshotClass>,
    /// Its writes, each remembered by resource version.
    writer: Writer<VolumeSnapshotContent>,
}

/// Runs until `shutdown` (Ok) or until a cache cannot be filled (Err).
pub async fn run(
    cfg: Config,
    clients: Clients,
    shutdown: CancellationToken,
) -> Result<(), ControllerError> {
    let queue: Arc<WorkQueue<String>> = WorkQueue::new(
        CONTENT_QUEUE,
        cfg.retry_start,
        cfg.retry_max,
        Arc::clone(&clients.metrics),
        shutdown.clone(),
    );
    let mut ready = Vec::new();

    let written: Arc<Writes<String>> = Arc::default();
    let contents = cached::watch_ours::<ContentTrim>(
        &clients.watches,
        cfg.node.as_deref(),
        cfg.driver.clone(),
        cached::Watched {
            fingerprint: decide::fingerprint,
            look: |c: &VolumeSnapshotContent| {
                let status = c.status.as_ref();
                (
                    c.spec.driver.as_str(),
                    status.and_then(|s| s.ready_to_use) == Some(true),
                    decide::group_member(c) && status.is_some_and(|s| s.snapshot_handle.is_some()),
                )
            },
        },
        Arc::clone(&queue),
        Arc::clone(&written),
        &shutdown,
        &mut ready,
    );
    let classes = cache::watch::<VolumeSnapshotClass>(
        &clients.watches,
        &shutdown,
        &mut ready,
        |c| cached::trim_class_meta(&mut c.metadata),
        |_, _| {},
    );

    info!("Starting CSI snapshotter");
    for r in ready {
        tokio::select! {
            res = r => if res.is_err() {
                error!("Cannot sync caches");
                return Err(ControllerError::Sync);
            },
            () = shutdown.cancelled() => return Ok(()),
        }
    }

    let recorder = Recorder::start(
        clients.events.clone(),
        &format!("csi-snapshotter {}", cfg.driver),
        "",
        shutdown.clone(),
    );
    let ctl = Arc::new(Controller {
        writer: Writer::new(clients.kube.clone(), written),
        clients,
        recorder,
        contents,
        classes,
        cfg,
    });
    // Upstream's informer resync: every content is synced again every --resync-period.
    let (c, q) = (Arc::clone(&ctl), Arc::clone(&queue));
    Runner::new(vec![Lane::new(queue, ctl.cfg.workers)])
        .resync(ctl.cfg.resync, move || {
            for content in c.contents.state() {
                if content.ours {
                    q.add(content.compact.name().to_owned());
                }
            }
        })
        .run(
            ctl,
            shutdown,
            |c: Arc<Controller>, _, name: String| async move { c.sync(&name).await },
            |_: &Controller, _, name: &String, why: String| {
                debug!(content = %name, why = %why, "content needs another sync");
                Action::Retry
            },
        )
        .await;
    info!("Shutting down CSI snapshotter");
    Ok(())
}

fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

impl Controller {
    fn class(&self, name: &str) -> Option<Arc<VolumeSnapshotClass>> {
        self.classes.get(&ObjectRef::new(name))
    }

    /// The reference events about `c` name.
    fn reference(c: &VolumeSnapshotContent) -> ObjectReference {
        ObjectReference {
            api_version: Some("snapshot.storage.k8s.io/v1".into()),
            kind: Some("VolumeSnapshotContent".into()),
            name: c.metadata.name.clone(),
            uid: c.metadata.uid.clone(),
            resource_version: c.metadata.resource_version.clone(),
            ..ObjectReference::default()
        }
    }

    fn warn(&self, c: &VolumeSnapshotContent, reason: &str, message: &str) {
        self.recorder
            .event(&Self::reference(c), EventType::Warning, reason, message);
    }

    /// One sync of the content `name`: what next, or why it needs another one after the
    /// back-off.
    async fn sync(&self, name: &str) -> Result<Action, String> {
        let Some(cached) = self.contents.get(name) else {
            debug!(content = name, "content was deleted, ignoring");
            return Ok(Action::Done);
        };
        let content = cached.compact.object();
        drop(cached);
        let class_driver = content
            .spec
            .volume_snapshot_class_name
            .as_deref()
            .and_then(|n| self.class(n))
            .map(|c| c.driver.clone());
        if !decide::is_ours(&content, &self.cfg.driver, class_driver.as_deref()) {
            return Ok(Action::Done);
        }
        if self
            .writer
            .written
            .behind(name, content.metadata.resource_version.as_deref())
        {
            return Ok(Action::After(CACHE_CATCH_UP));
        }
        let action = decide::action(&content);
        debug!(content = name, action = ?action, "syncing content");
        let result = match action {
            decide::Action::Delete => return self.delete(content).await,
            decide::Action::Create | decide::Action::CreateAgain => {
                self.create(content.clone()).await
            }
            decide::Action::CheckStatic => self.check_static(content.clone()).await,
            decide::Action::Ready => {
                if decide::being_created(&content) {
                    self.remove_being_created(&content).await.map_err(|e| {
                        format!(
                            "failed to remove VolumeSnapshotBeingCreated annotation on the content {name}: {}",
                            decide::go_quote(&e)
                        )
                    })?;
                    // The annotation held a deletion back, and its removal is no change the
                    // watch filter wakes for (the fingerprint leaves it out): look again once
                    // the cache has the write, so that a content deleted while its snapshot was
                    // being cut is deleted now, not at the next resync.
                    if content.metadata.deletion_timestamp.is_some() {
                        return Ok(Action::After(CACHE_CATCH_UP));
                    }
                }
                return Ok(Action::Done);
            }
            decide::Action::Nothing => return Ok(Action::Done),
        };
        match result {
            Ok(true) => Ok(Action::Done),
            Ok(false) => Err("snapshot not ready yet".into()),
            Err(failure) => {
                let (current, err) = *failure;
                let (reason, message) = decide::failure(action, &err);
                self.record_error(&current, reason, &message).await;
                error!(content = name, err = %err, "could not sync content");
                Err(err)
            }
        }
    }

    /// Writes `message` into the content's `status.error` (unless it is there already, then
    /// neither the write nor the event happens) and records the event.
    async fn record_error(&self, c: &VolumeSnapshotContent, reason: &str, message: &str) {
        let Some(patch) = decide::error_patch(c.status.as_ref(), message, &now_rfc3339()) else {
            return;
        };
        if let Err(e) = self.writer.patch_status(&c.name_any(), patch).await {
            error!(content = %c.name_any(), err = %api_message(&e), "failed to write the content's error status");
        }
        self.warn(c, reason, message);
    }

    /// The CreateSnapshot and DeleteSnapshot secrets of `c` (from its annotations).
    async fn annotated_secrets(
        &self,
        c: &VolumeSnapshotContent,
    ) -> Result<HashMap<String, String>, String> {
        match decide::annotated_secret(c)? {
            None => Ok(HashMap::new()),
            Some(r) => self.writer.secret(&r).await.map_err(|e| {
                error!(content = %c.name_any(), err = %e, "failed to get credentials");
                format!(
                    "cannot get credentials for snapshot content {:?}",
                    c.name_any()
                )
            }),
        }
    }

    async fn patch_meta(
        &self,
        c: &VolumeSnapshotContent,
        patch: serde_json::Value,
    ) -> Result<VolumeSnapshotContent, String> {
        self.writer
            .patch(&c.name_any(), patch)
            .await
            .map_err(|e| api_message(&e))
    }

    async fn remove_being_created(
        &self,
        c: &VolumeSnapshotContent,
    ) -> Result<VolumeSnapshotContent, String> {
        self.patch_meta(
            c,
            json!({"metadata": {"annotations": {ANN_BEING_CREATED: null}}}),
        )
        .await
    }

    /// Writes the status after `taken` (if it changes anything).
    async fn write_status(
        &self,
        c: &VolumeSnapshotContent,
        taken: &Taken,
    ) -> Result<VolumeSnapshotContent, String> {
        let Some(next) = decide::status_after(c.status.as_ref(), taken) else {
            return Ok(c.clone());
        };
        let name = c.name_any();
        self.writer
            .patch_status(&name, decide::status_patch(&next))
            .await
            .map_err(|e| {
                format!(
                    "error updating status for volume snapshot content {name}: snapshot controller failed to update {name} on API server: {}",
                    api_message(&e)
                )
            })
    }

    /// CreateSnapshot for `c` (the first or a re-sent one) and the status after it: `Ok(ready)`,
    /// or the content as last written and the error.
    async fn create(&self, c: VolumeSnapshotContent) -> Result<bool, SyncFailure> {
        let name = c.name_any();
        let fail = |c: &VolumeSnapshotContent, e: String| Err(Box::new((c.clone(), e)));
        // 1-2: class and secrets.
        let inputs = async {
            let class = match c.spec.volume_snapshot_class_name.as_deref() {
                None => {
                    return Err(format!(
                        "failed to take snapshot {name} without a snapshot class"
                    ));
                }
                Some(n) => self.class(n).ok_or_else(|| {
                    format!("volumesnapshotclass.snapshot.storage.k8s.io {n:?} not found")
                })?,
            };
            let secrets = self.annotated_secrets(&c).await?;
            Ok((class, secrets))
        };
        let (class, secrets) = match inputs.await {
            Ok(x) => x,
            Err(e) => {
                return fail(
                    &c,
                    format!(
                        "failed to get input parameters to create snapshot for content {name}: {}",
                        decide::go_quote(&e)
                    ),
                );
            }
        };
        // 3: the being-created annotation, before anything may reach the driver.
        let c = if decide::being_created(&c) {
            c
        } else {
            match self
                .patch_meta(
                    &c,
                    json!({"metadata": {"annotations": {ANN_BEING_CREATED: "yes"}}}),
                )
                .await
            {
                Ok(updated) => updated,
                Err(e) => {
                    return fail(
                        &c,
                        format!(
                            "failed to add VolumeSnapshotBeingCreated annotation on the content {name}: {}",
                            decide::go_quote(&e)
                        ),
                    );
                }
            }
        };
        // 4-5: parameters. Upstream checks them only now, so an unknown reserved key leaves
        // the annotation on (and the content undeletable until the class is fixed): kept, as
        // the snapshot-controller and tools rely on the same order.
        let empty = BTreeMap::new();
        let mut params = match decide::strip_parameters(class.parameters.as_ref().unwrap_or(&empty))
        {
            Ok(p) => p,
            Err(e) => return fail(&c, e),
        };
        if self.cfg.extra_create_metadata {
            decide::add_metadata(&mut params, &c);
        }
        // 6: the handler's checks.
        let Some(uid) = c
            .spec
            .volume_snapshot_ref
            .uid
            .clone()
            .filter(|u| !u.is_empty())
        else {
            return fail(
                &c,
                format!("cannot create snapshot. Snapshot content {name} not bound to a snapshot"),
            );
        };
        let Some(volume) = c.spec.source.volume_handle.clone() else {
            return fail(
                &c,
                format!(
                    "cannot create snapshot. Volume handle not found in snapshot content {name}"
                ),
            );
        };
        let snapshot_name =
            decide::snapshot_name(&self.cfg.name_prefix, &uid, self.cfg.uuid_length);
        let taken = match self
            .clients
            .driver
            .create_snapshot(&volume, &snapshot_name, params, secrets)
            .await
        {
            Ok(t) => t,
            Err(Failed { message, code }) => {
                let mut err = format!(
                    "failed to take snapshot of the volume {volume}: {}",
                    decide::go_quote(&message)
                );
                let mut current = c.clone();
                if !decide::may_be_in_progress(code) {
                    // Final: nothing is being created any more.
                    match self.remove_being_created(&c).await {
                        Ok(updated) => current = updated,
                        Err(e) => {
                            err = format!(
                                "failed to remove VolumeSnapshotBeingCreated annotation from the content {name}: {e}"
                            );
                        }
                    }
                }
                return Err(Box::new((current, err)));
            }
        };
        debug!(content = %name, handle = %taken.handle, ready = taken.ready, "CreateSnapshot answered");
        let c = match self.write_status(&c, &taken).await {
            Ok(updated) => updated,
            Err(e) => return fail(&c, e),
        };
        if let Err(e) = self.remove_being_created(&c).await {
            return fail(
                &c,
                format!(
                    "failed to remove VolumeSnapshotBeingCreated annotation on the content {name}: {}",
                    decide::go_quote(&e)
                ),
            );
        }
        Ok(taken.ready)
    }

    /// The status of a pre-provisioned content from ListSnapshots (or ready at once when the
    /// driver cannot list).
    async fn check_static(&self, c: VolumeSnapshotContent) -> Result<bool, SyncFailure> {
        let name = c.name_any();
        let fail = |e: String| Err(Box::new((c.clone(), e)));
        let secrets = match c.spec.volume_snapshot_class_name.as_deref() {
            None => HashMap::new(),
            Some(n) => {
                let Some(class) = self.class(n) else {
                    return fail(format!(
                        "failed to get snapshot class {n} for snapshot content {name}: volumesnapshotclass.snapshot.storage.k8s.io {n:?} not found"
                    ));
                };
                let empty = BTreeMap::new();
                match decide::list_secret(class.parameters.as_ref().unwrap_or(&empty), &name) {
                    Ok(None) => HashMap::new(),
                    Ok(Some(r)) => match self.writer.secret(&r).await {
                        Ok(s) => s,
                        Err(e) => {
                            return fail(format!(
                                "failed to get credentials for snapshot content {name}: {e}"
                            ));
                        }
                    },
                    Err(e) => {
                        return fail(format!(
                            "failed to get secret reference for snapshot content {name}: {e}"
                        ));
                    }
                }
            }
        };
        let handle = c
            .status
            .as_ref()
            .and_then(|s| s.snapshot_handle.clone())
            .or_else(|| c.spec.source.snapshot_handle.clone())
            .unwrap_or_default();
        let taken = if self.cfg.caps.list_snapshots {
            match self.clients.driver.list_snapshot(&handle, secrets).await {
                Ok(Some(t)) => t,
                Ok(None) => {
                    return fail(format!(
                        "failed to list snapshot for content {name}: {}",
                        decide::go_quote(&format!("can not find snapshot for snapshotID {handle}"))
                    ));
                }
                Err(f) => {
                    return fail(format!(
                        "failed to list snapshot for content {name}: {}",
                        decide::go_quote(&f.message)
                    ));
                }
            }
        } else {
            Taken {
                handle: handle.clone(),
                creation_time: now_nanos(),
                size: 0,
                ready: true,
                group_handle: String::new(),
            }
        };
        // The handle written is the content's own, whatever the driver listed.
        let taken = Taken {
            handle: c.spec.source.snapshot_handle.clone().unwrap_or(handle),
            ..taken
        };
        match self.write_status(&c, &taken).await {
            Ok(_) => Ok(taken.ready),
            Err(e) => fail(e),
        }
    }

    /// Deletion: DeleteSnapshot by policy, the status cleared, then the finalizer removed.
    async fn delete(&self, c: VolumeSnapshotContent) -> Result<Action, String> {
        let name = c.name_any();
        let status = c.status.as_ref();
        let handle = status.and_then(|s| s.snapshot_handle.clone());
        let member = status.is_some_and(|s| s.volume_group_snapshot_handle.is_some());
        let mut current = c.clone();
        if c.spec.deletion_policy == "Delete"
            && let Some(handle) = handle
            && !member
        {
            let secrets = match self.annotated_secrets(&c).await {
                Ok(s) => s,
                Err(e) => {
                    self.warn(
                        &c,
                        decide::REASON_DELETE_ERROR,
                        "Failed to get snapshot credentials",
                    );
                    return Err(format!(
                        "failed to get input parameters to delete snapshot for content {name}: {}",
                        decide::go_quote(&e)
                    ));
                }
            };
            if let Err(f) = self.clients.driver.delete_snapshot(&handle, secrets).await {
                self.warn(&c, decide::REASON_DELETE_ERROR, "Failed to delete snapshot");
                let err = format!(
                    "failed to delete snapshot {name:?}, err: failed to delete snapshot content {name}: {}",
                    decide::go_quote(&f.message)
                );
                error!(content = %name, err = %err, "could not sync content");
                return Err(err);
            }
            match self
                .writer
                .patch_status(&name, decide::cleared_status_patch())
                .await
            {
                Ok(updated) => current = updated,
                Err(e) => {
                    self.warn(
                        &c,
                        decide::REASON_DELETE_ERROR,
                        "Failed to clear content status",
                    );
                    return Err(api_message(&e));
                }
            }
        }
        self.writer
            .remove_finalizer(&current, FINALIZER_CONTENT_BOUND)
            .await
            .map_err(|e| {
                format!(
                    "snapshot controller failed to update {name} on API server: {}",
                    api_message(&e)
                )
            })?;
        Ok(Action::Done)
    }
}
