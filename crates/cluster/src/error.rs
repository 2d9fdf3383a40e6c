//! Errors of this crate.

use std::path::PathBuf;

/// Everything that can go wrong while bringing a cluster up, using it or tearing it down.
///
/// Its `Debug` output is its (multi-line) message, so a failing `.expect()` in a test shows
/// what went wrong and, where a process was involved, the end of its log.
#[derive(thiserror::Error)]
pub enum Error {
    /// The host lacks something the cluster needs (root, a command, a kernel feature); the
    /// message names it and the command that installs it.
    #[error("the one-node cluster cannot run here: {what}\n  fix: {fix}")]
    Missing {
        /// What is missing.
        what: String,
        /// The command or step that provides it.
        fix: String,
    },
    /// A control-plane peer failed (not built, did not start).
    #[error(transparent)]
    Peer(#[from] plugreg_testpeers::Error),
    /// An I/O operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A helper command (ctr, kubectl, an image script) failed.
    #[error("`{command}` failed ({status}):\n{output}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status.
        status: String,
        /// The end of its output.
        output: String,
    },
    /// A node process (containerd, the kubelet) exited or did not get ready.
    #[error("{process} {reason}\n--- {process} log ({log}) tail ---\n{tail}", log = log.display())]
    Node {
        /// Which process.
        process: String,
        /// What happened.
        reason: String,
        /// Its log file.
        log: PathBuf,
        /// The end of its log.
        tail: String,
    },
    /// Something did not happen within its deadline.
    #[error("timed out after {waited:?} waiting for {what}; last: {last}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        waited: std::time::Duration,
        /// The last thing seen.
        last: String,
    },
    /// A manifest could not be applied or does not make sense.
    #[error("manifest: {0}")]
    Manifest(String),
    /// A Kubernetes API call failed.
    #[error("kube API: {0}")]
    Kube(#[from] kube::Error),
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn missing(what: impl Into<String>, fix: impl Into<String>) -> Self {
        Error::Missing {
            what: what.into(),
            fix: fix.into(),
        }
    }
}

impl From<plugreg_testpeers::MissingPeer> for Error {
    fn from(e: plugreg_testpeers::MissingPeer) -> Self {
        Error::missing(e.to_string(), crate::host::PEERS_SETUP)
    }
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}
