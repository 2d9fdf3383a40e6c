//! CSI migration (`spec/upstream-csi-migration.md` §4.1, §5.1 and checklist 2, 4, 6, 8, 10, 14):
//! the test driver registered as `ebs.csi.aws.com`, claims of `kubernetes.io/aws-ebs` classes
//! handed over by kube-controller-manager's PV controller, provisioned with the translated class
//! and saved as in-tree PVs.
//!
//! Every test here serves the same driver name, so each has an API server and a KCM of its own.

mod common;

use std::collections::BTreeMap;

use common::{Env, free_local_addr, http_get, poll};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Secret};
use plugreg_csi_test_driver::{DriverConfig, Method};
use plugreg_proto::csi::v1::volume_capability::AccessType;
use plugreg_testpeers::KubeVersion;
use serde_json::json;

const EBS: &str = "ebs.csi.aws.com";
const K: &str = "topology.ebs.csi.aws.com/zone";
const IN_TREE: &str = "kubernetes.io/aws-ebs";

/// A driver named `ebs.csi.aws.com` with VOLUME_ACCESSIBILITY_CONSTRAINTS, serving `key=value`.
fn topology_driver(key: &'static str, value: &'static str) -> impl FnOnce(&mut DriverConfig) {
    move |c| {
        c.name = EBS.into();
        c.accessibility_constraints = true;
        c.topology = BTreeMap::from([(key.to_owned(), value.to_owned())]);
    }
}

fn annotation<'a>(c: &'a PersistentVolumeClaim, key: &str) -> Option<&'a str> {
    c.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

fn metric_line(method: &str, n: u64) -> String {
    format!(
        "csi_sidecar_operations_seconds_count{{driver_name=\"{EBS}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/{method}\",migrated=\"true\"}} {n}"
    )
}

async fn wait_metric(addr: std::net::SocketAddr, line: &str) {
    poll(&format!("{line} in /metrics"), || async {
        let (_, body) = http_get(addr, "/metrics");
        body.lines().any(|l| l == line).then_some(())
    })
    .await;
}

/// Checklist 2, 4, 6, 8 and 14: KCM hands a claim of an in-tree EBS class to `ebs.csi.aws.com`
/// (both storage-provisioner annotations, no `migrated-to` on the claim); CreateVolume gets the
/// translated parameters (`fsType` as the capability's, `allowautoiopspergbincrease`) with
/// `migrated="true"`; the PV is saved in-tree (`awsElasticBlockStore`, GA zone and region in
/// its node affinity and labels, `provisioned-by: kubernetes.io/aws-ebs`) and KCM marks it
/// `migrated-to`; a class with `zone` and `allowedTopologies` fails with the translation's
/// error; deleting the claim deletes the volume through the PV's translation; checklist 20:
/// with the deletion-secret annotations gone, with the secret of the translated class.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_an_in_tree_class_are_provisioned_in_tree_and_deleted() {
    let mut env = Env::isolated(KubeVersion::V1_36_2, topology_driver(K, "us-east-1a")).await;
    env.name = EBS.into();
    let node = format!("{}-node", env.ns);
    env.topology_node(&node, &[(K, "us-east-1a")], &[K]).await;
    let class = env
        .class(
            "-gp3",
            json!({"provisioner": IN_TREE, "reclaimPolicy": "Delete",
                "parameters": {"type": "gp3", "fsType": "xfs", "iopsPerGB": "10", "encrypted": "true",
                    "csi.storage.k8s.io/provisioner-secret-name": "ebs-creds",
                    "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}"}}),
        )
        .await;
    let conflict = env
        .class(
            "-conflict",
            json!({"provisioner": IN_TREE, "parameters": {"zone": "us-east-1a"},
                "allowedTopologies": [{"matchLabelExpressions": [
                    {"key": "topology.kubernetes.io/zone", "values": ["us-east-1a"]}]}]}),
        )
        .await;
    let addr = free_local_addr();
    let mut p = env.provisioner(&[&format!("--http-endpoint={addr}")]);

    env.api::<Secret>()
        .create(
            &Default::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "ebs-creds"}, "stringData": {"token": "ebs-t"}}),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    env.claim("data", &class, "1Gi", json!({})).await;
    let claim = env.wait_bound("data").await;
    for key in [
        "volume.kubernetes.io/storage-provisioner",
        "volume.beta.kubernetes.io/storage-provisioner",
    ] {
        assert_eq!(annotation(&claim, key), Some(EBS), "{key}");
    }
    assert_eq!(annotation(&claim, "pv.kubernetes.io/migrated-to"), None);
    let requests = env.calls.create_requests();
    assert_eq!(requests.len(), 1, "{requests:?}");
    let req = &requests[0];
    let params: BTreeMap<_, _> = req.parameters.clone().into_iter().collect();
    assert_eq!(
        params,
        common::map(&[
            ("type", "gp3"),
            ("iopsPerGB", "10"),
            ("allowautoiopspergbincrease", "true"),
            ("encrypted", "true"),
        ])
    );
    assert!(
        req.volume_capabilities
            .iter()
            .all(|c| matches!(&c.access_type, Some(AccessType::Mount(m)) if m.fs_type == "xfs")),
        "{req:?}"
    );
    let pv_name = claim.spec.unwrap().volume_name.unwrap();
    let pv = env
        .wait_pv(&pv_name, "migrated-to from KCM", |pv| {
            pv.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("pv.kubernetes.io/migrated-to"))
                .is_some_and(|m| m == EBS)
        })
        .await;
    let annotations = pv.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations
            .get("pv.kubernetes.io/provisioned-by")
            .map(String::as_str),
        Some(IN_TREE)
    );
    let labels = pv.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels,
        common::map(&[
            ("topology.kubernetes.io/zone", "us-east-1a"),
            ("topology.kubernetes.io/region", "us-east-1"),
        ])
    );
    let spec = pv.spec.clone().unwrap();
    assert!(spec.csi.is_none(), "{spec:?}");
    let ebs = spec.aws_elastic_block_store.clone().unwrap();
    assert_eq!(ebs.fs_type.as_deref(), Some("xfs"));
    let affinity = serde_json::to_value(&spec.node_affinity).unwrap();
    assert_eq!(
        affinity,
        json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-east-1a"]},
            {"key": "topology.kubernetes.io/region", "operator": "In", "values": ["us-east-1"]},
        ]}]}})
    );
    wait_metric(addr, &metric_line("CreateVolume", 1)).await;

    env.claim("bad", &conflict, "1Gi", json!({})).await;
    let failed = env.wait_event(&env.ns, "bad", "ProvisioningFailed").await;
    assert!(
        failed.ends_with(
            "failed to translate storage class: cannot simultaneously set allowed topologies and zone/zones parameters"
        ),
        "{failed}"
    );

    // Checklist 20: a migrated PV without the deletion-secret annotations is deleted with the
    // secret of its class, translated first.
    assert_eq!(
        annotations
            .get("volume.kubernetes.io/provisioner-deletion-secret-name")
            .map(String::as_str),
        Some("ebs-creds")
    );
    env.volumes()
        .patch(
            &pv_name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"annotations": {
                "volume.kubernetes.io/provisioner-deletion-secret-name": null,
                "volume.kubernetes.io/provisioner-deletion-secret-namespace": null}}})),
        )
        .await
        .unwrap();
    env.api::<PersistentVolumeClaim>()
        .delete("data", &Default::default())
        .await
        .unwrap();
    env.wait_pv_gone(&pv_name).await;
    let deletes = env.calls.delete_requests();
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert_eq!(deletes[0].volume_id, ebs.volume_id);
    assert_eq!(
        deletes[0].secrets.get("token").map(String::as_str),
        Some("ebs-t"),
        "{}",
        p.log()
    );
    wait_metric(addr, &metric_line("DeleteVolume", 1)).await;
    assert!(p.running(), "{}", p.log());
}

/// Checklist 10, with decisions M2: the driver reports a topology without a zone, so the PV
/// cannot be written back in-tree (`... Error:Failed to handle region topology. error: no
/// zones specified`). Upstream leaves the volume behind and repeats CreateVolume forever;
/// plugreg deletes the volume it created, saves no PV and reports the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pv_that_cannot_be_written_back_in_tree_is_deleted_and_reported() {
    const NODE_KEY: &str = "topology.hostpath.csi/node";
    let mut env = Env::isolated(KubeVersion::V1_36_2, topology_driver(NODE_KEY, "n1")).await;
    env.name = EBS.into();
    let node = format!("{}-node", env.ns);
    env.topology_node(&node, &[(NODE_KEY, "n1")], &[NODE_KEY])
        .await;
    let class = env.class("-plain", json!({"provisioner": IN_TREE})).await;
    let mut p = env.provisioner(&[]);
    env.claim("data", &class, "1Gi", json!({})).await;
    let failed = env.wait_event(&env.ns, "data", "ProvisioningFailed").await;
    assert!(
        failed.ends_with("Error:Failed to handle region topology. error: no zones specified"),
        "{failed}"
    );
    assert!(
        failed.contains("failed to translate topology. PV:"),
        "{failed}"
    );
    tokio::time::timeout(common::WAIT, env.calls.wait_for(Method::DeleteVolume, 1))
        .await
        .expect("DeleteVolume of the created volume");
    let created: Vec<String> = env
        .calls
        .create_requests()
        .into_iter()
        .map(|r| r.name)
        .collect();
    let deleted = env.calls.delete_requests();
    assert!(!created.is_empty());
    assert_eq!(
        env.volumes()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .len(),
        0
    );
    assert!(
        deleted.iter().all(|d| !d.volume_id.is_empty()),
        "{deleted:?}"
    );
    assert!(p.running(), "{}", p.log());
}

/// Checklist 13 (and decisions M2): a GCE PD claim whose volume ID has fewer than six `/`
/// parts cannot be written back as `gcePersistentDisk`; the volume is deleted and the error,
/// upstream's text with its trailing space, reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gce_volume_id_without_its_parts_is_deleted_and_reported() {
    const GCE: &str = "pd.csi.storage.gke.io";
    let mut env = Env::isolated(KubeVersion::V1_36_2, |c| c.name = GCE.into()).await;
    env.name = GCE.into();
    let class = env
        .class("-pd", json!({"provisioner": "kubernetes.io/gce-pd"}))
        .await;
    let mut p = env.provisioner(&[]);
    env.claim("data", &class, "1Gi", json!({})).await;
    let failed = env.wait_event(&env.ns, "data", "ProvisioningFailed").await;
    assert!(
        failed.ends_with("failed to get id components.Got: 1, wanted 6 components or more. "),
        "{failed:?}"
    );
    tokio::time::timeout(common::WAIT, env.calls.wait_for(Method::DeleteVolume, 1))
        .await
        .expect("DeleteVolume of the created volume");
    let created = env.calls.create_requests();
    let deleted = env.calls.delete_requests();
    assert!(!created.is_empty() && !deleted.is_empty());
    assert_eq!(
        env.volumes()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .len(),
        0
    );
    assert!(p.running(), "{}", p.log());
}
