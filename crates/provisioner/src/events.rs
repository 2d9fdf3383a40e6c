//! placeholder
#![allow(missing_docs, unused)]
use k8s_openapi::api::core::v1::ObjectReference;
#[derive(Debug, Clone, Copy)]
pub enum EventType {
    Normal,
    Warning,
}
#[derive(Debug, Clone)]
pub struct Recorder;
impl Recorder {
    pub fn start(
        client: kube::Client,
        component: &str,
        host: &str,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Recorder {
        Recorder
    }
    pub fn event(&self, object: &ObjectReference, t: EventType, reason: &str, message: &str) {}
}
