//! The checks behind the `goflags` fuzz target and its property test: Go `flag` syntax and the
//! flag table (`flags::parse`) and the Go value parsers (`gosyntax`), fed arbitrary bytes.
//!
//! Shared by `tests/props.rs` (arbtest, in the normal suite) and `fuzz/fuzz_targets/goflags.rs`
//! (libFuzzer), which include this file with `#[path]`.

use plugreg_node_driver_registrar::flags::{self, FlagError, Parsed};
use plugreg_node_driver_registrar::gosyntax;

/// Values that reach the interesting branches of the value parsers.
const VALUES: &[&str] = &[
    "",
    "0",
    "1",
    "-1",
    "true",
    "false",
    "T",
    "0x1F",
    "017",
    "0b101",
    "1s",
    "-1.5h",
    "500ms",
    "1.999999999999999999999999999999h",
    "9223372036854775807ns",
    "2562047h",
    "18446744073709551616",
    "5Mi",
    "1e3",
    ".",
    "a=1,b=2",
    "=1",
    "µs",
    "unix:///x",
    ":9809",
    "--",
    "-v",
];

/// Reads the input as a command line: a tiny grammar of dashes, flag names, `=` and values
/// (so the fuzzer reaches the table quickly), with raw bytes mixed in.
pub fn args_from(data: &[u8]) -> Vec<String> {
    let names: Vec<&str> = flags::names().collect();
    let mut args = Vec::new();
    let mut bytes = data.iter().copied();
    while let Some(op) = bytes.next() {
        let pick = |b: Option<u8>, n: usize| usize::from(b.unwrap_or(0)) % n;
        let arg = match op % 8 {
            0..=2 => {
                let dashes = ["-", "--", "---", ""][pick(bytes.next(), 4)];
                let name = names[pick(bytes.next(), names.len())];
                match op % 3 {
                    0 => format!("{dashes}{name}"),
                    _ => format!(
                        "{dashes}{name}={}",
                        VALUES[pick(bytes.next(), VALUES.len())]
                    ),
                }
            }
            3..=4 => VALUES[pick(bytes.next(), VALUES.len())].to_owned(),
            _ => {
                // Raw: up to 16 bytes, lossily UTF-8.
                let len = pick(bytes.next(), 17);
                let raw: Vec<u8> = bytes.by_ref().take(len).collect();
                String::from_utf8_lossy(&raw).into_owned()
            }
        };
        args.push(arg);
    }
    args
}

/// Every property, for one input.
pub fn check(data: &[u8]) {
    let args = args_from(data);
    check_command_line(&args);
    // The value parsers on the raw input as one string.
    check_values(&String::from_utf8_lossy(data));
    for a in &args {
        check_values(a);
    }
}

/// `flags::parse` never panics, words its errors as Go does, and agrees with itself on the
/// equivalent spellings of one command line.
pub fn check_command_line(args: &[String]) {
    let parsed = flags::parse(args);
    match &parsed {
        Err(FlagError(msg)) => {
            const GO_ERRORS: &[&str] = &[
                "bad flag syntax: ",
                "flag provided but not defined: -",
                "flag needs an argument: -",
                "invalid boolean value ",
                "invalid value ",
            ];
            assert!(
                GO_ERRORS.iter().any(|p| msg.starts_with(p)),
                "{args:?}: unexpected error wording {msg:?}"
            );
        }
        Ok(Parsed::Help) => {}
        Ok(Parsed::Run(f)) => {
            // Validation never panics either.
            let _ = f.logging.validate();
            // Nothing after `--` counts.
            let mut more = args.to_vec();
            more.push("--".into());
            more.extend(args.iter().cloned());
            assert_eq!(flags::parse(&more), parsed, "{args:?} then -- ...");
        }
    }
    // `-name=value` and `--name value` mean the same for every non-boolean flag, `-b` and
    // `-b=true` for every boolean one.
    if let [first, rest @ ..] = args {
        // A few flags per input (all of them would slow the fuzzer down forty-fold).
        let names: Vec<&str> = flags::names().collect();
        let chosen = [first.len(), rest.len(), first.len() + 7 * rest.len()];
        for name in chosen.map(|i| names[i % names.len()]) {
            let joined: Vec<String> = if flags::is_bool(name) {
                std::iter::once(format!("-{name}=true"))
                    .chain(rest.iter().cloned())
                    .collect()
            } else {
                std::iter::once(format!("-{name}={first}"))
                    .chain(rest.iter().cloned())
                    .collect()
            };
            let split: Vec<String> = if flags::is_bool(name) {
                std::iter::once(format!("--{name}"))
                    .chain(rest.iter().cloned())
                    .collect()
            } else {
                [format!("--{name}"), first.clone()]
                    .into_iter()
                    .chain(rest.iter().cloned())
                    .collect()
            };
            assert_eq!(
                flags::parse(&joined),
                flags::parse(&split),
                "{joined:?} vs {split:?}"
            );
        }
    }
}

/// The Go value parsers never panic, and what they accept reads back the same.
pub fn check_values(s: &str) {
    if let Ok(b) = gosyntax::parse_bool(s) {
        assert_eq!(gosyntax::parse_bool(&b.to_string()), Ok(b));
    }
    if let Ok(v) = gosyntax::parse_int(s) {
        assert_eq!(gosyntax::parse_int(&v.to_string()), Ok(v), "{s:?}");
    }
    if let Ok(v) = gosyntax::parse_uint(s) {
        assert_eq!(gosyntax::parse_uint(&v.to_string()), Ok(v), "{s:?}");
    }
    if let Ok(v) = gosyntax::parse_u32_decimal(s) {
        assert_eq!(gosyntax::parse_u32_decimal(&v.to_string()), Ok(v), "{s:?}");
    }
    if let Ok(n) = gosyntax::parse_duration_nanos(s) {
        assert_eq!(
            gosyntax::parse_duration_nanos(&format!("{n}ns")),
            Ok(n),
            "{s:?}"
        );
        let d = gosyntax::parse_duration(s).unwrap();
        assert_eq!(d.as_nanos(), u128::from(n.max(0).unsigned_abs()), "{s:?}");
    }
    let _ = gosyntax::parse_quantity_nonzero(s);
    let _ = gosyntax::check_vmodule(s);
}
