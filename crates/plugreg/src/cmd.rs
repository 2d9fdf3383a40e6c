//! One module per `plugreg` subcommand.

pub mod csi;
pub mod demo;
pub mod device;
pub mod dra;
pub mod manager;
pub mod sockets;
