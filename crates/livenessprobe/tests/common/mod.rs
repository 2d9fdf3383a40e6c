//! Helpers for the integration tests: livenessprobe as a real process with its log lines
//! collected, the CSI test driver on a real socket, a minimal HTTP client.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_livenessprobe");

/// The driver name the tests use.
pub const DRIVER: &str = "csi.liveness.plugreg.io";

/// Generous bound for things that happen at once (a slow CI machine is not a failure).
pub const SOON: Duration = Duration::from_secs(20);

/// Runs the binary to completion with `args`; returns (exit code, stdout, stderr).
pub fn run_to_end(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Log lines so far and whether stderr has closed, with a condition variable for new lines.
type Lines = Arc<(Mutex<(Vec<String>, bool)>, Condvar)>;

/// The sidecar as a running process; killed on drop.
pub struct Proc {
    child: Child,
    lines: Lines,
}

impl Proc {
    /// Starts the binary with `args`.
    pub fn spawn<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Self {
        let mut child = Command::new(BIN)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let lines: Lines = Arc::new((Mutex::new((Vec::new(), false)), Condvar::new()));
        let keep = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                keep.0
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .0
                    .push(line);
                keep.1.notify_all();
            }
            keep.0.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
            keep.1.notify_all();
        });
        Self { child, lines }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The first log line containing `needle`, waiting for it at most `within`.
    pub fn wait_for_line(&self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        let mut guard = self.lines.0.lock().unwrap();
        loop {
            if let Some(l) = guard.0.iter().find(|l| l.contains(needle)) {
                return l.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || guard.1 {
                let log = guard.0.join("\n");
                drop(guard);
                panic!("no log line with {needle:?}; log:\n{log}");
            }
            guard = self.lines.1.wait_timeout(guard, left).unwrap().0;
        }
    }

    /// Everything logged so far.
    pub fn log(&self) -> String {
        self.lines.0.lock().unwrap().0.join("\n")
    }

    /// The health server's address, from the "ServeMux listening" line.
    pub fn address(&self, line: &str) -> SocketAddr {
        let line = self.wait_for_line(line, SOON);
        let start = line.find("address=\"").unwrap() + "address=\"".len();
        let end = start + line[start..].find('"').unwrap();
        line[start..end].parse().unwrap()
    }

    /// Waits for the exit (at most [`SOON`]) and returns its code, with the whole log.
    pub fn exit(&mut self) -> (i32, String) {
        let deadline = Instant::now() + SOON;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "still running; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        // The reader ends with the pipe: wait for it so no line is missed.
        let mut guard = self.lines.0.lock().unwrap();
        while !guard.1 {
            guard = self.lines.1.wait_timeout(guard, SOON).unwrap().0;
        }
        (status.code().unwrap_or(-1), guard.0.join("\n"))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.1 request; returns (status code, body).
pub fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect_timeout(&addr, SOON).unwrap();
    stream.set_read_timeout(Some(SOON)).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
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

/// A GET.
pub fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    http(addr, "GET", path)
}

/// The CSI test driver named [`DRIVER`] with `config`'s behaviour, serving `socket`.
pub async fn driver(
    socket: &Path,
    config: plugreg_csi_test_driver::DriverConfig,
) -> plugreg_csi_test_driver::RunningDriver {
    let config = plugreg_csi_test_driver::DriverConfig {
        name: DRIVER.into(),
        ..config
    };
    plugreg_csi_test_driver::start(config, socket)
        .await
        .unwrap()
}

/// Arguments for a sidecar probing `socket`, health server on a free loopback port.
pub fn args(socket: &Path, extra: &[&str]) -> Vec<String> {
    let mut v = vec![
        format!("--csi-address={}", socket.display()),
        "--http-endpoint=127.0.0.1:0".into(),
        "-v=5".into(),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}
