//! What every plugreg program shares at run time, written once:
//!
//! * [`backoff`]: the one back-off policy (exponential, capped, optional jitter);
//! * [`accept`]: what a listener does when `accept()` fails for want of file descriptors;
//! * [`signal`]: SIGTERM / SIGINT (and SIGHUP for daemons) as one awaitable stream;
//! * [`prom`]: the Prometheus text format of every `/metrics` endpoint (label escaping, Go's
//!   number format, a fixed-bucket histogram);
//! * [`report`]: an error and its causes as one line, gRPC statuses worded as grpc-go words them;
//! * [`memory`]: freed heap pages given back to the kernel, for daemons.
//! * [`procfs`]: a process's memory and CPU time, and the mount points below a directory.
//!
//! It depends on tokio, tonic and libc only, so the registrar side can use it without pulling
//! in inotify or kube.

pub mod accept;
pub mod backoff;
pub mod memory;
pub mod procfs;
pub mod prom;
pub mod report;
pub mod signal;

pub use backoff::Backoff;
