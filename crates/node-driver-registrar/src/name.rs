//! The driver name check (R2): the name from GetPluginInfo becomes part of a path
//! (`<dir>/<name>-reg.sock`), so it is checked before anything is created. The rule lives in
//! `plugreg_csi_core::name`, shared with the kubelet-side CSI handler.

pub use plugreg_csi_core::name::{
    DriverNameError as NameError, MAX_DRIVER_NAME_LEN, check_driver_name,
};
