//! `plugreg-bench hol`: head-of-line blocking (issue 17, finding 8). A CSI driver whose
//! NodeGetInfo never answers is registered through many sockets; each of its registrations may
//! take the daemon's NodeGetInfo limit (2 min) plus 10 s. Meanwhile ordinary plugins register
//! one at a time, and the figure is how long each waits: socket created -> Notify(true).
//!
//! The real daemon runs with its defaults (64 shared operation slots, operations leave them
//! after 250 ms, a slow lane of 256) and `--node-info-file`, so that `CSIPlugin` gets the real
//! CSI handler. `--baseline-bin` measures another build the same way (the code before the fix).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use plugreg_registrar::{PluginInfo, Registrar};
use tokio_util::sync::CancellationToken;

use crate::plugin::Style;
use crate::stats::Summary;
use crate::{burst, handler, http, procfs, soak};

/// Opens this benchmark's block in BENCHMARKS.md.
pub const START: &str = "<!-- bench:hol:start -->";
/// Closes this benchmark's block in BENCHMARKS.md.
pub const END: &str = "<!-- bench:hol:end -->";

/// The goal: the ordinary plugins register as fast as with no hanging driver, i.e. within
/// D1's 5 ms at p99.
const GOAL_P99: Duration = Duration::from_millis(5);

/// How much worse than the answering driver's run the hanging driver's may be and still count
/// as the same: runs of either vary by more than this on a loaded 2-core machine.
const SAME_AS_REFERENCE: f64 = 1.25;

/// Flags of `plugreg-bench hol`.
#[derive(Debug, Clone, clap::Args)]
pub struct HolArgs {
    /// The `plugreg` binary [default: `plugreg` next to this binary].
    #[arg(long)]
    pub manager_bin: Option<PathBuf>,
    /// Another build of `plugreg` (e.g. before the fix), measured the same way.
    #[arg(long)]
    pub baseline_bin: Option<PathBuf>,
    /// Registration sockets of the hanging driver, comma-separated; one run each (0: no
    /// hanging driver, the reference).
    #[arg(long, value_delimiter = ',', default_value = "0,200,1000")]
    pub hanging: Vec<usize>,
    /// Ordinary plugins registered one at a time in each run.
    #[arg(long, default_value_t = 100)]
    pub plugins: usize,
    /// Extra flags for the daemon (e.g. `--daemon-arg=--max-concurrent-operations=16`).
    #[arg(long, allow_hyphen_values = true)]
    pub daemon_arg: Vec<String>,
    /// Runs of each driver (hanging, answering: taking turns) per socket count above 0.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Skip the reference runs: the same sockets of a driver whose NodeGetInfo answers at once,
    /// which tell the burst's own cost from the hanging driver's.
    #[arg(long)]
    pub no_reference: bool,
    /// An ordinary plugin not told Notify(true) within this counts as not registered.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub register_timeout: Duration,
    /// Write the results into this markdown file (replacing only this benchmark's block).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The ordinary plugins of one phase.
#[derive(Debug, Clone, Copy, Default)]
struct Phase {
    registered: usize,
    summary: Option<Summary>,
    /// The longest time creating one of their sockets took (the file system's part).
    max_bind: Duration,
    /// From the socket in place to Notify(true) (the daemon's part).
    after_bind: Option<Summary>,
}

#[derive(Debug, Clone)]
struct Run {
    build: String,
    hanging: usize,
    /// The driver answers NodeGetInfo at once (the reference run).
    answering: bool,
    plugins: usize,
    /// While the daemon still takes in the hanging driver's sockets (its first attempts).
    during: Phase,
    /// Once every socket of the hanging driver has had its first attempt.
    after: Phase,
    /// Sockets of the driver past their first dial when the ordinary plugins started.
    hanging_running: usize,
    /// How long the daemon took to give every hanging socket its first attempt.
    settled_after: Option<Duration>,
    /// The hanging driver's NodeGetInfo calls.
    node_get_info_calls: u64,
    rss_before_kib: u64,
    rss_kib: u64,
    hwm_kib: u64,
}

/// Runs the benchmark.
pub fn main(args: HolArgs) -> anyhow::Result<()> {
    let bin = crate::daemon_bin(args.manager_bin.as_deref())?;
    anyhow::ensure!(
        bin.is_file(),
        "no daemon binary at {} (cargo build --release -p plugreg)",
        bin.display()
    );
    let largest = args.hanging.iter().copied().max().unwrap_or(0) as u64;
    procfs::raise_nofile(largest * 4 + 4096).context("raising the open-file limit")?;
    let mut builds = vec![("this build".to_owned(), bin)];
    if let Some(b) = &args.baseline_bin {
        builds.push((format!("baseline ({})", b.display()), b.clone()));
    }
    let date = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let load = procfs::load_average();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut runs = Vec::new();
    for (build, bin) in &builds {
        let modes = args.hanging.iter().flat_map(|&n| {
            let turns = if n == 0 { 1 } else { args.repeats.max(1) };
            let reference = n > 0 && !args.no_reference;
            (0..turns).flat_map(move |_| {
                std::iter::once((n, false)).chain(reference.then_some((n, true)))
            })
        });
        for (hanging, answering) in modes {
            let driver = if answering { "answering" } else { "hanging" };
            eprintln!(
                "hol: {build}, {hanging} {driver} sockets, {} plugins",
                args.plugins
            );
            let run = runtime
                .block_on(measure(build, bin, hanging, answering, &args))
                .with_context(|| format!("{build}, {hanging} {driver} sockets"))?;
            eprintln!(
                "  during: {}/{} {:?}; after ({:?}): {}/{} {:?}; {} hanging registrations running; RSS {} -> {} KiB",
                run.during.registered,
                run.plugins,
                run.during.summary,
                run.settled_after,
                run.after.registered,
                run.plugins,
                run.after.summary,
                run.hanging_running,
                run.rss_before_kib,
                run.rss_kib
            );
            runs.push(run);
        }
    }
    let section = markdown(&runs, &args, &date, &load);
    match &args.out {
        Some(path) => {
            let existing = std::fs::read_to_string(path).unwrap_or_default();
            let text = crate::report::splice_between(&existing, &section, START, END);
            std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        None => print!("{section}"),
    }
    Ok(())
}

struct Daemon {
    child: Child,
    http: SocketAddr,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(bin: &Path, dir: &Path, node_info: &Path, extra: &[String]) -> anyhow::Result<Daemon> {
    let http = burst::free_local_port()?;
    let child = Command::new(bin)
        .arg("manager")
        .arg("--registry-dir")
        .arg(dir)
        .arg("--plugin-types")
        .arg(format!("CSIPlugin,{}", handler::PLUGIN_TYPE))
        .arg("--node-info-file")
        .arg(node_info)
        .args(["--liveness-interval", "0", "--http-endpoint"])
        .arg(http.to_string())
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(match std::env::var_os("PLUGREG_HOL_DAEMON_LOG") {
            Some(f) => Stdio::from(std::fs::File::create(f)?),
            None => Stdio::null(),
        })
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut daemon = Daemon { child, http };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok((200, _)) = http::get(http, "/healthz", Duration::from_secs(1)) {
            return Ok(daemon);
        }
        if let Some(status) = daemon.child.try_wait()? {
            bail!("the daemon exited at start: {status}");
        }
        if Instant::now() > deadline {
            bail!("the daemon was not healthy within 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The hidden `hang-driver` subcommand: the CSI driver whose NodeGetInfo never answers, and
/// `sockets` registration sockets for it in `dir`, in a process of their own (as in a cluster,
/// where the driver is another container: its load is the machine's, not the ordinary
/// plugins' runtime's). Says `ready`; answers `calls` with its NodeGetInfo count; stops at the
/// end of input.
pub fn hang_driver(dir: &Path, work: &Path, sockets: usize, answer: bool) -> anyhow::Result<()> {
    use std::io::{BufRead, Write};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let token = CancellationToken::new();
        let csi = work.join("hang.sock");
        let config = plugreg_csi_test_driver::DriverConfig {
            name: "hang.csi.plugreg.io".into(),
            node_get_info: plugreg_csi_test_driver::Fault {
                hang: !answer,
                ..Default::default()
            },
            ..Default::default()
        };
        let driver = plugreg_csi_test_driver::start(config, &csi).await?;
        for i in 0..sockets {
            let r = Registrar::new(PluginInfo {
                r#type: "CSIPlugin".into(),
                name: "hang.csi.plugreg.io".into(),
                endpoint: csi.display().to_string(),
                supported_versions: vec!["1.0.0".into()],
            });
            let (path, t) = (dir.join(format!("hang-{i}-reg.sock")), token.clone());
            tokio::spawn(async move { r.serve(&path, Default::default(), t).await });
        }
        println!("ready");
        let calls = driver.calls().clone();
        tokio::task::spawn_blocking(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if line == "calls" {
                    let n = calls.count(plugreg_csi_test_driver::Method::NodeGetInfo);
                    let mut out = std::io::stdout().lock();
                    let _ = writeln!(out, "{n}");
                    let _ = out.flush();
                }
            }
        })
        .await?;
        token.cancel();
        let _ = driver.stop().await;
        anyhow::Ok(())
    })
}

/// The hanging driver's process.
struct HangDriver {
    child: Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl HangDriver {
    fn start(dir: &Path, work: &Path, sockets: usize, answer: bool) -> anyhow::Result<Self> {
        use std::io::BufRead;
        let mut child = Command::new(std::env::current_exe()?)
            .arg("hang-driver")
            .args(answer.then_some("--answer"))
            .arg("--dir")
            .arg(dir)
            .arg("--work")
            .arg(work)
            .arg("--sockets")
            .arg(sockets.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the hanging driver")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut lines = std::io::BufReader::new(stdout).lines();
        match lines.next() {
            Some(Ok(l)) if l == "ready" => Ok(HangDriver { child, lines }),
            other => bail!("the hanging driver did not start: {other:?}"),
        }
    }

    fn node_get_info_calls(&mut self) -> anyhow::Result<u64> {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().context("no stdin")?;
        writeln!(stdin, "calls")?;
        stdin.flush()?;
        let line = self.lines.next().context("the hanging driver ended")??;
        Ok(line.trim().parse()?)
    }
}

impl Drop for HangDriver {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Records of the driver's sockets in `/plugins` at `addr`: (all, still waiting for their
/// first attempt, past it: registering or done).
fn hanging_states(addr: SocketAddr) -> (usize, usize, usize) {
    let Ok((200, body)) = http::get(addr, "/plugins", Duration::from_secs(10)) else {
        return (0, 0, 0);
    };
    let records: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap_or_default();
    let hanging: Vec<&serde_json::Value> = records
        .iter()
        .filter(|r| {
            r["socket"]
                .as_str()
                .is_some_and(|s| s.rsplit('/').next().is_some_and(|f| f.starts_with("hang-")))
        })
        .collect();
    let pending = hanging.iter().filter(|r| r["state"] == "pending").count();
    let started = hanging.len() - pending;
    (hanging.len(), pending, started)
}

/// Registers `args.plugins` ordinary plugins one at a time, numbered from `first`.
async fn ordinary(dir: &Path, first: usize, args: &HolArgs) -> anyhow::Result<Phase> {
    let mut latencies = Vec::new();
    let mut after_bind = Vec::new();
    let mut max_bind = Duration::ZERO;
    for n in first..first + args.plugins {
        let path = dir.join(handler::socket_name(n));
        let plugin = soak::start(Style::Registrar, &path, handler::plugin_info(n), false)?;
        max_bind = max_bind.max(plugin.bind_time());
        if let Some(d) = plugin.registered(args.register_timeout).await {
            eprintln!(
                "    {} {d:?} (bind {:?})",
                path.display(),
                plugin.bind_time()
            );
            latencies.push(d);
            after_bind.push(d.saturating_sub(plugin.bind_time()));
        }
        plugin.stop().await?;
    }
    Ok(Phase {
        registered: latencies.len(),
        summary: Summary::of(&latencies),
        max_bind,
        after_bind: Summary::of(&after_bind),
    })
}

async fn measure(
    build: &str,
    bin: &Path,
    hanging: usize,
    answering: bool,
    args: &HolArgs,
) -> anyhow::Result<Run> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("registry");
    let daemon = spawn(
        bin,
        &dir,
        &tmp.path().join("node-info.json"),
        &args.daemon_arg,
    )?;
    let pid = daemon.child.id().to_string();
    let rss_before_kib = procfs::memory(&pid)?.rss_kib;

    // The driver whose NodeGetInfo never answers, behind `hanging` registration sockets.
    let started = Instant::now();
    let mut driver = if hanging > 0 {
        Some(HangDriver::start(&dir, tmp.path(), hanging, answering)?)
    } else {
        None
    };
    // Phase 1, during the burst: once the driver's registrations have started (all of them, or
    // every shared slot's worth for a daemon that queues the rest), or 10 s.
    let want = hanging.min(64);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut hanging_running = 0;
    if hanging > 0 {
        loop {
            let d = daemon.http;
            hanging_running = tokio::task::spawn_blocking(move || hanging_states(d).2).await?;
            if hanging_running >= want || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let during = ordinary(&dir, 0, args).await?;

    // Phase 2, after the burst: every hanging socket seen and past its first attempt, or 60 s.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut settled_after = None;
    loop {
        let d = daemon.http;
        let (seen, pending, _) = tokio::task::spawn_blocking(move || hanging_states(d)).await?;
        if seen >= hanging && pending == 0 {
            settled_after = Some(started.elapsed());
            break;
        }
        if Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = ordinary(&dir, args.plugins, args).await?;

    let memory = procfs::memory(&pid)?;
    let node_get_info_calls = match &mut driver {
        Some(d) => d.node_get_info_calls()?,
        None => 0,
    };
    drop(driver);
    drop(daemon);
    Ok(Run {
        build: build.to_owned(),
        hanging,
        answering,
        plugins: args.plugins,
        during,
        after,
        hanging_running,
        settled_after,
        node_get_info_calls,
        rss_before_kib,
        rss_kib: memory.rss_kib,
        hwm_kib: memory.hwm_kib,
    })
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn markdown(runs: &[Run], args: &HolArgs, date: &str, load: &str) -> String {
    use std::fmt::Write;
    let machine = procfs::machine();
    let mut out = String::new();
    let _ = writeln!(out, "{START}");
    let _ = writeln!(
        out,
        "## Plugin manager: a slow plugin and everyone else (issue 17, finding 8)\n"
    );
    let _ = writeln!(
        out,
        "Written by `plugreg-bench hol` (crates/bench/src/hol.rs):\n\n    \
         cargo build --release -p plugreg -p plugreg-bench\n    \
         target/release/plugreg-bench hol --out BENCHMARKS.md\n"
    );
    let _ = writeln!(
        out,
        "The real daemon (`plugreg manager --node-info-file F --liveness-interval 0`, every other \
         flag its default: 64 shared operation slots, operations leave them after 250 ms for a \
         slow lane of 256, NodeGetInfo limit 2 min) watches a fresh registry directory. A CSI \
         driver whose NodeGetInfo never answers, in a process of its own, is registered through \
         *hanging* registration sockets, all created at once (each registration may take 2 min \
         10 s). {} ordinary plugins (plugreg's registrar, type `BenchPlugin`, in the benchmark \
         process) then register one at a time, twice: *during*, as soon as 64 of the driver's \
         sockets are past their first dial (while the daemon still takes in the rest of the \
         burst), and *after*, once every one of them has had its first attempt (the time in \
         brackets, from the burst's creation). Each figure runs from the socket's creation to the \
         plugin's Notify(true); one not told within {} counts as not registered. The reference: \
         the same run with a driver whose NodeGetInfo *answers* at once, taking turns with the \
         hanging one, {} runs each: what the burst of sockets costs by itself, so that what the \
         hanging adds can be told apart. The daemon cannot tell one plugin's sockets from \
         another's before GetInfo has answered on each, so a plugin whose socket appears in the \
         middle of another's burst waits for its share of the burst's dials either way.\n",
        args.plugins,
        humantime::format_duration(args.register_timeout),
        args.repeats
    );
    let _ = writeln!(out, "| | |\n|---|---|");
    let _ = writeln!(out, "| date | {date} |");
    let _ = writeln!(
        out,
        "| machine | {} CPUs, {}, Linux {}, {:.1} GiB RAM |",
        machine.cpus,
        machine.model,
        machine.kernel,
        machine.memory_mib as f64 / 1024.0
    );
    let _ = writeln!(out, "| load average at start | {load} |");
    let _ = writeln!(out, "| commit | {} |\n", crate::commit());
    let _ = writeln!(out, "| goal | measured | verdict |\n|---|---|---|");
    let mut counts: Vec<usize> = runs.iter().map(|r| r.hanging).filter(|&n| n > 0).collect();
    counts.dedup();
    for n in counts {
        let of = |answering: bool| -> Vec<&Run> {
            runs.iter()
                .filter(|r| r.build == "this build" && r.hanging == n && r.answering == answering)
                .collect()
        };
        let (hanging, answering) = (of(false), of(true));
        let all_registered =
            |rs: &[&Run], p: fn(&Run) -> Phase| rs.iter().all(|r| p(r).registered == r.plugins);
        // The worst run's p99 against D1, once the burst is in.
        let worst_after = hanging
            .iter()
            .filter_map(|r| r.after.summary)
            .map(|s| s.p99)
            .max();
        let met =
            all_registered(&hanging, |r| r.after) && worst_after.is_some_and(|p| p <= GOAL_P99);
        let _ = writeln!(
            out,
            "| a driver whose NodeGetInfo hangs, {n} sockets, once each of its sockets has had a first attempt: every other plugin registered, p99 < {} (D1), in each of {} runs | p99 at most {} | {} |",
            ms(GOAL_P99),
            hanging.len(),
            worst_after.map_or("-".into(), ms),
            if met { "met" } else { "**missed**" }
        );
        // While the burst is taken in: the hanging driver against one that answers at once.
        let median = |rs: &[&Run]| -> Option<Duration> {
            let mut v: Vec<Duration> = rs
                .iter()
                .filter_map(|r| r.during.summary)
                .map(|s| s.p99)
                .collect();
            v.sort();
            v.get(v.len().saturating_sub(1) / 2).copied()
        };
        if let (Some(h), Some(a)) = (median(&hanging), median(&answering)) {
            let met = all_registered(&hanging, |r| r.during)
                && h.as_secs_f64() <= a.as_secs_f64() * SAME_AS_REFERENCE;
            let _ = writeln!(
                out,
                "| while the daemon takes in {n} sockets, a driver whose NodeGetInfo hangs delays the other plugins no more than a driver that answers at once does with as many sockets (median p99 of the runs, within {}x for the machine's noise), every other plugin registered | hangs: {}; answers: {} | {} |",
                SAME_AS_REFERENCE,
                ms(h),
                ms(a),
                if met { "met" } else { "**missed**" }
            );
        }
        let worst_during = hanging
            .iter()
            .filter_map(|r| r.during.summary)
            .map(|s| s.p99)
            .max();
        let met =
            all_registered(&hanging, |r| r.during) && worst_during.is_some_and(|p| p <= GOAL_P99);
        let _ = writeln!(
            out,
            "| while the daemon takes in {n} sockets of the hanging driver: every other plugin registered, p99 < {} (D1's figure; D1 asks it of an idle machine) | p99 at most {} | {} |",
            ms(GOAL_P99),
            worst_during.map_or("-".into(), ms),
            if met { "met" } else { "**missed**" }
        );
    }
    let _ = writeln!(
        out,
        "\n| build | the driver's NodeGetInfo | its sockets | phase | its sockets past their first dial at the start | ordinary plugins registered | p50 | p99 | max | creating the socket, max | socket in place -> Notify(true), p99 | its NodeGetInfo calls | daemon RSS before | RSS after | VmHWM |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in runs {
        for (phase, p) in [("during", r.during), ("after", r.after)] {
            let (p50, p99, max) = p.summary.map_or(("-".into(), "-".into(), "-".into()), |s| {
                (ms(s.p50), ms(s.p99), ms(s.max))
            });
            let phase = match (phase, r.settled_after) {
                ("after", Some(t)) if r.hanging > 0 => {
                    format!("after ({:.1} s)", t.as_secs_f64())
                }
                ("after", None) if r.hanging > 0 => "after (not settled in 60 s)".into(),
                _ => phase.into(),
            };
            let after_bind = p.after_bind.map_or("-".into(), |s| ms(s.p99));
            let _ = writeln!(
                out,
                "| {} | {} | {} | {phase} | {} | {}/{} | {p50} | {p99} | {max} | {} | {after_bind} | {} | {} | {} | {} |",
                r.build,
                if r.hanging == 0 {
                    "-"
                } else if r.answering {
                    "answers"
                } else {
                    "hangs"
                },
                r.hanging,
                r.hanging_running,
                p.registered,
                r.plugins,
                ms(p.max_bind),
                r.node_get_info_calls,
                mib(r.rss_before_kib),
                mib(r.rss_kib),
                mib(r.hwm_kib)
            );
        }
    }
    let _ = writeln!(out, "\n{END}");
    out
}
