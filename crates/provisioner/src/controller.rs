//! The controller: watch caches (kube-runtime reflectors) for claims, volumes, classes, CSINodes,
//! Nodes and VolumeAttachments, a `claims` and a `volumes` work queue, and `--worker-threads`
//! workers on each (`upstream-external-provisioner.md` §5, §6, §9-§12; decisions P2-P4).
//!
//! Reads come from the caches only, apart from the provisioner secret (a live GET, as upstream:
//! watching every secret of the cluster would cost memory and widen RBAC). Writes per volume:
//! the claim's intent (P3), the PV, clearing the intent, and upstream's two events.
//!
//! P3, no leaked volumes: before CreateVolume the claim gets the annotation
//! [`INTENT_ANNOTATION`] (the PV name) and the finalizer [`INTENT_FINALIZER`] in one write. While
//! they are there the claim is provisioned even if it is being deleted (the finalizer keeps it in
//! the cache), so that a volume the driver may have created is always finished into a PV, which
//! the normal deletion path then deletes. They are cleared once the claim is Bound (after
//! kube-controller-manager's last write to it, so that the two never race), or once its PV is
//! saved if the claim is being deleted, or when the driver gave a final answer. A restart (or a
//! new leader) finds the claim with its intent in the first list and finishes it: CreateVolume
//! is idempotent by name.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::core::v1::{
    ObjectReference, PersistentVolume, PersistentVolumeClaim, Secret,
};
use k8s_openapi::api::storage::v1::{CSINode, StorageClass, VolumeAttachment};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::classify::{ProvisionError, State};
use crate::csi::{Capabilities, Driver};
use crate::events::{EventType, Recorder};
use crate::metrics::Metrics;
use crate::pv::{
    ANN_DELETION_SECRET_NAME, ANN_DELETION_SECRET_NAMESPACE, ANN_PROVISIONED_BY,
    FINALIZER as PV_FINALIZER,
};
use crate::queue::WorkQueue;
use crate::request::ANN_SELECTED_NODE;
use crate::request::{self, RequestOptions};
use crate::topology::TopologySource;
use crate::{pv, secrets};

/// The claim annotation that records a CreateVolume in flight (value: the PV name).
pub const INTENT_ANNOTATION: &str = "volume.plugreg.io/provisioning";
/// The claim finalizer that keeps a claim with a CreateVolume in flight until it is finished.
pub const INTENT_FINALIZER: &str = "volume.plugreg.io/provisioning";
/// How long an INVALID_ARGUMENT keeps a claim in the slow set (upstream's library default).
const INFEASIBLE_RETENTION: Duration = Duration::from_secs(300);
/// Upstream's effective resync of claims and volumes.
const RESYNC: Duration = Duration::from_secs(15 * 60);
/// How often CreateVolume's cleanup DeleteVolume is tried within one `--timeout`.
const CLEANUP_ATTEMPTS: usize = 5;

/// What the controller needs to know besides its clients.
#[derive(Debug, Clone)]
pub struct Config {
    /// The driver name (GetPluginInfo), i.e. the provisioner name.
    pub driver: String,
    /// The provisioner identity put into every PV's volume attributes (§2 step 15).
    pub identity: String,
    /// The request options from the flags.
    pub request: RequestOptions,
    /// The driver's capabilities (read once at start).
    pub capabilities: Capabilities,
    /// Workers per queue (`--worker-threads`).
    pub workers: usize,
    /// First back-off of a failed claim or volume (`--retry-interval-start`).
    pub retry_start: Duration,
    /// Back-off cap (`--retry-interval-max`).
    pub retry_max: Duration,
    /// CSI call deadline (`--timeout`), for the cleanup after a too-small volume.
    pub timeout: Duration,
}

/// The controller's failure: a watch cache never filled.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// The caches could not be filled (the run was cancelled first, or a writer went away).
    #[error("Failed to sync Informers!")]
    Sync,
}

/// The Kubernetes and CSI ends the controller talks to.
pub struct Clients {
    /// Carries what binds claims (intent, PV create, PV delete and finalizers) and the watches.
    pub high: Client,
    /// Carries bookkeeping (clearing the intent); events go through [`Clients::events`].
    pub low: Client,
    /// The event recorder.
    pub events: Recorder,
    /// The driver.
    pub driver: Arc<Driver>,
    /// The metrics.
    pub metrics: Arc<Metrics>,
}

struct Caches {
    claims: Store<PersistentVolumeClaim>,
    volumes: Store<PersistentVolume>,
    classes: Store<StorageClass>,
    nodes: Option<Store<Node>>,
    csinodes: Option<Store<CSINode>>,
    attachments: Option<Store<VolumeAttachment>>,
}

impl TopologySource for Caches {
    fn csinode(&self, name: &str) -> Option<Arc<CSINode>> {
        self.csinodes.as_ref()?.get(&ObjectRef::new(name))
    }
    fn node(&self, name: &str) -> Option<Arc<Node>> {
        self.nodes.as_ref()?.get(&ObjectRef::new(name))
    }
    fn csinodes(&self) -> Vec<Arc<CSINode>> {
        self.csinodes.as_ref().map(Store::state).unwrap_or_default()
    }
    fn nodes(&self) -> Vec<Arc<Node>> {
        self.nodes.as_ref().map(Store::state).unwrap_or_default()
    }
}

struct Controller {
    cfg: Config,
    clients: Clients,
    caches: Caches,
    claims: Arc<WorkQueue<ObjectRef<PersistentVolumeClaim>>>,
    volumes: Arc<WorkQueue<String>>,
    /// Claims whose CreateVolume said INVALID_ARGUMENT: uid -> (class uid, when).
    infeasible: Mutex<HashMap<String, (String, Instant)>>,
    /// PVs (by uid) whose volume this process deleted: when the cache shows them again, being
    /// deleted and still with the finalizer, only the finalizer is left to remove.
    deleted: Mutex<HashMap<String, Instant>>,
    /// PVs (by name) this process created: a claim synced again before the PV reaches the
    /// cache (its intent write queued it once more) must not be provisioned twice.
    created: Mutex<HashMap<String, Instant>>,
    /// PVs (by uid) whose finalizer this process removed after deleting them: the cache's
    /// late copies of them need nothing more.
    finalized: Mutex<HashMap<String, Instant>>,
    /// Claims (by uid) this process just rescheduled, with the resourceVersions from before
    /// that Update: a cache still showing one of them may still carry the old selected node
    /// and the intent, and provisioning from it would call CreateVolume on the old node again.
    rescheduled: Mutex<HashMap<String, (Vec<String>, Instant)>>,
}

/// How long [`Controller::deleted`] and [`Controller::created`] remember a volume, and how many
/// they keep at most.
const MEMORY: Duration = Duration::from_secs(600);
const MEMORY_KEEP: usize = 16_384;

/// Notes `key` in a bounded, expiring memory.
fn remember(memory: &Mutex<HashMap<String, Instant>>, key: &str) {
    let mut m = memory.lock().unwrap_or_else(|e| e.into_inner());
    if m.len() >= MEMORY_KEEP {
        m.retain(|_, at| at.elapsed() < MEMORY);
        if m.len() >= MEMORY_KEEP {
            m.clear();
        }
    }
    m.insert(key.to_owned(), Instant::now());
}

/// Whether `key` was noted less than [`MEMORY`] ago.
fn recent(memory: &Mutex<HashMap<String, Instant>>, key: &str) -> bool {
    memory
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(key)
        .is_some_and(|at| at.elapsed() < MEMORY)
}

/// How long [`Controller::rescheduled`] waits for the cache to catch up at most.
const RESCHEDULED_MEMORY: Duration = Duration::from_secs(60);

/// Runs the controller until `shutdown`: fills the caches, then provisions and deletes.
pub async fn run(
    cfg: Config,
    clients: Clients,
    shutdown: CancellationToken,
) -> Result<(), ControllerError> {
    let metrics = Arc::clone(&clients.metrics);
    let claims_q = WorkQueue::new(
        "claims",
        cfg.retry_start,
        cfg.retry_max,
        Arc::clone(&metrics),
        shutdown.clone(),
    );
    let volumes_q = WorkQueue::new(
        "volumes",
        cfg.retry_start,
        cfg.retry_max,
        Arc::clone(&metrics),
        shutdown.clone(),
    );
    let client = clients.high.clone();
    let topology = cfg.request.topology;
    let attach = cfg.capabilities.publish_unpublish_volume;
    if attach {
        info!("CSI driver supports PUBLISH_UNPUBLISH_VOLUME, watching VolumeAttachments");
    } else {
        info!(
            "CSI driver does not support PUBLISH_UNPUBLISH_VOLUME, not watching VolumeAttachments"
        );
    }

    let mut ready = Vec::new();
    let q = Arc::clone(&claims_q);
    let claims = watch::<PersistentVolumeClaim>(&client, &shutdown, &mut ready, move |ev| {
        if let Some(c) = ev {
            q.add(ObjectRef::from_obj(c));
        }
    });
    let q = Arc::clone(&volumes_q);
    let volumes = watch::<PersistentVolume>(&client, &shutdown, &mut ready, move |ev| {
        if let Some(v) = ev {
            q.add(v.name_any());
        }
    });
    let classes = watch::<StorageClass>(&client, &shutdown, &mut ready, |_| {});
    let (nodes, csinodes) = if topology {
        (
            Some(watch::<Node>(&client, &shutdown, &mut ready, |_| {})),
            Some(watch::<CSINode>(&client, &shutdown, &mut ready, |_| {})),
        )
    } else {
        (None, None)
    };
    let attachments =
        attach.then(|| watch::<VolumeAttachment>(&client, &shutdown, &mut ready, |_| {}));

    for r in ready {
        tokio::select! {
            res = r => if res.is_err() { return Err(ControllerError::Sync) },
            () = shutdown.cancelled() => return Ok(()),
        }
    }
    info!(
        "Informers synced; starting {} workers per queue",
        cfg.workers
    );

    let ctl = Arc::new(Controller {
        cfg,
        clients,
        caches: Caches {
            claims,
            volumes,
            classes,
            nodes,
            csinodes,
            attachments,
        },
        claims: claims_q,
        volumes: volumes_q,
        infeasible: Mutex::new(HashMap::new()),
        deleted: Mutex::new(HashMap::new()),
        created: Mutex::new(HashMap::new()),
        finalized: Mutex::new(HashMap::new()),
        rescheduled: Mutex::new(HashMap::new()),
    });

    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..ctl.cfg.workers.max(1) {
        let c = Arc::clone(&ctl);
        workers.spawn(async move {
            while let Some(item) = c.claims.next().await {
                let key = item.key.clone();
                match c.sync_claim(&key).await {
                    Ok(()) => c.claims.forget(&key),
                    Err(Retry::Soon) => c.claims.add_after(key, Duration::from_millis(50)),
                    Err(Retry::Backoff) => {
                        let n = c.claims.add_rate_limited(key.clone());
                        info!(key = %key, failures = n, "Retrying syncing claim");
                    }
                }
                c.claims.done(item);
            }
        });
        let c = Arc::clone(&ctl);
        workers.spawn(async move {
            while let Some(item) = c.volumes.next().await {
                let key = item.key.clone();
                match c.sync_volume(&key).await {
                    Ok(()) => c.volumes.forget(&key),
                    Err(Retry::Soon) => c.volumes.add_after(key, Duration::from_millis(50)),
                    Err(Retry::Backoff) => {
                        let n = c.volumes.add_rate_limited(key.clone());
                        info!(volume = %key, failures = n, "Retrying syncing volume");
                    }
                }
                c.volumes.done(item);
            }
        });
    }
    // Upstream re-enqueues every claim and volume every 15 minutes.
    let c = Arc::clone(&ctl);
    let stop = shutdown.clone();
    workers.spawn(async move {
        let mut tick = tokio::time::interval_at(Instant::now() + RESYNC, RESYNC);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    for claim in c.caches.claims.state() {
                        c.claims.add(ObjectRef::from_obj(&*claim));
                    }
                    for v in c.caches.volumes.state() {
                        c.volumes.add(v.name_any());
                    }
                }
                () = stop.cancelled() => return,
            }
        }
    });
    shutdown.cancelled().await;
    while workers.join_next().await.is_some() {}
    Ok(())
}

/// Starts a reflector for `K` (cluster-wide; managedFields dropped to save memory), calling
/// `on_apply` for every object listed or changed, and pushes a readiness future to `ready`.
fn watch<K>(
    client: &Client,
    shutdown: &CancellationToken,
    ready: &mut Vec<futures::future::BoxFuture<'static, Result<(), ()>>>,
    on_apply: impl Fn(Option<&K>) + Send + 'static,
) -> Store<K>
where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let api: Api<K> = Api::all(client.clone());
    let (reader, writer) = reflector::store();
    let stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(|o: &mut K| {
            o.meta_mut().managed_fields = None;
        })
        .reflect(writer);
    let stop = shutdown.clone();
    let kind = K::kind(&()).into_owned();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev,
                () = stop.cancelled() => return,
            };
            match ev {
                None => return,
                Some(Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o))) => {
                    on_apply(Some(&o))
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => warn!(kind = %kind, "watch failed (retrying): {e}"),
            }
        }
    });
    let r = reader.clone();
    ready.push(Box::pin(async move {
        r.wait_until_ready().await.map_err(|_| ())
    }));
    reader
}

/// How a failed sync is retried.
enum Retry {
    /// After a short pause (a stale cache lost an optimistic-concurrency race).
    Soon,
    /// After the key's exponential back-off.
    Backoff,
}

fn volume_ref(v: &PersistentVolume) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolume".into()),
        name: v.metadata.name.clone(),
        uid: v.metadata.uid.clone(),
        resource_version: v.metadata.resource_version.clone(),
        ..Default::default()
    }
}

fn is_bound(c: &PersistentVolumeClaim) -> bool {
    c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
}

fn has_intent(c: &PersistentVolumeClaim) -> bool {
    c.annotations().contains_key(INTENT_ANNOTATION)
        || c.finalizers().iter().any(|f| f == INTENT_FINALIZER)
}

impl Controller {
    fn claims_api(&self, ns: &str, low: bool) -> Api<PersistentVolumeClaim> {
        let c = if low {
            &self.clients.low
        } else {
            &self.clients.high
        };
        Api::namespaced(c.clone(), ns)
    }

    fn event(&self, obj: &ObjectReference, t: EventType, reason: &str, msg: &str) {
        self.clients.events.event(obj, t, reason, msg);
    }

    async fn sync_claim(&self, key: &ObjectRef<PersistentVolumeClaim>) -> Result<(), Retry> {
        let Some(claim) = self.caches.claims.get(key) else {
            debug!(claim = %key, "claim in work queue no longer exists");
            return Ok(());
        };
        if self.older_than_reschedule(&claim) {
            // The watch has not delivered our reschedule yet; its event queues the claim.
            debug!(claim = %key, "claim in cache predates its reschedule; waiting");
            return Err(Retry::Soon);
        }
        let intent = has_intent(&claim);
        let class = request::claim_class(&claim);
        let has_volume = claim
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.as_deref())
            .is_some_and(|v| !v.is_empty());
        if has_volume {
            // The intent goes once KCM has finished binding (its status write is the last
            // of its writes to the claim), so that clearing it never races KCM's updates.
            if intent && (is_bound(&claim) || claim.metadata.deletion_timestamp.is_some()) {
                return self.clear_intent(&claim).await;
            }
            return Ok(());
        }
        if claim.metadata.deletion_timestamp.is_some() && !intent {
            return Ok(());
        }
        let uid = claim.uid().unwrap_or_default();
        let started = Instant::now();
        match self.provision(&claim, intent).await {
            Ok(Outcome::Provisioned) => {
                self.clients
                    .metrics
                    .provision_succeeded(&class, "", started.elapsed());
                Ok(())
            }
            Ok(Outcome::Skipped) => Ok(()),
            Err(Failure::Conflict) => Err(Retry::Soon),
            Err(Failure::Silent(e)) => {
                self.clients.metrics.provision_failed(&class, "");
                debug!(claim = %key, "{e}");
                Err(Retry::Backoff)
            }
            Err(Failure::Error(e)) => {
                self.clients.metrics.provision_failed(&class, "");
                // The library's wrapping of every Provision error.
                let e = e.context(&format!(
                    "failed to provision volume with StorageClass {}",
                    crate::secrets::go_quote(&class)
                ));
                let r = pv::claim_ref(&claim);
                if e.infeasible {
                    let class_uid = self
                        .caches
                        .classes
                        .get(&ObjectRef::new(&class))
                        .and_then(|c| c.uid())
                        .unwrap_or_default();
                    self.lock_infeasible()
                        .insert(uid, (class_uid, Instant::now()));
                    self.event(
                        &r,
                        EventType::Warning,
                        "ProvisioningFailed",
                        &format!(
                            "Volume provisioning failed with infeasible error. Retries will be delayed. {}",
                            e.message
                        ),
                    );
                } else {
                    self.event(&r, EventType::Warning, "ProvisioningFailed", &e.message);
                }
                warn!(claim = %key, "failed to provision volume: {}", e.message);
                Err(Retry::Backoff)
            }
        }
    }

    fn lock_infeasible(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Instant)>> {
        self.infeasible.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Upstream's slow set (§11.4): true while the claim's last INVALID_ARGUMENT is recent and
    /// its class unchanged.
    fn recently_infeasible(&self, uid: &str, class_uid: &str) -> bool {
        let mut m = self.lock_infeasible();
        match m.get(uid) {
            Some((c, at)) if c == class_uid && at.elapsed() < INFEASIBLE_RETENTION => true,
            Some(_) => {
                m.remove(uid);
                false
            }
            None => false,
        }
    }

    async fn provision(
        &self,
        claim: &PersistentVolumeClaim,
        intent: bool,
    ) -> Result<Outcome, Failure> {
        let driver = &self.cfg.driver;
        let ns = claim.namespace().unwrap_or_default();
        let uid = claim.uid().unwrap_or_default();
        let class_name = request::claim_class(claim);
        let class = self.caches.classes.get(&ObjectRef::new(&class_name));

        if let Some(c) = &class
            && self.recently_infeasible(&uid, &c.uid().unwrap_or_default())
        {
            // The last answer was final, so nothing runs in the driver; an intent still here
            // outlived its clearing (the cache had not shown it yet, or a Conflict) and would
            // otherwise stay for the whole slow-set period.
            if intent {
                self.clear_intent(claim)
                    .await
                    .map_err(|_| Failure::Conflict)?;
            }
            return Err(Failure::Silent(format!(
                "skipping volume provisioning for pvc {uid}, because provisioning previously failed with infeasible error"
            )));
        }
        // A claim with our intent is ours whatever its annotations say now.
        if !intent {
            match request::should_provision(claim, class.as_deref(), driver) {
                Ok(true) => {}
                Ok(false) => return Ok(Outcome::Skipped),
                Err(e) => return Err(Failure::Silent(e.message)),
            }
        }
        let Some(class) = class else {
            return Err(Failure::Silent(format!(
                "storageClass {class_name:?} not found"
            )));
        };
        if class.provisioner != *driver {
            return Ok(Outcome::Skipped);
        }
        let pv_name = request::volume_name(
            &self.cfg.request.volume_name_prefix,
            self.cfg.request.volume_name_uuid_length,
            &uid,
        )
        .map_err(Failure::Error)?;
        if self.caches.volumes.get(&ObjectRef::new(&pv_name)).is_some()
            || recent(&self.created, &pv_name)
        {
            debug!(pv = %pv_name, "persistentvolume already exists");
            // A claim being deleted is not bound any more: let it go now. Otherwise the
            // intent goes when the claim is Bound (see `sync_claim`).
            if intent && claim.metadata.deletion_timestamp.is_some() {
                self.clear_intent(claim)
                    .await
                    .map_err(|_| Failure::Conflict)?;
            }
            return Ok(Outcome::Skipped);
        }
        let r = pv::claim_ref(claim);
        if let request::DataSource::ExternalPopulator { .. } =
            request::data_source(claim).map_err(Failure::Error)?
        {
            self.event(
                &r,
                EventType::Normal,
                "Provisioning",
                request::POPULATOR_EVENT,
            );
            return Ok(Outcome::Skipped);
        }
        self.event(
            &r,
            EventType::Normal,
            "Provisioning",
            &format!(
                "External provisioner is provisioning volume for claim \"{ns}/{}\"",
                claim.name_any()
            ),
        );
        self.check_capabilities().map_err(Failure::Error)?;
        let mut prepared =
            match request::prepare(claim, &class, driver, &self.cfg.request, &self.caches) {
                Ok(p) => p,
                Err(e) if e.state == State::Reschedule => {
                    self.reschedule(claim, intent, None).await?;
                    return Err(Failure::Error(e));
                }
                Err(e) => return Err(Failure::Error(e)),
            };
        // Upstream only logs the deprecation warnings.
        for w in &prepared.warnings {
            warn!("{w}");
        }
        if let Some(s) = &prepared.provisioner_secret {
            prepared.request.secrets = self
                .secret_data(s)
                .await
                .map_err(|m| Failure::Error(ProvisionError::no_change(m)))?;
        }

        // P3: the intent is on the claim before the driver hears of the volume.
        let mut written = None;
        if !intent {
            written = Some(self.record_intent(claim, &pv_name).await?);
        }

        let reschedule_possible =
            self.cfg.request.topology && request::selected_node(claim).is_some();
        let response = match self
            .clients
            .driver
            .create_volume(prepared.request.clone())
            .await
        {
            Ok(r) => r,
            Err(status) => {
                let e = ProvisionError::from_create_volume(&status, reschedule_possible);
                match e.state {
                    State::Background => {}
                    State::Reschedule => self.reschedule(claim, true, written.as_ref()).await?,
                    State::Final | State::NoChange => {
                        // Nothing runs in the driver: the intent has done its job.
                        let _ = self.clear_intent_of(&ns, &claim.name_any()).await;
                    }
                }
                return Err(Failure::Error(e));
            }
        };
        let volume = match pv::build(
            &prepared,
            claim,
            &class,
            driver,
            &self.cfg.identity,
            &response,
            &self.cfg.request,
        ) {
            Ok(v) => v,
            Err(e) => {
                let id = response
                    .volume
                    .as_ref()
                    .map(|v| v.volume_id.clone())
                    .unwrap_or_default();
                let msg = match e {
                    pv::PvError::TooSmall {
                        capacity,
                        requested,
                    } => format!(
                        "created volume capacity {capacity} less than requested capacity {requested}"
                    ),
                    pv::PvError::MissingContentSource => "volume content source missing".into(),
                    pv::PvError::NoVolumeId => {
                        // Nothing to clean up without an id; the driver broke the spec.
                        return Err(Failure::Error(ProvisionError::final_(
                            "CreateVolume returned no volume id",
                        )));
                    }
                };
                let msg = match self.cleanup(&id, &prepared.request.secrets).await {
                    Ok(()) => msg,
                    Err(status) => format!(
                        "{msg}. Cleanup of volume {pv_name} failed, volume is orphaned: {}",
                        plugreg_runtime::report::grpc(&status)
                    ),
                };
                return Err(Failure::Error(ProvisionError::new(State::Background, msg)));
            }
        };
        let pvs: Api<PersistentVolume> = Api::all(self.clients.high.clone());
        match pvs.create(&PostParams::default(), &volume).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {
                debug!(pv = %pv_name, "persistentvolume already exists");
            }
            Err(e) => {
                // The volume exists in the driver: keep the intent and try again (CreateVolume
                // is idempotent by name), as upstream retries the save forever.
                warn!(pv = %pv_name, "Failed to save volume: {e}");
                return Err(Failure::Error(ProvisionError::new(
                    State::Background,
                    format!("failed to save persistentvolume {pv_name}: {e}"),
                )));
            }
        }
        remember(&self.created, &pv_name);
        info!(claim = %format!("{ns}/{}", claim.name_any()), pv = %pv_name, "successfully created PV");
        self.event(
            &r,
            EventType::Normal,
            "ProvisioningSucceeded",
            &format!("Successfully provisioned volume {pv_name}"),
        );
        // The intent goes when KCM has bound the claim (see `sync_claim`); a claim being
        // deleted will not be bound, so it goes now (a failure is retried by the next sync).
        if claim.metadata.deletion_timestamp.is_some() {
            let _ = self.clear_intent_of(&ns, &claim.name_any()).await;
        }
        Ok(Outcome::Provisioned)
    }

    fn check_capabilities(&self) -> Result<(), ProvisionError> {
        let caps = &self.cfg.capabilities;
        request::check_capabilities(caps.controller_service, caps.create_delete_volume)
    }

    async fn secret_data(&self, s: &secrets::SecretRef) -> Result<HashMap<String, String>, String> {
        let api: Api<Secret> = Api::namespaced(self.clients.high.clone(), &s.namespace);
        let secret = api.get(&s.name).await.map_err(|e| {
            format!(
                "error getting secret {} in namespace {}: {e}",
                s.name, s.namespace
            )
        })?;
        Ok(secret
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
            .collect())
    }

    /// DeleteVolume of a volume that cannot be used, up to five times within one `--timeout`.
    async fn cleanup(
        &self,
        volume_id: &str,
        secrets: &HashMap<String, String>,
    ) -> Result<(), tonic::Status> {
        let deadline = Instant::now() + self.cfg.timeout;
        let mut last = tonic::Status::deadline_exceeded("cleanup not attempted");
        for _ in 0..CLEANUP_ATTEMPTS {
            if Instant::now() >= deadline {
                break;
            }
            match self
                .clients
                .driver
                .delete_volume(volume_id, secrets.clone())
                .await
            {
                Ok(()) => return Ok(()),
                Err(s) => last = s,
            }
        }
        Err(last)
    }

    /// Adds the intent annotation and finalizer: an Update of the cached claim, so that a stale
    /// cache loses (Conflict) instead of overwriting, and upstream's RBAC (PVCs: get, list,
    /// watch, update) is enough. Returns the claim as written.
    async fn record_intent(
        &self,
        claim: &PersistentVolumeClaim,
        pv_name: &str,
    ) -> Result<PersistentVolumeClaim, Failure> {
        let mut c = claim.clone();
        c.annotations_mut()
            .insert(INTENT_ANNOTATION.to_owned(), pv_name.to_owned());
        c.finalizers_mut().push(INTENT_FINALIZER.to_owned());
        let ns = claim.namespace().unwrap_or_default();
        match self
            .claims_api(&ns, false)
            .replace(&claim.name_any(), &PostParams::default(), &c)
            .await
        {
            Ok(updated) => Ok(updated),
            Err(kube::Error::Api(s)) if s.code == 409 => Err(Failure::Conflict),
            Err(e) => Err(Failure::Error(ProvisionError::no_change(format!(
                "failed to record the provisioning intent on the claim: {e}"
            )))),
        }
    }

    async fn clear_intent(&self, claim: &PersistentVolumeClaim) -> Result<(), Retry> {
        self.clear_intent_of(&claim.namespace().unwrap_or_default(), &claim.name_any())
            .await
    }

    /// Removes the intent (low priority) with an Update of the claim as the cache knows it; a
    /// Conflict means the cache is behind: the claim is synced again when it catches up.
    async fn clear_intent_of(&self, ns: &str, name: &str) -> Result<(), Retry> {
        let key = ObjectRef::new(name).within(ns);
        let Some(claim) = self.caches.claims.get(&key) else {
            return Ok(());
        };
        if !has_intent(&claim) {
            return Ok(());
        }
        let mut c = (*claim).clone();
        c.annotations_mut().remove(INTENT_ANNOTATION);
        c.finalizers_mut().retain(|f| f != INTENT_FINALIZER);
        match self
            .claims_api(ns, true)
            .replace(name, &PostParams::default(), &c)
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => {
                debug!(claim = %key, "clearing the provisioning intent failed (retrying): {e}");
                self.claims.add_after(key, Duration::from_millis(200));
                Err(Retry::Soon)
            }
        }
    }

    /// Removes the selected-node annotation (and the intent, if `intent`) so that the scheduler
    /// picks another node (§11.2 reschedule): one Update, as upstream, of `written` (the claim
    /// as this sync's intent write returned it: the cache may not have it yet) or else of the
    /// cached claim. The versions before it are remembered as stale, see
    /// [`Controller::rescheduled`].
    async fn reschedule(
        &self,
        claim: &PersistentVolumeClaim,
        intent: bool,
        written: Option<&PersistentVolumeClaim>,
    ) -> Result<(), Failure> {
        let ns = claim.namespace().unwrap_or_default();
        let name = claim.name_any();
        let key = ObjectRef::new(&name).within(&ns);
        let mut c = match written {
            Some(w) => w.clone(),
            None => self
                .caches
                .claims
                .get(&key)
                .map_or_else(|| claim.clone(), |c| (*c).clone()),
        };
        c.annotations_mut().remove(ANN_SELECTED_NODE);
        if intent {
            c.annotations_mut().remove(INTENT_ANNOTATION);
            c.finalizers_mut().retain(|f| f != INTENT_FINALIZER);
        }
        self.claims_api(&ns, false)
            .replace(&name, &PostParams::default(), &c)
            .await
            .map_err(|e| {
                Failure::Error(ProvisionError::final_(format!(
                    "failed to remove the selected-node annotation: {e}"
                )))
            })?;
        let stale = [
            claim.metadata.resource_version.as_deref(),
            c.metadata.resource_version.as_deref(),
        ]
        .into_iter()
        .flatten()
        .map(str::to_owned)
        .collect();
        let mut m = self.lock_rescheduled();
        if m.len() >= MEMORY_KEEP {
            m.retain(|_, (_, at)| at.elapsed() < RESCHEDULED_MEMORY);
        }
        m.insert(claim.uid().unwrap_or_default(), (stale, Instant::now()));
        Ok(())
    }

    fn lock_rescheduled(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, (Vec<String>, Instant)>> {
        self.rescheduled.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the cached `claim` is a version from before this process rescheduled it. The
    /// first newer version ends the watch on that claim.
    fn older_than_reschedule(&self, claim: &PersistentVolumeClaim) -> bool {
        let uid = claim.uid().unwrap_or_default();
        let mut m = self.lock_rescheduled();
        let Some((stale, at)) = m.get(&uid) else {
            return false;
        };
        let version = claim
            .metadata
            .resource_version
            .as_deref()
            .unwrap_or_default();
        if at.elapsed() < RESCHEDULED_MEMORY && stale.iter().any(|v| v == version) {
            return true;
        }
        m.remove(&uid);
        false
    }

    async fn sync_volume(&self, name: &str) -> Result<(), Retry> {
        let Some(volume) = self.caches.volumes.get(&ObjectRef::new(name)) else {
            return Ok(());
        };
        if !self.is_ours(&volume) {
            return Ok(());
        }
        let spec = volume.spec.clone().unwrap_or_default();
        let policy = spec
            .persistent_volume_reclaim_policy
            .as_deref()
            .unwrap_or("Delete");
        let phase = volume
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .unwrap_or("");
        let deleting = volume.metadata.deletion_timestamp.is_some();
        let has_finalizer = volume.finalizers().iter().any(|f| f == PV_FINALIZER);

        // Finalizer upkeep (§12 step 2).
        if policy == "Delete" && !deleting && phase == "Bound" && !has_finalizer {
            self.set_pv_finalizer(&volume, true).await?;
            return Ok(());
        }
        if (policy == "Retain" || policy == "Recycle") && has_finalizer {
            self.set_pv_finalizer(&volume, false).await?;
            return Ok(());
        }
        if (!has_finalizer && deleting) || phase != "Released" || policy != "Delete" {
            return Ok(());
        }
        let uid = volume.uid().unwrap_or_default();
        if deleting && recent(&self.deleted, &uid) {
            // Our own DELETE coming back through the cache: the volume is gone already, and
            // the finalizer too unless removing it failed.
            if recent(&self.finalized, &uid) {
                return Ok(());
            }
            return self
                .remove_pv_finalizer(name, Some((*volume).clone()))
                .await
                .map_err(|e| {
                    warn!(pv = %name, "{e}");
                    Retry::Backoff
                });
        }
        let class = spec.storage_class_name.clone().unwrap_or_default();
        let started = Instant::now();
        match self.delete(&volume).await {
            Ok(()) => {
                self.clients
                    .metrics
                    .delete_succeeded(&class, started.elapsed());
                Ok(())
            }
            Err(e) => {
                self.clients.metrics.delete_failed(&class);
                self.event(
                    &volume_ref(&volume),
                    EventType::Warning,
                    "VolumeFailedDelete",
                    &e,
                );
                warn!(pv = %name, "failed to delete volume: {e}");
                Err(Retry::Backoff)
            }
        }
    }

    fn is_ours(&self, v: &PersistentVolume) -> bool {
        match v.annotations().get(ANN_PROVISIONED_BY) {
            Some(p) => *p == self.cfg.driver,
            None => v
                .spec
                .as_ref()
                .and_then(|s| s.csi.as_ref())
                .is_some_and(|c| c.driver == self.cfg.driver),
        }
    }

    /// Adds or removes the provisioner's finalizer with a strategic-merge patch, as upstream:
    /// `finalizers` merges by value on the server, so no read, no resourceVersion, and no
    /// conflict with the pv-protection controller's own finalizer.
    async fn set_pv_finalizer(&self, v: &PersistentVolume, on: bool) -> Result<(), Retry> {
        match self.patch_pv_finalizer(&v.name_any(), on).await {
            Ok(()) => Ok(()),
            Err(e) => {
                warn!(pv = %v.name_any(), "{e}");
                Err(Retry::Backoff)
            }
        }
    }

    async fn patch_pv_finalizer(&self, name: &str, on: bool) -> Result<(), String> {
        let patch = if on {
            json!({"metadata": {"finalizers": [PV_FINALIZER]}})
        } else {
            json!({"metadata": {"$deleteFromPrimitiveList/finalizers": [PV_FINALIZER]}})
        };
        let api: Api<PersistentVolume> = Api::all(self.clients.high.clone());
        match api
            .patch(name, &PatchParams::default(), &Patch::Strategic(&patch))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(format!(
                "failed to modify finalizers to {PV_FINALIZER} on volume {name}: {e}"
            )),
        }
    }

    /// §12 step 4-6: DeleteVolume, then the PV, then its finalizer.
    async fn delete(&self, v: &PersistentVolume) -> Result<(), String> {
        let name = v.name_any();
        let spec = v.spec.as_ref();
        let Some(csi) = spec.and_then(|s| s.csi.as_ref()) else {
            return Err("invalid CSI PV".into());
        };
        self.check_capabilities().map_err(|e| e.message)?;
        let ann = v.annotations();
        let mut secrets = HashMap::new();
        if let (Some(n), Some(ns)) = (
            ann.get(ANN_DELETION_SECRET_NAME),
            ann.get(ANN_DELETION_SECRET_NAMESPACE),
        ) && !n.is_empty()
            && !ns.is_empty()
        {
            let r = secrets::SecretRef {
                name: n.clone(),
                namespace: ns.clone(),
            };
            match self.secret_data(&r).await {
                Ok(d) => secrets = d,
                Err(e) => warn!(pv = %name, "{e}; deleting without secrets"),
            }
        }
        if let Some(va) = &self.caches.attachments
            && let Some(a) =
                va.find(|a| a.spec.source.persistent_volume_name.as_deref() == Some(name.as_str()))
        {
            return Err(format!(
                "persistentvolume {name} is still attached to node {}",
                a.spec.node_name
            ));
        }
        self.clients
            .driver
            .delete_volume(&csi.volume_handle, secrets)
            .await
            .map_err(|s| plugreg_runtime::report::grpc(&s))?;
        remember(&self.deleted, &v.uid().unwrap_or_default());
        let api: Api<PersistentVolume> = Api::all(self.clients.high.clone());
        // The answer is the PV itself while finalizers hold it: no need to read it again.
        let left = match api.delete(&name, &DeleteParams::default()).await {
            Ok(answer) => answer.left(),
            Err(kube::Error::Api(s)) if s.code == 404 => None,
            Err(e) => return Err(format!("failed to delete persistentvolume {name}: {e}")),
        };
        info!(pv = %name, "volume deleted");
        if let Some(pv) = left {
            self.remove_pv_finalizer(&name, Some(pv)).await?;
        }
        remember(&self.finalized, &v.uid().unwrap_or_default());
        Ok(())
    }

    /// Removes the provisioner's finalizer from the PV if `known` (the PV as DELETE returned it,
    /// or the cache) still has it; a PV already gone is fine.
    async fn remove_pv_finalizer(
        &self,
        name: &str,
        known: Option<PersistentVolume>,
    ) -> Result<(), String> {
        if known.is_some_and(|v| !v.finalizers().iter().any(|f| f == PV_FINALIZER)) {
            return Ok(());
        }
        self.patch_pv_finalizer(name, false).await
    }
}

enum Outcome {
    Provisioned,
    Skipped,
}

enum Failure {
    /// Retry soon: the claim changed under us.
    Conflict,
    /// Retry with back-off, no event (upstream's errors without events).
    Silent(String),
    /// Retry with back-off after a `ProvisioningFailed` event.
    Error(ProvisionError),
}
