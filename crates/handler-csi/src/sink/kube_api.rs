//! [`KubeSink`]: node information in the Kubernetes API, as the kubelet's `nodeinfomanager`
//! writes it.
//!
//! * Node: the `csi.volume.kubernetes.io/nodeid` annotation and the topology labels, written
//!   with a strategic-merge patch of `nodes/<name>/status` (the subresource the kubelet may
//!   patch) that carries `metadata.resourceVersion`, so a concurrent writer makes the patch fail
//!   with 409 Conflict instead of losing its annotation entry. Conflicts are retried on a fresh
//!   read.
//! * CSINode (named after the Node): created if missing, with an owner reference to the Node;
//!   the driver's entry replaced with a full update carrying the resourceVersion, conflicts
//!   retried; no write when nothing changed. The API server refuses to change an existing
//!   entry in place, so a changed entry is removed by one update and added by the next.
//!
//! A publish whose CSINode write fails puts back the entry it took out and undoes its Node
//! change, so nothing stays half-written. Topology labels a kubelet may not set on its Node
//! ([`crate::noderestriction`]) fail the publish before anything is written.
//! Server-side apply is deliberately not used (kube-rs's apply needs the whole managed object and field ownership the API server tracks per manager; a merge patch of the fields we own is smaller and works on every release).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::{CSINode, CSINodeDriver, CSINodeSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::config::{InferConfigError, KubeConfigOptions, Kubeconfig, KubeconfigError};
use plugreg_runtime::Backoff;

use super::{NodeInfoSink, SinkError};
use crate::nodeinfo::{self, DriverNodeInfo, MergeError, MetaPatch, PublishUndo};

/// Limit for connecting to the API server (clients built by [`KubeSink::from_config`]).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Limit for one API request's answer (clients built by [`KubeSink::from_config`]).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Writes per object before a run of 409 Conflicts is given up.
const MAX_ATTEMPTS: u32 = 5;
/// Pause after the n-th conflict in a row: 10 ms, multiplied by 5 each time, plus up to 10 %
/// jitter (upstream's `retry.DefaultBackoff`). With [`MAX_ATTEMPTS`] the waits are 10, 50, 250
/// and 1250 ms (the cap leaves room for the jitter of the last).
const CONFLICT_BACKOFF: Backoff = Backoff {
    initial: Duration::from_millis(10),
    max: Duration::from_millis(1375),
    factor: 5,
    jitter: 0.1,
};

/// Why the Kubernetes API sink failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeSinkError {
    /// The kubeconfig file could not be loaded.
    #[error("failed to load kubeconfig {path:?}")]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: KubeconfigError,
    },
    /// Neither a kubeconfig nor the in-cluster configuration was found.
    #[error("failed to find a Kubernetes client configuration (in-cluster or kubeconfig)")]
    InferConfig(#[source] InferConfigError),
    /// No node name was given.
    #[error("the node name is empty: the Node and CSINode to write are named after it")]
    NoNodeName,
    /// The client could not be built.
    #[error("failed to create the Kubernetes client")]
    Client(#[source] kube::Error),
    /// Publishing to the Node failed (nothing was written).
    #[error("error updating Node object with CSI driver node info")]
    Node(#[source] WriteError),
    /// Publishing to the CSINode failed (the Node change was undone).
    #[error("error updating CSINode object with CSI driver node info")]
    CsiNode(#[source] WriteError),
    /// Withdrawing from the Node failed.
    #[error("error removing CSI driver node info from Node object")]
    RemoveNode(#[source] WriteError),
    /// Withdrawing from the CSINode failed.
    #[error("error removing CSI driver node info from CSINode object")]
    RemoveCsiNode(#[source] WriteError),
}

/// One failed step of a read-modify-write of a Node or CSINode.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// Reading the object failed.
    #[error("failed to get {kind} {name:?}")]
    Get {
        /// `Node` or `CSINode`.
        kind: &'static str,
        /// Object name.
        name: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// The merge rules refused the change (annotation unparsable, topology collision).
    #[error(transparent)]
    Merge(#[from] MergeError),
    /// The change would set labels the kubelet may not set on its Node; worded as the API
    /// server's NodeRestriction admission refuses the kubelet's request.
    #[error("nodes {name:?} is forbidden")]
    Forbidden {
        /// Node name.
        name: String,
        /// Which labels.
        #[source]
        source: MergeError,
    },
    /// The Node has no uid to point the CSINode's owner reference at.
    #[error("Node {name:?} has no uid")]
    NoUid {
        /// Node name.
        name: String,
    },
    /// Patching the Node failed.
    #[error("failed to patch Node {name:?}")]
    Patch {
        /// Node name.
        name: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// Creating the CSINode failed.
    #[error("failed to create CSINode {name:?}")]
    Create {
        /// CSINode name.
        name: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// Updating the CSINode failed.
    #[error("failed to update CSINode {name:?}")]
    Replace {
        /// CSINode name.
        name: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// Every attempt met a concurrent change.
    #[error("{kind} {name:?} kept changing: {attempts} writes in a row conflicted")]
    Conflict {
        /// `Node` or `CSINode`.
        kind: &'static str,
        /// Object name.
        name: String,
        /// How many writes were tried.
        attempts: u32,
        /// The last conflict.
        #[source]
        source: kube::Error,
    },
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.is_conflict())
}

fn is_already_exists(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.is_already_exists())
}

/// Node information in the Kubernetes API (see the module docs).
#[derive(Clone)]
pub struct KubeSink {
    client: kube::Client,
    node_name: String,
    // One read-modify-write sequence at a time, as upstream's nodeinfomanager (its undo relies
    // on no other driver of this process writing in between).
    lock: std::sync::Arc<tokio::sync::Mutex<()>>,
}

impl std::fmt::Debug for KubeSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeSink")
            .field("node_name", &self.node_name)
            .finish_non_exhaustive()
    }
}

impl KubeSink {
    /// A sink writing the Node `node_name` and the CSINode of the same name through `client`.
    pub fn new(client: kube::Client, node_name: impl Into<String>) -> Self {
        Self {
            client,
            node_name: node_name.into(),
            lock: Default::default(),
        }
    }

    /// A sink using the kubeconfig at `kubeconfig`, or when `None` the in-cluster service
    /// account (falling back to `$KUBECONFIG` / `~/.kube/config`, as `kube::Config::infer`).
    ///
    /// Requests time out after [`REQUEST_TIMEOUT`] and connecting after [`CONNECT_TIMEOUT`]
    /// (the sink never watches, so kube's long watch-friendly read timeout is not needed), so
    /// an API server that does not answer fails a registration instead of stalling it.
    pub async fn from_config(
        kubeconfig: Option<&Path>,
        node_name: &str,
    ) -> Result<Self, KubeSinkError> {
        if node_name.is_empty() {
            return Err(KubeSinkError::NoNodeName);
        }
        let mut config = match kubeconfig {
            Some(path) => {
                let kc_err = |source| KubeSinkError::Kubeconfig {
                    path: path.to_owned(),
                    source,
                };
                let kc = Kubeconfig::read_from(path).map_err(kc_err)?;
                kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                    .await
                    .map_err(kc_err)?
            }
            None => kube::Config::infer()
                .await
                .map_err(KubeSinkError::InferConfig)?,
        };
        config.connect_timeout = Some(CONNECT_TIMEOUT);
        config.read_timeout = Some(REQUEST_TIMEOUT);
        config.write_timeout = Some(REQUEST_TIMEOUT);
        // Count the read timeout from the request, not from when a pooled connection went idle.
        config.reset_reader_on_write = true;
        let client = kube::Client::try_from(config).map_err(KubeSinkError::Client)?;
        Ok(Self::new(client, node_name))
    }

    /// The Node (and CSINode) name.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    fn csinodes(&self) -> Api<CSINode> {
        Api::all(self.client.clone())
    }

    /// Read-modify-write of the Node's metadata: `plan` gets the current annotations and labels
    /// and says what to change; the patch carries the resourceVersion read, and a conflict
    /// starts over. Returns the plan's extra result of the attempt that was written (or found
    /// nothing to do) and the Node's uid.
    async fn update_node<R>(
        &self,
        mut plan: impl FnMut(
            &BTreeMap<String, String>,
            &BTreeMap<String, String>,
        ) -> Result<(MetaPatch, R), MergeError>,
    ) -> Result<(R, Option<String>), WriteError> {
        let name = &self.node_name;
        let nodes = self.nodes();
        let empty = BTreeMap::new();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let node = nodes.get(name).await.map_err(|source| WriteError::Get {
                kind: "Node",
                name: name.clone(),
                source,
            })?;
            let meta = &node.metadata;
            let (patch, extra) = plan(
                meta.annotations.as_ref().unwrap_or(&empty),
                meta.labels.as_ref().unwrap_or(&empty),
            )
            .map_err(|e| match e {
                e @ MergeError::ForbiddenLabels { .. } => WriteError::Forbidden {
                    name: name.clone(),
                    source: e,
                },
                e => WriteError::Merge(e),
            })?;
            let uid = meta.uid.clone();
            if patch.is_empty() {
                return Ok((extra, uid));
            }
            let body = patch.to_patch(meta.resource_version.as_deref());
            match nodes
                .patch_status(name, &PatchParams::default(), &Patch::Strategic(body))
                .await
            {
                Ok(_) => return Ok((extra, uid)),
                Err(e) if is_conflict(&e) && attempt < MAX_ATTEMPTS => {
                    tracing::debug!(node = %name, attempt, "Node changed meanwhile; retrying");
                    CONFLICT_BACKOFF.sleep(attempt).await;
                }
                Err(source) if is_conflict(&source) => {
                    return Err(WriteError::Conflict {
                        kind: "Node",
                        name: name.clone(),
                        attempts: attempt,
                        source,
                    });
                }
                Err(source) => {
                    return Err(WriteError::Patch {
                        name: name.clone(),
                        source,
                    });
                }
            }
        }
    }

    /// Read-modify-write of the CSINode's driver list: `change` gets the current list and
    /// returns the new one (`None`: nothing to write). A missing CSINode is created (owned by the
    /// Node with `node_uid`) when there is something to write and `node_uid` is known.
    async fn update_csinode(
        &self,
        node_uid: Option<&str>,
        mut change: impl FnMut(&[CSINodeDriver]) -> Option<Vec<CSINodeDriver>>,
    ) -> Result<(), WriteError> {
        let name = &self.node_name;
        let api = self.csinodes();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let current = api.get_opt(name).await.map_err(|source| WriteError::Get {
                kind: "CSINode",
                name: name.clone(),
                source,
            })?;
            let result = match current {
                None => {
                    let Some(drivers) = change(&[]) else {
                        return Ok(());
                    };
                    let uid = node_uid.ok_or_else(|| WriteError::NoUid { name: name.clone() })?;
                    let csinode = new_csinode(name, uid, drivers);
                    match api.create(&PostParams::default(), &csinode).await {
                        Ok(_) => return Ok(()),
                        // Someone else created it meanwhile: update theirs.
                        Err(e) if is_already_exists(&e) && attempt < MAX_ATTEMPTS => continue,
                        Err(source) => Err(WriteError::Create {
                            name: name.clone(),
                            source,
                        }),
                    }
                }
                Some(mut csinode) => {
                    let Some(drivers) = change(&csinode.spec.drivers) else {
                        return Ok(());
                    };
                    csinode.spec.drivers = drivers;
                    match api.replace(name, &PostParams::default(), &csinode).await {
                        Ok(_) => return Ok(()),
                        Err(source) => Err(WriteError::Replace {
                            name: name.clone(),
                            source,
                        }),
                    }
                }
            };
            match result {
                Err(WriteError::Replace { source, .. }) if is_conflict(&source) => {
                    if attempt >= MAX_ATTEMPTS {
                        return Err(WriteError::Conflict {
                            kind: "CSINode",
                            name: name.clone(),
                            attempts: attempt,
                            source,
                        });
                    }
                    tracing::debug!(csinode = %name, attempt, "CSINode changed meanwhile; retrying");
                    CONFLICT_BACKOFF.sleep(attempt).await;
                }
                other => return other,
            }
        }
    }

    /// Puts back a driver entry a failed publish took out (unless someone added one since).
    async fn restore_csinode_entry(&self, node_uid: Option<&str>, old: CSINodeDriver) {
        let result = self
            .update_csinode(node_uid, |drivers| {
                if drivers.iter().any(|d| d.name == old.name) {
                    None
                } else {
                    nodeinfo::upsert_driver(drivers, old.clone())
                }
            })
            .await;
        if let Err(e) = result {
            tracing::error!(
                csinode = %self.node_name,
                driver = %old.name,
                error = %crate::report::chain(&e),
                "failed to restore the previous CSINode driver entry after a failed publish"
            );
        }
    }

    async fn undo_node(&self, driver: &str, undo: &PublishUndo) {
        let result = self
            .update_node(|a, l| Ok((nodeinfo::plan_undo(a, l, driver, undo)?, ())))
            .await;
        if let Err(e) = result {
            tracing::error!(
                node = %self.node_name,
                driver,
                error = %crate::report::chain(&e),
                "failed to undo the Node change after the CSINode write failed"
            );
        }
    }
}

/// A CSINode named after the Node, owned by it, holding `drivers`.
fn new_csinode(name: &str, node_uid: &str, drivers: Vec<CSINodeDriver>) -> CSINode {
    CSINode {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".to_owned(),
                kind: "Node".to_owned(),
                name: name.to_owned(),
                uid: node_uid.to_owned(),
                ..Default::default()
            }]),
            ..Default::default()
        },
        spec: CSINodeSpec { drivers },
    }
}

#[async_trait]
impl NodeInfoSink for KubeSink {
    async fn publish(&self, driver: &DriverNodeInfo) -> Result<(), SinkError> {
        let _guard = self.lock.lock().await;
        let (undo, uid) = self
            .update_node(|a, l| nodeinfo::plan_publish(a, l, driver))
            .await
            .map_err(KubeSinkError::Node)?;
        let uid = uid.as_deref();
        let entry = nodeinfo::csinode_driver(driver);
        // The API server treats an existing driver entry as immutable: a different one is taken
        // out first and the new one added by a second write.
        let mut replaced = None;
        let mut written = self
            .update_csinode(uid, |drivers| {
                replaced = nodeinfo::differing_entry(drivers, &entry).cloned();
                replaced
                    .as_ref()
                    .and_then(|_| nodeinfo::remove_driver(drivers, &entry.name))
            })
            .await;
        if written.is_ok() {
            written = self
                .update_csinode(uid, |drivers| {
                    nodeinfo::upsert_driver(drivers, entry.clone())
                })
                .await;
        }
        if let Err(e) = written {
            if let Some(old) = replaced {
                self.restore_csinode_entry(uid, old).await;
            }
            self.undo_node(&driver.driver, &undo).await;
            return Err(KubeSinkError::CsiNode(e).into());
        }
        Ok(())
    }

    async fn remove(&self, driver_name: &str) -> Result<(), SinkError> {
        let _guard = self.lock.lock().await;
        // CSINode first, then the Node, as upstream; both are tried.
        let csinode = self
            .update_csinode(None, |drivers| {
                nodeinfo::remove_driver(drivers, driver_name)
            })
            .await
            .map_err(KubeSinkError::RemoveCsiNode);
        let node = self
            .update_node(|a, _| Ok((nodeinfo::plan_remove(a, driver_name)?, ())))
            .await
            .map_err(KubeSinkError::RemoveNode);
        csinode?;
        node?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_back_off_10ms_times_5_with_a_little_jitter() {
        let waits: Vec<u128> = (1..MAX_ATTEMPTS)
            .map(|n| CONFLICT_BACKOFF.base_delay(n).as_millis())
            .collect();
        assert_eq!(waits, [10, 50, 250, 1250]);
        for n in 1..MAX_ATTEMPTS {
            let base = CONFLICT_BACKOFF.base_delay(n);
            for _ in 0..50 {
                let d = CONFLICT_BACKOFF.delay(n);
                assert!(d >= base && d <= base.mul_f64(1.1), "{n}: {d:?}");
            }
        }
    }
}
