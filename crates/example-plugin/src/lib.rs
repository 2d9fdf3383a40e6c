//! An example plugin, the counterpart of upstream's: it registers with any type, name and
//! versions, and serves the `v1beta1` / `v1beta2` example services for the versions it
//! advertises, on its registration socket.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use plugreg_proto::example::{v1beta1, v1beta2};
use plugreg_registrar::{PluginInfo, Registrar, RegistrationStatus, ServeOptions};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

pub use plugreg_registrar::Error;

/// What the example plugin says about itself.
#[derive(Debug, Clone)]
pub struct ExampleConfig {
    /// The registration socket.
    pub socket: PathBuf,
    /// Plugin type.
    pub plugin_type: String,
    /// Plugin name.
    pub name: String,
    /// Endpoint to advertise; `None` advertises the socket itself.
    pub endpoint: Option<String>,
    /// Versions to advertise (and serve, where an example service exists).
    pub versions: Vec<String>,
}

/// A running (or ready to run) example plugin.
#[derive(Debug, Clone)]
pub struct ExamplePlugin {
    config: ExampleConfig,
    registrar: Registrar,
}

impl ExamplePlugin {
    /// A plugin for `config`.
    pub fn new(config: ExampleConfig) -> Self {
        let registrar = Registrar::new(PluginInfo {
            r#type: config.plugin_type.clone(),
            name: config.name.clone(),
            endpoint: config
                .endpoint
                .clone()
                .unwrap_or_else(|| config.socket.to_string_lossy().into_owned()),
            supported_versions: config.versions.clone(),
        });
        Self { config, registrar }
    }

    /// The registrar, for its status and notifications.
    pub fn registrar(&self) -> &Registrar {
        &self.registrar
    }

    /// Serves until `token` is cancelled, then removes the socket.
    pub async fn serve(&self, token: CancellationToken) -> Result<(), Error> {
        let versions = self.config.versions.clone();
        let registrar = self.registrar.clone();
        let make = move || {
            let mut router = plugreg_transport::server().add_service(registrar.service());
            for v in &versions {
                router = match v.as_str() {
                    "v1beta1" => {
                        router.add_service(v1beta1::example_server::ExampleServer::new(Example))
                    }
                    "v1beta2" => {
                        router.add_service(v1beta2::example_server::ExampleServer::new(Example))
                    }
                    _ => router,
                };
            }
            router
        };
        plugreg_registrar::serve_router(&self.config.socket, make, ServeOptions::default(), token)
            .await
    }
}

/// The JSON line printed for a notification:
/// `{"event":"notify","registered":true,"error":"","ts_ns":N}`.
pub fn notify_line(status: &RegistrationStatus) -> String {
    serde_json::json!({
        "event": "notify",
        "registered": status.plugin_registered,
        "error": status.error,
        "ts_ns": now_ns(),
    })
    .to_string()
}

/// Nanoseconds since the Unix epoch.
pub fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// The example service; the same answer at every version.
#[derive(Debug, Clone, Copy)]
struct Example;

#[tonic::async_trait]
impl v1beta1::example_server::Example for Example {
    async fn get_example_info(
        &self,
        _: Request<v1beta1::ExampleRequest>,
    ) -> Result<Response<v1beta1::ExampleResponse>, Status> {
        Ok(Response::new(v1beta1::ExampleResponse::default()))
    }
}

#[tonic::async_trait]
impl v1beta2::example_server::Example for Example {
    async fn get_example_info(
        &self,
        _: Request<v1beta2::ExampleRequest>,
    ) -> Result<Response<v1beta2::ExampleResponse>, Status> {
        Ok(Response::new(v1beta2::ExampleResponse::default()))
    }
}
