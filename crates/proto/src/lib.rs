//! plugreg's wire API, generated from our own `.proto` files (`proto/`).
//!
//! The generated code is checked in (`src/gen`, one file per proto package), so a build compiles
//! no protobuf compiler. After changing a `.proto` file run `cargo run -p plugreg-proto-gen`;
//! its test fails while `src/gen` is stale.
//!
//! - [`pluginregistration`]: the kubelet plugin registration service (`GetInfo`,
//!   `NotifyRegistrationStatus`), the same on the wire for v1alpha1, v1beta1 and v1.
//! - [`csi`]: CSI v1 Identity, Node, Controller and GroupController.
//! - [`example`]: the small versioned example services used by tests and the demo.
//! - [`deviceplugin`]: the kubelet device plugin API v1beta1 (`DevicePlugin`, and the classic
//!   `Registration` served on kubelet.sock).
//! - [`dra`]: the kubelet DRA plugin API (v1, v1beta1) and the DRA health API (v1alpha1).
//!
//! Every generated client and server uses [`codec::ProstCodec`]: prost's encoding with small
//! per-call buffers.

pub mod codec;

/// The kubelet plugin registration API (proto package `pluginregistration`).
pub mod pluginregistration {
    #![allow(missing_docs, clippy::all)]
    include!("gen/pluginregistration.rs");

    /// Plugin type of a CSI driver.
    pub const CSI_PLUGIN: &str = "CSIPlugin";
    /// Plugin type of a device plugin.
    pub const DEVICE_PLUGIN: &str = "DevicePlugin";
    /// Plugin type of a dynamic resource allocation driver.
    pub const DRA_PLUGIN: &str = "DRAPlugin";
}

/// CSI (proto package `csi.v1`): Identity, Node, Controller and GroupController.
pub mod csi {
    /// Package `csi.v1`.
    pub mod v1 {
        #![allow(missing_docs, clippy::all)]
        include!("gen/csi.v1.rs");
    }
}

/// Everything in proto package `v1beta1`: the example service at v1beta1 and the device plugin
/// API share the package (prost generates one file per package); [`example::v1beta1`] and
/// [`deviceplugin::v1beta1`] each re-export their part.
mod package_v1beta1 {
    #![allow(missing_docs, clippy::all)]
    include!("gen/v1beta1.rs");
}

/// The kubelet device plugin API.
pub mod deviceplugin {
    /// Version v1beta1 (proto package `v1beta1`).
    pub mod v1beta1 {
        pub use crate::package_v1beta1::{
            AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateRequest,
            ContainerAllocateResponse, ContainerPreferredAllocationRequest,
            ContainerPreferredAllocationResponse, Device, DevicePluginOptions, DeviceSpec, Empty,
            ListAndWatchResponse, Mount, NumaNode, PreStartContainerRequest,
            PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
            RegisterRequest, TopologyInfo, device_plugin_client, device_plugin_server,
            registration_client, registration_server,
        };

        /// The API version a device plugin registers with.
        pub const VERSION: &str = "v1beta1";
        /// `Device.health` of a usable device; any other value is unhealthy.
        pub const HEALTHY: &str = "Healthy";
        /// `Device.health` of an unusable device.
        pub const UNHEALTHY: &str = "Unhealthy";
        /// The kubelet's device-plugin directory (holds kubelet.sock and plugins' sockets).
        pub const DEVICE_PLUGIN_PATH: &str = "/var/lib/kubelet/device-plugins/";
        /// The classic registration socket's file name in [`DEVICE_PLUGIN_PATH`].
        pub const KUBELET_SOCKET_NAME: &str = "kubelet.sock";
        /// The kubelet's deadline for PreStartContainer, in seconds.
        pub const PRE_START_CONTAINER_TIMEOUT_SECS: u64 = 30;
    }
}

/// The example services, one module per API version.
pub mod example {
    /// Package `v1beta1`.
    pub mod v1beta1 {
        pub use crate::package_v1beta1::{
            ExampleRequest, ExampleResponse, example_client, example_server,
        };
    }
    /// Package `v1beta2`.
    pub mod v1beta2 {
        #![allow(missing_docs, clippy::all)]
        include!("gen/v1beta2.rs");
    }
}

/// The kubelet's DRA plugin API (`DRAPlugin`, packages `k8s.io.kubelet.pkg.apis.dra.*`) and the
/// DRA device health API (`DRAResourceHealth`, package `v1alpha1`).
pub mod dra {
    /// `PluginInfo.supported_versions` entry selecting [`v1`].
    pub const V1_SERVICE: &str = "v1.DRAPlugin";
    /// `PluginInfo.supported_versions` entry selecting [`v1beta1`].
    pub const V1BETA1_SERVICE: &str = "v1beta1.DRAPlugin";
    /// `PluginInfo.supported_versions` entry for the v1alpha1 health service.
    pub const HEALTH_V1ALPHA1_SERVICE: &str = "v1alpha1.DRAResourceHealth";

    /// Package `k8s.io.kubelet.pkg.apis.dra.v1`.
    pub mod v1 {
        #![allow(missing_docs, clippy::all)]
        include!("gen/k8s.io.kubelet.pkg.apis.dra.v1.rs");
    }
    /// Package `k8s.io.kubelet.pkg.apis.dra.v1beta1` (v1 without `Device.share_id`).
    pub mod v1beta1 {
        #![allow(missing_docs, clippy::all)]
        include!("gen/k8s.io.kubelet.pkg.apis.dra.v1beta1.rs");
    }
    /// Package `v1alpha1`: `DRAResourceHealth`.
    pub mod health_v1alpha1 {
        #![allow(missing_docs, clippy::all)]
        include!("gen/v1alpha1.rs");
    }
}
