//! The controller: watch caches (kube-runtime reflectors) for claims, volumes, classes, CSINodes,
//! Nodes and VolumeAttachments; three work queues (claims, PVs, recorded volumes) with
//! `--worker-threads` workers each, as upstream's provisioner controller; with CLONE_VOLUME the
//! cloning-protection queue (`--cloning-protection-threads` workers), and with
//! CREATE_DELETE_SNAPSHOT the sweeper of restore finalizers left on VolumeSnapshots.
//!
//! Restore and clone read their source live (the snapshot and its content; the source claim
//! and its PV) and check it with [`crate::source`]; the content source is part of the recorded
//! request, so a restore or clone cut short ends like any other volume: as a PV, or deleted.
//!
//! Each worker gathers a view of the caches and of the in-flight memory ([`InFlight`]), asks
//! [`crate::decide`] what to do, and does it: the decisions are pure and tested without I/O,
//! the acting is here. Provisioning a claim is a few such steps ([`crate::plan`]: before
//! CreateVolume, with its answer, with the PV and its save; [`crate::owner`] for a node's
//! claims), and what an Update writes is [`crate::edit`]'s.
//!
//! Reads come from the caches only, apart from the provisioner secret (a live GET, as upstream:
//! watching every secret of the cluster would cost memory and widen RBAC) and the rare claim
//! Updates (a reschedule, releasing a previous version's intent), which read the claim first so
//! that the Update keeps every field, including those this build does not know.
//!
//! No leaked volumes: before the driver hears of a volume, the volume is in the durable record
//! ([`crate::record`]), written for the claims started together in one write. The record stays
//! until the volume is saved as a PV, or deleted again with DeleteVolume when its claim or
//! class is gone; once a CreateVolume may have reached the driver without a definite answer,
//! no later error drops it. A restart or a new leader reads the record and finishes what was
//! started, with the recorded name and request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::core::v1::{
    ObjectReference, PersistentVolume, PersistentVolumeClaim, Secret,
};
use k8s_openapi::api::storage::v1::{CSINode, StorageClass, VolumeAttachment};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use plugreg_sidecar_kit::cache::{self, CompactStore, Keyed as _};
use plugreg_sidecar_kit::events::{EventType, Recorder};
use plugreg_sidecar_kit::queue::WorkQueue;
use plugreg_sidecar_kit::runtime::{Action, Lane, Runner, Writes};
use serde_json::json;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::cached::{CachedClaim, CachedPv, DeletionSecret, WatchedPv};
use crate::classify::ProvisionError;
use crate::csi::{Capabilities, Driver};
use crate::decide::{self, ClaimAction, RecordAction, VolumeAction};
use crate::edit;
use crate::inflight::InFlight;
use crate::metrics::{Metrics, ProvisionMetrics};
use crate::node::{self, NodeDeployment, Take};
use crate::owner;
use crate::plan::{self, Failure};
use crate::pv::FINALIZER as PV_FINALIZER;
use crate::record::{Entry, Journal, RecordError};
use crate::request::{self, RequestOptions};
use crate::topology::TopologySource;
use crate::{pv, secrets, source};
use plugreg_proto::csi::v1::{VolumeContentSource, volume_content_source};
use plugreg_sidecar_kit::snapshot::{self, VolumeSnapshot, VolumeSnapshotContent};

/// Upstream's effective resync of claims and volumes.
const RESYNC: Duration = Duration::from_secs(15 * 60);
/// VolumeSnapshots read per page by the finalizer sweeper (metadata only).
const SWEEP_PAGE: u32 = 100;
/// The wait between failed reads of the in-flight record at start (doubling, with jitter).
const LOAD_BACKOFF: plugreg_runtime::backoff::Backoff =
    plugreg_runtime::backoff::Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
/// How often CreateVolume's cleanup DeleteVolume is tried within one `--timeout`.
const CLEANUP_ATTEMPTS: usize = 5;
/// The reason of the event on a claim whose in-flight volume is deleted again.
pub const CANCELLED_REASON: &str = "ProvisioningCancelled";

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
    /// Workers of the cloning-protection controller (`--cloning-protection-threads`; it runs
    /// only when the driver reports CLONE_VOLUME).
    pub clone_protection_workers: usize,
    /// How often left-over restore finalizers are swept from VolumeSnapshots
    /// (`--snapshot-orphan-sweep-interval`; zero: never).
    pub snapshot_sweep: Duration,
    /// Distributed provisioning (`--node-deployment`): this node, and how it competes for
    /// claims of immediate binding.
    pub node: Option<Arc<NodeDeployment>>,
}

/// The controller's failure.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// The caches could not be filled (the run was cancelled first, or a writer went away).
    #[error("Failed to sync Informers!")]
    Sync,
}

/// The Kubernetes and CSI ends the controller talks to.
pub struct Clients {
    /// Carries what binds claims (PV create, PV delete and finalizers) and the watches.
    pub high: Client,
    /// Carries bookkeeping; events go through [`Clients::events`].
    pub low: Client,
    /// The event recorder.
    pub events: Recorder,
    /// The driver.
    pub driver: Arc<Driver>,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// The provisioning counters (registered with [`Clients::metrics`]).
    pub provisioned: Arc<ProvisionMetrics>,
    /// The durable record of in-flight volumes (written by its own task, see [`Journal::run`]).
    pub journal: Arc<Journal>,
    /// Entries of the record that another process wrote (from [`Journal::new`]).
    pub found: mpsc::UnboundedReceiver<Entry>,
    /// Capacity tracking's refresh after volume operations (`--enable-capacity`).
    pub capacity: Option<crate::capacity::Refresh>,
    /// Where the watch caches get their events.
    pub watches: cache::Watches,
}

/// A step that failed: what the claim's, PV's or record's worker logs or puts in an event.
#[derive(Debug, thiserror::Error)]
enum ActError {
    #[error("error getting secret {name} in namespace {namespace}: {source}")]
    Secret {
        name: String,
        namespace: String,
        #[source]
        source: kube::Error,
    },
    #[error("failed to modify finalizers to {PV_FINALIZER} on volume {volume}: {source}")]
    Finalizer {
        volume: String,
        #[source]
        source: kube::Error,
    },
    #[error("invalid CSI PV")]
    InvalidPv,
    /// An in-tree PV (CSI migration) that does not translate.
    #[error("{0}")]
    InTree(String),
    /// The class's deletion secret of a PV without deletion-secret annotations: its class
    /// does not translate, or its secret templates do not resolve.
    #[error("{0}")]
    ClassSecret(String),
    #[error("{0}")]
    Capabilities(ProvisionError),
    #[error("persistentvolume {volume} is still attached to node {node}")]
    Attached { volume: String, node: String },
    #[error("{}", plugreg_runtime::report::grpc(.0))]
    Driver(tonic::Status),
    #[error("failed to delete persistentvolume {volume}: {source}")]
    DeletePv {
        volume: String,
        #[source]
        source: kube::Error,
    },
    #[error("failed to update claim {claim}: {source}")]
    UpdateClaim {
        claim: String,
        #[source]
        source: kube::Error,
    },
    #[error("CreateVolume of volume {0} returned no volume id")]
    NoVolumeId(String),
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error("volume {0} is being worked on")]
    Busy(String),
}

/// A failed sync: the key goes back through the queue's rate-limited back-off.
struct Requeue;

struct Caches {
    claims: CompactStore<CachedClaim>,
    volumes: CompactStore<CachedPv>,
    classes: Store<StorageClass>,
    nodes: Option<Store<Node>>,
    csinodes: Option<Store<CSINode>>,
    attachments: Option<CompactStore<Attachment>>,
    /// With `--node-deployment`: the one Node and CSINode the topology code sees, made from
    /// NodeGetInfo (§B.2 step 4), in place of the watches.
    local: Option<(Arc<Node>, Arc<CSINode>)>,
}

impl TopologySource for Caches {
    fn csinode(&self, name: &str) -> Option<Arc<CSINode>> {
        if let Some((_, c)) = &self.local {
            return (c.metadata.name.as_deref() == Some(name)).then(|| Arc::clone(c));
        }
        self.csinodes.as_ref()?.get(&ObjectRef::new(name))
    }
    fn node(&self, name: &str) -> Option<Arc<Node>> {
        if let Some((n, _)) = &self.local {
            return (n.metadata.name.as_deref() == Some(name)).then(|| Arc::clone(n));
        }
        self.nodes.as_ref()?.get(&ObjectRef::new(name))
    }
    fn csinodes(&self) -> Vec<Arc<CSINode>> {
        if let Some((_, c)) = &self.local {
            return vec![Arc::clone(c)];
        }
        self.csinodes.as_ref().map(Store::state).unwrap_or_default()
    }
    fn nodes(&self) -> Vec<Arc<Node>> {
        if let Some((n, _)) = &self.local {
            return vec![Arc::clone(n)];
        }
        self.nodes.as_ref().map(Store::state).unwrap_or_default()
    }
}

struct Controller {
    cfg: Config,
    clients: Clients,
    caches: Caches,
    /// Keyed `namespace/name`, as the claims' store.
    claims: Arc<WorkQueue<Box<str>>>,
    volumes: Arc<WorkQueue<String>>,
    records: Arc<WorkQueue<String>>,
    /// Source claims of clones whose cloning protection may be released.
    clone_sources: Arc<WorkQueue<Box<str>>>,
    inflight: Arc<InFlight>,
    /// This process's reschedules (removals of the selected-node annotation), by claim UID:
    /// until the cache shows one, the cached claim still carries the old node.
    writes: Arc<Writes<String>>,
    /// `--node-deployment`: this node's attempts to become the owner of each claim of
    /// immediate binding, by claim UID (§B.4; dropped with the claim).
    owner_attempts: Arc<Mutex<HashMap<String, u32>>>,
    /// The run's end (a wait to become a claim's owner ends with it).
    stop: CancellationToken,
}

/// Whether a claim event concerns the cloning protection: the claim may carry it, or may be a
/// clone (whose change can release its source). A substring test on the cached JSON first,
/// so that the other claims cost nothing.
fn clone_protection_keys(c: &CachedClaim) -> Vec<Box<str>> {
    let mut keys = Vec::new();
    if !c.mentions(source::CLONE_FINALIZER) && !c.mentions("\"PersistentVolumeClaim\"") {
        return keys;
    }
    let claim = c.claim();
    if claim.metadata.deletion_timestamp.is_some()
        && claim
            .finalizers()
            .iter()
            .any(|f| f == source::CLONE_FINALIZER)
    {
        keys.push(claim_key(&claim));
    }
    if let Ok(request::DataSource::Claim { name, namespace }) = request::data_source(&claim) {
        keys.push(format!("{namespace}/{name}").into_boxed_str());
    }
    keys
}

/// Runs the controller until `shutdown`: fills the caches, reads the in-flight record, then
/// provisions, deletes, and finishes recorded volumes.
pub async fn run(
    cfg: Config,
    mut clients: Clients,
    shutdown: CancellationToken,
) -> Result<(), ControllerError> {
    let metrics = Arc::clone(&clients.metrics);
    let claims_q: Arc<WorkQueue<Box<str>>> = WorkQueue::new(
        "claims",
        cfg.retry_start,
        cfg.retry_max,
        Arc::clone(&metrics),
        shutdown.clone(),
    );
    let volumes_q: Arc<WorkQueue<String>> = WorkQueue::new(
        "volumes",
        cfg.retry_start,
        cfg.retry_max,
        Arc::clone(&metrics),
        shutdown.clone(),
    );
    let records_q: Arc<WorkQueue<String>> = WorkQueue::new(
        "records",
        cfg.retry_start,
        cfg.retry_max,
        Arc::clone(&metrics),
        shutdown.clone(),
    );
    let clone_sources_q: Arc<WorkQueue<Box<str>>> = WorkQueue::new(
        "cloning-protection",
        cfg.retry_start,
        cfg.retry_max,
        Arc::clone(&metrics),
        shutdown.clone(),
    );
    let clone_protection = cfg.capabilities.clone_volume;
    let inflight = Arc::new(InFlight::default());
    let watches = clients.watches.clone();
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
    let owner_attempts: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let writes = Arc::new(Writes::default());
    let (q, r, m, cp, attempts, w) = (
        Arc::clone(&claims_q),
        Arc::clone(&records_q),
        Arc::clone(&inflight),
        Arc::clone(&clone_sources_q),
        Arc::clone(&owner_attempts),
        Arc::clone(&writes),
    );
    // Decoded whole, kept compact (`CachedClaim::new`).
    let claims = cache::watch_compact::<PersistentVolumeClaim, _>(
        &watches,
        watcher::Config::default(),
        &shutdown,
        &mut ready,
        CachedClaim::new,
        move |c: &CachedClaim, deleted| {
            if clone_protection {
                for key in clone_protection_keys(c) {
                    cp.add(key);
                }
            }
            if deleted {
                // A deleted claim's recorded volume is finished by the record's worker.
                if let Some(v) = m.volume_of_claim(c.uid()) {
                    r.add(v.entry.volume);
                }
                lock(&attempts).remove(c.uid());
                w.forget(c.uid());
            } else {
                q.add(c.key().into());
            }
        },
    );
    let q = Arc::clone(&volumes_q);
    let volumes = cache::watch_compact::<WatchedPv, _>(
        &watches,
        watcher::Config::default(),
        &shutdown,
        &mut ready,
        CachedPv::from,
        move |v: &CachedPv, deleted| {
            if !deleted {
                q.add(v.name.to_string());
            }
        },
    );
    let classes = cache::watch::<StorageClass>(&watches, &shutdown, &mut ready, |_| {}, |_, _| {});
    // A node's provisioner knows its one node from NodeGetInfo: no Node or CSINode watch.
    let local = cfg.node.as_ref().map(|n| {
        (
            Arc::new(n.local.node_object()),
            Arc::new(n.local.csinode_object(&cfg.driver)),
        )
    });
    if let Some((n, c)) = &local {
        info!(
            "using local topology with Node = {:?} and CSINode = {:?}",
            n.metadata, c.spec
        );
    }
    let (nodes, csinodes) = if topology && local.is_none() {
        let driver = cfg.driver.clone();
        (
            Some(cache::watch::<Node>(
                &watches,
                &shutdown,
                &mut ready,
                trim_node,
                |_, _| {},
            )),
            Some(cache::watch::<CSINode>(
                &watches,
                &shutdown,
                &mut ready,
                move |n| trim_csinode(n, &driver),
                |_, _| {},
            )),
        )
    } else {
        (None, None)
    };
    // A volume's deletion waits for its attachments to go (§12): the deletion of one brings
    // its PV back at once, not after the PV's back-off (up to --retry-interval-max).
    let q = Arc::clone(&volumes_q);
    let attachments = attach.then(|| {
        cache::watch_compact::<VolumeAttachment, _>(
            &watches,
            watcher::Config::default(),
            &shutdown,
            &mut ready,
            Attachment::of,
            move |va: &Attachment, deleted| {
                if deleted && let Some(pv) = va.pv.as_deref() {
                    q.add(pv.to_owned());
                }
            },
        )
    });

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

    // What a previous process (or leader) left in flight; the claims are all queued already.
    let mut failures = 0;
    let loaded = loop {
        let attempt = tokio::select! {
            loaded = clients.journal.load() => loaded,
            () = shutdown.cancelled() => return Ok(()),
        };
        match attempt {
            Ok(l) => break l,
            Err(e) => {
                // Nothing may be created before the record is known: wait for it.
                failures += 1;
                error!("{e}; retrying");
                tokio::select! {
                    () = LOAD_BACKOFF.sleep(failures) => {}
                    () = shutdown.cancelled() => return Ok(()),
                }
            }
        }
    };
    if !loaded.is_empty() {
        info!(
            volumes = loaded.len(),
            "finishing the volumes of the in-flight record"
        );
    }
    for e in loaded {
        records_q.add(e.volume.clone());
        inflight.add(e, true);
    }
    let mut found = std::mem::replace(&mut clients.found, mpsc::unbounded_channel().1);

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
            local,
        },
        claims: claims_q,
        volumes: volumes_q,
        records: records_q,
        clone_sources: clone_sources_q,
        inflight,
        writes,
        owner_attempts,
        stop: shutdown.clone(),
    });
    let mut workers = tokio::task::JoinSet::new();
    // Each sync is boxed: its future (tens of KiB for a claim's) lives on the heap only while
    // the key is worked on, not in each of the idle workers' tasks.
    if clone_protection {
        info!(
            "starting {} cloning-protection workers",
            ctl.cfg.clone_protection_workers.max(1)
        );
        let lane = Lane::new(
            Arc::clone(&ctl.clone_sources),
            ctl.cfg.clone_protection_workers,
        );
        workers.spawn(Runner::new(vec![lane]).run(
            Arc::clone(&ctl),
            shutdown.clone(),
            |c: Arc<Controller>, _, key: Box<str>| async move {
                c.sync_clone_source(&key).await.map(|()| Action::Done)
            },
            |_: &Controller, _, _, Requeue| Action::Retry,
        ));
    }
    if !ctl.cfg.snapshot_sweep.is_zero() && ctl.cfg.capabilities.create_delete_snapshot {
        workers.spawn(Arc::clone(&ctl).sweep_snapshots(shutdown.clone()));
    }

    workers.spawn(Arc::clone(&ctl.clients.journal).run(shutdown.clone()));
    let c = Arc::clone(&ctl);
    let stop = shutdown.clone();
    workers.spawn(async move {
        while let Some(e) = tokio::select! {
            e = found.recv() => e,
            () = stop.cancelled() => None,
        } {
            warn!(volume = %e.volume, claim = %e.claim_key(), "another process recorded this volume; taking it over");
            c.records.add(e.volume.clone());
            c.inflight.add(e, true);
        }
    });
    let n = ctl.cfg.workers;
    // Upstream re-enqueues every claim and volume every 15 minutes; the record too.
    let c = Arc::clone(&ctl);
    let resync = move || {
        for claim in c.caches.claims.state() {
            c.claims.add(claim.key().into());
        }
        for v in c.caches.volumes.state() {
            c.volumes.add(v.name.to_string());
        }
        for v in c.inflight.volumes() {
            c.records.add(v);
        }
    };
    workers.spawn(
        Runner::new(vec![Lane::new(Arc::clone(&ctl.claims), n)])
            .resync(RESYNC, resync)
            .run(
                Arc::clone(&ctl),
                shutdown.clone(),
                |c: Arc<Controller>, _, key: Box<str>| async move {
                    c.sync_claim(&key).await.map(|()| Action::Done)
                },
                |c: &Controller, _, key, Requeue| {
                    let failures = c.claims.failures(key) + 1;
                    info!(key = %key, failures, "Retrying syncing claim");
                    Action::Retry
                },
            ),
    );
    workers.spawn(volume_runner(&ctl, &shutdown, Volumes::Pv));
    workers.spawn(volume_runner(&ctl, &shutdown, Volumes::Record));
    shutdown.cancelled().await;
    while workers.join_next().await.is_some() {}
    Ok(())
}

/// The two queues keyed by volume name.
#[derive(Clone, Copy)]
enum Volumes {
    /// PVs of this driver.
    Pv,
    /// The volumes of the in-flight record.
    Record,
}

/// The runner of one of the queues keyed by volume name, with `--worker-threads` workers.
fn volume_runner(
    ctl: &Arc<Controller>,
    shutdown: &CancellationToken,
    which: Volumes,
) -> impl Future<Output = ()> + use<> {
    let queue = match which {
        Volumes::Pv => &ctl.volumes,
        Volumes::Record => &ctl.records,
    };
    Runner::new(vec![Lane::new(Arc::clone(queue), ctl.cfg.workers)]).run(
        Arc::clone(ctl),
        shutdown.clone(),
        move |c: Arc<Controller>, _, key: String| async move {
            match which {
                Volumes::Pv => c.sync_volume(&key).await,
                Volumes::Record => c.sync_record(&key).await,
            }
            .map(|()| Action::Done)
        },
        move |c: &Controller, _, key: &String, Requeue| {
            match which {
                Volumes::Pv => {
                    let failures = c.volumes.failures(key) + 1;
                    info!(volume = %key, failures, "Retrying syncing volume");
                }
                Volumes::Record => {
                    let failures = c.records.failures(key) + 1;
                    info!(volume = %key, failures, "Retrying the in-flight volume");
                }
            }
            Action::Retry
        },
    )
}

/// A Node as topology reads it: its name and labels.
fn trim_node(n: &mut Node) {
    n.metadata.annotations = None;
    n.metadata.owner_references = None;
    n.spec = None;
    n.status = None;
}

/// A CSINode as topology reads it: this driver's entry only.
fn trim_csinode(n: &mut CSINode, driver: &str) {
    n.metadata.annotations = None;
    n.metadata.labels = None;
    n.metadata.owner_references = None;
    n.spec.drivers.retain(|d| d.name == driver);
}

/// A VolumeAttachment as the deletion check reads it: its PV and node, and its name as the
/// store's key. Typed, a `VolumeAttachment` is about 3.5 KiB before a single string (its
/// `inlineVolumeSpec` is a whole PV spec inline); this is a few dozen bytes.
#[derive(Debug)]
struct Attachment {
    name: Box<str>,
    pv: Option<Box<str>>,
    node: Box<str>,
}

impl Attachment {
    fn of(va: VolumeAttachment) -> Self {
        Self {
            name: va.metadata.name.unwrap_or_default().into_boxed_str(),
            pv: va
                .spec
                .source
                .persistent_volume_name
                .map(String::into_boxed_str),
            node: va.spec.node_name.into_boxed_str(),
        }
    }
}

impl cache::Keyed for Attachment {
    fn key(&self) -> &str {
        &self.name
    }
}

/// The work queue's key of `claim` (its key in the claims' store).
fn claim_key(claim: &PersistentVolumeClaim) -> Box<str> {
    cache::store_key(&claim.metadata)
}

fn volume_ref(v: &CachedPv) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolume".into()),
        name: Some(v.name.to_string()),
        uid: (!v.uid.is_empty()).then(|| v.uid.to_string()),
        resource_version: (!v.resource_version.is_empty()).then(|| v.resource_version.to_string()),
        ..Default::default()
    }
}

/// The claim an entry of the record names, for events about it.
fn entry_claim_ref(e: &Entry) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolumeClaim".into()),
        namespace: Some(e.namespace.clone()),
        name: Some(e.claim.clone()),
        uid: Some(e.uid.clone()),
        ..Default::default()
    }
}

impl From<ActError> for Failure {
    fn from(e: ActError) -> Self {
        match e {
            ActError::Busy(_) => Failure::Silent(e.to_string()),
            ActError::Capabilities(p) => Failure::Error(p),
            e => Failure::Error(ProvisionError::no_change(e.to_string())),
        }
    }
}

impl Controller {
    fn event(&self, obj: &ObjectReference, t: EventType, reason: &str, msg: &str) {
        self.clients.events.event(obj, t, reason, msg);
    }

    async fn sync_claim(&self, key: &str) -> Result<(), Requeue> {
        let Some(cached) = self.caches.claims.get(key) else {
            // A deleted claim's recorded volume went to the record's worker with the deletion.
            debug!(claim = %key, "claim in work queue no longer exists");
            return Ok(());
        };
        let claim = cached.claim();
        drop(cached);
        let now = Instant::now();
        let uid = claim.uid().unwrap_or_default();
        let version = claim.resource_version().unwrap_or_default();
        let class_name = request::claim_class(&claim);
        let class = self.caches.classes.get(&ObjectRef::new(&class_name));
        let record = self.inflight.volume_of_claim(&uid);
        let driver = self.cfg.driver.as_str();
        let opts = &self.cfg.request;
        let name =
            request::volume_name(&opts.volume_name_prefix, opts.volume_name_uuid_length, &uid);
        let named_has_class =
            decide::class_to_find(&claim, class.as_deref(), driver).is_some_and(|n| {
                let classes = self.caches.classes.state();
                classes.iter().any(|c| c.provisioner == n)
            });
        let volume = decide::volume_to_find(
            &claim,
            class.as_deref(),
            driver,
            named_has_class,
            record.as_ref(),
            &name,
        );
        let view = decide::ClaimView {
            claim: &claim,
            class: class.as_deref(),
            driver,
            record: record.as_ref(),
            name: &name,
            pv_cached: volume.is_some_and(|v| self.caches.volumes.get(&v).is_some()),
            infeasible: class.as_ref().is_some_and(|c| {
                let class_uid = c.uid().unwrap_or_default();
                self.inflight.infeasible(&uid, &class_uid, now)
            }),
            stale: self.writes.behind(uid.as_str(), Some(version.as_str())),
            named_has_class,
            another_node: self.another_node(&claim),
        };
        let action = decide::claim(&view);
        debug!(claim = %key, ?action, "claim synced");
        match action {
            ClaimAction::Nothing => Ok(()),
            ClaimAction::WaitForCache => {
                debug!(claim = %key, "claim in cache predates its reschedule; waiting");
                Err(Requeue)
            }
            ClaimAction::Retry(e) => {
                self.clients.provisioned.provision_failed(&class_name, "");
                debug!(claim = %key, "{e}");
                Err(Requeue)
            }
            ClaimAction::Fail(e) => {
                self.fail(&claim, &class_name, e);
                Err(Requeue)
            }
            ClaimAction::Forget(v) => {
                self.clients.journal.forget(&v);
                self.inflight.remove(&v);
                Ok(())
            }
            ClaimAction::HandOver(v) => {
                // The record's worker deletes the volume; the claim (if it stays) retries.
                self.records.add(v);
                Err(Requeue)
            }
            ClaimAction::ReleaseLegacy => self.release_legacy(&claim).await.map_err(|e| {
                warn!(claim = %key, "{e}");
                Requeue
            }),
            ClaimAction::AdoptLegacy(v) => self
                .adopt_legacy(&claim, class.as_deref(), &v)
                .await
                .map_err(|e| {
                    warn!(claim = %key, "{e}");
                    Requeue
                }),
            ClaimAction::Populator => {
                self.event(
                    &pv::claim_ref(&claim),
                    EventType::Normal,
                    "Provisioning",
                    request::POPULATOR_EVENT,
                );
                Ok(())
            }
            ClaimAction::Provision { volume } => match class {
                Some(class) => {
                    self.provision_claim(key, &claim, &class, &volume, record)
                        .await
                }
                None => Err(Requeue),
            },
        }
    }

    /// [`ClaimAction::Provision`]: unless `--node-deployment` leaves the claim to another node
    /// (or to becoming its owner first), provisions its volume and reports the attempt's end.
    async fn provision_claim(
        &self,
        key: &str,
        claim: &PersistentVolumeClaim,
        class: &StorageClass,
        volume: &str,
        record: Option<crate::inflight::Volume>,
    ) -> Result<(), Requeue> {
        let class_name = request::claim_class(claim);
        let nd = self.cfg.node.as_deref();
        let this_node = nd.map(|nd| plan::ThisNode {
            name: &nd.local.node,
            immediate_binding: nd.immediate_binding,
        });
        match (plan::take(claim, class, record.is_some(), this_node), nd) {
            (Take::Provision, _) => {}
            (Take::TryOwner, Some(nd)) => {
                return self.become_owner(claim, class, nd).await.map_err(|e| {
                    self.fail(claim, &class_name, plan::owner_failed(key, &e));
                    Requeue
                });
            }
            (Take::Skip | Take::TryOwner, _) => return Ok(()),
        }
        let started = Instant::now();
        let result = self.provision(claim, class, volume, record).await;
        let end = plan::finished(result);
        if end.refresh_capacity
            && let Some(r) = &self.clients.capacity
        {
            r.class(&class_name);
        }
        match end.result {
            Ok(()) => {
                let took = started.elapsed();
                self.clients
                    .provisioned
                    .provision_succeeded(&class_name, "", took);
                Ok(())
            }
            Err(Failure::Silent(e)) => {
                self.clients.provisioned.provision_failed(&class_name, "");
                debug!(claim = %key, "{e}");
                Err(Requeue)
            }
            Err(Failure::Error(e)) => {
                if end.slow {
                    let uid = claim.uid().unwrap_or_default();
                    let class_uid = class.uid().unwrap_or_default();
                    self.inflight
                        .set_infeasible(&uid, &class_uid, Instant::now());
                }
                self.fail(claim, &class_name, e);
                Err(Requeue)
            }
        }
    }

    /// `--node-deployment`: whether the claim is selected for another node than this one.
    fn another_node(&self, claim: &PersistentVolumeClaim) -> bool {
        let this = self.cfg.node.as_deref().map(|nd| nd.local.node.as_str());
        decide::another_node(claim, this)
    }

    /// §B.4: waits this node's turn, checks its capacity, and writes its name into the claim's
    /// `selected-node` annotation; the Update's event brings the claim back, now this node's.
    /// Returns without an error when another node took the claim first, when this node has too
    /// little capacity, or when the class's allowed topologies exclude this node. Each answer
    /// is read by [`owner`].
    async fn become_owner(
        &self,
        claim: &PersistentVolumeClaim,
        class: &StorageClass,
        nd: &NodeDeployment,
    ) -> Result<(), String> {
        let node_name = nd.local.node.as_str();
        let ns = claim.namespace().unwrap_or_default();
        let name = claim.name_any();
        let key: Box<str> = format!("{ns}/{name}").into();
        let uid = claim.uid().unwrap_or_default();
        let cx = owner::Context {
            node: node_name,
            class,
            driver: &self.cfg.driver,
            options: &self.cfg.request,
            topology: &self.caches,
        };
        if let Some(why) = owner::excluded(claim, &cx) {
            debug!("{why}");
            return Ok(());
        }
        let poll = (nd.base_delay / 100).max(Duration::from_millis(10));
        loop {
            let attempt = *lock(&self.owner_attempts).entry(uid.clone()).or_default();
            let wait = node::delay(
                nd.base_delay,
                nd.max_delay,
                attempt,
                plugreg_runtime::backoff::unit_random(),
            );
            lock(&self.owner_attempts).insert(uid.clone(), attempt.saturating_add(1));
            debug!(
                "will try to become owner of PVC {key} with resource version {} in {wait:?} (attempt #{attempt})",
                claim.resource_version().unwrap_or_default()
            );
            let deadline = Instant::now() + wait;
            // The cached claim, watched while waiting and once at the end.
            let current = loop {
                let cached = self.caches.claims.get(&key).map(|c| c.claim());
                let current = match owner::waited(cached, &name, &uid, node_name) {
                    owner::Waited::Free(current) => current,
                    owner::Waited::Stop {
                        forget_attempts,
                        log,
                    } => {
                        if forget_attempts {
                            lock(&self.owner_attempts).remove(&uid);
                        }
                        if let Some(log) = log {
                            debug!("{log}");
                        }
                        return Ok(());
                    }
                    owner::Waited::Fail(e) => return Err(e),
                };
                let now = Instant::now();
                if now >= deadline {
                    break current;
                }
                tokio::select! {
                    () = tokio::time::sleep(poll.min(deadline - now)) => {}
                    () = self.stop.cancelled() => {
                        return Err("timed out waiting to become PVC owner".to_owned());
                    }
                }
            };
            if !self.enough_capacity(&current, &cx).await {
                debug!(
                    "not enough capacity for PVC {key} with resource version {} on node {node_name}",
                    current.resource_version().unwrap_or_default()
                );
                return Ok(());
            }
            let patch = owner::patch(&current, node_name);
            let api: Api<PersistentVolumeClaim> = Api::namespaced(self.clients.high.clone(), &ns);
            let answer = api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await;
            match owner::patched(answer.map(drop).map_err(|e| api_error(&e)), node_name) {
                owner::Patched::Owner => {
                    lock(&self.owner_attempts).remove(&uid);
                    info!(claim = %key, node = node_name, "became the owner of the claim");
                    return Ok(());
                }
                owner::Patched::Retry => {
                    debug!("conflict during PVC {key} update, will try again");
                }
                owner::Patched::Fail(e) => return Err(e),
            }
        }
    }

    /// §B.4 step 3: whether this node's driver reports room for the claim in one of the
    /// request's topology terms (or without topology); what to ask and what the answers mean
    /// is [`owner::capacity_check`]'s and [`owner::capacity_answer`]'s.
    async fn enough_capacity(
        &self,
        claim: &PersistentVolumeClaim,
        cx: &owner::Context<'_>,
    ) -> bool {
        let key = owner::key(claim);
        let (needed, requests) = match owner::capacity_check(claim, cx) {
            owner::CapacityCheck::Proceed(log) => {
                if let Some(log) = log {
                    debug!("{log}");
                }
                return true;
            }
            owner::CapacityCheck::Ask { needed, requests } => (needed, requests),
        };
        for req in requests {
            let answer = self.clients.driver.get_capacity_with(req).await;
            let available = answer
                .map(|r| r.available_capacity)
                .map_err(|e| e.to_status());
            match owner::capacity_answer(&key, available, needed) {
                owner::CapacityAnswer::Enough => return true,
                owner::CapacityAnswer::Short => {}
                owner::CapacityAnswer::Proceed(log) => {
                    debug!("{log}");
                    return true;
                }
            }
        }
        false
    }

    /// Upstream's `ProvisioningFailed` event and log line.
    fn fail(&self, claim: &PersistentVolumeClaim, class: &str, e: ProvisionError) {
        self.clients.provisioned.provision_failed(class, "");
        let report = plan::failed_event(class, e);
        let r = pv::claim_ref(claim);
        self.event(&r, EventType::Warning, "ProvisioningFailed", &report.event);
        warn!(claim = %format!("{}/{}", claim.namespace().unwrap_or_default(), claim.name_any()), "failed to provision volume: {}", report.log);
    }

    /// Records the volume (unless a CreateVolume of it may have run already: then the recorded
    /// request is repeated), calls CreateVolume, and saves the PV: each step's facts gathered
    /// here, decided by [`plan`], and carried out here.
    async fn provision(
        &self,
        claim: &PersistentVolumeClaim,
        class: &StorageClass,
        volume: &str,
        record: Option<crate::inflight::Volume>,
    ) -> Result<(), Failure> {
        let driver = &self.cfg.driver;
        let ns = claim.namespace().unwrap_or_default();
        let r = pv::claim_ref(claim);
        self.event(
            &r,
            EventType::Normal,
            "Provisioning",
            &format!(
                "External provisioner is provisioning volume for claim \"{ns}/{}\"",
                claim.name_any()
            ),
        );
        let c = plan::Claim {
            claim,
            class,
            driver,
            identity: &self.cfg.identity,
            options: &self.cfg.request,
            volume,
            record: record.as_ref(),
        };
        let mut ready = match plan::start(&c, self.check_capabilities(), &self.caches) {
            Ok(ready) => ready,
            Err(f) => return Err(self.failed(claim, volume, f).await),
        };
        // Upstream only logs the deprecation warnings.
        for w in &ready.prepared.warnings {
            warn!("{w}");
        }
        // The claim's VolumeAttributesClass, read live as upstream does (an error leaves the
        // claim as it is, to be retried).
        if let Some(name) = &ready.attributes_class {
            let api: Api<plugreg_sidecar_kit::vac::VolumeAttributesClass> =
                Api::all(self.clients.high.clone());
            let vac = api.get(name).await.map_err(|e| {
                Failure::Error(ProvisionError::no_change(format!(
                    "failed to get VolumeAttributesClass {name}: {e}"
                )))
            })?;
            request::apply_attributes_class(&mut ready.prepared, &vac, driver)
                .map_err(Failure::Error)?;
        }
        // A restore or a clone: the source, read live and checked as upstream does, then
        // protected by its finalizer until the volume exists.
        let mut source_read = None;
        if ready.read_source {
            // Boxed: its two reads at once are the largest state of a claim's sync, and only a
            // restore or a clone needs it.
            let (source, read) = Box::pin(self.content_source(claim, class, &ready.source)).await?;
            ready.prepared.request.volume_content_source = source;
            source_read = read;
        }
        self.protect_source(&ready.source, source_read).await?;
        let send = match plan::send(&c, &ready) {
            Ok(send) => send,
            Err(f) => return Err(self.failed(claim, volume, f).await),
        };
        if let Some(entry) = send.record {
            self.inflight.add(entry.clone(), false);
            if let Err(e) = self.clients.journal.record(entry).await {
                self.inflight.remove(volume);
                return Err(ActError::from(e).into());
            }
        }
        let _busy = self
            .inflight
            .begin(volume)
            .ok_or_else(|| ActError::Busy(volume.to_owned()))?;
        let mut request = send.request;
        if let Some(s) = &send.secret {
            request.secrets = self.secret_data(s).await?;
        }

        let answer = self
            .clients
            .driver
            .create_volume(request.clone(), ready.migrated)
            .await
            .map_err(|e| e.to_status());
        let response = match plan::created(&ready, answer) {
            Ok(r) => r,
            Err(f) => return Err(self.failed(claim, volume, f).await),
        };
        let pv_object = match plan::built(&c, &ready, &response) {
            plan::Built::Save(pv) => pv,
            plan::Built::Cleanup {
                id,
                message,
                warning,
            } => {
                if let Some(w) = warning {
                    warn!(pv = %volume, "{w}");
                }
                let deleted = self.cleanup(&id, &request.secrets, ready.migrated).await;
                let f = plan::cleaned_up(volume, message, deleted);
                return Err(self.failed(claim, volume, f).await);
            }
            plan::Built::Fail(f) => return Err(self.failed(claim, volume, f).await),
        };
        let pvs: Api<PersistentVolume> = Api::all(self.clients.high.clone());
        let answer = pvs.create(&PostParams::default(), &pv_object).await;
        match plan::saved(volume, answer.map(drop).map_err(|e| api_error(&e))) {
            plan::Saved::Created => {}
            plan::Saved::Existed => debug!(pv = %volume, "persistentvolume already exists"),
            plan::Saved::Failed { warning, failed } => {
                warn!(pv = %volume, "{warning}");
                return Err(self.failed(claim, volume, failed).await);
            }
        }
        // The PV is the volume's record now; the memory stays until the cache shows it.
        self.inflight.mark_saved(volume, Instant::now());
        self.clients.journal.forget(volume);
        if let Some(snapshot) = plan::snapshot_to_release(claim) {
            self.release_snapshot(&ns, snapshot).await;
        }
        info!(claim = %format!("{ns}/{}", claim.name_any()), pv = %volume, "successfully created PV");
        self.event(
            &r,
            EventType::Normal,
            "ProvisioningSucceeded",
            &format!("Successfully provisioned volume {volume}"),
        );
        Ok(())
    }

    /// Carries out a failed step of [`Controller::provision`]: the record first, then the
    /// reschedule (whose own failure is reported instead); returns what is reported.
    async fn failed(
        &self,
        claim: &PersistentVolumeClaim,
        volume: &str,
        f: plan::Failed,
    ) -> Failure {
        match f.record {
            plan::RecordStep::Keep => {}
            plan::RecordStep::Drop => self.drop_record(volume),
            plan::RecordStep::MarkAmbiguous => self.inflight.mark_ambiguous(volume),
        }
        if f.reschedule
            && let Err(e) = self.reschedule(claim).await
        {
            return e;
        }
        f.failure
    }

    /// The content source of a restore or a clone (`None` for an empty volume): the snapshot
    /// and its content, or the source claim and its PersistentVolume, read live and checked in
    /// upstream's order. A failed check is upstream's no-change error: a `ProvisioningFailed`
    /// event and a retry with back-off (a snapshot not ready yet is provisioned once it is).
    async fn content_source(
        &self,
        claim: &PersistentVolumeClaim,
        class: &StorageClass,
        source: &request::DataSource,
    ) -> Result<(Option<VolumeContentSource>, Option<serde_json::Value>), Failure> {
        let Some((kind, name)) = source.kind_and_name() else {
            return Ok((None, None));
        };
        let wrap = |msg: String| {
            Failure::Error(ProvisionError::no_change(format!(
                "error getting handle for DataSource Type {kind} by Name {name}: {msg}"
            )))
        };
        let high = &self.clients.high;
        match source {
            request::DataSource::Snapshot { name, namespace } => {
                let raw = get_json(high, &snapshots_path(namespace), name).await;
                let (vs, raw) = typed::<VolumeSnapshot>(raw).map_err(|e| {
                    wrap(format!(
                        "error getting snapshot {name} from api server: {}",
                        go_error(&e)
                    ))
                })?;
                let content = source::snapshot_content_name(&vs).map_err(wrap)?;
                let contents: Api<VolumeSnapshotContent> = Api::all(high.clone());
                let vsc = contents.get(&content).await.map_err(|e| {
                    warn!(
                        "error getting snapshotcontent {content} for snapshot {namespace}/{name} from api server: {}",
                        go_error(&e)
                    );
                    wrap(source::not_bound(name))
                })?;
                let source = source::restore_source(
                    claim,
                    class,
                    &vs,
                    &vsc,
                    self.cfg.request.prevent_volume_mode_conversion,
                )
                .map_err(wrap)?;
                Ok((Some(source), Some(raw)))
            }
            request::DataSource::Claim { name, namespace } => {
                // Read live: the cache keeps of a Bound claim only what provisioning it needs,
                // and the Update that protects it must start from the whole object. Upstream
                // reads the claim from its informer and then GETs its PV; so that the live
                // read adds no round trip to the step, the PV the cached claim is bound to is
                // read at the same time (a claim's volumeName does not change once set), and
                // read again only if the live claim names another.
                let pvs: Api<PersistentVolume> = Api::all(high.clone());
                let cached_volume = self
                    .caches
                    .claims
                    .get(&format!("{namespace}/{name}"))
                    .and_then(|c| c.claim().spec?.volume_name)
                    .filter(|v| !v.is_empty());
                let path = claims_path(namespace);
                let (raw, early) = tokio::join!(get_json(high, &path, name), async {
                    match &cached_volume {
                        Some(v) => Some(pvs.get(v).await),
                        None => None,
                    }
                });
                let (src, raw) = typed::<PersistentVolumeClaim>(raw).map_err(|e| {
                    let ns = claim.namespace().unwrap_or_default();
                    wrap(plan::source_claim_unreadable(name, &ns, &api_error(&e)))
                })?;
                let volume = source::clone_claim_checks(claim, &src).map_err(wrap)?;
                let read = match early {
                    Some(read) if cached_volume.as_deref() == Some(volume.as_str()) => read,
                    _ => pvs.get(&volume).await,
                };
                let pv = match read {
                    Ok(pv) => Some(pv),
                    Err(e) => {
                        warn!(
                            "error getting volume {volume} for PVC {namespace}/{name}: {}",
                            go_error(&e)
                        );
                        None
                    }
                };
                let source = source::clone_source(claim, class, &src, pv.as_ref()).map_err(wrap)?;
                Ok((Some(source), Some(raw)))
            }
            request::DataSource::None | request::DataSource::ExternalPopulator { .. } => {
                Ok((None, None))
            }
        }
    }

    /// Puts the provisioner's finalizer on the source before CreateVolume: the cloning
    /// protection on a source claim (any failure: no-change), the restore protection on a
    /// snapshot (Forbidden is tolerated, as upstream: RBAC may not grant it). A source gone
    /// meanwhile needs no protection. `read` is the source as the checks just read it: the
    /// Update starts from it (upstream's one round trip) and reads again only on a conflict.
    async fn protect_source(
        &self,
        source: &request::DataSource,
        read: Option<serde_json::Value>,
    ) -> Result<(), Failure> {
        let high = &self.clients.high;
        match source {
            request::DataSource::Claim { name, namespace } => {
                let answer = update_known(high, &claims_path(namespace), name, read, |o| {
                    edit::finalizer(o, source::CLONE_FINALIZER, true)
                })
                .await;
                plan::clone_protected(answer.map(drop).map_err(|e| api_error(&e)))?;
            }
            request::DataSource::Snapshot { name, namespace } => {
                let answer = update_known(high, &snapshots_path(namespace), name, read, |o| {
                    edit::finalizer(o, source::SNAPSHOT_FINALIZER, true)
                })
                .await;
                let answer = answer.map(drop).map_err(|e| api_error(&e));
                if let Some(line) = plan::snapshot_protected(namespace, name, answer)? {
                    info!(snapshot = %format!("{namespace}/{name}"), "{line}");
                }
            }
            request::DataSource::None | request::DataSource::ExternalPopulator { .. } => {}
        }
        Ok(())
    }

    /// Removes the restore protection from the snapshot `ns/name` after its restore succeeded.
    /// A snapshot gone, or a finalizer RBAC does not let us touch, is fine; any other failure
    /// is logged and left to the sweeper (provisioning still succeeded).
    async fn release_snapshot(&self, ns: &str, name: &str) {
        let answer = update_json(&self.clients.high, &snapshots_path(ns), name, |o| {
            edit::finalizer(o, source::SNAPSHOT_FINALIZER, false)
        })
        .await;
        if let Some(w) =
            plan::snapshot_released(ns, name, answer.map(drop).map_err(|e| api_error(&e)))
        {
            warn!("{w}");
        }
    }

    /// The cloning-protection controller: a source claim being deleted keeps its finalizer
    /// while a clone of it in its namespace is still Pending, and loses it after.
    async fn sync_clone_source(&self, key: &str) -> Result<(), Requeue> {
        let Some(cached) = self.caches.claims.get(key) else {
            return Ok(());
        };
        let claim = cached.claim();
        drop(cached);
        if claim.metadata.deletion_timestamp.is_none()
            || !claim
                .finalizers()
                .iter()
                .any(|f| f == source::CLONE_FINALIZER)
        {
            return Ok(());
        }
        let ns = claim.namespace().unwrap_or_default();
        let name = claim.name_any();
        let quoted = format!("\"{name}\"");
        let cloning = self.caches.claims.any(|o| {
            o.namespace() == ns && o.mentions(&quoted) && {
                let o = o.claim();
                let pending = o.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending");
                let source = o.spec.as_ref().and_then(|s| s.data_source.as_ref());
                pending
                    && source.is_some_and(|d| d.kind == "PersistentVolumeClaim" && d.name == name)
            }
        });
        if cloning {
            warn!(
                "Retrying to sync claim {ns}/{name}: PVC '{name}' is in 'Pending' state, cloning in progress"
            );
            return Err(Requeue);
        }
        // A recorded clone of it not settled yet (its claim may be gone) still needs the
        // source: finishing or deleting it repeats CreateVolume, which the driver answers only
        // while the source volume exists.
        let handle = claim
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.as_deref())
            .and_then(|v| self.caches.volumes.get(v))
            .and_then(|pv| Some(pv.spec.as_ref()?.csi.as_ref()?.volume_handle.clone()));
        if let Some(handle) = handle
            && self.recorded_sources().iter().any(
                |s| matches!(s, volume_content_source::Type::Volume(v) if v.volume_id == handle),
            )
        {
            info!(claim = %format!("{ns}/{name}"), "a recorded clone of it is in flight; keeping the cloning-protection finalizer");
            return Err(Requeue);
        }
        match self
            .update_claim(&ns, &name, |o| {
                edit::finalizer(o, source::CLONE_FINALIZER, false)
            })
            .await
        {
            Ok(_) => {
                info!(claim = %format!("{ns}/{name}"), "removed the cloning-protection finalizer");
                Ok(())
            }
            Err(e) => {
                warn!(claim = %format!("{ns}/{name}"), "{e}");
                Err(Requeue)
            }
        }
    }

    /// The sweeper of restore finalizers left on VolumeSnapshots (a restore whose claim was
    /// deleted, or whose removal failed): every `snapshot_sweep`, the finalizer goes from each
    /// snapshot that no Pending claim restores from and no recorded in-flight restore of its
    /// namespace may still need. Off when the snapshot API is not served or RBAC does not let
    /// it list snapshots.
    async fn sweep_snapshots(self: Arc<Self>, stop: CancellationToken) {
        let api: Api<VolumeSnapshot> = Api::all(self.clients.low.clone());
        match api.list(&kube::api::ListParams::default().limit(1)).await {
            Ok(_) => {}
            Err(e) => {
                info!(
                    "snapshot finalizer sweeper disabled: cannot list volumesnapshots: {}",
                    go_error(&e)
                );
                return;
            }
        }
        let mut tick = tokio::time::interval_at(
            Instant::now() + self.cfg.snapshot_sweep,
            self.cfg.snapshot_sweep,
        );
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = stop.cancelled() => return,
            }
            // Namespaces with a recorded restore in flight: their snapshots stay protected
            // until the record is settled (its retry or its deletion repeats the restore).
            let restoring: std::collections::HashSet<String> = self
                .inflight
                .volumes()
                .iter()
                .filter_map(|v| self.inflight.volume(v))
                .filter(|v| {
                    v.entry.request().ok().is_some_and(|r| {
                        matches!(
                            r.volume_content_source.and_then(|c| c.r#type),
                            Some(volume_content_source::Type::Snapshot(_))
                        )
                    })
                })
                .map(|v| v.entry.namespace.clone())
                .collect();
            // Only the metadata, a page at a time, and of it only the names and finalizers: a
            // cluster with thousands of snapshots is never held whole (a full list of 1,000
            // typed snapshots every sweep was an 8 MB peak of the provisioner's memory; pages
            // of 250 decoded as `PartialObjectMeta`, every managedFields entry a JSON tree, were
            // a 1.7 MB peak of csi-sidecars' at 600 claims).
            let mut params = kube::api::ListParams::default().limit(SWEEP_PAGE);
            loop {
                let page = match list_snapshot_finalizers(&self.clients.low, &params).await {
                    Ok(l) => l,
                    Err(e) => {
                        warn!(
                            "snapshot finalizer sweep: cannot list volumesnapshots: {}",
                            go_error(&e)
                        );
                        break;
                    }
                };
                for vs in page.items {
                    if !vs
                        .metadata
                        .finalizers
                        .iter()
                        .any(|f| f == source::SNAPSHOT_FINALIZER)
                    {
                        continue;
                    }
                    let (ns, name) = (vs.metadata.namespace, vs.metadata.name);
                    if restoring.contains(&ns) || self.restoring_from(&ns, &name) {
                        continue;
                    }
                    match update_json(&self.clients.low, &snapshots_path(&ns), &name, |o| {
                        edit::finalizer(o, source::SNAPSHOT_FINALIZER, false)
                    })
                    .await
                    {
                        Ok(_) => {
                            info!(snapshot = %format!("{ns}/{name}"), "removed the orphaned volumesnapshot-as-source-protection finalizer")
                        }
                        Err(e) => {
                            warn!(snapshot = %format!("{ns}/{name}"), "failed to remove the orphaned volumesnapshot-as-source-protection finalizer: {}", go_error(&e))
                        }
                    }
                }
                match page.metadata.continue_.filter(|c| !c.is_empty()) {
                    Some(token) => params = params.continue_token(&token),
                    None => break,
                }
            }
        }
    }

    /// The content sources of the recorded in-flight volumes.
    fn recorded_sources(&self) -> Vec<volume_content_source::Type> {
        self.inflight
            .volumes()
            .iter()
            .filter_map(|v| self.inflight.volume(v))
            .filter_map(|v| v.entry.request().ok()?.volume_content_source?.r#type)
            .collect()
    }

    /// Whether a Pending (or phase-less) claim of `ns` restores from the snapshot `name`.
    fn restoring_from(&self, ns: &str, name: &str) -> bool {
        let quoted = format!("\"{name}\"");
        self.caches.claims.any(|o| {
            o.namespace() == ns && o.mentions(&quoted) && {
                let o = o.claim();
                let phase = o.status.as_ref().and_then(|s| s.phase.as_deref());
                matches!(phase, None | Some("Pending"))
                    && matches!(
                        request::data_source(&o),
                        Ok(request::DataSource::Snapshot { name: n, .. }) if n == name
                    )
            }
        })
    }

    /// Drops a volume of which nothing exists in the driver from the record.
    fn drop_record(&self, volume: &str) {
        self.clients.journal.forget(volume);
        self.inflight.remove(volume);
    }

    fn check_capabilities(&self) -> Result<(), ProvisionError> {
        let caps = &self.cfg.capabilities;
        request::check_capabilities(caps.controller_service, caps.create_delete_volume)
    }

    async fn secret_data(
        &self,
        s: &secrets::SecretRef,
    ) -> Result<HashMap<String, String>, ActError> {
        let api: Api<Secret> = Api::namespaced(self.clients.high.clone(), &s.namespace);
        let secret = api.get(&s.name).await.map_err(|source| ActError::Secret {
            name: s.name.clone(),
            namespace: s.namespace.clone(),
            source,
        })?;
        Ok(secret
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
            .collect())
    }

    /// DeleteVolume of a volume that cannot be used, up to five times within one `--timeout`
    /// (`migrated`: of a claim of an in-tree class, the metrics label).
    async fn cleanup(
        &self,
        volume_id: &str,
        secrets: &HashMap<String, String>,
        migrated: bool,
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
                .delete_volume(volume_id, secrets.clone(), migrated)
                .await
            {
                Ok(()) => return Ok(()),
                Err(e) => last = e.to_status(),
            }
        }
        Err(last)
    }

    /// Updates the claim `ns/name` with `edit` applied to it as the API server has it now: the
    /// claim is read first, so the Update keeps every field (also those this build does not
    /// know) and a concurrent change makes it fail with a Conflict instead of being overwritten.
    /// Returns the resourceVersions before and after, or `None` if the claim is gone or
    /// `edit` changed nothing.
    async fn update_claim(
        &self,
        ns: &str,
        name: &str,
        edit: impl FnOnce(&mut serde_json::Value) -> bool,
    ) -> Result<Option<(String, String)>, ActError> {
        let path = format!("/api/v1/namespaces/{ns}/persistentvolumeclaims");
        update_json(&self.clients.high, &path, name, edit)
            .await
            .map_err(|source| ActError::UpdateClaim {
                claim: format!("{ns}/{name}"),
                source,
            })
    }

    /// Removes the selected-node annotation so that the scheduler picks another node (upstream's
    /// reschedule). The write is remembered: until the cache shows it, the cached claim still
    /// carries the old node.
    async fn reschedule(&self, claim: &PersistentVolumeClaim) -> Result<(), Failure> {
        let ns = claim.namespace().unwrap_or_default();
        let written = self
            .update_claim(&ns, &claim.name_any(), edit::unselect_node)
            .await
            .map_err(|e| {
                Failure::Error(ProvisionError::final_(format!(
                    "failed to remove the selected-node annotation: {e}"
                )))
            })?;
        if let Some((_, after)) = written {
            self.writes
                .record(claim.uid().unwrap_or_default(), Some(after.as_str()));
        }
        Ok(())
    }

    /// Removes a previous version's intent (annotation and finalizer) from the claim.
    async fn release_legacy(&self, claim: &PersistentVolumeClaim) -> Result<(), ActError> {
        let ns = claim.namespace().unwrap_or_default();
        let uid = claim.uid().unwrap_or_default();
        self.update_claim(&ns, &claim.name_any(), |c| edit::release_legacy(c, &uid))
            .await?;
        info!(claim = %format!("{ns}/{}", claim.name_any()), "released the provisioning intent of a previous version");
        Ok(())
    }

    /// Moves a previous version's in-flight volume into the record (with the request built
    /// from the claim and its class, or the claim alone if the class is gone), then releases
    /// the claim. The record's worker or the claim's next sync finishes the volume.
    async fn adopt_legacy(
        &self,
        claim: &PersistentVolumeClaim,
        class: Option<&StorageClass>,
        volume: &str,
    ) -> Result<(), ActError> {
        let entry = decide::legacy_entry(
            claim,
            class,
            &self.cfg.driver,
            &self.cfg.request,
            &self.caches,
            volume,
        )
        .map_err(ActError::Capabilities)?;
        self.inflight.add(entry.clone(), true);
        if let Err(e) = self.clients.journal.record(entry).await {
            self.inflight.remove(volume);
            return Err(e.into());
        }
        self.release_legacy(claim).await?;
        match decide::adopted(claim) {
            decide::Adopted::Delete => {
                self.event(
                    &pv::claim_ref(claim),
                    EventType::Normal,
                    CANCELLED_REASON,
                    &format!(
                        "Claim released; volume {volume} that may have been created for it is recorded and will be deleted"
                    ),
                );
                self.records.add(volume.to_owned());
            }
            decide::Adopted::Provision => self.claims.add(claim_key(claim)),
        }
        Ok(())
    }

    async fn sync_record(&self, volume: &str) -> Result<(), Requeue> {
        let Some(v) = self.inflight.volume(volume) else {
            return Ok(());
        };
        // Held from the decision to its end: no CreateVolume of it runs meanwhile, so a volume
        // that none may have created yet can simply be dropped.
        let Some(_busy) = self.inflight.begin(volume) else {
            debug!(volume = %volume, "in-flight volume is being worked on; retrying");
            return Err(Requeue);
        };
        let key: Box<str> = format!("{}/{}", v.entry.namespace, v.entry.claim).into();
        let claim = self.caches.claims.get(&key).map(|c| c.claim());
        let class_cached = claim.as_ref().is_some_and(|c| {
            self.caches
                .classes
                .get(&ObjectRef::new(&request::claim_class(c)))
                .is_some()
        });
        let view = decide::RecordView {
            volume: &v,
            claim: claim.as_ref(),
            class_cached,
            pv_cached: self.caches.volumes.get(volume).is_some(),
            another_node: claim.as_ref().is_some_and(|c| self.another_node(c)),
        };
        match decide::record_held(&view) {
            RecordAction::Claim => {
                self.claims.add(key);
                Ok(())
            }
            RecordAction::Forget => {
                self.drop_record(volume);
                Ok(())
            }
            RecordAction::Delete => match self.abandon(&v.entry, claim.is_some()).await {
                Ok(()) => Ok(()),
                Err(e) => {
                    warn!(volume = %volume, claim = %v.entry.claim_key(), "failed to delete the in-flight volume: {e}");
                    Err(Requeue)
                }
            },
        }
    }

    /// Deletes a recorded volume nobody will use: CreateVolume with the recorded request
    /// (idempotent by name: it returns the volume's ID, creating the volume if the first call
    /// never reached the driver), then DeleteVolume, then drops it from the record.
    /// The caller holds the volume ([`InFlight::begin`]).
    async fn abandon(&self, e: &Entry, claim_exists: bool) -> Result<(), ActError> {
        self.check_capabilities().map_err(ActError::Capabilities)?;
        let mut request = e.request()?;
        if let Some(s) = &e.template.secret {
            match self.secret_data(s).await {
                Ok(d) => request.secrets = d,
                Err(err) => warn!(volume = %e.volume, "{err}; trying without secrets"),
            }
        }
        let secrets = request.secrets.clone();
        let restore_or_clone = request.volume_content_source.is_some();
        // A recorded volume's repetition: its claim's class is not read again (the label says
        // not migrated).
        let created = match self.clients.driver.create_volume(request, false).await {
            Ok(c) => c,
            Err(err) => {
                let status = err.to_status();
                // A restore or clone whose source is gone (a deleted snapshot's content goes
                // with it): a driver answers a repeated request by name first, so NOT_FOUND
                // means no volume of this name exists and there is nothing to delete.
                if restore_or_clone && status.code() == tonic::Code::NotFound {
                    self.drop_record(&e.volume);
                    info!(volume = %e.volume, claim = %e.claim_key(), "the in-flight volume's source is gone and the driver has no volume of its name: {}", status.message());
                    self.event(
                        &entry_claim_ref(e),
                        EventType::Normal,
                        CANCELLED_REASON,
                        &format!(
                            "Volume {} that was being provisioned was never created: its source is gone",
                            e.volume
                        ),
                    );
                    return Ok(());
                }
                return Err(ActError::Driver(status));
            }
        };
        let id = created
            .volume
            .map(|v| v.volume_id)
            .filter(|id| !id.is_empty())
            .ok_or_else(|| ActError::NoVolumeId(e.volume.clone()))?;
        self.clients
            .driver
            .delete_volume(&id, secrets, false)
            .await
            .map_err(|e| ActError::Driver(e.to_status()))?;
        self.drop_record(&e.volume);
        let why = if claim_exists {
            "its claim does not need it any more"
        } else {
            "its claim is gone"
        };
        info!(volume = %e.volume, claim = %e.claim_key(), "deleted the in-flight volume: {why}");
        self.event(
            &entry_claim_ref(e),
            EventType::Normal,
            CANCELLED_REASON,
            &format!(
                "Deleted volume {} that was being provisioned: {why}",
                e.volume
            ),
        );
        Ok(())
    }

    async fn sync_volume(&self, name: &str) -> Result<(), Requeue> {
        let Some(volume) = self.caches.volumes.get(name) else {
            return Ok(());
        };
        let uid = volume.uid.to_string();
        let view = decide::VolumeView {
            pv: &*volume,
            driver: &self.cfg.driver,
            deleted: self.inflight.deleted(&uid, Instant::now()),
        };
        let action = decide::volume(&view);
        let phase = volume.status.as_ref().and_then(|s| s.phase.as_deref());
        debug!(pv = %name, phase = phase.unwrap_or_default(), ?action, "volume synced");
        let result = match action {
            VolumeAction::Nothing => return Ok(()),
            VolumeAction::AddFinalizer => self.patch_pv_finalizer(name, true).await,
            VolumeAction::RemoveFinalizer => self.patch_pv_finalizer(name, false).await,
            VolumeAction::Delete => {
                let class = volume
                    .spec
                    .as_ref()
                    .and_then(|s| s.storage_class_name.clone())
                    .unwrap_or_default();
                // §B.6: a node deletes only the volumes on it; another node's is counted as a
                // successful delete, without an event or a CSI call.
                if let Some(nd) = &self.cfg.node {
                    let affinity = volume
                        .spec
                        .as_ref()
                        .and_then(|s| s.node_affinity.as_deref());
                    match node::on_this_node(affinity, &nd.local) {
                        Ok(true) => {}
                        Ok(false) => {
                            debug!(pv = %name, "PV was not provisioned on this node");
                            self.clients
                                .provisioned
                                .delete_succeeded(&class, Duration::ZERO);
                            return Ok(());
                        }
                        Err(e) => {
                            self.clients.provisioned.delete_failed(&class);
                            let msg = format!("checking volume affinity failed: {e}");
                            self.event(
                                &volume_ref(&volume),
                                EventType::Warning,
                                "VolumeFailedDelete",
                                &msg,
                            );
                            warn!(pv = %name, "failed to delete volume: {msg}");
                            return Err(Requeue);
                        }
                    }
                }
                let started = Instant::now();
                match self.delete(&volume).await {
                    Ok(()) => {
                        self.clients
                            .provisioned
                            .delete_succeeded(&class, started.elapsed());
                        if let Some(r) = &self.clients.capacity {
                            r.class(&class);
                        }
                        return Ok(());
                    }
                    Err(e) => {
                        self.clients.provisioned.delete_failed(&class);
                        self.event(
                            &volume_ref(&volume),
                            EventType::Warning,
                            "VolumeFailedDelete",
                            &e.to_string(),
                        );
                        warn!(pv = %name, "failed to delete volume: {e}");
                        // Still attached: the attachment's deletion queues the PV again (the
                        // VolumeAttachment cache's handler), so a retry on the back-off would
                        // only fail again, with another event, until then (upstream retries
                        // on its back-off: at 1,000 claims deleted at once, thousands of
                        // refusals and queued events while the attacher detaches).
                        if matches!(e, ActError::Attached { .. }) {
                            return Ok(());
                        }
                        return Err(Requeue);
                    }
                }
            }
        };
        result.map_err(|e| {
            warn!(pv = %name, "{e}");
            Requeue
        })
    }

    /// Adds or removes the provisioner's finalizer with a strategic-merge patch, as upstream:
    /// `finalizers` merges by value on the server, so no read, no resourceVersion, and no
    /// conflict with the pv-protection controller's own finalizer.
    async fn patch_pv_finalizer(&self, name: &str, on: bool) -> Result<(), ActError> {
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
            Err(source) => Err(ActError::Finalizer {
                volume: name.to_owned(),
                source,
            }),
        }
    }

    /// The deletion secret of a PV without both deletion-secret annotations (one an older
    /// provisioner made, or a static one): the provisioner secret its StorageClass names,
    /// resolved with the claim `claim` (name, namespace) of its `claimRef`; a class of the
    /// in-tree plugin this driver replaces is translated first (its error is the deletion's).
    /// No class name, no class (a warning) or no claim: no secret.
    fn class_deletion_secret(
        &self,
        v: &CachedPv,
        claim: Option<&(String, String)>,
    ) -> Result<Option<secrets::SecretRef>, ActError> {
        let class_name = v
            .spec
            .as_ref()
            .and_then(|s| s.storage_class_name.as_deref())
            .unwrap_or_default();
        if class_name.is_empty() {
            return Ok(None);
        }
        let Some(class) = self.caches.classes.get(&ObjectRef::new(class_name)) else {
            warn!(pv = %v.name, "failed to get storageclass: {class_name}, proceeding to delete without secrets. storageclass.storage.k8s.io \"{class_name}\" not found");
            return Ok(None);
        };
        let Some((claim_name, claim_namespace)) = claim else {
            return Ok(None);
        };
        let (class, _) = request::csi_class(&class, &self.cfg.driver)
            .map_err(|e| ActError::ClassSecret(e.to_string()))?;
        let stub = PersistentVolumeClaim {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(claim_name.clone()),
                namespace: Some(claim_namespace.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        let params = class.parameters.clone().unwrap_or_default();
        secrets::resolve(secrets::SecretKind::Provisioner, &params, &v.name, &stub).map_err(|e| {
            ActError::ClassSecret(format!(
                "failed to get secretreference for volume {}: {e}",
                v.name
            ))
        })
    }

    /// §12 step 4-6: DeleteVolume, then the PV, then its finalizer.
    async fn delete(&self, v: &CachedPv) -> Result<(), ActError> {
        let name = v.name.to_string();
        let uid = v.uid.to_string();
        // An in-tree PV (CSI migration) is deleted through its translation; one that does
        // not translate fails with the translation's error, unwrapped as upstream's.
        let in_tree = v.spec.as_ref().and_then(|s| s.in_tree.as_deref());
        if let Some(e) = in_tree.and_then(|t| t.error.as_deref()) {
            return Err(ActError::InTree(e.to_owned()));
        }
        let migrated = in_tree.is_some();
        let Some(csi) = v.spec.as_ref().and_then(|s| s.csi.as_ref()) else {
            return Err(ActError::InvalidPv);
        };
        self.check_capabilities().map_err(ActError::Capabilities)?;
        let secret = match &v.deletion_secret {
            DeletionSecret::Annotated(named) => {
                named.as_deref().map(|(n, ns)| secrets::SecretRef {
                    name: n.clone(),
                    namespace: ns.clone(),
                })
            }
            DeletionSecret::FromClass(claim) => self.class_deletion_secret(v, claim.as_deref())?,
        };
        let mut secrets = HashMap::new();
        if let Some(r) = secret {
            match self.secret_data(&r).await {
                Ok(d) => secrets = d,
                // As upstream: the secret may be gone already; the driver decides.
                Err(e) => error!(pv = %name, "Failed to get credentials for volume {name}: {e}"),
            }
        }
        if let Some(va) = &self.caches.attachments
            && let Some(a) = va.find(|a| a.pv.as_deref() == Some(name.as_str()))
        {
            return Err(ActError::Attached {
                volume: name,
                node: a.node.to_string(),
            });
        }
        self.clients
            .driver
            .delete_volume(&csi.volume_handle, secrets, migrated)
            .await
            .map_err(|e| ActError::Driver(e.to_status()))?;
        self.inflight.set_deleted(&uid, false, Instant::now());
        let api: Api<PersistentVolume> = Api::all(self.clients.high.clone());
        // The answer is the PV itself while finalizers hold it: no need to read it again (and
        // no decoded PV kept across the next await).
        let ours_left = match api.delete(&name, &DeleteParams::default()).await {
            Ok(answer) => answer
                .left()
                .is_some_and(|pv| pv.finalizers().iter().any(|f| f == PV_FINALIZER)),
            Err(kube::Error::Api(s)) if s.code == 404 => false,
            Err(source) => {
                return Err(ActError::DeletePv {
                    volume: name,
                    source,
                });
            }
        };
        info!(pv = %name, "volume deleted");
        if ours_left {
            self.patch_pv_finalizer(&name, false).await?;
        }
        self.inflight.set_deleted(&uid, true, Instant::now());
        Ok(())
    }
}

/// The lock, also if a worker panicked while holding it (the map stays usable).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Updates the object `name` under the collection `path` with `edit` applied to it as the API
/// server has it now: it is read first, so the Update keeps every field (also those this build
/// does not know) and a concurrent change makes it fail with a Conflict instead of being
/// overwritten. Returns the resourceVersions before and after, or `None` if the object is gone
/// or `edit` changed nothing.
async fn update_json(
    client: &Client,
    path: &str,
    name: &str,
    edit: impl FnOnce(&mut serde_json::Value) -> bool,
) -> Result<Option<(String, String)>, kube::Error> {
    let req = kube::core::Request::new(path)
        .get(name, &kube::api::GetParams::default())
        .map_err(kube::Error::BuildRequest)?;
    let obj: serde_json::Value = match client.request(req).await {
        Ok(o) => o,
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(None),
        Err(e) => return Err(e),
    };
    edit_and_put(client, path, name, obj, edit).await
}

/// `obj` (as read) edited by `edit` and `PUT` to `<path>/<name>`: the resourceVersions before
/// and after, or `None` when the edit changes nothing or the object is gone.
async fn edit_and_put(
    client: &Client,
    path: &str,
    name: &str,
    mut obj: serde_json::Value,
    edit: impl FnOnce(&mut serde_json::Value) -> bool,
) -> Result<Option<(String, String)>, kube::Error> {
    let before = obj["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if !edit(&mut obj) {
        return Ok(None);
    }
    let body = serde_json::to_vec(&obj).map_err(kube::Error::SerdeError)?;
    let req = kube::core::Request::new(path)
        .replace(name, &PostParams::default(), body)
        .map_err(kube::Error::BuildRequest)?;
    match client.request::<serde_json::Value>(req).await {
        Ok(written) => Ok(Some((
            before,
            written["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        ))),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
        Err(e) => Err(e),
    }
}

/// `GET <path>/<name>` as JSON, kept whole: a PUT of it later drops no field the typed
/// view does not know.
async fn get_json(
    client: &Client,
    path: &str,
    name: &str,
) -> Result<serde_json::Value, kube::Error> {
    let req = kube::core::Request::new(path)
        .get(name, &kube::api::GetParams::default())
        .map_err(kube::Error::BuildRequest)?;
    client.request(req).await
}

/// A page of VolumeSnapshots as the finalizer sweeper reads it: each one's namespace, name and
/// finalizers (the rest of the metadata, its managedFields above all, is skipped while
/// parsing, never built), and the list's continue token.
#[derive(serde::Deserialize)]
struct SnapshotPage {
    #[serde(default)]
    items: Vec<SnapshotNames>,
    #[serde(default)]
    metadata: PageMeta,
}

#[derive(serde::Deserialize)]
struct SnapshotNames {
    metadata: SnapshotMeta,
}

#[derive(serde::Deserialize)]
struct SnapshotMeta {
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    finalizers: Vec<String>,
}

#[derive(serde::Deserialize, Default)]
struct PageMeta {
    #[serde(default, rename = "continue")]
    continue_: Option<String>,
}

/// One page of every namespace's VolumeSnapshots, metadata only (kube's `list_metadata`
/// request), read as a [`SnapshotPage`].
async fn list_snapshot_finalizers(
    client: &Client,
    params: &kube::api::ListParams,
) -> Result<SnapshotPage, kube::Error> {
    use kube::Resource as _;
    let req = kube::core::Request::new(VolumeSnapshot::url_path(&(), None))
        .list_metadata(params)
        .map_err(kube::Error::BuildRequest)?;
    client.request(req).await
}

/// The typed view of an object read as JSON, beside the JSON.
fn typed<K: serde::de::DeserializeOwned>(
    read: Result<serde_json::Value, kube::Error>,
) -> Result<(K, serde_json::Value), kube::Error> {
    let raw = read?;
    let obj = K::deserialize(&raw).map_err(kube::Error::SerdeError)?;
    Ok((obj, raw))
}

/// [`update_json`] starting from `known`, the object as just read, instead of a GET: one
/// round trip. If it changed since (409 Conflict), the usual read-modify-write follows.
async fn update_known(
    client: &Client,
    path: &str,
    name: &str,
    known: Option<serde_json::Value>,
    edit: impl Fn(&mut serde_json::Value) -> bool,
) -> Result<Option<(String, String)>, kube::Error> {
    if let Some(obj) = known {
        match edit_and_put(client, path, name, obj, &edit).await {
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            answer => return answer,
        }
    }
    update_json(client, path, name, edit).await
}

/// The collection path of claims in `ns`.
fn claims_path(ns: &str) -> String {
    format!("/api/v1/namespaces/{ns}/persistentvolumeclaims")
}

/// A failed API call as [`plan`] reads it.
fn api_error(e: &kube::Error) -> plan::ApiError {
    plan::ApiError {
        code: match e {
            kube::Error::Api(s) => Some(s.code),
            _ => None,
        },
        text: e.to_string(),
        message: go_error(e),
    }
}

/// A Kubernetes error as Go prints it: the API server's message, or the client's error.
fn go_error(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => s.message.clone(),
        e => e.to_string(),
    }
}

/// The collection path of VolumeSnapshots in `ns`.
fn snapshots_path(ns: &str) -> String {
    format!(
        "/apis/{}/{}/namespaces/{ns}/volumesnapshots",
        snapshot::GROUP,
        snapshot::VERSION
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cached::{LAST_APPLIED, trim_claim};

    #[test]
    fn caches_keep_only_what_decisions_read() {
        let mut c: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {
                "name": "data", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                "labels": {"app": "x"},
                "annotations": {LAST_APPLIED: "{...}", "volume.kubernetes.io/selected-node": "n1"},
                "finalizers": ["kubernetes.io/pvc-protection"],
            },
            "spec": {"storageClassName": "fast", "accessModes": ["ReadWriteOnce"]},
            "status": {"phase": "Pending", "conditions": [{"type": "Resizing", "status": "True"}]},
        }))
        .unwrap();
        trim_claim(&mut c);
        assert_eq!(c.metadata.labels, None);
        assert_eq!(
            c.annotations().keys().collect::<Vec<_>>(),
            ["volume.kubernetes.io/selected-node"]
        );
        // Only a previous version's finalizer is read.
        assert!(c.finalizers().is_empty());
        let s = c.status.unwrap();
        assert_eq!(s.phase.as_deref(), Some("Pending"));
        assert_eq!(s.conditions, None);

        // Bound: identity, volume and class only.
        let mut b: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": "data", "namespace": "ns", "uid": "u", "resourceVersion": "9",
                "annotations": {"pv.kubernetes.io/bind-completed": "yes", request::ANN_BETA_STORAGE_CLASS: "old"}},
            "spec": {"storageClassName": "fast", "accessModes": ["ReadWriteOnce"], "volumeName": "pv-1",
                "resources": {"requests": {"storage": "1Gi"}}},
            "status": {"phase": "Bound", "capacity": {"storage": "1Gi"}},
        }))
        .unwrap();
        trim_claim(&mut b);
        assert_eq!(
            b.annotations().keys().collect::<Vec<_>>(),
            [request::ANN_BETA_STORAGE_CLASS]
        );
        let spec = b.spec.as_ref().unwrap();
        assert_eq!(spec.volume_name.as_deref(), Some("pv-1"));
        assert_eq!(spec.storage_class_name.as_deref(), Some("fast"));
        assert_eq!(
            (spec.access_modes.as_ref(), spec.resources.as_ref()),
            (None, None)
        );
        assert_eq!(b.uid().as_deref(), Some("u"));
        // With a previous version's intent it stays whole until released.
        let mut l: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": "data", "annotations": {decide::LEGACY_INTENT: "pv-1"}},
            "spec": {"volumeName": "pv-1", "accessModes": ["ReadWriteOnce"]},
            "status": {"phase": "Bound"},
        }))
        .unwrap();
        trim_claim(&mut l);
        assert!(decide::has_legacy_intent(&l));
        assert!(l.spec.unwrap().access_modes.is_some());

        let mut n: CSINode = serde_json::from_value(json!({
            "metadata": {"name": "n1"},
            "spec": {"drivers": [{"name": "d", "nodeID": "n1"}, {"name": "other", "nodeID": "n1"}]},
        }))
        .unwrap();
        trim_csinode(&mut n, "d");
        assert_eq!(n.spec.drivers.len(), 1);
    }
}
