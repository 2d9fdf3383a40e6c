//! A real kube-apiserver v1.20 (with etcd) starts on loopback and stores a
//! Node written with kube-rs.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ObjectMeta, PostParams};
use plugreg_testpeers::ApiServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_round_trip() {
    let server = ApiServer::start().await.expect("start apiserver");
    assert!(server.url().starts_with("https://127.0.0.1:"));
    assert!(server.kubeconfig_path().is_file());
    assert!(!server.token().is_empty());

    let client = server.client().await.expect("client");
    let nodes: Api<Node> = Api::all(client);
    let labels = BTreeMap::from([("plugreg.test/kind".to_owned(), "interop".to_owned())]);
    let node = Node {
        metadata: ObjectMeta {
            name: Some("plugreg-node-1".to_owned()),
            labels: Some(labels.clone()),
            ..Default::default()
        },
        ..Default::default()
    };
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create node");

    let got = nodes.get("plugreg-node-1").await.expect("get node");
    assert_eq!(got.metadata.name.as_deref(), Some("plugreg-node-1"));
    assert_eq!(got.metadata.labels.as_ref(), Some(&labels));
    assert!(got.metadata.uid.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_run_side_by_side() {
    let (a, b) = tokio::join!(ApiServer::start(), ApiServer::start());
    let (a, b) = (a.expect("start first"), b.expect("start second"));
    assert_ne!(a.url(), b.url());

    let na: Api<Node> = Api::all(a.client().await.expect("client a"));
    let nb: Api<Node> = Api::all(b.client().await.expect("client b"));
    let node = Node {
        metadata: ObjectMeta {
            name: Some("only-in-a".to_owned()),
            ..Default::default()
        },
        ..Default::default()
    };
    na.create(&PostParams::default(), &node)
        .await
        .expect("create in a");
    assert!(na.get_opt("only-in-a").await.expect("get a").is_some());
    assert!(nb.get_opt("only-in-a").await.expect("get b").is_none());

    let dir = a.dir().to_path_buf();
    drop(a);
    assert!(!dir.exists(), "temp dir removed on drop");
}
