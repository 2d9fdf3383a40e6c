//! The handler contract, re-exported from `plugreg-handler-api` (where handlers take it from, so
//! that they need not link the manager): [`PluginHandler`], [`HandlerError`],
//! [`HandlerRegistry`].

pub use plugreg_handler_api::{HandlerError, HandlerRegistry, PluginHandler, async_trait};
