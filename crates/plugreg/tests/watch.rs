//! `plugreg watch` as a real process: one JSON line per socket, and a clean exit (status 0) on
//! SIGTERM and on SIGINT.

use std::process::Command;
use std::time::Duration;

use plugreg_testpeers::{LinesFrom, PeerProcess};

const SOON: Duration = Duration::from_secs(15);

#[tokio::test]
async fn watch_prints_a_new_socket_and_exits_cleanly_on_sigterm_and_sigint() {
    for signal in ["SIGTERM", "SIGINT"] {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_plugreg"));
        cmd.arg("watch")
            .arg("--registry-dir")
            .arg(dir.path())
            .args(["-o", "json", "--timeout", "100ms"]);
        let mut watch =
            PeerProcess::spawn_command("plugreg watch", cmd, LinesFrom::Stdout).unwrap();

        let socket = dir.path().join("a.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let want = socket.display().to_string();
        let line = watch
            .next_matching(|v| v["socket"] == want.as_str(), SOON)
            .await
            .unwrap();
        // "present" when the first scan found it before the watch saw it appear.
        assert!(
            line["event"] == "added" || line["event"] == "present",
            "{line}"
        );

        match signal {
            "SIGTERM" => watch.terminate().unwrap(),
            _ => watch.interrupt().unwrap(),
        }
        let status = watch.wait_exit(SOON).await.unwrap();
        assert!(status.success(), "{signal}: {status:?}");
    }
}
