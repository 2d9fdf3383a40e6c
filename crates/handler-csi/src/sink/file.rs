//! [`FileSink`]: node information in a local JSON file, for use without a cluster.
//!
//! The file mirrors the two Kubernetes objects the `KubeSink` writes, so an operator reads it
//! the same way:
//!
//! ```json
//! {
//!   "node": {
//!     "annotations": { "csi.volume.kubernetes.io/nodeid": "{\"hostpath.csi.k8s.io\":\"node-1\"}" },
//!     "labels": { "topology.hostpath.csi/node": "node-1" }
//!   },
//!   "csinode": {
//!     "drivers": [
//!       { "name": "hostpath.csi.k8s.io", "nodeID": "node-1",
//!         "topologyKeys": ["topology.hostpath.csi/node"], "allocatable": { "count": 10 } }
//!     ]
//!   }
//! }
//! ```
//!
//! Every change reads the file, applies the same merge rules as the API sink (including the
//! topology collision check) and replaces the file atomically: a temporary file in the same
//! directory is written, flushed to disk and renamed over the old one, so a reader never sees a
//! half-written file and a crash leaves either the old or the new content.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use k8s_openapi::api::storage::v1::CSINodeDriver;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;

use super::{NodeInfoSink, SinkError};
use crate::nodeinfo::{self, DriverNodeInfo, MergeError};

/// The file's content.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeInfoFile {
    /// What the Node object would carry.
    #[serde(default)]
    pub node: FileNode,
    /// What the CSINode object would carry.
    #[serde(default)]
    pub csinode: FileCsiNode,
}

impl NodeInfoFile {
    /// Applies a planned Node change and, when given, a new CSINode driver list; returns
    /// whether anything changed.
    fn apply(&mut self, patch: &nodeinfo::MetaPatch, drivers: Option<Vec<CSINodeDriver>>) -> bool {
        patch.apply(&mut self.node.annotations, &mut self.node.labels);
        let changed = !patch.is_empty() || drivers.is_some();
        if let Some(d) = drivers {
            self.csinode.drivers = d;
        }
        changed
    }
}

/// The Node part of [`NodeInfoFile`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileNode {
    /// Annotations (only `csi.volume.kubernetes.io/nodeid` is written).
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// Topology labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// The CSINode part of [`NodeInfoFile`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileCsiNode {
    /// One entry per driver, as `CSINode.spec.drivers`.
    #[serde(default)]
    pub drivers: Vec<CSINodeDriver>,
}

/// Why the file sink failed.
#[derive(Debug, thiserror::Error)]
pub enum FileSinkError {
    /// The file could not be read.
    #[error("failed to read node info file {path:?}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The file is not in the expected shape; it is left untouched.
    #[error("failed to parse node info file {path:?}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The merge rules refused the change (e.g. a topology collision).
    #[error("error updating node info file {path:?} with CSI driver node info")]
    Merge {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: MergeError,
    },
    /// The new content could not be encoded.
    #[error("failed to encode node info for {path:?}")]
    Encode {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The new file could not be written or moved into place.
    #[error("failed to write node info file {path:?}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Node information in a JSON file (see the module docs for the shape).
#[derive(Debug)]
pub struct FileSink {
    path: PathBuf,
    // One read-modify-write at a time.
    lock: tokio::sync::Mutex<()>,
}

impl FileSink {
    /// A sink writing `path` (created on first publish, with its parent directories).
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            lock: tokio::sync::Mutex::new(()),
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the file; a missing file is empty content.
    pub async fn read(&self) -> Result<NodeInfoFile, FileSinkError> {
        match tokio::fs::read(&self.path).await {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|source| FileSinkError::Parse {
                path: self.path.clone(),
                source,
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(NodeInfoFile::default()),
            Err(source) => Err(FileSinkError::Read {
                path: self.path.clone(),
                source,
            }),
        }
    }

    async fn update(
        &self,
        change: impl FnOnce(&mut NodeInfoFile) -> Result<bool, MergeError>,
    ) -> Result<(), FileSinkError> {
        let _guard = self.lock.lock().await;
        let mut content = self.read().await?;
        let changed = change(&mut content).map_err(|source| FileSinkError::Merge {
            path: self.path.clone(),
            source,
        })?;
        if !changed {
            return Ok(());
        }
        let mut bytes =
            serde_json::to_vec_pretty(&content).map_err(|source| FileSinkError::Encode {
                path: self.path.clone(),
                source,
            })?;
        bytes.push(b'\n');
        write_atomically(&self.path, &bytes)
            .await
            .map_err(|source| FileSinkError::Write {
                path: self.path.clone(),
                source,
            })
    }
}

#[async_trait]
impl NodeInfoSink for FileSink {
    async fn publish(&self, driver: &DriverNodeInfo) -> Result<(), SinkError> {
        self.update(|f| {
            let (patch, _) = nodeinfo::plan_publish(&f.node.annotations, &f.node.labels, driver)?;
            let drivers =
                nodeinfo::upsert_driver(&f.csinode.drivers, nodeinfo::csinode_driver(driver));
            Ok(f.apply(&patch, drivers))
        })
        .await?;
        Ok(())
    }

    async fn remove(&self, driver_name: &str) -> Result<(), SinkError> {
        self.update(|f| {
            let patch = nodeinfo::plan_remove(&f.node.annotations, driver_name)?;
            let drivers = nodeinfo::remove_driver(&f.csinode.drivers, driver_name);
            Ok(f.apply(&patch, drivers))
        })
        .await?;
        Ok(())
    }
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Replaces `path` with `bytes`: write a temporary file beside it, fsync, rename over `path`,
/// fsync the directory.
pub(crate) async fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    tokio::fs::create_dir_all(dir).await?;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path has no file name"))?;
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let temp = dir.join(format!(
        ".{}.{}-{n}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = async {
        let mut f = tokio::fs::File::create(&temp).await?;
        f.write_all(bytes).await?;
        f.sync_all().await?;
        drop(f);
        tokio::fs::rename(&temp, path).await
    }
    .await;
    if let Err(e) = written {
        let _ = tokio::fs::remove_file(&temp).await;
        return Err(e);
    }
    // Make the rename itself durable; failing to is not worth failing the write for.
    if let Ok(d) = tokio::fs::File::open(dir).await
        && let Err(e) = d.sync_all().await
    {
        tracing::debug!(dir = %dir.display(), error = %e, "failed to fsync directory");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodeinfo::NODE_ID_ANNOTATION;

    fn info(driver: &str, node_id: &str, topology: &[(&str, &str)], max: i64) -> DriverNodeInfo {
        DriverNodeInfo {
            driver: driver.into(),
            node_id: node_id.into(),
            topology: topology
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
            max_volumes: max,
        }
    }

    #[tokio::test]
    async fn publish_and_remove_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/node-info.json");
        let sink = FileSink::new(path.clone());

        sink.publish(&info("a.example.com", "na", &[("zone", "z1")], 5))
            .await
            .unwrap();
        sink.publish(&info("b.example.com", "nb", &[], 0))
            .await
            .unwrap();
        let raw: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            raw,
            serde_json::json!({
                "node": {
                    "annotations": {NODE_ID_ANNOTATION: r#"{"a.example.com":"na","b.example.com":"nb"}"#},
                    "labels": {"zone": "z1"},
                },
                "csinode": {"drivers": [
                    {"name": "a.example.com", "nodeID": "na", "topologyKeys": ["zone"], "allocatable": {"count": 5}},
                    {"name": "b.example.com", "nodeID": "nb"},
                ]},
            })
        );

        sink.remove("a.example.com").await.unwrap();
        let f = sink.read().await.unwrap();
        assert_eq!(
            f.node
                .annotations
                .get(NODE_ID_ANNOTATION)
                .map(String::as_str),
            Some(r#"{"b.example.com":"nb"}"#)
        );
        assert_eq!(f.node.labels.get("zone").map(String::as_str), Some("z1"));
        assert_eq!(f.csinode.drivers.len(), 1);
        sink.remove("b.example.com").await.unwrap();
        let f = sink.read().await.unwrap();
        assert!(
            f.node.annotations.is_empty(),
            "annotation dropped when empty"
        );
        assert!(f.csinode.drivers.is_empty());
        // Removing what is not there is fine.
        sink.remove("b.example.com").await.unwrap();
    }

    #[tokio::test]
    async fn collision_leaves_the_file_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node-info.json");
        let sink = FileSink::new(path.clone());
        sink.publish(&info("a", "na", &[("zone", "z1")], 0))
            .await
            .unwrap();
        let before = std::fs::read(&path).unwrap();
        let err = sink
            .publish(&info("b", "nb", &[("zone", "z2")], 0))
            .await
            .unwrap_err();
        assert!(
            crate::report::chain(&err).contains(
                r#"detected topology value collision: driver reported "zone":"z2" but existing label is "zone":"z1""#
            ),
            "{err}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), before);
    }

    #[tokio::test]
    async fn unparsable_file_is_an_error_and_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node-info.json");
        std::fs::write(&path, b"{ not json").unwrap();
        let sink = FileSink::new(path.clone());
        let err = sink.publish(&info("a", "na", &[], 0)).await.unwrap_err();
        assert!(matches!(err, SinkError::File(FileSinkError::Parse { .. })));
        assert_eq!(std::fs::read(&path).unwrap(), b"{ not json");
    }

    #[tokio::test]
    async fn atomic_replace_leaves_no_temporary_files_and_replaces_the_inode() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.json");
        write_atomically(&path, b"one").await.unwrap();
        let ino1 = std::fs::metadata(&path).unwrap().ino();
        // A reader holding the old file keeps reading the old content.
        let old = std::fs::File::open(&path).unwrap();
        write_atomically(&path, b"two").await.unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_ne!(
            std::fs::metadata(&path).unwrap().ino(),
            ino1,
            "renamed, not rewritten"
        );
        let mut s = String::new();
        std::io::Read::read_to_string(&mut &old, &mut s).unwrap();
        assert_eq!(s, "one");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f.json")]);
    }

    #[tokio::test]
    async fn failed_write_leaves_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.json");
        write_atomically(&path, b"one").await.unwrap();
        // The parent of `bad` is a file, so the temporary file cannot be created.
        let bad = path.join("child.json");
        assert!(write_atomically(&bad, b"x").await.is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
    }
}
