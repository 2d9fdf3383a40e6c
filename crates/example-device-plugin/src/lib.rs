//! The example device plugin's logic: `count` widgets of one resource, each on a NUMA node,
//! whose health can be flipped; every call and change is reported as a JSON event.

use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use plugreg_deviceplugin::DeviceLogic;
use plugreg_deviceplugin::api::{
    ContainerAllocateRequest, ContainerAllocateResponse, ContainerPreferredAllocationRequest,
    ContainerPreferredAllocationResponse, Device, DevicePluginOptions, HEALTHY, NumaNode,
    TopologyInfo, UNHEALTHY,
};
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};
use tonic::Status;

/// Nanoseconds since the epoch, for event lines.
pub fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// `count` widgets named `widget-0` .. `widget-<count-1>`.
#[derive(Debug)]
pub struct Widgets {
    devices: watch::Sender<Vec<Device>>,
    options: DevicePluginOptions,
    events: broadcast::Sender<Value>,
}

impl Widgets {
    /// All healthy, spread round-robin over `numa_nodes` NUMA nodes (none: no topology).
    pub fn new(count: usize, numa_nodes: u32, pre_start_required: bool) -> Self {
        let devices = (0..count)
            .map(|i| Device {
                id: format!("widget-{i}"),
                health: HEALTHY.to_owned(),
                topology: (numa_nodes > 0).then(|| TopologyInfo {
                    nodes: vec![NumaNode {
                        id: (i as u64 % u64::from(numa_nodes)) as i64,
                    }],
                }),
            })
            .collect();
        Self {
            devices: watch::Sender::new(devices),
            options: DevicePluginOptions {
                pre_start_required,
                get_preferred_allocation_available: true,
            },
            events: broadcast::channel(1024).0,
        }
    }

    /// One JSON object per health change and per call, from now on.
    pub fn events(&self) -> broadcast::Receiver<Value> {
        self.events.subscribe()
    }

    fn emit(&self, mut v: Value) {
        v["ts_ns"] = json!(now_ns().to_string());
        let _ = self.events.send(v);
    }

    /// How many widgets.
    pub fn len(&self) -> usize {
        self.devices.borrow().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Flips the health of widget `index` (modulo the count); returns its id and new health.
    pub fn flip(&self, index: usize) -> Option<(String, String)> {
        let mut changed = None;
        self.devices.send_if_modified(|devs| {
            let Some(d) = index.checked_rem(devs.len()).and_then(|i| devs.get_mut(i)) else {
                return false;
            };
            d.health = if d.health == HEALTHY {
                UNHEALTHY
            } else {
                HEALTHY
            }
            .to_owned();
            changed = Some((d.id.clone(), d.health.clone()));
            true
        });
        if let Some((id, health)) = &changed {
            self.emit(json!({"event": "health", "id": id, "health": health}));
        }
        changed
    }

    fn known(&self, ids: &[String]) -> Result<(), Status> {
        let devs = self.devices.borrow();
        match ids.iter().find(|id| !devs.iter().any(|d| &d.id == *id)) {
            Some(id) => Err(Status::invalid_argument(format!("unknown device {id:?}"))),
            None => Ok(()),
        }
    }
}

#[async_trait]
impl DeviceLogic for Widgets {
    fn options(&self) -> DevicePluginOptions {
        self.options
    }

    fn devices(&self) -> watch::Receiver<Vec<Device>> {
        self.devices.subscribe()
    }

    async fn allocate(
        &self,
        request: ContainerAllocateRequest,
    ) -> Result<ContainerAllocateResponse, Status> {
        self.known(&request.devices_ids)?;
        self.emit(json!({"event": "allocate", "devices": request.devices_ids}));
        let mut r = ContainerAllocateResponse::default();
        r.envs
            .insert("EXAMPLE_WIDGETS".into(), request.devices_ids.join(","));
        r.annotations
            .insert("example.com/widgets".into(), request.devices_ids.join(","));
        Ok(r)
    }

    async fn preferred_allocation(
        &self,
        request: ContainerPreferredAllocationRequest,
    ) -> Result<ContainerPreferredAllocationResponse, Status> {
        let size = usize::try_from(request.allocation_size).unwrap_or(0);
        // The ones that must be in, then the other candidates in order.
        let mut pick: Vec<String> = request.must_include_device_ids.clone();
        for id in &request.available_device_ids {
            if pick.len() >= size {
                break;
            }
            if !pick.contains(id) {
                pick.push(id.clone());
            }
        }
        pick.truncate(size.max(request.must_include_device_ids.len()));
        self.emit(json!({"event": "preferred", "devices": pick}));
        Ok(ContainerPreferredAllocationResponse { device_ids: pick })
    }

    async fn pre_start(&self, devices_ids: Vec<String>) -> Result<(), Status> {
        self.known(&devices_ids)?;
        self.emit(json!({"event": "pre_start", "devices": devices_ids}));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn flips_health_and_picks_preferred_devices() {
        let w = Widgets::new(3, 2, false);
        let rx = w.devices();
        assert_eq!(rx.borrow()[1].topology.as_ref().unwrap().nodes[0].id, 1);
        assert_eq!(w.flip(4), Some(("widget-1".into(), UNHEALTHY.into())));
        assert_eq!(rx.borrow()[1].health, UNHEALTHY);
        assert_eq!(w.flip(1), Some(("widget-1".into(), HEALTHY.into())));
        assert_eq!(Widgets::new(0, 0, false).flip(0), None);
        let p = w
            .preferred_allocation(ContainerPreferredAllocationRequest {
                available_device_ids: vec!["widget-0".into(), "widget-2".into(), "widget-1".into()],
                must_include_device_ids: vec!["widget-1".into()],
                allocation_size: 2,
            })
            .await
            .unwrap();
        assert_eq!(p.device_ids, ["widget-1", "widget-0"]);
        let e = w
            .allocate(ContainerAllocateRequest {
                devices_ids: vec!["nope".into()],
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
    }
}
