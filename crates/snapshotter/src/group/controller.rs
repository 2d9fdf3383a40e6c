//! The group content controller: watch caches of VolumeGroupSnapshotContents and
//! VolumeGroupSnapshotClasses, the work queue `csi-snapshotter-groupsnapshotcontent`, and the
//! sync of one group content (create, re-create until ready, pre-provisioned status, deletion),
//! run by the sidecar kit's [`Runner`] with `--worker-threads` workers and the
//! `--resync-period` resync.
//!
//! Differences from upstream v8.6.0, none visible in the objects it leaves:
//! - its own writes do not wake it (upstream enqueues every update, its three writes per pass
//!   included, and so re-sends CreateVolumeGroupSnapshot about every 800 ms until the group is
//!   ready, kubernetes-csi/external-snapshotter#1488); a group not yet ready is asked again
//!   after the queue's back-off (`--retry-interval-start` doubling to `--retry-interval-max`;
//!   upstream forgets it until the next resync, #1457);
//! - a check that changes nothing writes nothing (upstream PUTs the whole status of a
//!   pre-provisioned group at every check);
//! - the status is a merge patch of the status subresource, never a PUT that can conflict;
//! - each member in the status carries its creation time, readiness and size, which the
//!   snapshot-controller copies into the member's content (upstream leaves them empty until a
//!   ListSnapshots of each member);
//! - the caches wait for the group CRDs without holding the content controller back (upstream
//!   serves no snapshot at all while the group CRDs are missing).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use plugreg_sidecar_kit::cache::{self, CompactStore};
use plugreg_sidecar_kit::compact::Trim;
use plugreg_sidecar_kit::events::{EventType, Recorder};
use plugreg_sidecar_kit::groupsnapshot::{
    ANN_BEING_CREATED, ANN_BEING_DELETED, ANN_DELETION_SECRET_NAME, ANN_DELETION_SECRET_NAMESPACE,
    FINALIZER_CONTENT_BOUND, VolumeGroupSnapshotClass, VolumeGroupSnapshotContent,
};
use plugreg_sidecar_kit::queue::WorkQueue;
use plugreg_sidecar_kit::runtime::{Action, Lane, Runner, Writes};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info};

use super::decide::{self, GroupTaken};
use crate::cached::{self, CACHE_CATCH_UP, Cached};
use crate::controller::{Clients, Config};
use crate::csi::Failed;
use crate::decide::{go_quote, may_be_in_progress, snapshot_name, strip_parameters};
use crate::writes::{Writer, api_message, now_rfc3339};

/// The group content queue's name (upstream's).
pub const GROUP_QUEUE: &str = "csi-snapshotter-groupsnapshotcontent";

/// What the group controller needs beyond the content controller's [`Config`].
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// `--groupsnapshot-name-prefix`.
    pub name_prefix: String,
    /// `--groupsnapshot-name-uuid-length`.
    pub uuid_length: i64,
}

/// A failed create or check: the group content as last written and the error.
type SyncFailure = Box<(VolumeGroupSnapshotContent, String)>;

/// The annotations a decision reads; the rest are dropped from the cache.
const KEPT_ANNOTATIONS: [&str; 4] = [
    ANN_BEING_CREATED,
    ANN_BEING_DELETED,
    ANN_DELETION_SECRET_NAME,
    ANN_DELETION_SECRET_NAMESPACE,
];

/// What the group content cache keeps of a group content: what the decisions and the events
/// read.
pub enum GroupContentTrim {}

impl Trim for GroupContentTrim {
    type Object = VolumeGroupSnapshotContent;

    fn trim(c: &mut VolumeGroupSnapshotContent) {
        // Contents are cluster-scoped: the kit's trim with the lifecycle fields (finalizers,
        // deletion time) the decisions read.
        plugreg_sidecar_kit::compact::trim_meta(&mut c.metadata, &KEPT_ANNOTATIONS, true);
        cached::trim_ref(&mut c.spec.volume_group_snapshot_ref);
    }
}

struct Controller {
    cfg: Config,
    group: GroupConfig,
    clients: Clients,
    recorder: Recorder,
    contents: CompactStore<Cached<GroupContentTrim>>,
    classes: Store<VolumeGroupSnapshotClass>,
    writer: Writer<VolumeGroupSnapshotContent>,
}

/// Runs until `shutdown`. The caches may wait for the group CRDs for ever (each failed watch
/// is logged and retried); the content controller runs meanwhile.
pub async fn run(cfg: Config, group: GroupConfig, clients: Clients, shutdown: CancellationToken) {
    let queue: Arc<WorkQueue<String>> = WorkQueue::new(
        GROUP_QUEUE,
        cfg.retry_start,
        cfg.retry_max,
        Arc::clone(&clients.metrics),
        shutdown.clone(),
    );
    let mut ready = Vec::new();
    let written: Arc<Writes<String>> = Arc::default();
    let contents = cached::watch_ours::<GroupContentTrim>(
        &clients.watches,
        cfg.node.as_deref(),
        cfg.driver.clone(),
        cached::Watched {
            fingerprint: decide::fingerprint,
            look: |c: &VolumeGroupSnapshotContent| {
                (
                    c.spec.driver.as_str(),
                    c.status.as_ref().and_then(|s| s.ready_to_use) == Some(true),
                    false,
                )
            },
        },
        Arc::clone(&queue),
        Arc::clone(&written),
        &shutdown,
        &mut ready,
    );
    let classes = cache::watch::<VolumeGroupSnapshotClass>(
        &clients.watches,
        &shutdown,
        &mut ready,
        |c| cached::trim_class_meta(&mut c.metadata),
        |_, _| {},
    );
    for r in ready {
        tokio::select! {
            res = r => if res.is_err() {
                return;
            },
            () = shutdown.cancelled() => return,
        }
    }
    info!("Starting CSI group snapshotter");
    let recorder = Recorder::start(
        clients.events.clone(),
        &format!("csi-snapshotter {}", cfg.driver),
        "",
        shutdown.clone(),
    );
    let ctl = Arc::new(Controller {
        writer: Writer::new(clients.kube.clone(), written),
        cfg,
        group,
        clients,
        recorder,
        contents,
        classes,
    });
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
                debug!(group_content = %name, why = %why, "group content needs another sync");
                Action::Retry
            },
        )
        .await;
}

impl Controller {
    fn class(&self, name: &str) -> Option<Arc<VolumeGroupSnapshotClass>> {
        self.classes.get(&ObjectRef::new(name))
    }

    fn warn(&self, c: &VolumeGroupSnapshotContent, reason: &str, message: &str) {
        let reference = ObjectReference {
            api_version: Some("groupsnapshot.storage.k8s.io/v1".into()),
            kind: Some("VolumeGroupSnapshotContent".into()),
            name: c.metadata.name.clone(),
            uid: c.metadata.uid.clone(),
            resource_version: c.metadata.resource_version.clone(),
            ..ObjectReference::default()
        };
        self.recorder
            .event(&reference, EventType::Warning, reason, message);
    }

    async fn sync(&self, name: &str) -> Result<Action, String> {
        let Some(cached) = self.contents.get(name) else {
            debug!(group_content = name, "group content was deleted, ignoring");
            return Ok(Action::Done);
        };
        let content = cached.compact.object();
        drop(cached);
        let class_driver = content
            .spec
            .volume_group_snapshot_class_name
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
                            "failed to remove VolumeGroupSnapshotBeingCreated annotation on the groupSnapshotContent {name}: {}",
                            go_quote(&e)
                        )
                    })?;
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
            Ok(false) => Err("group snapshot not ready yet".into()),
            Err(failure) => {
                let (current, err) = *failure;
                let (reason, message) = decide::failure(action, &err);
                self.record_error(&current, reason, &message).await;
                error!(group_content = name, err = %err, "could not sync group snapshot content");
                Err(err)
            }
        }
    }

    async fn record_error(&self, c: &VolumeGroupSnapshotContent, reason: &str, message: &str) {
        let current = c.status.as_ref().and_then(|s| s.error.as_ref());
        let Some(patch) = crate::decide::error_patch_over(current, message, &now_rfc3339()) else {
            return;
        };
        if let Err(e) = self.writer.patch_status(&c.name_any(), patch).await {
            error!(group_content = %c.name_any(), err = %api_message(&e), "failed to write the group content's error status");
        }
        self.warn(c, reason, message);
    }

    /// The create and delete secrets of `c` (from its group deletion-secret annotations).
    async fn annotated_secrets(
        &self,
        c: &VolumeGroupSnapshotContent,
    ) -> Result<HashMap<String, String>, String> {
        match decide::annotated_secret(c)? {
            None => Ok(HashMap::new()),
            Some(r) => self.writer.secret(&r).await.map_err(|e| {
                error!(group_content = %c.name_any(), err = %e, "Failed to get credentials for group snapshot content");
                format!(
                    "cannot get credentials for group snapshot content {:?}",
                    c.name_any()
                )
            }),
        }
    }

    async fn patch_meta(
        &self,
        c: &VolumeGroupSnapshotContent,
        patch: serde_json::Value,
    ) -> Result<VolumeGroupSnapshotContent, String> {
        let name = c.name_any();
        self.writer.patch(&name, patch).await.map_err(|e| {
            format!(
                "snapshot controller failed to update {name} on API server: {}",
                api_message(&e)
            )
        })
    }

    async fn remove_being_created(
        &self,
        c: &VolumeGroupSnapshotContent,
    ) -> Result<VolumeGroupSnapshotContent, String> {
        self.patch_meta(
            c,
            json!({"metadata": {"annotations": {ANN_BEING_CREATED: null}}}),
        )
        .await
    }

    async fn write_status(
        &self,
        c: &VolumeGroupSnapshotContent,
        taken: &GroupTaken,
    ) -> Result<VolumeGroupSnapshotContent, String> {
        let Some(next) = decide::status_after(c.status.as_ref(), taken) else {
            return Ok(c.clone());
        };
        let name = c.name_any();
        self.writer
            .patch_status(&name, decide::status_patch(&next))
            .await
            .map_err(|e| {
                format!(
                    "snapshot controller failed to update {name} on API server: {}",
                    api_message(&e)
                )
            })
    }

    /// CreateVolumeGroupSnapshot for `c` (the first or a re-sent one) and the status after it:
    /// `Ok(ready)`, or the group content as last written and the error.
    async fn create(&self, c: VolumeGroupSnapshotContent) -> Result<bool, SyncFailure> {
        let name = c.name_any();
        let fail = |c: &VolumeGroupSnapshotContent, e: String| Err(Box::new((c.clone(), e)));
        info!(group_content = %name, "createGroupSnapshotWrapper: Creating group snapshot for group snapshot content {name} through the plugin ...");
        let inputs = async {
            let class = match c.spec.volume_group_snapshot_class_name.as_deref() {
                None => {
                    return Err(format!(
                        "failed to take group snapshot {name} without a group snapshot class"
                    ));
                }
                Some(n) => self.class(n).ok_or_else(|| {
                    format!("volumegroupsnapshotclass.groupsnapshot.storage.k8s.io {n:?} not found")
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
                        "failed to get input parameters to create group snapshot for group snapshot content {name}: {}",
                        go_quote(&e)
                    ),
                );
            }
        };
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
                            "failed to add VolumeGroupSnapshotBeingCreated annotation on the group snapshot content {name}: {}",
                            go_quote(&e)
                        ),
                    );
                }
            }
        };
        // Upstream checks the parameters only now, so an unknown reserved key leaves the
        // annotation on: kept, as for contents.
        let empty = BTreeMap::new();
        let mut params = match strip_parameters(class.parameters.as_ref().unwrap_or(&empty)) {
            Ok(p) => p,
            Err(e) => return fail(&c, e),
        };
        if self.cfg.extra_create_metadata {
            decide::add_metadata(&mut params, &c);
        }
        let Some(uid) = c
            .spec
            .volume_group_snapshot_ref
            .uid
            .clone()
            .filter(|u| !u.is_empty())
        else {
            return fail(
                &c,
                format!(
                    "cannot create group snapshot. Group snapshot content {name} not bound to a group snapshot"
                ),
            );
        };
        let volumes = decide::volume_handles(&c).to_vec();
        if volumes.is_empty() {
            return fail(
                &c,
                format!(
                    "cannot create group snapshot. PVCs to be snapshotted not found in group snapshot content {name}"
                ),
            );
        }
        let group_name = snapshot_name(&self.group.name_prefix, &uid, self.group.uuid_length);
        let taken = match self
            .clients
            .driver
            .create_group(&volumes, &group_name, params, secrets)
            .await
        {
            Ok(t) => t,
            Err(Failed { message, code }) => {
                info!(group_content = %name, "createGroupSnapshotWrapper: CreateGroupSnapshot for groupSnapshotContent {name} returned error: {message}");
                let mut err = format!(
                    "failed to take group snapshot of the volumes [{}]: {}",
                    volumes.join(" "),
                    go_quote(&message)
                );
                let mut current = c.clone();
                if !may_be_in_progress(code) {
                    match self.remove_being_created(&c).await {
                        Ok(updated) => current = updated,
                        Err(e) => {
                            err = format!(
                                "failed to remove VolumeGroupSnapshotBeingCreated annotation from the group snapshot content {name}: {e}"
                            );
                        }
                    }
                }
                return Err(Box::new((current, err)));
            }
        };
        debug!(group_content = %name, handle = %taken.handle, ready = taken.ready, members = taken.members.len(), "CreateVolumeGroupSnapshot answered");
        let c = match self.write_status(&c, &taken).await {
            Ok(updated) => updated,
            Err(e) => {
                return fail(
                    &c,
                    format!("error updating status for volume group snapshot content {name}: {e}"),
                );
            }
        };
        if let Err(e) = self.remove_being_created(&c).await {
            return fail(
                &c,
                format!(
                    "failed to remove VolumeGroupSnapshotBeingCreated annotation on the groupSnapshotContent {name}: {}",
                    go_quote(&e)
                ),
            );
        }
        Ok(taken.ready)
    }

    /// The status of a pre-provisioned group from GetVolumeGroupSnapshot.
    async fn check_static(&self, c: VolumeGroupSnapshotContent) -> Result<bool, SyncFailure> {
        let name = c.name_any();
        let fail = |e: String| Err(Box::new((c.clone(), e)));
        let secrets = match c.spec.volume_group_snapshot_class_name.as_deref() {
            None => HashMap::new(),
            Some(n) => {
                let Some(class) = self.class(n) else {
                    return fail(format!(
                        "failed to get group snapshot class {n} for group snapshot content {name}: volumegroupsnapshotclass.groupsnapshot.storage.k8s.io {n:?} not found"
                    ));
                };
                let empty = BTreeMap::new();
                match crate::decide::class_secret(
                    class.parameters.as_ref().unwrap_or(&empty),
                    &decide::GET_SECRET,
                    &name,
                ) {
                    Ok(None) => HashMap::new(),
                    Ok(Some(r)) => match self.writer.secret(&r).await {
                        Ok(s) => s,
                        Err(e) => {
                            return fail(format!(
                                "failed to get credentials for group snapshot content {name}: {e}"
                            ));
                        }
                    },
                    Err(e) => {
                        return fail(format!(
                            "failed to get secret reference for group snapshot content {name}: {e}"
                        ));
                    }
                }
            }
        };
        let handle = decide::group_handle(&c).unwrap_or_default();
        let ids = c
            .spec
            .source
            .group_snapshot_handles
            .as_ref()
            .map(|h| h.volume_snapshot_handles.clone())
            .unwrap_or_default();
        if ids.is_empty() {
            return fail(format!(
                "cannot list group snapshot {name}. No snapshots found in the group snapshot content"
            ));
        }
        let taken = match self.clients.driver.get_group(&handle, ids, secrets).await {
            // Upstream reads only the readiness and the time of the answer.
            Ok(t) => GroupTaken {
                handle: handle.clone(),
                members: Vec::new(),
                ..t
            },
            Err(f) => {
                return fail(format!(
                    "failed to list group snapshot for group snapshot content {name}: {}",
                    go_quote(&f.message)
                ));
            }
        };
        match self.write_status(&c, &taken).await {
            Ok(_) => Ok(taken.ready),
            Err(e) => fail(e),
        }
    }

    /// Deletion: DeleteVolumeGroupSnapshot by policy, the status cleared, then the finalizer
    /// removed, in one pass.
    async fn delete(&self, c: VolumeGroupSnapshotContent) -> Result<Action, String> {
        let name = c.name_any();
        let mut current = c.clone();
        let status_handle = c
            .status
            .as_ref()
            .and_then(|s| s.volume_group_snapshot_handle.clone());
        if c.spec.deletion_policy == "Delete" && status_handle.is_some() {
            let secrets = match self.annotated_secrets(&c).await {
                Ok(s) => s,
                Err(e) => {
                    self.warn(
                        &c,
                        decide::REASON_DELETE_ERROR,
                        "Failed to get snapshot credentials",
                    );
                    return Err(format!(
                        "failed to get input parameters to delete group snapshot for group snapshot content {name}: {}",
                        go_quote(&e)
                    ));
                }
            };
            let ids = decide::member_ids(&c);
            if ids.is_empty() {
                return Err(format!(
                    "cannot delete group snapshot content {name}. No snapshots found in the group snapshot"
                ));
            }
            let handle = decide::group_handle(&c).unwrap_or_default();
            if let Err(f) = self
                .clients
                .driver
                .delete_group(&handle, ids, secrets)
                .await
            {
                self.warn(
                    &c,
                    decide::REASON_DELETE_ERROR,
                    "Failed to delete group snapshot",
                );
                let err = format!(
                    "failed to delete group snapshot {name:?}, err: {}",
                    f.message
                );
                error!(group_content = %name, err = %err, "could not sync group snapshot content");
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
                    return Err(format!(
                        "snapshot controller failed to update {name} on API server: {}",
                        api_message(&e)
                    ));
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
