//! The log layout itself (a `tracing-subscriber` formatter): only the binary needs it, so it
//! sits behind the `cli` feature.

use std::fmt::{self, Write as _};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

use super::LogFormat;

/// Installs the global subscriber (stderr, `format`, `-v` = `verbosity`); `own` lists the
/// target prefixes of the sidecar's own lines (its info lines show at `-v=0`, its debug lines
/// at `-v=2`). Does nothing if a global subscriber is already set.
pub fn init(format: LogFormat, verbosity: u32, own: &'static [&'static str]) {
    let layer = tracing_subscriber::fmt::layer()
        .event_format(KlogFormat { format, own })
        .with_writer(std::io::stderr);
    let filter = tracing_subscriber::filter::filter_fn(move |meta| {
        min_verbosity(meta, own).is_some_and(|v| v <= verbosity)
    });
    use tracing_subscriber::Layer as _;
    let _ = tracing_subscriber::registry()
        .with(layer.with_filter(filter))
        .try_init();
}

/// The lowest `-v` at which a line shows, or `None` for never.
fn min_verbosity(meta: &Metadata<'_>, own: &[&str]) -> Option<u32> {
    let target = meta.target();
    let this_crate = own.iter().any(|p| target.starts_with(p));
    let plugreg = target.starts_with("plugreg");
    let level = *meta.level();
    Some(if level <= Level::WARN {
        0
    } else if level == Level::INFO {
        if plugreg { 0 } else { 6 }
    } else if level == Level::DEBUG {
        match () {
            _ if target.ends_with("::v4") => 4,
            _ if target.ends_with("::v5") => 5,
            _ if this_crate => 2,
            _ if plugreg => 4,
            _ => 6,
        }
    } else if plugreg {
        5
    } else {
        9
    })
}

/// Formats events as klog text or component-base JSON.
#[derive(Debug, Clone, Copy)]
pub struct KlogFormat {
    /// Which layout.
    pub format: LogFormat,
    /// Target prefixes of the sidecar's own lines (see [`init`]).
    pub own: &'static [&'static str],
}

impl<S, N> FormatEvent<S, N> for KlogFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let meta = event.metadata();
        let line = Line {
            level: *meta.level(),
            caller: caller(meta),
            v: min_verbosity(meta, self.own).unwrap_or(0),
            now: SystemTime::now(),
            fields,
        };
        let text = match self.format {
            LogFormat::Text => line.text(std::process::id()),
            LogFormat::Json => line.json(),
        };
        writer.write_str(&text)
    }
}

fn caller(meta: &Metadata<'_>) -> String {
    let file = meta
        .file()
        .map(|f| f.rsplit(['/', '\\']).next().unwrap_or(f))
        .unwrap_or("?");
    format!("{file}:{}", meta.line().unwrap_or(0))
}

/// A field value: text is quoted in both layouts, numbers and booleans are not.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Text(String),
    Raw(String),
}

#[derive(Debug, Default)]
struct Fields {
    message: String,
    pairs: Vec<(&'static str, Value)>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_owned();
        } else {
            self.pairs
                .push((field.name(), Value::Text(value.to_owned())));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.pairs.push((
            field.name(),
            Value::Text(plugreg_runtime::report::chain(value)),
        ));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.pairs
            .push((field.name(), Value::Raw(value.to_string())));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.pairs
            .push((field.name(), Value::Raw(value.to_string())));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.pairs
            .push((field.name(), Value::Raw(value.to_string())));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.pairs
            .push((field.name(), Value::Raw(value.to_string())));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let text = format!("{value:?}");
        if field.name() == "message" {
            self.message = text;
        } else {
            self.pairs.push((field.name(), Value::Text(text)));
        }
    }
}

struct Line {
    level: Level,
    caller: String,
    v: u32,
    now: SystemTime,
    fields: Fields,
}

impl Line {
    fn text(&self, pid: u32) -> String {
        let letter = match self.level {
            Level::ERROR => 'E',
            Level::WARN => 'W',
            _ => 'I',
        };
        let since = self.now.duration_since(UNIX_EPOCH).unwrap_or_default();
        let secs = since.as_secs();
        let (_, month, day) = civil_from_days((secs / 86_400) as i64);
        let tod = secs % 86_400;
        let mut out = format!(
            "{letter}{month:02}{day:02} {:02}:{:02}:{:02}.{:06} {pid:>7} {}] {:?}",
            tod / 3600,
            tod / 60 % 60,
            tod % 60,
            since.subsec_micros(),
            self.caller,
            self.fields.message,
        );
        for (key, value) in &self.fields.pairs {
            match value {
                Value::Text(t) => {
                    let _ = write!(out, " {key}={t:?}");
                }
                Value::Raw(r) => {
                    let _ = write!(out, " {key}={r}");
                }
            }
        }
        out.push('\n');
        out
    }

    fn json(&self) -> String {
        let since = self.now.duration_since(UNIX_EPOCH).unwrap_or_default();
        let quote = json_quote;
        let mut out = format!(
            "{{\"ts\":{}.{:06},\"caller\":{},\"msg\":{}",
            since.as_secs(),
            since.subsec_micros(),
            quote(&self.caller),
            quote(&self.fields.message),
        );
        // component-base leaves "v" out of error lines.
        if self.level != Level::ERROR {
            let _ = write!(out, ",\"v\":{}", self.v);
        }
        for (key, value) in &self.fields.pairs {
            let rendered = match value {
                Value::Text(t) => quote(t),
                Value::Raw(r)
                    if r.parse::<f64>().is_ok_and(f64::is_finite)
                        || r == "true"
                        || r == "false" =>
                {
                    r.clone()
                }
                Value::Raw(r) => quote(r),
            };
            let _ = write!(out, ",{}:{rendered}", quote(key));
        }
        out.push_str("}\n");
        out
    }
}

/// A JSON string literal for `s`.
fn json_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            // Control characters (C0, DEL, C1 such as NEL), the Unicode line and paragraph
            // separators (as Go's encoding/json) and the bidirectional overrides: escaped, so no
            // reader of the log takes them for a line break or reads the text reordered.
            c if c.is_control()
                || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') =>
            {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// (year, month, day) of a day number counted from 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn line(level: Level, v: u32, pairs: Vec<(&'static str, Value)>) -> Line {
        Line {
            level,
            caller: "run.rs:42".into(),
            v,
            // 2024-11-21 11:00:43.540224 UTC
            now: UNIX_EPOCH + Duration::from_micros(1_732_186_843_540_224),
            fields: Fields {
                message: "Version".into(),
                pairs,
            },
        }
    }

    #[test]
    fn text_lines_have_the_klog_layout() {
        let l = line(
            Level::INFO,
            0,
            vec![
                ("version", Value::Text("v2.17.0".into())),
                ("count", Value::Raw("3".into())),
            ],
        );
        assert_eq!(
            l.text(1),
            "I1121 11:00:43.540224       1 run.rs:42] \"Version\" version=\"v2.17.0\" count=3\n"
        );
        let e = line(
            Level::ERROR,
            0,
            vec![("err", Value::Text("a \"b\"\nc".into()))],
        );
        assert!(
            e.text(12345)
                .starts_with("E1121 11:00:43.540224   12345 run.rs:42] ")
        );
        assert!(e.text(1).ends_with(" err=\"a \\\"b\\\"\\nc\"\n"));
        assert!(line(Level::WARN, 0, vec![]).text(1).starts_with('W'));
    }

    #[test]
    fn json_lines_have_the_component_base_layout() {
        let l = line(
            Level::INFO,
            0,
            vec![
                ("version", Value::Text("v2.17.0".into())),
                ("count", Value::Raw("3".into())),
            ],
        );
        let j = l.json();
        assert_eq!(
            j,
            "{\"ts\":1732186843.540224,\"caller\":\"run.rs:42\",\"msg\":\"Version\",\"v\":0,\"version\":\"v2.17.0\",\"count\":3}\n"
        );
        let parsed: serde_json::Value = serde_json::from_str(&j).unwrap();
        assert_eq!(parsed["msg"], "Version");
        let e = line(Level::ERROR, 0, vec![("err", Value::Text("x".into()))]).json();
        let parsed: serde_json::Value = serde_json::from_str(&e).unwrap();
        assert!(parsed.get("v").is_none(), "error lines carry no v");
        assert_eq!(parsed["err"], "x");
        let d: serde_json::Value =
            serde_json::from_str(&line(Level::DEBUG, 4, vec![]).json()).unwrap();
        assert_eq!(d["v"], 4);
    }

    /// Issue 17, finding 5: strings from peers (a driver's errors and names, the kubelet's
    /// rejection reasons) go into messages and values; none can end the line or start another.
    #[test]
    fn peer_strings_stay_on_their_line() {
        let nasty = [
            "x\nI1121 11:00:43.540224       1 main.go:1] \"forged\"",
            "a\r\nb",
            "esc\u{1b}[2K",
            "sep\u{2028}arator",
            "next\u{85}line",
            "right\u{202e}left",
        ];
        for s in nasty {
            let mut l = line(Level::ERROR, 0, vec![("err", Value::Text(s.into()))]);
            l.fields.message = format!("failed: {s}");
            for out in [l.text(1), l.json()] {
                let body = out.strip_suffix('\n').unwrap();
                assert!(
                    !body
                        .chars()
                        .any(|c| c.is_control() || matches!(c, '\u{2028}' | '\u{202e}')),
                    "{out:?}"
                );
            }
            let parsed: serde_json::Value = serde_json::from_str(&l.json()).unwrap();
            assert_eq!(parsed["err"], s);
        }
    }

    #[test]
    fn json_strings_are_escaped() {
        let nasty = "a\"b\\c\nd\te\u{1}f\u{e9}";
        let quoted = json_quote(nasty);
        let back: String = serde_json::from_str(&quoted).unwrap();
        assert_eq!(back, nasty);
    }

    #[test]
    fn dates_are_converted_from_unix_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_048), (2024, 11, 21));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }
}
