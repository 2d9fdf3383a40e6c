//! placeholder (lead's compile stub; replaced by the helper's module)
#![allow(missing_docs, unused)]
use crate::classify::ProvisionError;
use crate::secrets::{PvSecrets, SecretRef};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use plugreg_proto::csi::v1::CreateVolumeRequest;
#[derive(Debug, Clone, Default)]
pub struct RequestOptions {
    pub volume_name_prefix: String,
    pub volume_name_uuid_length: i64,
    pub extra_create_metadata: bool,
    pub default_fstype: String,
    pub controller_publish_readonly: bool,
    pub strict_topology: bool,
    pub immediate_topology: bool,
    pub topology: bool,
    pub single_node_multi_writer: bool,
}
pub fn volume_name(
    prefix: &str,
    uuid_length: i64,
    claim_uid: &str,
) -> Result<String, ProvisionError> {
    Ok(format!("{prefix}-{claim_uid}"))
}
pub fn should_provision(
    claim: &PersistentVolumeClaim,
    class: Option<&StorageClass>,
    driver: &str,
) -> Result<bool, ProvisionError> {
    Ok(true)
}
pub fn selected_node(claim: &PersistentVolumeClaim) -> Option<String> {
    None
}
pub struct Prepared {
    pub request: CreateVolumeRequest,
    pub pv_name: String,
    pub fs_type: String,
    pub requested_bytes: i64,
    pub provisioner_secret: Option<SecretRef>,
    pub secrets: PvSecrets,
    pub warnings: Vec<String>,
}
pub fn prepare(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    driver: &str,
    opts: &RequestOptions,
    topo: &dyn crate::topology::TopologySource,
) -> Result<Prepared, ProvisionError> {
    unimplemented!()
}
