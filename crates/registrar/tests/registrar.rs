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
