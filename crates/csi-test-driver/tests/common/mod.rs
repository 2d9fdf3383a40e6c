//! What the test driver's tests share: a channel to a driver's socket and a volume capability.

#![allow(dead_code)] // each test file uses what it needs

use std::path::Path;
use std::time::Duration;

use plugreg_proto::csi::v1::{VolumeCapability, volume_capability};
use tonic::transport::Channel;

/// A channel to the driver listening on `path`.
pub async fn channel(path: &Path) -> Channel {
    plugreg_transport::connect_path(path, Duration::from_secs(5))
        .await
        .unwrap()
}

/// A single-node-writer mount capability.
pub fn cap() -> VolumeCapability {
    VolumeCapability {
        access_type: Some(volume_capability::AccessType::Mount(
            volume_capability::MountVolume::default(),
        )),
        access_mode: Some(volume_capability::AccessMode {
            mode: volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
    }
}
