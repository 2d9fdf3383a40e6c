//! `csi-resizer` against a real kube-apiserver and kube-controller-manager (v1.36.2 and
//! v1.20.2), with the test driver on a Unix socket: the resize items of the upstream test
//! checklist (controller-only expansion, node expansion required, final and infeasible errors
//! with recovery by lowering the request, the trivial resizer, ignored claims, the Lease).

mod common;

use common::*;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use plugreg_csi_test_driver::{Failure, Fault, Method, NodeCapability};
use plugreg_proto::csi::v1::volume_capability;
use plugreg_testpeers::KubeVersion;
use serde_json::json;
use tonic::Code;

const GI: i64 = 1 << 30;

async fn controller_only_expansion(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let _resizer = env.resizer(&[
        "--leader-election",
        &format!("--leader-election-namespace={}", env.ns),
    ]);
    env.request("data", "2Gi").await;
    let pvc = env
        .wait_claim("data", "capacity 2Gi", |c| {
            capacity(c).as_deref() == Some("2Gi")
        })
        .await;
    let reqs = env.calls.expand_requests();
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    let r = &reqs[0];
    assert_eq!(r.volume_id, "vol-0");
    assert_eq!(r.capacity_range.unwrap().required_bytes, 2 * GI);
    let cap = r.volume_capability.as_ref().unwrap();
    assert_eq!(
        cap.access_mode.unwrap().mode,
        volume_capability::access_mode::Mode::SingleNodeWriter as i32
    );
    match cap.access_type.as_ref().unwrap() {
        volume_capability::AccessType::Mount(m) => {
            assert_eq!(m.fs_type, "ext4");
            assert_eq!(m.mount_flags, ["noatime"]);
        }
        other => panic!("{other:?}"),
    }
    let pv = env.volumes().get(&env.pv_name("data")).await.unwrap();
    assert_eq!(pv_capacity(&pv), "2Gi");
    assert!(condition_types(&pvc).is_empty(), "{pvc:?}");
    if version == KubeVersion::V1_36_2 {
        assert_eq!(allocated(&pvc).as_deref(), Some("2Gi"));
        assert_eq!(resize_status(&pvc), None);
        assert_eq!(
            pvc.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("volume.kubernetes.io/node-expansion-not-required"))
                .map(String::as_str),
            Some("true")
        );
    } else {
        // v1.20.2 drops the fields it does not know.
        assert_eq!(allocated(&pvc), None);
    }
    assert_eq!(
        env.wait_event("data", "Resizing").await,
        format!(
            "External resizer is resizing volume {}",
            env.pv_name("data")
        )
    );
    assert_eq!(
        env.wait_event("data", "VolumeResizeSuccessful").await,
        "Resize volume succeeded"
    );
    // Only the leader acts, on the Lease named after the driver.
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let lease_name = format!("external-resizer-{}", env.name.replace('.', "-"));
    let lease = leases.get(&lease_name).await.unwrap();
    assert!(lease.spec.unwrap().holder_identity.is_some());
}

#[tokio::test]
async fn controller_only_expansion_v1_36() {
    controller_only_expansion(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn controller_only_expansion_v1_20() {
    controller_only_expansion(KubeVersion::V1_20_2).await;
}

async fn node_expansion_required(version: KubeVersion) {
    let env = Env::new(version, |c| c.node_expansion_required = true).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let _resizer = env.resizer(&[]);
    env.request("data", "2Gi").await;
    let pv_name = env.pv_name("data");
    env.wait_pv(&pv_name, "capacity 2Gi", |pv| pv_capacity(pv) == "2Gi")
        .await;
    let pvc = env
        .wait_claim("data", "FileSystemResizePending", |c| {
            condition(c, "FileSystemResizePending").is_some()
        })
        .await;
    assert_eq!(capacity(&pvc).as_deref(), Some("1Gi"));
    assert_eq!(
        condition(&pvc, "FileSystemResizePending")
            .unwrap()
            .message
            .as_deref(),
        Some(
            "Waiting for user to (re-)start a pod to finish file system resize of volume on node."
        )
    );
    if version == KubeVersion::V1_36_2 {
        // Resizing is kept beside it.
        assert!(condition(&pvc, "Resizing").is_some(), "{pvc:?}");
        assert_eq!(resize_status(&pvc).as_deref(), Some("NodeResizePending"));
    }
    assert_eq!(
        env.wait_event("data", "FileSystemResizeRequired").await,
        "Require file system resize of volume on node"
    );
    // The kubelet finishes (emulated): capacity up, conditions and status gone.
    let status = if version == KubeVersion::V1_36_2 {
        json!({"status": {"capacity": {"storage": "2Gi"}, "conditions": null,
                          "allocatedResourceStatuses": null}})
    } else {
        json!({"status": {"capacity": {"storage": "2Gi"}, "conditions": null}})
    };
    env.patch_status("data", status).await;
    // The next growth is the driver's second call: nothing was called in between.
    env.request("data", "3Gi").await;
    env.wait_pv(&pv_name, "capacity 3Gi", |pv| pv_capacity(pv) == "3Gi")
        .await;
    let reqs = env.calls.expand_requests();
    let sizes: Vec<i64> = reqs
        .iter()
        .map(|r| r.capacity_range.unwrap().required_bytes)
        .collect();
    assert_eq!(sizes, [2 * GI, 3 * GI]);
}

#[tokio::test]
async fn node_expansion_required_v1_36() {
    node_expansion_required(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn node_expansion_required_v1_20() {
    node_expansion_required(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn final_error_backs_off_and_a_lower_request_recovers_v1_36() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::ControllerExpandVolume,
            Fault {
                error: Some(Failure::new(Code::Internal, "disk array on fire")),
                fail_first: Some(2),
                ..Fault::default()
            },
        );
        // 4Gi and more is out of range (infeasible).
        c.max_capacity = 3 * GI;
    })
    .await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    // Back-off of 2 s, then 4 s: the error stays long enough for a poll on a loaded machine to
    // see it before the third call succeeds.
    let _resizer = env.resizer(&["--retry-interval-start=2s"]);
    env.request("data", "2Gi").await;
    let pvc = env
        .wait_claim("data", "ControllerResizeError", |c| {
            condition(c, "ControllerResizeError").is_some()
        })
        .await;
    assert_eq!(
        condition(&pvc, "ControllerResizeError")
            .unwrap()
            .message
            .as_deref(),
        Some("failed to expand pvc with rpc error: code = Internal desc = disk array on fire")
    );
    assert_eq!(allocated(&pvc).as_deref(), Some("2Gi"));
    let failed = env.wait_event("data", "VolumeResizeFailed").await;
    assert_eq!(
        failed,
        format!(
            "resize volume \"{}\" by resizer \"{}\" failed: rpc error: code = Internal desc = disk array on fire",
            env.pv_name("data"),
            env.name
        )
    );
    // Retried after the back-off; the third call succeeds.
    env.wait_claim("data", "capacity 2Gi", |c| {
        capacity(c).as_deref() == Some("2Gi")
    })
    .await;
    assert_eq!(env.calls.count(Method::ControllerExpandVolume), 3);

    // Infeasible: 8Gi is out of range.
    env.request("data", "8Gi").await;
    let pvc = env
        .wait_claim("data", "ControllerResizeInfeasible", |c| {
            resize_status(c).as_deref() == Some("ControllerResizeInfeasible")
        })
        .await;
    assert!(
        condition(&pvc, "ControllerResizeError")
            .unwrap()
            .message
            .unwrap()
            .contains("code = OutOfRange")
    );
    // The user lowers the request (still above the capacity): the driver gets it at once.
    env.request("data", "3Gi").await;
    let pvc = env
        .wait_claim("data", "capacity 3Gi", |c| {
            capacity(c).as_deref() == Some("3Gi")
        })
        .await;
    assert_eq!(allocated(&pvc).as_deref(), Some("3Gi"));
    assert_eq!(resize_status(&pvc), None);
    let sizes: Vec<i64> = env
        .calls
        .expand_requests()
        .iter()
        .map(|r| r.capacity_range.unwrap().required_bytes)
        .collect();
    assert_eq!(sizes.first(), Some(&(2 * GI)));
    assert_eq!(sizes.last(), Some(&(3 * GI)));
    assert!(sizes.contains(&(8 * GI)), "{sizes:?}");
    // With --retry-interval-max at 5m, 8Gi was asked at most twice (the call that failed and
    // the one quick retry after it).
    assert!(
        sizes.iter().filter(|s| **s == 8 * GI).count() <= 2,
        "{sizes:?}"
    );
}

#[tokio::test]
async fn uncertain_error_keeps_the_allocated_size_v1_36() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::ControllerExpandVolume,
            Fault {
                error: Some(Failure::new(Code::Unavailable, "try later")),
                fail_first: Some(1),
                // The first call is in the driver long enough for the request to be lowered
                // while its outcome is unknown, whenever the retry then comes (lowered after
                // the failure instead, a retry brought at once by the resizer's own status
                // write could grow the volume first, and the API server then refused a request
                // below the grown capacity).
                delay: Some(std::time::Duration::from_secs(5)),
                delay_first: Some(1),
                ..Fault::default()
            },
        );
    })
    .await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let _resizer = env.resizer(&["--retry-interval-start=1s"]);
    env.request("data", "3Gi").await;
    env.wait_calls(Method::ControllerExpandVolume, 1).await;
    // The user lowers the request while the outcome is unknown: the driver still gets 3Gi.
    env.request("data", "2Gi").await;
    env.wait_event("data", "VolumeResizeFailed").await;
    let pvc = env
        .wait_claim("data", "PV grown", |c| {
            capacity(c).as_deref() == Some("3Gi")
        })
        .await;
    assert_eq!(allocated(&pvc).as_deref(), Some("3Gi"));
    let sizes: Vec<i64> = env
        .calls
        .expand_requests()
        .iter()
        .map(|r| r.capacity_range.unwrap().required_bytes)
        .collect();
    assert_eq!(sizes.len(), 2, "{sizes:?}");
    assert!(sizes.iter().all(|s| *s == 3 * GI), "{sizes:?}");
}

async fn trivial_resizer(version: KubeVersion) {
    let env = Env::new(version, |c| {
        c.controller_expand = false;
        c.node_capabilities = vec![NodeCapability::ExpandVolume];
    })
    .await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let resizer = env.resizer(&[]);
    env.request("data", "2Gi").await;
    let pv_name = env.pv_name("data");
    env.wait_pv(&pv_name, "capacity 2Gi", |pv| pv_capacity(pv) == "2Gi")
        .await;
    env.wait_claim("data", "FileSystemResizePending", |c| {
        condition(c, "FileSystemResizePending").is_some()
    })
    .await;
    assert_eq!(env.calls.count(Method::ControllerExpandVolume), 0);
    assert!(
        resizer.log().contains(
            "The CSI driver supports node resize only, using trivial resizer to handle resize requests"
        ),
        "{}",
        resizer.log()
    );
}

#[tokio::test]
async fn trivial_resizer_v1_36() {
    trivial_resizer(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn trivial_resizer_v1_20() {
    trivial_resizer(KubeVersion::V1_20_2).await;
}

/// Checklist 6: another driver's PV, a label-only change, and a claim that is not bound
/// (its PV is bound to another claim UID, so KCM leaves it Pending) get no call.
#[tokio::test]
async fn other_drivers_and_unchanged_claims_are_ignored_v1_36() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    env.bound_claim_of("other", "1Gi", "vol-1", Some("other.csi.test"), json!({}))
        .await;
    env.bound_claim("same", "1Gi", "vol-2").await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    // A PV that names a claim "stale" of another UID, and the claim "stale" naming the PV.
    let stale_pv = env.pv_name("stale");
    env.volumes()
        .create(
            &kube::api::PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": stale_pv},
                "spec": {
                    "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain", "storageClassName": env.class,
                    "claimRef": {"namespace": env.ns, "name": "stale", "uid": "0b0e7e1e-0000-4000-8000-000000000000"},
                    "csi": {"driver": env.name, "volumeHandle": "vol-3"},
                }
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    env.claims()
        .create(
            &kube::api::PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "stale"},
                "spec": {"storageClassName": env.class, "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}}, "volumeName": stale_pv}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    // One worker: the claims are taken in the order they change.
    // (The API server refuses a new request on an unbound claim: its request above its
    // capacity, which it has none of, is what the resizer sees at start.)
    let _resizer = env.resizer(&["--workers=1"]);
    env.request("other", "2Gi").await;
    env.claims()
        .patch(
            "same",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .unwrap();
    env.request("data", "2Gi").await;
    env.wait_claim("data", "capacity 2Gi", |c| {
        capacity(c).as_deref() == Some("2Gi")
    })
    .await;
    let ids: Vec<String> = env
        .calls
        .expand_requests()
        .into_iter()
        .map(|r| r.volume_id)
        .collect();
    assert_eq!(ids, ["vol-0"]);
    let other = env.volumes().get(&env.pv_name("other")).await.unwrap();
    assert_eq!(pv_capacity(&other), "1Gi");
    let stale = env.claims().get("stale").await.unwrap();
    assert_ne!(
        stale.status.and_then(|s| s.phase).as_deref(),
        Some("Bound"),
        "KCM does not bind a claim to a PV of another claim UID"
    );
}

#[tokio::test]
async fn legacy_flow_without_recover_volume_expansion_failure_v1_36() {
    let env = Env::new(KubeVersion::V1_36_2, |c| c.node_expansion_required = true).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let _resizer = env.resizer(&["--feature-gates=RecoverVolumeExpansionFailure=false"]);
    env.request("data", "2Gi").await;
    let pvc = env
        .wait_claim("data", "FileSystemResizePending", |c| {
            condition(c, "FileSystemResizePending").is_some()
        })
        .await;
    assert_eq!(condition_types(&pvc), ["FileSystemResizePending"]);
    // No resize status in the legacy flow (only the kubelet would write one).
    assert_eq!(resize_status(&pvc), None);
    let pv = env.volumes().get(&env.pv_name("data")).await.unwrap();
    assert_eq!(pv_capacity(&pv), "2Gi");
}

#[tokio::test]
async fn offline_only_expansion_waits_for_the_pods_to_go_v1_36() {
    use k8s_openapi::api::core::v1::Pod;
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::ControllerExpandVolume,
            Fault {
                error: Some(Failure::new(Code::FailedPrecondition, "volume is in use")),
                fail_first: Some(1),
                ..Fault::default()
            },
        );
    })
    .await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    // A pod using the claim (never scheduled: no scheduler runs, so it stays Pending, which
    // counts as using it).
    // No service-account controller runs: the pod's account is created here.
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(env.client.clone(), &env.ns);
    accounts
        .create(
            &Default::default(),
            &serde_json::from_value(json!({"metadata": {"name": "default"}})).unwrap(),
        )
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.ns);
    pods.create(
        &Default::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": "user"},
            "spec": {
                "automountServiceAccountToken": false,
                "containers": [{"name": "c", "image": "none"}],
                "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "data"}}],
            }
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    let resizer = env.resizer(&["--retry-interval-start=200ms"]);
    env.request("data", "2Gi").await;
    let msg = env.wait_event("data", "VolumeResizeFailed").await;
    assert!(msg.contains("volume is in use"), "{msg}");
    // The next retries stop at the in-use guard, without calling the driver.
    poll("the in-use event", || async {
        env.events("data").await.into_iter().find(|e| {
            e.message.as_deref()
                == Some(
                    format!(
                        "Unable to expand {}/data because CSI driver {} only supports offline expansion and volume is currently in-use",
                        env.ns, env.name
                    )
                    .as_str(),
                )
        })
    })
    .await;
    assert_eq!(env.calls.count(Method::ControllerExpandVolume), 1);
    pods.delete("user", &kube::api::DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    env.wait_claim("data", "capacity 2Gi", |c| {
        capacity(c).as_deref() == Some("2Gi")
    })
    .await;
    assert_eq!(env.calls.count(Method::ControllerExpandVolume), 2);
    assert!(resizer.log().contains("Register Pod informer for resizer"));
}

#[tokio::test]
async fn metrics_name_the_queue_after_the_driver_v1_36() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _resizer = env.resizer(&[&format!("--http-endpoint=127.0.0.1:{port}")]);
    env.request("data", "2Gi").await;
    env.wait_claim("data", "capacity 2Gi", |c| {
        capacity(c).as_deref() == Some("2Gi")
    })
    .await;
    let body = poll("metrics", || async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        out.contains("ControllerExpandVolume").then_some(out)
    })
    .await;
    assert!(
        body.contains(&format!(
            "workqueue_adds_total{{name=\"{}-pvc\"}}",
            env.name
        )),
        "{body}"
    );
    assert!(
        body.contains(&format!(
            "csi_sidecar_operations_seconds_count{{driver_name=\"{}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/ControllerExpandVolume\"}} 1",
            env.name
        )),
        "{body}"
    );
}

/// A call that may have grown the volume is not forgotten across a restart: the target is
/// durable in `status.allocatedResources` before the driver is called.
#[tokio::test]
async fn an_uncertain_target_survives_a_restart_v1_36() {
    let mut env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::ControllerExpandVolume,
            Fault {
                error: Some(Failure::new(Code::Aborted, "operation pending")),
                ..Fault::default()
            },
        );
    })
    .await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let mut first = env.resizer(&["--retry-interval-start=5m"]);
    env.request("data", "3Gi").await;
    env.wait_calls(Method::ControllerExpandVolume, 1).await;
    env.wait_event("data", "VolumeResizeFailed").await;
    first.kill();
    // The user lowers the request while nobody knows what the driver did.
    env.request("data", "2Gi").await;
    env.restart_driver(|_| {}).await;
    let _second = env.resizer(&[]);
    let pvc = env
        .wait_claim("data", "capacity 3Gi", |c| {
            capacity(c).as_deref() == Some("3Gi")
        })
        .await;
    assert_eq!(allocated(&pvc).as_deref(), Some("3Gi"));
    let sizes: Vec<i64> = env
        .calls
        .expand_requests()
        .iter()
        .map(|r| r.capacity_range.unwrap().required_bytes)
        .collect();
    assert_eq!(sizes, [3 * GI]);
}

/// Checklist 12: with `AnnotateFsResize`, a volume that needs node expansion gets the claim's
/// capacity before the resize in `volume.alpha.kubernetes.io/pre-resize-capacity`, and the
/// annotation goes once the claim's capacity reaches the PV's (the kubelet's part emulated).
async fn annotate_fs_resize(version: KubeVersion) {
    use kube::ResourceExt as _;
    const ANN: &str = "volume.alpha.kubernetes.io/pre-resize-capacity";
    let env = Env::new(version, |c| c.node_expansion_required = true).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let _resizer = env.resizer(&["--feature-gates=AnnotateFsResize=true"]);
    env.request("data", "2Gi").await;
    let pv_name = env.pv_name("data");
    let pv = env
        .wait_pv(&pv_name, "capacity 2Gi", |pv| pv_capacity(pv) == "2Gi")
        .await;
    assert_eq!(
        pv.annotations().get(ANN).map(String::as_str),
        Some("1Gi"),
        "{pv:?}"
    );
    env.wait_event("data", "FileSystemResizeRequired").await;
    let status = if version == KubeVersion::V1_36_2 {
        json!({"status": {"capacity": {"storage": "2Gi"}, "conditions": null,
                          "allocatedResourceStatuses": null}})
    } else {
        json!({"status": {"capacity": {"storage": "2Gi"}, "conditions": null}})
    };
    env.patch_status("data", status).await;
    env.wait_pv(&pv_name, "no pre-resize annotation", |pv| {
        !pv.annotations().contains_key(ANN)
    })
    .await;
}

#[tokio::test]
async fn annotate_fs_resize_v1_36() {
    annotate_fs_resize(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn annotate_fs_resize_v1_20() {
    annotate_fs_resize(KubeVersion::V1_20_2).await;
}

/// Checklist 10: with `--handle-volume-inuse-error=false` no pod is listed or watched, and
/// FailedPrecondition is retried like any final error, with a pod using the claim.
#[tokio::test]
async fn without_the_in_use_check_no_pod_is_watched_and_retries_go_on_v1_36() {
    use k8s_openapi::api::core::v1::Pod;
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::ControllerExpandVolume,
            Fault {
                error: Some(Failure::new(Code::FailedPrecondition, "volume is in use")),
                fail_first: Some(2),
                ..Fault::default()
            },
        );
    })
    .await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(env.client.clone(), &env.ns);
    accounts
        .create(
            &Default::default(),
            &serde_json::from_value(json!({"metadata": {"name": "default"}})).unwrap(),
        )
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.ns);
    pods.create(
        &Default::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": "user"},
            "spec": {
                "automountServiceAccountToken": false,
                "containers": [{"name": "c", "image": "none"}],
                "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "data"}}],
            }
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let resizer = env.resizer(&[
        "--handle-volume-inuse-error=false",
        "--retry-interval-start=200ms",
        &format!("--http-endpoint=127.0.0.1:{port}"),
    ]);
    env.request("data", "2Gi").await;
    env.wait_claim("data", "capacity 2Gi", |c| {
        capacity(c).as_deref() == Some("2Gi")
    })
    .await;
    // Two refusals, then the call that succeeded: the pod held nothing back.
    assert_eq!(env.calls.count(Method::ControllerExpandVolume), 3);
    assert!(pods.get_opt("user").await.unwrap().is_some());
    assert!(!resizer.log().contains("Register Pod informer for resizer"));
    let body = poll("metrics", || async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        out.contains("resource=\"persistentvolumeclaims\"")
            .then_some(out)
    })
    .await;
    assert!(!body.contains("resource=\"pods\""), "{body}");
}
