//! The transport against real sockets in a temp dir.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::time::Duration;

use plugreg_proto::example::v1beta1::example_client::ExampleClient;
use plugreg_proto::example::v1beta1::example_server::{Example, ExampleServer};
use plugreg_proto::example::v1beta1::{ExampleRequest, ExampleResponse};
use plugreg_transport::{Error, bind, connect, connect_path, serve, server};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

struct Echo;

#[tonic::async_trait]
impl Example for Echo {
    async fn get_example_info(
        &self,
        req: Request<ExampleRequest>,
    ) -> Result<Response<ExampleResponse>, Status> {
        Ok(Response::new(ExampleResponse {
            error: req.into_inner().request,
        }))
    }
}

fn start(path: &std::path::Path) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let socket = bind(path).expect("bind");
    let token = CancellationToken::new();
    let t = token.clone();
    let router = server().add_service(ExampleServer::new(Echo));
    let task = tokio::spawn(async move {
        serve(router, socket, t.cancelled_owned())
            .await
            .expect("serve");
    });
    (token, task)
}

#[tokio::test]
async fn serves_dials_and_removes_socket_on_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("e.sock");
    let (token, task) = start(&path);

    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o700,
        "owner-only socket"
    );
    // No temporary file is left beside it.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

    for addr in [
        path.display().to_string(),
        format!("unix://{}", path.display()),
    ] {
        let ch = connect(&addr, Duration::from_secs(5)).await.unwrap();
        let reply = ExampleClient::new(ch)
            .get_example_info(ExampleRequest {
                request: "hi".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(reply.into_inner().error, "hi");
    }

    token.cancel();
    task.await.unwrap();
    assert!(!path.exists(), "socket removed on shutdown");
}

#[tokio::test]
async fn replaces_a_stale_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists(), "stale socket left behind");
    let (token, task) = start(&path);
    connect_path(&path, Duration::from_secs(5)).await.unwrap();
    token.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn refuses_to_replace_a_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.sock");
    std::fs::write(&path, b"precious").unwrap();
    let err = bind(&path).unwrap_err();
    assert!(matches!(err, Error::NotASocket { .. }), "{err:?}");
    assert!(err.to_string().contains("not a socket"));
    assert_eq!(std::fs::read(&path).unwrap(), b"precious", "file untouched");
}

#[tokio::test]
async fn leaves_a_socket_that_replaced_ours() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.sock");
    let first = bind(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let second = bind(&path).unwrap();
    assert!(!first.identity().is_in_place());
    drop(first);
    assert!(
        path.exists(),
        "dropping the old socket must not remove the new one"
    );
    drop(second);
    assert!(!path.exists());
}

#[tokio::test]
async fn dialing_nothing_or_a_dead_socket_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.sock");
    let err = connect_path(&missing, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err:?}");

    let dead = dir.path().join("dead.sock");
    drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
    let err = connect_path(&dead, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err:?}");

    let err = connect("relative.sock", Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidAddress { .. }), "{err:?}");
}

#[tokio::test]
async fn a_socket_that_never_answers_cannot_hang_a_call() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hang.sock");
    // Listening but never accepting: the kernel completes connect() and the HTTP/2 preface is
    // fire-and-forget, so the hang surfaces on the call, which a deadline must end.
    let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let outcome = tokio::time::timeout(Duration::from_millis(300), async {
        let ch = connect_path(&path, Duration::from_millis(300)).await?;
        ExampleClient::new(ch)
            .get_example_info(ExampleRequest::default())
            .await
            .map_err(|_| Error::InvalidAddress {
                address: String::new(),
                reason: "call failed",
            })
    })
    .await;
    assert!(
        !matches!(outcome, Ok(Ok(_))),
        "a call to a hung peer must not succeed"
    );
}

#[tokio::test]
async fn socket_path_too_long_is_refused_before_binding() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s".repeat(120));
    let err = bind(&path).unwrap_err();
    assert!(matches!(err, Error::PathTooLong { .. }), "{err:?}");
}
