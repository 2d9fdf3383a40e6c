//! How every command prints: the `-o table|json` choice, aligned columns, aligned key-value
//! pairs and pretty JSON.

use std::io::{self, Write};

use serde::Serialize;

/// Output format of operator commands (`-o`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// An aligned table for people.
    Table,
    /// JSON for scripts.
    Json,
}

/// Writes rows as left-aligned columns two spaces apart; a row's last cell is not padded and
/// trailing blanks are trimmed.
pub fn table<R: AsRef<[String]>>(out: &mut dyn Write, rows: &[R]) -> io::Result<()> {
    let cols = rows.iter().map(|r| r.as_ref().len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.as_ref().get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let r = r.as_ref();
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            if c + 1 == r.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<w$}  ", w = widths[c]));
            }
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

/// Writes `key  value` lines with the keys padded to the longest.
pub fn key_values(out: &mut dyn Write, rows: &[(&str, String)]) -> io::Result<()> {
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in rows {
        writeln!(out, "{k:<width$}  {v}")?;
    }
    Ok(())
}

/// Writes `value` as pretty JSON and a newline.
pub fn json(out: &mut dyn Write, value: &impl Serialize) -> Result<(), serde_json::Error> {
    serde_json::to_writer_pretty(&mut *out, value)?;
    writeln!(out).map_err(serde_json::Error::io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_and_the_last_is_not_padded() {
        let mut out = Vec::new();
        let rows = [
            ["NAME".to_owned(), "STATE".into(), "X".into()],
            ["a-long-name".into(), "ok".into(), "".into()],
        ];
        table(&mut out, &rows).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "NAME         STATE  X\na-long-name  ok\n"
        );
        let mut out = Vec::new();
        table(
            &mut out,
            &[vec!["a".to_owned()], vec!["bb".into(), "c".into()]],
        )
        .unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "a\nbb  c\n");
    }

    #[test]
    fn json_is_pretty_with_a_newline() {
        let mut out = Vec::new();
        json(&mut out, &serde_json::json!({"a": 1})).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "{\n  \"a\": 1\n}\n");
    }
}
