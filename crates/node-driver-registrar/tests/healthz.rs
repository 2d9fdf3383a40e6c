//! `/healthz` through the library, with the socket check turned off so that a missing or
//! hijacked socket stays that way while the test looks: upstream's codes and bodies, and an
//! answer within `--timeout` even when the socket never answers (R4).

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{DRIVER, KUBELET_PATH, healthy_driver, http_get};
use plugreg_node_driver_registrar::{Config, Progress, RunError, Sidecar};
use tokio_util::sync::CancellationToken;

const TIMEOUT: Duration = Duration::from_millis(500);

struct Running {
    _tmp: tempfile::TempDir,
    socket: PathBuf,
    http: std::net::SocketAddr,
    token: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), RunError>>,
    _driver: plugreg_csi_test_driver::RunningDriver,
}

async fn running() -> Running {
    let tmp = tempfile::tempdir().unwrap();
    let csi = tmp.path().join("csi.sock");
    let driver = healthy_driver(&csi).await;
    let config = Config {
        csi_address: csi.display().to_string(),
        kubelet_registration_path: KUBELET_PATH.into(),
        plugin_registration_path: tmp.path().display().to_string(),
        http_endpoint: "127.0.0.1:0".into(),
        timeout: TIMEOUT,
        socket_check_period: Duration::from_secs(3600),
        ..Config::default()
    };
    let sidecar = Sidecar::new(config);
    let mut progress = sidecar.progress();
    let token = CancellationToken::new();
    let task = tokio::spawn(sidecar.run(token.clone()));
    let p: Progress = tokio::time::timeout(
        Duration::from_secs(10),
        progress.wait_for(|p| p.http_address.is_some()),
    )
    .await
    .expect("the sidecar starts")
    .unwrap()
    .clone();
    Running {
        socket: p.socket.unwrap(),
        http: p.http_address.unwrap(),
        _tmp: tmp,
        token,
        task,
        _driver: driver,
    }
}

/// GET /healthz off the runtime thread; returns (code, body, how long it took).
async fn healthz(r: &Running) -> (u16, String, Duration) {
    let addr = r.http;
    tokio::task::spawn_blocking(move || {
        let t = Instant::now();
        let (code, body) = http_get(addr, "/healthz", Duration::from_secs(30));
        (code, body, t.elapsed())
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_is_ok_while_serving_and_404_when_the_socket_is_gone() {
    let r = running().await;
    assert_eq!(
        r.socket,
        PathBuf::from(format!("{}/{DRIVER}-reg.sock", r._tmp.path().display()))
    );
    let (code, body, _) = healthz(&r).await;
    assert_eq!((code, body.as_str()), (200, "ok"));

    std::fs::remove_file(&r.socket).unwrap();
    let (code, body, _) = healthz(&r).await;
    assert_eq!(
        (code, body.as_str()),
        (404, "registration socket does not exist")
    );

    std::fs::write(&r.socket, b"x").unwrap();
    let (code, body, _) = healthz(&r).await;
    assert_eq!(code, 500);
    assert_eq!(
        body,
        format!(
            "file exists in socketPath {} but it's not a socket",
            r.socket.display()
        )
    );
    std::fs::remove_file(&r.socket).unwrap();

    r.token.cancel();
    r.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_within_the_timeout_when_the_socket_never_answers() {
    let r = running().await;
    // Take the path over with a socket that is listening but never accepts or answers.
    std::fs::remove_file(&r.socket).unwrap();
    let _hijacker = std::os::unix::net::UnixListener::bind(&r.socket).unwrap();
    for _ in 0..2 {
        let (code, body, took) = healthz(&r).await;
        assert_eq!(code, 500, "{body}");
        assert!(
            body.starts_with("error connecting to node-registrar socket")
                || body.starts_with("error getting info from node-registrar socket"),
            "{body}"
        );
        assert!(body.ends_with("context deadline exceeded"), "{body}");
        assert!(took >= TIMEOUT - Duration::from_millis(50), "{took:?}");
        assert!(
            took < TIMEOUT + Duration::from_millis(400),
            "{took:?}: bounded by --timeout"
        );
    }
    r.token.cancel();
    r.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_reports_a_socket_that_answers_another_name() {
    let r = running().await;
    std::fs::remove_file(&r.socket).unwrap();
    let other = plugreg_registrar::Registrar::new(plugreg_registrar::PluginInfo {
        name: "other.example.com".into(),
        ..Default::default()
    });
    let token = CancellationToken::new();
    let serving = tokio::spawn({
        let (s, t) = (r.socket.clone(), token.clone());
        async move { other.serve(&s, Default::default(), t).await }
    });
    common::wait_until(Duration::from_secs(5), "the other socket", || {
        common::is_socket(&r.socket)
    });
    let (code, body, _) = healthz(&r).await;
    assert_eq!(
        (code, body.as_str()),
        (500, "invalid driver name other.example.com")
    );
    token.cancel();
    serving.await.unwrap().unwrap();
    r.token.cancel();
    r.task.await.unwrap().unwrap();
}

/// A registration socket that answers GetInfo slowly and counts the calls.
#[derive(Clone)]
struct SlowRegistration {
    get_info_calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    delay: Duration,
}

#[tonic::async_trait]
impl plugreg_proto::pluginregistration::registration_server::Registration for SlowRegistration {
    async fn get_info(
        &self,
        _: tonic::Request<plugreg_proto::pluginregistration::InfoRequest>,
    ) -> Result<tonic::Response<plugreg_proto::pluginregistration::PluginInfo>, tonic::Status> {
        self.get_info_calls
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(self.delay).await;
        Ok(tonic::Response::new(
            plugreg_proto::pluginregistration::PluginInfo {
                name: DRIVER.into(),
                ..Default::default()
            },
        ))
    }

    async fn notify_registration_status(
        &self,
        _: tonic::Request<plugreg_proto::pluginregistration::RegistrationStatus>,
    ) -> Result<
        tonic::Response<plugreg_proto::pluginregistration::RegistrationStatusResponse>,
        tonic::Status,
    > {
        Ok(tonic::Response::new(Default::default()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_healthz_callers_share_one_check() {
    const CALLERS: usize = 40;
    let r = running().await;
    // Serve the path with a registration server that takes 300 ms per GetInfo and counts them.
    std::fs::remove_file(&r.socket).unwrap();
    let slow = SlowRegistration {
        get_info_calls: Default::default(),
        delay: Duration::from_millis(300),
    };
    let calls = slow.get_info_calls.clone();
    let bound = plugreg_transport::bind(&r.socket).unwrap();
    let stop = CancellationToken::new();
    let server = tokio::spawn(plugreg_transport::serve(
        plugreg_transport::server().add_service(
            plugreg_proto::pluginregistration::registration_server::RegistrationServer::new(slow),
        ),
        bound,
        stop.clone().cancelled_owned(),
    ));

    let addr = r.http;
    let answers = tokio::task::spawn_blocking(move || {
        let start = std::sync::Arc::new(std::sync::Barrier::new(CALLERS));
        let threads: Vec<_> = (0..CALLERS)
            .map(|_| {
                let start = start.clone();
                std::thread::spawn(move || {
                    start.wait();
                    http_get(addr, "/healthz", Duration::from_secs(30))
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join()).collect::<Vec<_>>()
    })
    .await
    .unwrap();
    if answers.iter().any(Result::is_err) {
        // Say why (the suite once saw "connection refused" here): did the sidecar stop?
        let ended = if r.task.is_finished() {
            format!("the sidecar had stopped: {:?}", r.task.await)
        } else {
            "the sidecar still ran".to_owned()
        };
        panic!("a /healthz caller failed to get an answer; {ended}");
    }
    let answers: Vec<(u16, String)> = answers.into_iter().map(Result::unwrap).collect();
    let checks = calls.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        checks <= CALLERS / 8,
        "{CALLERS} concurrent /healthz callers made {checks} GetInfo calls"
    );
    for (code, body) in &answers {
        assert_eq!((*code, body.as_str()), (200, "ok"));
    }
    stop.cancel();
    server.await.unwrap().unwrap();
    r.token.cancel();
    r.task.await.unwrap().unwrap();
}
