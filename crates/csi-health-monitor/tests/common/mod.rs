//! The world a `csi-external-health-monitor-controller` test runs in: its own real
//! kube-apiserver (v1.36.2, or v1.20.2), the test CSI driver reporting volume conditions on a
//! Unix socket in a temp dir, and the sidecar binary as a child process.
//!
//! The tests write what kube-controller-manager and the provisioner would have written for a
//! bound claim (a CSI PersistentVolume and its bound claim): the health monitor only reads
//! them; the events it writes are read back through the API server.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Namespace, PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use plugreg_csi_test_driver::{Calls, DriverConfig, RunningDriver};
use plugreg_testpeers::sidecar::{self, LoggedSidecar};
use plugreg_testpeers::{ApiServer, ApiServerOptions, KubeVersion};
use serde_json::json;
use tempfile::TempDir;

/// How long a test waits for the cluster to get somewhere.
pub const WAIT: Duration = Duration::from_secs(60);
/// The namespace of every test's claims (each test has its own API server).
pub const NS: &str = "health";
/// The driver's name.
pub const DRIVER: &str = "health.csi.plugreg.test";
/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_csi-external-health-monitor-controller");

/// One test's world.
pub struct Env {
    pub api: ApiServer,
    pub client: kube::Client,
    pub dir: TempDir,
    pub driver: RunningDriver,
    pub calls: Calls,
    pub socket: PathBuf,
    /// The log files of the sidecars started, shown when a wait times out.
    pub logs: std::sync::Mutex<Vec<PathBuf>>,
}

/// A driver reporting volume conditions with `volumes` known from the start, listing them
/// when `list` (else ControllerGetVolume only).
pub fn driver_config(volumes: &[&str], list: bool) -> DriverConfig {
    DriverConfig {
        name: DRIVER.to_owned(),
        controller: true,
        list_volumes: list,
        volume_condition: true,
        volumes: volumes.iter().map(|v| (*v).to_owned()).collect(),
        ..DriverConfig::default()
    }
}

impl Env {
    /// An API server of `version`, the namespace, and the driver of `config`.
    pub async fn new(version: KubeVersion, config: DriverConfig) -> Env {
        Env::with_options(version, &ApiServerOptions::default(), config).await
    }

    /// [`Env::new`] with the API server started with `options` (an audit log).
    pub async fn with_options(
        version: KubeVersion,
        options: &ApiServerOptions,
        config: DriverConfig,
    ) -> Env {
        let api = ApiServer::start_with(version, options)
            .await
            .expect("kube-apiserver");
        let client = api.client().await.unwrap();
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap(),
            )
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("csi.sock");
        let calls = config.calls.clone();
        let driver = plugreg_csi_test_driver::start(config, &socket)
            .await
            .unwrap();
        Env {
            api,
            client,
            dir,
            driver,
            calls,
            socket,
            logs: std::sync::Mutex::default(),
        }
    }

    /// A claim `claim` bound to the CSI PV `pv-<claim>` of `driver` with `handle`, as the PV
    /// controller leaves them; returns the claim's UID.
    pub async fn bound_claim_of(&self, claim: &str, driver: &str, handle: &str) -> String {
        let pv = format!("pv-{claim}");
        sidecar::bound_claim(&self.client, NS, claim, &pv, driver, handle, true).await
    }

    /// [`bound_claim_of`](Self::bound_claim_of) this test's driver.
    pub async fn bound_claim(&self, claim: &str, handle: &str) -> String {
        self.bound_claim_of(claim, DRIVER, handle).await
    }

    /// Sets the phase of the PV `pv-<claim>` and of the claim.
    pub async fn set_phase(&self, claim: &str, phase: &str) {
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), NS);
        let status = Patch::Merge(json!({"status": {"phase": phase}}));
        pvs.patch_status(&format!("pv-{claim}"), &PatchParams::default(), &status)
            .await
            .unwrap();
        let claim_phase = if phase == "Bound" { "Bound" } else { "Pending" };
        pvcs.patch_status(
            claim,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": claim_phase}})),
        )
        .await
        .unwrap();
    }

    /// The events about the claim `claim`, oldest first.
    pub async fn events(&self, claim: &str) -> Vec<Event> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), NS);
        let mut list = api
            .list(&ListParams::default().fields(&format!("involvedObject.name={claim}")))
            .await
            .unwrap()
            .items;
        list.sort_by_key(|e| e.first_timestamp.clone().map(|t| t.0));
        list
    }

    /// `(reason, message, count)` of each event about `claim`, oldest first.
    pub async fn said(&self, claim: &str) -> Vec<(String, String, i32)> {
        self.events(claim)
            .await
            .into_iter()
            .map(|e| {
                (
                    e.reason.unwrap_or_default(),
                    e.message.unwrap_or_default(),
                    e.count.unwrap_or_default(),
                )
            })
            .collect()
    }

    /// Waits until `claim` has an event with `reason` and `message` whose count is at least
    /// `count`; returns it.
    pub async fn wait_event(&self, claim: &str, reason: &str, message: &str, count: i32) -> Event {
        self.poll(
            &format!("event {reason} {message:?} x{count} on {claim}"),
            || async {
                self.events(claim).await.into_iter().find(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.message.as_deref() == Some(message)
                        && e.count.unwrap_or_default() >= count
                })
            },
        )
        .await
    }

    /// Waits until `claim` has an event with `reason` whose message ends with `message`.
    pub async fn wait_event_containing(&self, claim: &str, reason: &str, message: &str) -> Event {
        self.poll(
            &format!("event {reason} ...{message:?} on {claim}"),
            || async {
                self.events(claim).await.into_iter().find(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.message.as_deref().is_some_and(|m| m.ends_with(message))
                })
            },
        )
        .await
    }

    /// Polls `f` every 100 ms until it returns `Some`, for at most [`WAIT`]; on time-out the
    /// panic shows the sidecars' logs.
    pub async fn poll<T, F, Fut>(&self, what: &str, f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let logs = || sidecar::log_tails(&self.logs.lock().unwrap(), 60);
        sidecar::poll_showing(what, WAIT, logs, f).await
    }

    /// The requests in the audit log (JSON lines) so far, when the API server keeps one.
    pub fn audited(&self) -> Vec<serde_json::Value> {
        let Some(path) = self.api.audit_log_path() else {
            return Vec::new();
        };
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Starts the health monitor for this driver with `args` added (`--v=5`).
    pub fn monitor(&self, args: &[&str]) -> LoggedSidecar {
        static N: AtomicUsize = AtomicUsize::new(0);
        let log = self.dir.path().join(format!(
            "health-monitor-{}.log",
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let cmd = sidecar::controller_command(BIN, &self.socket, self.api.kubeconfig_path(), args);
        self.logs.lock().unwrap().push(log.clone());
        LoggedSidecar::spawn(cmd, log)
    }
}
