//! placeholder
#![allow(missing_docs, unused)]
use plugreg_proto::csi::v1::{CreateVolumeRequest, CreateVolumeResponse};
use std::collections::HashMap;
#[derive(Debug, Clone, Default)]
pub struct Capabilities {
    pub controller_service: bool,
    pub accessibility_constraints: bool,
    pub create_delete_volume: bool,
    pub publish_unpublish_volume: bool,
    pub single_node_multi_writer: bool,
    pub create_delete_snapshot: bool,
    pub clone_volume: bool,
    pub modify_volume: bool,
}
pub struct Driver;
impl Driver {
    pub async fn create_volume(
        &self,
        req: CreateVolumeRequest,
    ) -> Result<CreateVolumeResponse, tonic::Status> {
        unimplemented!()
    }
    pub async fn delete_volume(
        &self,
        volume_id: &str,
        secrets: HashMap<String, String>,
    ) -> Result<(), tonic::Status> {
        unimplemented!()
    }
}
