//! A configurable fake CSI driver for tests and demos.
//!
//! It serves CSI `Identity` (GetPluginInfo, GetPluginCapabilities, Probe), `Node` (every RPC)
//! and, when asked, the volume part of `Controller` (CreateVolume, DeleteVolume,
//! ControllerGetCapabilities) on a Unix socket. Every answer comes from a [`DriverConfig`].
//! Stage and publish make real bind mounts when the driver runs as root and plain directories
//! otherwise (see [`MountMode`]); the checks follow the error codes the CSI spec requires. Any
//! method can be made slow, failing or hanging through a [`Fault`], for every call or only for
//! the first few. [`Calls`] counts the calls and streams them as [`Call`] events, so a test can
//! wait for and assert on what its peer did. With [`DriverConfig::volume_condition`] it reports
//! each volume's health, which a test turns abnormal and back while the driver runs
//! ([`RunningDriver::set_condition`], [`Conditions`]). With [`DriverConfig::group_snapshots`] it
//! also serves the CSI `GroupController` (volume group snapshots whose members are ordinary
//! snapshots of the driver).
//!
//! ```no_run
//! # async fn demo() -> Result<(), plugreg_csi_test_driver::Error> {
//! use std::time::Duration;
//! use plugreg_csi_test_driver::{DriverConfig, Fault, start};
//!
//! let config = DriverConfig {
//!     name: "csi.example.com".into(),
//!     // The first two GetPluginInfo calls take 2 s each.
//!     get_plugin_info: Fault {
//!         delay: Some(Duration::from_secs(2)),
//!         delay_first: Some(2),
//!         ..Fault::default()
//!     },
//!     ..DriverConfig::default()
//! };
//! let driver = start(config, "/tmp/csi.sock".as_ref()).await?;
//! // ... drive the code under test ...
//! assert!(driver.calls().get_plugin_info() >= 1);
//! driver.stop().await
//! # }
//! ```

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use plugreg_proto::csi::v1::controller_server::ControllerServer;
use plugreg_proto::csi::v1::group_controller_server::GroupControllerServer;
use plugreg_proto::csi::v1::identity_server::{Identity, IdentityServer};
use plugreg_proto::csi::v1::node_server::NodeServer;
use plugreg_proto::csi::v1::{
    ControllerExpandVolumeRequest, ControllerModifyVolumeRequest, ControllerPublishVolumeRequest,
    ControllerUnpublishVolumeRequest, CreateSnapshotRequest, CreateVolumeGroupSnapshotRequest,
    CreateVolumeRequest, DeleteSnapshotRequest, DeleteVolumeGroupSnapshotRequest,
    DeleteVolumeRequest, GetCapacityRequest, GetPluginCapabilitiesRequest,
    GetPluginCapabilitiesResponse, GetPluginInfoRequest, GetPluginInfoResponse, PluginCapability,
    ProbeRequest, ProbeResponse, VolumeCondition, node_service_capability, plugin_capability,
};
use plugreg_transport::{BoundSocket, MAX_MESSAGE_SIZE};
use tokio::sync::{Notify, broadcast};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Router;
use tonic::{Request, Response};

mod snapshots;
mod volumes;

pub use node_service_capability::rpc::Type as NodeCapability;
pub use volumes::{MountMode, PUBLISHED_DEVICE, valid_volume_id};

/// How long a stopping driver waits for open connections to close before dropping them.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
pub use tonic::Code;

/// What went wrong while running the driver.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket could not be created.
    #[error("failed to create the driver socket")]
    Bind(#[source] plugreg_transport::Error),
    /// The gRPC server failed.
    #[error("the driver's gRPC server failed")]
    Serve(#[source] plugreg_transport::Error),
    /// The serving task panicked or was aborted.
    #[error("the driver task ended abnormally")]
    Join(#[source] tokio::task::JoinError),
    /// A topology list is not `key=value[,key=value...]`.
    #[error("invalid topology {0:?}: expected key=value[,key=value...]")]
    Topology(String),
}

/// A gRPC error to answer with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The status code.
    pub code: Code,
    /// The status message.
    pub message: String,
}

impl Failure {
    /// A failure with `code` and `message`.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    fn status(&self) -> tonic::Status {
        tonic::Status::new(self.code, self.message.clone())
    }
}

/// The error used by [`Fault::fail_first`] when [`Fault::error`] is not set.
pub fn injected_failure() -> Failure {
    Failure::new(Code::Unavailable, "injected failure")
}

/// How one RPC misbehaves. The default answers at once and successfully.
///
/// For each call, in this order: a hanging call never answers (until the driver stops, then
/// it fails with UNAVAILABLE); a delayed call waits [`delay`](Self::delay); a failing call
/// answers with an error instead of the configured response.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fault {
    /// Wait this long before answering.
    pub delay: Option<Duration>,
    /// Delay only the first N calls; `None` delays every call.
    pub delay_first: Option<u64>,
    /// Answer with this error.
    pub error: Option<Failure>,
    /// Fail only the first N calls; `None` fails every call when [`error`](Self::error) is set.
    /// When this is set and `error` is not, the calls fail with [`injected_failure`].
    pub fail_first: Option<u64>,
    /// Fail only the calls after the first N (the first N answer as configured): a second
    /// page that fails after a first that did not. Takes [`error`](Self::error), else
    /// [`injected_failure`].
    pub fail_after: Option<u64>,
    /// Never answer.
    pub hang: bool,
}

/// What a call with the given 0-based index should do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Plan {
    delay: Option<Duration>,
    error: Option<Failure>,
    hang: bool,
}

impl Fault {
    fn plan(&self, index: u64) -> Plan {
        let within = |first: Option<u64>| first.is_none_or(|n| index < n);
        let delay = self.delay.filter(|_| within(self.delay_first));
        let error = match (&self.error, self.fail_first, self.fail_after) {
            (e, _, Some(n)) => (index >= n).then(|| e.clone().unwrap_or_else(injected_failure)),
            (Some(e), first, None) if within(first) => Some(e.clone()),
            (None, Some(n), None) if index < n => Some(injected_failure()),
            _ => None,
        };
        Plan {
            delay,
            error,
            hang: self.hang,
        }
    }
}

/// The RPCs the driver serves (the Controller ones only with [`DriverConfig::controller`], the
/// GroupController ones only with [`DriverConfig::group_snapshots`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Method {
    /// `/csi.v1.Identity/GetPluginInfo`
    GetPluginInfo,
    /// `/csi.v1.Identity/GetPluginCapabilities`
    GetPluginCapabilities,
    /// `/csi.v1.Identity/Probe`
    Probe,
    /// `/csi.v1.Node/NodeGetCapabilities`
    NodeGetCapabilities,
    /// `/csi.v1.Node/NodeGetInfo`
    NodeGetInfo,
    /// `/csi.v1.Node/NodeStageVolume`
    NodeStageVolume,
    /// `/csi.v1.Node/NodeUnstageVolume`
    NodeUnstageVolume,
    /// `/csi.v1.Node/NodePublishVolume`
    NodePublishVolume,
    /// `/csi.v1.Node/NodeUnpublishVolume`
    NodeUnpublishVolume,
    /// `/csi.v1.Node/NodeGetVolumeStats`
    NodeGetVolumeStats,
    /// `/csi.v1.Node/NodeExpandVolume`
    NodeExpandVolume,
    /// `/csi.v1.Controller/CreateVolume`
    CreateVolume,
    /// `/csi.v1.Controller/DeleteVolume`
    DeleteVolume,
    /// `/csi.v1.Controller/ControllerGetCapabilities`
    ControllerGetCapabilities,
    /// `/csi.v1.Controller/ControllerPublishVolume`
    ControllerPublishVolume,
    /// `/csi.v1.Controller/ControllerUnpublishVolume`
    ControllerUnpublishVolume,
    /// `/csi.v1.Controller/ListVolumes`
    ListVolumes,
    /// `/csi.v1.Controller/ControllerExpandVolume`
    ControllerExpandVolume,
    /// `/csi.v1.Controller/ControllerModifyVolume`
    ControllerModifyVolume,
    /// `/csi.v1.Controller/CreateSnapshot`
    CreateSnapshot,
    /// `/csi.v1.Controller/DeleteSnapshot`
    DeleteSnapshot,
    /// `/csi.v1.Controller/ListSnapshots`
    ListSnapshots,
    /// `/csi.v1.Controller/GetSnapshot`
    GetSnapshot,
    /// `/csi.v1.Controller/GetCapacity`
    GetCapacity,
    /// `/csi.v1.Controller/ControllerGetVolume`
    ControllerGetVolume,
    /// `/csi.v1.GroupController/GroupControllerGetCapabilities`
    GroupControllerGetCapabilities,
    /// `/csi.v1.GroupController/CreateVolumeGroupSnapshot`
    CreateVolumeGroupSnapshot,
    /// `/csi.v1.GroupController/DeleteVolumeGroupSnapshot`
    DeleteVolumeGroupSnapshot,
    /// `/csi.v1.GroupController/GetVolumeGroupSnapshot`
    GetVolumeGroupSnapshot,
}

impl Method {
    /// Every method, in declaration order.
    pub const ALL: [Method; 29] = [
        Method::GetPluginInfo,
        Method::GetPluginCapabilities,
        Method::Probe,
        Method::NodeGetCapabilities,
        Method::NodeGetInfo,
        Method::NodeStageVolume,
        Method::NodeUnstageVolume,
        Method::NodePublishVolume,
        Method::NodeUnpublishVolume,
        Method::NodeGetVolumeStats,
        Method::NodeExpandVolume,
        Method::CreateVolume,
        Method::DeleteVolume,
        Method::ControllerGetCapabilities,
        Method::ControllerPublishVolume,
        Method::ControllerUnpublishVolume,
        Method::ListVolumes,
        Method::ControllerExpandVolume,
        Method::ControllerModifyVolume,
        Method::CreateSnapshot,
        Method::DeleteSnapshot,
        Method::ListSnapshots,
        Method::GetSnapshot,
        Method::GetCapacity,
        Method::ControllerGetVolume,
        Method::GroupControllerGetCapabilities,
        Method::CreateVolumeGroupSnapshot,
        Method::DeleteVolumeGroupSnapshot,
        Method::GetVolumeGroupSnapshot,
    ];

    /// The method name, e.g. `GetPluginInfo`.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::GetPluginInfo => "GetPluginInfo",
            Method::GetPluginCapabilities => "GetPluginCapabilities",
            Method::Probe => "Probe",
            Method::NodeGetCapabilities => "NodeGetCapabilities",
            Method::NodeGetInfo => "NodeGetInfo",
            Method::NodeStageVolume => "NodeStageVolume",
            Method::NodeUnstageVolume => "NodeUnstageVolume",
            Method::NodePublishVolume => "NodePublishVolume",
            Method::NodeUnpublishVolume => "NodeUnpublishVolume",
            Method::NodeGetVolumeStats => "NodeGetVolumeStats",
            Method::NodeExpandVolume => "NodeExpandVolume",
            Method::CreateVolume => "CreateVolume",
            Method::DeleteVolume => "DeleteVolume",
            Method::ControllerGetCapabilities => "ControllerGetCapabilities",
            Method::ControllerPublishVolume => "ControllerPublishVolume",
            Method::ControllerUnpublishVolume => "ControllerUnpublishVolume",
            Method::ListVolumes => "ListVolumes",
            Method::ControllerExpandVolume => "ControllerExpandVolume",
            Method::ControllerModifyVolume => "ControllerModifyVolume",
            Method::CreateSnapshot => "CreateSnapshot",
            Method::DeleteSnapshot => "DeleteSnapshot",
            Method::ListSnapshots => "ListSnapshots",
            Method::GetSnapshot => "GetSnapshot",
            Method::GetCapacity => "GetCapacity",
            Method::ControllerGetVolume => "ControllerGetVolume",
            Method::GroupControllerGetCapabilities => "GroupControllerGetCapabilities",
            Method::CreateVolumeGroupSnapshot => "CreateVolumeGroupSnapshot",
            Method::DeleteVolumeGroupSnapshot => "DeleteVolumeGroupSnapshot",
            Method::GetVolumeGroupSnapshot => "GetVolumeGroupSnapshot",
        }
    }

    /// The method named `name` (as [`as_str`](Self::as_str) spells it).
    pub fn from_name(name: &str) -> Option<Method> {
        Method::ALL.into_iter().find(|m| m.as_str() == name)
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One call as it arrived, with what the driver is going to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// Which RPC.
    pub method: Method,
    /// 1 for the first call of this method, 2 for the second, ...
    pub number: u64,
    /// How long the answer is delayed.
    pub delay: Option<Duration>,
    /// The error it will answer with, if any.
    pub error: Option<Failure>,
    /// Whether it will never be answered.
    pub hang: bool,
}

/// Call counters and a stream of [`Call`] events, shared (cheap to clone) between the driver and
/// whoever watches it. A call is counted and published when it arrives, before any delay.
#[derive(Debug, Clone)]
pub struct Calls {
    inner: Arc<CallsInner>,
}

#[derive(Debug)]
struct CallsInner {
    counts: [AtomicU64; Method::ALL.len()],
    /// When the last [`KEEP_REQUESTS`] calls of each method arrived.
    arrivals: [Mutex<std::collections::VecDeque<std::time::Instant>>; Method::ALL.len()],
    changed: Notify,
    events: broadcast::Sender<Call>,
    /// The last [`KEEP_REQUESTS`] CreateVolume and DeleteVolume requests.
    creates: Mutex<std::collections::VecDeque<CreateVolumeRequest>>,
    deletes: Mutex<std::collections::VecDeque<DeleteVolumeRequest>>,
    /// The last [`KEEP_REQUESTS`] ControllerPublishVolume and ControllerUnpublishVolume
    /// requests.
    publishes: Mutex<std::collections::VecDeque<ControllerPublishVolumeRequest>>,
    unpublishes: Mutex<std::collections::VecDeque<ControllerUnpublishVolumeRequest>>,
    /// The last [`KEEP_REQUESTS`] ControllerExpandVolume and ControllerModifyVolume requests.
    expands: Mutex<std::collections::VecDeque<ControllerExpandVolumeRequest>>,
    modifies: Mutex<std::collections::VecDeque<ControllerModifyVolumeRequest>>,
    /// The last [`KEEP_REQUESTS`] CreateSnapshot and DeleteSnapshot requests.
    create_snapshots: Mutex<std::collections::VecDeque<CreateSnapshotRequest>>,
    delete_snapshots: Mutex<std::collections::VecDeque<DeleteSnapshotRequest>>,
    /// The last [`KEEP_REQUESTS`] CreateVolumeGroupSnapshot and DeleteVolumeGroupSnapshot
    /// requests.
    create_group_snapshots: Mutex<std::collections::VecDeque<CreateVolumeGroupSnapshotRequest>>,
    delete_group_snapshots: Mutex<std::collections::VecDeque<DeleteVolumeGroupSnapshotRequest>>,
    /// The last [`KEEP_REQUESTS`] GetCapacity requests.
    get_capacities: Mutex<std::collections::VecDeque<GetCapacityRequest>>,
    /// The volume ids of the last [`KEEP_REQUESTS`] ControllerGetVolume requests.
    get_volumes: Mutex<std::collections::VecDeque<String>>,
}

/// How many CreateVolume / DeleteVolume requests [`Calls`] keeps for inspection.
pub const KEEP_REQUESTS: usize = 1024;

fn keep<T>(q: &Mutex<std::collections::VecDeque<T>>, item: T) {
    let mut q = q.lock().unwrap_or_else(|e| e.into_inner());
    if q.len() == KEEP_REQUESTS {
        q.pop_front();
    }
    q.push_back(item);
}

impl Default for Calls {
    fn default() -> Self {
        Self {
            inner: Arc::new(CallsInner {
                counts: Default::default(),
                arrivals: Default::default(),
                changed: Notify::new(),
                events: broadcast::Sender::new(256),
                creates: Mutex::default(),
                deletes: Mutex::default(),
                publishes: Mutex::default(),
                unpublishes: Mutex::default(),
                expands: Mutex::default(),
                modifies: Mutex::default(),
                create_snapshots: Mutex::default(),
                delete_snapshots: Mutex::default(),
                create_group_snapshots: Mutex::default(),
                delete_group_snapshots: Mutex::default(),
                get_capacities: Mutex::default(),
                get_volumes: Mutex::default(),
            }),
        }
    }
}

impl Calls {
    /// Calls of `method` so far.
    pub fn count(&self, method: Method) -> u64 {
        self.inner.counts[method.index()].load(Ordering::SeqCst)
    }

    /// GetPluginInfo calls so far.
    pub fn get_plugin_info(&self) -> u64 {
        self.count(Method::GetPluginInfo)
    }

    /// NodeGetInfo calls so far.
    pub fn node_get_info(&self) -> u64 {
        self.count(Method::NodeGetInfo)
    }

    /// The CreateVolume requests received (the last [`KEEP_REQUESTS`]), oldest first.
    pub fn create_requests(&self) -> Vec<CreateVolumeRequest> {
        let q = self.inner.creates.lock().unwrap_or_else(|e| e.into_inner());
        q.iter().cloned().collect()
    }

    /// The CreateSnapshot requests received (the last [`KEEP_REQUESTS`]), oldest first.
    pub fn create_snapshot_requests(&self) -> Vec<CreateSnapshotRequest> {
        let q = self.inner.create_snapshots.lock();
        q.unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// The DeleteSnapshot requests received (the last [`KEEP_REQUESTS`]), oldest first.
    pub fn delete_snapshot_requests(&self) -> Vec<DeleteSnapshotRequest> {
        let q = self.inner.delete_snapshots.lock();
        q.unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    pub(crate) fn keep_create_snapshot(&self, r: &CreateSnapshotRequest) {
        keep(&self.inner.create_snapshots, r.clone());
    }

    pub(crate) fn keep_delete_snapshot(&self, r: &DeleteSnapshotRequest) {
        keep(&self.inner.delete_snapshots, r.clone());
    }

    /// The CreateVolumeGroupSnapshot requests received (the last [`KEEP_REQUESTS`]), oldest
    /// first.
    pub fn create_group_snapshot_requests(&self) -> Vec<CreateVolumeGroupSnapshotRequest> {
        let q = self.inner.create_group_snapshots.lock();
        q.unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// The DeleteVolumeGroupSnapshot requests received (the last [`KEEP_REQUESTS`]), oldest
    /// first.
    pub fn delete_group_snapshot_requests(&self) -> Vec<DeleteVolumeGroupSnapshotRequest> {
        let q = self.inner.delete_group_snapshots.lock();
        q.unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    pub(crate) fn keep_create_group_snapshot(&self, r: &CreateVolumeGroupSnapshotRequest) {
        keep(&self.inner.create_group_snapshots, r.clone());
    }

    pub(crate) fn keep_delete_group_snapshot(&self, r: &DeleteVolumeGroupSnapshotRequest) {
        keep(&self.inner.delete_group_snapshots, r.clone());
    }

    /// The volume ids of the ControllerGetVolume requests received (the last
    /// [`KEEP_REQUESTS`]), oldest first.
    pub fn get_volume_requests(&self) -> Vec<String> {
        let q = self
            .inner
            .get_volumes
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        q.iter().cloned().collect()
    }

    pub(crate) fn keep_get_volume(&self, volume_id: &str) {
        keep(&self.inner.get_volumes, volume_id.to_owned());
    }

    /// The DeleteVolume requests received (the last [`KEEP_REQUESTS`]), oldest first.
    pub fn delete_requests(&self) -> Vec<DeleteVolumeRequest> {
        let q = self.inner.deletes.lock().unwrap_or_else(|e| e.into_inner());
        q.iter().cloned().collect()
    }

    /// The ControllerPublishVolume requests received (the last [`KEEP_REQUESTS`]), oldest
    /// first.
    pub fn publish_requests(&self) -> Vec<ControllerPublishVolumeRequest> {
        let q = self
            .inner
            .publishes
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        q.iter().cloned().collect()
    }

    /// The ControllerUnpublishVolume requests received (the last [`KEEP_REQUESTS`]), oldest
    /// first.
    pub fn unpublish_requests(&self) -> Vec<ControllerUnpublishVolumeRequest> {
        let q = self
            .inner
            .unpublishes
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        q.iter().cloned().collect()
    }

    pub(crate) fn keep_publish(&self, r: &ControllerPublishVolumeRequest) {
        keep(&self.inner.publishes, r.clone());
    }

    pub(crate) fn keep_unpublish(&self, r: &ControllerUnpublishVolumeRequest) {
        keep(&self.inner.unpublishes, r.clone());
    }

    pub(crate) fn keep_create(&self, r: &CreateVolumeRequest) {
        keep(&self.inner.creates, r.clone());
    }

    pub(crate) fn keep_delete(&self, r: &DeleteVolumeRequest) {
        keep(&self.inner.deletes, r.clone());
    }

    /// The ControllerExpandVolume requests received (the last [`KEEP_REQUESTS`]), oldest first.
    pub fn expand_requests(&self) -> Vec<ControllerExpandVolumeRequest> {
        let q = self.inner.expands.lock().unwrap_or_else(|e| e.into_inner());
        q.iter().cloned().collect()
    }

    /// The ControllerModifyVolume requests received (the last [`KEEP_REQUESTS`]), oldest first.
    pub fn modify_requests(&self) -> Vec<ControllerModifyVolumeRequest> {
        let q = self
            .inner
            .modifies
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        q.iter().cloned().collect()
    }

    /// The GetCapacity requests received (the last [`KEEP_REQUESTS`]), oldest first.
    pub fn get_capacity_requests(&self) -> Vec<GetCapacityRequest> {
        let q = self
            .inner
            .get_capacities
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        q.iter().cloned().collect()
    }

    pub(crate) fn keep_get_capacity(&self, r: &GetCapacityRequest) {
        keep(&self.inner.get_capacities, r.clone());
    }

    pub(crate) fn keep_expand(&self, r: &ControllerExpandVolumeRequest) {
        keep(&self.inner.expands, r.clone());
    }

    pub(crate) fn keep_modify(&self, r: &ControllerModifyVolumeRequest) {
        keep(&self.inner.modifies, r.clone());
    }

    /// Every call from now on, as it arrives.
    pub fn subscribe(&self) -> broadcast::Receiver<Call> {
        self.inner.events.subscribe()
    }

    /// Waits until at least `n` calls of `method` have arrived.
    pub async fn wait_for(&self, method: Method, n: u64) {
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.count(method) >= n {
                return;
            }
            changed.await;
        }
    }

    /// When the calls of `method` arrived (the last [`KEEP_REQUESTS`]), oldest first: to
    /// measure the spacing of a peer's retries.
    pub fn arrivals(&self, method: Method) -> Vec<std::time::Instant> {
        let q = self.inner.arrivals[method.index()].lock();
        q.unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect()
    }

    /// Counts a call, notes when it arrived and returns its 0-based index.
    fn record(&self, method: Method) -> u64 {
        keep(
            &self.inner.arrivals[method.index()],
            std::time::Instant::now(),
        );
        self.inner.counts[method.index()].fetch_add(1, Ordering::SeqCst)
    }

    fn publish(&self, call: Call) {
        self.inner.changed.notify_waiters();
        // Nobody listening is fine.
        let _ = self.inner.events.send(call);
    }
}

/// Everything the driver answers. The defaults describe a healthy driver named
/// `csi.plugreg.test` on node `node-1`.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    /// GetPluginInfo `name` (may be empty or invalid, to test the peer).
    pub name: String,
    /// GetPluginInfo `vendor_version`.
    pub vendor_version: String,
    /// GetPluginInfo `manifest`.
    pub manifest: BTreeMap<String, String>,
    /// Whether GetPluginCapabilities lists VOLUME_ACCESSIBILITY_CONSTRAINTS.
    pub accessibility_constraints: bool,
    /// Probe `ready`.
    pub ready: bool,
    /// NodeGetInfo `node_id` (may be empty).
    pub node_id: String,
    /// NodeGetInfo topology segments; empty means no `accessible_topology`.
    pub topology: BTreeMap<String, String>,
    /// NodeGetInfo `max_volumes_per_node`.
    pub max_volumes_per_node: i64,
    /// NodeGetCapabilities RPC capabilities.
    pub node_capabilities: Vec<NodeCapability>,
    /// How GetPluginInfo misbehaves.
    pub get_plugin_info: Fault,
    /// How NodeGetInfo misbehaves.
    pub node_get_info: Fault,
    /// How the other methods misbehave (for GetPluginInfo and NodeGetInfo an entry here wins
    /// over the two fields above).
    pub faults: BTreeMap<Method, Fault>,
    /// Serve the Controller service (CreateVolume, DeleteVolume, ControllerGetCapabilities with
    /// CREATE_DELETE_VOLUME; UNIMPLEMENTED for the rest) and list CONTROLLER_SERVICE.
    pub controller: bool,
    /// Like csi-test's mock driver, refuse NodeStageVolume and NodePublishVolume without
    /// `publish_context["device"]` (INVALID_ARGUMENT); with [`controller`](Self::controller)
    /// also advertise PUBLISH_UNPUBLISH_VOLUME and serve ControllerPublishVolume (publish_context
    /// `{"device": "/dev/plugreg-test"}`) and ControllerUnpublishVolume.
    pub controller_publish: bool,
    /// With [`controller`](Self::controller): also advertise LIST_VOLUMES and
    /// LIST_VOLUMES_PUBLISHED_NODES and serve ListVolumes (every volume with the nodes it is
    /// ControllerPublished to, `max_entries` per page, the next index as the token).
    pub list_volumes: bool,
    /// With [`list_volumes`](Self::list_volumes): answer at most this many entries a page
    /// whatever `max_entries` asks (the spec lets a plugin return fewer), as drivers with many
    /// volumes do. `None`: `max_entries`, all when it is 0.
    pub list_volumes_page: Option<usize>,
    /// Report volume conditions (the health external-health-monitor watches). With
    /// [`controller`](Self::controller): advertise the controller capabilities VOLUME_CONDITION
    /// and GET_VOLUME, serve ControllerGetVolume (the volume with its capacity, the nodes it is
    /// ControllerPublished to and its condition; an unknown volume is NOT_FOUND) and put the
    /// condition into ListVolumes' entries (ListVolumes itself still needs
    /// [`list_volumes`](Self::list_volumes)). On the node side, when
    /// [`node_capabilities`](Self::node_capabilities) has GET_VOLUME_STATS: advertise the node
    /// capability VOLUME_CONDITION and put the condition into NodeGetVolumeStats (listing
    /// VOLUME_CONDITION in `node_capabilities` does the same for the node alone). Each
    /// volume's condition comes from [`conditions`](Self::conditions).
    pub volume_condition: bool,
    /// With [`volume_condition`](Self::volume_condition): leave the condition out for a healthy
    /// volume instead of reporting `{abnormal: false, message: ""}`, as the spec allows and as
    /// some drivers answer (external-health-monitor takes a missing condition as healthy).
    pub omit_healthy_condition: bool,
    /// With [`volume_condition`](Self::volume_condition): leave GET_VOLUME out of the
    /// controller capabilities and answer ControllerGetVolume UNIMPLEMENTED, for a driver that
    /// reports conditions through ListVolumes only (or, without
    /// [`list_volumes`](Self::list_volumes), one that advertises VOLUME_CONDITION but neither
    /// way to read it).
    pub no_get_volume: bool,
    /// Which volumes are abnormal, and why. Clone it before handing the config over (or use
    /// [`RunningDriver::set_condition`]) to turn a volume abnormal and back while the driver
    /// runs.
    pub conditions: Conditions,
    /// Check the paths the CO must provide before anything else about the volume, as csi-test's
    /// mock driver and csi-driver-host-path do: NodeStageVolume with a staging_target_path that
    /// does not exist, and NodePublishVolume with a target_path whose parent does not exist or
    /// (when staging) a staging_target_path that does not exist, are INTERNAL, even for an
    /// unknown volume. Without it the volume is looked up first.
    pub strict_paths: bool,
    /// Volumes that exist from the start (pre-provisioned), by id; see [`valid_volume_id`].
    pub volumes: Vec<String>,
    /// Where volumes live (`<dir>/<volume id>`); `None`: `<socket>.volumes` beside the socket.
    pub data_dir: Option<PathBuf>,
    /// Keep the volumes in [`data_dir`](Self::data_dir) as a real driver keeps them in its
    /// backing store: every instance sharing the directory (a controller plugin and node
    /// plugins, a restarted driver) knows every volume, CreateVolume uses the name as the id,
    /// unpublish and unstage unmount what another instance mounted, and stopping leaves the
    /// mounts in place. Off: volumes live in this instance's memory (ids `pv-1`, `pv-2`, ...)
    /// and its mounts are undone when it stops.
    pub persistent: bool,
    /// Bind mounts or plain directories.
    pub mount: MountMode,
    /// Capacity of a volume created without a size, and of pre-provisioned volumes.
    pub default_capacity: i64,
    /// CreateVolume refuses more than this with OUT_OF_RANGE (0: no limit); so does
    /// ControllerExpandVolume.
    pub max_capacity: i64,
    /// With [`controller`](Self::controller): advertise the controller capability
    /// EXPAND_VOLUME and serve ControllerExpandVolume (the volume must exist; it grows to
    /// `required_bytes`, never shrinks).
    pub controller_expand: bool,
    /// ControllerExpandVolume's `node_expansion_required`.
    pub node_expansion_required: bool,
    /// With [`controller`](Self::controller): advertise MODIFY_VOLUME and serve
    /// ControllerModifyVolume (the volume must exist; a mutable parameter named `invalid` is
    /// INVALID_ARGUMENT, as a driver refuses what it cannot apply).
    pub controller_modify: bool,
    /// Also advertise SINGLE_NODE_MULTI_WRITER.
    pub single_node_multi_writer: bool,
    /// Also advertise PUBLISH_READONLY (the driver honours ControllerPublishVolume's
    /// `readonly`).
    pub publish_readonly: bool,
    /// With [`controller`](Self::controller): advertise CREATE_DELETE_SNAPSHOT, LIST_SNAPSHOTS
    /// and GET_SNAPSHOT, serve them (a snapshot is a copy of its volume's directory), and accept
    /// a snapshot as CreateVolume's content source (the new volume starts as its copy).
    pub snapshots: bool,
    /// With [`snapshots`](Self::snapshots): do not advertise LIST_SNAPSHOTS, and answer
    /// ListSnapshots UNIMPLEMENTED (a driver that can only create and delete).
    pub no_list_snapshots: bool,
    /// CreateSnapshot answers `ready_to_use: false` this many times for a new snapshot before
    /// it is ready (a restore from it is UNAVAILABLE until then).
    pub snapshot_ready_after: u32,
    /// Serve the GroupController service on the same socket and list GROUP_CONTROLLER_SERVICE:
    /// GroupControllerGetCapabilities answers CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT, and
    /// Create, Delete and GetVolumeGroupSnapshot keep groups whose members are snapshots of this
    /// driver (with [`snapshots`](Self::snapshots) they show in ListSnapshots and GetSnapshot
    /// and restore like any other). Off: the service is not served (UNIMPLEMENTED).
    pub group_snapshots: bool,
    /// CreateVolumeGroupSnapshot answers `ready_to_use: false` (for the group and each member)
    /// this many times for a new group before it is ready; each GetVolumeGroupSnapshot of the
    /// group counts as an answer too. Its members are not ready in ListSnapshots and GetSnapshot,
    /// nor usable as a restore source (UNAVAILABLE), until then.
    pub group_ready_after: u32,
    /// With [`controller`](Self::controller): advertise CLONE_VOLUME and accept another volume
    /// as CreateVolume's content source (the new volume starts as its copy).
    pub clone_volume: bool,
    /// What CreateVolume does with a restore or clone that asks for less than its source holds.
    /// The default is the strictest correct answer, a refusal; the others are the lenient
    /// answers of real drivers, for tests that need them.
    pub smaller_than_source: SmallerThanSource,
    /// The storage pools GetCapacity reports; with any pool the Controller advertises
    /// GET_CAPACITY, and CreateVolume takes its volumes out of the pool of this driver's own
    /// [`topology`](Self::topology) (RESOURCE_EXHAUSTED when it has too little left). Clone it
    /// before handing the config over to change the pools while the driver runs.
    pub capacity: Capacity,
    /// A file holding the size in bytes of the pool of this driver's own topology segment,
    /// read at every GetCapacity and CreateVolume (a missing or unreadable file: the
    /// [`capacity`](Self::capacity) pools alone): a pool an operator grows while the driver
    /// runs, as a cluster test does from the host. Set, it also advertises GET_CAPACITY.
    pub capacity_file: Option<PathBuf>,
    /// A fault of a driver that breaks the spec: CreateVolume reports this capacity instead of
    /// the volume's (0: unknown; less than required: a volume too small).
    pub reported_capacity: Option<i64>,
    /// A fault of a driver that breaks the spec: CreateVolume's answer leaves out the content
    /// source it was asked for (the volume still starts as its copy).
    pub omit_content_source: bool,
    /// Where calls are counted; clone it before handing the config over to watch the driver.
    pub calls: Calls,
    /// Where each answered call is written down with its times ([`CallLog`]), for a benchmark
    /// that lines the driver's own time up with the API server's audit log.
    pub call_log: Option<CallLog>,
}

/// An append-only file with one line per call the driver answered:
/// `<start µs> <end µs> <method>` (microseconds since the Unix epoch, the method as
/// [`Method::as_str`] spells it). Several drivers may share one file: each line is one
/// `write` to a file opened for appending, so lines never interleave. Cheap to clone.
#[derive(Debug, Clone)]
pub struct CallLog {
    file: Arc<std::fs::File>,
}

impl CallLog {
    /// Opens (creating) `path` for appending.
    pub fn open(path: &Path) -> std::io::Result<CallLog> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(CallLog {
            file: Arc::new(file),
        })
    }

    fn write(&self, method: Method, start: SystemTime, end: SystemTime) {
        use std::io::Write as _;
        let micros = |t: SystemTime| t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros());
        let line = format!("{} {} {method}\n", micros(start), micros(end));
        // A benchmark's aid: a full disk loses a line, never a call.
        if let Err(e) = (&*self.file).write_all(line.as_bytes()) {
            tracing::warn!(error = %e, "writing the call log");
        }
    }
}

/// One call being answered: written to the [`CallLog`], if there is one, when the handler
/// returns and drops it.
struct CallTimer<'a> {
    log: Option<&'a CallLog>,
    method: Method,
    start: SystemTime,
}

impl Drop for CallTimer<'_> {
    fn drop(&mut self) {
        if let Some(log) = self.log {
            log.write(self.method, self.start, SystemTime::now());
        }
    }
}

impl Default for DriverConfig {
    fn default() -> Self {
        Self {
            name: "csi.plugreg.test".into(),
            vendor_version: "0.1.0".into(),
            manifest: BTreeMap::new(),
            accessibility_constraints: false,
            ready: true,
            node_id: "node-1".into(),
            topology: BTreeMap::new(),
            max_volumes_per_node: 0,
            node_capabilities: Vec::new(),
            get_plugin_info: Fault::default(),
            node_get_info: Fault::default(),
            faults: BTreeMap::new(),
            controller: false,
            controller_publish: false,
            list_volumes: false,
            list_volumes_page: None,
            volume_condition: false,
            omit_healthy_condition: false,
            no_get_volume: false,
            conditions: Conditions::default(),
            strict_paths: false,
            volumes: Vec::new(),
            data_dir: None,
            persistent: false,
            mount: MountMode::Auto,
            default_capacity: 1 << 30,
            max_capacity: 0,
            controller_expand: false,
            node_expansion_required: false,
            controller_modify: false,
            single_node_multi_writer: false,
            publish_readonly: false,
            snapshots: false,
            no_list_snapshots: false,
            snapshot_ready_after: 0,
            group_snapshots: false,
            group_ready_after: 0,
            clone_volume: false,
            smaller_than_source: SmallerThanSource::Refuse,
            capacity: Capacity::default(),
            capacity_file: None,
            reported_capacity: None,
            omit_content_source: false,
            calls: Calls::default(),
            call_log: None,
        }
    }
}

/// The volumes' conditions as [`DriverConfig::volume_condition`] reports them, shared (cheap to
/// clone) between the driver and whoever changes them. Every volume is healthy until it is
/// made abnormal. A condition belongs to a volume id, not to a volume: it may be set before the
/// volume exists and outlives its deletion (a volume made again under the same id has it too).
#[derive(Debug, Clone, Default)]
pub struct Conditions {
    /// Abnormal volumes by id, with their message.
    abnormal: Arc<Mutex<BTreeMap<String, String>>>,
}

impl Conditions {
    /// Makes `volume_id` abnormal with `message` (`Some`), or healthy again (`None`).
    pub fn set(&self, volume_id: impl Into<String>, abnormal: Option<&str>) {
        let mut m = self.lock();
        match abnormal {
            Some(message) => {
                m.insert(volume_id.into(), message.to_owned());
            }
            None => {
                m.remove(&volume_id.into());
            }
        }
    }

    /// The message of `volume_id` when it is abnormal; `None` when it is healthy.
    pub fn abnormal(&self, volume_id: &str) -> Option<String> {
        self.lock().get(volume_id).cloned()
    }

    /// The condition the driver reports for `volume_id`: `None` for a healthy volume when
    /// `omit_healthy`.
    pub(crate) fn report(&self, volume_id: &str, omit_healthy: bool) -> Option<VolumeCondition> {
        match self.abnormal(volume_id) {
            Some(message) => Some(VolumeCondition {
                abnormal: true,
                message,
            }),
            None if omit_healthy => None,
            None => Some(VolumeCondition::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        self.abnormal.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A driver's storage pools, one per topology segment, shared (cheap to clone) between the
/// driver and whoever changes them. GetCapacity for a segment answers what its pool holds less
/// what CreateVolume has taken from it; a segment without a pool has none.
#[derive(Debug, Clone, Default)]
pub struct Capacity {
    inner: Arc<Mutex<CapacityPools>>,
}

#[derive(Debug, Default)]
struct CapacityPools {
    /// Pools by segment, sorted by key (a `BTreeMap` is).
    pools: Vec<(BTreeMap<String, String>, i64)>,
    maximum_volume_size: Option<i64>,
    minimum_volume_size: Option<i64>,
}

impl Capacity {
    /// Pools of `bytes` for each of `segments`.
    pub fn with_pools(
        segments: impl IntoIterator<Item = (BTreeMap<String, String>, i64)>,
    ) -> Capacity {
        let c = Capacity::default();
        for (segment, bytes) in segments {
            c.set(segment, bytes);
        }
        c
    }

    /// Sets the pool of `segment` to `bytes` (in all: volumes already taken from it stay taken).
    pub fn set(&self, segment: BTreeMap<String, String>, bytes: i64) {
        let mut p = self.lock();
        match p.pools.iter_mut().find(|(s, _)| *s == segment) {
            Some((_, b)) => *b = bytes,
            None => p.pools.push((segment, bytes)),
        }
    }

    /// GetCapacity's `maximum_volume_size` and `minimum_volume_size` (`None`: not reported).
    /// CreateVolume refuses sizes outside them (OUT_OF_RANGE).
    pub fn set_volume_size_limits(&self, minimum: Option<i64>, maximum: Option<i64>) {
        let mut p = self.lock();
        p.minimum_volume_size = minimum;
        p.maximum_volume_size = maximum;
    }

    /// Whether any pool is set (the driver then advertises GET_CAPACITY).
    pub fn is_tracked(&self) -> bool {
        !self.lock().pools.is_empty()
    }

    /// The pool of `segment`, if it has one.
    pub(crate) fn pool(&self, segment: &BTreeMap<String, String>) -> Option<i64> {
        self.lock()
            .pools
            .iter()
            .find(|(s, _)| s == segment)
            .map(|(_, b)| *b)
    }

    pub(crate) fn limits(&self) -> (Option<i64>, Option<i64>) {
        let p = self.lock();
        (p.minimum_volume_size, p.maximum_volume_size)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CapacityPools> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What CreateVolume does when `required_bytes` is less than its content source holds (the
/// snapshot's size, or the source volume's capacity). The CSI spec names OUT_OF_RANGE for
/// "trying to create a volume smaller than the source snapshot"; drivers differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SmallerThanSource {
    /// OUT_OF_RANGE, naming both sizes, as a strict driver answers (csi-driver-host-path
    /// answers INVALID_ARGUMENT). A request without a size still gets the source's size.
    #[default]
    Refuse,
    /// Lenient: the volume quietly gets the source's size, more than was asked for.
    Grow,
    /// Lenient and wrong: the volume gets the size asked for, smaller than the data it starts
    /// with (csi-test's mock driver ignores the source's size).
    Accept,
}

/// Parses a topology list `key=value[,key=value...]`; an empty string is an empty map.
pub fn parse_topology(list: &str) -> Result<BTreeMap<String, String>, Error> {
    let mut segments = BTreeMap::new();
    for item in list.split(',').filter(|s| !s.is_empty()) {
        match item.split_once('=') {
            Some((k, v)) if !k.is_empty() => {
                segments.insert(k.to_owned(), v.to_owned());
            }
            _ => return Err(Error::Topology(list.to_owned())),
        }
    }
    Ok(segments)
}

/// The gRPC services (Identity, Node and, with [`DriverConfig::controller`], Controller; with
/// [`DriverConfig::group_snapshots`], GroupController)
/// answering from `config`. Hanging and delayed calls give up with UNAVAILABLE when `token` is
/// cancelled, so a server shutdown never waits on them. Volumes live in `config.data_dir`, or
/// in the current directory's `csi-test-driver.volumes` when it is unset.
pub fn router(config: DriverConfig, token: CancellationToken) -> Router {
    build(config, token).0
}

fn build(mut config: DriverConfig, token: CancellationToken) -> (Router, Driver) {
    let data_dir = config
        .data_dir
        .take()
        .unwrap_or_else(|| PathBuf::from("csi-test-driver.volumes"));
    let state = volumes::State::with_volumes(&config.volumes, config.default_capacity);
    let driver = Driver {
        config: Arc::new(config),
        token,
        data_dir,
        state: Arc::new(Mutex::new(state)),
    };
    let mut router = plugreg_transport::server()
        .add_service(
            IdentityServer::new(driver.clone())
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
        )
        .add_service(
            NodeServer::new(driver.clone())
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
        );
    if driver.config.controller {
        router = router.add_service(
            ControllerServer::new(driver.clone())
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
        );
    }
    if driver.config.group_snapshots {
        router = router.add_service(
            GroupControllerServer::new(driver.clone())
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
        );
    }
    (router, driver)
}

/// Creates the socket at `socket` (replacing a stale one) and serves until `token` is
/// cancelled (then at most [`SHUTDOWN_GRACE`] more); the socket is removed on return.
pub async fn serve(
    config: DriverConfig,
    socket: &Path,
    token: CancellationToken,
) -> Result<(), Error> {
    let bound = plugreg_transport::bind(socket).map_err(Error::Bind)?;
    serve_bound(config, bound, token).await
}

/// Serves on an already bound socket until `token` is cancelled; the socket is removed on
/// return.
pub async fn serve_bound(
    mut config: DriverConfig,
    socket: BoundSocket,
    token: CancellationToken,
) -> Result<(), Error> {
    if config.data_dir.is_none() {
        let mut name = socket.path().file_name().unwrap_or_default().to_owned();
        name.push(".volumes");
        config.data_dir = Some(socket.path().with_file_name(name));
    }
    let (router, driver) = build(config, token.clone());
    let result = serve_router(router, socket, token).await;
    // Whatever happened, leave no mount behind.
    driver.unmount_all();
    result
}

async fn serve_router(
    router: Router,
    socket: BoundSocket,
    token: CancellationToken,
) -> Result<(), Error> {
    let serving = plugreg_transport::serve(router, socket, token.clone().cancelled_owned());
    tokio::pin!(serving);
    tokio::select! {
        result = &mut serving => return result.map_err(Error::Serve),
        _ = token.cancelled() => {}
    }
    // Clients that keep their connections open must not hold the shutdown up: after a grace
    // period the server is dropped, which closes them and removes the socket all the same.
    match tokio::time::timeout(SHUTDOWN_GRACE, serving).await {
        Ok(result) => result.map_err(Error::Serve),
        Err(_) => Ok(()),
    }
}

/// Binds the socket now (it is listening when this returns) and serves in a background task.
pub async fn start(config: DriverConfig, socket: &Path) -> Result<RunningDriver, Error> {
    let bound = plugreg_transport::bind(socket).map_err(Error::Bind)?;
    let calls = config.calls.clone();
    let conditions = config.conditions.clone();
    let token = CancellationToken::new();
    let task = tokio::spawn(serve_bound(config, bound, token.clone()));
    Ok(RunningDriver {
        path: socket.to_owned(),
        calls,
        conditions,
        token,
        task: Some(task),
    })
}

/// A driver serving in the background, from [`start`]. Dropping it stops the driver.
#[derive(Debug)]
pub struct RunningDriver {
    path: PathBuf,
    calls: Calls,
    conditions: Conditions,
    token: CancellationToken,
    task: Option<JoinHandle<Result<(), Error>>>,
}

impl RunningDriver {
    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The driver's call counters.
    pub fn calls(&self) -> &Calls {
        &self.calls
    }

    /// The volumes' conditions ([`DriverConfig::conditions`]).
    pub fn conditions(&self) -> &Conditions {
        &self.conditions
    }

    /// Makes `volume_id` abnormal with `message` (`Some`), or healthy again (`None`), from the
    /// next call on (see [`DriverConfig::volume_condition`]).
    pub fn set_condition(&self, volume_id: &str, abnormal: Option<&str>) {
        self.conditions.set(volume_id, abnormal);
    }

    /// Stops serving, removes the socket and waits for the server to finish.
    pub async fn stop(mut self) -> Result<(), Error> {
        self.token.cancel();
        match self.task.take() {
            Some(task) => task.await.map_err(Error::Join)?,
            None => Ok(()),
        }
    }
}

impl Drop for RunningDriver {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

#[derive(Debug, Clone)]
struct Driver {
    config: Arc<DriverConfig>,
    token: CancellationToken,
    data_dir: PathBuf,
    state: Arc<Mutex<volumes::State>>,
}

impl Driver {
    fn fault(&self, method: Method) -> Option<&Fault> {
        self.config.faults.get(&method).or(match method {
            Method::GetPluginInfo => Some(&self.config.get_plugin_info),
            Method::NodeGetInfo => Some(&self.config.node_get_info),
            _ => None,
        })
    }

    /// Counts and publishes a call, then carries out its fault plan. The handler keeps the
    /// timer until it answers ([`CallLog`]).
    async fn enter(&self, method: Method) -> Result<CallTimer<'_>, tonic::Status> {
        let timer = CallTimer {
            log: self.config.call_log.as_ref(),
            method,
            start: SystemTime::now(),
        };
        let index = self.config.calls.record(method);
        let plan = self
            .fault(method)
            .map(|f| f.plan(index))
            .unwrap_or_default();
        tracing::debug!(%method, number = index + 1, ?plan, "CSI call");
        self.config.calls.publish(Call {
            method,
            number: index + 1,
            delay: plan.delay,
            error: plan.error.clone(),
            hang: plan.hang,
        });
        let stopped = || tonic::Status::unavailable("the driver is stopping");
        if plan.hang {
            self.token.cancelled().await;
            return Err(stopped());
        }
        if let Some(delay) = plan.delay {
            tokio::select! {
                _ = self.token.cancelled() => return Err(stopped()),
                _ = tokio::time::sleep(delay) => {}
            }
        }
        match plan.error {
            Some(e) => Err(e.status()),
            None => Ok(timer),
        }
    }
}

fn to_map(m: &BTreeMap<String, String>) -> HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

#[tonic::async_trait]
impl Identity for Driver {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, tonic::Status> {
        let _call = self.enter(Method::GetPluginInfo).await?;
        Ok(Response::new(GetPluginInfoResponse {
            name: self.config.name.clone(),
            vendor_version: self.config.vendor_version.clone(),
            manifest: to_map(&self.config.manifest),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, tonic::Status> {
        let _call = self.enter(Method::GetPluginCapabilities).await?;
        use plugin_capability::service::Type;
        let service = |t: Type| PluginCapability {
            r#type: Some(plugin_capability::Type::Service(
                plugin_capability::Service { r#type: t as i32 },
            )),
        };
        let capabilities = [
            (self.config.controller, Type::ControllerService),
            (
                self.config.accessibility_constraints,
                Type::VolumeAccessibilityConstraints,
            ),
            (self.config.group_snapshots, Type::GroupControllerService),
        ]
        .into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, t)| service(t))
        .collect();
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn probe(
        &self,
        _: Request<ProbeRequest>,
    ) -> Result<Response<ProbeResponse>, tonic::Status> {
        let _call = self.enter(Method::Probe).await?;
        Ok(Response::new(ProbeResponse {
            ready: Some(self.config.ready),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_plans_follow_the_first_n_limits() {
        let ms = Duration::from_millis;
        let err = Failure::new(Code::Internal, "boom");
        let cases: Vec<(Fault, Vec<Plan>)> = vec![
            (Fault::default(), vec![Plan::default(); 3]),
            (
                Fault {
                    delay: Some(ms(5)),
                    ..Fault::default()
                },
                vec![
                    Plan {
                        delay: Some(ms(5)),
                        ..Plan::default()
                    };
                    3
                ],
            ),
            (
                Fault {
                    delay: Some(ms(5)),
                    delay_first: Some(2),
                    ..Fault::default()
                },
                vec![
                    Plan {
                        delay: Some(ms(5)),
                        ..Plan::default()
                    },
                    Plan {
                        delay: Some(ms(5)),
                        ..Plan::default()
                    },
                    Plan::default(),
                ],
            ),
            (
                Fault {
                    error: Some(err.clone()),
                    ..Fault::default()
                },
                vec![
                    Plan {
                        error: Some(err.clone()),
                        ..Plan::default()
                    };
                    3
                ],
            ),
            (
                Fault {
                    error: Some(err.clone()),
                    fail_first: Some(1),
                    ..Fault::default()
                },
                vec![
                    Plan {
                        error: Some(err.clone()),
                        ..Plan::default()
                    },
                    Plan::default(),
                    Plan::default(),
                ],
            ),
            (
                Fault {
                    fail_first: Some(2),
                    ..Fault::default()
                },
                vec![
                    Plan {
                        error: Some(injected_failure()),
                        ..Plan::default()
                    },
                    Plan {
                        error: Some(injected_failure()),
                        ..Plan::default()
                    },
                    Plan::default(),
                ],
            ),
        ];
        for (fault, plans) in cases {
            let got: Vec<Plan> = (0..3).map(|i| fault.plan(i)).collect();
            assert_eq!(got, plans, "{fault:?}");
        }
    }

    #[test]
    fn parses_topology_lists() {
        assert!(parse_topology("").unwrap().is_empty());
        let t = parse_topology("zone=a,rack=r1").unwrap();
        assert_eq!(t.get("zone").map(String::as_str), Some("a"));
        assert_eq!(t.get("rack").map(String::as_str), Some("r1"));
        assert_eq!(
            parse_topology("k=").unwrap().get("k").map(String::as_str),
            Some("")
        );
        for bad in ["zone", "=a", "zone=a,rack"] {
            assert!(parse_topology(bad).is_err(), "{bad:?}");
        }
    }
}
