//! Go's `flag` package over a table of [`Spec`]s: `-flag` and `--flag`, `-flag=value` and
//! `-flag value`, booleans take a value only in the `=` form, parsing stops at the first
//! non-flag argument or after `--`, an unknown flag is an error (exit [`FLAG_ERROR_EXIT`]) and
//! `-h`/`-help` asks for the usage (exit 0). Errors and the usage text are worded as Go words
//! them. The logging flags of component-base and the legacy klog flags are here as [`Spec`]s,
//! for each sidecar's table.

use std::fmt::Write as _;

use crate::gosyntax::{SyntaxError, parse_bool, parse_duration_nanos, parse_int, parse_uint};

/// A command-line error: print it, then the usage, to stderr and exit [`FLAG_ERROR_EXIT`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FlagError(pub String);

/// The exit code of a command-line error.
pub const FLAG_ERROR_EXIT: i32 = 2;

/// The value type of a flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `-x` or `-x=BOOL`.
    Bool,
    /// Any text.
    String,
    /// A Go duration.
    Duration,
    /// A Go `int`.
    Int,
    /// A Go `uint`.
    Uint,
    /// Free-form value shown as `value` (or another type name) in the usage.
    Value,
}

/// One flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    /// Name without dashes.
    pub name: &'static str,
    /// Value type.
    pub kind: Kind,
    /// Type name in the usage (`string`, `duration`, ...); empty for booleans.
    pub type_name: &'static str,
    /// Default as the usage shows it (empty, `0`, `0s` and `false` are not shown).
    pub default: &'static str,
    /// Help text.
    pub usage: &'static str,
    /// A legacy klog flag: accepted, its syntax checked, its value ignored.
    pub legacy: bool,
}

/// A flag of `kind`.
pub const fn flag(
    name: &'static str,
    kind: Kind,
    type_name: &'static str,
    default: &'static str,
    usage: &'static str,
) -> Spec {
    Spec {
        name,
        kind,
        type_name,
        default,
        usage,
        legacy: false,
    }
}

/// A legacy klog flag (accepted and ignored), with `usage` saying so.
pub const fn legacy(
    name: &'static str,
    kind: Kind,
    type_name: &'static str,
    usage: &'static str,
) -> Spec {
    Spec {
        name,
        kind,
        type_name,
        default: "",
        usage,
        legacy: true,
    }
}

/// A flag's value as the command line gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    /// A boolean flag (bare means `true`).
    Bool(bool),
    /// Any other flag's text.
    Text(&'a str),
}

/// How parsing ended (errors aside).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every flag was applied: run.
    Run,
    /// `-h`, `-help` or `--help` (unless the table defines them): print the usage and exit 0.
    Help,
}

/// Looks `name` up in `specs`.
pub fn lookup<'a>(specs: &'a [Spec], name: &str) -> Option<&'a Spec> {
    specs.iter().find(|s| s.name == name)
}

/// Parses the arguments after the program name against `specs`, calling `set` for each flag in
/// order; `set` refuses a value with the reason Go would give.
pub fn parse<S: AsRef<str>>(
    specs: &[Spec],
    args: &[S],
    mut set: impl FnMut(&Spec, Value<'_>) -> Result<(), SyntaxError>,
) -> Result<Outcome, FlagError> {
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_ref();
        if arg.len() < 2 || !arg.starts_with('-') {
            break;
        }
        let minuses = if arg.as_bytes()[1] == b'-' {
            if arg.len() == 2 {
                break; // "--" ends the flags
            }
            2
        } else {
            1
        };
        let body = &arg[minuses..];
        if body.is_empty() || body.starts_with('-') || body.starts_with('=') {
            return Err(FlagError(format!("bad flag syntax: {arg}")));
        }
        i += 1;
        let (name, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (body, None),
        };
        let Some(spec) = lookup(specs, name) else {
            if name == "help" || name == "h" {
                return Ok(Outcome::Help);
            }
            return Err(FlagError(format!("flag provided but not defined: -{name}")));
        };
        if spec.kind == Kind::Bool {
            let value = inline.unwrap_or("true");
            let b = parse_bool(value).map_err(|e| {
                FlagError(format!("invalid boolean value {value:?} for -{name}: {e}"))
            })?;
            set(spec, Value::Bool(b)).map_err(|e| {
                FlagError(format!("invalid boolean value {value:?} for -{name}: {e}"))
            })?;
        } else {
            let value = match inline {
                Some(v) => v,
                None => match args.get(i) {
                    Some(v) => {
                        i += 1;
                        v.as_ref()
                    }
                    None => return Err(FlagError(format!("flag needs an argument: -{name}"))),
                },
            };
            set(spec, Value::Text(value))
                .map_err(|e| FlagError(format!("invalid value {value:?} for flag -{name}: {e}")))?;
        }
    }
    Ok(Outcome::Run)
}

/// Checks `value` against the syntax of `kind` and ignores it (for legacy and no-op flags).
pub fn check_syntax(kind: Kind, value: &str) -> Result<(), SyntaxError> {
    match kind {
        Kind::Duration => parse_duration_nanos(value).map(drop),
        Kind::Int => parse_int(value).map(drop),
        Kind::Uint => parse_uint(value).map(drop),
        Kind::Bool => parse_bool(value).map(drop),
        Kind::String | Kind::Value => Ok(()),
    }
}

/// The usage text Go's `flag` package would print for `specs` (sorted by name, as Go sorts
/// them), for the program `argv0`.
pub fn usage(argv0: &str, specs: &[Spec]) -> String {
    let mut out = format!("Usage of {argv0}:\n");
    for spec in specs {
        let mut line = format!("  -{}", spec.name);
        if !spec.type_name.is_empty() {
            let _ = write!(line, " {}", spec.type_name);
        }
        // Go puts a one-letter boolean's usage on the same line.
        if line.len() <= 4 {
            line.push('\t');
        } else {
            line.push_str("\n    \t");
        }
        line.push_str(spec.usage);
        let is_zero = matches!(spec.default, "" | "0" | "0s" | "false");
        if !is_zero {
            if spec.kind == Kind::String {
                let _ = write!(line, " (default {:?})", spec.default);
            } else {
                let _ = write!(line, " (default {})", spec.default);
            }
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// component-base's logging flags, for a sidecar's table (values go to
/// [`LogOptions`](crate::logging::LogOptions)).
pub mod logging {
    use super::{Kind, Spec, flag};

    /// `--log-flush-frequency`.
    pub const LOG_FLUSH_FREQUENCY: Spec = flag(
        "log-flush-frequency",
        Kind::Duration,
        "duration",
        "5s",
        "Maximum number of seconds between log flushes.",
    );
    /// `--log-json-info-buffer-size`.
    pub const LOG_JSON_INFO_BUFFER_SIZE: Spec = flag(
        "log-json-info-buffer-size",
        Kind::Value,
        "quantity",
        "",
        "[Alpha] In JSON format with split output streams, the info messages can be buffered. Requires the LoggingAlphaOptions feature gate, which cannot be enabled here.",
    );
    /// `--log-json-split-stream`.
    pub const LOG_JSON_SPLIT_STREAM: Spec = flag(
        "log-json-split-stream",
        Kind::Bool,
        "",
        "",
        "[Alpha] In JSON format, write error messages to stderr and info messages to stdout. Requires the LoggingAlphaOptions feature gate, which cannot be enabled here.",
    );
    /// `--log-text-info-buffer-size`.
    pub const LOG_TEXT_INFO_BUFFER_SIZE: Spec = flag(
        "log-text-info-buffer-size",
        Kind::Value,
        "quantity",
        "",
        "[Alpha] In text format with split output streams, the info messages can be buffered. Requires the LoggingAlphaOptions feature gate, which cannot be enabled here.",
    );
    /// `--log-text-split-stream`.
    pub const LOG_TEXT_SPLIT_STREAM: Spec = flag(
        "log-text-split-stream",
        Kind::Bool,
        "",
        "",
        "[Alpha] In text format, write error messages to stderr and info messages to stdout. Requires the LoggingAlphaOptions feature gate, which cannot be enabled here.",
    );
    /// `--logging-format`.
    pub const LOGGING_FORMAT: Spec = flag(
        "logging-format",
        Kind::String,
        "string",
        "text",
        "Sets the log format. Permitted formats: \"json\", \"text\".",
    );
    /// `-v`.
    pub const V: Spec = flag(
        "v",
        Kind::Value,
        "value",
        "0",
        "number for the log level verbosity",
    );
    /// `--vmodule`.
    pub const VMODULE: Spec = flag(
        "vmodule",
        Kind::Value,
        "value",
        "",
        "comma-separated list of pattern=N settings for file-filtered logging (only works for text log format); accepted and ignored here.",
    );
}

/// The klog flags removed from the Kubernetes sidecars (name, kind, usage type name): a
/// sidecar lists them with [`legacy`] and its own usage text, sorted into its table.
pub const LEGACY_KLOG: &[(&str, Kind, &str)] = &[
    ("add-dir-header", Kind::Bool, ""),
    ("alsologtostderr", Kind::Bool, ""),
    ("log-backtrace-at", Kind::Value, "value"),
    ("log-dir", Kind::String, "string"),
    ("log-file", Kind::String, "string"),
    ("log-file-max-size", Kind::Uint, "uint"),
    ("logtostderr", Kind::Bool, ""),
    ("one-output", Kind::Bool, ""),
    ("skip-headers", Kind::Bool, ""),
    ("skip-log-headers", Kind::Bool, ""),
    ("stderrthreshold", Kind::Value, "value"),
];
