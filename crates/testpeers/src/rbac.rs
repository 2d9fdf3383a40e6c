//! A sidecar's sample RBAC from `deploy/`, for tests that run a sidecar with exactly the rights
//! upstream's sample gives it: its documents picked out of a manifest, their rules in a form
//! that compares, and the documents created with a ServiceAccount to bind them to.

use std::path::Path;

use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::serde;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use crate::Error;

/// One rule for one resource: (API group, resource, sorted verbs).
pub type Rule = (String, String, Vec<String>);

/// The documents of the multi-document YAML `manifest` whose name contains `name_contains`,
/// with `$(DRIVER_NAME)` replaced by `driver` and every subject's namespace set to `ns` (what
/// kustomize does with `deploy/`).
pub fn sample(
    manifest: &Path,
    name_contains: &str,
    driver: &str,
    ns: &str,
) -> Result<Vec<Value>, Error> {
    let text = std::fs::read_to_string(manifest)
        .map_err(|e| Error::io(format!("reading {}", manifest.display()), e))?;
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
        .map_err(|e| Error::Unsupported(format!("{}: {e}", manifest.display())))?;
    docs.into_iter()
        .filter(|d| {
            d["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.contains(name_contains))
        })
        .map(|d| {
            let mut d: Value =
                serde_json::from_str(&d.to_string().replace("$(DRIVER_NAME)", driver))
                    .map_err(|e| Error::Unsupported(e.to_string()))?;
            if let Some(subjects) = d["subjects"].as_array_mut() {
                for s in subjects {
                    s["namespace"] = json!(ns);
                }
            }
            Ok(d)
        })
        .collect()
}

/// The rules of a Role or ClusterRole document, one per group and resource, sorted.
pub fn rules(role: &Value) -> Vec<Rule> {
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    let mut out = Vec::new();
    for r in role["rules"].as_array().into_iter().flatten() {
        let mut verbs = strings(&r["verbs"]);
        verbs.sort();
        for g in strings(&r["apiGroups"]) {
            for res in strings(&r["resources"]) {
                out.push((g.clone(), res, verbs.clone()));
            }
        }
    }
    out.sort();
    out
}

/// One [`Rule`], verbs in any order.
pub fn rule(group: &str, resource: &str, verbs: &[&str]) -> Rule {
    let mut verbs: Vec<String> = verbs.iter().map(|v| (*v).to_owned()).collect();
    verbs.sort();
    (group.to_owned(), resource.to_owned(), verbs)
}

fn parse<T: serde::de::DeserializeOwned>(d: &Value) -> Result<T, Error> {
    serde_json::from_value(d.clone()).map_err(|e| Error::Unsupported(e.to_string()))
}

/// Creates the ServiceAccount `default` in `ns` unless it exists: the ServiceAccount admission
/// plugin wants it for every pod, and no service-account controller runs beside a test's API
/// server to make it.
pub async fn default_service_account(client: &kube::Client, ns: &str) -> Result<(), Error> {
    let sa: ServiceAccount = parse(&json!({"metadata": {"name": "default"}}))?;
    match Api::<ServiceAccount>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &sa)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Creates ServiceAccount `ns/account` and the RBAC documents `docs` (ClusterRoles, Roles in
/// `ns`, and their bindings).
pub async fn create(
    client: &kube::Client,
    ns: &str,
    account: &str,
    docs: &[Value],
) -> Result<(), Error> {
    let pp = PostParams::default();
    let sa: ServiceAccount = parse(&json!({"metadata": {"name": account}}))?;
    Api::<ServiceAccount>::namespaced(client.clone(), ns)
        .create(&pp, &sa)
        .await?;
    for d in docs {
        match d["kind"].as_str() {
            Some("ClusterRole") => {
                Api::<ClusterRole>::all(client.clone())
                    .create(&pp, &parse(d)?)
                    .await?;
            }
            Some("ClusterRoleBinding") => {
                Api::<ClusterRoleBinding>::all(client.clone())
                    .create(&pp, &parse(d)?)
                    .await?;
            }
            Some("Role") => {
                Api::<Role>::namespaced(client.clone(), ns)
                    .create(&pp, &parse(d)?)
                    .await?;
            }
            Some("RoleBinding") => {
                Api::<RoleBinding>::namespaced(client.clone(), ns)
                    .create(&pp, &parse(d)?)
                    .await?;
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "an RBAC document of kind {other:?}"
                )));
            }
        }
    }
    Ok(())
}
