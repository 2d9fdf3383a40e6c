//! Workloads for a cluster: a StorageClass, a claim, and a host-network pod that mounts the
//! claim and writes a file to it (what the tests and the benchmark run, and a start for a
//! driver author's own checks).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, PersistentVolumeClaim, PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource,
    Pod, PodSpec, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ObjectMeta, PostParams};

use crate::{Cluster, Error};

/// Creates StorageClass `name` of `provisioner` with `volumeBindingMode: WaitForFirstConsumer`
/// (the volume is made where the pod is scheduled), `reclaimPolicy: Delete` and
/// `allowVolumeExpansion: true` (deploy/ runs csi-resizer).
pub async fn storage_class(cluster: &Cluster, name: &str, provisioner: &str) -> Result<(), Error> {
    let sc = StorageClass {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        provisioner: provisioner.to_owned(),
        volume_binding_mode: Some("WaitForFirstConsumer".to_owned()),
        reclaim_policy: Some("Delete".to_owned()),
        allow_volume_expansion: Some(true),
        ..Default::default()
    };
    Api::<StorageClass>::all(cluster.client())
        .create(&PostParams::default(), &sc)
        .await?;
    Ok(())
}

/// Creates claim `ns/name` of 1 MiB, `ReadWriteOnce`, of class `class`.
pub async fn claim(cluster: &Cluster, ns: &str, name: &str, class: &str) -> Result<(), Error> {
    let pvc = PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".to_owned()]),
            storage_class_name: Some(class.to_owned()),
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
    Api::<PersistentVolumeClaim>::namespaced(cluster.client(), ns)
        .create(&PostParams::default(), &pvc)
        .await?;
    Ok(())
}

/// Creates (through [`Cluster::apply`], so with the loopback rules) pod `ns/name` running
/// `image` (a busybox) that mounts claim `claim` at `/data`, writes `text` and a newline to
/// `/data/<file>`, then waits, ending at once on SIGTERM (grace period 5 s).
pub async fn pod_with_claim(
    cluster: &Cluster,
    ns: &str,
    name: &str,
    image: &str,
    claim: &str,
    file: &str,
    text: &str,
) -> Result<Pod, Error> {
    pod_running(
        cluster,
        ns,
        name,
        image,
        claim,
        &format!("echo '{text}' > /data/{file}"),
    )
    .await
}

/// Like [`pod_with_claim`], but the pod prints `/data/<file>` to its log (where
/// [`Cluster::container_log`] reads it) instead of writing it.
pub async fn pod_reading_claim(
    cluster: &Cluster,
    ns: &str,
    name: &str,
    image: &str,
    claim: &str,
    file: &str,
) -> Result<Pod, Error> {
    pod_running(
        cluster,
        ns,
        name,
        image,
        claim,
        &format!("cat /data/{file}"),
    )
    .await
}

/// Pod `ns/name` that mounts claim `claim` at `/data`, runs `first` (a shell command), then
/// waits, ending at once on SIGTERM.
async fn pod_running(
    cluster: &Cluster,
    ns: &str,
    name: &str,
    image: &str,
    claim: &str,
    first: &str,
) -> Result<Pod, Error> {
    let script = format!("{first} && trap 'exit 0' TERM && while :; do sleep 1 & wait $!; done");
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            host_network: Some(true),
            automount_service_account_token: Some(false),
            termination_grace_period_seconds: Some(5),
            containers: vec![Container {
                name: "app".to_owned(),
                image: Some(image.to_owned()),
                image_pull_policy: Some("Never".to_owned()),
                command: Some(vec!["/bin/sh".to_owned(), "-c".to_owned(), script]),
                volume_mounts: Some(vec![VolumeMount {
                    name: "data".to_owned(),
                    mount_path: "/data".to_owned(),
                    ..Default::default()
                }]),
                ..Default::default()
            }],
            volumes: Some(vec![Volume {
                name: "data".to_owned(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.to_owned(),
                    read_only: None,
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let pod = serde_json::to_value(pod).map_err(|e| Error::Manifest(e.to_string()))?;
    let applied = cluster.apply(pod).await?;
    serde_json::from_value(applied).map_err(|e| Error::Manifest(e.to_string()))
}
