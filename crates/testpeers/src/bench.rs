//! What the sidecars' benchmarks share: a free port, the sidecar's own API request counter
//! (`plugreg_kube_requests_total`) and its writes, the machine's load, the date and commit a
//! run is recorded with, creating objects many at a time, and the memory of a process
//! (VmRSS, RssAnon, RssFile; sampled peaks; resident pages per mapped file).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use futures::StreamExt;

/// A free TCP port of 127.0.0.1 (for a sidecar's `--http-endpoint`), never one this process
/// handed out before ([`crate::free_port`]).
pub fn free_port() -> u16 {
    crate::free_port().expect("a free port on 127.0.0.1")
}

/// A sidecar's API requests so far (its `plugreg_kube_requests_total` on `/metrics` at
/// `127.0.0.1:port`), by `verb resource` (summed over the controllers of `csi-sidecars`, whose
/// series carry a `controller` label); empty when it does not answer.
pub fn requests(port: u16) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return out;
    };
    let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("plugreg_kube_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let get = |k: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        if let Ok(v) = value.trim().parse::<f64>() {
            *out.entry(format!("{} {}", get("verb"), get("resource")))
                .or_default() += v as u64;
        }
    }
    out
}

/// The writes among `requests`' counts: every verb but get, list and watch.
pub fn writes(r: &BTreeMap<String, u64>) -> u64 {
    r.iter()
        .filter(|(k, _)| {
            let verb = k.split(' ').next().unwrap_or("");
            !matches!(verb, "get" | "list" | "watch" | "GET" | "LIST" | "WATCH")
        })
        .map(|(_, v)| *v)
        .sum()
}

/// The counts of `after` that grew since `before`, by how much.
pub fn delta(
    after: &BTreeMap<String, u64>,
    before: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// The load averages of `/proc/loadavg` (1, 5 and 15 minutes).
pub fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Today's date (UTC), as a run is recorded.
pub fn date() -> String {
    let out = Command::new("date").args(["-u", "+%Y-%m-%d"]).output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The repository's short HEAD, as a run is recorded.
pub fn commit() -> String {
    let out = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// Runs `make(0..n)`, 32 at a time.
pub async fn create_all<F, Fut>(n: usize, make: F)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    futures::stream::iter(0..n)
        .map(make)
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
}

/// Samples the resident anonymous and file-backed memory of `pid` every 100 ms until `stop`,
/// and returns the highest of each.
pub fn sample_peaks(
    pid: u32,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<(u64, u64)> {
    std::thread::spawn(move || {
        let pid = pid.to_string();
        let (mut anon, mut file) = (0, 0);
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let a = plugreg_runtime::procfs::status_kib(&pid, "RssAnon").unwrap_or(0);
            let f = plugreg_runtime::procfs::status_kib(&pid, "RssFile").unwrap_or(0);
            (anon, file) = (anon.max(a), file.max(f));
            std::thread::sleep(Duration::from_millis(100));
        }
        (anon, file)
    })
}

/// Prints the resident KiB of each file mapped by `pid` (where the file-backed part comes from).
pub fn print_file_mappings(pid: u32) {
    let Ok(smaps) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else {
        return;
    };
    let mut per_file: BTreeMap<String, u64> = BTreeMap::new();
    let mut current = None;
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields
            .first()
            .is_some_and(|f| f.contains('-') && !f.ends_with(':'))
        {
            current = fields
                .get(5)
                .map(|p| format!("{p} {}", fields.get(1).unwrap_or(&"")));
        } else if fields.first() == Some(&"Rss:")
            && let Some(file) = &current
            && file.starts_with('/')
        {
            *per_file.entry(file.clone()).or_default() += fields
                .get(1)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    for (file, kib) in per_file {
        println!("resident file pages: {kib} KiB {file}");
    }
}

/// VmRSS, RssAnon and RssFile of `pid` now, in KiB.
pub fn rss(pid: u32) -> (u64, u64, u64) {
    let pid = pid.to_string();
    let f = |k| plugreg_runtime::procfs::status_kib(&pid, k).unwrap_or(0);
    (f("VmRSS"), f("RssAnon"), f("RssFile"))
}

/// A sidecar benchmark's command line: `--out FILE` (write the block there), `--quick` (100
/// objects), `--n N`, `--qps Q` (memory studies only); anything else is ignored (`cargo bench`
/// passes `--bench`).
#[derive(Debug, Clone, PartialEq)]
pub struct BenchArgs {
    /// The Markdown file to write the block into (relative to the repository root).
    pub out: Option<String>,
    /// How many objects.
    pub n: usize,
    /// `--qps`, when given.
    pub qps: Option<f64>,
}

impl BenchArgs {
    /// Parses the process's arguments; `n` is the number of objects without `--quick`/`--n`.
    pub fn parse(n: usize) -> Self {
        Self::parse_from(std::env::args().skip(1), n)
    }

    /// Parses `args` (without the program name).
    pub fn parse_from(args: impl IntoIterator<Item = String>, n: usize) -> Self {
        let mut parsed = Self {
            out: None,
            n,
            qps: None,
        };
        let mut it = args.into_iter();
        while let Some(x) = it.next() {
            match x.as_str() {
                "--out" => parsed.out = it.next(),
                "--quick" => parsed.n = 100,
                "--n" => parsed.n = it.next().and_then(|v| v.parse().ok()).unwrap_or(parsed.n),
                "--qps" => parsed.qps = it.next().and_then(|v| v.parse().ok()).or(parsed.qps),
                _ => {}
            }
        }
        parsed
    }
}

/// Writes `block` (which starts with `start` and ends with `end`, the sidecar's `bench:`
/// markers) into the file `out` of the repository: in place of the text between the markers,
/// or appended when they are not there.
pub fn write_block(out: &str, start: &str, end: &str, block: &str) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let p = &root.join(out);
    let text = std::fs::read_to_string(p).unwrap_or_default();
    std::fs::write(p, replace_block(&text, start, end, block)).unwrap();
}

/// `text` with the part from `start` to `end` replaced by `block` (trimmed at its end), or
/// `block` appended when the markers are not there in that order.
pub fn replace_block(text: &str, start: &str, end: &str, block: &str) -> String {
    match (text.find(start), text.find(end)) {
        (Some(s), Some(e)) if s < e => {
            format!(
                "{}{}{}",
                &text[..s],
                block.trim_end(),
                &text[e + end.len()..]
            )
        }
        _ => format!("{text}\n{block}"),
    }
}

/// The Markdown table of a run's goals: `(goal, measured, met)` rows, "met" or "**missed**".
pub fn goals_table(rows: &[(String, String, bool)]) -> String {
    let mut t = String::from("| goal | measured | verdict |\n|---|---|---|\n");
    for (goal, measured, ok) in rows {
        let verdict = if *ok { "met" } else { "**missed**" };
        t.push_str(&format!("| {goal} | {measured} | {verdict} |\n"));
    }
    t
}

/// What a benchmark measured of a sidecar's memory, in KiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Memory {
    /// Peak RSS (VmHWM).
    pub hwm_kib: u64,
    /// The highest resident anonymous memory sampled.
    pub peak_anon_kib: u64,
    /// The highest resident file-backed memory sampled.
    pub peak_file_kib: u64,
    /// Resident anonymous memory at the end.
    pub anon_kib: u64,
    /// Resident file-backed memory at the end.
    pub file_kib: u64,
    /// VmRSS, anonymous and file-backed once the caches are filled, before the first object.
    pub idle_kib: (u64, u64, u64),
}

impl Memory {
    /// Reads the process `pid`'s VmHWM, RssAnon and RssFile now, with the `idle` figures
    /// ([`rss`] before the first object) and the sampled `peaks` ([`sample_peaks`]: anonymous,
    /// file-backed).
    pub fn measure(pid: u32, idle: (u64, u64, u64), peaks: (u64, u64)) -> Self {
        let status =
            |field| plugreg_runtime::procfs::status_kib(&pid.to_string(), field).unwrap_or(0);
        Self {
            hwm_kib: status("VmHWM"),
            peak_anon_kib: peaks.0,
            peak_file_kib: peaks.1,
            anon_kib: status("RssAnon"),
            file_kib: status("RssFile"),
            idle_kib: idle,
        }
    }

    /// Peak RSS (VmHWM) in MiB.
    pub fn hwm_mib(&self) -> f64 {
        self.hwm_kib as f64 / 1024.0
    }

    /// The paragraph that reports it; `first` names the first object of the run ("the first
    /// VolumeAttachment").
    pub fn paragraph(&self, first: &str) -> String {
        let m = |k: u64| k as f64 / 1024.0;
        format!(
            "Peak RSS (VmHWM) {:.1} MiB; the highest sampled (every 100 ms) {:.1} MiB anonymous (heap, caches, \
             stacks) and {:.1} MiB file-backed (the binary's and the C libraries' pages); at the end {:.1} MiB anonymous \
             and {:.1} MiB file-backed. Idle (caches filled, before {first}): {:.1} MiB, {:.1} MiB \
             anonymous and {:.1} MiB file-backed.\n\n",
            m(self.hwm_kib),
            m(self.peak_anon_kib),
            m(self.peak_file_kib),
            m(self.anon_kib),
            m(self.file_kib),
            m(self.idle_kib.0),
            m(self.idle_kib.1),
            m(self.idle_kib.2),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_args_take_out_n_quick_and_qps_and_ignore_the_rest() {
        let args = |a: &[&str]| BenchArgs::parse_from(a.iter().map(|s| (*s).to_owned()), 1000);
        assert_eq!(
            args(&["--bench"]),
            BenchArgs {
                out: None,
                n: 1000,
                qps: None
            }
        );
        let a = args(&["--bench", "--out", "B.md", "--n", "7", "--qps", "20"]);
        assert_eq!(a.out.as_deref(), Some("B.md"));
        assert_eq!((a.n, a.qps), (7, Some(20.0)));
        assert_eq!(args(&["--quick"]).n, 100);
    }

    #[test]
    fn a_block_replaces_its_markers_or_is_appended() {
        let (s, e) = ("<!-- a:start -->", "<!-- a:end -->");
        let block = format!("{s}\nnew\n{e}\n");
        assert_eq!(
            replace_block(&format!("x\n{s}\nold\n{e}\ny\n"), s, e, &block),
            format!("x\n{s}\nnew\n{e}\ny\n")
        );
        assert_eq!(replace_block("x\n", s, e, &block), format!("x\n\n{block}"));
    }

    #[test]
    fn goals_are_met_or_missed() {
        let t = goals_table(&[
            ("a".into(), "1".into(), true),
            ("b".into(), "2".into(), false),
        ]);
        assert!(
            t.ends_with("| a | 1 | met |\n| b | 2 | **missed** |\n"),
            "{t}"
        );
    }
}
