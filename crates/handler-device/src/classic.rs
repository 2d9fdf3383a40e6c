//! The classic way in: `v1beta1.Registration/Register` served on `kubelet.sock` in a
//! device-plugin directory. The plugin must already serve its DevicePlugin socket in that
//! directory; Register answers only after the socket was dialled and its options read.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use plugreg_proto::deviceplugin::v1beta1::registration_server::{Registration, RegistrationServer};
use plugreg_proto::deviceplugin::v1beta1::{Empty, KUBELET_SOCKET_NAME, RegisterRequest, VERSION};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::client::{self, ClientConfig, ConnectError};
use crate::inventory::{Inventory, RegisteredVia};
use crate::resource::is_extended_resource_name;

/// A RegisterRequest is a few short strings: anything larger is refused before it is buffered.
const MAX_REGISTER_REQUEST: usize = 16 * 1024;

/// Why a Register call was refused; the texts are the kubelet's (the endpoint check is ours).
#[derive(Debug, thiserror::Error)]
pub enum RegisterRefusal {
    /// The version is not v1beta1.
    #[error(
        "requested API version \"{0}\" is not supported by kubelet. Supported version is [\"{VERSION}\"]"
    )]
    Version(String),
    /// The resource name is not an extended resource name.
    #[error("the ResourceName \"{0}\" is invalid")]
    Name(String),
    /// The endpoint is not a plain file name (it would leave the device-plugin directory).
    #[error(
        "invalid endpoint {0:?}: must be the file name of a socket in the device plugin directory"
    )]
    Endpoint(String),
    /// Dialing or GetDevicePluginOptions failed.
    #[error(transparent)]
    Connect(#[from] ConnectError),
}

impl From<RegisterRefusal> for Status {
    fn from(e: RegisterRefusal) -> Self {
        // grpc-go sends a plain Go error as code Unknown.
        Status::unknown(e.to_string())
    }
}

/// Why serving kubelet.sock failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// kubelet.sock could not be created.
    #[error("cannot create the device plugin registration socket")]
    Bind(#[source] plugreg_transport::Error),
    /// The server failed.
    #[error("the device plugin registration server failed")]
    Serve(#[source] plugreg_transport::Error),
}

/// The kubelet.sock Registration service.
#[derive(Debug, Clone)]
pub struct ClassicRegistration {
    dir: PathBuf,
    inventory: Arc<Inventory>,
    config: ClientConfig,
}

impl ClassicRegistration {
    /// Registers plugins whose sockets are in `dir`, into `inventory`.
    pub fn new(dir: impl Into<PathBuf>, inventory: Arc<Inventory>, config: ClientConfig) -> Self {
        Self {
            dir: dir.into(),
            inventory,
            config,
        }
    }

    /// `dir/kubelet.sock`.
    pub fn socket_path(&self) -> PathBuf {
        self.dir.join(KUBELET_SOCKET_NAME)
    }

    /// Checks a request and returns the plugin's socket path.
    fn check(&self, req: &RegisterRequest) -> Result<PathBuf, RegisterRefusal> {
        if req.version != VERSION {
            return Err(RegisterRefusal::Version(req.version.clone()));
        }
        if !is_extended_resource_name(&req.resource_name) {
            return Err(RegisterRefusal::Name(req.resource_name.clone()));
        }
        let e = req.endpoint.as_str();
        if e.is_empty() || e == "." || e == ".." || e.contains('/') || e.contains('\0') {
            return Err(RegisterRefusal::Endpoint(req.endpoint.clone()));
        }
        Ok(self.dir.join(e))
    }

    /// Handles one Register call.
    pub async fn register(&self, req: RegisterRequest) -> Result<(), RegisterRefusal> {
        self.inventory
            .count_classic_registration(&req.resource_name);
        let path = self.check(&req)?;
        let connected = client::connect(&path, &self.config).await?;
        client::start(
            &self.inventory,
            &path,
            &req.resource_name,
            RegisteredVia::KubeletSock,
            connected,
            &self.config,
        );
        Ok(())
    }

    /// Serves kubelet.sock until `token` is cancelled, then removes it.
    pub async fn serve(self, token: CancellationToken) -> Result<(), ServeError> {
        let socket = plugreg_transport::bind(&self.socket_path()).map_err(ServeError::Bind)?;
        tracing::info!(socket = %self.socket_path().display(), "serving device plugin registration (kubelet.sock)");
        let service = RegistrationServer::new(self)
            .max_decoding_message_size(MAX_REGISTER_REQUEST)
            .max_encoding_message_size(MAX_REGISTER_REQUEST);
        let router = plugreg_transport::server().add_service(service);
        plugreg_transport::serve(router, socket, token.cancelled_owned())
            .await
            .map_err(ServeError::Serve)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

#[tonic::async_trait]
impl Registration for ClassicRegistration {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let req = request.into_inner();
        let resource = req.resource_name.clone();
        match ClassicRegistration::register(self, req).await {
            Ok(()) => Ok(Response::new(Empty {})),
            Err(e) => {
                tracing::error!(resource, error = %e, "Bad registration request from device plugin");
                Err(e.into())
            }
        }
    }
}
