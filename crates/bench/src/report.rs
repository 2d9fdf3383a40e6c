//! The benchmark's section of BENCHMARKS.md: rendered from the figures, and spliced between its
//! markers so that other authors' sections stay as they are.

use std::fmt::Write;
use std::time::Duration;

use crate::burst::BurstResult;
use crate::latency::LatencyResult;
use crate::procfs::Machine;
use crate::stats::Summary;

/// Opens this benchmark's block in BENCHMARKS.md.
pub const START: &str = "<!-- bench:manager:start -->";
/// Closes this benchmark's block in BENCHMARKS.md.
pub const END: &str = "<!-- bench:manager:end -->";

/// Goal of D1: registration p99.
pub const GOAL_LATENCY_P99: Duration = Duration::from_millis(5);
/// Goal of issue 2: 10,000 plugins registered within this time.
pub const GOAL_BURST_TIME: Duration = Duration::from_secs(3);
/// Goal of issue 2: the manager's peak RSS at 10,000 plugins.
pub const GOAL_RSS_KIB: u64 = 64 * 1024;
/// The burst size the goals are about.
pub const GOAL_BURST_COUNT: usize = 10_000;

/// Everything the section shows.
#[derive(Debug, Clone)]
pub struct Report {
    /// When the run began (RFC 3339).
    pub date: String,
    /// Where it ran.
    pub machine: Machine,
    /// Load averages when the run began (other work on the machine skews the bursts).
    pub load: String,
    /// `git rev-parse --short HEAD`, and whether the tree was dirty.
    pub commit: String,
    /// The command line.
    pub command: String,
    /// A `--quick` smoke run.
    pub quick: bool,
    /// The latency runs, one per registry file system.
    pub latency: Vec<LatencyResult>,
    /// Wait after each burst before its steady RSS was read.
    pub settle: Duration,
    /// Every burst that completed.
    pub bursts: Vec<BurstResult>,
    /// Runs that failed, with why.
    pub failures: Vec<String>,
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn secs(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn failures_text(failures: &[(String, u64)]) -> String {
    if failures.is_empty() {
        "0".to_owned()
    } else {
        failures
            .iter()
            .map(|(s, n)| format!("{s}: {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "**missed**" }
}

impl Report {
    /// The markdown block, markers included.
    pub fn markdown(&self) -> String {
        let mut o = String::new();
        let m = &self.machine;
        let _ = writeln!(o, "{START}");
        let _ = writeln!(
            o,
            "## Plugin manager: latency and bursts (issues 2 and 8)\n"
        );
        if self.quick {
            let _ = writeln!(
                o,
                "**Smoke run (`--quick`): small counts, not the figures of record.**\n"
            );
        }
        let _ = writeln!(
            o,
            "Written by `plugreg-bench` (crates/bench); the figures of record come from (the \
             daemon must be built: without it the bursts run against the library only):\n\n    \
             cargo build --release -p plugreg -p plugreg-bench\n    \
             target/release/plugreg-bench --out BENCHMARKS.md\n"
        );
        let _ = writeln!(o, "| | |\n|---|---|");
        let _ = writeln!(o, "| date | {} |", self.date);
        let _ = writeln!(
            o,
            "| machine | {} CPUs, {}, Linux {}, {:.1} GiB RAM |",
            m.cpus,
            m.model,
            m.kernel,
            m.memory_mib as f64 / 1024.0
        );
        let _ = writeln!(o, "| load average at start | {} |", self.load);
        let _ = writeln!(o, "| commit | {} |", self.commit);
        let _ = writeln!(o, "| command | `{}` |\n", self.command);

        self.goals(&mut o);
        if !self.latency.is_empty() {
            latency_section(&mut o, &self.latency);
        }
        if !self.bursts.is_empty() {
            burst_section(&mut o, &self.bursts, self.settle, m.cpus);
        }
        if !self.failures.is_empty() {
            let _ = writeln!(o, "### Runs that failed\n");
            for f in &self.failures {
                let _ = writeln!(o, "- {f}");
            }
            o.push('\n');
        }
        let _ = writeln!(o, "{END}");
        o
    }

    fn goals(&self, o: &mut String) {
        let _ = writeln!(o, "### Goals\n");
        let _ = writeln!(o, "| goal | measured | verdict |\n|---|---|---|");
        if self.latency.is_empty() {
            let _ = writeln!(o, "| registration p99 < 5 ms (D1) | not run | |");
        }
        for l in &self.latency {
            if l.style.is_go() {
                let _ = writeln!(
                    o,
                    "| socket created -> Notify(true), p99 < {}, no failed attempt (issue 8), \
                     {} plugin, registry on {} | {} ({} of {} over {}; failed attempts: {}) | {} |",
                    ms(GOAL_LATENCY_P99),
                    l.style.label(),
                    l.fs,
                    ms(l.registration.p99),
                    l.over_goal,
                    l.registration.count,
                    ms(GOAL_LATENCY_P99),
                    failures_text(&l.failed_attempts),
                    verdict(l.registration.p99 < GOAL_LATENCY_P99 && l.failed_attempts.is_empty())
                );
            } else {
                let _ = writeln!(
                    o,
                    "| socket created -> Notify(true), p99 < {} (D1), {} plugin, registry on {} \
                     | {} | {} |",
                    ms(GOAL_LATENCY_P99),
                    l.style.label(),
                    l.fs,
                    ms(l.registration.p99),
                    verdict(l.registration.p99 < GOAL_LATENCY_P99)
                );
            }
        }
        for b in self.bursts.iter().filter(|b| b.style != "registrar") {
            let warnings = b.log_warnings.unwrap_or(0);
            let _ = writeln!(
                o,
                "| {} plugins at once, {}: no failed attempt, no warning (issue 8), {}, registry \
                 on {} | failed attempts: {}; log warnings: {} | {} |",
                b.count,
                b.style,
                b.manager,
                b.fs,
                failures_text(&b.failures),
                b.log_warnings.map_or("no log".into(), |n| n.to_string()),
                verdict(b.failures.is_empty() && warnings == 0)
            );
        }
        let full: Vec<&BurstResult> = self
            .bursts
            .iter()
            .filter(|b| b.count == GOAL_BURST_COUNT && b.style == "registrar")
            .collect();
        if full.is_empty() {
            let _ = writeln!(
                o,
                "| 10,000 plugins registered < 3 s; manager peak RSS < 64 MiB | not run | |"
            );
        }
        for b in full {
            let _ = writeln!(
                o,
                "| 10,000 plugins registered < {}, {}, registry on {} | {} (binding the sockets \
                 alone: {}) | {} |",
                secs(GOAL_BURST_TIME),
                b.manager,
                b.fs,
                secs(b.all_registered),
                secs(b.bind_all),
                verdict(b.all_registered < GOAL_BURST_TIME)
            );
            let _ = writeln!(
                o,
                "| manager peak RSS (VmHWM) < {} at 10,000 plugins, {}, registry on {} | {} | {} |",
                mib(GOAL_RSS_KIB),
                b.manager,
                b.fs,
                mib(b.peak_kib),
                verdict(b.peak_kib < GOAL_RSS_KIB)
            );
        }
        o.push('\n');
    }
}

fn latency_section(o: &mut String, runs: &[LatencyResult]) {
    let Some(l) = runs.first() else { return };
    let _ = writeln!(o, "### Registration and deregistration latency\n");
    let _ = writeln!(
        o,
        "One plugin at a time, {} measured after {} unmeasured warm-up registrations. The plugin \
         manager library runs in the benchmark process on a 2-worker multi-thread runtime with \
         upstream's defaults (64 concurrent operations, 1 s resync) and an accept-all \
         `BenchPlugin` handler that timestamps its calls; each plugin is the registrar library \
         (`BenchPlugin`, `example.com/bench-N`, `v1beta1`) on a current-thread runtime. \
         Registration starts just before the socket is bound (bound under a hidden name and \
         renamed into place) and ends when the plugin's status channel says registered; \
         deregistration starts just before the benchmark deletes the socket and ends when the \
         handler's `deregister` is called. One run per file system of the registry directory: \
         binding a Unix socket creates an inode, which costs far more on a journalled disk file \
         system than on tmpfs. *plugin* is how the plugin creates its socket: `registrar` is \
         plugreg's registrar (a listening socket renamed into place, so the manager can never \
         find it refusing); `bind-then-listen` is a Go- or C-style plugin (`bind()` at the path, \
         then `listen()` after the gap shown; the clock starts at `bind()`), served with the same \
         Registration service. Go's `net.Listen` makes the two calls back to back (gap 0); under \
         `strace -f` the real Go example plugin (`example-plugin`, 20 starts) made no system \
         call between them and showed 125-547 µs from `bind()` to `listen()`, an upper bound \
         (strace stops the process at each traced call); the 1 ms gap stands for a plugin that \
         is slower to listen. *failed attempts* are the manager's \
         `plugreg_registration_failures_total` at the end of the run (warm-up included); each \
         is one back-off.\n",
        l.registration.count, l.warmup
    );
    let _ = writeln!(
        o,
        "| registry on | plugin | measure | n | p50 | p99 | max | mean | over 5 ms | failed \
         attempts |\n|---|---|---|---|---|---|---|---|---|---|"
    );
    for l in runs {
        latency_rows(o, l);
    }
    o.push('\n');
}

fn latency_rows(o: &mut String, l: &LatencyResult) {
    let fs = &l.fs;
    let style = l.style.label();
    let row = |o: &mut String, what: &str, s: &Summary, extra: &str| {
        let _ = writeln!(
            o,
            "| {fs} | {style} | {what} | {} | {} | {} | {} | {} | {extra} |",
            s.count,
            ms(s.p50),
            ms(s.p99),
            ms(s.max),
            ms(s.mean)
        );
    };
    row(
        o,
        "**registration**: socket created -> plugin receives Notify(true)",
        &l.registration,
        &format!("{} | {}", l.over_goal, failures_text(&l.failed_attempts)),
    );
    row(
        o,
        "of which: socket created -> handler `register` (inotify, dial, GetInfo, validate)",
        &l.to_handler,
        " | ",
    );
    row(
        o,
        "of which: handler `register` -> plugin receives Notify(true)",
        &l.handler_to_notify,
        " | ",
    );
    row(
        o,
        "**deregistration**: socket removed -> handler `deregister`",
        &l.deregistration,
        " | ",
    );
}

fn burst_section(o: &mut String, bursts: &[BurstResult], settle: Duration, cpus: usize) {
    let _ = writeln!(o, "### Bursts: many plugins at once\n");
    let _ = writeln!(
        o,
        "The manager is a process of its own; one farm process (`plugreg-bench farm`, a 2-worker \
         runtime) binds every plugin's socket as fast as it can, each with its own registrar, \
         and reports when every plugin received Notify(true). Both processes share the machine's \
         CPUs. Each configuration runs several times and the table shows the run with the median time \
         (*each run* lists all, in seconds). *all registered* is first bind -> last Notify(true); *p50/p99* are first bind -> \
         each plugin's Notify(true). CPU is user + system time of the process during the burst; \
         *CPUs busy* is manager plus farm CPU over the CPUs' time until all were registered \
         (near 100 % means the burst is bound by CPU, shared by both sides). The daemon runs with `--liveness-interval 0` and its default logging (to a file); the \
         in-process-child manager is the library with the same handler and no HTTP server or \
         logs. *plugin* is how the farm's plugins create their sockets (see the latency \
         section); the bind-then-listen farm binds each socket and listens on it right away, \
         as Go's net.Listen does, and runs against the daemon only. *failed attempts* are the \
         manager's `plugreg_registration_failures_total` by step after the burst (each one a \
         back-off); *log warnings* are WARN and ERROR lines in the daemon's log of the run.\n"
    );
    let _ = writeln!(
        o,
        "| manager | plugin | registry on | plugins | bind all | all registered | each run | plugins/s | p50 | p99 | \
         manager's mean seen -> registered | manager CPU | farm CPU | CPUs busy | manager CPU \
         per plugin | registrations counted | failed attempts | log warnings |"
    );
    let _ = writeln!(o, "|{}", "---|".repeat(18));
    for b in bursts {
        let rate = b.count as f64 / b.all_registered.as_secs_f64().max(1e-9);
        let busy = (b.manager_cpu + b.farm_cpu).as_secs_f64()
            / (cpus.max(1) as f64 * b.all_registered.as_secs_f64().max(1e-9));
        let failures = failures_text(&b.failures);
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {:.0} % | {:.0} µs | {} | {} | {} |",
            b.manager,
            b.style,
            b.fs,
            b.count,
            secs(b.bind_all),
            secs(b.all_registered),
            b.all_registered_runs
                .iter()
                .map(|d| format!("{:.2}", d.as_secs_f64()))
                .collect::<Vec<_>>()
                .join(", "),
            rate,
            secs(b.p50),
            secs(b.p99),
            b.manager_mean_latency.map_or("-".into(), secs),
            secs(b.manager_cpu),
            secs(b.farm_cpu),
            busy * 100.0,
            b.manager_cpu.as_secs_f64() * 1e6 / b.count as f64,
            b.registrations_total.map_or("-".into(), |n| n.to_string()),
            failures,
            b.log_warnings.map_or("no log".into(), |n| n.to_string())
        );
    }
    o.push('\n');
    let _ = writeln!(
        o,
        "| manager | plugin | registry on | plugins | RSS idle | peak RSS (VmHWM) | steady RSS (after \
         burst) | manager CPU while idle | RSS after all deregistered | VmHWM at the end | \
         deregister all | manager log | farm peak RSS |"
    );
    let _ = writeln!(o, "|{}", "---|".repeat(13));
    for b in bursts {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} % | {} | {} | {} | {} | {} |",
            b.manager,
            b.style,
            b.fs,
            b.count,
            mib(b.idle_rss_kib),
            mib(b.peak_kib),
            mib(b.steady_rss_kib),
            b.idle_cpu_share * 100.0,
            b.after_deregistration_rss_kib.map_or("-".into(), mib),
            mib(b.final_peak_kib),
            b.deregister_all
                .map_or("-".into(), |d| format!("≤ {}", secs(d))),
            if b.log_bytes > 0 {
                format!("{:.1} KiB", b.log_bytes as f64 / 1024.0)
            } else {
                "none".into()
            },
            mib(b.farm_peak_kib),
        );
    }
    o.push('\n');
    let _ = writeln!(
        o,
        "*peak RSS* is VmHWM after the burst and {} of settling, before anything reads \
         `/metrics`; *steady RSS* is VmRSS at that moment; *manager CPU while idle* is its CPU \
         time over those {} of settling (all plugins registered, nothing changing), as a share \
         of one CPU. *deregister all* runs from telling the \
         farm to stop (it removes every socket) until `/metrics`, polled every 100 ms, counts \
         every deregistration; *VmHWM at the end* includes those scrapes (with 10,000 sockets \
         one scrape is megabytes of text).\n",
        secs(settle),
        secs(settle)
    );
}

/// `existing` with this benchmark's block replaced by `section` (appended when absent).
pub fn splice(existing: &str, section: &str) -> String {
    splice_between(existing, section, START, END)
}

/// `existing` with the block between `start_marker` and `end_marker` replaced by `section`
/// (appended when absent).
pub fn splice_between(
    existing: &str,
    section: &str,
    start_marker: &str,
    end_marker: &str,
) -> String {
    if let (Some(start), Some(end)) = (existing.find(start_marker), existing.find(end_marker))
        && start < end
    {
        let after = &existing[end + end_marker.len()..];
        let after = after.strip_prefix('\n').unwrap_or(after);
        return format!("{}{section}{after}", &existing[..start]);
    }
    if existing.trim().is_empty() {
        return format!("# Benchmarks\n\n{section}");
    }
    let sep = if existing.ends_with("\n\n") {
        ""
    } else if existing.ends_with('\n') {
        "\n"
    } else {
        "\n\n"
    };
    format!("{existing}{sep}{section}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(body: &str) -> String {
        format!("{START}\n{body}\n{END}\n")
    }

    fn sample() -> Report {
        let d = Duration::from_millis;
        let s = Summary::of(&[d(1), d(2)]).unwrap();
        let burst = BurstResult {
            manager: "m".into(),
            style: "registrar".into(),
            fs: "tmpfs".into(),
            count: GOAL_BURST_COUNT,
            bind_all: d(800),
            all_registered: d(2500),
            all_registered_runs: vec![d(2400), d(2500), d(2600)],
            p50: d(1500),
            p99: d(2400),
            idle_rss_kib: 5000,
            peak_kib: 70_000,
            final_peak_kib: 80_000,
            steady_rss_kib: 70_000,
            after_deregistration_rss_kib: None,
            manager_cpu: d(1600),
            idle_cpu_share: 0.05,
            farm_cpu: d(3300),
            farm_peak_kib: 140_000,
            registrations_total: Some(10_000),
            failures: vec![("dial".into(), 2)],
            manager_mean_latency: Some(d(1000)),
            deregister_all: Some(d(300)),
            log_bytes: 0,
            log_warnings: Some(0),
        };
        let go_burst = BurstResult {
            style: "bind-then-listen, gap 0".into(),
            count: 1000,
            failures: vec![("dial".into(), 9)],
            log_warnings: Some(9),
            ..burst.clone()
        };
        Report {
            date: "2026-01-01T00:00:00Z".into(),
            machine: crate::procfs::machine(),
            load: "0.1 0.2 0.3".into(),
            commit: "`abc`".into(),
            command: "cargo run".into(),
            quick: false,
            latency: vec![
                LatencyResult {
                    fs: "ext4".into(),
                    style: crate::plugin::Style::Registrar,
                    over_goal: 0,
                    failed_attempts: vec![],
                    warmup: 1,
                    registration: s,
                    to_handler: s,
                    handler_to_notify: s,
                    deregistration: s,
                },
                LatencyResult {
                    fs: "ext4".into(),
                    style: crate::plugin::Style::BindThenListen { gap: d(1) },
                    over_goal: 1,
                    failed_attempts: vec![("dial".into(), 1)],
                    warmup: 1,
                    registration: s,
                    to_handler: s,
                    handler_to_notify: s,
                    deregistration: s,
                },
            ],
            settle: Duration::from_secs(3),
            bursts: vec![burst, go_burst],
            failures: vec![],
        }
    }

    #[test]
    fn every_table_row_has_as_many_cells_as_its_header() {
        let md = sample().markdown();
        let mut header_cells = None;
        for line in md.lines() {
            if !line.starts_with('|') {
                header_cells = None;
                continue;
            }
            let cells = line.matches('|').count();
            match header_cells {
                None => header_cells = Some(cells),
                Some(h) => assert_eq!(cells, h, "row {line:?}"),
            }
        }
    }

    #[test]
    fn goals_are_judged() {
        let md = sample().markdown();
        assert!(
            md.contains("| 2.500 s (binding the sockets alone: 0.800 s) | met |"),
            "{md}"
        );
        assert!(md.contains("| 68.4 MiB | **missed** |"), "{md}");
        assert!(
            md.contains("(1 of 2 over 5.000 ms; failed attempts: dial: 1) | **missed** |"),
            "{md}"
        );
        assert!(
            md.contains("| failed attempts: dial: 9; log warnings: 9 | **missed** |"),
            "{md}"
        );
        assert!(md.starts_with(START) && md.trim_end().ends_with(END));
    }

    #[test]
    fn replaces_only_its_own_block() {
        let before = format!(
            "# Benchmarks\n\n## Sidecar\nkeep\n\n{}\n## After\nkeep too\n",
            block("old")
        );
        let after = splice(&before, &block("new"));
        assert_eq!(
            after,
            format!(
                "# Benchmarks\n\n## Sidecar\nkeep\n\n{}\n## After\nkeep too\n",
                block("new")
            )
        );
    }

    #[test]
    fn appends_when_absent_and_creates_when_empty() {
        assert_eq!(
            splice("# Benchmarks\n\n## Sidecar\n", &block("x")),
            format!("# Benchmarks\n\n## Sidecar\n\n{}", block("x"))
        );
        assert_eq!(
            splice("", &block("x")),
            format!("# Benchmarks\n\n{}", block("x"))
        );
    }
}
