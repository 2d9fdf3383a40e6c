//! The command line of livenessprobe v2.19, parsed the way Go's `flag` package parses it
//! (`plugreg_sidecar_kit::goflag`): an unknown flag or a bad value is exit 2, `-h`/`-help`
//! prints the usage and exits 0.
//!
//! On top of upstream: `--version` prints the version (upstream has none and exits 2), and the
//! legacy klog flags are accepted and ignored with a warning, and so is v1.x's
//! `--connection-timeout` (with upstream's old warning).

use plugreg_sidecar_kit::compat::Upstream;
use plugreg_sidecar_kit::flags::{self as kit, Command, SidecarFlags, Syntax};
use plugreg_sidecar_kit::goflag::{Kind, Spec, Value, flag};
use plugreg_sidecar_kit::gosyntax::{SyntaxError, parse_duration};

use crate::Config;

pub use plugreg_sidecar_kit::goflag::{FLAG_ERROR_EXIT, FlagError};

/// livenessprobe's command line: Go's `flag` syntax, no controller block.
pub const COMMAND: Command = Command {
    syntax: Syntax::Go,
    legacy_usage: "Legacy klog flag (no longer registered by livenessprobe): accepted and ignored.",
    version_usage: "Show version (a plugreg extension).",
    controller: false,
    upstream: Upstream::LivenessProbe,
};

/// The whole command line.
pub type Flags = kit::Flags<Config>;
/// What the command line asks for.
pub type Parsed = kit::Parsed<Config>;

/// livenessprobe's own flags, sorted by name.
const SPECS: &[Spec] = &[
    flag(
        "automaxprocs",
        Kind::Bool,
        "",
        "",
        "Set GOMAXPROCS from the container's CPU quota. Accepted for compatibility: this runtime is single-threaded.",
    ),
    flag(
        "csi-address",
        Kind::String,
        "string",
        "/run/csi/socket",
        "Address of the CSI driver socket to probe (a path or unix://PATH).",
    ),
    flag(
        "health-port",
        Kind::String,
        "string",
        "9808",
        "(deprecated) TCP port of the 0.0.0.0 listener for /healthz, used when --http-endpoint is empty. Only one of `--health-port` and `--http-endpoint` can be set.",
    ),
    flag(
        "http-endpoint",
        Kind::String,
        "string",
        "",
        "The TCP network address where the HTTP server for /healthz (and metrics) will listen (example: `:9808`). Empty means 0.0.0.0:<--health-port>. Only one of `--health-port` and `--http-endpoint` can be set.",
    ),
    flag(
        "metrics-address",
        Kind::String,
        "string",
        "",
        "(deprecated) The TCP network address of a separate HTTP server for metrics only. Only one of `--metrics-address` and `--http-endpoint` can be set.",
    ),
    flag(
        "metrics-path",
        Kind::String,
        "string",
        "/metrics",
        "The HTTP path where prometheus metrics will be exposed.",
    ),
    flag(
        "probe-timeout",
        Kind::Duration,
        "duration",
        "3s",
        "How long one /healthz check may take: connecting to the driver plus its Probe call.",
    ),
];

/// The name of every flag (without dashes), sorted, legacy klog flags included.
pub fn names() -> impl Iterator<Item = &'static str> {
    COMMAND.names::<Config>()
}

/// Whether `name` is a boolean flag (one that takes a value only as `-name=value`).
pub fn is_bool(name: &str) -> bool {
    COMMAND.is_bool::<Config>(name)
}

/// The usage text Go's `flag` package would print for these flags, for the program `argv0`.
pub fn usage(argv0: &str) -> String {
    COMMAND.usage::<Config>(argv0)
}

/// Parses the arguments after the program name.
pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Parsed, FlagError> {
    COMMAND.parse(args)
}

impl SidecarFlags for Config {
    fn specs() -> &'static [Spec] {
        SPECS
    }

    fn set(&mut self, spec: &Spec, value: Value<'_>) -> Result<(), SyntaxError> {
        let c = self;
        match (spec.name, value) {
            ("automaxprocs", Value::Bool(b)) => c.automaxprocs = b,
            ("csi-address", Value::Text(v)) => c.csi_address = v.to_owned(),
            ("health-port", Value::Text(v)) => c.health_port = v.to_owned(),
            ("http-endpoint", Value::Text(v)) => c.http_endpoint = v.to_owned(),
            ("metrics-address", Value::Text(v)) => c.metrics_address = v.to_owned(),
            ("metrics-path", Value::Text(v)) => c.metrics_path = v.to_owned(),
            // A Go duration; a negative one acts as an expired deadline (zero).
            ("probe-timeout", Value::Text(v)) => c.probe_timeout = parse_duration(v)?,
            (other, value) => unreachable!("--{other}={value:?} is in no table"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use plugreg_sidecar_kit::goflag;
    use plugreg_sidecar_kit::logging::LogFormat;

    fn run(args: &[&str]) -> Flags {
        match parse(args) {
            Ok(Parsed::Run(f)) => *f,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    fn err(args: &[&str]) -> String {
        match parse(args) {
            Err(FlagError(m)) => m,
            other => panic!("{args:?} must fail: {other:?}"),
        }
    }

    /// Upstream's flag table: every flag, its type and default.
    #[test]
    fn flag_table_matches_upstream() {
        let f = run(&[]);
        let c = &f.options;
        assert_eq!(c.csi_address, "/run/csi/socket");
        assert_eq!(c.probe_timeout, Duration::from_secs(3));
        assert_eq!(c.health_port, "9808");
        assert_eq!(c.http_endpoint, "");
        assert_eq!(c.metrics_address, "");
        assert_eq!(c.metrics_path, "/metrics");
        assert!(!c.automaxprocs);
        assert!(!f.version);
        assert_eq!(f.logging.verbosity, 0);
        assert_eq!(f.logging.validate(), Ok(LogFormat::Text));

        // (flag, type in the usage, default in the usage)
        let upstream: &[(&str, &str, Option<&str>)] = &[
            ("automaxprocs", "", None),
            ("csi-address", "string", Some("\"/run/csi/socket\"")),
            ("health-port", "string", Some("\"9808\"")),
            ("http-endpoint", "string", None),
            ("log-flush-frequency", "duration", Some("5s")),
            ("log-json-info-buffer-size", "quantity", None),
            ("log-json-split-stream", "", None),
            ("log-text-info-buffer-size", "quantity", None),
            ("log-text-split-stream", "", None),
            ("logging-format", "string", Some("\"text\"")),
            ("metrics-address", "string", None),
            ("metrics-path", "string", Some("\"/metrics\"")),
            ("probe-timeout", "duration", Some("3s")),
            ("v", "value", None),
            ("vmodule", "value", None),
        ];
        let u = usage("/livenessprobe");
        assert!(u.starts_with("Usage of /livenessprobe:\n"));
        for (name, type_name, default) in upstream {
            let head = if type_name.is_empty() {
                format!("  -{name}\n")
            } else {
                format!("  -{name} {type_name}\n")
            };
            let at = u.find(&head).unwrap_or_else(|| panic!("{head:?} in\n{u}"));
            let line = u[at + head.len()..].lines().next().unwrap();
            if let Some(d) = default {
                assert!(line.ends_with(&format!("(default {d})")), "{name}: {line}");
            } else {
                assert!(!line.contains("(default"), "{name}: {line}");
            }
        }
        for (name, kind, _) in plugreg_sidecar_kit::goflag::LEGACY_KLOG {
            let spec = goflag::lookup(&COMMAND.specs::<Config>(), name)
                .copied()
                .unwrap_or_else(|| panic!("legacy {name}"));
            assert!(spec.legacy && spec.kind == *kind, "legacy {name}");
        }
        let names: Vec<_> = names().collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        assert_eq!(names, sorted, "flags are listed sorted, as Go does");
    }

    #[test]
    fn values_use_go_syntax() {
        let f = run(&[
            "-csi-address",
            "/csi/csi.sock",
            "--probe-timeout=1m30s",
            "--health-port=9999",
            "--metrics-path=/m",
            "-v=5",
        ]);
        assert_eq!(f.options.csi_address, "/csi/csi.sock");
        assert_eq!(f.options.probe_timeout, Duration::from_secs(90));
        assert_eq!(f.options.health_port, "9999");
        assert_eq!(f.options.metrics_path, "/m");
        assert_eq!(f.logging.verbosity, 5);
        // health-port is a string upstream: any text is accepted here (listening may fail).
        assert_eq!(run(&["--health-port=abc"]).options.health_port, "abc");
        assert_eq!(
            err(&["--probe-timeout=3"]),
            "invalid value \"3\" for flag -probe-timeout: parse error"
        );
        assert_eq!(
            run(&["--probe-timeout=-1s"]).options.probe_timeout,
            Duration::ZERO
        );
        assert!(run(&["--automaxprocs"]).options.automaxprocs);
        assert!(run(&["--version"]).version);
    }

    #[test]
    fn errors_and_help_are_go_s() {
        assert_eq!(err(&["--x"]), "flag provided but not defined: -x");
        for not_defined in ["--timeout=1s", "--kubelet-registration-path=/p", "--mode=x"] {
            assert!(err(&[not_defined]).starts_with("flag provided but not defined"));
        }
        assert_eq!(
            err(&["--csi-address"]),
            "flag needs an argument: -csi-address"
        );
        assert_eq!(
            err(&["-automaxprocs=maybe"]),
            "invalid boolean value \"maybe\" for -automaxprocs: parse error"
        );
        for h in ["-h", "-help", "--help"] {
            assert_eq!(parse(&[h]), Ok(Parsed::Help));
        }
        let f = run(&["--logtostderr", "--log-file-max-size=10", "--v=2"]);
        assert_eq!(f.legacy, ["logtostderr", "log-file-max-size"]);
        assert_eq!(f.logging.verbosity, 2);
        // Parsing stops at the first non-flag argument.
        assert_eq!(run(&["x", "--bogus"]).options, Config::default());
    }

    #[test]
    fn connection_timeout_of_v1_is_accepted_with_upstreams_old_warning() {
        let f = run(&["--connection-timeout=3s", "--csi-address=/s"]);
        assert_eq!(
            f.outdated[0].warning,
            "Warning: option connection-timeout=\"3s\" is deprecated and has no effect"
        );
        assert!(err(&["--connection-timeout=x"]).contains("-connection-timeout"));
    }
}
