//! The life of a controller sidecar's process once its flags are checked, as every controller
//! sidecar walks it: one runtime thread ([`block_on`]; [`block_on_multi_thread`] for the
//! provisioner), the signal handlers installed first ([`Lifecycle::install`]), the driver
//! connection watched ([`Lifecycle::connect`]), the sidecar's own start-up steps raced against
//! that connection's loss and a signal ([`Lifecycle::start`]), the heap trimmed from then on,
//! and the run until it ends, a signal or the connection's loss ([`Lifecycle::run`]), with the
//! sidecar's upstream way of stopping ([`Stop`]).
//!
//! The sidecar keeps its own start-up order and log texts: it writes them in the future it
//! hands to [`Lifecycle::start`]. The lines logged here (`Shutting down`, `Stopped leading`,
//! the connection loss) are the same in every sidecar.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use plugreg_runtime::signal::{Received, Signals};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::driver::{self, ConnectionLost, CsiError};
use crate::service::ServiceError;

/// How often the heap's freed pages go back to the kernel once started: RSS follows the live
/// heap, not the highest peak of work so far (a crowd of objects, the first LIST of a cache).
const TRIM_PERIOD: Duration = Duration::from_secs(10);

/// The exit code of a process that panicked while its runtime ran: 2, a Go program's on an
/// unrecovered panic.
pub const PANIC_EXIT: i32 = 2;

/// Whether a panic now ends the process: while [`block_on`]'s future runs.
static FAIL_FAST: AtomicBool = AtomicBool::new(false);

/// Armed while a sidecar's runtime runs its future: a panic on any thread ends the process.
struct FailFast;

impl FailFast {
    /// Installs the panic hook (once: it stays for the process's life and only acts while
    /// armed) and arms it.
    ///
    /// Tokio catches a panicking task and goes on without it. In a controller that is a worker
    /// gone and its key left in the queue's processing set, never synced again: an operation
    /// lost until the process restarts. client-go's controllers crash the process instead (an
    /// unrecovered panic in any goroutine ends a Go program, exit 2), so Kubernetes restarts
    /// the container and the new process lists everything afresh. The hook does the same
    /// after the default hook has printed the panic. A panic after the future has returned
    /// (the runtime's teardown) is left to the default hook alone: the exit code is then the
    /// run's own.
    fn arm() -> Self {
        static HOOK: Once = Once::new();
        HOOK.call_once(|| {
            let default = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                default(info);
                if FAIL_FAST.load(Ordering::SeqCst) {
                    // A crash, not a shutdown: the state the panic left is not to be drained
                    // (no drain, no Lease release: it expires, as a crashed Go sidecar's). A
                    // controller sidecar owns no socket file that would stay behind.
                    #[allow(clippy::disallowed_methods)]
                    std::process::exit(PANIC_EXIT);
                }
            }));
        });
        FAIL_FAST.store(true, Ordering::SeqCst);
        Self
    }
}

impl Drop for FailFast {
    fn drop(&mut self) {
        FAIL_FAST.store(false, Ordering::SeqCst);
    }
}

/// Runs `future` on a one-thread runtime and returns its output. One thread: a controller
/// sidecar's work waits on the API server's token bucket and the driver, never on the CPU,
/// and one thread keeps one malloc arena (several grow apart after a crowd). A panic while
/// it runs, on any thread, ends the process with [`PANIC_EXIT`], as it would a Go sidecar.
pub fn block_on<F: Future>(future: F) -> std::io::Result<F::Output> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let _armed = FailFast::arm();
    Ok(runtime.block_on(future))
}

/// [`block_on`] on a multi-thread runtime (a worker thread per CPU, Tokio's default), for a
/// sidecar whose throughput and timings were measured on one and not yet on one thread: the
/// provisioner (a hundred claim and a hundred volume workers by default, its benchmarks).
pub fn block_on_multi_thread<F: Future>(future: F) -> std::io::Result<F::Output> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let _armed = FailFast::arm();
    Ok(runtime.block_on(future))
}

/// What a SIGTERM or SIGINT during the run does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnSignal {
    /// Log `Shutting down` (with the signal), end the work, wait for it up to `grace`, exit 0
    /// (the election releases the Lease if it was told to).
    Drain {
        /// How long the work may take to finish.
        grace: Duration,
    },
    /// The attacher's and snapshotter's way (their controllers run under client-go's
    /// `leaderelection.RunOrDie`): with leader election and without release on exit, log
    /// `Shutting down` and exit 1 at once (the Lease expires by itself); otherwise log
    /// "Received SIGTERM or SIGINT signal, shutting down controller.", end the work and wait
    /// for it up to `drain` (leading) or `grace`, then exit 1 with `Stopped leading` (leading)
    /// or 0.
    Controller {
        /// Whether leader election runs.
        leading: bool,
        /// `ReleaseLeaderElectionOnExit`.
        release_on_exit: bool,
        /// The wait without leader election.
        grace: Duration,
        /// The wait with leader election (the Lease's release included).
        drain: Duration,
        /// Whether a second signal during the wait exits 1 at once.
        second_signal_exits: bool,
    },
}

/// How a lost Lease is logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaderLostLine {
    /// `"Stopped leading" err="..."`.
    ErrField,
    /// `"Stopped leading: ..."`.
    InMessage,
}

/// How the run ends, as the sidecar's upstream ends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stop {
    /// A signal during the run.
    pub on_signal: OnSignal,
    /// The line of a lost Lease (exit 1).
    pub leader_lost: LeaderLostLine,
    /// The exit code of a run that failed otherwise (its error is logged).
    pub failed: i32,
}

/// The process's signals, its driver connection's loss and its trim task.
#[derive(Debug)]
pub struct Lifecycle {
    signals: Signals,
    lost: Option<ConnectionLost>,
    trim: Option<JoinHandle<()>>,
}

impl Lifecycle {
    /// Installs the SIGTERM and SIGINT handlers, first: a signal during start-up must not kill
    /// the process half-way. A failure is logged; `Err` holds the exit code, 1.
    pub fn install() -> Result<Self, i32> {
        match Signals::new() {
            Ok(signals) => Ok(Self {
                signals,
                lost: None,
                trim: None,
            }),
            Err(e) => {
                tracing::error!("installing signal handlers: {e}");
                Err(1)
            }
        }
    }

    /// Connects to the driver at `address` within [`driver::CONNECT_WINDOW`] and watches the
    /// connection from then on: its loss ends [`start`](Self::start) and
    /// [`run`](Self::run) with exit 1. The sidecar logs the error its own way.
    pub async fn connect(&mut self, address: &str) -> Result<Channel, CsiError> {
        let connected = driver::connect_watched(address, driver::CONNECT_WINDOW).await?;
        self.lost = Some(connected.lost);
        Ok(connected.channel)
    }

    /// Runs the sidecar's start-up steps, unless the driver connection is lost first (reported,
    /// exit 1) or a signal comes (`Shutting down`, exit 0); `Err` holds the exit code (the
    /// steps' own, after they logged why). Once started, the heap is trimmed every 10 s.
    pub async fn start<T>(
        &mut self,
        startup: impl Future<Output = Result<T, i32>>,
    ) -> Result<T, i32> {
        let lost = self.lost.clone();
        let started = tokio::select! {
            started = startup => started,
            code = exit_on_loss(lost) => Err(code),
            signal = self.signals.shutdown() => {
                shutting_down(signal);
                Err(0)
            }
        };
        if started.is_ok() {
            self.trim = Some(tokio::spawn(plugreg_runtime::memory::trim_every(
                TRIM_PERIOD,
            )));
        }
        started
    }

    /// Runs the work `run` (which ends when `shutdown` is cancelled) until it ends, a signal
    /// comes (see [`Stop::on_signal`]) or the driver connection is lost (exit 1); then stops
    /// the diagnostics server `http` and the trim task. Returns the exit code.
    pub async fn run<E: std::error::Error + 'static>(
        mut self,
        run: impl Future<Output = Result<(), ServiceError<E>>>,
        shutdown: CancellationToken,
        stop: Stop,
        http: Option<CancellationToken>,
    ) -> i32 {
        tokio::pin!(run);
        let lost = self.lost.take();
        let code = tokio::select! {
            result = &mut run => match result {
                Ok(()) => 0,
                Err(ServiceError::Leader(e)) => {
                    match stop.leader_lost {
                        LeaderLostLine::ErrField => tracing::error!(err = %e, "Stopped leading"),
                        LeaderLostLine::InMessage => tracing::error!("Stopped leading: {e}"),
                    }
                    1
                }
                Err(e) => {
                    tracing::error!("{e}");
                    stop.failed
                }
            },
            signal = self.signals.shutdown() => match stop.on_signal {
                OnSignal::Drain { grace } => {
                    shutting_down(signal);
                    shutdown.cancel();
                    let _ = tokio::time::timeout(grace, &mut run).await;
                    0
                }
                OnSignal::Controller { leading, release_on_exit, grace, drain, second_signal_exits } => {
                    if leading && !release_on_exit {
                        // Go's default: the process ends at once, the Lease expires by itself.
                        shutting_down(signal);
                        return 1;
                    }
                    tracing::info!("Received SIGTERM or SIGINT signal, shutting down controller.");
                    shutdown.cancel();
                    let wait = tokio::time::timeout(if leading { drain } else { grace }, &mut run);
                    if second_signal_exits {
                        tokio::select! {
                            _ = wait => {}
                            signal = self.signals.shutdown() => {
                                // As upstream: a second signal ends the process at once,
                                // without waiting for the workers or releasing the Lease.
                                tracing::info!(signal = signal.name(), "Received a second signal, exiting");
                                return 1;
                            }
                        }
                    } else {
                        let _ = wait.await;
                    }
                    if leading {
                        tracing::error!("Stopped leading");
                        1
                    } else {
                        0
                    }
                }
            },
            code = exit_on_loss(lost) => code,
        };
        if let Some(token) = http {
            token.cancel();
        }
        if let Some(trim) = self.trim.take() {
            trim.abort();
        }
        code
    }
}

/// The line of a signal that ends the process.
fn shutting_down(signal: Received) {
    tracing::info!(signal = signal.name(), "Shutting down");
}

/// [`driver::exit_on_connection_loss`], or never without a watched connection.
async fn exit_on_loss(lost: Option<ConnectionLost>) -> i32 {
    match lost {
        Some(lost) => driver::exit_on_connection_loss(lost).await,
        None => std::future::pending().await,
    }
}
