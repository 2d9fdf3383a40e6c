//! The command line of node-driver-registrar v2.17.0, parsed the way Go's `flag` package
//! parses it (R1): `-flag` and `--flag`, `-flag=value` and `-flag value`, booleans take a value
//! only in the `=` form, parsing stops at the first non-flag argument or after `--`, an unknown
//! flag is an error (exit 2) and `-h`/`-help` asks for the usage (exit 0).
//!
//! On top of upstream: the legacy klog flags (removed upstream in v2.11) are accepted and
//! ignored with a warning, `--csi-connect-window` sets how long the start-up may take to
//! reach the CSI driver and learn its name, and `--registration-socket-check-period` how often
//! the registration socket is checked (R3).

use std::time::Duration;

use plugreg_sidecar_kit::compat::Upstream;
use plugreg_sidecar_kit::flags::{self as kit, Command, SidecarFlags, Syntax};
use plugreg_sidecar_kit::goflag::{Kind, Spec, Value, flag};
use plugreg_sidecar_kit::gosyntax::{SyntaxError, parse_duration, parse_duration_nanos, parse_int};

use crate::Config;
#[cfg(test)]
use crate::logging::LogFormat;

pub use plugreg_sidecar_kit::goflag::{FLAG_ERROR_EXIT, FlagError};

/// node-driver-registrar's command line: Go's `flag` syntax, no controller block.
pub const COMMAND: Command = Command {
    syntax: Syntax::Go,
    legacy_usage: "Legacy klog flag (removed from node-driver-registrar in v2.11): accepted and ignored.",
    version_usage: "Show version.",
    controller: false,
    upstream: Upstream::Registrar,
};

/// The whole command line.
pub type Flags = kit::Flags<Config>;
/// What the command line asks for.
pub type Parsed = kit::Parsed<Config>;

/// node-driver-registrar's own flags, sorted by name.
const SPECS: &[Spec] = &[
    flag(
        "automaxprocs",
        Kind::Bool,
        "",
        "",
        "Set GOMAXPROCS from the container's CPU quota. Accepted for compatibility: this runtime is single-threaded.",
    ),
    flag(
        "connection-timeout",
        Kind::Duration,
        "duration",
        "0s",
        "The --connection-timeout flag is deprecated and has no effect.",
    ),
    flag(
        "csi-address",
        Kind::String,
        "string",
        "/run/csi/socket",
        "Path of the CSI driver socket that the node-driver-registrar will connect to (a path or unix://PATH).",
    ),
    flag(
        "csi-connect-window",
        Kind::Duration,
        "duration",
        "30s",
        "How long start-up keeps trying to connect to the CSI driver and to get its name (GetPluginInfo is retried with back-off within this window) before exiting 1.",
    ),
    flag(
        "enable-pprof",
        Kind::Bool,
        "",
        "",
        "Enable pprof profiling on --http-endpoint. Accepted for compatibility: there are no pprof handlers in this build.",
    ),
    flag(
        "health-port",
        Kind::Int,
        "int",
        "0",
        "(deprecated) TCP port for healthz requests; 0 disables it. Only one of `--health-port` and `--http-endpoint` can be set.",
    ),
    flag(
        "http-endpoint",
        Kind::String,
        "string",
        "",
        "The TCP network address where the HTTP server for diagnostics (/healthz, /metrics) will listen (example: `:9809`). Empty disables it. Only one of `--health-port` and `--http-endpoint` can be set.",
    ),
    flag(
        "kubelet-registration-path",
        Kind::String,
        "string",
        "",
        "Path of the CSI driver socket on the Kubernetes host machine.",
    ),
    flag(
        "mode",
        Kind::String,
        "string",
        "",
        "Deprecated. \"kubelet-registration-probe\" exits 0 at once; any other value means normal operation.",
    ),
    flag(
        "plugin-registration-path",
        Kind::String,
        "string",
        "/registration",
        "Path to Kubernetes plugin registration directory.",
    ),
    flag(
        "registration-socket-check-period",
        Kind::Duration,
        "duration",
        "500ms",
        "How often the registration socket is checked: if the path is empty or holds a socket nobody listens on, the socket is created again; a live socket of another instance (a rolling update) is left alone. 0 turns the check off.",
    ),
    flag(
        "timeout",
        Kind::Duration,
        "duration",
        "1s",
        "Timeout of each GetPluginInfo call at start-up and of the whole /healthz check.",
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
        let value = match (spec.name, value) {
            ("automaxprocs", Value::Bool(b)) => {
                c.automaxprocs = b;
                return Ok(());
            }
            ("enable-pprof", Value::Bool(b)) => {
                c.enable_pprof = b;
                return Ok(());
            }
            (_, Value::Text(value)) => value,
            (other, value) => unreachable!("--{other}={value:?} is in no table"),
        };
        match spec.name {
            "csi-address" => c.csi_address = value.to_owned(),
            "kubelet-registration-path" => c.kubelet_registration_path = value.to_owned(),
            "plugin-registration-path" => c.plugin_registration_path = value.to_owned(),
            "http-endpoint" => c.http_endpoint = value.to_owned(),
            "mode" => c.mode = value.to_owned(),
            "timeout" => c.timeout = parse_duration(value)?,
            "csi-connect-window" => c.csi_connect_window = parse_duration(value)?,
            "registration-socket-check-period" => c.socket_check_period = parse_duration(value)?,
            "connection-timeout" => {
                // Only "is it non-zero" matters: it is deprecated and has no effect.
                let nanos = parse_duration_nanos(value)?;
                c.connection_timeout = Duration::from_nanos(nanos.unsigned_abs());
            }
            "health-port" => c.health_port = parse_int(value)?,
            other => unreachable!("--{other} is in no table"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn defaults_match_upstream() {
        let f = run(&[]);
        let c = &f.options;
        assert_eq!(c.csi_address, "/run/csi/socket");
        assert_eq!(c.kubelet_registration_path, "");
        assert_eq!(c.plugin_registration_path, "/registration");
        assert_eq!(c.timeout, Duration::from_secs(1));
        assert_eq!(c.http_endpoint, "");
        assert_eq!(c.health_port, 0);
        assert!(!c.enable_pprof);
        assert_eq!(c.mode, "");
        assert_eq!(c.connection_timeout, Duration::ZERO);
        assert_eq!(c.csi_connect_window, Duration::from_secs(30));
        assert!(!c.automaxprocs);
        assert!(!f.version);
        assert_eq!(f.logging.verbosity, 0);
        assert_eq!(f.logging.format, "text");
        assert_eq!(f.logging.flush_frequency_nanos, 5_000_000_000);
        assert_eq!(f.logging.validate(), Ok(LogFormat::Text));
    }

    #[test]
    fn every_go_syntax_form_sets_a_value() {
        // (arguments, expected csi-address)
        let forms: &[&[&str]] = &[
            &["-csi-address=/a"],
            &["--csi-address=/a"],
            &["-csi-address", "/a"],
            &["--csi-address", "/a"],
            &["--csi-address=/x", "--csi-address=/a"],
        ];
        for args in forms {
            assert_eq!(run(args).options.csi_address, "/a", "{args:?}");
        }
        assert_eq!(run(&["--csi-address="]).options.csi_address, "");
        // A value may itself look like a flag when given separately.
        assert_eq!(run(&["--mode", "-x"]).options.mode, "-x");
        // Only the first '=' splits.
        assert_eq!(run(&["--mode=a=b"]).options.mode, "a=b");
    }

    #[test]
    fn booleans_take_a_value_only_with_equals() {
        let table: &[(&[&str], bool, &[&str])] = &[
            (&["-version"], true, &[]),
            (&["--version"], true, &[]),
            (&["-version=true"], true, &[]),
            (&["-version=1"], true, &[]),
            (&["-version=T"], true, &[]),
            (&["-version=false"], false, &[]),
            (&["--version=0"], false, &[]),
            (&["-version=F"], false, &[]),
        ];
        for (args, want, _) in table {
            assert_eq!(run(args).version, *want, "{args:?}");
        }
        // "-version false": the bool takes no separate value; "false" ends the flags.
        let f = run(&["-version", "false", "--mode=x"]);
        assert!(f.version);
        assert_eq!(f.options.mode, "", "parsing stopped at \"false\"");
        assert_eq!(
            err(&["-version=yes"]),
            "invalid boolean value \"yes\" for -version: parse error"
        );
        assert!(
            run(&["-enable-pprof", "-automaxprocs"])
                .options
                .enable_pprof
        );
        assert!(run(&["-automaxprocs"]).options.automaxprocs);
    }

    #[test]
    fn durations_and_ints_use_go_syntax() {
        let d = |args: &[&str]| run(args).options.timeout;
        assert_eq!(d(&["-timeout=500ms"]), Duration::from_millis(500));
        assert_eq!(d(&["-timeout", "1m30s"]), Duration::from_secs(90));
        assert_eq!(d(&["--timeout=1h"]), Duration::from_secs(3600));
        assert_eq!(d(&["--timeout=0"]), Duration::ZERO);
        assert_eq!(d(&["--timeout=-1s"]), Duration::ZERO);
        assert_eq!(
            err(&["--timeout=10"]),
            "invalid value \"10\" for flag -timeout: parse error"
        );
        assert_eq!(
            err(&["--timeout", "1sec"]),
            "invalid value \"1sec\" for flag -timeout: parse error"
        );
        assert_eq!(run(&["--health-port=9809"]).options.health_port, 9809);
        assert_eq!(run(&["--health-port", "0x2651"]).options.health_port, 9809);
        assert_eq!(run(&["--health-port=-1"]).options.health_port, -1);
        assert_eq!(
            err(&["--health-port=abc"]),
            "invalid value \"abc\" for flag -health-port: parse error"
        );
        assert_eq!(
            err(&["--health-port=99999999999999999999"]),
            "invalid value \"99999999999999999999\" for flag -health-port: value out of range"
        );
        assert_eq!(
            run(&["--csi-connect-window=2s"]).options.csi_connect_window,
            Duration::from_secs(2)
        );
        assert_eq!(
            run(&["--connection-timeout=1m"]).options.connection_timeout,
            Duration::from_secs(60)
        );
        assert_ne!(
            run(&["--connection-timeout=-1s"])
                .options
                .connection_timeout,
            Duration::ZERO,
            "a negative value is non-zero, so it still logs the deprecation"
        );
    }

    #[test]
    fn parsing_stops_at_the_first_non_flag_or_double_dash() {
        let f = run(&["--mode=a", "positional", "--mode=b", "--bogus"]);
        assert_eq!(f.options.mode, "a");
        let f = run(&["--mode=a", "--", "--mode=b", "--bogus"]);
        assert_eq!(f.options.mode, "a");
        let f = run(&["--mode=a", "-", "--mode=b"]);
        assert_eq!(f.options.mode, "a", "a lone '-' is a non-flag argument");
    }

    #[test]
    fn errors_are_worded_as_go_words_them() {
        assert_eq!(err(&["-x"]), "flag provided but not defined: -x");
        assert_eq!(
            err(&["--metrics-address=:8080"]),
            "flag provided but not defined: -metrics-address"
        );
        for not_defined in ["--kubeconfig=/k", "--leader-election", "--metrics-path=/m"] {
            assert!(err(&[not_defined]).starts_with("flag provided but not defined"));
        }
        assert_eq!(err(&["---x"]), "bad flag syntax: ---x");
        assert_eq!(err(&["-=x"]), "bad flag syntax: -=x");
        assert_eq!(
            err(&["--csi-address"]),
            "flag needs an argument: -csi-address"
        );
        assert_eq!(
            err(&["-v=x"]),
            "invalid value \"x\" for flag -v: parse error"
        );
        assert!(err(&["--vmodule=main"]).starts_with("invalid value \"main\" for flag -vmodule"));
    }

    #[test]
    fn help_flags_ask_for_usage() {
        for h in ["-h", "-help", "--help", "--h"] {
            assert_eq!(parse(&[h]), Ok(Parsed::Help), "{h}");
        }
        // An earlier error wins; a later one is never reached.
        assert!(parse(&["-x", "-h"]).is_err());
        assert_eq!(parse(&["-h", "-x"]), Ok(Parsed::Help));
    }

    #[test]
    fn legacy_klog_flags_are_accepted_and_listed() {
        let f = run(&[
            "--logtostderr",
            "--alsologtostderr=false",
            "--log-dir=/tmp",
            "--log-file",
            "/tmp/x.log",
            "--log-file-max-size=1800",
            "--skip-headers",
            "--skip-log-headers=true",
            "--stderrthreshold=INFO",
            "--add-dir-header",
            "--one-output",
            "--log-backtrace-at=main.go:1",
            "--csi-address=/after",
        ]);
        assert_eq!(
            f.legacy,
            [
                "logtostderr",
                "alsologtostderr",
                "log-dir",
                "log-file",
                "log-file-max-size",
                "skip-headers",
                "skip-log-headers",
                "stderrthreshold",
                "add-dir-header",
                "one-output",
                "log-backtrace-at",
            ]
        );
        assert_eq!(f.options.csi_address, "/after", "parsing went on");
        assert!(err(&["--log-file-max-size=big"]).contains("-log-file-max-size"));
    }

    #[test]
    fn logging_flags_validate_as_component_base() {
        let f = run(&["-v=5", "--vmodule=main=4", "--logging-format=json"]);
        assert_eq!(f.logging.verbosity, 5);
        assert_eq!(f.logging.validate(), Ok(LogFormat::Json));
        assert_eq!(run(&["-v", "2"]).logging.verbosity, 2);

        let invalid: &[&[&str]] = &[
            &["--logging-format=xml"],
            &["--log-flush-frequency=0"],
            &["--log-flush-frequency=-1s"],
            &["--log-text-split-stream"],
            &["--log-text-info-buffer-size=1Mi"],
            &["--log-json-split-stream=true"],
            &["--log-json-info-buffer-size=512"],
        ];
        for args in invalid {
            assert!(run(args).logging.validate().is_err(), "{args:?}");
        }
        // Setting an alpha option to its zero value is allowed, as upstream.
        let valid: &[&[&str]] = &[
            &["--log-text-split-stream=false"],
            &["--log-json-info-buffer-size=0"],
            &["--log-flush-frequency=1s"],
        ];
        for args in valid {
            assert!(run(args).logging.validate().is_ok(), "{args:?}");
        }
        assert!(err(&["--log-text-info-buffer-size=lots"]).contains("-log-text-info-buffer-size"));
    }

    #[test]
    fn usage_lists_every_flag_the_go_way() {
        let u = usage("/csi-node-driver-registrar");
        assert!(u.starts_with("Usage of /csi-node-driver-registrar:\n"));
        assert!(u.contains("  -csi-address string\n    \t"));
        assert!(u.contains("(default \"/run/csi/socket\")"));
        assert!(u.contains("  -timeout duration\n"));
        assert!(u.contains("(default 1s)"));
        assert!(u.contains("  -version\n    \tShow version."));
        for spec in COMMAND.specs::<Config>() {
            assert!(u.contains(&format!("  -{}", spec.name)), "{}", spec.name);
        }
        let names: Vec<_> = names().collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        assert_eq!(names, sorted, "flags are listed sorted, as Go does");
    }

    #[test]
    fn connection_timeout_stays_the_registrars_own_flag() {
        // Still defined by node-driver-registrar: its own deprecation line, not the kit's.
        let f = run(&["--connection-timeout=1m"]);
        assert_eq!(f.options.connection_timeout, Duration::from_secs(60));
        assert!(f.outdated.is_empty());
    }
}
