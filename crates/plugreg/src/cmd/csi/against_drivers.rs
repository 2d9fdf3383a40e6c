//! `plugreg csi ...` against a fake CSI driver, a registration-only socket, a hanging driver and
//! a stale socket, all on real Unix sockets.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use super::{CliError, CsiCommand, Output, Target, run};
use plugreg_csi_test_driver::{DriverConfig, Fault, NodeCapability, start};
use plugreg_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use plugreg_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

fn target(socket: &Path, output: Output) -> Target {
    Target {
        endpoint: format!("unix://{}", socket.display()),
        timeout: Duration::from_secs(5),
        output,
    }
}

async fn output(cmd: CsiCommand) -> Result<String, CliError> {
    let mut out = Vec::new();
    run(cmd, &mut out).await?;
    Ok(String::from_utf8(out).expect("UTF-8 output"))
}

fn driver_config() -> DriverConfig {
    DriverConfig {
        name: "hostpath.csi.k8s.io".into(),
        vendor_version: "v1.2.3".into(),
        manifest: BTreeMap::from([("commit".to_owned(), "abc".to_owned())]),
        accessibility_constraints: true,
        node_id: "node-7".into(),
        topology: BTreeMap::from([("topology.hostpath.csi/node".to_owned(), "node-7".to_owned())]),
        max_volumes_per_node: 42,
        node_capabilities: vec![
            NodeCapability::StageUnstageVolume,
            NodeCapability::GetVolumeStats,
        ],
        ..DriverConfig::default()
    }
}

#[tokio::test]
async fn info_node_info_and_capabilities_as_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let _d = start(driver_config(), &sock).await.unwrap();
    let ep = format!("unix://{}", sock.display());

    let table = output(CsiCommand::Info(target(&sock, Output::Table)))
        .await
        .unwrap();
    assert_eq!(
        table,
        format!(
            "ENDPOINT        {ep}\n\
             NAME            hostpath.csi.k8s.io\n\
             VENDOR VERSION  v1.2.3\n\
             MANIFEST        commit=abc\n\
             CAPABILITIES    VOLUME_ACCESSIBILITY_CONSTRAINTS\n\
             READY           true\n"
        )
    );
    let json: serde_json::Value = serde_json::from_str(
        &output(CsiCommand::Info(target(&sock, Output::Json)))
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        json,
        serde_json::json!({
            "endpoint": ep,
            "name": "hostpath.csi.k8s.io",
            "vendor_version": "v1.2.3",
            "manifest": {"commit": "abc"},
            "capabilities": ["VOLUME_ACCESSIBILITY_CONSTRAINTS"],
            "ready": true,
        })
    );

    let table = output(CsiCommand::NodeInfo(target(&sock, Output::Table)))
        .await
        .unwrap();
    assert_eq!(
        table,
        format!(
            "ENDPOINT     {ep}\n\
             NODE ID      node-7\n\
             MAX VOLUMES  42\n\
             TOPOLOGY     topology.hostpath.csi/node=node-7\n"
        )
    );
    let json: serde_json::Value = serde_json::from_str(
        &output(CsiCommand::NodeInfo(target(&sock, Output::Json)))
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        json,
        serde_json::json!({
            "endpoint": ep,
            "node_id": "node-7",
            "max_volumes_per_node": 42,
            "topology": {"topology.hostpath.csi/node": "node-7"},
        })
    );

    let json: serde_json::Value = serde_json::from_str(
        &output(CsiCommand::NodeCapabilities(target(&sock, Output::Json)))
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        json["capabilities"],
        serde_json::json!(["STAGE_UNSTAGE_VOLUME", "GET_VOLUME_STATS"])
    );
}

/// A plugin registration socket: serves `pluginregistration.Registration` only.
struct RegistrationOnly;

#[tonic::async_trait]
impl Registration for RegistrationOnly {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo::default()))
    }

    async fn notify_registration_status(
        &self,
        _: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

#[tokio::test]
async fn a_registration_socket_is_not_a_csi_driver() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("x-reg.sock");
    let bound = plugreg_transport::bind(&sock).unwrap();
    let token = CancellationToken::new();
    let router = plugreg_transport::server().add_service(RegistrationServer::new(RegistrationOnly));
    let server = tokio::spawn(plugreg_transport::serve(
        router,
        bound,
        token.clone().cancelled_owned(),
    ));

    let err = output(CsiCommand::Info(target(&sock, Output::Table)))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            CliError::NotCsi {
                method: "GetPluginInfo",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("is not a CSI driver: GetPluginInfo answered UNIMPLEMENTED"),
        "{err}"
    );
    let err = output(CsiCommand::NodeInfo(target(&sock, Output::Json)))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            CliError::NotCsi {
                method: "NodeGetInfo",
                ..
            }
        ),
        "{err:?}"
    );

    token.cancel();
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_driver_that_does_not_answer_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let _d = start(
        DriverConfig {
            get_plugin_info: Fault {
                hang: true,
                ..Fault::default()
            },
            ..DriverConfig::default()
        },
        &sock,
    )
    .await
    .unwrap();
    let mut t = target(&sock, Output::Table);
    t.timeout = Duration::from_millis(200);
    let err = output(CsiCommand::Info(t)).await.unwrap_err();
    assert!(
        matches!(
            err,
            CliError::Timeout {
                method: "GetPluginInfo",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .ends_with("did not answer GetPluginInfo within 200ms"),
        "{err}"
    );
}

#[tokio::test]
async fn a_stale_socket_cannot_be_connected() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("stale.sock");
    // Bound and closed: the file stays, nobody listens.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    let err = output(CsiCommand::NodeCapabilities(target(&sock, Output::Table)))
        .await
        .unwrap_err();
    assert!(matches!(err, CliError::Dial { .. }), "{err:?}");
    assert!(
        plugreg_handler_csi::report::chain(&err).contains("cannot connect to unix://"),
        "{err}"
    );
}
