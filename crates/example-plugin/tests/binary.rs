//! `plugreg-example-plugin` as a process: it answers GetInfo, serves the example services it
//! advertises, prints one JSON line per notification and removes its socket on SIGTERM.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use plugreg_proto::example::v1beta2::ExampleRequest;
use plugreg_proto::example::v1beta2::example_client::ExampleClient;
use plugreg_proto::pluginregistration::registration_client::RegistrationClient;
use plugreg_proto::pluginregistration::{InfoRequest, RegistrationStatus};
use plugreg_testpeers::{LinesFrom, PeerProcess};

const SOON: Duration = Duration::from_secs(15);

#[tokio::test]
async fn answers_prints_notifications_and_cleans_up() {
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("ex.sock");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_plugreg-example-plugin"));
    cmd.arg("--socket").arg(&sock).args([
        "--type",
        "DevicePlugin",
        "--name",
        "example.com/ex",
        "--versions",
        "v1beta1,v1beta2",
    ]);
    let mut p = PeerProcess::spawn_command("example plugin", cmd, LinesFrom::Stdout).unwrap();
    p.next_event("listening", SOON).await.unwrap();
    assert_eq!(
        std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777,
        0o700
    );

    let ch = plugreg_transport::connect_path(&sock, SOON).await.unwrap();
    let info = RegistrationClient::new(ch.clone())
        .get_info(InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.r#type, "DevicePlugin");
    assert_eq!(info.name, "example.com/ex");
    assert_eq!(
        info.endpoint,
        sock.display().to_string(),
        "the endpoint defaults to the socket"
    );
    assert_eq!(info.supported_versions, ["v1beta1", "v1beta2"]);
    let reply = ExampleClient::new(ch.clone())
        .get_example_info(ExampleRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.error, "");

    for (registered, error) in [(false, "try again"), (true, "")] {
        RegistrationClient::new(ch.clone())
            .notify_registration_status(RegistrationStatus {
                plugin_registered: registered,
                error: error.into(),
            })
            .await
            .unwrap();
        let n = p.next_event("notify", SOON).await.unwrap();
        assert_eq!(n["registered"], registered);
        assert_eq!(n["error"], error);
        assert!(n["ts_ns"].as_u64().unwrap() > 0);
    }

    p.terminate().unwrap();
    assert!(p.wait_exit(SOON).await.unwrap().success());
    assert!(!sock.exists(), "SIGTERM removes the socket");
}
