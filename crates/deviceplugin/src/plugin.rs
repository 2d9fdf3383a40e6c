//! Serving a device plugin's socket and registering it with the kubelet, either way.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use plugreg_proto::deviceplugin::v1beta1::registration_client::RegistrationClient;
use plugreg_proto::deviceplugin::v1beta1::{RegisterRequest, VERSION};
use plugreg_proto::pluginregistration::DEVICE_PLUGIN;
use plugreg_registrar::{PluginInfo, Registrar, ServeOptions};
use plugreg_runtime::Backoff;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::service::{DeviceLogic, DevicePluginService};

/// How a device plugin registers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registration {
    /// Serve `pluginregistration.Registration` on `socket` (in the kubelet's
    /// `plugins_registry`); the plugin manager finds it.
    PluginsRegistry {
        /// The registration socket.
        socket: PathBuf,
    },
    /// Call `Register` on the kubelet's `kubelet.sock` at this path; the plugin's own socket
    /// must be in the same directory.
    KubeletSocket {
        /// `kubelet.sock`.
        path: PathBuf,
    },
}

/// Where a device plugin serves and how it registers.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// The extended resource, e.g. `example.com/widget`.
    pub resource: String,
    /// The plugin's own socket (DevicePlugin service).
    pub socket: PathBuf,
    /// How it registers.
    pub registration: Registration,
    /// How often its sockets and kubelet.sock are checked (re-creation, kubelet restarts).
    pub check_period: Duration,
    /// Waits between failed Register calls.
    pub retry: Backoff,
    /// Limit for one Register call (the kubelet dials back and reads the options inside it).
    pub register_timeout: Duration,
}

impl PluginConfig {
    fn new(resource: &str, socket: PathBuf, registration: Registration) -> Self {
        Self {
            resource: resource.to_owned(),
            socket,
            registration,
            check_period: Duration::from_millis(200),
            retry: Backoff::new(Duration::from_millis(200), Duration::from_secs(10))
                .with_jitter(0.1),
            register_timeout: Duration::from_secs(30),
        }
    }

    /// Classic registration through `kubelet_sock`; the plugin's socket is `socket_name` in
    /// the same directory.
    pub fn kubelet_socket(resource: &str, kubelet_sock: &Path, socket_name: &str) -> Self {
        let dir = kubelet_sock.parent().unwrap_or(Path::new("."));
        Self::new(
            resource,
            dir.join(socket_name),
            Registration::KubeletSocket {
                path: kubelet_sock.to_owned(),
            },
        )
    }

    /// Registration through `registry_dir` (a registration socket named after the resource);
    /// the plugin serves at `socket`.
    pub fn plugins_registry(resource: &str, registry_dir: &Path, socket: PathBuf) -> Self {
        let file = format!("{}-reg.sock", resource.replace('/', "_"));
        Self::new(
            resource,
            socket,
            Registration::PluginsRegistry {
                socket: registry_dir.join(file),
            },
        )
    }
}

/// What happened, for a program that reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The plugin's socket accepts connections.
    Serving {
        /// The socket.
        socket: PathBuf,
    },
    /// The kubelet accepted the plugin (Register returned, or NotifyRegistrationStatus said so).
    Registered {
        /// `kubelet.sock` or `plugins_registry`.
        via: &'static str,
    },
    /// The kubelet refused the plugin, or Register failed; retried.
    RegistrationFailed {
        /// Why.
        error: String,
    },
    /// kubelet.sock was re-created: the plugin registers again.
    KubeletRestarted,
}

/// Why a device plugin stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Serving the plugin's socket failed.
    #[error("cannot serve the device plugin socket {path:?}")]
    Serve {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: plugreg_registrar::Error,
    },
    /// Serving the registration socket failed.
    #[error("cannot serve the registration socket {path:?}")]
    Registration {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: plugreg_registrar::Error,
    },
    /// The plugin's socket did not come up.
    #[error("the device plugin socket {0:?} did not start listening")]
    NotListening(PathBuf),
}

/// A device plugin: serves its logic and keeps it registered.
pub struct DevicePlugin<L: ?Sized> {
    config: PluginConfig,
    logic: Arc<L>,
    events: broadcast::Sender<Event>,
}

impl<L: DeviceLogic + ?Sized> DevicePlugin<L> {
    /// A plugin for `logic`.
    pub fn new(config: PluginConfig, logic: Arc<L>) -> Self {
        Self {
            config,
            logic,
            events: broadcast::channel(256).0,
        }
    }

    /// Events from now on.
    pub fn events(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// The configuration.
    pub fn config(&self) -> &PluginConfig {
        &self.config
    }

    fn emit(&self, e: Event) {
        let _ = self.events.send(e);
    }

    /// Serves and registers until `token` is cancelled; then removes the sockets it created.
    pub async fn run(&self, token: CancellationToken) -> Result<(), Error> {
        let stop = token.child_token();
        let logic = self.logic.clone();
        let streams_stop = stop.clone();
        let socket = self.config.socket.clone();
        let serve_opts = ServeOptions {
            recreate_check: Some(self.config.check_period),
        };
        let serve_token = stop.clone();
        let server = tokio::spawn(
            async move {
                plugreg_registrar::serve_router(
                    &socket,
                    move || {
                        plugreg_transport::server().add_service(
                            DevicePluginService::new(logic.clone(), streams_stop.clone())
                                .into_server(),
                        )
                    },
                    serve_opts,
                    serve_token,
                )
                .await
                .map_err(|source| Error::Serve {
                    path: socket,
                    source,
                })
            }
            .instrument(tracing::info_span!("device_plugin_server")),
        );
        let registering = async {
            self.wait_listening(&stop).await?;
            self.emit(Event::Serving {
                socket: self.config.socket.clone(),
            });
            match &self.config.registration {
                Registration::PluginsRegistry { socket } => {
                    self.register_through_registry(socket, &stop).await
                }
                Registration::KubeletSocket { path } => {
                    self.register_through_kubelet_sock(path, &stop).await;
                    Ok(())
                }
            }
        };
        let result = tokio::select! {
            r = registering => r,
            _ = token.cancelled() => Ok(()),
        };
        stop.cancel();
        let served = match server.await {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "device plugin server task failed");
                Ok(())
            }
        };
        result.and(served)
    }

    /// Waits until the plugin's socket accepts connections.
    async fn wait_listening(&self, stop: &CancellationToken) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if tokio::net::UnixStream::connect(&self.config.socket)
                .await
                .is_ok()
            {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline || stop.is_cancelled() {
                return Err(Error::NotListening(self.config.socket.clone()));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn register_through_registry(
        &self,
        socket: &Path,
        stop: &CancellationToken,
    ) -> Result<(), Error> {
        let registrar = Registrar::new(PluginInfo {
            r#type: DEVICE_PLUGIN.to_owned(),
            name: self.config.resource.clone(),
            endpoint: self.config.socket.to_string_lossy().into_owned(),
            supported_versions: vec![VERSION.to_owned()],
        });
        let mut notes = registrar.notifications();
        let events = self.events.clone();
        let relay = tokio::spawn(async move {
            loop {
                match notes.recv().await {
                    Ok(s) if s.plugin_registered => {
                        let _ = events.send(Event::Registered {
                            via: "plugins_registry",
                        });
                    }
                    Ok(s) => {
                        let _ = events.send(Event::RegistrationFailed { error: s.error });
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        let opts = ServeOptions {
            recreate_check: Some(self.config.check_period),
        };
        let r = registrar
            .serve(socket, opts, stop.clone())
            .await
            .map_err(|source| Error::Registration {
                path: socket.to_owned(),
                source,
            });
        relay.abort();
        r
    }

    /// Registers on kubelet.sock, retrying with back-off, and again whenever kubelet.sock is
    /// re-created. Returns when `stop` is cancelled.
    async fn register_through_kubelet_sock(&self, kubelet_sock: &Path, stop: &CancellationToken) {
        let mut failures = 0u32;
        loop {
            if stop.is_cancelled() {
                return;
            }
            // The kubelet deletes the plugin's socket when it starts; the server re-creates it.
            if let Err(e) = self.wait_listening(stop).await {
                tracing::warn!(error = %e, "device plugin socket not back yet");
            }
            let registered_at = identity(kubelet_sock);
            match self.register_once(kubelet_sock).await {
                Ok(()) => {
                    failures = 0;
                    tracing::info!(kubelet_sock = %kubelet_sock.display(), "registered with the kubelet");
                    self.emit(Event::Registered {
                        via: "kubelet.sock",
                    });
                    // Until kubelet.sock is a different file (the kubelet restarted), or was
                    // gone for a while and is back.
                    let mut was_gone = false;
                    loop {
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = tokio::time::sleep(self.config.check_period) => {}
                        }
                        let now = identity(kubelet_sock);
                        was_gone |= now.is_none();
                        if now.is_some() && (was_gone || now != registered_at) {
                            tracing::info!("kubelet.sock was re-created; registering again");
                            self.emit(Event::KubeletRestarted);
                            break;
                        }
                    }
                }
                Err(error) => {
                    failures = failures.saturating_add(1);
                    tracing::warn!(%error, failures, "Register on kubelet.sock failed");
                    self.emit(Event::RegistrationFailed { error });
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = self.config.retry.sleep(failures) => {}
                    }
                }
            }
        }
    }

    async fn register_once(&self, kubelet_sock: &Path) -> Result<(), String> {
        let endpoint = self
            .config
            .socket
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let conn = plugreg_transport::connect_direct(kubelet_sock, Duration::from_secs(10))
            .await
            .map_err(|e| plugreg_runtime::report::chain(&e))?;
        let mut client = plugreg_transport::client!(RegistrationClient, conn);
        let req = RegisterRequest {
            version: VERSION.to_owned(),
            endpoint,
            resource_name: self.config.resource.clone(),
            options: Some(self.logic.options()),
        };
        match tokio::time::timeout(self.config.register_timeout, client.register(req)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(s)) => Err(plugreg_runtime::report::grpc(&s)),
            Err(_) => Err(format!(
                "Register did not answer within {:?}",
                self.config.register_timeout
            )),
        }
    }
}

/// Device, inode and change time of a file, to notice that it was re-created (a new file may
/// get the inode number of the one it replaces; its change time is still new).
fn identity(path: &Path) -> Option<(u64, u64, i64, i64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}
