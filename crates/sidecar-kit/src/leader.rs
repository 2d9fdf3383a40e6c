//! Leader election on a `coordination.k8s.io/v1` Lease,
//! with client-go's algorithm as csi-lib-utils configures it:
//!
//! - The Lease's spec is the election record: `holderIdentity`, `leaseDurationSeconds` (whole
//!   seconds of the lease duration), `acquireTime`, `renewTime`, `leaseTransitions`.
//! - A lease is valid until `leaseDurationSeconds` after this process last *saw the record
//!   change*, by its own monotonic clock: the clocks of the holder and of the API server are
//!   never compared with ours.
//! - Acquiring: one attempt at once, then one every retry period (plus up to 1.2 times that of
//!   jitter, so that standbys do not move in step), until the lease is free or expired and our
//!   write wins. Every write carries the `resourceVersion` last read: a Conflict means another
//!   candidate won, and the attempt fails.
//! - Renewing: every retry period; a renewal that has not succeeded within the renew deadline
//!   (retried every retry period meanwhile) ends leadership: [`LeaderElection::run`] returns
//!   [`LeaderError::Lost`] ("Stopped leading"; the binary exits 1).
//! - `/healthz/leader-election` ([`LeaderHealth::check`]): failing only while this process
//!   believes it leads and has not renewed for longer than the lease duration + 20 s (a renew
//!   loop that hangs instead of giving up).
//!
//! On becoming leader it records the event `<identity> became leader` (Normal,
//! `LeaderElection`) on the Lease, from the component `<lock name>/<host name>` (both
//! unsanitised, as csi-lib-utils' recorder names it), and sets
//! `leader_election_master_status`.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::flags::ControllerFlags;
use crate::metrics::Metrics;

/// client-go's `JitterFactor`: the renew deadline must exceed the retry period times this, and
/// acquire attempts wait up to this many retry periods more.
pub const JITTER_FACTOR: f64 = 1.2;
/// How long past the lease duration a leader that fails to renew still counts as healthy
/// (csi-lib-utils' `DefaultHealthCheckTimeout`).
pub const HEALTH_TOLERANCE: Duration = Duration::from_secs(20);

/// csi-lib-utils' name rule: every character outside `[a-zA-Z0-9-]` becomes `-`, and an `X` is
/// appended when the result ends with `-` (a Lease name may not).
pub fn sanitize_name(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    if out.is_empty() || out.ends_with('-') {
        out.push('X');
    }
    out
}

/// csi-provisioner's lock name for the driver `driver`: the driver name with `/` replaced by
/// `-`, not sanitised (`example.com/hostpath.csi` -> `example.com-hostpath.csi`). It names the
/// `LeaderElection` event's source; the Lease is named [`lease_name`].
pub fn lock_name(driver: &str) -> String {
    driver.replace('/', "-")
}

/// csi-provisioner's Lease name for the driver `driver`: its [`lock_name`], sanitised
/// (`hostpath.csi.k8s.io` -> `hostpath-csi-k8s-io`).
pub fn lease_name(driver: &str) -> String {
    sanitize_name(&lock_name(driver))
}

/// The leader-election identity: the host name, sanitised like the Lease name.
pub fn leader_identity(hostname: &str) -> String {
    sanitize_name(hostname)
}

/// The Lease's namespace: `flag` (`--leader-election-namespace`), else `$POD_NAMESPACE`, else
/// the service account's namespace file, else `default` (csi-lib-utils' order).
pub fn namespace(flag: &str) -> String {
    if !flag.is_empty() {
        return flag.to_owned();
    }
    if let Ok(ns) = std::env::var("POD_NAMESPACE")
        && !ns.is_empty()
    {
        return ns;
    }
    read_small("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        .filter(|ns| !ns.is_empty())
        .unwrap_or_else(|| "default".to_owned())
}

/// This host's name (the kernel's, as Go's `os.Hostname`).
pub fn hostname() -> String {
    read_small("/proc/sys/kernel/hostname").unwrap_or_else(|| "localhost".to_owned())
}

/// The first line of a small file (at most 4 KiB read), trimmed.
fn read_small(path: &str) -> Option<String> {
    use std::io::Read as _;
    let mut buf = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(4096)
        .read_to_end(&mut buf)
        .ok()?;
    let text = String::from_utf8_lossy(&buf);
    Some(text.lines().next().unwrap_or_default().trim().to_owned())
}

/// Why [`LeaderElection::run`] ended badly.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// The configuration cannot work (client-go panics at start on these).
    #[error("invalid leader election configuration: {0}")]
    Invalid(String),
    /// The lease was not renewed within the renew deadline: another process may lead now.
    #[error("Stopped leading: failed to renew lease {namespace}/{name}: {reason}")]
    Lost {
        /// The Lease's namespace.
        namespace: String,
        /// The Lease's name.
        name: String,
        /// What the last attempt saw.
        reason: String,
    },
}

/// The settings of one election. The identity must differ between the candidates; the
/// namespace and name are the Lease's (shared by the candidates).
#[derive(Debug, Clone)]
pub struct LeaderElection {
    /// The Lease's namespace.
    pub namespace: String,
    /// The Lease's name (see [`lease_name`]).
    pub lease_name: String,
    /// This candidate's `holderIdentity` (upstream: the sanitised host name).
    pub identity: String,
    /// How long a lease holds without renewal (`leaseDurationSeconds`, in whole seconds).
    pub lease_duration: Duration,
    /// How long the leader keeps retrying a failed renewal before it gives up.
    pub renew_deadline: Duration,
    /// How often candidates try to acquire, and the leader renews.
    pub retry_period: Duration,
    /// Labels put on the Lease (on create and on every write; other labels are left alone).
    pub labels: BTreeMap<String, String>,
    /// Give the lease up when the work ends (`ReleaseLeaderElectionOnExit`): it is written with
    /// no holder and a one-second duration, so a standby takes over at its next attempt.
    pub release_on_cancel: bool,
    /// client-go's `Name`: the `name` label of `leader_election_master_status` and the lease
    /// named in the health check's error. csi-lib-utils leaves it empty, and so does
    /// [`LeaderElection::new`].
    pub name: String,
    /// Where `leader_election_master_status` goes.
    pub metrics: Option<Arc<Metrics>>,
    /// The `LeaderElection` event's source component. csi-lib-utils names it
    /// `<lock name>/<host name>`, both unsanitised
    /// (`external-attacher-leader-hostpath.csi.k8s.io/node-1`), while the Lease and the holder
    /// identity carry their sanitised forms. [`LeaderElection::from_flags`] sets it so;
    /// [`LeaderElection::new`] starts from `<lease name>/<identity>`.
    pub event_component: String,
}

impl LeaderElection {
    /// The election the controller flags ask for (`--leader-election-*`) under the sidecar's
    /// csi-lib-utils lock name `lock_name` (unsanitised, e.g.
    /// `external-attacher-leader-hostpath.csi.k8s.io`): on the Lease named `lock_name`
    /// sanitised ([`sanitize_name`]) in [`namespace`], as this host ([`hostname`], sanitised),
    /// its event from `<lock_name>/<host name>`. Release on exit and metrics are the caller's
    /// to set.
    pub fn from_flags(flags: &ControllerFlags, lock_name: &str) -> Self {
        let host = hostname();
        let mut le = Self::new(
            &namespace(&flags.leader_election_namespace),
            &sanitize_name(lock_name),
            &leader_identity(&host),
        );
        le.event_component = format!("{lock_name}/{host}");
        le.lease_duration = flags.leader_election_lease_duration;
        le.renew_deadline = flags.leader_election_renew_deadline;
        le.retry_period = flags.leader_election_retry_period;
        le.labels = flags.leader_election_labels.clone();
        le
    }

    /// An election on the Lease `namespace/lease_name` as `identity`, with upstream's default
    /// timings (15 s, 10 s, 5 s), no labels, no release on exit, no metrics, its event from
    /// `<lease_name>/<identity>`.
    pub fn new(namespace: &str, lease_name: &str, identity: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            lease_name: lease_name.to_owned(),
            identity: identity.to_owned(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(5),
            labels: BTreeMap::new(),
            release_on_cancel: false,
            name: String::new(),
            metrics: None,
            event_component: format!("{lease_name}/{identity}"),
        }
    }

    /// The event client-go's recorder writes when this candidate becomes leader at `now`:
    /// `<identity> became leader` (Normal, `LeaderElection`) on `lease`, from
    /// [`event_component`](Self::event_component).
    fn became_leader_event(&self, lease: &Lease, now: Timestamp) -> Event {
        Event {
            metadata: ObjectMeta {
                name: Some(format!(
                    "{}.{:x}",
                    self.lease_name,
                    now.as_nanosecond().max(0)
                )),
                namespace: Some(self.namespace.clone()),
                ..Default::default()
            },
            involved_object: ObjectReference {
                api_version: Some("coordination.k8s.io/v1".to_owned()),
                kind: Some("Lease".to_owned()),
                name: Some(self.lease_name.clone()),
                namespace: Some(self.namespace.clone()),
                uid: lease.metadata.uid.clone(),
                resource_version: lease.metadata.resource_version.clone(),
                ..Default::default()
            },
            reason: Some("LeaderElection".to_owned()),
            message: Some(format!("{} became leader", self.identity)),
            type_: Some("Normal".to_owned()),
            count: Some(1),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            source: Some(EventSource {
                component: Some(self.event_component.clone()),
                host: None,
            }),
            ..Default::default()
        }
    }

    /// client-go's checks (`NewLeaderElector`), in its order and words: lease duration >
    /// renew deadline > retry period × 1.2, all positive, and an identity.
    pub fn validate(&self) -> Result<(), LeaderError> {
        let invalid = |m: &str| Err(LeaderError::Invalid(m.to_owned()));
        if self.lease_duration <= self.renew_deadline {
            return invalid("leaseDuration must be greater than renewDeadline");
        }
        if self.renew_deadline <= self.retry_period.mul_f64(JITTER_FACTOR) {
            return invalid("renewDeadline must be greater than retryPeriod*JitterFactor");
        }
        if self.lease_duration.is_zero() {
            return invalid("leaseDuration must be greater than zero");
        }
        if self.renew_deadline.is_zero() {
            return invalid("renewDeadline must be greater than zero");
        }
        if self.retry_period.is_zero() {
            return invalid("retryPeriod must be greater than zero");
        }
        if self.identity.is_empty() {
            return invalid("Lock identity is empty");
        }
        if self.namespace.is_empty() || self.lease_name.is_empty() {
            return invalid("the Lease's namespace and name must not be empty");
        }
        Ok(())
    }

    /// Campaigns until this process leads, then runs `on_started_leading` (given a token that
    /// is cancelled when it should stop: on `shutdown`) while renewing the lease.
    ///
    /// Returns:
    /// - `Err(Invalid)` at once for a configuration [`validate`](Self::validate) refuses;
    /// - `Err(Lost)` when a renewal did not succeed within the renew deadline (the work is
    ///   dropped unfinished: the caller is expected to exit, as upstream does);
    /// - `Ok(())` when `shutdown` came before leadership, or when the work finished (by
    ///   itself, or after `shutdown`, which it should answer by draining). The lease is
    ///   renewed while the work drains, then released if [`release_on_cancel`] is set.
    ///
    /// Dropping the future (or aborting its task) stops everything at once and leaves the
    /// lease to expire, as a killed process would.
    ///
    /// [`release_on_cancel`]: Self::release_on_cancel
    pub async fn run<F, Fut>(
        self,
        client: kube::Client,
        health: LeaderHealth,
        shutdown: CancellationToken,
        on_started_leading: F,
    ) -> Result<(), LeaderError>
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = ()>,
    {
        self.validate()?;
        health.configure(&self.name, self.lease_duration);
        let mut elector = Elector::new(self, client, health);
        if let Some(m) = &elector.cfg.metrics {
            m.leader(&elector.cfg.name, false);
        }
        tracing::info!(lease = %elector.describe(), "attempting to acquire leader lease...");
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            () = elector.acquire() => {}
        }
        tracing::debug!("became leader, starting");
        let work_token = shutdown.child_token();
        let work = on_started_leading(work_token.clone());
        let lost = {
            let renew = elector.renew();
            tokio::pin!(work, renew);
            tokio::select! {
                lost = &mut renew => Some(lost),
                () = &mut work => None,
            }
        };
        work_token.cancel();
        if let Some(lost) = lost {
            if let Some(m) = &elector.cfg.metrics {
                m.leader(&elector.cfg.name, false);
            }
            return Err(lost);
        }
        if elector.cfg.release_on_cancel {
            elector.release().await;
        }
        Ok(())
    }
}

/// Runs a controller's `work` at once when `leader` is `None` (no `--leader-election`), or
/// else, with the election's own client (so that renewing the Lease never waits behind the
/// work's requests), only once this process leads and until it stops leading or `shutdown`.
///
/// The outer result is the election's (`Err` when leadership was lost: upstream exits 1),
/// the inner one the work's: `run_elected(..).await??` in a function whose error type converts
/// from both.
pub async fn run_elected<F, Fut, E>(
    leader: Option<(LeaderElection, kube::Client)>,
    health: LeaderHealth,
    shutdown: CancellationToken,
    work: F,
) -> Result<Result<(), E>, LeaderError>
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), E>>,
{
    let Some((election, client)) = leader else {
        return Ok(work(shutdown).await);
    };
    let result = Mutex::new(Ok(()));
    election
        .run(client, health, shutdown, |token| async {
            let r = work(token).await;
            *result.lock().unwrap_or_else(|e| e.into_inner()) = r;
        })
        .await?;
    Ok(result.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// The `/healthz/leader-election` check, shared (cheaply cloned) between the election and the
/// HTTP server. Healthy unless this process believes it leads and has not seen its lease
/// renewed for longer than the lease duration + [`HEALTH_TOLERANCE`].
#[derive(Debug, Clone, Default)]
pub struct LeaderHealth {
    state: Arc<Mutex<HealthState>>,
    /// The checks of the other controllers of one process ([`LeaderHealth::joined`]).
    parts: Arc<[LeaderHealth]>,
}

#[derive(Debug, Default)]
struct HealthState {
    name: String,
    lease_duration: Duration,
    /// Whether the record last seen names us, and when it was seen to change.
    leader: bool,
    observed: Option<Instant>,
}

impl LeaderHealth {
    /// A check that passes until an election reports through it.
    pub fn new() -> Self {
        Self::default()
    }

    /// One check for the elections of several controllers in one process (`csi-sidecars`):
    /// unhealthy when any of `parts` is, with the first one's reason.
    pub fn joined(parts: Vec<LeaderHealth>) -> Self {
        Self {
            state: Arc::default(),
            parts: parts.into(),
        }
    }

    /// `Ok` or the reason this process is unhealthy (client-go's `Check`, its words).
    pub fn check(&self) -> Result<(), String> {
        {
            let s = self.lock();
            if let Some(seen) = s.observed
                && s.leader
                && seen.elapsed() > s.lease_duration + HEALTH_TOLERANCE
            {
                return Err(format!(
                    "failed election to renew leadership on lease {}",
                    s.name
                ));
            }
        }
        self.parts.iter().try_for_each(LeaderHealth::check)
    }

    /// Whether the record last seen names this process as the holder.
    pub fn is_leader(&self) -> bool {
        self.lock().leader
    }

    pub(crate) fn configure(&self, name: &str, lease_duration: Duration) {
        let mut s = self.lock();
        s.name = name.to_owned();
        s.lease_duration = lease_duration;
    }

    pub(crate) fn observe(&self, leader: bool, at: Instant) {
        let mut s = self.lock();
        s.leader = leader;
        s.observed = Some(at);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HealthState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The election record, as the Lease's spec holds it.
#[derive(Debug, Clone, PartialEq, Default)]
struct Record {
    holder: String,
    duration_secs: i32,
    acquire: Option<MicroTime>,
    renew: Option<MicroTime>,
    transitions: i32,
}

impl Record {
    fn from_spec(spec: Option<&LeaseSpec>) -> Self {
        let Some(s) = spec else {
            return Self::default();
        };
        Self {
            holder: s.holder_identity.clone().unwrap_or_default(),
            duration_secs: s.lease_duration_seconds.unwrap_or(0),
            acquire: s.acquire_time.clone(),
            renew: s.renew_time.clone(),
            transitions: s.lease_transitions.unwrap_or(0),
        }
    }

    /// Written into a Lease, keeping the spec fields the record does not cover.
    fn apply(&self, lease: &mut Lease) {
        let spec = lease.spec.get_or_insert_with(Default::default);
        spec.holder_identity = Some(self.holder.clone());
        spec.lease_duration_seconds = Some(self.duration_secs);
        spec.acquire_time = self.acquire.clone();
        spec.renew_time = self.renew.clone();
        spec.lease_transitions = Some(self.transitions);
    }
}

/// One candidate's state: client-go's `LeaderElector` with a `LeaseLock`.
struct Elector {
    cfg: LeaderElection,
    leases: Api<Lease>,
    events: Api<Event>,
    /// The Lease last read or written: its resourceVersion makes the next write conditional.
    lease: Option<Lease>,
    observed: Record,
    observed_at: Instant,
    reported_leader: String,
    health: LeaderHealth,
}

impl Elector {
    fn new(cfg: LeaderElection, client: kube::Client, health: LeaderHealth) -> Self {
        Self {
            leases: Api::namespaced(client.clone(), &cfg.namespace),
            events: Api::namespaced(client, &cfg.namespace),
            cfg,
            lease: None,
            observed: Record::default(),
            observed_at: Instant::now(),
            reported_leader: String::new(),
            health,
        }
    }

    fn describe(&self) -> String {
        format!("{}/{}", self.cfg.namespace, self.cfg.lease_name)
    }

    fn is_leader(&self) -> bool {
        self.observed.holder == self.cfg.identity
    }

    fn is_lease_valid(&self, now: Instant) -> bool {
        let secs = u64::try_from(self.observed.duration_secs).unwrap_or(0);
        self.observed_at + Duration::from_secs(secs) > now
    }

    fn set_observed(&mut self, record: Record) {
        self.observed = record;
        self.observed_at = Instant::now();
        self.health.observe(self.is_leader(), self.observed_at);
    }

    /// Attempts until one succeeds, then records the event and the metric.
    async fn acquire(&mut self) {
        loop {
            let ok = self.attempt().await;
            self.maybe_report_transition();
            if ok {
                tracing::info!(lease = %self.describe(), "successfully acquired lease");
                if let Some(m) = &self.cfg.metrics {
                    m.leader(&self.cfg.name, true);
                }
                self.record_became_leader();
                return;
            }
            tracing::debug!(lease = %self.describe(), "failed to acquire lease");
            tokio::time::sleep(jittered(self.cfg.retry_period)).await;
        }
    }

    /// Renews every retry period; returns when a renewal has not succeeded within the renew
    /// deadline.
    async fn renew(&mut self) -> LeaderError {
        loop {
            let deadline = Instant::now() + self.cfg.renew_deadline;
            let renewed = loop {
                match tokio::time::timeout_at(deadline, self.try_acquire_or_renew()).await {
                    Ok(true) => break true,
                    Ok(false) => {}
                    Err(_) => break false,
                }
                if Instant::now() + self.cfg.retry_period >= deadline {
                    tokio::time::sleep_until(deadline).await;
                    break false;
                }
                tokio::time::sleep(self.cfg.retry_period).await;
            };
            self.maybe_report_transition();
            if !renewed {
                let reason = if self.is_leader() {
                    "timed out waiting for the condition".to_owned()
                } else {
                    format!("the lease is held by {:?}", self.observed.holder)
                };
                tracing::info!(lease = %self.describe(), %reason, "failed to renew lease");
                return LeaderError::Lost {
                    namespace: self.cfg.namespace.clone(),
                    name: self.cfg.lease_name.clone(),
                    reason,
                };
            }
            tracing::trace!(lease = %self.describe(), "successfully renewed lease");
            tokio::time::sleep(self.cfg.retry_period).await;
        }
    }

    /// One attempt outside the renew loop, bounded like a renewal.
    async fn attempt(&mut self) -> bool {
        tokio::time::timeout(self.cfg.renew_deadline, self.try_acquire_or_renew())
            .await
            .unwrap_or(false)
    }

    /// client-go's `tryAcquireOrRenew`: true if we hold the lease afterwards.
    async fn try_acquire_or_renew(&mut self) -> bool {
        let now = now_micro();
        let mut record = Record {
            holder: self.cfg.identity.clone(),
            duration_secs: i32::try_from(self.cfg.lease_duration.as_secs()).unwrap_or(i32::MAX),
            acquire: Some(now.clone()),
            renew: Some(now),
            transitions: 0,
        };

        // 1. The leader writes optimistically over the object it last saw.
        if self.is_leader()
            && self.is_lease_valid(Instant::now())
            && let Some(lease) = self.lease.clone()
        {
            record.acquire = self.observed.acquire.clone();
            record.transitions = self.observed.transitions;
            match self.update(lease, &record).await {
                Ok(()) => {
                    self.set_observed(record);
                    return true;
                }
                Err(e) => tracing::error!(
                    err = %e,
                    "Failed to update lock optimistically, falling back to slow path"
                ),
            }
        }

        // 2. Read the record, or create it.
        let current = match self.leases.get_opt(&self.cfg.lease_name).await {
            Ok(Some(lease)) => lease,
            Ok(None) => {
                let mut lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.cfg.lease_name.clone()),
                        namespace: Some(self.cfg.namespace.clone()),
                        labels: (!self.cfg.labels.is_empty()).then(|| self.cfg.labels.clone()),
                        ..Default::default()
                    },
                    spec: None,
                };
                record.apply(&mut lease);
                return match self.leases.create(&PostParams::default(), &lease).await {
                    Ok(created) => {
                        self.lease = Some(created);
                        self.set_observed(record);
                        true
                    }
                    Err(e) => {
                        tracing::error!(err = %e, "error initially creating leader election record");
                        false
                    }
                };
            }
            Err(e) => {
                tracing::error!(err = %e, lease = %self.describe(), "error retrieving resource lock");
                return false;
            }
        };

        // 3. Someone else's unexpired lease stands; its expiry counts from when we saw it change.
        let old = Record::from_spec(current.spec.as_ref());
        self.lease = Some(current.clone());
        if old != self.observed {
            self.set_observed(old.clone());
        }
        if !old.holder.is_empty() && self.is_lease_valid(Instant::now()) && !self.is_leader() {
            tracing::trace!(holder = %old.holder, "lock is held and has not yet expired");
            return false;
        }

        // 4. Take it (or renew through the slow path), conditional on what we just read.
        if self.is_leader() {
            record.acquire = old.acquire.clone();
            record.transitions = old.transitions;
        } else {
            record.transitions = old.transitions.saturating_add(1);
        }
        match self.update(current, &record).await {
            Ok(()) => {
                self.set_observed(record);
                true
            }
            Err(e) => {
                tracing::error!(err = %e, "Failed to update lock");
                false
            }
        }
    }

    /// Writes `record` into `lease` (with our labels) as a conditional update.
    async fn update(&mut self, mut lease: Lease, record: &Record) -> Result<(), kube::Error> {
        record.apply(&mut lease);
        if !self.cfg.labels.is_empty() {
            let labels = lease.metadata.labels.get_or_insert_with(Default::default);
            labels.extend(self.cfg.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        let written = self
            .leases
            .replace(&self.cfg.lease_name, &PostParams::default(), &lease)
            .await?;
        self.lease = Some(written);
        Ok(())
    }

    /// Gives the lease up: no holder, a one-second duration. Reads the Lease first: the renew
    /// loop may have been stopped in the middle of a write, leaving the resourceVersion we
    /// know stale.
    async fn release(&mut self) {
        if !self.is_leader() {
            return;
        }
        let released = tokio::time::timeout(self.cfg.renew_deadline, async {
            let lease = self.leases.get(&self.cfg.lease_name).await?;
            let current = Record::from_spec(lease.spec.as_ref());
            if current.holder != self.cfg.identity {
                // Someone else holds it already: nothing of ours to give up.
                self.set_observed(current);
                return Ok(false);
            }
            let now = now_micro();
            let record = Record {
                holder: String::new(),
                duration_secs: 1,
                acquire: Some(now.clone()),
                renew: Some(now),
                transitions: current.transitions,
            };
            self.update(lease, &record).await?;
            self.set_observed(record);
            Ok::<_, kube::Error>(true)
        })
        .await;
        match released {
            Ok(Ok(true)) => {
                if let Some(m) = &self.cfg.metrics {
                    m.leader(&self.cfg.name, false);
                }
                tracing::info!(lease = %self.describe(), "released lease");
            }
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::error!(err = %e, "Failed to release lock"),
            Err(_) => tracing::error!("Failed to release lock: timed out"),
        }
    }

    fn maybe_report_transition(&mut self) {
        if self.observed.holder == self.reported_leader {
            return;
        }
        self.reported_leader = self.observed.holder.clone();
        tracing::debug!(leader = %self.reported_leader, "New leader detected");
    }

    /// The `LeaderElection` event on the Lease, sent in the background (as client-go's
    /// recorder does) so that leading does not wait for it.
    fn record_became_leader(&self) {
        let Some(lease) = &self.lease else {
            return;
        };
        let event = self.cfg.became_leader_event(lease, Timestamp::now());
        let events = self.events.clone();
        let limit = self.cfg.renew_deadline;
        tokio::spawn(async move {
            match tokio::time::timeout(limit, events.create(&PostParams::default(), &event)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(err = %e, "could not record the LeaderElection event"),
                Err(_) => tracing::warn!("could not record the LeaderElection event: timed out"),
            }
        });
    }
}

/// Now, at the precision the API server keeps (a MicroTime is written with six digits): what
/// we remember of our own writes then equals what we read back.
fn now_micro() -> MicroTime {
    let now = Timestamp::now();
    MicroTime(Timestamp::from_microsecond(now.as_microsecond()).unwrap_or(now))
}

/// `period` plus a random share of up to [`JITTER_FACTOR`] times it (client-go's
/// `wait.Jitter`), enough to keep standbys out of step.
fn jittered(period: Duration) -> Duration {
    period + period.mul_f64(JITTER_FACTOR * plugreg_runtime::backoff::unit_random())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_sanitised_as_csi_lib_utils_does() {
        assert_eq!(sanitize_name("hostpath.csi.k8s.io"), "hostpath-csi-k8s-io");
        assert_eq!(sanitize_name("a/b_c"), "a-b-c");
        assert_eq!(sanitize_name("node-1."), "node-1-X");
        assert_eq!(sanitize_name("Host-01"), "Host-01");
        assert_eq!(sanitize_name("é"), "-X");
    }

    #[test]
    fn provisioner_lock_name_keeps_what_its_lease_name_sanitises() {
        assert_eq!(
            lock_name("example.com/hostpath.csi"),
            "example.com-hostpath.csi"
        );
        assert_eq!(
            lease_name("example.com/hostpath.csi"),
            "example-com-hostpath-csi"
        );
    }

    #[test]
    fn election_from_flags_sanitises_the_lease_but_not_the_event_component() {
        let lock = "external-attacher-leader-hostpath.csi.k8s.io";
        let le = LeaderElection::from_flags(&ControllerFlags::default(), lock);
        assert_eq!(
            le.lease_name,
            "external-attacher-leader-hostpath-csi-k8s-io"
        );
        assert_eq!(le.identity, leader_identity(&hostname()));
        assert_eq!(le.event_component, format!("{lock}/{}", hostname()));
    }

    #[test]
    fn became_leader_event_comes_from_the_unsanitised_lock_name_and_host() {
        let lock = "external-health-monitor-leader-hostpath.csi.k8s.io";
        let mut le = LeaderElection::new(
            "ns",
            &sanitize_name(lock),
            &leader_identity("node-1.example.com"),
        );
        le.event_component = format!("{lock}/node-1.example.com");
        let lease = Lease {
            metadata: ObjectMeta {
                uid: Some("uid-1".to_owned()),
                resource_version: Some("7".to_owned()),
                ..Default::default()
            },
            ..Default::default()
        };
        let ev = le.became_leader_event(&lease, Timestamp::UNIX_EPOCH);
        assert_eq!(
            ev.source.and_then(|s| s.component).as_deref(),
            Some("external-health-monitor-leader-hostpath.csi.k8s.io/node-1.example.com")
        );
        assert_eq!(
            ev.message.as_deref(),
            Some("node-1-example-com became leader")
        );
        assert_eq!(ev.reason.as_deref(), Some("LeaderElection"));
        let obj = ev.involved_object;
        assert_eq!(
            obj.name.as_deref(),
            Some("external-health-monitor-leader-hostpath-csi-k8s-io")
        );
        assert_eq!(obj.kind.as_deref(), Some("Lease"));
        assert_eq!(obj.uid.as_deref(), Some("uid-1"));
        assert_eq!(ev.metadata.namespace.as_deref(), Some("ns"));
    }

    #[test]
    fn a_new_election_names_its_event_after_the_lease_and_identity() {
        let le = LeaderElection::new("ns", "my-lease", "me");
        assert_eq!(le.event_component, "my-lease/me");
    }

    #[test]
    fn jitter_stays_within_client_gos_bounds() {
        let p = Duration::from_millis(500);
        for _ in 0..1000 {
            let j = jittered(p);
            assert!(j >= p && j <= p + p.mul_f64(JITTER_FACTOR), "{j:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn health_fails_only_for_a_leader_past_lease_plus_tolerance() {
        let health = LeaderHealth::new();
        assert_eq!(health.check(), Ok(()), "before any election");
        health.configure("", Duration::from_secs(15));

        // A standby is healthy however long ago it saw the record.
        health.observe(false, Instant::now());
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert_eq!(health.check(), Ok(()));

        // A leader is healthy up to lease duration + 20 s after its last renewal...
        health.observe(true, Instant::now());
        assert!(health.is_leader());
        tokio::time::advance(Duration::from_secs(35)).await;
        assert_eq!(health.check(), Ok(()));
        // ...and not a moment longer.
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            health.check(),
            Err("failed election to renew leadership on lease ".to_owned())
        );
        // A renewal (or seeing another holder) makes it healthy again.
        health.observe(true, Instant::now());
        assert_eq!(health.check(), Ok(()));
        tokio::time::advance(Duration::from_secs(60)).await;
        health.observe(false, Instant::now());
        assert_eq!(health.check(), Ok(()));
    }

    #[test]
    fn clones_share_one_state() {
        let a = LeaderHealth::new();
        let b = a.clone();
        a.configure("lease-x", Duration::ZERO);
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(21))
            .expect("a monotonic clock 21 s old");
        a.observe(true, long_ago);
        assert_eq!(
            b.check(),
            Err("failed election to renew leadership on lease lease-x".to_owned())
        );
    }

    #[test]
    fn timings_are_checked_as_client_go_does() {
        let ok = LeaderElection::new("ns", "lease", "me");
        assert!(ok.validate().is_ok());
        let with = |lease: u64, renew: u64, retry: u64| {
            let mut e = ok.clone();
            e.lease_duration = Duration::from_millis(lease);
            e.renew_deadline = Duration::from_millis(renew);
            e.retry_period = Duration::from_millis(retry);
            e.validate().map_err(|e| e.to_string())
        };
        assert!(with(2000, 1500, 500).is_ok());
        let err = with(1000, 1000, 100).unwrap_err();
        assert!(
            err.contains("leaseDuration must be greater than renewDeadline"),
            "{err}"
        );
        // 1.2 × 500 ms = 600 ms: the renew deadline must exceed it.
        let err = with(2000, 600, 500).unwrap_err();
        assert!(
            err.contains("renewDeadline must be greater than retryPeriod*JitterFactor"),
            "{err}"
        );
        assert!(with(2000, 601, 500).is_ok());
        let err = with(2000, 1000, 0).unwrap_err();
        assert!(
            err.contains("retryPeriod must be greater than zero"),
            "{err}"
        );
        let mut anonymous = ok.clone();
        anonymous.identity.clear();
        assert!(
            anonymous
                .validate()
                .unwrap_err()
                .to_string()
                .contains("Lock identity is empty")
        );
    }

    #[test]
    fn our_timestamps_survive_the_wire_unchanged() {
        let now = now_micro();
        let json = serde_json::to_string(&now).unwrap();
        let back: MicroTime = serde_json::from_str(&json).unwrap();
        assert_eq!(back, now, "{json}");
    }

    #[test]
    fn record_round_trips_through_a_lease_and_keeps_other_fields() {
        let mut lease = Lease {
            spec: Some(LeaseSpec {
                strategy: Some("OldestEmulationVersion".to_owned()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let now = now_micro();
        let record = Record {
            holder: "me".to_owned(),
            duration_secs: 15,
            acquire: Some(now.clone()),
            renew: Some(now),
            transitions: 3,
        };
        record.apply(&mut lease);
        assert_eq!(Record::from_spec(lease.spec.as_ref()), record);
        assert_eq!(
            lease.spec.and_then(|s| s.strategy).as_deref(),
            Some("OldestEmulationVersion")
        );
    }

    /// A joined check is as healthy as its least healthy part, and names that part's lease.
    #[test]
    fn a_joined_check_fails_with_the_part_that_fails() {
        let (a, b) = (LeaderHealth::new(), LeaderHealth::new());
        let joined = LeaderHealth::joined(vec![a.clone(), b.clone()]);
        assert_eq!(joined.check(), Ok(()));
        b.configure("external-attacher-leader-d", Duration::from_secs(15));
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(60))
            .expect("a minute after boot");
        b.observe(true, long_ago);
        a.observe(true, Instant::now());
        assert_eq!(
            joined.check(),
            Err("failed election to renew leadership on lease external-attacher-leader-d".into())
        );
        b.observe(false, Instant::now());
        assert_eq!(joined.check(), Ok(()));
    }
}
