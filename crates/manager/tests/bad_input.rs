//! Bad input never panics, never blocks other plugins and always leaves a clear error.

mod common;

use common::*;
use plugreg_manager::{PluginState, Step};
use plugreg_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use plugreg_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// A plugin whose GetInfo misbehaves on purpose.
#[derive(Clone)]
enum Rogue {
    Hang,
    Huge,
}

#[tonic::async_trait]
impl Registration for Rogue {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        match self {
            Rogue::Hang => std::future::pending().await,
            Rogue::Huge => Ok(Response::new(info(
                "DevicePlugin",
                &"x".repeat(5 << 20),
                "",
                &["v1beta1"],
            ))),
        }
    }
    async fn notify_registration_status(
        &self,
        _: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

fn serve_rogue(path: &std::path::Path, rogue: Rogue) -> CancellationToken {
    let bound = plugreg_transport::bind(path).unwrap();
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let svc = RegistrationServer::new(rogue).max_encoding_message_size(64 << 20);
        let _ = plugreg_transport::serve(
            plugreg_transport::server().add_service(svc),
            bound,
            t.cancelled_owned(),
        )
        .await;
    });
    token
}

#[tokio::test]
async fn a_hanging_get_info_times_out_backs_off_and_blocks_nobody() {
    let h = Harness::start_with(|c| c.max_concurrent_operations = 1).await;
    let hang = h.root.join("hang.sock");
    let _t = serve_rogue(&hang, Rogue::Hang);
    let r = h
        .wait_record(&hang, |r| r.is_some_and(|r| r.failures >= 1))
        .await
        .unwrap();
    assert_eq!(r.failed_step, Some(Step::GetInfo));
    let err = r.last_error.unwrap();
    assert!(err.starts_with(&format!("RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket {}, err: ", hang.display())), "{err}");
    // Even with a single operation slot, a good plugin still registers.
    let good = Plugin::device(&h.root.join("good.sock"), "example.com/good").await;
    good.wait_registered().await;
    assert!(
        h.recorder
            .calls
            .lock()
            .unwrap()
            .iter()
            .all(|c| !format!("{c:?}").contains("hang"))
    );
}

#[tokio::test]
async fn a_get_info_reply_over_4_mib_is_refused() {
    let h = Harness::start().await;
    let huge = h.root.join("huge.sock");
    let _t = serve_rogue(&huge, Rogue::Huge);
    let r = h
        .wait_record(&huge, |r| r.is_some_and(|r| r.failures >= 1))
        .await
        .unwrap();
    assert_eq!(r.failed_step, Some(Step::GetInfo));
    let err = r.last_error.unwrap();
    assert!(
        err.contains("OutOfRange")
            || err.contains("message length too large")
            || err.contains("larger than max"),
        "{err}"
    );
    let good = Plugin::device(&h.root.join("good.sock"), "example.com/good").await;
    good.wait_registered().await;
}

#[tokio::test]
async fn bad_names_endpoints_and_versions_are_refused_with_a_reason() {
    let h = Harness::start().await;
    let cases = [
        (
            "empty-name",
            info("DevicePlugin", "", "", &["v1beta1"]),
            "plugin name is empty",
        ),
        (
            "long-name",
            info("DevicePlugin", &"n".repeat(1000), "", &["v1beta1"]),
            "printable ASCII",
        ),
        (
            "odd-name",
            info(
                "DevicePlugin",
                "bad name\twith\u{1b}[31m escapes",
                "",
                &["v1beta1"],
            ),
            "printable ASCII",
        ),
        (
            "long-endpoint",
            info(
                "DevicePlugin",
                "example.com/e",
                &format!("/{}", "e".repeat(5000)),
                &["v1beta1"],
            ),
            "longer than 4096",
        ),
        (
            "odd-endpoint",
            info("DevicePlugin", "example.com/e", "/x\u{0}y", &["v1beta1"]),
            "control characters",
        ),
        (
            "bad-version",
            info("DevicePlugin", "example.com/v", "", &["v1 beta"]),
            "version",
        ),
    ];
    let mut plugins = Vec::new();
    for (file, i, _) in &cases {
        plugins.push(Plugin::start(&h.root.join(format!("{file}.sock")), i.clone()).await);
    }
    for (p, (file, _, want)) in plugins.iter().zip(&cases) {
        let s = p.wait_status(|s| s.rejected_total >= 1).await;
        let err = s.last.unwrap().error;
        assert!(
            err.starts_with("RegisterPlugin error -- plugin validation failed with err: "),
            "{file}: {err}"
        );
        assert!(
            err.contains(want),
            "{file}: {err:?} should mention {want:?}"
        );
        assert!(err.len() < 400, "{file}: the message stays short");
        let r = h
            .wait_record(&p.socket, |r| r.is_some_and(|r| r.failed_step.is_some()))
            .await
            .unwrap();
        assert_eq!(r.failed_step, Some(Step::CheckInfo));
    }
    assert!(
        h.recorder.calls.lock().unwrap().is_empty(),
        "no bad input reached the handler"
    );
    let good = Plugin::device(&h.root.join("good.sock"), "example.com/good").await;
    good.wait_registered().await;
}

#[tokio::test]
async fn files_that_are_not_sockets_and_hidden_names_are_ignored() {
    let h = Harness::start().await;
    std::fs::write(h.root.join("x.sock"), b"regular file").unwrap();
    let fifo = h.root.join("fifo.sock");
    let status = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(status.success());
    let hidden = Plugin::device(&h.root.join(".hidden.sock"), "example.com/hidden").await;
    std::fs::create_dir(h.root.join(".hiddendir")).unwrap();
    let in_hidden =
        Plugin::device(&h.root.join(".hiddendir/in.sock"), "example.com/inhidden").await;
    let good = Plugin::device(&h.root.join("good.sock"), "example.com/good").await;
    good.wait_registered().await;
    h.wait_record(&good.socket, |r| {
        r.is_some_and(|r| r.state == PluginState::Registered)
    })
    .await;
    let snap = h.manager.snapshot();
    assert_eq!(snap.len(), 1, "{snap:?}");
    assert_eq!(snap[0].name, "example.com/good");
    assert_eq!(hidden.status().borrow().notifications(), 0);
    assert_eq!(in_hidden.status().borrow().notifications(), 0);
}

#[tokio::test]
async fn a_symlink_to_a_socket_registers_and_symlink_loops_do_not_hang() {
    let h = Harness::start().await;
    // A loop between two directories inside the tree.
    let (a, b) = (h.root.join("a"), h.root.join("b"));
    std::fs::create_dir(&a).unwrap();
    std::fs::create_dir(&b).unwrap();
    std::os::unix::fs::symlink(&b, a.join("to-b")).unwrap();
    std::os::unix::fs::symlink(&a, b.join("to-a")).unwrap();
    // A self-referencing symlink named like a socket.
    std::os::unix::fs::symlink(h.root.join("self.sock"), h.root.join("self.sock")).unwrap();
    // A symlink to a real socket outside the tree.
    let outside = h.dir.path().join("outside.sock");
    let target = Plugin::device(&outside, "example.com/linked").await;
    let link = b.join("linked.sock");
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    target.wait_registered().await;
    let r = h
        .wait_record(&link, |r| {
            r.is_some_and(|r| r.state == PluginState::Registered)
        })
        .await
        .unwrap();
    assert_eq!(r.endpoint, link.display().to_string());
    // A rescan walks the same loops without hanging.
    h.manager.rescan();
    let good = Plugin::device(&h.root.join("good.sock"), "example.com/good").await;
    good.wait_registered().await;
    h.wait_record(&good.socket, |r| {
        r.is_some_and(|r| r.state == PluginState::Registered)
    })
    .await;
    assert_eq!(h.manager.snapshot().len(), 2);
}

#[tokio::test]
async fn a_socket_nobody_listens_on_backs_off_and_says_why() {
    let h = Harness::start().await;
    let dead = h.root.join("dead.sock");
    drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
    let r = h
        .wait_record(&dead, |r| r.is_some_and(|r| r.failures >= 2))
        .await
        .unwrap();
    assert_eq!(r.failed_step, Some(Step::Dial));
    assert!(r.last_error.unwrap().starts_with(&format!(
        "RegisterPlugin error -- dial failed at socket {}",
        dead.display()
    )));
    let good = Plugin::device(&h.root.join("good.sock"), "example.com/good").await;
    good.wait_registered().await;
}
