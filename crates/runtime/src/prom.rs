//! Prometheus text format: the one label-value escaper every `/metrics` endpoint uses.

/// Escapes a label value for the Prometheus text format (backslash, double quote and newline are
/// the only escapes it knows); the caller adds the surrounding quotes.
pub fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_what_the_text_format_escapes_and_nothing_else() {
        assert_eq!(escape_label("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
        assert_eq!(
            escape_label("/var/lib/kubelet/x-reg.sock"),
            "/var/lib/kubelet/x-reg.sock"
        );
        assert_eq!(escape_label("tab\there é"), "tab\there é");
    }
}
