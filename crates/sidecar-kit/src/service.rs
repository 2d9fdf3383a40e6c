//! The Kubernetes side of a controller sidecar's run, after its start-up checks: the
//! rate-limited clients (one bucket, two priorities, [`ratelimit::clients`]), leader election
//! on a client and bucket of its own (renewing the Lease never waits behind the work; upstream
//! gives it its own clientset too), and the sidecar's controllers, run directly or only while
//! this process holds the Lease ([`run_elected`]).
//!
//! A sidecar's `Service` is its driver and controller settings beside a [`Kube`]; its `run`
//! hands [`Kube::run`] the closure that starts its controllers with the [`Clients`].

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::flags::ControllerFlags;
use crate::leader::{LeaderElection, LeaderError, LeaderHealth, run_elected};
use crate::metrics::Metrics;
use crate::ratelimit;
use crate::shared::{Hub, Watches};

/// What the run needs of Kubernetes, gathered by the binary's start-up. Cloned for each run
/// of a controller that restarts inside its process (`csi-sidecars`).
#[derive(Clone)]
pub struct Kube {
    /// The Kubernetes client configuration.
    pub config: kube::Config,
    /// `--kube-api-qps`.
    pub qps: f64,
    /// `--kube-api-burst`.
    pub burst: u32,
    /// Leader election, when `--leader-election`.
    pub leader: Option<LeaderElection>,
    /// Shared with `/healthz/leader-election`.
    pub health: LeaderHealth,
    /// The metrics (the token bucket's are registered here).
    pub metrics: Arc<Metrics>,
    /// The controller's name among several in one process (`csi-sidecars`): its bucket's
    /// request counter carries it as the label `controller`. `None` in a sidecar of its own.
    pub controller: Option<&'static str>,
    /// The client the election renews its Lease on, shared by the controllers of one process;
    /// `None`: a client of its own, at the work's QPS and burst, built by [`Kube::run`].
    pub leader_client: Option<kube::Client>,
    /// The watches the controllers of one process share (`csi-sidecars`); `None`: the
    /// controller's caches watch on their own, on the high-priority client.
    pub hub: Option<Arc<Hub>>,
    /// The connection the work's clients share: the process's, shared by its controllers
    /// (`csi-sidecars`); `None`: one of their own, made by [`Kube::transport`] or
    /// [`Kube::run`]. The leader election's client never shares it.
    pub transport: Option<ratelimit::Transport>,
}

/// The clients of the work, sharing one token bucket.
pub struct Clients {
    /// Object writes and reads: first in the bucket's line.
    pub high: kube::Client,
    /// Events and other bulk writes: after every waiting high-priority request.
    pub low: kube::Client,
    /// The bucket both share, for work that takes its tokens itself on a client without a
    /// limit ([`ratelimit::unlimited_client`], [`ratelimit::RateLimiter::acquire`]): the
    /// provisioner's in-flight record, which chooses each write's priority.
    pub limiter: Arc<ratelimit::RateLimiter>,
    /// Where the controller's caches get their events.
    pub watches: Watches,
}

/// How a run ended badly.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError<E: std::error::Error + 'static> {
    /// The clients could not be built.
    #[error("failed to build the Kubernetes clients: {0}")]
    Clients(#[from] ratelimit::Error),
    /// Leadership was lost (`Stopped leading`): upstream's sidecars exit 1.
    #[error("Stopped leading: {0}")]
    Leader(#[from] LeaderError),
    /// The controllers failed (their caches never filled).
    #[error(transparent)]
    Controller(E),
}

impl Kube {
    /// What the controller flags ask for: their rate limit and, with `--leader-election`, the
    /// election under the sidecar's upstream lock name `lock_name` (unsanitised: the Lease is
    /// named after it sanitised, the `LeaderElection` event's source after it as it is; see
    /// [`LeaderElection::from_flags`]), released on exit when `release_on_exit`, its status in
    /// `metrics`.
    pub fn from_flags(
        flags: &ControllerFlags,
        config: kube::Config,
        lock_name: &str,
        release_on_exit: bool,
        health: LeaderHealth,
        metrics: Arc<Metrics>,
    ) -> Self {
        let leader = flags.leader_election.then(|| {
            let mut le = LeaderElection::from_flags(flags, lock_name);
            le.release_on_cancel = release_on_exit;
            le.metrics = Some(metrics.clone());
            le
        });
        let (qps, burst) = flags.rate_limit();
        Self {
            config,
            qps,
            burst,
            leader,
            health,
            metrics,
            controller: None,
            leader_client: None,
            hub: None,
            transport: None,
        }
    }

    /// The connection of the work's clients: the one given, else one made now and kept for
    /// [`Kube::run`]. For a client the work builds itself beside [`Clients`] (the
    /// provisioner's record).
    pub fn transport(&mut self) -> Result<ratelimit::Transport, ratelimit::Error> {
        match &self.transport {
            Some(t) => Ok(t.clone()),
            None => {
                let t = ratelimit::Transport::new(self.config.clone())?;
                self.transport = Some(t.clone());
                Ok(t)
            }
        }
    }

    /// Builds the clients, then runs `work` with them until `shutdown` (Ok), until leadership
    /// is lost or until `work` fails (Err). `work` gets the token that ends it: `shutdown`,
    /// or with leader election the end of this process's leadership.
    pub async fn run<E, F, Fut>(
        mut self,
        shutdown: CancellationToken,
        work: F,
    ) -> Result<(), ServiceError<E>>
    where
        E: std::error::Error + 'static,
        F: FnOnce(Clients, CancellationToken) -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        let transport = self.transport()?;
        let (high, low, limiter) = ratelimit::clients_on(&transport, self.qps, self.burst)?;
        match self.controller {
            None => self.metrics.register("kube-requests", limiter.clone()),
            Some(c) => self.metrics.register(
                &format!("kube-requests/{c}"),
                Arc::new(ratelimit::ControllerRequests {
                    limiter: limiter.clone(),
                    controller: c.to_owned(),
                }),
            ),
        }
        let leader = match (self.leader, self.leader_client) {
            (Some(le), Some(client)) => Some((le, client)),
            (Some(le), None) => Some((
                le,
                ratelimit::own_client(self.config, self.qps, self.burst)?,
            )),
            (None, _) => None,
        };
        let watches = match self.hub {
            Some(hub) => Watches::shared(hub),
            None => Watches::own(high.clone()),
        };
        let clients = Clients {
            high,
            low,
            limiter,
            watches,
        };
        run_elected(leader, self.health, shutdown, |token| work(clients, token))
            .await?
            .map_err(ServiceError::Controller)
    }
}
