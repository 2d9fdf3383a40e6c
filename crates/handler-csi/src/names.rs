//! Checks of a driver's name and endpoint before the handler uses them (D7): the name ends up in
//! a Node annotation and a CSINode entry, the endpoint is dialed.

use std::path::PathBuf;

pub use plugreg_csi_core::name::{DriverNameError, MAX_DRIVER_NAME_LEN};

/// Why a driver name or endpoint was refused.
#[derive(Debug, thiserror::Error)]
pub enum NameError {
    /// The driver name breaks the CSI rules.
    #[error(transparent)]
    Name(#[from] DriverNameError),
    /// The endpoint is empty.
    #[error("endpoint is empty")]
    EmptyEndpoint,
    /// The endpoint is not an absolute socket path.
    #[error("invalid endpoint {endpoint:?}")]
    InvalidEndpoint {
        /// The endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: plugreg_transport::Error,
    },
    /// The endpoint names a relative path (`unix://rel.sock`), which would depend on the
    /// daemon's working directory.
    #[error("invalid endpoint {endpoint:?}: the socket path must be absolute")]
    RelativeEndpoint {
        /// The endpoint.
        endpoint: String,
    },
}

/// Checks a CSI driver name (see [`plugreg_csi_core::name`]).
pub fn check_driver_name(name: &str) -> Result<(), NameError> {
    Ok(plugreg_csi_core::check_driver_name(name)?)
}

/// Checks an endpoint (an absolute socket path, or `unix://` and an absolute path) and returns
/// the socket path.
pub fn check_endpoint(endpoint: &str) -> Result<PathBuf, NameError> {
    if endpoint.is_empty() {
        return Err(NameError::EmptyEndpoint);
    }
    let path = plugreg_transport::parse_address(endpoint).map_err(|source| {
        NameError::InvalidEndpoint {
            endpoint: endpoint.to_owned(),
            source,
        }
    })?;
    if !path.is_absolute() {
        return Err(NameError::RelativeEndpoint {
            endpoint: endpoint.to_owned(),
        });
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_names() {
        for ok in [
            "a",
            "hostpath.csi.k8s.io",
            "Ebs.CSI.aws.com",
            "my-driver",
            "0x",
            &"a".repeat(63),
        ] {
            assert!(check_driver_name(ok).is_ok(), "{ok:?} must pass");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "a..b",
            ".a",
            "a.",
            "a/b",
            "../x",
            "a\0b",
            "a b",
            "a_b",
            "dr\u{e9}",
            &"a".repeat(64),
        ] {
            assert!(check_driver_name(bad).is_err(), "{bad:?} must fail");
        }
        assert!(
            check_driver_name(&"a".repeat(64))
                .unwrap_err()
                .to_string()
                .contains("64 characters, more than 63")
        );
    }

    #[test]
    fn endpoints() {
        assert_eq!(
            check_endpoint("/var/lib/kubelet/plugins/d/csi.sock").unwrap(),
            PathBuf::from("/var/lib/kubelet/plugins/d/csi.sock")
        );
        assert_eq!(
            check_endpoint("unix:///csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        for bad in [
            "",
            "csi.sock",
            "unix://csi.sock",
            "tcp://1.2.3.4:5",
            "/a\0b",
        ] {
            assert!(check_endpoint(bad).is_err(), "{bad:?} must fail");
        }
    }
}
