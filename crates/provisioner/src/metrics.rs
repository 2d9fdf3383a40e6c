//! upstream's metrics (`upstream-external-provisioner.md` §17) in the Prometheus text format.
//!
//! API fixed by the lead; bodies to be written (issue 12).

use std::time::Duration;

/// Every metric the provisioner exports. Cheap to share (`Arc<Metrics>`), safe to update from
/// any task.
#[derive(Debug, Default)]
pub struct Metrics {
    driver: String,
}

impl Metrics {
    /// An empty registry for the driver `driver` (the `driver_name` label of the CSI calls).
    pub fn new(driver: &str) -> Self {
        Self {
            driver: driver.to_owned(),
        }
    }

    /// Sets the driver name once it is known (GetPluginInfo answers after the first calls).
    pub fn set_driver(&mut self, driver: &str) {
        self.driver = driver.to_owned();
    }

    /// One CSI call: `method` is the full gRPC path (`/csi.v1.Controller/CreateVolume`),
    /// `code` its status (`Ok` for success; `None` when the call failed without a gRPC status:
    /// `unknown-non-grpc`).
    pub fn csi_call(&self, method: &str, code: Option<tonic::Code>, elapsed: Duration) {
        let _ = (method, code, elapsed, &self.driver);
    }

    /// A claim provisioned (`controller_persistentvolumeclaim_provision_total` and `_duration_seconds`).
    pub fn provision_succeeded(&self, class: &str, source: &str, elapsed: Duration) {
        let _ = (class, source, elapsed);
    }

    /// A provisioning attempt that did not succeed (`..._provision_failed_total`).
    pub fn provision_failed(&self, class: &str, source: &str) {
        let _ = (class, source);
    }

    /// A volume deleted (`controller_persistentvolume_delete_total` and `_duration_seconds`).
    pub fn delete_succeeded(&self, class: &str, elapsed: Duration) {
        let _ = (class, elapsed);
    }

    /// A failed deletion attempt (`controller_persistentvolume_delete_failed_total`).
    pub fn delete_failed(&self, class: &str) {
        let _ = class;
    }

    /// Work-queue metrics (`workqueue_*{name="<queue>"}`): an item was added.
    pub fn queue_add(&self, queue: &str) {
        let _ = queue;
    }

    /// Work-queue metrics: the queue's current depth.
    pub fn queue_depth(&self, queue: &str, depth: usize) {
        let _ = (queue, depth);
    }

    /// Work-queue metrics: an item was re-queued after a failure (`workqueue_retries_total`).
    pub fn queue_retry(&self, queue: &str) {
        let _ = queue;
    }

    /// Work-queue metrics: an item waited `waited` in the queue and took `worked` to process.
    pub fn queue_done(&self, queue: &str, waited: Duration, worked: Duration) {
        let _ = (queue, waited, worked);
    }

    /// `leader_election_master_status{name}`: 1 while this process holds the lease.
    pub fn leader(&self, name: &str, is_leader: bool) {
        let _ = (name, is_leader);
    }

    /// Where `plugreg_kube_requests_total{verb,resource}` comes from: the client's limiter.
    pub fn set_kube_requests(&self, limiter: std::sync::Arc<crate::ratelimit::RateLimiter>) {
        let _ = limiter;
    }

    /// Everything, in the Prometheus text format (version 0.0.4).
    pub fn render(&self) -> String {
        String::new()
    }
}
