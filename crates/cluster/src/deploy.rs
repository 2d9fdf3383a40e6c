//! Applying a kustomization (an overlay of `deploy/`) to the cluster for real: rendered by
//! kustomize (kubectl v1.20.2's, the oldest the manifests support), adapted to the cluster by
//! the loopback rules below, and applied object by object with server-side apply.
//!
//! # The loopback rules
//!
//! Nothing in the cluster may send a packet beyond 127.0.0.0/8, and two clusters on one host
//! must not collide. So every pod template (Pod, Deployment, DaemonSet, StatefulSet,
//! ReplicaSet, Job, CronJob) is changed as follows before it is applied; nothing else is:
//!
//! - `hostNetwork: true`: the node's CNI list is loopback-only, so a pod network would have no
//!   address (and there is to be none);
//! - every container gets `KUBERNETES_SERVICE_HOST=127.0.0.1` and `KUBERNETES_SERVICE_PORT`
//!   = the API server's port: in-cluster clients reach the API server itself, never the
//!   `kubernetes` Service's cluster IP;
//! - every container port gets a free port of the host instead (host-network pods of two
//!   clusters would otherwise bind the same one), and what refers to the old port follows:
//!   listen addresses in arguments (`--http-endpoint=:9809` becomes
//!   `--http-endpoint=127.0.0.1:<new>`; the CSI sidecars' `--health-port=9808`, which listens
//!   on every interface, becomes `--http-endpoint=127.0.0.1:<new>`) and numeric probe ports;
//! - probes ask 127.0.0.1 (a host-network pod's IP would be the node's, and the node has none);
//! - `imagePullPolicy: Never`: images come from files, never from a registry.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::Scope;
use serde_json::{Value, json};

use crate::error::Error;
use crate::host;

/// The field manager of the cluster's server-side applies.
pub const FIELD_MANAGER: &str = "plugreg-cluster";

/// What the loopback rules changed, one line each (for a driver author to read).
pub type Changes = Vec<String>;

/// Renders `kustomization` (a directory) with kustomize and returns its objects as JSON.
/// `kubeconfig` names a reachable API server (kubectl maps the kinds through it).
pub fn render(kustomization: &Path, kubeconfig: &Path) -> Result<Vec<Value>, Error> {
    let kubectl = host::kubectl()?;
    let cache = tempfile::Builder::new()
        .prefix("plugreg-kubectl-")
        .tempdir()
        .map_err(|e| Error::io("creating kubectl's cache dir", e))?;
    let yaml = host::run(
        Command::new(&kubectl)
            .arg("kustomize")
            .arg(kustomization)
            .env("HOME", cache.path()),
    )?;
    let file = cache.path().join("rendered.yaml");
    std::fs::write(&file, &yaml).map_err(|e| Error::io("writing the rendered manifests", e))?;
    // YAML to JSON, the way kubectl reads manifests (no YAML parser in this workspace).
    let json = host::run(
        Command::new(&kubectl)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!(
                "--cache-dir={}",
                cache.path().join("cache").display()
            ))
            .args([
                "create",
                "--dry-run=client",
                "--validate=false",
                "-o",
                "json",
                "-f",
            ])
            .arg(&file)
            .env("HOME", cache.path()),
    )?;
    let mut objects = Vec::new();
    for v in serde_json::Deserializer::from_str(&json).into_iter::<Value>() {
        let v = v.map_err(|e| Error::Manifest(format!("kubectl printed no JSON: {e}")))?;
        match v["kind"].as_str() {
            Some("List") => objects.extend(v["items"].as_array().cloned().unwrap_or_default()),
            _ => objects.push(v),
        }
    }
    Ok(objects)
}

/// Applies the loopback rules (see the module documentation) to every pod template in
/// `objects`, taking new ports from `new_port`.
pub fn loopback_rules(
    objects: &mut [Value],
    api_port: u16,
    mut new_port: impl FnMut() -> Result<u16, Error>,
) -> Result<Changes, Error> {
    let mut changes = Vec::new();
    for obj in objects.iter_mut() {
        let what = format!(
            "{} {}",
            obj["kind"].as_str().unwrap_or("?"),
            obj["metadata"]["name"].as_str().unwrap_or("?")
        );
        let Some(spec) = pod_spec(obj) else {
            continue;
        };
        pod_rules(spec, api_port, &mut new_port, &what, &mut changes)?;
    }
    Ok(changes)
}

/// The pod spec inside an object, if it has one.
fn pod_spec(obj: &mut Value) -> Option<&mut Value> {
    let path: &[&str] = match obj["kind"].as_str()? {
        "Pod" => &["spec"],
        "Deployment"
        | "DaemonSet"
        | "StatefulSet"
        | "ReplicaSet"
        | "Job"
        | "ReplicationController" => &["spec", "template", "spec"],
        "CronJob" => &["spec", "jobTemplate", "spec", "template", "spec"],
        _ => return None,
    };
    let mut v = obj;
    for key in path {
        v = v.get_mut(*key)?;
    }
    v.is_object().then_some(v)
}

fn pod_rules(
    spec: &mut Value,
    api_port: u16,
    new_port: &mut impl FnMut() -> Result<u16, Error>,
    what: &str,
    changes: &mut Changes,
) -> Result<(), Error> {
    if spec["hostNetwork"] != json!(true) {
        spec["hostNetwork"] = json!(true);
        changes.push(format!("{what}: hostNetwork: true"));
    }
    // One new port per declared port, shared by the pod's containers (a probe of one
    // container may name the port another declares).
    let mut ports = BTreeMap::new();
    for c in containers(spec) {
        for p in c["ports"].as_array().into_iter().flatten() {
            if let Some(old) = p["containerPort"].as_u64()
                && let std::collections::btree_map::Entry::Vacant(e) = ports.entry(old)
            {
                e.insert(new_port()?);
            }
        }
    }
    for c in containers_mut(spec) {
        let name = c["name"].as_str().unwrap_or("?").to_owned();
        let at = format!("{what}, container {name}");
        if c["imagePullPolicy"] != json!("Never") {
            c["imagePullPolicy"] = json!("Never");
        }
        set_env(c, "KUBERNETES_SERVICE_HOST", "127.0.0.1");
        set_env(c, "KUBERNETES_SERVICE_PORT", &api_port.to_string());
        if let Some(list) = c.get_mut("ports").and_then(Value::as_array_mut) {
            for p in list {
                if let Some(new) = p["containerPort"].as_u64().and_then(|o| ports.get(&o)) {
                    p["containerPort"] = json!(new);
                    if let Some(m) = p.as_object_mut() {
                        m.remove("hostPort");
                    }
                }
            }
        }
        for key in ["args", "command"] {
            if let Some(list) = c.get_mut(key).and_then(Value::as_array_mut) {
                for arg in list {
                    if let Some(s) = arg.as_str()
                        && let Some(new) = rewrite_arg(s, &ports)
                    {
                        changes.push(format!("{at}: {s} -> {new}"));
                        *arg = json!(new);
                    }
                }
            }
        }
        for probe in ["livenessProbe", "readinessProbe", "startupProbe"] {
            for handler in ["httpGet", "tcpSocket"] {
                let Some(h) = c
                    .get_mut(probe)
                    .and_then(|p| p.get_mut(handler))
                    .filter(|h| h.is_object())
                else {
                    continue;
                };
                h["host"] = json!("127.0.0.1");
                if let Some(new) = h["port"].as_u64().and_then(|o| ports.get(&o)) {
                    h["port"] = json!(new);
                }
            }
        }
    }
    for (old, new) in &ports {
        changes.push(format!("{what}: port {old} -> 127.0.0.1:{new}"));
    }
    Ok(())
}

/// The containers and init containers of a pod spec.
fn containers(spec: &Value) -> impl Iterator<Item = &Value> {
    ["initContainers", "containers"]
        .into_iter()
        .flat_map(|k| spec[k].as_array().into_iter().flatten())
}

fn containers_mut(spec: &mut Value) -> Vec<&mut Value> {
    let Some(map) = spec.as_object_mut() else {
        return Vec::new();
    };
    map.iter_mut()
        .filter(|(k, _)| *k == "initContainers" || *k == "containers")
        .flat_map(|(_, v)| v.as_array_mut().into_iter().flatten())
        .collect()
}

fn set_env(container: &mut Value, name: &str, value: &str) {
    if !container["env"].is_array() {
        container["env"] = json!([]);
    }
    let Some(env) = container["env"].as_array_mut() else {
        return;
    };
    env.retain(|e| e["name"] != json!(name));
    env.push(json!({"name": name, "value": value}));
}

/// The rewritten form of one argument, if it names a remapped port: a listen address
/// (`--x=:P`, `--x=0.0.0.0:P`, `--x=[::]:P`, `--x=localhost:P`, `--x=127.0.0.1:P`) becomes
/// `--x=127.0.0.1:Q`; `--health-port=P` (the CSI sidecars' listen-everywhere flag) becomes
/// `--http-endpoint=127.0.0.1:Q`; another `--...port=P` becomes `--...port=Q`.
fn rewrite_arg(arg: &str, ports: &BTreeMap<u64, u16>) -> Option<String> {
    let (flag, value) = arg.split_once('=')?;
    if !flag.starts_with('-') {
        return None;
    }
    if let Some((host, port)) = value.rsplit_once(':') {
        let new = ports.get(&port.parse::<u64>().ok()?)?;
        return matches!(host, "" | "0.0.0.0" | "[::]" | "localhost" | "127.0.0.1")
            .then(|| format!("{flag}=127.0.0.1:{new}"));
    }
    let new = ports.get(&value.parse::<u64>().ok()?)?;
    let bare = flag.trim_start_matches('-');
    if bare == "health-port" {
        return Some(format!("--http-endpoint=127.0.0.1:{new}"));
    }
    bare.ends_with("port").then(|| format!("{flag}={new}"))
}

/// Applies `objects` with server-side apply (field manager [`FIELD_MANAGER`], conflicts
/// forced): namespaces first, then what pods need (accounts, roles, configuration), then the
/// rest. A namespace an object names but none of the objects creates is created.
pub async fn apply(client: &kube::Client, objects: &[Value]) -> Result<(), Error> {
    let mut ordered: Vec<&Value> = objects.iter().collect();
    ordered.sort_by_key(|o| rank(o["kind"].as_str().unwrap_or("")));
    let mut namespaces: Vec<String> = objects
        .iter()
        .filter_map(|o| o["metadata"]["namespace"].as_str().map(str::to_owned))
        .collect();
    namespaces.sort();
    namespaces.dedup();
    for ns in namespaces {
        let exists = objects.iter().any(|o| {
            o["kind"] == json!("Namespace") && o["metadata"]["name"] == json!(ns.as_str())
        });
        if !exists {
            apply_one(
                client,
                &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
            )
            .await?;
        }
    }
    for obj in ordered {
        apply_one(client, obj).await?;
    }
    Ok(())
}

/// The order objects are applied in.
fn rank(kind: &str) -> u8 {
    match kind {
        "CustomResourceDefinition" => 0,
        "Namespace" => 1,
        "ServiceAccount" | "ConfigMap" | "Secret" => 2,
        "ClusterRole" | "Role" => 3,
        "ClusterRoleBinding" | "RoleBinding" => 4,
        "CSIDriver" | "StorageClass" | "PriorityClass" => 5,
        _ => 6,
    }
}

/// Server-side applies one object; returns it as the API server has it.
pub async fn apply_one(client: &kube::Client, obj: &Value) -> Result<Value, Error> {
    let (group, version) = match obj["apiVersion"].as_str().unwrap_or("").split_once('/') {
        Some((g, v)) => (g.to_owned(), v.to_owned()),
        None => (
            String::new(),
            obj["apiVersion"].as_str().unwrap_or("").to_owned(),
        ),
    };
    let kind = obj["kind"].as_str().unwrap_or("").to_owned();
    let name = obj["metadata"]["name"]
        .as_str()
        .ok_or_else(|| Error::Manifest(format!("a {kind} without a name")))?
        .to_owned();
    let gvk = GroupVersionKind::gvk(&group, &version, &kind);
    let (resource, caps) = kube::discovery::pinned_kind(client, &gvk).await?;
    let api: Api<DynamicObject> = match caps.scope {
        Scope::Namespaced => Api::namespaced_with(
            client.clone(),
            obj["metadata"]["namespace"].as_str().unwrap_or("default"),
            &resource,
        ),
        Scope::Cluster => Api::all_with(client.clone(), &resource),
    };
    let applied = api
        .patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(obj),
        )
        .await
        .map_err(|e| Error::Manifest(format!("applying {kind} {name}: {e}")))?;
    serde_json::to_value(applied).map_err(|e| Error::Manifest(format!("{kind} {name}: {e}")))
}

/// Writes a kustomization in `dir` whose base is `base` (kustomize v2 wants it relative) with
/// `patches` (file name, strategic-merge patch YAML) on top: a test's own overlay.
pub fn write_overlay(dir: &Path, base: &Path, patches: &[(&str, &str)]) -> Result<PathBuf, Error> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let dir = dir
        .canonicalize()
        .map_err(|e| Error::io(format!("resolving {}", dir.display()), e))?;
    let base = base
        .canonicalize()
        .map_err(|e| Error::io(format!("resolving {}", base.display()), e))?;
    let mut text = format!("bases:\n- {}\n", relative(&dir, &base).display());
    if !patches.is_empty() {
        text.push_str("patchesStrategicMerge:\n");
    }
    for (file, yaml) in patches {
        std::fs::write(dir.join(file), yaml)
            .map_err(|e| Error::io(format!("writing {file}"), e))?;
        text.push_str(&format!("- {file}\n"));
    }
    std::fs::write(dir.join("kustomization.yaml"), text)
        .map_err(|e| Error::io("writing kustomization.yaml", e))?;
    Ok(dir)
}

/// `to` relative to `from` (both absolute and resolved).
fn relative(from: &Path, to: &Path) -> PathBuf {
    let a: Vec<Component<'_>> = from.components().collect();
    let b: Vec<Component<'_>> = to.components().collect();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let mut out = PathBuf::new();
    for _ in common..a.len() {
        out.push("..");
    }
    for c in &b[common..] {
        out.push(c.as_os_str());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn daemonset() -> Value {
        json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "csi-node"},
            "spec": {"template": {"spec": {"containers": [
                {"name": "driver", "image": "d", "ports": [{"name": "healthz", "containerPort": 9808}],
                 "livenessProbe": {"httpGet": {"path": "/healthz", "port": "healthz"}}},
                {"name": "registrar", "image": "r", "args": ["--http-endpoint=:9809", "--v=2"],
                 "ports": [{"name": "healthz-reg", "containerPort": 9809, "hostPort": 9809}],
                 "livenessProbe": {"httpGet": {"path": "/healthz", "port": 9809}}},
                {"name": "probe", "image": "p", "args": ["--csi-address=/csi/csi.sock", "--health-port=9808"],
                 "env": [{"name": "KUBERNETES_SERVICE_HOST", "value": "10.0.0.1"}]}
            ]}}}
        })
    }

    #[test]
    fn loopback_rules_move_ports_and_point_at_the_api_server() {
        let mut objs = vec![
            daemonset(),
            json!({"kind": "ConfigMap", "metadata": {"name": "x"}}),
        ];
        let mut next = 40000;
        let changes = loopback_rules(&mut objs, 6443, || {
            next += 1;
            Ok(next)
        })
        .unwrap();
        let spec = &objs[0]["spec"]["template"]["spec"];
        assert_eq!(spec["hostNetwork"], json!(true));
        let c = &spec["containers"];
        assert_eq!(c[0]["ports"][0]["containerPort"], json!(40001));
        assert_eq!(c[0]["livenessProbe"]["httpGet"]["port"], json!("healthz"));
        assert_eq!(c[0]["livenessProbe"]["httpGet"]["host"], json!("127.0.0.1"));
        assert_eq!(c[1]["args"][0], json!("--http-endpoint=127.0.0.1:40002"));
        assert_eq!(c[1]["args"][1], json!("--v=2"));
        assert_eq!(c[1]["ports"][0]["containerPort"], json!(40002));
        assert!(c[1]["ports"][0].get("hostPort").is_none());
        assert_eq!(c[1]["livenessProbe"]["httpGet"]["port"], json!(40002));
        assert_eq!(c[2]["args"][1], json!("--http-endpoint=127.0.0.1:40001"));
        for container in c.as_array().unwrap() {
            assert_eq!(container["imagePullPolicy"], json!("Never"));
            let env = container["env"].as_array().unwrap();
            let get = |n: &str| {
                let hits: Vec<_> = env.iter().filter(|e| e["name"] == json!(n)).collect();
                assert_eq!(hits.len(), 1, "{n} once in {env:?}");
                hits[0]["value"].clone()
            };
            assert_eq!(get("KUBERNETES_SERVICE_HOST"), json!("127.0.0.1"));
            assert_eq!(get("KUBERNETES_SERVICE_PORT"), json!("6443"));
        }
        assert_eq!(
            objs[1],
            json!({"kind": "ConfigMap", "metadata": {"name": "x"}})
        );
        // Nothing the rules do not set appears (no empty probes, no null lists).
        assert!(c[2].get("livenessProbe").is_none() && c[0].get("args").is_none());
        assert!(
            changes.iter().any(|c| c.contains("--health-port=9808")),
            "{changes:?}"
        );
    }

    #[test]
    fn only_listen_addresses_and_port_flags_are_rewritten() {
        let ports = BTreeMap::from([(8080, 41000)]);
        let r = |a: &str| rewrite_arg(a, &ports);
        assert_eq!(
            r("--http-endpoint=:8080").as_deref(),
            Some("--http-endpoint=127.0.0.1:41000")
        );
        assert_eq!(
            r("--metrics-address=0.0.0.0:8080").as_deref(),
            Some("--metrics-address=127.0.0.1:41000")
        );
        assert_eq!(
            r("--listen=[::]:8080").as_deref(),
            Some("--listen=127.0.0.1:41000")
        );
        assert_eq!(
            r("--health-port=8080").as_deref(),
            Some("--http-endpoint=127.0.0.1:41000")
        );
        assert_eq!(
            r("--metrics-port=8080").as_deref(),
            Some("--metrics-port=41000")
        );
        // Other hosts, other ports, other numbers, positional words: untouched.
        assert_eq!(r("--server=10.1.2.3:8080"), None);
        assert_eq!(r("--http-endpoint=:9090"), None);
        assert_eq!(r("--max-volumes=8080"), None);
        assert_eq!(r("8080"), None);
        assert_eq!(r("x=:8080"), None);
    }

    #[test]
    fn relative_paths_climb_to_the_common_ancestor() {
        assert_eq!(
            relative(Path::new("/tmp/a/b"), Path::new("/work/x/deploy/test")),
            PathBuf::from("../../../work/x/deploy/test")
        );
        assert_eq!(
            relative(Path::new("/a"), Path::new("/a/b")),
            PathBuf::from("b")
        );
    }
}
