//! The kubelet side of plugin registration.
//!
//! Data flows one way: file-system event ([`watcher`]) -> desired state ([`state`]) ->
//! [`reconciler`] -> per-socket operation ([`operation`]) -> [`handler`] -> notify.

pub mod handler;

pub use handler::{HandlerError, HandlerRegistry, PluginHandler, async_trait};
