//! The plugin side of kubelet plugin registration.
//!
//! A plugin describes itself with a [`PluginInfo`], serves the `pluginregistration.Registration`
//! service on a socket in the kubelet's registry directory, and learns the kubelet's verdict from
//! `NotifyRegistrationStatus`. [`Registrar`] does the serving; [`Registrar::status`] is a watch
//! channel with the latest verdict and counters.
//!
//! ```no_run
//! # async fn demo() -> Result<(), plugreg_registrar::Error> {
//! use plugreg_registrar::{PluginInfo, Registrar};
//! let registrar = Registrar::new(PluginInfo {
//!     r#type: "DevicePlugin".into(),
//!     name: "example.com/gpu".into(),
//!     endpoint: "/var/lib/kubelet/device-plugins/gpu.sock".into(),
//!     supported_versions: vec!["v1beta1".into()],
//! });
//! let token = tokio_util::sync::CancellationToken::new();
//! let socket = "/var/lib/kubelet/plugins_registry/example.com-gpu-reg.sock".as_ref();
//! registrar.serve(socket, Default::default(), token).await
//! # }
//! ```

pub mod handover;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use plugreg_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use plugreg_proto::pluginregistration::{InfoRequest, RegistrationStatusResponse};
use plugreg_runtime::report;
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Router;
use tonic::{Request, Response};

pub use plugreg_proto::pluginregistration::{PluginInfo, RegistrationStatus};
pub use plugreg_transport::MAX_MESSAGE_SIZE;

/// What went wrong while serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The registration socket could not be created.
    #[error("failed to create the registration socket")]
    Bind(#[source] plugreg_transport::Error),
    /// The gRPC server failed.
    #[error("registration server stopped serving")]
    Serve(#[source] plugreg_transport::Error),
}

/// What the plugin has heard from the kubelet so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Status {
    /// The latest notification, if any came.
    pub last: Option<RegistrationStatus>,
    /// Notifications with `plugin_registered = true`.
    pub accepted_total: u64,
    /// Notifications with `plugin_registered = false`.
    pub rejected_total: u64,
    /// When the latest rejection came.
    pub last_rejected_at: Option<SystemTime>,
}

impl Status {
    /// True when the latest notification accepted the plugin.
    pub fn is_registered(&self) -> bool {
        self.last.as_ref().is_some_and(|s| s.plugin_registered)
    }

    /// Notifications received in all.
    pub fn notifications(&self) -> u64 {
        self.accepted_total + self.rejected_total
    }
}

/// How [`Registrar::serve`] behaves.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// How often to check that the registration socket is still in place. When the path is empty
    /// or holds a dead socket, the socket is created again; when another live instance took it
    /// over, it is left to that instance (R3). `None` turns the check off.
    pub recreate_check: Option<Duration>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            recreate_check: Some(Duration::from_secs(1)),
        }
    }
}

/// Serves `Registration` for one [`PluginInfo`].
#[derive(Debug, Clone)]
pub struct Registrar {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    info: PluginInfo,
    status: watch::Sender<Status>,
    notifications: broadcast::Sender<RegistrationStatus>,
    get_info_total: AtomicU64,
}

impl Registrar {
    /// A registrar answering GetInfo with `info`.
    pub fn new(info: PluginInfo) -> Self {
        Self {
            inner: Arc::new(Inner {
                info,
                status: watch::Sender::new(Status::default()),
                notifications: broadcast::channel(64).0,
                get_info_total: AtomicU64::new(0),
            }),
        }
    }

    /// What GetInfo answers.
    pub fn info(&self) -> &PluginInfo {
        &self.inner.info
    }

    /// The latest verdict and counters; changes on every NotifyRegistrationStatus.
    pub fn status(&self) -> watch::Receiver<Status> {
        self.inner.status.subscribe()
    }

    /// Every NotifyRegistrationStatus from now on, one item per call (unlike
    /// [`status`](Self::status), which keeps only the latest).
    pub fn notifications(&self) -> broadcast::Receiver<RegistrationStatus> {
        self.inner.notifications.subscribe()
    }

    /// How many GetInfo calls were answered.
    pub fn get_info_total(&self) -> u64 {
        self.inner.get_info_total.load(Ordering::Relaxed)
    }

    /// The gRPC service, to add to a router that also serves other services on the socket.
    pub fn service(&self) -> RegistrationServer<Registrar> {
        RegistrationServer::new(self.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE)
    }

    /// Serves only `Registration` on `socket` until `token` is cancelled; see
    /// [`serve_router`](Self::serve_router).
    pub async fn serve(
        &self,
        socket: &Path,
        options: ServeOptions,
        token: CancellationToken,
    ) -> Result<(), Error> {
        let this = self.clone();
        self.serve_router(
            socket,
            move || plugreg_transport::server().add_service(this.service()),
            options,
            token,
        )
        .await
    }

    /// The free [`crate::serve_router`] for a router that serves this registrar,
    /// with the kubelet's verdict carried across a hand-over: the instance that stops tells its
    /// successor whether the kubelet had accepted the plugin, and the successor's
    /// [`status`](Self::status) starts from that.
    pub async fn serve_router(
        &self,
        socket: &Path,
        make_router: impl FnMut() -> Router,
        options: ServeOptions,
        token: CancellationToken,
    ) -> Result<(), Error> {
        serve_socket(
            socket,
            make_router,
            options,
            token,
            Some(&self.inner.status),
        )
        .await
    }
}

/// Serves the router made by `make_router` on `socket` until `token` is cancelled.
///
/// **Starting.** If a live instance serves `socket` already (a DaemonSet surge rollout runs the
/// old and the new instance at once), this call does not touch it: it listens on the hand-over
/// socket beside it until that instance stops and passes its listening socket on (see
/// [`handover`]), and serves that from then on. The socket file never changes, so the kubelet
/// never deregisters the plugin. An instance that cannot hand over (Go's registrar, an older
/// plugreg) is waited for too, until its socket is gone or dead. A stale socket is replaced at
/// once; a file that is not a socket is an error and stays untouched.
///
/// **Stopping.** When `token` is cancelled, the listening socket goes to a successor waiting
/// for it, if any, and the file stays; otherwise the socket is removed if it is still the one
/// this call served.
///
/// **While serving** the socket is checked every [`ServeOptions::recreate_check`] (R3). If the
/// path is empty, or holds a socket nobody listens on, it is created again and a fresh router is
/// served on it. If another live socket took the path over, this call leaves it alone and stops
/// serving, and keeps watching: it waits for that instance's hand-over, or takes the path back
/// once that socket is gone or dead. It never removes a socket it did not create.
pub async fn serve_router(
    socket: &Path,
    make_router: impl FnMut() -> Router,
    options: ServeOptions,
    token: CancellationToken,
) -> Result<(), Error> {
    serve_socket(socket, make_router, options, token, None).await
}

async fn serve_socket(
    socket: &Path,
    mut make_router: impl FnMut() -> Router,
    options: ServeOptions,
    token: CancellationToken,
    status: Option<&watch::Sender<Status>>,
) -> Result<(), Error> {
    let period = options.recreate_check.unwrap_or(Duration::from_secs(1));
    let Some(mut bound) = acquire(socket, Phase::Start, period, &token, status).await? else {
        return Ok(());
    };
    loop {
        tracing::info!(socketPath = %socket.display(), "Registration Server started");
        let identity = bound.identity();
        let vanished = token.child_token();
        let watchdog = options.recreate_check.map(|period| {
            let vanished = vanished.clone();
            tokio::spawn(async move {
                // The first check comes one period after binding, not at once.
                let start = tokio::time::Instant::now() + period;
                let mut tick = tokio::time::interval_at(start, period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = vanished.cancelled() => return,
                        _ = tick.tick() => {}
                    }
                    if !identity.is_in_place() {
                        vanished.cancel();
                        return;
                    }
                }
            })
        });
        let listener_copy = bound
            .try_clone_listener()
            .inspect_err(|e| tracing::warn!(error = %e, "cannot hand the registration socket over: no second descriptor"))
            .ok();
        let keep = bound.keep_file();
        // Runs inside the server, which keeps accepting until it is done: a connection it
        // accepts meanwhile is still served to the end, the successor takes the next ones.
        let shutdown = async {
            vanished.cancelled().await;
            let Some(listener) = listener_copy.as_ref().filter(|_| token.is_cancelled()) else {
                return;
            };
            let registered = status.is_some_and(|s| s.borrow().is_registered());
            match handover::offer(socket, listener, registered).await {
                Ok(true) => {
                    keep.keep();
                    tracing::info!(socketPath = %socket.display(), "Handed the registration socket over to the instance that started after this one");
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(socketPath = %socket.display(), error = %report::chain(&e), "the instance waiting for the registration socket did not take it")
                }
            }
        };
        let result = plugreg_transport::serve(make_router(), bound, shutdown).await;
        vanished.cancel();
        if let Some(w) = watchdog {
            let _ = w.await;
        }
        result.map_err(Error::Serve)?;
        if token.is_cancelled() {
            return Ok(());
        }
        match acquire(socket, Phase::TakeBack, period, &token, status).await? {
            Some(b) => bound = b,
            None => return Ok(()),
        }
    }
}

/// Why [`acquire`] is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Starting up: a stale socket is replaced at once, and a failed bind is an error.
    Start,
    /// Our socket left the path while serving: R3's rules, and a failed bind is retried.
    TakeBack,
}

/// Pause between looks at the path while starting.
const START_POLL: Duration = Duration::from_millis(100);

/// Who holds a socket path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Occupant {
    /// Nothing is there.
    Nobody,
    /// A socket that accepts connections: some other instance serves it.
    Live,
    /// A socket whose connections are refused; its device and inode.
    Refusing(u64, u64),
    /// Not a socket: binding refuses it (and says so) until it is gone.
    NotASocket,
    /// A socket we cannot probe (no permission, say): left alone.
    Unknown,
}

/// Looks at the path and, if a socket is there, dials it once.
async fn occupant(path: &Path) -> Occupant {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => m,
        Ok(_) => return Occupant::NotASocket,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Occupant::Nobody,
        Err(_) => return Occupant::Unknown,
    };
    let dial = tokio::time::timeout(PROBE_TIMEOUT, tokio::net::UnixStream::connect(path)).await;
    match dial {
        Ok(Ok(_)) => Occupant::Live,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            Occupant::Refusing(meta.dev(), meta.ino())
        }
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => Occupant::Nobody,
        // A full backlog (EAGAIN) or a slow accept means someone listens.
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::WouldBlock => Occupant::Live,
        Err(_) => Occupant::Live,
        Ok(Err(_)) => Occupant::Unknown,
    }
}

/// How long a liveness dial of a socket at our path may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Gets a listening socket at `socket` to serve: from the live instance serving it (a
/// hand-over), or by binding it once it is empty or dead. While taking the path back (R3) a
/// socket must refuse two checks in a row (a socket bound by a Go program refuses for a moment
/// before it listens). `None` once `token` is cancelled.
async fn acquire(
    socket: &Path,
    phase: Phase,
    period: Duration,
    token: &CancellationToken,
    status: Option<&watch::Sender<Status>>,
) -> Result<Option<plugreg_transport::BoundSocket>, Error> {
    let pause = match phase {
        Phase::Start => START_POLL,
        Phase::TakeBack => period,
    };
    let mut refused: Option<(u64, u64)> = None;
    let mut successor: Option<handover::Successor> = None;
    let mut announced = false;
    loop {
        if token.is_cancelled() {
            return Ok(None);
        }
        let bind = match occupant(socket).await {
            Occupant::Live => {
                refused = None;
                if successor.is_none() {
                    match handover::Successor::listen(socket) {
                        Ok(s) => successor = s,
                        Err(e) => {
                            tracing::warn!(socketPath = %socket.display(), error = %report::chain(&e), "cannot listen for a hand-over")
                        }
                    }
                }
                if !announced {
                    if phase == Phase::TakeBack {
                        tracing::warn!(socketPath = %socket.display(), "registration socket was replaced by another live instance; leaving it to that instance");
                    }
                    if successor.is_some() {
                        tracing::info!(socketPath = %socket.display(), "Registration socket is served by another instance; waiting for it to hand the socket over");
                    } else {
                        tracing::info!(socketPath = %socket.display(), "Registration socket is served by another instance; waiting for it to go");
                    }
                    announced = true;
                }
                if let Some(s) = &successor {
                    // The offer is awaited across the looks at the path, never dropped midway.
                    let mut next = std::pin::pin!(s.next_offer());
                    loop {
                        tokio::select! {
                            _ = token.cancelled() => return Ok(None),
                            offer = &mut next => {
                                if let Some(b) = take_over(offer, socket, status).await {
                                    return Ok(Some(b));
                                }
                                break;
                            }
                            _ = tokio::time::sleep(pause) => {
                                if occupant(socket).await != Occupant::Live {
                                    break;
                                }
                            }
                        }
                    }
                    continue;
                }
                false
            }
            Occupant::Nobody => {
                if phase == Phase::TakeBack {
                    tracing::warn!(socketPath = %socket.display(), "registration socket disappeared; re-creating it");
                }
                true
            }
            Occupant::Refusing(..) if phase == Phase::Start => true,
            Occupant::Refusing(dev, ino) if refused == Some((dev, ino)) => {
                tracing::warn!(socketPath = %socket.display(), "registration socket is stale (nobody listens on it); re-creating it");
                true
            }
            Occupant::Refusing(dev, ino) => {
                refused = Some((dev, ino));
                false
            }
            Occupant::NotASocket => {
                refused = None;
                true
            }
            Occupant::Unknown => {
                refused = None;
                phase == Phase::Start
            }
        };
        if bind {
            // Our hand-over socket goes before we take the path: nobody is to offer us anything.
            successor = None;
            match plugreg_transport::bind(socket) {
                Ok(b) => return Ok(Some(b)),
                Err(e) if phase == Phase::Start => return Err(Error::Bind(e)),
                Err(e) => {
                    tracing::warn!(socketPath = %socket.display(), error = %e, "cannot re-create the registration socket yet")
                }
            }
        }
        tokio::select! {
            _ = token.cancelled() => return Ok(None),
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// Serves the socket a previous instance handed over, tells it so, and starts from its verdict.
async fn take_over(
    offer: handover::Offer,
    socket: &Path,
    status: Option<&watch::Sender<Status>>,
) -> Option<plugreg_transport::BoundSocket> {
    let handover::Offer {
        listener,
        registered,
        ack,
    } = offer;
    let bound = match plugreg_transport::BoundSocket::adopt(listener, socket) {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(socketPath = %socket.display(), error = %report::chain(&e), "cannot serve the registration socket handed over");
            return None;
        }
    };
    if let Err(e) = ack.send().await {
        // It may remove the socket now; the check (R3) puts it back.
        tracing::warn!(socketPath = %socket.display(), error = %e, "the previous instance did not hear that this one took the registration socket over");
    }
    if registered && let Some(status) = status {
        status.send_modify(|s| {
            s.last = Some(RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            });
        });
    }
    tracing::info!(socketPath = %socket.display(), registered, "Took the registration socket over from the previous instance");
    Some(bound)
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn get_info(
        &self,
        request: Request<InfoRequest>,
    ) -> Result<Response<PluginInfo>, tonic::Status> {
        tracing::debug!(request = ?request.get_ref(), "Received GetInfo call");
        self.inner.get_info_total.fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(self.inner.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, tonic::Status> {
        let status = request.into_inner();
        tracing::info!(status = ?status, "Received NotifyRegistrationStatus call");
        let _ = self.inner.notifications.send(status.clone());
        self.inner.status.send_modify(|s| {
            if status.plugin_registered {
                s.accepted_total += 1;
            } else {
                s.rejected_total += 1;
                s.last_rejected_at = Some(SystemTime::now());
            }
            s.last = Some(status);
        });
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
