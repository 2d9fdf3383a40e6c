//! How both controllers (contents and group contents) write: JSON merge patches of what
//! changes, each remembered by resource version ([`Writes`]) so that a sync finding the cache
//! behind its own write looks again instead of acting on what it already changed; the bound
//! finalizer's removal with the resource version the list was read at; and the Secrets the
//! driver calls take.

use std::collections::HashMap;
use std::fmt::Debug;
use std::marker::PhantomData;
use std::sync::Arc;

use k8s_openapi::ClusterResourceScope;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use plugreg_sidecar_kit::runtime::Writes;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::decide::SecretRef;

/// The writes of one controller to its cluster-scoped kind `K`.
pub struct Writer<K> {
    kube: Client,
    /// Our own last write of each object, by name.
    pub written: Arc<Writes<String>>,
    kind: PhantomData<fn() -> K>,
}

impl<K> Writer<K>
where
    K: Resource<DynamicType = (), Scope = ClusterResourceScope> + Clone + DeserializeOwned + Debug,
{
    /// Writes with `kube`, remembering them in `written`.
    pub fn new(kube: Client, written: Arc<Writes<String>>) -> Self {
        Self {
            kube,
            written,
            kind: PhantomData,
        }
    }

    fn api(&self) -> Api<K> {
        Api::all(self.kube.clone())
    }

    fn remember(&self, name: &str, updated: &K) {
        self.written
            .record(name.to_owned(), updated.meta().resource_version.as_deref());
    }

    /// A merge patch of `name`'s metadata or spec.
    pub async fn patch(&self, name: &str, patch: Value) -> Result<K, kube::Error> {
        let updated = self
            .api()
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await?;
        self.remember(name, &updated);
        Ok(updated)
    }

    /// A merge patch of `name`'s status subresource.
    pub async fn patch_status(&self, name: &str, patch: Value) -> Result<K, kube::Error> {
        let updated = self
            .api()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(patch))
            .await?;
        self.remember(name, &updated);
        Ok(updated)
    }

    /// Removes `finalizer` from `object` (nothing when it is not there), with the resource
    /// version the list was read at: a finalizer added meanwhile is not lost.
    pub async fn remove_finalizer(&self, object: &K, finalizer: &str) -> Result<(), kube::Error> {
        let finalizers = object.finalizers();
        if !finalizers.iter().any(|f| f == finalizer) {
            return Ok(());
        }
        let rest: Vec<&String> = finalizers.iter().filter(|f| *f != finalizer).collect();
        let rest = if rest.is_empty() {
            json!(null)
        } else {
            json!(rest)
        };
        let patch = json!({"metadata": {
            "finalizers": rest,
            "resourceVersion": object.meta().resource_version,
        }});
        self.patch(&object.name_any(), patch).await.map(drop)
    }

    /// The data of the Secret `r`, values as strings.
    pub async fn secret(&self, r: &SecretRef) -> Result<HashMap<String, String>, String> {
        let api: Api<Secret> = Api::namespaced(self.kube.clone(), &r.0);
        let s = api.get(&r.1).await.map_err(|e| api_message(&e))?;
        Ok(s.data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
            .collect())
    }
}

/// The message of an API error as client-go prints it (`secrets "x" not found`).
pub fn api_message(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => s.message.clone(),
        other => other.to_string(),
    }
}

/// Now, as a status's `error.time` (RFC 3339, seconds).
pub fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .map(|t| t.to_string())
        .unwrap_or_default()
}
