//! `csi-attacher` against a real kube-apiserver (v1.36.2 and v1.20.2) and the test CSI driver:
//! the checklist of `docs/upstream/upstream-external-attacher.md` §22 for what the attach/detach
//! controller hands over (VolumeAttachments written here as it writes them).

mod common;

use std::time::Duration;

use common::{Env, NODE_ID, free_local_addr, http_get, poll};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, DeleteParams, ListParams};
use plugreg_csi_test_driver::{Code, Failure, Fault, Method};
use plugreg_proto::csi::v1::volume_capability::{AccessType, access_mode::Mode};
use plugreg_testpeers::KubeVersion;
use serde_json::json;

/// Checklist 4, 7 and 12-14: attach with everything the PV says, finalizers first, status
/// from the publish context; detach with one Unpublish, finalizers last; the PV finalizer
/// goes with the last VolumeAttachment.
async fn attach_and_detach(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    let node = env.unique("node");
    env.csinode(&node, &[("other.csi", "x"), (&env.name, NODE_ID)])
        .await;
    env.secret("publish", &[("user", "admin")]).await;
    let pv = env.unique("pv");
    env.pv(
        &pv,
        "vol-a",
        json!({
            "metadata": {"finalizers": ["example.com/keep"]},
            "spec": {
                "mountOptions": ["noatime"],
                "csi": {
                    "readOnly": true,
                    "fsType": "xfs",
                    "volumeAttributes": {"pool": "fast"},
                    "controllerPublishSecretRef": {"name": "publish", "namespace": env.ns},
                },
            }
        }),
    )
    .await;
    let _a = env.attacher(&[]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    let done = env.wait_attached(&va).await;
    let fin = env.finalizer();
    assert_eq!(
        done.metadata.finalizers.as_deref(),
        Some(&[fin.clone()][..])
    );
    assert_eq!(
        done.metadata
            .annotations
            .as_ref()
            .unwrap()
            .get("csi.alpha.kubernetes.io/node-id")
            .map(String::as_str),
        Some(NODE_ID)
    );
    let status = done.status.unwrap();
    assert_eq!(
        status
            .attachment_metadata
            .unwrap()
            .get("device")
            .map(String::as_str),
        Some("/dev/plugreg-test")
    );
    assert!(status.attach_error.is_none());
    // The PV got the finalizer beside the one it had.
    let p = env.pvs().get(&pv).await.unwrap();
    // (kubernetes.io/pv-protection is the API server's admission.)
    let fins = p.metadata.finalizers.unwrap();
    assert!(fins.contains(&"example.com/keep".to_owned()), "{fins:?}");
    assert_eq!(fins.last(), Some(&fin), "{fins:?}");
    let reqs = env.calls.publish_requests();
    assert_eq!(reqs.len(), 1);
    let r = &reqs[0];
    assert_eq!(r.volume_id, "vol-a");
    assert_eq!(r.node_id, NODE_ID);
    // The test driver has no PUBLISH_READONLY: readonly is sent false.
    assert!(!r.readonly);
    assert_eq!(
        r.volume_context.get("pool").map(String::as_str),
        Some("fast")
    );
    assert_eq!(r.secrets.get("user").map(String::as_str), Some("admin"));
    let cap = r.volume_capability.as_ref().unwrap();
    match cap.access_type.as_ref().unwrap() {
        AccessType::Mount(m) => {
            assert_eq!(m.fs_type, "xfs");
            assert_eq!(m.mount_flags, vec!["noatime".to_owned()]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(cap.access_mode.unwrap().mode, Mode::SingleNodeWriter as i32);

    // Detach.
    env.delete_va(&va).await;
    env.wait_va_gone(&va).await;
    let un = env.calls.unpublish_requests();
    assert_eq!(un.len(), 1, "one Unpublish");
    assert_eq!(un[0].volume_id, "vol-a");
    assert_eq!(un[0].node_id, NODE_ID);
    assert_eq!(un[0].secrets.get("user").map(String::as_str), Some("admin"));
    // The PV, deleted now, loses our finalizer (and keeps the other).
    env.pvs()
        .delete(&pv, &DeleteParams::default())
        .await
        .unwrap();
    let p = env
        .wait_pv(&pv, "PV finalizer removed", |p| {
            !p.metadata.finalizers.as_ref().unwrap().contains(&fin)
        })
        .await;
    assert!(
        p.metadata
            .finalizers
            .unwrap()
            .contains(&"example.com/keep".to_owned())
    );
    assert_eq!(
        env.calls.count(Method::ControllerUnpublishVolume),
        1,
        "no second Unpublish"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_and_detach_v1_36() {
    attach_and_detach(KubeVersion::V1_36_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_and_detach_v1_20() {
    attach_and_detach(KubeVersion::V1_20_2).await;
}

/// Checklist 3: without PUBLISH_UNPUBLISH_VOLUME the VolumeAttachment is marked attached with
/// no call, no finalizer, no annotation; its deletion is immediate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trivial_handler_marks_attached_without_a_call() {
    let env = Env::new(KubeVersion::V1_36_2, |c| c.controller_publish = false).await;
    let node = env.unique("node");
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    let _a = env.attacher(&[]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    let done = env.wait_attached(&va).await;
    assert!(done.metadata.finalizers.is_none());
    assert!(done.metadata.annotations.is_none());
    assert!(done.status.unwrap().attachment_metadata.is_none());
    assert_eq!(env.calls.count(Method::ControllerPublishVolume), 0);
    env.delete_va(&va).await;
    env.wait_va_gone(&va).await;
    let p = env.pvs().get(&pv).await.unwrap();
    assert!(
        !p.metadata
            .finalizers
            .unwrap_or_default()
            .contains(&env.finalizer())
    );
}

/// Checklist 7: a missing secret is an attach error with upstream's text; no finalizer is
/// written on the VolumeAttachment; it attaches once the secret exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_secret_is_an_attach_error_until_it_exists() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(
        &pv,
        "vol-a",
        json!({"spec": {"csi": {"controllerPublishSecretRef": {"name": "later", "namespace": env.ns}}}}),
    )
    .await;
    let _a = env.attacher(&["--retry-interval-max=2s"]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    let want = format!(
        "failed to load secret \"{}/later\": secrets \"later\" not found",
        env.ns
    );
    let failed = env.wait_attach_error(&va, &want).await;
    assert_eq!(
        failed
            .status
            .unwrap()
            .attach_error
            .unwrap()
            .message
            .unwrap(),
        want
    );
    assert!(
        failed.metadata.finalizers.is_none(),
        "no VA finalizer before the inputs are known"
    );
    assert!(!env.calls.publish_requests().iter().any(|_| true));
    env.secret("later", &[("k", "v")]).await;
    let done = env.wait_attached(&va).await;
    assert!(
        done.status.unwrap().attach_error.is_none(),
        "success clears attachError"
    );
}

/// Checklist 8: node ID errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_id_errors_have_upstreams_texts() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    let _a = env.attacher(&["--retry-interval-max=1s"]);
    let lonely = env.unique("lonely");
    let va = env.unique("va1");
    env.va(&va, &pv, &lonely).await;
    env.wait_attach_error(
        &va,
        &format!("csinode.storage.k8s.io \"{lonely}\" not found"),
    )
    .await;
    let other = env.unique("other");
    env.csinode(&other, &[("other.csi", "x")]).await;
    let pv2 = env.unique("pv2");
    env.pv(&pv2, "vol-b", json!({})).await;
    let va2 = env.unique("va2");
    env.va(&va2, &pv2, &other).await;
    env.wait_attach_error(
        &va2,
        &format!("CSINode {other} does not contain driver {}", env.name),
    )
    .await;
    assert_eq!(env.calls.count(Method::ControllerPublishVolume), 0);
}

/// Checklist 9: a ResourceExhausted publish is stored with its code (on servers that keep
/// it), `attached` unchanged, retried with back-off; success clears it.
async fn resource_exhausted(version: KubeVersion) {
    let env = Env::new(version, |c| {
        c.faults.insert(
            Method::ControllerPublishVolume,
            Fault {
                error: Some(Failure::new(Code::ResourceExhausted, "too many volumes")),
                fail_first: Some(2),
                ..Fault::default()
            },
        );
    })
    .await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    // Back-off of 3 s, then 6 s: the error stays long enough for a poll on a loaded machine to
    // see it before the third call succeeds.
    let _a = env.attacher(&["--retry-interval-start=3s"]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    let failed = env
        .wait_attach_error(
            &va,
            "rpc error: code = ResourceExhausted desc = too many volumes",
        )
        .await;
    let status = failed.status.unwrap();
    assert!(!status.attached);
    let code = status.attach_error.unwrap().error_code;
    match version {
        KubeVersion::V1_36_2 => assert_eq!(code, Some(8)),
        // The field does not exist there: dropped by the server.
        KubeVersion::V1_20_2 => assert_eq!(code, None),
    }
    // The finalizer went on before the call: a publish that failed may still have attached.
    assert!(
        failed
            .metadata
            .finalizers
            .unwrap()
            .contains(&env.finalizer())
    );
    let done = env.wait_attached(&va).await;
    assert!(done.status.unwrap().attach_error.is_none());
    assert_eq!(env.calls.count(Method::ControllerPublishVolume), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_exhausted_v1_36() {
    resource_exhausted(KubeVersion::V1_36_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_exhausted_v1_20() {
    resource_exhausted(KubeVersion::V1_20_2).await;
}

/// Checklist 9: a failing ControllerPublishVolume is retried after `--retry-interval-start`,
/// the wait doubling up to `--retry-interval-max` (here 0.5 s, 1 s, 2 s, then 2 s again where
/// 4 s would come without the cap), as the driver's call times and the
/// `csi_sidecar_operations_seconds` counts show. Neither the VolumeAttachment's finalizer nor
/// its `attachError` coming back through the watch cuts a wait short: the first retry waits
/// too (upstream's comes at once, when its own finalizer write comes back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_retries_back_off_exponentially_up_to_the_cap() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::ControllerPublishVolume,
            Fault {
                error: Some(Failure::new(Code::ResourceExhausted, "too many volumes")),
                fail_first: Some(4),
                ..Fault::default()
            },
        );
    })
    .await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    let addr = free_local_addr();
    let _a = env.attacher(&[
        "--retry-interval-start=500ms",
        "--retry-interval-max=2s",
        &format!("--http-endpoint={addr}"),
    ]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attached(&va).await;
    let times = env.calls.arrivals(Method::ControllerPublishVolume);
    assert_eq!(times.len(), 5, "four failures, then success");
    let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();

    let metric = |name: &str, labels: String| format!("{name}{{{labels}}}");
    let count = |code: &str| {
        metric(
            "csi_sidecar_operations_seconds_count",
            format!(
                "driver_name=\"{}\",grpc_status_code=\"{code}\",method_name=\"/csi.v1.Controller/ControllerPublishVolume\"",
                env.name
            ),
        )
    };
    let (failed, ok) = (count("ResourceExhausted"), count("OK"));
    let retries = metric("workqueue_retries_total", "name=\"csi-attacher-va\"".into());
    let body = poll("the publishes in /metrics", || async {
        let (_, body) = http_get(addr, "/metrics")?;
        body.lines().any(|l| l.starts_with(&ok)).then_some(body)
    })
    .await;
    let value = |prefix: &str| -> u32 {
        body.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {prefix}\n{body}"))
    };
    assert_eq!(value(&failed), 4, "{body}");
    assert_eq!(value(&ok), 1, "{body}");
    // Failures before the first publish (on a loaded machine the CSINode cache, which is not
    // waited for at start, may not have the node yet) count towards the back-off as well.
    let early = value(&retries)
        .checked_sub(4)
        .unwrap_or_else(|| panic!("fewer retries than failed publishes\n{body}"));
    let backoff = |failures: u32| {
        Duration::from_millis(500)
            .saturating_mul(1 << failures.saturating_sub(1).min(10))
            .min(Duration::from_secs(2))
    };
    let backoffs: Vec<Duration> = (1..=4).map(|n| backoff(early + n)).collect();
    // Each wait starts when the failed sync ends, so a gap is its back-off plus the work
    // around one publish: never shorter (the tolerance is for timer rounding).
    let tolerance = Duration::from_millis(20);
    for (i, (gap, backoff)) in gaps.iter().zip(&backoffs).enumerate() {
        assert!(
            *gap + tolerance >= *backoff,
            "retry {} after {gap:?}, before its back-off of {backoff:?}: {gaps:?}",
            i + 1
        );
    }
    // The gaps grow while the back-off doubles.
    for i in 1..gaps.len() {
        if backoffs[i] > backoffs[i - 1] {
            assert!(gaps[i] > gaps[i - 1], "{gaps:?} for {backoffs:?}");
        }
    }
    if early == 0 {
        assert_eq!(backoffs[..3], [500, 1000, 2000].map(Duration::from_millis));
    }
    // Capped: without --retry-interval-max the fourth wait would be 4 s or more.
    assert!(gaps[3] < Duration::from_secs(4), "{gaps:?}");
}

/// Checklist 9: the attacher's own write of `attachError` comes back through the watch and
/// does not bring another ControllerPublishVolume before the back-off (10 min here) ends.
///
/// A first VolumeAttachment attached shows the attacher ready (its CSINode cache, not waited
/// for at start, has the node). The second names a volume the driver does not have (NotFound)
/// and already carries the finalizer and node ID annotation, so that its `attachError` is the
/// only write of its failed attach. A third, created once that error is stored, comes later
/// in the watch and, with one worker, after anything the error's event queued: once it is
/// attached, an extra publish of the second would have been made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_error_update_does_not_bring_another_publish() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let (pv0, pv1, pv2) = (env.unique("pv-0"), env.unique("pv-1"), env.unique("pv-2"));
    env.pv(&pv0, "vol-a", json!({})).await;
    env.pv(&pv1, "vol-missing", json!({})).await;
    env.pv(&pv2, "vol-b", json!({})).await;
    let _a = env.attacher(&["--retry-interval-start=10m", "--worker-threads=1"]);
    // The CSINode cache is not waited for at start (upstream neither): the first
    // VolumeAttachment may fail on it and wait out the 10 min back-off. Another one made after
    // that error finds the node (no publish was made for the failed one).
    let mut attempt = 0;
    loop {
        let va0 = env.unique(&format!("va-0-{attempt}"));
        env.va(&va0, &pv0, &node).await;
        let va = env
            .wait_va(
                &va0,
                &format!("{va0} attached or failing on its CSINode"),
                |va| {
                    va.status.as_ref().is_some_and(|s| {
                        s.attached
                            || s.attach_error
                                .as_ref()
                                .and_then(|e| e.message.as_deref())
                                .is_some_and(|m| m.contains("csinode.storage.k8s.io"))
                    })
                },
            )
            .await;
        if va.status.is_some_and(|s| s.attached) {
            break;
        }
        attempt += 1;
        assert!(
            attempt < 5,
            "the CSINode never reached the attacher's cache"
        );
    }

    let va1 = env.unique("va-1");
    env.vas()
        .create(
            &kube::api::PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {
                    "name": va1,
                    "finalizers": [env.finalizer()],
                    "annotations": {"csi.alpha.kubernetes.io/node-id": NODE_ID},
                },
                "spec": {
                    "attacher": env.name,
                    "nodeName": node,
                    "source": {"persistentVolumeName": pv1},
                }
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    env.wait_attach_error(
        &va1,
        "rpc error: code = NotFound desc = volume \"vol-missing\" does not exist",
    )
    .await;
    let va2 = env.unique("va-2");
    env.va(&va2, &pv2, &node).await;
    env.wait_attached(&va2).await;
    let published: Vec<String> = env
        .calls
        .publish_requests()
        .into_iter()
        .map(|r| r.volume_id)
        .collect();
    assert_eq!(
        published,
        ["vol-a", "vol-missing", "vol-b"],
        "one publish each"
    );
    let second = env.vas().get(&va1).await.unwrap();
    assert!(!second.status.unwrap().attached);
}

/// Checklist 10: a publish slower than `--timeout` is DeadlineExceeded, retried, and a later
/// success clears the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_timeout_is_stored_and_retried() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::ControllerPublishVolume,
            Fault {
                delay: Some(Duration::from_secs(3)),
                // Two slow calls, the second a second after the first timed out: the error
                // stays in place long enough for a poll to see it.
                delay_first: Some(2),
                ..Fault::default()
            },
        );
    })
    .await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    let _a = env.attacher(&["--timeout=1s"]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attach_error(
        &va,
        "rpc error: code = DeadlineExceeded desc = context deadline exceeded",
    )
    .await;
    let done = env.wait_attached(&va).await;
    assert!(done.status.unwrap().attach_error.is_none());
    assert_eq!(env.calls.count(Method::ControllerPublishVolume), 3);
}

/// Checklist 11: a PV marked for deletion is not published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pv_marked_for_deletion_is_not_published() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(
        &pv,
        "vol-a",
        json!({"metadata": {"finalizers": ["example.com/hold"]}}),
    )
    .await;
    env.pvs()
        .delete(&pv, &DeleteParams::default())
        .await
        .unwrap();
    let _a = env.attacher(&[]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attach_error(
        &va,
        &format!("PersistentVolume \"{pv}\" is marked for deletion"),
    )
    .await;
    assert_eq!(env.calls.count(Method::ControllerPublishVolume), 0);
}

/// Checklist 12: an Unpublish error is stored in `detachError`, the VolumeAttachment stays and
/// is retried until the driver says OK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublish_error_is_a_detach_error_and_retried() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::ControllerUnpublishVolume,
            Fault {
                error: Some(Failure::new(Code::NotFound, "no such node")),
                fail_first: Some(1),
                ..Fault::default()
            },
        );
    })
    .await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    // The detach error stays 5 s before the retry: long enough for a poll to see it.
    let _a = env.attacher(&["--retry-interval-start=5s"]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attached(&va).await;
    env.delete_va(&va).await;
    let failed = env
        .wait_va(&va, "detachError", |v| {
            v.status
                .as_ref()
                .and_then(|s| s.detach_error.as_ref())
                .is_some()
        })
        .await;
    let err = failed.status.unwrap().detach_error.unwrap();
    assert_eq!(
        err.message.as_deref(),
        Some("rpc error: code = NotFound desc = no such node")
    );
    assert!(err.error_code.is_none(), "no error code for detach");
    env.wait_va_gone(&va).await;
    assert_eq!(env.calls.count(Method::ControllerUnpublishVolume), 2);
}

/// Checklist 13: a VolumeAttachment whose attach never succeeded still gets Unpublish on
/// deletion (its finalizer went on before the call), so nothing the driver may have attached
/// is forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_attach_is_still_unpublished_on_deletion() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::ControllerPublishVolume,
            Fault {
                error: Some(Failure::new(Code::Aborted, "busy")),
                ..Fault::default()
            },
        );
    })
    .await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    let _a = env.attacher(&[]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attach_error(&va, "code = Aborted desc = busy")
        .await;
    env.delete_va(&va).await;
    env.wait_va_gone(&va).await;
    assert_eq!(env.calls.count(Method::ControllerUnpublishVolume), 1);
}

/// Checklist 8 (detach) and 16: a detach after the CSINode lost the driver uses the annotation
/// written at attach; another driver's VolumeAttachment is never touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_uses_the_annotation_and_other_drivers_are_left_alone() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    let pv2 = env.unique("pv2");
    env.pv(&pv2, "vol-b", json!({})).await;
    let _a = env.attacher(&[]);
    let foreign = env.unique("foreign");
    env.va_of(&foreign, "other.csi.example", &pv2, &node).await;
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attached(&va).await;
    let csinodes: Api<k8s_openapi::api::storage::v1::CSINode> = Api::all(env.client.clone());
    csinodes
        .delete(&node, &DeleteParams::default())
        .await
        .unwrap();
    env.delete_va(&va).await;
    env.wait_va_gone(&va).await;
    assert_eq!(env.calls.unpublish_requests()[0].node_id, NODE_ID);
    // Our VolumeAttachment was attached and detached after the foreign one was created: had
    // the attacher taken it, it would have been attached by now.
    let f = env.vas().get(&foreign).await.unwrap();
    assert!(f.metadata.finalizers.is_none(), "{f:?}");
    assert!(
        !f.status.is_some_and(|s| s.attached),
        "foreign VolumeAttachment touched"
    );
    assert_eq!(env.calls.count(Method::ControllerPublishVolume), 1);
}

/// Better than upstream (external-attacher #706, #761): with one worker per queue, detaches
/// held up in the driver do not keep a new attach waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_detaches_do_not_starve_attaches() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::ControllerUnpublishVolume,
            Fault {
                delay: Some(Duration::from_secs(5)),
                ..Fault::default()
            },
        );
    })
    .await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let addr = free_local_addr();
    let _a = env.attacher(&[
        "--worker-threads=1",
        "--timeout=30s",
        &format!("--http-endpoint={addr}"),
    ]);
    let mut vas = Vec::new();
    for (i, vol) in ["vol-a", "vol-b", "vol-c"].iter().enumerate() {
        let pv = env.unique(&format!("pv{i}"));
        env.pv(&pv, vol, json!({})).await;
        let va = env.unique(&format!("va{i}"));
        env.va(&va, &pv, &node).await;
        vas.push(va);
    }
    for va in &vas {
        env.wait_attached(va).await;
    }
    for va in &vas {
        env.delete_va(va).await;
    }
    // The first detach is in the driver; the others wait in the detach queue.
    env.calls
        .wait_for(Method::ControllerUnpublishVolume, 1)
        .await;
    let body = poll("detach backlog in /metrics", || async {
        let (_, body) = http_get(addr, "/metrics")?;
        body.lines()
            .any(|l| l == "csi_attacher_queue_backlog{name=\"csi-attacher-va-detach\"} 2")
            .then_some(body)
    })
    .await;
    assert!(
        body.contains("csi_attacher_queue_oldest_waiting_seconds{name=\"csi-attacher-va-detach\"}"),
        "{body}"
    );
    let pv = env.unique("pvnew");
    env.pv(&pv, "vol-d", json!({})).await;
    let va = env.unique("vanew");
    env.va(&va, &pv, &node).await;
    env.wait_attached(&va).await;
    // Attached while the detaches (5 s each, one at a time) are still going on.
    assert!(
        env.calls.count(Method::ControllerUnpublishVolume) < 3,
        "the attach waited for the detaches"
    );
    for va in &vas {
        env.wait_va_gone(va).await;
    }
}

/// Checklist 17: the Lease is `external-attacher-leader-<sanitised driver>`, its
/// `LeaderElection` event comes from `external-attacher-leader-<driver>/<host name>` (the
/// driver not sanitised, as csi-lib-utils names its recorder) and the leader attaches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_election_uses_upstreams_lease_name() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    let addr = free_local_addr();
    let _a = env.attacher(&[
        "--leader-election",
        &format!("--leader-election-namespace={}", env.ns),
        &format!("--http-endpoint={addr}"),
    ]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attached(&va).await;
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let name = format!("external-attacher-leader-{}", env.name.replace('.', "-"));
    let lease = leases.get(&name).await.unwrap();
    assert!(lease.spec.unwrap().holder_identity.is_some());
    let events: Api<Event> = Api::namespaced(env.client.clone(), &env.ns);
    let component = poll("the LeaderElection event", || async {
        let list = events
            .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
            .await
            .ok()?;
        list.items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("LeaderElection"))?
            .source?
            .component
    })
    .await;
    assert_eq!(
        component,
        format!(
            "external-attacher-leader-{}/{}",
            env.name,
            plugreg_sidecar_kit::leader::hostname()
        )
    );
    let (code, body) = poll("leader health", || async {
        http_get(addr, "/healthz/leader-election")
    })
    .await;
    assert_eq!((code, body.as_str()), (200, "ok"));
}

/// Checklist 15: with LIST_VOLUMES_PUBLISHED_NODES, a volume unpublished behind Kubernetes'
/// back is published again within `--reconcile-sync`, reading every page of `--max-entries`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciler_republishes_what_was_unpublished_behind_its_back() {
    let env = Env::new(KubeVersion::V1_36_2, |c| c.list_volumes = true).await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-c", json!({})).await;
    let a = env.attacher(&["--reconcile-sync=1s", "--max-entries=2"]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attached(&va).await;
    assert_eq!(env.calls.count(Method::ControllerPublishVolume), 1);
    // A third party detaches the volume in the driver.
    let conn = plugreg_csi_core::client::Connection::connect(
        &env.socket.display().to_string(),
        Duration::from_secs(5),
        Duration::from_secs(5),
        plugreg_csi_core::client::Retry::ONCE,
    )
    .await
    .unwrap();
    conn.controller()
        .controller_unpublish_volume(plugreg_proto::csi::v1::ControllerUnpublishVolumeRequest {
            volume_id: "vol-c".into(),
            node_id: NODE_ID.into(),
            secrets: Default::default(),
        })
        .await
        .unwrap();
    env.calls.wait_for(Method::ControllerPublishVolume, 2).await;
    // Six volumes at two a page: at least three ListVolumes calls per reconcile.
    let lists = env.calls.count(Method::ListVolumes);
    assert!(lists >= 3, "{lists}");
    let log = poll("the mismatch logged", || async {
        let log = a.log();
        log.contains("VolumeAttachment attached status and actual state do not match")
            .then_some(log)
    })
    .await;
    assert!(
        log.contains("CSI driver supports list volumes published nodes"),
        "{log}"
    );
    env.wait_attached(&va).await;
}

/// Checklist 14: a PV deleted while a VolumeAttachment names it keeps the finalizer; it goes
/// with the last VolumeAttachment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pv_finalizer_stays_while_a_volume_attachment_names_it() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    let a = env.attacher(&[]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attached(&va).await;
    env.pvs()
        .delete(&pv, &DeleteParams::default())
        .await
        .unwrap();
    // The PV's update (its deletion) is synced: the finalizer is kept.
    poll("the PV sync", || async {
        a.log()
            .lines()
            .any(|l| l.contains("finalizer kept") && l.contains(&pv))
            .then_some(())
    })
    .await;
    let fin = env.finalizer();
    let p = env.pvs().get(&pv).await.unwrap();
    assert!(p.metadata.finalizers.unwrap().contains(&fin));
    env.delete_va(&va).await;
    env.wait_va_gone(&va).await;
    env.wait_pv(&pv, "PV finalizer removed", |p| {
        !p.metadata.finalizers.as_ref().unwrap().contains(&fin)
    })
    .await;
}

/// Checklist 18: metric names and labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_have_upstreams_names() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    let addr = free_local_addr();
    let _a = env.attacher(&[&format!("--http-endpoint={addr}")]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attached(&va).await;
    let publish = format!(
        "csi_sidecar_operations_seconds_count{{driver_name=\"{}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/ControllerPublishVolume\"}} 1",
        env.name
    );
    let body = poll("publish in /metrics", || async {
        let (_, body) = http_get(addr, "/metrics")?;
        body.lines().any(|l| l == publish).then_some(body)
    })
    .await;
    for want in [
        "workqueue_adds_total{name=\"csi-attacher-va\"}",
        "workqueue_depth{name=\"csi-attacher-va\"}",
        "csi_attacher_queue_backlog{name=\"csi-attacher-va\"}",
        "csi_attacher_queue_backlog{name=\"csi-attacher-va-detach\"}",
        "csi_attacher_queue_backlog{name=\"csi-attacher-pv\"}",
        "csi_attacher_queue_oldest_waiting_seconds{name=\"csi-attacher-va\"}",
        "process_start_time_seconds",
    ] {
        assert!(body.contains(want), "{want}\n{body}");
    }
    assert!(
        !body.contains("migrated="),
        "no migrated label for other drivers"
    );
}

/// Checklist 17: with ReleaseLeaderElectionOnExit, SIGTERM stops the leader, clears the
/// Lease's holder and exits 1 (client-go's "Stopped leading"), as upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_on_exit_clears_the_lease_holder() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let mut a = env.attacher(&[
        "--leader-election",
        &format!("--leader-election-namespace={}", env.ns),
        "--feature-gates=ReleaseLeaderElectionOnExit=true",
    ]);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let name = format!("external-attacher-leader-{}", env.name.replace('.', "-"));
    poll("the Lease held", || async {
        let l = leases.get_opt(&name).await.ok().flatten()?;
        l.spec?.holder_identity.filter(|h| !h.is_empty())
    })
    .await;
    a.signal("TERM");
    assert_eq!(a.exit_code().await, 1, "{}", a.log());
    let lease = leases.get(&name).await.unwrap();
    let holder = lease.spec.unwrap().holder_identity.unwrap_or_default();
    assert!(holder.is_empty(), "holder {holder:?}");
    assert!(
        a.log()
            .contains("Received SIGTERM or SIGINT signal, shutting down controller.")
    );
}

/// Checklist 17 (ReleaseLeaderElectionOnExit): SIGTERM while a ControllerPublishVolume is in
/// the driver: the leader lets that sync finish (the VolumeAttachment is marked attached after
/// the signal) before it clears the Lease's holder and exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_on_exit_waits_for_the_running_publish() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::ControllerPublishVolume,
            Fault {
                delay: Some(Duration::from_secs(2)),
                ..Fault::default()
            },
        );
    })
    .await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    let mut a = env.attacher(&[
        "--leader-election",
        &format!("--leader-election-namespace={}", env.ns),
        "--feature-gates=ReleaseLeaderElectionOnExit=true",
    ]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.calls.wait_for(Method::ControllerPublishVolume, 1).await;
    a.signal("TERM");
    assert_eq!(a.exit_code().await, 1, "{}", a.log());
    let done = env.vas().get(&va).await.unwrap();
    assert!(
        done.status.is_some_and(|s| s.attached),
        "the running publish was finished and saved\n{}",
        a.log()
    );
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let name = format!("external-attacher-leader-{}", env.name.replace('.', "-"));
    let holder = leases
        .get(&name)
        .await
        .unwrap()
        .spec
        .unwrap()
        .holder_identity;
    assert_eq!(holder.as_deref(), Some(""), "released after the drain");
    assert_eq!(env.calls.count(Method::ControllerPublishVolume), 1);
}

/// Checklist 17 (ReleaseLeaderElectionOnExit): a second SIGTERM while the first one's shutdown
/// waits for a running publish (30 s in the driver; the wait would last up to 10 s) ends the
/// process at once with exit 1, as upstream, leaving the Lease to expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_does_not_wait_for_the_workers() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::ControllerPublishVolume,
            Fault {
                delay: Some(Duration::from_secs(30)),
                ..Fault::default()
            },
        );
    })
    .await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-a", json!({})).await;
    let mut a = env.attacher(&[
        "--leader-election",
        &format!("--leader-election-namespace={}", env.ns),
        "--feature-gates=ReleaseLeaderElectionOnExit=true",
        "--timeout=60s",
    ]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.calls.wait_for(Method::ControllerPublishVolume, 1).await;
    a.signal("TERM");
    poll("the first signal handled", || async {
        a.log()
            .contains("Received SIGTERM or SIGINT signal, shutting down controller.")
            .then_some(())
    })
    .await;
    let second = tokio::time::Instant::now();
    a.signal("TERM");
    assert_eq!(a.exit_code().await, 1, "{}", a.log());
    let took = second.elapsed();
    assert!(
        a.log().contains("Received a second signal, exiting"),
        "{}",
        a.log()
    );
    // Well before the drain would have ended (10 s after the first signal).
    assert!(
        took < plugreg_attacher::service::DRAIN - Duration::from_secs(2),
        "{took:?}"
    );
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let name = format!("external-attacher-leader-{}", env.name.replace('.', "-"));
    let holder = leases
        .get(&name)
        .await
        .unwrap()
        .spec
        .unwrap()
        .holder_identity;
    assert!(
        holder.is_some_and(|h| !h.is_empty()),
        "not released: the process did not wait"
    );
}

/// Checklist 5 and 6: a Block PV that many nodes write reaches the driver as a block
/// capability with MULTI_NODE_MULTI_WRITER, and the PV's `readOnly` is passed through to a
/// driver with PUBLISH_READONLY (the driver without it gets `false`: see `attach_and_detach`).
/// The test driver keeps volumes as directories and refuses a block capability with
/// FAILED_PRECONDITION: that refusal, stored as the attach error, is the end of this test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_volumes_and_publish_readonly_reach_the_driver() {
    let env = Env::new(KubeVersion::V1_36_2, |c| c.publish_readonly = true).await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(
        &pv,
        "vol-b",
        json!({"spec": {"volumeMode": "Block", "accessModes": ["ReadWriteMany"],
            "csi": {"readOnly": true}}}),
    )
    .await;
    let _a = env.attacher(&[]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    let failed = env
        .wait_attach_error(
            &va,
            "rpc error: code = FailedPrecondition desc = block volumes are not supported by this driver",
        )
        .await;
    assert!(!failed.status.unwrap().attached);
    let reqs = env.calls.publish_requests();
    let r = &reqs[0];
    assert!(
        r.readonly,
        "PUBLISH_READONLY: the PV's readOnly goes through"
    );
    let cap = r.volume_capability.as_ref().unwrap();
    assert!(
        matches!(cap.access_type, Some(AccessType::Block(_))),
        "{cap:?}"
    );
    assert_eq!(
        cap.access_mode.unwrap().mode,
        Mode::MultiNodeMultiWriter as i32
    );
}

/// Checklist 14: a finalizer another client adds to the PV after the attach survives the
/// attacher's own finalizer removal (the removal names only its own entry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_clients_pv_finalizer_is_not_undone() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-d", json!({})).await;
    let _a = env.attacher(&[]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attached(&va).await;
    let fin = env.finalizer();
    env.wait_pv(&pv, "our PV finalizer", |p| {
        p.metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.contains(&fin))
    })
    .await;
    // Another client adds its finalizer after ours (a JSON Patch append, as controllers do).
    env.pvs()
        .patch(
            &pv,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::<()>::Json(
                serde_json::from_value(json!([
                    {"op": "add", "path": "/metadata/finalizers/-", "value": "example.com/late"}
                ]))
                .unwrap(),
            ),
        )
        .await
        .unwrap();
    env.pvs()
        .delete(&pv, &DeleteParams::default())
        .await
        .unwrap();
    env.delete_va(&va).await;
    env.wait_va_gone(&va).await;
    let p = env
        .wait_pv(&pv, "our PV finalizer removed", |p| {
            !p.metadata.finalizers.as_ref().unwrap().contains(&fin)
        })
        .await;
    assert!(
        p.metadata
            .finalizers
            .unwrap()
            .contains(&"example.com/late".to_owned()),
        "the other client's finalizer stays"
    );
}

/// The attacher's PV finalizer removal, computed from a cached PV that another client's change
/// has since overtaken (the provisioner removes its own finalizer from a deleted PV in the same
/// second): the real API server applies it, removes only ours, and keeps what the other client
/// changed. Upstream's JSON Patch (`test` + `remove` at the cached index) is refused with 422
/// here and retried after a back-off.
async fn a_stale_pv_finalizer_removal_applies(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    let fin = env.finalizer();
    let pv = env.unique("pv");
    env.pv(
        &pv,
        "vol-e",
        json!({"metadata": {"finalizers": ["example.com/first", fin, "example.com/last"]}}),
    )
    .await;
    env.pvs()
        .delete(&pv, &DeleteParams::default())
        .await
        .unwrap();
    let cached = env.pvs().get(&pv).await.unwrap();
    assert!(cached.metadata.deletion_timestamp.is_some());
    // Another client removes the finalizer before ours: ours moves from index 1 to 0.
    env.pvs()
        .patch(
            &pv,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::<()>::Json(
                serde_json::from_value(json!([{"op": "remove", "path": "/metadata/finalizers/0"}]))
                    .unwrap(),
            ),
        )
        .await
        .unwrap();
    let patch = plugreg_attacher::decide::pv_remove_finalizer_patch(
        &cached,
        &fin,
        &env.name,
        std::iter::empty::<&str>(),
    )
    .expect("a deleted PV without attachments loses our finalizer");
    let after = env
        .pvs()
        .patch(
            &pv,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Strategic(&patch),
        )
        .await
        .expect("the removal applies to the changed list");
    // The API server's admission adds kubernetes.io/pv-protection; it stays too.
    let left = after.metadata.finalizers.unwrap_or_default();
    assert!(!left.contains(&fin), "ours is removed: {left:?}");
    assert!(
        left.contains(&"example.com/last".to_owned()),
        "the others stay: {left:?}"
    );
    assert!(
        !left.contains(&"example.com/first".to_owned()),
        "the other client's removal stays: {left:?}"
    );
    // The PV goes (the shared API server outlives the test).
    let _ = env
        .pvs()
        .patch(
            &pv,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_pv_finalizer_removal_applies_v1_20_2() {
    a_stale_pv_finalizer_removal_applies(KubeVersion::V1_20_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_pv_finalizer_removal_applies_v1_36_2() {
    a_stale_pv_finalizer_removal_applies(KubeVersion::V1_36_2).await;
}

/// Checklist 15: a failing ListVolumes is logged as upstream logs it, and the attacher goes
/// on: it neither exits nor stops attaching.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_list_volumes_is_logged_and_not_fatal() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.list_volumes = true;
        c.faults.insert(
            Method::ListVolumes,
            Fault {
                error: Some(Failure {
                    code: Code::Internal,
                    message: "backend unreachable".into(),
                }),
                ..Fault::default()
            },
        );
    })
    .await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let mut a = env.attacher(&["--reconcile-sync=1s"]);
    // Two reconciles have failed.
    env.calls.wait_for(Method::ListVolumes, 2).await;
    let log = poll("the failure logged", || async {
        let log = a.log();
        (log.matches("failed to ListVolumes").count() >= 2).then_some(log)
    })
    .await;
    assert!(log.contains("backend unreachable"), "{log}");
    let pv = env.unique("pv");
    env.pv(&pv, "vol-e", json!({})).await;
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attached(&va).await;
    assert!(
        a.running(),
        "a failing ListVolumes is not fatal\n{}",
        a.log()
    );
}

/// Checklist 18 (and migration checklist 1): a CSI-migration target's metrics carry
/// `migrated`, `false` on the publish, which concerns a CSI volume, and on the calls that
/// concern none (the Probe after the second connection), as csi-lib-utils records them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_targets_metrics_carry_migrated() {
    const TARGET: &str = "pd.csi.storage.gke.io";
    let mut env = Env::new(KubeVersion::V1_36_2, |c| c.name = TARGET.into()).await;
    env.name = TARGET.into();
    let node = env.unique("node");
    env.csinode(&node, &[(TARGET, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(&pv, "vol-f", json!({})).await;
    let addr = free_local_addr();
    let _a = env.attacher(&[&format!("--http-endpoint={addr}")]);
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attached(&va).await;
    let publish = format!(
        "csi_sidecar_operations_seconds_count{{driver_name=\"{TARGET}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/ControllerPublishVolume\",migrated=\"false\"}} 1"
    );
    let body = poll("publish in /metrics", || async {
        let (_, body) = http_get(addr, "/metrics")?;
        body.lines().any(|l| l == publish).then_some(body)
    })
    .await;
    let probe = format!(
        "csi_sidecar_operations_seconds_count{{driver_name=\"{TARGET}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/Probe\",migrated=\"false\"}}"
    );
    assert!(body.contains(&probe), "{body}");
}
