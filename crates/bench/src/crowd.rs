//! `plugreg-bench http`: the diagnostics HTTP servers (csi-node-driver-registrar's,
//! livenessprobe's and `plugreg manager`'s, all `plugreg_sidecar_kit::http`) under a crowd of
//! clients that hold connections open, as a hostile pod on the node network could (issue 17,
//! findings 1 and 2):
//!
//! - *idle*: connect and send nothing;
//! - *slow-loris*: send the start of a request head, then one more byte every 300 ms.
//!
//! (Clients that never read their answer are the tests' business: the answers here are a few
//! KiB, which the socket buffers take whole.)
//!
//! A client whose connection the server closes connects again at once, so the crowd stays at
//! its size. Meanwhile one probe at a time asks `/healthz` (every 50 ms, each on a fresh
//! connection, as the kubelet's probe does); the figures are the probes' round trips (connect
//! to the end of the answer) and the server's memory. `--baseline-dir` runs the same against
//! other builds of the binaries (the code before the fix) in the same run.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::stats::Summary;
use crate::{burst, procfs};

/// Opens this benchmark's block in BENCHMARKS.md.
pub const START: &str = "<!-- bench:http:start -->";
/// Closes this benchmark's block in BENCHMARKS.md.
pub const END: &str = "<!-- bench:http:end -->";

/// The goal: every probe answered within this time.
const GOAL_ANSWER: Duration = Duration::from_millis(100);
/// The goal: the server's resident memory stays under this.
const GOAL_RSS_KIB: u64 = 16 * 1024;

/// Flags of `plugreg-bench http`.
#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
    /// Where `csi-node-driver-registrar`, `livenessprobe` and `plugreg` are [default: next to
    /// this binary].
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Another build of the same binaries (e.g. before a fix), measured the same way.
    #[arg(long)]
    pub baseline_dir: Option<PathBuf>,
    /// Clients in the crowd.
    #[arg(long, default_value_t = 1000)]
    pub clients: usize,
    /// How long the probes run under each crowd.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub duration: Duration,
    /// A probe not answered within this counts as unanswered.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    pub probe_timeout: Duration,
    /// Only these servers (comma-separated: registrar, livenessprobe, manager).
    #[arg(long, value_delimiter = ',')]
    pub servers: Option<Vec<String>>,
    /// Write the results into this markdown file (replacing only this benchmark's block).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The servers measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    Registrar,
    Livenessprobe,
    Manager,
}

impl Server {
    const ALL: [Server; 3] = [Server::Registrar, Server::Livenessprobe, Server::Manager];

    fn name(self) -> &'static str {
        match self {
            Server::Registrar => "registrar",
            Server::Livenessprobe => "livenessprobe",
            Server::Manager => "manager",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Server::Registrar => "csi-node-driver-registrar",
            Server::Livenessprobe => "livenessprobe",
            Server::Manager => "plugreg manager",
        }
    }

    fn binary(self) -> &'static str {
        match self {
            Server::Registrar => "csi-node-driver-registrar",
            Server::Livenessprobe => "livenessprobe",
            Server::Manager => "plugreg",
        }
    }
}

/// What the crowd's clients do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Crowd {
    Idle,
    SlowLoris,
}

impl Crowd {
    const ALL: [Crowd; 2] = [Crowd::Idle, Crowd::SlowLoris];

    fn label(self) -> &'static str {
        match self {
            Crowd::Idle => "idle",
            Crowd::SlowLoris => "slow-loris",
        }
    }
}

/// One server of one build under one crowd.
#[derive(Debug, Clone)]
struct Run {
    server: Server,
    build: String,
    crowd: Crowd,
    clients: usize,
    probes: usize,
    answered: usize,
    summary: Option<Summary>,
    rss_before_kib: u64,
    rss_max_kib: u64,
    hwm_kib: u64,
    connects: u64,
}

impl Run {
    fn met(&self) -> bool {
        self.answered == self.probes
            && self.summary.is_some_and(|s| s.max <= GOAL_ANSWER)
            && self.rss_max_kib.max(self.hwm_kib) < GOAL_RSS_KIB
    }
}

/// Runs the benchmark.
pub fn main(args: HttpArgs) -> anyhow::Result<()> {
    let here = std::env::current_exe()?
        .parent()
        .context("the benchmark binary has no directory")?
        .to_owned();
    let bin_dir = args.bin_dir.clone().unwrap_or(here);
    // The crowd, the probes and the drivers' sockets: two descriptors a client, with room.
    procfs::raise_nofile(args.clients as u64 * 2 + 1024).context("raising the open-file limit")?;
    let servers: Vec<Server> = match &args.servers {
        Some(names) => Server::ALL
            .into_iter()
            .filter(|s| names.iter().any(|n| n == s.name()))
            .collect(),
        None => Server::ALL.to_vec(),
    };
    let mut builds = vec![("this build".to_owned(), bin_dir)];
    if let Some(b) = &args.baseline_dir {
        builds.push((format!("baseline ({})", b.display()), b.clone()));
    }
    let date = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let load = procfs::load_average();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut runs = Vec::new();
    for server in &servers {
        for (build, dir) in &builds {
            for crowd in Crowd::ALL {
                eprintln!(
                    "http: {} ({build}), {} {}",
                    server.label(),
                    args.clients,
                    crowd.label()
                );
                let run = runtime
                    .block_on(measure(*server, build, dir, crowd, &args))
                    .with_context(|| format!("{} ({build}), {}", server.label(), crowd.label()))?;
                eprintln!(
                    "  answered {}/{}; {:?}; RSS {} -> max {} KiB, VmHWM {} KiB; {} connects",
                    run.answered,
                    run.probes,
                    run.summary,
                    run.rss_before_kib,
                    run.rss_max_kib,
                    run.hwm_kib,
                    run.connects
                );
                runs.push(run);
            }
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

/// A server process and what it needs (its CSI driver, its directories).
struct Running {
    child: Child,
    addr: SocketAddr,
    _driver: Option<plugreg_csi_test_driver::RunningDriver>,
    _tmp: tempfile::TempDir,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start(server: Server, dir: &Path) -> anyhow::Result<Running> {
    let bin = dir.join(server.binary());
    anyhow::ensure!(
        bin.is_file(),
        "no {} at {} (cargo build --release -p plugreg -p plugreg-node-driver-registrar -p plugreg-livenessprobe)",
        server.binary(),
        bin.display()
    );
    let tmp = tempfile::tempdir()?;
    let addr = burst::free_local_port()?;
    let csi = tmp.path().join("csi.sock");
    let driver = match server {
        Server::Manager => None,
        _ => {
            let config = plugreg_csi_test_driver::DriverConfig {
                name: "bench.csi.plugreg.io".into(),
                ..Default::default()
            };
            Some(plugreg_csi_test_driver::start(config, &csi).await?)
        }
    };
    let mut cmd = Command::new(&bin);
    match server {
        Server::Registrar => {
            let reg = tmp.path().join("registry");
            std::fs::create_dir(&reg)?;
            cmd.arg(format!("--csi-address={}", csi.display()))
                .arg(format!("--plugin-registration-path={}", reg.display()))
                .arg("--kubelet-registration-path=/var/lib/kubelet/plugins/bench/csi.sock")
                .arg(format!("--http-endpoint={addr}"));
        }
        Server::Livenessprobe => {
            cmd.arg(format!("--csi-address={}", csi.display()))
                .arg(format!("--http-endpoint={addr}"));
        }
        Server::Manager => {
            cmd.arg("manager")
                .arg("--registry-dir")
                .arg(tmp.path().join("registry"))
                .args(["--liveness-interval", "0", "--http-endpoint"])
                .arg(addr.to_string());
        }
    }
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut running = Running {
        child,
        addr,
        _driver: driver,
        _tmp: tmp,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if matches!(probe(addr, Duration::from_secs(1)).await, Some((200, _))) {
            return Ok(running);
        }
        if let Some(status) = running.child.try_wait()? {
            bail!("{} exited at start: {status}", server.label());
        }
        if Instant::now() > deadline {
            bail!("{} was not healthy within 30 s", server.label());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One `/healthz` on a fresh connection: the status and the round trip, or `None` when it was
/// not answered within `limit`.
async fn probe(addr: SocketAddr, limit: Duration) -> Option<(u16, Duration)> {
    let start = Instant::now();
    let exchange = async {
        let mut s = TcpStream::connect(addr).await.ok()?;
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await.ok()?;
        let text = String::from_utf8_lossy(&answer);
        text.split(' ').nth(1)?.parse::<u16>().ok()
    };
    let code = tokio::time::timeout(limit, exchange).await.ok()??;
    Some((code, start.elapsed()))
}

/// One client of the crowd: connects, behaves as `crowd` says, and connects again whenever the
/// server closes the connection, until `stop`.
async fn client(addr: SocketAddr, crowd: Crowd, stop: Arc<AtomicBool>, connects: Arc<AtomicU64>) {
    while !stop.load(Ordering::Relaxed) {
        let connected =
            tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await;
        let Ok(Ok(mut s)) = connected else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        connects.fetch_add(1, Ordering::Relaxed);
        match crowd {
            Crowd::Idle => {
                let mut byte = [0u8; 1];
                // Returns when the server closes (or on the stop, below).
                let _ = tokio::select! {
                    r = s.read(&mut byte) => r.ok(),
                    _ = until(&stop) => None,
                };
            }
            Crowd::SlowLoris => {
                if s.write_all(b"GET /healthz HTTP/1.1\r\nHost: crowd\r\nX-Slow: ")
                    .await
                    .is_err()
                {
                    continue;
                }
                loop {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    if s.write_all(b"a").await.is_err() {
                        break;
                    }
                }
            }
        }
    }
}

async fn until(stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn measure(
    server: Server,
    build: &str,
    dir: &Path,
    crowd: Crowd,
    args: &HttpArgs,
) -> anyhow::Result<Run> {
    let running = start(server, dir).await?;
    let pid = running.child.id().to_string();
    let addr = running.addr;
    let rss_before_kib = procfs::memory(&pid)?.rss_kib;
    let stop = Arc::new(AtomicBool::new(false));
    let connects = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for _ in 0..args.clients {
        clients.push(tokio::spawn(client(
            addr,
            crowd,
            stop.clone(),
            connects.clone(),
        )));
    }
    // The crowd is in: every client has connected once (or 10 s have passed: a server that
    // stops accepting keeps the rest in its backlog or refuses them).
    let deadline = Instant::now() + Duration::from_secs(10);
    while connects.load(Ordering::Relaxed) < args.clients as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut rtts = Vec::new();
    let mut probes = 0;
    let mut rss_max_kib = 0;
    let end = Instant::now() + args.duration;
    while Instant::now() < end {
        probes += 1;
        if let Some((200, rtt)) = probe(addr, args.probe_timeout).await {
            rtts.push(rtt);
        }
        rss_max_kib = rss_max_kib.max(procfs::memory(&pid)?.rss_kib);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let memory = procfs::memory(&pid)?;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.abort();
    }
    drop(running);
    Ok(Run {
        server,
        build: build.to_owned(),
        crowd,
        clients: args.clients,
        probes,
        answered: rtts.len(),
        summary: Summary::of(&rtts),
        rss_before_kib,
        rss_max_kib: rss_max_kib.max(memory.rss_kib),
        hwm_kib: memory.hwm_kib,
        connects: connects.load(Ordering::Relaxed),
    })
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn markdown(runs: &[Run], args: &HttpArgs, date: &str, load: &str) -> String {
    use std::fmt::Write;
    let machine = procfs::machine();
    let mut out = String::new();
    let _ = writeln!(out, "{START}");
    let _ = writeln!(
        out,
        "## Diagnostics HTTP servers under a crowd (issue 17, findings 1 and 2)\n"
    );
    let _ = writeln!(
        out,
        "Written by `plugreg-bench http` (crates/bench/src/crowd.rs):\n\n    \
         cargo build --release -p plugreg -p plugreg-node-driver-registrar -p plugreg-livenessprobe -p plugreg-bench\n    \
         target/release/plugreg-bench http --out BENCHMARKS.md\n"
    );
    let _ = writeln!(
        out,
        "Each server is the release binary, started fresh for each crowd: csi-node-driver-registrar \
         and livenessprobe against the in-process CSI test driver, `plugreg manager` with an empty \
         registry. {} clients hold connections open: *idle* ones connect and send nothing, \
         *slow-loris* ones send the start of a request head and then one byte every 300 ms; a \
         client whose connection the server closes connects again at once. Meanwhile a probe asks `/healthz` every 50 ms for \
         {} on a fresh connection (as the kubelet does); its round trip runs from connect to the \
         end of the answer, and a probe not answered within {} counts as unanswered. RSS is the \
         server's VmRSS (sampled after each probe) and VmHWM.\n",
        args.clients,
        humantime::format_duration(args.duration),
        humantime::format_duration(args.probe_timeout),
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
    let _ = writeln!(out, "### Goals\n");
    let _ = writeln!(out, "| goal | measured | verdict |\n|---|---|---|");
    for r in runs.iter().filter(|r| r.build == "this build") {
        let worst = r.summary.map_or("none answered".to_owned(), |s| ms(s.max));
        let _ = writeln!(
            out,
            "| {}: with {} {} clients, every /healthz answered within {} and RSS under {} | {}/{} answered, slowest {}; RSS at most {} | {} |",
            r.server.label(),
            r.clients,
            r.crowd.label(),
            ms(GOAL_ANSWER),
            mib(GOAL_RSS_KIB),
            r.answered,
            r.probes,
            worst,
            mib(r.rss_max_kib.max(r.hwm_kib)),
            if r.met() { "met" } else { "**missed**" }
        );
    }
    let _ = writeln!(out, "\n### Every run\n");
    let _ = writeln!(
        out,
        "| server | build | crowd | probes answered | p50 | p99 | max | RSS before the crowd | RSS with the crowd (max) | VmHWM | crowd connects |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in runs {
        let (p50, p99, max) = r.summary.map_or(("-".into(), "-".into(), "-".into()), |s| {
            (ms(s.p50), ms(s.p99), ms(s.max))
        });
        let _ = writeln!(
            out,
            "| {} | {} | {} {} | {}/{} | {p50} | {p99} | {max} | {} | {} | {} | {} |",
            r.server.label(),
            r.build,
            r.clients,
            r.crowd.label(),
            r.answered,
            r.probes,
            mib(r.rss_before_kib),
            mib(r.rss_max_kib),
            mib(r.hwm_kib),
            r.connects
        );
    }
    let _ = writeln!(out, "\n{END}");
    out
}
