//! Handing a listening registration socket from a running instance to its successor, so that
//! the socket file never changes hands through a delete.
//!
//! The kubelet deregisters a plugin whenever its registration socket is removed or created
//! again (even a re-creation over a dead socket starts with a deregistration). In a DaemonSet
//! surge rollout the old and the new instance of a plugin run side by side for a while; if the
//! new one created its own socket, or the old one removed its socket on the way out, the kubelet
//! would forget the plugin for a moment. Instead:
//!
//! * A new instance that finds `<dir>/<name>` alive leaves it alone and listens on a hidden
//!   hand-over socket beside it, `<dir>/.<name>` (the kubelet ignores dot-names; only the
//!   owner can connect, mode 0700): [`Successor::listen`].
//! * When the serving instance stops (SIGTERM in a pod), it connects there and sends the
//!   successor a duplicate of its listening descriptor (`SCM_RIGHTS`) with [`OFFER`], waits for
//!   [`ACK`], and exits without removing `<dir>/<name>`: [`offer`]. The successor serves the
//!   same socket from then on: the file never changes, so the kubelet sees nothing at all.
//!
//! An instance that serves pays nothing for this until it stops (one `connect` that finds no
//! hand-over socket); only a successor makes a file. With no successor, or when it does not
//! acknowledge in time, the stopping instance removes its socket as before. Both sides check
//! that the other runs as the same user; every message is a fixed line, anything else closes the
//! connection.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketType,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};

/// The stopping instance's offer, carrying the listening descriptor; the status byte before the
/// newline is `r` when the kubelet's latest notification accepted the plugin, `-` otherwise.
pub const OFFER: &[u8] = b"plugreg-handover/1 offer ?\n";
/// The successor's acknowledgement: it serves the socket now.
pub const ACK: &[u8] = b"plugreg-handover/1 ack\n";

/// Where in [`OFFER`] the status byte sits.
const OFFER_STATUS_AT: usize = OFFER.len() - 2;
/// How long either side waits for the other's message.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// The hand-over socket of the registration socket `socket`: `.<name>` beside it. `None` when
/// `socket` has no file name.
pub fn handover_path(socket: &Path) -> Option<PathBuf> {
    let name = socket.file_name()?;
    let mut hidden = std::ffi::OsString::from(".");
    hidden.push(name);
    Some(socket.with_file_name(hidden))
}

/// Why a hand-over failed.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    /// Talking to the other instance failed.
    #[error("hand-over connection failed")]
    Io(#[from] std::io::Error),
    /// The other instance said something else than the protocol's line.
    #[error("unexpected hand-over message {0:?}")]
    Protocol(String),
    /// The offer carried no descriptor, more than one, or one that is not a listening Unix
    /// stream socket.
    #[error("the hand-over carried {0}")]
    BadDescriptor(&'static str),
    /// The other end runs as another user.
    #[error("the other end of the hand-over runs as uid {peer}, not as this uid {own}")]
    ForeignPeer {
        /// The peer's uid.
        peer: u32,
        /// Ours.
        own: u32,
    },
    /// The other instance took too long.
    #[error("the other instance did not answer within {ANSWER_TIMEOUT:?}")]
    Timeout,
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

/// A successor waiting for the instance that serves a registration socket to hand it over.
/// Dropping it removes its hand-over socket.
#[derive(Debug)]
pub struct Successor {
    listener: UnixListener,
    _guard: plugreg_transport::SocketGuard,
}

impl Successor {
    /// Listens on the hand-over socket of `socket`. `Ok(None)` when another successor listens
    /// there already (it goes first; this one waits its turn).
    pub fn listen(socket: &Path) -> Result<Option<Successor>, plugreg_transport::Error> {
        let Some(path) = handover_path(socket) else {
            return Ok(None);
        };
        if std::os::unix::net::UnixStream::connect(&path).is_ok() {
            return Ok(None);
        }
        let (listener, guard) = plugreg_transport::bind(&path)?.into_parts();
        Ok(Some(Successor {
            listener,
            _guard: guard,
        }))
    }

    /// Waits for an offer. A connection that offers nothing valid within two seconds is
    /// dropped (and said so at debug level), and the wait goes on.
    pub async fn next_offer(&self) -> Offer {
        loop {
            let stream = match self.listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "hand-over socket: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let received = async {
                check_peer(&stream)?;
                tokio::time::timeout(ANSWER_TIMEOUT, receive_offer(&stream))
                    .await
                    .map_err(|_| HandoverError::Timeout)?
            };
            match received.await {
                Ok(Some((listener, registered))) => {
                    return Offer {
                        listener,
                        registered,
                        ack: Ack(stream),
                    };
                }
                Ok(None) => tracing::debug!("a hand-over connection closed without an offer"),
                Err(e) => {
                    tracing::warn!(error = %plugreg_runtime::report::chain(&e), "refused a hand-over")
                }
            }
        }
    }
}

/// Offers `listener` to the successor waiting on the hand-over socket of `socket`, if one
/// does, and waits for its acknowledgement. `Ok(false)` when none waits.
pub async fn offer(
    socket: &Path,
    listener: &OwnedFd,
    registered: bool,
) -> Result<bool, HandoverError> {
    let Some(path) = handover_path(socket) else {
        return Ok(false);
    };
    let mut stream = match UnixStream::connect(&path).await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "no successor waits");
            return Ok(false);
        }
    };
    check_peer(&stream)?;
    send_offer(&mut stream, listener, registered).await?;
    Ok(true)
}

/// The peer of a hand-over connection must run as this process's user.
///
/// Only the uid is read. Two containers of a surge rollout run in sibling PID namespaces, where
/// the kernel reports the peer's pid as 0; rustix's `socket_peercred` refuses a zero pid (its
/// `Pid` is non-zero), tokio's `peer_cred` reports it as absent.
fn check_peer(stream: &UnixStream) -> Result<(), HandoverError> {
    let peer = stream.peer_cred()?.uid();
    let own = rustix::process::geteuid().as_raw();
    if peer != own {
        return Err(HandoverError::ForeignPeer { peer, own });
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

/// Sends the offer and waits for the acknowledgement.
async fn send_offer(
    successor: &mut UnixStream,
    listener: &OwnedFd,
    registered: bool,
) -> Result<(), HandoverError> {
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
        .map_err(|_| HandoverError::Timeout)??;
    // The descriptor went with the first byte; the rest of the line is plain data.
    if sent < message.len() {
        tokio::time::timeout(ANSWER_TIMEOUT, successor.write_all(&message[sent..]))
            .await
            .map_err(|_| HandoverError::Timeout)??;
    }
    let mut answer = [0u8; ACK.len()];
    tokio::time::timeout(ANSWER_TIMEOUT, successor.read_exact(&mut answer))
        .await
        .map_err(|_| HandoverError::Timeout)??;
    if answer != ACK {
        return Err(HandoverError::Protocol(
            String::from_utf8_lossy(&answer).into_owned(),
        ));
    }
    Ok(())
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

    #[test]
    fn messages_are_single_lines() {
        for m in [OFFER, ACK] {
            assert!(m.ends_with(b"\n") && !m[..m.len() - 1].contains(&b'\n'));
        }
        assert_eq!(OFFER[OFFER_STATUS_AT], b'?');
    }

    fn listening_socket(dir: &Path) -> OwnedFd {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let l = std::os::unix::net::UnixListener::bind(dir.join(format!("l{n}.sock"))).unwrap();
        OwnedFd::from(l)
    }

    /// A stopping instance that sends `message` with `fds` to the successor of `socket`;
    /// returns what it reads back until the successor closes the connection.
    async fn fake_offer(socket: &Path, message: &[u8], fds: Vec<OwnedFd>) -> Vec<u8> {
        let stream = UnixStream::connect(handover_path(socket).unwrap())
            .await
            .unwrap();
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
        let mut answer = Vec::new();
        let mut stream = stream;
        let _ = stream.read_to_end(&mut answer).await;
        answer
    }

    #[tokio::test]
    async fn a_good_offer_is_taken_and_acknowledged() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("p.sock");
        let successor = Successor::listen(&socket).unwrap().unwrap();
        let fd = listening_socket(dir.path());
        let taker = tokio::spawn(async move {
            let offer = successor.next_offer().await;
            assert!(offer.registered);
            assert!(offer.listener.local_addr().unwrap().as_pathname().is_some());
            offer.ack.send().await.unwrap();
            drop(successor);
        });
        let answer = fake_offer(&socket, b"plugreg-handover/1 offer r\n", vec![fd]).await;
        assert_eq!(answer, ACK);
        taker.await.unwrap();
        assert!(
            !handover_path(&socket).unwrap().exists(),
            "the successor removes its socket"
        );
    }

    #[tokio::test]
    async fn offers_that_are_not_one_listening_unix_socket_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("p.sock");
        let successor = Successor::listen(&socket).unwrap().unwrap();
        let waiting = tokio::spawn(async move { successor.next_offer().await });
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
            // Refused: the connection closes without an acknowledgement.
            let answer = fake_offer(&socket, message, fds).await;
            assert!(answer.is_empty(), "{what}: {answer:?}");
            assert!(!waiting.is_finished(), "{what} was taken");
        }
        waiting.abort();
    }

    #[tokio::test]
    async fn nobody_waiting_means_no_handover() {
        let dir = tempfile::tempdir().unwrap();
        let fd = listening_socket(dir.path());
        assert!(!offer(&dir.path().join("p.sock"), &fd, true).await.unwrap());
    }

    #[tokio::test]
    async fn a_successor_that_never_answers_gets_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("p.sock");
        let silent = UnixListener::bind(handover_path(&socket).unwrap()).unwrap();
        let fd = listening_socket(dir.path());
        let started = tokio::time::Instant::now();
        let (r, accepted) = tokio::join!(offer(&socket, &fd, true), silent.accept());
        assert!(matches!(r, Err(HandoverError::Timeout)), "{r:?}");
        assert!(started.elapsed() >= ANSWER_TIMEOUT);
        drop(accepted);
    }

    #[tokio::test]
    async fn one_successor_listens_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("p.sock");
        let first = Successor::listen(&socket).unwrap();
        assert!(first.is_some());
        assert!(Successor::listen(&socket).unwrap().is_none());
        drop(first);
        assert!(Successor::listen(&socket).unwrap().is_some());
    }
}
