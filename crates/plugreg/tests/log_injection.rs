//! Issue 17, finding 5: strings from a plugin (its gRPC status messages) and from the file
//! system (socket names) cannot forge lines in `plugreg manager`'s text log.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use plugreg_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use plugreg_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// What a forged line would start with: a timestamp of the text format.
const FORGED: &str =
    "2030-01-01T00:00:00.000000Z  INFO plugreg_manager::reconciler: plugin registered";

/// A plugin whose GetInfo fails with a message that tries to start a line of its own.
struct Liar;

#[tonic::async_trait]
impl Registration for Liar {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Err(Status::internal(format!(
            "no info\n{FORGED} socket=/fake.sock\r\n{FORGED} name=\u{1b}[2Kx"
        )))
    }

    async fn notify_registration_status(
        &self,
        _: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

fn serve_liar(path: &Path) -> CancellationToken {
    let bound = plugreg_transport::bind(path).unwrap();
    let token = CancellationToken::new();
    let shutdown = token.clone().cancelled_owned();
    tokio::spawn(async move {
        let server = plugreg_transport::server().add_service(RegistrationServer::new(Liar));
        let _ = plugreg_transport::serve(server, bound, shutdown).await;
    });
    token
}

struct Manager(Child);

impl Drop for Manager {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_and_socket_strings_cannot_forge_log_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    let log = tmp.path().join("manager.log");
    let manager = Command::new(env!("CARGO_BIN_EXE_plugreg"))
        .args(["manager", "--registry-dir"])
        .arg(&dir)
        .args(["--plugin-types", "DevicePlugin", "--liveness-interval", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let _manager = Manager(manager);
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !read_log().contains("Starting Kubelet Plugin Manager") {
        assert!(
            Instant::now() < deadline,
            "the manager did not start:\n{}",
            read_log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A socket whose very name tries to start a line, served by a plugin whose error does too.
    let socket = dir.join("x\n2030-01-01T00:00:00.000000Z  INFO z.sock");
    let _liar = serve_liar(&socket);
    while !read_log().contains("plugin registration failed") {
        assert!(
            Instant::now() < deadline,
            "no failure logged:\n{}",
            read_log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let text = read_log();
    let failure = text
        .lines()
        .find(|l| l.contains("plugin registration failed"))
        .unwrap();
    assert!(failure.contains(" WARN "), "{failure}");
    assert!(
        failure.contains("no info\\n2030-01-01T00:00:00.000000Z  INFO"),
        "the status message is in the line, escaped: {failure}"
    );
    assert!(
        failure.contains("/x\\n2030-01-01T00:00:00.000000Z  INFO z.sock"),
        "the socket name is in the line, escaped: {failure}"
    );
    for line in text.lines() {
        assert!(
            !line.starts_with("2030-"),
            "a forged line in the log:\n{line}\n--- whole log:\n{text}"
        );
        assert!(
            !line.contains('\u{1b}'),
            "an escape sequence reached the log: {line:?}"
        );
    }
}
