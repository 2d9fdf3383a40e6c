//! The CSI rules and clients that plugreg's CSI programs share, in a crate with no kube and no
//! clap, so that the sidecar (`csi-node-driver-registrar`), the operator commands and later CSI
//! programs (livenessprobe, csi-provisioner) can use them without the kubelet-side handler's
//! dependencies.
//!
//! * [`name`]: the driver-name rule (the sidecar before the name becomes a path, the handler
//!   before it reaches the Kubernetes API);
//! * [`version`]: which supported-version lists a driver may register with, and when a second
//!   registration of a driver name is allowed;
//! * [`client`]: a connection to a driver with timeouts, retries and typed errors;
//! * [`node`]: the kubelet's CSI node client (C1) and [`layout`], its directory layout;
//! * [`check`]: the driver check for driver authors (C2).

pub mod check;
pub mod client;
pub mod layout;
pub mod name;
pub mod node;
mod sha256;
pub mod version;

pub use client::{CallError, Connection, NODE_TIMEOUT, Retry};
pub use layout::{DEFAULT_KUBELET_ROOT, KubeletLayout, LayoutError};
pub use name::{DriverNameError, MAX_DRIVER_NAME_LEN, check_driver_name};
pub use node::{NodeClient, NodeError, VolumeMode, VolumePaths, VolumeSpec};
pub use version::{Version, VersionError, check_versions};
