//! The driver's snapshot calls and content sources on a real socket (issue 21): CreateSnapshot
//! idempotent by name with the spec's codes, readiness after a number of calls, ListSnapshots
//! filters and pages, GetSnapshot, DeleteSnapshot idempotent, a restore and a clone that start
//! with their source's data and at least its size, a persistent driver's snapshots seen by
//! another instance, and the calls left UNIMPLEMENTED without `snapshots`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use plugreg_csi_test_driver::{Code, DriverConfig, Method, MountMode, SmallerThanSource, start};
use plugreg_proto::csi::v1::controller_client::ControllerClient;
use plugreg_proto::csi::v1::{
    CapacityRange, ControllerGetCapabilitiesRequest, CreateSnapshotRequest, CreateVolumeRequest,
    DeleteSnapshotRequest, GetSnapshotRequest, ListSnapshotsRequest, Snapshot, Volume,
    VolumeCapability, VolumeContentSource, controller_service_capability, volume_capability,
    volume_content_source,
};
use tonic::transport::Channel;

async fn client(path: &Path) -> ControllerClient<Channel> {
    ControllerClient::new(
        plugreg_transport::connect_path(path, Duration::from_secs(5))
            .await
            .unwrap(),
    )
}

fn create(name: &str, bytes: i64, source: Option<VolumeContentSource>) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![VolumeCapability {
            access_type: Some(volume_capability::AccessType::Mount(
                volume_capability::MountVolume::default(),
            )),
            access_mode: Some(volume_capability::AccessMode {
                mode: volume_capability::access_mode::Mode::SingleNodeWriter as i32,
            }),
        }],
        volume_content_source: source,
        ..Default::default()
    }
}

/// CreateVolume that must succeed: the volume.
async fn new_volume(ctl: &mut ControllerClient<Channel>, r: CreateVolumeRequest) -> Volume {
    ctl.create_volume(r)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
}

/// CreateSnapshot that must succeed: the snapshot.
async fn new_snapshot(ctl: &mut ControllerClient<Channel>, r: CreateSnapshotRequest) -> Snapshot {
    ctl.create_snapshot(r)
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap()
}

fn from_snapshot(id: &str) -> Option<VolumeContentSource> {
    Some(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Snapshot(
            volume_content_source::SnapshotSource {
                snapshot_id: id.into(),
            },
        )),
    })
}

fn from_volume(id: &str) -> Option<VolumeContentSource> {
    Some(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Volume(
            volume_content_source::VolumeSource {
                volume_id: id.into(),
            },
        )),
    })
}

fn snap(name: &str, source: &str) -> CreateSnapshotRequest {
    CreateSnapshotRequest {
        source_volume_id: source.into(),
        name: name.into(),
        ..Default::default()
    }
}

fn config(data: &Path) -> DriverConfig {
    DriverConfig {
        controller: true,
        snapshots: true,
        clone_volume: true,
        data_dir: Some(data.to_owned()),
        mount: MountMode::Directory,
        ..DriverConfig::default()
    }
}

fn file_in(data: &Path, volume: &str) -> PathBuf {
    data.join(volume).join("data.txt")
}

#[tokio::test]
async fn snapshot_restore_and_clone_carry_the_data() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, data) = (dir.path().join("csi.sock"), dir.path().join("data"));
    let d = start(config(&data), &sock).await.unwrap();
    let mut ctl = client(&sock).await;

    let caps = ctl
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    use controller_service_capability::rpc::Type;
    let offered: Vec<i32> = caps
        .capabilities
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(controller_service_capability::Type::Rpc(r)) => Some(r.r#type),
            _ => None,
        })
        .collect();
    for t in [
        Type::CreateDeleteSnapshot,
        Type::ListSnapshots,
        Type::GetSnapshot,
        Type::CloneVolume,
    ] {
        assert!(offered.contains(&(t as i32)), "{t:?} offered");
    }

    let v = new_volume(&mut ctl, create("pvc-a", 1 << 20, None)).await;
    std::fs::write(file_in(&data, &v.volume_id), "hello").unwrap();

    // Created once; the repeat returns the same snapshot.
    let s1 = new_snapshot(&mut ctl, snap("snapshot-1", &v.volume_id)).await;
    assert_eq!(s1.source_volume_id, v.volume_id);
    assert_eq!(s1.size_bytes, 1 << 20);
    assert!(s1.ready_to_use);
    assert!(s1.creation_time.is_some_and(|t| t.seconds > 0));
    // The data taken is the data at that moment.
    std::fs::write(file_in(&data, &v.volume_id), "changed").unwrap();
    let again = new_snapshot(&mut ctl, snap("snapshot-1", &v.volume_id)).await;
    assert_eq!(again, s1);

    // The same name of another volume: ALREADY_EXISTS; an unknown volume: NOT_FOUND; no name:
    // INVALID_ARGUMENT.
    let other = new_volume(&mut ctl, create("pvc-b", 1 << 20, None)).await;
    let e = ctl
        .create_snapshot(snap("snapshot-1", &other.volume_id))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);
    let e = ctl
        .create_snapshot(snap("snapshot-x", "no-such-volume"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = ctl
        .create_snapshot(snap("", &v.volume_id))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // Restore: the snapshot's data, at least its size.
    let r = new_volume(
        &mut ctl,
        create("pvc-restored", 1 << 20, from_snapshot(&s1.snapshot_id)),
    )
    .await;
    assert_eq!(r.capacity_bytes, 1 << 20);
    assert_eq!(r.content_source, from_snapshot(&s1.snapshot_id));
    assert_eq!(
        std::fs::read_to_string(file_in(&data, &r.volume_id)).unwrap(),
        "hello"
    );
    let e = ctl
        .create_volume(create("pvc-nothing", 0, from_snapshot("no-such-snapshot")))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let mut too_small = create("pvc-small", 1024, from_snapshot(&s1.snapshot_id));
    too_small.capacity_range.as_mut().unwrap().limit_bytes = 2048;
    let e = ctl.create_volume(too_small).await.unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange);

    // Clone: the volume's data now.
    let c = new_volume(
        &mut ctl,
        create("pvc-clone", 2 << 20, from_volume(&v.volume_id)),
    )
    .await;
    assert_eq!(c.capacity_bytes, 2 << 20);
    assert_eq!(
        std::fs::read_to_string(file_in(&data, &c.volume_id)).unwrap(),
        "changed"
    );
    let e = ctl
        .create_volume(create("pvc-clone-2", 0, from_volume("no-such-volume")))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    // Asking for less than the source holds is refused (the strict default).
    let e = ctl
        .create_volume(create("pvc-clone-3", 1024, from_volume(&v.volume_id)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange);

    // List: all, by id, by source, in pages.
    ctl.create_snapshot(snap("snapshot-2", &v.volume_id))
        .await
        .unwrap();
    ctl.create_snapshot(snap("snapshot-3", &other.volume_id))
        .await
        .unwrap();
    let all = ctl
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.entries.len(), 3);
    assert!(all.next_token.is_empty());
    let by_source = ctl
        .list_snapshots(ListSnapshotsRequest {
            source_volume_id: v.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_source.entries.len(), 2);
    let by_id = ctl
        .list_snapshots(ListSnapshotsRequest {
            snapshot_id: s1.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_id.entries.len(), 1);
    assert_eq!(by_id.entries[0].snapshot.as_ref(), Some(&s1));
    let none = ctl
        .list_snapshots(ListSnapshotsRequest {
            snapshot_id: "no-such-snapshot".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(none.entries.is_empty(), "an unknown id lists nothing");
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = ctl
            .list_snapshots(ListSnapshotsRequest {
                max_entries: 2,
                starting_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(page.entries.len() <= 2);
        seen.extend(page.entries);
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(seen.len(), 3);
    let e = ctl
        .list_snapshots(ListSnapshotsRequest {
            starting_token: "junk".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Aborted);

    // Get, then delete twice (idempotent); gone afterwards.
    let got = ctl
        .get_snapshot(GetSnapshotRequest {
            snapshot_id: s1.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.snapshot, Some(s1.clone()));
    let del = DeleteSnapshotRequest {
        snapshot_id: s1.snapshot_id.clone(),
        ..Default::default()
    };
    ctl.delete_snapshot(del.clone()).await.unwrap();
    ctl.delete_snapshot(del).await.unwrap();
    let e = ctl
        .get_snapshot(GetSnapshotRequest {
            snapshot_id: s1.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(!data.join(".snapshots").join(&s1.snapshot_id).exists());

    assert_eq!(d.calls().count(Method::DeleteSnapshot), 2);
    assert_eq!(d.calls().create_snapshot_requests().len(), 7);
    d.stop().await.unwrap();
}

/// A restore or clone asking for less than its source holds: refused with OUT_OF_RANGE naming
/// both sizes by default (the spec's code for it), grown to the source's size or made at the
/// smaller size in the two lenient modes; a request without a size gets at least the source's
/// size in every mode.
#[tokio::test]
async fn a_request_smaller_than_its_source_is_refused_unless_lenient() {
    for mode in [
        SmallerThanSource::Refuse,
        SmallerThanSource::Grow,
        SmallerThanSource::Accept,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (sock, data) = (dir.path().join("csi.sock"), dir.path().join("data"));
        let d = start(
            DriverConfig {
                smaller_than_source: mode,
                ..config(&data)
            },
            &sock,
        )
        .await
        .unwrap();
        let mut ctl = client(&sock).await;
        let v = new_volume(&mut ctl, create("pvc-a", 2 << 20, None)).await;
        let s = new_snapshot(&mut ctl, snap("snapshot-a", &v.volume_id)).await;
        assert_eq!(s.size_bytes, 2 << 20);
        for (name, source, what) in [
            (
                "pvc-r",
                from_snapshot(&s.snapshot_id),
                format!("snapshot {:?}", s.snapshot_id),
            ),
            (
                "pvc-c",
                from_volume(&v.volume_id),
                format!("volume {:?}", v.volume_id),
            ),
        ] {
            let r = ctl
                .create_volume(create(name, 1 << 20, source.clone()))
                .await;
            match mode {
                SmallerThanSource::Refuse => {
                    let e = r.unwrap_err();
                    assert_eq!(e.code(), Code::OutOfRange, "{mode:?} {name}");
                    assert_eq!(
                        e.message(),
                        format!(
                            "requested 1048576 bytes, less than the 2097152 bytes of the source {what}"
                        )
                    );
                }
                SmallerThanSource::Grow => {
                    let got = r.unwrap().into_inner().volume.unwrap();
                    assert_eq!(got.capacity_bytes, 2 << 20, "{mode:?} {name}");
                }
                SmallerThanSource::Accept => {
                    let got = r.unwrap().into_inner().volume.unwrap();
                    assert_eq!(got.capacity_bytes, 1 << 20, "{mode:?} {name}");
                }
            }
            // No size asked: the driver's default (1 GiB), never less than the source.
            let sized = new_volume(&mut ctl, create(&format!("{name}-0"), 0, source)).await;
            assert!(sized.capacity_bytes >= 2 << 20, "{mode:?} {name}");
        }
        d.stop().await.unwrap();
    }
}

#[tokio::test]
async fn a_snapshot_is_ready_after_the_configured_calls_and_restores_only_then() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, data) = (dir.path().join("csi.sock"), dir.path().join("data"));
    let d = start(
        DriverConfig {
            snapshot_ready_after: 2,
            ..config(&data)
        },
        &sock,
    )
    .await
    .unwrap();
    let mut ctl = client(&sock).await;
    let v = new_volume(&mut ctl, create("pvc-a", 0, None)).await;
    let mut ready = Vec::new();
    for _ in 0..3 {
        let s = new_snapshot(&mut ctl, snap("snapshot-1", &v.volume_id)).await;
        ready.push(s.ready_to_use);
        if !s.ready_to_use {
            let e = ctl
                .create_volume(create("pvc-early", 0, from_snapshot(&s.snapshot_id)))
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        }
    }
    assert_eq!(ready, [false, false, true]);
    d.stop().await.unwrap();
}

#[tokio::test]
async fn a_persistent_drivers_snapshots_are_seen_by_another_instance() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let persistent = |d: &Path| DriverConfig {
        persistent: true,
        ..config(d)
    };
    let (sock1, sock2) = (dir.path().join("one.sock"), dir.path().join("two.sock"));
    let one = start(persistent(&data), &sock1).await.unwrap();
    let two = start(persistent(&data), &sock2).await.unwrap();
    let (mut c1, mut c2) = (client(&sock1).await, client(&sock2).await);
    let v = new_volume(&mut c1, create("pvc-a", 0, None)).await;
    std::fs::write(file_in(&data, &v.volume_id), "kept").unwrap();
    let s = new_snapshot(&mut c1, snap("snapshot-a", &v.volume_id)).await;
    assert_eq!(s.snapshot_id, "snapshot-a", "the name is the id");
    // The other instance knows it: get, list, a repeat of the create, a restore.
    let got = c2
        .get_snapshot(GetSnapshotRequest {
            snapshot_id: s.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.snapshot, Some(s.clone()));
    let listed = c2
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 1);
    let repeat = new_snapshot(&mut c2, snap("snapshot-a", &v.volume_id)).await;
    assert_eq!(repeat, s);
    let r = new_volume(&mut c2, create("pvc-r", 0, from_snapshot(&s.snapshot_id))).await;
    assert_eq!(
        std::fs::read_to_string(file_in(&data, &r.volume_id)).unwrap(),
        "kept"
    );
    one.stop().await.unwrap();
    two.stop().await.unwrap();
}

#[tokio::test]
async fn without_snapshots_the_calls_are_unimplemented_and_sources_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, data) = (dir.path().join("csi.sock"), dir.path().join("data"));
    let d = start(
        DriverConfig {
            snapshots: false,
            clone_volume: false,
            ..config(&data)
        },
        &sock,
    )
    .await
    .unwrap();
    let mut ctl = client(&sock).await;
    let v = new_volume(&mut ctl, create("pvc-a", 0, None)).await;
    let e = ctl
        .create_snapshot(snap("snapshot-1", &v.volume_id))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    let e = ctl
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    for source in [from_snapshot("snap-1"), from_volume(&v.volume_id)] {
        let e = ctl
            .create_volume(create("pvc-b", 0, source))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
    }
    d.stop().await.unwrap();
}

/// A repeated restore is answered by name, even once its snapshot is gone (the spec matches a
/// repeated CreateVolume by name, capacity, capabilities and parameters); a new one from a
/// missing snapshot is NOT_FOUND.
#[tokio::test]
async fn a_repeated_restore_is_answered_by_name_after_its_snapshot_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, data) = (dir.path().join("csi.sock"), dir.path().join("data"));
    let _d = start(config(&data), &sock).await.unwrap();
    let mut ctl = client(&sock).await;
    let src = new_volume(&mut ctl, create("src", 1024, None)).await;
    let s = new_snapshot(&mut ctl, snap("s", &src.volume_id)).await;
    let restored = new_volume(&mut ctl, create("r", 1024, from_snapshot(&s.snapshot_id))).await;
    ctl.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: s.snapshot_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let again = new_volume(&mut ctl, create("r", 1024, from_snapshot(&s.snapshot_id))).await;
    assert_eq!(again.volume_id, restored.volume_id);
    let e = ctl
        .create_volume(create("other", 1024, from_snapshot(&s.snapshot_id)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}
