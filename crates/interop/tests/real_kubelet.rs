//! plugreg's plugin side against the REAL kubelet plugin manager (`pkg/kubelet/pluginmanager`)
//! of every release the peers provide (v1.20.2 and v1.36.2, see `interop/build-peers.sh`):
//! each test is a body run once per release, `<test>::v1_20_2` and `<test>::v1_36_2`.

mod common;

use std::path::Path;
use std::time::Duration;

use plugreg_interop::{for_each_kube_version, workspace_bin};
use plugreg_registrar::{PluginInfo, Registrar, ServeOptions};
use plugreg_testpeers::{
    HandlerCall, KubeVersion, PeerProcess, PluginManagerOptions, RealPluginManager,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);

async fn kubelet(k: KubeVersion, dir: &Path, options: PluginManagerOptions) -> RealPluginManager {
    RealPluginManager::start(k, dir, &options, WAIT)
        .await
        .unwrap_or_else(|e| panic!("the real kubelet plugin manager {k}: {e}"))
}

async fn registrar_library_against_real_kubelet(
    k: KubeVersion,
    plugin_type: &str,
    name: &str,
    versions: &[&str],
) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    let mut kubelet = kubelet(k, &dir, PluginManagerOptions::default()).await;
    let socket = dir.join("plugreg-reg.sock");
    let endpoint = tmp.path().join("service.sock").display().to_string();
    let registrar = Registrar::new(PluginInfo {
        r#type: plugin_type.into(),
        name: name.into(),
        endpoint: endpoint.clone(),
        supported_versions: versions.iter().map(|v| v.to_string()).collect(),
    });
    let token = CancellationToken::new();
    let task = tokio::spawn({
        let (r, s, t) = (registrar.clone(), socket.clone(), token.clone());
        async move { r.serve(&s, ServeOptions::default(), t).await }
    });

    let v = kubelet
        .next(HandlerCall::Validate, name, WAIT)
        .await
        .expect("real kubelet: validate");
    assert_eq!(v.plugin_type, plugin_type);
    assert_eq!(v.endpoint.as_deref(), Some(endpoint.as_str()));
    assert_eq!(v.versions, versions);
    assert_eq!(v.error, None);
    let r = kubelet
        .next(HandlerCall::Register, name, WAIT)
        .await
        .expect("real kubelet: register");
    assert_eq!(r.endpoint.as_deref(), Some(endpoint.as_str()));
    assert_eq!(r.versions, versions);
    // v1.36's RegisterPlugin takes a client timeout; the plugin manager passes none.
    assert_eq!(r.client_timeout, None);
    let mut status = registrar.status();
    tokio::time::timeout(WAIT, status.wait_for(|s| s.is_registered()))
        .await
        .expect("the real kubelet never sent Notify(true)")
        .unwrap();

    token.cancel();
    task.await.unwrap().unwrap();
    assert!(!socket.exists());
    let d = kubelet
        .next(HandlerCall::Deregister, name, WAIT)
        .await
        .expect("real kubelet: deregister");
    assert_eq!(d.plugin_type, plugin_type);
    match k {
        // 1.20's DeRegisterPlugin(name) has no endpoint; newer ones pass the registered one.
        KubeVersion::V1_20_2 => assert_eq!(d.endpoint, None),
        KubeVersion::V1_36_2 => assert_eq!(d.endpoint.as_deref(), Some(endpoint.as_str())),
    }
    kubelet.terminate().unwrap();
}

/// The start of a client's HTTP/2 connection: its first request's header fields, and every
/// byte it sent up to the end of that header block.
struct FirstRequest {
    headers: Vec<(String, String)>,
    bytes: Vec<u8>,
}

/// Accepts one connection on `listener` as a minimal HTTP/2 server and returns the client's
/// first request. Reads at most 64 KiB.
async fn first_request(listener: &tokio::net::UnixListener) -> FirstRequest {
    const LIMIT: usize = 64 * 1024;
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let (mut conn, _) = listener.accept().await.unwrap();
    // Server preface: an empty SETTINGS frame.
    conn.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
    let mut buf = Vec::new();
    let mut block = Vec::new();
    let mut pos = PREFACE.len();
    loop {
        while buf.len() >= pos + 9 {
            let h = &buf[pos..pos + 9];
            let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
            let (kind, flags) = (h[3], h[4]);
            if buf.len() < pos + 9 + len {
                break;
            }
            let mut payload = &buf[pos + 9..pos + 9 + len];
            match kind {
                // SETTINGS without ACK: acknowledge.
                4 if flags & 1 == 0 => conn.write_all(&[0, 0, 0, 4, 1, 0, 0, 0, 0]).await.unwrap(),
                // HEADERS, CONTINUATION
                1 | 9 => {
                    if kind == 1 && flags & 0x8 != 0 {
                        let pad = usize::from(payload[0]);
                        payload = &payload[1..payload.len() - pad];
                    }
                    if kind == 1 && flags & 0x20 != 0 {
                        payload = &payload[5..];
                    }
                    block.extend_from_slice(payload);
                    if flags & 0x4 != 0 {
                        let mut d = loona_hpack::Decoder::new();
                        let headers = d
                            .decode(&block)
                            .expect("an HPACK header block")
                            .into_iter()
                            .map(|(n, v)| {
                                (
                                    String::from_utf8_lossy(&n).into_owned(),
                                    String::from_utf8_lossy(&v).into_owned(),
                                )
                            })
                            .collect();
                        buf.truncate(pos + 9 + len);
                        return FirstRequest {
                            headers,
                            bytes: buf,
                        };
                    }
                }
                _ => {}
            }
            pos += 9 + len;
        }
        assert!(buf.len() < LIMIT, "no request headers in {LIMIT} bytes");
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the kubelet closed the connection before a request");
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() >= PREFACE.len() {
            assert_eq!(&buf[..PREFACE.len()], PREFACE, "HTTP/2 client preface");
        }
    }
}

for_each_kube_version! {
    async fn registrar_library_registers_a_csi_plugin_with_the_real_kubelet(k: KubeVersion) {
        registrar_library_against_real_kubelet(k, "CSIPlugin", "csi.plugreg.example", &["1.0.0"])
            .await;
    }

    async fn registrar_library_registers_a_device_plugin_with_the_real_kubelet(k: KubeVersion) {
        registrar_library_against_real_kubelet(k, "DevicePlugin", "example.com/gpu", &["v1beta1"])
            .await;
    }

    async fn registrar_library_hears_the_real_kubelets_refusal(k: KubeVersion) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("plugins_registry");
        let name = "example.com/nope";
        let options = PluginManagerOptions {
            fail_validate: vec![name.into()],
            ..Default::default()
        };
        let mut kubelet = kubelet(k, &dir, options).await;
        let registrar = Registrar::new(PluginInfo {
            r#type: "DevicePlugin".into(),
            name: name.into(),
            endpoint: String::new(),
            supported_versions: vec!["v1beta1".into()],
        });
        let token = CancellationToken::new();
        tokio::spawn({
            let (r, s, t) = (registrar.clone(), dir.join("nope.sock"), token.clone());
            async move { r.serve(&s, ServeOptions::default(), t).await }
        });
        let mut status = registrar.status();
        let s = tokio::time::timeout(WAIT, status.wait_for(|s| s.rejected_total > 0))
            .await
            .expect("the real kubelet never sent Notify(false)")
            .unwrap()
            .clone();
        let v = kubelet.next(HandlerCall::Validate, name, WAIT).await.unwrap();
        // An empty endpoint: the kubelet uses the registration socket itself.
        assert_eq!(v.endpoint.as_deref(), Some(dir.join("nope.sock").to_str().unwrap()));
        assert_eq!(
            s.last.unwrap().error,
            format!(
                "RegisterPlugin error -- plugin validation failed with err: {}",
                kubelet.validate_error(name)
            )
        );
        token.cancel();
        kubelet.terminate().unwrap();
    }

    async fn registrar_library_hears_a_failed_registration(k: KubeVersion) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("plugins_registry");
        let name = "example.com/unlucky";
        let options = PluginManagerOptions {
            fail_register: vec![name.into()],
            ..Default::default()
        };
        let mut kubelet = kubelet(k, &dir, options).await;
        let registrar = Registrar::new(PluginInfo {
            r#type: "DevicePlugin".into(),
            name: name.into(),
            endpoint: tmp.path().join("dp.sock").display().to_string(),
            supported_versions: vec!["v1beta1".into()],
        });
        let token = CancellationToken::new();
        tokio::spawn({
            let (r, s, t) = (registrar.clone(), dir.join("unlucky.sock"), token.clone());
            async move { r.serve(&s, ServeOptions::default(), t).await }
        });
        let r = kubelet.next(HandlerCall::Register, name, WAIT).await.unwrap();
        assert_eq!(r.error, Some(kubelet.register_error(name)));
        let mut status = registrar.status();
        let s = tokio::time::timeout(WAIT, status.wait_for(|s| s.rejected_total > 0))
            .await
            .expect("the real kubelet never sent Notify(false)")
            .unwrap()
            .clone();
        assert_eq!(
            s.last.unwrap().error,
            format!(
                "RegisterPlugin error -- plugin registration failed with err: {}",
                kubelet.register_error(name)
            )
        );
        match k {
            // 1.20 records the plugin as registered before calling the handler, so a failed
            // RegisterPlugin is never retried (while the socket stays).
            KubeVersion::V1_20_2 => {}
            // Newer kubelets retry it with back-off: the handler is called again.
            KubeVersion::V1_36_2 => {
                let again = kubelet.next(HandlerCall::Register, name, WAIT).await.unwrap();
                assert!(again.ts_ns > r.ts_ns);
            }
        }
        token.cancel();
        kubelet.terminate().unwrap();
    }

    async fn registrar_recreates_its_deleted_socket_and_the_real_kubelet_registers_it_again(
        k: KubeVersion
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("plugins_registry");
        let mut kubelet = kubelet(k, &dir, PluginManagerOptions::default()).await;
        let name = "example.com/phoenix";
        let registrar = Registrar::new(PluginInfo {
            r#type: "DevicePlugin".into(),
            name: name.into(),
            endpoint: tmp.path().join("dp.sock").display().to_string(),
            supported_versions: vec!["v1beta1".into()],
        });
        let socket = dir.join("phoenix.sock");
        let token = CancellationToken::new();
        let task = tokio::spawn({
            let (r, s, t) = (registrar.clone(), socket.clone(), token.clone());
            let options = ServeOptions {
                recreate_check: Some(Duration::from_millis(100)),
            };
            async move { r.serve(&s, options, t).await }
        });
        let first = kubelet.next(HandlerCall::Register, name, WAIT).await.unwrap();
        let mut status = registrar.status();
        tokio::time::timeout(WAIT, status.wait_for(|s| s.accepted_total == 1))
            .await
            .expect("first Notify(true)")
            .unwrap();

        std::fs::remove_file(&socket).unwrap();
        // The kubelet drops the plugin whose socket went away, and registers the new socket.
        let d = kubelet.next(HandlerCall::Deregister, name, WAIT).await.unwrap();
        assert!(d.ts_ns > first.ts_ns);
        let again = kubelet.next(HandlerCall::Register, name, WAIT).await.unwrap();
        assert!(again.ts_ns > d.ts_ns);
        tokio::time::timeout(WAIT, status.wait_for(|s| s.accepted_total == 2))
            .await
            .expect("second Notify(true)")
            .unwrap();
        token.cancel();
        task.await.unwrap().unwrap();
        kubelet.terminate().unwrap();
    }

    async fn real_kubelet_sends_an_authority_that_h2_refuses(k: KubeVersion) {
        // What the kubelet's gRPC client sends as :authority decides whether a plain h2/tonic
        // server accepts its requests (see plugreg-transport's `authority` module).
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("plugins_registry");
        let kubelet = kubelet(k, &dir, PluginManagerOptions::default()).await;
        let socket = dir.join("probe.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let FirstRequest { headers, bytes } = tokio::time::timeout(WAIT, first_request(&listener))
            .await
            .expect("the real kubelet never sent a request");
        let get = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
                .unwrap_or_else(|| panic!("no {name} in {headers:?}"))
        };
        assert_eq!(get(":method"), "POST", "{headers:?}");
        assert_eq!(get(":path"), "/pluginregistration.Registration/GetInfo", "{headers:?}");
        assert_eq!(get("content-type"), "application/grpc", "{headers:?}");
        assert!(get("user-agent").starts_with("grpc-go/"), "{headers:?}");
        let socket = socket.to_str().unwrap();
        match k {
            // grpc-go 1.27: the socket path as it is.
            KubeVersion::V1_20_2 => assert_eq!(get(":authority"), socket, "{headers:?}"),
            // grpc-go 1.79: the socket path percent-encoded, e.g. %2Fvar%2Flib%2F...
            KubeVersion::V1_36_2 => {
                assert_eq!(get(":authority"), socket.replace('/', "%2F"), "{headers:?}")
            }
        }
        // Neither is a valid URI authority for the http crate (hence h2 and tonic): plugreg's
        // transport replaces it, once, before the server sees the request.
        let mut rewriter = plugreg_transport::authority::Rewriter::new();
        let mut out = Vec::new();
        rewriter.feed(&bytes, &mut out).unwrap();
        assert_eq!(rewriter.rewritten(), 1, "{headers:?}");
        kubelet.terminate().unwrap();
    }

    async fn node_driver_registrar_with_csi_test_driver_registers_with_the_real_kubelet(
        k: KubeVersion
    ) {
        common::node_driver_registrar_registers_and_deregisters(
            k,
            "csi-node-driver-registrar (plugreg)",
            std::process::Command::new(workspace_bin("csi-node-driver-registrar")),
            WAIT,
        )
        .await;
    }
}

/// One registration RPC the kubelet made, with the deadline it set.
#[derive(Debug)]
struct Rpc {
    method: &'static str,
    registered: Option<bool>,
    grpc_timeout: Option<String>,
}

/// A plugin's registration service that answers `GetInfo` and fails every
/// `NotifyRegistrationStatus(true)` with UNAVAILABLE, reporting each call.
struct FailingNotify {
    info: plugreg_proto::pluginregistration::PluginInfo,
    calls: tokio::sync::mpsc::UnboundedSender<Rpc>,
}

fn grpc_timeout<T>(r: &tonic::Request<T>) -> Option<String> {
    r.metadata()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

#[tonic::async_trait]
impl plugreg_proto::pluginregistration::registration_server::Registration for FailingNotify {
    async fn get_info(
        &self,
        request: tonic::Request<plugreg_proto::pluginregistration::InfoRequest>,
    ) -> Result<tonic::Response<plugreg_proto::pluginregistration::PluginInfo>, tonic::Status> {
        let _ = self.calls.send(Rpc {
            method: "GetInfo",
            registered: None,
            grpc_timeout: grpc_timeout(&request),
        });
        Ok(tonic::Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: tonic::Request<plugreg_proto::pluginregistration::RegistrationStatus>,
    ) -> Result<
        tonic::Response<plugreg_proto::pluginregistration::RegistrationStatusResponse>,
        tonic::Status,
    > {
        let registered = request.get_ref().plugin_registered;
        let _ = self.calls.send(Rpc {
            method: "NotifyRegistrationStatus",
            registered: Some(registered),
            grpc_timeout: grpc_timeout(&request),
        });
        if registered {
            return Err(tonic::Status::unavailable("plugreg test: notify refused"));
        }
        Ok(tonic::Response::new(Default::default()))
    }
}

for_each_kube_version! {
    async fn real_kubelet_after_a_failed_notify(k: KubeVersion) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("plugins_registry");
        let mut kubelet = kubelet(k, &dir, PluginManagerOptions::default()).await;
        let name = "example.com/deaf";
        let (tx, mut calls) = tokio::sync::mpsc::unbounded_channel();
        let service = FailingNotify {
            info: plugreg_proto::pluginregistration::PluginInfo {
                r#type: "DevicePlugin".into(),
                name: name.into(),
                endpoint: tmp.path().join("dp.sock").display().to_string(),
                supported_versions: vec!["v1beta1".into()],
            },
            calls: tx,
        };
        let router = plugreg_transport::server().add_service(
            plugreg_proto::pluginregistration::registration_server::RegistrationServer::new(
                service,
            ),
        );
        let socket = plugreg_transport::bind(&dir.join("deaf.sock")).unwrap();
        let token = CancellationToken::new();
        let server = tokio::spawn({
            let t = token.clone();
            async move { plugreg_transport::serve(router, socket, t.cancelled_owned()).await }
        });

        let mut next_call = async || {
            tokio::time::timeout(WAIT, calls.recv())
                .await
                .expect("the real kubelet made no further registration call")
                .unwrap()
        };
        let get_info = next_call().await;
        assert_eq!(get_info.method, "GetInfo");
        let r = kubelet.next(HandlerCall::Register, name, WAIT).await.unwrap();
        assert_eq!(r.error, None);
        let notify = next_call().await;
        assert_eq!(notify.method, "NotifyRegistrationStatus");
        assert_eq!(notify.registered, Some(true));
        // The kubelet's deadlines, the same in both: GetInfo 1 s, NotifyRegistrationStatus 5 s
        // (grpc-go writes them in µs, e.g. 999968u, less what passed before sending).
        for (rpc, deadline_us) in [(&get_info, 1_000_000), (&notify, 5_000_000)] {
            let t = rpc.grpc_timeout.as_deref().expect("a grpc-timeout");
            let micros: u64 = t.strip_suffix('u').and_then(|n| n.parse().ok()).expect(t);
            assert!(
                (deadline_us - 100_000..=deadline_us).contains(&micros),
                "{rpc:?}"
            );
        }
        match k {
            // 1.20 has recorded the plugin as registered before notifying and keeps it so
            // (the handler's registration stands; nothing is retried).
            KubeVersion::V1_20_2 => {}
            // 1.36 undoes the handler's registration (DeRegisterPlugin) and, after a
            // back-off, starts over: GetInfo, ValidatePlugin, RegisterPlugin, notify.
            KubeVersion::V1_36_2 => {
                let d = kubelet.next(HandlerCall::Deregister, name, WAIT).await.unwrap();
                assert!(d.ts_ns > r.ts_ns);
                assert_eq!(next_call().await.method, "GetInfo");
                let again = kubelet.next(HandlerCall::Register, name, WAIT).await.unwrap();
                assert!(again.ts_ns > d.ts_ns);
                let notify = next_call().await;
                assert_eq!(notify.method, "NotifyRegistrationStatus");
                assert_eq!(notify.registered, Some(true));
            }
        }
        token.cancel();
        server.await.unwrap().unwrap();
        kubelet.terminate().unwrap();
    }
}

/// Waits for one `call` per name in `names` (in any order; other names' lines are skipped).
async fn each_of(kubelet: &mut RealPluginManager, call: HandlerCall, names: &[String]) {
    let mut missing: std::collections::BTreeSet<&str> = names.iter().map(String::as_str).collect();
    while !missing.is_empty() {
        let e = kubelet
            .next_any(call, WAIT)
            .await
            .unwrap_or_else(|e| panic!("{call:?} of {missing:?}: {e}"));
        missing.remove(e.name.as_str());
    }
}

/// Waits, for each name in `names`, for a DeRegisterPlugin and then a RegisterPlugin (its
/// socket removed and bound again). Both kinds are read together: a registrar binds again
/// within 50 ms, so the first plugins are registered again while the kubelet still
/// deregisters the last ones, and waiting for every deregistration first would skip those
/// registrations.
async fn each_deregistered_then_registered(kubelet: &mut RealPluginManager, names: &[String]) {
    let mut deregistered = std::collections::BTreeSet::new();
    let mut missing: std::collections::BTreeSet<&str> = names.iter().map(String::as_str).collect();
    while !missing.is_empty() {
        let (call, e) = kubelet
            .next_of(&[HandlerCall::Deregister, HandlerCall::Register], WAIT)
            .await
            .unwrap_or_else(|err| panic!("re-registration of {missing:?}: {err}"));
        match call {
            HandlerCall::Deregister => {
                deregistered.insert(e.name);
            }
            _ => {
                if deregistered.contains(&e.name) {
                    missing.remove(e.name.as_str());
                }
            }
        }
    }
}

for_each_kube_version! {
    /// The kubelet stats every file created in its registry directory before it ignores
    /// dot-names: a socket bound under a hidden name and renamed into place before the kubelet
    /// got to it made it log "Error when handling create event ... stat file ... failed".
    /// Plugins bind in a hidden directory instead, afresh each time, also when a restarted
    /// kubelet watches the directories it found (hidden ones included).
    async fn registrations_leave_no_error_in_the_real_kubelets_log(k: KubeVersion) {
        const PLUGINS: usize = 20;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("plugins_registry");
        let mut kubelet = kubelet(k, &dir, PluginManagerOptions::default()).await;
        let names: Vec<String> = (0..PLUGINS).map(|i| format!("example.com/quiet{i}")).collect();
        let token = CancellationToken::new();
        let mut tasks = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let registrar = Registrar::new(PluginInfo {
                r#type: "DevicePlugin".into(),
                name: name.clone(),
                endpoint: tmp.path().join(format!("dp{i}.sock")).display().to_string(),
                supported_versions: vec!["v1beta1".into()],
            });
            let socket = dir.join(format!("quiet{i}.sock"));
            let options = ServeOptions {
                recreate_check: Some(Duration::from_millis(50)),
            };
            let t = token.clone();
            tasks.push(tokio::spawn(async move { registrar.serve(&socket, options, t).await }));
        }
        each_of(&mut kubelet, HandlerCall::Register, &names).await;

        // A kubelet started now watches every directory it finds. Each socket, deleted, is
        // bound again by its registrar and registered again.
        kubelet.process().stop(WAIT).await.unwrap();
        let mut errors = kubelet.process().klog_errors();
        let mut kubelet = self::kubelet(k, &dir, PluginManagerOptions::default()).await;
        each_of(&mut kubelet, HandlerCall::Register, &names).await;
        for i in 0..PLUGINS {
            std::fs::remove_file(dir.join(format!("quiet{i}.sock"))).unwrap();
        }
        each_deregistered_then_registered(&mut kubelet, &names).await;

        token.cancel();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        each_of(&mut kubelet, HandlerCall::Deregister, &names).await;
        kubelet.process().stop(WAIT).await.unwrap();
        errors.extend(kubelet.process().klog_errors());
        assert!(
            errors.is_empty(),
            "the real kubelet {k} logged {} errors:\n{}",
            errors.len(),
            errors.join("\n")
        );
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "left in the registry directory: {left:?}");
    }
}

/// Our `csi-node-driver-registrar` as a process logging JSON lines to stderr.
fn sidecar(label: &str, csi: &Path, registry: &Path, host_path: &str) -> PeerProcess {
    let mut cmd = std::process::Command::new(workspace_bin("csi-node-driver-registrar"));
    cmd.args([
        format!("--csi-address={}", csi.display()),
        format!("--kubelet-registration-path={host_path}"),
        format!("--plugin-registration-path={}", registry.display()),
        "--logging-format=json".into(),
        "-v=2".into(),
    ]);
    PeerProcess::spawn_command(label, cmd, plugreg_testpeers::LinesFrom::Stderr).unwrap()
}

fn msg_is(text: &'static str) -> impl FnMut(&serde_json::Value) -> bool {
    move |v| v.get("msg").and_then(serde_json::Value::as_str) == Some(text)
}

fn inode(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).unwrap().ino()
}

for_each_kube_version! {
    /// A DaemonSet surge rollout of the node plugin: the old and the new
    /// csi-node-driver-registrar of one driver run at once, then the old pod is stopped with
    /// SIGTERM. The kubelet deregisters a plugin whenever its socket is removed or created
    /// again; the old instance hands its listening socket to the new one instead, so the real
    /// kubelet never calls DeRegisterPlugin, and the new instance is the one that answers.
    async fn a_surge_rollout_of_the_sidecar_never_deregisters_the_driver(k: KubeVersion) {
        const NAME: &str = "csi.surge.plugreg.io";
        let host_path = "/var/lib/kubelet/plugins/csi.surge.plugreg.io/csi.sock";
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("plugins_registry");
        let mut kubelet = kubelet(k, &dir, PluginManagerOptions::default()).await;
        let csi_sock = tmp.path().join("csi.sock");
        let driver = plugreg_csi_test_driver::start(
            plugreg_csi_test_driver::DriverConfig {
                name: NAME.into(),
                ..Default::default()
            },
            &csi_sock,
        )
        .await
        .unwrap();
        let socket = dir.join(format!("{NAME}-reg.sock"));

        let mut old = sidecar("old registrar", &csi_sock, &dir, host_path);
        kubelet.next(HandlerCall::Register, NAME, WAIT).await.expect("registered by the old");
        old.next_matching(msg_is("Received NotifyRegistrationStatus call"), WAIT)
            .await
            .unwrap();
        let before = inode(&socket);

        let mut new = sidecar("new registrar", &csi_sock, &dir, host_path);
        new.next_matching(
            msg_is("Registration socket is served by another instance; waiting for it to hand the socket over"),
            WAIT,
        )
        .await
        .unwrap();
        // The old pod is deleted: SIGTERM.
        old.terminate().unwrap();
        assert!(old.wait_exit(WAIT).await.unwrap().success(), "{}", old.stderr_tail());
        new.next_matching(msg_is("Took the registration socket over from the previous instance"), WAIT)
            .await
            .unwrap();
        assert_eq!(inode(&socket), before, "the socket file changed");

        // A plugin registered now: the kubelet handles its socket after anything the hand-over
        // could have caused.
        let token = CancellationToken::new();
        let marker = Registrar::new(PluginInfo {
            r#type: "DevicePlugin".into(),
            name: "example.com/after-the-rollout".into(),
            endpoint: tmp.path().join("dp.sock").display().to_string(),
            supported_versions: vec!["v1beta1".into()],
        });
        tokio::spawn({
            let (s, t) = (dir.join("marker.sock"), token.clone());
            async move { marker.serve(&s, ServeOptions::default(), t).await }
        });
        kubelet
            .next(HandlerCall::Register, "example.com/after-the-rollout", WAIT)
            .await
            .unwrap();
        // Everything this kubelet printed, to the end.
        kubelet.process().stop(WAIT).await.unwrap();
        kubelet.process().lines().collect_for(WAIT).await;
        let deregistrations: Vec<&String> = kubelet
            .process()
            .lines()
            .seen()
            .iter()
            .filter(|l| l.contains("\"DeRegisterPlugin\"") || l.contains("\"deregister\""))
            .collect();
        assert!(
            deregistrations.is_empty(),
            "the real kubelet {k} dropped the driver: {deregistrations:?}"
        );

        // A kubelet restarted now registers the driver through the new instance: it answers
        // GetInfo and hears the verdict.
        let mut kubelet = self::kubelet(k, &dir, PluginManagerOptions::default()).await;
        let r = kubelet.next(HandlerCall::Register, NAME, WAIT).await.unwrap();
        assert_eq!(r.endpoint.as_deref(), Some(host_path));
        new.next_matching(msg_is("Received NotifyRegistrationStatus call"), WAIT)
            .await
            .unwrap();

        // The new pod deleted too, with no successor: the socket goes and the driver with it.
        new.terminate().unwrap();
        assert!(new.wait_exit(WAIT).await.unwrap().success(), "{}", new.stderr_tail());
        assert!(!socket.exists());
        kubelet.next(HandlerCall::Deregister, NAME, WAIT).await.unwrap();
        token.cancel();
        kubelet.terminate().unwrap();
        let _ = driver.stop().await;
    }
}
