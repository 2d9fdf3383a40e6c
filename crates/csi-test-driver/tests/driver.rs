//! The driver on real sockets: in-process through the library, and as a process.

mod common;

use common::channel;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use plugreg_csi_test_driver::{Code, DriverConfig, Failure, Fault, Method, NodeCapability, start};
use plugreg_proto::csi::v1::identity_client::IdentityClient;
use plugreg_proto::csi::v1::node_client::NodeClient;
use plugreg_proto::csi::v1::{
    GetPluginCapabilitiesRequest, GetPluginInfoRequest, NodeGetCapabilitiesRequest,
    NodeGetInfoRequest, ProbeRequest, plugin_capability,
};

#[tokio::test]
async fn answers_from_its_config() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("csi.sock");
    let config = DriverConfig {
        name: "csi.example.com".into(),
        vendor_version: "1.2.3".into(),
        manifest: [("k".to_owned(), "v".to_owned())].into(),
        accessibility_constraints: true,
        node_id: "n7".into(),
        topology: [("zone".to_owned(), "a".to_owned())].into(),
        max_volumes_per_node: 16,
        node_capabilities: vec![NodeCapability::StageUnstageVolume],
        ..DriverConfig::default()
    };
    let driver = start(config, &path).await.unwrap();
    let ch = channel(&path).await;
    let mut identity = IdentityClient::new(ch.clone());
    let mut node = NodeClient::new(ch);

    let info = identity
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "csi.example.com");
    assert_eq!(info.vendor_version, "1.2.3");
    assert_eq!(info.manifest.get("k").map(String::as_str), Some("v"));

    let caps = identity
        .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 1);
    assert!(matches!(
        caps.capabilities[0].r#type,
        Some(plugin_capability::Type::Service(plugin_capability::Service { r#type }))
            if r#type == plugin_capability::service::Type::VolumeAccessibilityConstraints as i32
    ));
    let probe = identity.probe(ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.ready, Some(true));

    let ni = node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ni.node_id, "n7");
    assert_eq!(ni.max_volumes_per_node, 16);
    assert_eq!(
        ni.accessible_topology
            .unwrap()
            .segments
            .get("zone")
            .map(String::as_str),
        Some("a")
    );
    let ncaps = node
        .node_get_capabilities(NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ncaps.capabilities.len(), 1);

    let calls = driver.calls().clone();
    assert_eq!(calls.get_plugin_info(), 1);
    assert_eq!(calls.node_get_info(), 1);
    for m in &Method::ALL[..5] {
        assert_eq!(calls.count(*m), 1, "{m}");
    }
    for m in &Method::ALL[5..] {
        assert_eq!(calls.count(*m), 0, "{m}");
    }
    driver.stop().await.unwrap();
    assert!(!path.exists(), "stop removes the socket");
}

#[tokio::test]
async fn defaults_without_capabilities_or_topology() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("csi.sock");
    let driver = start(
        DriverConfig {
            node_id: String::new(),
            ..DriverConfig::default()
        },
        &path,
    )
    .await
    .unwrap();
    let ch = channel(&path).await;
    let caps = IdentityClient::new(ch.clone())
        .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(caps.capabilities.is_empty());
    let ni = NodeClient::new(ch)
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ni.node_id, "", "an empty node id is answered as is");
    assert!(ni.accessible_topology.is_none());
    driver.stop().await.unwrap();
}

#[tokio::test]
async fn fails_the_first_calls_then_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("csi.sock");
    let config = DriverConfig {
        get_plugin_info: Fault {
            error: Some(Failure::new(Code::Internal, "not yet")),
            fail_first: Some(2),
            ..Fault::default()
        },
        node_get_info: Fault {
            error: Some(Failure::new(Code::FailedPrecondition, "no node")),
            ..Fault::default()
        },
        ..DriverConfig::default()
    };
    let driver = start(config, &path).await.unwrap();
    let ch = channel(&path).await;
    let mut identity = IdentityClient::new(ch.clone());
    for _ in 0..2 {
        let err = identity
            .get_plugin_info(GetPluginInfoRequest {})
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Internal);
        assert_eq!(err.message(), "not yet");
    }
    assert!(
        identity
            .get_plugin_info(GetPluginInfoRequest {})
            .await
            .is_ok()
    );
    let mut node = NodeClient::new(ch);
    for _ in 0..2 {
        let err = node.node_get_info(NodeGetInfoRequest {}).await.unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "fails every call");
    }
    assert_eq!(driver.calls().get_plugin_info(), 3);
    assert_eq!(driver.calls().node_get_info(), 2);
    driver.stop().await.unwrap();
}

#[tokio::test]
async fn delays_only_the_first_calls_and_publishes_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("csi.sock");
    let delay = Duration::from_millis(300);
    let config = DriverConfig {
        get_plugin_info: Fault {
            delay: Some(delay),
            delay_first: Some(1),
            ..Fault::default()
        },
        ..DriverConfig::default()
    };
    let mut events = config.calls.subscribe();
    let driver = start(config, &path).await.unwrap();
    let mut identity = IdentityClient::new(channel(&path).await);

    let t = Instant::now();
    identity
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap();
    assert!(t.elapsed() >= delay, "first call is delayed");
    let t = Instant::now();
    identity
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap();
    assert!(t.elapsed() < delay, "second call is not delayed");

    let first = events.recv().await.unwrap();
    assert_eq!(
        (first.method, first.number, first.delay),
        (Method::GetPluginInfo, 1, Some(delay))
    );
    let second = events.recv().await.unwrap();
    assert_eq!((second.number, second.delay), (2, None));
    driver.stop().await.unwrap();
}

#[tokio::test]
async fn a_hanging_call_is_released_when_the_driver_stops() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("csi.sock");
    let config = DriverConfig {
        node_get_info: Fault {
            hang: true,
            ..Fault::default()
        },
        ..DriverConfig::default()
    };
    let calls = config.calls.clone();
    let driver = start(config, &path).await.unwrap();
    let mut node = NodeClient::new(channel(&path).await);
    let call = tokio::spawn(async move { node.node_get_info(NodeGetInfoRequest {}).await });
    tokio::time::timeout(
        Duration::from_secs(5),
        calls.wait_for(Method::NodeGetInfo, 1),
    )
    .await
    .expect("the call arrives");
    assert!(!call.is_finished(), "the call hangs");
    tokio::time::timeout(Duration::from_secs(5), driver.stop())
        .await
        .expect("stop is not held up by the hanging call")
        .unwrap();
    let err = call.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
}

#[tokio::test]
async fn replaces_a_stale_socket_and_refuses_a_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("csi.sock");
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let driver = start(DriverConfig::default(), &path).await.unwrap();
    IdentityClient::new(channel(&path).await)
        .probe(ProbeRequest {})
        .await
        .unwrap();
    driver.stop().await.unwrap();

    std::fs::write(&path, b"data").unwrap();
    let err = start(DriverConfig::default(), &path).await.unwrap_err();
    assert!(matches!(err, plugreg_csi_test_driver::Error::Bind(_)));
    assert_eq!(std::fs::read(&path).unwrap(), b"data");
}

/// Reads JSON lines from the child's stdout until one has `event` == `want`.
fn next_event(
    lines: &mut impl Iterator<Item = std::io::Result<String>>,
    want: &str,
) -> serde_json::Value {
    for line in lines {
        let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        if v["event"] == want {
            return v;
        }
    }
    panic!("stdout ended before a {want:?} event");
}

// Multi-threaded: the test blocks on the child's stdout and exit while the client's
// connection task must keep running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_reports_events_and_removes_its_socket_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("csi.sock");
    for signal in [rustix::process::Signal::TERM, rustix::process::Signal::INT] {
        let start = Instant::now();
        let mut child = Command::new(env!("CARGO_BIN_EXE_csi-test-driver"))
            .arg(format!("--endpoint=unix://{}", path.display()))
            .args(["--name", "bin.example.com", "--start-delay", "200ms"])
            .args(["--get-plugin-info-fail-first", "1"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let listening = next_event(&mut lines, "listening");
        assert!(start.elapsed() >= Duration::from_millis(200), "start delay");
        assert_eq!(listening["socket"], path.display().to_string());

        let mut identity = IdentityClient::new(channel(&path).await);
        let err = identity
            .get_plugin_info(GetPluginInfoRequest {})
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unavailable);
        let info = identity
            .get_plugin_info(GetPluginInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.name, "bin.example.com");
        let call = next_event(&mut lines, "call");
        assert_eq!(call["method"], "GetPluginInfo");
        assert_eq!(call["number"], 1);
        assert_eq!(call["error"], "injected failure");
        drop(identity);

        let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
        rustix::process::kill_process(pid, signal).unwrap();
        let status = tokio::task::spawn_blocking(move || child.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(status.success(), "{signal:?}: {status:?}");
        assert!(!path.exists(), "{signal:?} removes the socket");
    }
}

/// `--call-log`: every answered call is a line `<start µs> <end µs> <method>`, its start at or
/// before its end and both inside the time the client waited; two drivers share the file
/// without mixing their lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_writes_each_answered_call_to_the_call_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("calls.log");
    let micros = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros()
    };
    let mut children = Vec::new();
    let before = micros();
    for (n, delay) in [(1, "30ms"), (2, "0s")] {
        let path = dir.path().join(format!("csi-{n}.sock"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_csi-test-driver"))
            .arg(format!("--endpoint=unix://{}", path.display()))
            .arg(format!("--call-log={}", log.display()))
            .arg(format!("--fault=Probe:delay={delay}"))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        next_event(&mut lines, "listening");
        let mut identity = IdentityClient::new(channel(&path).await);
        identity.probe(ProbeRequest {}).await.unwrap();
        identity
            .get_plugin_info(GetPluginInfoRequest {})
            .await
            .unwrap();
        children.push(child);
    }
    let after = micros();
    for child in &mut children {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let calls: Vec<(u128, u128, &str)> = text
        .lines()
        .map(|line| {
            let mut f = line.split(' ');
            let start = f.next().unwrap().parse().unwrap();
            let end = f.next().unwrap().parse().unwrap();
            let method = f.next().unwrap();
            assert_eq!(f.next(), None, "{line}");
            (start, end, method)
        })
        .collect();
    let methods: Vec<&str> = calls.iter().map(|c| c.2).collect();
    assert_eq!(
        methods,
        ["Probe", "GetPluginInfo", "Probe", "GetPluginInfo"],
        "{text}"
    );
    for (start, end, _) in &calls {
        assert!(before <= *start && start <= end && *end <= after, "{text}");
    }
    // The first driver's Probe waited its 30 ms fault before answering.
    assert!(calls[0].1 - calls[0].0 >= 30_000, "{text}");
}

/// `strict_paths` looks at the paths the CO provides before the volume, as csi-test's mock
/// driver does: a staging path that does not exist, or a target whose parent does not exist,
/// is INTERNAL even for an unknown volume; with the paths in place the volume decides.
#[tokio::test]
async fn strict_paths_refuse_missing_paths_before_the_volume() {
    use plugreg_proto::csi::v1::{
        NodePublishVolumeRequest, NodeStageVolumeRequest, VolumeCapability, volume_capability,
    };
    let dir = tempfile::tempdir().unwrap();
    let cap = Some(VolumeCapability {
        access_type: Some(volume_capability::AccessType::Mount(Default::default())),
        access_mode: Some(volume_capability::AccessMode {
            mode: volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
    });
    let missing = dir.path().join("missing");
    let existing = dir.path().join("staging");
    std::fs::create_dir(&existing).unwrap();
    for strict in [true, false] {
        let path = dir.path().join(format!("csi-{strict}.sock"));
        let driver = start(
            DriverConfig {
                node_capabilities: vec![NodeCapability::StageUnstageVolume],
                strict_paths: strict,
                data_dir: Some(dir.path().join("data")),
                ..DriverConfig::default()
            },
            &path,
        )
        .await
        .unwrap();
        let mut node = NodeClient::new(channel(&path).await);
        let stage = |p: &Path| NodeStageVolumeRequest {
            volume_id: "unknown".into(),
            staging_target_path: p.display().to_string(),
            volume_capability: cap.clone(),
            ..Default::default()
        };
        let publish = |target: &Path, staging: &Path| NodePublishVolumeRequest {
            volume_id: "unknown".into(),
            staging_target_path: staging.display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: cap.clone(),
            ..Default::default()
        };
        fn code<T>(r: Result<T, tonic::Status>) -> Code {
            r.map(drop).unwrap_err().code()
        }
        let missing_path = if strict {
            Code::Internal
        } else {
            Code::NotFound
        };
        assert_eq!(
            code(node.node_stage_volume(stage(&missing)).await),
            missing_path
        );
        assert_eq!(
            code(node.node_stage_volume(stage(&existing)).await),
            Code::NotFound
        );
        let target_in_missing = missing.join("mount");
        let target = dir.path().join("mount");
        assert_eq!(
            code(
                node.node_publish_volume(publish(&target_in_missing, &existing))
                    .await
            ),
            missing_path
        );
        assert_eq!(
            code(node.node_publish_volume(publish(&target, &missing)).await),
            missing_path
        );
        assert_eq!(
            code(node.node_publish_volume(publish(&target, &existing)).await),
            Code::NotFound
        );
        driver.stop().await.unwrap();
    }
}
