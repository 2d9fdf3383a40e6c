//! The kubelet side of device plugins with real sockets: the handler inside a real plugin
//! manager, the classic kubelet.sock server, and real device plugins (the plugin-side library
//! with the example widgets, or a raw server that hangs where a test needs it).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use plugreg_deviceplugin::api::device_plugin_server::{DevicePlugin, DevicePluginServer};
use plugreg_deviceplugin::api::registration_client::RegistrationClient;
use plugreg_deviceplugin::api::{
    AllocateRequest, AllocateResponse, DevicePluginOptions, Empty, ListAndWatchResponse,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, RegisterRequest,
};
use plugreg_deviceplugin::{DevicePlugin as Plugin, Event, PluginConfig};
use plugreg_example_device_plugin::Widgets;
use plugreg_handler_device::{
    ClassicRegistration, ClientConfig, DevicePluginHandler, EndpointInfo, Health, Inventory,
    RegisteredVia,
};
use plugreg_manager::{HandlerRegistry, ManagerConfig, PluginManager};
use plugreg_registrar::{PluginInfo, Registrar};
use plugreg_runtime::Backoff;
use tokio_util::sync::CancellationToken;

const SOON: Duration = Duration::from_secs(10);
const RESOURCE: &str = "example.com/widget";

fn quick() -> ClientConfig {
    ClientConfig {
        dial_timeout: Duration::from_secs(2),
        options_timeout: Duration::from_millis(500),
        redial: Backoff::new(Duration::from_millis(20), Duration::from_millis(200)),
        classic_grace: Duration::from_secs(60),
    }
}

/// Waits until `f` holds for the inventory.
async fn until(
    inv: &Inventory,
    what: &str,
    f: impl Fn(&[EndpointInfo]) -> bool,
) -> Vec<EndpointInfo> {
    let mut changes = inv.changes();
    let deadline = tokio::time::Instant::now() + SOON;
    loop {
        let snap = inv.snapshot();
        if f(&snap) {
            return snap;
        }
        if tokio::time::timeout_at(deadline, changes.changed())
            .await
            .is_err()
        {
            panic!("timed out waiting for {what}: {snap:#?}");
        }
    }
}

fn healthy(e: &EndpointInfo) -> usize {
    e.devices
        .iter()
        .filter(|d| d.health == Health::Healthy)
        .count()
}

async fn manager(dir: &Path, inv: &Arc<Inventory>, token: &CancellationToken) -> PluginManager {
    let handlers = HandlerRegistry::new().with(
        "DevicePlugin",
        Arc::new(DevicePluginHandler::new(inv.clone(), quick())),
    );
    let mut c = ManagerConfig::new(dir.join("plugins_registry"));
    c.backoff_initial = Duration::from_millis(20);
    c.backoff_max = Duration::from_millis(200);
    PluginManager::start(c, handlers, token.clone())
        .await
        .unwrap()
}

fn spawn_plugin(
    config: PluginConfig,
    widgets: Arc<Widgets>,
) -> (
    Arc<Plugin<Widgets>>,
    CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    let plugin = Arc::new(Plugin::new(config, widgets));
    let token = CancellationToken::new();
    let (p, t) = (plugin.clone(), token.clone());
    let h = tokio::spawn(async move { p.run(t).await.unwrap() });
    (plugin, token, h)
}

#[tokio::test]
async fn plugins_registry_device_plugin_lists_devices_follows_health_and_is_dropped_on_removal() {
    let dir = tempfile::tempdir().unwrap();
    let token = CancellationToken::new();
    let inv = Arc::new(Inventory::new());
    let _m = manager(dir.path(), &inv, &token).await;
    std::fs::create_dir_all(dir.path().join("plugins")).unwrap();
    let widgets = Arc::new(Widgets::new(3, 2, false));
    let socket = dir.path().join("plugins/w.sock");
    let cfg = PluginConfig::plugins_registry(
        RESOURCE,
        &dir.path().join("plugins_registry"),
        socket.clone(),
    );
    let reg_socket = match &cfg.registration {
        plugreg_deviceplugin::Registration::PluginsRegistry { socket } => socket.clone(),
        _ => unreachable!(),
    };
    let (plugin, ptoken, handle) = spawn_plugin(cfg, widgets.clone());
    let mut events = plugin.events();

    let snap = until(&inv, "3 healthy devices", |s| {
        s.len() == 1 && healthy(&s[0]) == 3
    })
    .await;
    assert_eq!(snap[0].resource, RESOURCE);
    assert_eq!(snap[0].endpoint, socket);
    assert_eq!(snap[0].registered_via, RegisteredVia::PluginsRegistry);
    assert!(snap[0].options.get_preferred_allocation_available);
    assert_eq!(snap[0].devices[1].topology, Some(vec![1]));
    loop {
        match tokio::time::timeout(SOON, events.recv())
            .await
            .unwrap()
            .unwrap()
        {
            Event::Registered { via } => {
                assert_eq!(via, "plugins_registry");
                break;
            }
            Event::Serving { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }

    widgets.flip(2);
    let snap = until(&inv, "widget-2 unhealthy", |s| {
        s.len() == 1 && healthy(&s[0]) == 2
    })
    .await;
    assert_eq!(snap[0].devices[2].health, Health::Unhealthy);
    widgets.flip(2);
    until(&inv, "widget-2 healthy again", |s| {
        s.len() == 1 && healthy(&s[0]) == 3
    })
    .await;

    // A clean stop removes both sockets; the manager deregisters and the client is dropped.
    ptoken.cancel();
    handle.await.unwrap();
    assert!(!socket.exists() && !reg_socket.exists());
    until(&inv, "the endpoint dropped", |s| s.is_empty()).await;
    token.cancel();
}

#[tokio::test]
async fn plugins_registry_validation_texts_reach_the_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let token = CancellationToken::new();
    let inv = Arc::new(Inventory::new());
    let _m = manager(dir.path(), &inv, &token).await;
    let cases = [
        (
            "a.sock",
            RESOURCE,
            vec!["v1alpha", "v1"],
            "RegisterPlugin error -- plugin validation failed with err: manager version, v1beta1, is not among plugin supported versions [v1alpha v1]",
        ),
        (
            "b.sock",
            "gpu",
            vec!["v1beta1"],
            "RegisterPlugin error -- plugin validation failed with err: invalid name of device plugin socket: the ResourceName \"gpu\" is invalid",
        ),
    ];
    let mut waits = Vec::new();
    for (file, name, versions, want) in cases {
        let r = Registrar::new(PluginInfo {
            r#type: "DevicePlugin".into(),
            name: name.into(),
            endpoint: dir.path().join("nowhere.sock").display().to_string(),
            supported_versions: versions.into_iter().map(String::from).collect(),
        });
        let (rr, t, s) = (
            r.clone(),
            token.clone(),
            dir.path().join("plugins_registry").join(file),
        );
        tokio::spawn(async move { rr.serve(&s, Default::default(), t).await.unwrap() });
        waits.push((r, want));
    }
    // A valid plugin whose endpoint nobody serves: the dial error, wrapped as a register failure.
    let r = Registrar::new(PluginInfo {
        r#type: "DevicePlugin".into(),
        name: RESOURCE.into(),
        endpoint: dir.path().join("nowhere.sock").display().to_string(),
        supported_versions: vec!["v1beta1".into()],
    });
    let (rr, t, s) = (
        r.clone(),
        token.clone(),
        dir.path().join("plugins_registry/c.sock"),
    );
    tokio::spawn(async move { rr.serve(&s, Default::default(), t).await.unwrap() });
    for (r, want) in waits {
        let mut s = r.status();
        let st = tokio::time::timeout(SOON, s.wait_for(|s| s.rejected_total > 0))
            .await
            .unwrap()
            .unwrap()
            .clone();
        assert_eq!(st.last.unwrap().error, want);
    }
    let mut s = r.status();
    let st = tokio::time::timeout(SOON, s.wait_for(|s| s.rejected_total > 0))
        .await
        .unwrap()
        .unwrap()
        .clone();
    let e = st.last.unwrap().error;
    assert!(
        e.starts_with("RegisterPlugin error -- plugin registration failed with err: failed to dial device plugin: "),
        "{e}"
    );
    assert!(inv.snapshot().is_empty());
    token.cancel();
}

async fn classic(
    dir: &Path,
    inv: &Arc<Inventory>,
    cfg: ClientConfig,
) -> (PathBuf, CancellationToken, tokio::task::JoinHandle<()>) {
    let server = ClassicRegistration::new(dir, inv.clone(), cfg);
    let path = server.socket_path();
    let token = CancellationToken::new();
    let t = token.clone();
    let h = tokio::spawn(async move { server.serve(t).await.unwrap() });
    let deadline = tokio::time::Instant::now() + SOON;
    while tokio::net::UnixStream::connect(&path).await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "kubelet.sock never listened"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (path, token, h)
}

#[tokio::test]
async fn classic_registration_lists_devices_survives_a_plugin_restart_and_a_kubelet_restart() {
    let dir = tempfile::tempdir().unwrap();
    let inv = Arc::new(Inventory::new());
    let (kubelet_sock, ktoken, kh) = classic(dir.path(), &inv, quick()).await;
    let widgets = Arc::new(Widgets::new(2, 1, true));
    let cfg = PluginConfig::kubelet_socket(RESOURCE, &kubelet_sock, "w.sock");
    let endpoint = cfg.socket.clone();
    let (plugin, ptoken, handle) = spawn_plugin(cfg.clone(), widgets.clone());
    let events = plugin.events();
    let snap = until(&inv, "2 healthy devices", |s| {
        s.len() == 1 && healthy(&s[0]) == 2
    })
    .await;
    assert_eq!(snap[0].registered_via, RegisteredVia::KubeletSock);
    assert_eq!(snap[0].endpoint, endpoint);
    assert!(snap[0].options.pre_start_required);
    assert!(inv.render_metrics().contains(
        "plugreg_device_plugin_registration_total{resource_name=\"example.com/widget\"} 1\n"
    ));

    // Killed: its stream breaks, its devices turn unhealthy and stay listed.
    ptoken.cancel();
    handle.await.unwrap();
    until(&inv, "devices unhealthy", |s| {
        s.len() == 1 && !s[0].connected && healthy(&s[0]) == 0 && s[0].devices.len() == 2
    })
    .await;

    // Restarted: registers again and replaces the endpoint.
    let (plugin, ptoken, handle) = spawn_plugin(cfg, widgets.clone());
    until(&inv, "back", |s| {
        s.len() == 1 && s[0].connected && healthy(&s[0]) == 2
    })
    .await;

    // The kubelet restarts: kubelet.sock is re-created; the plugin registers again.
    let mut events2 = plugin.events();
    ktoken.cancel();
    kh.await.unwrap();
    let (_k2, ktoken2, _kh2) = classic(dir.path(), &inv, quick()).await;
    let mut saw_restart = false;
    loop {
        match tokio::time::timeout(SOON, events2.recv())
            .await
            .unwrap()
            .unwrap()
        {
            Event::KubeletRestarted => saw_restart = true,
            Event::Registered { via } if saw_restart => {
                assert_eq!(via, "kubelet.sock");
                break;
            }
            _ => {}
        }
    }
    assert!(
        inv.render_metrics().contains(
            "plugreg_device_plugin_registration_total{resource_name=\"example.com/widget\"} 3\n"
        ),
        "{}",
        inv.render_metrics()
    );
    drop(events);
    ptoken.cancel();
    handle.await.unwrap();
    ktoken2.cancel();
}

async fn register(kubelet_sock: &Path, req: RegisterRequest) -> Result<(), tonic::Status> {
    let ch = plugreg_transport::connect_path(kubelet_sock, SOON)
        .await
        .unwrap();
    RegistrationClient::new(ch).register(req).await.map(|_| ())
}

fn req(version: &str, endpoint: &str, resource: &str) -> RegisterRequest {
    RegisterRequest {
        version: version.into(),
        endpoint: endpoint.into(),
        resource_name: resource.into(),
        options: None,
    }
}

/// A device plugin that hangs where told to.
#[derive(Clone, Default)]
struct Hanging {
    options: bool,
    list: bool,
}

#[tonic::async_trait]
impl DevicePlugin for Hanging {
    async fn get_device_plugin_options(
        &self,
        _: tonic::Request<Empty>,
    ) -> Result<tonic::Response<DevicePluginOptions>, tonic::Status> {
        if self.options {
            std::future::pending::<()>().await;
        }
        Ok(tonic::Response::new(DevicePluginOptions::default()))
    }
    type ListAndWatchStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<ListAndWatchResponse, tonic::Status>> + Send>,
    >;
    async fn list_and_watch(
        &self,
        _: tonic::Request<Empty>,
    ) -> Result<tonic::Response<Self::ListAndWatchStream>, tonic::Status> {
        if self.list {
            return Ok(tonic::Response::new(Box::pin(tokio_stream::pending())));
        }
        Err(tonic::Status::unavailable("no devices today"))
    }
    async fn get_preferred_allocation(
        &self,
        _: tonic::Request<PreferredAllocationRequest>,
    ) -> Result<tonic::Response<PreferredAllocationResponse>, tonic::Status> {
        std::future::pending().await
    }
    async fn allocate(
        &self,
        _: tonic::Request<AllocateRequest>,
    ) -> Result<tonic::Response<AllocateResponse>, tonic::Status> {
        std::future::pending().await
    }
    async fn pre_start_container(
        &self,
        _: tonic::Request<PreStartContainerRequest>,
    ) -> Result<tonic::Response<PreStartContainerResponse>, tonic::Status> {
        std::future::pending().await
    }
}

fn serve_raw(path: &Path, plugin: Hanging, token: &CancellationToken) {
    let socket = plugreg_transport::bind(path).unwrap();
    let router = plugreg_transport::server().add_service(DevicePluginServer::new(plugin));
    let t = token.clone();
    tokio::spawn(
        async move { plugreg_transport::serve(router, socket, t.cancelled_owned()).await },
    );
}

#[tokio::test]
async fn classic_register_refuses_with_the_kubelets_texts_and_bounds_hung_plugins() {
    let dir = tempfile::tempdir().unwrap();
    let inv = Arc::new(Inventory::new());
    let (ks, ktoken, _kh) = classic(dir.path(), &inv, quick()).await;
    let token = CancellationToken::new();
    let hang_options = Hanging {
        options: true,
        ..Default::default()
    };
    serve_raw(&dir.path().join("hang.sock"), hang_options, &token);
    serve_raw(
        &dir.path().join("silent.sock"),
        Hanging {
            list: true,
            ..Default::default()
        },
        &token,
    );
    serve_raw(&dir.path().join("refuses.sock"), Hanging::default(), &token);

    let cases = [
        (
            req("v1", "x.sock", RESOURCE),
            "requested API version \"v1\" is not supported by kubelet. Supported version is [\"v1beta1\"]",
        ),
        (
            req("v1beta1", "x.sock", "kubernetes.io/gpu"),
            "the ResourceName \"kubernetes.io/gpu\" is invalid",
        ),
        (
            req("v1beta1", "../x.sock", RESOURCE),
            "invalid endpoint \"../x.sock\": must be the file name of a socket in the device plugin directory",
        ),
        (
            req("v1beta1", "", RESOURCE),
            "invalid endpoint \"\": must be the file name of a socket in the device plugin directory",
        ),
        (
            req("v1beta1", "hang.sock", RESOURCE),
            "failed to get device plugin options: rpc error: code = DeadlineExceeded desc = context deadline exceeded",
        ),
    ];
    for (r, want) in cases {
        let e = register(&ks, r).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unknown);
        assert_eq!(e.message(), want);
    }
    let e = register(&ks, req("v1beta1", "missing.sock", RESOURCE))
        .await
        .unwrap_err();
    assert!(
        e.message().starts_with("failed to dial device plugin: "),
        "{}",
        e.message()
    );
    assert!(inv.snapshot().is_empty());

    // A plugin that never answers ListAndWatch is registered, with no devices yet.
    register(&ks, req("v1beta1", "silent.sock", "example.com/silent"))
        .await
        .unwrap();
    // One whose ListAndWatch fails at once is registered and shown broken (re-dialled).
    register(&ks, req("v1beta1", "refuses.sock", "example.com/refuses"))
        .await
        .unwrap();
    let snap = until(&inv, "two endpoints, one broken", |s| {
        s.len() == 2
            && s.iter()
                .any(|e| e.resource == "example.com/refuses" && e.last_error.is_some())
    })
    .await;
    let silent = snap
        .iter()
        .find(|e| e.resource == "example.com/silent")
        .unwrap();
    assert!(silent.connected && silent.devices.is_empty());
    let refuses = snap
        .iter()
        .find(|e| e.resource == "example.com/refuses")
        .unwrap();
    assert!(
        refuses
            .last_error
            .as_deref()
            .unwrap()
            .contains("no devices today"),
        "{refuses:?}"
    );
    let m = inv.render_metrics();
    assert!(
        m.contains(
            "plugreg_device_plugin_registration_total{resource_name=\"kubernetes.io/gpu\"} 1\n"
        ),
        "{m}"
    );
    token.cancel();
    ktoken.cancel();
}

#[tokio::test]
async fn two_sockets_of_one_resource_are_two_clients_and_deregister_drops_only_one() {
    let dir = tempfile::tempdir().unwrap();
    let token = CancellationToken::new();
    let inv = Arc::new(Inventory::new());
    let handler = DevicePluginHandler::new(inv.clone(), quick());
    use plugreg_manager::PluginHandler;
    let mut endpoints = Vec::new();
    for (i, n) in [(0, 2usize), (1, 3)] {
        let socket = dir.path().join(format!("w{i}.sock"));
        let widgets = Arc::new(Widgets::new(n, 0, false));
        let logic = plugreg_deviceplugin::DevicePluginService::new(widgets, token.clone());
        let bound = plugreg_transport::bind(&socket).unwrap();
        let router = plugreg_transport::server().add_service(logic.into_server());
        let t = token.clone();
        tokio::spawn(
            async move { plugreg_transport::serve(router, bound, t.cancelled_owned()).await },
        );
        let e = socket.display().to_string();
        handler
            .register(RESOURCE, &e, &["v1beta1".into()])
            .await
            .unwrap();
        endpoints.push(e);
    }
    until(&inv, "both", |s| {
        s.len() == 2 && s.iter().map(healthy).sum::<usize>() == 5
    })
    .await;
    let m = inv.render_metrics();
    assert!(
        m.contains("plugreg_devices{resource=\"example.com/widget\",health=\"healthy\"} 5\n"),
        "{m}"
    );
    handler.deregister(RESOURCE, &endpoints[0]).await;
    let snap = until(&inv, "one left", |s| s.len() == 1).await;
    assert_eq!(snap[0].endpoint.display().to_string(), endpoints[1]);
    assert_eq!(healthy(&snap[0]), 3);
    token.cancel();
}

#[tokio::test]
async fn a_broken_stream_marks_devices_unhealthy_and_is_redialled_when_the_plugin_is_back() {
    use plugreg_manager::PluginHandler;
    let dir = tempfile::tempdir().unwrap();
    let inv = Arc::new(Inventory::new());
    let handler = DevicePluginHandler::new(inv.clone(), quick());
    let socket = dir.path().join("w.sock");
    let serve = |widgets: Arc<Widgets>| {
        let token = CancellationToken::new();
        let logic = plugreg_deviceplugin::DevicePluginService::new(widgets, token.clone());
        let bound = plugreg_transport::bind(&socket).unwrap();
        let router = plugreg_transport::server().add_service(logic.into_server());
        let t = token.clone();
        tokio::spawn(
            async move { plugreg_transport::serve(router, bound, t.cancelled_owned()).await },
        );
        token
    };
    let first = serve(Arc::new(Widgets::new(2, 0, false)));
    let e = socket.display().to_string();
    handler
        .register(RESOURCE, &e, &["v1beta1".into()])
        .await
        .unwrap();
    until(&inv, "2 healthy", |s| s.len() == 1 && healthy(&s[0]) == 2).await;

    first.cancel();
    let snap = until(&inv, "unhealthy, re-dialling", |s| {
        s.len() == 1 && !s[0].connected && healthy(&s[0]) == 0 && s[0].last_error.is_some()
    })
    .await;
    assert_eq!(snap[0].devices.len(), 2);

    // Back with 3 devices on the same socket: re-dialled without a new registration.
    let second = serve(Arc::new(Widgets::new(3, 0, false)));
    let snap = until(&inv, "re-dialled", |s| {
        s.len() == 1 && s[0].connected && healthy(&s[0]) == 3
    })
    .await;
    assert_eq!(snap[0].registered_via, RegisteredVia::PluginsRegistry);
    assert!(snap[0].last_error.is_none());
    second.cancel();
}
