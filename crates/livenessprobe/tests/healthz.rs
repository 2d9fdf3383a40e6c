//! `/healthz` against the real CSI test driver on a real Unix socket, with livenessprobe as a
//! real process: 200 from a healthy driver, 500 with upstream's bodies from a failing, a not
//! ready and a hanging driver (the hang answered once `--probe-timeout` runs out), concurrent
//! callers sharing one Probe, metrics where upstream serves them.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{Proc, SOON, args, driver, get, http};
use plugreg_csi_test_driver::{DriverConfig, Failure, Fault, Method};
use tonic::Code;

/// The driver's Probe misbehaves as `fault` says.
fn probe(fault: Fault) -> std::collections::BTreeMap<Method, Fault> {
    [(Method::Probe, fault)].into()
}

async fn blocking_get(addr: SocketAddr, path: &'static str) -> (u16, String) {
    tokio::task::spawn_blocking(move || get(addr, path))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_driver_gives_200_ok_and_any_method_works() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let d = driver(&socket, DriverConfig::default()).await;
    let p = Proc::spawn(&args(&socket, &[]));
    let addr = p.address("\"ServeMux listening\"");
    p.wait_for_line(
        &format!("\"CSI driver name\" driver=\"{}\"", common::DRIVER),
        SOON,
    );
    assert_eq!(blocking_get(addr, "/healthz").await, (200, "ok".into()));
    let (code, body) = tokio::task::spawn_blocking(move || http(addr, "POST", "/healthz"))
        .await
        .unwrap();
    assert_eq!((code, body.as_str()), (200, "ok"));
    assert_eq!(d.calls().count(Method::Probe), 2, "one Probe per check");
    p.wait_for_line("\"Health check succeeded\"", SOON);
    p.wait_for_line("\"Sending probe request to CSI driver\"", SOON);
    // Anything else is Go's 404; metrics are on the --http-endpoint server.
    assert_eq!(
        blocking_get(addr, "/healthz/").await,
        (404, "404 page not found\n".into())
    );
    let (code, metrics) = blocking_get(addr, "/metrics").await;
    assert_eq!(code, 200);
    for needle in [
        "csi_sidecar_operations_seconds_count{driver_name=\"csi.liveness.plugreg.io\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/Probe\"} 2",
        "csi_sidecar_operations_seconds_count{driver_name=\"unknown-driver\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/GetPluginInfo\"} 1",
        "process_start_time_seconds ",
    ] {
        assert!(metrics.contains(needle), "{needle} in\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_or_not_ready_driver_gives_500_with_upstreams_body() {
    let dir = tempfile::tempdir().unwrap();
    let failing = dir.path().join("failing.sock");
    let not_ready = dir.path().join("not-ready.sock");
    let _f = driver(
        &failing,
        DriverConfig {
            faults: probe(Fault {
                error: Some(Failure::new(Code::FailedPrecondition, "disk on fire")),
                ..Fault::default()
            }),
            ..DriverConfig::default()
        },
    )
    .await;
    let _n = driver(
        &not_ready,
        DriverConfig {
            ready: false,
            ..DriverConfig::default()
        },
    )
    .await;
    let pf = Proc::spawn(&args(&failing, &[]));
    let pn = Proc::spawn(&args(&not_ready, &[]));
    let (af, an) = (
        pf.address("\"ServeMux listening\""),
        pn.address("\"ServeMux listening\""),
    );
    assert_eq!(
        blocking_get(af, "/healthz").await,
        (
            500,
            "rpc error: code = FailedPrecondition desc = disk on fire".into()
        )
    );
    pf.wait_for_line("\"Health check failed\"", SOON);
    assert_eq!(
        blocking_get(an, "/healthz").await,
        (500, "driver responded but is not ready".into())
    );
    pn.wait_for_line("\"Driver responded but is not ready\"", SOON);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_driver_gives_500_when_the_probe_timeout_runs_out() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let _d = driver(
        &socket,
        DriverConfig {
            faults: probe(Fault {
                hang: true,
                ..Fault::default()
            }),
            ..DriverConfig::default()
        },
    )
    .await;
    let p = Proc::spawn(&args(&socket, &["--probe-timeout=700ms"]));
    let addr = p.address("\"ServeMux listening\"");
    let started = Instant::now();
    let answer = blocking_get(addr, "/healthz").await;
    let took = started.elapsed();
    assert_eq!(
        answer,
        (
            500,
            "rpc error: code = DeadlineExceeded desc = context deadline exceeded".into()
        )
    );
    // The driver never answers: only the probe timeout can have ended the check.
    assert!(took >= Duration::from_millis(700), "{took:?}");
    let (_, metrics) = blocking_get(addr, "/metrics").await;
    assert!(
        metrics.contains(
            "grpc_status_code=\"DeadlineExceeded\",method_name=\"/csi.v1.Identity/Probe\"} 1"
        ),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_gone_after_start_gives_500_context_deadline_exceeded() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let d = driver(&socket, DriverConfig::default()).await;
    let p = Proc::spawn(&args(&socket, &["--probe-timeout=300ms"]));
    let addr = p.address("\"ServeMux listening\"");
    assert_eq!(blocking_get(addr, "/healthz").await.0, 200);
    d.stop().await.unwrap();
    assert_eq!(
        blocking_get(addr, "/healthz").await,
        (500, "context deadline exceeded".into())
    );
    p.wait_for_line("\"Failed to establish connection to CSI driver\"", SOON);
    // The driver comes back: healthy again, without restarting the sidecar.
    let _d = driver(&socket, DriverConfig::default()).await;
    assert_eq!(blocking_get(addr, "/healthz").await, (200, "ok".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_share_one_probe() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    // A slow Probe keeps the first check in flight while the others arrive.
    let d = driver(
        &socket,
        DriverConfig {
            faults: probe(Fault {
                delay: Some(Duration::from_secs(2)),
                ..Fault::default()
            }),
            ..DriverConfig::default()
        },
    )
    .await;
    let p = Proc::spawn(&args(&socket, &["--probe-timeout=10s"]));
    let addr = p.address("\"ServeMux listening\"");
    let first = tokio::spawn(blocking_get(addr, "/healthz"));
    d.calls().wait_for(Method::Probe, 1).await;
    let others: Vec<_> = (0..7)
        .map(|_| tokio::spawn(blocking_get(addr, "/healthz")))
        .collect();
    assert_eq!(first.await.unwrap(), (200, "ok".into()));
    for o in others {
        assert_eq!(o.await.unwrap(), (200, "ok".into()));
    }
    assert_eq!(d.calls().count(Method::Probe), 1, "8 callers, one Probe");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_separate_metrics_server_serves_only_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let _d = driver(&socket, DriverConfig::default()).await;
    let p = Proc::spawn(&[
        format!("--csi-address=unix://{}", socket.display()),
        "--health-port=0".into(),
        "--metrics-address=127.0.0.1:0".into(),
        "--metrics-path=/m".into(),
    ]);
    let metrics = p.address("\"Separate metrics ServeMux listening\"");
    let health = p.address("\"ServeMux listening\"");
    assert_eq!(blocking_get(health, "/healthz").await, (200, "ok".into()));
    assert_eq!(
        blocking_get(health, "/m").await.0,
        404,
        "no metrics on the health port"
    );
    assert_eq!(blocking_get(metrics, "/healthz").await.0, 404);
    let (code, body) = blocking_get(metrics, "/m").await;
    assert_eq!(code, 200);
    assert!(
        body.contains("method_name=\"/csi.v1.Identity/Probe\"} 1"),
        "{body}"
    );
}
