//! The one client of a CSI driver, for every plugreg program that calls one (the kubelet-side
//! handler, the node client, `plugreg csi`, the driver check, the provisioner): a connection
//! with each call bounded by a timeout (the kubelet's 2 minutes for node calls by default),
//! retried on transient failures under a [`Retry`] policy, its failure kept as a typed
//! [`CallError`] with the gRPC status.
//!
//! Retrying relies on the driver's idempotency, which the CSI spec requires of every stage,
//! publish, unpublish, unstage, expand, CreateVolume and DeleteVolume call: a repeat of a call
//! whose answer was lost does no work twice.

use std::future::Future;
use std::time::Duration;

use plugreg_proto::csi::v1::controller_client::ControllerClient;
use plugreg_proto::csi::v1::group_controller_client::GroupControllerClient;
use plugreg_proto::csi::v1::identity_client::IdentityClient;
use plugreg_proto::csi::v1::node_client::NodeClient as NodeStub;
use plugreg_proto::csi::v1::{
    ControllerGetCapabilitiesRequest, ControllerGetCapabilitiesResponse, CreateVolumeRequest,
    CreateVolumeResponse, DeleteVolumeRequest, DeleteVolumeResponse, GetPluginCapabilitiesRequest,
    GetPluginCapabilitiesResponse, GetPluginInfoRequest, GetPluginInfoResponse,
    NodeGetCapabilitiesRequest, NodeGetCapabilitiesResponse, NodeGetInfoRequest,
    NodeGetInfoResponse, ProbeRequest, ProbeResponse,
};
use plugreg_runtime::backoff::Backoff;
use tonic::Code;
use tonic::transport::Channel;

/// The kubelet's deadline for every CSI node call (`csiTimeout`, docs/upstream/csi-wire.md §1.13).
pub const NODE_TIMEOUT: Duration = Duration::from_secs(120);

/// Why a call to a CSI driver failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The socket could not be dialed.
    #[error("failed to dial the CSI driver at {endpoint}")]
    Dial {
        /// The endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: plugreg_transport::Error,
    },
    /// The driver did not answer in time (on the last attempt): the deadline passed on this
    /// side (a DEADLINE_EXCEEDED the driver answered before it is [`CallError::Rpc`]).
    #[error("{method} did not answer within {}", humantime::format_duration(*.timeout))]
    Timeout {
        /// The RPC, e.g. `NodeStageVolume`.
        method: &'static str,
        /// The limit.
        timeout: Duration,
        /// Calls made.
        attempts: u32,
    },
    /// The driver answered with an error status (on the last attempt).
    #[error("{method} failed")]
    Rpc {
        /// The RPC.
        method: &'static str,
        /// The driver's status, as it came.
        #[source]
        status: tonic::Status,
        /// Calls made.
        attempts: u32,
    },
    /// The driver does not advertise the capability the call needs, so it was not made (the
    /// kubelet does not make it either).
    #[error("{method} not called: the driver does not advertise {capability}")]
    NotSupported {
        /// The RPC.
        method: &'static str,
        /// The missing capability, e.g. `GET_VOLUME_STATS`.
        capability: &'static str,
    },
}

impl CallError {
    /// The gRPC status the driver answered with, if it answered.
    pub fn status(&self) -> Option<&tonic::Status> {
        match self {
            CallError::Rpc { status, .. } => Some(status),
            _ => None,
        }
    }

    /// The gRPC code: the driver's, DEADLINE_EXCEEDED for a timeout, UNAVAILABLE when the
    /// socket could not be dialed, `None` for a call not made.
    pub fn code(&self) -> Option<Code> {
        match self {
            CallError::Rpc { status, .. } => Some(status.code()),
            CallError::Timeout { .. } => Some(Code::DeadlineExceeded),
            CallError::Dial { .. } => Some(Code::Unavailable),
            CallError::NotSupported { .. } => None,
        }
    }

    /// The failure as the gRPC status grpc-go's client reports for it: the driver's status;
    /// DEADLINE_EXCEEDED with Go's context text for a timeout; UNAVAILABLE for a failed dial;
    /// FAILED_PRECONDITION for a call not made. The status keeps its source, so a failure of
    /// the transport stays recognisable (see `tonic::Status::source`).
    pub fn to_status(&self) -> tonic::Status {
        match self {
            CallError::Rpc { status, .. } => status.clone(),
            CallError::Timeout { .. } => tonic::Status::deadline_exceeded(DEADLINE_TEXT),
            CallError::Dial { source, .. } => {
                tonic::Status::unavailable(plugreg_runtime::report::chain(source))
            }
            CallError::NotSupported { .. } => tonic::Status::failed_precondition(self.to_string()),
        }
    }
}

/// What Go's context says when a deadline passes, the text of a timed-out call's status.
pub const DEADLINE_TEXT: &str = "context deadline exceeded";

/// Which failures are retried, how often, and how long to wait in between.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Retry {
    /// Calls at most (1: no retry).
    pub attempts: u32,
    /// Wait between calls.
    pub backoff: Backoff,
}

impl Default for Retry {
    /// Three calls, 500 ms then 1 s apart.
    fn default() -> Self {
        Self {
            attempts: 3,
            backoff: Backoff::new(Duration::from_millis(500), Duration::from_secs(5)),
        }
    }
}

impl Retry {
    /// One call, no retry.
    pub const ONCE: Retry = Retry {
        attempts: 1,
        backoff: Backoff::new(Duration::ZERO, Duration::ZERO),
    };
}

/// Whether a failure with `code` may pass on a repeat of the same call: the driver was busy
/// (UNAVAILABLE, ABORTED: another operation on the volume, RESOURCE_EXHAUSTED) or the answer
/// was lost (DEADLINE_EXCEEDED). Everything else needs a change first (the spec's "fix, then
/// retry" codes) or must not be retried at all (NodeExpandVolume's FAILED_PRECONDITION).
pub fn is_transient(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable | Code::Aborted | Code::ResourceExhausted | Code::DeadlineExceeded
    )
}

/// A connection to one CSI driver.
#[derive(Debug, Clone)]
pub struct Connection {
    channel: Channel,
    endpoint: String,
    timeout: Duration,
    retry: Retry,
}

impl Connection {
    /// Dials `endpoint` (a socket path or `unix://PATH`) within `dial_timeout`. Calls get
    /// `call_timeout` each (see [`NODE_TIMEOUT`]) and are retried under `retry`.
    pub async fn connect(
        endpoint: &str,
        dial_timeout: Duration,
        call_timeout: Duration,
        retry: Retry,
    ) -> Result<Self, CallError> {
        let channel = plugreg_transport::connect(endpoint, dial_timeout)
            .await
            .map_err(|source| CallError::Dial {
                endpoint: endpoint.to_owned(),
                source,
            })?;
        Ok(Self::from_channel(channel, endpoint, call_timeout, retry))
    }

    /// Calls over a channel already dialed to `endpoint` (e.g. by
    /// [`plugreg_transport::connect_watched`], for a caller that watches the connection), each
    /// within `call_timeout` and retried under `retry`.
    pub fn from_channel(
        channel: Channel,
        endpoint: &str,
        call_timeout: Duration,
        retry: Retry,
    ) -> Self {
        Self {
            channel,
            endpoint: endpoint.to_owned(),
            timeout: call_timeout,
            retry: Retry {
                attempts: retry.attempts.max(1),
                ..retry
            },
        }
    }

    /// The endpoint dialed.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The per-call timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The same connection with another retry policy.
    pub fn with_retry(&self, retry: Retry) -> Self {
        Self {
            retry: Retry {
                attempts: retry.attempts.max(1),
                ..retry
            },
            ..self.clone()
        }
    }

    /// The same connection with another per-call timeout.
    pub fn with_timeout(&self, timeout: Duration) -> Self {
        Self {
            timeout,
            ..self.clone()
        }
    }

    /// The Identity service stub.
    pub fn identity(&self) -> IdentityClient<Channel> {
        plugreg_transport::client!(IdentityClient, self.channel.clone())
    }

    /// The Node service stub.
    pub fn node(&self) -> NodeStub<Channel> {
        plugreg_transport::client!(NodeStub, self.channel.clone())
    }

    /// The Controller service stub.
    pub fn controller(&self) -> ControllerClient<Channel> {
        plugreg_transport::client!(ControllerClient, self.channel.clone())
    }

    /// The GroupController service stub (volume group snapshots). Only a driver that lists
    /// GROUP_CONTROLLER_SERVICE in GetPluginCapabilities serves it; others answer UNIMPLEMENTED.
    pub fn group_controller(&self) -> GroupControllerClient<Channel> {
        plugreg_transport::client!(GroupControllerClient, self.channel.clone())
    }

    /// `Identity/Probe`.
    pub async fn probe(&self) -> Result<ProbeResponse, CallError> {
        let id = self.identity();
        self.call("Probe", &ProbeRequest {}, |r| {
            let mut id = id.clone();
            async move { id.probe(r).await }
        })
        .await
    }

    /// `Identity/GetPluginInfo`.
    pub async fn get_plugin_info(&self) -> Result<GetPluginInfoResponse, CallError> {
        let id = self.identity();
        self.call("GetPluginInfo", &GetPluginInfoRequest {}, |r| {
            let mut id = id.clone();
            async move { id.get_plugin_info(r).await }
        })
        .await
    }

    /// `Identity/GetPluginCapabilities`.
    pub async fn get_plugin_capabilities(
        &self,
    ) -> Result<GetPluginCapabilitiesResponse, CallError> {
        let id = self.identity();
        self.call(
            "GetPluginCapabilities",
            &GetPluginCapabilitiesRequest {},
            |r| {
                let mut id = id.clone();
                async move { id.get_plugin_capabilities(r).await }
            },
        )
        .await
    }

    /// `Node/NodeGetInfo`.
    pub async fn node_get_info(&self) -> Result<NodeGetInfoResponse, CallError> {
        let node = self.node();
        self.call("NodeGetInfo", &NodeGetInfoRequest {}, |r| {
            let mut n = node.clone();
            async move { n.node_get_info(r).await }
        })
        .await
    }

    /// `Node/NodeGetCapabilities`.
    pub async fn node_get_capabilities(&self) -> Result<NodeGetCapabilitiesResponse, CallError> {
        let node = self.node();
        self.call("NodeGetCapabilities", &NodeGetCapabilitiesRequest {}, |r| {
            let mut n = node.clone();
            async move { n.node_get_capabilities(r).await }
        })
        .await
    }

    /// `Controller/ControllerGetCapabilities`.
    pub async fn controller_get_capabilities(
        &self,
    ) -> Result<ControllerGetCapabilitiesResponse, CallError> {
        let ctl = self.controller();
        self.call(
            "ControllerGetCapabilities",
            &ControllerGetCapabilitiesRequest {},
            |r| {
                let mut c = ctl.clone();
                async move { c.controller_get_capabilities(r).await }
            },
        )
        .await
    }

    /// `Controller/CreateVolume`.
    pub async fn create_volume(
        &self,
        msg: &CreateVolumeRequest,
    ) -> Result<CreateVolumeResponse, CallError> {
        let ctl = self.controller();
        self.call("CreateVolume", msg, |r| {
            let mut c = ctl.clone();
            async move { c.create_volume(r).await }
        })
        .await
    }

    /// `Controller/DeleteVolume`.
    pub async fn delete_volume(
        &self,
        msg: &DeleteVolumeRequest,
    ) -> Result<DeleteVolumeResponse, CallError> {
        let ctl = self.controller();
        self.call("DeleteVolume", msg, |r| {
            let mut c = ctl.clone();
            async move { c.delete_volume(r).await }
        })
        .await
    }

    /// Makes the call `make(request)` under the timeout and the retry policy. `msg` is cloned
    /// for each attempt: a repeat sends exactly the same arguments.
    pub async fn call<Req, Resp, F, Fut>(
        &self,
        method: &'static str,
        msg: &Req,
        mut make: F,
    ) -> Result<Resp, CallError>
    where
        Req: Clone,
        F: FnMut(tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut request = tonic::Request::new(msg.clone());
            // The driver sees the deadline too (grpc-timeout).
            request.set_timeout(self.timeout);
            let started = tokio::time::Instant::now();
            let result = match tokio::time::timeout(self.timeout, make(request)).await {
                Ok(Ok(r)) => return Ok(r.into_inner()),
                Ok(Err(status)) if deadline_passed(&status, started.elapsed() >= self.timeout) => {
                    CallError::Timeout {
                        method,
                        timeout: self.timeout,
                        attempts: attempt,
                    }
                }
                Ok(Err(status)) => CallError::Rpc {
                    method,
                    status,
                    attempts: attempt,
                },
                Err(_) => CallError::Timeout {
                    method,
                    timeout: self.timeout,
                    attempts: attempt,
                },
            };
            let transient = result.code().is_some_and(is_transient);
            if !transient || attempt >= self.retry.attempts {
                return Err(result);
            }
            tracing::debug!(method, attempt, error = %result, "transient failure; repeating the call");
            tokio::time::sleep(self.retry.backoff.delay(attempt)).await;
        }
    }
}

/// Whether `status` says the call's deadline passed on this side: tonic's own enforcement of
/// the `grpc-timeout` we set, or a DEADLINE_EXCEEDED or CANCELLED once the deadline is `over`.
/// tonic reports its enforcement as CANCELLED ("Timeout expired"), sometimes without a source,
/// racing our timer for the same deadline. A DEADLINE_EXCEEDED the driver answers before the
/// deadline is the driver's answer, kept with its own text.
pub fn deadline_passed(status: &tonic::Status, over: bool) -> bool {
    if over && matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled) {
        return true;
    }
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if e.is::<tonic::TimeoutExpired>() {
            return true;
        }
        source = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_codes() {
        for c in [
            Code::Unavailable,
            Code::Aborted,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
        ] {
            assert!(is_transient(c), "{c:?}");
        }
        for c in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::FailedPrecondition,
            Code::Unimplemented,
            Code::Internal,
            Code::OutOfRange,
        ] {
            assert!(!is_transient(c), "{c:?}");
        }
    }
}
