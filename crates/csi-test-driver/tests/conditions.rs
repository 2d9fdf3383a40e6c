//! Volume conditions on a real socket (what csi-external-health-monitor-controller and the
//! kubelet's volume health read): the capabilities, ControllerGetVolume, ListVolumes pages and
//! NodeGetVolumeStats carry each volume's condition, a volume turned abnormal and back while the
//! driver runs is reported so by all three, and the codes a strict driver answers.

mod common;

use common::{cap, channel};

use std::path::PathBuf;

use plugreg_csi_test_driver::{
    Code, Conditions, DriverConfig, Failure, Fault, Method, MountMode, NodeCapability,
    RunningDriver, start,
};
use plugreg_proto::csi::v1::controller_client::ControllerClient;
use plugreg_proto::csi::v1::node_client::NodeClient;
use plugreg_proto::csi::v1::{
    ControllerGetCapabilitiesRequest, ControllerGetVolumeRequest, ControllerPublishVolumeRequest,
    ListVolumesRequest, NodeGetCapabilitiesRequest, NodeGetVolumeStatsRequest,
    NodePublishVolumeRequest, VolumeCondition, controller_service_capability,
    node_service_capability,
};
use tonic::transport::Channel;

type ControllerCap = controller_service_capability::rpc::Type;

/// A driver with every volume-condition RPC: the Controller (with ListVolumes) and a Node
/// with GET_VOLUME_STATS, volumes `vol-a`, `vol-b`, `vol-c`, directories instead of mounts.
fn config() -> DriverConfig {
    DriverConfig {
        controller: true,
        list_volumes: true,
        volume_condition: true,
        node_capabilities: vec![NodeCapability::GetVolumeStats],
        volumes: vec!["vol-a".into(), "vol-b".into(), "vol-c".into()],
        mount: MountMode::Directory,
        ..DriverConfig::default()
    }
}

struct Peer {
    // Dropped last: the driver's socket and volumes live in it.
    _dir: tempfile::TempDir,
    driver: RunningDriver,
    ctl: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    /// A publish target of `vol-a` (after [`Peer::publish`]).
    target: PathBuf,
}

impl Peer {
    async fn start(config: DriverConfig) -> Peer {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let target = dir.path().join("pod").join("mount");
        std::fs::create_dir(target.parent().unwrap()).unwrap();
        let driver = start(config, &sock).await.unwrap();
        let ch = channel(&sock).await;
        Peer {
            _dir: dir,
            driver,
            ctl: ControllerClient::new(ch.clone()),
            node: NodeClient::new(ch),
            target,
        }
    }

    /// NodePublishVolume of `vol-a` at [`target`](Self::target) (no staging).
    async fn publish(&mut self) {
        self.node
            .node_publish_volume(NodePublishVolumeRequest {
                volume_id: "vol-a".into(),
                target_path: self.target.display().to_string(),
                volume_capability: Some(cap()),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    async fn controller_caps(&mut self) -> Vec<i32> {
        self.ctl
            .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner()
            .capabilities
            .into_iter()
            .filter_map(|c| {
                c.r#type
                    .map(|controller_service_capability::Type::Rpc(r)| r.r#type)
            })
            .collect()
    }

    async fn node_caps(&mut self) -> Vec<i32> {
        self.node
            .node_get_capabilities(NodeGetCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner()
            .capabilities
            .into_iter()
            .filter_map(|c| {
                c.r#type
                    .map(|node_service_capability::Type::Rpc(r)| r.r#type)
            })
            .collect()
    }

    async fn get_volume(&mut self, id: &str) -> Result<Option<VolumeCondition>, tonic::Status> {
        let r = self
            .ctl
            .controller_get_volume(ControllerGetVolumeRequest {
                volume_id: id.into(),
            })
            .await?
            .into_inner();
        assert_eq!(r.volume.unwrap().volume_id, id);
        Ok(r.status.expect("status is required").volume_condition)
    }

    /// Every ListVolumes page of `page` entries: (volume id, condition) in order.
    async fn list(&mut self, page: i32) -> Vec<(String, Option<VolumeCondition>)> {
        let mut all = Vec::new();
        let mut token = String::new();
        loop {
            let r = self
                .ctl
                .list_volumes(ListVolumesRequest {
                    max_entries: page,
                    starting_token: token,
                })
                .await
                .unwrap()
                .into_inner();
            assert!(page == 0 || r.entries.len() <= page as usize);
            for e in r.entries {
                let status = e.status.expect("every entry has a status");
                all.push((e.volume.unwrap().volume_id, status.volume_condition));
            }
            if r.next_token.is_empty() {
                return all;
            }
            token = r.next_token;
        }
    }

    async fn stats(&mut self) -> Result<Option<VolumeCondition>, tonic::Status> {
        let r = self
            .node
            .node_get_volume_stats(NodeGetVolumeStatsRequest {
                volume_id: "vol-a".into(),
                volume_path: self.target.display().to_string(),
                staging_target_path: String::new(),
            })
            .await?
            .into_inner();
        assert!(!r.usage.is_empty());
        Ok(r.volume_condition)
    }
}

fn healthy() -> Option<VolumeCondition> {
    Some(VolumeCondition {
        abnormal: false,
        message: String::new(),
    })
}

fn abnormal(message: &str) -> Option<VolumeCondition> {
    Some(VolumeCondition {
        abnormal: true,
        message: message.into(),
    })
}

#[tokio::test]
async fn capabilities_advertise_volume_condition_and_get_volume() {
    let mut p = Peer::start(config()).await;
    let caps = p.controller_caps().await;
    for want in [
        ControllerCap::VolumeCondition,
        ControllerCap::GetVolume,
        ControllerCap::ListVolumes,
    ] {
        assert!(caps.contains(&(want as i32)), "{want:?} in {caps:?}");
    }
    assert_eq!(
        p.node_caps().await,
        vec![
            NodeCapability::GetVolumeStats as i32,
            NodeCapability::VolumeCondition as i32
        ]
    );

    // Off (the default): neither side advertises it.
    let mut p = Peer::start(DriverConfig {
        volume_condition: false,
        ..config()
    })
    .await;
    let caps = p.controller_caps().await;
    assert!(!caps.contains(&(ControllerCap::VolumeCondition as i32)));
    assert!(!caps.contains(&(ControllerCap::GetVolume as i32)));
    assert_eq!(
        p.node_caps().await,
        vec![NodeCapability::GetVolumeStats as i32]
    );

    // The node reports conditions only through NodeGetVolumeStats: no GET_VOLUME_STATS, no
    // VOLUME_CONDITION.
    let mut p = Peer::start(DriverConfig {
        node_capabilities: vec![NodeCapability::StageUnstageVolume],
        ..config()
    })
    .await;
    assert_eq!(
        p.node_caps().await,
        vec![NodeCapability::StageUnstageVolume as i32]
    );
}

/// `no_get_volume`: VOLUME_CONDITION without GET_VOLUME, ControllerGetVolume UNIMPLEMENTED;
/// ListVolumes still carries the conditions.
#[tokio::test]
async fn no_get_volume_leaves_get_volume_out() {
    let mut p = Peer::start(DriverConfig {
        no_get_volume: true,
        ..config()
    })
    .await;
    p.driver.set_condition("vol-a", Some("gone"));
    let caps = p.controller_caps().await;
    assert!(caps.contains(&(ControllerCap::VolumeCondition as i32)));
    assert!(caps.contains(&(ControllerCap::ListVolumes as i32)));
    assert!(!caps.contains(&(ControllerCap::GetVolume as i32)));
    assert_eq!(
        p.get_volume("vol-a").await.unwrap_err().code(),
        Code::Unimplemented
    );
    assert_eq!(p.list(0).await[0], ("vol-a".into(), abnormal("gone")));
}

#[tokio::test]
async fn controller_get_volume_answers_the_volume_and_its_status() {
    let mut p = Peer::start(DriverConfig {
        controller_publish: true,
        default_capacity: 5 << 20,
        ..config()
    })
    .await;
    let r = p
        .ctl
        .controller_get_volume(ControllerGetVolumeRequest {
            volume_id: "vol-b".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let v = r.volume.unwrap();
    assert_eq!((v.volume_id.as_str(), v.capacity_bytes), ("vol-b", 5 << 20));
    assert!(v.volume_context.is_empty());
    let status = r.status.unwrap();
    assert!(status.published_node_ids.is_empty());
    assert_eq!(status.volume_condition, healthy());

    // ControllerPublished: the node shows in the status.
    p.ctl
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: "vol-b".into(),
            node_id: "node-1".into(),
            volume_capability: Some(cap()),
            ..Default::default()
        })
        .await
        .unwrap();
    let status = p
        .ctl
        .controller_get_volume(ControllerGetVolumeRequest {
            volume_id: "vol-b".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap();
    assert_eq!(status.published_node_ids, vec!["node-1".to_owned()]);
    assert_eq!(p.driver.calls().count(Method::ControllerGetVolume), 2);
}

#[tokio::test]
async fn list_volumes_pages_carry_the_conditions() {
    let conditions = Conditions::default();
    conditions.set("vol-b", Some("disk gone"));
    let mut p = Peer::start(DriverConfig {
        conditions: conditions.clone(),
        ..config()
    })
    .await;
    for page in [0, 1, 2] {
        assert_eq!(
            p.list(page).await,
            vec![
                ("vol-a".to_owned(), healthy()),
                ("vol-b".to_owned(), abnormal("disk gone")),
                ("vol-c".to_owned(), healthy()),
            ],
            "pages of {page}"
        );
    }
    // The config's handle and the running driver's are the same.
    p.driver.set_condition("vol-b", None);
    assert_eq!(conditions.abnormal("vol-b"), None);
    assert!(p.list(2).await.iter().all(|(_, c)| *c == healthy()));

    // Without volume_condition the status has no condition.
    let mut p = Peer::start(DriverConfig {
        volume_condition: false,
        conditions,
        ..config()
    })
    .await;
    assert!(p.list(0).await.iter().all(|(_, c)| c.is_none()));
}

#[tokio::test]
async fn a_volume_turned_abnormal_and_back_is_reported_by_all_three_rpcs() {
    let mut p = Peer::start(config()).await;
    p.publish().await;
    assert_eq!(p.get_volume("vol-a").await.unwrap(), healthy());
    assert_eq!(p.stats().await.unwrap(), healthy());

    p.driver
        .set_condition("vol-a", Some("I/O errors on /dev/sdx"));
    let bad = abnormal("I/O errors on /dev/sdx");
    assert_eq!(p.get_volume("vol-a").await.unwrap(), bad);
    assert_eq!(p.stats().await.unwrap(), bad);
    let listed = p.list(0).await;
    assert_eq!(listed[0], ("vol-a".to_owned(), bad.clone()));
    // Only that volume.
    assert_eq!(p.get_volume("vol-b").await.unwrap(), healthy());
    assert_eq!(listed[1].1, healthy());

    p.driver.set_condition("vol-a", None);
    assert_eq!(p.get_volume("vol-a").await.unwrap(), healthy());
    assert_eq!(p.stats().await.unwrap(), healthy());
    assert_eq!(p.list(0).await[0], ("vol-a".to_owned(), healthy()));
}

#[tokio::test]
async fn omit_healthy_condition_leaves_healthy_volumes_without_one() {
    let mut p = Peer::start(DriverConfig {
        omit_healthy_condition: true,
        ..config()
    })
    .await;
    p.publish().await;
    assert_eq!(p.get_volume("vol-a").await.unwrap(), None);
    assert_eq!(p.stats().await.unwrap(), None);
    assert!(p.list(0).await.iter().all(|(_, c)| c.is_none()));

    // An abnormal volume still says so, with an empty message when given one.
    p.driver.set_condition("vol-a", Some(""));
    assert_eq!(p.get_volume("vol-a").await.unwrap(), abnormal(""));
    assert_eq!(p.stats().await.unwrap(), abnormal(""));
    assert_eq!(p.list(0).await[0].1, abnormal(""));
    p.driver.set_condition("vol-a", None);
    assert_eq!(p.get_volume("vol-a").await.unwrap(), None);
}

#[tokio::test]
async fn controller_get_volume_codes_of_a_strict_driver() {
    let mut p = Peer::start(config()).await;
    let code = |r: Result<Option<VolumeCondition>, tonic::Status>| r.unwrap_err().code();
    assert_eq!(code(p.get_volume("").await), Code::InvalidArgument);
    assert_eq!(code(p.get_volume("no-such-volume").await), Code::NotFound);
    // A condition set for a volume that does not exist makes no volume.
    p.driver.set_condition("no-such-volume", Some("x"));
    assert_eq!(code(p.get_volume("no-such-volume").await), Code::NotFound);

    // Without volume_condition: UNIMPLEMENTED, and not counted as a call.
    let mut p = Peer::start(DriverConfig {
        volume_condition: false,
        ..config()
    })
    .await;
    assert_eq!(code(p.get_volume("vol-a").await), Code::Unimplemented);
    assert_eq!(p.driver.calls().count(Method::ControllerGetVolume), 0);

    // ListVolumes still needs list_volumes.
    let mut p = Peer::start(DriverConfig {
        list_volumes: false,
        ..config()
    })
    .await;
    let e = p
        .ctl
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    assert_eq!(p.get_volume("vol-a").await.unwrap(), healthy());
}

#[tokio::test]
async fn controller_get_volume_takes_faults() {
    let mut p = Peer::start(DriverConfig {
        faults: [(
            Method::ControllerGetVolume,
            Fault {
                error: Some(Failure::new(Code::Unavailable, "backend down")),
                fail_first: Some(1),
                ..Fault::default()
            },
        )]
        .into(),
        ..config()
    })
    .await;
    let e = p.get_volume("vol-a").await.unwrap_err();
    assert_eq!((e.code(), e.message()), (Code::Unavailable, "backend down"));
    assert_eq!(p.get_volume("vol-a").await.unwrap(), healthy());
    assert_eq!(
        Method::from_name("ControllerGetVolume"),
        Some(Method::ControllerGetVolume)
    );
}
