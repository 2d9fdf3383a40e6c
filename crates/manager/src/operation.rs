//! One registration attempt and one deregistration, with upstream's steps and error strings.
//!
//! Register: dial -> GetInfo -> check the reply (D7) -> handler by type -> validate -> register
//! -> Notify(true). An unknown type, a refused check or a failed validate is answered with
//! Notify(false, reason). A failed register or a failed final notify is rolled back: the
//! handler's deregister is called (D2), so the caller can back off and retry from scratch.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::FutureExt;
use tokio_util::sync::CancellationToken;

use plugreg_proto::pluginregistration::registration_client::RegistrationClient;
use plugreg_proto::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus};
use plugreg_runtime::report;
use plugreg_transport::Connection;

use crate::handler::HandlerRegistry;

/// The step of a registration that failed (a metrics label and a log key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Connecting to the registration socket.
    Dial,
    /// Calling GetInfo.
    GetInfo,
    /// The plugin's reply failed plugreg's checks (D7).
    CheckInfo,
    /// No handler for the plugin type.
    NoHandler,
    /// The handler refused the plugin.
    Validate,
    /// The handler failed to register the plugin.
    Register,
    /// The final NotifyRegistrationStatus failed.
    Notify,
}

impl Step {
    /// Every step, in order.
    pub const ALL: [Step; 7] = [
        Step::Dial,
        Step::GetInfo,
        Step::CheckInfo,
        Step::NoHandler,
        Step::Validate,
        Step::Register,
        Step::Notify,
    ];

    /// The label used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Dial => "dial",
            Step::GetInfo => "get_info",
            Step::CheckInfo => "check_info",
            Step::NoHandler => "no_handler",
            Step::Validate => "validate",
            Step::Register => "register",
            Step::Notify => "notify",
        }
    }
}

/// A failed registration attempt. The message is upstream's.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct RegisterError {
    /// Which step failed.
    pub step: Step,
    /// Upstream-style message (`RegisterPlugin error -- ...`).
    pub message: String,
    /// What GetInfo answered, when it got that far.
    pub info: Option<PluginInfo>,
    /// The dial was refused by a socket file less than [`YOUNG_SOCKET`] old: most likely a
    /// plugin that has bound its socket but not called listen() yet (D1).
    pub young_refusal: bool,
}

/// How long after its creation a socket that refuses connections is taken for a plugin still
/// between bind() and listen() (D1), rather than a dead one.
pub const YOUNG_SOCKET: Duration = Duration::from_secs(1);

/// Whether `e` is a refused connect to a socket file younger than [`YOUNG_SOCKET`].
fn refused_by_young_socket(e: &plugreg_transport::Error, socket: &Path) -> bool {
    let refused = matches!(e, plugreg_transport::Error::Dial { source, .. }
        if source.kind() == std::io::ErrorKind::ConnectionRefused);
    refused
        && std::fs::metadata(socket)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age < YOUNG_SOCKET))
}

/// Timeouts of one registration attempt.
#[derive(Debug, Clone)]
pub struct Timeouts {
    /// Connecting.
    pub dial: Duration,
    /// GetInfo.
    pub get_info: Duration,
    /// NotifyRegistrationStatus.
    pub notify: Duration,
    /// Each handler call (validate, register, deregister) of a plugin type (D7).
    pub handler: HandlerTimeouts,
}

/// How long a handler call may take: a default and per-plugin-type overrides (D7).
#[derive(Debug, Clone)]
pub struct HandlerTimeouts {
    /// For plugin types without an override.
    pub default: Duration,
    /// By plugin type.
    pub by_type: Arc<HashMap<String, Duration>>,
}

impl HandlerTimeouts {
    /// The limit for a handler call of `plugin_type`.
    pub fn for_type(&self, plugin_type: &str) -> Duration {
        self.by_type
            .get(plugin_type)
            .copied()
            .unwrap_or(self.default)
    }
}

/// How far an operation got: the step a panic outside a handler call is counted against, and
/// the plugin it is about once GetInfo told.
#[derive(Debug, Default)]
pub struct Progress {
    step: AtomicUsize,
    plugin: OnceLock<(String, String)>,
    /// Told the operation's task id once GetInfo named the plugin (the runner's channel).
    identified: Option<tokio::sync::mpsc::UnboundedSender<tokio::task::Id>>,
}

impl Progress {
    pub(crate) fn set(&self, step: Step) {
        let i = Step::ALL.iter().position(|s| *s == step).unwrap_or(0);
        self.step.store(i, Ordering::Relaxed);
    }

    /// The step the operation is in (or last was in).
    pub fn step(&self) -> Step {
        Step::ALL[self.step.load(Ordering::Relaxed).min(Step::ALL.len() - 1)]
    }

    /// The plugin's type and name, once GetInfo answered.
    pub fn plugin(&self) -> Option<&(String, String)> {
        self.plugin.get()
    }

    /// Progress that tells `identified` the operation's task id once GetInfo named the plugin.
    pub(crate) fn telling(identified: tokio::sync::mpsc::UnboundedSender<tokio::task::Id>) -> Self {
        Progress {
            identified: Some(identified),
            ..Progress::default()
        }
    }

    pub(crate) fn set_plugin(&self, plugin_type: &str, name: &str) {
        if self
            .plugin
            .set((plugin_type.to_owned(), name.to_owned()))
            .is_ok()
            && let (Some(tx), Some(id)) = (&self.identified, tokio::task::try_id())
        {
            let _ = tx.send(id);
        }
    }
}

/// What a cancelled registration reports: the runner cancels the slow operation of the plugin
/// holding the most slow operations when it needs room for another.
pub const CANCELLED: &str =
    "operation cancelled: it ran slow while this plugin held the most slow operations";

/// Awaits `fut` unless `cancel` fires first (`None` then).
async fn unless_cancelled<T>(
    cancel: &CancellationToken,
    fut: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => None,
        v = fut => Some(v),
    }
}

/// Runs one handler call with a time limit; a panic inside it becomes an error instead of
/// taking the operation down (the handler is someone else's code). With `cancel`, the call is
/// abandoned when it fires.
async fn handler_call<T>(
    limit: Duration,
    call: impl std::future::Future<Output = T>,
    cancel: Option<&CancellationToken>,
) -> Result<T, String> {
    let call = tokio::time::timeout(limit, AssertUnwindSafe(call).catch_unwind());
    let done = match cancel {
        Some(cancel) => unless_cancelled(cancel, call)
            .await
            .ok_or_else(|| CANCELLED.to_owned())?,
        None => call.await,
    };
    match done {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(panic)) => Err(format!("handler panicked: {}", panic_text(&*panic))),
        Err(_) => Err(format!("handler did not answer within {limit:?}")),
    }
}

/// The message of a panic payload.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_owned()
    }
}

/// What a successful registration recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// Plugin type.
    pub plugin_type: String,
    /// Plugin name.
    pub name: String,
    /// Endpoint handed to the handler (the socket path when the plugin gave none).
    pub endpoint: String,
    /// Advertised versions.
    pub versions: Vec<String>,
}

pub use crate::info_check::{
    MAX_ENDPOINT_LEN, MAX_NAME_LEN, MAX_TYPE_LEN, MAX_VERSION_LEN, MAX_VERSIONS,
};

/// Checks the fields of a GetInfo reply before they reach a handler (D7); see
/// [`info_check`](crate::info_check).
pub fn check_info(info: &PluginInfo) -> Result<(), String> {
    crate::info_check::check_fields(
        &info.r#type,
        &info.name,
        &info.endpoint,
        &info.supported_versions,
    )
}

fn client(conn: Connection) -> RegistrationClient<Connection> {
    plugreg_transport::client!(RegistrationClient, conn)
}

/// Sends `NotifyRegistrationStatus`; with a non-empty `error` the result is that error (or
/// `"<error>: <rpc error>"` when the call itself failed), as upstream's notify helper.
async fn notify(
    client: &mut RegistrationClient<Connection>,
    registered: bool,
    error: &str,
    timeout: Duration,
) -> Result<(), String> {
    let mut req = tonic::Request::new(RegistrationStatus {
        plugin_registered: registered,
        error: error.to_owned(),
    });
    req.set_timeout(timeout);
    let sent = match tokio::time::timeout(timeout, client.notify_registration_status(req)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status)) => Err(report::grpc(&status)),
        Err(_) => Err(report::grpc(&no_reply(timeout))),
    };
    match (sent, error.is_empty()) {
        (Ok(()), true) => Ok(()),
        (Ok(()), false) => Err(error.to_owned()),
        (Err(e), true) => Err(e),
        (Err(e), false) => Err(format!("{error}: {e}")),
    }
}

/// The status of a call that got no reply in time.
fn no_reply(timeout: Duration) -> tonic::Status {
    tonic::Status::deadline_exceeded(format!("no reply within {timeout:?}"))
}

/// Tells the plugin it was refused and builds the error for the caller: the refusal's own text
/// when the notify went through, upstream's "failed to send error" text when it did not.
async fn refuse(
    client: &mut RegistrationClient<Connection>,
    step: Step,
    reason: String,
    op_error: Option<String>,
    info: &PluginInfo,
    socket: &Path,
    timeout: Duration,
) -> RegisterError {
    let message = match notify(client, false, &reason, timeout).await {
        Err(e) if e == reason => op_error.unwrap_or(reason),
        Err(e) => format!(
            "RegisterPlugin error -- failed to send error at socket {}, err: {e}",
            socket.display()
        ),
        Ok(()) => op_error.unwrap_or(reason),
    };
    RegisterError {
        step,
        message,
        info: Some(info.clone()),
        young_refusal: false,
    }
}

/// One registration attempt of the socket at `socket`. When `cancel` fires, the attempt ends
/// at its next step (a handler call in flight is abandoned, a registration rolled back) with
/// [`CANCELLED`].
pub async fn register(
    socket: &Path,
    handlers: &HandlerRegistry,
    timeouts: &Timeouts,
    progress: &Progress,
    cancel: &CancellationToken,
) -> Result<Registered, RegisterError> {
    progress.set(Step::Dial);
    let fail = |step, message: String, info: Option<&PluginInfo>| RegisterError {
        step,
        message,
        info: info.cloned(),
        young_refusal: false,
    };
    let cancelled = |step| RegisterError {
        step,
        message: format!(
            "RegisterPlugin error -- {CANCELLED} at socket {}",
            socket.display()
        ),
        info: None,
        young_refusal: false,
    };
    let dialled = unless_cancelled(
        cancel,
        plugreg_transport::connect_direct(socket, timeouts.dial),
    )
    .await
    .ok_or_else(|| cancelled(Step::Dial))?;
    let channel = dialled.map_err(|e| RegisterError {
        young_refusal: refused_by_young_socket(&e, socket),
        ..fail(
            Step::Dial,
            format!(
                "RegisterPlugin error -- dial failed at socket {}, err: {}",
                socket.display(),
                report::chain(&e)
            ),
            None,
        )
    })?;
    let mut client = client(channel);

    progress.set(Step::GetInfo);
    let mut req = tonic::Request::new(InfoRequest {});
    req.set_timeout(timeouts.get_info);
    let answer = tokio::time::timeout(timeouts.get_info, client.get_info(req));
    let answer = unless_cancelled(cancel, answer)
        .await
        .ok_or_else(|| cancelled(Step::GetInfo))?;
    let info = match answer {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(status)) => {
            return Err(fail(
                Step::GetInfo,
                get_info_error(socket, &report::grpc(&status)),
                None,
            ));
        }
        Err(_) => {
            let e = report::grpc(&no_reply(timeouts.get_info));
            return Err(fail(Step::GetInfo, get_info_error(socket, &e), None));
        }
    };

    progress.set_plugin(&info.r#type, &info.name);
    let limit = timeouts.handler.for_type(&info.r#type);
    let (handler, endpoint) = match admit(&info, socket, handlers, limit, progress, cancel).await {
        Ok(admitted) => admitted,
        Err(r) => {
            let err = refuse(
                &mut client,
                r.step,
                r.reason,
                r.op_error,
                &info,
                socket,
                timeouts.notify,
            );
            return Err(err.await);
        }
    };

    progress.set(Step::Notify);
    let notified = unless_cancelled(cancel, notify(&mut client, true, "", timeouts.notify))
        .await
        .unwrap_or_else(|| Err(CANCELLED.to_owned()));
    if let Err(e) = notified {
        rollback(handler, &info.name, &endpoint, limit).await;
        return Err(fail(
            Step::Notify,
            format!(
                "RegisterPlugin error -- failed to send registration status at socket {}, err: {e}",
                socket.display()
            ),
            Some(&info),
        ));
    }

    Ok(Registered {
        plugin_type: info.r#type,
        name: info.name,
        endpoint,
        versions: info.supported_versions,
    })
}

/// Why a plugin was turned away after GetInfo: what the plugin is told, and (where upstream
/// differs) what the operation reports.
struct Refusal {
    step: Step,
    reason: String,
    op_error: Option<String>,
}

impl Refusal {
    fn new(step: Step, reason: String) -> Self {
        Self {
            step,
            reason,
            op_error: None,
        }
    }
}

/// Checks the plugin's reply, finds its handler, validates and registers it. A failed
/// register is rolled back (D2) before the refusal is returned.
async fn admit<'h>(
    info: &PluginInfo,
    socket: &Path,
    handlers: &'h HandlerRegistry,
    limit: Duration,
    progress: &Progress,
    cancel: &CancellationToken,
) -> Result<(&'h Arc<dyn crate::PluginHandler>, String), Refusal> {
    let refused = "RegisterPlugin error -- plugin validation failed with err";
    progress.set(Step::CheckInfo);
    check_info(info).map_err(|e| Refusal::new(Step::CheckInfo, format!("{refused}: {e}")))?;
    let handler = handlers.get(&info.r#type).ok_or_else(|| {
        let reason = format!(
            "RegisterPlugin error -- no handler registered for plugin type: {} at socket {}",
            info.r#type,
            socket.display()
        );
        Refusal::new(Step::NoHandler, reason)
    })?;
    let endpoint = if info.endpoint.is_empty() {
        socket.to_string_lossy().into_owned()
    } else {
        info.endpoint.clone()
    };
    let versions = &info.supported_versions;
    progress.set(Step::Validate);
    let validated = handler_call(
        limit,
        handler.validate(&info.name, &endpoint, versions),
        Some(cancel),
    )
    .await
    .and_then(|r| r.map_err(|e| e.to_string()));
    if let Err(e) = validated {
        return Err(Refusal {
            step: Step::Validate,
            reason: format!("{refused}: {e}"),
            op_error: Some(
                "RegisterPlugin error -- pluginHandler.ValidatePluginFunc failed".into(),
            ),
        });
    }
    progress.set(Step::Register);
    let registered = handler_call(
        limit,
        handler.register(&info.name, &endpoint, versions),
        Some(cancel),
    )
    .await
    .and_then(|r| r.map_err(|e| e.to_string()));
    if let Err(e) = registered {
        rollback(handler, &info.name, &endpoint, limit).await;
        let reason = format!("RegisterPlugin error -- plugin registration failed with err: {e}");
        return Err(Refusal::new(Step::Register, reason));
    }
    Ok((handler, endpoint))
}

/// D2: a failed register or notify is undone, so the next attempt starts from scratch.
async fn rollback(
    handler: &Arc<dyn crate::PluginHandler>,
    name: &str,
    endpoint: &str,
    limit: Duration,
) {
    // Not cancellable: a registration is always undone.
    if let Err(e) = handler_call(limit, handler.deregister(name, endpoint), None).await {
        tracing::warn!(name, endpoint, error = %e, "DeRegisterPlugin of a failed registration failed");
    }
}

fn get_info_error(socket: &Path, err: &str) -> String {
    format!(
        "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket {}, err: {err}",
        socket.display()
    )
}

/// Deregisters a plugin: the handler forgets it; no call is made to the plugin.
pub async fn deregister(
    handlers: &HandlerRegistry,
    plugin_type: &str,
    name: &str,
    endpoint: &str,
    limit: Duration,
) {
    match handlers.get(plugin_type) {
        Some(h) => {
            if let Err(e) = handler_call(limit, h.deregister(name, endpoint), None).await {
                tracing::warn!(plugin_type, name, endpoint, error = %e, "DeRegisterPlugin failed");
            }
        }
        None => tracing::warn!(
            plugin_type,
            name,
            "UnregisterPlugin error -- failed to get plugin handler"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(t: &str, n: &str, e: &str, v: &[&str]) -> PluginInfo {
        PluginInfo {
            r#type: t.into(),
            name: n.into(),
            endpoint: e.into(),
            supported_versions: v.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn accepts_ordinary_plugin_info() {
        check_info(&info(
            "CSIPlugin",
            "csi.example.com",
            "/var/lib/kubelet/plugins/x/csi.sock",
            &["1.0.0"],
        ))
        .unwrap();
        check_info(&info("DevicePlugin", "example.com/gpu", "", &["v1beta1"])).unwrap();
    }

    #[test]
    fn refuses_empty_long_and_odd_fields() {
        let long = "n".repeat(MAX_NAME_LEN + 1);
        let cases = [
            (info("CSIPlugin", "", "", &[]), "plugin name is empty"),
            (info("", "x", "", &[]), "plugin type is empty"),
            (info("CSIPlugin", &long, "", &[]), "not 1-316"),
            (info("CSIPlugin", "a b", "", &[]), "printable"),
            (info("CSIPlugin", "a\u{7}", "", &[]), "printable"),
            (info("CSIPlugin", "ok", "/x\n", &[]), "control"),
            (info("CSIPlugin", "ok", "", &[""]), "version"),
        ];
        for (i, want) in cases {
            let err = check_info(&i).unwrap_err();
            assert!(err.contains(want), "{err:?} should mention {want:?}");
        }
    }

    /// upstream TestNotifyPlugin: success is Ok, a refusal with a message is that message, a
    /// transport error is an error.
    #[tokio::test]
    async fn notify_reports_success_refusal_and_transport_errors() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("n.sock");
        let registrar = plugreg_registrar::Registrar::new(PluginInfo::default());
        let token = tokio_util::sync::CancellationToken::new();
        tokio::spawn({
            let (r, s, t) = (registrar.clone(), sock.clone(), token.clone());
            async move { r.serve(&s, Default::default(), t).await.unwrap() }
        });
        while !sock.exists() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let ch = plugreg_transport::connect_direct(&sock, Duration::from_secs(2))
            .await
            .unwrap();
        let mut c = client(ch);
        let t = Duration::from_secs(2);
        assert_eq!(notify(&mut c, true, "", t).await, Ok(()));
        assert_eq!(notify(&mut c, false, "no", t).await, Err("no".to_owned()));
        assert_eq!(registrar.status().borrow().notifications(), 2);
        token.cancel();
        while sock.exists() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let err = notify(&mut c, true, "", Duration::from_millis(500))
            .await
            .unwrap_err();
        assert!(err.starts_with("rpc error: code = "), "{err}");
        let err = notify(&mut c, false, "why", Duration::from_millis(500))
            .await
            .unwrap_err();
        assert!(err.starts_with("why: rpc error: code = "), "{err}");
    }

    #[test]
    fn long_values_are_truncated_in_messages() {
        let err = check_info(&info("CSIPlugin", &"x".repeat(5000), "", &[])).unwrap_err();
        assert!(err.len() < 300, "{}", err.len());
    }
}
