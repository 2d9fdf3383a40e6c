//! The checks behind the `class_parameters` fuzz target and its property test: a StorageClass's
//! `parameters` as the provisioner reads them (`plugreg_provisioner::request`): the fs type,
//! the `csi.storage.k8s.io/` keys it keeps to itself, and the rest that goes to the driver.
//!
//! Shared by `tests/props.rs` (arbtest, in the normal suite) and
//! `fuzz/fuzz_targets/class_parameters.rs` (libFuzzer), which include this file with `#[path]`;
//! the including crate provides `crate::arbitrary` (the `arbitrary` crate).

use std::collections::BTreeMap;

use crate::arbitrary::{Result, Unstructured};
use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use plugreg_provisioner::classify::State;
use plugreg_provisioner::request::{self, RequestOptions};
use plugreg_provisioner::topology::TopologySource;

const PREFIX: &str = "csi.storage.k8s.io/";

/// The `csi.storage.k8s.io/` keys upstream's `removePrefixedParameters` knows (and drops).
const RESERVED: [&str; 17] = [
    "csi.storage.k8s.io/fstype",
    "csi.storage.k8s.io/secret-name",
    "csi.storage.k8s.io/secret-namespace",
    "csi.storage.k8s.io/provisioner-secret-name",
    "csi.storage.k8s.io/provisioner-secret-namespace",
    "csi.storage.k8s.io/controller-publish-secret-name",
    "csi.storage.k8s.io/controller-publish-secret-namespace",
    "csi.storage.k8s.io/node-stage-secret-name",
    "csi.storage.k8s.io/node-stage-secret-namespace",
    "csi.storage.k8s.io/node-publish-secret-name",
    "csi.storage.k8s.io/node-publish-secret-namespace",
    "csi.storage.k8s.io/controller-expand-secret-name",
    "csi.storage.k8s.io/controller-expand-secret-namespace",
    "csi.storage.k8s.io/node-expand-secret-name",
    "csi.storage.k8s.io/node-expand-secret-namespace",
    "csi.storage.k8s.io/controller-modify-secret-name",
    "csi.storage.k8s.io/controller-modify-secret-namespace",
];

/// Keys near the rules: reserved, almost reserved, the deprecated spellings, the driver's own.
const KEYS: &[&str] = &[
    "csi.storage.k8s.io/fstype",
    "csi.storage.k8s.io/provisioner-secret-name",
    "csi.storage.k8s.io/provisioner-secret-namespace",
    "csi.storage.k8s.io/node-stage-secret-name",
    "csi.storage.k8s.io/secret-name",
    "csi.storage.k8s.io/pvc/name",
    "csi.storage.k8s.io/pv/name",
    "csi.storage.k8s.io/",
    "csi.storage.k8s.io/FSTYPE",
    "csi.storage.k8s.io/fstype ",
    "CSI.storage.k8s.io/fstype",
    "csi.storage.k8s.io",
    "fstype",
    "FSType",
    "fsType",
    "fstypé",
    "csiProvisionerSecretName",
    "csiNodeStageSecretNamespace",
    "type",
    "replication",
    "",
];

/// No cluster: topology is off in these requests.
struct NoCluster;

impl TopologySource for NoCluster {
    fn csinode(&self, _: &str) -> Option<std::sync::Arc<k8s_openapi::api::storage::v1::CSINode>> {
        None
    }
    fn node(&self, _: &str) -> Option<std::sync::Arc<k8s_openapi::api::core::v1::Node>> {
        None
    }
    fn csinodes(&self) -> Vec<std::sync::Arc<k8s_openapi::api::storage::v1::CSINode>> {
        Vec::new()
    }
    fn nodes(&self) -> Vec<std::sync::Arc<k8s_openapi::api::core::v1::Node>> {
        Vec::new()
    }
}

/// A parameter map: keys from [`KEYS`], reserved ones or anything, values short or anything.
pub fn params(u: &mut Unstructured) -> Result<BTreeMap<String, String>> {
    let n = u.int_in_range(0..=8)?;
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let key = match u.int_in_range(0u8..=5)? {
            0 => u.arbitrary()?,
            1 => format!("{PREFIX}{}", short(u)?),
            2 => (*u.choose(&RESERVED)?).to_owned(),
            _ => (*u.choose(KEYS)?).to_owned(),
        };
        let value = match u.int_in_range(0u8..=3)? {
            0 => u.arbitrary()?,
            1 => String::new(),
            _ => (*u.choose(&["ext4", "xfs", "s", "ns", "${pvc.name}", "apps", "3"])?).to_owned(),
        };
        out.insert(key, value);
    }
    Ok(out)
}

/// A short arbitrary string (the tail of a key).
fn short(u: &mut Unstructured) -> Result<String> {
    let s: String = u.arbitrary()?;
    Ok(s.chars().take(24).collect())
}

/// A claim that passes every check before the parameters are read.
fn claim() -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some("data".into()),
            namespace: Some("apps".into()),
            uid: Some("5f1e3b7c-9a2d-4e8f-b6c1-0d2e3f4a5b6c".into()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_owned(),
                    Quantity("1Gi".into()),
                )])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The property: the driver gets exactly the keys outside `csi.storage.k8s.io/`, an unknown key
/// inside it is refused (upstream's text, naming the first such key), the fs type comes from
/// exactly one of its two keys, and the whole request never panics and never leaks a reserved
/// key to the driver.
pub fn check(u: &mut Unstructured) -> Result<()> {
    let params = params(u)?;

    let unknown = params
        .keys()
        .find(|k| k.starts_with(PREFIX) && !RESERVED.contains(&k.as_str()));
    let driver = request::driver_parameters(&params);
    match (&driver, unknown) {
        (Ok(got), None) => {
            let want: BTreeMap<&String, &String> = params
                .iter()
                .filter(|(k, _)| !k.starts_with(PREFIX))
                .collect();
            let got: BTreeMap<&String, &String> = got.iter().collect();
            assert_eq!(got, want);
        }
        (Err(e), Some(k)) => {
            assert_eq!(e.state, State::Final);
            assert_eq!(
                e.message,
                format!(
                    "failed to strip CSI Parameters of prefixed keys: found unknown parameter key \"{k}\" with reserved namespace {PREFIX}"
                )
            );
        }
        (got, unknown) => panic!("{params:?}: {got:?}, unknown key {unknown:?}"),
    }

    let default = *u.choose(&["", "ext4", "xfs"])?;
    let sources: Vec<&String> = params
        .iter()
        .filter(|(k, _)| {
            k.eq_ignore_ascii_case("fstype") || k.as_str() == "csi.storage.k8s.io/fstype"
        })
        .map(|(_, v)| v)
        .collect();
    let deprecated = params
        .keys()
        .filter(|k| k.eq_ignore_ascii_case("fstype"))
        .count();
    match request::fs_type(&params, default) {
        Ok((fs, warnings)) => {
            assert!(sources.len() <= 1, "{params:?}");
            let want = sources
                .first()
                .map(|s| s.as_str())
                .filter(|s| !s.is_empty())
                .unwrap_or(default);
            assert_eq!(fs, want);
            assert_eq!(warnings.len(), deprecated);
        }
        Err(e) => {
            assert!(sources.len() > 1, "{params:?}: {e}");
            assert_eq!(e.state, State::Final);
        }
    }

    // The whole request: never a panic, never a reserved key to the driver.
    let class = StorageClass {
        metadata: ObjectMeta {
            name: Some("fast".into()),
            ..Default::default()
        },
        provisioner: "csi.example.com".into(),
        parameters: Some(params.clone()),
        ..Default::default()
    };
    let opts = RequestOptions {
        extra_create_metadata: u.arbitrary()?,
        ..Default::default()
    };
    match request::prepare(&claim(), &class, "csi.example.com", &opts, &NoCluster) {
        Ok(p) => {
            assert!(driver.is_ok());
            let extra = [
                request::PVC_NAME_KEY,
                request::PVC_NAMESPACE_KEY,
                request::PV_NAME_KEY,
            ];
            for k in p.request.parameters.keys() {
                assert!(
                    !k.starts_with(PREFIX)
                        || (opts.extra_create_metadata && extra.contains(&k.as_str())),
                    "{k} reached the driver"
                );
            }
        }
        Err(e) => assert!(!e.message.is_empty()),
    }

    // The class as JSON, with values of any type, through serde.
    let mut json = serde_json::Map::new();
    for (k, v) in &params {
        let value = if u.ratio(1, 8)? {
            serde_json::Value::from(u.arbitrary::<i64>()?)
        } else {
            serde_json::Value::from(v.as_str())
        };
        json.insert(k.clone(), value);
    }
    let class = serde_json::json!({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
        "metadata": {"name": "fast"}, "provisioner": "csi.example.com", "parameters": json,
    });
    if let Ok(class) = serde_json::from_value::<StorageClass>(class) {
        let read = class.parameters.unwrap_or_default();
        let _ = request::driver_parameters(&read);
        let _ = request::fs_type(&read, default);
    }
    Ok(())
}
