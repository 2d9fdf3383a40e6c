//! The kubelet side of DRA drivers: [`DraHandler`], the plugin manager's handler for type
//! `DRAPlugin` (D10, D11). It chooses the service a driver advertises, keeps one watched
//! connection per driver instance (rolling updates run two), follows each instance's device
//! health stream, and makes NodePrepareResources / NodeUnprepareResources with the kubelet's
//! answer checks.

mod dra;

pub use dra::{
    DRA_CALL_TIMEOUT, DRA_SERVICES, DeviceDetails, DraDetails, DraError, DraHandler, DraService,
    choose_service,
};
