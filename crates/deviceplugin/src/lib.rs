//! Write a kubelet device plugin in Rust.
//!
//! Implement [`DeviceLogic`] (the devices as a watch channel, Allocate, and optionally
//! GetPreferredAllocation and PreStartContainer), describe where to serve and how to register in
//! a [`PluginConfig`], and run a [`DevicePlugin`]. It serves `v1beta1.DevicePlugin` on its own
//! socket and registers either through `plugins_registry` (with `plugreg-registrar`) or through
//! the classic `Register` call on `kubelet.sock`, re-registering when the kubelet restarts (its
//! `kubelet.sock` is re-created, and it deletes the plugin's socket, which is re-created too).
//! When the token is cancelled it stops and removes its sockets. No inotify, no plugin manager.
//!
//! ```no_run
//! # use plugreg_deviceplugin::*;
//! # async fn demo(logic: std::sync::Arc<impl DeviceLogic>) -> Result<(), Error> {
//! let config = PluginConfig::kubelet_socket("example.com/widget", "/var/lib/kubelet/device-plugins/kubelet.sock".as_ref(), "widget.sock");
//! let plugin = DevicePlugin::new(config, logic);
//! plugin.run(tokio_util::sync::CancellationToken::new()).await
//! # }
//! ```

mod plugin;
mod service;

pub use async_trait::async_trait;
pub use plugin::{DevicePlugin, Error, Event, PluginConfig, Registration};
pub use plugreg_proto::deviceplugin::v1beta1 as api;
pub use service::{DeviceLogic, DevicePluginService};
