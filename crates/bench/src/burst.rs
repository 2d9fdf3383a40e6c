//! Many plugins at once: a manager process (the `plugreg manager` daemon or the benchmark's own
//! `manager` subcommand) and a farm process serving every plugin, started on a fresh registry
//! directory. The farm times the burst; `/proc` gives the manager's memory and CPU time.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::plugin::Style;
use crate::{child, http, procfs};

/// Which manager serves the burst.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManagerKind {
    /// The real daemon binary, `plugreg manager`.
    Daemon(PathBuf),
    /// This binary's hidden `manager` subcommand (the library, no HTTP server, no logs).
    Child,
}

impl ManagerKind {
    /// How the report names it.
    pub fn label(&self) -> &'static str {
        match self {
            ManagerKind::Daemon(_) => "plugreg manager (daemon)",
            ManagerKind::Child => "in-process-child (library)",
        }
    }
}

/// How every burst runs.
#[derive(Debug, Clone)]
pub struct BurstOptions {
    /// Passed to the manager when set.
    pub max_concurrent_operations: Option<usize>,
    /// Extra arguments for the daemon.
    pub daemon_args: Vec<String>,
    /// Longest wait for every plugin to be registered.
    pub timeout: Duration,
    /// Wait after the burst before the steady RSS is read.
    pub settle: Duration,
    /// Worker threads of the farm's runtime.
    pub farm_workers: usize,
}

/// What one burst measured.
#[derive(Debug, Clone, Default)]
pub struct BurstResult {
    /// Which manager.
    pub manager: String,
    /// How the farm's plugins create their sockets.
    pub style: String,
    /// The file system of the registry directory.
    pub fs: String,
    /// Plugins.
    pub count: usize,
    /// First bind -> last bind.
    pub bind_all: Duration,
    /// First bind -> last Notify(true) received.
    pub all_registered: Duration,
    /// `all_registered` of every run of this configuration, in order (this result is the
    /// median one).
    pub all_registered_runs: Vec<Duration>,
    /// First bind -> Notify(true), median over plugins.
    pub p50: Duration,
    /// First bind -> Notify(true), 99th percentile over plugins.
    pub p99: Duration,
    /// Manager RSS before the burst.
    pub idle_rss_kib: u64,
    /// Manager VmHWM after the burst and the settling time (before `/metrics` is read).
    pub peak_kib: u64,
    /// Manager VmHWM at the end, after reading `/metrics` and deregistering every plugin.
    pub final_peak_kib: u64,
    /// Manager RSS after settling.
    pub steady_rss_kib: u64,
    /// Manager RSS after every plugin was deregistered again.
    pub after_deregistration_rss_kib: Option<u64>,
    /// Manager CPU time spent during the burst.
    pub manager_cpu: Duration,
    /// Manager CPU time per wall-clock time while every plugin is registered and nothing
    /// happens (the settling time), e.g. 0.05 = 5 % of one CPU.
    pub idle_cpu_share: f64,
    /// Farm CPU time spent during the burst (binding, serving both RPCs).
    pub farm_cpu: Duration,
    /// Farm VmHWM after the burst.
    pub farm_peak_kib: u64,
    /// `plugreg_registrations_total` after the burst.
    pub registrations_total: Option<u64>,
    /// Non-zero `plugreg_registration_failures_total` by step.
    pub failures: Vec<(String, u64)>,
    /// Mean of the manager's own socket-seen -> registered latency.
    pub manager_mean_latency: Option<Duration>,
    /// Farm told to stop (it removes every socket) -> all deregistered, as seen by polling
    /// `/metrics`.
    pub deregister_all: Option<Duration>,
    /// Size of the manager's log of the whole run.
    pub log_bytes: u64,
    /// Warnings (and errors) in the manager's log of the whole run; `None` without a log.
    pub log_warnings: Option<u64>,
}

/// Runs one burst of `count` plugins against a `kind` manager, in a registry directory made
/// under `parent`.
pub fn run(
    kind: &ManagerKind,
    count: usize,
    parent: &Path,
    opts: &BurstOptions,
    style: Style,
) -> anyhow::Result<BurstResult> {
    let tmp = tempfile::Builder::new()
        .prefix("plugreg-bench-")
        .tempdir_in(parent)
        .with_context(|| format!("creating a temporary directory in {}", parent.display()))?;
    let dir = tmp.path().join("registry");
    std::fs::create_dir(&dir)?;
    let log = tmp.path().join("manager.log");
    let mut manager = ManagerProc::spawn(kind, &dir, &log, opts)?;
    let result = measure(&mut manager, kind, &dir, count, opts, style);
    let stopped = manager.stop();
    let mut result = result?;
    stopped.context("stopping the manager")?;
    result.log_bytes = std::fs::metadata(&log).map_or(0, |m| m.len());
    if matches!(kind, ManagerKind::Daemon(_)) {
        let text = std::fs::read_to_string(&log).context("reading the manager's log")?;
        result.log_warnings = Some(warnings(&text));
    }
    Ok(result)
}

fn measure(
    manager: &mut ManagerProc,
    kind: &ManagerKind,
    dir: &Path,
    count: usize,
    opts: &BurstOptions,
    style: Style,
) -> anyhow::Result<BurstResult> {
    manager.wait_ready(Duration::from_secs(20))?;
    // Let the watcher list the (empty) directory and the process settle.
    std::thread::sleep(Duration::from_millis(300));
    let pid = manager.pid();
    let idle = procfs::memory(&pid)?;
    let cpu_before = procfs::cpu_time(&pid)?;

    let mut farm = FarmProc::spawn(dir, count, opts, style)?;
    let bound = farm.expect("bound", Duration::from_secs(120))?;
    let done = farm.expect_any(
        &["registered", "timeout"],
        opts.timeout + Duration::from_secs(10),
    )?;
    let cpu_after = procfs::cpu_time(&pid)?;
    let manager_cpu = cpu_after - cpu_before;
    let farm_cpu = procfs::cpu_time(&farm.pid()).unwrap_or_default();
    if done["event"] == "timeout" {
        let registered = done["registered"].as_u64().unwrap_or(0);
        farm.stop()?;
        bail!(
            "{}: only {registered} of {count} plugins registered within {:?}",
            kind.label(),
            opts.timeout
        );
    }
    let us = |v: &serde_json::Value, k: &str| Duration::from_micros(v[k].as_u64().unwrap_or(0));

    std::thread::sleep(opts.settle);
    let steady = procfs::memory(&pid)?;
    let idle_cpu = procfs::cpu_time(&pid)? - cpu_after;
    let metrics = manager.metrics().ok();
    let failures = metrics.as_deref().map(failures_by_step).unwrap_or_default();

    let stopping = Instant::now();
    farm.stop()?;
    let deregister_all =
        manager.wait_deregistered(count as u64, stopping, Duration::from_secs(120));
    let end = procfs::memory(&pid)?;

    Ok(BurstResult {
        manager: kind.label().to_owned(),
        style: style.label(),
        count,
        fs: procfs::fs_type(dir),
        bind_all: us(&bound, "bind_all_us"),
        all_registered: us(&done, "last_us"),
        all_registered_runs: Vec::new(),
        p50: us(&done, "p50_us"),
        p99: us(&done, "p99_us"),
        idle_rss_kib: idle.rss_kib,
        peak_kib: steady.hwm_kib,
        final_peak_kib: end.hwm_kib,
        steady_rss_kib: steady.rss_kib,
        after_deregistration_rss_kib: deregister_all.map(|_| end.rss_kib),
        manager_cpu,
        idle_cpu_share: idle_cpu.as_secs_f64() / opts.settle.as_secs_f64().max(1e-3),
        farm_cpu,
        farm_peak_kib: done["hwm_kib"].as_u64().unwrap_or(0),
        registrations_total: metrics
            .as_deref()
            .and_then(|m| metric(m, "plugreg_registrations_total"))
            .map(|v| v as u64),
        failures,
        manager_mean_latency: metrics.as_deref().and_then(|m| {
            let sum = metric(m, "plugreg_registration_latency_seconds_sum")?;
            let n = metric(m, "plugreg_registration_latency_seconds_count")?;
            (n > 0.0).then(|| Duration::from_secs_f64(sum / n))
        }),
        deregister_all,
        log_bytes: 0,
        log_warnings: None,
    })
}

/// The run with the median time until all registered (the lower median of an even count),
/// carrying the times of every run.
pub fn median(runs: Vec<BurstResult>) -> Option<BurstResult> {
    let times: Vec<Duration> = runs.iter().map(|r| r.all_registered).collect();
    let mut sorted = runs;
    sorted.sort_by_key(|r| r.all_registered);
    let mid = sorted.len().checked_sub(1)? / 2;
    let mut chosen = sorted.swap_remove(mid);
    chosen.all_registered_runs = times;
    Some(chosen)
}

/// The value of the sample named exactly `name` (with its labels, if any) in Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| match l.rsplit_once(' ') {
            Some((k, v)) if k == name => v.trim().parse().ok(),
            _ => None,
        })
}

/// Non-zero `plugreg_registration_failures_total` samples by step.
pub fn failures_by_step(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("plugreg_registration_failures_total{step=\""))
        .filter_map(|rest| {
            let (step, rest) = rest.split_once('"')?;
            let n: f64 = rest.rsplit_once(' ')?.1.trim().parse().ok()?;
            (n > 0.0).then(|| (step.to_owned(), n as u64))
        })
        .collect()
}

/// Lines of a `plugreg` log (text or JSON) at level WARN or ERROR.
pub fn warnings(log: &str) -> u64 {
    log.lines()
        .filter(|l| {
            let text_level = l.split_whitespace().nth(1);
            matches!(text_level, Some("WARN" | "ERROR"))
                || l.contains("\"level\":\"WARN\"")
                || l.contains("\"level\":\"ERROR\"")
        })
        .count() as u64
}

/// Lines a child writes on stdout, read on a thread of their own.
struct Lines(mpsc::Receiver<String>);

impl Lines {
    fn spawn(stdout: impl std::io::Read + Send + 'static) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self(rx)
    }

    fn next(&self, timeout: Duration) -> anyhow::Result<String> {
        self.0
            .recv_timeout(timeout)
            .map_err(|e| anyhow::anyhow!("no output within {timeout:?}: {e}"))
    }
}

/// A running manager process.
struct ManagerProc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Option<Lines>,
    http: Option<SocketAddr>,
}

impl ManagerProc {
    fn spawn(
        kind: &ManagerKind,
        dir: &Path,
        log: &Path,
        opts: &BurstOptions,
    ) -> anyhow::Result<Self> {
        let log_file = File::create(log)?;
        match kind {
            ManagerKind::Daemon(bin) => {
                let http = free_local_port()?;
                let mut cmd = Command::new(bin);
                cmd.arg("manager")
                    .arg("--registry-dir")
                    .arg(dir)
                    .args(["--plugin-types", crate::handler::PLUGIN_TYPE])
                    .arg("--http-endpoint")
                    .arg(http.to_string())
                    .args(["--liveness-interval", "0"]);
                if let Some(n) = opts.max_concurrent_operations {
                    cmd.arg("--max-concurrent-operations").arg(n.to_string());
                }
                cmd.args(&opts.daemon_args)
                    .stdin(Stdio::null())
                    .stdout(log_file.try_clone()?)
                    .stderr(log_file);
                let child = cmd
                    .spawn()
                    .with_context(|| format!("starting {}", bin.display()))?;
                Ok(Self {
                    child,
                    stdin: None,
                    lines: None,
                    http: Some(http),
                })
            }
            ManagerKind::Child => {
                let mut cmd = Command::new(std::env::current_exe()?);
                cmd.arg("manager").arg("--registry-dir").arg(dir);
                if let Some(n) = opts.max_concurrent_operations {
                    cmd.arg("--max-concurrent-operations").arg(n.to_string());
                }
                let mut child = cmd
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(log_file)
                    .spawn()
                    .context("starting the manager subcommand")?;
                let stdin = child.stdin.take();
                let lines = child.stdout.take().map(Lines::spawn);
                Ok(Self {
                    child,
                    stdin,
                    lines,
                    http: None,
                })
            }
        }
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    fn wait_ready(&mut self, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        if let Some(lines) = &self.lines {
            let line = lines.next(limit).context("manager did not start")?;
            if line.trim() != "ready" {
                bail!("manager said {line:?} instead of ready");
            }
            return Ok(());
        }
        let addr = self.http.context("no HTTP endpoint")?;
        loop {
            if let Ok((200, _)) = http::get(addr, "/healthz", Duration::from_secs(1)) {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!("manager exited at start: {status}");
            }
            if Instant::now() > deadline {
                bail!("manager not healthy within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn metrics(&mut self) -> anyhow::Result<String> {
        if let Some(addr) = self.http {
            let (code, body) = http::get(addr, "/metrics", Duration::from_secs(10))?;
            if code != 200 {
                bail!("/metrics answered {code}");
            }
            return Ok(body);
        }
        let stdin = self.stdin.as_mut().context("manager stdin closed")?;
        writeln!(stdin, "metrics")?;
        stdin.flush()?;
        let lines = self.lines.as_ref().context("no manager output")?;
        let mut text = String::new();
        loop {
            let line = lines.next(Duration::from_secs(10))?;
            if line == child::END_OF_METRICS {
                return Ok(text);
            }
            text.push_str(&line);
            text.push('\n');
        }
    }

    /// Polls `/metrics` until `count` deregistrations are counted; how long that took since
    /// `start`.
    fn wait_deregistered(
        &mut self,
        count: u64,
        start: Instant,
        limit: Duration,
    ) -> Option<Duration> {
        while start.elapsed() < limit {
            let n = self
                .metrics()
                .ok()
                .and_then(|m| metric(&m, "plugreg_deregistrations_total"));
            if n.is_some_and(|n| n as u64 >= count) {
                return Some(start.elapsed());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    }

    /// Asks the manager to stop (SIGTERM for the daemon, end of input for the subcommand) and
    /// waits; kills it after 20 s.
    fn stop(&mut self) -> anyhow::Result<ExitStatus> {
        match self.stdin.take() {
            Some(stdin) => drop(stdin),
            None => rustix::process::kill_process(
                rustix::process::Pid::from_child(&self.child),
                rustix::process::Signal::TERM,
            )
            .context("signalling the manager")?,
        }
        wait_or_kill(&mut self.child, Duration::from_secs(20))
    }
}

/// A running farm process.
struct FarmProc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines,
}

impl FarmProc {
    fn spawn(dir: &Path, count: usize, opts: &BurstOptions, style: Style) -> anyhow::Result<Self> {
        let style_arg = match style {
            Style::Registrar => "registrar".to_owned(),
            Style::BindThenListen { gap } => format!("go:{}", humantime::format_duration(gap)),
        };
        let mut child = Command::new(std::env::current_exe()?)
            .arg("farm")
            .arg("--style")
            .arg(style_arg)
            .arg("--dir")
            .arg(dir)
            .arg("--count")
            .arg(count.to_string())
            .arg("--workers")
            .arg(opts.farm_workers.to_string())
            .arg("--timeout")
            .arg(humantime::format_duration(opts.timeout).to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the farm")?;
        let stdin = child.stdin.take();
        let lines = Lines::spawn(child.stdout.take().context("farm stdout")?);
        Ok(Self {
            child,
            stdin,
            lines,
        })
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    fn expect(&mut self, event: &str, limit: Duration) -> anyhow::Result<serde_json::Value> {
        self.expect_any(&[event], limit)
    }

    fn expect_any(
        &mut self,
        events: &[&str],
        limit: Duration,
    ) -> anyhow::Result<serde_json::Value> {
        let line = self
            .lines
            .next(limit)
            .with_context(|| format!("farm: waiting for {events:?}"))?;
        let value: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("farm said {line:?}"))?;
        if !events.iter().any(|e| value["event"] == *e) {
            bail!("farm said {line:?}, expected {events:?}");
        }
        Ok(value)
    }

    fn stop(&mut self) -> anyhow::Result<()> {
        drop(self.stdin.take());
        self.expect("stopped", Duration::from_secs(60))?;
        let status = wait_or_kill(&mut self.child, Duration::from_secs(20))?;
        if !status.success() {
            bail!("farm exited with {status}");
        }
        Ok(())
    }
}

impl Drop for FarmProc {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn wait_or_kill(child: &mut Child, limit: Duration) -> anyhow::Result<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            child.kill()?;
            return Ok(child.wait()?);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_local_port() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x\nplugreg_registrations_total 10000\n\
        plugreg_registration_failures_total{step=\"dial\"} 3\n\
        plugreg_registration_failures_total{step=\"notify\"} 0\n\
        plugreg_registration_latency_seconds_sum 1.5\n";

    #[test]
    fn reads_samples_by_exact_name() {
        assert_eq!(metric(TEXT, "plugreg_registrations_total"), Some(10000.0));
        assert_eq!(
            metric(TEXT, "plugreg_registration_latency_seconds_sum"),
            Some(1.5)
        );
        assert_eq!(metric(TEXT, "plugreg_registrations"), None);
    }

    #[test]
    fn median_run_carries_every_time() {
        let run = |ms| BurstResult {
            all_registered: Duration::from_millis(ms),
            ..Default::default()
        };
        let m = median(vec![run(30), run(10), run(20), run(40)]).unwrap();
        assert_eq!(m.all_registered, Duration::from_millis(20));
        let ms: Vec<u128> = m
            .all_registered_runs
            .iter()
            .map(|d| d.as_millis())
            .collect();
        assert_eq!(ms, [30, 10, 20, 40]);
        assert!(median(Vec::new()).is_none());
    }

    #[test]
    fn counts_warnings_in_text_and_json_logs() {
        let log = "2026-11-23T10:00:00.000001Z  INFO plugreg_manager: Registered plugin\n\
            2026-11-23T10:00:00.000002Z  WARN plugreg_manager: registration failed; retrying\n\
            {\"timestamp\":\"x\",\"level\":\"WARN\",\"message\":\"m\"}\n\
            {\"timestamp\":\"x\",\"level\":\"INFO\",\"message\":\"WARN\"}\n\
            2026-11-23T10:00:00.000003Z ERROR plugreg: x\n";
        assert_eq!(warnings(log), 3);
    }

    #[test]
    fn lists_only_steps_that_failed() {
        assert_eq!(failures_by_step(TEXT), vec![("dial".to_owned(), 3)]);
    }
}
