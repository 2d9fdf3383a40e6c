//! The example DRA driver (a real process) against the real kubelet v1.36.2 DRA handler
//! (`kubelet-plugins-v1.36.2`, see `shared/peers`): the kubelet's plugin manager registers it
//! with the kubelet's own `DRAPlugin` handler, picks `v1.DRAPlugin`, follows its health stream,
//! and its DRA client's NodePrepareResources / NodeUnprepareResources reach our driver.

use std::process::Command;
use std::time::Duration;

use plugreg_testpeers::KUBELET_PLUGINS_V1_36;
use plugreg_testpeers::{LinesFrom, PeerProcess};

const SOON: Duration = Duration::from_secs(20);

#[tokio::test]
async fn the_real_kubelet_registers_the_driver_and_its_dra_client_prepares_through_it() {
    let dir = tempfile::tempdir().unwrap();
    let registry = dir.path().join("registry");
    std::fs::create_dir_all(&registry).unwrap();
    let mut kubelet = PeerProcess::spawn(
        KUBELET_PLUGINS_V1_36,
        [
            "-sockets-dir".as_ref(),
            registry.as_os_str(),
            "-types".as_ref(),
            "DRAPlugin".as_ref(),
            "-node-name".as_ref(),
            "node-1".as_ref(),
            "-dra-prepare".as_ref(),
            "uid-1:ns:claim-1".as_ref(),
        ],
    )
    .unwrap();
    kubelet.next_event("Started", SOON).await.unwrap();

    let mut cmd = Command::new(env!("CARGO_BIN_EXE_plugreg-example-dra-driver"));
    cmd.args(["--driver-name", "gpu.example.com", "--node-name", "node-1"])
        .arg("--registry-dir")
        .arg(&registry)
        .arg("--plugin-dir")
        .arg(dir.path().join("plugin"));
    let mut driver =
        PeerProcess::spawn_command("example DRA driver", cmd, LinesFrom::Stdout).unwrap();
    let endpoint = dir.path().join("plugin/dra.sock").display().to_string();

    let v = kubelet.next_event("ValidatePlugin", SOON).await.unwrap();
    assert_eq!(v["result"], "ok", "{v}");
    assert_eq!(v["endpoint"], endpoint.as_str());
    let v = kubelet.next_event("RegisterPlugin", SOON).await.unwrap();
    assert_eq!(v["result"], "ok", "{v}");
    assert_eq!(
        v["versions"],
        serde_json::json!([
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth"
        ])
    );
    // The kubelet answers NotifyRegistrationStatus after its handler's Register, and its DRA
    // client may already call the driver by then: the driver sees the three in any order.
    let seen = driver
        .next_each(
            &["notify", "NodePrepareResources", "NodeUnprepareResources"],
            |_| true,
            SOON,
        )
        .await
        .unwrap();
    let n = &seen["notify"];
    assert_eq!(n["registered"], true, "{n}");

    // The health stream and the calls run concurrently in the kubelet: take them in any order.
    let events = kubelet
        .next_each(
            &[
                "DRAHealth",
                "NodePrepareResources",
                "NodeUnprepareResources",
            ],
            |_| true,
            SOON,
        )
        .await
        .unwrap();
    // The kubelet's health stream gets our devices.
    let h = &events["DRAHealth"];
    assert_eq!(h["devices"].as_array().unwrap().len(), 4, "{h}");
    assert_eq!(h["devices"][0]["health"], "HEALTHY");
    // The kubelet's DRA client called our NodePrepareResources, then NodeUnprepareResources.
    let p = &events["NodePrepareResources"];
    assert_eq!(p["result"], "ok", "{p}");
    assert_eq!(
        p["claims"][0]["devices"][0],
        serde_json::json!({"pool": "node-1", "device": "dev-0", "cdi_device_ids": ["gpu.example.com/dev=uid-1"]})
    );
    assert_eq!(events["NodeUnprepareResources"]["result"], "ok");
    // The driver saw the same calls, for the claim the kubelet was given.
    for call in ["NodePrepareResources", "NodeUnprepareResources"] {
        assert_eq!(
            seen[call]["claims"],
            serde_json::json!([{"namespace": "ns", "name": "claim-1", "uid": "uid-1"}]),
            "{call}"
        );
    }

    // The driver stops: the kubelet deregisters it.
    driver.terminate().unwrap();
    assert!(driver.wait_exit(SOON).await.unwrap().success());
    let d = kubelet.next_event("DeRegisterPlugin", SOON).await.unwrap();
    assert_eq!(d["name"], "gpu.example.com");
    kubelet.terminate().unwrap();
}

/// The driver's ResourceSlice on the real v1.36.2 API server: published by the driver, wiped by
/// the real kubelet's DRA plugin manager once the driver is gone.
#[tokio::test]
async fn the_published_resource_slice_is_accepted_and_the_real_kubelet_wipes_it_when_the_driver_goes()
 {
    use kube::api::{Api, ListParams, PostParams};
    use kube::core::{ApiResource, DynamicObject, GroupVersionKind};

    let server =
        plugreg_testpeers::ApiServer::start_version(plugreg_testpeers::KubeVersion::V1_36_2)
            .await
            .unwrap();
    let client = server.client().await.unwrap();
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata": {"name": "node-1"}})).unwrap(),
        )
        .await
        .unwrap();
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceSlice"),
        "resourceslices",
    );
    let slices: Api<DynamicObject> = Api::all_with(client.clone(), &ar);

    let dir = tempfile::tempdir().unwrap();
    let registry = dir.path().join("registry");
    std::fs::create_dir_all(&registry).unwrap();
    let kubeconfig = server.kubeconfig_path().as_os_str().to_owned();
    let mut kubelet = PeerProcess::spawn(
        KUBELET_PLUGINS_V1_36,
        [
            "-sockets-dir".as_ref(),
            registry.as_os_str(),
            "-types".as_ref(),
            "DRAPlugin".as_ref(),
            "-node-name".as_ref(),
            "node-1".as_ref(),
            "-kubeconfig".as_ref(),
            kubeconfig.as_os_str(),
            "-dra-wiping-delay".as_ref(),
            "1s".as_ref(),
        ],
    )
    .unwrap();
    kubelet.next_event("Started", SOON).await.unwrap();

    let mut cmd = Command::new(env!("CARGO_BIN_EXE_plugreg-example-dra-driver"));
    cmd.args([
        "--driver-name",
        "gpu.example.com",
        "--node-name",
        "node-1",
        "--devices",
        "2",
    ])
    .arg("--registry-dir")
    .arg(&registry)
    .arg("--plugin-dir")
    .arg(dir.path().join("plugin"))
    .arg("--kubeconfig")
    .arg(&kubeconfig);
    let mut driver =
        PeerProcess::spawn_command("example DRA driver", cmd, LinesFrom::Stdout).unwrap();
    let p = driver
        .next_matching(
            |v| {
                v["event"]
                    .as_str()
                    .is_some_and(|e| e.starts_with("ResourceSlices"))
            },
            SOON,
        )
        .await
        .unwrap();
    assert_eq!(p["event"], "ResourceSlicesPublished", "{p}");
    assert_eq!(p["created"], 1);
    let reg = kubelet.next_event("RegisterPlugin", SOON).await.unwrap();
    assert_eq!(reg["result"], "ok", "{reg}");
    let list = slices.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].data["spec"]["driver"], "gpu.example.com");
    assert_eq!(list[0].data["spec"]["devices"][1]["name"], "dev-1");

    driver.terminate().unwrap();
    assert!(driver.wait_exit(SOON).await.unwrap().success());
    let w = kubelet
        .next_matching(
            |v| {
                v["event"] == "WipeResourceSlices"
                    && v["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("spec.driver=gpu.example.com"))
            },
            SOON,
        )
        .await
        .unwrap();
    assert_eq!(w["result"], "200 OK", "{w}");
    let deadline = std::time::Instant::now() + SOON;
    while !slices
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .is_empty()
    {
        assert!(std::time::Instant::now() < deadline, "slice not wiped");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    kubelet.terminate().unwrap();
}
