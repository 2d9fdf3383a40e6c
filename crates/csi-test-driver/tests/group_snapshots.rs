//! The driver's GroupController on a real socket: served only when asked for, with the
//! plugin capability; CreateVolumeGroupSnapshot idempotent by name with the spec's codes;
//! members that are real snapshots (listed with their group's id, restorable, not deletable
//! alone); Get and Delete checking `snapshot_ids`; Delete idempotent; readiness after a number
//! of answers; faults; a persistent driver's groups seen by another instance.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use plugreg_csi_test_driver::{Code, DriverConfig, Failure, Fault, Method, MountMode, start};
use plugreg_proto::csi::v1::controller_client::ControllerClient;
use plugreg_proto::csi::v1::group_controller_client::GroupControllerClient;
use plugreg_proto::csi::v1::identity_client::IdentityClient;
use plugreg_proto::csi::v1::{
    CapacityRange, CreateVolumeGroupSnapshotRequest, CreateVolumeRequest, DeleteSnapshotRequest,
    DeleteVolumeGroupSnapshotRequest, GetPluginCapabilitiesRequest, GetSnapshotRequest,
    GetVolumeGroupSnapshotRequest, GroupControllerGetCapabilitiesRequest, ListSnapshotsRequest,
    Volume, VolumeContentSource, VolumeGroupSnapshot, group_controller_service_capability,
    plugin_capability, volume_content_source,
};
use tonic::transport::Channel;

mod common;

struct Clients {
    ctl: ControllerClient<Channel>,
    group: GroupControllerClient<Channel>,
    id: IdentityClient<Channel>,
}

async fn clients(path: &Path) -> Clients {
    let ch = plugreg_transport::connect_path(path, Duration::from_secs(5))
        .await
        .unwrap();
    Clients {
        ctl: ControllerClient::new(ch.clone()),
        group: GroupControllerClient::new(ch.clone()),
        id: IdentityClient::new(ch),
    }
}

fn config(data: &Path) -> DriverConfig {
    DriverConfig {
        controller: true,
        snapshots: true,
        group_snapshots: true,
        data_dir: Some(data.to_owned()),
        mount: MountMode::Directory,
        ..DriverConfig::default()
    }
}

async fn new_volume(ctl: &mut ControllerClient<Channel>, name: &str) -> Volume {
    restore(ctl, name, None).await.unwrap()
}

async fn restore(
    ctl: &mut ControllerClient<Channel>,
    name: &str,
    source: Option<&str>,
) -> Result<Volume, tonic::Status> {
    let r = CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: 1 << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![common::cap()],
        volume_content_source: source.map(|id| VolumeContentSource {
            r#type: Some(volume_content_source::Type::Snapshot(
                volume_content_source::SnapshotSource {
                    snapshot_id: id.into(),
                },
            )),
        }),
        ..Default::default()
    };
    Ok(ctl.create_volume(r).await?.into_inner().volume.unwrap())
}

fn group_of(name: &str, volumes: &[&str]) -> CreateVolumeGroupSnapshotRequest {
    CreateVolumeGroupSnapshotRequest {
        name: name.into(),
        source_volume_ids: volumes.iter().map(|v| v.to_string()).collect(),
        ..Default::default()
    }
}

async fn create_group(
    group: &mut GroupControllerClient<Channel>,
    r: CreateVolumeGroupSnapshotRequest,
) -> Result<VolumeGroupSnapshot, tonic::Status> {
    Ok(group
        .create_volume_group_snapshot(r)
        .await?
        .into_inner()
        .group_snapshot
        .unwrap())
}

fn member_ids(g: &VolumeGroupSnapshot) -> Vec<String> {
    g.snapshots.iter().map(|s| s.snapshot_id.clone()).collect()
}

fn get(g: &str, ids: Vec<String>) -> GetVolumeGroupSnapshotRequest {
    GetVolumeGroupSnapshotRequest {
        group_snapshot_id: g.into(),
        snapshot_ids: ids,
        ..Default::default()
    }
}

fn delete(g: &str, ids: Vec<String>) -> DeleteVolumeGroupSnapshotRequest {
    DeleteVolumeGroupSnapshotRequest {
        group_snapshot_id: g.into(),
        snapshot_ids: ids,
        ..Default::default()
    }
}

async fn plugin_services(id: &mut IdentityClient<Channel>) -> Vec<i32> {
    id.get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| match c.r#type {
            Some(plugin_capability::Type::Service(s)) => Some(s.r#type),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn the_group_controller_is_served_and_advertised_only_when_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let group_service = plugin_capability::service::Type::GroupControllerService as i32;

    let sock = dir.path().join("off.sock");
    let off = DriverConfig {
        group_snapshots: false,
        ..config(&dir.path().join("off"))
    };
    let d = start(off, &sock).await.unwrap();
    let mut c = clients(&sock).await;
    assert!(!plugin_services(&mut c.id).await.contains(&group_service));
    let e = c
        .group
        .group_controller_get_capabilities(GroupControllerGetCapabilitiesRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    let e = c
        .group
        .create_volume_group_snapshot(group_of("g", &["v"]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    assert_eq!(d.calls().count(Method::CreateVolumeGroupSnapshot), 0);
    d.stop().await.unwrap();

    let sock = dir.path().join("on.sock");
    let d = start(config(&dir.path().join("on")), &sock).await.unwrap();
    let mut c = clients(&sock).await;
    assert!(plugin_services(&mut c.id).await.contains(&group_service));
    let caps = c
        .group
        .group_controller_get_capabilities(GroupControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    use group_controller_service_capability::{Rpc, Type, rpc};
    let types: Vec<Option<Type>> = caps.into_iter().map(|c| c.r#type).collect();
    assert_eq!(
        types,
        [Some(Type::Rpc(Rpc {
            r#type: rpc::Type::CreateDeleteGetVolumeGroupSnapshot as i32
        }))]
    );
    assert_eq!(d.calls().count(Method::GroupControllerGetCapabilities), 1);
    d.stop().await.unwrap();
}

#[tokio::test]
async fn create_is_idempotent_by_name_and_refuses_other_volumes_or_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let d = start(config(&dir.path().join("data")), &sock)
        .await
        .unwrap();
    let mut c = clients(&sock).await;
    let v1 = new_volume(&mut c.ctl, "a").await.volume_id;
    let v2 = new_volume(&mut c.ctl, "b").await.volume_id;
    let v3 = new_volume(&mut c.ctl, "c").await.volume_id;

    let g = create_group(&mut c.group, group_of("g", &[&v1, &v2]))
        .await
        .unwrap();
    assert!(!g.group_snapshot_id.is_empty());
    assert!(g.ready_to_use);
    assert!(g.creation_time.is_some());
    let sources: Vec<&str> = g
        .snapshots
        .iter()
        .map(|s| s.source_volume_id.as_str())
        .collect();
    assert_eq!(sources, [v1.as_str(), v2.as_str()]);
    for s in &g.snapshots {
        assert_eq!(s.group_snapshot_id, g.group_snapshot_id);
        assert_eq!(s.creation_time, g.creation_time);
        assert!(s.ready_to_use);
        assert_eq!(s.size_bytes, 1 << 20);
    }

    // The same volumes, in another order: the same group.
    let again = create_group(&mut c.group, group_of("g", &[&v2, &v1]))
        .await
        .unwrap();
    assert_eq!(again.group_snapshot_id, g.group_snapshot_id);
    assert_eq!(member_ids(&again), member_ids(&g));

    let e = create_group(&mut c.group, group_of("g", &[&v1, &v3]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    let mut other_parameters = group_of("g", &[&v1, &v2]);
    other_parameters
        .parameters
        .insert("tier".into(), "gold".into());
    let e = create_group(&mut c.group, other_parameters)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");

    // Another name: another group, other snapshots.
    let h = create_group(&mut c.group, group_of("h", &[&v1]))
        .await
        .unwrap();
    assert_ne!(h.group_snapshot_id, g.group_snapshot_id);
    assert!(!member_ids(&g).contains(&member_ids(&h)[0]));

    let kept = d.calls().create_group_snapshot_requests();
    assert_eq!(kept.len(), 5);
    assert_eq!(kept[0].name, "g");
    assert_eq!(kept[4].source_volume_ids, [v1]);
    d.stop().await.unwrap();
}

#[tokio::test]
async fn invalid_arguments_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let d = start(config(&dir.path().join("data")), &sock)
        .await
        .unwrap();
    let mut c = clients(&sock).await;
    let v = new_volume(&mut c.ctl, "a").await.volume_id;

    for (what, r) in [
        ("no name", group_of("", &[&v])),
        ("no volumes", group_of("g", &[])),
        ("an empty volume id", group_of("g", &[""])),
        ("a volume twice", group_of("g", &[&v, &v])),
        ("an unknown volume", group_of("g", &[&v, "nope"])),
        ("a control character", group_of("g\u{1}", &[&v])),
        ("a long name", group_of(&"x".repeat(129), &[&v])),
    ] {
        let e = create_group(&mut c.group, r).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
    }
    // Whitespace is allowed in a name.
    create_group(&mut c.group, group_of("g with\ttabs", &[&v]))
        .await
        .unwrap();

    let e = c
        .group
        .get_volume_group_snapshot(get("", vec!["s".into()]))
        .await;
    assert_eq!(e.unwrap_err().code(), Code::InvalidArgument);
    let e = c.group.get_volume_group_snapshot(get("g", vec![])).await;
    assert_eq!(e.unwrap_err().code(), Code::InvalidArgument);
    let e = c
        .group
        .delete_volume_group_snapshot(delete("", vec!["s".into()]))
        .await;
    assert_eq!(e.unwrap_err().code(), Code::InvalidArgument);
    let e = c
        .group
        .delete_volume_group_snapshot(delete("g", vec![]))
        .await;
    assert_eq!(e.unwrap_err().code(), Code::InvalidArgument);
    d.stop().await.unwrap();
}

#[tokio::test]
async fn members_are_listed_with_their_group_and_restore_the_data() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, data) = (dir.path().join("csi.sock"), dir.path().join("data"));
    let d = start(config(&data), &sock).await.unwrap();
    let mut c = clients(&sock).await;
    let v1 = new_volume(&mut c.ctl, "a").await.volume_id;
    let v2 = new_volume(&mut c.ctl, "b").await.volume_id;
    std::fs::write(data.join(&v1).join("data.txt"), "one").unwrap();
    std::fs::write(data.join(&v2).join("data.txt"), "two").unwrap();

    let g = create_group(&mut c.group, group_of("g", &[&v1, &v2]))
        .await
        .unwrap();
    // Written after the group was cut: not in its snapshots.
    std::fs::write(data.join(&v1).join("data.txt"), "later").unwrap();

    let listed = c
        .ctl
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries;
    let listed: Vec<_> = listed.into_iter().filter_map(|e| e.snapshot).collect();
    assert_eq!(listed.len(), 2);
    for s in &listed {
        assert_eq!(s.group_snapshot_id, g.group_snapshot_id);
    }
    let by_volume = c
        .ctl
        .list_snapshots(ListSnapshotsRequest {
            source_volume_id: v2.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .entries;
    assert_eq!(by_volume[0].snapshot, Some(g.snapshots[1].clone()));

    let member = &g.snapshots[0];
    let got = c
        .ctl
        .get_snapshot(GetSnapshotRequest {
            snapshot_id: member.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot;
    assert_eq!(got.as_ref(), Some(member));

    let restored = restore(&mut c.ctl, "r", Some(&member.snapshot_id))
        .await
        .unwrap();
    let text = std::fs::read_to_string(data.join(&restored.volume_id).join("data.txt")).unwrap();
    assert_eq!(text, "one");

    // A member goes only with its group (the spec's "Snapshot is part of a group").
    let e = c
        .ctl
        .delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: member.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        restore(&mut c.ctl, "r2", Some(&member.snapshot_id))
            .await
            .is_ok()
    );
    d.stop().await.unwrap();
}

#[tokio::test]
async fn get_and_delete_check_the_snapshot_ids_and_delete_is_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, data) = (dir.path().join("csi.sock"), dir.path().join("data"));
    let d = start(config(&data), &sock).await.unwrap();
    let mut c = clients(&sock).await;
    let v1 = new_volume(&mut c.ctl, "a").await.volume_id;
    let v2 = new_volume(&mut c.ctl, "b").await.volume_id;
    let g = create_group(&mut c.group, group_of("g", &[&v1, &v2]))
        .await
        .unwrap();
    let id = g.group_snapshot_id.clone();
    let ids = member_ids(&g);
    let mut reversed = ids.clone();
    reversed.reverse();

    let e = c
        .group
        .get_volume_group_snapshot(get("nope", ids.clone()))
        .await;
    assert_eq!(e.unwrap_err().code(), Code::NotFound);
    for wrong in [vec![ids[0].clone()], vec![ids[0].clone(), "x".into()]] {
        let e = c
            .group
            .get_volume_group_snapshot(get(&id, wrong.clone()))
            .await;
        assert_eq!(e.unwrap_err().code(), Code::InvalidArgument, "{wrong:?}");
        let e = c
            .group
            .delete_volume_group_snapshot(delete(&id, wrong.clone()))
            .await;
        assert_eq!(e.unwrap_err().code(), Code::InvalidArgument, "{wrong:?}");
    }
    let got = c
        .group
        .get_volume_group_snapshot(get(&id, reversed.clone()))
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(got, g);

    c.group
        .delete_volume_group_snapshot(delete(&id, reversed))
        .await
        .unwrap();
    let listed = c
        .ctl
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries;
    assert!(listed.is_empty(), "{listed:?}");
    for member in &ids {
        assert!(!data.join(".snapshots").join(member).exists());
        let e = restore(&mut c.ctl, &format!("from-{member}"), Some(member)).await;
        assert_eq!(e.unwrap_err().code(), Code::NotFound);
    }
    // Gone: Get is NOT_FOUND, Delete again is OK.
    let e = c
        .group
        .get_volume_group_snapshot(get(&id, ids.clone()))
        .await;
    assert_eq!(e.unwrap_err().code(), Code::NotFound);
    c.group
        .delete_volume_group_snapshot(delete(&id, ids.clone()))
        .await
        .unwrap();
    c.group
        .delete_volume_group_snapshot(delete("never-was", ids.clone()))
        .await
        .unwrap();

    let kept = d.calls().delete_group_snapshot_requests();
    assert_eq!(kept.len(), 5);
    assert_eq!(kept[4].group_snapshot_id, "never-was");
    assert_eq!(d.calls().count(Method::GetVolumeGroupSnapshot), 5);
    d.stop().await.unwrap();
}

#[tokio::test]
async fn a_group_and_its_members_are_ready_after_the_configured_answers() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let d = start(
        DriverConfig {
            group_ready_after: 2,
            ..config(&dir.path().join("data"))
        },
        &sock,
    )
    .await
    .unwrap();
    let mut c = clients(&sock).await;
    let v1 = new_volume(&mut c.ctl, "a").await.volume_id;
    let v2 = new_volume(&mut c.ctl, "b").await.volume_id;
    let r = group_of("g", &[&v1, &v2]);

    let member_ready = |entries: Vec<plugreg_proto::csi::v1::list_snapshots_response::Entry>| {
        entries
            .into_iter()
            .map(|e| e.snapshot.unwrap().ready_to_use)
            .collect::<BTreeSet<bool>>()
    };
    for answer in 1..=2 {
        let g = create_group(&mut c.group, r.clone()).await.unwrap();
        assert!(!g.ready_to_use, "answer {answer}");
        assert!(
            g.snapshots.iter().all(|s| !s.ready_to_use),
            "answer {answer}"
        );
        let listed = c
            .ctl
            .list_snapshots(ListSnapshotsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .entries;
        assert_eq!(member_ready(listed), BTreeSet::from([false]));
        let e = restore(&mut c.ctl, "r", Some(&g.snapshots[0].snapshot_id)).await;
        assert_eq!(e.unwrap_err().code(), Code::Unavailable);
    }
    let g = create_group(&mut c.group, r.clone()).await.unwrap();
    assert!(g.ready_to_use);
    assert!(g.snapshots.iter().all(|s| s.ready_to_use));
    let listed = c
        .ctl
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries;
    assert_eq!(member_ready(listed), BTreeSet::from([true]));
    restore(&mut c.ctl, "r", Some(&g.snapshots[0].snapshot_id))
        .await
        .unwrap();

    // GetVolumeGroupSnapshot polls count too.
    let h = create_group(&mut c.group, group_of("h", &[&v1]))
        .await
        .unwrap();
    assert!(!h.ready_to_use);
    let poll = get(&h.group_snapshot_id, member_ids(&h));
    let mut seen = Vec::new();
    for _ in 0..2 {
        let got = c
            .group
            .get_volume_group_snapshot(poll.clone())
            .await
            .unwrap()
            .into_inner()
            .group_snapshot
            .unwrap();
        seen.push(got.ready_to_use);
    }
    assert_eq!(seen, [false, true]);
    d.stop().await.unwrap();
}

#[tokio::test]
async fn a_fault_fails_the_group_calls_like_any_other() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let mut cfg = config(&dir.path().join("data"));
    cfg.faults.insert(
        Method::CreateVolumeGroupSnapshot,
        Fault {
            error: Some(Failure::new(Code::ResourceExhausted, "no space")),
            fail_first: Some(1),
            ..Fault::default()
        },
    );
    let d = start(cfg, &sock).await.unwrap();
    let mut c = clients(&sock).await;
    let v = new_volume(&mut c.ctl, "a").await.volume_id;
    let e = create_group(&mut c.group, group_of("g", &[&v]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    create_group(&mut c.group, group_of("g", &[&v]))
        .await
        .unwrap();
    assert_eq!(d.calls().count(Method::CreateVolumeGroupSnapshot), 2);
    d.stop().await.unwrap();
}

#[tokio::test]
async fn a_persistent_drivers_groups_are_seen_by_another_instance() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let persistent = || DriverConfig {
        persistent: true,
        ..config(&data)
    };
    let (sock_a, sock_b) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    let a = start(persistent(), &sock_a).await.unwrap();
    let b = start(persistent(), &sock_b).await.unwrap();
    let mut ca = clients(&sock_a).await;
    let mut cb = clients(&sock_b).await;
    let v1 = new_volume(&mut ca.ctl, "v1").await.volume_id;
    let v2 = new_volume(&mut ca.ctl, "v2").await.volume_id;
    let mut r = group_of("g", &[&v1, &v2]);
    r.parameters.insert("k".into(), "a:b\nc".into());
    let g = create_group(&mut ca.group, r.clone()).await.unwrap();
    assert_eq!(g.group_snapshot_id, "g");

    // The other instance knows the group, its members and its parameters.
    let again = create_group(&mut cb.group, r.clone()).await.unwrap();
    assert_eq!(again, g);
    let mut other = r.clone();
    other.parameters.clear();
    let e = create_group(&mut cb.group, other).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);
    let e = cb
        .ctl
        .delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: g.snapshots[0].snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    restore(&mut cb.ctl, "r", Some(&g.snapshots[1].snapshot_id))
        .await
        .unwrap();

    cb.group
        .delete_volume_group_snapshot(delete("g", member_ids(&g)))
        .await
        .unwrap();
    let e = cb
        .group
        .get_volume_group_snapshot(get("g", member_ids(&g)))
        .await;
    assert_eq!(e.unwrap_err().code(), Code::NotFound);
    assert!(!data.join(".snapshots").join(".g.group").exists());
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}
