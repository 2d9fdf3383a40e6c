//! plugreg's wire API, generated from our own `.proto` files (`proto/`).
//!
//! The generated code is checked in (`src/gen`, one file per proto package), so a build compiles
//! no protobuf compiler. After changing a `.proto` file run `cargo run -p plugreg-proto-gen`;
//! its test fails while `src/gen` is stale.
//!
//! - [`pluginregistration`]: the kubelet plugin registration service (`GetInfo`,
//!   `NotifyRegistrationStatus`), the same on the wire for v1alpha1, v1beta1 and v1.
//! - [`csi`]: CSI v1 Identity, Node and Controller.
//! - [`example`]: the small versioned example services used by tests and the demo.

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

/// CSI (proto package `csi.v1`): Identity, Node and Controller.
pub mod csi {
    /// Package `csi.v1`.
    pub mod v1 {
        #![allow(missing_docs, clippy::all)]
        include!("gen/csi.v1.rs");
    }
}

/// The example services, one module per API version.
pub mod example {
    /// Package `v1beta1`.
    pub mod v1beta1 {
        #![allow(missing_docs, clippy::all)]
        include!("gen/v1beta1.rs");
    }
    /// Package `v1beta2`.
    pub mod v1beta2 {
        #![allow(missing_docs, clippy::all)]
        include!("gen/v1beta2.rs");
    }
}
