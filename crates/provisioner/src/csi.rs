//! The CSI driver as the provisioner sees it (`docs/upstream/upstream-external-provisioner.md`
//! §2 steps 10-14): what the capabilities read at start-up mean to it, and the Controller and
//! Node calls it makes (CreateVolume, DeleteVolume, GetCapacity, NodeGetInfo).
//!
//! The calls are the kit's timed client's ([`Client`], over `plugreg_csi_core`'s client): each
//! carries the `--timeout` deadline (as `grpc-timeout` and as a local timer), is made once
//! (the controller retries on its own terms), fails with its [`CallError`] and is reported to
//! `csi_sidecar_operations_seconds`. Messages are bounded to
//! [`MAX_MESSAGE_SIZE`](plugreg_transport::MAX_MESSAGE_SIZE) both ways. Connecting, probing,
//! the name, the capability reads and the exit on connection loss are every controller
//! sidecar's ([`plugreg_sidecar_kit::driver`]).

use std::collections::HashMap;
use std::time::Duration;

use plugreg_csi_core::client::CallError;
use plugreg_proto::csi::v1::{
    CreateVolumeRequest, CreateVolumeResponse, DeleteVolumeRequest, GetCapacityRequest,
    GetCapacityResponse, NodeGetInfoRequest, NodeGetInfoResponse, Topology,
};
use plugreg_sidecar_kit::csi::{self as kit, Client, ControllerRpc, PluginService};

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

impl From<&kit::Capabilities> for Capabilities {
    /// What GetPluginCapabilities and ControllerGetCapabilities mean to the provisioner.
    fn from(read: &kit::Capabilities) -> Self {
        Self {
            controller_service: read.has_service(PluginService::ControllerService),
            accessibility_constraints: read
                .has_service(PluginService::VolumeAccessibilityConstraints),
            create_delete_volume: read.has_rpc(ControllerRpc::CreateDeleteVolume),
            publish_unpublish_volume: read.has_rpc(ControllerRpc::PublishUnpublishVolume),
            single_node_multi_writer: read.has_rpc(ControllerRpc::SingleNodeMultiWriter),
            create_delete_snapshot: read.has_rpc(ControllerRpc::CreateDeleteSnapshot),
            clone_volume: read.has_rpc(ControllerRpc::CloneVolume),
            modify_volume: read.has_rpc(ControllerRpc::ModifyVolume),
        }
    }
}

/// The driver's Controller and Node calls, each within `--timeout` and counted in the metrics.
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct Driver {
    client: Client,
}

impl Driver {
    /// The calls on `client` (the one [`identify`](plugreg_sidecar_kit::driver::identify)
    /// returns: `--timeout`, the metrics).
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// The `--timeout` deadline of every call.
    pub fn timeout(&self) -> Duration {
        self.client.timeout()
    }

    /// CreateVolume within the timeout; `migrated`: for a claim of an in-tree class (the
    /// metrics label).
    pub async fn create_volume(
        &self,
        req: CreateVolumeRequest,
        migrated: bool,
    ) -> Result<CreateVolumeResponse, CallError> {
        self.client
            .timed_as(
                CREATE_VOLUME,
                Some(migrated),
                &req,
                self.client.connection().create_volume(&req),
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
        self.client
            .timed_as(
                DELETE_VOLUME,
                Some(migrated),
                &req,
                self.client.connection().delete_volume(&req),
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
        let conn = self.client.connection();
        let ctl = conn.controller();
        let call = conn.call("GetCapacity", &req, |r| {
            let mut ctl = ctl.clone();
            async move { ctl.get_capacity(r).await }
        });
        self.client.timed(GET_CAPACITY, &req, call).await
    }

    /// NodeGetInfo within the timeout (`--node-deployment` asks it once at start, on the same
    /// socket).
    pub async fn node_info(&self) -> Result<NodeGetInfoResponse, CallError> {
        self.client
            .timed(
                NODE_GET_INFO,
                &NodeGetInfoRequest {},
                self.client.connection().node_get_info(),
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use plugreg_csi_test_driver::{DriverConfig, Failure, Fault, Method, RunningDriver};
    use plugreg_proto::csi::v1::{VolumeCapability, volume_capability};
    use plugreg_sidecar_kit::driver::{
        CapabilityReads, CsiError, Identified, Identify, IdentifyError, UNKNOWN_DRIVER, connect,
        connect_watched, identify, shown_address, socket_path,
    };
    use std::convert::Infallible;
    use std::path::PathBuf;
    use std::sync::Arc;
    use tonic::Code;
    use tonic::transport::Channel;

    /// Calls over `ch` within `timeout`.
    fn client(ch: Channel, timeout: Duration) -> Client {
        Client::new(ch, timeout, Arc::new(Metrics::new("test")))
    }

    /// The provisioner's start-up questions.
    const PROVISIONER: Identify = Identify {
        timeout: Duration::from_secs(5),
        startup_deadline: None,
        probe_first: true,
        migration: true,
        capabilities: CapabilityReads::PluginAndController,
        grpc_log: None,
    };

    /// [`identify`] without the sidecar's steps.
    async fn identify_plain(
        ch: &Channel,
        how: &Identify,
    ) -> Result<Identified<()>, IdentifyError<Infallible>> {
        identify(ch, how, |_| {}, async |_, _| Ok(())).await
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

    /// A test driver with `config` on a socket in a temporary directory, and a channel to it.
    async fn started(config: DriverConfig) -> (tempfile::TempDir, RunningDriver, Channel) {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
        let ch = connect(sock.to_str().unwrap(), Duration::from_secs(5))
            .await
            .unwrap();
        (dir, driver, ch)
    }

    fn controller_driver() -> DriverConfig {
        DriverConfig {
            controller: true,
            ..Default::default()
        }
    }

    /// The calls received since `events` was subscribed.
    fn received(
        events: &mut tokio::sync::broadcast::Receiver<plugreg_csi_test_driver::Call>,
    ) -> Vec<Method> {
        std::iter::from_fn(|| events.try_recv().ok())
            .map(|c| c.method)
            .collect()
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
    async fn identify_reads_name_and_capabilities_from_a_real_driver() {
        let config = DriverConfig {
            accessibility_constraints: true,
            controller_publish: true,
            ..controller_driver()
        };
        let mut events = config.calls.subscribe();
        let (_dir, _driver, ch) = started(config).await;
        let mut named = None;
        let found = identify(
            &ch,
            &PROVISIONER,
            |name| named = Some(name.to_owned()),
            async |name, metrics| Ok::<_, ()>((name.to_owned(), Arc::clone(metrics))),
        )
        .await
        .unwrap();
        assert_eq!(found.name, "csi.plugreg.test");
        assert_eq!(named.as_deref(), Some("csi.plugreg.test"));
        // `ready` gets the registry the client counts in.
        assert_eq!(found.ready.0, "csi.plugreg.test");
        assert!(Arc::ptr_eq(&found.ready.1, found.client.metrics()));
        assert_eq!(
            Capabilities::from(&found.capabilities),
            Capabilities {
                controller_service: true,
                accessibility_constraints: true,
                create_delete_volume: true,
                publish_unpublish_volume: true,
                ..Capabilities::default()
            }
        );
        assert_eq!(
            received(&mut events),
            [
                Method::Probe,
                Method::GetPluginInfo,
                Method::GetPluginCapabilities,
                Method::ControllerGetCapabilities
            ]
        );
        // The calls before the name count as `unknown-driver`, the later ones as the driver.
        let text = found.client.metrics().render();
        assert!(
            text.contains(&format!("driver_name=\"{UNKNOWN_DRIVER}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/GetPluginInfo\"")),
            "{text}"
        );
        assert!(
            text.contains("driver_name=\"csi.plugreg.test\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/ControllerGetCapabilities\""),
            "{text}"
        );
    }

    /// A CSI-migration target: a second Probe loop on a fresh registry with the `migrated`
    /// label (the calls before it stay with the old one).
    #[tokio::test]
    async fn identify_reprobes_a_migration_target_on_a_migrated_registry() {
        let config = DriverConfig {
            name: "pd.csi.storage.gke.io".into(),
            ..controller_driver()
        };
        let mut events = config.calls.subscribe();
        let (_dir, _driver, ch) = started(config).await;
        let found = identify_plain(&ch, &PROVISIONER).await.unwrap();
        assert_eq!(
            received(&mut events),
            [
                Method::Probe,
                Method::GetPluginInfo,
                Method::Probe,
                Method::GetPluginCapabilities,
                Method::ControllerGetCapabilities
            ]
        );
        let text = found.client.metrics().render();
        assert!(!text.contains(UNKNOWN_DRIVER), "{text}");
        assert!(!text.contains("GetPluginInfo"), "{text}");
        assert!(
            text.contains("driver_name=\"pd.csi.storage.gke.io\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/Probe\",migrated=\"false\""),
            "{text}"
        );
        // Without `migration` (the snapshotter) the driver is not probed twice.
        let how = Identify {
            migration: false,
            ..PROVISIONER
        };
        identify_plain(&ch, &how).await.unwrap();
        assert_eq!(
            received(&mut events),
            [
                Method::Probe,
                Method::GetPluginInfo,
                Method::GetPluginCapabilities,
                Method::ControllerGetCapabilities
            ]
        );
    }

    /// The snapshotter's order: the name, `ready` (its HTTP server), then the Probe; only
    /// ControllerGetCapabilities.
    #[tokio::test]
    async fn identify_can_probe_after_ready_and_read_the_controller_only() {
        let config = controller_driver();
        let calls = config.calls.clone();
        let mut events = config.calls.subscribe();
        let (_dir, _driver, ch) = started(config).await;
        let how = Identify {
            probe_first: false,
            migration: false,
            capabilities: CapabilityReads::Controller,
            ..PROVISIONER
        };
        let found = identify(
            &ch,
            &how,
            |_| {},
            async |_, _| Ok::<_, ()>(calls.count(Method::Probe)),
        )
        .await
        .unwrap();
        assert_eq!(found.ready, 0, "no Probe before `ready`");
        assert!(found.capabilities.plugin.is_empty());
        assert!(
            found
                .capabilities
                .has_rpc(ControllerRpc::CreateDeleteVolume)
        );
        assert_eq!(
            received(&mut events),
            [
                Method::GetPluginInfo,
                Method::Probe,
                Method::ControllerGetCapabilities
            ]
        );
    }

    /// The attacher's and the resizer's reads: no ControllerGetCapabilities without
    /// CONTROLLER_SERVICE; a failing `ready` ends it before the capabilities.
    #[tokio::test]
    async fn identify_skips_the_controller_without_its_service_and_stops_at_ready() {
        let config = DriverConfig::default();
        let calls = config.calls.clone();
        let (_dir, _driver, ch) = started(config).await;
        let how = Identify {
            startup_deadline: Some(Duration::from_secs(1)),
            capabilities: CapabilityReads::PluginThenControllerService,
            ..PROVISIONER
        };
        let found = identify_plain(&ch, &how).await.unwrap();
        assert!(
            !found
                .capabilities
                .has_service(PluginService::ControllerService)
        );
        assert!(found.capabilities.controller.is_empty());
        assert_eq!(calls.count(Method::ControllerGetCapabilities), 0);
        let err = identify(&ch, &how, |_| {}, async |_, _| Err::<(), _>(7))
            .await
            .unwrap_err();
        assert!(matches!(err, IdentifyError::Ready(7)), "{err}");
        assert_eq!(calls.count(Method::GetPluginCapabilities), 1);
    }

    /// Capabilities answered after the shared deadline are a failure of the read that did not
    /// make it (the attacher's 1 s for both).
    #[tokio::test]
    async fn identify_shares_the_startup_deadline_between_the_capability_reads() {
        let mut config = controller_driver();
        config.faults.insert(
            Method::ControllerGetCapabilities,
            Fault {
                delay: Some(Duration::from_millis(1500)),
                ..Default::default()
            },
        );
        let (_dir, _driver, ch) = started(config).await;
        let how = Identify {
            startup_deadline: Some(Duration::from_secs(1)),
            capabilities: CapabilityReads::PluginThenControllerService,
            timeout: Duration::from_secs(60),
            ..PROVISIONER
        };
        let err = identify_plain(&ch, &how).await.unwrap_err();
        assert!(
            matches!(err, IdentifyError::ControllerCapabilities(_)),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "rpc error: code = DeadlineExceeded desc = context deadline exceeded"
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
        let driver = Driver::new(client(ch, Duration::from_secs(5)));
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
        let mut config = controller_driver();
        config.faults.insert(
            Method::CreateVolume,
            Fault {
                hang: true,
                ..Default::default()
            },
        );
        let (_dir, _driver, ch) = started(config).await;
        let driver = Driver::new(client(ch, Duration::from_millis(200)));
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
        let config = DriverConfig {
            name: String::new(),
            ..controller_driver()
        };
        let (_dir, _driver, ch) = started(config).await;
        assert!(matches!(
            identify_plain(&ch, &PROVISIONER).await,
            Err(IdentifyError::Name(CsiError::EmptyName))
        ));
    }

    #[tokio::test]
    async fn capabilities_fail_without_a_controller_service() {
        let (_dir, _driver, ch) = started(DriverConfig::default()).await;
        let err = identify_plain(&ch, &PROVISIONER).await.unwrap_err();
        assert!(
            matches!(err, IdentifyError::ControllerCapabilities(_)),
            "{err}"
        );
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
        let name = client(ch, Duration::from_secs(5)).plugin_name().await;
        assert_eq!(name.unwrap(), "csi.plugreg.test");
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
        let (_dir, _driver, ch) = started(config).await;
        client(ch, Duration::from_secs(5))
            .probe_forever()
            .await
            .unwrap();
        assert_eq!(calls.count(Method::Probe), 3);
    }

    #[tokio::test]
    async fn probe_unimplemented_is_fatal() {
        let mut config = controller_driver();
        config.faults.insert(
            Method::Probe,
            Fault {
                error: Some(Failure::new(Code::Unimplemented, "no probe")),
                ..Default::default()
            },
        );
        let (_dir, _driver, ch) = started(config).await;
        let err = client(ch, Duration::from_secs(5))
            .probe_forever()
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
            let client = client(ch.clone(), Duration::from_secs(5));
            tokio::spawn(async move { client.probe_forever().await })
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
        let c = client(connected.channel.clone(), Duration::from_secs(5));
        c.plugin_name().await.unwrap();
        assert!(!connected.lost.is_closed());
        driver.stop().await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), connected.lost.wait())
            .await
            .expect("the loss is signalled");
    }
}
