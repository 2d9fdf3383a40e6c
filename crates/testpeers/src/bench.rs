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

/// A free TCP port of 127.0.0.1 (for a sidecar's `--http-endpoint`).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A sidecar's API requests so far (its `plugreg_kube_requests_total` on `/metrics` at
/// `127.0.0.1:port`), by `verb resource`; empty when it does not answer.
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
            out.insert(format!("{} {}", get("verb"), get("resource")), v as u64);
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
