//! placeholder
#![allow(missing_docs, unused)]
use crate::request::{Prepared, RequestOptions};
use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use plugreg_proto::csi::v1::CreateVolumeResponse;
pub enum PvError {
    TooSmall { capacity: i64, requested: i64 },
    MissingContentSource,
}
pub fn build(
    prepared: &Prepared,
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    driver: &str,
    identity: &str,
    response: &CreateVolumeResponse,
    opts: &RequestOptions,
) -> Result<PersistentVolume, PvError> {
    unimplemented!()
}
pub fn claim_ref(claim: &PersistentVolumeClaim) -> ObjectReference {
    unimplemented!()
}
