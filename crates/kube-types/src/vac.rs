//! The VolumeAttributesClass of `storage.k8s.io/v1` (Kubernetes 1.34; newer than the generated
//! types this workspace builds against), with the fields the sidecars read, and the discovery
//! check upstream's sidecars make at start-up.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// A VolumeAttributesClass: its driver and parameters.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VolumeAttributesClass {
    /// The object's metadata.
    pub metadata: ObjectMeta,
    /// The driver that handles the class.
    #[serde(rename = "driverName", default)]
    pub driver_name: String,
    /// The mutable parameters (CreateVolume's `mutable_parameters`, ControllerModifyVolume's).
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
}

impl kube::Resource for VolumeAttributesClass {
    type DynamicType = ();
    type Scope = k8s_openapi::ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "VolumeAttributesClass".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "storage.k8s.io".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "volumeattributesclasses".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The VolumeAttributesClass gate after upstream's start-up check: on when asked for, unless
/// it was not set explicitly and discovery ([`api_available`]) found no v1 API.
pub fn gate(on: bool, explicit: bool, available: Option<bool>) -> bool {
    on && (explicit || available != Some(false))
}

/// Upstream's start-up check: `Some(false)` when discovery of `storage.k8s.io/v1` succeeds and
/// lists no VolumeAttributesClass (the API server is older than 1.34, or has the API off);
/// `None` when discovery failed (upstream then leaves the gate as it is).
pub async fn api_available(client: &kube::Client) -> Option<bool> {
    discover(client).await.ok()
}

/// Discovery of `storage.k8s.io/v1`: whether it lists VolumeAttributesClass (`false` also when
/// the group is not served at all, a 404), or why discovery failed (csi-resizer logs it).
pub async fn discover(client: &kube::Client) -> Result<bool, kube::Error> {
    match client.list_api_group_resources("storage.k8s.io/v1").await {
        Ok(list) => Ok(list
            .resources
            .iter()
            .any(|r| r.kind == "VolumeAttributesClass")),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::gate;

    #[test]
    fn the_gate_goes_off_only_when_implicit_and_the_api_is_missing() {
        assert!(gate(true, false, None), "discovery failed: as it is");
        assert!(gate(true, false, Some(true)));
        assert!(!gate(true, false, Some(false)));
        assert!(gate(true, true, Some(false)), "set explicitly: kept");
        assert!(!gate(false, false, Some(true)));
    }
}
