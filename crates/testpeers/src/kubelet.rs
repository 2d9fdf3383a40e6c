//! The real kubelet plugin manager and the real example plugin, of each Kubernetes release the
//! peers come from, behind one API.
//!
//! The v1.20.2 peers are plugreg's Go harnesses (`interop/go/`); the v1.36.2 ones are the
//! prebuilt harnesses of `shared/peers` (see its README). Their flags and JSON lines differ:
//!
//! | | v1.20.2 | v1.36.2 |
//! |---|---|---|
//! | plugin manager | `plugin-manager-harness --dir D --reject N --fail-register N` | `kubelet-pluginmanager-v1.36.2 -sockets-dir D -fail-validate N -fail-register N` |
//! | started | `ready` | `Started` |
//! | handler calls | `validate` / `register` / `deregister`, `type`, `error` | `ValidatePlugin` / `RegisterPlugin` / `DeRegisterPlugin`, `plugin_type`, `result` (`ok` or the error) |
//! | example plugin | `example-plugin --socket S` | `example-plugin-v1.36.2 -endpoint S` |
//! | serving / status | `ready`, `notify` (`registered`, `error`) | `Serving`, `NotifyRegistrationStatus` (`plugin_registered`, `error`) |
//!
//! [`RealPluginManager`] and [`RealExamplePlugin`] start the right binary with the right flags
//! and turn its lines into [`HandlerEvent`] and [`Notification`], so a test body can take a
//! [`KubeVersion`] and run unchanged against every release in [`KubeVersion::ALL`].

use std::ffi::OsString;
use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::error::Error;
use crate::peers::{
    APISERVER, CONTROLLER_MANAGER, EXAMPLE_PLUGIN, KUBELET, PLUGIN_MANAGER_HARNESS, SCHEDULER,
};
use crate::process::PeerProcess;

/// What the plugin manager logs (klog, stderr) once its watcher has walked the registry
/// directory, in every release.
const WATCHING: &str = "Starting Kubelet Plugin Manager";

/// kube-apiserver v1.36.2 (prebuilt, see `shared/peers`).
pub const APISERVER_V1_36: &str = "kube-apiserver-v1.36.2";
/// kube-controller-manager v1.36.2 (prebuilt).
pub const CONTROLLER_MANAGER_V1_36: &str = "kube-controller-manager-v1.36.2";
/// The real kubelet plugin manager v1.36.2 with JSON-printing fake handlers.
pub const PLUGIN_MANAGER_V1_36: &str = "kubelet-pluginmanager-v1.36.2";
/// The real kubelet plugin manager v1.36.2 with the kubelet's own DRA and device plugin
/// handlers.
pub const KUBELET_PLUGINS_V1_36: &str = "kubelet-plugins-v1.36.2";
/// The real pluginwatcher example plugin v1.36.2.
pub const EXAMPLE_PLUGIN_V1_36: &str = "example-plugin-v1.36.2";
/// The whole kubelet v1.36.2 (prebuilt).
pub const KUBELET_V1_36: &str = "kubelet-v1.36.2";
/// kube-scheduler v1.36.2 (prebuilt).
pub const SCHEDULER_V1_36: &str = "kube-scheduler-v1.36.2";

/// A Kubernetes release whose real components the peers provide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KubeVersion {
    /// v1.20.2, built from Debian's source package by `interop/build-peers.sh`.
    V1_20_2,
    /// v1.36.2, prebuilt (or built from a Kubernetes checkout) by `interop/build-peers.sh`.
    V1_36_2,
}

impl KubeVersion {
    /// Every release, oldest first: what a test runs against to cover them all.
    pub const ALL: [KubeVersion; 2] = [KubeVersion::V1_20_2, KubeVersion::V1_36_2];

    /// The version as Kubernetes writes it, e.g. `v1.36.2`.
    pub fn as_str(self) -> &'static str {
        match self {
            KubeVersion::V1_20_2 => "v1.20.2",
            KubeVersion::V1_36_2 => "v1.36.2",
        }
    }

    /// The peer name (see [`peer`](crate::peer)) of the plugin manager harness.
    pub fn plugin_manager_peer(self) -> &'static str {
        match self {
            KubeVersion::V1_20_2 => PLUGIN_MANAGER_HARNESS,
            KubeVersion::V1_36_2 => PLUGIN_MANAGER_V1_36,
        }
    }

    /// The peer name of the example plugin.
    pub fn example_plugin_peer(self) -> &'static str {
        match self {
            KubeVersion::V1_20_2 => EXAMPLE_PLUGIN,
            KubeVersion::V1_36_2 => EXAMPLE_PLUGIN_V1_36,
        }
    }

    /// The peer name of kube-apiserver.
    pub fn apiserver_peer(self) -> &'static str {
        match self {
            KubeVersion::V1_20_2 => APISERVER,
            KubeVersion::V1_36_2 => APISERVER_V1_36,
        }
    }

    /// The peer name of its kube-controller-manager.
    pub fn controller_manager_peer(self) -> &'static str {
        match self {
            KubeVersion::V1_20_2 => CONTROLLER_MANAGER,
            KubeVersion::V1_36_2 => CONTROLLER_MANAGER_V1_36,
        }
    }

    /// The peer name of its kube-scheduler.
    pub fn scheduler_peer(self) -> &'static str {
        match self {
            KubeVersion::V1_20_2 => SCHEDULER,
            KubeVersion::V1_36_2 => SCHEDULER_V1_36,
        }
    }

    /// The peer name of its (whole) kubelet.
    pub fn kubelet_peer(self) -> &'static str {
        match self {
            KubeVersion::V1_20_2 => KUBELET,
            KubeVersion::V1_36_2 => KUBELET_V1_36,
        }
    }
}

impl fmt::Display for KubeVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A call of a plugin handler that the plugin manager harness reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandlerCall {
    /// `ValidatePlugin(name, endpoint, versions)`.
    Validate,
    /// `RegisterPlugin(name, endpoint, versions[, timeout])`.
    Register,
    /// `DeRegisterPlugin(name[, endpoint])`.
    Deregister,
}

impl HandlerCall {
    fn event(self, version: KubeVersion) -> &'static str {
        match (version, self) {
            (KubeVersion::V1_20_2, HandlerCall::Validate) => "validate",
            (KubeVersion::V1_20_2, HandlerCall::Register) => "register",
            (KubeVersion::V1_20_2, HandlerCall::Deregister) => "deregister",
            (KubeVersion::V1_36_2, HandlerCall::Validate) => "ValidatePlugin",
            (KubeVersion::V1_36_2, HandlerCall::Register) => "RegisterPlugin",
            (KubeVersion::V1_36_2, HandlerCall::Deregister) => "DeRegisterPlugin",
        }
    }
}

/// One handler call the real plugin manager made, whatever the release.
#[derive(Debug, Clone, PartialEq)]
pub struct HandlerEvent {
    /// Which call.
    pub call: HandlerCall,
    /// The handler's plugin type (`CSIPlugin`, `DevicePlugin`).
    pub plugin_type: String,
    /// The plugin's name, from its `GetInfo`.
    pub name: String,
    /// The endpoint passed to the handler; `None` where the call has none (v1.20's
    /// `DeRegisterPlugin(name)`).
    pub endpoint: Option<String>,
    /// The supported versions passed to the handler (empty for a deregistration).
    pub versions: Vec<String>,
    /// The error the handler returned, `None` when it accepted.
    pub error: Option<String>,
    /// The client timeout v1.36's `RegisterPlugin` receives (`None` when absent or in v1.20).
    pub client_timeout: Option<Duration>,
    /// When the harness printed the line (Unix time, ns).
    pub ts_ns: i64,
    /// The line as printed.
    pub raw: Value,
}

/// Which plugin names the harness's fake handlers refuse.
#[derive(Debug, Clone, Default)]
pub struct PluginManagerOptions {
    /// Names whose `ValidatePlugin` fails.
    pub fail_validate: Vec<String>,
    /// Names whose `RegisterPlugin` fails (after a successful validation).
    pub fail_register: Vec<String>,
}

/// The real kubelet plugin manager (`pkg/kubelet/pluginmanager`) of one release, watching a
/// registration directory, with fake `CSIPlugin` and `DevicePlugin` handlers that report
/// every call.
///
/// Dropping it kills the process.
#[derive(Debug)]
pub struct RealPluginManager {
    version: KubeVersion,
    process: PeerProcess,
}

impl RealPluginManager {
    /// Creates `dir` (as the kubelet does), starts the harness of `version` on it and waits
    /// (at most `timeout`) for its start line.
    pub async fn start(
        version: KubeVersion,
        dir: &Path,
        options: &PluginManagerOptions,
        timeout: Duration,
    ) -> Result<Self, Error> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let list = |names: &[String]| OsString::from(names.join(","));
        let mut args: Vec<OsString> = Vec::new();
        match version {
            KubeVersion::V1_20_2 => {
                args.extend(["--dir".into(), dir.into()]);
                if !options.fail_validate.is_empty() {
                    args.extend(["--reject".into(), list(&options.fail_validate)]);
                }
            }
            KubeVersion::V1_36_2 => {
                args.extend([
                    "-sockets-dir".into(),
                    dir.into(),
                    "-types".into(),
                    "CSIPlugin,DevicePlugin".into(),
                ]);
                if !options.fail_validate.is_empty() {
                    args.extend(["-fail-validate".into(), list(&options.fail_validate)]);
                }
            }
        }
        if !options.fail_register.is_empty() {
            args.extend(["--fail-register".into(), list(&options.fail_register)]);
        }
        let mut process = PeerProcess::spawn(version.plugin_manager_peer(), args)?;
        let started = match version {
            KubeVersion::V1_20_2 => "ready",
            KubeVersion::V1_36_2 => "Started",
        };
        process.next_event(started, timeout).await?;
        // The harness says it started when it has called the plugin manager's Run, which first
        // walks the registry directory (adding a watch to every directory in it, hidden ones
        // included) and only then logs this line and starts its reconciler. A socket bound
        // while that walk runs can be stat'ed by it after a rename took it away, and the
        // kubelet then logs an error no running kubelet would.
        let deadline = tokio::time::Instant::now() + timeout;
        while !process.stderr_tail().contains(WATCHING) {
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::NotReady {
                    peer: process.label().to_owned(),
                    reason: format!("no {WATCHING:?} on stderr within {timeout:?}"),
                    log: process.stderr_tail(),
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(RealPluginManager { version, process })
    }

    /// The release.
    pub fn version(&self) -> KubeVersion {
        self.version
    }

    /// Waits at most `timeout` for the next `call` for the plugin `name`.
    pub async fn next(
        &mut self,
        call: HandlerCall,
        name: &str,
        timeout: Duration,
    ) -> Result<HandlerEvent, Error> {
        let v = self
            .process
            .next_event_named(call.event(self.version), name, timeout)
            .await?;
        self.parse(call, v)
    }

    /// Waits at most `timeout` for the next `call`, for any plugin.
    pub async fn next_any(
        &mut self,
        call: HandlerCall,
        timeout: Duration,
    ) -> Result<HandlerEvent, Error> {
        let v = self
            .process
            .next_event(call.event(self.version), timeout)
            .await?;
        self.parse(call, v)
    }

    /// Waits at most `timeout` for the next of the handler calls `calls`, for any plugin, and
    /// says which it was: for calls of different kinds that race (a plugin registered again
    /// before the others are deregistered), which waiting for one kind at a time would skip.
    pub async fn next_of(
        &mut self,
        calls: &[HandlerCall],
        timeout: Duration,
    ) -> Result<(HandlerCall, HandlerEvent), Error> {
        let version = self.version;
        let v = self
            .process
            .next_matching(
                |v| {
                    let e = v.get("event").and_then(serde_json::Value::as_str);
                    calls.iter().any(|c| Some(c.event(version)) == e)
                },
                timeout,
            )
            .await?;
        let e = v.get("event").and_then(serde_json::Value::as_str);
        let call = calls
            .iter()
            .copied()
            .find(|c| Some(c.event(version)) == e)
            .unwrap_or(calls[0]);
        self.parse(call, v).map(|ev| (call, ev))
    }

    /// The harness's line `v` of a `call`, read as a [`HandlerEvent`].
    fn parse(&self, call: HandlerCall, v: Value) -> Result<HandlerEvent, Error> {
        parse_handler_event(self.version, call, v).map_err(|reason| Error::BadLine {
            peer: self.process.label().to_owned(),
            reason,
        })
    }

    /// The error text the harness's handler returns for a name in
    /// [`PluginManagerOptions::fail_validate`].
    pub fn validate_error(&self, name: &str) -> String {
        match self.version {
            KubeVersion::V1_20_2 => "rejected by harness".to_owned(),
            KubeVersion::V1_36_2 => {
                format!("pmharness: validation of {name:?} rejected by --fail-validate")
            }
        }
    }

    /// The error text the harness's handler returns for a name in
    /// [`PluginManagerOptions::fail_register`].
    pub fn register_error(&self, name: &str) -> String {
        match self.version {
            KubeVersion::V1_20_2 => "register failed by harness".to_owned(),
            KubeVersion::V1_36_2 => {
                format!("pmharness: registration of {name:?} rejected by --fail-register")
            }
        }
    }

    /// The harness process (its raw lines, stderr tail, signals).
    pub fn process(&mut self) -> &mut PeerProcess {
        &mut self.process
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) -> Result<(), Error> {
        self.process.terminate()
    }
}

fn str_field(v: &Value, key: &str) -> Result<String, String> {
    match v.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!("{key:?} is not a string: {other}")),
        None => Err(format!("no {key:?}")),
    }
}

fn parse_handler_event(
    version: KubeVersion,
    call: HandlerCall,
    raw: Value,
) -> Result<HandlerEvent, String> {
    let with_line = |e: String| format!("{e} in {raw}");
    let (type_key, plugin_type) = match version {
        KubeVersion::V1_20_2 => ("type", str_field(&raw, "type")),
        KubeVersion::V1_36_2 => ("plugin_type", str_field(&raw, "plugin_type")),
    };
    let plugin_type = plugin_type.map_err(|e| with_line(format!("{type_key}: {e}")))?;
    let name = str_field(&raw, "name").map_err(with_line)?;
    // Both harnesses leave the endpoint out or empty where the call has none.
    let endpoint = raw
        .get("endpoint")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned);
    let versions = match raw.get("versions") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| with_line("a version is not a string".to_owned()))?,
        Some(other) => return Err(with_line(format!("\"versions\" is {other}"))),
    };
    let error = match version {
        KubeVersion::V1_20_2 => raw.get("error").and_then(Value::as_str).map(str::to_owned),
        KubeVersion::V1_36_2 => match raw.get("result").and_then(Value::as_str) {
            None | Some("ok") => None,
            Some(e) => Some(e.to_owned()),
        },
    };
    let client_timeout = raw
        .get("client_timeout_ns")
        .and_then(Value::as_u64)
        .map(Duration::from_nanos);
    let ts_ns = raw
        .get("ts_ns")
        .and_then(Value::as_i64)
        .ok_or_else(|| with_line("no \"ts_ns\"".to_owned()))?;
    Ok(HandlerEvent {
        call,
        plugin_type,
        name,
        endpoint,
        versions,
        error,
        client_timeout,
        ts_ns,
        raw,
    })
}

/// A `NotifyRegistrationStatus` the example plugin received from a plugin manager.
#[derive(Debug, Clone, PartialEq)]
pub struct Notification {
    /// `plugin_registered`.
    pub registered: bool,
    /// `error` (empty when registered).
    pub error: String,
    /// The line as printed.
    pub raw: Value,
}

/// The kubelet's own example plugin (`pluginwatcher.NewTestExamplePlugin`) of one release,
/// serving the registration service and the example services on one socket (which it also
/// advertises as its endpoint).
///
/// Dropping it kills the process.
#[derive(Debug)]
pub struct RealExamplePlugin {
    version: KubeVersion,
    process: PeerProcess,
}

impl RealExamplePlugin {
    /// Starts the example plugin of `version` on `socket`, answering `GetInfo` with
    /// `plugin_type`, `name` and `versions`, and waits (at most `timeout`) until it serves.
    pub async fn start(
        version: KubeVersion,
        socket: &Path,
        name: &str,
        plugin_type: &str,
        versions: &[&str],
        timeout: Duration,
    ) -> Result<Self, Error> {
        let (socket_flag, serving) = match version {
            KubeVersion::V1_20_2 => ("--socket", "ready"),
            KubeVersion::V1_36_2 => ("-endpoint", "Serving"),
        };
        let args: Vec<OsString> = vec![
            socket_flag.into(),
            socket.into(),
            "--name".into(),
            name.into(),
            "--type".into(),
            plugin_type.into(),
            "--versions".into(),
            versions.join(",").into(),
        ];
        let mut process = PeerProcess::spawn(version.example_plugin_peer(), args)?;
        process.next_event(serving, timeout).await?;
        Ok(RealExamplePlugin { version, process })
    }

    /// The release.
    pub fn version(&self) -> KubeVersion {
        self.version
    }

    /// Waits at most `timeout` for the next `NotifyRegistrationStatus` the plugin received.
    pub async fn next_notification(&mut self, timeout: Duration) -> Result<Notification, Error> {
        let (event, registered_key) = match self.version {
            KubeVersion::V1_20_2 => ("notify", "registered"),
            KubeVersion::V1_36_2 => ("NotifyRegistrationStatus", "plugin_registered"),
        };
        let raw = self.process.next_event(event, timeout).await?;
        let registered = raw.get(registered_key).and_then(Value::as_bool);
        let error = raw.get("error").and_then(Value::as_str);
        match (registered, error) {
            (Some(registered), Some(error)) => Ok(Notification {
                registered,
                error: error.to_owned(),
                raw,
            }),
            _ => Err(Error::BadLine {
                peer: self.process.label().to_owned(),
                reason: format!("no boolean {registered_key:?} or string \"error\" in {raw}"),
            }),
        }
    }

    /// The plugin process (its raw lines, stderr tail, signals).
    pub fn process(&mut self) -> &mut PeerProcess {
        &mut self.process
    }

    /// Sends SIGTERM (the plugin stops serving and removes its socket).
    pub fn terminate(&self) -> Result<(), Error> {
        self.process.terminate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn v1_20_lines_parse() {
        let e = parse_handler_event(
            KubeVersion::V1_20_2,
            HandlerCall::Validate,
            json!({"event":"validate","type":"CSIPlugin","name":"n","endpoint":"/e",
                   "versions":["1.0.0"],"error":"rejected by harness","ts_ns":5}),
        )
        .unwrap();
        assert_eq!(e.plugin_type, "CSIPlugin");
        assert_eq!(e.endpoint.as_deref(), Some("/e"));
        assert_eq!(e.versions, ["1.0.0"]);
        assert_eq!(e.error.as_deref(), Some("rejected by harness"));
        assert_eq!(e.client_timeout, None);
        let d = parse_handler_event(
            KubeVersion::V1_20_2,
            HandlerCall::Deregister,
            json!({"event":"deregister","type":"DevicePlugin","name":"n","endpoint":"","ts_ns":6}),
        )
        .unwrap();
        assert_eq!(d.endpoint, None);
        assert!(d.versions.is_empty());
        assert_eq!(d.error, None);
    }

    #[test]
    fn v1_36_lines_parse() {
        let e = parse_handler_event(
            KubeVersion::V1_36_2,
            HandlerCall::Register,
            json!({"ts_ns":7,"event":"RegisterPlugin","plugin_type":"DevicePlugin","name":"n",
                   "endpoint":"/e","versions":["v1beta1"],"result":"ok","client_timeout_ns":10_000_000_000_u64}),
        )
        .unwrap();
        assert_eq!(e.plugin_type, "DevicePlugin");
        assert_eq!(e.error, None);
        assert_eq!(e.client_timeout, Some(Duration::from_secs(10)));
        let f = parse_handler_event(
            KubeVersion::V1_36_2,
            HandlerCall::Validate,
            json!({"ts_ns":7,"event":"ValidatePlugin","plugin_type":"CSIPlugin","name":"n","result":"no"}),
        )
        .unwrap();
        assert_eq!(f.error.as_deref(), Some("no"));
        assert_eq!(f.endpoint, None);
    }

    #[test]
    fn malformed_lines_are_errors_not_panics() {
        for raw in [
            json!({"event":"validate","name":"n","ts_ns":1}),
            json!({"event":"validate","type":7,"name":"n","ts_ns":1}),
            json!({"event":"validate","type":"t","name":"n","versions":"x","ts_ns":1}),
            json!({"event":"validate","type":"t","name":"n","versions":[1],"ts_ns":1}),
            json!({"event":"validate","type":"t","name":"n"}),
        ] {
            let err =
                parse_handler_event(KubeVersion::V1_20_2, HandlerCall::Validate, raw).unwrap_err();
            assert!(err.contains(" in {"), "{err}");
        }
    }
}
