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
    /// An ordinary plugin not told Notify(true) within this counts as not registered.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub register_timeout: Duration,
    /// Write the results into this markdown file (replacing only this benchmark's block).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Clone)]
struct Run {
    build: String,
    hanging: usize,
    plugins: usize,
    registered: usize,
    summary: Option<Summary>,
    /// Registrations of the hanging driver running when the ordinary plugins started.
    hanging_running: usize,
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
        for &hanging in &args.hanging {
            eprintln!(
                "hol: {build}, {hanging} hanging sockets, {} plugins",
                args.plugins
            );
            let run = runtime
                .block_on(measure(build, bin, hanging, &args))
                .with_context(|| format!("{build}, {hanging} hanging sockets"))?;
            eprintln!(
                "  registered {}/{}; {:?}; {} hanging registrations running; RSS {} -> {} KiB",
                run.registered,
                run.plugins,
                run.summary,
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

fn spawn(bin: &Path, dir: &Path, node_info: &Path) -> anyhow::Result<Daemon> {
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
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
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

/// Registrations in state `registering`, from the daemon's `/plugins` at `addr`.
fn registering(addr: SocketAddr) -> usize {
    let Ok((200, body)) = http::get(addr, "/plugins", Duration::from_secs(10)) else {
        return 0;
    };
    let records: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap_or_default();
    records
        .iter()
        .filter(|r| r["state"] == "registering")
        .count()
}

async fn measure(build: &str, bin: &Path, hanging: usize, args: &HolArgs) -> anyhow::Result<Run> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("registry");
    let daemon = spawn(bin, &dir, &tmp.path().join("node-info.json"))?;
    let pid = daemon.child.id().to_string();
    let rss_before_kib = procfs::memory(&pid)?.rss_kib;
    let token = CancellationToken::new();

    // The driver whose NodeGetInfo never answers, behind `hanging` registration sockets.
    let csi = tmp.path().join("hang.sock");
    let config = plugreg_csi_test_driver::DriverConfig {
        name: "hang.csi.plugreg.io".into(),
        node_get_info: plugreg_csi_test_driver::Fault {
            hang: true,
            ..Default::default()
        },
        ..Default::default()
    };
    let driver = plugreg_csi_test_driver::start(config, &csi).await?;
    for i in 0..hanging {
        let r = Registrar::new(PluginInfo {
            r#type: "CSIPlugin".into(),
            name: "hang.csi.plugreg.io".into(),
            endpoint: csi.display().to_string(),
            supported_versions: vec!["1.0.0".into()],
        });
        let (path, t) = (dir.join(format!("hang-{i}-reg.sock")), token.clone());
        tokio::spawn(async move { r.serve(&path, Default::default(), t).await });
    }
    // Wait until the hanging registrations have started (all of them, or every shared slot's
    // worth for a daemon that queues the rest), or 10 s.
    let want = hanging.min(64);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut hanging_running = 0;
    if hanging > 0 {
        loop {
            let d = daemon.http;
            hanging_running = tokio::task::spawn_blocking(move || registering(d)).await?;
            if hanging_running >= want || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let mut latencies = Vec::new();
    for n in 0..args.plugins {
        let path = dir.join(handler::socket_name(n));
        let plugin = soak::start(Style::Registrar, &path, handler::plugin_info(n), false)?;
        if let Some(d) = plugin.registered(args.register_timeout).await {
            latencies.push(d);
        }
        plugin.stop().await?;
    }
    let memory = procfs::memory(&pid)?;
    let node_get_info_calls = driver
        .calls()
        .count(plugreg_csi_test_driver::Method::NodeGetInfo);
    token.cancel();
    drop(daemon);
    let _ = driver.stop().await;
    Ok(Run {
        build: build.to_owned(),
        hanging,
        plugins: args.plugins,
        registered: latencies.len(),
        summary: Summary::of(&latencies),
        hanging_running,
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
         driver in the benchmark process whose NodeGetInfo never answers is registered through \
         *hanging* registration sockets of its own (each registration may take 2 min 10 s). Once \
         its registrations run, {} ordinary plugins (plugreg's registrar, type `BenchPlugin`) \
         register one at a time; each figure runs from the socket's creation to the plugin's \
         Notify(true); one not told within {} counts as not registered.\n",
        args.plugins,
        humantime::format_duration(args.register_timeout)
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
    for r in runs
        .iter()
        .filter(|r| r.build == "this build" && r.hanging > 0)
    {
        let met = r.registered == r.plugins && r.summary.is_some_and(|s| s.p99 <= GOAL_P99);
        let p99 = r.summary.map_or("-".into(), |s| ms(s.p99));
        let _ = writeln!(
            out,
            "| with {} sockets of a driver whose NodeGetInfo hangs: every other plugin registered, p99 < {} (D1) | {}/{} registered, p99 {p99} | {} |",
            r.hanging,
            ms(GOAL_P99),
            r.registered,
            r.plugins,
            if met { "met" } else { "**missed**" }
        );
    }
    let _ = writeln!(
        out,
        "\n| build | hanging sockets | their registrations running | ordinary plugins registered | p50 | p99 | max | NodeGetInfo calls of the hanging driver | daemon RSS before | RSS after | VmHWM |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in runs {
        let (p50, p99, max) = r.summary.map_or(("-".into(), "-".into(), "-".into()), |s| {
            (ms(s.p50), ms(s.p99), ms(s.max))
        });
        let _ = writeln!(
            out,
            "| {} | {} | {} | {}/{} | {p50} | {p99} | {max} | {} | {} | {} | {} |",
            r.build,
            r.hanging,
            r.hanging_running,
            r.registered,
            r.plugins,
            r.node_get_info_calls,
            mib(r.rss_before_kib),
            mib(r.rss_kib),
            mib(r.hwm_kib)
        );
    }
    let _ = writeln!(out, "\n{END}");
    out
}
