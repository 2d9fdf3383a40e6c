//! What the cache tests share: a ConfigMap kept as its key and the value of its `v` entry.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use plugreg_sidecar_kit::cache::{self, Keyed};

/// A ConfigMap as the tests keep it: its key and the value of its `v` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Compact {
    pub key: Box<str>,
    pub value: Box<str>,
}

impl Keyed for Compact {
    fn key(&self) -> &str {
        &self.key
    }
}

/// The compact form of `cm`.
pub fn compact(cm: ConfigMap) -> Compact {
    Compact {
        key: cache::store_key(&cm.metadata),
        value: cm
            .data
            .and_then(|d| d.get("v").cloned())
            .unwrap_or_default()
            .into(),
    }
}

/// A ConfigMap `name` labelled `test=<label>` holding `v: value`.
pub fn config_map(name: &str, label: &str, value: &str) -> ConfigMap {
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some(name.into());
    cm.metadata.labels = Some(BTreeMap::from([("test".into(), label.into())]));
    cm.data = Some(BTreeMap::from([("v".into(), value.into())]));
    cm
}
