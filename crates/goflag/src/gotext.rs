//! Go's texts as upstream's sidecars print them: a string quoted by `%q` (`strconv.Quote`) and
//! `strconv.Atoi`'s errors. One copy for every sidecar that reproduces such a text.

use std::fmt::Write;

/// Go's `strconv.Quote` (what `%q` and `%#v` print for a string), for the characters that
/// occur in Kubernetes names and IDs; other non-printable characters become `\u` escapes.
pub fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\u{b}' => out.push_str("\\v"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Go's `int32(strconv.Atoi(s))`: an optional sign and decimal digits, a 64-bit range, then
/// truncated to 32 bits as Go's conversion does. The error is `strconv.Atoi`'s text.
pub fn atoi32(s: &str) -> Result<i32, String> {
    use std::num::IntErrorKind;
    match s.parse::<i64>() {
        // Truncation is Go's int32() conversion.
        Ok(v) => Ok(v as i32),
        Err(e) => {
            let why = match e.kind() {
                IntErrorKind::PosOverflow | IntErrorKind::NegOverflow => "value out of range",
                _ => "invalid syntax",
            };
            Err(format!("strconv.Atoi: parsing {}: {why}", quote(s)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_as_go_does() {
        assert_eq!(quote("pv-1"), "\"pv-1\"");
        assert_eq!(quote("a\"b\\c\n\u{1}"), "\"a\\\"b\\\\c\\n\\x01\"");
        assert_eq!(quote(""), "\"\"");
    }

    #[test]
    fn atoi_accepts_signed_decimals_and_names_go_errors() {
        assert_eq!(atoi32("0"), Ok(0));
        assert_eq!(atoi32("+3"), Ok(3));
        assert_eq!(atoi32("-2"), Ok(-2));
        assert_eq!(atoi32("4294967297"), Ok(1), "int32() truncates");
        assert_eq!(
            atoi32(""),
            Err("strconv.Atoi: parsing \"\": invalid syntax".to_owned())
        );
        assert_eq!(
            atoi32(" 1"),
            Err("strconv.Atoi: parsing \" 1\": invalid syntax".to_owned())
        );
        assert_eq!(
            atoi32("99999999999999999999"),
            Err("strconv.Atoi: parsing \"99999999999999999999\": value out of range".to_owned())
        );
    }
}
