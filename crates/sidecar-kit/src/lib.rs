//! What plugreg's drop-ins for the Go CSI sidecars (csi-node-driver-registrar, livenessprobe,
//! csi-provisioner) share: Go's `flag` and spf13/pflag syntax and value parsers ([`goflag`],
//! [`pflag`], [`gosyntax`]), component-base's
//! logging flags and klog-style log lines ([`logging`]), and a small HTTP/1 diagnostics server
//! with the bounds a network endpoint needs and one shared health check in flight ([`http`]).

pub mod goflag;
pub mod gosyntax;
pub mod http;
pub mod logging;
pub mod pflag;
