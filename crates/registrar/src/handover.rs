//! Handing a listening registration socket from a running instance to its successor, so that
//! the socket file never changes hands through a delete.
//!
//! The kubelet deregisters a plugin whenever its registration socket is removed or created
//! again (even a re-creation over a dead socket starts with a deregistration). In a DaemonSet
//! surge rollout the old and the new instance of a plugin run side by side for a while; if the
//! new one created its own socket, or the old one removed its socket on the way out, the kubelet
//! would forget the plugin for a moment. Instead:
//!
//! * The instance serving `<dir>/<name>` also listens on a hidden hand-over socket beside it,
//!   `<dir>/.<name>` (the kubelet ignores dot-names). Only its owner can connect (mode 0700).
//! * A new instance that finds `<dir>/<name>` alive connects to the hand-over socket, says
//!   [`WAIT`] and waits.
//! * When the serving instance stops (SIGTERM in a pod), it sends the waiting successor a
//!   duplicate of its listening descriptor (`SCM_RIGHTS`) with [`OFFER`], waits for [`ACK`], and
//!   exits without removing `<dir>/<name>`. The successor serves the same socket from then on:
//!   the file never changes, so the kubelet sees nothing at all.
//!
//! With no successor waiting, or when the successor does not acknowledge in time, the stopping
//! instance removes its socket as before. Every message is a fixed line; anything else closes
//! the connection.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketType,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

/// A successor's request, sent once after connecting: "hand me the socket when you stop".
pub const WAIT: &[u8] = b"plugreg-handover/1 wait\n";
/// The serving instance's offer, carrying the listening descriptor; the status byte before the
/// newline is `r` when the kubelet's latest notification accepted the plugin, `-` otherwise.
pub const OFFER: &[u8] = b"plugreg-handover/1 offer ?\n";
/// The successor's acknowledgement: it serves the socket now.
pub const ACK: &[u8] = b"plugreg-handover/1 ack\n";

/// Where in [`OFFER`] the status byte sits.
const OFFER_STATUS_AT: usize = OFFER.len() - 2;
/// How long a connection may take to say [`WAIT`], and a successor to say [`ACK`].
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);
/// Successors kept waiting at once; a further one replaces the oldest.
const MAX_WAITING: usize = 8;

/// The hand-over socket of the registration socket `socket`: `.<name>` beside it. `None` when
/// `socket` has no file name.
pub fn handover_path(socket: &Path) -> Option<PathBuf> {
    let name = socket.file_name()?;
    let mut hidden = std::ffi::OsString::from(".");
    hidden.push(name);
    Some(socket.with_file_name(hidden))
}

/// Why a hand-over could not be received.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    /// Talking to the serving instance failed.
    #[error("hand-over connection failed")]
    Io(#[from] std::io::Error),
    /// The serving instance said something other than [`OFFER`].
    #[error("unexpected hand-over message {0:?}")]
    Protocol(String),
    /// The offer carried no descriptor, more than one, or one that is not a listening Unix
    /// stream socket.
    #[error("the hand-over carried {0}")]
    BadDescriptor(&'static str),
    /// The hand-over socket belongs to another user.
    #[error("the hand-over socket is served by uid {peer}, not by this uid {own}")]
    ForeignPeer {
        /// The peer's uid.
        peer: u32,
        /// Ours.
        own: u32,
    },
}

/// What a successor got from [`wait_for_offer`].
#[derive(Debug)]
pub enum Waited {
    /// The serving instance handed its listening socket over; acknowledge it with
    /// [`Offer::accept`] once it is served.
    Offer(Offer),
    /// The serving instance went away (or refused) without handing over.
    Gone,
    /// Nobody serves the hand-over socket.
    Unavailable,
    /// `token` was cancelled while waiting.
    Cancelled,
}

/// A received listening socket, not yet acknowledged.
#[derive(Debug)]
pub struct Offer {
    /// The listening socket.
    pub listener: std::os::unix::net::UnixListener,
    /// Whether the kubelet had accepted the plugin when the socket was handed over.
    pub registered: bool,
    /// The answer still owed to the previous instance.
    pub ack: Ack,
}

/// The connection to the previous instance, which waits to hear that its socket is served.
#[derive(Debug)]
pub struct Ack(UnixStream);

impl Ack {
    /// Tells the previous instance that this one serves the socket now, so it leaves the file
    /// in place.
    pub async fn send(mut self) -> std::io::Result<()> {
        tokio::time::timeout(ANSWER_TIMEOUT, self.0.write_all(ACK))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
    }
}

/// Connects to the hand-over socket `path` and waits until the instance behind it offers its
/// listening socket, goes away, or `token` is cancelled. `waiting` runs once the request is
/// sent (from then on a stopping instance hands the socket to this one).
pub async fn wait_for_offer(
    path: &Path,
    token: &CancellationToken,
    waiting: impl FnOnce(),
) -> Waited {
    let mut stream = match UnixStream::connect(path).await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "no hand-over socket");
            return Waited::Unavailable;
        }
    };
    if let Err(e) = check_peer(&stream) {
        tracing::warn!(path = %path.display(), error = %plugreg_runtime::report::chain(&e), "not waiting for a hand-over");
        return Waited::Unavailable;
    }
    if let Err(e) = stream.write_all(WAIT).await {
        tracing::debug!(path = %path.display(), error = %e, "the serving instance went away");
        return Waited::Gone;
    }
    waiting();
    let received = tokio::select! {
        _ = token.cancelled() => return Waited::Cancelled,
        r = receive_offer(&stream) => r,
    };
    match received {
        Ok(Some((listener, registered))) => Waited::Offer(Offer {
            listener,
            registered,
            ack: Ack(stream),
        }),
        Ok(None) => Waited::Gone,
        Err(HandoverError::Io(e)) => {
            tracing::debug!(path = %path.display(), error = %e, "the serving instance went away");
            Waited::Gone
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %plugreg_runtime::report::chain(&e), "refused a hand-over");
            Waited::Gone
        }
    }
}

/// The peer of a hand-over connection must run as this process's user.
fn check_peer(stream: &UnixStream) -> Result<(), HandoverError> {
    let peer = rustix::net::sockopt::socket_peercred(stream).map_err(std::io::Error::from)?;
    let own = rustix::process::geteuid();
    if peer.uid != own {
        return Err(HandoverError::ForeignPeer {
            peer: peer.uid.as_raw(),
            own: own.as_raw(),
        });
    }
    Ok(())
}

/// Reads one [`OFFER`] and its descriptor. `None` on end of stream before a whole offer.
async fn receive_offer(
    stream: &UnixStream,
) -> Result<Option<(std::os::unix::net::UnixListener, bool)>, HandoverError> {
    let mut message = [0u8; OFFER.len()];
    let mut got = 0;
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut truncated = false;
    while got < message.len() {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let n = stream
            .async_io(Interest::READABLE, || {
                let mut control = RecvAncillaryBuffer::new(&mut space);
                let r = rustix::net::recvmsg(
                    stream,
                    &mut [IoSliceMut::new(&mut message[got..])],
                    &mut control,
                    RecvFlags::CMSG_CLOEXEC,
                )?;
                for m in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(received) = m {
                        fds.extend(received);
                    }
                }
                // More descriptors than there was room for: the kernel closed the rest.
                truncated |= r.flags.contains(rustix::net::ReturnFlags::CTRUNC);
                Ok(r.bytes)
            })
            .await?;
        if n == 0 {
            return Ok(None);
        }
        got += n;
    }
    let status = message[OFFER_STATUS_AT];
    let mut expected = *b"plugreg-handover/1 offer ?\n";
    expected[OFFER_STATUS_AT] = status;
    if expected != message || !matches!(status, b'r' | b'-') {
        return Err(HandoverError::Protocol(
            String::from_utf8_lossy(&message).into_owned(),
        ));
    }
    if truncated {
        return Err(HandoverError::BadDescriptor("more than one descriptor"));
    }
    let fd = match <[OwnedFd; 1]>::try_from(fds) {
        Ok([fd]) => fd,
        Err(fds) if fds.is_empty() => return Err(HandoverError::BadDescriptor("no descriptor")),
        Err(_) => return Err(HandoverError::BadDescriptor("more than one descriptor")),
    };
    check_listener(&fd)?;
    Ok(Some((
        std::os::unix::net::UnixListener::from(fd),
        status == b'r',
    )))
}

/// The descriptor must be a listening Unix stream socket.
fn check_listener(fd: &OwnedFd) -> Result<(), HandoverError> {
    let not_a_listener = |_| HandoverError::BadDescriptor("a descriptor that is not a socket");
    let domain = rustix::net::sockopt::socket_domain(fd).map_err(not_a_listener)?;
    let kind = rustix::net::sockopt::socket_type(fd).map_err(not_a_listener)?;
    let listening = rustix::net::sockopt::socket_acceptconn(fd).map_err(not_a_listener)?;
    if domain != AddressFamily::UNIX || kind != SocketType::STREAM || !listening {
        return Err(HandoverError::BadDescriptor(
            "a socket that is not a listening Unix stream socket",
        ));
    }
    Ok(())
}

/// The successors waiting on a serving instance's hand-over socket. Dropping it stops listening
/// (and removes the hand-over socket) in the background; [`close`](Self::close) waits for that.
#[derive(Debug)]
pub struct Successors {
    stop: CancellationToken,
    /// Accepts successors; ends with the list of those waiting.
    task: Mutex<Option<tokio::task::JoinHandle<Vec<UnixStream>>>>,
}

impl Drop for Successors {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Successors {
    /// Listens on the hand-over socket of `socket` (see [`handover_path`]) and keeps each
    /// successor that says [`WAIT`]. The socket is bound in the background, off the runtime's
    /// threads: the registration socket is served meanwhile (binding costs a few file-system
    /// operations, milliseconds on a busy journalled disk). A socket that cannot be bound
    /// means no hand-over (a debug line). `None` when `socket` has no file name.
    pub fn listen(socket: &Path) -> Option<Self> {
        let path = handover_path(socket)?;
        let stop = CancellationToken::new();
        let task = tokio::spawn(accept_successors(path, stop.clone()));
        Some(Successors {
            stop,
            task: Mutex::new(Some(task)),
        })
    }

    /// Stops listening, then offers `listener` to the successors that connected before, the
    /// latest first, until one acknowledges. Returns whether one took it.
    pub async fn hand_over(&self, listener: &OwnedFd, registered: bool) -> bool {
        let mut waiting = self.stopped().await;
        while let Some(mut successor) = waiting.pop() {
            match offer(&mut successor, listener, registered).await {
                Ok(()) => return true,
                Err(e) => {
                    tracing::debug!(error = %e, "a waiting successor did not take the socket; trying the next")
                }
            }
        }
        false
    }

    /// Stops listening and removes the hand-over socket; successors still waiting see their
    /// connection close.
    pub async fn close(self) {
        drop(self.stopped().await);
    }

    /// Stops the accepting task and returns the successors it kept (none the second time).
    async fn stopped(&self) -> Vec<UnixStream> {
        self.stop.cancel();
        let task = self
            .task
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match task {
            Some(task) => task.await.unwrap_or_default(),
            None => Vec::new(),
        }
    }
}

/// Sends the offer and waits for the acknowledgement.
async fn offer(
    successor: &mut UnixStream,
    listener: &OwnedFd,
    registered: bool,
) -> std::io::Result<()> {
    let mut message = *b"plugreg-handover/1 offer ?\n";
    message[OFFER_STATUS_AT] = if registered { b'r' } else { b'-' };
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let send = successor.async_io(Interest::WRITABLE, || {
        let fds = [listener.as_fd()];
        let mut control = SendAncillaryBuffer::new(&mut space);
        control.push(SendAncillaryMessage::ScmRights(&fds));
        Ok(rustix::net::sendmsg(
            &*successor,
            &[IoSlice::new(&message)],
            &mut control,
            SendFlags::NOSIGNAL,
        )?)
    });
    let sent = tokio::time::timeout(ANSWER_TIMEOUT, send)
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    // The descriptor went with the first byte; the rest of the line is plain data.
    if sent < message.len() {
        tokio::time::timeout(ANSWER_TIMEOUT, successor.write_all(&message[sent..]))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    }
    let mut answer = [0u8; ACK.len()];
    tokio::time::timeout(ANSWER_TIMEOUT, successor.read_exact(&mut answer))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    if answer != ACK {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("unexpected answer {:?}", String::from_utf8_lossy(&answer)),
        ));
    }
    Ok(())
}

/// Accepts connections on the hand-over socket until `stop`, keeping each that says [`WAIT`] in
/// time (at most [`MAX_WAITING`], the oldest dropped first). At `stop` it also takes the
/// connections still in the backlog and waits for their greetings (each within
/// [`ANSWER_TIMEOUT`]): a successor whose connect succeeded before the stop is not missed.
/// Returns the successors, the oldest first.
async fn accept_successors(path: PathBuf, stop: CancellationToken) -> Vec<UnixStream> {
    let bound = {
        let path = path.clone();
        tokio::task::spawn_blocking(move || plugreg_transport::bind(&path)).await
    };
    if stop.is_cancelled() {
        // Stopped while binding: nobody can have waited yet; the socket goes again.
        return Vec::new();
    }
    let (listener, guard): (UnixListener, _) = match bound {
        Ok(Ok(b)) => b.into_parts(),
        Ok(Err(e)) => {
            tracing::debug!(path = %path.display(), error = %plugreg_runtime::report::chain(&e), "no hand-over socket: a successor will replace the registration socket");
            return Vec::new();
        }
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "no hand-over socket");
            return Vec::new();
        }
    };
    let mut waiting: Vec<UnixStream> = Vec::new();
    let keep = |waiting: &mut Vec<UnixStream>, done: Result<Option<UnixStream>, _>| {
        if let Ok(Some(stream)) = done {
            if waiting.len() == MAX_WAITING {
                waiting.remove(0);
            }
            waiting.push(stream);
        }
    };
    let mut greeting = tokio::task::JoinSet::new();
    let mut shortages = 0u32;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            Some(done) = greeting.join_next(), if !greeting.is_empty() => keep(&mut waiting, done),
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    shortages = 0;
                    if greeting.len() < MAX_WAITING {
                        greeting.spawn(greeted(stream));
                    }
                }
                Err(e) => {
                    if !plugreg_runtime::accept::is_shortage(&e) {
                        tracing::debug!(error = %e, "hand-over socket: accept failed");
                    }
                    shortages = shortages.saturating_add(1);
                    tokio::time::sleep(plugreg_runtime::accept::BACKOFF.delay(shortages)).await;
                }
            },
        }
    }
    // Nobody new can connect from here on; the connections made before wait in the backlog.
    drop(guard);
    match listener.into_std() {
        Ok(listener) => {
            while let Ok((stream, _)) = listener.accept() {
                if greeting.len() >= MAX_WAITING {
                    break;
                }
                if let Ok(stream) = stream
                    .set_nonblocking(true)
                    .and_then(|()| UnixStream::from_std(stream))
                {
                    greeting.spawn(greeted(stream));
                }
            }
        }
        Err(e) => tracing::debug!(error = %e, "hand-over socket: cannot take the backlog"),
    }
    while let Some(done) = greeting.join_next().await {
        keep(&mut waiting, done);
    }
    waiting
}

/// The stream, once it has said [`WAIT`] within [`ANSWER_TIMEOUT`]; `None` otherwise.
async fn greeted(mut stream: UnixStream) -> Option<UnixStream> {
    check_peer(&stream).ok()?;
    let mut hello = [0u8; WAIT.len()];
    match tokio::time::timeout(ANSWER_TIMEOUT, stream.read_exact(&mut hello)).await {
        Ok(Ok(_)) if hello == WAIT => Some(stream),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handover_socket_is_the_hidden_twin() {
        assert_eq!(
            handover_path(Path::new("/r/csi.example.com-reg.sock")),
            Some(PathBuf::from("/r/.csi.example.com-reg.sock"))
        );
        assert_eq!(handover_path(Path::new("/")), None);
    }

    /// A fake serving instance on `path`: accepts one successor, reads its request and sends
    /// `message` with `fds`.
    async fn fake_offer(path: &Path, message: &'static [u8], fds: Vec<OwnedFd>) -> Waited {
        let listener = UnixListener::bind(path).unwrap();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut request = [0u8; WAIT.len()];
            stream.read_exact(&mut request).await.unwrap();
            assert_eq!(request, WAIT);
            let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
            let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !borrowed.is_empty() {
                assert!(control.push(SendAncillaryMessage::ScmRights(&borrowed)));
            }
            stream
                .async_io(Interest::WRITABLE, || {
                    Ok(rustix::net::sendmsg(
                        &stream,
                        &[IoSlice::new(message)],
                        &mut control,
                        SendFlags::NOSIGNAL,
                    )?)
                })
                .await
                .unwrap();
            // Keep the connection until the successor has judged the offer.
            let mut rest = Vec::new();
            let _ = stream.read_to_end(&mut rest).await;
        });
        let waited = wait_for_offer(path, &CancellationToken::new(), || {}).await;
        server.abort();
        waited
    }

    fn listening_socket(dir: &Path) -> OwnedFd {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let l = std::os::unix::net::UnixListener::bind(dir.join(format!("l{n}.sock"))).unwrap();
        OwnedFd::from(l)
    }

    #[tokio::test]
    async fn a_good_offer_is_taken() {
        let dir = tempfile::tempdir().unwrap();
        let fd = listening_socket(dir.path());
        let w = fake_offer(
            &dir.path().join("h"),
            b"plugreg-handover/1 offer r\n",
            vec![fd],
        )
        .await;
        let Waited::Offer(offer) = w else {
            panic!("{w:?}")
        };
        assert!(offer.registered);
        assert!(offer.listener.local_addr().unwrap().as_pathname().is_some());
    }

    #[tokio::test]
    async fn offers_that_are_not_one_listening_unix_socket_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h");
        let file = OwnedFd::from(std::fs::File::create(dir.path().join("f")).unwrap());
        let (connected, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let tcp = OwnedFd::from(std::net::TcpListener::bind("127.0.0.1:0").unwrap());
        for (what, message, fds) in [
            (
                "no descriptor",
                &b"plugreg-handover/1 offer r\n"[..],
                vec![],
            ),
            ("a file", b"plugreg-handover/1 offer r\n", vec![file]),
            (
                "a connected socket",
                b"plugreg-handover/1 offer -\n",
                vec![OwnedFd::from(connected)],
            ),
            ("a TCP listener", b"plugreg-handover/1 offer r\n", vec![tcp]),
            (
                "two descriptors",
                b"plugreg-handover/1 offer r\n",
                vec![listening_socket(dir.path()), listening_socket(dir.path())],
            ),
            (
                "another message",
                b"plugreg-handover/1 offer x\n",
                vec![listening_socket(dir.path())],
            ),
            (
                "garbage",
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                vec![listening_socket(dir.path())],
            ),
        ] {
            let _ = std::fs::remove_file(&path);
            let w = fake_offer(&path, message, fds).await;
            assert!(matches!(w, Waited::Gone), "{what}: {w:?}");
        }
    }

    /// Connects to the hand-over socket of `socket` once it is bound (in the background).
    async fn connect_when_bound(socket: &Path) -> UnixStream {
        let path = handover_path(socket).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(s) = UnixStream::connect(&path).await {
                return s;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{path:?} never bound"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    #[tokio::test]
    async fn a_successor_that_never_answers_gets_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("p.sock");
        let successors = Successors::listen(&socket).unwrap();
        let mut silent = connect_when_bound(&socket).await;
        silent.write_all(WAIT).await.unwrap();
        let fd = listening_socket(dir.path());
        let started = tokio::time::Instant::now();
        assert!(!successors.hand_over(&fd, true).await);
        assert!(started.elapsed() >= ANSWER_TIMEOUT);
        // It got the offer, but never said it took it.
        let mut offer = [0u8; OFFER.len()];
        silent.read_exact(&mut offer).await.unwrap();
        assert_eq!(&offer, b"plugreg-handover/1 offer r\n");
        successors.close().await;
        assert!(!handover_path(&socket).unwrap().exists());
    }

    #[tokio::test]
    async fn a_connection_that_never_says_wait_is_not_a_successor() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("p.sock");
        let successors = Successors::listen(&socket).unwrap();
        let mut rude = connect_when_bound(&socket).await;
        rude.write_all(b"plugreg-handover/1 WAIT\n").await.unwrap();
        let fd = listening_socket(dir.path());
        assert!(!successors.hand_over(&fd, false).await);
        let mut rest = Vec::new();
        rude.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "nothing is offered to it: {rest:?}");
    }

    #[test]
    fn messages_are_single_lines() {
        for m in [WAIT, OFFER, ACK] {
            assert!(m.ends_with(b"\n") && !m[..m.len() - 1].contains(&b'\n'));
        }
        assert_eq!(OFFER[OFFER_STATUS_AT], b'?');
    }
}
