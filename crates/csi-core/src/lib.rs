//! The CSI rules that both sides of registration share, in a crate with no kube and no clap, so
//! that the sidecar (`csi-node-driver-registrar`) and later CSI programs (the node client,
//! livenessprobe, csi-provisioner) can use them without the kubelet-side handler's dependencies.
//!
//! * [`name`]: the driver-name rule (the sidecar before the name becomes a path, the handler
//!   before it reaches the Kubernetes API);
//! * [`version`]: which supported-version lists a driver may register with, and when a second
//!   registration of a driver name is allowed.

pub mod name;
pub mod version;

pub use name::{DriverNameError, MAX_DRIVER_NAME_LEN, check_driver_name};
pub use version::{Version, VersionError, check_versions};
