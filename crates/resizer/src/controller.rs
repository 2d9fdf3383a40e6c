//! The resize and modify controllers: watch caches of claims, volumes (and pods, and
//! VolumeAttributesClasses), one work queue each (both named `<driver>-pvc`, as upstream, so
//! their `workqueue_*` metrics merge), each run by a [`Runner`] of the kit's runtime with
//! `--workers` workers and the resync, and the syncs that act on the decisions of
//! [`crate::decide`]. The two runners are independent, as upstream's controllers: a claim may
//! be resized and modified at the same time.
//!
//! What a sync writes, and in which order, is upstream's (the crate README lists it). Every
//! claim write goes through the `status` subresource; the PV gets merge patches. The
//! resourceVersion a write returns is remembered ([`Writes`]) until the watch delivers it (or
//! something newer): a sync that finds the cached claim or PV older than its own write looks
//! again after `CACHE_CATCH_UP`, so that it never acts on the state before that write.
//!
//! No call that may have changed the volume is forgotten: the target size is written to
//! `status.allocatedResources` (and the modify target to `status.modifyVolumeStatus`) before
//! the driver is called, and a target whose outcome is unknown stays the target, also after a
//! restart or a leader change.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    ObjectReference, PersistentVolume, PersistentVolumeClaim, Secret,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use plugreg_csi_core::client::CallError;
use plugreg_proto::csi::v1::{
    CapacityRange, ControllerExpandVolumeRequest, ControllerModifyVolumeRequest, VolumeCapability,
    volume_capability,
};
use plugreg_sidecar_kit::cache::{self, CompactStore};
use plugreg_sidecar_kit::events::{EventType, Recorder};
use plugreg_sidecar_kit::metrics::Metrics;
use plugreg_sidecar_kit::migration;
use plugreg_sidecar_kit::quantity::format_binary_si;
use plugreg_sidecar_kit::queue::WorkQueue;
use plugreg_sidecar_kit::runtime::{Action, Lane, Runner, Writes};
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::cached::{Claim, Compact, Decoded, PodUse, Pv};
use crate::csi::{Driver, Resizer, error_text};
use crate::decide::{self, ClaimView, Failure, Memory, Modify, Resize, SlowSet};
use crate::kube::{self as k, VolumeAttributesClass, claim_key};

/// What the controllers need to know besides their clients.
#[derive(Debug, Clone)]
pub struct Config {
    /// The driver name.
    pub driver: String,
    /// How claims grow (`None`: no resize controller).
    pub resizer: Option<Resizer>,
    /// Whether the modify controller runs (MODIFY_VOLUME and the VolumeAttributesClass gate).
    pub modify: bool,
    /// `--workers` (each queue).
    pub workers: usize,
    /// `--retry-interval-start`.
    pub retry_start: Duration,
    /// `--retry-interval-max` (also the infeasible slow-retry window).
    pub retry_max: Duration,
    /// `--resync-period`.
    pub resync: Duration,
    /// `RecoverVolumeExpansionFailure`.
    pub recover: bool,
    /// `AnnotateFsResize`.
    pub annotate_fs_resize: bool,
    /// `--handle-volume-inuse-error`.
    pub handle_inuse: bool,
    /// `--extra-modify-metadata`.
    pub extra_modify_metadata: bool,
}

/// The controllers' clients.
#[derive(Clone)]
pub struct Clients {
    /// Where the watch caches get their events.
    pub watches: cache::Watches,
    /// Claims, volumes, secrets, pods, classes.
    pub client: Client,
    /// Events.
    pub events: Recorder,
    /// The driver.
    pub driver: Driver,
    /// The metrics.
    pub metrics: Arc<Metrics>,
}

/// Why the controllers stopped.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A watch cache never filled.
    #[error("Cannot sync pod, pv or pvc caches")]
    Sync,
}

/// How long a sync that found the cache behind its own last write waits before looking again.
/// Not [`Action::Wait`]: the watch event of the write does not always bring the key back (the
/// update filters are upstream's, and a PV's event never brings its claim).
const CACHE_CATCH_UP: Duration = Duration::from_millis(200);

/// Keys whose last target was infeasible, and since when (`slowset`): kept for the window.
#[derive(Debug, Default)]
struct SlowSetMap {
    entries: Mutex<HashMap<String, Instant>>,
}

impl SlowSetMap {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// The time left for `key`, if it is in the set and its window has not passed.
    fn remaining(&self, key: &str, window: Duration) -> Option<Duration> {
        let mut m = self.lock();
        let since = *m.get(key)?;
        match window.checked_sub(since.elapsed()) {
            Some(left) if !left.is_zero() => Some(left),
            _ => {
                m.remove(key);
                None
            }
        }
    }
    fn add(&self, key: &str) {
        self.lock()
            .entry(key.to_owned())
            .or_insert_with(Instant::now);
    }
    fn remove(&self, key: &str) {
        self.lock().remove(key);
    }
}

/// Remembers our write of `key` whose answer is `written`, unless the watch cache has it
/// already (`cached`, read after the answer): the answer and the watch race on different
/// connections, and a write remembered after its watch event would stay until the object's next
/// change, which after a finished expansion never comes.
fn remember(writes: &Writes<String>, key: String, written: Option<&str>, cached: Option<&str>) {
    writes.record(key.clone(), written);
    writes.seen(&key, cached);
}

/// Whether the resizer of `driver` handles the claim's PV: the driver's CSI volume, or (for a
/// CSI-migration target) any PV of a claim whose `volume.kubernetes.io/storage-resizer`
/// annotation names the driver, as upstream's `CanSupport`; bound to this claim (namespace and
/// UID: a PV whose claim was deleted and made again under the same name belongs to the old
/// claim).
fn supports(driver: &str, pv: &PersistentVolume, pvc: &PersistentVolumeClaim) -> bool {
    let spec = pv.spec.as_ref();
    let migrated = migration::in_tree_plugin(driver).is_some()
        && pvc
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(k::ANN_STORAGE_RESIZER))
            .is_some_and(|r| r == driver);
    let ours = migrated
        || spec
            .and_then(|s| s.csi.as_ref())
            .is_some_and(|c| c.driver == driver);
    let bound_here = spec
        .and_then(|s| s.claim_ref.as_ref())
        .is_some_and(|r| r.namespace == pvc.metadata.namespace && r.uid == pvc.metadata.uid);
    ours && bound_here
}

/// What the pods say about claims in use.
type Pods = Store<PodUse>;

struct Controller {
    cfg: Config,
    c: Clients,
    claims: CompactStore<Compact<Claim>>,
    volumes: CompactStore<Compact<Pv>>,
    pods: Option<Pods>,
    classes: Option<Store<VolumeAttributesClass>>,
    /// Our last write of each claim (by key) the watch has not delivered yet.
    claim_writes: Arc<Writes<String>>,
    /// The same of each PV (by name).
    volume_writes: Arc<Writes<String>>,
    resize_q: Arc<WorkQueue<String>>,
    modify_q: Arc<WorkQueue<String>>,
    /// Claims (by key) whose last expansion ended with a final error.
    final_errors: Mutex<HashSet<String>>,
    /// Claim UIDs whose last expansion failed with FailedPrecondition.
    in_use_errors: Mutex<HashSet<String>>,
    resize_slow: SlowSetMap,
    modify_slow: SlowSetMap,
    /// Claims whose modification has no final answer yet.
    uncertain: Mutex<HashSet<String>>,
}

fn set<'a>(m: &'a Mutex<HashSet<String>>) -> std::sync::MutexGuard<'a, HashSet<String>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs the controllers until `shutdown`.
pub async fn run(
    cfg: Config,
    c: Clients,
    shutdown: CancellationToken,
) -> Result<(), ControllerError> {
    let name: &'static str = Box::leak(format!("{}-pvc", cfg.driver).into_boxed_str());
    let queue = || {
        WorkQueue::new(
            name,
            cfg.retry_start,
            cfg.retry_max,
            Arc::clone(&c.metrics),
            shutdown.clone(),
        )
    };
    let (resize_q, modify_q) = (queue(), queue());
    let resizing = cfg.resizer.is_some();
    let mut ready = Vec::new();
    let recover = cfg.recover;
    let (rq, mq) = (Arc::clone(&resize_q), Arc::clone(&modify_q));
    let modifying = cfg.modify;
    // The last view of each claim, for the update filters.
    let mut seen: HashMap<String, decide::Seen> = HashMap::new();
    let claim_writes = Arc::new(Writes::default());
    let volume_writes = Arc::new(Writes::default());
    let writes = Arc::clone(&claim_writes);
    let claims = cache::watch_compact::<Decoded<Claim>, _>(
        &c.watches,
        watcher::Config::default(),
        &shutdown,
        &mut ready,
        Decoded::into_compact,
        move |cached, deleted| {
            let pvc = &cached.object();
            let key = claim_key(pvc);
            if deleted {
                writes.forget(&key);
                seen.remove(&key);
                rq.forget(&key);
                mq.forget(&key);
                return;
            }
            writes.seen(&key, pvc.metadata.resource_version.as_deref());
            let view = k::claim_view(pvc);
            let mv = k::modify_view(pvc);
            match seen.get(&key) {
                None => {
                    if resizing {
                        rq.add(key.clone());
                    }
                    if modifying {
                        mq.add(key.clone());
                    }
                }
                Some(old) => {
                    if resizing && decide::resize_update_wanted(old, &view, recover) {
                        rq.add(key.clone());
                    }
                    if modifying && decide::modify_update_wanted(old, &mv, view.bound) {
                        mq.add(key.clone());
                    }
                }
            }
            seen.insert(key, decide::Seen::of(&view, &mv.spec));
        },
    );
    let writes = Arc::clone(&volume_writes);
    let volumes = cache::watch_compact::<Decoded<Pv>, _>(
        &c.watches,
        watcher::Config::default(),
        &shutdown,
        &mut ready,
        Decoded::into_compact,
        move |pv, deleted| {
            if deleted {
                writes.forget(pv.name());
            } else {
                writes.seen(pv.name(), pv.resource_version());
            }
        },
    );
    let pods = (resizing && cfg.handle_inuse).then(|| {
        info!(controller = %cfg.driver, "Register Pod informer for resizer");
        cache::watch::<PodUse>(&c.watches, &shutdown, &mut ready, |_| {}, |_, _| {})
    });
    let mut class_ready = Vec::new();
    // A class that appears brings back the claims waiting for it (`Pending`); upstream's class
    // informer has no handler, so they wait for their next change.
    let (class_tx, mut class_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let classes = modifying.then(|| {
        cache::watch::<VolumeAttributesClass>(
            &c.watches,
            &shutdown,
            &mut class_ready,
            |_| {},
            move |vac, deleted| {
                if !deleted {
                    let _ = class_tx.send(vac.name_any());
                }
            },
        )
    });
    if resizing {
        info!(controller = %cfg.driver, "Starting external resizer");
    }
    if modifying {
        info!(controller = %cfg.driver, "Starting external resizer for modify volume");
    }
    for r in ready {
        tokio::select! {
            res = r => if res.is_err() {
                error!("Cannot sync pod, pv or pvc caches");
                return Err(ControllerError::Sync);
            },
            () = shutdown.cancelled() => return Ok(()),
        }
    }
    let ctl = Arc::new(Controller {
        cfg,
        c,
        claims,
        volumes,
        pods,
        classes,
        claim_writes,
        volume_writes,
        resize_q,
        modify_q,
        final_errors: Mutex::default(),
        in_use_errors: Mutex::default(),
        resize_slow: SlowSetMap::default(),
        modify_slow: SlowSetMap::default(),
        uncertain: Mutex::default(),
    });
    let resync = ctl.cfg.resync.max(Duration::from_secs(1));
    let mut tasks = tokio::task::JoinSet::new();
    if resizing {
        let c = Arc::clone(&ctl);
        tasks.spawn(
            Runner::new(lane(&ctl.resize_q, ctl.cfg.workers))
                .resync(resync, move || {
                    for pvc in c.claims.state() {
                        c.resize_q.add(claim_key(&pvc.object()));
                    }
                })
                .run(
                    Arc::clone(&ctl),
                    shutdown.clone(),
                    |c, _, key| async move { c.sync_resize(&key).await },
                    |_, _, _, ()| Action::Retry,
                ),
        );
    }
    if ctl.cfg.modify {
        // The modify controller waits for the class cache on its own (as upstream's): an API
        // server that never serves the classes holds up modifying, not resizing.
        let c = Arc::clone(&ctl);
        let stop = shutdown.clone();
        tasks.spawn(async move {
            for r in class_ready {
                tokio::select! {
                    res = r => if res.is_err() {
                        error!("Cannot sync pod, pv, pvc or vac caches");
                        return;
                    },
                    () = stop.cancelled() => return,
                }
            }
            // A modification found in progress may have reached the driver: pursue its
            // target.
            {
                let mut u = set(&c.uncertain);
                for pvc in c.claims.state() {
                    let pvc = pvc.object();
                    if k::modify_view(&pvc)
                        .status
                        .is_some_and(|(s, _)| s == decide::modify_status::IN_PROGRESS)
                    {
                        u.insert(claim_key(&pvc));
                    }
                }
            }
            let r = Arc::clone(&c);
            Runner::new(lane(&c.modify_q, c.cfg.workers))
                .resync(resync, move || {
                    for pvc in r.claims.state() {
                        let pvc = pvc.object();
                        let mv = k::modify_view(&pvc);
                        if mv.status.is_none() && k::claim_view(&pvc).bound {
                            r.modify_q.add(claim_key(&pvc));
                        }
                    }
                })
                .run(
                    c,
                    stop,
                    |c, _, key| async move { c.sync_modify(&key).await },
                    |_, _, _, ()| Action::Retry,
                )
                .await;
        });
    }
    let c = Arc::clone(&ctl);
    let stop = shutdown.clone();
    tasks.spawn(async move {
        loop {
            let name = tokio::select! {
                n = class_rx.recv() => match n { Some(n) => n, None => return },
                () = stop.cancelled() => return,
            };
            for pvc in c.claims.state() {
                let pvc = pvc.object();
                let waiting = k::modify_view(&pvc)
                    .status
                    .is_some_and(|(s, t)| s == decide::modify_status::PENDING && t == name);
                if waiting {
                    c.modify_q.add(claim_key(&pvc));
                }
            }
        }
    });
    shutdown.cancelled().await;
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// The lane of `queue` with `workers` workers; none for none (`--workers=0`: as upstream, no
/// sync runs; a lane runs at least one worker).
fn lane(queue: &Arc<WorkQueue<String>>, workers: usize) -> Vec<Lane<String>> {
    if workers == 0 {
        return Vec::new();
    }
    vec![Lane::new(Arc::clone(queue), workers)]
}

fn claim_ref(pvc: &PersistentVolumeClaim) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolumeClaim".into()),
        namespace: pvc.metadata.namespace.clone(),
        name: pvc.metadata.name.clone(),
        uid: pvc.metadata.uid.clone(),
        resource_version: pvc.metadata.resource_version.clone(),
        ..ObjectReference::default()
    }
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

fn kube_error(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => s.message.clone(),
        other => other.to_string(),
    }
}

impl Controller {
    fn claim(&self, key: &str) -> Option<PersistentVolumeClaim> {
        Some(self.claims.get(key)?.object())
    }

    fn volume(&self, name: &str) -> Option<PersistentVolume> {
        Some(self.volumes.get(name)?.object())
    }

    /// Whether the cached claim `key` or its PV is older than our own last write of it.
    fn behind(&self, key: &str, pvc: &PersistentVolumeClaim, pv: &PersistentVolume) -> bool {
        self.claim_writes
            .behind(key, pvc.metadata.resource_version.as_deref())
            || self
                .volume_writes
                .behind(&pv.name_any(), pv.metadata.resource_version.as_deref())
    }

    fn event(&self, pvc: &PersistentVolumeClaim, type_: EventType, reason: &str, message: &str) {
        self.c.events.event(&claim_ref(pvc), type_, reason, message);
    }

    fn claims_api(&self, ns: &str) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.c.client.clone(), ns)
    }

    /// Patches the claim's status (a JSON merge patch; with the claim's resourceVersion as a
    /// precondition when `precondition`), remembering the returned object.
    async fn patch_claim(
        &self,
        pvc: &PersistentVolumeClaim,
        mut body: Value,
        precondition: bool,
    ) -> Result<PersistentVolumeClaim, String> {
        if precondition {
            body["metadata"]["resourceVersion"] = json!(pvc.metadata.resource_version);
        }
        let ns = pvc.metadata.namespace.as_deref().unwrap_or_default();
        let name = pvc.metadata.name.as_deref().unwrap_or_default();
        match self
            .claims_api(ns)
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(new) => {
                let cached = self.claims.get(&format!("{ns}/{name}"));
                remember(
                    &self.claim_writes,
                    claim_key(&new),
                    new.metadata.resource_version.as_deref(),
                    cached.as_deref().and_then(|c| c.resource_version()),
                );
                Ok(new)
            }
            Err(e) => Err(format!(
                "can't patch status of  PVC {ns}/{name} with {}",
                kube_error(&e)
            )),
        }
    }

    async fn patch_volume(&self, name: &str, body: Value) -> Result<PersistentVolume, String> {
        let api: Api<PersistentVolume> = Api::all(self.c.client.clone());
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(new) => {
                let cached = self.volumes.get(name);
                remember(
                    &self.volume_writes,
                    name.to_owned(),
                    new.metadata.resource_version.as_deref(),
                    cached.as_deref().and_then(|c| c.resource_version()),
                );
                Ok(new)
            }
            Err(e) => Err(kube_error(&e)),
        }
    }

    async fn secret(&self, ns: &str, name: &str) -> Result<HashMap<String, String>, String> {
        let api: Api<Secret> = Api::namespaced(self.c.client.clone(), ns);
        match api.get(name).await {
            Ok(s) => Ok(s
                .data
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
                .collect()),
            Err(e) => Err(format!(
                "error getting secret {name} in namespace {ns}: {}",
                kube_error(&e)
            )),
        }
    }

    /// Whether a running pod uses the claim `ns/name`.
    fn in_use(&self, ns: &str, name: &str) -> bool {
        let Some(pods) = &self.pods else {
            return false;
        };
        pods.state().iter().any(|p| {
            p.metadata.namespace.as_deref() == Some(ns)
                && !p.ended
                && p.claims.iter().any(|c| c == name)
        })
    }

    // ---- resizing

    /// One resize sync of the claim `key`; `Err`: failed (logged), again after its back-off.
    async fn sync_resize(&self, key: &str) -> Result<Action, ()> {
        let Some(pvc) = self.claim(key) else {
            return Ok(Action::Done);
        };
        let view = k::claim_view(&pvc);
        if view.volume_name.is_empty() {
            return Ok(Action::Done);
        }
        let Some(pv) = self.volume(&view.volume_name) else {
            error!(
                pvc = key,
                "Error syncing PVC: PV {:?} bound to pvc {key:?} not found", view.volume_name
            );
            return Err(());
        };
        if self.behind(key, &pvc, &pv) {
            return Ok(Action::After(CACHE_CATCH_UP));
        }
        if self.cfg.annotate_fs_resize
            && let Err(e) = self.clean_pre_resize_annotation(&pv, &view).await
        {
            error!(pvc = key, "Error syncing PVC: {e}");
            return Err(());
        }
        if !decide::needs_resize(&view) {
            debug!(target: "plugreg_resizer::v4", pvc = key, "No need to resize PVC");
            return Ok(Action::Done);
        }
        if !supports(&self.cfg.driver, &pv, &pvc) {
            debug!(target: "plugreg_resizer::v4", pvc = key, "Resizer doesn't support PV");
            return Ok(Action::Done);
        }
        if self.cfg.recover {
            self.expand_and_recover(key, &pvc, &pv, &view).await
        } else {
            self.expand_legacy(key, &pvc, &pv, &view).await
        }
    }

    async fn clean_pre_resize_annotation(
        &self,
        pv: &PersistentVolume,
        view: &ClaimView,
    ) -> Result<(), String> {
        let has = pv
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(k::ANN_PRE_RESIZE_CAPACITY));
        if has && view.capacity.unwrap_or(0) >= k::pv_capacity(pv) {
            let name = pv.name_any();
            self.patch_volume(
                &name,
                json!({"metadata": {"annotations": {k::ANN_PRE_RESIZE_CAPACITY: null}}}),
            )
            .await?;
        }
        Ok(())
    }

    async fn expand_and_recover(
        &self,
        key: &str,
        pvc: &PersistentVolumeClaim,
        pv: &PersistentVolume,
        view: &ClaimView,
    ) -> Result<Action, ()> {
        let pv_cap = k::pv_capacity(pv);
        let controller_expands = self.cfg.resizer == Some(Resizer::Csi);
        let in_slow_set = self
            .resize_slow
            .remaining(key, self.cfg.retry_max)
            .is_some();
        if view.resize_status.as_deref() == Some(decide::status::CONTROLLER_INFEASIBLE) {
            self.resize_slow.add(key);
        }
        let memory = Memory {
            final_error: set(&self.final_errors).contains(key),
            in_slow_set,
        };
        if decide::old_api_server(view, pv_cap) {
            warn!(
                pvc = key,
                "external-resizer may be running with older version of kubernetes api-server, please upgrade to k8s version 1.32"
            );
        }
        let (target, update_status) = match decide::resize_target(
            view,
            pv_cap,
            memory,
            controller_expands,
        ) {
            Resize::Stop => return Ok(Action::Done),
            Resize::DelayRetry => {
                let left = self
                    .resize_slow
                    .remaining(key, self.cfg.retry_max)
                    .unwrap_or(self.cfg.retry_start);
                info!(
                    pvc = key,
                    "skipping volume expansion for pvc {key}, because expansion previously failed with infeasible error"
                );
                return Ok(Action::After(left));
            }
            Resize::Expand {
                target,
                update_status,
            } => (target, update_status),
        };
        // 1. Mark the claim as resizing, with the target as allocated: from here on the
        // target is durable.
        let now = now();
        let conditions = k::merge_resize_conditions(
            k::conditions(pvc),
            vec![k::condition(k::RESIZING, "", &now)],
            !update_status,
        );
        let mut status = json!({
            "conditions": conditions,
            "allocatedResources": {"storage": format_binary_si(target)},
        });
        if update_status {
            status["allocatedResourceStatuses"] =
                json!({"storage": decide::status::CONTROLLER_IN_PROGRESS});
        }
        let body = json!({
            "metadata": {"annotations": {k::ANN_NODE_EXPANSION_NOT_REQUIRED: null}},
            "status": status,
        });
        let pvc = match self.patch_claim(pvc, body, true).await {
            Ok(p) => p,
            Err(e) => {
                error!(
                    pvc = key,
                    "Error syncing PVC: marking pvc {key:?} as resizing failed: {e}"
                );
                return Err(());
            }
        };
        self.resize_call(key, &pvc, pv, target).await?;
        Ok(Action::Done)
    }

    /// Steps 2-6 of a resize: the in-use guard, the event, the call and what follows.
    async fn resize_call(
        &self,
        key: &str,
        pvc: &PersistentVolumeClaim,
        pv: &PersistentVolume,
        target: i64,
    ) -> Result<(), ()> {
        let uid = pvc.metadata.uid.clone().unwrap_or_default();
        let (ns, name) = key.split_once('/').unwrap_or_default();
        if self.cfg.handle_inuse {
            let marked = set(&self.in_use_errors).contains(&uid);
            if marked && self.in_use(ns, name) {
                let msg = format!(
                    "Unable to expand {key} because CSI driver {} only supports offline expansion and volume is currently in-use",
                    self.cfg.driver
                );
                self.event(pvc, EventType::Warning, "VolumeResizeFailed", &msg);
                error!(pvc = key, "Error syncing PVC: {msg}");
                return Err(());
            }
            set(&self.in_use_errors).remove(&uid);
        }
        let pv_name = pv.name_any();
        self.event(
            pvc,
            EventType::Normal,
            "Resizing",
            &format!("External resizer is resizing volume {pv_name}"),
        );
        let outcome = match self.cfg.resizer {
            Some(Resizer::Csi) => self.expand_volume(pv, target).await,
            _ => Ok((target, true)),
        };
        match outcome {
            Ok((new_size, node_expansion)) => {
                set(&self.final_errors).remove(key);
                self.resize_slow.remove(key);
                self.resize_succeeded(key, pvc, pv, new_size, node_expansion)
                    .await
            }
            Err(e) => {
                self.resize_failed(key, pvc, &pv_name, &uid, e).await;
                Err(())
            }
        }
    }

    /// ControllerExpandVolume for `pv` to `target` bytes: (new size, node expansion required).
    async fn expand_volume(
        &self,
        pv: &PersistentVolume,
        target: i64,
    ) -> Result<(i64, bool), ExpandError> {
        let (spec, migrated) = expanded_spec(&self.cfg.driver, pv).map_err(ExpandError::Other)?;
        let csi = spec.csi.clone().unwrap_or_default();
        if csi.volume_handle.is_empty() {
            return Err(ExpandError::Other("empty volume handle".into()));
        }
        let secrets = match &csi.controller_expand_secret_ref {
            Some(r) => self
                .secret(
                    r.namespace.as_deref().unwrap_or_default(),
                    r.name.as_deref().unwrap_or_default(),
                )
                .await
                .map_err(ExpandError::Other)?,
            None => HashMap::new(),
        };
        let snmw = self
            .c
            .driver
            .single_node_multi_writer()
            .await
            .map_err(|e| {
                ExpandError::Other(format!(
                    "failed to get capabilities of volume {} with {}",
                    pv.name_any(),
                    error_text(&e)
                ))
            })?;
        let block = spec.volume_mode.as_deref() == Some("Block");
        let access_type = if block {
            volume_capability::AccessType::Block(volume_capability::BlockVolume {})
        } else {
            volume_capability::AccessType::Mount(volume_capability::MountVolume {
                fs_type: csi.fs_type.clone().unwrap_or_default(),
                mount_flags: spec.mount_options.clone().unwrap_or_default(),
                volume_mount_group: String::new(),
            })
        };
        let modes = spec.access_modes.clone().unwrap_or_default();
        let mode = access_mode(&modes, snmw);
        let req = ControllerExpandVolumeRequest {
            volume_id: csi.volume_handle.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: target,
                limit_bytes: 0,
            }),
            secrets,
            volume_capability: Some(VolumeCapability {
                access_mode: Some(volume_capability::AccessMode { mode: mode as i32 }),
                access_type: Some(access_type),
            }),
        };
        let resp = self
            .c
            .driver
            .expand(req, migrated)
            .await
            .map_err(ExpandError::Call)?;
        // A driver that answers no size has the target.
        let size = if resp.capacity_bytes > 0 {
            resp.capacity_bytes
        } else {
            target
        };
        Ok((size, resp.node_expansion_required))
    }

    async fn resize_succeeded(
        &self,
        key: &str,
        pvc: &PersistentVolumeClaim,
        pv: &PersistentVolume,
        new_size: i64,
        node_expansion: bool,
    ) -> Result<(), ()> {
        let pv_name = pv.name_any();
        let size = format_binary_si(new_size);
        let mut body = json!({"spec": {"capacity": {"storage": size}}});
        if self.cfg.annotate_fs_resize && node_expansion {
            let has = pv
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(k::ANN_PRE_RESIZE_CAPACITY));
            if !has {
                let old = pvc
                    .status
                    .as_ref()
                    .and_then(|s| s.capacity.as_ref()?.get("storage").cloned())
                    .map(|q| q.0)
                    .unwrap_or_default();
                body["metadata"] = json!({"annotations": {k::ANN_PRE_RESIZE_CAPACITY: old}});
            }
        }
        if let Err(e) = self.patch_volume(&pv_name, body).await {
            let msg = format!(
                "updating capacity of PV {pv_name:?} to {size} failed: error updating pv {pv_name:?} by resizer: {e}"
            );
            self.event(pvc, EventType::Warning, "VolumeResizeFailed", &msg);
            error!(pvc = key, "Error syncing PVC: {msg}");
            return Err(());
        }
        let now = now();
        if node_expansion {
            let mut status = json!({
                "conditions": k::merge_resize_conditions(
                    k::conditions(pvc),
                    vec![k::condition(k::FS_RESIZE_PENDING, k::FS_RESIZE_PENDING_MESSAGE, &now)],
                    true,
                ),
            });
            let mut body = json!({});
            if self.cfg.recover {
                status["allocatedResourceStatuses"] =
                    json!({"storage": decide::status::NODE_PENDING});
                body["metadata"] =
                    json!({"annotations": {k::ANN_NODE_EXPANSION_NOT_REQUIRED: null}});
            } else {
                status["conditions"] = json!(k::merge_resize_conditions(
                    &k::without_resize_conditions(k::conditions(pvc)),
                    vec![k::condition(
                        k::FS_RESIZE_PENDING,
                        k::FS_RESIZE_PENDING_MESSAGE,
                        &now
                    )],
                    false,
                ));
            }
            body["status"] = status;
            if let Err(e) = self.patch_claim(pvc, body, true).await {
                error!(
                    pvc = key,
                    "Error syncing PVC: mark PVC {key:?} as node expansion required failed: {e}"
                );
                return Err(());
            }
            self.event(
                pvc,
                EventType::Normal,
                "FileSystemResizeRequired",
                "Require file system resize of volume on node",
            );
        } else {
            let mut body = json!({
                "status": {
                    "capacity": {"storage": size},
                    "conditions": k::without_resize_conditions(k::conditions(pvc)),
                },
            });
            if self.cfg.recover {
                body["status"]["allocatedResourceStatuses"] = json!({"storage": null});
                body["metadata"] =
                    json!({"annotations": {k::ANN_NODE_EXPANSION_NOT_REQUIRED: "true"}});
            }
            if let Err(e) = self.patch_claim(pvc, body, true).await {
                error!(
                    pvc = key,
                    "Error syncing PVC: mark PVC {key:?} as resize finished failed: {e}"
                );
                return Err(());
            }
            self.event(
                pvc,
                EventType::Normal,
                "VolumeResizeSuccessful",
                "Resize volume succeeded",
            );
        }
        info!(pvc = key, pv = %pv_name, size = %size, "Resize volume succeeded");
        Ok(())
    }

    async fn resize_failed(
        &self,
        key: &str,
        pvc: &PersistentVolumeClaim,
        pv_name: &str,
        uid: &str,
        e: ExpandError,
    ) {
        let (class, text) = match &e {
            ExpandError::Call(c) => (decide::classify(c.code()), error_text(c)),
            ExpandError::Other(t) => (Failure::Uncertain, t.clone()),
        };
        if let ExpandError::Call(c) = &e
            && c.code() == Some(tonic::Code::FailedPrecondition)
            && self.cfg.handle_inuse
        {
            set(&self.in_use_errors).insert(uid.to_owned());
        }
        let mut msg = format!(
            "resize volume {pv_name:?} by resizer {:?} failed: {text}",
            self.cfg.driver
        );
        if self.cfg.recover {
            match class {
                Failure::Uncertain => {
                    set(&self.final_errors).remove(key);
                    self.resize_slow.remove(key);
                }
                Failure::Infeasible | Failure::Final => {
                    set(&self.final_errors).insert(key.to_owned());
                    if class == Failure::Final {
                        self.resize_slow.remove(key);
                    }
                    let now = now();
                    let cond = k::condition(
                        k::CONTROLLER_RESIZE_ERROR,
                        &format!("failed to expand pvc with {text}"),
                        &now,
                    );
                    let mut status = json!({
                        "conditions": k::merge_resize_conditions(k::conditions(pvc), vec![cond], true),
                    });
                    if class == Failure::Infeasible {
                        status["allocatedResourceStatuses"] =
                            json!({"storage": decide::status::CONTROLLER_INFEASIBLE});
                    }
                    if let Err(e2) = self
                        .patch_claim(pvc, json!({"status": status}), false)
                        .await
                    {
                        msg = format!(
                            "resizing failed in controller with {text} but failed to update PVC {key} with: {e2}"
                        );
                    }
                }
            }
        }
        self.event(pvc, EventType::Warning, "VolumeResizeFailed", &msg);
        error!(pvc = key, "Error syncing PVC: {msg}");
    }

    async fn expand_legacy(
        &self,
        key: &str,
        pvc: &PersistentVolumeClaim,
        pv: &PersistentVolume,
        view: &ClaimView,
    ) -> Result<Action, ()> {
        let Some(target) = decide::legacy_target(view, k::pv_capacity(pv)) else {
            return Ok(Action::Done);
        };
        let now = now();
        let body = json!({"status": {"conditions": k::merge_resize_conditions(
            k::conditions(pvc),
            vec![k::condition(k::RESIZING, "", &now)],
            false,
        )}});
        let pvc = match self.patch_claim(pvc, body, true).await {
            Ok(p) => p,
            Err(e) => {
                error!(
                    pvc = key,
                    "Error syncing PVC: marking pvc {key:?} as resizing failed: Mark PVC {key:?} as resize as in progress failed: {e}"
                );
                return Err(());
            }
        };
        self.resize_call(key, &pvc, pv, target).await?;
        Ok(Action::Done)
    }

    // ---- modifying

    /// One modify sync of the claim `key`; `Err`: failed (logged), again after its back-off.
    async fn sync_modify(&self, key: &str) -> Result<Action, ()> {
        let Some(pvc) = self.claim(key) else {
            return Ok(Action::Done);
        };
        let view = k::claim_view(&pvc);
        if view.volume_name.is_empty() {
            return Ok(Action::Done);
        }
        let Some(pv) = self.volume(&view.volume_name) else {
            error!(
                pvc = key,
                "Error syncing PVC: PV {:?} not found", view.volume_name
            );
            return Err(());
        };
        if self.behind(key, &pvc, &pv) {
            return Ok(Action::After(CACHE_CATCH_UP));
        }
        let ours = pv
            .spec
            .as_ref()
            .and_then(|s| s.csi.as_ref())
            .is_some_and(|c| c.driver == self.cfg.driver);
        if !ours || !view.bound {
            return Ok(Action::Done);
        }
        let mv = k::modify_view(&pvc);
        let in_slow = self
            .modify_slow
            .remaining(key, self.cfg.retry_max)
            .is_some();
        let uncertain = set(&self.uncertain).contains(key);
        let (slow, action) = decide::modify_decision(&mv, in_slow, uncertain);
        match slow {
            SlowSet::Add => self.modify_slow.add(key),
            SlowSet::Remove => self.modify_slow.remove(key),
            SlowSet::Keep => {}
        }
        match action {
            Modify::Nothing => Ok(Action::Done),
            Modify::SlowSkip => {
                error!(
                    pvc = key,
                    "Error syncing PVC: skipping volume modification for pvc {key}, because modification previously failed with infeasible error"
                );
                Err(())
            }
            Modify::Cancel => {
                if mv.modifying_condition {
                    self.event(
                        &pvc,
                        EventType::Normal,
                        "VolumeModifyCanceled",
                        "Cancelled modify.",
                    );
                    let conditions: Vec<_> = k::conditions(&pvc)
                        .iter()
                        .filter(|c| c.type_ != k::MODIFYING_VOLUME)
                        .cloned()
                        .collect();
                    if let Err(e) = self
                        .patch_claim(&pvc, json!({"status": {"conditions": conditions}}), false)
                        .await
                    {
                        error!(pvc = key, "Error syncing PVC: {e}");
                        return Err(());
                    }
                }
                Ok(Action::Done)
            }
            Modify::Continue(target) => {
                let Some(vac) = self.class(&target) else {
                    error!(
                        pvc = key,
                        "Error syncing PVC: volumeattributesclass.storage.k8s.io {target:?} not found"
                    );
                    return Err(());
                };
                self.modify_call(key, &pvc, &pv, &vac).await?;
                Ok(Action::Done)
            }
            Modify::Start(target) => {
                let Some(vac) = self.class(&target) else {
                    let msg = format!("VAC {target:?} does not exist.");
                    self.event(&pvc, EventType::Warning, "VolumeModifyFailed", &msg);
                    let body = json!({"status": {"modifyVolumeStatus": {
                        "status": decide::modify_status::PENDING,
                        "targetVolumeAttributesClassName": target,
                    }}});
                    if let Err(e) = self.patch_claim(&pvc, body, true).await {
                        error!(pvc = key, "Error syncing PVC: {e}");
                        return Err(());
                    }
                    // As upstream: no requeue; the claim's next change (or the resync of
                    // claims without a modify status) brings it back.
                    return Ok(Action::Done);
                };
                let now = now();
                let cond = k::condition(
                    k::MODIFYING_VOLUME,
                    &format!("Modifying volume to {target:?} is in progress."),
                    &now,
                );
                let body = json!({"status": {
                    "modifyVolumeStatus": {
                        "status": decide::modify_status::IN_PROGRESS,
                        "targetVolumeAttributesClassName": target,
                    },
                    "conditions": k::merge_modify_conditions(k::conditions(&pvc), &[cond], &[], &now),
                }});
                let pvc = match self.patch_claim(&pvc, body, true).await {
                    Ok(p) => p,
                    Err(e) => {
                        error!(pvc = key, "Error syncing PVC: {e}");
                        return Err(());
                    }
                };
                self.event(
                    &pvc,
                    EventType::Normal,
                    "VolumeModify",
                    &format!(
                        "external resizer is modifying volume {} with vac {target}",
                        pvc.name_any()
                    ),
                );
                self.modify_call(key, &pvc, &pv, &vac).await?;
                Ok(Action::Done)
            }
        }
    }

    fn class(&self, name: &str) -> Option<Arc<VolumeAttributesClass>> {
        self.classes.as_ref()?.get(&reflector::ObjectRef::new(name))
    }

    async fn modify_call(
        &self,
        key: &str,
        pvc: &PersistentVolumeClaim,
        pv: &PersistentVolume,
        vac: &VolumeAttributesClass,
    ) -> Result<(), ()> {
        let target = vac.name_any();
        let csi = pv
            .spec
            .as_ref()
            .and_then(|s| s.csi.clone())
            .unwrap_or_default();
        let ann = pv.metadata.annotations.clone().unwrap_or_default();
        let secret_ref = match (
            ann.get(k::ANN_MODIFY_SECRET_NAME),
            ann.get(k::ANN_MODIFY_SECRET_NAMESPACE),
        ) {
            (Some(n), Some(ns)) => Some((ns.clone(), n.clone())),
            _ => csi.controller_expand_secret_ref.as_ref().map(|r| {
                (
                    r.namespace.clone().unwrap_or_default(),
                    r.name.clone().unwrap_or_default(),
                )
            }),
        };
        let secrets = match secret_ref {
            Some((ns, n)) => match self.secret(&ns, &n).await {
                Ok(s) => s,
                Err(e) => {
                    error!(
                        pvc = key,
                        "Error syncing PVC: cannot get error status from modify volume err: {e}"
                    );
                    return Err(());
                }
            },
            None => HashMap::new(),
        };
        let mut params: HashMap<String, String> = vac.parameters.clone().into_iter().collect();
        if self.cfg.extra_modify_metadata {
            params.insert("csi.storage.k8s.io/pvc/name".into(), pvc.name_any());
            params.insert(
                "csi.storage.k8s.io/pvc/namespace".into(),
                pvc.namespace().unwrap_or_default(),
            );
            params.insert("csi.storage.k8s.io/pv/name".into(), pv.name_any());
        }
        let req = ControllerModifyVolumeRequest {
            volume_id: csi.volume_handle.clone(),
            secrets,
            mutable_parameters: params,
        };
        match self.c.driver.modify(req).await {
            Ok(()) => {
                set(&self.uncertain).remove(key);
                if let Err(e) = self
                    .patch_volume(
                        &pv.name_any(),
                        json!({"spec": {"volumeAttributesClassName": target}}),
                    )
                    .await
                {
                    error!(
                        pvc = key,
                        "Error syncing PVC: cannot get error status from modify volume err: {e}"
                    );
                    return Err(());
                }
                let conditions: Vec<_> = k::conditions(pvc)
                    .iter()
                    .filter(|c| c.type_ != k::MODIFYING_VOLUME && c.type_ != k::MODIFY_VOLUME_ERROR)
                    .cloned()
                    .collect();
                let body = json!({"status": {
                    "currentVolumeAttributesClassName": target,
                    "modifyVolumeStatus": null,
                    "conditions": conditions,
                }});
                if let Err(e) = self.patch_claim(pvc, body, false).await {
                    error!(
                        pvc = key,
                        "Error syncing PVC: cannot get error status from modify volume err: {e}"
                    );
                    return Err(());
                }
                self.event(
                    pvc,
                    EventType::Normal,
                    "VolumeModifySuccessful",
                    &format!(
                        "external resizer modified volume {} with vac {target} successfully",
                        pvc.name_any()
                    ),
                );
                Ok(())
            }
            Err(e) => {
                self.modify_failed(key, pvc, &target, &e).await;
                Err(())
            }
        }
    }

    async fn modify_failed(
        &self,
        key: &str,
        pvc: &PersistentVolumeClaim,
        target: &str,
        e: &CallError,
    ) {
        let status = e.to_status();
        let code = status.code();
        let text = error_text(e);
        let uncertain = decide::modify_uncertain(code);
        let now = now();
        let (state, modifying_msg, event) = if uncertain {
            set(&self.uncertain).insert(key.to_owned());
            (
                decide::modify_status::IN_PROGRESS,
                format!("Modifying volume to {target:?} is still in progress."),
                format!("{text}. Still modifying to VAC {target}"),
            )
        } else {
            set(&self.uncertain).remove(key);
            let infeasible = code == tonic::Code::InvalidArgument;
            if infeasible {
                self.modify_slow.add(key);
            }
            (
                if infeasible {
                    decide::modify_status::INFEASIBLE
                } else {
                    decide::modify_status::IN_PROGRESS
                },
                format!("Modifying volume to {target:?} failed. Waiting for retry."),
                text.clone(),
            )
        };
        let mut err_cond = k::condition(k::MODIFY_VOLUME_ERROR, status.message(), &now);
        err_cond.reason = Some(plugreg_runtime::report::go_code(code).to_owned());
        let conds = [
            k::condition(k::MODIFYING_VOLUME, &modifying_msg, &now),
            err_cond,
        ];
        let body = json!({"status": {
            "modifyVolumeStatus": {"status": state, "targetVolumeAttributesClassName": target},
            "conditions": k::merge_modify_conditions(k::conditions(pvc), &conds, &[], &now),
        }});
        if let Err(e2) = self.patch_claim(pvc, body, true).await {
            error!(pvc = key, "Error syncing PVC: {e2}");
        }
        self.event(pvc, EventType::Warning, "VolumeModifyFailed", &event);
        error!(pvc = key, "Error syncing PVC: {text}");
    }
}

/// How an expansion failed.
#[derive(Debug)]
enum ExpandError {
    /// The driver's answer (or its absence).
    Call(CallError),
    /// Before the call (secrets, handle, capabilities).
    Other(String),
}

/// The CSI spec ControllerExpandVolume is built from, and whether it was translated (the
/// `migrated` metrics label): a CSI PV's own; an in-tree PV translated when `driver` is a
/// migration target (upstream's errors otherwise: the ownership check lets such a PV through
/// only by the claim's resizer annotation).
fn expanded_spec(
    driver: &str,
    pv: &PersistentVolume,
) -> Result<(k8s_openapi::api::core::v1::PersistentVolumeSpec, bool), String> {
    let spec = pv.spec.clone().unwrap_or_default();
    if spec.csi.is_some() {
        return Ok((spec, false));
    }
    if migration::in_tree_plugin(driver).is_none() {
        return Err(format!("volume {} is not migrated to CSI", pv.name_any()));
    }
    let translated = migration::translate_in_tree_pv_to_csi(pv)
        .map_err(|e| format!("failed to translate persistent volume: {e}"))?;
    Ok((translated.spec.unwrap_or_default(), true))
}

/// The CSI access mode of a PV's access modes (external-resizer takes the PV's modes as the
/// attacher does): the widest mode wins.
fn access_mode(modes: &[String], snmw: bool) -> volume_capability::access_mode::Mode {
    use volume_capability::access_mode::Mode;
    let has = |m: &str| modes.iter().any(|x| x == m);
    if has("ReadWriteMany") {
        Mode::MultiNodeMultiWriter
    } else if has("ReadOnlyMany") {
        Mode::MultiNodeReaderOnly
    } else if has("ReadWriteOncePod") {
        if snmw {
            Mode::SingleNodeSingleWriter
        } else {
            Mode::SingleNodeWriter
        }
    } else if snmw {
        Mode::SingleNodeMultiWriter
    } else {
        Mode::SingleNodeWriter
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volume_capability::access_mode::Mode;

    #[test]
    fn access_modes_follow_the_widest() {
        let m = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            access_mode(&m(&["ReadWriteOnce"]), false),
            Mode::SingleNodeWriter
        );
        assert_eq!(
            access_mode(&m(&["ReadWriteOnce"]), true),
            Mode::SingleNodeMultiWriter
        );
        assert_eq!(
            access_mode(&m(&["ReadWriteOncePod"]), true),
            Mode::SingleNodeSingleWriter
        );
        assert_eq!(
            access_mode(&m(&["ReadWriteOnce", "ReadWriteMany"]), false),
            Mode::MultiNodeMultiWriter
        );
        assert_eq!(
            access_mode(&m(&["ReadOnlyMany"]), false),
            Mode::MultiNodeReaderOnly
        );
    }

    /// Checklist 6: only our driver's PV bound to this very claim (namespace and UID).
    #[test]
    fn supports_only_our_pv_bound_to_this_claim() {
        let pvc = |uid: &str| -> PersistentVolumeClaim {
            serde_json::from_value(
                json!({"metadata": {"name": "c", "namespace": "ns", "uid": uid}}),
            )
            .unwrap()
        };
        let pv = |driver: &str, ns: &str, uid: &str| -> PersistentVolume {
            serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": {
                "csi": {"driver": driver, "volumeHandle": "h"},
                "claimRef": {"namespace": ns, "name": "c", "uid": uid}}}))
            .unwrap()
        };
        assert!(supports("d", &pv("d", "ns", "u1"), &pvc("u1")));
        assert!(
            !supports("d", &pv("d", "ns", "u0"), &pvc("u1")),
            "UID mismatch"
        );
        assert!(
            !supports("d", &pv("d", "other", "u1"), &pvc("u1")),
            "namespace"
        );
        assert!(
            !supports("d", &pv("e", "ns", "u1"), &pvc("u1")),
            "other driver"
        );
        let mut unbound = pv("d", "ns", "u1");
        unbound.spec.as_mut().unwrap().claim_ref = None;
        assert!(!supports("d", &unbound, &pvc("u1")), "no claimRef");
    }

    /// Checklist 31-33: a migration target takes any PV of a claim whose resizer annotation
    /// names it (upstream's `CanSupport`); another driver never does; the spec expanded is the
    /// translated one.
    #[test]
    fn a_migration_target_takes_claims_annotated_for_it() {
        const EBS: &str = "ebs.csi.aws.com";
        let pvc = |resizer: Option<&str>| -> PersistentVolumeClaim {
            let annotations = resizer.map(|r| json!({k::ANN_STORAGE_RESIZER: r}));
            serde_json::from_value(
                json!({"metadata": {"name": "c", "namespace": "ns", "uid": "u1",
                "annotations": annotations}}),
            )
            .unwrap()
        };
        let in_tree: PersistentVolume = serde_json::from_value(json!({"metadata": {"name": "p"},
            "spec": {"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/vol-1"},
                "claimRef": {"namespace": "ns", "name": "c", "uid": "u1"}}}))
        .unwrap();
        let nfs: PersistentVolume = serde_json::from_value(json!({"metadata": {"name": "n"},
            "spec": {"nfs": {"server": "s", "path": "/"},
                "claimRef": {"namespace": "ns", "name": "c", "uid": "u1"}}}))
        .unwrap();
        assert!(supports(EBS, &in_tree, &pvc(Some(EBS))));
        assert!(supports(EBS, &nfs, &pvc(Some(EBS))), "whatever the PV");
        assert!(!supports(EBS, &in_tree, &pvc(None)), "not handed over");
        assert!(
            !supports(
                "hostpath.csi.k8s.io",
                &in_tree,
                &pvc(Some("hostpath.csi.k8s.io"))
            ),
            "33: no migration driver"
        );

        let (spec, migrated) = expanded_spec(EBS, &in_tree).unwrap();
        assert!(migrated);
        assert_eq!(spec.csi.unwrap().volume_handle, "vol-1");
        assert_eq!(
            expanded_spec(EBS, &nfs).unwrap_err(),
            "failed to translate persistent volume: could not find in-tree plugin translation logic for \"n\""
        );
        assert_eq!(
            expanded_spec("hostpath.csi.k8s.io", &nfs).unwrap_err(),
            "volume n is not migrated to CSI"
        );
    }

    /// Our write is remembered only until the watch delivers it (or something newer), also
    /// when the watch comes before the answer: before, each claim's last answer stayed for good.
    #[test]
    fn our_writes_are_forgotten_once_the_watch_has_them() {
        let w = Writes::default();
        remember(&w, "ns/c".into(), Some("7"), Some("6"));
        // An older object from the watch: the cache is behind, ours stays.
        w.seen("ns/c", Some("6"));
        assert!(w.behind("ns/c", Some("6")));
        // The watch catches up: ours goes.
        w.seen("ns/c", Some("7"));
        assert!(w.is_empty());
        // An answer the watch has delivered already (or something newer) is not kept: the
        // watch came first, and nothing would forget it.
        remember(&w, "ns/c".into(), Some("8"), Some("8"));
        remember(&w, "ns/c".into(), Some("7"), Some("8"));
        assert!(w.is_empty());
        // No cached copy to compare with: kept.
        remember(&w, "ns/c".into(), Some("9"), None);
        assert!(w.behind("ns/c", Some("8")));
    }

    #[tokio::test(start_paused = true)]
    async fn the_slow_set_holds_for_its_window() {
        let s = SlowSetMap::default();
        let w = Duration::from_secs(10);
        assert!(s.remaining("a", w).is_none());
        s.add("a");
        assert_eq!(s.remaining("a", w), Some(w));
        tokio::time::advance(Duration::from_secs(4)).await;
        s.add("a");
        assert_eq!(s.remaining("a", w), Some(Duration::from_secs(6)));
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(s.remaining("a", w).is_none());
    }
}
