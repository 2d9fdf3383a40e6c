//! The health monitor's run while it leads: the watch caches, the reports' memory seeded from
//! the claims' live events, one of the two check paths, and the node watcher.
//!
//! - **ListVolumes path** ([`Mode::ListVolumes`]): a pass right after the caches fill, then one
//!   `--list-volumes-interval` after each pass ends. A pass lists the driver's volumes page by
//!   page within one `--timeout`; each listed volume is looked up by its handle and judged on
//!   the spot ([`Reports::judge`]), so a pass holds one page and the verdicts, never every
//!   page. A failed page drops the pass (no events), as upstream.
//! - **ControllerGetVolume path** ([`Mode::GetVolume`]): `--worker-threads` workers on the
//!   kit's runner, each pausing `--monitor-interval` after each check, as upstream's do. A PV
//!   is queued when it is (or becomes) Bound, and by a feed every `--volume-list-add-interval`;
//!   a PV found deleted, deleting or unbound leaves the cycle and comes back when it is Bound
//!   again (upstream never checks it again until a restart). A failed check comes back after
//!   its back-off (`--monitor-interval` doubling up to five minutes), not at once.
//! - **Node watcher** (`--enable-node-watcher`): a node not Ready for five minutes (or
//!   Terminated, or deleted) gets `NodeFailed` on the claims of the driver's PVs that its pods
//!   use, once per failure; Ready again, `NodeRecovered` once. Pods are matched by their
//!   current node, so a pod scheduled after it was first seen counts.
//!
//! Events go through the kit's recorder (client-go's correlation and spam filter) on the
//! low-priority client. Their involved object is the PV's `claimRef` (namespace, name, UID):
//! no claim is read, and no Event is watched.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use kube::api::{Api, ListParams};
use plugreg_sidecar_kit::cache::{self, CompactStore, Watches};
use plugreg_sidecar_kit::events::{EventType, Recorder};
use plugreg_sidecar_kit::metrics::Metrics;
use plugreg_sidecar_kit::queue::WorkQueue;
use plugreg_sidecar_kit::runtime::{Action, Lane, Runner};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::cached::{
    Handles, NodeHealth, PodClaims, SeenEvent, Volume, WatchedNode, WatchedPod, WatchedPv,
};
use crate::csi::{Driver, failure};
use crate::decide::{self, Condition, Mode, NodeVerdict, Nodes, Reports, Verdict};

/// The PV queue's name (upstream's).
pub const PV_QUEUE: &str = "csi-monitor-pv-queue";
/// The node queue's name (upstream's).
pub const NODE_QUEUE: &str = "nodes";
/// The longest back-off of a failed check or node.
pub const RETRY_MAX: Duration = Duration::from_secs(300);
/// Events read a page at a time when the memory of reports is seeded.
pub const SEED_PAGE: u32 = 250;

/// The controller's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// The driver's name.
    pub driver: String,
    /// The check path.
    pub mode: Mode,
    /// `--timeout`: one ListVolumes pass, one ControllerGetVolume.
    pub timeout: Duration,
    /// `--monitor-interval`.
    pub monitor_interval: Duration,
    /// `--list-volumes-interval`.
    pub list_volumes_interval: Duration,
    /// `--volume-list-add-interval`.
    pub volume_list_add_interval: Duration,
    /// `--node-list-add-interval`.
    pub node_list_add_interval: Duration,
    /// `--resync`.
    pub resync: Duration,
    /// `--worker-threads`.
    pub workers: usize,
    /// `--enable-node-watcher`.
    pub node_watcher: bool,
    /// `--node-failure-grace`.
    pub node_failure_grace: Duration,
}

/// What the controller talks to.
pub struct Clients {
    /// Where the caches get their events.
    pub watches: Watches,
    /// Reads (the seed of the reports).
    pub kube: kube::Client,
    /// Event writes.
    pub events: kube::Client,
    /// The driver.
    pub driver: Driver,
    /// The metrics (the queues').
    pub metrics: Arc<Metrics>,
}

/// How the controller failed.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A cache never filled before the run was stopped.
    #[error("Cannot sync cache")]
    Sync,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Controller {
    cfg: Config,
    driver: Driver,
    kube: kube::Client,
    recorder: Recorder,
    volumes: CompactStore<Volume>,
    handles: Arc<Mutex<Handles>>,
    reports: Arc<Mutex<Reports>>,
    /// PVs in the ControllerGetVolume cycle (queued, waiting or being checked).
    cycling: Arc<Mutex<HashSet<String>>>,
    pv_queue: Arc<WorkQueue<String>>,
    pods: Option<CompactStore<PodClaims>>,
    nodes: Option<CompactStore<NodeHealth>>,
    node_state: Mutex<Nodes>,
    shutdown: CancellationToken,
}

/// Runs until `shutdown` (Ok) or until a cache cannot be filled (Err).
pub async fn run(
    cfg: Config,
    clients: Clients,
    shutdown: CancellationToken,
) -> Result<(), ControllerError> {
    let pv_queue: Arc<WorkQueue<String>> = WorkQueue::new(
        PV_QUEUE,
        cfg.monitor_interval.max(Duration::from_secs(1)),
        RETRY_MAX,
        Arc::clone(&clients.metrics),
        shutdown.clone(),
    );
    let node_queue: Arc<WorkQueue<String>> = WorkQueue::new(
        NODE_QUEUE,
        Duration::from_secs(1),
        RETRY_MAX,
        Arc::clone(&clients.metrics),
        shutdown.clone(),
    );
    let mut ready = Vec::new();
    let handles: Arc<Mutex<Handles>> = Arc::default();
    let cycling: Arc<Mutex<HashSet<String>>> = Arc::default();
    let get_volume = cfg.mode == Mode::GetVolume;
    let reports: Arc<Mutex<Reports>> = Arc::default();
    let (h, c, q, r, driver) = (
        Arc::clone(&handles),
        Arc::clone(&cycling),
        Arc::clone(&pv_queue),
        Arc::clone(&reports),
        cfg.driver.clone(),
    );
    let volumes = cache::watch_compact::<WatchedPv, _>(
        &clients.watches,
        Default::default(),
        &shutdown,
        &mut ready,
        move |pv| Volume::new(pv, &driver),
        move |v: &Volume, deleted| {
            lock(&h).update(v, deleted);
            // A deleted volume's claim is reported about no more.
            if deleted && let Some(claim) = v.claim.as_deref() {
                lock(&r).forget(&claim.uid);
            }
            if get_volume && !deleted && v.is_checked() && lock(&c).insert(v.name.to_string()) {
                q.add(v.name.to_string());
            }
        },
    );
    let (pods, nodes) = if cfg.node_watcher {
        let pods = cache::watch_compact::<WatchedPod, _>(
            &clients.watches,
            Default::default(),
            &shutdown,
            &mut ready,
            PodClaims::new,
            |_, _| {},
        );
        let q = Arc::clone(&node_queue);
        let nodes = cache::watch_compact::<WatchedNode, _>(
            &clients.watches,
            Default::default(),
            &shutdown,
            &mut ready,
            NodeHealth::new,
            move |n: &NodeHealth, _| q.add(n.name.to_string()),
        );
        (Some(pods), Some(nodes))
    } else {
        (None, None)
    };

    info!("Starting CSI External PV Health Monitor Controller");
    for r in ready {
        tokio::select! {
            res = r => if res.is_err() {
                error!("Cannot sync cache");
                return Err(ControllerError::Sync);
            },
            () = shutdown.cancelled() => return Ok(()),
        }
    }

    let recorder = Recorder::start(
        clients.events.clone(),
        &decide::component(&cfg.driver),
        "",
        shutdown.clone(),
    );
    let grace = cfg.node_failure_grace;
    let ctl = Arc::new(Controller {
        cfg,
        driver: clients.driver,
        kube: clients.kube,
        recorder,
        volumes,
        handles,
        reports,
        cycling,
        pv_queue,
        pods,
        nodes,
        node_state: Mutex::new(Nodes::new(grace)),
        shutdown: shutdown.clone(),
    });
    ctl.seed().await;

    let mut tasks = tokio::task::JoinSet::new();
    match ctl.cfg.mode {
        Mode::ListVolumes => {
            tasks.spawn(Arc::clone(&ctl).list_volumes_loop());
        }
        Mode::GetVolume => {
            let c = Arc::clone(&ctl);
            let runner = Runner::new(vec![Lane::new(Arc::clone(&ctl.pv_queue), ctl.cfg.workers)])
                .resync(ctl.cfg.volume_list_add_interval, move || c.feed());
            ctl.feed();
            tasks.spawn(runner.run(
                Arc::clone(&ctl),
                shutdown.clone(),
                |c: Arc<Controller>, _, name: String| async move { c.check_one(&name).await },
                |_: &Controller, _, _: &String, e: Infallible| match e {},
            ));
        }
    }
    if ctl.cfg.node_watcher {
        let (c1, c2) = (Arc::clone(&ctl), Arc::clone(&ctl));
        let (q1, q2) = (Arc::clone(&node_queue), Arc::clone(&node_queue));
        let runner = Runner::new(vec![Lane::new(node_queue, 1)])
            .resync(ctl.cfg.resync, move || c1.queue_nodes(&q1))
            .resync(ctl.cfg.node_list_add_interval, move || {
                debug!("Resyncing Node watcher");
                c2.queue_nodes(&q2);
            });
        tasks.spawn(runner.run(
            Arc::clone(&ctl),
            shutdown.clone(),
            |c: Arc<Controller>, _, name: String| async move { Ok(c.watch_node(&name)) },
            |_: &Controller, _, _: &String, e: Infallible| match e {},
        ));
    }
    shutdown.cancelled().await;
    while tasks.join_next().await.is_some() {}
    info!("Shutting down CSI External PV Health Monitor Controller");
    Ok(())
}

impl Controller {
    /// Fills the memory of reports from the claims' live `VolumeConditionAbnormal` and
    /// `VolumeConditionNormal` events (two paged LISTs with field selectors), so that a new
    /// leader neither repeats an abnormal report nor misses a recovery. A failure is logged
    /// and the run goes on with an empty memory (an abnormal volume is then reported again).
    async fn seed(&self) {
        let abnormal = match self
            .list_events(decide::REASON_ABNORMAL, EventType::Warning)
            .await
        {
            Ok(a) => a,
            Err(e) => {
                warn!(err = %e, "Cannot read the claims' abnormal-volume events; abnormal volumes will be reported again");
                return;
            }
        };
        let normal = match self
            .list_events(decide::REASON_NORMAL, EventType::Normal)
            .await
        {
            Ok(n) => n,
            Err(e) => {
                warn!(err = %e, "Cannot read the claims' recovery events; abnormal volumes will be reported again");
                return;
            }
        };
        let mut reports = lock(&self.reports);
        for (uid, (message, at)) in &abnormal {
            if normal.get(uid).is_some_and(|(_, n)| n >= at) {
                continue;
            }
            reports.seed(uid, message, *at);
        }
        debug!(
            abnormal = reports.abnormal(),
            "Remembered the claims reported abnormal"
        );
    }

    /// The newest event of `reason` and `type_` about each claim (by UID): its message and
    /// when it was last written.
    async fn list_events(
        &self,
        reason: &str,
        type_: EventType,
    ) -> Result<HashMap<String, (String, SystemTime)>, kube::Error> {
        let mut found: HashMap<String, (String, SystemTime)> = HashMap::new();
        let selector = format!(
            "involvedObject.kind=PersistentVolumeClaim,reason={reason},type={}",
            type_.as_str()
        );
        let api: Api<SeenEvent> = Api::all(self.kube.clone());
        let mut params = ListParams::default().fields(&selector).limit(SEED_PAGE);
        loop {
            let list = api.list(&params).await?;
            for ev in list.items {
                let Some(uid) = ev.claim_uid() else { continue };
                let at = ev.written();
                if found.get(uid).is_none_or(|(_, t)| *t <= at) {
                    found.insert(uid.to_owned(), (ev.message().to_owned(), at));
                }
            }
            match list.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(c) => params = params.continue_token(&c),
                None => return Ok(found),
            }
        }
    }

    /// The ListVolumes path: a pass, then `--list-volumes-interval`, until the run ends.
    async fn list_volumes_loop(self: Arc<Self>) {
        loop {
            self.list_pass().await;
            tokio::select! {
                () = tokio::time::sleep(self.cfg.list_volumes_interval) => {}
                () = self.shutdown.cancelled() => return,
            }
        }
    }

    /// One ListVolumes pass (see the module docs).
    async fn list_pass(&self) {
        let deadline = Instant::now() + self.cfg.timeout;
        let mut token = String::new();
        // The verdicts of this pass by claim UID (a duplicate id: the last entry wins).
        let mut verdicts: BTreeMap<Box<str>, (Arc<Volume>, Verdict)> = BTreeMap::new();
        let mut listed = 0usize;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let page = if left.is_zero() {
                Err("rpc error: code = DeadlineExceeded desc = context deadline exceeded".into())
            } else {
                tokio::select! {
                    p = self.driver.list_volumes(&token, left) => p.map_err(|e| failure(&e)),
                    () = self.shutdown.cancelled() => return,
                }
            };
            let page = match page {
                Ok(p) => p,
                Err(e) => {
                    error!(err = %format!("failed to list volumes: {e}"), "Check controller volume status error");
                    return;
                }
            };
            if page.without_volume > 0 {
                warn!(
                    entries = page.without_volume,
                    "ListVolumes answered entries without a volume; skipped"
                );
            }
            listed += page.volumes.len();
            {
                let handles = lock(&self.handles);
                let reports = lock(&self.reports);
                let now = SystemTime::now();
                for (id, condition) in &page.volumes {
                    for name in handles.names(id) {
                        let Some(v) = self.volumes.get(name) else {
                            continue;
                        };
                        if !v.bound {
                            debug!(pv = %v.name, "PV status is not bound");
                            continue;
                        }
                        let Some(uid) = claim_uid(&v) else { continue };
                        match reports.judge(uid, condition, now) {
                            Some(verdict) => {
                                verdicts.insert(uid.into(), (Arc::clone(&v), verdict));
                            }
                            None => {
                                verdicts.remove(uid);
                            }
                        }
                    }
                }
            }
            if page.next_token.is_empty() {
                break;
            }
            if page.next_token == token {
                error!(err = %format!("failed to list volumes: the driver answered the starting token {token:?} as the next one again"), "Check controller volume status error");
                return;
            }
            token = page.next_token;
        }
        debug!(
            volumes = listed,
            changes = verdicts.len(),
            "ListVolumes pass done"
        );
        // Abnormal volumes first: at the API rate limit their events are the ones that matter
        // most, and the recoveries wait behind them.
        let (abnormal, normal): (Vec<_>, Vec<_>) = verdicts
            .into_values()
            .partition(|(_, v)| matches!(v, Verdict::Abnormal(_)));
        for (v, verdict) in abnormal.into_iter().chain(normal) {
            self.report(&v, verdict);
        }
    }

    /// Writes the event of `verdict` about `v`'s claim and remembers it.
    fn report(&self, v: &Volume, verdict: Verdict) {
        let Some(claim) = v.claim.as_deref() else {
            return;
        };
        let object = claim.object_ref();
        match &verdict {
            Verdict::Abnormal(message) => {
                info!(pv = %v.name, pvc = %format!("{}/{}", claim.namespace, claim.name), message = %message, "Volume condition is abnormal");
                self.recorder.event(
                    &object,
                    EventType::Warning,
                    decide::REASON_ABNORMAL,
                    message,
                );
            }
            Verdict::Normal => {
                info!(pv = %v.name, pvc = %format!("{}/{}", claim.namespace, claim.name), "Volume condition is normal again");
                self.recorder.event(
                    &object,
                    EventType::Normal,
                    decide::REASON_NORMAL,
                    decide::MESSAGE_NORMAL,
                );
            }
        }
        lock(&self.reports).record(&claim.uid, &verdict, SystemTime::now());
    }

    /// Queues every checked PV not in the cycle (the ControllerGetVolume path's feed).
    fn feed(&self) {
        let mut cycling = lock(&self.cycling);
        for v in self.volumes.state() {
            if v.is_checked() && cycling.insert(v.name.to_string()) {
                self.pv_queue.add(v.name.to_string());
            }
        }
    }

    /// One ControllerGetVolume check of the PV `name`, then the worker's pause.
    async fn check_one(&self, name: &str) -> Result<Action, Infallible> {
        debug!(pv = name, "Started PV processing");
        let leave = |why: &str| {
            lock(&self.cycling).remove(name);
            if !why.is_empty() {
                info!(pv = name, "{why}");
            }
            Ok(Action::Done)
        };
        let Some(v) = self.volumes.get(name) else {
            debug!(pv = name, "PV deleted, ignoring");
            return leave("");
        };
        if v.deleting {
            return leave("PV is being deleted now, skip checking health condition");
        }
        if !v.bound {
            return leave("PV status is not bound, remove it from the queue");
        }
        if !v.is_ours() {
            return leave("");
        }
        let action = if v.handle.is_empty() {
            error!(
                pv = name,
                err = "volume handle in csi source is empty",
                "Check controller volume status error"
            );
            Action::Retry
        } else if claim_uid(&v).is_none() {
            Action::Retry
        } else {
            let checked = tokio::select! {
                c = self.driver.get_volume(&v.handle) => c,
                () = self.shutdown.cancelled() => return Ok(Action::Wait),
            };
            match checked {
                Ok(condition) => {
                    self.judge_and_report(&v, &condition);
                    // Back in the cycle, its back-off reset.
                    self.pv_queue.add(name.to_owned());
                    Action::Done
                }
                Err(e) => {
                    error!(pv = name, err = %failure(&e), "Check controller volume status error");
                    Action::Retry
                }
            }
        };
        tokio::select! {
            () = tokio::time::sleep(self.cfg.monitor_interval) => {}
            () = self.shutdown.cancelled() => {}
        }
        Ok(action)
    }

    fn judge_and_report(&self, v: &Volume, condition: &Condition) {
        let Some(uid) = claim_uid(v) else { return };
        let verdict = lock(&self.reports).judge(uid, condition, SystemTime::now());
        if let Some(verdict) = verdict {
            self.report(v, verdict);
        }
    }

    fn queue_nodes(&self, queue: &WorkQueue<String>) {
        if let Some(nodes) = &self.nodes {
            for n in nodes.state() {
                queue.add(n.name.to_string());
            }
        }
    }

    /// The node watcher's look at the node `name`.
    fn watch_node(&self, name: &str) -> Action {
        debug!(node = name, "WatchNode");
        let (Some(nodes), Some(_)) = (&self.nodes, &self.pods) else {
            return Action::Done;
        };
        let now = Instant::now();
        let verdict = match nodes.get(name) {
            None => {
                let v = lock(&self.node_state).deleted(name);
                if v == NodeVerdict::Failed {
                    info!(node = name, "Node is deleted, so mark the PVs on the node");
                    self.tell_claims(name, true);
                }
                return Action::Done;
            }
            Some(node) => lock(&self.node_state).judge(&node, now),
        };
        match verdict {
            NodeVerdict::Nothing => Action::Done,
            NodeVerdict::LookAt(at) => {
                debug!(node = name, "Node is not ready, but less than 5 minutes");
                Action::After(at.saturating_duration_since(now))
            }
            NodeVerdict::Failed => {
                info!(node = name, "Node is broken");
                self.tell_claims(name, true);
                lock(&self.node_state).failed(name);
                Action::Done
            }
            NodeVerdict::Recovered => {
                self.tell_claims(name, false);
                lock(&self.node_state).recovered(name);
                Action::Done
            }
        }
    }

    /// `NodeFailed` (`failed`) or `NodeRecovered` on the claim of each Bound driver PV that a
    /// pod on `node` uses.
    fn tell_claims(&self, node: &str, failed: bool) {
        let Some(pods) = &self.pods else { return };
        // Claim `namespace/name` -> the pods on the node that use it.
        let mut claims: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for p in pods.state() {
            if &*p.node != node {
                continue;
            }
            for c in &p.claims {
                claims
                    .entry(format!("{}/{c}", p.namespace()))
                    .or_default()
                    .push(p.name().to_owned());
            }
        }
        if claims.is_empty() {
            return;
        }
        for v in self.volumes.state() {
            if !v.is_ours() || !v.bound {
                continue;
            }
            let Some(claim) = v.claim.as_deref() else {
                continue;
            };
            let Some(pod_names) = claims.get_mut(&format!("{}/{}", claim.namespace, claim.name))
            else {
                continue;
            };
            if claim.uid.is_empty() {
                error!(pv = %v.name, "Get PVC error");
                continue;
            }
            pod_names.sort_unstable();
            let object = claim.object_ref();
            let (reason, message) = if failed {
                let names: Vec<&str> = pod_names.iter().map(String::as_str).collect();
                (
                    decide::REASON_NODE_FAILED,
                    decide::node_failed_message(&names, &claim.name, &claim.namespace, node),
                )
            } else {
                (
                    decide::REASON_NODE_RECOVERED,
                    decide::node_recovered_message(node),
                )
            };
            self.recorder
                .event(&object, EventType::Warning, reason, &message);
        }
    }
}

/// The UID of the claim `v` is bound to; none (a Bound PV without a claim UID) is logged as
/// upstream's "Get PVC error" (upstream crashes on a Bound PV without a claim).
fn claim_uid(v: &Volume) -> Option<&str> {
    match v.claim.as_deref() {
        Some(c) if !c.uid.is_empty() => Some(&c.uid),
        _ => {
            error!(pv = %v.name, err = "the PV names no claim UID", "Get PVC error");
            None
        }
    }
}
