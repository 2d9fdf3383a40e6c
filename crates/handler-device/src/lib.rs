//! The kubelet side of device plugins (D9).
//!
//! - [`DevicePluginHandler`]: the plugin manager's handler for type `DevicePlugin`.
//! - [`ClassicRegistration`]: `v1beta1.Registration/Register` on `kubelet.sock`, the way most
//!   device plugins register.
//! - [`Inventory`]: what both feed: per plugin socket, the resource, options and devices (id,
//!   health, NUMA topology), for `/plugins` and `/metrics` (D11).
//!
//! Each plugin socket gets one client: dial (10 s), GetDevicePluginOptions, then one ListAndWatch
//! stream whose every answer replaces that socket's device list. A broken stream marks the
//! socket's devices unhealthy and re-dials with back-off. Besides the handler, the crate
//! serves kubelet.sock and owns the inventory both ways share.

mod classic;
mod client;
mod handler;
mod inventory;
mod resource;

pub use classic::{ClassicRegistration, RegisterRefusal, ServeError};
pub use client::{ClientConfig, ConnectError};
pub use handler::{DevicePluginHandler, HandlerRefusal};
pub use inventory::{DeviceInfo, EndpointInfo, Health, Inventory, Options, RegisteredVia};
pub use plugreg_proto::pluginregistration::DEVICE_PLUGIN as PLUGIN_TYPE;
pub use resource::is_extended_resource_name;
