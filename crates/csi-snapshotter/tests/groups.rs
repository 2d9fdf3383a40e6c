//! Volume group snapshots with the `CSIVolumeGroupSnapshot` gate, through the real Go
//! snapshot-controller v8.6.0 (its gate on too) on a real kube-apiserver v1.36.2, the test
//! driver's GroupController and `csi-snapshotter`: the controller makes the group content, the
//! sidecar cuts the group, the controller makes the members from the sidecar's status, and the
//! group's deletion ends in one DeleteVolumeGroupSnapshot; a pre-provisioned group is made ready
//! through GetVolumeGroupSnapshot; a driver without a GroupController gets upstream's event.

mod common;

use std::collections::HashMap;

use common::{Env, NS};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams};
use plugreg_csi_test_driver::Method;
use plugreg_sidecar_kit::groupsnapshot::{
    ANN_BEING_CREATED, VolumeGroupSnapshotClass, VolumeGroupSnapshotContent,
};
use plugreg_sidecar_kit::snapshot::{ANN_GROUP_SNAPSHOT_HANDLE, VolumeSnapshotContent};
use serde_json::{Value, json};

const GATE: &str = "--feature-gates=CSIVolumeGroupSnapshot=true";

fn group_resource() -> ApiResource {
    ApiResource {
        group: "groupsnapshot.storage.k8s.io".into(),
        version: "v1".into(),
        api_version: "groupsnapshot.storage.k8s.io/v1".into(),
        kind: "VolumeGroupSnapshot".into(),
        plural: "volumegroupsnapshots".into(),
    }
}

fn groups(env: &Env) -> Api<DynamicObject> {
    Api::namespaced_with(env.client.clone(), NS, &group_resource())
}

/// Two claims labelled `app=db`, bound to `vol-a` and `vol-b`, a group class of the driver
/// with policy Delete, and a VolumeGroupSnapshot of the label; returns its UID.
async fn group_of_two(env: &Env, class_parameters: Value) -> String {
    for (claim, handle) in [("db-0", "vol-a"), ("db-1", "vol-b")] {
        env.bound_claim(claim, handle).await;
        let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
            Api::namespaced(env.client.clone(), NS);
        claims
            .patch(
                claim,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"app": "db"}}})),
            )
            .await
            .unwrap();
    }
    env.create::<VolumeGroupSnapshotClass>(json!({
        "metadata": {"name": "group-cls"},
        "driver": env.name, "deletionPolicy": "Delete", "parameters": class_parameters,
    }))
    .await;
    let made = groups(env)
        .create(
            &Default::default(),
            &serde_json::from_value(json!({
                "apiVersion": "groupsnapshot.storage.k8s.io/v1", "kind": "VolumeGroupSnapshot",
                "metadata": {"name": "db", "namespace": NS},
                "spec": {"source": {"selector": {"matchLabels": {"app": "db"}}},
                         "volumeGroupSnapshotClassName": "group-cls"},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    made.metadata.uid.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_snapshot_becomes_ready_with_its_members_and_goes_by_its_policy() {
    let env = Env::with_controller(&[GATE], |d| {
        d.group_snapshots = true;
        d.group_ready_after = 1;
    })
    .await;
    let sidecar = env.snapshotter(&[GATE, "--extra-create-metadata"]);
    let uid = group_of_two(&env, json!({"tier": "gold"})).await;
    let content_name = format!("groupsnapcontent-{uid}");

    // The real controller copies the group content's readiness into the group.
    env.poll("group db readyToUse", || async {
        let g = groups(&env).get_opt("db").await.ok().flatten()?;
        (g.data["status"]["readyToUse"] == json!(true)).then_some(())
    })
    .await;

    // Not ready once: CreateVolumeGroupSnapshot was sent twice, identically, after a back-off
    // (not at each of the sidecar's own writes), and never GetVolumeGroupSnapshot.
    let creates = env.calls.create_group_snapshot_requests();
    assert_eq!(creates.len(), 2, "{creates:?}");
    assert_eq!(creates[0], creates[1]);
    let first = &creates[0];
    assert_eq!(first.name, format!("groupsnapshot-{uid}"));
    let mut sources = first.source_volume_ids.clone();
    sources.sort();
    assert_eq!(sources, ["vol-a", "vol-b"]);
    let want: HashMap<String, String> = [
        ("tier", "gold"),
        ("csi.storage.k8s.io/volumegroupsnapshot/name", "db"),
        ("csi.storage.k8s.io/volumegroupsnapshot/namespace", NS),
        (
            "csi.storage.k8s.io/volumegroupsnapshotcontent/name",
            content_name.as_str(),
        ),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    assert_eq!(first.parameters, want);
    assert_eq!(env.calls.count(Method::GetVolumeGroupSnapshot), 0);

    // The group content: the group, its time and both members, no annotation left.
    let contents: Api<VolumeGroupSnapshotContent> = Api::all(env.client.clone());
    let content = contents.get(&content_name).await.unwrap();
    assert!(
        !content
            .metadata
            .annotations
            .unwrap_or_default()
            .contains_key(ANN_BEING_CREATED)
    );
    let status = content.status.unwrap();
    let group_handle = status.volume_group_snapshot_handle.clone().unwrap();
    assert_eq!(status.ready_to_use, Some(true));
    assert!(status.creation_time.is_some());
    let members = status.volume_snapshot_info_list.unwrap();
    assert_eq!(members.len(), 2, "{members:?}");
    let mut member_ids: Vec<String> = members
        .iter()
        .map(|m| m.snapshot_handle.clone().unwrap())
        .collect();
    member_ids.sort();

    // The controller's members: contents marked with the group, ready, never CreateSnapshot.
    env.poll("two ready member contents", || async {
        let all = env.contents().list(&Default::default()).await.ok()?.items;
        let ready: Vec<&VolumeSnapshotContent> = all
            .iter()
            .filter(|c| {
                c.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(ANN_GROUP_SNAPSHOT_HANDLE))
                    == Some(&group_handle)
                    && c.status.as_ref().and_then(|s| s.ready_to_use) == Some(true)
            })
            .collect();
        (ready.len() == 2).then_some(())
    })
    .await;
    assert_eq!(env.calls.count(Method::CreateSnapshot), 0);

    // Policy Delete: the group's deletion ends in one DeleteVolumeGroupSnapshot naming both
    // members, and no DeleteSnapshot of a member.
    groups(&env)
        .delete("db", &DeleteParams::default())
        .await
        .unwrap();
    env.poll("group content gone", || async {
        matches!(contents.get_opt(&content_name).await, Ok(None)).then_some(())
    })
    .await;
    let deletes = env.calls.delete_group_snapshot_requests();
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert_eq!(deletes[0].group_snapshot_id, group_handle);
    let mut deleted = deletes[0].snapshot_ids.clone();
    deleted.sort();
    assert_eq!(deleted, member_ids);
    assert_eq!(env.calls.count(Method::DeleteSnapshot), 0);
    drop(sidecar);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_group_is_an_event_and_snapshots_go_on_without_a_group_controller() {
    // A driver without a GroupController: upstream's error line, and single snapshots still
    // work; a group of it fails with upstream's event on the group content.
    let env = Env::with_controller(&[GATE], |_| {}).await;
    let sidecar = env.snapshotter(&[GATE]);
    let uid = group_of_two(&env, json!({})).await;
    let content_name = format!("groupsnapcontent-{uid}");
    env.wait_event(
        "default",
        &content_name,
        "GroupSnapshotCreationFailed",
        "Failed to create group snapshot: failed to take group snapshot of the volumes",
    )
    .await;
    let log = std::fs::read_to_string(&sidecar.log).unwrap();
    assert!(
        log.contains(
            "error determining if driver supports create/delete group snapshot operations"
        ),
        "{log}"
    );
    env.class("cls", "Delete", json!({})).await;
    let snap = env.snapshot("one", "db-0", "cls").await;
    env.wait_content(&format!("snapcontent-{snap}"), "a ready snapshot", |c| {
        c.status.as_ref().and_then(|s| s.ready_to_use) == Some(true)
    })
    .await;
    drop(sidecar);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_provisioned_group_is_ready_through_get_volume_group_snapshot() {
    let env = Env::with_controller(&[GATE], |d| d.group_snapshots = true).await;
    // A group the driver already holds (cut by hand, as an administrator importing it would).
    let conn = plugreg_csi_core::client::Connection::connect(
        env.socket.to_str().unwrap(),
        std::time::Duration::from_secs(5),
        std::time::Duration::from_secs(5),
        Default::default(),
    )
    .await
    .unwrap();
    let cut = conn
        .group_controller()
        .create_volume_group_snapshot(plugreg_proto::csi::v1::CreateVolumeGroupSnapshotRequest {
            name: "imported".into(),
            source_volume_ids: vec!["vol-c".into(), "vol-d".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    let members: Vec<String> = cut
        .snapshots
        .iter()
        .map(|s| s.snapshot_id.clone())
        .collect();
    let sidecar = env.snapshotter(&[GATE]);
    env.create::<VolumeGroupSnapshotContent>(json!({
        "metadata": {"name": "imported-content"},
        "spec": {"driver": env.name, "deletionPolicy": "Retain",
                 "source": {"groupSnapshotHandles": {
                     "volumeGroupSnapshotHandle": cut.group_snapshot_id,
                     "volumeSnapshotHandles": members}},
                 "volumeGroupSnapshotRef": {"name": "imported", "namespace": NS}},
    }))
    .await;
    groups(&env)
        .create(
            &Default::default(),
            &serde_json::from_value(json!({
                "apiVersion": "groupsnapshot.storage.k8s.io/v1", "kind": "VolumeGroupSnapshot",
                "metadata": {"name": "imported", "namespace": NS},
                "spec": {"source": {"volumeGroupSnapshotContentName": "imported-content"}},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let contents: Api<VolumeGroupSnapshotContent> = Api::all(env.client.clone());
    let content = env
        .poll("imported content ready", || async {
            contents
                .get_opt("imported-content")
                .await
                .ok()
                .flatten()
                .filter(|c| c.status.as_ref().and_then(|s| s.ready_to_use) == Some(true))
        })
        .await;
    let status = content.status.unwrap();
    assert_eq!(
        status.volume_group_snapshot_handle.as_deref(),
        Some(cut.group_snapshot_id.as_str())
    );
    assert!(status.creation_time.is_some());
    // Asked with GetVolumeGroupSnapshot, never cut again.
    assert!(env.calls.count(Method::GetVolumeGroupSnapshot) >= 1);
    assert_eq!(env.calls.create_group_snapshot_requests().len(), 1);
    env.poll("group imported readyToUse", || async {
        let g = groups(&env).get_opt("imported").await.ok().flatten()?;
        (g.data["status"]["readyToUse"] == json!(true)).then_some(())
    })
    .await;
    drop(sidecar);
}
