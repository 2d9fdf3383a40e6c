//! What to do with one VolumeGroupSnapshotContent, and what to write: pure functions of the
//! cached object (no client, no driver), as [`crate::decide`] is for contents.

use std::collections::HashMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use plugreg_sidecar_kit::groupsnapshot::{
    ANN_BEING_CREATED, ANN_BEING_DELETED, ANN_DELETION_SECRET_NAME, ANN_DELETION_SECRET_NAMESPACE,
    VolumeGroupSnapshotContent, VolumeGroupSnapshotContentStatus, VolumeSnapshotInfo,
};
use serde_json::{Value, json};

use crate::decide::{SecretKeys, SecretRef};

/// Whether `content` is this driver's: a source to work from, the driver named, and its class
/// (when the cache has it) of the same driver.
pub fn is_ours(
    content: &VolumeGroupSnapshotContent,
    driver: &str,
    class_driver: Option<&str>,
) -> bool {
    let source = &content.spec.source;
    let has_source = source.group_snapshot_handles.is_some()
        || source
            .volume_handles
            .as_ref()
            .is_some_and(|v| !v.is_empty());
    has_source && content.spec.driver == driver && class_driver.is_none_or(|d| d == driver)
}

fn annotation<'a>(content: &'a VolumeGroupSnapshotContent, key: &str) -> Option<&'a str> {
    content
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// Whether a CreateVolumeGroupSnapshot may be in flight (the being-created annotation).
pub fn being_created(content: &VolumeGroupSnapshotContent) -> bool {
    annotation(content, ANN_BEING_CREATED).is_some()
}

/// What a sync does with a group content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Deletion: DeleteVolumeGroupSnapshot by policy, then the finalizer removed.
    Delete,
    /// The first CreateVolumeGroupSnapshot.
    Create,
    /// CreateVolumeGroupSnapshot again with the same name, until the group is ready (upstream
    /// never asks GetVolumeGroupSnapshot for a group it created).
    CreateAgain,
    /// A pre-provisioned group's status from GetVolumeGroupSnapshot.
    CheckStatic,
    /// Ready: at most a leftover being-created annotation to remove.
    Ready,
    /// Nothing to do.
    Nothing,
}

/// Whether a group content being deleted may be acted on: an unbound pre-provisioned one at
/// once; otherwise only with the controller's being-deleted annotation and no create in
/// flight.
pub fn should_delete(content: &VolumeGroupSnapshotContent) -> bool {
    if content.metadata.deletion_timestamp.is_none() {
        return false;
    }
    let unbound = content
        .spec
        .volume_group_snapshot_ref
        .uid
        .as_deref()
        .is_none_or(str::is_empty);
    if content.spec.source.group_snapshot_handles.is_some() && unbound {
        return true;
    }
    !being_created(content) && annotation(content, ANN_BEING_DELETED).is_some()
}

/// The volumes a dynamic group content snapshots (empty for a pre-provisioned one).
pub fn volume_handles(content: &VolumeGroupSnapshotContent) -> &[String] {
    content.spec.source.volume_handles.as_deref().unwrap_or(&[])
}

/// What a sync does with `content`, in upstream's order.
pub fn action(content: &VolumeGroupSnapshotContent) -> Action {
    if should_delete(content) {
        return Action::Delete;
    }
    let dynamic = !volume_handles(content).is_empty();
    let Some(status) = &content.status else {
        return if dynamic {
            Action::Create
        } else {
            Action::CheckStatic
        };
    };
    if status.ready_to_use == Some(true) {
        Action::Ready
    } else if content.spec.source.group_snapshot_handles.is_some() {
        Action::CheckStatic
    } else if dynamic {
        Action::CreateAgain
    } else {
        Action::Nothing
    }
}

/// The secret of CreateVolumeGroupSnapshot and DeleteVolumeGroupSnapshot, from the group
/// deletion-secret annotations the snapshot-controller resolved: none unless both are there;
/// either empty is an error.
pub fn annotated_secret(content: &VolumeGroupSnapshotContent) -> Result<Option<SecretRef>, String> {
    let name = annotation(content, ANN_DELETION_SECRET_NAME);
    let namespace = annotation(content, ANN_DELETION_SECRET_NAMESPACE);
    match (namespace, name) {
        (Some(ns), Some(n)) if !ns.is_empty() && !n.is_empty() => {
            Ok(Some((ns.to_owned(), n.to_owned())))
        }
        (Some(_), Some(_)) => Err(format!(
            "cannot retrieve secrets for group snapshot content {:?}, err: secret name or namespace not specified",
            name_of(content)
        )),
        _ => Ok(None),
    }
}

/// The GetVolumeGroupSnapshot secret of a pre-provisioned group content, in its class's
/// parameters.
pub const GET_SECRET: SecretKeys = SecretKeys {
    name: "csi.storage.k8s.io/group-snapshotter-get-secret-name",
    namespace: "csi.storage.k8s.io/group-snapshotter-get-secret-namespace",
    kind: "GroupSnapshotterGet",
    token: "volumegroupsnapshotcontent.name",
};

/// `--extra-create-metadata`: the VolumeGroupSnapshot's name.
pub const META_GROUP_NAME: &str = "csi.storage.k8s.io/volumegroupsnapshot/name";
/// `--extra-create-metadata`: the VolumeGroupSnapshot's namespace.
pub const META_GROUP_NAMESPACE: &str = "csi.storage.k8s.io/volumegroupsnapshot/namespace";
/// `--extra-create-metadata`: the group content's name.
pub const META_GROUP_CONTENT_NAME: &str = "csi.storage.k8s.io/volumegroupsnapshotcontent/name";

/// Adds the `--extra-create-metadata` keys for `content`.
pub fn add_metadata(params: &mut HashMap<String, String>, content: &VolumeGroupSnapshotContent) {
    let r = &content.spec.volume_group_snapshot_ref;
    params.insert(META_GROUP_NAME.into(), r.name.clone().unwrap_or_default());
    params.insert(
        META_GROUP_NAMESPACE.into(),
        r.namespace.clone().unwrap_or_default(),
    );
    params.insert(META_GROUP_CONTENT_NAME.into(), name_of(content).to_owned());
}

fn name_of(content: &VolumeGroupSnapshotContent) -> &str {
    content.metadata.name.as_deref().unwrap_or_default()
}

/// A group snapshot as the driver answered it.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupTaken {
    /// The group's CSI ID.
    pub handle: String,
    /// Every member can be restored from.
    pub ready: bool,
    /// When the driver cut it (now when the driver said nothing).
    pub creation_time: Time,
    /// The members, in the driver's order (empty from GetVolumeGroupSnapshot, whose members
    /// upstream ignores).
    pub members: Vec<VolumeSnapshotInfo>,
}

/// The status after `taken` over `current`, or `None` when nothing changes (no write): a new
/// status whole; else the handle and the creation time only where absent, `readyToUse` when
/// it differs (the error cleared once ready), and the members as the driver last listed them.
/// Upstream writes the member list once, as the first answer had it (the snapshot-controller
/// copies it into the members' contents while the group is not ready, so a member first listed
/// not ready is written back to not ready after it became ready), and writes the whole status
/// again at every check of a pre-provisioned group; here a check that changes nothing writes
/// nothing.
pub fn status_after(
    current: Option<&VolumeGroupSnapshotContentStatus>,
    taken: &GroupTaken,
) -> Option<VolumeGroupSnapshotContentStatus> {
    let members = (!taken.members.is_empty()).then(|| taken.members.clone());
    let Some(cur) = current else {
        return Some(VolumeGroupSnapshotContentStatus {
            volume_group_snapshot_handle: Some(taken.handle.clone()),
            creation_time: Some(taken.creation_time.clone()),
            ready_to_use: Some(taken.ready),
            error: None,
            volume_snapshot_info_list: members,
        });
    };
    let mut next = cur.clone();
    if next.volume_group_snapshot_handle.is_none() {
        next.volume_group_snapshot_handle = Some(taken.handle.clone());
    }
    if next.ready_to_use != Some(taken.ready) {
        next.ready_to_use = Some(taken.ready);
        if taken.ready {
            next.error = None;
        }
    }
    if next.creation_time.is_none() {
        next.creation_time = Some(taken.creation_time.clone());
    }
    if members.is_some() && next.volume_snapshot_info_list != members {
        next.volume_snapshot_info_list = members;
    }
    (&next != cur).then_some(next)
}

/// The status patch (a JSON merge patch of the status subresource) that writes `next`, with an
/// explicit null for an error it drops.
pub fn status_patch(next: &VolumeGroupSnapshotContentStatus) -> Value {
    let mut status = serde_json::to_value(next).unwrap_or_else(|_| json!({}));
    if let Value::Object(o) = &mut status
        && next.error.is_none()
    {
        o.insert("error".into(), Value::Null);
    }
    json!({ "status": status })
}

/// The status patch after a DeleteVolumeGroupSnapshot: handle, readiness and time gone (the
/// member list and the error stay, as upstream's).
pub fn cleared_status_patch() -> Value {
    json!({"status": {
        "volumeGroupSnapshotHandle": null, "readyToUse": null, "creationTime": null, "error": null,
    }})
}

/// The snapshot IDs DeleteVolumeGroupSnapshot names: the members in the status, else the
/// pre-provisioned ones in the spec.
pub fn member_ids(content: &VolumeGroupSnapshotContent) -> Vec<String> {
    let listed: Vec<String> = content
        .status
        .as_ref()
        .and_then(|s| s.volume_snapshot_info_list.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|m| m.snapshot_handle.clone())
        .collect();
    if !listed.is_empty() {
        return listed;
    }
    content
        .spec
        .source
        .group_snapshot_handles
        .as_ref()
        .map(|h| h.volume_snapshot_handles.clone())
        .unwrap_or_default()
}

/// The group's CSI ID: the status's, else the pre-provisioned one in the spec.
pub fn group_handle(content: &VolumeGroupSnapshotContent) -> Option<String> {
    content
        .status
        .as_ref()
        .and_then(|s| s.volume_group_snapshot_handle.clone())
        .or_else(|| {
            content
                .spec
                .source
                .group_snapshot_handles
                .as_ref()
                .map(|h| h.volume_group_snapshot_handle.clone())
        })
        .filter(|h| !h.is_empty())
}

/// Event reason of a failed first create.
pub const REASON_CREATE_FAILED: &str = "GroupSnapshotCreationFailed";
/// Event reason of a failed later check (a re-sent create, a GetVolumeGroupSnapshot).
pub const REASON_CHECK_FAILED: &str = "GroupSnapshotContentCheckandUpdateFailed";
/// Event reason of a failed deletion.
pub const REASON_DELETE_ERROR: &str = "GroupSnapshotDeleteError";

/// The event reason and the message (also `status.error.message`) of a failed `action`.
pub fn failure(action: Action, err: &str) -> (&'static str, String) {
    if action == Action::Create {
        (
            REASON_CREATE_FAILED,
            format!("Failed to create group snapshot: {err}"),
        )
    } else {
        (
            REASON_CHECK_FAILED,
            format!("Failed to check and update group snapshot content: {err}"),
        )
    }
}

/// A hash of what makes a changed group content worth a sync: everything but the resource
/// version, the status, the finalizers, managed fields and the being-created annotation. The
/// sidecar's own writes leave it unchanged (upstream wakes at every update, its own writes
/// included, and re-sends CreateVolumeGroupSnapshot in a loop until the group is ready).
pub fn fingerprint(content: &VolumeGroupSnapshotContent) -> u64 {
    crate::decide::fingerprint_of(&content.metadata, &content.spec, ANN_BEING_CREATED)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn content(v: Value) -> VolumeGroupSnapshotContent {
        serde_json::from_value(v).unwrap()
    }

    fn dynamic() -> VolumeGroupSnapshotContent {
        content(json!({
            "metadata": {"name": "groupsnapcontent-1"},
            "spec": {"driver": "d", "deletionPolicy": "Delete",
                     "source": {"volumeHandles": ["vol-1", "vol-2"]},
                     "volumeGroupSnapshotRef": {"name": "g", "namespace": "ns", "uid": "u-1"},
                     "volumeGroupSnapshotClassName": "c"}
        }))
    }

    fn taken(ready: bool) -> GroupTaken {
        GroupTaken {
            handle: "group-1".into(),
            ready,
            creation_time: Time(k8s_openapi::jiff::Timestamp::from_second(1_700_000_000).unwrap()),
            members: vec![VolumeSnapshotInfo {
                volume_handle: Some("vol-1".into()),
                snapshot_handle: Some("snap-1".into()),
                creation_time: Some(1_700_000_000_000_000_000),
                ready_to_use: Some(ready),
                restore_size: Some(1024),
            }],
        }
    }

    #[test]
    fn only_the_drivers_group_contents_with_a_source_are_ours() {
        let c = dynamic();
        assert!(is_ours(&c, "d", None));
        assert!(!is_ours(&c, "d", Some("other")));
        assert!(!is_ours(&c, "e", None));
        let mut empty = c.clone();
        empty.spec.source.volume_handles = Some(vec![]);
        assert!(!is_ours(&empty, "d", None));
    }

    #[test]
    fn the_actions_follow_upstreams_order() {
        let mut c = dynamic();
        assert_eq!(action(&c), Action::Create);
        c.status = status_after(None, &taken(false));
        assert_eq!(action(&c), Action::CreateAgain);
        c.status = status_after(c.status.as_ref(), &taken(true));
        assert_eq!(action(&c), Action::Ready);
        // Deleted while a create may be in flight: not yet.
        c.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        c.metadata.annotations = Some(BTreeMap::from([
            (ANN_BEING_CREATED.to_owned(), "yes".to_owned()),
            (ANN_BEING_DELETED.to_owned(), "yes".to_owned()),
        ]));
        assert_eq!(action(&c), Action::Ready);
        c.metadata.annotations = Some(BTreeMap::from([(
            ANN_BEING_DELETED.to_owned(),
            "yes".to_owned(),
        )]));
        assert_eq!(action(&c), Action::Delete);
        let pre = content(json!({
            "metadata": {"name": "pre", "deletionTimestamp": "2026-11-29T16:00:00Z"},
            "spec": {"driver": "d", "deletionPolicy": "Retain",
                     "source": {"groupSnapshotHandles": {"volumeGroupSnapshotHandle": "g",
                                                          "volumeSnapshotHandles": ["s"]}},
                     "volumeGroupSnapshotRef": {"name": "g", "namespace": "ns"}}
        }));
        assert_eq!(action(&pre), Action::Delete, "unbound pre-provisioned");
    }

    #[test]
    fn a_check_that_changes_nothing_writes_nothing() {
        let first = status_after(None, &taken(false)).unwrap();
        assert_eq!(first.volume_snapshot_info_list.as_ref().unwrap().len(), 1);
        let ready = status_after(Some(&first), &taken(true)).unwrap();
        assert_eq!(ready.ready_to_use, Some(true));
        // The members as the driver last listed them.
        assert_eq!(
            ready.volume_snapshot_info_list.unwrap()[0].ready_to_use,
            Some(true)
        );
        let again = status_after(
            Some(&status_after(Some(&first), &taken(true)).unwrap()),
            &taken(true),
        );
        assert_eq!(again, None);
        // A pre-provisioned check has no members: nothing to add.
        let mut no_members = taken(true);
        no_members.members.clear();
        let s = status_after(None, &no_members).unwrap();
        assert_eq!(status_after(Some(&s), &no_members), None);
    }

    #[test]
    fn deletion_names_the_members_of_the_status_or_of_the_spec() {
        let mut c = dynamic();
        c.status = status_after(None, &taken(true));
        assert_eq!(member_ids(&c), ["snap-1"]);
        assert_eq!(group_handle(&c).as_deref(), Some("group-1"));
        let pre = content(json!({
            "metadata": {"name": "pre"},
            "spec": {"driver": "d", "deletionPolicy": "Delete",
                     "source": {"groupSnapshotHandles": {"volumeGroupSnapshotHandle": "g",
                                                          "volumeSnapshotHandles": ["s1", "s2"]}}}
        }));
        assert_eq!(member_ids(&pre), ["s1", "s2"]);
        assert_eq!(group_handle(&pre).as_deref(), Some("g"));
    }

    #[test]
    fn secrets_come_from_both_annotations() {
        let mut c = dynamic();
        assert_eq!(annotated_secret(&c), Ok(None));
        c.metadata.annotations = Some(BTreeMap::from([
            (ANN_DELETION_SECRET_NAME.to_owned(), "s".to_owned()),
            (ANN_DELETION_SECRET_NAMESPACE.to_owned(), "ns".to_owned()),
        ]));
        assert_eq!(
            annotated_secret(&c),
            Ok(Some(("ns".to_owned(), "s".to_owned())))
        );
        c.metadata.annotations = Some(BTreeMap::from([
            (ANN_DELETION_SECRET_NAME.to_owned(), String::new()),
            (ANN_DELETION_SECRET_NAMESPACE.to_owned(), "ns".to_owned()),
        ]));
        assert_eq!(
            annotated_secret(&c).unwrap_err(),
            "cannot retrieve secrets for group snapshot content \"groupsnapcontent-1\", err: secret name or namespace not specified"
        );
    }
}
