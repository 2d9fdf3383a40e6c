//! Go flag syntax and klog logging, as upstream's Go sidecars show them: Go's `flag` and
//! spf13/pflag command lines ([`goflag`], [`pflag`]) over Go's value syntax ([`gosyntax`]),
//! Go's quoted strings and `strconv` errors ([`gotext`]), and component-base's logging flags
//! with (feature `cli`) klog-style text or JSON log lines ([`logging`]).
//!
//! It is not a sidecar's command line: which flags a sidecar has, the removed klog flags and the
//! `main` skeleton live in `plugreg-sidecar-kit` (`flags`, `compat`, `cli`). A library that only
//! parses or quotes leaves `cli` out and does not pull in tracing-subscriber.

pub mod goflag;
pub mod gosyntax;
pub mod gotext;
pub mod logging;
pub mod pflag;
