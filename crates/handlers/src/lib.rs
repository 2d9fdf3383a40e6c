//! Handlers for plugin types that need no node-level side effects of their own.
//!
//! - [`ExampleHandler`]: upstream's example handler, for tests and demos. It accepts plugins
//!   whose versions are exactly its configured list and, on register, calls `GetExampleInfo` on
//!   every example service version the plugin advertises.
//! - [`RecordHandler`]: accepts any plugin and remembers it; stands in for the
//!   device-plugin handler (and for CSI when no node-info sink is configured).
//! - [`DraHandler`]: the kubelet's `DRAPlugin` handler (D10, D11).

mod dra;
mod example;
mod record;

pub use dra::{
    DRA_CALL_TIMEOUT, DRA_SERVICES, DeviceDetails, DraDetails, DraError, DraHandler, DraService,
    choose_service,
};
pub use example::{EXAMPLE_PLUGIN, ExampleHandler};
pub use record::RecordHandler;
