//! ResourceSlice publishing (feature `kube`): the node-local part of Go's `resourceslice`
//! controller, as one idempotent sync call.
//!
//! [`publish`] makes the API server hold exactly the given pools for (driver, node): per pool one
//! ResourceSlice per [`Slice`], named by `generateName` `<index, 5+ hex digits>-<driver>-<node>-`,
//! `spec.nodeName` = the node, owned by the Node (`controller: true`, so they are garbage-collected
//! with it), `spec.pool.generation` raised when anything changed, `resourceSliceCount` the number
//! of slices. Pools no longer given lose their slices.
//!
//! `resource.k8s.io/v1` is used when the server serves it, else `v1beta1` (devices nested under
//! `basic`). The objects are written as JSON (kube's `DynamicObject`), so no k8s-openapi version
//! feature beyond the workspace's is needed.
//!
//! Simplification against upstream: a pool that changed is rewritten by deleting its old slices
//! and creating new ones at the new generation (upstream updates matching slices in place); and
//! the call syncs once — callers call it again when their devices change (no watch, no periodic
//! resync).

use std::collections::BTreeMap;

use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::{Value, json};

/// A device attribute value: exactly one of int, bool, string, version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attribute {
    /// `int`.
    Int(i64),
    /// `bool`.
    Bool(bool),
    /// `string`.
    String(String),
    /// `version` (semver).
    Version(String),
}

impl Attribute {
    fn to_json(&self) -> Value {
        match self {
            Attribute::Int(i) => json!({ "int": i }),
            Attribute::Bool(b) => json!({ "bool": b }),
            Attribute::String(s) => json!({ "string": s }),
            Attribute::Version(v) => json!({ "version": v }),
        }
    }
}

/// A device in a slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceDevice {
    /// A DNS label, unique in the pool.
    pub name: String,
    /// Attributes by qualified name.
    pub attributes: BTreeMap<String, Attribute>,
}

/// One ResourceSlice's devices (at most 128).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Slice {
    /// The devices.
    pub devices: Vec<SliceDevice>,
}

/// A pool: its slices in priority order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Pool {
    /// The pool name (often the node name).
    pub name: String,
    /// The driver's generation; the published one is at least this.
    pub generation: i64,
    /// The slices; publish at least one (possibly empty) per pool.
    pub slices: Vec<Slice>,
}

/// What a sync did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Slices created.
    pub created: usize,
    /// Slices deleted.
    pub deleted: usize,
}

/// Why publishing failed.
#[derive(Debug, thiserror::Error)]
pub enum SliceError {
    /// No node name.
    #[error("no NodeName was set to publish resources")]
    NoNodeName,
    /// The pools are not valid.
    #[error("invalid pool {pool}: {reason}")]
    Invalid {
        /// Pool.
        pool: String,
        /// Why.
        reason: String,
    },
    /// The server serves no ResourceSlice API we know.
    #[error("the API server serves neither resource.k8s.io/v1 nor v1beta1 ResourceSlices")]
    NoApi,
    /// An API call failed.
    #[error("{what}")]
    Api {
        /// Which call.
        what: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> SliceError {
    let what = what.into();
    move |source| SliceError::Api { what, source }
}

/// The ResourceSlice API version the server serves: `v1`, else `v1beta1`.
pub async fn api_version(client: &kube::Client) -> Result<&'static str, SliceError> {
    for v in ["v1", "v1beta1"] {
        if let Ok(list) = client
            .list_api_group_resources(&format!("resource.k8s.io/{v}"))
            .await
            && list.resources.iter().any(|r| r.name == "resourceslices")
        {
            return Ok(v);
        }
    }
    Err(SliceError::NoApi)
}

fn device_json(version: &str, d: &SliceDevice) -> Value {
    let attrs: serde_json::Map<String, Value> = d
        .attributes
        .iter()
        .map(|(k, v)| (k.clone(), v.to_json()))
        .collect();
    if version == "v1beta1" {
        json!({ "name": d.name, "basic": { "attributes": attrs } })
    } else {
        json!({ "name": d.name, "attributes": attrs })
    }
}

fn check(pools: &[Pool]) -> Result<(), SliceError> {
    for p in pools {
        let invalid = |reason: String| SliceError::Invalid {
            pool: p.name.clone(),
            reason,
        };
        if p.name.is_empty() {
            return Err(invalid("empty pool name".into()));
        }
        let mut seen = std::collections::HashSet::new();
        for s in &p.slices {
            if s.devices.len() > 128 {
                return Err(invalid(format!(
                    "{} devices in one slice (max 128)",
                    s.devices.len()
                )));
            }
            for d in &s.devices {
                if !seen.insert(d.name.as_str()) {
                    return Err(invalid(format!("duplicate device name {}", d.name)));
                }
            }
        }
    }
    Ok(())
}

/// Makes the server hold exactly `pools` for (`driver`, `node_name`); see the module docs.
pub async fn publish(
    client: &kube::Client,
    driver: &str,
    node_name: &str,
    pools: &[Pool],
) -> Result<Stats, SliceError> {
    if node_name.is_empty() {
        return Err(SliceError::NoNodeName);
    }
    check(pools)?;
    let version = api_version(client).await?;
    let nodes: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk(&GroupVersionKind::gvk("", "v1", "Node")),
    );
    let node = nodes
        .get(node_name)
        .await
        .map_err(api_err(format!("get Node {node_name}")))?;
    let node_uid = node.metadata.uid.clone().unwrap_or_default();
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("resource.k8s.io", version, "ResourceSlice"),
        "resourceslices",
    );
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    let existing = api
        .list(
            &ListParams::default()
                .fields(&format!("spec.driver={driver},spec.nodeName={node_name}")),
        )
        .await
        .map_err(api_err("list ResourceSlices"))?
        .items;
    let mut by_pool: BTreeMap<String, Vec<DynamicObject>> = BTreeMap::new();
    for s in existing {
        let pool = s.data["spec"]["pool"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        by_pool.entry(pool).or_default().push(s);
    }
    let mut stats = Stats::default();
    for pool in pools {
        let old = by_pool.remove(&pool.name).unwrap_or_default();
        let current = old
            .iter()
            .filter_map(|s| s.data["spec"]["pool"]["generation"].as_i64())
            .max();
        let count = pool.slices.len().max(1);
        let width = format!("{:x}", count - 1).len().max(5);
        let wanted: Vec<Vec<Value>> = if pool.slices.is_empty() {
            vec![Vec::new()]
        } else {
            pool.slices
                .iter()
                .map(|s| s.devices.iter().map(|d| device_json(version, d)).collect())
                .collect()
        };
        // Unchanged: the same slices (by index prefix), all at the current generation, with the
        // same devices in the same order.
        let unchanged = current.is_some_and(|g| g >= pool.generation)
            && old.len() == wanted.len()
            && wanted.iter().enumerate().all(|(i, devs)| {
                let prefix = format!("{i:0width$x}-");
                old.iter().any(|s| {
                    s.metadata
                        .name
                        .as_deref()
                        .is_some_and(|n| n.starts_with(&prefix))
                        && s.data["spec"]["pool"]["generation"].as_i64() == current
                        && s.data["spec"]["pool"]["resourceSliceCount"].as_i64()
                            == Some(count as i64)
                        && s.data["spec"]["devices"]
                            .as_array()
                            .cloned()
                            .unwrap_or_default()
                            == *devs
                })
            });
        if unchanged {
            continue;
        }
        let generation = current.map_or(pool.generation, |g| (g + 1).max(pool.generation));
        stats.deleted += delete_all(&api, &old).await?;
        for (i, devices) in wanted.into_iter().enumerate() {
            let mut spec = json!({
                "driver": driver,
                "pool": {
                    "name": pool.name,
                    "generation": generation,
                    "resourceSliceCount": count,
                },
                "nodeName": node_name,
            });
            if !devices.is_empty() {
                spec["devices"] = Value::Array(devices);
            }
            let obj: DynamicObject = serde_json::from_value(json!({
                "apiVersion": format!("resource.k8s.io/{version}"),
                "kind": "ResourceSlice",
                "metadata": {
                    "generateName": format!("{i:0width$x}-{driver}-{node_name}-"),
                    "ownerReferences": [{
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": node_name,
                        "uid": node_uid,
                        "controller": true,
                    }],
                },
                "spec": spec,
            }))
            .map_err(|e| SliceError::Invalid {
                pool: pool.name.clone(),
                reason: e.to_string(),
            })?;
            api.create(&PostParams::default(), &obj)
                .await
                .map_err(api_err(format!(
                    "create ResourceSlice for pool {}",
                    pool.name
                )))?;
            stats.created += 1;
        }
    }
    // Pools no longer published.
    for old in by_pool.values() {
        stats.deleted += delete_all(&api, old).await?;
    }
    Ok(stats)
}

async fn delete_all(
    api: &Api<DynamicObject>,
    slices: &[DynamicObject],
) -> Result<usize, SliceError> {
    let mut n = 0;
    for s in slices {
        let Some(name) = s.metadata.name.as_deref() else {
            continue;
        };
        let dp = DeleteParams {
            preconditions: Some(kube::api::Preconditions {
                uid: s.metadata.uid.clone(),
                resource_version: s.metadata.resource_version.clone(),
            }),
            ..DeleteParams::default()
        };
        match api.delete(name, &dp).await {
            Ok(_) => n += 1,
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(api_err(format!("delete ResourceSlice {name}"))(e)),
        }
    }
    Ok(n)
}
