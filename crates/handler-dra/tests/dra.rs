//! The DRA handler against real DRA drivers (plugreg-dra on real Unix sockets), alone and inside a
//! real plugin manager.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use plugreg_dra::{
    Claim, Config, DeviceHealth, DeviceIdentifier, Driver, DriverError, HealthStatus,
    PrepareResult, async_trait,
};
use plugreg_handler_dra::DraHandler;
use plugreg_manager::{HandlerRegistry, ManagerConfig, PluginHandler, PluginManager};
use plugreg_proto::pluginregistration::PluginInfo;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const SOON: Duration = Duration::from_secs(10);

/// A driver that answers one device named after its tag per claim, or hangs.
struct TestDriver {
    tag: String,
    hang: bool,
    calls: Mutex<Vec<String>>,
    health: Option<watch::Receiver<Vec<DeviceHealth>>>,
}

impl TestDriver {
    fn new(tag: &str) -> Self {
        Self {
            tag: tag.into(),
            hang: false,
            calls: Mutex::new(Vec::new()),
            health: None,
        }
    }
}

#[async_trait]
impl Driver for TestDriver {
    async fn prepare(
        &self,
        claims: Vec<Claim>,
    ) -> Result<HashMap<String, PrepareResult>, DriverError> {
        self.calls.lock().unwrap().push("prepare".into());
        if self.hang {
            std::future::pending::<()>().await;
        }
        Ok(claims
            .into_iter()
            .map(|c| {
                let d = plugreg_dra::Device {
                    request_names: vec!["req/sub".into()],
                    pool_name: "pool".into(),
                    device_name: self.tag.clone(),
                    cdi_device_ids: vec![format!("example.com/dev={}", c.name)],
                    share_id: Some("s1".into()),
                };
                (c.uid, Ok(vec![d]))
            })
            .collect())
    }

    async fn unprepare(
        &self,
        claims: Vec<Claim>,
    ) -> Result<HashMap<String, Result<(), String>>, DriverError> {
        self.calls.lock().unwrap().push("unprepare".into());
        if self.hang {
            std::future::pending::<()>().await;
        }
        Ok(claims
            .into_iter()
            .map(|c| {
                let r = if c.name == "bad" {
                    Err("cannot unprepare".to_owned())
                } else {
                    Ok(())
                };
                (c.uid, r)
            })
            .collect())
    }

    fn health(&self) -> Option<watch::Receiver<Vec<DeviceHealth>>> {
        self.health.clone()
    }
}

fn claim(uid: &str, name: &str) -> Claim {
    Claim {
        namespace: "ns".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

fn config(dir: &Path, driver: &str) -> Config {
    let mut c = Config::new(driver);
    c.registry_dir = dir.join("registry");
    c.plugin_dir = dir.join("plugins").join(driver);
    std::fs::create_dir_all(&c.registry_dir).unwrap();
    std::fs::create_dir_all(&c.plugin_dir).unwrap();
    c
}

async fn manager(dir: &Path, handler: &DraHandler, token: &CancellationToken) -> PluginManager {
    let mut c = ManagerConfig::new(dir.join("registry"));
    c.liveness = None;
    let handlers = HandlerRegistry::new().with("DRAPlugin", Arc::new(handler.clone()));
    PluginManager::start(c, handlers, token.clone())
        .await
        .unwrap()
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + SOON;
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn registered(p: &plugreg_dra::Plugin) {
    let mut s = p.registrar().status();
    tokio::time::timeout(SOON, s.wait_for(|s| s.is_registered()))
        .await
        .expect("registered in time")
        .unwrap();
}

/// A registrar advertising `versions` for a DRAPlugin; returns the error the manager sent back.
async fn rejected(dir: &Path, file: &str, versions: &[&str], token: &CancellationToken) -> String {
    let r = plugreg_registrar::Registrar::new(PluginInfo {
        r#type: "DRAPlugin".into(),
        name: "bad.example.com".into(),
        endpoint: "/run/bad/dra.sock".into(),
        supported_versions: versions.iter().map(|v| v.to_string()).collect(),
    });
    let sock = dir.join("registry").join(file);
    tokio::spawn({
        let (r, t) = (r.clone(), token.clone());
        async move { r.serve(&sock, Default::default(), t).await.unwrap() }
    });
    let mut s = r.status();
    let st = tokio::time::timeout(SOON, s.wait_for(|s| s.rejected_total > 0))
        .await
        .unwrap()
        .unwrap()
        .clone();
    st.last.unwrap().error
}

#[tokio::test]
async fn every_validation_text_reaches_the_plugin_and_call_errors_are_upstreams() {
    let dir = tempfile::tempdir().unwrap();
    let token = CancellationToken::new();
    let handler = DraHandler::new();
    std::fs::create_dir_all(dir.path().join("registry")).unwrap();
    let _m = manager(dir.path(), &handler, &token).await;

    assert_eq!(
        rejected(dir.path(), "empty.sock", &[], &token).await,
        "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions of DRA driver plugin bad.example.com at endpoint /run/bad/dra.sock: empty list of supported gRPC services (aka supported versions)"
    );
    assert_eq!(
        rejected(
            dir.path(),
            "none.sock",
            &["1.0.0", "v1alpha1.DRAResourceHealth"],
            &token
        )
        .await,
        r#"RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions of DRA driver plugin bad.example.com at endpoint /run/bad/dra.sock: none of services supported by the plugin (["1.0.0" "v1alpha1.DRAResourceHealth"]) are supported by the kubelet (["v1.DRAPlugin" "v1beta1.DRAPlugin"])"#
    );

    // The same (driver, endpoint) twice; unreachable endpoints are still registered.
    let v = vec!["v1.DRAPlugin".to_owned()];
    handler
        .register("x.example.com", "/nowhere/dra.sock", &v)
        .await
        .unwrap();
    let err = handler
        .register("x.example.com", "/nowhere/dra.sock", &v)
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "endpoint /nowhere/dra.sock already registered for DRA driver plugin x.example.com"
    );
    let e = handler
        .prepare("", vec![claim("u", "n")])
        .await
        .unwrap_err();
    assert_eq!(e.message(), "DRA driver name is empty");
    let e = handler.prepare("y.example.com", vec![]).await.unwrap_err();
    assert_eq!(e.message(), "DRA driver y.example.com is not registered");
    // Disconnected: fails at once with Unavailable rather than waiting 45 s.
    until("dial failed", || {
        handler
            .details("x.example.com", "/nowhere/dra.sock")
            .unwrap()
            .connection
            == "disconnected"
    })
    .await;
    let e = handler
        .prepare("x.example.com", vec![claim("u", "n")])
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    token.cancel();
}

#[tokio::test]
async fn prepare_and_unprepare_reach_the_driver_through_a_real_manager_v1_and_v1beta1() {
    let dir = tempfile::tempdir().unwrap();
    let token = CancellationToken::new();
    let handler = DraHandler::new();
    let c1 = config(dir.path(), "one.example.com");
    let mut c2 = config(dir.path(), "two.example.com");
    c2.node_v1 = false;
    let _m = manager(dir.path(), &handler, &token).await;
    let p1 = plugreg_dra::start(Arc::new(TestDriver::new("d1")), c1, token.clone())
        .await
        .unwrap();
    let p2 = plugreg_dra::start(Arc::new(TestDriver::new("d2")), c2, token.clone())
        .await
        .unwrap();
    registered(&p1).await;
    registered(&p2).await;

    for (driver, dev, service, share) in [
        ("one.example.com", "d1", "v1.DRAPlugin", Some("s1")),
        ("two.example.com", "d2", "v1beta1.DRAPlugin", None),
    ] {
        let r = handler
            .prepare(driver, vec![claim("uid-1", "c1"), claim("uid-2", "c2")])
            .await
            .unwrap();
        assert_eq!(r.claims.len(), 2);
        let got = &r.claims["uid-1"];
        assert_eq!(got.error, "");
        assert_eq!(got.devices[0].device_name, dev);
        assert_eq!(got.devices[0].request_names, ["req"], "subrequest stripped");
        assert_eq!(got.devices[0].cdi_device_ids, ["example.com/dev=c1"]);
        assert_eq!(got.devices[0].share_id.as_deref(), share);
        let r = handler
            .unprepare(driver, vec![claim("uid-1", "c1"), claim("uid-3", "bad")])
            .await
            .unwrap();
        assert_eq!(r.claims["uid-1"].error, "");
        assert_eq!(r.claims["uid-3"].error, "cannot unprepare");
        let endpoint = if driver.starts_with("one") {
            p1.plugin_socket()
        } else {
            p2.plugin_socket()
        };
        let d = handler
            .details(driver, &endpoint.display().to_string())
            .unwrap();
        assert_eq!(
            (d.service.as_str(), d.connection.as_str(), d.serving),
            (service, "connected", true)
        );
    }
    let m = handler.render_metrics();
    for line in [
        r#"plugreg_dra_calls_total{driver_name="one.example.com",method_name="NodePrepareResources",grpc_status_code="OK"} 1"#,
        r#"plugreg_dra_calls_total{driver_name="two.example.com",method_name="NodeUnprepareResources",grpc_status_code="OK"} 1"#,
        r#"plugreg_dra_instances{driver_name="one.example.com",connected="true"} 1"#,
    ] {
        assert!(m.contains(line), "{line} missing in\n{m}");
    }
    token.cancel();
}

#[tokio::test]
async fn rolling_update_the_newest_connected_instance_serves_and_the_older_goes_away() {
    let dir = tempfile::tempdir().unwrap();
    let token = CancellationToken::new();
    let handler = DraHandler::new();
    let _m = manager(dir.path(), &handler, &token).await;
    let driver = "gpu.example.com";
    let mut old_cfg = config(dir.path(), driver);
    old_cfg.rolling_update = Some("pod-old".into());
    let mut new_cfg = old_cfg.clone();
    new_cfg.rolling_update = Some("pod-new".into());
    let old_token = token.child_token();
    let old = plugreg_dra::start(Arc::new(TestDriver::new("old")), old_cfg, old_token.clone())
        .await
        .unwrap();
    registered(&old).await;
    let new = plugreg_dra::start(Arc::new(TestDriver::new("new")), new_cfg, token.clone())
        .await
        .unwrap();
    registered(&new).await;
    assert_ne!(old.plugin_socket(), new.plugin_socket());
    let old_ep = old.plugin_socket().display().to_string();
    let new_ep = new.plugin_socket().display().to_string();
    until("both connected", || {
        handler
            .details(driver, &new_ep)
            .is_some_and(|d| d.connection == "connected")
            && handler
                .details(driver, &old_ep)
                .is_some_and(|d| d.connection == "connected")
    })
    .await;
    let dev = |r: plugreg_proto::dra::v1::NodePrepareResourcesResponse| {
        r.claims["u"].devices[0].device_name.clone()
    };
    assert_eq!(
        dev(handler
            .prepare(driver, vec![claim("u", "c")])
            .await
            .unwrap()),
        "new"
    );
    assert!(handler.details(driver, &new_ep).unwrap().serving);
    assert!(!handler.details(driver, &old_ep).unwrap().serving);

    // The old pod goes away: its sockets are removed and the manager deregisters it.
    old_token.cancel();
    until("old instance deregistered", || {
        handler.details(driver, &old_ep).is_none()
    })
    .await;
    assert_eq!(
        dev(handler
            .prepare(driver, vec![claim("u", "c")])
            .await
            .unwrap()),
        "new"
    );

    // A newer instance that is not connected does not serve: the connected older one does.
    let v = vec!["v1.DRAPlugin".to_owned()];
    handler
        .register(driver, "/nowhere/dra-newest.sock", &v)
        .await
        .unwrap();
    assert_eq!(handler.serving_endpoint(driver).unwrap(), new_ep);
    assert_eq!(
        dev(handler
            .prepare(driver, vec![claim("u", "c")])
            .await
            .unwrap()),
        "new"
    );
    token.cancel();
}

#[tokio::test]
async fn a_lost_connection_is_noticed_without_a_call() {
    let dir = tempfile::tempdir().unwrap();
    let token = CancellationToken::new();
    let handler = DraHandler::new();
    let p = plugreg_dra::start(
        Arc::new(TestDriver::new("d")),
        config(dir.path(), "d.example.com"),
        token.clone(),
    )
    .await
    .unwrap();
    let ep = p.plugin_socket().display().to_string();
    handler
        .register("d.example.com", &ep, &["v1.DRAPlugin".to_owned()])
        .await
        .unwrap();
    until("connected", || {
        handler.details("d.example.com", &ep).unwrap().connection == "connected"
    })
    .await;
    token.cancel();
    p.stopped().await;
    until("disconnected", || {
        handler.details("d.example.com", &ep).unwrap().connection == "disconnected"
    })
    .await;
    handler.deregister("d.example.com", &ep).await;
    assert!(handler.details("d.example.com", &ep).is_none());
}

#[tokio::test]
async fn a_plugin_that_hangs_in_each_call_gets_deadline_exceeded() {
    let dir = tempfile::tempdir().unwrap();
    let token = CancellationToken::new();
    let handler = DraHandler::with_timeouts(Duration::from_millis(300), Duration::from_secs(5));
    let mut driver = TestDriver::new("d");
    driver.hang = true;
    let driver = Arc::new(driver);
    let p = plugreg_dra::start(
        driver.clone(),
        config(dir.path(), "hang.example.com"),
        token.clone(),
    )
    .await
    .unwrap();
    let ep = p.plugin_socket().display().to_string();
    handler
        .register("hang.example.com", &ep, &["v1.DRAPlugin".to_owned()])
        .await
        .unwrap();
    let e = handler
        .prepare("hang.example.com", vec![claim("u", "c")])
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    // Serialised calls: the hung prepare released the lock when its call was cancelled.
    let e = handler
        .unprepare("hang.example.com", vec![claim("u", "c")])
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    until("driver saw both calls", || {
        driver.calls.lock().unwrap().len() == 2
    })
    .await;
    let m = handler.render_metrics();
    for method in ["NodePrepareResources", "NodeUnprepareResources"] {
        let line = format!(
            r#"plugreg_dra_calls_total{{driver_name="hang.example.com",method_name="{method}",grpc_status_code="DeadlineExceeded"}} 1"#
        );
        assert!(m.contains(&line), "{line} missing in\n{m}");
    }
    token.cancel();
}

#[tokio::test]
async fn device_health_from_the_stream_is_shown_and_stale_reports_are_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let token = CancellationToken::new();
    let handler = DraHandler::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let dh = |dev: &str, h: HealthStatus, t: i64, msg: &str| DeviceHealth {
        device: Some(DeviceIdentifier {
            pool_name: "pool".into(),
            device_name: dev.into(),
        }),
        health: h as i32,
        last_updated_time: t,
        health_check_timeout_seconds: 0,
        message: msg.into(),
    };
    let (tx, rx) = watch::channel(vec![dh("gpu0", HealthStatus::Healthy, now, "")]);
    let mut driver = TestDriver::new("d");
    driver.health = Some(rx);
    let cfg = config(dir.path(), "h.example.com");
    let _m = manager(dir.path(), &handler, &token).await;
    let p = plugreg_dra::start(Arc::new(driver), cfg, token.clone())
        .await
        .unwrap();
    assert_eq!(
        p.registrar().info().supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth"
        ]
    );
    registered(&p).await;
    let ep = p.plugin_socket().display().to_string();
    let health = |h: &DraHandler| {
        h.details("h.example.com", &ep)
            .map(|d| {
                d.devices
                    .iter()
                    .map(|d| format!("{}/{}={}:{}", d.pool, d.device, d.health, d.message))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    until("healthy", || health(&handler) == ["pool/gpu0=Healthy:"]).await;
    tx.send_replace(vec![
        dh("gpu0", HealthStatus::Unhealthy, now, "ECC errors"),
        dh("gpu1", HealthStatus::Healthy, now - 3600, "old"),
    ]);
    until("updated", || {
        health(&handler) == ["pool/gpu0=Unhealthy:ECC errors", "pool/gpu1=Unknown:old"]
    })
    .await;
    token.cancel();
}

/// Counts calls in flight across drivers; remembers the most at once.
#[derive(Default)]
struct Overlap {
    now: std::sync::atomic::AtomicUsize,
    max: std::sync::atomic::AtomicUsize,
}

struct SlowDriver(Arc<Overlap>);

#[async_trait]
impl Driver for SlowDriver {
    async fn prepare(
        &self,
        claims: Vec<Claim>,
    ) -> Result<HashMap<String, PrepareResult>, DriverError> {
        use std::sync::atomic::Ordering::SeqCst;
        let n = self.0.now.fetch_add(1, SeqCst) + 1;
        self.0.max.fetch_max(n, SeqCst);
        tokio::time::sleep(Duration::from_millis(100)).await;
        self.0.now.fetch_sub(1, SeqCst);
        Ok(claims.into_iter().map(|c| (c.uid, Ok(vec![]))).collect())
    }

    async fn unprepare(
        &self,
        claims: Vec<Claim>,
    ) -> Result<HashMap<String, Result<(), String>>, DriverError> {
        Ok(claims.into_iter().map(|c| (c.uid, Ok(()))).collect())
    }
}

#[tokio::test]
async fn rolling_update_instances_serialise_their_calls_through_the_lock_file() {
    let dir = tempfile::tempdir().unwrap();
    let token = CancellationToken::new();
    let overlap = Arc::new(Overlap::default());
    let mut eps = Vec::new();
    for uid in ["a", "b"] {
        let mut c = config(dir.path(), "s.example.com");
        c.rolling_update = Some(uid.into());
        let p = plugreg_dra::start(Arc::new(SlowDriver(overlap.clone())), c, token.clone())
            .await
            .unwrap();
        eps.push(p.plugin_socket().display().to_string());
    }
    assert!(dir.path().join("plugins/s.example.com").is_dir());
    // One handler per instance, so that both are called at once.
    let mut calls = Vec::new();
    for (i, ep) in eps.iter().enumerate() {
        let h = DraHandler::new();
        h.register("s.example.com", ep, &["v1.DRAPlugin".to_owned()])
            .await
            .unwrap();
        for j in 0..3 {
            let h = h.clone();
            calls.push(tokio::spawn(async move {
                h.prepare("s.example.com", vec![claim(&format!("u{i}{j}"), "c")])
                    .await
                    .unwrap()
            }));
        }
    }
    for c in calls {
        c.await.unwrap();
    }
    assert_eq!(overlap.max.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(
        dir.path()
            .join("plugins/s.example.com/serialize.lock")
            .exists()
    );
    token.cancel();
}
