//! The real kube-controller-manager of each release (v1.20.2, v1.36.2) runs against the API
//! server of its release with the volume controllers: it hands a claim of an `Immediate`
//! class to the class's (external) provisioner by annotation, and binds a PV pre-bound to
//! the claim; a controller name of another release is refused.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, ObjectReference, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeSpec, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ObjectMeta, PostParams};
use plugreg_testpeers::{
    ApiServer, ControllerManager, Error, KubeVersion, VOLUME_CONTROLLERS, VOLUME_CONTROLLERS_V1_20,
    volume_controllers,
};

const WAIT: Duration = Duration::from_secs(60);
const BETA_PROVISIONER: &str = "volume.beta.kubernetes.io/storage-provisioner";
const GA_PROVISIONER: &str = "volume.kubernetes.io/storage-provisioner";

/// Polls `probe` until it yields a value, failing with `what` and the KCM's log after
/// [`WAIT`].
async fn wait_for<T, F, Fut>(kcm: &ControllerManager, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let last = match probe().await {
            Ok(v) => return v,
            Err(last) => last,
        };
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} not within {WAIT:?}; last: {last}\n--- KCM log ---\n{}",
            kcm.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn provisions_by_annotation_and_binds_a_prebound_pv(version: KubeVersion) {
    let server = ApiServer::start_version(version)
        .await
        .expect("start kube-apiserver");
    let kcm = ControllerManager::start_volume_controllers(&server, &[])
        .await
        .expect("start kube-controller-manager");
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
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
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
    let created = pvcs
        .create(&PostParams::default(), &pvc)
        .await
        .expect("create pvc");
    let uid = created.metadata.uid.expect("the claim's uid");

    // The PV binder finds no PV and hands the claim to the class's provisioner: v1.20 by the
    // beta annotation only, v1.36 by the beta and the GA one.
    let ann = wait_for(&kcm, "the provisioner annotation", || async {
        let got = pvcs.get("plugreg-claim").await.map_err(|e| e.to_string())?;
        let ann = got.metadata.annotations.unwrap_or_default();
        match ann.get(BETA_PROVISIONER) {
            Some(_) => Ok(ann),
            None => Err(format!("{ann:?}")),
        }
    })
    .await;
    assert_eq!(
        ann.get(BETA_PROVISIONER).map(String::as_str),
        Some(provisioner)
    );
    let ga = ann.get(GA_PROVISIONER).map(String::as_str);
    match version {
        KubeVersion::V1_20_2 => assert_eq!(ga, None, "{ann:?}"),
        KubeVersion::V1_36_2 => assert_eq!(ga, Some(provisioner), "{ann:?}"),
    }

    // A PV pre-bound to the claim (as an external provisioner writes it): the binder binds.
    let pv = PersistentVolume {
        metadata: ObjectMeta {
            name: Some("plugreg-pv".to_owned()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            access_modes: Some(vec!["ReadWriteOnce".to_owned()]),
            capacity: Some(BTreeMap::from([(
                "storage".to_owned(),
                Quantity("1Mi".to_owned()),
            )])),
            storage_class_name: Some("plugreg-immediate".to_owned()),
            persistent_volume_reclaim_policy: Some("Delete".to_owned()),
            csi: Some(CSIPersistentVolumeSource {
                driver: provisioner.to_owned(),
                volume_handle: "vol-1".to_owned(),
                ..Default::default()
            }),
            claim_ref: Some(ObjectReference {
                kind: Some("PersistentVolumeClaim".to_owned()),
                api_version: Some("v1".to_owned()),
                namespace: Some("default".to_owned()),
                name: Some("plugreg-claim".to_owned()),
                uid: Some(uid),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let pvs: Api<PersistentVolume> = Api::all(client);
    pvs.create(&PostParams::default(), &pv)
        .await
        .expect("create pv");

    let bound = wait_for(&kcm, "the claim bound", || async {
        let got = pvcs.get("plugreg-claim").await.map_err(|e| e.to_string())?;
        let phase = got.status.as_ref().and_then(|s| s.phase.clone());
        if phase.as_deref() == Some("Bound") {
            Ok(got)
        } else {
            Err(format!("phase {phase:?}"))
        }
    })
    .await;
    let ann = bound.metadata.annotations.unwrap_or_default();
    assert_eq!(
        ann.get("pv.kubernetes.io/bind-completed")
            .map(String::as_str),
        Some("yes"),
        "{ann:?}"
    );
    assert_eq!(
        bound.spec.and_then(|s| s.volume_name).as_deref(),
        Some("plugreg-pv")
    );
    // The PVC protection controller guards the claim in use.
    assert!(
        bound
            .metadata
            .finalizers
            .unwrap_or_default()
            .iter()
            .any(|f| f == "kubernetes.io/pvc-protection")
    );
    wait_for(&kcm, "the PV bound", || async {
        let got = pvs.get("plugreg-pv").await.map_err(|e| e.to_string())?;
        let phase = got.status.and_then(|s| s.phase);
        if phase.as_deref() == Some("Bound") {
            Ok(())
        } else {
            Err(format!("phase {phase:?}"))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_20_2_provisions_by_annotation_and_binds_a_prebound_pv() {
    provisions_by_annotation_and_binds_a_prebound_pv(KubeVersion::V1_20_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_36_2_provisions_by_annotation_and_binds_a_prebound_pv() {
    provisions_by_annotation_and_binds_a_prebound_pv(KubeVersion::V1_36_2).await;
}

#[test]
fn volume_controllers_follow_the_release() {
    assert_eq!(
        volume_controllers(KubeVersion::V1_20_2),
        VOLUME_CONTROLLERS_V1_20
    );
    assert_eq!(volume_controllers(KubeVersion::V1_36_2), VOLUME_CONTROLLERS);
}

/// v1.20.2 does not know v1.36.2's names: the controller manager exits naming the first, and
/// `start` says so instead of waiting for `/healthz`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_20_2_refuses_the_controller_names_of_v1_36_2() {
    let server = ApiServer::shared(KubeVersion::V1_20_2)
        .await
        .expect("start kube-apiserver v1.20.2");
    let err = ControllerManager::start(&server, VOLUME_CONTROLLERS)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotReady { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("persistentvolume-binder-controller")
            && msg.contains("is not in the list of known controllers"),
        "{msg}"
    );
}
