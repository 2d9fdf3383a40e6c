//! spf13/pflag's command-line syntax over a table of [`Spec`]s (the sidecars that use pflag
//! rather than Go's `flag`, such as external-provisioner):
//!
//! - long flags take two dashes: `--name=value` or `--name value`; a boolean is `--name` or
//!   `--name=BOOL` (a separate `--name false` leaves `false` as a positional argument);
//! - a single dash is for one-letter shorthands only (`-v=5`, `-v5`, `-v 5`, `-h`); every
//!   one-letter flag is its own shorthand, as pflag gives Go-registered flags; so
//!   `-csi-address=x` fails with `unknown shorthand flag: 'c' in -csi-address`;
//! - positional arguments may appear anywhere and are returned, `--` ends the flags;
//! - an unknown flag is an error (print it and the usage to stderr, exit
//!   [`FLAG_ERROR_EXIT`]); `-h` / `--help` (unless the table defines them) ask for the usage
//!   (exit 0).
//!
//! Values are checked with [`gosyntax`](crate::gosyntax) by the caller's `set`; the shapes
//! ([`Spec`], [`Kind`], [`Value`], [`FlagError`]) are [`goflag`](crate::goflag)'s.

use std::fmt::Write as _;

pub use crate::goflag::{FLAG_ERROR_EXIT, FlagError, Kind, Spec, Value, flag, legacy, lookup};
use crate::gosyntax::SyntaxError;

/// What the command line asks for (errors aside).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every flag was applied: run. Holds the positional arguments (upstream ignores them).
    Run(Vec<String>),
    /// `-h` or `--help`: print the usage and exit 0.
    Help,
}

/// Parses the arguments after the program name against `specs`, calling `set` for each flag in
/// order (a repeated flag is set again); `set` refuses a value with the reason Go would give.
pub fn parse<S: AsRef<str>>(
    specs: &[Spec],
    args: &[S],
    mut set: impl FnMut(&Spec, Value<'_>) -> Result<(), SyntaxError>,
) -> Result<Outcome, FlagError> {
    let mut positional = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_ref();
        i += 1;
        if arg.len() < 2 || !arg.starts_with('-') {
            positional.push(arg.to_owned());
            continue;
        }
        if let Some(body) = arg.strip_prefix("--") {
            if body.is_empty() {
                positional.extend(args[i..].iter().map(|a| a.as_ref().to_owned()));
                break;
            }
            if body.starts_with('-') || body.starts_with('=') {
                return Err(FlagError(format!("bad flag syntax: {arg}")));
            }
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (body, None),
            };
            let Some(spec) = lookup(specs, name) else {
                if name == "help" {
                    return Ok(Outcome::Help);
                }
                return Err(FlagError(format!("unknown flag: --{name}")));
            };
            let value = match (inline, spec.kind) {
                (Some(v), _) => v,
                (None, Kind::Bool) => "true",
                (None, _) => match args.get(i) {
                    Some(v) => {
                        i += 1;
                        v.as_ref()
                    }
                    None => return Err(FlagError(format!("flag needs an argument: {arg}"))),
                },
            };
            apply(spec, value, &mut set)?;
        } else {
            // A run of shorthands: `-abc` is `-a -b -c` while they are booleans; a valued one
            // takes the rest of the run (or the next argument) as its value.
            let mut shorts = &arg[1..];
            while let Some(c) = shorts.chars().next() {
                let name = &shorts[..c.len_utf8()];
                let spec = lookup(specs, name).filter(|s| s.name.chars().count() == 1);
                let Some(spec) = spec else {
                    if c == 'h' {
                        return Ok(Outcome::Help);
                    }
                    return Err(FlagError(format!(
                        "unknown shorthand flag: {c:?} in -{}",
                        &arg[1..]
                    )));
                };
                let rest = &shorts[c.len_utf8()..];
                let value;
                if let Some(v) = rest.strip_prefix('=') {
                    value = v;
                    shorts = "";
                } else if spec.kind == Kind::Bool {
                    value = "true";
                    shorts = rest;
                } else if !rest.is_empty() {
                    value = rest;
                    shorts = "";
                } else if let Some(v) = args.get(i) {
                    i += 1;
                    value = v.as_ref();
                    shorts = "";
                } else {
                    return Err(FlagError(format!(
                        "flag needs an argument: {c:?} in -{}",
                        &arg[1..]
                    )));
                }
                apply(spec, value, &mut set)?;
            }
        }
    }
    Ok(Outcome::Run(positional))
}

/// Sets one flag, wording a refusal as pflag does.
fn apply(
    spec: &Spec,
    value: &str,
    set: &mut impl FnMut(&Spec, Value<'_>) -> Result<(), SyntaxError>,
) -> Result<(), FlagError> {
    let refused = |e: SyntaxError| {
        FlagError(format!(
            "invalid argument {value:?} for {:?} flag: {}",
            display_name(spec),
            go_reason(spec.kind, value, &e)
        ))
    };
    if spec.kind == Kind::Bool {
        let b = crate::gosyntax::parse_bool(value).map_err(refused)?;
        set(spec, Value::Bool(b)).map_err(refused)
    } else {
        set(spec, Value::Text(value)).map_err(refused)
    }
}

/// `-v, --v` for a one-letter flag, `--name` otherwise.
fn display_name(spec: &Spec) -> String {
    if spec.name.chars().count() == 1 {
        format!("-{0}, --{0}", spec.name)
    } else {
        format!("--{}", spec.name)
    }
}

/// The error text of the Go parser behind `kind`.
fn go_reason(kind: Kind, value: &str, e: &SyntaxError) -> String {
    let func = match kind {
        Kind::Bool => "strconv.ParseBool",
        Kind::Int => "strconv.ParseInt",
        Kind::Uint => "strconv.ParseUint",
        Kind::Duration => return format!("time: invalid duration {value:?}"),
        Kind::String | Kind::Value => return e.to_string(),
    };
    let what = match e {
        SyntaxError::Parse => "invalid syntax",
        SyntaxError::Range => "value out of range",
        SyntaxError::Other(s) => s,
    };
    format!("{func}: parsing {value:?}: {what}")
}

/// `strconv.ParseFloat(s, 64)` for decimal notation (`5`, `0.5`, `1e3`, `Inf`, `NaN`); the
/// value of a `float64` flag such as `--kube-api-qps`.
pub fn parse_float(s: &str) -> Result<f64, SyntaxError> {
    // Rust's parser accepts what Go's decimal syntax does, plus nothing dangerous; Go also takes
    // `_` separators and hex floats, which no manifest uses.
    s.parse::<f64>().map_err(|_| SyntaxError::Parse)
}

/// `strconv.ParseFloat(s, 32)`: a `float32` flag; out of `f32` range is a range error.
pub fn parse_float32(s: &str) -> Result<f32, SyntaxError> {
    let v = parse_float(s)?;
    if v.is_finite() && v.abs() > f64::from(f32::MAX) {
        return Err(SyntaxError::Range);
    }
    Ok(v as f32)
}

/// The usage text pflag prints for `specs` (in table order, which should be sorted by name as
/// pflag sorts them), for the program `argv0`.
pub fn usage(argv0: &str, specs: &[Spec]) -> String {
    let mut lines = Vec::with_capacity(specs.len());
    let mut width = 0;
    for spec in specs {
        let mut head = if spec.name.chars().count() == 1 {
            format!("  -{0}, --{0}", spec.name)
        } else {
            format!("      --{}", spec.name)
        };
        if !spec.type_name.is_empty() {
            let _ = write!(head, " {}", spec.type_name);
        }
        width = width.max(head.len());
        let mut text = spec.usage.to_owned();
        if !matches!(spec.default, "" | "0" | "0s" | "false" | "[]") {
            if spec.kind == Kind::String {
                let _ = write!(text, " (default {:?})", spec.default);
            } else {
                let _ = write!(text, " (default {})", spec.default);
            }
        }
        lines.push((head, text));
    }
    let mut out = format!("Usage of {argv0}:\n");
    for (head, text) in lines {
        let _ = writeln!(out, "{head:width$}   {text}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gosyntax::{parse_duration, parse_int};

    const SPECS: &[Spec] = &[
        flag(
            "csi-address",
            Kind::String,
            "string",
            "/run/csi/socket",
            "socket",
        ),
        flag("leader-election", Kind::Bool, "", "", "elect"),
        flag("timeout", Kind::Duration, "duration", "10s", "deadline"),
        flag("v", Kind::Value, "Level", "0", "verbosity"),
        flag("worker-threads", Kind::Uint, "uint", "100", "workers"),
        flag("x", Kind::Bool, "", "", "one-letter boolean"),
    ];

    /// Parses `args`, returning the outcome and the flags set, as `name=value`.
    fn run(args: &[&str]) -> Result<(Outcome, Vec<String>), FlagError> {
        let mut seen = Vec::new();
        let outcome = parse(SPECS, args, |spec, value| {
            let shown = match value {
                Value::Bool(b) => b.to_string(),
                Value::Text(t) => {
                    match spec.kind {
                        Kind::Duration => {
                            parse_duration(t)?;
                        }
                        Kind::Int | Kind::Uint => {
                            parse_int(t)?;
                        }
                        _ => {}
                    }
                    t.to_owned()
                }
            };
            seen.push(format!("{}={shown}", spec.name));
            Ok(())
        })?;
        Ok((outcome, seen))
    }

    fn set(args: &[&str]) -> Vec<String> {
        run(args).unwrap().1
    }

    fn err(args: &[&str]) -> String {
        run(args).unwrap_err().0
    }

    #[test]
    fn long_flags_take_equals_or_the_next_argument() {
        assert_eq!(set(&["--csi-address=/a"]), ["csi-address=/a"]);
        assert_eq!(set(&["--csi-address", "/a"]), ["csi-address=/a"]);
        assert_eq!(set(&["--csi-address="]), ["csi-address="]);
        assert_eq!(set(&["--timeout", "1m30s"]), ["timeout=1m30s"]);
    }

    #[test]
    fn booleans_take_a_value_only_after_equals() {
        assert_eq!(set(&["--leader-election"]), ["leader-election=true"]);
        assert_eq!(set(&["--leader-election=false"]), ["leader-election=false"]);
        let (outcome, seen) = run(&["--leader-election", "false"]).unwrap();
        assert_eq!(seen, ["leader-election=true"]);
        assert_eq!(outcome, Outcome::Run(vec!["false".into()]));
        assert_eq!(
            err(&["--leader-election=maybe"]),
            "invalid argument \"maybe\" for \"--leader-election\" flag: strconv.ParseBool: parsing \"maybe\": invalid syntax"
        );
    }

    #[test]
    fn one_dash_is_for_shorthands_only() {
        assert_eq!(set(&["-v=5"]), ["v=5"]);
        assert_eq!(set(&["-v", "5"]), ["v=5"]);
        assert_eq!(set(&["-v5"]), ["v=5"]);
        assert_eq!(set(&["--v=5"]), ["v=5"]);
        assert_eq!(set(&["-x"]), ["x=true"]);
        assert_eq!(set(&["-xv", "3"]), ["x=true", "v=3"]);
        assert_eq!(
            err(&["-csi-address=x"]),
            "unknown shorthand flag: 'c' in -csi-address=x"
        );
        assert_eq!(
            err(&["-csi-address"]),
            "unknown shorthand flag: 'c' in -csi-address"
        );
    }

    #[test]
    fn help_and_unknown_flags() {
        assert_eq!(run(&["-h"]).unwrap().0, Outcome::Help);
        assert_eq!(run(&["--help"]).unwrap().0, Outcome::Help);
        assert_eq!(
            run(&["--v=1", "--help", "--bogus"]).unwrap().0,
            Outcome::Help
        );
        assert_eq!(err(&["--bogus"]), "unknown flag: --bogus");
        assert_eq!(err(&["--bogus=1"]), "unknown flag: --bogus");
        assert_eq!(err(&["---x"]), "bad flag syntax: ---x");
        assert_eq!(err(&["--=x"]), "bad flag syntax: --=x");
    }

    #[test]
    fn missing_values_are_errors() {
        assert_eq!(
            err(&["--csi-address"]),
            "flag needs an argument: --csi-address"
        );
        assert_eq!(err(&["-v"]), "flag needs an argument: 'v' in -v");
    }

    #[test]
    fn positional_arguments_are_kept_aside_anywhere() {
        let (outcome, seen) = run(&["a", "--v=2", "-", "b", "--", "--timeout=1s", "-x"]).unwrap();
        assert_eq!(seen, ["v=2"]);
        assert_eq!(
            outcome,
            Outcome::Run(vec![
                "a".into(),
                "-".into(),
                "b".into(),
                "--timeout=1s".into(),
                "-x".into()
            ])
        );
    }

    #[test]
    fn bad_values_are_worded_as_go_words_them() {
        assert_eq!(
            err(&["--timeout=10"]),
            "invalid argument \"10\" for \"--timeout\" flag: time: invalid duration \"10\""
        );
        assert_eq!(
            err(&["--worker-threads=many"]),
            "invalid argument \"many\" for \"--worker-threads\" flag: strconv.ParseUint: parsing \"many\": invalid syntax"
        );
    }

    #[test]
    fn repeated_flags_are_set_each_time() {
        assert_eq!(set(&["--v=1", "-v", "2"]), ["v=1", "v=2"]);
    }

    #[test]
    fn floats_parse_as_go_does() {
        assert_eq!(parse_float("5").unwrap(), 5.0);
        assert_eq!(parse_float("0.5").unwrap(), 0.5);
        assert_eq!(parse_float("1e3").unwrap(), 1000.0);
        assert!(parse_float("five").is_err());
        assert_eq!(parse_float32("1").unwrap(), 1.0);
        assert_eq!(parse_float32("1e39"), Err(SyntaxError::Range));
    }

    #[test]
    fn usage_aligns_the_columns_as_pflag_does() {
        let text = usage("csi-provisioner", SPECS);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "Usage of csi-provisioner:");
        assert_eq!(
            lines[1],
            "      --csi-address string    socket (default \"/run/csi/socket\")"
        );
        assert_eq!(lines[2], "      --leader-election       elect");
        assert_eq!(lines[4], "  -v, --v Level               verbosity");
        assert_eq!(
            lines[5],
            "      --worker-threads uint   workers (default 100)"
        );
    }
}
