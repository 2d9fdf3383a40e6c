//! The registrar on a real socket, driven by a real gRPC client.

use std::time::Duration;

use plugreg_proto::pluginregistration::InfoRequest;
use plugreg_proto::pluginregistration::registration_client::RegistrationClient;
use plugreg_registrar::{PluginInfo, Registrar, RegistrationStatus, ServeOptions};
use tokio_util::sync::CancellationToken;

fn info() -> PluginInfo {
    PluginInfo {
        r#type: "CSIPlugin".into(),
        name: "csi.example.com".into(),
        endpoint: "/var/lib/kubelet/plugins/csi.example.com/csi.sock".into(),
        supported_versions: vec!["1.0.0".into()],
    }
}

async fn wait_for_socket(path: &std::path::Path) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while plugreg_transport::path_kind(path).unwrap() != plugreg_transport::PathKind::Socket {
        assert!(
            tokio::time::Instant::now() < deadline,
            "socket {path:?} never appeared"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn client(path: &std::path::Path) -> RegistrationClient<tonic::transport::Channel> {
    RegistrationClient::new(
        plugreg_transport::connect_path(path, Duration::from_secs(5))
            .await
            .unwrap(),
    )
}

#[tokio::test]
async fn answers_get_info_and_exposes_notifications() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("csi.example.com-reg.sock");
    let registrar = Registrar::new(info());
    let token = CancellationToken::new();
    let task = tokio::spawn({
        let (r, p, t) = (registrar.clone(), path.clone(), token.clone());
        async move { r.serve(&p, ServeOptions::default(), t).await }
    });
    wait_for_socket(&path).await;

    let mut c = client(&path).await;
    assert_eq!(
        c.get_info(InfoRequest {}).await.unwrap().into_inner(),
        info()
    );
    assert_eq!(registrar.get_info_total(), 1);

    let mut status = registrar.status();
    assert!(!status.borrow().is_registered());
    c.notify_registration_status(RegistrationStatus {
        plugin_registered: false,
        error: "nope".into(),
    })
    .await
    .unwrap();
    status.changed().await.unwrap();
    {
        let s = status.borrow_and_update();
        assert!(!s.is_registered());
        assert_eq!(s.rejected_total, 1);
        assert_eq!(s.last.as_ref().unwrap().error, "nope");
        assert!(s.last_rejected_at.is_some());
    }
    c.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();
    status.changed().await.unwrap();
    assert!(status.borrow().is_registered());
    assert_eq!(status.borrow().notifications(), 2);

    token.cancel();
    task.await.unwrap().unwrap();
    assert!(!path.exists(), "clean shutdown removes the socket");
}

#[tokio::test]
async fn recreates_its_socket_when_someone_deletes_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p-reg.sock");
    let registrar = Registrar::new(info());
    let token = CancellationToken::new();
    let options = ServeOptions {
        recreate_check: Some(Duration::from_millis(20)),
    };
    let task = tokio::spawn({
        let (r, p, t) = (registrar.clone(), path.clone(), token.clone());
        async move { r.serve(&p, options, t).await }
    });
    wait_for_socket(&path).await;
    std::fs::remove_file(&path).unwrap();
    wait_for_socket(&path).await;
    let mut c = client(&path).await;
    assert_eq!(
        c.get_info(InfoRequest {}).await.unwrap().into_inner().name,
        "csi.example.com"
    );
    token.cancel();
    task.await.unwrap().unwrap();
    assert!(!path.exists());
}

#[tokio::test]
async fn refuses_a_regular_file_at_the_socket_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x-reg.sock");
    std::fs::write(&path, "keep me").unwrap();
    let err = Registrar::new(info())
        .serve(&path, ServeOptions::default(), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("registration socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "keep me");
}

fn named(name: &str) -> PluginInfo {
    PluginInfo {
        name: name.into(),
        ..info()
    }
}

fn inode(path: &std::path::Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| m.ino())
}

async fn answers(path: &std::path::Path) -> String {
    client(path)
        .await
        .get_info(InfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .name
}

/// Serves `name` on `path` with a short re-create check; returns the token and the task.
fn start(name: &str, path: &std::path::Path, period: Duration) -> Running {
    let registrar = Registrar::new(named(name));
    let token = CancellationToken::new();
    let options = ServeOptions {
        recreate_check: Some(period),
    };
    let task = tokio::spawn({
        let (p, t) = (path.to_owned(), token.clone());
        async move { registrar.serve(&p, options, t).await }
    });
    (token, task)
}

async fn wait_for_answer(path: &std::path::Path, name: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if plugreg_transport::path_kind(path).unwrap() == plugreg_transport::PathKind::Socket
            && let Ok(channel) =
                plugreg_transport::connect_path(path, Duration::from_millis(500)).await
            && let Ok(info) = RegistrationClient::new(channel)
                .get_info(InfoRequest {})
                .await
            && info.into_inner().name == name
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{path:?} never answered {name}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

type Running = (
    CancellationToken,
    tokio::task::JoinHandle<Result<(), plugreg_registrar::Error>>,
);

/// An older instance ("old") and a newer one ("new") on one path, the newer started once the
/// older answers, returned once the newer answers.
async fn old_and_new(path: &std::path::Path, period: Duration) -> (Running, Running) {
    let old = start("old", path, period);
    wait_for_answer(path, "old").await;
    let new = start("new", path, period);
    wait_for_answer(path, "new").await;
    (old, new)
}

/// A DaemonSet surge rollout: the old and the new instance run at once on one path (R3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_instance_keeps_the_path_and_the_older_leaves_it_alone() {
    const PERIOD: Duration = Duration::from_millis(20);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p-reg.sock");
    let ((old_token, old_task), (new_token, new_task)) = old_and_new(&path, PERIOD).await;
    let newest = inode(&path).unwrap();

    // Over 25 check periods the newer socket stays in place: nobody re-binds.
    let window = tokio::time::Instant::now() + PERIOD * 25;
    while tokio::time::Instant::now() < window {
        assert_eq!(inode(&path), Some(newest), "the path was re-bound");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(answers(&path).await, "new");

    // Stopping the older instance does not remove the newer one's socket.
    old_token.cancel();
    old_task.await.unwrap().unwrap();
    assert_eq!(inode(&path), Some(newest), "the older instance removed it");
    assert_eq!(answers(&path).await, "new");

    new_token.cancel();
    new_task.await.unwrap().unwrap();
    assert!(!path.exists(), "the newer instance removes its own socket");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_older_instance_takes_the_path_back_when_the_newer_leaves() {
    const PERIOD: Duration = Duration::from_millis(20);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p-reg.sock");
    let ((old_token, old_task), (new_token, new_task)) = old_and_new(&path, PERIOD).await;
    new_token.cancel();
    new_task.await.unwrap().unwrap();
    wait_for_answer(&path, "old").await;
    old_token.cancel();
    old_task.await.unwrap().unwrap();
    assert!(!path.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_socket_at_the_path_is_replaced() {
    const PERIOD: Duration = Duration::from_millis(20);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p-reg.sock");
    let (token, task) = start("me", &path, PERIOD);
    wait_for_answer(&path, "me").await;
    // Someone put a socket there and went away: the file stays, connections are refused.
    std::fs::remove_file(&path).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let dead = inode(&path).unwrap();
    wait_for_answer(&path, "me").await;
    assert_ne!(inode(&path), Some(dead));
    token.cancel();
    task.await.unwrap().unwrap();
    assert!(!path.exists());
}
