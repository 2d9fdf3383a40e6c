//! `plugreg-bench`: the issue-2 benchmark of the plugin manager. Registration and
//! deregistration latency one plugin at a time (manager in-process), then 1,000 and 10,000
//! plugins at once (manager and plugins in processes of their own), written into
//! BENCHMARKS.md between this benchmark's markers.
//!
//! Last, unless `--quick` or `--skip-soak`, the churn soak (also the `soak` subcommand) runs
//! against the `plugreg manager` daemon and checks that what it registered matches what is
//! there (its own block in BENCHMARKS.md).
//!
//! ```text
//! cargo build --release -p plugreg -p plugreg-bench && target/release/plugreg-bench --out BENCHMARKS.md
//! cargo run --release -p plugreg-bench -- soak --out BENCHMARKS.md
//! cargo run --release -p plugreg-bench -- --quick
//! cargo build --release -p plugreg -p plugreg-bench && target/release/plugreg-bench devices
//! ```

mod burst;
mod child;
mod crowd;
mod devices;
mod farm;
mod handler;
mod hol;
mod http;
mod latency;
mod plugin;
mod procfs;
mod report;
mod soak;
mod stats;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

use burst::{BurstOptions, ManagerKind};
use plugin::Style;
use report::Report;

/// Benchmarks plugreg's plugin manager and writes the figures into BENCHMARKS.md.
#[derive(Debug, Parser)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Hidden>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Write the results into this markdown file (replacing only this benchmark's block).
    #[arg(long)]
    out: Option<PathBuf>,
    /// A small smoke run: 20 latency samples, one burst of 200 plugins.
    #[arg(long)]
    quick: bool,
    /// Registrations (and deregistrations) measured one at a time [default: 200; quick: 20].
    #[arg(long)]
    latency_count: Option<usize>,
    /// Unmeasured registrations before the latency run [default: 10; quick: 3].
    #[arg(long)]
    warmup: Option<usize>,
    /// Burst sizes, comma-separated [default: 1000,10000; quick: 200].
    #[arg(long, value_delimiter = ',')]
    burst: Option<Vec<usize>>,
    /// Runs of each burst; the report shows the median one [default: 3; quick: 1].
    #[arg(long)]
    burst_runs: Option<usize>,
    /// Which manager serves the bursts: `auto` is the daemon when its binary exists, and the
    /// in-process-child manager always.
    #[arg(long, value_enum, default_value_t = ManagerChoice::Auto)]
    manager: ManagerChoice,
    /// The `plugreg` binary [default: `plugreg` next to this binary].
    #[arg(long)]
    manager_bin: Option<PathBuf>,
    /// Passed to the managers of the bursts (their default otherwise).
    #[arg(long)]
    max_concurrent_operations: Option<usize>,
    /// Extra argument for the daemon (repeatable), e.g. `--daemon-arg=-v --daemon-arg=0`.
    #[arg(long = "daemon-arg", allow_hyphen_values = true)]
    daemon_args: Vec<String>,
    /// Longest wait for a burst to be registered.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "120s")]
    burst_timeout: Duration,
    /// Wait after a burst before reading the steady RSS.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "3s")]
    settle: Duration,
    /// Parent directories of the registry directories, comma-separated; every run is made in
    /// each [default: the system temp dir, and /dev/shm when it is a tmpfs]. Binding a Unix
    /// socket creates an inode, so the file system shows in the figures.
    #[arg(long, value_delimiter = ',')]
    work_dirs: Option<Vec<PathBuf>>,
    /// Plugin styles of the latency runs, comma-separated: `registrar` (plugreg's registrar,
    /// listening before its socket appears), `go` (bound first, listening right after, as Go's
    /// net.Listen), `go:GAP` (listening GAP after binding).
    #[arg(long, value_delimiter = ',', value_parser = plugin::parse_style,
          default_value = "registrar,go,go:1ms")]
    latency_styles: Vec<Style>,
    /// Plugin styles of the bursts (as --latency-styles). Bind-then-listen bursts run against
    /// the daemon only when it is one of the managers.
    #[arg(long, value_delimiter = ',', value_parser = plugin::parse_style,
          default_value = "registrar,go")]
    burst_styles: Vec<Style>,
    /// Skip the latency run.
    #[arg(long)]
    skip_latency: bool,
    /// Skip the bursts.
    #[arg(long)]
    skip_burst: bool,
    /// Skip the churn soak (which runs last, with its defaults, unless `--quick`; run it on its
    /// own, with other settings, as the `soak` subcommand).
    #[arg(long)]
    skip_soak: bool,
}

/// The soak's flags alone, to get their defaults.
#[derive(Debug, Parser)]
struct SoakDefaults {
    #[command(flatten)]
    args: soak::SoakArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ManagerChoice {
    Auto,
    Daemon,
    InProcessChild,
}

/// The soak, and the parts of the benchmark that run as processes of their own.
#[derive(Debug, Subcommand)]
enum Hidden {
    /// Serve many plugins at once (one registrar per socket).
    #[command(hide = true)]
    Farm {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        count: usize,
        #[arg(long, default_value_t = 2)]
        workers: usize,
        #[arg(long, value_parser = humantime::parse_duration, default_value = "120s")]
        timeout: Duration,
        #[arg(long, value_parser = plugin::parse_style, default_value = "registrar")]
        style: Style,
    },
    /// Churn plugin sockets against the `plugreg manager` daemon and check its end state.
    Soak(soak::SoakArgs),
    /// The diagnostics HTTP servers (registrar, livenessprobe, manager) under a crowd of idle
    /// and slow-loris clients: /healthz round trips and memory.
    Http(crowd::HttpArgs),
    /// Ordinary plugins registering while a CSI driver whose NodeGetInfo hangs is registered
    /// through many sockets.
    Hol(hol::HolArgs),
    /// Device plugins against the `plugreg manager` daemon: a health change until `/plugins`
    /// shows it, and 100 plugins of 100 devices until all are listed, with the daemon's RSS.
    Devices(devices::DevicesArgs),
    /// The hanging CSI driver of `hol`, with its registration sockets.
    #[command(hide = true)]
    HangDriver {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        work: PathBuf,
        #[arg(long)]
        sockets: usize,
        /// NodeGetInfo answers at once (the reference run) instead of hanging.
        #[arg(long)]
        answer: bool,
    },
    /// Run the plugin manager library with an accept-all BenchPlugin handler.
    #[command(hide = true)]
    Manager {
        #[arg(long)]
        registry_dir: PathBuf,
        #[arg(long)]
        max_concurrent_operations: Option<usize>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Hidden::Farm {
            dir,
            count,
            workers,
            timeout,
            style,
        }) => farm::run(&dir, count, workers, timeout, style),
        Some(Hidden::Soak(args)) => soak::main(args),
        Some(Hidden::Http(args)) => crowd::main(args),
        Some(Hidden::Hol(args)) => hol::main(args),
        Some(Hidden::Devices(args)) => devices::main(args),
        Some(Hidden::HangDriver {
            dir,
            work,
            sockets,
            answer,
        }) => hol::hang_driver(&dir, &work, sockets, answer),
        Some(Hidden::Manager {
            registry_dir,
            max_concurrent_operations,
        }) => child::run(&registry_dir, max_concurrent_operations),
        None => run(cli.run),
    }
}

fn run(args: RunArgs) -> anyhow::Result<()> {
    let date = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let latency_count = args
        .latency_count
        .unwrap_or(if args.quick { 20 } else { 200 });
    let warmup = args.warmup.unwrap_or(if args.quick { 3 } else { 10 });
    let bursts = args.burst.clone().unwrap_or_else(|| {
        if args.quick {
            vec![200]
        } else {
            vec![1_000, 10_000]
        }
    });
    let burst_runs = args
        .burst_runs
        .unwrap_or(if args.quick { 1 } else { 3 })
        .max(1);
    let managers = managers(&args)?;
    let largest = bursts.iter().copied().max().unwrap_or(0) as u64;
    procfs::raise_nofile(largest + 1024).context("raising the open-file limit for the farm")?;

    let mut report = Report {
        date,
        machine: procfs::machine(),
        load: procfs::load_average(),
        commit: commit(),
        command: command_line(),
        quick: args.quick,
        latency: Vec::new(),
        settle: args.settle,
        bursts: Vec::new(),
        failures: Vec::new(),
    };

    let work_dirs = args.work_dirs.clone().unwrap_or_else(default_work_dirs);
    let latency_runs: Vec<(&PathBuf, Style)> = work_dirs
        .iter()
        .filter(|_| !args.skip_latency)
        .flat_map(|p| args.latency_styles.iter().map(move |s| (p, *s)))
        .collect();
    for (parent, style) in latency_runs {
        eprintln!(
            "latency: {latency_count} registrations after {warmup} warm-up, {}, in {} ({})",
            style.label(),
            parent.display(),
            procfs::fs_type(parent)
        );
        let tmp = tempfile::Builder::new()
            .prefix("plugreg-bench-")
            .tempdir_in(parent)?;
        let l = latency::run(&tmp.path().join("registry"), latency_count, warmup, style)
            .context("latency run")?;
        eprintln!(
            "  registration p50 {:?} p99 {:?} ({} over 5 ms); deregistration p50 {:?} p99 {:?}; \
             failed attempts {:?}",
            l.registration.p50,
            l.registration.p99,
            l.over_goal,
            l.deregistration.p50,
            l.deregistration.p99,
            l.failed_attempts
        );
        report.latency.push(l);
    }

    if !args.skip_burst {
        let opts = BurstOptions {
            max_concurrent_operations: args.max_concurrent_operations,
            daemon_args: args.daemon_args.clone(),
            timeout: args.burst_timeout,
            settle: args.settle,
            farm_workers: 2,
        };
        let has_daemon = managers.iter().any(|k| matches!(k, ManagerKind::Daemon(_)));
        let mut runs = Vec::new();
        for style in &args.burst_styles {
            for kind in &managers {
                // The bind-then-listen bursts are about the daemon (the issue's finding).
                if style.is_go() && has_daemon && !matches!(kind, ManagerKind::Daemon(_)) {
                    continue;
                }
                for parent in &work_dirs {
                    runs.extend(bursts.iter().map(|&n| (*style, kind, parent, n)));
                }
            }
        }
        for (style, kind, parent, count) in runs {
            let fs = procfs::fs_type(parent);
            let mut results = Vec::new();
            for run in 1..=burst_runs {
                eprintln!(
                    "burst: {count} plugins ({}), {}, in {} ({fs}), run {run}/{burst_runs}",
                    style.label(),
                    kind.label(),
                    parent.display(),
                );
                match burst::run(kind, count, parent, &opts, style) {
                    Ok(b) => {
                        eprintln!(
                            "  all registered in {:?}, p99 {:?}, manager peak RSS {} KiB, steady \
                             {} KiB, failed attempts {:?}, log warnings {:?}",
                            b.all_registered,
                            b.p99,
                            b.peak_kib,
                            b.steady_rss_kib,
                            b.failures,
                            b.log_warnings
                        );
                        results.push(b);
                    }
                    Err(e) => {
                        eprintln!("  failed: {e:#}");
                        report.failures.push(format!(
                            "{count} plugins ({}), {}, {fs}, run {run}: {e:#}",
                            style.label(),
                            kind.label()
                        ));
                    }
                }
            }
            report.bursts.extend(burst::median(results));
        }
    }

    let section = report.markdown();
    match &args.out {
        Some(path) => {
            let existing = match std::fs::read_to_string(path) {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
                Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
            };
            std::fs::write(path, report::splice(&existing, &section))
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        None => print!("{section}"),
    }
    let soaked = if args.quick || args.skip_soak {
        Ok(())
    } else {
        let mut soak = SoakDefaults::parse_from(["soak"]).args;
        soak.out = args.out.clone();
        soak.manager_bin = args.manager_bin.clone();
        eprintln!("soak: {} cycles against the daemon", soak.cycles);
        soak::main(soak).context("the churn soak")
    };
    if !report.failures.is_empty() {
        anyhow::bail!("{} burst run(s) failed", report.failures.len())
    }
    soaked
}

/// The `plugreg` daemon binary: `given`, or else `plugreg` beside this benchmark's binary.
pub(crate) fn daemon_bin(given: Option<&std::path::Path>) -> anyhow::Result<PathBuf> {
    Ok(match given {
        Some(b) => b.to_owned(),
        None => std::env::current_exe()?
            .parent()
            .context("the benchmark binary has no directory")?
            .join("plugreg"),
    })
}

/// The managers the bursts run against.
fn managers(args: &RunArgs) -> anyhow::Result<Vec<ManagerKind>> {
    let bin = daemon_bin(args.manager_bin.as_deref())?;
    Ok(match args.manager {
        ManagerChoice::Daemon => {
            anyhow::ensure!(bin.is_file(), "no daemon binary at {}", bin.display());
            vec![ManagerKind::Daemon(bin)]
        }
        ManagerChoice::InProcessChild => vec![ManagerKind::Child],
        ManagerChoice::Auto if bin.is_file() => vec![ManagerKind::Daemon(bin), ManagerKind::Child],
        ManagerChoice::Auto => {
            eprintln!(
                "no daemon binary at {}; bursts use the in-process-child manager only",
                bin.display()
            );
            vec![ManagerKind::Child]
        }
    })
}

/// The system temp dir, and /dev/shm too when it is a tmpfs on another file system.
fn default_work_dirs() -> Vec<PathBuf> {
    let temp = std::env::temp_dir();
    let shm = PathBuf::from("/dev/shm");
    let mut dirs = vec![temp.clone()];
    if shm.is_dir() && procfs::fs_type(&shm) == "tmpfs" && procfs::fs_type(&temp) != "tmpfs" {
        dirs.push(shm);
    }
    dirs
}

/// The short commit hash, marked when the working tree differs from it.
pub(crate) fn commit() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(hash) => {
            // BENCHMARKS.md is this program's own output: writing it does not make the
            // measured code differ from the commit.
            let dirty = git(&[
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":(exclude)BENCHMARKS.md",
            ])
            .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("`{hash}` (working tree had uncommitted changes)")
            } else {
                format!("`{hash}`")
            }
        }
        None => "unknown".to_owned(),
    }
}

/// How this run was invoked, as a cargo command.
fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        "cargo run --release -p plugreg-bench".to_owned()
    } else {
        format!("cargo run --release -p plugreg-bench -- {}", args.join(" "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_full_run_soaks_with_the_soak_subcommands_defaults() {
        let d = SoakDefaults::parse_from(["soak"]).args;
        assert_eq!(
            (d.cycles, d.baseline_after, d.concurrency),
            (100_000, 10_000, 64)
        );
        assert_eq!(d.liveness_interval, Duration::from_millis(100));
        let cli = Cli::parse_from(["plugreg-bench", "--skip-soak", "--burst-styles", "go:2ms"]);
        assert!(cli.run.skip_soak);
        assert_eq!(
            cli.run.burst_styles,
            [Style::BindThenListen {
                gap: Duration::from_millis(2)
            }]
        );
        assert!(Cli::try_parse_from(["plugreg-bench", "--latency-styles", "rust"]).is_err());
    }
}
