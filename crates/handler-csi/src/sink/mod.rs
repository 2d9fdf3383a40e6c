//! Where a registered driver's node information goes: the Kubernetes API (`KubeSink`: Node
//! annotation and labels, CSINode entry; with the `kube` feature) or a local JSON file
//! ([`FileSink`], for use without a cluster).
//!
//! A sink's `publish` either writes everything or leaves what was there before: the handler
//! relies on that to leave nothing half-written when a registration fails.

mod file;
#[cfg(feature = "kube")]
mod kube_api;

use std::fmt::Debug;
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;

use crate::nodeinfo::DriverNodeInfo;

pub use self::file::{FileCsiNode, FileNode, FileSink, FileSinkError, NodeInfoFile};
#[cfg(feature = "kube")]
pub use self::kube_api::{CONNECT_TIMEOUT, KubeSink, KubeSinkError, REQUEST_TIMEOUT, WriteError};

/// Publishes and withdraws drivers' node information.
#[async_trait]
pub trait NodeInfoSink: Send + Sync + Debug + 'static {
    /// Publishes `driver`'s information (replacing what the same driver published before).
    /// On error nothing of this call stays written.
    async fn publish(&self, driver: &DriverNodeInfo) -> Result<(), SinkError>;

    /// Withdraws `driver_name`'s node id and CSINode entry; topology labels stay. Withdrawing a
    /// driver that is not published is not an error.
    async fn remove(&self, driver_name: &str) -> Result<(), SinkError>;
}

/// Why a sink failed.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The Kubernetes API sink failed.
    #[cfg(feature = "kube")]
    #[error(transparent)]
    Kube(#[from] KubeSinkError),
    /// The file sink failed.
    #[error(transparent)]
    File(#[from] FileSinkError),
}

/// Which sink to build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkConfig {
    /// The Kubernetes API.
    #[cfg(feature = "kube")]
    Kube {
        /// Kubeconfig file; `None`: the in-cluster service account (or `$KUBECONFIG` /
        /// `~/.kube/config`, as `kube::Config::infer` finds them).
        kubeconfig: Option<PathBuf>,
        /// This node's name: the Node to annotate and label, and the CSINode's name.
        node_name: String,
    },
    /// A JSON file, replaced atomically on every change.
    File(PathBuf),
}

/// Builds the sink `cfg` describes.
pub async fn build_sink(cfg: &SinkConfig) -> Result<Arc<dyn NodeInfoSink>, SinkError> {
    Ok(match cfg {
        #[cfg(feature = "kube")]
        SinkConfig::Kube {
            kubeconfig,
            node_name,
        } => Arc::new(KubeSink::from_config(kubeconfig.as_deref(), node_name).await?),
        SinkConfig::File(path) => Arc::new(FileSink::new(path.clone())),
    })
}
