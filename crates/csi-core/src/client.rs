//! One connection to a CSI driver and the calls on it: each call bounded by a timeout (the
//! kubelet's 2 minutes for node calls by default), retried on transient failures under a
//! [`Retry`] policy, its failure kept as a typed [`CallError`] with the gRPC status.
//!
//! Retrying relies on the driver's idempotency, which the CSI spec requires of every stage,
//! publish, unpublish, unstage, expand, CreateVolume and DeleteVolume call: a repeat of a call
//! whose answer was lost does no work twice.

use std::future::Future;
use std::time::Duration;

use plugreg_proto::csi::v1::controller_client::ControllerClient;
use plugreg_proto::csi::v1::identity_client::IdentityClient;
use plugreg_proto::csi::v1::node_client::NodeClient as NodeStub;
use plugreg_runtime::backoff::Backoff;
use plugreg_transport::MAX_MESSAGE_SIZE;
use tonic::Code;
use tonic::transport::Channel;

/// The kubelet's deadline for every CSI node call (`csiTimeout`, csi-wire.md §1.13).
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
    /// The driver did not answer in time (on the last attempt).
    #[error("{method} did not answer within {}", humantime_like(*.timeout))]
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

fn humantime_like(d: Duration) -> String {
    format!("{d:?}")
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
}

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
        Ok(Self {
            channel,
            endpoint: endpoint.to_owned(),
            timeout: call_timeout,
            retry: Retry {
                attempts: retry.attempts.max(1),
                ..retry
            },
        })
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
        IdentityClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE)
    }

    /// The Node service stub.
    pub fn node(&self) -> NodeStub<Channel> {
        NodeStub::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE)
    }

    /// The Controller service stub.
    pub fn controller(&self) -> ControllerClient<Channel> {
        ControllerClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE)
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

/// Whether `status` says the call's deadline passed: the driver's DEADLINE_EXCEEDED, or tonic's
/// own enforcement of the `grpc-timeout` we set. tonic reports the latter as CANCELLED
/// ("Timeout expired") without a source, racing our timer for the same deadline, so a
/// CANCELLED once the deadline is `over` counts as the timeout too.
pub fn deadline_passed(status: &tonic::Status, over: bool) -> bool {
    if status.code() == Code::DeadlineExceeded || (over && status.code() == Code::Cancelled) {
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
