//! The kubelet's CSI node client (decision C1): stage, publish, unpublish, unstage, expand and
//! volume stats, with the kubelet's rules.
//!
//! * Capability-driven: [`NodeClient::connect`] asks NodeGetCapabilities once; NodeStage and
//!   NodeUnstage are skipped without STAGE_UNSTAGE_VOLUME (and publish then gets no staging
//!   path), stats and expand are not called unless advertised ([`CallError::NotSupported`]).
//! * The kubelet's paths ([`crate::layout`]) and its 2-minute deadline ([`NODE_TIMEOUT`]).
//! * The volume capability is built from access mode, volume mode, fs type and mount flags
//!   ([`VolumeSpec::capability`]).
//! * [`NodeClient::mount`] and [`NodeClient::unmount`] run the kubelet's whole sequence,
//!   creating the directories the kubelet creates and removing them after.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use plugreg_proto::csi::v1::{
    CapacityRange, NodeExpandVolumeRequest, NodeGetVolumeStatsRequest, NodeGetVolumeStatsResponse,
    NodePublishVolumeRequest, NodeStageVolumeRequest, NodeUnpublishVolumeRequest,
    NodeUnstageVolumeRequest, VolumeCapability, node_service_capability, volume_capability,
};

use crate::client::{CallError, Connection, NODE_TIMEOUT, Retry};
use crate::layout::{KubeletLayout, LayoutError};

pub use node_service_capability::rpc::Type as NodeCapability;
pub use volume_capability::access_mode::Mode as AccessMode;

/// Why a node operation failed.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A call failed or was not made.
    #[error(transparent)]
    Call(#[from] CallError),
    /// A path could not be made from the names given.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A directory the kubelet creates or removes could not be.
    #[error("cannot {action} {path:?}")]
    Dir {
        /// `create` or `remove`.
        action: &'static str,
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl NodeError {
    /// The gRPC code of a failed call (see [`CallError::code`]).
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            NodeError::Call(c) => c.code(),
            _ => None,
        }
    }
}

/// Filesystem or raw block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeMode {
    /// A mounted filesystem.
    Filesystem {
        /// Filesystem type ("" = the driver's default).
        fs_type: String,
        /// Extra mount options.
        mount_flags: Vec<String>,
        /// Group to mount with; sent only when the driver advertises VOLUME_MOUNT_GROUP.
        mount_group: Option<String>,
    },
    /// A raw block device.
    Block,
}

impl Default for VolumeMode {
    fn default() -> Self {
        VolumeMode::Filesystem {
            fs_type: String::new(),
            mount_flags: Vec::new(),
            mount_group: None,
        }
    }
}

/// One volume as the kubelet hands it to the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeSpec {
    /// The volume handle (CSI `volume_id`).
    pub volume_id: String,
    /// Access mode.
    pub access_mode: AccessMode,
    /// Filesystem or block.
    pub mode: VolumeMode,
    /// Publish read-only.
    pub readonly: bool,
    /// `volume_context` (from CreateVolume / the PV).
    pub volume_context: BTreeMap<String, String>,
    /// `publish_context` (from ControllerPublishVolume).
    pub publish_context: BTreeMap<String, String>,
    /// Secrets for NodeStageVolume.
    pub stage_secrets: BTreeMap<String, String>,
    /// Secrets for NodePublishVolume.
    pub publish_secrets: BTreeMap<String, String>,
}

impl VolumeSpec {
    /// A filesystem volume, single-node writer, no contexts.
    pub fn new(volume_id: impl Into<String>) -> Self {
        Self {
            volume_id: volume_id.into(),
            access_mode: AccessMode::SingleNodeWriter,
            mode: VolumeMode::default(),
            readonly: false,
            volume_context: BTreeMap::new(),
            publish_context: BTreeMap::new(),
            stage_secrets: BTreeMap::new(),
            publish_secrets: BTreeMap::new(),
        }
    }

    /// The CSI volume capability; `mount_group` only when the driver honours it.
    pub fn capability(&self, with_mount_group: bool) -> VolumeCapability {
        let access_type = match &self.mode {
            VolumeMode::Block => {
                volume_capability::AccessType::Block(volume_capability::BlockVolume {})
            }
            VolumeMode::Filesystem {
                fs_type,
                mount_flags,
                mount_group,
            } => volume_capability::AccessType::Mount(volume_capability::MountVolume {
                fs_type: fs_type.clone(),
                mount_flags: mount_flags.clone(),
                volume_mount_group: mount_group
                    .clone()
                    .filter(|_| with_mount_group)
                    .unwrap_or_default(),
            }),
        };
        VolumeCapability {
            access_type: Some(access_type),
            access_mode: Some(volume_capability::AccessMode {
                mode: self.access_mode as i32,
            }),
        }
    }

    /// Whether this is a block volume.
    pub fn is_block(&self) -> bool {
        self.mode == VolumeMode::Block
    }
}

fn map(m: &BTreeMap<String, String>) -> HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// The node capabilities a driver advertised.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeCapabilities {
    /// Every capability listed, known or not (as numbers for unknown ones).
    pub listed: Vec<i32>,
}

impl NodeCapabilities {
    /// Whether `c` is listed.
    pub fn has(&self, c: NodeCapability) -> bool {
        self.listed.contains(&(c as i32))
    }

    /// The names of the listed capabilities (`RPC_<n>` for unknown ones).
    pub fn names(&self) -> Vec<String> {
        self.listed
            .iter()
            .map(|&n| {
                NodeCapability::try_from(n)
                    .map_or_else(|_| format!("RPC_{n}"), |c| c.as_str_name().to_owned())
            })
            .collect()
    }
}

/// Where a volume is staged (if the driver stages) and published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumePaths {
    /// The staging path; `None` when the driver has no STAGE_UNSTAGE_VOLUME.
    pub staging: Option<PathBuf>,
    /// The publish target.
    pub target: PathBuf,
}

/// Whether a capability-dependent step ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The call was made and succeeded.
    Done,
    /// Not called: the driver does not advertise the capability.
    Skipped,
}

/// The kubelet's CSI node client for one driver.
#[derive(Debug, Clone)]
pub struct NodeClient {
    conn: Connection,
    caps: NodeCapabilities,
}

impl NodeClient {
    /// Dials `endpoint` within `dial_timeout` and asks NodeGetCapabilities. Every later call
    /// gets `call_timeout` (use [`NODE_TIMEOUT`] for the kubelet's) and `retry`.
    pub async fn connect(
        endpoint: &str,
        dial_timeout: Duration,
        call_timeout: Duration,
        retry: Retry,
    ) -> Result<Self, NodeError> {
        let conn = Connection::connect(endpoint, dial_timeout, call_timeout, retry).await?;
        Self::from_connection(conn).await
    }

    /// A client on an existing connection (asks NodeGetCapabilities).
    pub async fn from_connection(conn: Connection) -> Result<Self, NodeError> {
        let r = conn.node_get_capabilities().await?;
        let listed = r
            .capabilities
            .iter()
            .filter_map(|c| {
                c.r#type
                    .as_ref()
                    .map(|node_service_capability::Type::Rpc(rpc)| rpc.r#type)
            })
            .collect();
        Ok(Self {
            conn,
            caps: NodeCapabilities { listed },
        })
    }

    /// The kubelet's timeout for node calls, for [`connect`](Self::connect).
    pub const TIMEOUT: Duration = NODE_TIMEOUT;

    /// The capabilities the driver advertised.
    pub fn capabilities(&self) -> &NodeCapabilities {
        &self.caps
    }

    /// The connection.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// Whether the driver stages volumes.
    pub fn stages(&self) -> bool {
        self.caps.has(NodeCapability::StageUnstageVolume)
    }

    /// The kubelet's paths for `spec` of `driver` in pod `pod_uid`, under `layout`. The
    /// staging path is `None` when the driver does not stage.
    pub fn paths(
        &self,
        layout: &KubeletLayout,
        driver: &str,
        spec: &VolumeSpec,
        pod_uid: &str,
        volume_name: &str,
    ) -> Result<VolumePaths, NodeError> {
        let (staging, target) = if spec.is_block() {
            (
                layout.block_staging_path(volume_name)?,
                layout.block_publish_path(volume_name, pod_uid)?,
            )
        } else {
            (
                layout.staging_path(driver, &spec.volume_id)?,
                layout.publish_path(pod_uid, volume_name)?,
            )
        };
        Ok(VolumePaths {
            staging: self.stages().then_some(staging),
            target,
        })
    }

    fn capability(&self, spec: &VolumeSpec) -> VolumeCapability {
        spec.capability(self.caps.has(NodeCapability::VolumeMountGroup))
    }

    /// NodeStageVolume at `staging_path` (which must exist, as the kubelet creates it); skipped
    /// without STAGE_UNSTAGE_VOLUME.
    pub async fn stage(&self, spec: &VolumeSpec, staging_path: &Path) -> Result<Step, NodeError> {
        if !self.stages() {
            return Ok(Step::Skipped);
        }
        let msg = NodeStageVolumeRequest {
            volume_id: spec.volume_id.clone(),
            publish_context: map(&spec.publish_context),
            staging_target_path: path_string(staging_path),
            volume_capability: Some(self.capability(spec)),
            secrets: map(&spec.stage_secrets),
            volume_context: map(&spec.volume_context),
        };
        let node = self.conn.node();
        self.conn
            .call("NodeStageVolume", &msg, |r| {
                let mut n = node.clone();
                async move { n.node_stage_volume(r).await }
            })
            .await?;
        Ok(Step::Done)
    }

    /// NodeUnstageVolume; skipped without STAGE_UNSTAGE_VOLUME.
    pub async fn unstage(&self, volume_id: &str, staging_path: &Path) -> Result<Step, NodeError> {
        if !self.stages() {
            return Ok(Step::Skipped);
        }
        let msg = NodeUnstageVolumeRequest {
            volume_id: volume_id.to_owned(),
            staging_target_path: path_string(staging_path),
        };
        let node = self.conn.node();
        self.conn
            .call("NodeUnstageVolume", &msg, |r| {
                let mut n = node.clone();
                async move { n.node_unstage_volume(r).await }
            })
            .await?;
        Ok(Step::Done)
    }

    /// NodePublishVolume at `target` (its parent must exist); `staging_path` is sent only when
    /// the driver stages.
    pub async fn publish(
        &self,
        spec: &VolumeSpec,
        staging_path: Option<&Path>,
        target: &Path,
    ) -> Result<(), NodeError> {
        let msg = NodePublishVolumeRequest {
            volume_id: spec.volume_id.clone(),
            publish_context: map(&spec.publish_context),
            staging_target_path: staging_path
                .filter(|_| self.stages())
                .map(path_string)
                .unwrap_or_default(),
            target_path: path_string(target),
            volume_capability: Some(self.capability(spec)),
            readonly: spec.readonly,
            secrets: map(&spec.publish_secrets),
            volume_context: map(&spec.volume_context),
        };
        let node = self.conn.node();
        self.conn
            .call("NodePublishVolume", &msg, |r| {
                let mut n = node.clone();
                async move { n.node_publish_volume(r).await }
            })
            .await?;
        Ok(())
    }

    /// NodeUnpublishVolume.
    pub async fn unpublish(&self, volume_id: &str, target: &Path) -> Result<(), NodeError> {
        let msg = NodeUnpublishVolumeRequest {
            volume_id: volume_id.to_owned(),
            target_path: path_string(target),
        };
        let node = self.conn.node();
        self.conn
            .call("NodeUnpublishVolume", &msg, |r| {
                let mut n = node.clone();
                async move { n.node_unpublish_volume(r).await }
            })
            .await?;
        Ok(())
    }

    /// NodeGetVolumeStats for the volume at `volume_path`; only with GET_VOLUME_STATS.
    pub async fn stats(
        &self,
        volume_id: &str,
        volume_path: &Path,
        staging_path: Option<&Path>,
    ) -> Result<NodeGetVolumeStatsResponse, NodeError> {
        if !self.caps.has(NodeCapability::GetVolumeStats) {
            return Err(CallError::NotSupported {
                method: "NodeGetVolumeStats",
                capability: "GET_VOLUME_STATS",
            }
            .into());
        }
        let msg = NodeGetVolumeStatsRequest {
            volume_id: volume_id.to_owned(),
            volume_path: path_string(volume_path),
            staging_target_path: staging_path.map(path_string).unwrap_or_default(),
        };
        let node = self.conn.node();
        Ok(self
            .conn
            .call("NodeGetVolumeStats", &msg, |r| {
                let mut n = node.clone();
                async move { n.node_get_volume_stats(r).await }
            })
            .await?)
    }

    /// NodeExpandVolume to `required_bytes` (0: the driver decides); only with EXPAND_VOLUME.
    /// Returns the size the driver reports (0: not reported).
    pub async fn expand(
        &self,
        spec: &VolumeSpec,
        volume_path: &Path,
        staging_path: Option<&Path>,
        required_bytes: i64,
    ) -> Result<i64, NodeError> {
        if !self.caps.has(NodeCapability::ExpandVolume) {
            return Err(CallError::NotSupported {
                method: "NodeExpandVolume",
                capability: "EXPAND_VOLUME",
            }
            .into());
        }
        let msg = NodeExpandVolumeRequest {
            volume_id: spec.volume_id.clone(),
            volume_path: path_string(volume_path),
            capacity_range: (required_bytes > 0).then_some(CapacityRange {
                required_bytes,
                limit_bytes: 0,
            }),
            staging_target_path: staging_path
                .filter(|_| self.stages())
                .map(path_string)
                .unwrap_or_default(),
            volume_capability: Some(self.capability(spec)),
            secrets: HashMap::new(),
        };
        let node = self.conn.node();
        let r = self
            .conn
            .call("NodeExpandVolume", &msg, |r| {
                let mut n = node.clone();
                async move { n.node_expand_volume(r).await }
            })
            .await?;
        Ok(r.capacity_bytes)
    }

    /// The kubelet's mount sequence: create the staging directory and stage (when the driver
    /// stages), create the target's parent, publish.
    pub async fn mount(&self, spec: &VolumeSpec, paths: &VolumePaths) -> Result<(), NodeError> {
        if let Some(staging) = &paths.staging {
            create_dir_all(staging)?;
            self.stage(spec, staging).await?;
        }
        if let Some(parent) = paths.target.parent() {
            create_dir_all(parent)?;
        }
        self.publish(spec, paths.staging.as_deref(), &paths.target)
            .await
    }

    /// The kubelet's unmount sequence: unpublish, remove what is left of the target
    /// directories, unstage (when the driver stages), remove the staging directories. Only
    /// empty directories are removed, never anything still mounted or holding data.
    pub async fn unmount(&self, volume_id: &str, paths: &VolumePaths) -> Result<(), NodeError> {
        self.unpublish(volume_id, &paths.target).await?;
        remove_empty(&paths.target)?;
        if let Some(parent) = paths.target.parent() {
            remove_empty(parent)?;
        }
        if let Some(staging) = &paths.staging {
            self.unstage(volume_id, staging).await?;
            remove_empty(staging)?;
            if let Some(parent) = staging.parent() {
                remove_empty(parent)?;
            }
        }
        Ok(())
    }
}

fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn create_dir_all(p: &Path) -> Result<(), NodeError> {
    std::fs::create_dir_all(p).map_err(|source| NodeError::Dir {
        action: "create",
        path: p.to_owned(),
        source,
    })
}

/// Removes `p` if it is an empty directory; a missing, non-empty or busy one is left alone.
fn remove_empty(p: &Path) -> Result<(), NodeError> {
    use std::io::ErrorKind;
    match std::fs::remove_dir(p) {
        Ok(()) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::NotFound | ErrorKind::DirectoryNotEmpty | ErrorKind::ResourceBusy
            ) =>
        {
            Ok(())
        }
        Err(source) => Err(NodeError::Dir {
            action: "remove",
            path: p.to_owned(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_from_the_spec() {
        let mut s = VolumeSpec::new("v");
        s.mode = VolumeMode::Filesystem {
            fs_type: "ext4".into(),
            mount_flags: vec!["noatime".into()],
            mount_group: Some("1000".into()),
        };
        s.access_mode = AccessMode::MultiNodeReaderOnly;
        let c = s.capability(false);
        assert_eq!(
            c.access_mode.unwrap().mode,
            AccessMode::MultiNodeReaderOnly as i32
        );
        let Some(volume_capability::AccessType::Mount(m)) = c.access_type else {
            panic!("{c:?}")
        };
        assert_eq!(m.fs_type, "ext4");
        assert_eq!(m.mount_flags, ["noatime"]);
        assert_eq!(m.volume_mount_group, "", "only with VOLUME_MOUNT_GROUP");
        let Some(volume_capability::AccessType::Mount(m)) = s.capability(true).access_type else {
            panic!()
        };
        assert_eq!(m.volume_mount_group, "1000");
        s.mode = VolumeMode::Block;
        assert!(matches!(
            s.capability(true).access_type,
            Some(volume_capability::AccessType::Block(_))
        ));
    }
}
