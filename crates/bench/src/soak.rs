//! `plugreg-bench soak`: churns plugin sockets against the real `plugreg manager` daemon and
//! checks, at the end, that what the daemon has registered is exactly what is alive.
//!
//! Each cycle creates one socket and deletes it (or leaves it behind, dead). The kinds of cycle
//! take turns by cycle number (see [`Kind::of`]): plugreg's registrar, Go-style plugins that
//! bind before they listen (with and without a gap), sockets deleted before they could be
//! registered, and plugins that die after registering and leave their socket behind (refusing
//! connections; the daemon's D5 probes must find them dead). Every 1,000th cycle starts a plugin
//! that stays alive to the end; after the last cycle a few more are started. Then:
//!
//! - every live plugin's socket is registered (no *present-but-unregistered* socket), and
//! - nothing registered lacks a live plugin (no *registered-but-gone* socket): neither a socket
//!   that was deleted nor a dead plugin's leftover socket.
//!
//! The daemon's resident memory is read after the first `--baseline-after` cycles and at the
//! end.

use std::collections::{BTreeSet, VecDeque};
use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use plugreg_registrar::{PluginInfo, Registrar};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::plugin::{self, Style};
use crate::stats::Summary;
use crate::{burst, handler, http, procfs};

/// Opens the soak's block in BENCHMARKS.md.
pub const START: &str = "<!-- bench:soak:start -->";
/// Closes the soak's block in BENCHMARKS.md.
pub const END: &str = "<!-- bench:soak:end -->";

/// Flags of `plugreg-bench soak`.
#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    /// Socket create/delete cycles.
    #[arg(long, default_value_t = 100_000)]
    pub cycles: usize,
    /// Cycles running at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// The daemon's RSS baseline is read once this many cycles are done.
    #[arg(long, default_value_t = 10_000)]
    pub baseline_after: usize,
    /// The `plugreg` binary [default: `plugreg` next to this binary].
    #[arg(long)]
    pub manager_bin: Option<PathBuf>,
    /// Parent directory of the registry directory [default: the system temp dir].
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// The daemon's dead-plugin probe interval (short, so that leftover sockets of dead plugins
    /// are found dead within the soak; the daemon's default is 10 s).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "100ms")]
    pub liveness_interval: Duration,
    /// Refused probes in a row that make a plugin dead, for the daemon.
    #[arg(long, default_value_t = 2)]
    pub liveness_failures: u32,
    /// Leftover sockets of dead plugins kept at once; the oldest is deleted when there are more
    /// (as a restarting plugin or an operator would).
    #[arg(long, default_value_t = 128)]
    pub leftovers: usize,
    /// Plugins started after the last cycle that stay alive for the final check.
    #[arg(long, default_value_t = 32)]
    pub final_live: usize,
    /// Plugins of the every-1,000th cycles kept alive at once; the oldest is stopped (its
    /// socket removed) when there are more. Bounded, so that the plugins alive do not grow
    /// with the cycles: the soak measures what churn leaves behind, not what live plugins hold.
    #[arg(long, default_value_t = 100)]
    pub staying: usize,
    /// Longest wait for a cycle's plugin to be told it is registered.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub register_timeout: Duration,
    /// Longest wait at the end for the daemon's registrations to match the live plugins.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    pub settle_timeout: Duration,
    /// Extra argument for the daemon (repeatable).
    #[arg(long = "daemon-arg", allow_hyphen_values = true)]
    pub daemon_args: Vec<String>,
    /// Write the results into this markdown file (replacing only the soak's block).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the results as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// What one cycle does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// plugreg's registrar; waits for Notify(true), stops (its socket goes with it).
    Registrar,
    /// A registrar socket bound and at once dropped (created and deleted before anything
    /// could register it).
    RegistrarGone,
    /// Go-style; waits for Notify(true), deletes the socket, stops.
    Go(Duration),
    /// Go-style socket bound and deleted before it ever listened.
    GoNeverListened,
    /// Go-style; waits for Notify(true), then dies leaving its socket behind.
    GoDies,
    /// plugreg's registrar killed after Notify(true): its socket stays behind.
    RegistrarDies,
    /// Stays alive until the end.
    Stays(Style),
}

impl Kind {
    /// The kind of cycle `n`: 30 % registrar, 30 % Go-style (gap 0 twice, 1 ms once), 10 %
    /// registrar sockets deleted at once, 10 % Go-style sockets deleted before listening, 20 %
    /// plugins that die leaving their socket; every 1,000th stays alive.
    fn of(n: usize) -> Self {
        if n % 1000 == 999 {
            return Kind::Stays(if (n / 1000).is_multiple_of(2) {
                Style::Registrar
            } else {
                Style::BindThenListen {
                    gap: Duration::ZERO,
                }
            });
        }
        match n % 10 {
            0..=2 => Kind::Registrar,
            3 => Kind::RegistrarGone,
            4 | 5 => Kind::Go(Duration::ZERO),
            6 => Kind::Go(Duration::from_millis(1)),
            7 => Kind::GoNeverListened,
            8 => Kind::GoDies,
            _ => Kind::RegistrarDies,
        }
    }

    fn style(self) -> Option<Style> {
        match self {
            Kind::Registrar | Kind::RegistrarDies => Some(Style::Registrar),
            Kind::Go(gap) => Some(Style::BindThenListen { gap }),
            Kind::GoDies => Some(Style::BindThenListen {
                gap: Duration::ZERO,
            }),
            Kind::Stays(s) => Some(s),
            Kind::RegistrarGone | Kind::GoNeverListened => None,
        }
    }
}

/// A plugin serving on its socket.
pub(crate) struct Running {
    path: PathBuf,
    registrar: Registrar,
    created: Instant,
    /// When its socket was in place (bound, and renamed into place where the style does).
    bound: Instant,
    token: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Running {
    /// Socket created -> Notify(true), or `None` when not told within `limit`.
    pub(crate) async fn registered(&self, limit: Duration) -> Option<Duration> {
        let mut status = self.registrar.status();
        tokio::time::timeout(limit, status.wait_for(|s| s.is_registered()))
            .await
            .ok()?
            .ok()?;
        Some(self.created.elapsed())
    }

    /// How long creating the socket took (the file system's part of [`Self::registered`]).
    pub(crate) fn bind_time(&self) -> Duration {
        self.bound - self.created
    }

    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        self.token.cancel();
        self.task.await.context("plugin task")?
    }
}

/// Starts a plugin of `style` at `path`. With `leave_socket`, the socket file stays when the
/// plugin stops (a plugin killed without cleaning up).
pub(crate) fn start(
    style: Style,
    path: &Path,
    info: PluginInfo,
    leave_socket: bool,
) -> anyhow::Result<Running> {
    let registrar = Registrar::new(info);
    let token = CancellationToken::new();
    let shutdown = token.clone().cancelled_owned();
    let created = Instant::now();
    let task = match style {
        Style::Registrar => {
            let bound = plugreg_transport::bind(path)
                .with_context(|| format!("binding {}", path.display()))?;
            let (listener, guard) = bound.into_parts();
            if leave_socket {
                // The guard only removes the socket file when dropped; a killed plugin never
                // gets to run it. Forgetting it leaks its path, nothing else.
                std::mem::forget(guard);
                let r = registrar.clone();
                tokio::spawn(async move { plugin::serve_listener(&r, listener, shutdown).await })
            } else {
                let r = registrar.clone();
                tokio::spawn(async move {
                    let served = plugin::serve_listener(&r, listener, shutdown).await;
                    drop(guard);
                    served
                })
            }
        }
        Style::BindThenListen { gap } if gap.is_zero() => {
            let listener = plugin::bind_then_listen(path, gap)?;
            let r = registrar.clone();
            tokio::spawn(async move { plugin::serve_listener(&r, listener, shutdown).await })
        }
        Style::BindThenListen { gap } => {
            let bound = plugreg_testpeers::goplugin::bind_only(path)
                .with_context(|| format!("binding {}", path.display()))?;
            let r = registrar.clone();
            tokio::spawn(async move {
                // Not a blocking sleep: other cycles share this thread.
                tokio::time::sleep(gap).await;
                let listener = bound.listen().context("listening")?;
                plugin::serve_listener(&r, listener, shutdown).await
            })
        }
    };
    // The bind is synchronous above: the socket is in place once `start` gets here.
    let bound = Instant::now();
    Ok(Running {
        path: path.to_owned(),
        registrar,
        created,
        bound,
        token,
        task,
    })
}

/// What the cycles saw.
#[derive(Debug, Default)]
struct Tally {
    /// Socket created -> Notify(true), registrar plugins.
    registrar_latency: Vec<Duration>,
    /// Socket created -> Notify(true), bind-then-listen plugins.
    go_latency: Vec<Duration>,
    /// Plugins not told they are registered within the limit.
    not_registered: u64,
    /// Cycles that failed on the plugin side (binding, serving).
    errors: Vec<String>,
}

struct Ctx {
    dir: PathBuf,
    register_timeout: Duration,
    max_leftovers: usize,
    leftovers: Mutex<VecDeque<PathBuf>>,
    max_staying: usize,
    staying: Mutex<VecDeque<Running>>,
    tally: Mutex<Tally>,
    next: AtomicUsize,
    done: AtomicUsize,
    cycles: usize,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Ctx {
    async fn worker(self: Arc<Self>, worker: usize) {
        let mut k = 0usize;
        loop {
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            if n >= self.cycles {
                return;
            }
            // Each worker re-uses two paths, so sockets are re-created where others just went.
            let path = self.dir.join(format!("w{worker}-{}.sock", k % 2));
            k += 1;
            if let Err(e) = self.cycle(n, &path).await {
                let mut t = lock(&self.tally);
                if t.errors.len() < 20 {
                    t.errors.push(format!("cycle {n}: {e:#}"));
                }
            }
            self.done.fetch_add(1, Ordering::Relaxed);
        }
    }

    async fn cycle(&self, n: usize, path: &Path) -> anyhow::Result<()> {
        let kind = Kind::of(n);
        let info = soak_info(n);
        match kind {
            Kind::RegistrarGone => {
                drop(plugreg_transport::bind(path)?);
                return Ok(());
            }
            Kind::GoNeverListened => {
                let bound = plugreg_testpeers::goplugin::bind_only(path)?;
                tokio::task::yield_now().await;
                std::fs::remove_file(path)?;
                drop(bound);
                return Ok(());
            }
            _ => {}
        }
        let style = kind.style().context("a kind with a plugin")?;
        let path = match kind {
            Kind::GoDies | Kind::RegistrarDies => self.dir.join(format!("dead-{n}.sock")),
            Kind::Stays(_) => self.dir.join(format!("live-{n}.sock")),
            _ => path.to_owned(),
        };
        let leave = matches!(kind, Kind::GoDies | Kind::RegistrarDies);
        let running = start(style, &path, info, leave)?;
        let took = running.registered(self.register_timeout).await;
        {
            let mut t = lock(&self.tally);
            match (took, style) {
                (Some(d), Style::Registrar) => t.registrar_latency.push(d),
                (Some(d), Style::BindThenListen { .. }) => t.go_latency.push(d),
                (None, _) => t.not_registered += 1,
            }
        }
        match kind {
            Kind::Stays(_) => {
                let oldest = {
                    let mut staying = lock(&self.staying);
                    staying.push_back(running);
                    if staying.len() > self.max_staying {
                        staying.pop_front()
                    } else {
                        None
                    }
                };
                if let Some(old) = oldest {
                    let path = old.path.clone();
                    old.stop().await?;
                    let _ = std::fs::remove_file(&path);
                }
            }
            Kind::GoDies | Kind::RegistrarDies => {
                running.stop().await?;
                let oldest = {
                    let mut l = lock(&self.leftovers);
                    l.push_back(path);
                    if l.len() > self.max_leftovers {
                        l.pop_front()
                    } else {
                        None
                    }
                };
                if let Some(old) = oldest {
                    std::fs::remove_file(&old)
                        .with_context(|| format!("removing {}", old.display()))?;
                }
            }
            Kind::Go(_) => {
                std::fs::remove_file(&running.path)?;
                running.stop().await?;
            }
            _ => running.stop().await?,
        }
        Ok(())
    }
}

fn soak_info(n: usize) -> PluginInfo {
    PluginInfo {
        name: format!("example.com/soak-{n}"),
        ..handler::plugin_info(n)
    }
}

/// The `plugreg manager` daemon under soak.
struct Daemon {
    child: Child,
    http: SocketAddr,
}

impl Daemon {
    fn spawn(bin: &Path, dir: &Path, log: &Path, args: &SoakArgs) -> anyhow::Result<Self> {
        let http = burst::free_local_port()?;
        let log_file = File::create(log)?;
        let child = Command::new(bin)
            .arg("manager")
            .arg("--registry-dir")
            .arg(dir)
            .args(["--plugin-types", crate::handler::PLUGIN_TYPE])
            .arg("--http-endpoint")
            .arg(http.to_string())
            .arg("--liveness-interval")
            .arg(humantime::format_duration(args.liveness_interval).to_string())
            .arg("--liveness-failures")
            .arg(args.liveness_failures.to_string())
            .args(&args.daemon_args)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut daemon = Self { child, http };
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

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    fn get(&self, path: &str) -> anyhow::Result<String> {
        let (code, body) = http::get(self.http, path, Duration::from_secs(30))?;
        anyhow::ensure!(code == 200, "{path} answered {code}");
        Ok(body)
    }

    /// Sockets the daemon has registered, and those it knows in any state.
    fn plugins(&self) -> anyhow::Result<Known> {
        let body = self.get("/plugins")?;
        let records: Vec<serde_json::Value> =
            serde_json::from_str(&body).context("parsing /plugins")?;
        let mut known = Known::default();
        for r in records {
            let socket = PathBuf::from(r["socket"].as_str().unwrap_or_default());
            if r["state"] == "registered" {
                known.registered.insert(socket.clone());
            }
            known.all.insert(socket);
        }
        Ok(known)
    }

    fn stop(mut self) -> anyhow::Result<()> {
        rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::TERM,
        )
        .context("signalling the daemon")?;
        let status = burst::wait_or_kill(&mut self.child, Duration::from_secs(20))?;
        anyhow::ensure!(status.success(), "the daemon exited with {status}");
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[derive(Debug, Default)]
struct Known {
    registered: BTreeSet<PathBuf>,
    all: BTreeSet<PathBuf>,
}

/// The end state, compared with what is alive.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct EndState {
    /// Live plugins at the end.
    pub live: usize,
    /// Leftover sockets of dead plugins still present at the end.
    pub dead_leftovers: usize,
    /// Live plugins whose socket the daemon has not registered.
    pub present_but_unregistered: Vec<PathBuf>,
    /// Sockets the daemon has registered without a live plugin behind them (deleted sockets and
    /// dead plugins' leftovers).
    pub registered_but_gone: Vec<PathBuf>,
    /// Of those, leftovers of dead plugins.
    pub dead_still_registered: usize,
    /// Sockets the daemon still lists (in any state) although their file is gone.
    pub listed_without_file: Vec<PathBuf>,
    /// Seconds from the last cycle until the daemon's view matched (or the limit).
    pub converged_s: f64,
    /// Whether it matched within the limit.
    pub converged: bool,
}

impl EndState {
    fn holds(&self) -> bool {
        self.converged
            && self.present_but_unregistered.is_empty()
            && self.registered_but_gone.is_empty()
    }
}

/// Everything the soak measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SoakResult {
    /// Cycles run.
    pub cycles: usize,
    /// Cycles at once.
    pub concurrency: usize,
    /// File system of the registry directory.
    pub fs: String,
    /// Seconds the cycles took.
    pub churn_s: f64,
    /// Cycles per second.
    pub cycles_per_s: f64,
    /// Daemon RSS after the first `baseline_after` cycles, KiB.
    pub rss_baseline_kib: u64,
    /// Cycles done when the baseline was read.
    pub baseline_after: usize,
    /// Daemon RSS after each further 10 % of the cycles, (cycles done, KiB).
    pub rss_samples: Vec<(usize, u64)>,
    /// Daemon RSS at the end (after the final check), KiB.
    pub rss_end_kib: u64,
    /// The baseline, each sample and the end split into (cycles done, anonymous KiB,
    /// file-backed KiB); the end's cycles are the total.
    pub rss_parts: Vec<(usize, u64, u64)>,
    /// Daemon VmHWM at the end, KiB.
    pub hwm_end_kib: u64,
    /// Daemon CPU seconds over the whole soak.
    pub daemon_cpu_s: f64,
    /// The end state.
    pub end: EndState,
    /// After every plugin was stopped and every socket removed: sockets still registered.
    pub registered_after_cleanup: Option<usize>,
    /// Registration latency of registrar plugins: p50, p99, max (ms).
    pub registrar_ms: Option<[f64; 3]>,
    /// Registration latency of bind-then-listen plugins: p50, p99, max (ms).
    pub go_ms: Option<[f64; 3]>,
    /// Plugins not told they were registered within the per-cycle limit.
    pub not_registered: u64,
    /// Plugin-side errors (the first few).
    pub errors: Vec<String>,
    /// The daemon's counters at the end.
    pub registrations_total: Option<u64>,
    /// Deregistrations counted by the daemon.
    pub deregistrations_total: Option<u64>,
    /// Dead plugins found by the daemon's probes.
    pub dead_plugins_total: Option<u64>,
    /// Failed registration attempts by step.
    pub failed_attempts: Vec<(String, u64)>,
    /// WARN and ERROR lines in the daemon's log.
    pub log_warnings: u64,
    /// Size of the daemon's log, bytes.
    pub log_bytes: u64,
    /// Probe settings given to the daemon.
    pub liveness: String,
    /// Leftover sockets of dead plugins kept at once.
    pub leftovers: usize,
    /// Plugins started after the last cycle.
    pub final_live: usize,
    /// Plugins of the every-1,000th cycles kept alive at once.
    pub staying: usize,
}

impl SoakResult {
    /// The highest RSS read after the baseline: every sample and the end.
    pub fn rss_max_kib(&self) -> u64 {
        self.rss_samples
            .iter()
            .map(|(_, k)| *k)
            .chain([self.rss_end_kib])
            .max()
            .unwrap_or(self.rss_end_kib)
    }

    /// RSS flat within 5 % of the baseline from there to the end: every sample and the end
    /// (issue 17, finding 12).
    pub fn rss_ok(&self) -> bool {
        self.rss_max_kib() as f64 <= self.rss_baseline_kib as f64 * 1.05
    }
}

/// Runs the soak; writes its block into `--out`; fails when the end state does not hold.
pub fn main(args: SoakArgs) -> anyhow::Result<()> {
    let bin = crate::daemon_bin(args.manager_bin.as_deref())?;
    anyhow::ensure!(
        bin.is_file(),
        "no daemon binary at {} (cargo build --release -p plugreg)",
        bin.display()
    );
    procfs::raise_nofile(args.concurrency as u64 * 4 + args.final_live as u64 + 4096)
        .context("raising the open-file limit")?;
    let parent = args.work_dir.clone().unwrap_or_else(std::env::temp_dir);
    let tmp = tempfile::Builder::new()
        .prefix("plugreg-soak-")
        .tempdir_in(&parent)
        .with_context(|| format!("creating a directory in {}", parent.display()))?;
    let dir = tmp.path().join("registry");
    std::fs::create_dir(&dir)?;
    let log = tmp.path().join("manager.log");
    let date = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let started = Instant::now();

    let daemon = Daemon::spawn(&bin, &dir, &log, &args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("soak")
        .enable_all()
        .build()?;
    let result = rt.block_on(soak(&daemon, &dir, &args));
    let stopped = daemon.stop();
    let mut result = result?;
    stopped.context("stopping the daemon")?;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    result.log_warnings = burst::warnings(&text);
    result.log_bytes = text.len() as u64;
    let total = started.elapsed();

    eprintln!(
        "soak: {} cycles in {:.1} s ({:.0}/s); RSS {} KiB after {} cycles, {} KiB at the end; \
         end state {:?}; registered after cleanup {:?}",
        result.cycles,
        result.churn_s,
        result.cycles_per_s,
        result.rss_baseline_kib,
        result.baseline_after,
        result.rss_end_kib,
        result.end,
        result.registered_after_cleanup
    );
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    }
    if let Some(out) = &args.out {
        let existing = match std::fs::read_to_string(out) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e).with_context(|| format!("reading {}", out.display())),
        };
        let section = markdown(&result, &date, total);
        std::fs::write(
            out,
            crate::report::splice_between(&existing, &section, START, END),
        )
        .with_context(|| format!("writing {}", out.display()))?;
        eprintln!("wrote {}", out.display());
    }
    if !result.end.holds() {
        let e = &result.end;
        bail!(
            "the end state does not hold: {} present but unregistered, {} registered but gone \
             ({} of them dead plugins' leftovers){}; first ones: {:?}",
            e.present_but_unregistered.len(),
            e.registered_but_gone.len(),
            e.dead_still_registered,
            if e.converged { "" } else { ", not converged" },
            e.present_but_unregistered
                .iter()
                .chain(&e.registered_but_gone)
                .take(5)
                .collect::<Vec<_>>()
        );
    }
    // Every registration ends in exactly one deregistration once everything is gone: the
    // counters must agree (a registration whose socket vanished before its outcome was handled
    // once went uncounted).
    if result.registrations_total != result.deregistrations_total {
        bail!(
            "after the clean-up the manager counted {:?} registrations but {:?} deregistrations",
            result.registrations_total,
            result.deregistrations_total
        );
    }
    if result.registered_after_cleanup != Some(0) {
        bail!(
            "after every plugin stopped and every socket was removed, {:?} sockets were still \
             registered",
            result.registered_after_cleanup
        );
    }
    Ok(())
}

async fn soak(daemon: &Daemon, dir: &Path, args: &SoakArgs) -> anyhow::Result<SoakResult> {
    let pid = daemon.pid();
    let cpu_before = procfs::cpu_time(&pid)?;
    let ctx = Arc::new(Ctx {
        dir: dir.to_owned(),
        register_timeout: args.register_timeout,
        max_leftovers: args.leftovers.max(1),
        leftovers: Mutex::new(VecDeque::new()),
        max_staying: args.staying,
        staying: Mutex::new(VecDeque::new()),
        tally: Mutex::new(Tally::default()),
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        cycles: args.cycles,
    });

    // The plugins that stay alive are there from the start, so that the live population is the
    // same throughout and the RSS baseline is read under the load the end is: the churn's
    // every-1,000th plugin then replaces the oldest of them.
    for i in 0..args.staying {
        let n = args.cycles + args.final_live + i;
        let style = if i.is_multiple_of(2) {
            Style::Registrar
        } else {
            Style::BindThenListen {
                gap: Duration::ZERO,
            }
        };
        let path = dir.join(format!("live-pre-{i}.sock"));
        let running = start(style, &path, soak_info(n), false)?;
        running
            .registered(args.register_timeout)
            .await
            .with_context(|| format!("{} did not register before the churn", path.display()))?;
        lock(&ctx.staying).push_back(running);
    }

    let churn_start = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..args.concurrency.max(1) {
        workers.spawn(ctx.clone().worker(w));
    }
    // Read the daemon's RSS after the baseline and after each further tenth of the cycles.
    let step = (args.cycles / 10).max(1);
    let mut next_sample = args.baseline_after.min(args.cycles);
    let mut rss_baseline = None;
    let mut rss_samples = Vec::new();
    let mut rss_parts = Vec::new();
    let mut poll = tokio::time::interval(Duration::from_millis(20));
    while !workers.is_empty() {
        tokio::select! {
            r = workers.join_next() => {
                if let Some(r) = r {
                    r.context("soak worker")?;
                }
            }
            _ = poll.tick() => {}
        }
        let done = ctx.done.load(Ordering::Relaxed);
        if done >= next_sample && done < args.cycles {
            let m = procfs::memory(&pid)?;
            let rss = m.rss_kib;
            rss_parts.push((done, m.anon_kib, m.file_kib));
            if rss_baseline.is_none() {
                rss_baseline = Some((done, rss));
            } else {
                rss_samples.push((done, rss));
            }
            next_sample = done + step;
        }
    }
    let churn = churn_start.elapsed();

    // Plugins that stay alive through the final check, half of each style.
    let mut live: Vec<Running> = std::mem::take(&mut *lock(&ctx.staying)).into();
    for i in 0..args.final_live {
        let style = if i.is_multiple_of(2) {
            Style::Registrar
        } else {
            Style::BindThenListen {
                gap: Duration::ZERO,
            }
        };
        let path = dir.join(format!("final-{i}.sock"));
        live.push(start(style, &path, soak_info(args.cycles + i), false)?);
    }
    let leftovers: Vec<PathBuf> = lock(&ctx.leftovers).iter().cloned().collect();
    let end = converge(daemon, &live, &leftovers, args.settle_timeout).await?;
    let memory = procfs::memory(&pid)?;
    rss_parts.push((args.cycles, memory.anon_kib, memory.file_kib));
    let rss_baseline = rss_baseline.unwrap_or((ctx.done.load(Ordering::Relaxed), 0));

    // Clean up: every plugin stops, every socket goes; nothing may stay registered.
    for r in live {
        let path = r.path.clone();
        r.stop().await?;
        let _ = std::fs::remove_file(&path);
    }
    for l in &leftovers {
        let _ = std::fs::remove_file(l);
    }
    let registered_after_cleanup = wait_until(args.settle_timeout, || {
        Ok(daemon.plugins()?.registered.is_empty())
    })
    .await?
    .then_some(0)
    .or_else(|| daemon.plugins().ok().map(|k| k.registered.len()));

    let metrics = daemon.get("/metrics").unwrap_or_default();
    let counter = |name| burst::metric(&metrics, name).map(|v| v as u64);
    let tally = std::mem::take(&mut *lock(&ctx.tally));
    let figures = |v: &[Duration]| {
        Summary::of(v).map(|s| [s.p50, s.p99, s.max].map(|d| (d.as_secs_f64() * 1e6).round() / 1e3))
    };
    Ok(SoakResult {
        cycles: args.cycles,
        concurrency: args.concurrency,
        fs: procfs::fs_type(dir),
        churn_s: churn.as_secs_f64(),
        cycles_per_s: args.cycles as f64 / churn.as_secs_f64().max(1e-9),
        rss_baseline_kib: rss_baseline.1,
        baseline_after: rss_baseline.0,
        rss_samples,
        rss_end_kib: memory.rss_kib,
        rss_parts,
        hwm_end_kib: memory.hwm_kib,
        daemon_cpu_s: (procfs::cpu_time(&pid)? - cpu_before).as_secs_f64(),
        end,
        registered_after_cleanup,
        registrar_ms: figures(&tally.registrar_latency),
        go_ms: figures(&tally.go_latency),
        not_registered: tally.not_registered,
        errors: tally.errors,
        registrations_total: counter("plugreg_registrations_total"),
        deregistrations_total: counter("plugreg_deregistrations_total"),
        dead_plugins_total: counter("plugreg_dead_plugins_total"),
        failed_attempts: burst::failures_by_step(&metrics),
        log_warnings: 0,
        log_bytes: 0,
        liveness: format!(
            "--liveness-interval {} --liveness-failures {}",
            humantime::format_duration(args.liveness_interval),
            args.liveness_failures
        ),
        leftovers: args.leftovers,
        staying: args.staying,
        final_live: args.final_live,
    })
}

/// Polls the daemon until its registrations are exactly the live plugins (or `limit`), then
/// describes the end state.
async fn converge(
    daemon: &Daemon,
    live: &[Running],
    leftovers: &[PathBuf],
    limit: Duration,
) -> anyhow::Result<EndState> {
    let start = Instant::now();
    let expected: BTreeSet<PathBuf> = live.iter().map(|r| r.path.clone()).collect();
    let converged = wait_until(limit, || Ok(daemon.plugins()?.registered == expected)).await?;
    let converged_s = start.elapsed().as_secs_f64();
    let known = daemon.plugins()?;
    let leftovers: BTreeSet<&PathBuf> = leftovers.iter().collect();
    Ok(EndState {
        live: expected.len(),
        dead_leftovers: leftovers.len(),
        present_but_unregistered: expected.difference(&known.registered).cloned().collect(),
        registered_but_gone: known.registered.difference(&expected).cloned().collect(),
        dead_still_registered: known
            .registered
            .iter()
            .filter(|p| leftovers.contains(p))
            .count(),
        listed_without_file: known
            .all
            .iter()
            .filter(|p| std::fs::symlink_metadata(p).is_err())
            .cloned()
            .collect(),
        converged_s,
        converged,
    })
}

/// Polls `check` every 50 ms until it holds or `limit` passes; whether it held.
async fn wait_until(
    limit: Duration,
    mut check: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<bool> {
    let deadline = Instant::now() + limit;
    loop {
        // The HTTP client blocks and `check` borrows the daemon, so spawn_blocking (which needs
        // 'static) does not fit; the soak's plugins are all idle by now.
        #[allow(clippy::disallowed_methods)]
        let held = tokio::task::block_in_place(&mut check)?;
        if held {
            return Ok(true);
        }
        if Instant::now() > deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn markdown(r: &SoakResult, date: &str, total: Duration) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let verdict = |ok: bool| if ok { "met" } else { "**missed**" };
    let kib = |k: u64| format!("{:.1} MiB", k as f64 / 1024.0);
    let paths = |v: &[PathBuf]| {
        if v.is_empty() {
            "0".to_owned()
        } else {
            let names: Vec<String> = v
                .iter()
                .take(5)
                .map(|p| {
                    p.file_name()
                        .map_or(p.display().to_string(), |n| n.to_string_lossy().into())
                })
                .collect();
            format!(
                "{} ({}{})",
                v.len(),
                names.join(", "),
                if v.len() > 5 { ", ..." } else { "" }
            )
        }
    };
    let lat = |v: Option<[f64; 3]>| {
        v.map_or("-".into(), |[p50, p99, max]| {
            format!("p50 {p50:.3} ms, p99 {p99:.3} ms, max {max:.3} ms")
        })
    };
    let _ = writeln!(o, "{START}");
    let _ = writeln!(o, "## Plugin manager: churn soak (issue 8, finding 7)\n");
    let _ = writeln!(
        o,
        "Written by `plugreg-bench soak` (crates/bench/src/soak.rs), which the full benchmark \
         runs last; on its own:\n\n    \
         cargo build --release -p plugreg -p plugreg-bench\n    \
         target/release/plugreg-bench soak --out BENCHMARKS.md\n"
    );
    let _ = writeln!(
        o,
        "The real daemon (`plugreg manager`, `{}`, every other flag its default) watches a fresh \
         registry directory on {}. The soak process runs {} socket create/delete cycles, {} at \
         once, each worker re-using two socket paths: 30 % plugreg registrar plugins (wait for \
         Notify(true), stop, socket removed), 30 % bind-then-listen plugins (gap 0 twice, 1 ms \
         once; wait for Notify(true), delete the socket, stop), 10 % registrar sockets deleted \
         the moment they appear, 10 % bind-then-listen sockets deleted before they ever \
         listen, 20 % plugins (both kinds) that die after Notify(true) and leave their socket \
         behind, refusing connections (the newest {} such leftovers stay; older ones are \
         deleted); {} plugins that stay alive are started before the first cycle, and every \
         1,000th cycle starts another that replaces the oldest (which stops, its socket gone), \
         so the plugins alive are as many at the RSS baseline as at the end; {} more are \
         started after the last cycle. The probe settings are short so that the daemon's dead-plugin \
         detection (D5) acts within the soak. **End state**: every live plugin's socket is \
         registered (no *present but unregistered*), and every registered socket has a live \
         plugin (no *registered but gone*: neither a deleted socket nor a dead plugin's \
         leftover); polled on `/plugins` until it holds, for at most 30 s. Then every plugin \
         stops and every socket is removed, and nothing may stay registered.\n",
        r.liveness, r.fs, r.cycles, r.concurrency, r.leftovers, r.staying, r.final_live
    );
    let _ = writeln!(o, "| | |\n|---|---|");
    let _ = writeln!(o, "| date | {date} |");
    let _ = writeln!(o, "| commit | {} |", crate::commit());
    let _ = writeln!(
        o,
        "| wall time of the whole soak | {:.0} s |",
        total.as_secs_f64()
    );
    let _ = writeln!(
        o,
        "| cycles | {} in {:.1} s: **{:.0} cycles/s** |",
        r.cycles, r.churn_s, r.cycles_per_s
    );
    let _ = writeln!(o, "| daemon CPU | {:.1} s |", r.daemon_cpu_s);
    let _ = writeln!(
        o,
        "| registration, registrar plugins | {} |",
        lat(r.registrar_ms)
    );
    let _ = writeln!(
        o,
        "| registration, bind-then-listen plugins | {} |",
        lat(r.go_ms)
    );
    let _ = writeln!(
        o,
        "| plugins not told Notify(true) within 10 s | {} |",
        r.not_registered
    );
    let _ = writeln!(
        o,
        "| daemon counters | {} registrations, {} deregistrations, {} dead plugins found; failed \
         attempts: {} |",
        r.registrations_total.map_or("-".into(), |n| n.to_string()),
        r.deregistrations_total
            .map_or("-".into(), |n| n.to_string()),
        r.dead_plugins_total.map_or("-".into(), |n| n.to_string()),
        if r.failed_attempts.is_empty() {
            "0".to_owned()
        } else {
            r.failed_attempts
                .iter()
                .map(|(s, n)| format!("{s}: {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    let _ = writeln!(
        o,
        "| daemon log | {:.1} MiB, {} WARN/ERROR lines |",
        r.log_bytes as f64 / (1024.0 * 1024.0),
        r.log_warnings
    );
    let _ = writeln!(
        o,
        "| plugin-side errors | {} |",
        if r.errors.is_empty() {
            "none".to_owned()
        } else {
            r.errors.join("; ")
        }
    );
    o.push('\n');
    let _ = writeln!(o, "| goal | measured | verdict |\n|---|---|---|");
    let _ = writeln!(
        o,
        "| zero registered-but-gone sockets at the end | {} (of them dead plugins' leftovers: \
         {}; {} leftovers present) | {} |",
        paths(&r.end.registered_but_gone),
        r.end.dead_still_registered,
        r.end.dead_leftovers,
        verdict(r.end.converged && r.end.registered_but_gone.is_empty())
    );
    let _ = writeln!(
        o,
        "| zero present-but-unregistered sockets at the end | {} (of {} live plugins) | {} |",
        paths(&r.end.present_but_unregistered),
        r.end.live,
        verdict(r.end.converged && r.end.present_but_unregistered.is_empty())
    );
    let _ = writeln!(
        o,
        "| daemon RSS flat within 5 % from {} cycles to the end: every later sample and the \
         end (issue 17, finding 12) | {} -> {} at the end ({:+.1} %), highest {} ({:+.1} %) | {} |",
        r.baseline_after,
        kib(r.rss_baseline_kib),
        kib(r.rss_end_kib),
        (r.rss_end_kib as f64 / r.rss_baseline_kib.max(1) as f64 - 1.0) * 100.0,
        kib(r.rss_max_kib()),
        (r.rss_max_kib() as f64 / r.rss_baseline_kib.max(1) as f64 - 1.0) * 100.0,
        verdict(r.rss_ok())
    );
    o.push('\n');
    let _ = writeln!(
        o,
        "The daemon's view matched the live plugins {:.1} s after the last cycle{}; it still \
         listed {} sockets whose file was gone; after the clean-up {} sockets stayed \
         registered. Daemon RSS during the churn (cycles done: RSS): {}; VmHWM at the end {}. \
         The same split into anonymous memory (heap, stacks) + file-backed pages (the \
         executable's code, faulted in as more of it runs): {}.\n",
        r.end.converged_s,
        if r.end.converged {
            ""
        } else {
            " (**never**: the limit ran out)"
        },
        r.end.listed_without_file.len(),
        r.registered_after_cleanup
            .map_or("(unknown)".into(), |n| n.to_string()),
        std::iter::once((r.baseline_after, r.rss_baseline_kib))
            .chain(r.rss_samples.iter().copied())
            .map(|(n, k)| format!("{n}: {}", kib(k)))
            .collect::<Vec<_>>()
            .join(", "),
        kib(r.hwm_end_kib),
        r.rss_parts
            .iter()
            .map(|(n, a, f)| format!("{n}: {} + {}", kib(*a), kib(*f)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(o, "{END}");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_cycle_comes_round() {
        let kinds: Vec<Kind> = (0..1000).map(Kind::of).collect();
        let count = |f: fn(&Kind) -> bool| kinds.iter().filter(|k| f(k)).count();
        assert_eq!(count(|k| *k == Kind::Registrar), 300);
        assert_eq!(count(|k| matches!(k, Kind::Go(_))), 300);
        assert_eq!(count(|k| *k == Kind::RegistrarGone), 100);
        assert_eq!(count(|k| *k == Kind::GoNeverListened), 100);
        assert_eq!(count(|k| *k == Kind::GoDies), 100);
        assert_eq!(count(|k| *k == Kind::RegistrarDies), 99);
        assert_eq!(count(|k| matches!(k, Kind::Stays(_))), 1);
    }

    #[test]
    fn the_section_judges_the_end_state_and_the_memory() {
        let r = SoakResult {
            cycles: 100,
            rss_baseline_kib: 10_000,
            rss_end_kib: 12_000,
            rss_parts: vec![(10_000, 4_000, 7_000), (100_000, 4_500, 7_500)],
            end: EndState {
                live: 2,
                registered_but_gone: vec![PathBuf::from("/r/dead-8.sock")],
                dead_still_registered: 1,
                converged: false,
                ..Default::default()
            },
            ..Default::default()
        };
        let md = markdown(&r, "now", Duration::from_secs(1));
        assert!(md.starts_with(START) && md.trim_end().ends_with(END));
        assert!(
            md.contains("| 1 (dead-8.sock) (of them dead plugins' leftovers: 1; 0 leftovers present) | **missed** |"),
            "{md}"
        );
        assert!(md.contains("(+20.0 %) | **missed** |"), "{md}");
        assert!(
            md.contains("| 0 (of 2 live plugins) | **missed** |"),
            "{md}"
        );
    }
}
