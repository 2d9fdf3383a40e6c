//! Prometheus text format (version 0.0.4): the one label-value escaper every `/metrics`
//! endpoint uses, numbers as Go's client writes them, and a histogram with fixed buckets.

use std::fmt::Write as _;

/// The Prometheus client's default histogram buckets (`prometheus.DefBuckets`), seconds.
pub const DEFAULT_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// csi-lib-utils' buckets of `csi_sidecar_operations_seconds`, seconds.
pub const CSI_OPERATION_BUCKETS: [f64; 13] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 25.0, 50.0, 120.0, 300.0, 600.0,
];

/// The name of csi-lib-utils' histogram of CSI calls.
pub const CSI_OPERATIONS: &str = "csi_sidecar_operations_seconds";

/// Its help text (component-base marks the stability level).
pub const CSI_OPERATIONS_HELP: &str =
    "[ALPHA] Container Storage Interface operation duration with gRPC error code status total";

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

/// `v` as Go's Prometheus client writes sample values and bucket bounds (`strconv`'s shortest
/// `'g'` format: `0.005`, `10`, `1e-08`, `1.5e+06`, `+Inf`, `NaN`).
pub fn float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".to_owned();
    }
    if v.is_infinite() {
        return if v > 0.0 { "+Inf" } else { "-Inf" }.to_owned();
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "-0" } else { "0" }.to_owned();
    }
    // Rust's `{:e}` gives the shortest digits that read back as `v`, as Go's shortest format.
    let sci = format!("{:e}", v.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if v < 0.0 { "-" } else { "" };
    // Go's 'g' with the shortest precision decides with precision 6: exponent form when the
    // exponent is below -4 or at least 6 (so 1e+06, 1.7e+09).
    if !(-4..6).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let dot = if rest.is_empty() { "" } else { "." };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{dot}{rest}e{esign}{:02}", exp.abs());
    }
    if exp >= 0 {
        let int_len = (exp + 1) as usize;
        if digits.len() <= int_len {
            format!("{sign}{digits}{}", "0".repeat(int_len - digits.len()))
        } else {
            let (i, f) = digits.split_at(int_len);
            format!("{sign}{i}.{f}")
        }
    } else {
        format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
    }
}

/// `# HELP` and `# TYPE` lines of a metric family.
pub fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let help = help.replace('\\', "\\\\").replace('\n', "\\n");
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Label pairs in the text format, values escaped: `a="x",b="y"` (no braces; empty for none).
pub fn labels(pairs: &[(&str, &str)]) -> String {
    let mut out = String::new();
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{k}=\"{}\"", escape_label(v));
    }
    out
}

/// One sample line: `name{labels} value` (no braces without labels).
pub fn sample(out: &mut String, name: &str, labels: &str, value: f64) {
    if labels.is_empty() {
        let _ = writeln!(out, "{name} {}", float(value));
    } else {
        let _ = writeln!(out, "{name}{{{labels}}} {}", float(value));
    }
}

/// A histogram with fixed bucket bounds (seconds, or any unit), as the Prometheus client's.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bound; the `+Inf` count is `count`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram with these upper bounds (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Counts one observation of `v`.
    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Their sum.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// The `_bucket` (cumulative, then `+Inf`), `_sum` and `_count` lines of the series
    /// `labels` (from [`labels`]; empty for none).
    pub fn write(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (bound, n) in self.bounds.iter().zip(&self.counts) {
            cumulative += n;
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{}\"}} {}",
                float(*bound),
                float(cumulative as f64)
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            float(self.count as f64)
        );
        sample(out, &format!("{name}_sum"), labels, self.sum);
        sample(out, &format!("{name}_count"), labels, self.count as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_as_gos_strconv_shortest_g_format() {
        for (v, want) in [
            (0.005, "0.005"),
            (0.1, "0.1"),
            (10.0, "10"),
            (600.0, "600"),
            (1e-8, "1e-08"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (123456.0, "123456"),
            (1e6, "1e+06"),
            (1234567.0, "1.234567e+06"),
            (1.7e9, "1.7e+09"),
            (1700000000.25, "1.70000000025e+09"),
            (3.0, "3"),
            (0.30000000000000004, "0.30000000000000004"),
            (-2.5, "-2.5"),
            (0.0, "0"),
            (f64::INFINITY, "+Inf"),
            (f64::NAN, "NaN"),
        ] {
            assert_eq!(float(v), want, "{v}");
        }
    }

    #[test]
    fn a_histogram_writes_cumulative_buckets_sum_and_count() {
        static B: [f64; 3] = [0.1, 1.0, 10.0];
        let mut h = Histogram::new(&B);
        h.observe(0.05);
        h.observe(0.1);
        h.observe(5.0);
        h.observe(50.0);
        let mut out = String::new();
        h.write(&mut out, "x", &labels(&[("a", "q\"")]));
        assert_eq!(
            out,
            "x_bucket{a=\"q\\\"\",le=\"0.1\"} 2\n\
             x_bucket{a=\"q\\\"\",le=\"1\"} 2\n\
             x_bucket{a=\"q\\\"\",le=\"10\"} 3\n\
             x_bucket{a=\"q\\\"\",le=\"+Inf\"} 4\n\
             x_sum{a=\"q\\\"\"} 55.15\n\
             x_count{a=\"q\\\"\"} 4\n"
        );
        let mut out = String::new();
        Histogram::new(&B).write(&mut out, "y", "");
        assert!(out.starts_with("y_bucket{le=\"0.1\"} 0\n"), "{out}");
        assert!(out.ends_with("y_sum 0\ny_count 0\n"), "{out}");
    }

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
