//! Value syntax of Go's `flag` and `strconv` packages: booleans, integers, durations, and the
//! Kubernetes quantities and `pattern=N` lists of the logging flags. Each parser returns the
//! short reason Go gives (`parse error`, `value out of range`) so error lines read the same.

use std::time::Duration;

/// Why a value was refused, worded as Go words it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyntaxError {
    /// Not the expected syntax.
    #[error("parse error")]
    Parse,
    /// Syntactically fine but does not fit the type.
    #[error("value out of range")]
    Range,
    /// A free-form complaint (vmodule, quantities).
    #[error("{0}")]
    Other(String),
}

/// `strconv.ParseBool`: 1, t, T, TRUE, true, True, 0, f, F, FALSE, false, False.
pub fn parse_bool(s: &str) -> Result<bool, SyntaxError> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(SyntaxError::Parse),
    }
}

/// `strconv.ParseInt(s, 0, 64)`: optional sign, then decimal, `0x` hex, `0o`/`0` octal or `0b`
/// binary digits, with `_` allowed between digits when a base prefix is used (Go literal rules).
pub fn parse_int(s: &str) -> Result<i64, SyntaxError> {
    let (negative, body) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let magnitude = parse_uint_body(body)?;
    if negative {
        if magnitude > i64::MAX as u64 + 1 {
            return Err(SyntaxError::Range);
        }
        Ok((magnitude as i128).wrapping_neg() as i64)
    } else {
        i64::try_from(magnitude).map_err(|_| SyntaxError::Range)
    }
}

/// `strconv.ParseUint(s, 0, 64)`: like [`parse_int`] without a sign.
pub fn parse_uint(s: &str) -> Result<u64, SyntaxError> {
    parse_uint_body(s)
}

fn parse_uint_body(s: &str) -> Result<u64, SyntaxError> {
    if s.is_empty() {
        return Err(SyntaxError::Parse);
    }
    let lower = s.get(..2).map(str::to_ascii_lowercase);
    let (radix, digits, prefixed) = match lower.as_deref() {
        Some("0x") => (16, &s[2..], true),
        Some("0o") => (8, &s[2..], true),
        Some("0b") => (2, &s[2..], true),
        _ if s.len() > 1 && s.starts_with('0') => (8, &s[1..], true),
        _ => (10, s, false),
    };
    // Go literal rules: each `_` separates two digits, or the base prefix and a digit.
    if digits.contains('_')
        && (digits.ends_with('_')
            || digits.contains("__")
            || (!prefixed && digits.starts_with('_')))
    {
        return Err(SyntaxError::Parse);
    }
    let digits: String = digits.chars().filter(|&c| c != '_').collect();
    if digits.is_empty() {
        return Err(SyntaxError::Parse);
    }
    let mut value: u64 = 0;
    let mut overflow = false;
    for c in digits.chars() {
        let d = c.to_digit(radix).ok_or(SyntaxError::Parse)?;
        match value
            .checked_mul(u64::from(radix))
            .and_then(|v| v.checked_add(u64::from(d)))
        {
            Some(v) => value = v,
            None => overflow = true,
        }
    }
    if overflow {
        return Err(SyntaxError::Range);
    }
    Ok(value)
}

/// `strconv.ParseUint(s, 10, 32)`: what `-v` accepts.
pub fn parse_u32_decimal(s: &str) -> Result<u32, SyntaxError> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(SyntaxError::Parse);
    }
    s.parse::<u32>().map_err(|_| SyntaxError::Range)
}

/// `time.ParseDuration`, in nanoseconds (Go durations may be negative): a signed sequence of
/// decimal numbers with optional fraction and a unit (`ns`, `us`, `µs`, `ms`, `s`, `m`, `h`),
/// such as `300ms`, `-1.5h` or `2h45m`. A bare number is accepted only for `0`.
pub fn parse_duration_nanos(s: &str) -> Result<i64, SyntaxError> {
    let (negative, mut rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    if rest == "0" {
        return Ok(0);
    }
    if rest.is_empty() {
        return Err(SyntaxError::Parse);
    }
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        let int_part = &rest[..int_len];
        rest = &rest[int_len..];
        let mut frac_part = "";
        if let Some(after_dot) = rest.strip_prefix('.') {
            let frac_len = after_dot.bytes().take_while(u8::is_ascii_digit).count();
            frac_part = &after_dot[..frac_len];
            rest = &after_dot[frac_len..];
        }
        if int_part.is_empty() && frac_part.is_empty() {
            return Err(SyntaxError::Parse);
        }
        let unit_len = rest
            .char_indices()
            .find(|&(_, c)| c == '.' || c.is_ascii_digit())
            .map_or(rest.len(), |(i, _)| i);
        let unit = match &rest[..unit_len] {
            "ns" => 1u128,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(SyntaxError::Parse),
        };
        rest = &rest[unit_len..];
        let int: u128 = if int_part.is_empty() {
            0
        } else {
            int_part.parse().map_err(|_| SyntaxError::Parse)?
        };
        let mut amount = int.checked_mul(unit).ok_or(SyntaxError::Parse)?;
        if !frac_part.is_empty() {
            // Go keeps as many fraction digits as fit. 18 digits are plenty for nanoseconds and
            // keep `frac * unit` (< 10^18 * 3.6e12) far inside u128; 30 overflowed it.
            let digits = &frac_part[..frac_part.len().min(18)];
            let frac: u128 = digits.parse().map_err(|_| SyntaxError::Parse)?;
            amount += frac * unit / 10u128.pow(digits.len() as u32);
        }
        total = total.checked_add(amount).ok_or(SyntaxError::Parse)?;
        if total > i64::MAX as u128 + u128::from(negative) {
            return Err(SyntaxError::Parse);
        }
    }
    Ok(if negative {
        (total as i128).wrapping_neg() as i64
    } else {
        total as i64
    })
}

/// [`parse_duration_nanos`] with negative values clamped to zero (for settings where Go's
/// negative durations act like zero: an already expired deadline).
pub fn parse_duration(s: &str) -> Result<Duration, SyntaxError> {
    parse_duration_nanos(s).map(|n| Duration::from_nanos(n.max(0) as u64))
}

/// A Kubernetes resource quantity (`512`, `1K`, `2Ki`, `5Mi`, `1.5G`, `1e3`); returns whether it
/// is non-zero, which is all the alpha logging options need.
pub fn parse_quantity_nonzero(s: &str) -> Result<bool, SyntaxError> {
    let bad = || {
        SyntaxError::Other("quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'".into())
    };
    let body = s.strip_prefix(['+', '-']).unwrap_or(s);
    let num_len = body
        .bytes()
        .take_while(|b| b.is_ascii_digit() || *b == b'.')
        .count();
    let (number, suffix) = body.split_at(num_len);
    if number.is_empty() || number.bytes().filter(|&b| b == b'.').count() > 1 || number == "." {
        return Err(bad());
    }
    let suffix_ok = matches!(
        suffix,
        "" | "Ki"
            | "Mi"
            | "Gi"
            | "Ti"
            | "Pi"
            | "Ei"
            | "n"
            | "u"
            | "m"
            | "k"
            | "M"
            | "G"
            | "T"
            | "P"
            | "E"
    ) || (suffix.len() > 1
        && suffix.starts_with(['e', 'E'])
        && suffix[1..]
            .strip_prefix(['+', '-'])
            .unwrap_or(&suffix[1..])
            .bytes()
            .all(|b| b.is_ascii_digit())
        && suffix[1..].bytes().any(|b| b.is_ascii_digit()));
    if !suffix_ok {
        return Err(bad());
    }
    Ok(number.bytes().any(|b| (b'1'..=b'9').contains(&b)))
}

/// Checks a `--vmodule` list: comma-separated `pattern=N` (an empty string is an empty list).
pub fn check_vmodule(s: &str) -> Result<(), SyntaxError> {
    if s.is_empty() {
        return Ok(());
    }
    for part in s.split(',') {
        let Some((pattern, level)) = part.split_once('=').filter(|(_, l)| !l.contains('=')) else {
            return Err(SyntaxError::Other(
                "expect comma-separated list of filename=N".into(),
            ));
        };
        if pattern.is_empty() {
            return Err(SyntaxError::Other(
                "expect comma-separated list of filename=N".into(),
            ));
        }
        parse_u32_decimal(level)
            .map_err(|e| SyntaxError::Other(format!("parsing verbosity in {part:?}: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: i64 = 1_000_000_000;

    #[test]
    fn durations_follow_go_syntax() {
        let ok: &[(&str, i64)] = &[
            ("0", 0),
            ("-0", 0),
            ("+0", 0),
            ("1s", SEC),
            ("500ms", SEC / 2),
            ("1m30s", 90 * SEC),
            ("1h", 3600 * SEC),
            ("2h45m", (2 * 3600 + 45 * 60) * SEC),
            ("1.5s", 3 * SEC / 2),
            (".5s", SEC / 2),
            ("1.s", SEC),
            ("10us", 10_000),
            ("10µs", 10_000),
            ("10μs", 10_000),
            ("7ns", 7),
            ("-1s", -SEC),
            ("+2s", 2 * SEC),
            ("0s", 0),
            ("1h1m1s1ms1us1ns", 3_661_001_001_001),
            // Many fraction digits: found by the goflags fuzz target (overflowed before).
            ("1.999999999999999999999999999999h", 7_199_999_999_999),
        ];
        for (s, want) in ok {
            assert_eq!(parse_duration_nanos(s), Ok(*want), "{s:?}");
        }
        for bad in [
            "", "1", "10", "s", ".s", "1x", "1sec", "1 s", "-", "1s ", "1.2.3s", "3000000h",
        ] {
            assert_eq!(
                parse_duration_nanos(bad),
                Err(SyntaxError::Parse),
                "{bad:?}"
            );
        }
        assert_eq!(parse_duration("-1s"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
    }

    #[test]
    fn ints_follow_go_syntax() {
        let ok: &[(&str, i64)] = &[
            ("0", 0),
            ("9809", 9809),
            ("-1", -1),
            ("+7", 7),
            ("0x1F", 31),
            ("0X1f", 31),
            ("017", 15),
            ("0o17", 15),
            ("0b101", 5),
            ("0x_1F", 31),
            ("0_17", 15),
            ("1_000", 1000),
        ];
        for (s, want) in ok {
            assert_eq!(parse_int(s), Ok(*want), "{s:?}");
        }
        for bad in [
            "", "-", "abc", "1.5", "0x", "08", "_1", "0x__1", "0x1_", "9e3",
        ] {
            assert_eq!(parse_int(bad), Err(SyntaxError::Parse), "{bad:?}");
        }
        assert_eq!(parse_int("9223372036854775808"), Err(SyntaxError::Range));
        assert_eq!(parse_int("-9223372036854775808"), Ok(i64::MIN));
        assert_eq!(parse_uint("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(parse_uint("-1"), Err(SyntaxError::Parse));
        assert_eq!(parse_u32_decimal("5"), Ok(5));
        assert_eq!(parse_u32_decimal("0x5"), Err(SyntaxError::Parse));
        assert_eq!(parse_u32_decimal("-1"), Err(SyntaxError::Parse));
        assert_eq!(parse_u32_decimal("4294967296"), Err(SyntaxError::Range));
    }

    #[test]
    fn bools_follow_strconv() {
        for t in ["1", "t", "T", "TRUE", "true", "True"] {
            assert_eq!(parse_bool(t), Ok(true), "{t}");
        }
        for f in ["0", "f", "F", "FALSE", "false", "False"] {
            assert_eq!(parse_bool(f), Ok(false), "{f}");
        }
        for bad in ["", "yes", "on", "tRuE", "2"] {
            assert_eq!(parse_bool(bad), Err(SyntaxError::Parse), "{bad:?}");
        }
    }

    #[test]
    fn quantities_and_vmodule() {
        for (s, nonzero) in [
            ("0", false),
            ("0Ki", false),
            ("512", true),
            ("2Ki", true),
            ("1.5M", true),
            ("1e3", true),
            ("0.0", false),
        ] {
            assert_eq!(parse_quantity_nonzero(s), Ok(nonzero), "{s}");
        }
        for bad in ["", "x", "1Qi", "1..2", "e3", "1K", "1e"] {
            assert!(parse_quantity_nonzero(bad).is_err(), "{bad:?}");
        }
        for good in ["", "main=5", "*.go=2,foo=0"] {
            assert_eq!(check_vmodule(good), Ok(()), "{good:?}");
        }
        for bad in ["main", "main=x", "=3", "a=1=2", "a=1,"] {
            assert!(check_vmodule(bad).is_err(), "{bad:?}");
        }
    }
}
