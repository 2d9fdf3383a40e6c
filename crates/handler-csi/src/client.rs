//! Calls to a CSI driver's Identity and Node services over its Unix socket, each bounded by a
//! timeout that covers dialing and the call.

use std::future::Future;
use std::time::Duration;

use plugreg_proto::csi::v1::identity_client::IdentityClient;
use plugreg_proto::csi::v1::node_client::NodeClient;
use plugreg_proto::csi::v1::{
    GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse, GetPluginInfoRequest,
    GetPluginInfoResponse, NodeGetCapabilitiesRequest, NodeGetCapabilitiesResponse,
    NodeGetInfoRequest, NodeGetInfoResponse, ProbeRequest, ProbeResponse,
};
use plugreg_transport::MAX_MESSAGE_SIZE;
use tonic::transport::Channel;

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
    /// The driver did not answer in time.
    #[error("{method} did not answer within {}", humantime::format_duration(*.timeout))]
    Timeout {
        /// The RPC, e.g. `NodeGetInfo`.
        method: &'static str,
        /// The limit.
        timeout: Duration,
    },
    /// The driver answered with an error status.
    #[error("{method} failed")]
    Rpc {
        /// The RPC, e.g. `NodeGetInfo`.
        method: &'static str,
        /// The status.
        #[source]
        status: tonic::Status,
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
}

/// A connection to one CSI driver.
#[derive(Debug, Clone)]
pub struct CsiClient {
    channel: Channel,
    timeout: Duration,
}

impl CsiClient {
    /// Dials `endpoint` (a socket path or `unix://PATH`) within `timeout`; each later call gets
    /// `timeout` too.
    pub async fn connect(endpoint: &str, timeout: Duration) -> Result<Self, CallError> {
        let channel = plugreg_transport::connect(endpoint, timeout)
            .await
            .map_err(|source| CallError::Dial {
                endpoint: endpoint.to_owned(),
                source,
            })?;
        Ok(Self { channel, timeout })
    }

    fn identity(&self) -> IdentityClient<Channel> {
        IdentityClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE)
    }

    fn node(&self) -> NodeClient<Channel> {
        NodeClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE)
    }

    async fn call<T>(
        &self,
        method: &'static str,
        fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, CallError> {
        let started = tokio::time::Instant::now();
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(status))
                if plugreg_csi_core::client::deadline_passed(
                    &status,
                    started.elapsed() >= self.timeout,
                ) =>
            {
                Err(CallError::Timeout {
                    method,
                    timeout: self.timeout,
                })
            }
            Ok(Err(status)) => Err(CallError::Rpc { method, status }),
            Err(_) => Err(CallError::Timeout {
                method,
                timeout: self.timeout,
            }),
        }
    }

    /// `Identity/GetPluginInfo`.
    pub async fn get_plugin_info(&self) -> Result<GetPluginInfoResponse, CallError> {
        let mut c = self.identity();
        self.call(
            "GetPluginInfo",
            c.get_plugin_info(request(GetPluginInfoRequest {}, self.timeout)),
        )
        .await
    }

    /// `Identity/GetPluginCapabilities`.
    pub async fn get_plugin_capabilities(
        &self,
    ) -> Result<GetPluginCapabilitiesResponse, CallError> {
        let mut c = self.identity();
        self.call(
            "GetPluginCapabilities",
            c.get_plugin_capabilities(request(GetPluginCapabilitiesRequest {}, self.timeout)),
        )
        .await
    }

    /// `Identity/Probe`.
    pub async fn probe(&self) -> Result<ProbeResponse, CallError> {
        let mut c = self.identity();
        self.call("Probe", c.probe(request(ProbeRequest {}, self.timeout)))
            .await
    }

    /// `Node/NodeGetInfo`.
    pub async fn node_get_info(&self) -> Result<NodeGetInfoResponse, CallError> {
        let mut c = self.node();
        self.call(
            "NodeGetInfo",
            c.node_get_info(request(NodeGetInfoRequest {}, self.timeout)),
        )
        .await
    }

    /// `Node/NodeGetCapabilities`.
    pub async fn node_get_capabilities(&self) -> Result<NodeGetCapabilitiesResponse, CallError> {
        let mut c = self.node();
        self.call(
            "NodeGetCapabilities",
            c.node_get_capabilities(request(NodeGetCapabilitiesRequest {}, self.timeout)),
        )
        .await
    }
}

/// A request carrying `grpc-timeout`, so the driver sees the deadline too.
fn request<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}

/// Dials `endpoint` and calls NodeGetInfo, all within `timeout` (the dial and the call share it).
pub async fn node_get_info(
    endpoint: &str,
    timeout: Duration,
) -> Result<NodeGetInfoResponse, CallError> {
    let work = async {
        let client = CsiClient::connect(endpoint, timeout).await?;
        client.node_get_info().await
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(CallError::Timeout {
            method: "NodeGetInfo",
            timeout,
        }),
    }
}
