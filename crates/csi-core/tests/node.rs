//! The node client against the CSI test driver on a real Unix socket, with real bind mounts:
//! the tests that check mounts need root (CI runs as root) and fail, saying so, without it. A
//! guard unmounts whatever is left under a test's temp dir, even when the test fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use plugreg_csi_core::check::{self, CheckOptions, Outcome};
use plugreg_csi_core::client::Retry;
use plugreg_csi_core::node::{NodeCapability, Step};
use plugreg_csi_core::{CallError, KubeletLayout, NodeClient, NodeError, VolumeSpec};
use plugreg_csi_test_driver::{Code, DriverConfig, Failure, Fault, Method, RunningDriver, start};
use plugreg_runtime::backoff::Backoff;

/// Unmounts every mount point under the directory on drop (deepest first), then removes it.
struct MountGuard {
    dir: tempfile::TempDir,
}

impl MountGuard {
    fn new() -> Self {
        Self {
            dir: tempfile::Builder::new()
                .prefix("plugreg-node-")
                .tempdir_in("/tmp")
                .unwrap(),
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

fn is_mounted(p: &Path) -> bool {
    plugreg_runtime::procfs::mount_points_under(p)
        .iter()
        .any(|m| m == p)
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        let mut left = plugreg_runtime::procfs::mount_points_under(self.dir.path());
        left.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for m in left {
            let _ = rustix::mount::unmount(&m, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

/// Real bind mounts need root; a test that checks them fails without it rather than pass
/// without checking.
fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test checks real bind mounts and needs root (CI runs the suite as root); \
         run it as root"
    );
}

async fn driver(dir: &Path, config: DriverConfig) -> RunningDriver {
    let config = DriverConfig {
        volumes: vec!["vol-a".into()],
        data_dir: Some(dir.join("data")),
        ..config
    };
    start(config, &dir.join("csi.sock")).await.unwrap()
}

fn caps_all() -> Vec<NodeCapability> {
    vec![
        NodeCapability::StageUnstageVolume,
        NodeCapability::GetVolumeStats,
        NodeCapability::ExpandVolume,
    ]
}

async fn client(d: &RunningDriver, timeout: Duration, retry: Retry) -> NodeClient {
    NodeClient::connect(
        &d.path().display().to_string(),
        Duration::from_secs(5),
        timeout,
        retry,
    )
    .await
    .unwrap()
}

fn quick_retry() -> Retry {
    Retry {
        attempts: 3,
        backoff: Backoff::new(Duration::from_millis(10), Duration::from_millis(50)),
    }
}

#[tokio::test]
async fn every_call_with_real_mounts_and_idempotent_repeats() {
    require_root();
    let g = MountGuard::new();
    let d = driver(
        g.path(),
        DriverConfig {
            node_capabilities: caps_all(),
            ..DriverConfig::default()
        },
    )
    .await;
    let c = client(&d, NodeClient::TIMEOUT, Retry::ONCE).await;
    assert!(c.stages());
    let layout = KubeletLayout::new(g.path().join("kubelet"));
    let spec = VolumeSpec::new("vol-a");
    let paths = c
        .paths(&layout, "csi.plugreg.test", &spec, "pod-1", "pv-a")
        .unwrap();
    let staging = paths.staging.clone().expect("the driver stages");
    assert!(staging.ends_with("globalmount"));
    assert!(
        paths
            .target
            .ends_with("pods/pod-1/volumes/kubernetes.io~csi/pv-a/mount")
    );

    c.mount(&spec, &paths).await.unwrap();
    // Idempotent: the whole sequence again succeeds and changes nothing.
    c.mount(&spec, &paths).await.unwrap();
    assert_eq!(d.calls().count(Method::NodeStageVolume), 2);
    assert_eq!(d.calls().count(Method::NodePublishVolume), 2);
    assert!(paths.target.is_dir());
    assert!(is_mounted(&staging), "staging is a bind mount");
    assert!(is_mounted(&paths.target), "target is a bind mount");
    assert_eq!(
        plugreg_runtime::procfs::mount_points_under(&paths.target).len(),
        1,
        "a repeat mounts nothing twice"
    );
    // What the pod writes lands in the volume.
    std::fs::write(paths.target.join("hello"), b"hi").unwrap();
    assert_eq!(
        std::fs::read(g.path().join("data/vol-a/hello")).unwrap(),
        b"hi"
    );

    let stats = c
        .stats("vol-a", &paths.target, Some(&staging))
        .await
        .unwrap();
    assert_eq!(stats.usage.len(), 2);
    assert!(stats.usage[0].total > 0);
    let size = c
        .expand(&spec, &paths.target, Some(&staging), 5 << 30)
        .await
        .unwrap();
    assert_eq!(size, 5 << 30);

    c.unmount("vol-a", &paths).await.unwrap();
    assert!(!paths.target.exists(), "the driver removed the target");
    assert!(
        !paths.target.parent().unwrap().exists(),
        "the client removed its parent"
    );
    assert!(!staging.exists(), "the client removed the staging dir");
    assert!(plugreg_runtime::procfs::mount_points_under(g.path()).is_empty());
    // Repeated: unpublish/unstage of what is gone is OK.
    c.unmount("vol-a", &paths).await.unwrap();
    assert_eq!(d.calls().count(Method::NodeUnstageVolume), 2);
    d.stop().await.unwrap();
}

#[tokio::test]
async fn readonly_publish_is_read_only() {
    require_root();
    let g = MountGuard::new();
    let d = driver(g.path(), DriverConfig::default()).await;
    let c = client(&d, NodeClient::TIMEOUT, Retry::ONCE).await;
    let mut spec = VolumeSpec::new("vol-a");
    spec.readonly = true;
    let paths = c
        .paths(
            &KubeletLayout::new(g.path()),
            "csi.plugreg.test",
            &spec,
            "p",
            "v",
        )
        .unwrap();
    c.mount(&spec, &paths).await.unwrap();
    let err = std::fs::write(paths.target.join("x"), b"x").unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(rustix::io::Errno::ROFS.raw_os_error())
    );
    // Another readonly flag at the same target is ALREADY_EXISTS.
    spec.readonly = false;
    let err = c.publish(&spec, None, &paths.target).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::AlreadyExists), "{err:?}");
    c.unmount("vol-a", &paths).await.unwrap();
    assert!(plugreg_runtime::procfs::mount_points_under(g.path()).is_empty());
}

#[tokio::test]
async fn capabilities_decide_what_is_called() {
    require_root();
    let g = MountGuard::new();
    // No node capabilities: no stage, no stats, no expand.
    let d = driver(g.path(), DriverConfig::default()).await;
    let c = client(&d, NodeClient::TIMEOUT, Retry::ONCE).await;
    assert!(!c.stages());
    let spec = VolumeSpec::new("vol-a");
    let paths = c
        .paths(
            &KubeletLayout::new(g.path()),
            "csi.plugreg.test",
            &spec,
            "p",
            "v",
        )
        .unwrap();
    assert_eq!(paths.staging, None);
    assert_eq!(
        c.stage(&spec, Path::new("/nowhere")).await.unwrap(),
        Step::Skipped
    );
    c.mount(&spec, &paths).await.unwrap();
    assert!(
        is_mounted(&paths.target),
        "published straight from the volume"
    );
    let err = c.stats("vol-a", &paths.target, None).await.unwrap_err();
    assert!(
        matches!(
            err,
            NodeError::Call(CallError::NotSupported {
                capability: "GET_VOLUME_STATS",
                ..
            })
        ),
        "{err:?}"
    );
    let err = c.expand(&spec, &paths.target, None, 1).await.unwrap_err();
    assert!(
        matches!(
            err,
            NodeError::Call(CallError::NotSupported {
                capability: "EXPAND_VOLUME",
                ..
            })
        ),
        "{err:?}"
    );
    c.unmount("vol-a", &paths).await.unwrap();
    for m in [
        Method::NodeStageVolume,
        Method::NodeUnstageVolume,
        Method::NodeGetVolumeStats,
        Method::NodeExpandVolume,
    ] {
        assert_eq!(d.calls().count(m), 0, "{m} must not be called");
    }
    assert_eq!(d.calls().count(Method::NodePublishVolume), 1);
    assert_eq!(d.calls().count(Method::NodeUnpublishVolume), 1);
    assert!(plugreg_runtime::procfs::mount_points_under(g.path()).is_empty());
}

#[tokio::test]
async fn the_spec_codes_reach_the_caller() {
    let g = MountGuard::new();
    let d = driver(
        g.path(),
        DriverConfig {
            node_capabilities: caps_all(),
            ..DriverConfig::default()
        },
    )
    .await;
    let c = client(&d, NodeClient::TIMEOUT, quick_retry()).await;
    let unknown = VolumeSpec::new("no-such-volume");
    let dir = g.path().join("staging");
    std::fs::create_dir(&dir).unwrap();
    let err = c.stage(&unknown, &dir).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound));
    let NodeError::Call(CallError::Rpc { attempts, .. }) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*attempts, 1, "NOT_FOUND is not retried");
    let err = c
        .publish(&VolumeSpec::new("vol-a"), None, &g.path().join("t"))
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(Code::FailedPrecondition),
        "no staging path for a staging driver: {err:?}"
    );
}

/// A fault on `method` and what the client must report.
struct Case {
    method: Method,
    fault: Fault,
    code: Code,
    attempts: u32,
}

#[tokio::test]
async fn injected_failures_surface_with_their_code() {
    let fail = |code, first| Fault {
        error: Some(Failure::new(code, "injected")),
        fail_first: first,
        ..Fault::default()
    };
    let cases = [
        // A final error: one call.
        Case {
            method: Method::NodeStageVolume,
            fault: fail(Code::Internal, None),
            code: Code::Internal,
            attempts: 1,
        },
        Case {
            method: Method::NodePublishVolume,
            fault: fail(Code::NotFound, None),
            code: Code::NotFound,
            attempts: 1,
        },
        // Transient every time: retried until the attempts run out.
        Case {
            method: Method::NodeUnpublishVolume,
            fault: fail(Code::ResourceExhausted, None),
            code: Code::ResourceExhausted,
            attempts: 3,
        },
        Case {
            method: Method::NodeUnstageVolume,
            fault: fail(Code::Unavailable, None),
            code: Code::Unavailable,
            attempts: 3,
        },
        // A hang: the call's deadline, then retried (the driver is idempotent).
        Case {
            method: Method::NodeGetVolumeStats,
            fault: Fault {
                hang: true,
                ..Fault::default()
            },
            code: Code::DeadlineExceeded,
            attempts: 3,
        },
        Case {
            method: Method::NodeExpandVolume,
            fault: fail(Code::FailedPrecondition, None),
            code: Code::FailedPrecondition,
            attempts: 1,
        },
    ];
    for case in cases {
        let g = MountGuard::new();
        let d = driver(
            g.path(),
            DriverConfig {
                node_capabilities: caps_all(),
                faults: BTreeMap::from([(case.method, case.fault.clone())]),
                ..DriverConfig::default()
            },
        )
        .await;
        let c = client(&d, Duration::from_millis(300), quick_retry()).await;
        let spec = VolumeSpec::new("vol-a");
        let paths = c
            .paths(
                &KubeletLayout::new(g.path()),
                "csi.plugreg.test",
                &spec,
                "p",
                "v",
            )
            .unwrap();
        let staging = paths.staging.clone().unwrap();
        let result = match case.method {
            Method::NodeStageVolume | Method::NodePublishVolume => c.mount(&spec, &paths).await,
            Method::NodeUnpublishVolume | Method::NodeUnstageVolume => {
                c.mount(&spec, &paths).await.unwrap();
                c.unmount("vol-a", &paths).await
            }
            Method::NodeGetVolumeStats => {
                c.mount(&spec, &paths).await.unwrap();
                c.stats("vol-a", &paths.target, Some(&staging))
                    .await
                    .map(drop)
            }
            _ => {
                c.mount(&spec, &paths).await.unwrap();
                c.expand(&spec, &paths.target, Some(&staging), 1)
                    .await
                    .map(drop)
            }
        };
        let err = result.expect_err(case.method.as_str());
        assert_eq!(err.code(), Some(case.code), "{}: {err:?}", case.method);
        let attempts = match &err {
            NodeError::Call(CallError::Rpc { attempts, .. })
            | NodeError::Call(CallError::Timeout { attempts, .. }) => *attempts,
            other => panic!("{other:?}"),
        };
        assert_eq!(attempts, case.attempts, "{}", case.method);
        assert_eq!(
            d.calls().count(case.method),
            u64::from(case.attempts),
            "{}: each attempt reached the driver",
            case.method
        );
        d.stop().await.unwrap();
        assert!(
            plugreg_runtime::procfs::mount_points_under(g.path()).is_empty(),
            "{}: the driver unmounts on stop",
            case.method
        );
    }
}

#[tokio::test]
async fn a_transient_failure_passes_on_the_repeat() {
    let g = MountGuard::new();
    let d = driver(
        g.path(),
        DriverConfig {
            node_capabilities: caps_all(),
            faults: BTreeMap::from([
                (
                    Method::NodeStageVolume,
                    Fault {
                        error: Some(Failure::new(Code::Aborted, "busy")),
                        fail_first: Some(2),
                        ..Fault::default()
                    },
                ),
                (
                    Method::NodePublishVolume,
                    Fault {
                        delay: Some(Duration::from_millis(50)),
                        ..Fault::default()
                    },
                ),
            ]),
            ..DriverConfig::default()
        },
    )
    .await;
    let c = client(&d, NodeClient::TIMEOUT, quick_retry()).await;
    let spec = VolumeSpec::new("vol-a");
    let paths = c
        .paths(
            &KubeletLayout::new(g.path()),
            "csi.plugreg.test",
            &spec,
            "p",
            "v",
        )
        .unwrap();
    c.mount(&spec, &paths).await.unwrap();
    assert_eq!(d.calls().count(Method::NodeStageVolume), 3);
    c.unmount("vol-a", &paths).await.unwrap();
    assert!(plugreg_runtime::procfs::mount_points_under(g.path()).is_empty());
}

fn check_options(g: &MountGuard, d: &RunningDriver, volume: Option<&str>) -> CheckOptions {
    let root = g.path().join("check");
    std::fs::create_dir(&root).unwrap();
    CheckOptions {
        endpoint: d.path().display().to_string(),
        controller_endpoint: None,
        volume_id: volume.map(str::to_owned),
        root,
        dial_timeout: Duration::from_secs(5),
        call_timeout: Duration::from_secs(2),
        capacity_bytes: 1 << 20,
        volume_context: Default::default(),
        publish_context: Default::default(),
    }
}

#[tokio::test]
async fn check_passes_on_the_test_driver() {
    for (controller, caps) in [(true, caps_all()), (false, Vec::new())] {
        let g = MountGuard::new();
        let d = driver(
            g.path(),
            DriverConfig {
                node_capabilities: caps.clone(),
                controller,
                ..DriverConfig::default()
            },
        )
        .await;
        let report = check::run(&check_options(&g, &d, Some("vol-a"))).await;
        assert!(report.passed(), "{report:#?}");
        let step = |name: &str| report.steps.iter().find(|s| s.step == name).cloned();
        if controller {
            assert_eq!(step("CreateVolume").unwrap().outcome, Outcome::Pass);
            assert_eq!(
                step("DeleteVolume repeated").unwrap().outcome,
                Outcome::Pass
            );
            assert_eq!(
                step("NodeStageVolume repeated").unwrap().outcome,
                Outcome::Pass
            );
            assert_eq!(d.calls().count(Method::DeleteVolume), 2);
        } else {
            assert_eq!(step("CreateVolume").unwrap().outcome, Outcome::Skip);
            assert_eq!(step("NodeStageVolume").unwrap().outcome, Outcome::Skip);
            assert_eq!(step("NodeGetVolumeStats").unwrap().outcome, Outcome::Skip);
            assert_eq!(step("NodePublishVolume").unwrap().outcome, Outcome::Pass);
        }
        d.stop().await.unwrap();
        assert!(plugreg_runtime::procfs::mount_points_under(g.path()).is_empty());
    }
}

/// csi-test's mock driver and csi-driver-host-path look at the paths the kubelet provides
/// before they look up the volume: a staging path that does not exist, or a target whose parent
/// does not exist, is INTERNAL, even for an unknown volume. The kubelet creates the staging
/// directory and the target's parent before NodeStageVolume and NodePublishVolume; so does the
/// check, in every step, so that such a driver passes.
#[tokio::test]
async fn check_passes_on_a_driver_that_checks_paths_first() {
    for (controller, caps) in [(true, caps_all()), (false, Vec::new())] {
        let g = MountGuard::new();
        let d = driver(
            g.path(),
            DriverConfig {
                node_capabilities: caps.clone(),
                controller,
                controller_publish: controller,
                strict_paths: true,
                ..DriverConfig::default()
            },
        )
        .await;
        let options = check_options(&g, &d, Some("vol-a"));
        let report = check::run(&options).await;
        let failed: Vec<_> = report.failures().collect();
        assert!(failed.is_empty(), "controller {controller}: {failed:#?}");
        assert!(report.passed());
        // The kubelet's clean-up: every directory it made is gone again.
        let left: Vec<_> = walk(&options.root);
        assert!(left.is_empty(), "left under the kubelet root: {left:?}");
        d.stop().await.unwrap();
        assert!(plugreg_runtime::procfs::mount_points_under(g.path()).is_empty());
    }
}

/// Every file and directory under `dir`, recursively.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p.clone());
            }
            out.push(p);
        }
    }
    out
}

/// A wrong driver still fails, and the kubelet's own steps show where: one whose
/// NodeUnpublishVolume always fails leaves the target mounted, so the kubelet's clean-up
/// cannot remove it, and NodeUnstageVolume of a volume still published fails.
#[tokio::test]
async fn check_fails_a_driver_that_never_unpublishes() {
    require_root();
    let g = MountGuard::new();
    let d = driver(
        g.path(),
        DriverConfig {
            node_capabilities: caps_all(),
            controller: true,
            strict_paths: true,
            faults: [(
                Method::NodeUnpublishVolume,
                Fault {
                    error: Some(Failure::new(Code::Internal, "injected")),
                    ..Fault::default()
                },
            )]
            .into(),
            ..DriverConfig::default()
        },
    )
    .await;
    let report = check::run(&check_options(&g, &d, Some("vol-a"))).await;
    assert!(!report.passed());
    let failed: Vec<&str> = report.failures().map(|s| s.step.as_str()).collect();
    assert!(failed.contains(&"NodeUnpublishVolume"), "{failed:?}");
    assert!(
        failed
            .iter()
            .any(|s| s.starts_with("remove ") && s.ends_with("mount after NodeUnpublishVolume")),
        "{failed:?}"
    );
    assert!(failed.contains(&"NodeUnstageVolume"), "{failed:?}");
    d.stop().await.unwrap();
}

#[tokio::test]
async fn check_fails_without_a_volume() {
    let g = MountGuard::new();
    let d = driver(g.path(), DriverConfig::default()).await;
    let report = check::run(&check_options(&g, &d, None)).await;
    assert!(!report.passed());
    let failed: Vec<_> = report.failures().map(|s| s.step.as_str()).collect();
    assert_eq!(failed, ["volume"]);
}

/// Where `name` is in the report (panics naming the report when absent).
fn position(report: &check::Report, name: &str) -> usize {
    report
        .steps
        .iter()
        .position(|s| s.step == name)
        .unwrap_or_else(|| panic!("no step {name:?} in {report:#?}"))
}

/// A Controller with PUBLISH_UNPUBLISH_VOLUME: the check publishes before the node calls and
/// unpublishes after NodeUnstageVolume, before DeleteVolume, and hands the publish_context to
/// every node call (the driver, like csi-test's mock, refuses stage and publish without it).
#[tokio::test]
async fn check_controller_publishes_around_the_node_calls() {
    let g = MountGuard::new();
    let d = driver(
        g.path(),
        DriverConfig {
            node_capabilities: caps_all(),
            controller: true,
            controller_publish: true,
            ..DriverConfig::default()
        },
    )
    .await;
    let report = check::run(&check_options(&g, &d, None)).await;
    assert!(report.passed(), "{report:#?}");
    let at = |name| position(&report, name);
    assert!(at("CreateVolume repeated (same name)") < at("ControllerPublishVolume"));
    assert!(at("ControllerPublishVolume") < at("ControllerPublishVolume repeated"));
    assert!(at("ControllerPublishVolume repeated") < at("NodeStageVolume without volume_id"));
    assert!(at("NodeUnstageVolume repeated") < at("ControllerUnpublishVolume"));
    assert!(at("ControllerUnpublishVolume") < at("ControllerUnpublishVolume repeated"));
    assert!(at("ControllerUnpublishVolume repeated") < at("DeleteVolume"));
    assert_eq!(
        report.steps[at("ControllerPublishVolume")].detail,
        "publish_context keys: device"
    );
    // The unknown-volume probes carry the publish_context too, so they get NOT_FOUND.
    assert_eq!(
        report.steps[at("NodeStageVolume of an unknown volume")]
            .code
            .as_deref(),
        Some("NOT_FOUND")
    );
    // The call and its repeat, then the five error-code probes (and two for unpublish).
    assert_eq!(d.calls().count(Method::ControllerPublishVolume), 7);
    assert_eq!(d.calls().count(Method::ControllerUnpublishVolume), 4);
    for (step, code) in [
        (
            "ControllerPublishVolume without volume_id",
            "INVALID_ARGUMENT",
        ),
        (
            "ControllerPublishVolume without node_id",
            "INVALID_ARGUMENT",
        ),
        (
            "ControllerPublishVolume without volume_capability",
            "INVALID_ARGUMENT",
        ),
        ("ControllerPublishVolume of an unknown volume", "NOT_FOUND"),
        ("ControllerPublishVolume to an unknown node", "NOT_FOUND"),
        (
            "ControllerUnpublishVolume without volume_id",
            "INVALID_ARGUMENT",
        ),
        ("ControllerUnpublishVolume of an unknown volume", "OK"),
    ] {
        assert_eq!(
            report.steps[at(step)].code.as_deref(),
            Some(code),
            "{step}: {report:#?}"
        );
    }
    d.stop().await.unwrap();
    assert!(plugreg_runtime::procfs::mount_points_under(g.path()).is_empty());
}

/// Without a Controller that publishes, `publish_context` supplies what the node calls need.
#[tokio::test]
async fn check_passes_the_callers_publish_context() {
    let g = MountGuard::new();
    // controller_publish without controller: the node requires the device, nobody publishes.
    let d = driver(
        g.path(),
        DriverConfig {
            node_capabilities: caps_all(),
            controller_publish: true,
            ..DriverConfig::default()
        },
    )
    .await;
    let mut opts = check_options(&g, &d, Some("vol-a"));
    let report = check::run(&opts).await;
    assert!(!report.passed());
    let failed = &report.steps[position(&report, "NodeStageVolume")];
    assert_eq!(
        failed.code.as_deref(),
        Some("INVALID_ARGUMENT"),
        "{failed:?}"
    );
    assert!(
        failed.detail.contains("'device' key required"),
        "{failed:?}"
    );

    opts.root = g.path().join("check2");
    std::fs::create_dir(&opts.root).unwrap();
    opts.publish_context = BTreeMap::from([("device".into(), "/dev/x".into())]);
    let report = check::run(&opts).await;
    assert!(report.passed(), "{report:#?}");
    d.stop().await.unwrap();
    assert!(plugreg_runtime::procfs::mount_points_under(g.path()).is_empty());
}

/// The driver's NodeExpandVolume looks the volume up before it checks volume_path (as
/// csi-driver-host-path does); the spec allows either order, so the missing-argument probe must
/// name the real volume and get INVALID_ARGUMENT.
#[tokio::test]
async fn check_missing_argument_probes_use_the_real_volume() {
    for controller in [false, true] {
        let g = MountGuard::new();
        let d = driver(
            g.path(),
            DriverConfig {
                node_capabilities: caps_all(),
                controller,
                ..DriverConfig::default()
            },
        )
        .await;
        let report = check::run(&check_options(&g, &d, Some("vol-a"))).await;
        assert!(report.passed(), "{report:#?}");
        let s = &report.steps[position(&report, "NodeExpandVolume without volume_path")];
        assert_eq!(s.code.as_deref(), Some("INVALID_ARGUMENT"));
        d.stop().await.unwrap();
    }
}

/// Without any volume the missing-argument probes name an unknown one and accept NOT_FOUND,
/// saying so in the step's name; only the missing volume fails.
#[tokio::test]
async fn check_without_a_volume_accepts_not_found_for_missing_arguments() {
    let g = MountGuard::new();
    let d = driver(
        g.path(),
        DriverConfig {
            node_capabilities: caps_all(),
            ..DriverConfig::default()
        },
    )
    .await;
    let report = check::run(&check_options(&g, &d, None)).await;
    let failed: Vec<_> = report.failures().map(|s| s.step.as_str()).collect();
    assert_eq!(failed, ["volume"]);
    let s = &report.steps[position(
        &report,
        "NodeExpandVolume without volume_path (unknown volume: NOT_FOUND accepted)",
    )];
    assert_eq!(
        (s.outcome, s.code.as_deref()),
        (Outcome::Pass, Some("NOT_FOUND"))
    );
}

/// tonic enforces the `grpc-timeout` it sends as well and then reports CANCELLED ("Timeout
/// expired") without a source; racing our own timer, either could win. Every timeout must
/// surface as DEADLINE_EXCEEDED all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_is_always_deadline_exceeded() {
    let g = MountGuard::new();
    let d = driver(
        g.path(),
        DriverConfig {
            node_capabilities: caps_all(),
            faults: BTreeMap::from([(
                Method::NodeUnpublishVolume,
                Fault {
                    hang: true,
                    ..Fault::default()
                },
            )]),
            ..DriverConfig::default()
        },
    )
    .await;
    let c = client(&d, Duration::from_millis(20), Retry::ONCE).await;
    let mut codes = BTreeMap::new();
    for _ in 0..100 {
        let err = c.unpublish("vol-a", &g.path().join("t")).await.unwrap_err();
        *codes.entry(format!("{:?}", err.code())).or_insert(0) += 1;
    }
    assert_eq!(
        codes,
        BTreeMap::from([("Some(DeadlineExceeded)".to_owned(), 100)])
    );
}

/// What a driver run without root does: directories, no mounts; the sequence is the same.
#[tokio::test]
async fn directory_mode_makes_directories_only() {
    let g = MountGuard::new();
    let d = driver(
        g.path(),
        DriverConfig {
            node_capabilities: caps_all(),
            mount: plugreg_csi_test_driver::MountMode::Directory,
            ..DriverConfig::default()
        },
    )
    .await;
    let c = client(&d, NodeClient::TIMEOUT, Retry::ONCE).await;
    let spec = VolumeSpec::new("vol-a");
    let paths = c
        .paths(
            &KubeletLayout::new(g.path()),
            "csi.plugreg.test",
            &spec,
            "p",
            "v",
        )
        .unwrap();
    c.mount(&spec, &paths).await.unwrap();
    assert!(paths.target.is_dir());
    assert!(plugreg_runtime::procfs::mount_points_under(g.path()).is_empty());
    c.unmount("vol-a", &paths).await.unwrap();
    assert!(!paths.target.exists());
}
