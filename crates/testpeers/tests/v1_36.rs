//! The v1.36.2 peers work: the API server starts and stores objects, the controller manager
//! is healthy and binds-in-waiting a PVC, and the real example plugins of both releases
//! register with the real plugin managers of both releases (through the version-neutral API).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Node, PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ObjectMeta, PostParams};
use plugreg_testpeers::{
    ApiServer, ControllerManager, HandlerCall, KubeVersion, PluginManagerOptions,
    RealExamplePlugin, RealPluginManager, VOLUME_CONTROLLERS,
};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apiserver_v1_36_starts_and_stores_a_node() {
    let server = ApiServer::start_version(KubeVersion::V1_36_2)
        .await
        .expect("start kube-apiserver v1.36.2");
    assert_eq!(server.version(), KubeVersion::V1_36_2);
    let client = server.client().await.expect("client");
    let info = client.apiserver_version().await.expect("/version");
    assert_eq!(info.git_version, "v1.36.2");
    assert_eq!((info.major.as_str(), info.minor.as_str()), ("1", "36"));

    let nodes: Api<Node> = Api::all(client);
    let node = Node {
        metadata: ObjectMeta {
            name: Some("plugreg-node-136".to_owned()),
            labels: Some(BTreeMap::from([("k".to_owned(), "v".to_owned())])),
            ..Default::default()
        },
        ..Default::default()
    };
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create node");
    let got = nodes.get("plugreg-node-136").await.expect("get node");
    assert_eq!(got.metadata.labels, node.metadata.labels);
    assert!(got.metadata.uid.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_manager_v1_36_is_healthy_and_marks_a_pvc_for_its_provisioner() {
    let server = ApiServer::start_version(KubeVersion::V1_36_2)
        .await
        .expect("start kube-apiserver v1.36.2");
    let kcm = ControllerManager::start(&server, VOLUME_CONTROLLERS)
        .await
        .expect("start kube-controller-manager v1.36.2");
    assert_eq!(kcm.healthz().await.expect("/healthz").trim(), "ok");

    let client = server.client().await.expect("client");
    let provisioner = "hostpath.csi.k8s.io";
    let sc = StorageClass {
        metadata: ObjectMeta {
            name: Some("plugreg-immediate".to_owned()),
            ..Default::default()
        },
        provisioner: provisioner.to_owned(),
        volume_binding_mode: Some("Immediate".to_owned()),
        ..Default::default()
    };
    Api::<StorageClass>::all(client.clone())
        .create(&PostParams::default(), &sc)
        .await
        .expect("create storage class");
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client, "default");
    let pvc = PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some("plugreg-claim".to_owned()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".to_owned()]),
            storage_class_name: Some("plugreg-immediate".to_owned()),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_owned(),
                    Quantity("1Mi".to_owned()),
                )])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    pvcs.create(&PostParams::default(), &pvc)
        .await
        .expect("create pvc");

    // The PV binder finds no PV and hands the claim to the class's provisioner.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let got = pvcs.get("plugreg-claim").await.expect("get pvc");
        let ann = got.metadata.annotations.unwrap_or_default();
        if ann
            .get("volume.kubernetes.io/storage-provisioner")
            .map(String::as_str)
            == Some(provisioner)
        {
            assert_eq!(
                ann.get("volume.beta.kubernetes.io/storage-provisioner")
                    .map(String::as_str),
                Some(provisioner)
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the PVC never got its provisioner annotation: {ann:?}\n--- KCM log ---\n{}",
            kcm.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The real example plugin of `plugin` registers with the real plugin manager of `kubelet`
/// and is deregistered when it stops.
async fn example_plugin_registers_with_plugin_manager(plugin: KubeVersion, kubelet: KubeVersion) {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("plugins_registry");
    let name = "example.com/plugreg-device";
    let mut pm = RealPluginManager::start(kubelet, &dir, &PluginManagerOptions::default(), WAIT)
        .await
        .expect("plugin manager");
    assert_eq!(pm.version(), kubelet);
    let socket = dir.join("plugreg-device.sock");
    let mut ep = RealExamplePlugin::start(
        plugin,
        &socket,
        name,
        "DevicePlugin",
        &["v1beta1", "v1beta2"],
        WAIT,
    )
    .await
    .expect("example plugin");

    let v = pm.next(HandlerCall::Validate, name, WAIT).await.unwrap();
    assert_eq!(v.plugin_type, "DevicePlugin");
    assert_eq!(v.endpoint.as_deref(), socket.to_str());
    assert_eq!(v.versions, ["v1beta1", "v1beta2"]);
    let r = pm.next(HandlerCall::Register, name, WAIT).await.unwrap();
    assert_eq!(r.error, None);
    assert!(r.ts_ns >= v.ts_ns);
    let n = ep.next_notification(WAIT).await.unwrap();
    assert!(n.registered, "{}", n.raw);
    assert_eq!(n.error, "");

    ep.terminate().unwrap();
    ep.process().wait_exit(WAIT).await.unwrap();
    let d = pm.next(HandlerCall::Deregister, name, WAIT).await.unwrap();
    assert_eq!(d.plugin_type, "DevicePlugin");
    pm.terminate().unwrap();
    pm.process().wait_exit(WAIT).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_plugins_register_with_plugin_managers_of_every_release() {
    for plugin in KubeVersion::ALL {
        for kubelet in KubeVersion::ALL {
            example_plugin_registers_with_plugin_manager(plugin, kubelet).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_manager_v1_36_rejects_listed_names() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("reg");
    let name = "csi.example.com";
    let options = PluginManagerOptions {
        fail_validate: vec![name.to_owned()],
        ..Default::default()
    };
    let mut pm = RealPluginManager::start(KubeVersion::V1_36_2, &dir, &options, WAIT)
        .await
        .expect("plugin manager");
    let mut ep = RealExamplePlugin::start(
        KubeVersion::V1_36_2,
        &dir.join("csi.sock"),
        name,
        "CSIPlugin",
        &["v1beta1"],
        WAIT,
    )
    .await
    .expect("example plugin");
    let v = pm.next(HandlerCall::Validate, name, WAIT).await.unwrap();
    assert_eq!(v.error, Some(pm.validate_error(name)));
    let n = ep.next_notification(WAIT).await.unwrap();
    assert!(!n.registered, "{}", n.raw);
    assert_eq!(
        n.error,
        format!(
            "RegisterPlugin error -- plugin validation failed with err: {}",
            pm.validate_error(name)
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_apiserver_is_one_while_held_and_stops_after_the_last() {
    let (a, b) = tokio::join!(
        ApiServer::shared(KubeVersion::V1_36_2),
        ApiServer::shared(KubeVersion::V1_36_2)
    );
    let (a, b) = (a.expect("first"), b.expect("second"));
    assert!(std::sync::Arc::ptr_eq(&a, &b));
    assert_eq!(a.version(), KubeVersion::V1_36_2);
    let dir = a.dir().to_path_buf();
    drop(a);
    assert!(dir.exists(), "still held by b");
    drop(b);
    assert!(!dir.exists(), "stopped and removed after the last holder");
    let c = ApiServer::shared(KubeVersion::V1_36_2)
        .await
        .expect("third");
    assert_ne!(c.dir(), dir);
    Api::<Node>::all(c.client().await.expect("client"))
        .list(&Default::default())
        .await
        .expect("the new server answers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_manager_for_a_v1_20_apiserver_is_a_clear_error() {
    let server = ApiServer::shared(KubeVersion::V1_20_2)
        .await
        .expect("start kube-apiserver v1.20.2");
    let err = ControllerManager::start(&server, VOLUME_CONTROLLERS)
        .await
        .unwrap_err();
    assert!(
        matches!(err, plugreg_testpeers::Error::Unsupported(_)),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("v1.20.2") && msg.contains("v1.36.2"), "{msg}");
}
