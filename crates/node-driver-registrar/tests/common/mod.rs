//! Helpers shared by the integration tests: the sidecar as a real process with its log lines
//! on a channel, a minimal kubelet client, a minimal HTTP client, polls with deadlines.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use plugreg_proto::pluginregistration::registration_client::RegistrationClient;
use plugreg_proto::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_csi-node-driver-registrar");

/// A driver name the tests use.
pub const DRIVER: &str = "csi.test.plugreg.io";

/// The kubelet-side driver path the tests pass as `--kubelet-registration-path`.
pub const KUBELET_PATH: &str = "/var/lib/kubelet/plugins/csi.test.plugreg.io/csi.sock";

/// Runs the binary to completion with `args`; returns (exit code, stdout, stderr).
pub fn run_to_end(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The sidecar as a running process.
pub struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    all: Arc<Mutex<Vec<String>>>,
    /// Reads stderr; ends once the process has exited and its last line is read.
    reader: Option<std::thread::JoinHandle<()>>,
    pub started: Instant,
}

impl Proc {
    /// Starts the binary with `args`.
    pub fn spawn<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Self {
        let started = Instant::now();
        let mut child = Command::new(BIN)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        let all = Arc::new(Mutex::new(Vec::new()));
        let keep = all.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                keep.lock().unwrap().push(line.clone());
                let _ = tx.send(line);
            }
        });
        Self {
            child,
            lines,
            all,
            reader: Some(reader),
            started,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until a log line containing `needle` has appeared (at any time since the start)
    /// and returns the first such line.
    pub fn wait_for_line(&self, needle: &str, within: Duration) -> String {
        self.wait_for_nth(needle, 1, within)
    }

    /// Waits until `n` log lines containing `needle` have appeared and returns the `n`th.
    pub fn wait_for_nth(&self, needle: &str, n: usize, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let found: Vec<String> = self
                .all
                .lock()
                .unwrap()
                .iter()
                .filter(|l| l.contains(needle))
                .cloned()
                .collect();
            if found.len() >= n {
                return found[n - 1].clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                panic!(
                    "no log line {n} with {needle:?} within {within:?}; log so far:\n{}",
                    self.log()
                );
            }
            // Any new line (or a timeout slice) means: look again.
            let _ = self.lines.recv_timeout(left.min(Duration::from_millis(50)));
        }
    }

    /// Everything logged so far.
    pub fn log(&self) -> String {
        self.all.lock().unwrap().join("\n")
    }

    /// Sends `signal`.
    pub fn signal(&self, signal: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).unwrap();
        rustix::process::kill_process(pid, signal).unwrap();
    }

    /// Waits for the exit, at most `within`.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "still running after {within:?}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the exit and returns its code, asserting it within `within`; by then every
    /// line the process logged is in [`log`](Self::log).
    pub fn exit_code(&mut self, within: Duration) -> i32 {
        let status = self.wait_exit(within);
        // The pipe closed with the process: the reader ends after the last line.
        if let Some(reader) = self.reader.take() {
            reader.join().expect("the stderr reader panicked");
        }
        status.code().unwrap_or(-1)
    }

    /// The HTTP address from the "Starting HTTP server" line.
    pub fn http_address(&self, within: Duration) -> SocketAddr {
        let line = self.wait_for_line("\"Starting HTTP server\"", within);
        let start = line.find("address=\"").unwrap() + "address=\"".len();
        let end = start + line[start..].find('"').unwrap();
        line[start..end].parse().unwrap()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` every 5 ms until it is true, at most `within`.
pub fn wait_until(within: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether a socket file is at `path`.
pub fn is_socket(path: &Path) -> bool {
    plugreg_transport::path_kind(path).ok() == Some(plugreg_transport::PathKind::Socket)
}

/// The registration socket of [`DRIVER`] in `dir`.
pub fn reg_socket(dir: &Path) -> PathBuf {
    dir.join(format!("{DRIVER}-reg.sock"))
}

/// Standard arguments: driver socket, registration dir, kubelet path, short window.
pub fn args(csi: &Path, reg_dir: &Path) -> Vec<String> {
    vec![
        format!("--csi-address={}", csi.display()),
        format!("--plugin-registration-path={}", reg_dir.display()),
        format!("--kubelet-registration-path={KUBELET_PATH}"),
        "--csi-connect-window=10s".into(),
        "-v=5".into(),
    ]
}

/// A kubelet-like GetInfo call.
pub async fn get_info(socket: &Path) -> PluginInfo {
    let channel = plugreg_transport::connect_path(socket, Duration::from_secs(5))
        .await
        .unwrap();
    RegistrationClient::new(channel)
        .get_info(InfoRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// A kubelet-like NotifyRegistrationStatus call.
pub async fn notify(socket: &Path, registered: bool, error: &str) {
    let channel = plugreg_transport::connect_path(socket, Duration::from_secs(5))
        .await
        .unwrap();
    RegistrationClient::new(channel)
        .notify_registration_status(RegistrationStatus {
            plugin_registered: registered,
            error: error.into(),
        })
        .await
        .unwrap();
}

/// A plain HTTP/1.1 GET; returns (status code, body).
pub fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> (u16, String) {
    let mut stream = TcpStream::connect_timeout(&addr, timeout).unwrap();
    stream.set_read_timeout(Some(timeout)).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let code = response
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad response {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

/// The CSI test driver named [`DRIVER`], healthy, serving `socket`.
#[allow(dead_code)]
pub async fn healthy_driver(socket: &Path) -> plugreg_csi_test_driver::RunningDriver {
    let config = plugreg_csi_test_driver::DriverConfig {
        name: DRIVER.into(),
        ..Default::default()
    };
    plugreg_csi_test_driver::start(config, socket)
        .await
        .unwrap()
}
