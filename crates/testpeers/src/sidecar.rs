//! A sidecar binary under test, as its command-line tests run it: to the end with its output,
//! or as a running process whose stderr lines are collected for the test to wait on, killed
//! when dropped; and a plain HTTP GET of its diagnostics endpoint.
//!
//! The environment a developer's shell may carry into the process and that would change what
//! it does (`KUBECONFIG`, `KUBERNETES_SERVICE_HOST`, `NODE_NAME`) is removed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A bound for things that happen at once (a slow machine is not a failure).
pub const SOON: Duration = Duration::from_secs(20);

const CLEARED: [&str; 3] = ["KUBECONFIG", "KUBERNETES_SERVICE_HOST", "NODE_NAME"];

fn command(bin: &str) -> Command {
    let mut c = Command::new(bin);
    for v in CLEARED {
        c.env_remove(v);
    }
    c
}

/// Runs `bin` with `args` to completion; returns (exit code, stdout, stderr).
pub fn run_to_end(bin: &str, args: &[&str]) -> (i32, String, String) {
    let out = command(bin).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

type Lines = Arc<(Mutex<(Vec<String>, bool)>, Condvar)>;

/// A sidecar as a running process, its stderr lines collected; killed on drop.
pub struct Sidecar {
    child: Child,
    lines: Lines,
}

impl Sidecar {
    /// Starts `bin` with `args`.
    pub fn spawn<S: AsRef<std::ffi::OsStr>>(bin: &str, args: &[S]) -> Self {
        let mut child = command(bin)
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
                keep.0.lock().unwrap().0.push(line);
                keep.1.notify_all();
            }
            keep.0.lock().unwrap().1 = true;
            keep.1.notify_all();
        });
        Self { child, lines }
    }

    /// Waits until `n` log lines contain `needle`; returns the last of them. Panics with the
    /// log when they do not come within `within` or the process ends first.
    pub fn wait_for_lines(&self, needle: &str, n: usize, within: Duration) -> String {
        let deadline = Instant::now() + within;
        let mut guard = self.lines.0.lock().unwrap();
        loop {
            let found: Vec<&String> = guard.0.iter().filter(|l| l.contains(needle)).collect();
            if found.len() >= n {
                return found[n - 1].clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || guard.1 {
                let log = guard.0.join("\n");
                drop(guard);
                panic!("no {n} log lines with {needle:?}; log:\n{log}");
            }
            guard = self.lines.1.wait_timeout(guard, left).unwrap().0;
        }
    }

    /// Waits (at most [`SOON`]) for a log line containing `needle`; returns it.
    pub fn wait_for_line(&self, needle: &str) -> String {
        self.wait_for_lines(needle, 1, SOON)
    }

    /// The log so far.
    pub fn log(&self) -> String {
        self.lines.0.lock().unwrap().0.join("\n")
    }

    /// Whether the process still runs.
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Sends signal `name` (`TERM`, `INT`, ...) with kill(1).
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the exit (at most `within`); returns the code and the whole log.
    pub fn exit_within(&mut self, within: Duration) -> (i32, String) {
        let deadline = Instant::now() + within;
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
        let mut guard = self.lines.0.lock().unwrap();
        while !guard.1 {
            guard = self.lines.1.wait_timeout(guard, SOON).unwrap().0;
        }
        (status.code().unwrap_or(-1), guard.0.join("\n"))
    }

    /// [`exit_within`](Self::exit_within) [`SOON`].
    pub fn exit(&mut self) -> (i32, String) {
        self.exit_within(SOON)
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.1 GET of `path` at `addr`: (status code, body).
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect_timeout(&addr, SOON).unwrap();
    stream.set_read_timeout(Some(SOON)).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let code = response.split(' ').nth(1).unwrap().parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}
