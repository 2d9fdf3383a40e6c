//! The driver's storage pools on a real socket (issue 31): GET_CAPACITY only with a pool,
//! GetCapacity per topology segment (no topology: the node's own), a pool that shrinks as
//! CreateVolume takes volumes out of it and grows back on DeleteVolume, RESOURCE_EXHAUSTED when
//! it cannot hold a volume, the volume size limits, and pools changed while the driver runs.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use plugreg_csi_test_driver::{Capacity, Code, DriverConfig, Method, MountMode, start};
use plugreg_proto::csi::v1::controller_client::ControllerClient;
use plugreg_proto::csi::v1::{
    CapacityRange, ControllerGetCapabilitiesRequest, CreateVolumeRequest, DeleteVolumeRequest,
    GetCapacityRequest, GetCapacityResponse, Topology, VolumeCapability,
    controller_service_capability, volume_capability,
};
use tonic::transport::Channel;

const MI: i64 = 1 << 20;

async fn client(path: &Path) -> ControllerClient<Channel> {
    ControllerClient::new(
        plugreg_transport::connect_path(path, Duration::from_secs(5))
            .await
            .unwrap(),
    )
}

fn segment(zone: &str) -> BTreeMap<String, String> {
    BTreeMap::from([("topology.plugreg.test/zone".to_owned(), zone.to_owned())])
}

fn create(name: &str, bytes: i64) -> CreateVolumeRequest {
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
        ..Default::default()
    }
}

async fn capacity_of(
    ctl: &mut ControllerClient<Channel>,
    zone: Option<&str>,
) -> GetCapacityResponse {
    ctl.get_capacity(GetCapacityRequest {
        accessible_topology: zone.map(|z| Topology {
            segments: segment(z).into_iter().collect(),
        }),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
}

async fn offers_get_capacity(ctl: &mut ControllerClient<Channel>) -> bool {
    ctl.controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .iter()
        .any(|c| {
            matches!(&c.r#type, Some(controller_service_capability::Type::Rpc(r))
                if r.r#type == controller_service_capability::rpc::Type::GetCapacity as i32)
        })
}

/// A controller driver in `dir` (socket `csi.sock`, volumes in `data`) with `config` applied.
async fn controller(
    dir: &Path,
    config: impl FnOnce(&mut DriverConfig),
) -> plugreg_csi_test_driver::RunningDriver {
    let mut c = DriverConfig {
        controller: true,
        data_dir: Some(dir.join("data")),
        mount: MountMode::Directory,
        ..DriverConfig::default()
    };
    config(&mut c);
    start(c, &dir.join("csi.sock")).await.unwrap()
}

#[tokio::test]
async fn pools_shrink_with_volumes_and_refuse_what_they_cannot_hold() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let capacity = Capacity::with_pools([(segment("a"), 10 * MI), (segment("b"), 100 * MI)]);
    capacity.set_volume_size_limits(None, Some(8 * MI));
    let d = controller(dir.path(), |c| {
        c.topology = segment("a");
        c.capacity = capacity.clone();
    })
    .await;
    let mut ctl = client(&sock).await;
    assert!(offers_get_capacity(&mut ctl).await);

    // Each segment its own pool; no topology: the node's own; a segment without a pool: 0.
    let a = capacity_of(&mut ctl, Some("a")).await;
    assert_eq!(a.available_capacity, 10 * MI);
    assert_eq!(a.maximum_volume_size, Some(8 * MI));
    assert_eq!(a.minimum_volume_size, None);
    assert_eq!(
        capacity_of(&mut ctl, Some("b")).await.available_capacity,
        100 * MI
    );
    assert_eq!(
        capacity_of(&mut ctl, None).await.available_capacity,
        10 * MI
    );
    assert_eq!(capacity_of(&mut ctl, Some("c")).await.available_capacity, 0);

    // Volumes come out of the node's pool; a repeat of the same request takes nothing more.
    let v1 = ctl.create_volume(create("v1", 6 * MI)).await.unwrap();
    ctl.create_volume(create("v1", 6 * MI)).await.unwrap();
    assert_eq!(
        capacity_of(&mut ctl, Some("a")).await.available_capacity,
        4 * MI
    );
    assert_eq!(
        capacity_of(&mut ctl, Some("b")).await.available_capacity,
        100 * MI
    );
    let e = ctl.create_volume(create("v2", 5 * MI)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert_eq!(
        e.message(),
        "not enough capacity: 5242880 bytes requested, 4194304 bytes left"
    );
    // Larger than maximum_volume_size: OUT_OF_RANGE whatever the pool holds.
    capacity.set(segment("a"), 1000 * MI);
    let e = ctl.create_volume(create("v3", 9 * MI)).await.unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange);
    // The pool changed while the driver runs; a deleted volume gives its bytes back.
    assert_eq!(
        capacity_of(&mut ctl, Some("a")).await.available_capacity,
        994 * MI
    );
    let id = v1.into_inner().volume.unwrap().volume_id;
    ctl.delete_volume(DeleteVolumeRequest {
        volume_id: id,
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(
        capacity_of(&mut ctl, Some("a")).await.available_capacity,
        1000 * MI
    );

    // What was asked is kept for inspection.
    let asked = d.calls().get_capacity_requests();
    assert_eq!(asked.len(), 8);
    assert_eq!(
        asked[1].accessible_topology.as_ref().unwrap().segments,
        segment("b").into_iter().collect()
    );
    assert_eq!(d.calls().count(Method::GetCapacity), 8);
    d.stop().await.unwrap();
}

#[tokio::test]
async fn without_pools_get_capacity_is_unimplemented() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let d = controller(dir.path(), |_| {}).await;
    let mut ctl = client(&sock).await;
    assert!(!offers_get_capacity(&mut ctl).await);
    let e = ctl
        .get_capacity(GetCapacityRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    // Without a pool, CreateVolume is not limited.
    ctl.create_volume(create("big", 1 << 40)).await.unwrap();
    d.stop().await.unwrap();
}

/// A capacity file sizes the node's pool while the driver runs; without it readable, the
/// configured pools answer.
#[tokio::test]
async fn a_capacity_file_sizes_the_nodes_pool() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let file = dir.path().join("capacity");
    let d = controller(dir.path(), |c| {
        c.topology = segment("a");
        c.capacity_file = Some(file.clone());
    })
    .await;
    let mut ctl = client(&sock).await;
    assert!(offers_get_capacity(&mut ctl).await);
    assert_eq!(capacity_of(&mut ctl, None).await.available_capacity, 0);
    std::fs::write(&file, format!("{}\n", 2 * MI)).unwrap();
    assert_eq!(
        capacity_of(&mut ctl, Some("a")).await.available_capacity,
        2 * MI
    );
    let e = ctl.create_volume(create("v1", 3 * MI)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    std::fs::write(&file, (5 * MI).to_string()).unwrap();
    ctl.create_volume(create("v1", 3 * MI)).await.unwrap();
    assert_eq!(
        capacity_of(&mut ctl, Some("a")).await.available_capacity,
        2 * MI
    );
    d.stop().await.unwrap();
}
