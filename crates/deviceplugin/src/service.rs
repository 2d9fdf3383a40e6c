//! The device logic a plugin author writes, and the `v1beta1.DevicePlugin` server around it.

use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use futures::StreamExt;
use plugreg_proto::deviceplugin::v1beta1::device_plugin_server::{
    DevicePlugin as DevicePluginApi, DevicePluginServer,
};
use plugreg_proto::deviceplugin::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, ContainerPreferredAllocationResponse, Device,
    DevicePluginOptions, Empty, ListAndWatchResponse, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
};
use tokio::sync::watch;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// What a device plugin knows: its devices and how to hand them to a container.
#[async_trait]
pub trait DeviceLogic: Send + Sync + 'static {
    /// The plugin's feature flags (sent in Register and answered to GetDevicePluginOptions).
    /// Say `get_preferred_allocation_available` / `pre_start_required` only when the matching
    /// method is implemented.
    fn options(&self) -> DevicePluginOptions {
        DevicePluginOptions::default()
    }

    /// The full device list, now and after every change (each ListAndWatch stream sends the
    /// current list at once and again on every change).
    fn devices(&self) -> watch::Receiver<Vec<Device>>;

    /// What a container needs to use `request.devices_ids` (the kubelet sends one container).
    async fn allocate(
        &self,
        request: ContainerAllocateRequest,
    ) -> Result<ContainerAllocateResponse, Status>;

    /// The plugin's preferred pick of `allocation_size` devices among the candidates.
    async fn preferred_allocation(
        &self,
        _request: ContainerPreferredAllocationRequest,
    ) -> Result<ContainerPreferredAllocationResponse, Status> {
        Err(Status::unimplemented(
            "this device plugin does not implement GetPreferredAllocation",
        ))
    }

    /// Called before a container using `devices_ids` starts (when `pre_start_required`).
    async fn pre_start(&self, _devices_ids: Vec<String>) -> Result<(), Status> {
        Ok(())
    }
}

/// The gRPC `DevicePlugin` service for a [`DeviceLogic`]. Its ListAndWatch streams end when
/// `stop` is cancelled, so that a graceful server shutdown does not wait for the kubelet.
pub struct DevicePluginService<L: ?Sized> {
    logic: Arc<L>,
    stop: CancellationToken,
}

impl<L: DeviceLogic + ?Sized> DevicePluginService<L> {
    /// Serves `logic`; streams end when `stop` is cancelled.
    pub fn new(logic: Arc<L>, stop: CancellationToken) -> Self {
        Self { logic, stop }
    }

    /// The tonic service, with plugreg's message cap.
    pub fn into_server(self) -> DevicePluginServer<Self> {
        DevicePluginServer::new(self)
            .max_decoding_message_size(plugreg_transport::MAX_MESSAGE_SIZE)
            .max_encoding_message_size(plugreg_transport::MAX_MESSAGE_SIZE)
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl<L: DeviceLogic + ?Sized> DevicePluginApi for DevicePluginService<L> {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(self.logic.options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let devices = tokio_stream::wrappers::WatchStream::new(self.logic.devices())
            .map(|devices| Ok(ListAndWatchResponse { devices }))
            .take_until(self.stop.clone().cancelled_owned());
        Ok(Response::new(Box::pin(devices)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let mut container_responses = Vec::new();
        for r in request.into_inner().container_requests {
            container_responses.push(self.logic.preferred_allocation(r).await?);
        }
        Ok(Response::new(PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let mut container_responses = Vec::new();
        for r in request.into_inner().container_requests {
            container_responses.push(self.logic.allocate(r).await?);
        }
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        self.logic
            .pre_start(request.into_inner().devices_ids)
            .await?;
        Ok(Response::new(PreStartContainerResponse {}))
    }
}
