//! The v1.36.2 peers work: the API server starts and stores objects (the controller manager:
//! `controller_manager.rs`), and the real example plugins of both releases
//! register with the real plugin managers of both releases (through the version-neutral API).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ObjectMeta, PostParams};
use plugreg_testpeers::{
    ApiServer, HandlerCall, KubeVersion, PluginManagerOptions, RealExamplePlugin, RealPluginManager,
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
