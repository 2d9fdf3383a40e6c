//! End to end on one machine: plugreg's plugin manager (the kubelet side) in-process with a
//! recording CSI handler, the CSI test driver in-process, and the sidecar as a real process.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use plugreg_manager::{
    HandlerError, HandlerRegistry, ManagerConfig, PluginHandler, PluginManager, PluginState,
    async_trait,
};
use rustix::process::Signal;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(10);

/// What the handler was asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Register { name: String, endpoint: String },
    Deregister { name: String, endpoint: String },
}

/// A CSI handler that accepts everything and reports each call on a channel.
struct Recorder(mpsc::UnboundedSender<Call>);

#[async_trait]
impl PluginHandler for Recorder {
    async fn validate(&self, _: &str, _: &str, versions: &[String]) -> Result<(), HandlerError> {
        if versions.iter().any(|v| v == "1.0.0") {
            Ok(())
        } else {
            Err(format!("unsupported versions {versions:?}").into())
        }
    }

    async fn register(&self, name: &str, endpoint: &str, _: &[String]) -> Result<(), HandlerError> {
        let _ = self.0.send(Call::Register {
            name: name.into(),
            endpoint: endpoint.into(),
        });
        Ok(())
    }

    async fn deregister(&self, name: &str, endpoint: &str) {
        let _ = self.0.send(Call::Deregister {
            name: name.into(),
            endpoint: endpoint.into(),
        });
    }
}

struct Node {
    _tmp: tempfile::TempDir,
    csi: PathBuf,
    registry: PathBuf,
    manager: PluginManager,
    calls: mpsc::UnboundedReceiver<Call>,
    token: CancellationToken,
    _driver: plugreg_csi_test_driver::RunningDriver,
}

async fn node() -> Node {
    let tmp = tempfile::tempdir().unwrap();
    let csi = tmp.path().join("csi.sock");
    let registry = tmp.path().join("plugins_registry");
    let driver = healthy_driver(&csi).await;
    let (tx, calls) = mpsc::unbounded_channel();
    let token = CancellationToken::new();
    let manager = PluginManager::start(
        ManagerConfig::new(&registry),
        HandlerRegistry::new().with("CSIPlugin", Arc::new(Recorder(tx))),
        token.clone(),
    )
    .await
    .unwrap();
    Node {
        _tmp: tmp,
        csi,
        registry,
        manager,
        calls,
        token,
        _driver: driver,
    }
}

impl Node {
    async fn next_call(&mut self) -> Call {
        tokio::time::timeout(WAIT, self.calls.recv())
            .await
            .expect("a handler call in time")
            .expect("the handler is alive")
    }

    fn state_of(&self, socket: &Path) -> Option<PluginState> {
        self.manager
            .snapshot()
            .into_iter()
            .find(|r| r.socket == socket)
            .map(|r| r.state)
    }
}

fn registered() -> Call {
    Call::Register {
        name: DRIVER.into(),
        endpoint: KUBELET_PATH.into(),
    }
}

fn deregistered() -> Call {
    Call::Deregister {
        name: DRIVER.into(),
        endpoint: KUBELET_PATH.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_with_the_manager_and_deregisters_on_sigterm_and_sigint() {
    for signal in [Signal::TERM, Signal::INT] {
        let mut n = node().await;
        let mut p = Proc::spawn(&args(&n.csi, &n.registry));
        assert_eq!(n.next_call().await, registered());
        let socket = reg_socket(&n.registry);
        p.wait_for_line("\"Received NotifyRegistrationStatus call\"", WAIT);
        wait_until(WAIT, "the record to say Registered", || {
            n.state_of(&socket) == Some(PluginState::Registered)
        });
        let record = n
            .manager
            .snapshot()
            .into_iter()
            .find(|r| r.socket == socket)
            .unwrap();
        assert_eq!(record.plugin_type, "CSIPlugin");
        assert_eq!(record.versions, ["1.0.0"]);

        p.signal(signal);
        assert_eq!(p.exit_code(WAIT), 0, "{signal:?}: {}", p.log());
        assert!(!socket.exists(), "{signal:?}");
        assert_eq!(n.next_call().await, deregistered(), "{signal:?}");
        n.token.cancel();
        n.manager.stopped().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_deleted_by_someone_else_is_re_created_and_registered_again() {
    let mut n = node().await;
    let p = Proc::spawn(&args(&n.csi, &n.registry));
    assert_eq!(n.next_call().await, registered());
    let socket = reg_socket(&n.registry);
    std::fs::remove_file(&socket).unwrap();
    assert_eq!(n.next_call().await, deregistered());
    assert_eq!(n.next_call().await, registered(), "{}", p.log());
    wait_until(WAIT, "registered again", || {
        n.state_of(&socket) == Some(PluginState::Registered)
    });
    n.token.cancel();
    n.manager.stopped().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance_rejected_by_the_handler_exits_1_and_cleans_up() {
    // A handler that refuses everything: the manager answers Notify(false).
    struct Refuse;
    #[async_trait]
    impl PluginHandler for Refuse {
        async fn validate(&self, name: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
            Err(format!("RegisterPlugin error -- plugin {name} refused").into())
        }
        async fn register(&self, _: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
            Ok(())
        }
        async fn deregister(&self, _: &str, _: &str) {}
    }
    let tmp = tempfile::tempdir().unwrap();
    let csi = tmp.path().join("csi.sock");
    let registry = tmp.path().join("plugins_registry");
    let driver = healthy_driver(&csi).await;
    let token = CancellationToken::new();
    let manager = PluginManager::start(
        ManagerConfig::new(&registry),
        HandlerRegistry::new().with("CSIPlugin", Arc::new(Refuse)),
        token.clone(),
    )
    .await
    .unwrap();
    let mut p = Proc::spawn(&args(&csi, &registry));
    assert_eq!(p.exit_code(WAIT), 1);
    assert!(
        p.log().contains(
            "\"Registration process failed with error, restarting registration container\""
        ),
        "{}",
        p.log()
    );
    assert!(p.log().contains("refused"));
    assert!(!reg_socket(&registry).exists());
    token.cancel();
    manager.stopped().await;
    driver.stop().await.unwrap();
}

/// A DaemonSet rolling update with `maxSurge`: the old and the new sidecar of one driver run at
/// once. The newer waits; when the older gets SIGTERM it hands its listening socket to the newer
/// and leaves the file in place, so the manager sees nothing at all: no deregistration, no
/// second registration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_surge_rollout_hands_the_socket_over_and_the_manager_sees_nothing() {
    let mut n = node().await;
    let socket = reg_socket(&n.registry);
    let mut old = Proc::spawn(&args(&n.csi, &n.registry));
    assert_eq!(n.next_call().await, registered());
    wait_until(WAIT, "the older instance registered", || {
        n.state_of(&socket) == Some(PluginState::Registered)
    });
    old.wait_for_line("\"Received NotifyRegistrationStatus call\"", WAIT);
    let before = inode(&socket);

    let mut new = Proc::spawn(&args(&n.csi, &n.registry));
    new.wait_for_line("waiting for it to hand the socket over", WAIT);
    old.signal(Signal::TERM);
    assert_eq!(old.exit_code(WAIT), 0, "{}", old.log());
    assert!(
        old.log().contains("Handed the registration socket over"),
        "{}",
        old.log()
    );
    new.wait_for_line("Took the registration socket over", WAIT);
    assert_eq!(inode(&socket), before, "the socket file changed");
    assert_eq!(get_info(&socket).await.name, DRIVER);

    // A plugin registered after the hand-over: its registration comes after anything the
    // hand-over could have caused.
    let marker = marker(&n.registry, n.token.clone());
    assert_eq!(n.next_call().await, marker_registered(), "{}", new.log());
    assert_eq!(n.state_of(&socket), Some(PluginState::Registered));

    new.signal(Signal::TERM);
    assert_eq!(new.exit_code(WAIT), 0, "{}", new.log());
    assert!(!socket.exists());
    assert_eq!(n.next_call().await, deregistered());
    n.token.cancel();
    marker.await.unwrap().unwrap();
    n.manager.stopped().await;
}

/// The older instance stopping first with no successor waiting removes its socket as before;
/// a newer instance that stops while it waits leaves the older one serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_instance_that_stops_leaves_the_older_serving() {
    let mut n = node().await;
    let socket = reg_socket(&n.registry);
    let mut old = Proc::spawn(&args(&n.csi, &n.registry));
    assert_eq!(n.next_call().await, registered());
    let before = inode(&socket);
    let mut new = Proc::spawn(&args(&n.csi, &n.registry));
    new.wait_for_line("waiting for it to hand the socket over", WAIT);
    new.signal(Signal::TERM);
    assert_eq!(new.exit_code(WAIT), 0, "{}", new.log());
    assert_eq!(inode(&socket), before);
    assert_eq!(get_info(&socket).await.name, DRIVER);
    let marker = marker(&n.registry, n.token.clone());
    assert_eq!(n.next_call().await, marker_registered(), "{}", old.log());

    old.signal(Signal::TERM);
    assert_eq!(old.exit_code(WAIT), 0, "{}", old.log());
    assert!(!socket.exists());
    assert_eq!(n.next_call().await, deregistered());
    n.token.cancel();
    marker.await.unwrap().unwrap();
    n.manager.stopped().await;
}

const MARKER: &str = "marker.plugreg.io";

/// Registers a second CSI plugin in `registry` until `token` is cancelled.
fn marker(
    registry: &Path,
    token: CancellationToken,
) -> tokio::task::JoinHandle<Result<(), plugreg_registrar::Error>> {
    let registrar = plugreg_registrar::Registrar::new(plugreg_registrar::PluginInfo {
        r#type: "CSIPlugin".into(),
        name: MARKER.into(),
        endpoint: "/var/lib/kubelet/plugins/marker/csi.sock".into(),
        supported_versions: vec!["1.0.0".into()],
    });
    let socket = registry.join("marker-reg.sock");
    tokio::spawn(async move {
        registrar
            .serve(&socket, plugreg_registrar::ServeOptions::default(), token)
            .await
    })
}

fn marker_registered() -> Call {
    Call::Register {
        name: MARKER.into(),
        endpoint: "/var/lib/kubelet/plugins/marker/csi.sock".into(),
    }
}

fn inode(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).unwrap().ino()
}
