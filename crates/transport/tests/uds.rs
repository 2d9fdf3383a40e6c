//! The transport against real sockets in a temp dir.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::time::Duration;

use plugreg_proto::example::v1beta1::example_client::ExampleClient;
use plugreg_proto::example::v1beta1::example_server::{Example, ExampleServer};
use plugreg_proto::example::v1beta1::{ExampleRequest, ExampleResponse};
use plugreg_transport::{
    Error, bind, connect, connect_direct_driven, connect_path, connect_watched, serve,
    serve_with_limit, server,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
    // Beside it only its hidden staging directory, empty, until the socket goes.
    assert_eq!(entries(dir.path()), ["e.sock", ".e.sock~"]);
    assert_eq!(entries(&dir.path().join(".e.sock~")), Vec::<String>::new());

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
    assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));
}

#[tokio::test]
async fn a_watched_channel_signals_when_its_server_goes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.sock");
    let (token, task) = start(&path);
    let watched = connect_watched(path.to_str().unwrap(), Duration::from_secs(5))
        .await
        .unwrap();
    let mut client = plugreg_transport::client!(ExampleClient, watched.channel.clone());
    let reply = client
        .get_example_info(ExampleRequest {
            request: "hi".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(reply.into_inner().error, "hi");
    assert!(!watched.closed.is_closed(), "the connection is alive");

    token.cancel();
    task.await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), watched.closed.wait())
        .await
        .expect("the end of the connection is signalled");
    assert!(watched.closed.is_closed());
}

#[tokio::test]
async fn a_driven_connection_ends_its_driver_when_its_server_goes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.sock");
    let (token, task) = start(&path);
    let (conn, driver) = connect_direct_driven(&path, Duration::from_secs(5))
        .await
        .unwrap();
    let driving = tokio::spawn(driver);
    let mut client = plugreg_transport::client!(ExampleClient, conn);
    let reply = client
        .get_example_info(ExampleRequest {
            request: "direct".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(reply.into_inner().error, "direct");
    assert!(!driving.is_finished(), "the connection is alive");

    token.cancel();
    task.await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), driving)
        .await
        .expect("the driver completes when the connection ends")
        .unwrap();
}

/// Names in `dir`, the socket first, then the rest sorted.
fn entries(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort_by_key(|n| (n.starts_with('.'), n.clone()));
    v
}

fn inode(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).unwrap().ino()
}

/// A kubelet that started while a staging directory existed watches it; binding again must not
/// create the socket in that directory but in a new one.
#[tokio::test]
async fn each_bind_stages_in_a_fresh_private_directory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.sock");
    let staging = dir.path().join(".f.sock~");
    std::fs::create_dir(&staging).unwrap();
    // Held open, the old directory's inode cannot be reused for the new one.
    let held = std::fs::File::open(&staging).unwrap();
    let old = inode(&staging);
    let socket = bind(&path).unwrap();
    assert_ne!(
        inode(&staging),
        old,
        "an old empty staging directory is replaced"
    );
    let meta = std::fs::symlink_metadata(&staging).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.permissions().mode() & 0o777, 0o700);
    drop(socket);
    drop(held);
    assert!(entries(dir.path()).is_empty());
}

#[tokio::test]
async fn a_staging_name_in_use_is_left_alone_and_another_is_taken() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g.sock");
    // Someone else's (or a busy) directory, and a file, under the names binding would use.
    let busy = dir.path().join(".g.sock~");
    std::fs::create_dir(&busy).unwrap();
    std::fs::write(busy.join("keep"), b"x").unwrap();
    let socket = bind(&path).unwrap();
    let names = entries(dir.path());
    assert_eq!(names.len(), 3, "{names:?}");
    assert!(
        names[2].starts_with(".g.sock~") && names[2].len() == ".g.sock~".len() + 8,
        "{names:?}"
    );
    connect_path(&path, Duration::from_secs(5)).await.unwrap();
    drop(socket);
    assert_eq!(entries(dir.path()), [".g.sock~"]);
    assert_eq!(std::fs::read(busy.join("keep")).unwrap(), b"x");
}

#[tokio::test]
async fn a_kept_socket_file_stays_when_dropped_and_an_adopted_one_serves() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("k.sock");
    let first = bind(&path).unwrap();
    let dup = first.try_clone_listener().unwrap();
    first.keep_file().keep();
    drop(first);
    assert!(path.exists(), "a kept socket file stays");
    assert_eq!(
        entries(dir.path()),
        ["k.sock"],
        "its staging directory goes"
    );
    // The duplicate descriptor still listens behind the same file.
    let adopted =
        plugreg_transport::BoundSocket::adopt(std::os::unix::net::UnixListener::from(dup), &path)
            .unwrap();
    let token = CancellationToken::new();
    let t = token.clone();
    let router = server().add_service(ExampleServer::new(Echo));
    let task = tokio::spawn(async move { serve(router, adopted, t.cancelled_owned()).await });
    let ch = connect_path(&path, Duration::from_secs(5)).await.unwrap();
    let reply = ExampleClient::new(ch)
        .get_example_info(ExampleRequest {
            request: "adopted".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(reply.into_inner().error, "adopted");
    token.cancel();
    task.await.unwrap().unwrap();
    assert!(!path.exists(), "the adopter removes the socket it served");
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

#[tokio::test]
async fn connections_beyond_the_cap_wait_until_one_closes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cap.sock");
    let socket = bind(&path).unwrap();
    let token = CancellationToken::new();
    let t = token.clone();
    let router = server().add_service(ExampleServer::new(Echo));
    let task = tokio::spawn(serve_with_limit(router, socket, 2, t.cancelled_owned()));
    let call = |ch: tonic::transport::Channel| async move {
        ExampleClient::new(ch)
            .get_example_info(ExampleRequest {
                request: "x".into(),
                ..Default::default()
            })
            .await
    };

    // Two connections fill the cap; both are served.
    let first = connect_path(&path, Duration::from_secs(5)).await.unwrap();
    call(first.clone()).await.unwrap();
    let second = connect_path(&path, Duration::from_secs(5)).await.unwrap();
    call(second.clone()).await.unwrap();

    // A third one connects (the kernel queues it in the backlog) but is not served while both
    // stay open. Proving that something does not happen takes a bounded wait.
    let third = connect_path(&path, Duration::from_secs(5)).await.unwrap();
    let mut waiting = tokio::spawn(call(third));
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut waiting)
            .await
            .is_err(),
        "a connection over the cap was served"
    );

    // Closing one frees its slot: the waiting connection is accepted and served.
    drop(first);
    let reply = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("served once a slot is free")
        .unwrap()
        .unwrap();
    assert_eq!(reply.into_inner().error, "x");
    call(second).await.unwrap();

    token.cancel();
    task.await.unwrap().unwrap();
}

/// HPACK "literal without indexing, new name", no Huffman.
fn literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.push(0);
    for s in [name, value] {
        assert!(s.len() < 127, "one-byte length");
        out.push(s.len() as u8);
        out.extend_from_slice(s);
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8], out: &mut Vec<u8>) {
    let len = payload.len();
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// What grpc-go before ~2022 (kubelets before ~1.26) sends: the socket path as `:authority`.
/// Written by hand because no Rust client can put a path in a URI authority.
#[tokio::test]
async fn a_socket_path_authority_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old-client.sock");
    let (token, task) = start(&path);

    let mut block = Vec::new();
    literal(b":method", b"POST", &mut block);
    literal(b":scheme", b"http", &mut block);
    literal(b":path", b"/v1beta1.Example/GetExampleInfo", &mut block);
    literal(b":authority", path.to_str().unwrap().as_bytes(), &mut block);
    literal(b"content-type", b"application/grpc", &mut block);
    literal(b"te", b"trailers", &mut block);
    // ExampleRequest { request: "hi" } in a gRPC message frame.
    let message = [0, 0, 0, 0, 4, 0x0a, 2, b'h', b'i'];
    let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    frame(0x4, 0, 0, &[], &mut bytes);
    frame(0x1, 0x4, 1, &block, &mut bytes);
    frame(0x0, 0x1, 1, &message, &mut bytes);

    let mut conn = tokio::net::UnixStream::connect(&path).await.unwrap();
    conn.write_all(&bytes).await.unwrap();
    // Read the server's frames until the trailers (HEADERS with END_STREAM) of stream 1.
    let mut decoder = loona_hpack::Decoder::new();
    let mut headers = Vec::new();
    let mut data = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let mut head = [0u8; 9];
            conn.read_exact(&mut head)
                .await
                .expect("the server hung up early");
            let len =
                (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
            let mut payload = vec![0u8; len];
            conn.read_exact(&mut payload).await.unwrap();
            assert_ne!(head[3], 0x3, "RST_STREAM: the request was refused");
            assert_ne!(head[3], 0x7, "GOAWAY: the connection was refused");
            match head[3] {
                0x0 => data.extend_from_slice(&payload),
                0x1 => {
                    headers.extend(decoder.decode(&payload).unwrap());
                    if head[4] & 0x1 != 0 {
                        return;
                    }
                }
                _ => {}
            }
        }
    })
    .await
    .expect("a complete response");
    let header = |n: &[u8]| {
        headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_slice())
    };
    assert_eq!(header(b":status"), Some(&b"200"[..]));
    assert_eq!(header(b"grpc-status"), Some(&b"0"[..]), "{headers:?}");
    assert!(data.ends_with(b"hi"), "the echo: {data:?}");

    // A graceful shutdown waits for open connections.
    drop(conn);
    token.cancel();
    task.await.unwrap();
}
