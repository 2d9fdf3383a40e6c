//! The driver's Controller service on a real socket: CreateVolume idempotent by name, the
//! spec's codes for incompatible repeats, capacity and topology, DeleteVolume, the RPCs it does
//! not implement, call counters and faults (issue 12's csi-provisioner tests build on these).

mod common;

use common::{cap, channel};

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use plugreg_csi_test_driver::{Code, DriverConfig, Failure, Fault, Method, NodeCapability, start};
use plugreg_proto::csi::v1::controller_client::ControllerClient;
use plugreg_proto::csi::v1::identity_client::IdentityClient;
use plugreg_proto::csi::v1::node_client::NodeClient;
use plugreg_proto::csi::v1::{
    CapacityRange, ControllerGetCapabilitiesRequest, CreateVolumeRequest, DeleteVolumeRequest,
    GetCapacityRequest, GetPluginCapabilitiesRequest, NodeStageVolumeRequest,
    NodeUnstageVolumeRequest, Topology, TopologyRequirement, controller_service_capability,
    plugin_capability,
};

fn create(name: &str, bytes: i64) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap()],
        ..Default::default()
    }
}

fn zone(z: &str) -> Topology {
    Topology {
        segments: HashMap::from([("zone".to_owned(), z.to_owned())]),
    }
}

#[tokio::test]
async fn create_and_delete_follow_the_spec() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let d = start(
        DriverConfig {
            controller: true,
            topology: BTreeMap::from([("zone".to_owned(), "a".to_owned())]),
            max_capacity: 1 << 30,
            node_capabilities: vec![NodeCapability::StageUnstageVolume],
            mount: plugreg_csi_test_driver::MountMode::Directory,
            ..DriverConfig::default()
        },
        &sock,
    )
    .await
    .unwrap();
    let ch = channel(&sock).await;
    let mut ctl = ControllerClient::new(ch.clone());

    let caps = IdentityClient::new(ch.clone())
        .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(caps.capabilities.iter().any(|c| matches!(
        &c.r#type,
        Some(plugin_capability::Type::Service(s))
            if s.r#type == plugin_capability::service::Type::ControllerService as i32
    )));
    let ccaps = ctl
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(matches!(
        &ccaps.capabilities[..],
        [c] if matches!(&c.r#type, Some(controller_service_capability::Type::Rpc(r))
            if r.r#type == controller_service_capability::rpc::Type::CreateDeleteVolume as i32)
    ));

    // Created once; a repeat with the same name returns the same volume.
    let v1 = ctl
        .create_volume(create("pvc-1", 1 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(v1.capacity_bytes, 1 << 20);
    assert_eq!(v1.accessible_topology, vec![zone("a")]);
    assert!(
        dir.path()
            .join("csi.sock.volumes")
            .join(&v1.volume_id)
            .is_dir()
    );
    let again = ctl
        .create_volume(create("pvc-1", 1 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(again.volume_id, v1.volume_id);
    // Same name, a size the volume does not have: ALREADY_EXISTS.
    let e = ctl
        .create_volume(create("pvc-1", 2 << 20))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    // Too big: OUT_OF_RANGE; no name or no capability: INVALID_ARGUMENT.
    let e = ctl.create_volume(create("big", 2 << 30)).await.unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange);
    let e = ctl.create_volume(create("", 1)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let mut no_caps = create("x", 1);
    no_caps.volume_capabilities.clear();
    assert_eq!(
        ctl.create_volume(no_caps).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    // A topology the driver does not serve: RESOURCE_EXHAUSTED; one it serves: fine.
    let mut elsewhere = create("pvc-2", 1);
    elsewhere.accessibility_requirements = Some(TopologyRequirement {
        requisite: vec![zone("b")],
        preferred: vec![],
    });
    assert_eq!(
        ctl.create_volume(elsewhere.clone())
            .await
            .unwrap_err()
            .code(),
        Code::ResourceExhausted
    );
    elsewhere.accessibility_requirements = Some(TopologyRequirement {
        requisite: vec![zone("b"), zone("a")],
        preferred: vec![zone("a")],
    });
    let v2 = ctl
        .create_volume(elsewhere)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_ne!(v2.volume_id, v1.volume_id);

    // A staged volume cannot be deleted; then it can, twice (idempotent), and its data goes.
    let staging = dir.path().join("staging");
    std::fs::create_dir(&staging).unwrap();
    let mut node = NodeClient::new(ch.clone());
    node.node_stage_volume(NodeStageVolumeRequest {
        volume_id: v1.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap()),
        ..Default::default()
    })
    .await
    .unwrap();
    let del = DeleteVolumeRequest {
        volume_id: v1.volume_id.clone(),
        ..Default::default()
    };
    assert_eq!(
        ctl.delete_volume(del.clone()).await.unwrap_err().code(),
        Code::FailedPrecondition
    );
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: v1.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await
    .unwrap();
    ctl.delete_volume(del.clone()).await.unwrap();
    ctl.delete_volume(del).await.unwrap();
    assert!(
        !dir.path()
            .join("csi.sock.volumes")
            .join(&v1.volume_id)
            .exists()
    );

    // Not implemented: UNIMPLEMENTED.
    let e = ctl
        .get_capacity(GetCapacityRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);

    assert_eq!(d.calls().count(Method::CreateVolume), 8);
    assert_eq!(d.calls().count(Method::DeleteVolume), 3);
    assert_eq!(d.calls().count(Method::ControllerGetCapabilities), 1);
    d.stop().await.unwrap();
}

#[tokio::test]
async fn controller_faults() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let d = start(
        DriverConfig {
            controller: true,
            faults: BTreeMap::from([
                (
                    Method::CreateVolume,
                    Fault {
                        error: Some(Failure::new(Code::ResourceExhausted, "full")),
                        fail_first: Some(1),
                        ..Fault::default()
                    },
                ),
                (
                    Method::DeleteVolume,
                    Fault {
                        hang: true,
                        ..Fault::default()
                    },
                ),
            ]),
            ..DriverConfig::default()
        },
        &sock,
    )
    .await
    .unwrap();
    let mut ctl = ControllerClient::new(channel(&sock).await);
    let e = ctl.create_volume(create("v", 1)).await.unwrap_err();
    assert_eq!((e.code(), e.message()), (Code::ResourceExhausted, "full"));
    let v = ctl
        .create_volume(create("v", 1))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let mut req = tonic::Request::new(DeleteVolumeRequest {
        volume_id: v.volume_id,
        ..Default::default()
    });
    req.set_timeout(Duration::from_millis(200));
    let hung = tokio::time::timeout(Duration::from_millis(500), ctl.delete_volume(req)).await;
    assert!(
        matches!(&hung, Ok(Err(_))),
        "a hanging DeleteVolume never answers; the caller's deadline ends it: {hung:?}"
    );
    d.calls().wait_for(Method::DeleteVolume, 1).await;
    d.stop().await.unwrap();
}

/// `controller_publish`: ControllerPublishVolume returns the device (idempotent, NOT_FOUND for
/// an unknown volume or node), the node refuses to stage without it, DeleteVolume refuses a
/// volume still published, ControllerUnpublishVolume is idempotent.
#[tokio::test]
async fn controller_publish_hands_the_node_its_device() {
    use plugreg_proto::csi::v1::{
        ControllerPublishVolumeRequest, ControllerUnpublishVolumeRequest,
    };
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let d = start(
        DriverConfig {
            controller: true,
            controller_publish: true,
            node_capabilities: vec![NodeCapability::StageUnstageVolume],
            mount: plugreg_csi_test_driver::MountMode::Directory,
            ..DriverConfig::default()
        },
        &sock,
    )
    .await
    .unwrap();
    let ch = channel(&sock).await;
    let mut ctl = ControllerClient::new(ch.clone());
    let mut node = NodeClient::new(ch);

    let caps = ctl
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(caps.capabilities.iter().any(|c| matches!(
        &c.r#type,
        Some(controller_service_capability::Type::Rpc(r))
            if r.r#type == controller_service_capability::rpc::Type::PublishUnpublishVolume as i32
    )));

    let id = ctl
        .create_volume(create("v", 1 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let publish = |volume_id: &str, node_id: &str| ControllerPublishVolumeRequest {
        volume_id: volume_id.into(),
        node_id: node_id.into(),
        volume_capability: Some(cap()),
        ..Default::default()
    };
    let e = ctl
        .controller_publish_volume(publish("nope", "node-1"))
        .await;
    assert_eq!(e.unwrap_err().code(), Code::NotFound);
    let e = ctl.controller_publish_volume(publish(&id, "node-2")).await;
    assert_eq!(e.unwrap_err().code(), Code::NotFound);
    for _ in 0..2 {
        let r = ctl
            .controller_publish_volume(publish(&id, "node-1"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.publish_context,
            HashMap::from([(
                "device".to_owned(),
                plugreg_csi_test_driver::PUBLISHED_DEVICE.to_owned()
            )])
        );
    }

    let staging = dir.path().join("staging");
    std::fs::create_dir(&staging).unwrap();
    let mut stage = NodeStageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap()),
        ..Default::default()
    };
    let e = node.node_stage_volume(stage.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(e.message(), "stage volume info 'device' key required");
    stage.publish_context = HashMap::from([("device".to_owned(), "/dev/x".to_owned())]);
    node.node_stage_volume(stage).await.unwrap();
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await
    .unwrap();

    let delete = DeleteVolumeRequest {
        volume_id: id.clone(),
        ..Default::default()
    };
    let e = ctl.delete_volume(delete.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    let unpublish = ControllerUnpublishVolumeRequest {
        volume_id: id.clone(),
        node_id: "node-1".into(),
        ..Default::default()
    };
    for _ in 0..2 {
        ctl.controller_unpublish_volume(unpublish.clone())
            .await
            .unwrap();
    }
    ctl.delete_volume(delete).await.unwrap();
    assert_eq!(d.calls().count(Method::ControllerPublishVolume), 4);
    assert_eq!(d.calls().count(Method::ControllerUnpublishVolume), 2);
    d.stop().await.unwrap();
}

/// Whether `path` is a mount point in this process's mount namespace.
fn is_mount_point(path: &Path) -> bool {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let want = path.to_str().unwrap();
    text.lines()
        .any(|l| l.split(' ').nth(4).is_some_and(|m| m == want))
}

/// A persistent driver keeps its volumes in the data directory: a volume created by one
/// instance (the controller plugin) is staged and published by another (a node plugin), whose
/// mounts outlive it; a third instance (the node plugin restarted) unpublishes and unstages
/// them, and the first deletes the volume, leaving the backing store empty. As a controller
/// plugin and node plugins of a real driver, sharing one store, do in a cluster.
#[tokio::test]
async fn persistent_instances_share_volumes_and_leave_mounts_to_the_orchestrator() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test makes real bind mounts: run it as root"
    );
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("store");
    let config = |controller| DriverConfig {
        controller,
        persistent: true,
        data_dir: Some(data.clone()),
        node_capabilities: vec![NodeCapability::StageUnstageVolume],
        mount: plugreg_csi_test_driver::MountMode::Bind,
        ..DriverConfig::default()
    };
    let controller = start(config(true), &dir.path().join("ctl.sock"))
        .await
        .unwrap();
    let mut ctl = ControllerClient::new(channel(controller.path()).await);

    // The name is the id, so a repeat (here or from another instance) finds the same volume.
    let v = ctl
        .create_volume(create("pvc-0123", 4096))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(v.volume_id, "pvc-0123");
    assert!(data.join("pvc-0123").is_dir());
    let err = ctl.create_volume(create("a/b", 1)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    let staging = dir.path().join("staging");
    let target = dir.path().join("target");
    std::fs::create_dir(&staging).unwrap();
    let node_a = start(config(false), &dir.path().join("node-a.sock"))
        .await
        .unwrap();
    let mut node = NodeClient::new(channel(node_a.path()).await);
    node.node_stage_volume(NodeStageVolumeRequest {
        volume_id: "pvc-0123".into(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap()),
        ..Default::default()
    })
    .await
    .unwrap();
    node.node_publish_volume(plugreg_proto::csi::v1::NodePublishVolumeRequest {
        volume_id: "pvc-0123".into(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap()),
        ..Default::default()
    })
    .await
    .unwrap();
    std::fs::write(target.join("hello"), "from the pod").unwrap();
    assert_eq!(
        std::fs::read_to_string(data.join("pvc-0123/hello")).unwrap(),
        "from the pod"
    );
    node_a.stop().await.unwrap();
    assert!(is_mount_point(&staging) && is_mount_point(&target));

    // The restarted node plugin did not mount them, and still takes them down.
    let node_b = start(config(false), &dir.path().join("node-b.sock"))
        .await
        .unwrap();
    let mut node = NodeClient::new(channel(node_b.path()).await);
    node.node_unpublish_volume(plugreg_proto::csi::v1::NodeUnpublishVolumeRequest {
        volume_id: "pvc-0123".into(),
        target_path: target.display().to_string(),
    })
    .await
    .unwrap();
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: "pvc-0123".into(),
        staging_target_path: staging.display().to_string(),
    })
    .await
    .unwrap();
    assert!(!target.exists() && !is_mount_point(&staging));
    node_b.stop().await.unwrap();

    ctl.delete_volume(DeleteVolumeRequest {
        volume_id: "pvc-0123".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let left: Vec<_> = std::fs::read_dir(&data).unwrap().collect();
    assert!(left.is_empty(), "the backing store is not empty: {left:?}");
    controller.stop().await.unwrap();
}

/// Messages many times the codec's starting buffer (plugreg-proto's `codec::BUFFER_BYTES`) go
/// through whole in both directions (a cut or garbled message fails to decode): a CreateVolume
/// with 64 long parameters, twice, and a ListVolumes answer of every volume in one message.
#[tokio::test]
async fn messages_larger_than_the_codec_buffer_go_through_whole() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let _d = start(
        DriverConfig {
            controller: true,
            list_volumes: true,
            max_capacity: 1 << 30,
            ..DriverConfig::default()
        },
        &sock,
    )
    .await
    .unwrap();
    let mut ctl = ControllerClient::new(channel(&sock).await);
    let big = CreateVolumeRequest {
        parameters: (0..64)
            .map(|i| (format!("key-{i:02}"), format!("{i:02}-{}", "v".repeat(100))))
            .collect(),
        ..create("big", 1 << 20)
    };
    assert!(prost::Message::encoded_len(&big) > 8 * plugreg_proto::codec::BUFFER_BYTES);
    let first = ctl.create_volume(big.clone()).await.unwrap().into_inner();
    let again = ctl.create_volume(big).await.unwrap().into_inner();
    assert_eq!(
        first.volume, again.volume,
        "the repeat matches every parameter"
    );
    for i in 0..100 {
        ctl.create_volume(create(&format!("volume-{i:03}"), 1 << 20))
            .await
            .unwrap();
    }
    let listed = ctl
        .list_volumes(plugreg_proto::csi::v1::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 101);
    let ids: std::collections::HashSet<_> = listed
        .entries
        .iter()
        .filter_map(|e| e.volume.as_ref())
        .filter(|v| v.capacity_bytes == 1 << 20)
        .map(|v| v.volume_id.clone())
        .collect();
    assert_eq!(ids.len(), 101, "every volume listed once, whole");
    assert!(prost::Message::encoded_len(&listed) > 2 * plugreg_proto::codec::BUFFER_BYTES);
}
