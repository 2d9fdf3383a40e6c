//! The controller: watch caches (kube-runtime reflectors) of VolumeAttachments,
//! PersistentVolumes and (with the real handler) CSINodes; three work queues, whose workers,
//! back-off and resync are the kit's [`runtime`](plugreg_sidecar_kit::runtime)'s; the
//! ListVolumes reconciler. Decisions are [`crate::decide`]'s; this module carries them out.
//!
//! Better than upstream (external-attacher #706, #761): attaches and detaches wait in separate
//! queues (`csi-attacher-va` and `csi-attacher-va-detach`, each with `--worker-threads`
//! workers), so a crowd of detaches cannot starve attaches or the other way round; the two are
//! lanes of one [`Runner`], which never lets them work on the same VolumeAttachment at once
//! (the PV queue has a runner of its own: PV names are another key space); and each queue's
//! backlog and the age of its oldest waiting item are in `/metrics`
//! (`csi_attacher_queue_backlog`, `csi_attacher_queue_oldest_waiting_seconds`).
//!
//! A failed sync waits out its back-off (`--retry-interval-start` doubling to
//! `--retry-interval-max`): a watch event that brings nothing new since the failed attempt
//! (its own finalizer write, its `attachError`) does not cut it short. Upstream's queue runs
//! the key again at once when its own finalizer write comes back while the publish fails, so
//! its first retry comes at once and its second after one start interval; here they come
//! after one and two.
//!
//! A publish that may have attached something is never forgotten: the VolumeAttachment's
//! finalizer is written before ControllerPublishVolume is called, so its deletion always goes
//! through ControllerUnpublishVolume, whatever the publish answered.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, Secret, SecretReference};
use k8s_openapi::api::storage::v1::{CSINode, VolumeAttachment};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use plugreg_runtime::prom;
use plugreg_sidecar_kit::cache::{self, CompactStore};
use plugreg_sidecar_kit::metrics::{Collector, Families, Metrics};
use plugreg_sidecar_kit::queue::WorkQueue;
use plugreg_sidecar_kit::runtime::{Action, Lane, LaneId, Runner, Writes};
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info};

use crate::cached::{Compact, Decoded, Pv, Va};
use crate::csi::{Driver, RpcFailure};
use crate::decide::{self, DriverCaps};

/// The attach queue's name (upstream's single VolumeAttachment queue).
pub const ATTACH_QUEUE: &str = "csi-attacher-va";
/// The detach queue's name (plugreg's own: upstream has one queue for both).
pub const DETACH_QUEUE: &str = "csi-attacher-va-detach";
/// The PV queue's name.
pub const PV_QUEUE: &str = "csi-attacher-pv";

/// The detach queue's lane in the VolumeAttachment runner (the attach queue's is 0).
const DETACH_LANE: LaneId = 1;

/// What the controller needs to know.
#[derive(Debug, Clone)]
pub struct Config {
    /// The driver name (GetPluginInfo).
    pub driver: String,
    /// What the driver can do.
    pub caps: DriverCaps,
    /// `--default-fstype`.
    pub default_fstype: String,
    /// `--worker-threads` (per queue).
    pub workers: usize,
    /// `--retry-interval-start`.
    pub retry_start: Duration,
    /// `--retry-interval-max`.
    pub retry_max: Duration,
    /// `--resync`.
    pub resync: Duration,
    /// `--reconcile-sync`.
    pub reconcile_sync: Duration,
    /// `--timeout` (the budget of one reconcile).
    pub timeout: Duration,
    /// `--max-entries`.
    pub max_entries: i32,
    /// MutableCSINodeAllocatableCount: write `attachError.errorCode`.
    pub error_codes: bool,
}

/// Who the controller talks to.
#[derive(Clone)]
pub struct Clients {
    /// Where the watch caches get their events.
    pub watches: cache::Watches,
    /// The rate-limited Kubernetes client.
    pub kube: Client,
    /// The driver.
    pub driver: Driver,
    /// Where the queue metrics go.
    pub metrics: Arc<Metrics>,
}

/// How the controller ended badly.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A watch cache never filled.
    #[error("Cannot sync caches")]
    Sync,
}

/// A failed sync: the key goes back through its queue's back-off.
#[derive(Debug)]
struct Requeue(String);

/// How a PV patch is sent: the finalizer is added by a JSON Patch (RFC 6902) whose `test`
/// makes a concurrent change fail it instead of being undone, and removed by value with a
/// strategic-merge patch ([`decide::pv_remove_finalizer_patch`]).
#[derive(Debug, Clone, Copy)]
enum PatchKind {
    Json,
    Strategic,
}

/// For each VolumeAttachment whose last sync failed, the [`decide::sync_fingerprint`] of what
/// that sync left (the object after its own writes, errors aside).
#[derive(Default, Clone)]
struct Failed(Arc<Mutex<HashMap<String, u64>>>);

impl Failed {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the cached `va` is what the failed sync of it left.
    fn unchanged(&self, name: &str, va: &VolumeAttachment) -> bool {
        self.map().get(name) == Some(&decide::sync_fingerprint(va))
    }
}

/// The fingerprint of `written` (a write's answer) as the watch cache will hold it.
fn cached_fingerprint(written: VolumeAttachment) -> u64 {
    decide::sync_fingerprint(&Compact::<Va>::new(written).object())
}

type Queue = Arc<WorkQueue<String>>;

/// `csi_attacher_queue_backlog` and `csi_attacher_queue_oldest_waiting_seconds` of the three
/// queues.
struct Backlog {
    queues: Vec<Queue>,
}

impl std::fmt::Debug for Backlog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Backlog")
    }
}

impl Collector for Backlog {
    fn collect(&self, families: &mut Families) {
        let names = [ATTACH_QUEUE, DETACH_QUEUE, PV_QUEUE];
        families.samples(
            "csi_attacher_queue_backlog",
            "Items waiting in each work queue (not counting those being worked on or in back-off).",
            "gauge",
            self.queues
                .iter()
                .zip(names)
                .map(|(q, n)| (prom::labels(&[("name", n)]), q.len() as f64)),
        );
        families.samples(
            "csi_attacher_queue_oldest_waiting_seconds",
            "How long the oldest waiting item of each work queue has waited (0 when none waits).",
            "gauge",
            self.queues.iter().zip(names).map(|(q, n)| {
                (
                    prom::labels(&[("name", n)]),
                    q.oldest_wait().map_or(0.0, |d| d.as_secs_f64()),
                )
            }),
        );
    }
}

struct Controller {
    cfg: Config,
    fin: String,
    clients: Clients,
    vas: CompactStore<Compact<Va>>,
    pvs: CompactStore<Compact<Pv>>,
    csinodes: Option<Store<CSINode>>,
    attach_q: Queue,
    detach_q: Queue,
    pv_q: Queue,
    /// VolumeAttachments the reconciler found out of step with the driver: their next sync
    /// skips the "already attached / detached" rules (consumed by it).
    forced: Mutex<HashSet<String>>,
    /// The resource version of this process's last write of each VolumeAttachment that its
    /// watch will report as a change worth a sync (finalizer, `attached`). A sync that finds
    /// the cache older would act on what it already changed (a second ControllerPublishVolume
    /// and status write, upstream does both); it waits for the watch event of that write
    /// instead, which queues the VolumeAttachment again.
    written: Arc<Writes<String>>,
    failed: Failed,
}

/// Runs until `shutdown` (Ok) or until a cache cannot be filled (Err).
pub async fn run(
    cfg: Config,
    clients: Clients,
    shutdown: CancellationToken,
) -> Result<(), ControllerError> {
    let queue = |name| {
        WorkQueue::new(
            name,
            cfg.retry_start,
            cfg.retry_max,
            Arc::clone(&clients.metrics),
            shutdown.clone(),
        )
    };
    let (attach_q, detach_q, pv_q): (Queue, Queue, Queue) =
        (queue(ATTACH_QUEUE), queue(DETACH_QUEUE), queue(PV_QUEUE));
    clients.metrics.register(
        "attacher-backlog",
        Arc::new(Backlog {
            queues: vec![
                Arc::clone(&attach_q),
                Arc::clone(&detach_q),
                Arc::clone(&pv_q),
            ],
        }),
    );
    let fin = decide::finalizer(&cfg.driver);

    let mut ready = Vec::new();
    let fingerprints: Mutex<HashMap<String, u64>> = Mutex::default();
    let written: Arc<Writes<String>> = Arc::default();
    let w = Arc::clone(&written);
    let failed = Failed::default();
    let f = failed.clone();
    let (aq, dq, pq, driver) = (
        Arc::clone(&attach_q),
        Arc::clone(&detach_q),
        Arc::clone(&pv_q),
        cfg.driver.clone(),
    );
    let vas = cache::watch_compact::<Decoded<Va>, _>(
        &clients.watches,
        watcher::Config::default(),
        &shutdown,
        &mut ready,
        Decoded::into_compact,
        move |va, deleted| {
            let va = &va.object();
            let name = va.name_any();
            if deleted {
                fingerprints
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&name);
                w.forget(&name);
                f.map().remove(&name);
                if let Some(pv) = &va.spec.source.persistent_volume_name {
                    pq.add(pv.clone());
                }
                return;
            }
            if !decide::is_ours(va, &driver) {
                return;
            }
            let fp = decide::sync_fingerprint(va);
            let changed = fingerprints
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name.clone(), fp)
                != Some(fp);
            if changed {
                route(&aq, &dq, va, name);
            }
        },
    );
    let (pq, f2, driver) = (Arc::clone(&pv_q), fin.clone(), cfg.driver.clone());
    let pvs = cache::watch_compact::<Decoded<Pv>, _>(
        &clients.watches,
        watcher::Config::default(),
        &shutdown,
        &mut ready,
        Decoded::into_compact,
        move |pv, deleted| {
            if !deleted && decide::pv_needs_sync(&pv.object(), &f2, &driver) {
                pq.add(pv.name().to_owned());
            }
        },
    );
    // Not waited for at start (upstream neither): a VolumeAttachment failing on a CSINode
    // not cached yet is retried by its back-off.
    let mut not_waited = Vec::new();
    let csinodes = cfg.caps.real_handler().then(|| {
        let driver = cfg.driver.clone();
        cache::watch::<CSINode>(
            &clients.watches,
            &shutdown,
            &mut not_waited,
            move |n| n.spec.drivers.retain(|d| d.name == driver),
            |_, _| {},
        )
    });

    info!("Starting CSI attacher");
    for r in ready {
        tokio::select! {
            res = r => if res.is_err() {
                error!("Cannot sync caches");
                return Err(ControllerError::Sync);
            },
            () = shutdown.cancelled() => return Ok(()),
        }
    }

    let ctl = Arc::new(Controller {
        fin,
        clients,
        vas,
        pvs,
        csinodes,
        attach_q,
        detach_q,
        pv_q,
        forced: Mutex::default(),
        written,
        failed,
        cfg,
    });

    // Upstream's informers resync every --resync: every object (PVs too) is synced again.
    let c = Arc::clone(&ctl);
    let vas = Runner::new(vec![
        Lane::new(Arc::clone(&ctl.attach_q), ctl.cfg.workers),
        Lane::new(Arc::clone(&ctl.detach_q), ctl.cfg.workers),
    ])
    .resync(ctl.cfg.resync, move || c.resync())
    .run(
        Arc::clone(&ctl),
        shutdown.clone(),
        |c: Arc<Controller>, lane, key: String| async move {
            c.sync_va(&key, lane == DETACH_LANE).await
        },
        |_: &Controller, _, key: &String, Requeue(e)| {
            debug!(VolumeAttachment = %key, err = %e, "Error processing");
            Action::Retry
        },
    );
    let pvs =
        Runner::new(vec![Lane::new(Arc::clone(&ctl.pv_q), ctl.cfg.workers)]).run(
            Arc::clone(&ctl),
            shutdown.clone(),
            |c: Arc<Controller>, _, key: String| async move {
                c.sync_pv(&key).await.map(|()| Action::Done)
            },
            |_: &Controller, _, key: &String, Requeue(e)| {
                debug!(PersistentVolume = %key, err = %e, "Error processing");
                Action::Retry
            },
        );
    let reconciler = async {
        if !ctl.cfg.caps.reconciles() {
            return;
        }
        info!(
            "CSI driver supports list volumes published nodes. Using capability to reconcile volume attachment objects with actual backend state"
        );
        loop {
            ctl.reconcile().await;
            tokio::select! {
                () = tokio::time::sleep(ctl.cfg.reconcile_sync) => {}
                () = shutdown.cancelled() => return,
            }
        }
    };
    tokio::join!(vas, pvs, reconciler);
    info!("Shutting CSI attacher");
    Ok(())
}

/// Queues `va` where it belongs: the detach queue once it is being deleted, else the attach
/// queue.
fn route(attach: &Queue, detach: &Queue, va: &VolumeAttachment, name: String) {
    if decide::deleting(va) {
        detach.add(name);
    } else {
        attach.add(name);
    }
}

/// The message of an API error as client-go prints it (`secrets "x" not found`).
fn api_message(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => s.message.clone(),
        other => other.to_string(),
    }
}

fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

impl Controller {
    fn va_api(&self) -> Api<VolumeAttachment> {
        Api::all(self.clients.kube.clone())
    }

    /// The cached VolumeAttachment `name`, as the decisions read it.
    fn va(&self, name: &str) -> Option<VolumeAttachment> {
        Some(self.vas.get(name)?.object())
    }

    /// The cached PersistentVolume `name`, as the decisions read it.
    fn pv(&self, name: &str) -> Option<PersistentVolume> {
        Some(self.pvs.get(name)?.object())
    }

    fn csinode(&self, node: &str) -> Option<Arc<CSINode>> {
        self.csinodes
            .as_ref()?
            .get(&reflector::ObjectRef::new(node))
    }

    fn take_forced(&self, name: &str) -> bool {
        self.forced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)
    }

    /// Every cached object into its queue again (`--resync`).
    fn resync(&self) {
        for va in self.vas.state() {
            let va = va.object();
            if decide::is_ours(&va, &self.cfg.driver) {
                route(&self.attach_q, &self.detach_q, &va, va.name_any());
            }
        }
        for pv in self.pvs.state() {
            if decide::pv_needs_sync(&pv.object(), &self.fin, &self.cfg.driver) {
                self.pv_q.add(pv.name().to_owned());
            }
        }
    }

    /// Remembers our write of a VolumeAttachment, `written` the API server's answer.
    fn wrote(&self, written: &VolumeAttachment) {
        self.written.record(
            written.name_any(),
            written.metadata.resource_version.as_deref(),
        );
    }

    /// One sync of the VolumeAttachment `name` from the attach (`detach` false) or detach
    /// queue; the runtime has it reconciled by no other worker meanwhile.
    async fn sync_va(&self, name: &str, detach: bool) -> Result<Action, Requeue> {
        let Some(va) = self.va(name) else {
            debug!(
                VolumeAttachment = name,
                "VolumeAttachment was deleted, ignoring"
            );
            return Ok(Action::Done);
        };
        if !decide::is_ours(&va, &self.cfg.driver) {
            return Ok(Action::Done);
        }
        if decide::deleting(&va) != detach {
            // Its state changed after it was queued: the other queue's.
            route(&self.attach_q, &self.detach_q, &va, name.to_owned());
            return Ok(Action::Done);
        }
        if self
            .written
            .behind(name, va.metadata.resource_version.as_deref())
        {
            debug!(
                VolumeAttachment = name,
                "cache older than our last write; its watch event queues it again"
            );
            return Ok(Action::Wait);
        }
        let queue = if detach {
            &self.detach_q
        } else {
            &self.attach_q
        };
        if queue.is_waiting(name) && self.failed.unchanged(name, &va) {
            debug!(
                VolumeAttachment = name,
                "unchanged since its last attempt failed; waiting out its back-off"
            );
            return Ok(Action::Wait);
        }
        let forced = self.take_forced(name);
        let mut left = decide::sync_fingerprint(&va);
        let result = match decide::decide(&va, &self.cfg.driver, &self.cfg.caps, forced) {
            decide::Action::Nothing(why) => {
                debug!(VolumeAttachment = name, "{why}");
                Ok(())
            }
            decide::Action::MarkAttached => self.mark_attached(&va).await,
            decide::Action::Attach => self.attach(&va, &mut left).await,
            decide::Action::Detach => self.detach(&va).await,
        };
        let mut failed = self.failed.map();
        match result {
            Ok(()) => {
                failed.remove(name);
                Ok(Action::Done)
            }
            Err(e) => {
                failed.insert(name.to_owned(), left);
                Err(e)
            }
        }
    }

    async fn mark_attached(&self, va: &VolumeAttachment) -> Result<(), Requeue> {
        let name = va.name_any();
        match self
            .va_api()
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(decide::trivially_attached_patch()),
            )
            .await
        {
            Ok(_) => {
                debug!(VolumeAttachment = %name, "Marked VolumeAttachment as attached");
                Ok(())
            }
            Err(e) => {
                error!(VolumeAttachment = %name, err = %e, "Error saving VolumeAttachment as attached");
                Err(Requeue(e.to_string()))
            }
        }
    }

    /// The secrets of `secret`, every `data` key as a string, or upstream's error.
    async fn secrets(
        &self,
        secret: Option<&SecretReference>,
    ) -> Result<HashMap<String, String>, String> {
        let Some(r) = secret else {
            return Ok(HashMap::new());
        };
        let (ns, name) = (
            r.namespace.clone().unwrap_or_default(),
            r.name.clone().unwrap_or_default(),
        );
        let api: Api<Secret> = Api::namespaced(self.clients.kube.clone(), &ns);
        let s = api
            .get(&name)
            .await
            .map_err(|e| format!("failed to load secret \"{ns}/{name}\": {}", api_message(&e)))?;
        Ok(s.data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
            .collect())
    }

    /// A patch of `kind` on the PV `name`.
    async fn patch_pv(&self, name: &str, patch: &Value, kind: PatchKind) -> Result<(), String> {
        let body = serde_json::to_vec(patch).map_err(|e| e.to_string())?;
        let content_type = match kind {
            PatchKind::Json => "application/json-patch+json",
            PatchKind::Strategic => "application/strategic-merge-patch+json",
        };
        let req = http::Request::patch(format!("/api/v1/persistentvolumes/{name}"))
            .header(http::header::CONTENT_TYPE, content_type)
            .body(body)
            .map_err(|e| e.to_string())?;
        self.clients
            .kube
            .request::<PersistentVolume>(req)
            .await
            .map(drop)
            .map_err(|e| api_message(&e))
    }

    /// Saves an attach error (a failed save is logged and ignored) and returns the sync error.
    async fn attach_failed(
        &self,
        va: &VolumeAttachment,
        message: &str,
        code: Option<i32>,
    ) -> Requeue {
        let name = va.name_any();
        let code = code.filter(|_| self.cfg.error_codes);
        let patch = decide::attach_error_patch(message, &now_rfc3339(), code);
        if let Err(e) = self
            .va_api()
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            debug!(VolumeAttachment = %name, err = %e, "Failed to save attach error to VolumeAttachment");
        }
        Requeue(format!("failed to attach: {message}"))
    }

    async fn detach_failed(&self, va: &VolumeAttachment, message: &str) -> Requeue {
        let name = va.name_any();
        let patch = decide::detach_error_patch(message, &now_rfc3339());
        if let Err(e) = self
            .va_api()
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            debug!(VolumeAttachment = %name, err = %e, "Failed to save detach error to VolumeAttachment");
        }
        Requeue(format!("failed to detach: {message}"))
    }

    /// Attaches `va`; `left` becomes the fingerprint of what its writes made of it.
    async fn attach(&self, va: &VolumeAttachment, left: &mut u64) -> Result<(), Requeue> {
        let name = va.name_any();
        debug!(VolumeAttachment = %name, "Attaching");
        let pv = va
            .spec
            .source
            .persistent_volume_name
            .as_ref()
            .and_then(|p| self.pv(p));
        let csinode = self.csinode(&va.spec.node_name);
        let plan = match decide::attach_plan(
            va,
            &self.cfg.driver,
            &self.cfg.caps,
            &self.cfg.default_fstype,
            pv.as_ref(),
            csinode.as_deref(),
        ) {
            Ok(p) => p,
            Err(e) => return Err(self.attach_failed(va, &e, None).await),
        };
        if let Some((pv_name, patch)) = &plan.pv_patch
            && let Err(e) = self.patch_pv(pv_name, patch, PatchKind::Json).await
        {
            let msg = format!("could not add PersistentVolume finalizer: {e}");
            return Err(self.attach_failed(va, &msg, None).await);
        }
        let inputs = match plan.inputs {
            Ok(i) => i,
            Err(e) => return Err(self.attach_failed(va, &e, None).await),
        };
        let secrets = match self.secrets(inputs.secret.as_ref()).await {
            Ok(s) => s,
            Err(e) => return Err(self.attach_failed(va, &e, None).await),
        };
        let node_id = match plan.node_id {
            Ok(n) => n,
            Err(e) => return Err(self.attach_failed(va, &e, None).await),
        };
        // The finalizer before the call: from here on the deletion of this VolumeAttachment
        // goes through ControllerUnpublishVolume.
        if let Some(patch) = decide::va_attach_patch(va, &self.fin, &node_id) {
            match self
                .va_api()
                .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
                .await
            {
                Ok(written) => {
                    self.wrote(&written);
                    *left = cached_fingerprint(written);
                }
                Err(e) => {
                    let msg = format!("could not save VolumeAttachment: {}", api_message(&e));
                    return Err(self.attach_failed(va, &msg, None).await);
                }
            }
        }
        let published = self
            .clients
            .driver
            .publish(
                inputs.migrated,
                &inputs.volume_id,
                &node_id,
                &inputs.capability,
                inputs.readonly,
                secrets,
                &inputs.volume_context,
            )
            .await;
        let context = match published {
            Ok(c) => c,
            Err(e) => {
                let f = RpcFailure::from(&e);
                if crate::csi::may_be_in_progress(f.code) {
                    info!(VolumeAttachment = %name, err = %f.message, "ControllerPublishVolume may still be in progress; the finalizer stays until it is unpublished");
                }
                return Err(self.attach_failed(va, &f.message, Some(f.code)).await);
            }
        };
        debug!(VolumeAttachment = %name, "Attached");
        self.va_api()
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(decide::attached_status_patch(va, &context)),
            )
            .await
            .map(|written| self.wrote(&written))
            .map_err(|e| Requeue(format!("failed to mark as attached: {}", api_message(&e))))
    }

    async fn detach(&self, va: &VolumeAttachment) -> Result<(), Requeue> {
        let name = va.name_any();
        debug!(VolumeAttachment = %name, "Detaching");
        let pv = va
            .spec
            .source
            .persistent_volume_name
            .as_ref()
            .and_then(|p| self.pv(p));
        let csinode = self.csinode(&va.spec.node_name);
        let plan = match decide::detach_plan(va, &self.cfg.driver, pv.as_ref(), csinode.as_deref())
        {
            Ok(p) => p,
            Err(e) => return Err(self.detach_failed(va, &e).await),
        };
        let secrets = match self.secrets(plan.secret.as_ref()).await {
            Ok(s) => s,
            Err(e) => return Err(self.detach_failed(va, &e).await),
        };
        if let Err(e) = self
            .clients
            .driver
            .unpublish(plan.migrated, &plan.volume_id, &plan.node_id, secrets)
            .await
        {
            let f = RpcFailure::from(&e);
            return Err(self.detach_failed(va, &f.message).await);
        }
        debug!(VolumeAttachment = %name, "Detached");
        // The finalizer first (so a failed status write cannot cause a second unpublish),
        // then the status, unless the finalizer's removal let the API server delete it.
        let gone = decide::removal_deletes(va, &self.fin);
        if let Some(patch) = decide::va_remove_finalizer_patch(va, &self.fin) {
            match self
                .va_api()
                .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
                .await
            {
                Ok(written) => self.wrote(&written),
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
                Err(e) => {
                    return Err(Requeue(format!(
                        "could not mark as detached: {}",
                        api_message(&e)
                    )));
                }
            }
        }
        if gone {
            return Ok(());
        }
        let Some(patch) = decide::detached_status_patch(va) else {
            return Ok(());
        };
        match self
            .va_api()
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(written) => {
                self.wrote(&written);
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(Requeue(format!(
                "could not mark as detached: {}",
                api_message(&e)
            ))),
        }
    }

    /// One sync of the PV `name`: remove the finalizer once it is deleted and no
    /// VolumeAttachment names it.
    async fn sync_pv(&self, name: &str) -> Result<(), Requeue> {
        if !self.cfg.caps.real_handler() {
            return Ok(());
        }
        let Some(pv) = self.pv(name) else {
            return Ok(());
        };
        // Most PVs queued keep their finalizer; only those that may lose it read every
        // cached VolumeAttachment.
        if !decide::pv_needs_sync(&pv, &self.fin, &self.cfg.driver) {
            debug!(PersistentVolume = name, "finalizer kept");
            return Ok(());
        }
        // One cached VolumeAttachment decoded at a time, none of them held across the patch
        // below: a burst of deleted PVs (one sync each, every one waiting for the rate
        // limiter) must not hold a copy of every VolumeAttachment each.
        let names = self
            .vas
            .state()
            .into_iter()
            .filter_map(|va| va.object().spec.source.persistent_volume_name);
        let Some(patch) =
            decide::pv_remove_finalizer_patch(&pv, &self.fin, &self.cfg.driver, names)
        else {
            debug!(PersistentVolume = name, "finalizer kept");
            return Ok(());
        };
        self.patch_pv(name, &patch, PatchKind::Strategic)
            .await
            .map_err(Requeue)?;
        debug!(
            PersistentVolume = name,
            "Removed finalizer from PersistentVolume"
        );
        Ok(())
    }

    /// One ListVolumes reconcile: every VolumeAttachment whose `attached` differs from the
    /// driver's published nodes is synced again, forced.
    async fn reconcile(&self) {
        debug!("Reconciling VolumeAttachments with driver backend state");
        let max = self.cfg.max_entries;
        let published = match self
            .clients
            .driver
            .published_nodes(max, self.cfg.timeout)
            .await
        {
            Ok(p) => p,
            Err(e) => {
                error!(err = %format!("failed to ListVolumes: failed to list volumes: {e}"), "Failed to reconcile VolumeAttachment");
                return;
            }
        };
        for va in self.vas.state() {
            let va = va.object();
            if !decide::is_ours(&va, &self.cfg.driver) {
                continue;
            }
            let name = va.name_any();
            let csinode = self.csinode(&va.spec.node_name);
            let node_id =
                match decide::node_id_for_detach(&va, csinode.as_deref(), &self.cfg.driver) {
                    Ok(n) => n,
                    Err(e) => {
                        debug!(VolumeAttachment = %name, err = %e, "skipped by the reconciler");
                        continue;
                    }
                };
            let pv = va
                .spec
                .source
                .persistent_volume_name
                .as_ref()
                .and_then(|p| self.pv(p));
            let handle = match decide::source(&va).and_then(|src| {
                decide::volume_spec(&src, pv.as_ref(), false)
                    .and_then(|v| decide::reconciled_handle(&src, &v, &node_id))
            }) {
                Ok(handle) => handle,
                Err(e) => {
                    debug!(VolumeAttachment = %name, err = %e, "skipped by the reconciler");
                    continue;
                }
            };
            let found = published
                .get(&handle)
                .is_some_and(|nodes| nodes.contains(&node_id));
            let attached = decide::attached(&va);
            if found != attached {
                error!(VolumeAttachment = %name, volumeHandle = %handle, attachedStatus = attached, found, "VolumeAttachment attached status and actual state do not match. Adding back to VolumeAttachment queue for forced reprocessing");
                self.forced
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(name.clone());
                route(&self.attach_q, &self.detach_q, &va, name);
            }
        }
    }
}
