//! Logging set-up shared by every subcommand: klog-like `-v` levels, text or JSON.
//!
//! Log lines carry strings that came from plugins and from the file system (plugin names,
//! endpoints, versions, socket paths, the error texts of gRPC statuses). In the text format,
//! [`EscapedFields`] writes them so that none can end a line or pass for another field; the
//! JSON format escapes them by its nature.

use std::fmt;

use clap::ValueEnum;
use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::Writer;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Maps klog's `-v` onto a tracing filter (0-1 info, 2-4 debug, 5+ trace); `RUST_LOG`
/// overrides it.
pub fn init(verbosity: u8, format: LogFormat, quiet: bool) {
    let level = match verbosity {
        _ if quiet && verbosity == 0 => "error",
        0..=1 => "info",
        2..=4 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!(
            "{level},h2=warn,hyper=warn,tower=warn,kube=warn,rustls=warn"
        ))
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.fmt_fields(EscapedFields).init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init(),
    }
}

/// The fields of a text log line (of events and spans): the message first, with control and
/// line-breaking characters escaped (`\n`, `\u{1b}`), then `key=value` pairs whose value is
/// written bare only when it is printable ASCII without spaces, quotes, backslashes or `=`, and
/// quoted with the same escapes (and `\"`, `\\`) otherwise. So a value, whoever chose it, stays
/// inside its own field on its own line.
#[derive(Debug, Clone, Copy, Default)]
pub struct EscapedFields;

impl<'writer> FormatFields<'writer> for EscapedFields {
    fn format_fields<R: RecordFields>(
        &self,
        mut writer: Writer<'writer>,
        fields: R,
    ) -> fmt::Result {
        let mut collected = Collected::default();
        fields.record(&mut collected);
        let mut separator = "";
        if let Some(message) = &collected.message {
            write_escaped(&mut writer, message)?;
            separator = " ";
        }
        for (key, value) in &collected.pairs {
            write!(writer, "{separator}{key}=")?;
            write_value(&mut writer, value)?;
            separator = " ";
        }
        Ok(())
    }
}

/// The message and the other fields of one event or span, as text.
#[derive(Default)]
struct Collected {
    message: Option<String>,
    pairs: Vec<(&'static str, String)>,
}

impl Visit for Collected {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.record(field, value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.record(field, format!("{value:?}"));
    }
}

impl Collected {
    fn record(&mut self, field: &Field, text: String) {
        match field.name() {
            "message" => self.message = Some(text),
            // `log` crate records arrive with these; the formatter shows the target itself.
            name if name.starts_with("log.") => {}
            name => self.pairs.push((name, text)),
        }
    }
}

/// Whether `c` must not appear as itself in a log line: control characters (newlines, ESC,
/// NEL), the Unicode line and paragraph separators, and the bidirectional overrides that make
/// text read in another order than it is written.
fn must_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn write_escaped(w: &mut impl fmt::Write, s: &str) -> fmt::Result {
    for c in s.chars() {
        if must_escape(c) {
            write!(w, "{}", c.escape_default())?;
        } else {
            w.write_char(c)?;
        }
    }
    Ok(())
}

fn write_value(w: &mut impl fmt::Write, s: &str) -> fmt::Result {
    let bare = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'"' | b'\\' | b'='));
    if bare {
        return w.write_str(s);
    }
    w.write_char('"')?;
    for c in s.chars() {
        match c {
            '"' => w.write_str("\\\"")?,
            '\\' => w.write_str("\\\\")?,
            c if must_escape(c) => write!(w, "{}", c.escape_default())?,
            c => w.write_char(c)?,
        }
    }
    w.write_char('"')
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Everything logged by `f` through the text format, as one string.
    fn text_log(f: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let sink = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .fmt_fields(EscapedFields)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn peer_strings_cannot_start_a_line_or_fake_a_field() {
        let forged =
            "boom\n2026-01-01T00:00:00.000000Z  INFO plugreg_manager: plugin registered socket=/x";
        let nasty = [
            forged,
            "a\r\nb",
            "x\u{1b}[2Jy",
            "line\u{2028}separator",
            "next\u{85}line",
            "quote\" name=evil",
            "back\\slash",
            "",
            "right\u{202e}left",
        ];
        let log = text_log(|| {
            let span = tracing::info_span!("register", socket = %forged);
            let _entered = span.enter();
            for value in nasty {
                tracing::warn!(error = %value, name = value, "plugin registration failed: {value}");
            }
        });
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), nasty.len(), "{log}");
        for (line, value) in lines.iter().zip(nasty) {
            assert!(line.contains(" WARN "), "{line}");
            // The message keeps its text with the line breaks escaped; the fields are quoted
            // (or bare, for a plain word) and read back to the very value.
            let (_, fields) = line.split_once(" error=").unwrap();
            let (error, rest) = read_value(fields);
            assert_eq!(error, value, "{line}");
            let name = rest.strip_prefix(" name=").unwrap();
            let (name, rest) = read_value(name);
            assert_eq!(name, value, "{line}");
            assert_eq!(rest, "", "{line}");
        }
        assert!(
            lines[0].contains("socket=\"boom\\n2026-01-01T00:00:00.000000Z  INFO"),
            "{}",
            lines[0]
        );
        assert!(
            lines[0].contains("plugin registration failed: boom\\n2026"),
            "{}",
            lines[0]
        );
    }

    #[test]
    fn plain_values_stay_bare() {
        let log = text_log(|| {
            tracing::info!(
                socket = "/var/lib/kubelet/plugins_registry/a-reg.sock",
                count = 3,
                ok = true,
                "plugin registered"
            );
        });
        assert!(
            log.trim_end().ends_with(
                "plugin registered socket=/var/lib/kubelet/plugins_registry/a-reg.sock count=3 ok=true"
            ),
            "{log}"
        );
    }

    /// Reads one value as written by [`write_value`]; returns it and what follows.
    fn read_value(s: &str) -> (String, &str) {
        let Some(quoted) = s.strip_prefix('"') else {
            let end = s.find(' ').unwrap_or(s.len());
            return (s[..end].to_owned(), &s[end..]);
        };
        let mut out = String::new();
        let mut chars = quoted.char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '"' => return (out, &quoted[i + 1..]),
                '\\' => match chars.next().unwrap().1 {
                    'n' => out.push('\n'),
                    'r' => out.push('\r'),
                    't' => out.push('\t'),
                    '"' => out.push('"'),
                    '\\' => out.push('\\'),
                    'u' => {
                        let rest = &quoted[i + 2..];
                        let close = rest.find('}').unwrap();
                        let code = u32::from_str_radix(&rest[1..close], 16).unwrap();
                        out.push(char::from_u32(code).unwrap());
                        for _ in 0..close + 1 {
                            chars.next();
                        }
                    }
                    other => panic!("unexpected escape \\{other}"),
                },
                c => out.push(c),
            }
        }
        panic!("unterminated value in {s:?}")
    }
}
