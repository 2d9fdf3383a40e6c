//! The health monitor's calls to the driver: ListVolumes page by page and ControllerGetVolume,
//! on the kit's timed client (each call counted in `csi_sidecar_operations_seconds`), and what
//! the capabilities read at start-up mean to it.

use std::time::Duration;

use plugreg_csi_core::client::CallError;
use plugreg_proto::csi::v1::{
    ControllerGetVolumeRequest, ListVolumesRequest, VolumeCondition, list_volumes_response,
};
use plugreg_runtime::report;
use plugreg_sidecar_kit::csi::{Capabilities, Client, ControllerRpc, PluginService};

use crate::decide::{self, Condition, Mode};

/// `/csi.v1.Controller/ListVolumes`.
pub const LIST_VOLUMES: &str = "/csi.v1.Controller/ListVolumes";
/// `/csi.v1.Controller/ControllerGetVolume`.
pub const GET_VOLUME: &str = "/csi.v1.Controller/ControllerGetVolume";

/// The path the driver's capabilities choose (see [`decide::mode`]), or why it cannot be
/// monitored in upstream's words (without its ", exiting"): no controller service, or
/// neither LIST_VOLUMES nor GET_VOLUME with VOLUME_CONDITION.
pub fn mode(read: &Capabilities) -> Result<Mode, &'static str> {
    if !read.has_service(PluginService::ControllerService) {
        return Err("CSI driver does not support Plugin Controller Service");
    }
    decide::mode(
        read.has_rpc(ControllerRpc::ListVolumes),
        read.has_rpc(ControllerRpc::GetVolume),
        read.has_rpc(ControllerRpc::VolumeCondition),
    )
    .ok_or("CSI driver does not support Controller ListVolumes and GetVolume service or does not implement VolumeCondition")
}

/// One page of ListVolumes: each listed volume's id and condition, and the next token.
#[derive(Debug, Default)]
pub struct Page {
    /// `(volume_id, condition)` of each entry with a volume, in the driver's order.
    pub volumes: Vec<(String, Condition)>,
    /// Entries without a volume (upstream crashes on one; they are skipped here).
    pub without_volume: usize,
    /// `next_token` (empty: the last page).
    pub next_token: String,
}

fn condition(c: Option<VolumeCondition>) -> Condition {
    c.map(|c| Condition {
        abnormal: c.abnormal,
        message: c.message,
    })
    .unwrap_or_default()
}

/// A failed call in grpc-go's words (`rpc error: code = X desc = Y`).
pub fn failure(e: &CallError) -> String {
    report::grpc(&e.to_status())
}

/// The driver's calls. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Driver {
    client: Client,
}

impl Driver {
    /// The calls on `client` (the one start-up identified the driver with: `--timeout`, the
    /// metrics).
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// One ListVolumes page from `token`, within `timeout` (what is left of the pass's).
    pub async fn list_volumes(&self, token: &str, timeout: Duration) -> Result<Page, CallError> {
        let client = self.client.with_timeout(timeout);
        let req = ListVolumesRequest {
            max_entries: 0,
            starting_token: token.to_owned(),
        };
        let ctl = client.connection().controller();
        let call = client.connection().call("ListVolumes", &req, |r| {
            let mut c = ctl.clone();
            async move { c.list_volumes(r).await }
        });
        let resp = client.timed(LIST_VOLUMES, &req, call).await?;
        let mut page = Page {
            next_token: resp.next_token,
            ..Page::default()
        };
        page.volumes.reserve(resp.entries.len());
        for list_volumes_response::Entry { volume, status } in resp.entries {
            match volume {
                Some(v) => page.volumes.push((
                    v.volume_id,
                    condition(status.and_then(|s| s.volume_condition)),
                )),
                None => page.without_volume += 1,
            }
        }
        Ok(page)
    }

    /// ControllerGetVolume of `volume_id`, within `--timeout`: its condition (none reported:
    /// healthy).
    pub async fn get_volume(&self, volume_id: &str) -> Result<Condition, CallError> {
        let req = ControllerGetVolumeRequest {
            volume_id: volume_id.to_owned(),
        };
        let ctl = self.client.connection().controller();
        let call = self
            .client
            .connection()
            .call("ControllerGetVolume", &req, |r| {
                let mut c = ctl.clone();
                async move { c.controller_get_volume(r).await }
            });
        let resp = self.client.timed(GET_VOLUME, &req, call).await?;
        Ok(condition(resp.status.and_then(|s| s.volume_condition)))
    }

    /// The deadline of each call (`--timeout`).
    pub fn timeout(&self) -> Duration {
        self.client.timeout()
    }
}
