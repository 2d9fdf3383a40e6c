//! A sidecar binary under test, as its command-line tests run it: to the end with its output,
//! or as a running process whose stderr lines are collected for the test to wait on, killed
//! when dropped; a plain HTTP GET of its diagnostics endpoint; and the checks every sidecar's
//! command-line tests make (`--version`, the flags and defaults `-h` lists, a metric served);
//! and, for the tests against an API server, a sidecar whose output goes to a file
//! ([`LoggedSidecar`]), a poll with a deadline (and one that shows the peers' logs when it times
//! out), a JSON merge for test objects and a claim bound to a CSI PV as the PV controller
//! leaves them ([`bound_claim`]).
//!
//! The environment a developer's shell may carry into the process and that would change what
//! it does (`KUBECONFIG`, `KUBERNETES_SERVICE_HOST`, `NODE_NAME`) is removed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A bound for things that happen at once (a slow machine is not a failure).
pub const SOON: Duration = Duration::from_secs(20);

/// How long a test against an API server waits for the cluster (or a sidecar) to get somewhere.
pub const CLUSTER_WAIT: Duration = Duration::from_secs(60);

/// A `--master` whose kube config builds without contacting anything: the start-up steps
/// before the first API call run without an API server.
pub const MASTER: &str = "--master=http://127.0.0.1:1";

const CLEARED: [&str; 3] = ["KUBECONFIG", "KUBERNETES_SERVICE_HOST", "NODE_NAME"];

/// A [`Command`] for `bin` without the environment that would change what a sidecar does.
pub fn command(bin: &str) -> Command {
    let mut c = Command::new(bin);
    for v in CLEARED {
        c.env_remove(v);
    }
    c
}

/// Sends the signal `name` (`TERM`, `INT`, ...) to `child` with kill(1).
fn send_signal(child: &Child, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
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
        send_signal(&self.child, name);
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

/// The arguments of a controller sidecar that runs against the driver at `socket` without an
/// API server ([`MASTER`]), then `extra`.
pub fn csi_args(socket: &Path, extra: &[&str]) -> Vec<String> {
    let mut v = vec![
        MASTER.to_owned(),
        format!("--csi-address={}", socket.display()),
    ];
    v.extend(extra.iter().map(|s| (*s).to_owned()));
    v
}

/// Asserts that `bin --version` and `bin -version` (Go's `flag`: one dash works too) print
/// `<argv0> <version>` and exit 0; `version` is what the sidecar reports.
pub fn assert_prints_version(bin: &str, version: &str) {
    let (code, out, _) = run_to_end(bin, &["--version"]);
    assert_eq!(code, 0);
    assert_eq!(out, format!("{bin} {version}\n"));
    let (code, out, _) = run_to_end(bin, &["-version"]);
    assert_eq!(code, 0);
    assert!(out.starts_with(bin));
}

/// Asserts that the usage text lists each `(flag, default)`: the default in the flag's line
/// or the three after it (Go's `flag` puts long help texts on their own lines).
pub fn assert_usage_defaults(usage: &str, defaults: &[(&str, &str)]) {
    for (flag, default) in defaults {
        let line = usage
            .lines()
            .position(|l| l.trim_start().starts_with(&format!("{flag} ")) || l.trim() == *flag)
            .unwrap_or_else(|| panic!("{flag} missing:\n{usage}"));
        let text: String = usage
            .lines()
            .skip(line)
            .take(4)
            .collect::<Vec<_>>()
            .join(" ");
        assert!(text.contains(default), "{flag}: {text}");
    }
}

/// Asserts that the usage text lists each of `flags` (indented, as Go's `flag` prints them).
pub fn assert_usage_lists(usage: &str, flags: &[&str]) {
    for flag in flags {
        assert!(
            usage.contains(&format!("  {flag}")),
            "{flag} missing:\n{usage}"
        );
    }
}

/// A loopback address with a port free just now, for a sidecar's `--http-endpoint`.
pub fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Polls `GET path` at `addr` (200 each time) until the body contains `want`, at most
/// [`SOON`]; returns that body.
pub fn wait_for_body(addr: SocketAddr, path: &str, want: &str) -> String {
    let deadline = Instant::now() + SOON;
    loop {
        let (code, body) = http_get(addr, path);
        assert_eq!(code, 200);
        if body.contains(want) {
            return body;
        }
        assert!(Instant::now() < deadline, "no {want:?} in:\n{body}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A [`command`] for a controller sidecar `bin` against the driver at `socket` and the API
/// server of `kubeconfig`, logging at `-v=5`, then `args`.
pub fn controller_command(bin: &str, socket: &Path, kubeconfig: &Path, args: &[&str]) -> Command {
    let mut cmd = command(bin);
    cmd.arg(format!("--csi-address={}", socket.display()))
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg("--v=5")
        .args(args);
    cmd
}

/// A sidecar process whose stdout and stderr go to a file (the log outlives the process, for
/// tests that read it after the exit); killed when dropped.
pub struct LoggedSidecar {
    /// The process.
    pub child: Child,
    /// Its log file.
    pub log: PathBuf,
}

impl LoggedSidecar {
    /// Starts `cmd` (see [`command`]) with stdin closed and its output written to `log`.
    pub fn spawn(mut cmd: Command, log: PathBuf) -> Self {
        let out = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        Self { child, log }
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// How many established TCP connections the process holds to `port` ([`connections_to`]).
    pub fn connections_to(&self, port: u16) -> usize {
        connections_to(self.child.id(), port)
    }

    /// Whether the process still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends the signal `name` (`TERM`, `INT`) with kill(1).
    pub fn signal(&self, name: &str) {
        send_signal(&self.child, name);
    }

    /// SIGKILL: no chance to clean up.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit (at most [`CLUSTER_WAIT`]); its exit code.
    pub async fn exit_code(&mut self) -> i32 {
        self.exit_code_within(CLUSTER_WAIT).await
    }

    /// Waits for the process to exit (at most `within`); its exit code. Panics with the log
    /// when it still runs then.
    pub async fn exit_code_within(&mut self, within: Duration) -> i32 {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return s.code().unwrap_or(-1);
            }
            assert!(
                Instant::now() < deadline,
                "the sidecar did not exit:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for LoggedSidecar {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `f` every `every` until it returns `Some`, for at most `within`; panics naming
/// `what` then.
pub async fn poll<T, F, Fut>(what: &str, within: Duration, every: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(every).await;
    }
}

/// Polls `f` every 100 ms until it returns `Some`, for at most `within`; on time-out panics
/// with `timed out waiting for <what>` and, on the next line, `context()`: what the test shows
/// of its peers then (e.g. [`log_tails`] of its sidecars' logs).
pub async fn poll_showing<T, F, Fut>(
    what: &str,
    within: Duration,
    context: impl FnOnce() -> String,
    mut f: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out waiting for {what}\n{}", context());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The last `n` lines of each of the files `logs` (an unreadable one as empty), each after a
/// `--- <path> ---` line and followed by a line break.
pub fn log_tails(logs: &[PathBuf], n: usize) -> String {
    let mut out = String::new();
    for log in logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(n);
        out.push_str(&format!(
            "--- {} ---\n{}\n",
            log.display(),
            lines[from..].join("\n")
        ));
    }
    out
}

/// Merges `extra` into `base`: objects key by key, anything else replaced. For test objects
/// built from a base and the fields a test cares about.
pub fn merge_json(base: &mut serde_json::Value, extra: serde_json::Value) {
    match (base, extra) {
        (serde_json::Value::Object(b), serde_json::Value::Object(e)) => {
            for (k, v) in e {
                merge_json(b.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, e) => *b = e,
    }
}

/// Creates the object `object` of kind `K` (JSON without `apiVersion` and `kind`, which are
/// `K`'s; in its `metadata.namespace` when it has one) and returns it as the API server stored
/// it. Panics when the API server refuses it: a test's set-up must succeed.
pub async fn create_object<K: kube::Resource<DynamicType = ()>>(
    client: &kube::Client,
    mut object: serde_json::Value,
) -> kube::api::DynamicObject {
    use kube::api::{Api, ApiResource, DynamicObject, PostParams};
    let ar = ApiResource::erase::<K>(&());
    object["apiVersion"] = serde_json::json!(ar.api_version);
    object["kind"] = serde_json::json!(ar.kind);
    let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    let parsed = serde_json::from_value(object).expect("an object");
    api.create(&PostParams::default(), &parsed)
        .await
        .unwrap_or_else(|e| panic!("creating a {}: {e}", ar.kind))
}

/// A claim `claim` in `namespace` bound to the CSI PV `pv` of `driver` with the volume `handle`,
/// as the PV controller leaves them: the PV in phase Bound and, when `claim_bound`, the claim
/// too (else it keeps the phase Pending it was created with). Returns the claim's UID.
///
/// The claim asks for 1Gi ReadWriteOnce of no class and names `pv` (`volumeName`); the PV (1Gi,
/// ReadWriteOnce, Retain, no class) names the claim back (`claimRef`: namespace, name, UID).
pub async fn bound_claim(
    client: &kube::Client,
    namespace: &str,
    claim: &str,
    pv: &str,
    driver: &str,
    handle: &str,
    claim_bound: bool,
) -> String {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    let created = create_object::<PersistentVolumeClaim>(
        client,
        serde_json::json!({
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {"accessModes": ["ReadWriteOnce"], "volumeName": pv,
                     "storageClassName": "",
                     "resources": {"requests": {"storage": "1Gi"}}},
        }),
    )
    .await;
    let uid = created.metadata.uid.expect("a claim's UID");
    create_object::<PersistentVolume>(
        client,
        serde_json::json!({
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "claimRef": {"namespace": namespace, "name": claim, "uid": uid},
                "csi": {"driver": driver, "volumeHandle": handle},
            }
        }),
    )
    .await;
    set_status_phase::<PersistentVolume>(client, None, pv).await;
    if claim_bound {
        set_status_phase::<PersistentVolumeClaim>(client, Some(namespace), claim).await;
    }
    uid
}

/// Patches the status of the object `name` of kind `K` (in `namespace` if it has one) to
/// phase Bound.
async fn set_status_phase<K: kube::Resource<DynamicType = ()>>(
    client: &kube::Client,
    namespace: Option<&str>,
    name: &str,
) {
    use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
    let ar = ApiResource::erase::<K>(&());
    let api: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    let bound = Patch::Merge(serde_json::json!({"status": {"phase": "Bound"}}));
    api.patch_status(name, &PatchParams::default(), &bound)
        .await
        .unwrap_or_else(|e| panic!("setting the {} {name} Bound: {e}", ar.kind));
}

/// How many established TCP connections process `pid` holds to a remote `port` (of any
/// address; tests run on loopback only): its socket descriptors (`/proc/<pid>/fd`) matched by
/// inode with the kernel's table of its network namespace (`/proc/<pid>/net/tcp` and `tcp6`).
pub fn connections_to(pid: u32, port: u16) -> usize {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    let inodes: std::collections::BTreeSet<String> = fds
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|t| {
            t.to_string_lossy()
                .strip_prefix("socket:[")
                .and_then(|r| r.strip_suffix(']'))
                .map(str::to_owned)
        })
        .collect();
    let mut n = 0;
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(remote), Some(state), Some(inode)) = (f.get(2), f.get(3), f.get(9)) else {
                continue;
            };
            let remote_port = remote
                .rsplit_once(':')
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if *state == "01" && remote_port == Some(port) && inodes.contains(*inode) {
                n += 1;
            }
        }
    }
    n
}
