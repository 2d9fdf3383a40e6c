//! placeholder
#![allow(missing_docs, unused)]
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::CSINode;
use std::sync::Arc;
pub trait TopologySource {
    fn csinode(&self, name: &str) -> Option<Arc<CSINode>>;
    fn node(&self, name: &str) -> Option<Arc<Node>>;
    fn csinodes(&self) -> Vec<Arc<CSINode>>;
    fn nodes(&self) -> Vec<Arc<Node>>;
}
