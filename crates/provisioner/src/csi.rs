//! The CSI driver as the provisioner sees it (`docs/upstream/upstream-external-provisioner.md` §2 steps 10-14):
//! connecting to its socket within a window, probing it until it is ready, its name and
//! capabilities, and the two Controller calls the provisioner makes (CreateVolume,
//! DeleteVolume).
//!
//! The calls are `plugreg_csi_core`'s client's: each carries the `--timeout` deadline (as
//! `grpc-timeout` and as a local timer), is made once (the controller retries on its own terms)
//! and fails with its [`CallError`]; here each is also reported to [`Metrics::csi_call`].
//! Messages are bounded to [`MAX_MESSAGE_SIZE`](plugreg_transport::MAX_MESSAGE_SIZE) both ways.
//!
//! Connection loss: upstream exits 1 once the driver connection is lost after start-up. Here
//! [`connect_watched`] hands back a [`ConnectionLost`] that resolves when the transport under the
//! channel ends (the driver closed it or died); `main` selects on it and calls
//! [`exit_on_connection_loss`].

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use plugreg_csi_core::client::{CallError, Connection};
use plugreg_proto::csi::v1::{
    CreateVolumeRequest, CreateVolumeResponse, DeleteVolumeRequest, GetCapacityRequest,
    GetCapacityResponse, NodeGetInfoResponse, Topology, controller_service_capability,
    plugin_capability,
};
use tonic::transport::Channel;

use crate::metrics::Metrics;

pub use plugreg_sidecar_kit::driver::{
    CONNECT_WINDOW, Connected, ConnectionLost, CsiError, LOST_MESSAGE, PROBE, TERMINATION_LOG,
    connect, connect_watched, connection, exit_on_connection_loss, probe_forever,
    report_connection_loss, shown_address, socket_path,
};

/// `/csi.v1.Identity/GetPluginInfo`.
pub const GET_PLUGIN_INFO: &str = "/csi.v1.Identity/GetPluginInfo";
/// `/csi.v1.Identity/GetPluginCapabilities`.
pub const GET_PLUGIN_CAPABILITIES: &str = "/csi.v1.Identity/GetPluginCapabilities";
/// `/csi.v1.Controller/ControllerGetCapabilities`.
pub const CONTROLLER_GET_CAPABILITIES: &str = "/csi.v1.Controller/ControllerGetCapabilities";
/// `/csi.v1.Controller/CreateVolume`.
pub const CREATE_VOLUME: &str = "/csi.v1.Controller/CreateVolume";
/// `/csi.v1.Controller/DeleteVolume`.
pub const DELETE_VOLUME: &str = "/csi.v1.Controller/DeleteVolume";
/// `/csi.v1.Controller/GetCapacity`.
pub const GET_CAPACITY: &str = "/csi.v1.Controller/GetCapacity";
/// `/csi.v1.Node/NodeGetInfo`.
pub const NODE_GET_INFO: &str = "/csi.v1.Node/NodeGetInfo";

/// What the driver can do (read once at start, never refreshed, as upstream).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// Plugin capability CONTROLLER_SERVICE.
    pub controller_service: bool,
    /// Plugin capability VOLUME_ACCESSIBILITY_CONSTRAINTS.
    pub accessibility_constraints: bool,
    /// Controller capability CREATE_DELETE_VOLUME.
    pub create_delete_volume: bool,
    /// Controller capability PUBLISH_UNPUBLISH_VOLUME.
    pub publish_unpublish_volume: bool,
    /// Controller capability SINGLE_NODE_MULTI_WRITER.
    pub single_node_multi_writer: bool,
    /// Controller capability CREATE_DELETE_SNAPSHOT.
    pub create_delete_snapshot: bool,
    /// Controller capability CLONE_VOLUME.
    pub clone_volume: bool,
    /// Controller capability MODIFY_VOLUME.
    pub modify_volume: bool,
}

/// The driver's Identity and Controller calls, each within `--timeout` and counted in the
/// metrics. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Driver {
    conn: Connection,
    metrics: Arc<Metrics>,
}

impl Driver {
    /// Calls over `ch`, each within `timeout`, reported to `metrics`.
    pub fn new(ch: Channel, timeout: Duration, metrics: Arc<Metrics>) -> Self {
        Self {
            conn: connection(&ch, timeout),
            metrics,
        }
    }

    /// The `--timeout` deadline of every call.
    pub fn timeout(&self) -> Duration {
        self.conn.timeout()
    }

    /// GetPluginInfo: the driver name (the provisioner name); an empty one is an error.
    pub async fn plugin_info(&self) -> Result<String, CsiError> {
        let info = timed(
            &self.metrics,
            GET_PLUGIN_INFO,
            None,
            self.conn.get_plugin_info(),
        )
        .await
        .map_err(CsiError::Call)?;
        if info.name.is_empty() {
            return Err(CsiError::EmptyName);
        }
        Ok(info.name)
    }

    /// GetPluginCapabilities, then ControllerGetCapabilities (each within the timeout).
    pub async fn capabilities(&self) -> Result<Capabilities, CsiError> {
        let plugin = timed(
            &self.metrics,
            GET_PLUGIN_CAPABILITIES,
            None,
            self.conn.get_plugin_capabilities(),
        )
        .await
        .map_err(CsiError::Call)?;
        let ctrl = timed(
            &self.metrics,
            CONTROLLER_GET_CAPABILITIES,
            None,
            self.conn.controller_get_capabilities(),
        )
        .await
        .map_err(CsiError::Call)?;
        let mut caps = Capabilities::default();
        use plugin_capability::service::Type as P;
        for cap in &plugin.capabilities {
            if let Some(plugin_capability::Type::Service(s)) = &cap.r#type {
                match P::try_from(s.r#type) {
                    Ok(P::ControllerService) => caps.controller_service = true,
                    Ok(P::VolumeAccessibilityConstraints) => caps.accessibility_constraints = true,
                    _ => {}
                }
            }
        }
        use controller_service_capability::rpc::Type as C;
        for cap in &ctrl.capabilities {
            let Some(controller_service_capability::Type::Rpc(rpc)) = &cap.r#type else {
                continue;
            };
            match C::try_from(rpc.r#type) {
                Ok(C::CreateDeleteVolume) => caps.create_delete_volume = true,
                Ok(C::PublishUnpublishVolume) => caps.publish_unpublish_volume = true,
                Ok(C::SingleNodeMultiWriter) => caps.single_node_multi_writer = true,
                Ok(C::CreateDeleteSnapshot) => caps.create_delete_snapshot = true,
                Ok(C::CloneVolume) => caps.clone_volume = true,
                Ok(C::ModifyVolume) => caps.modify_volume = true,
                _ => {}
            }
        }
        Ok(caps)
    }

    /// CreateVolume within the timeout; `migrated`: for a claim of an in-tree class (the
    /// metrics label).
    pub async fn create_volume(
        &self,
        req: CreateVolumeRequest,
        migrated: bool,
    ) -> Result<CreateVolumeResponse, CallError> {
        timed(
            &self.metrics,
            CREATE_VOLUME,
            Some(migrated),
            self.conn.create_volume(&req),
        )
        .await
    }

    /// DeleteVolume within the timeout; `migrated`: of an in-tree PV (the metrics label).
    pub async fn delete_volume(
        &self,
        volume_id: &str,
        secrets: HashMap<String, String>,
        migrated: bool,
    ) -> Result<(), CallError> {
        let req = DeleteVolumeRequest {
            volume_id: volume_id.to_owned(),
            secrets,
        };
        timed(
            &self.metrics,
            DELETE_VOLUME,
            Some(migrated),
            self.conn.delete_volume(&req),
        )
        .await
        .map(drop)
    }
}

impl Driver {
    /// GetCapacity as capacity tracking asks it (§A.9.1): the class's parameters unfiltered, no
    /// capabilities, the segment as the topology (present even when empty), within the timeout.
    pub async fn get_capacity(
        &self,
        segment: &std::collections::BTreeMap<String, String>,
        parameters: HashMap<String, String>,
    ) -> Result<GetCapacityResponse, CallError> {
        self.get_capacity_with(GetCapacityRequest {
            volume_capabilities: Vec::new(),
            parameters,
            accessible_topology: Some(Topology {
                segments: segment.clone().into_iter().collect(),
            }),
        })
        .await
    }

    /// GetCapacity with `req` as it is, within the timeout (`--node-deployment`'s check before
    /// it takes a claim asks with the claim's capabilities and filtered parameters).
    pub async fn get_capacity_with(
        &self,
        req: GetCapacityRequest,
    ) -> Result<GetCapacityResponse, CallError> {
        let conn = self.conn.clone();
        timed(&self.metrics, GET_CAPACITY, None, async move {
            let ctl = conn.controller();
            conn.call("GetCapacity", &req, |r| {
                let mut ctl = ctl.clone();
                async move { ctl.get_capacity(r).await }
            })
            .await
        })
        .await
    }

    /// NodeGetInfo within the timeout (`--node-deployment` asks it once at start, on the same
    /// socket).
    pub async fn node_info(&self) -> Result<NodeGetInfoResponse, CallError> {
        timed(
            &self.metrics,
            NODE_GET_INFO,
            None,
            self.conn.node_get_info(),
        )
        .await
    }
}

/// Runs one call and records it in `csi_sidecar_operations_seconds` (the kit's timing).
/// `migrated` is the `migrated` label of a call for a volume (`true` for a claim of an in-tree
/// class or an in-tree PV), `None` for the others; it shows only for a migration target.
async fn timed<T>(
    metrics: &Metrics,
    method: &str,
    migrated: Option<bool>,
    call: impl Future<Output = Result<T, CallError>>,
) -> Result<T, CallError> {
    metrics
        .timed_csi_call_as(method, migrated, call, CallError::code)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugreg_csi_test_driver::{DriverConfig, Failure, Fault, Method};
    use plugreg_proto::csi::v1::{VolumeCapability, volume_capability};
    use std::path::PathBuf;
    use tonic::Code;

    fn metrics() -> Arc<Metrics> {
        Arc::new(Metrics::new("test"))
    }

    fn mount_capability() -> VolumeCapability {
        VolumeCapability {
            access_type: Some(volume_capability::AccessType::Mount(
                volume_capability::MountVolume::default(),
            )),
            access_mode: Some(volume_capability::AccessMode {
                mode: volume_capability::access_mode::Mode::SingleNodeWriter as i32,
            }),
        }
    }

    fn controller_driver() -> DriverConfig {
        DriverConfig {
            controller: true,
            ..Default::default()
        }
    }

    #[test]
    fn addresses_follow_the_sidecar_rules() {
        assert_eq!(shown_address("/csi/csi.sock"), "unix:///csi/csi.sock");
        assert_eq!(
            shown_address("unix:///csi/csi.sock"),
            "unix:///csi/csi.sock"
        );
        assert_eq!(
            socket_path("unix:///a.sock").unwrap(),
            PathBuf::from("/a.sock")
        );
        let err = socket_path("dns:///csi:1234").unwrap_err();
        assert!(
            err.to_string().contains("only Unix socket addresses"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn reads_name_and_capabilities_from_a_real_driver() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let _driver = plugreg_csi_test_driver::start(
            DriverConfig {
                accessibility_constraints: true,
                controller_publish: true,
                ..controller_driver()
            },
            &sock,
        )
        .await
        .unwrap();
        let ch = connect(sock.to_str().unwrap(), Duration::from_secs(5))
            .await
            .unwrap();
        let driver = Driver::new(ch, Duration::from_secs(5), metrics());
        assert_eq!(driver.plugin_info().await.unwrap(), "csi.plugreg.test");
        let caps = driver.capabilities().await.unwrap();
        assert_eq!(
            caps,
            Capabilities {
                controller_service: true,
                accessibility_constraints: true,
                create_delete_volume: true,
                publish_unpublish_volume: true,
                ..Capabilities::default()
            }
        );
    }

    #[tokio::test]
    async fn creates_and_deletes_a_volume() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let config = controller_driver();
        let calls = config.calls.clone();
        let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
        let ch = connect(
            &format!("unix://{}", sock.display()),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        let driver = Driver::new(ch, Duration::from_secs(5), metrics());
        let created = driver
            .create_volume(
                CreateVolumeRequest {
                    name: "pvc-1".into(),
                    volume_capabilities: vec![mount_capability()],
                    ..Default::default()
                },
                false,
            )
            .await
            .unwrap();
        let id = created.volume.unwrap().volume_id;
        assert!(!id.is_empty());
        driver
            .delete_volume(&id, HashMap::new(), false)
            .await
            .unwrap();
        assert_eq!(calls.count(Method::CreateVolume), 1);
        assert_eq!(calls.count(Method::DeleteVolume), 1);
    }

    #[tokio::test]
    async fn calls_end_at_the_timeout_with_deadline_exceeded() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let mut config = controller_driver();
        config.faults.insert(
            Method::CreateVolume,
            Fault {
                hang: true,
                ..Default::default()
            },
        );
        let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
        let ch = connect(sock.to_str().unwrap(), Duration::from_secs(5))
            .await
            .unwrap();
        let driver = Driver::new(ch, Duration::from_millis(200), metrics());
        let err = driver
            .create_volume(
                CreateVolumeRequest {
                    name: "pvc-1".into(),
                    ..Default::default()
                },
                false,
            )
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(Code::DeadlineExceeded));
    }

    #[tokio::test]
    async fn an_empty_driver_name_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let config = DriverConfig {
            name: String::new(),
            ..controller_driver()
        };
        let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
        let ch = connect(sock.to_str().unwrap(), Duration::from_secs(5))
            .await
            .unwrap();
        let driver = Driver::new(ch, Duration::from_secs(5), metrics());
        assert!(matches!(
            driver.plugin_info().await,
            Err(CsiError::EmptyName)
        ));
    }

    #[tokio::test]
    async fn capabilities_fail_without_a_controller_service() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let _driver = plugreg_csi_test_driver::start(DriverConfig::default(), &sock)
            .await
            .unwrap();
        let ch = connect(sock.to_str().unwrap(), Duration::from_secs(5))
            .await
            .unwrap();
        let driver = Driver::new(ch, Duration::from_secs(5), metrics());
        let err = driver.capabilities().await.unwrap_err();
        assert!(err.to_string().contains("code = Unimplemented"), "{err}");
    }

    #[tokio::test]
    async fn connect_waits_for_a_late_socket() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let address = sock.to_str().unwrap().to_owned();
        let connecting =
            tokio::spawn(async move { connect(&address, Duration::from_secs(20)).await });
        // The first attempt has failed once the task has had a moment; no sleep is needed for
        // correctness: the driver may start before or after it.
        tokio::task::yield_now().await;
        let _driver = plugreg_csi_test_driver::start(controller_driver(), &sock)
            .await
            .unwrap();
        let ch = connecting.await.unwrap().unwrap();
        let driver = Driver::new(ch, Duration::from_secs(5), metrics());
        assert_eq!(driver.plugin_info().await.unwrap(), "csi.plugreg.test");
    }

    #[tokio::test(start_paused = true)]
    async fn connect_gives_up_after_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("absent.sock");
        let err = connect(sock.to_str().unwrap(), Duration::from_secs(3))
            .await
            .unwrap_err();
        assert!(matches!(err, CsiError::Connect { .. }), "{err}");
    }

    #[tokio::test]
    async fn probe_retries_timeouts_then_succeeds() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let mut config = controller_driver();
        config.faults.insert(
            Method::Probe,
            Fault {
                error: Some(Failure::new(Code::DeadlineExceeded, "slow")),
                fail_first: Some(2),
                ..Default::default()
            },
        );
        let calls = config.calls.clone();
        let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
        let ch = connect(sock.to_str().unwrap(), Duration::from_secs(5))
            .await
            .unwrap();
        probe_forever(&ch, Duration::from_secs(5), &Metrics::new("x"))
            .await
            .unwrap();
        assert_eq!(calls.count(Method::Probe), 3);
    }

    #[tokio::test]
    async fn probe_unimplemented_is_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let mut config = controller_driver();
        config.faults.insert(
            Method::Probe,
            Fault {
                error: Some(Failure::new(Code::Unimplemented, "no probe")),
                ..Default::default()
            },
        );
        let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
        let ch = connect(sock.to_str().unwrap(), Duration::from_secs(5))
            .await
            .unwrap();
        let err = probe_forever(&ch, Duration::from_secs(5), &Metrics::new("x"))
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "CSI driver probe failed: rpc error: code = Unimplemented desc = no probe"
        );
    }

    #[tokio::test]
    async fn probe_loops_while_not_ready_and_ends_when_ready() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let not_ready = DriverConfig {
            ready: false,
            ..controller_driver()
        };
        let calls = not_ready.calls.clone();
        let first = plugreg_csi_test_driver::start(not_ready, &sock)
            .await
            .unwrap();
        let ch = connect(sock.to_str().unwrap(), Duration::from_secs(5))
            .await
            .unwrap();
        let probing = {
            let ch = ch.clone();
            tokio::spawn(async move {
                probe_forever(&ch, Duration::from_secs(5), &Metrics::new("x")).await
            })
        };
        calls.wait_for(Method::Probe, 2).await;
        assert!(!probing.is_finished());
        // A ready driver takes over the path atomically (rename over the socket), then the
        // first one goes: the channel redials the path and finds the ready one, never nothing.
        let ready = controller_driver();
        let ready_calls = ready.calls.clone();
        let staged = dir.path().join("ready.sock");
        let _second = plugreg_csi_test_driver::start(ready, &staged)
            .await
            .unwrap();
        std::fs::rename(&staged, &sock).unwrap();
        first.stop().await.unwrap();
        tokio::time::timeout(Duration::from_secs(20), probing)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(ready_calls.count(Method::Probe) >= 1);
    }

    #[tokio::test]
    async fn loss_of_the_driver_fires_the_signal() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let driver = plugreg_csi_test_driver::start(controller_driver(), &sock)
            .await
            .unwrap();
        let connected = connect_watched(sock.to_str().unwrap(), Duration::from_secs(5))
            .await
            .unwrap();
        let d = Driver::new(connected.channel.clone(), Duration::from_secs(5), metrics());
        d.plugin_info().await.unwrap();
        assert!(!connected.lost.is_closed());
        driver.stop().await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), connected.lost.wait())
            .await
            .expect("the loss is signalled");
    }

    #[test]
    fn connection_loss_writes_an_existing_termination_log_only() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("termination-log");
        report_connection_loss(&log);
        assert!(!log.exists(), "never created");
        std::fs::write(&log, "old text that is longer").unwrap();
        report_connection_loss(&log);
        assert_eq!(std::fs::read_to_string(&log).unwrap(), LOST_MESSAGE);
    }
}
