//! An example DRA driver: every claim gets one device of the pool (`dev-0` .. `dev-<n-1>`,
//! round robin), with the CDI id `<driver>/dev=<claim uid>`. Prepared claims are remembered so
//! that preparing again gives the same answer (idempotent), and unpreparing an unknown claim is
//! fine. Every call is reported on a channel as one JSON line, and device health is reported as
//! Healthy for all devices.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use plugreg_dra::{
    Claim, Device, DeviceHealth, DeviceIdentifier, Driver, DriverError, HealthStatus,
    PrepareResult, async_trait,
};
use tokio::sync::{mpsc, watch};

/// The example driver.
#[derive(Debug)]
pub struct ExampleDriver {
    driver_name: String,
    pool: String,
    devices: usize,
    state: Mutex<State>,
    events: Option<mpsc::UnboundedSender<String>>,
    health: watch::Sender<Vec<DeviceHealth>>,
}

#[derive(Debug, Default)]
struct State {
    prepared: HashMap<String, Device>,
    next: usize,
}

/// Nanoseconds since the Unix epoch.
pub fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

fn claims_json(claims: &[Claim]) -> serde_json::Value {
    claims
        .iter()
        .map(|c| serde_json::json!({"namespace": c.namespace, "name": c.name, "uid": c.uid}))
        .collect()
}

impl ExampleDriver {
    /// `devices` devices (at least one) in pool `pool`; call events go to `events` as JSON lines.
    pub fn new(
        driver_name: impl Into<String>,
        pool: impl Into<String>,
        devices: usize,
        events: Option<mpsc::UnboundedSender<String>>,
    ) -> Self {
        let pool = pool.into();
        let devices = devices.max(1);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        let health = (0..devices)
            .map(|i| DeviceHealth {
                device: Some(DeviceIdentifier {
                    pool_name: pool.clone(),
                    device_name: format!("dev-{i}"),
                }),
                health: HealthStatus::Healthy as i32,
                last_updated_time: now,
                // The example never re-reports: its reports must not go stale.
                health_check_timeout_seconds: i64::from(u32::MAX),
                message: String::new(),
            })
            .collect();
        Self {
            driver_name: driver_name.into(),
            pool,
            devices,
            state: Mutex::default(),
            events,
            health: watch::Sender::new(health),
        }
    }

    /// The device names, in order.
    pub fn device_names(&self) -> Vec<String> {
        (0..self.devices).map(|i| format!("dev-{i}")).collect()
    }

    /// The pool name.
    pub fn pool(&self) -> &str {
        &self.pool
    }

    fn emit(&self, v: serde_json::Value) {
        if let Some(tx) = &self.events {
            let _ = tx.send(v.to_string());
        }
    }
}

#[async_trait]
impl Driver for ExampleDriver {
    async fn prepare(
        &self,
        claims: Vec<Claim>,
    ) -> Result<HashMap<String, PrepareResult>, DriverError> {
        self.emit(serde_json::json!({
            "event": "NodePrepareResources", "claims": claims_json(&claims), "ts_ns": now_ns()
        }));
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = HashMap::new();
        for c in claims {
            if c.uid.is_empty() {
                // No key to answer under: the kubelet counts it as skipped.
                continue;
            }
            let device = match state.prepared.get(&c.uid) {
                Some(d) => d.clone(),
                None => {
                    let d = Device {
                        request_names: Vec::new(),
                        pool_name: self.pool.clone(),
                        device_name: format!("dev-{}", state.next % self.devices),
                        cdi_device_ids: vec![format!("{}/dev={}", self.driver_name, c.uid)],
                        share_id: None,
                    };
                    state.next += 1;
                    state.prepared.insert(c.uid.clone(), d.clone());
                    d
                }
            };
            out.insert(c.uid, Ok(vec![device]));
        }
        Ok(out)
    }

    async fn unprepare(
        &self,
        claims: Vec<Claim>,
    ) -> Result<HashMap<String, Result<(), String>>, DriverError> {
        self.emit(serde_json::json!({
            "event": "NodeUnprepareResources", "claims": claims_json(&claims), "ts_ns": now_ns()
        }));
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        Ok(claims
            .into_iter()
            .map(|c| {
                state.prepared.remove(&c.uid);
                (c.uid, Ok(()))
            })
            .collect())
    }

    fn health(&self) -> Option<watch::Receiver<Vec<DeviceHealth>>> {
        Some(self.health.subscribe())
    }
}
