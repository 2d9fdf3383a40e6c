//! The one timed CSI client of the controller sidecars: a channel to the driver, the per-call
//! deadline (`--timeout`), the `csi_sidecar_operations_seconds` metric and, where the sidecar
//! logs its calls as csi-lib-utils' interceptor does, the `-v=5` "GRPC call"/"GRPC response"
//! lines capped at `--max-grpc-log-length`. Every call goes through [`Client::timed`]; the
//! client has the Identity calls and the capability reads every sidecar makes at start-up
//! ([`crate::driver::identify`]), and each sidecar's `Driver` wraps it with its own Controller
//! calls.

use std::collections::HashMap;
use std::fmt::Debug;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use plugreg_csi_core::client::{CallError, Connection, Retry};
use plugreg_proto::csi::v1::{
    ControllerGetCapabilitiesRequest, GetPluginCapabilitiesRequest, GetPluginInfoRequest,
    ProbeRequest, controller_service_capability, plugin_capability,
};
use plugreg_runtime::report;
use tokio::time::MissedTickBehavior;
use tonic::Code;
use tonic::transport::Channel;

use crate::driver::CsiError;
use crate::metrics::Metrics;

pub use controller_service_capability::rpc::Type as ControllerRpc;
pub use plugin_capability::service::Type as PluginService;

/// `/csi.v1.Identity/Probe`.
pub const PROBE: &str = "/csi.v1.Identity/Probe";
/// `/csi.v1.Identity/GetPluginInfo`.
pub const GET_PLUGIN_INFO: &str = "/csi.v1.Identity/GetPluginInfo";
/// `/csi.v1.Identity/GetPluginCapabilities`.
pub const GET_PLUGIN_CAPABILITIES: &str = "/csi.v1.Identity/GetPluginCapabilities";
/// `/csi.v1.Controller/ControllerGetCapabilities`.
pub const CONTROLLER_GET_CAPABILITIES: &str = "/csi.v1.Controller/ControllerGetCapabilities";

/// Where the calls are logged, at `-v=5` (csi-lib-utils' interceptor logs every call there).
pub const V5: &str = "plugreg_sidecar_kit::csi::v5";

/// Pause between Probe attempts.
const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// What replaces each secret in a logged request (protosanitizer's text).
const STRIPPED: &str = "***stripped***";

/// `secrets` with every value replaced, for a logged request.
pub fn stripped(secrets: &HashMap<String, String>) -> HashMap<String, String> {
    secrets
        .keys()
        .map(|k| (k.clone(), STRIPPED.to_owned()))
        .collect()
}

/// `text` capped at `max` characters as csi-lib-utils caps a logged response
/// (`--max-grpc-log-length`): the first `max` characters and a note; `max` <= 0 is no cap.
pub fn cap_log(text: String, max: i64) -> String {
    let Ok(max) = usize::try_from(max) else {
        return text;
    };
    if max == 0 {
        return text;
    }
    match text.char_indices().nth(max) {
        Some((end, _)) => format!(
            "{} [response body too large, log capped to {max} chars]",
            &text[..end]
        ),
        None => text,
    }
}

/// What the driver answered to the capability reads (empty where it was not asked).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// GetPluginCapabilities' services.
    pub plugin: Vec<PluginService>,
    /// ControllerGetCapabilities' RPCs.
    pub controller: Vec<ControllerRpc>,
}

impl Capabilities {
    /// Whether the plugin has the service `service` (CONTROLLER_SERVICE, ...).
    pub fn has_service(&self, service: PluginService) -> bool {
        self.plugin.contains(&service)
    }

    /// Whether the controller has the RPC capability `rpc` (CREATE_DELETE_VOLUME, ...).
    pub fn has_rpc(&self, rpc: ControllerRpc) -> bool {
        self.controller.contains(&rpc)
    }
}

/// The driver's calls, each made once within the deadline and counted in
/// `csi_sidecar_operations_seconds`. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    conn: Connection,
    metrics: Arc<Metrics>,
    /// `--max-grpc-log-length` of a sidecar that logs its calls; `None`: not logged.
    grpc_log: Option<i64>,
}

impl Client {
    /// Calls over `channel`, each within `timeout`, reported to `metrics`, not logged.
    pub fn new(channel: Channel, timeout: Duration, metrics: Arc<Metrics>) -> Self {
        Self {
            // The address is the channel's; the calls do not need it.
            conn: Connection::from_channel(channel, "", timeout, Retry::ONCE),
            metrics,
            grpc_log: None,
        }
    }

    /// Logs every call at `-v=5`, each response capped at `max` characters
    /// (`--max-grpc-log-length`; <= 0: no cap).
    pub fn logging_calls(mut self, max: i64) -> Self {
        self.grpc_log = Some(max);
        self
    }

    /// The same client with another per-call deadline.
    pub fn with_timeout(&self, timeout: Duration) -> Self {
        Self {
            conn: self.conn.with_timeout(timeout),
            ..self.clone()
        }
    }

    /// The connection the calls are made on (its stubs and `call` build a sidecar's own calls).
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The registry the calls are counted in.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The deadline of every call.
    pub fn timeout(&self) -> Duration {
        self.conn.timeout()
    }

    /// Runs one call of `method` (the full gRPC path) that concerns no volume: see
    /// [`timed_as`](Self::timed_as).
    pub fn timed<'a, T: Debug + Default + 'a>(
        &'a self,
        method: &'a str,
        request: &'a (dyn Debug + Sync),
        call: impl Future<Output = Result<T, CallError>> + 'a,
    ) -> impl Future<Output = Result<T, CallError>> + 'a {
        self.timed_as(method, None, request, call)
    }

    /// Runs one call and records it in `csi_sidecar_operations_seconds`; `migrated` is the
    /// `migrated` label of a call for a volume (`true` for a translated in-tree PV's), `None`
    /// for the others. A client [`logging_calls`](Self::logging_calls) logs it at `-v=5` as
    /// csi-lib-utils does: "GRPC call" with `request` as given (such a sidecar passes its
    /// requests with their secrets [`stripped`]), then "GRPC response" with the answer (capped)
    /// and the error.
    ///
    /// The call's future is boxed here, before it is first polled: a tonic call's state is
    /// several KiB (its request encoding, the channel's response future, the timeout), and
    /// inline it would be part of every future that awaits a CSI call (a provisioner's claim
    /// sync, a PV's deletion) for the whole of that future's life, not only while the call
    /// runs (docs/design.md S7).
    pub fn timed_as<'a, T: Debug + Default + 'a>(
        &'a self,
        method: &'a str,
        migrated: Option<bool>,
        request: &'a (dyn Debug + Sync),
        call: impl Future<Output = Result<T, CallError>> + 'a,
    ) -> impl Future<Output = Result<T, CallError>> + 'a {
        self.timed_boxed(method, migrated, request, Box::pin(call))
    }

    async fn timed_boxed<T: Debug + Default>(
        &self,
        method: &str,
        migrated: Option<bool>,
        request: &(dyn Debug + Sync),
        call: Pin<Box<impl Future<Output = Result<T, CallError>>>>,
    ) -> Result<T, CallError> {
        if self.grpc_log.is_some() {
            tracing::debug!(target: V5, method, request = ?request, "GRPC call");
        }
        let res = self
            .metrics
            .timed_csi_call_as(method, migrated, call, CallError::code)
            .await;
        if let Some(max) = self.grpc_log
            && tracing::enabled!(target: V5, tracing::Level::DEBUG)
        {
            let (response, err) = match &res {
                Ok(r) => (format!("{r:?}"), "<nil>".to_owned()),
                Err(e) => (format!("{:?}", T::default()), report::grpc(&e.to_status())),
            };
            tracing::debug!(target: V5, method, response = %cap_log(response, max), err = %err, "GRPC response");
        }
        res
    }

    /// Probes the driver until it is ready (csi-lib-utils' `ProbeForever`): a Probe about
    /// every second; `ready=false` and DeadlineExceeded are retried without limit, anything
    /// else (UNIMPLEMENTED included) is [`CsiError::Probe`].
    pub async fn probe_forever(&self) -> Result<(), CsiError> {
        let mut ticker = tokio::time::interval(PROBE_INTERVAL);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        ticker.tick().await; // the first tick is immediate
        loop {
            tracing::info!("Probing CSI driver for readiness");
            match self.timed(PROBE, &ProbeRequest {}, self.conn.probe()).await {
                Ok(response) if response.ready != Some(false) => return Ok(()),
                Ok(_) => tracing::info!("CSI driver is not ready"),
                Err(e) if e.code() == Some(Code::DeadlineExceeded) => {
                    tracing::info!("CSI driver probe timed out")
                }
                Err(e) => return Err(CsiError::Probe(report::grpc(&e.to_status()))),
            }
            ticker.tick().await;
        }
    }

    /// GetPluginInfo: the driver's name; an empty one is [`CsiError::EmptyName`].
    pub async fn plugin_name(&self) -> Result<String, CsiError> {
        let info = self
            .timed(
                GET_PLUGIN_INFO,
                &GetPluginInfoRequest {},
                self.conn.get_plugin_info(),
            )
            .await
            .map_err(CsiError::Call)?;
        if info.name.is_empty() {
            return Err(CsiError::EmptyName);
        }
        Ok(info.name)
    }

    /// GetPluginCapabilities: the plugin's services.
    pub async fn plugin_capabilities(&self) -> Result<Vec<PluginService>, CallError> {
        let answer = self
            .timed(
                GET_PLUGIN_CAPABILITIES,
                &GetPluginCapabilitiesRequest {},
                self.conn.get_plugin_capabilities(),
            )
            .await?;
        Ok(answer
            .capabilities
            .iter()
            .filter_map(|c| match &c.r#type {
                Some(plugin_capability::Type::Service(s)) => PluginService::try_from(s.r#type).ok(),
                _ => None,
            })
            .collect())
    }

    /// ControllerGetCapabilities: the controller's RPC capabilities.
    pub async fn controller_capabilities(&self) -> Result<Vec<ControllerRpc>, CallError> {
        let answer = self
            .timed(
                CONTROLLER_GET_CAPABILITIES,
                &ControllerGetCapabilitiesRequest {},
                self.conn.controller_get_capabilities(),
            )
            .await?;
        Ok(answer
            .capabilities
            .iter()
            .filter_map(|c| match &c.r#type {
                Some(controller_service_capability::Type::Rpc(r)) => {
                    ControllerRpc::try_from(r.r#type).ok()
                }
                _ => None,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_capped_at_the_maximum_only() {
        assert_eq!(cap_log("abcdef".into(), -1), "abcdef");
        assert_eq!(cap_log("abcdef".into(), 0), "abcdef");
        assert_eq!(cap_log("abcdef".into(), 6), "abcdef");
        assert_eq!(
            cap_log("abcdef".into(), 3),
            "abc [response body too large, log capped to 3 chars]"
        );
        // Characters, not bytes.
        assert_eq!(
            cap_log("äöü".into(), 2),
            "äö [response body too large, log capped to 2 chars]"
        );
    }

    #[test]
    fn logged_secrets_keep_their_keys_only() {
        let secrets = HashMap::from([("password".to_owned(), "hunter2".to_owned())]);
        assert_eq!(
            stripped(&secrets),
            HashMap::from([("password".to_owned(), STRIPPED.to_owned())])
        );
    }
}
