//! A plugin socket that behaves like Go's and C's: bound first, listening only later.
//!
//! Go's `net.Listen("unix", path)` calls `bind()` and then `listen()`; between the two the path
//! exists (inotify reports IN_CREATE) but `connect()` is refused. plugreg's own registrar binds
//! under a hidden name and renames a listening socket into place, so it never shows that window.
//! Tests and benchmarks use [`bind_only`] to reproduce the window on purpose, as wide as they like.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

/// A Unix stream socket bound at a path but not listening yet.
#[derive(Debug)]
pub struct BoundNotListening {
    fd: OwnedFd,
    path: PathBuf,
}

/// Creates a socket at `path` with `bind()` alone, as Go does first. Connecting to it is refused
/// until [`BoundNotListening::listen`].
pub fn bind_only(path: &Path) -> io::Result<BoundNotListening> {
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    let addr = SocketAddrUnix::new(path)?;
    rustix::net::bind(&fd, &addr)?;
    Ok(BoundNotListening {
        fd,
        path: path.to_path_buf(),
    })
}

impl BoundNotListening {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Starts listening (backlog 128, as tests need no more) and hands the socket to tokio. Must
    /// be called inside a tokio runtime.
    pub fn listen(self) -> io::Result<tokio::net::UnixListener> {
        rustix::net::listen(&self.fd, 128)?;
        tokio::net::UnixListener::from_std(std::os::unix::net::UnixListener::from(self.fd))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn connect_is_refused_until_listen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("go.sock");
        let bound = bind_only(&path).unwrap();
        assert!(path.exists());
        let err = tokio::net::UnixStream::connect(&path).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
        let listener = bound.listen().unwrap();
        let (client, accepted) =
            tokio::join!(tokio::net::UnixStream::connect(&path), listener.accept());
        client.unwrap();
        accepted.unwrap();
    }
}
