//! The real kube-scheduler of each release (v1.20.2, v1.36.2) runs against the API server of
//! its release: `/healthz` answers without credentials, and a pod is bound to the one Ready
//! node that fits it (and not to a node it does not tolerate).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Container, Node, NodeCondition, NodeSpec, NodeStatus, Pod, PodSpec, ServiceAccount, Taint,
    Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ObjectMeta, PostParams};
use plugreg_testpeers::{ApiServer, KubeVersion, Scheduler};

const WAIT: Duration = Duration::from_secs(60);

fn node(name: &str, taint: bool) -> Node {
    let resources = BTreeMap::from([
        ("cpu".to_owned(), Quantity("2".to_owned())),
        ("memory".to_owned(), Quantity("4Gi".to_owned())),
        ("pods".to_owned(), Quantity("110".to_owned())),
    ]);
    Node {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            taints: taint.then(|| {
                vec![Taint {
                    key: "plugreg.test/keep-out".to_owned(),
                    effect: "NoSchedule".to_owned(),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        }),
        status: Some(NodeStatus {
            capacity: Some(resources.clone()),
            allocatable: Some(resources),
            conditions: Some(vec![NodeCondition {
                type_: "Ready".to_owned(),
                status: "True".to_owned(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
    }
}

async fn binds_a_pod_to_the_node_that_fits(version: KubeVersion) {
    let server = ApiServer::start_version(version)
        .await
        .expect("start kube-apiserver");
    let scheduler = Scheduler::start(&server)
        .await
        .expect("start kube-scheduler");
    assert_eq!(scheduler.healthz().await.expect("/healthz").trim(), "ok");
    assert!(scheduler.url().starts_with("https://127.0.0.1:"));

    let client = server.client().await.expect("client");
    let nodes: Api<Node> = Api::all(client.clone());
    for (name, taint) in [("tainted", true), ("open", false)] {
        let created = nodes
            .create(&PostParams::default(), &node(name, taint))
            .await
            .expect("create node");
        // The status is a subresource: set it as the kubelet would.
        let mut with_status = created;
        with_status.status = node(name, taint).status;
        nodes
            .replace_status(name, &PostParams::default(), &with_status)
            .await
            .expect("node status");
    }
    // No controller manager here to make the namespace's default service account.
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    let account = ServiceAccount {
        metadata: ObjectMeta {
            name: Some("default".to_owned()),
            ..Default::default()
        },
        ..Default::default()
    };
    accounts
        .create(&PostParams::default(), &account)
        .await
        .expect("create the default service account");
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some("p".to_owned()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            // No token controller here either.
            automount_service_account_token: Some(false),
            // The API server taints a new Node not-ready until the node lifecycle controller
            // (not running here) sees it Ready.
            tolerations: Some(vec![Toleration {
                key: Some("node.kubernetes.io/not-ready".to_owned()),
                operator: Some("Exists".to_owned()),
                effect: Some("NoSchedule".to_owned()),
                ..Default::default()
            }]),
            containers: vec![Container {
                name: "c".to_owned(),
                image: Some("plugreg.test/busybox".to_owned()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let p = pods.get("p").await.expect("get pod");
        let status = format!("{:?}", p.status);
        if let Some(node) = p.spec.and_then(|s| s.node_name) {
            assert_eq!(
                node, "open",
                "bound to a node whose taint it does not tolerate"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "pod not bound within {WAIT:?}: {status}\n--- kube-scheduler log ---\n{}",
            scheduler.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_20_2_binds_a_pod_to_the_node_that_fits() {
    binds_a_pod_to_the_node_that_fits(KubeVersion::V1_20_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_36_2_binds_a_pod_to_the_node_that_fits() {
    binds_a_pod_to_the_node_that_fits(KubeVersion::V1_36_2).await;
}
