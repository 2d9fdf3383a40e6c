//! The kubelet side of upstream's example plugin: [`ExampleHandler`], the handler for type
//! [`EXAMPLE_PLUGIN`], as upstream's plugin-manager tests use it. It accepts plugins whose versions
//! are exactly its configured list and, on register, calls `GetExampleInfo` on every example
//! service version the plugin advertises. For tests and demos.

use std::time::Duration;

use plugreg_handler_api::{HandlerError, PluginHandler, async_trait};
use plugreg_proto::example::{v1beta1, v1beta2};

/// The plugin type the example handler is registered for.
pub const EXAMPLE_PLUGIN: &str = "ExamplePlugin";

/// Why the example handler refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum ExampleError {
    /// The endpoint is empty.
    #[error("endpoint is empty")]
    EmptyEndpoint,
    /// The advertised versions are not the configured ones.
    #[error("plugin supported versions {got:?} differ from the handler's {want:?}")]
    Versions {
        /// What the plugin advertised.
        got: Vec<String>,
        /// What the handler accepts.
        want: Vec<String>,
    },
    /// Dialing the endpoint failed.
    #[error("failed to dial {endpoint}")]
    Dial {
        /// The endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: plugreg_transport::Error,
    },
    /// A `GetExampleInfo` call failed.
    #[error("GetExampleInfo {version} at {endpoint} failed: {status}")]
    Call {
        /// The service version.
        version: String,
        /// The endpoint.
        endpoint: String,
        /// The gRPC status.
        status: tonic::Status,
    },
}

/// Upstream's example handler.
#[derive(Debug, Clone)]
pub struct ExampleHandler {
    versions: Vec<String>,
    timeout: Duration,
}

impl ExampleHandler {
    /// Accepts plugins advertising exactly `versions` (in order).
    pub fn new(versions: Vec<String>) -> Self {
        Self {
            versions,
            timeout: Duration::from_secs(1),
        }
    }
}

#[async_trait]
impl PluginHandler for ExampleHandler {
    async fn validate(
        &self,
        _name: &str,
        endpoint: &str,
        versions: &[String],
    ) -> Result<(), HandlerError> {
        if endpoint.is_empty() {
            return Err(ExampleError::EmptyEndpoint.into());
        }
        if versions != self.versions.as_slice() {
            return Err(ExampleError::Versions {
                got: versions.to_vec(),
                want: self.versions.clone(),
            }
            .into());
        }
        Ok(())
    }

    async fn register(
        &self,
        name: &str,
        endpoint: &str,
        versions: &[String],
    ) -> Result<(), HandlerError> {
        let channel = plugreg_transport::connect(endpoint, self.timeout)
            .await
            .map_err(|source| ExampleError::Dial {
                endpoint: endpoint.to_owned(),
                source,
            })?;
        let call_err = |version: &str, status| ExampleError::Call {
            version: version.to_owned(),
            endpoint: endpoint.to_owned(),
            status,
        };
        for version in versions {
            match version.as_str() {
                "v1beta1" => {
                    let mut req = tonic::Request::new(v1beta1::ExampleRequest {
                        request: "example request".into(),
                        v1beta1_field: name.to_owned(),
                    });
                    req.set_timeout(self.timeout);
                    v1beta1::example_client::ExampleClient::new(channel.clone())
                        .get_example_info(req)
                        .await
                        .map_err(|s| call_err(version, s))?;
                }
                "v1beta2" => {
                    let mut req = tonic::Request::new(v1beta2::ExampleRequest {
                        request: "example request".into(),
                        v1beta2_field: name.to_owned(),
                    });
                    req.set_timeout(self.timeout);
                    v1beta2::example_client::ExampleClient::new(channel.clone())
                        .get_example_info(req)
                        .await
                        .map_err(|s| call_err(version, s))?;
                }
                other => tracing::debug!(version = other, "no example service for this version"),
            }
        }
        Ok(())
    }

    async fn deregister(&self, name: &str, endpoint: &str) {
        tracing::debug!(name, endpoint, "example plugin deregistered");
    }
}
