//! Errors of this crate.

use std::path::PathBuf;
use std::time::Duration;

/// A peer binary that `interop/build-peers.sh` has not built (yet).
///
/// Its `Debug` output is its message, so `.expect()` / `.unwrap()` in a test
/// show the instruction to run the script.
#[derive(Clone, thiserror::Error)]
#[error(
    "test peer `{name}` is not built (looked for {}): run `interop/build-peers.sh` \
     (it builds every peer into ${{PLUGREG_PEERS_DIR:-$HOME/.cache/plugreg-peers}}; {reason})",
    path.display()
)]
pub struct MissingPeer {
    /// The peer's name, e.g. `kube-apiserver`.
    pub name: String,
    /// Where the binary was expected.
    pub path: PathBuf,
    /// What exactly is missing.
    pub reason: String,
}

/// Everything that can go wrong while running peers.
///
/// Its `Debug` output is its (multi-line) message, so a failing `.expect()`
/// in a test shows what a peer printed.
#[derive(thiserror::Error)]
pub enum Error {
    /// A peer is not built.
    #[error(transparent)]
    MissingPeer(#[from] MissingPeer),
    /// An I/O operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A helper command (e.g. `openssl`) failed.
    #[error("command `{command}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status.
        status: String,
        /// The end of its stderr.
        stderr: String,
    },
    /// No line matching the expectation arrived in time, or the peer's
    /// stdout closed first.
    #[error("peer `{peer}`: {what} ({reason}); {details}")]
    NoMatch {
        /// The peer's label.
        peer: String,
        /// What was waited for.
        what: String,
        /// `timed out after ...` or `stdout closed`.
        reason: String,
        /// Every stdout line seen so far, and the end of the peer's stderr.
        details: String,
    },
    /// A peer printed a line of the expected event whose fields are not what its release
    /// prints.
    #[error("peer `{peer}`: unexpected line: {reason}")]
    BadLine {
        /// The peer's label.
        peer: String,
        /// What is wrong, with the line.
        reason: String,
    },
    /// The requested combination of peers is not available (e.g. a component not built for
    /// that release).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A server peer did not become ready in time, or exited.
    #[error("{peer} did not become ready: {reason}\n--- {peer} log tail ---\n{log}")]
    NotReady {
        /// The peer's name.
        peer: String,
        /// Why.
        reason: String,
        /// The end of its log.
        log: String,
    },
    /// A peer did not exit in time after being asked to.
    #[error(
        "peer `{peer}` still running {waited:?} after being asked to exit; stderr tail:\n{stderr}"
    )]
    StillRunning {
        /// The peer's label.
        peer: String,
        /// How long it was waited for.
        waited: Duration,
        /// The end of the peer's stderr.
        stderr: String,
    },
    /// A Kubernetes client error.
    #[error("kube client: {0}")]
    Kube(#[from] kube::Error),
    /// Loading the generated kubeconfig failed.
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

impl std::fmt::Debug for MissingPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}
