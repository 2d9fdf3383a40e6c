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
            && let Ok(Ok(info)) = tokio::time::timeout(
                Duration::from_millis(500),
                RegistrationClient::new(channel).get_info(InfoRequest {}),
            )
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

/// Whether a successor listens on the hand-over socket of `socket` (`.<name>` beside it): a
/// listening socket bound at its address in the kernel's table of Unix sockets
/// (`/proc/net/unix`), seen without connecting to it. The hand-over socket is bound in its
/// staging directory `..<name>~` and renamed into place, and the kernel shows that address.
fn successor_listening(socket: &std::path::Path) -> bool {
    let name = socket.file_name().unwrap().to_string_lossy();
    let handover = format!("{}/..{name}~/.s", socket.parent().unwrap().display());
    let table = std::fs::read_to_string("/proc/net/unix").expect("/proc/net/unix");
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // Num RefCount Protocol Flags Type St Inode Path; Flags 00010000: listening.
        fields.len() == 8 && fields[3] == "00010000" && fields[7] == handover
    })
}

async fn wait_for_successor(socket: &std::path::Path) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !successor_listening(socket) || !handover_file(socket).exists() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no successor ever listened for the hand-over of {socket:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn handover_file(socket: &std::path::Path) -> std::path::PathBuf {
    socket.with_file_name(format!(
        ".{}",
        socket.file_name().unwrap().to_string_lossy()
    ))
}

/// An older instance ("old", accepted by the kubelet) and a newer one ("new") on one path, the
/// newer started once the older answers, returned once the newer waits for the hand-over.
async fn old_and_new(
    path: &std::path::Path,
    period: Duration,
) -> (Running, Running, Registrar, Registrar) {
    let old_registrar = Registrar::new(named("old"));
    let old = start_registrar(&old_registrar, path, period);
    wait_for_answer(path, "old").await;
    client(path)
        .await
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    let new_registrar = Registrar::new(named("new"));
    let new = start_registrar(&new_registrar, path, period);
    wait_for_successor(path).await;
    (old, new, old_registrar, new_registrar)
}

fn start_registrar(registrar: &Registrar, path: &std::path::Path, period: Duration) -> Running {
    let token = CancellationToken::new();
    let options = ServeOptions {
        recreate_check: Some(period),
    };
    let task = tokio::spawn({
        let (r, p, t) = (registrar.clone(), path.to_owned(), token.clone());
        async move { r.serve(&p, options, t).await }
    });
    (token, task)
}

/// A DaemonSet surge rollout: the old and the new instance run at once on one path. The newer
/// waits; when the older stops it hands its listening socket over, so the socket file never
/// changes (the kubelet deregisters a plugin whenever its socket is removed or created).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_older_instance_hands_its_socket_to_the_newer_when_it_stops() {
    const PERIOD: Duration = Duration::from_millis(20);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p-reg.sock");
    let ((old_token, old_task), (new_token, new_task), _, new_registrar) =
        old_and_new(&path, PERIOD).await;
    let socket = inode(&path).unwrap();
    // Waiting, the newer instance leaves the older's socket alone.
    assert_eq!(answers(&path).await, "old");
    assert!(!new_registrar.status().borrow().is_registered());

    // Watch the path through the whole hand-over: it must never be missing or another file.
    let watching = CancellationToken::new();
    let watcher = tokio::spawn({
        let (p, w) = (path.clone(), watching.clone());
        async move {
            let mut looks = 0u64;
            while !w.is_cancelled() {
                assert_eq!(
                    inode(&p),
                    Some(socket),
                    "the socket file changed after {looks} looks"
                );
                looks += 1;
                tokio::task::yield_now().await;
            }
            looks
        }
    });
    old_token.cancel();
    old_task.await.unwrap().unwrap();
    assert_eq!(answers(&path).await, "new");
    watching.cancel();
    assert!(watcher.await.unwrap() > 0);
    assert_eq!(inode(&path), Some(socket));
    // The kubelet's verdict came along.
    assert!(new_registrar.status().borrow().is_registered());
    assert_eq!(new_registrar.status().borrow().notifications(), 0);

    new_token.cancel();
    new_task.await.unwrap().unwrap();
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "the last instance removes the socket, its hand-over socket and their directories"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_older_instance_keeps_serving_when_the_newer_stops_first() {
    const PERIOD: Duration = Duration::from_millis(20);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p-reg.sock");
    let ((old_token, old_task), (new_token, new_task), _, _) = old_and_new(&path, PERIOD).await;
    let socket = inode(&path);
    new_token.cancel();
    new_task.await.unwrap().unwrap();
    assert_eq!(inode(&path), socket);
    assert_eq!(answers(&path).await, "old");
    old_token.cancel();
    old_task.await.unwrap().unwrap();
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
}

/// Three instances in a row: the third waits its turn while the second waits for the first;
/// each stop hands the same socket on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn successors_wait_their_turn_and_the_socket_passes_down_the_line() {
    const PERIOD: Duration = Duration::from_millis(20);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p-reg.sock");
    let ((old_token, old_task), (new_token, new_task), _, _) = old_and_new(&path, PERIOD).await;
    let socket = inode(&path);
    let third = Registrar::new(named("third"));
    let (third_token, third_task) = start_registrar(&third, &path, PERIOD);
    old_token.cancel();
    old_task.await.unwrap().unwrap();
    wait_for_answer(&path, "new").await;
    // The second serves now; the third listens for its hand-over in turn.
    wait_for_successor(&path).await;
    new_token.cancel();
    new_task.await.unwrap().unwrap();
    wait_for_answer(&path, "third").await;
    assert_eq!(inode(&path), socket, "the socket file changed");
    third_token.cancel();
    third_task.await.unwrap().unwrap();
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
}

/// A live socket of a program that cannot hand over (Go's registrar, an older plugreg) is never
/// replaced: the new instance waits until it is dead or gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_socket_of_another_program_is_waited_for_until_it_dies() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p-reg.sock");
    let other = tokio::net::UnixListener::bind(&path).unwrap();
    let theirs = inode(&path);
    // A second link keeps their inode from being reused for ours.
    std::fs::hard_link(&path, dir.path().join("held")).unwrap();
    let (token, task) = start("me", &path, Duration::from_millis(20));
    wait_for_successor(&path).await;
    assert_eq!(inode(&path), theirs, "a live socket was replaced");
    drop(other);
    wait_for_answer(&path, "me").await;
    assert_ne!(inode(&path), theirs);
    assert!(
        !handover_file(&path).exists(),
        "the hand-over socket goes once it serves"
    );
    token.cancel();
    task.await.unwrap().unwrap();
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
    // A second link keeps the dead socket's inode from being reused for the new one.
    std::fs::hard_link(&path, dir.path().join("held")).unwrap();
    wait_for_answer(&path, "me").await;
    assert_ne!(inode(&path), Some(dead));
    token.cancel();
    task.await.unwrap().unwrap();
    assert!(!path.exists());
}
