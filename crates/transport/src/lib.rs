//! gRPC over Unix-domain sockets: the one place plugreg binds a socket ([`bind`]) and the one
//! place it dials one ([`connect`], [`connect_direct`]), with the same timeouts and message caps
//! everywhere ([`client!`] builds a generated client with them).
//!
//! A caller that must notice when the connection ends gets a signal with it:
//! [`connect_watched`] gives a channel and a [`Closed`] that fires when the channel's connection
//! ends; [`connect_direct_driven`] gives a bare HTTP/2 connection and the future that drives it,
//! which completes when the connection ends.
//!
//! Binding removes a stale socket at the path, refuses to touch a file that is not a socket, and
//! makes the socket connectable by its owner only (mode 0700, as upstream's umask 0077 gives,
//! set on the socket before `bind`, so never wider). The socket is bound in a hidden staging
//! directory beside the final path, listens, and is then renamed into place, so it appears at
//! its final path already listening: a watcher that dials it on sight is never refused.
//!
//! Why a directory: the kubelet's plugin watcher stats every file created in the registry
//! directory before it ignores names that start with `.`, and when a rename had already moved a
//! hidden temporary socket away it logged "Error when handling create event ... stat file
//! `.../.<pid>-<n>~` failed". It does not look into a dot-directory created while it runs (it
//! ignores that directory's own creation, which it can stat because the directory stays), but
//! it does watch every directory, dot-named or not, that exists when it starts. So the staging
//! directory is made afresh for each bind (never one a kubelet may have started to watch), and
//! it stays, empty, until the socket is dropped (so the kubelet's stat of its creation always
//! finds it). Keeping a hidden second name of the socket instead would spare the `mkdir`, but
//! leave a live registration socket under a dot-name, which a kubelet that dials every socket
//! it finds (as upstream once proposed, kubernetes#129799) would register twice.

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

pub mod authority;

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::{Channel, Endpoint, Uri};

/// Largest gRPC message sent or accepted, both ways (4 MiB, gRPC's default receive limit).
pub const MAX_MESSAGE_SIZE: usize = 4 * 1024 * 1024;

/// Longest socket path the kernel accepts: `sun_path` is 108 bytes including the final NUL.
pub const MAX_SOCKET_PATH: usize = 107;

/// Mode of every socket plugreg creates: only the owner may connect.
pub const SOCKET_MODE: u32 = 0o700;

/// What went wrong while binding, serving or dialing.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The path does not fit in `sun_path`.
    #[error(
        "socket path {path:?} is {len} bytes, longer than the {MAX_SOCKET_PATH} a Unix socket address can hold"
    )]
    PathTooLong {
        /// The path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// Something other than a socket is at the path; it was left untouched.
    #[error("file exists in socketPath {path:?} but it's not a socket")]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// The path could not be inspected.
    #[error("failed to stat {path:?}")]
    Stat {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A stale socket could not be removed.
    #[error("failed to remove stale socket {path:?}")]
    RemoveStale {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// bind/listen, chmod or rename failed.
    #[error("failed to listen on socket {path:?}")]
    Listen {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// An address is neither an absolute path nor `unix://` followed by a path.
    #[error("invalid address {address:?}: {reason}")]
    InvalidAddress {
        /// The address as given.
        address: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// Connecting failed.
    #[error("failed to connect to {path:?}")]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// Connecting (directly, without a tonic channel) failed.
    #[error("failed to connect to {path:?}")]
    Dial {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Connecting took longer than allowed.
    #[error("timed out after {timeout:?} connecting to {path:?}")]
    ConnectTimeout {
        /// The socket path.
        path: PathBuf,
        /// The limit.
        timeout: Duration,
    },
    /// The gRPC server failed.
    #[error("gRPC server on {path:?} failed")]
    Serve {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Checks that `path` fits in `sun_path`.
pub fn check_path_len(path: &Path) -> Result<()> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(Error::PathTooLong {
            path: path.to_owned(),
            len,
        });
    }
    Ok(())
}

/// Turns a socket address into a path: an absolute path, or `unix://` followed by a path
/// (`unix:///csi/csi.sock` is `/csi/csi.sock`; a relative path after `unix://` is allowed, as in
/// csi-lib-utils).
pub fn parse_address(address: &str) -> Result<PathBuf> {
    let invalid = |reason| Error::InvalidAddress {
        address: address.to_owned(),
        reason,
    };
    let path = match address.strip_prefix("unix://") {
        Some(rest) => rest,
        None if address.starts_with('/') => address,
        None => return Err(invalid("expected an absolute path or unix://PATH")),
    };
    if path.is_empty() {
        return Err(invalid("the path is empty"));
    }
    if path.contains('\0') {
        return Err(invalid("the path contains a NUL byte"));
    }
    let path = PathBuf::from(path);
    check_path_len(&path)?;
    Ok(path)
}

/// What is at a path, as far as socket handling cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathKind {
    /// Nothing.
    Missing,
    /// A Unix socket (not following symlinks).
    Socket,
    /// Anything else.
    Other,
}

/// Looks at `path` without following symlinks.
pub fn path_kind(path: &Path) -> Result<PathKind> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => Ok(PathKind::Socket),
        Ok(_) => Ok(PathKind::Other),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(PathKind::Missing),
        Err(source) => Err(Error::Stat {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Removes a stale socket at `path`; refuses (and leaves untouched) anything that is not one.
pub fn remove_stale_socket(path: &Path) -> Result<()> {
    match path_kind(path)? {
        PathKind::Missing => Ok(()),
        PathKind::Other => Err(Error::NotASocket {
            path: path.to_owned(),
        }),
        PathKind::Socket => match std::fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(Error::RemoveStale {
                path: path.to_owned(),
                source,
            }),
        },
    }
}

/// A listening socket that plugreg owns. Dropping it removes the socket file, but only while the
/// file at the path is still this socket (someone may have replaced it since), and unless
/// [`KeepFile::keep`] said another process serves it now.
#[derive(Debug)]
pub struct BoundSocket {
    listener: UnixListener,
    guard: SocketGuard,
}

impl BoundSocket {
    /// The path the socket is reachable at.
    pub fn path(&self) -> &Path {
        &self.guard.socket.path
    }

    /// Which file this socket is, to check later whether it is still in place.
    pub fn identity(&self) -> SocketIdentity {
        self.guard.socket.clone()
    }

    /// Splits into the listener and the guard that removes the socket when dropped.
    pub fn into_parts(self) -> (UnixListener, SocketGuard) {
        (self.listener, self.guard)
    }

    /// A handle that, once [`kept`](KeepFile::keep), stops the socket file from being removed
    /// when this socket (or its guard) is dropped: for handing the listener to another process.
    pub fn keep_file(&self) -> KeepFile {
        KeepFile(self.guard.keep.clone())
    }

    /// A second descriptor of the listening socket (`dup`), e.g. to pass to another process.
    /// Connections then queue once and go to whichever holder accepts first.
    pub fn try_clone_listener(&self) -> io::Result<OwnedFd> {
        self.listener.as_fd().try_clone_to_owned()
    }

    /// Takes over a listening socket that another process bound at `path` and passed on (see
    /// [`try_clone_listener`](Self::try_clone_listener)). Dropping the result removes the
    /// socket file at `path` if it is still the one there now. Must be called inside a tokio
    /// runtime.
    pub fn adopt(listener: std::os::unix::net::UnixListener, path: &Path) -> Result<BoundSocket> {
        let listen_err = |source| Error::Listen {
            path: path.to_owned(),
            source,
        };
        listener.set_nonblocking(true).map_err(listen_err)?;
        let listener = UnixListener::from_std(listener).map_err(listen_err)?;
        let meta = std::fs::symlink_metadata(path).map_err(listen_err)?;
        if !meta.file_type().is_socket() {
            return Err(Error::NotASocket {
                path: path.to_owned(),
            });
        }
        Ok(BoundSocket {
            listener,
            guard: SocketGuard::new(path, &meta, None),
        })
    }
}

/// Tells a [`BoundSocket`]'s guard to leave the socket file in place when it is dropped.
#[derive(Debug, Clone)]
pub struct KeepFile(Arc<AtomicBool>);

impl KeepFile {
    /// From now on, dropping the socket leaves its file in place (its staging directory
    /// still goes): another process serves the socket.
    pub fn keep(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A socket file by path, device and inode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketIdentity {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl SocketIdentity {
    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file at the path is still this socket (false once it was deleted or
    /// replaced).
    pub fn is_in_place(&self) -> bool {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) => m.dev() == self.dev && m.ino() == self.ino,
            Err(_) => false,
        }
    }
}

/// Removes a socket file on drop if it is still the one that was bound (same device and inode)
/// and it was not [kept](KeepFile), and the hidden staging directory it was bound in.
#[derive(Debug)]
pub struct SocketGuard {
    socket: SocketIdentity,
    staging: Option<SocketIdentity>,
    keep: Arc<AtomicBool>,
}

impl SocketGuard {
    fn new(path: &Path, meta: &std::fs::Metadata, staging: Option<SocketIdentity>) -> Self {
        SocketGuard {
            socket: SocketIdentity {
                path: path.to_owned(),
                dev: meta.dev(),
                ino: meta.ino(),
            },
            staging,
            keep: Arc::default(),
        }
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.socket.path
    }
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        if !self.keep.load(Ordering::SeqCst)
            && self.socket.is_in_place()
            && let Err(e) = std::fs::remove_file(&self.socket.path)
        {
            tracing::warn!(path = %self.socket.path.display(), error = %e, "failed to remove socket");
        }
        // Only the directory this bind made: a later bind of the same path may have made a new
        // one under the same name.
        if let Some(staging) = &self.staging
            && staging.is_in_place()
            && let Err(e) = std::fs::remove_dir(&staging.path)
        {
            tracing::debug!(path = %staging.path.display(), error = %e, "failed to remove the staging directory");
        }
    }
}

/// The socket's name inside its staging directory: a dot-name too, so that a kubelet which does
/// watch the directory (one started while it existed) ignores it.
const STAGED_NAME: &str = ".s";

/// Most attempts at a free staging directory name.
const STAGING_ATTEMPTS: u32 = 8;

/// Makes the staging directory for a socket named `name` in `dir`: `.<name>~`, made afresh (an
/// empty one of that name is removed first), or `.<name>~<random>` when that name is in use.
/// Mode 0700. `None` when the staged socket's path would not fit in `sun_path`.
fn make_staging_dir(dir: &Path, name: &std::ffi::OsStr) -> io::Result<Option<SocketIdentity>> {
    let mut base = std::ffi::OsString::from(".");
    base.push(name);
    base.push("~");
    let mut builder = std::fs::DirBuilder::new();
    builder.mode(0o700);
    for attempt in 0..STAGING_ATTEMPTS {
        let mut staging_name = base.clone();
        if attempt > 0 {
            let suffix = plugreg_runtime::backoff::random_u64() as u32;
            staging_name.push(format!("{suffix:08x}"));
        }
        let staging = dir.join(&staging_name);
        if staging.join(STAGED_NAME).as_os_str().len() > MAX_SOCKET_PATH {
            return Ok(None);
        }
        if attempt == 0 {
            match std::fs::remove_dir(&staging) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                // Not empty (in use by another bind) or not a directory: another name.
                Err(_) => continue,
            }
        }
        match builder.create(&staging) {
            Ok(()) => {
                let meta = std::fs::symlink_metadata(&staging)?;
                return Ok(Some(SocketIdentity {
                    path: staging,
                    dev: meta.dev(),
                    ino: meta.ino(),
                }));
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        "no free name for a staging directory",
    ))
}

/// A listening Unix socket bound at `path`, connectable by its owner only from the start: the
/// mode is set on the socket before `bind` (Linux gives the file the socket's mode, less the
/// umask), so there is no moment in which others could connect.
fn listen_private(path: &Path) -> io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    rustix::fs::fchmod(&fd, rustix::fs::Mode::from_raw_mode(SOCKET_MODE))?;
    rustix::net::bind(&fd, &SocketAddrUnix::new(path)?)?;
    rustix::net::listen(&fd, LISTEN_BACKLOG)?;
    Ok(fd)
}

/// The listen backlog of every socket plugreg binds (tokio's default).
const LISTEN_BACKLOG: i32 = 1024;

/// Binds a private, listening Unix socket at `path`: checks the length, removes a stale socket,
/// refuses a non-socket, binds in a fresh hidden staging directory beside it (mode 0700 from the
/// start) and renames it into place (see the module docs). Must be called inside a tokio
/// runtime.
pub fn bind(path: &Path) -> Result<BoundSocket> {
    check_path_len(path)?;
    remove_stale_socket(path)?;
    let listen_err = |source| Error::Listen {
        path: path.to_owned(),
        source,
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let staging = match path.file_name() {
        Some(name) => make_staging_dir(dir, name).map_err(listen_err)?,
        None => None,
    };
    let fd = match &staging {
        Some(staging) => {
            let temp = staging.path.join(STAGED_NAME);
            let placed = listen_private(&temp).and_then(|fd| {
                std::fs::rename(&temp, path)?;
                Ok(fd)
            });
            match placed {
                Ok(fd) => fd,
                Err(e) => {
                    let _ = std::fs::remove_file(&temp);
                    let _ = std::fs::remove_dir(&staging.path);
                    return Err(listen_err(e));
                }
            }
        }
        // The directory is so long that only the final name fits: bound in place, which a
        // watcher may see a moment before it listens.
        None => listen_private(path).map_err(listen_err)?,
    };
    let listener = std::os::unix::net::UnixListener::from(fd);
    let listener = UnixListener::from_std(listener).map_err(listen_err)?;
    let meta = std::fs::symlink_metadata(path).map_err(listen_err)?;
    Ok(BoundSocket {
        listener,
        guard: SocketGuard::new(path, &meta, staging),
    })
}

/// Most connections one server handles at once unless told otherwise (D7): more clients wait in
/// the socket's listen backlog until a connection closes. Each connection costs up to about
/// 100 KiB of buffers in [`authority::AuthorityFix`] at worst, plus what h2 holds.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

/// Serves `router` on `socket` until `shutdown` completes, then removes the socket (if it is
/// still ours). Handles at most [`DEFAULT_MAX_CONNECTIONS`] connections at once.
pub async fn serve(
    router: tonic::transport::server::Router,
    socket: BoundSocket,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    serve_with_limit(router, socket, DEFAULT_MAX_CONNECTIONS, shutdown).await
}

/// [`serve`] with at most `max_connections` (at least 1) connections at once: the next one is
/// accepted only when one of them has closed.
pub async fn serve_with_limit(
    router: tonic::transport::server::Router,
    socket: BoundSocket,
    max_connections: usize,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let (listener, guard) = socket.into_parts();
    let incoming = Incoming {
        listener,
        slots: Arc::new(Semaphore::new(max_connections.max(1))),
        acquiring: None,
        slot: None,
        shortages: 0,
        pause: None,
    };
    let result = router
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    let path = guard.path().to_owned();
    drop(guard);
    result.map_err(|source| Error::Serve { path, source })
}

type Acquire = Pin<Box<dyn Future<Output = Option<OwnedSemaphorePermit>> + Send>>;

/// Accepted connections, each holding a slot of the listener's connection cap, each wrapped in
/// [`authority::AuthorityFix`] (older gRPC clients send the socket path as :authority).
struct Incoming {
    listener: UnixListener,
    slots: Arc<Semaphore>,
    acquiring: Option<Acquire>,
    slot: Option<OwnedSemaphorePermit>,
    /// Accepts that failed in a row for want of resources, and the pause before the next one:
    /// tonic retries a failed accept at once, which spins on EMFILE.
    shortages: u32,
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl tokio_stream::Stream for Incoming {
    type Item = io::Result<authority::AuthorityFix<UnixStream>>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.slot.is_none() {
            // Not accepting until a slot is free leaves further clients in the kernel's
            // backlog instead of growing without bound.
            let slots = this.slots.clone();
            let acquiring = this
                .acquiring
                .get_or_insert_with(|| Box::pin(async move { slots.acquire_owned().await.ok() }));
            let slot = ready!(acquiring.as_mut().poll(cx));
            this.acquiring = None;
            match slot {
                Some(s) => this.slot = Some(s),
                None => return Poll::Ready(None),
            }
        }
        loop {
            if let Some(pause) = this.pause.as_mut() {
                ready!(pause.as_mut().poll(cx));
                this.pause = None;
            }
            match ready!(this.listener.poll_accept(cx)) {
                Ok((stream, _)) => {
                    this.shortages = 0;
                    let slot = this.slot.take().expect("acquired above");
                    return Poll::Ready(Some(Ok(authority::AuthorityFix::with_permit(
                        stream, slot,
                    ))));
                }
                Err(e) if plugreg_runtime::accept::is_shortage(&e) => {
                    this.shortages = this.shortages.saturating_add(1);
                    let wait = plugreg_runtime::accept::BACKOFF.delay(this.shortages);
                    if this.shortages == 1 {
                        tracing::warn!(error = %e, "cannot accept a connection; pausing accepts");
                    }
                    this.pause = Some(Box::pin(tokio::time::sleep(wait)));
                }
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
        }
    }
}

/// A tonic server builder with plugreg's defaults: the header-list bound h2 advertises agrees
/// with the one [`authority`] enforces.
pub fn server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_max_header_list_size(authority::MAX_HEADER_LIST_SIZE as u32)
}

/// Dials the gRPC server on the Unix socket at `address` (absolute path or `unix://PATH`),
/// connecting eagerly within `timeout`.
pub async fn connect(address: &str, timeout: Duration) -> Result<Channel> {
    let path = parse_address(address)?;
    connect_path(&path, timeout).await
}

/// Dials the gRPC server on the Unix socket at `path`, connecting eagerly within `timeout`.
pub async fn connect_path(path: &Path, timeout: Duration) -> Result<Channel> {
    connect_path_watched(path, timeout).await.map(|w| w.channel)
}

/// A channel from [`connect_watched`] and the signal of its connection's end.
#[derive(Debug, Clone)]
pub struct WatchedChannel {
    /// The gRPC channel. It dials the socket again by itself after a loss; `closed` still
    /// reports the first loss.
    pub channel: Channel,
    /// Fires when the connection the channel was opened with ends.
    pub closed: Closed,
}

/// Fires once a connection has ended: the peer closed it, it failed, or this side dropped it.
/// Cheap to clone; every clone sees the same end. The default one never fires.
#[derive(Debug, Clone, Default)]
pub struct Closed(tokio_util::sync::CancellationToken);

impl Closed {
    /// Waits until the connection has ended.
    pub async fn wait(&self) {
        self.0.cancelled().await;
    }

    /// Whether the connection has ended.
    pub fn is_closed(&self) -> bool {
        self.0.is_cancelled()
    }
}

/// [`connect`], plus a signal that fires when the connection ends later (for a sidecar that
/// exits once its driver goes away).
pub async fn connect_watched(address: &str, timeout: Duration) -> Result<WatchedChannel> {
    let path = parse_address(address)?;
    connect_path_watched(&path, timeout).await
}

/// [`connect_path`], plus a signal that fires when the connection ends later.
pub async fn connect_path_watched(path: &Path, timeout: Duration) -> Result<WatchedChannel> {
    check_path_len(path)?;
    // The URI is never resolved: the connector dials the socket path.
    let endpoint = Endpoint::from_static("http://[::]:0")
        .connect_timeout(timeout)
        .tcp_nodelay(true);
    let closed = Closed::default();
    let dial_path = path.to_owned();
    let token = closed.0.clone();
    let connector = tower::service_fn(move |_: Uri| {
        let p = dial_path.clone();
        let token = token.clone();
        async move {
            let stream = UnixStream::connect(p).await?;
            Ok::<_, io::Error>(TokioIo::new(WatchedStream { stream, token }))
        }
    });
    // The one place a tonic channel is dialed (the workspace lint forbids it elsewhere).
    #[allow(clippy::disallowed_methods)]
    let connecting = endpoint.connect_with_connector(connector);
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(channel)) => Ok(WatchedChannel { channel, closed }),
        Ok(Err(source)) => Err(Error::Connect {
            path: path.to_owned(),
            source,
        }),
        Err(_) => Err(Error::ConnectTimeout {
            path: path.to_owned(),
            timeout,
        }),
    }
}

/// A Unix stream that cancels `token` when a read sees its end (EOF or an error) or when it is
/// dropped (after a GOAWAY the client side may close first, never reading EOF).
#[derive(Debug)]
struct WatchedStream {
    stream: UnixStream,
    token: tokio_util::sync::CancellationToken,
}

impl Drop for WatchedStream {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

impl tokio::io::AsyncRead for WatchedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let wanted = buf.remaining() > 0;
        let this = &mut *self;
        let result = Pin::new(&mut this.stream).poll_read(cx, buf);
        match &result {
            Poll::Ready(Ok(())) if wanted && buf.filled().len() == before => this.token.cancel(),
            Poll::Ready(Err(_)) => this.token.cancel(),
            _ => {}
        }
        result
    }
}

impl tokio::io::AsyncWrite for WatchedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// A bare HTTP/2 connection to a Unix socket, usable by any generated gRPC client (see
/// [`client!`]).
///
/// Cheaper than a [`Channel`] for one-shot exchanges such as a registration attempt: no buffer
/// task, no reconnect layer. Deadlines are the caller's. Dropping every clone closes the
/// connection.
#[derive(Debug, Clone)]
pub struct Connection {
    send: hyper::client::conn::http2::SendRequest<tonic::body::Body>,
}

/// The origin to give a generated client used over a [`Connection`] (or a [`Channel`], which
/// puts its own in place).
pub const ORIGIN: &str = "http://localhost";

/// [`ORIGIN`] as a URI.
pub fn origin() -> Uri {
    Uri::from_static(ORIGIN)
}

/// A generated gRPC client over `$conn` (a [`Connection`] or a [`Channel`]) with plugreg's
/// origin and message caps ([`MAX_MESSAGE_SIZE`] both ways):
/// `plugreg_transport::client!(IdentityClient, channel)`.
#[macro_export]
macro_rules! client {
    ($($client:ident)::+, $conn:expr $(,)?) => {
        $($client)::+::with_origin($conn, $crate::origin())
            .max_decoding_message_size($crate::MAX_MESSAGE_SIZE)
            .max_encoding_message_size($crate::MAX_MESSAGE_SIZE)
    };
}

/// Connects to the Unix socket at `path` and completes the HTTP/2 handshake, within `timeout`.
/// The connection runs in a task of its own until every clone is dropped or the peer ends it.
pub async fn connect_direct(path: &Path, timeout: Duration) -> Result<Connection> {
    let (connection, driver) = connect_direct_driven(path, timeout).await?;
    tokio::spawn(driver);
    Ok(connection)
}

/// Drives a connection from [`connect_direct_driven`]: completes when the connection has ended
/// (the peer closed it, or it failed). Dropping it closes the connection at once.
#[must_use = "the connection makes no progress unless its driver is awaited or spawned"]
pub struct ConnectionDriver(Pin<Box<dyn Future<Output = ()> + Send>>);

impl std::fmt::Debug for ConnectionDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConnectionDriver")
    }
}

impl Future for ConnectionDriver {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.as_mut().poll(cx)
    }
}

/// [`connect_direct`], but the caller drives the connection: awaiting the [`ConnectionDriver`]
/// is how it learns that the connection ended, and dropping it closes the connection.
pub async fn connect_direct_driven(
    path: &Path,
    timeout: Duration,
) -> Result<(Connection, ConnectionDriver)> {
    check_path_len(path)?;
    let dial = async {
        let stream = UnixStream::connect(path).await?;
        // The one place a bare HTTP/2 connection is dialed (the workspace lint forbids it
        // elsewhere).
        #[allow(clippy::disallowed_methods)]
        let handshake =
            hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .handshake::<_, tonic::body::Body>(TokioIo::new(stream));
        let (send, conn) = handshake.await.map_err(io::Error::other)?;
        let driver = ConnectionDriver(Box::pin(async move {
            if let Err(e) = conn.await {
                tracing::trace!(error = %e, "HTTP/2 connection ended");
            }
        }));
        Ok::<_, io::Error>((Connection { send }, driver))
    };
    match tokio::time::timeout(timeout, dial).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(source)) => Err(Error::Dial {
            path: path.to_owned(),
            source,
        }),
        Err(_) => Err(Error::ConnectTimeout {
            path: path.to_owned(),
            timeout,
        }),
    }
}

impl tower::Service<http::Request<tonic::body::Body>> for Connection {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper::Error;
    type Future =
        std::pin::Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.send.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(self.send.send_request(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_unix_addresses() {
        assert_eq!(
            parse_address("/a/b.sock").unwrap(),
            PathBuf::from("/a/b.sock")
        );
        assert_eq!(
            parse_address("unix:///a/b.sock").unwrap(),
            PathBuf::from("/a/b.sock")
        );
        assert_eq!(
            parse_address("unix://rel.sock").unwrap(),
            PathBuf::from("rel.sock")
        );
        for bad in ["", "csi.sock", "unix://", "tcp://1.2.3.4:5", "/a\0b"] {
            assert!(parse_address(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn refuses_paths_longer_than_sun_path() {
        let long = format!("/{}", "x".repeat(MAX_SOCKET_PATH));
        let err = parse_address(&long).unwrap_err();
        assert!(matches!(err, Error::PathTooLong { len, .. } if len == MAX_SOCKET_PATH + 1));
        assert!(err.to_string().contains("longer than the 107"));
        assert!(parse_address(&long[..MAX_SOCKET_PATH]).is_ok());
    }
}
