//! The device inventory: what every connected device plugin endpoint (one per socket) reports,
//! fed by both ways of registering, read by `/plugins` and `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use plugreg_proto::deviceplugin::v1beta1::{self as api, DevicePluginOptions};
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Most distinct resource names `plugreg_device_plugin_registration_total` keeps apart.
pub const MAX_REGISTRATION_LABELS: usize = 256;
const OTHER_LABEL: &str = "<other>";

/// How a device plugin registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum RegisteredVia {
    /// Through the plugin manager (a socket in `plugins_registry`).
    #[serde(rename = "plugins_registry")]
    PluginsRegistry,
    /// Through the classic `Register` call on `kubelet.sock`.
    #[serde(rename = "kubelet.sock")]
    KubeletSock,
}

impl RegisteredVia {
    /// The label used in JSON and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            RegisteredVia::PluginsRegistry => "plugins_registry",
            RegisteredVia::KubeletSock => "kubelet.sock",
        }
    }
}

/// A device's health as the kubelet reads it: only the exact string `Healthy` is healthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Health {
    /// Usable.
    Healthy,
    /// Not usable (or the plugin's stream is broken).
    Unhealthy,
}

impl Health {
    /// Reads `Device.health`.
    pub fn parse(s: &str) -> Self {
        if s == api::HEALTHY {
            Health::Healthy
        } else {
            Health::Unhealthy
        }
    }

    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => api::HEALTHY,
            Health::Unhealthy => api::UNHEALTHY,
        }
    }
}

/// One device of an endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    /// The plugin's id.
    pub id: String,
    /// Its health.
    pub health: Health,
    /// Its NUMA nodes, when the plugin gave a topology.
    pub topology: Option<Vec<i64>>,
}

impl From<&api::Device> for DeviceInfo {
    fn from(d: &api::Device) -> Self {
        DeviceInfo {
            id: d.id.clone(),
            health: Health::parse(&d.health),
            topology: d
                .topology
                .as_ref()
                .map(|t| t.nodes.iter().map(|n| n.id).collect()),
        }
    }
}

/// A plugin's feature flags.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Options {
    /// PreStartContainer before each container start.
    pub pre_start_required: bool,
    /// GetPreferredAllocation is implemented.
    pub get_preferred_allocation_available: bool,
}

impl From<&DevicePluginOptions> for Options {
    fn from(o: &DevicePluginOptions) -> Self {
        Options {
            pre_start_required: o.pre_start_required,
            get_preferred_allocation_available: o.get_preferred_allocation_available,
        }
    }
}

/// One endpoint as `/plugins` shows it (the `details` of a device plugin).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EndpointInfo {
    /// The extended resource.
    pub resource: String,
    /// The DevicePlugin socket.
    pub endpoint: PathBuf,
    /// How it registered.
    pub registered_via: RegisteredVia,
    /// Whether its ListAndWatch stream is open.
    pub connected: bool,
    /// Its options (read once per connection).
    pub options: Options,
    /// Its devices, as its latest ListAndWatch answer listed them (all unhealthy while the
    /// stream is broken).
    pub devices: Vec<DeviceInfo>,
    /// Why the stream or the last re-dial failed, while it is broken.
    pub last_error: Option<String>,
    /// ListAndWatch answers received.
    pub updates: u64,
    /// Since when it is registered.
    #[serde(skip)]
    pub registered_at: SystemTime,
}

/// One client's claim on an endpoint's entry: its updates count only while the entry is still
/// its own (a re-registration replaces the client and its ticket).
#[derive(Debug, Clone)]
pub(crate) struct Ticket {
    id: u64,
    /// Stops the client's stream task.
    pub(crate) token: CancellationToken,
}

#[derive(Debug)]
struct Slot {
    info: EndpointInfo,
    ticket: Ticket,
}

/// Every device plugin endpoint, keyed by its socket path (a second plugin of the same resource
/// on another socket is a second entry).
#[derive(Debug)]
pub struct Inventory {
    slots: Mutex<BTreeMap<PathBuf, Slot>>,
    /// Bumped on every change, so that tests and watchers can wait for one.
    version: watch::Sender<u64>,
    next_ticket: std::sync::atomic::AtomicU64,
    classic_registrations: Mutex<BTreeMap<String, u64>>,
}

impl Default for Inventory {
    fn default() -> Self {
        Self {
            slots: Mutex::default(),
            version: watch::Sender::new(0),
            next_ticket: Default::default(),
            classic_registrations: Mutex::default(),
        }
    }
}

impl Inventory {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, BTreeMap<PathBuf, Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Changes whenever the inventory changes.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// Puts a freshly connected endpoint in place (replacing and stopping any earlier client of
    /// the same socket); returns the token that stops the new one.
    pub(crate) fn insert(
        &self,
        endpoint: &Path,
        resource: &str,
        via: RegisteredVia,
        options: Options,
    ) -> Ticket {
        let ticket = Ticket {
            id: self
                .next_ticket
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            token: CancellationToken::new(),
        };
        let old = self.slots().insert(
            endpoint.to_owned(),
            Slot {
                info: EndpointInfo {
                    resource: resource.to_owned(),
                    endpoint: endpoint.to_owned(),
                    registered_via: via,
                    connected: true,
                    options,
                    devices: Vec::new(),
                    last_error: None,
                    updates: 0,
                    registered_at: SystemTime::now(),
                },
                ticket: ticket.clone(),
            },
        );
        if let Some(old) = old {
            old.ticket.token.cancel();
        }
        self.bump();
        ticket
    }

    /// Applies `f` to the endpoint's entry if `token` is still the one that owns it (a replaced
    /// client's late updates are ignored).
    pub(crate) fn update(
        &self,
        endpoint: &Path,
        ticket: &Ticket,
        f: impl FnOnce(&mut EndpointInfo),
    ) {
        let changed = {
            let mut slots = self.slots();
            match slots.get_mut(endpoint) {
                Some(s) if s.ticket.id == ticket.id => {
                    f(&mut s.info);
                    true
                }
                _ => false,
            }
        };
        if changed {
            self.bump();
        }
    }

    /// A ListAndWatch answer: the whole device list is replaced.
    pub(crate) fn set_devices(&self, endpoint: &Path, ticket: &Ticket, devices: &[api::Device]) {
        let devices: Vec<DeviceInfo> = devices.iter().map(DeviceInfo::from).collect();
        self.update(endpoint, ticket, |e| {
            e.devices = devices;
            e.connected = true;
            e.last_error = None;
            e.updates += 1;
        });
    }

    /// The stream broke: every device of the endpoint becomes unhealthy.
    pub(crate) fn disconnected(&self, endpoint: &Path, ticket: &Ticket, why: String) {
        self.update(endpoint, ticket, |e| {
            e.connected = false;
            e.last_error = Some(why);
            for d in &mut e.devices {
                d.health = Health::Unhealthy;
            }
        });
    }

    /// Drops the endpoint's client if `token` still owns it (or always, with `None`); returns
    /// whether something was dropped.
    pub(crate) fn remove(&self, endpoint: &Path, ticket: Option<&Ticket>) -> bool {
        let removed = {
            let mut slots = self.slots();
            match slots.get(endpoint) {
                Some(s) if ticket.is_none_or(|t| s.ticket.id == t.id) => slots.remove(endpoint),
                _ => None,
            }
        };
        match removed {
            Some(s) => {
                s.ticket.token.cancel();
                self.bump();
                true
            }
            None => false,
        }
    }

    /// Drops the endpoint's client if it registered `via` that path; returns whether it did.
    pub(crate) fn remove_via(&self, endpoint: &Path, via: RegisteredVia) -> bool {
        let ticket = match self.slots().get(endpoint) {
            Some(s) if s.info.registered_via == via => s.ticket.clone(),
            _ => return false,
        };
        self.remove(endpoint, Some(&ticket))
    }

    /// Stops every endpoint's client (at shutdown).
    pub fn clear(&self) {
        let slots = std::mem::take(&mut *self.slots());
        for s in slots.into_values() {
            s.ticket.token.cancel();
        }
        self.bump();
    }

    /// Counts a Register call. Names come from any client before validation, so the number of
    /// distinct labels is capped: beyond [`MAX_REGISTRATION_LABELS`] they count as `<other>`.
    pub(crate) fn count_classic_registration(&self, resource: &str) {
        let mut counts = self
            .classic_registrations
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let key = if counts.contains_key(resource) || counts.len() < MAX_REGISTRATION_LABELS {
            resource
        } else {
            OTHER_LABEL
        };
        *counts.entry(key.to_owned()).or_default() += 1;
    }

    /// The endpoint at `endpoint`.
    pub fn get(&self, endpoint: &Path) -> Option<EndpointInfo> {
        self.slots().get(endpoint).map(|s| s.info.clone())
    }

    /// Every endpoint, by socket path.
    pub fn snapshot(&self) -> Vec<EndpointInfo> {
        self.slots().values().map(|s| s.info.clone()).collect()
    }

    /// Prometheus text: devices by resource and health, endpoints by resource and how they
    /// registered, classic Register calls by resource.
    pub fn render_metrics(&self) -> String {
        let mut devices: BTreeMap<(String, Health), u64> = BTreeMap::new();
        let mut endpoints: BTreeMap<(String, &'static str, bool), u64> = BTreeMap::new();
        for e in self.snapshot() {
            for h in [Health::Healthy, Health::Unhealthy] {
                devices.entry((e.resource.clone(), h)).or_default();
            }
            for d in &e.devices {
                *devices.entry((e.resource.clone(), d.health)).or_default() += 1;
            }
            *endpoints
                .entry((e.resource.clone(), e.registered_via.as_str(), e.connected))
                .or_default() += 1;
        }
        let mut out = String::new();
        out.push_str(
            "# HELP plugreg_devices Devices reported by device plugins, by resource and health.\n",
        );
        out.push_str("# TYPE plugreg_devices gauge\n");
        for ((r, h), n) in &devices {
            let _ = writeln!(
                out,
                "plugreg_devices{{resource=\"{}\",health=\"{}\"}} {n}",
                plugreg_runtime::prom::escape_label(r),
                h.as_str().to_ascii_lowercase()
            );
        }
        out.push_str("# HELP plugreg_device_plugin_endpoints Device plugin endpoints, by resource, registration path and whether their ListAndWatch stream is open.\n");
        out.push_str("# TYPE plugreg_device_plugin_endpoints gauge\n");
        for ((r, via, connected), n) in &endpoints {
            let _ = writeln!(
                out,
                "plugreg_device_plugin_endpoints{{resource=\"{}\",registered_via=\"{via}\",connected=\"{connected}\"}} {n}",
                plugreg_runtime::prom::escape_label(r)
            );
        }
        out.push_str("# HELP plugreg_device_plugin_registration_total Register calls on kubelet.sock, by resource (counted before validation, as the kubelet does).\n");
        out.push_str("# TYPE plugreg_device_plugin_registration_total counter\n");
        for (r, n) in self
            .classic_registrations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "plugreg_device_plugin_registration_total{{resource_name=\"{}\"}} {n}",
                plugreg_runtime::prom::escape_label(r)
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugreg_proto::deviceplugin::v1beta1::{Device, NumaNode, TopologyInfo};

    fn dev(id: &str, health: &str, numa: Option<&[i64]>) -> Device {
        Device {
            id: id.into(),
            health: health.into(),
            topology: numa.map(|n| TopologyInfo {
                nodes: n.iter().map(|&id| NumaNode { id }).collect(),
            }),
        }
    }

    #[test]
    fn devices_are_replaced_marked_unhealthy_on_disconnect_and_counted() {
        let inv = Inventory::new();
        let ep = Path::new("/dp/a.sock");
        let t = inv.insert(
            ep,
            "x.com/w",
            RegisteredVia::KubeletSock,
            Options::default(),
        );
        inv.set_devices(
            ep,
            &t,
            &[dev("a", "Healthy", Some(&[0, 1])), dev("b", "sick", None)],
        );
        let e = inv.get(ep).unwrap();
        assert_eq!(e.devices[0].topology, Some(vec![0, 1]));
        assert_eq!(e.devices[1].health, Health::Unhealthy);
        let m = inv.render_metrics();
        assert!(
            m.contains("plugreg_devices{resource=\"x.com/w\",health=\"healthy\"} 1\n"),
            "{m}"
        );
        assert!(
            m.contains("plugreg_devices{resource=\"x.com/w\",health=\"unhealthy\"} 1\n"),
            "{m}"
        );
        inv.disconnected(ep, &t, "gone".into());
        let e = inv.get(ep).unwrap();
        assert!(!e.connected);
        assert!(e.devices.iter().all(|d| d.health == Health::Unhealthy));
        assert!(inv.render_metrics().contains("health=\"unhealthy\"} 2\n"));
    }

    #[test]
    fn a_replaced_client_can_neither_update_nor_remove_the_new_one() {
        let inv = Inventory::new();
        let ep = Path::new("/dp/a.sock");
        let old = inv.insert(
            ep,
            "x.com/w",
            RegisteredVia::PluginsRegistry,
            Options::default(),
        );
        let new = inv.insert(
            ep,
            "x.com/w",
            RegisteredVia::KubeletSock,
            Options::default(),
        );
        assert!(old.token.is_cancelled());
        inv.set_devices(ep, &old, &[dev("stale", "Healthy", None)]);
        assert!(inv.get(ep).unwrap().devices.is_empty());
        assert!(!inv.remove(ep, Some(&old)));
        assert!(inv.remove(ep, Some(&new)));
        assert!(new.token.is_cancelled());
        assert!(inv.snapshot().is_empty());
    }

    #[test]
    fn registration_counts_keep_a_bounded_number_of_labels() {
        let inv = Inventory::new();
        for i in 0..MAX_REGISTRATION_LABELS + 10 {
            inv.count_classic_registration(&format!("x.com/r{i}"));
        }
        inv.count_classic_registration("x.com/r0");
        let m = inv.render_metrics();
        assert!(m.contains("{resource_name=\"x.com/r0\"} 2\n"), "{m}");
        assert!(m.contains("{resource_name=\"<other>\"} 10\n"), "{m}");
        assert_eq!(
            m.matches("plugreg_device_plugin_registration_total{")
                .count(),
            MAX_REGISTRATION_LABELS + 1
        );
    }

    #[test]
    fn json_shape_is_the_agreed_details_object() {
        let inv = Inventory::new();
        let ep = Path::new("/dp/a.sock");
        let t = inv.insert(
            ep,
            "x.com/w",
            RegisteredVia::KubeletSock,
            Options::default(),
        );
        inv.set_devices(ep, &t, &[dev("a", "Healthy", Some(&[0]))]);
        let v = serde_json::to_value(inv.get(ep).unwrap()).unwrap();
        assert_eq!(v["registered_via"], "kubelet.sock");
        assert_eq!(v["options"]["pre_start_required"], false);
        assert_eq!(
            v["devices"],
            serde_json::json!([{"id": "a", "health": "Healthy", "topology": [0]}])
        );
    }
}
