//! Storage capacity tracking (`--enable-capacity`; `docs/upstream/upstream-capacity-and-node-deployment.md`
//! §A): for every topology segment the driver's nodes report and every StorageClass of the
//! driver that binds on first consumer, a CSIStorageCapacity object in `NAMESPACE` holding what
//! GetCapacity answers, so that the scheduler only picks a node whose storage can hold a claim.
//!
//! The decisions are pure functions ([`segments`], [`qualifies`], [`plan`], [`manager_id`],
//! [`quantity`]); [`run`] watches Nodes, CSINodes, StorageClasses and its own objects, and keeps
//! the objects in line with the work items (segment x class) through a work queue, on a client
//! of its own (`--kube-api-capacity-qps/-burst`).
//!
//! Where upstream v6.3.0 has quirks (§A.11), this controller does what upstream meant: work
//! keys are values (an item queued twice is synced once), segments and `matchLabels` compare as
//! sets of pairs (an empty segment's object is not re-created every poll), an object it created
//! is known at once (no duplicate before the watch shows it), and an object without `capacity`
//! is updated rather than a crash.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::watcher;
use plugreg_sidecar_kit::cache::{self, Readiness};
use plugreg_sidecar_kit::metrics::{Collector, Families};
use plugreg_sidecar_kit::queue::WorkQueue;
use plugreg_sidecar_kit::runtime::{Action, Lane, Runner};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::csi::Driver;
use crate::metrics::Metrics;

/// A topology segment: (key, value) pairs, sorted by key.
pub type Segment = BTreeMap<String, String>;

/// The label naming the driver of an object.
pub const DRIVER_LABEL: &str = "csi.storage.k8s.io/drivername";
/// The label naming the manager of an object ([`manager_id`]).
pub const MANAGED_BY_LABEL: &str = "csi.storage.k8s.io/managed-by";
/// The manager id of a central provisioner.
pub const MANAGER: &str = "external-provisioner";
/// The work queue's name (upstream's).
pub const QUEUE: &str = "csistoragecapacity";
/// The name of the object the API version probe tries to create (invalid on purpose).
const PROBE_NAME: &str = "#%123-invalid-name";

/// Which CSIStorageCapacity API the server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiVersion {
    /// `storage.k8s.io/v1` (Kubernetes 1.24 and later).
    V1,
    /// `storage.k8s.io/v1beta1` (1.21 to 1.26).
    V1beta1,
}

impl ApiVersion {
    /// The resource for this version.
    pub fn resource(self) -> ApiResource {
        let version = match self {
            ApiVersion::V1 => "v1",
            ApiVersion::V1beta1 => "v1beta1",
        };
        ApiResource {
            group: "storage.k8s.io".into(),
            version: version.into(),
            api_version: format!("storage.k8s.io/{version}"),
            kind: "CSIStorageCapacity".into(),
            plural: "csistoragecapacities".into(),
        }
    }
}

/// Why capacity tracking could not start (upstream: `klog.Fatal`, exit 255).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// `NAMESPACE` is unset or empty.
    #[error("need NAMESPACE env variable for CSIStorageCapacity objects")]
    Namespace,
    /// `POD_NAME` is unset or empty and an owner is wanted.
    #[error("need POD_NAME env variable to determine CSIStorageCapacity owner")]
    PodName,
    /// The owner lookup failed.
    #[error("look up owner(s) of pod: {0}")]
    Owner(String),
    /// The API probe's invalid object was created.
    #[error("creating an invalid v1.CSIStorageCapacity didn't fail as expected, got: {0}")]
    ProbeCreated(String),
    /// The API probe failed otherwise.
    #[error("unexpected error when checking for the V1 CSIStorageCapacity API: {0}")]
    Probe(String),
}

/// Finds the API version as upstream does: creating an object with an invalid name answers 422
/// where v1 is served and 404 where it is not.
pub async fn detect_api(client: &kube::Client, namespace: &str) -> Result<ApiVersion, StartError> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &ApiVersion::V1.resource());
    let mut probe = DynamicObject::new(PROBE_NAME, &ApiVersion::V1.resource());
    probe.data = json!({"storageClassName": "probe"});
    match api.create(&PostParams::default(), &probe).await {
        Err(kube::Error::Api(s)) if s.code == 422 => {
            info!("using the CSIStorageCapacity v1 API");
            Ok(ApiVersion::V1)
        }
        Err(kube::Error::Api(s)) if s.code == 404 => {
            info!("using the CSIStorageCapacity v1beta1 API");
            Ok(ApiVersion::V1beta1)
        }
        Ok(o) => Err(StartError::ProbeCreated(format!("{o:?}"))),
        Err(e) => Err(StartError::Probe(e.to_string())),
    }
}

/// The owner of the objects: none below level 0, the pod at 0, then each level one controller
/// further up (§A.3). Objects are read generically, their resources found by discovery.
pub async fn owner(
    client: &kube::Client,
    namespace: &str,
    pod: &str,
    level: i64,
) -> Result<Option<OwnerReference>, StartError> {
    if level < 0 {
        return Ok(None);
    }
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), namespace);
    let p = pods
        .get(pod)
        .await
        .map_err(|e| StartError::Owner(format!("get object: {e}")))?;
    let mut current = OwnerReference {
        api_version: "v1".into(),
        kind: "Pod".into(),
        name: p.metadata.name.clone().unwrap_or_default(),
        uid: p.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: None,
    };
    let mut refs = p.metadata.owner_references.unwrap_or_default();
    for step in 0..level {
        let Some(next) = refs.iter().find(|r| r.controller == Some(true)).cloned() else {
            return Err(StartError::Owner(format!(
                "{}/{} {:?} in namespace {namespace:?} has no controlling owner, cannot unwind the ownership further",
                current.api_version, current.kind, current.name
            )));
        };
        current = OwnerReference {
            block_owner_deletion: None,
            controller: Some(true),
            ..next
        };
        if step + 1 == level {
            break;
        }
        let (group, version) = match current.api_version.split_once('/') {
            Some((g, v)) => (g.to_owned(), v.to_owned()),
            None => (String::new(), current.api_version.clone()),
        };
        let gvk = kube::api::GroupVersionKind::gvk(&group, &version, &current.kind);
        let (ar, _) = kube::discovery::pinned_kind(client, &gvk)
            .await
            .map_err(|e| StartError::Owner(format!("build client: {e}")))?;
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &ar);
        let o = api
            .get(&current.name)
            .await
            .map_err(|e| StartError::Owner(format!("get object: {e}")))?;
        refs = o.metadata.owner_references.unwrap_or_default();
    }
    Ok(Some(current))
}

/// The manager id (§A.6): `external-provisioner`, or with `--node-deployment` the node's name
/// joined to it within the 63 characters of a label value.
pub fn manager_id(node: Option<&str>) -> String {
    let Some(node) = node else {
        return MANAGER.to_owned();
    };
    let joined = format!("{MANAGER}-{node}");
    if joined.len() <= 63 {
        return joined;
    }
    if node.len() <= 52 {
        let keep = 53 - node.len();
        return format!(
            "{}-{:08x}-{node}",
            &MANAGER[..keep.min(MANAGER.len())],
            fnv1a32(MANAGER)
        );
    }
    format!("{MANAGER}-{:08x}", fnv1a32(&joined))
}

/// FNV-1a, 32 bits (the manager id's hash; also the node record's name).
pub(crate) fn fnv1a32(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// A byte count as an exact binary-SI quantity: the largest of `Ki` to `Ei` that divides it
/// (`100Gi`, `1536Mi`), else plain digits (`1000`, `0`).
pub fn quantity(bytes: i64) -> String {
    const UNITS: [&str; 6] = ["Ei", "Pi", "Ti", "Gi", "Mi", "Ki"];
    if bytes != 0 {
        for (i, unit) in UNITS.iter().enumerate() {
            let size = 1_i64 << (10 * (6 - i));
            if bytes % size == 0 {
                return format!("{}{unit}", bytes / size);
            }
        }
    }
    bytes.to_string()
}

/// The segments of the driver's nodes (§A.5.1): every CSINode with an entry named `driver`
/// whose Node is known and carries every topology key as a label, its (key, value) pairs;
/// identical segments once. An entry without keys gives the empty segment (all nodes).
pub fn segments<'a>(
    driver: &str,
    csinodes: impl IntoIterator<Item = &'a CSINode>,
    node_labels: impl Fn(&str) -> Option<BTreeMap<String, String>>,
) -> BTreeSet<Segment> {
    let mut out = BTreeSet::new();
    for csinode in csinodes {
        let Some(entry) = csinode.spec.drivers.iter().find(|d| d.name == driver) else {
            continue;
        };
        let Some(name) = csinode.metadata.name.as_deref() else {
            continue;
        };
        let Some(labels) = node_labels(name) else {
            continue;
        };
        let mut segment = Segment::new();
        let mut complete = true;
        for key in entry.topology_keys.iter().flatten() {
            match labels.get(key) {
                Some(v) => {
                    segment.insert(key.clone(), v.clone());
                }
                None => complete = false,
            }
        }
        if complete {
            out.insert(segment);
        }
    }
    out
}

/// A segment as upstream's log prints it: `[key: value key2: value2]`, `[]` when empty.
fn go_segment(segment: &Segment) -> String {
    let pairs: Vec<String> = segment.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    format!("[{}]", pairs.join(" "))
}

/// Whether `class` gets capacity objects (§A.7): its provisioner is the driver, and it binds
/// on first consumer (or any binding with `--capacity-for-immediate-binding`).
pub fn qualifies(class: &StorageClass, driver: &str, immediate: bool) -> bool {
    class.provisioner == driver
        && (immediate || class.volume_binding_mode.as_deref() != Some("Immediate"))
}

/// What one item's object needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// No object yet: create it.
    Create,
    /// The object differs: write these values (and the owner, when it lacks it).
    Update,
    /// Nothing to write.
    Nothing,
}

/// The values of one item's object as the API server holds them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Existing {
    /// `capacity`, when set.
    pub capacity: Option<String>,
    /// `maximumVolumeSize`, when set.
    pub maximum_volume_size: Option<String>,
    /// Whether the wanted owner is among its controlling owners.
    pub has_owner: bool,
}

/// Decides what the object of an item needs after GetCapacity answered `capacity` and
/// `maximum` (§A.8.2): quantities compare by value, so `1Gi` and `1073741824` are equal.
pub fn plan(existing: Option<&Existing>, capacity: i64, maximum: Option<i64>, owner: bool) -> Plan {
    let Some(e) = existing else {
        return Plan::Create;
    };
    let same = |have: &Option<String>, want: Option<i64>| match (have, want) {
        (None, None) => true,
        (Some(h), Some(w)) => plugreg_sidecar_kit::quantity::parse_bytes(h).ok() == Some(w),
        _ => false,
    };
    if same(&e.capacity, Some(capacity))
        && same(&e.maximum_volume_size, maximum)
        && (!owner || e.has_owner)
    {
        Plan::Nothing
    } else {
        Plan::Update
    }
}

/// A work item: a segment and a class name.
pub type Item = (Segment, String);

/// What the queue holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    /// Bring the object of an item in line.
    Sync(Segment, String),
    /// Delete an obsolete object (by name).
    Delete(String),
}

/// Asks capacity tracking to refresh a class's objects after a volume operation (§A.9.3).
/// Cheap to clone; a refresh asked while tracking does not run is dropped.
#[derive(Debug, Clone)]
pub struct Refresh(tokio::sync::mpsc::UnboundedSender<String>);

impl Refresh {
    /// A handle and the receiving end [`run`] takes.
    pub fn channel() -> (Refresh, tokio::sync::mpsc::UnboundedReceiver<String>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (Refresh(tx), rx)
    }

    /// Every item of `class` is synced again: after a provision that made a volume or changed
    /// state, and after a deletion. Upstream narrows this to the PV's topology when the PV has
    /// node affinity; this asks GetCapacity of every segment of the class instead (a superset:
    /// the PV cache keeps no node affinity).
    pub fn class(&self, class: &str) {
        if !class.is_empty() {
            let _ = self.0.send(class.to_owned());
        }
    }
}

/// What [`run`] needs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The driver name.
    pub driver: String,
    /// `NAMESPACE`.
    pub namespace: String,
    /// The owner of the objects, if any.
    pub owner: Option<OwnerReference>,
    /// The manager id ([`manager_id`]).
    pub manager: String,
    /// `--capacity-for-immediate-binding`.
    pub immediate_binding: bool,
    /// `--capacity-poll-interval`.
    pub poll: Duration,
    /// `--capacity-threads`.
    pub workers: usize,
    /// `--retry-interval-start`.
    pub retry_start: Duration,
    /// `--retry-interval-max`.
    pub retry_max: Duration,
    /// The API version served ([`detect_api`]).
    pub api: ApiVersion,
    /// `--node-deployment`: the one segment of this node (from NodeGetInfo; empty when the
    /// driver reports no topology) instead of the segments of the watched CSINodes (§A.5.2).
    pub fixed: Option<Segment>,
}

/// An object of ours as the controller keeps it.
#[derive(Debug, Clone)]
struct Held {
    name: String,
    resource_version: Option<String>,
    class: String,
    segment: Segment,
    existing: Existing,
    uid: Option<String>,
}

struct State {
    /// Items wanted now.
    items: BTreeSet<Item>,
    /// Our objects by name (the watch's view, ahead of it by our own writes).
    objects: HashMap<String, Held>,
}

/// The three gauges of §A.10.
#[derive(Debug, Default)]
struct Gauges {
    goal: Mutex<(usize, usize, usize)>,
}

impl Collector for Gauges {
    fn collect(&self, families: &mut Families) {
        let (goal, current, obsolete) = *self.goal.lock().unwrap_or_else(|e| e.into_inner());
        for (name, help, v) in [
            (
                "csistoragecapacities_desired_goal",
                "[ALPHA] Number of CSIStorageCapacity objects that are supposed to be managed automatically.",
                goal,
            ),
            (
                "csistoragecapacities_desired_current",
                "[ALPHA] Number of CSIStorageCapacity objects that exist and are supposed to be managed automatically.",
                current,
            ),
            (
                "csistoragecapacities_obsolete",
                "[ALPHA] Number of CSIStorageCapacity objects that exist and will be deleted automatically. Objects that exist and may need an update are not considered obsolete and therefore not included in this value.",
                obsolete,
            ),
        ] {
            families.samples(name, help, "gauge", [(String::new(), v as f64)]);
        }
    }
}

/// Errors of [`run`].
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A cache never filled.
    #[error("waiting for the capacity controller's caches failed")]
    Caches,
}

struct Controller {
    cfg: Config,
    client: kube::Client,
    driver: Arc<Driver>,
    classes: reflector::Store<StorageClass>,
    state: Mutex<State>,
    queue: Arc<WorkQueue<Key>>,
    gauges: Arc<Gauges>,
}

fn held_of(o: &DynamicObject, owner: Option<&OwnerReference>) -> Held {
    let d = &o.data;
    let segment: Segment = d["nodeTopology"]["matchLabels"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default();
    let text = |v: &Value| v.as_str().map(str::to_owned);
    Held {
        name: o.metadata.name.clone().unwrap_or_default(),
        resource_version: o.metadata.resource_version.clone(),
        class: d["storageClassName"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        segment,
        existing: Existing {
            capacity: text(&d["capacity"]),
            maximum_volume_size: text(&d["maximumVolumeSize"]),
            has_owner: owner.is_some_and(|w| {
                o.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|r| r.uid == w.uid && r.controller == Some(true))
            }),
        },
        uid: o.metadata.uid.clone(),
    }
}

impl Controller {
    fn api(&self) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.client.clone(),
            &self.cfg.namespace,
            &self.cfg.api.resource(),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The object linked to `item`: the first of ours with its class and segment.
    fn linked(state: &State, item: &Item) -> Option<Held> {
        let mut found: Vec<&Held> = state
            .objects
            .values()
            .filter(|h| h.class == item.1 && h.segment == item.0)
            .collect();
        found.sort_by(|a, b| a.name.cmp(&b.name));
        found.first().map(|h| (*h).clone())
    }

    /// Queues deletion of every object of ours that matches no item, or duplicates another
    /// object of its item; updates the gauges.
    fn sweep(&self) {
        let s = self.lock();
        let mut seen: BTreeSet<Item> = BTreeSet::new();
        let mut names: Vec<&Held> = s.objects.values().collect();
        names.sort_by(|a, b| a.name.cmp(&b.name));
        let mut obsolete = 0;
        for h in names {
            let item = (h.segment.clone(), h.class.clone());
            if s.items.contains(&item) && seen.insert(item) {
                continue;
            }
            obsolete += 1;
            self.queue.add(Key::Delete(h.name.clone()));
        }
        *self.gauges.goal.lock().unwrap_or_else(|e| e.into_inner()) =
            (s.items.len(), seen.len(), obsolete);
    }

    async fn sync(&self, key: &Key) -> Result<(), String> {
        match key {
            Key::Delete(name) => {
                let gone = {
                    let s = self.lock();
                    match s.objects.get(name) {
                        None => return Ok(()),
                        Some(h) => {
                            let item = (h.segment.clone(), h.class.clone());
                            !(s.items.contains(&item)
                                && Self::linked(&s, &item).is_some_and(|l| l.name == *name))
                        }
                    }
                };
                if !gone {
                    return Ok(());
                }
                match self.api().delete(name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(format!("delete CSIStorageCapacity {name}: {e}")),
                }
                self.lock().objects.remove(name);
                Ok(())
            }
            Key::Sync(segment, class_name) => {
                let item = (segment.clone(), class_name.clone());
                if !self.lock().items.contains(&item) {
                    return Ok(());
                }
                let Some(class) = self.classes.get(&ObjectRef::new(class_name)) else {
                    return Ok(());
                };
                let shown = format!("{class_name}/{segment:?}");
                let parameters: HashMap<String, String> = class
                    .parameters
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .collect();
                let answer = self
                    .driver
                    .get_capacity(segment, parameters)
                    .await
                    .map_err(|e| format!("CSI GetCapacity for {shown}: {e}"))?;
                let linked = Self::linked(&self.lock(), &item);
                let owner = self.cfg.owner.is_some();
                match plan(
                    linked.as_ref().map(|h| &h.existing),
                    answer.available_capacity,
                    answer.maximum_volume_size,
                    owner,
                ) {
                    Plan::Nothing => Ok(()),
                    Plan::Create => {
                        let o = self.object(
                            None,
                            segment,
                            class_name,
                            answer.available_capacity,
                            answer.maximum_volume_size,
                            None,
                        );
                        let made = self
                            .api()
                            .create(&PostParams::default(), &o)
                            .await
                            .map_err(|e| format!("create CSIStorageCapacity for {shown}: {e}"))?;
                        debug!(object = ?made.metadata.name, item = %shown, "created CSIStorageCapacity");
                        let h = held_of(&made, self.cfg.owner.as_ref());
                        self.lock().objects.insert(h.name.clone(), h);
                        Ok(())
                    }
                    Plan::Update => {
                        let h = linked.expect("Update has an object");
                        let o = self.object(
                            Some(&h),
                            segment,
                            class_name,
                            answer.available_capacity,
                            answer.maximum_volume_size,
                            h.resource_version.clone(),
                        );
                        let made = self
                            .api()
                            .replace(&h.name, &PostParams::default(), &o)
                            .await
                            .map_err(|e| format!("update CSIStorageCapacity for {shown}: {e}"))?;
                        let h = held_of(&made, self.cfg.owner.as_ref());
                        self.lock().objects.insert(h.name.clone(), h);
                        Ok(())
                    }
                }
            }
        }
    }

    /// The object of an item (§A.9.2); an existing one keeps its name, its other owners and
    /// gets ours appended when it lacks it.
    fn object(
        &self,
        existing: Option<&Held>,
        segment: &Segment,
        class: &str,
        capacity: i64,
        maximum: Option<i64>,
        resource_version: Option<String>,
    ) -> DynamicObject {
        let ar = self.cfg.api.resource();
        let mut o = DynamicObject::new("", &ar);
        o.metadata = ObjectMeta {
            name: existing.map(|h| h.name.clone()),
            generate_name: existing.is_none().then(|| "csisc-".to_owned()),
            namespace: Some(self.cfg.namespace.clone()),
            resource_version,
            uid: existing.and_then(|h| h.uid.clone()),
            labels: Some(BTreeMap::from([
                (DRIVER_LABEL.to_owned(), self.cfg.driver.clone()),
                (MANAGED_BY_LABEL.to_owned(), self.cfg.manager.clone()),
            ])),
            owner_references: self.cfg.owner.clone().map(|o| vec![o]),
            ..ObjectMeta::default()
        };
        let mut data = json!({
            "storageClassName": class,
            "nodeTopology": {"matchLabels": segment},
            "capacity": quantity(capacity),
        });
        if let Some(m) = maximum {
            data["maximumVolumeSize"] = Value::String(quantity(m));
        }
        o.data = data;
        o
    }
}

/// Runs capacity tracking until `shutdown`: watches, the work queue's workers and the poll
/// loop. `client` is the capacity client (its own rate limit), `watches` where the Node,
/// CSINode and StorageClass watches come from.
pub async fn run(
    cfg: Config,
    client: kube::Client,
    watches: cache::Watches,
    driver: Arc<Driver>,
    metrics: Arc<Metrics>,
    mut refresh: tokio::sync::mpsc::UnboundedReceiver<String>,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    info!("Starting Capacity Controller");
    let queue: Arc<WorkQueue<Key>> = WorkQueue::new(
        QUEUE,
        cfg.retry_start,
        cfg.retry_max,
        Arc::clone(&metrics),
        shutdown.clone(),
    );
    let changed = Arc::new(tokio::sync::Notify::new());
    let mut ready: Readiness = Vec::new();
    let driver_name = cfg.driver.clone();
    // A node's provisioner has its one segment; the central one watches Nodes and CSINodes.
    let topology = match &cfg.fixed {
        Some(segment) => {
            info!(
                "producing CSIStorageCapacity objects with fixed topology segment {}",
                go_segment(segment)
            );
            None
        }
        None => Some((
            cache::watch::<Node>(
                &watches,
                &shutdown,
                &mut ready,
                |n| {
                    let labels = n.metadata.labels.take();
                    n.metadata = ObjectMeta {
                        name: n.metadata.name.take(),
                        labels,
                        ..ObjectMeta::default()
                    };
                    n.spec = None;
                    n.status = None;
                },
                notifier(&changed),
            ),
            cache::watch::<CSINode>(
                &watches,
                &shutdown,
                &mut ready,
                move |c| {
                    c.metadata = ObjectMeta {
                        name: c.metadata.name.take(),
                        ..ObjectMeta::default()
                    };
                    c.spec.drivers.retain(|d| d.name == driver_name);
                },
                notifier(&changed),
            ),
        )),
    };
    let classes = cache::watch::<StorageClass>(
        &watches,
        &shutdown,
        &mut ready,
        |c| {
            c.metadata = ObjectMeta {
                name: c.metadata.name.take(),
                ..ObjectMeta::default()
            };
            c.mount_options = None;
            c.allowed_topologies = None;
        },
        notifier(&changed),
    );
    let gauges = Arc::new(Gauges::default());
    metrics.register("capacity", gauges.clone());
    let ctl = Arc::new(Controller {
        client: client.clone(),
        driver,
        classes: classes.clone(),
        state: Mutex::new(State {
            items: BTreeSet::new(),
            objects: HashMap::new(),
        }),
        queue: Arc::clone(&queue),
        gauges,
        cfg,
    });

    // Our objects: namespaced, selected by the two labels.
    let selector = format!(
        "{DRIVER_LABEL}={},{MANAGED_BY_LABEL}={}",
        ctl.cfg.driver, ctl.cfg.manager
    );
    let own = ctl.api();
    let (objects_ready_tx, objects_ready) = tokio::sync::oneshot::channel::<()>();
    {
        let ctl = Arc::clone(&ctl);
        let stop = shutdown.clone();
        let changed = Arc::clone(&changed);
        tokio::spawn(async move {
            let stream =
                watcher(own, watcher::Config::default().labels(&selector)).default_backoff();
            let mut stream = std::pin::pin!(stream);
            let mut listed: Option<HashMap<String, Held>> = None;
            let mut ready_tx = Some(objects_ready_tx);
            loop {
                let ev = tokio::select! {
                    ev = stream.next() => ev,
                    () = stop.cancelled() => return,
                };
                let owner = ctl.cfg.owner.clone();
                match ev {
                    None => return,
                    Some(Ok(watcher::Event::Init)) => listed = Some(HashMap::new()),
                    Some(Ok(watcher::Event::InitApply(o))) => {
                        let h = held_of(&o, owner.as_ref());
                        if let Some(l) = listed.as_mut() {
                            l.insert(h.name.clone(), h);
                        }
                    }
                    Some(Ok(watcher::Event::InitDone)) => {
                        if let Some(l) = listed.take() {
                            ctl.lock().objects = l;
                        }
                        if let Some(tx) = ready_tx.take() {
                            let _ = tx.send(());
                        }
                        changed.notify_one();
                    }
                    Some(Ok(watcher::Event::Apply(o))) => {
                        let h = held_of(&o, owner.as_ref());
                        let newer = {
                            let mut s = ctl.lock();
                            let newer = s.objects.get(&h.name).is_none_or(|old| {
                                rv(&old.resource_version) <= rv(&h.resource_version)
                            });
                            if newer {
                                s.objects.insert(h.name.clone(), h);
                            }
                            newer
                        };
                        if newer {
                            changed.notify_one();
                        }
                    }
                    Some(Ok(watcher::Event::Delete(o))) => {
                        let name = o.metadata.name.clone().unwrap_or_default();
                        let h = ctl.lock().objects.remove(&name);
                        // Deleted by someone (or unlabelled): its item gets a new object.
                        if let Some(h) = h {
                            ctl.queue.add(Key::Sync(h.segment, h.class));
                        }
                        changed.notify_one();
                    }
                    Some(Err(e)) => warn!("CSIStorageCapacity watch failed (retrying): {e}"),
                }
            }
        });
    }
    let caches = async {
        for r in ready {
            r.await?;
        }
        objects_ready.await.map_err(|_| ())
    };
    tokio::select! {
        r = caches => r.map_err(|()| RunError::Caches)?,
        () = shutdown.cancelled() => return Ok(()),
    }
    let recompute = {
        let ctl = Arc::clone(&ctl);
        move |log: bool| {
            let segs = match (&topology, &ctl.cfg.fixed) {
                (Some((nodes, csinodes)), _) => segments(
                    &ctl.cfg.driver,
                    csinodes.state().iter().map(|c| c.as_ref()),
                    |name| {
                        nodes
                            .get(&ObjectRef::new(name))
                            .map(|n| n.metadata.labels.clone().unwrap_or_default())
                    },
                ),
                (None, fixed) => BTreeSet::from([fixed.clone().unwrap_or_default()]),
            };
            let classes: Vec<String> = ctl
                .classes
                .state()
                .iter()
                .filter(|c| qualifies(c, &ctl.cfg.driver, ctl.cfg.immediate_binding))
                .filter_map(|c| c.metadata.name.clone())
                .collect();
            let items: BTreeSet<Item> = segs
                .iter()
                .flat_map(|s| classes.iter().map(move |c| (s.clone(), c.clone())))
                .collect();
            let added: Vec<Item> = {
                let mut s = ctl.lock();
                let added = items.difference(&s.items).cloned().collect();
                if log {
                    debug!(
                        "Initial number of topology segments {}, storage classes {}, potential CSIStorageCapacity objects {}",
                        segs.len(),
                        classes.len(),
                        items.len()
                    );
                }
                s.items = items;
                added
            };
            for (segment, class) in added {
                ctl.queue.add(Key::Sync(segment, class));
            }
            ctl.sweep();
        }
    };
    recompute(true);
    info!("Started Capacity Controller");

    let mut tasks = tokio::task::JoinSet::new();
    // The poll: every item at start (queued by the first recompute) and then once per interval.
    let c = Arc::clone(&ctl);
    let poll = move || {
        let items: Vec<Item> = c.lock().items.iter().cloned().collect();
        for (segment, class) in items {
            c.queue.add(Key::Sync(segment, class));
        }
    };
    tasks.spawn(
        Runner::new(vec![Lane::new(Arc::clone(&ctl.queue), ctl.cfg.workers)])
            .resync(ctl.cfg.poll, poll)
            .run(
                Arc::clone(&ctl),
                shutdown.clone(),
                |c: Arc<Controller>, _, key: Key| async move {
                    c.sync(&key).await.map(|()| Action::Done)
                },
                |c: &Controller, _, key: &Key, e| {
                    let n = c.queue.failures(key) + 1;
                    warn!("Retrying {key:?} after {n} failures: {e}");
                    Action::Retry
                },
            ),
    );
    // Topology and class changes.
    {
        let stop = shutdown.clone();
        let changed = Arc::clone(&changed);
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    () = changed.notified() => recompute(false),
                    () = stop.cancelled() => return,
                }
            }
        });
    }
    // Refreshes after volume operations.
    {
        let c = Arc::clone(&ctl);
        let stop = shutdown.clone();
        tasks.spawn(async move {
            loop {
                let class = tokio::select! {
                    class = refresh.recv() => match class {
                        Some(class) => class,
                        None => return,
                    },
                    () = stop.cancelled() => return,
                };
                let items: Vec<Item> = c
                    .lock()
                    .items
                    .iter()
                    .filter(|(_, cls)| *cls == class)
                    .cloned()
                    .collect();
                for (segment, class) in items {
                    c.queue.add(Key::Sync(segment, class));
                }
            }
        });
    }
    shutdown.cancelled().await;
    while tasks.join_next().await.is_some() {}
    info!("Shutting down Capacity Controller");
    Ok(())
}

/// A watch callback that wakes the recomputation.
fn notifier<K>(n: &Arc<tokio::sync::Notify>) -> impl FnMut(&K, bool) + Send + 'static {
    let n = Arc::clone(n);
    move |_, _| n.notify_one()
}

fn rv(v: &Option<String>) -> u64 {
    v.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::storage::v1::{CSINodeDriver, CSINodeSpec};

    #[test]
    fn quantities_are_exact_binary_si() {
        assert_eq!(quantity(100 << 30), "100Gi");
        assert_eq!(quantity(1536 << 20), "1536Mi");
        assert_eq!(quantity(1000), "1000");
        assert_eq!(quantity(1_000_000_000), "1000000000");
        assert_eq!(quantity(0), "0");
        assert_eq!(quantity(1024), "1Ki");
        assert_eq!(quantity(1 << 60), "1Ei");
    }

    #[test]
    fn manager_ids_match_upstreams_vectors() {
        assert_eq!(fnv1a32(MANAGER), 0x53f4_0b57);
        assert_eq!(manager_id(None), "external-provisioner");
        let node = |n: usize| format!("node{}", "a".repeat(n));
        assert_eq!(
            manager_id(Some(&node(38))),
            format!("external-provisioner-{}", node(38))
        );
        assert_eq!(
            manager_id(Some(&node(39))),
            format!("external-p-53f40b57-{}", node(39))
        );
        assert_eq!(
            manager_id(Some(&node(48))),
            format!("e-53f40b57-{}", node(48))
        );
        assert_eq!(manager_id(Some(&node(49))), "external-provisioner-a3607ff1");
        assert_eq!(manager_id(Some(&node(63))), "external-provisioner-df38e37f");
    }

    fn csinode(name: &str, driver: &str, keys: Option<&[&str]>) -> CSINode {
        CSINode {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            spec: CSINodeSpec {
                drivers: vec![CSINodeDriver {
                    name: driver.into(),
                    node_id: name.into(),
                    topology_keys: keys.map(|k| k.iter().map(|s| (*s).to_owned()).collect()),
                    allocatable: None,
                }],
            },
        }
    }

    #[test]
    fn segments_come_from_csinodes_whose_nodes_carry_every_key() {
        let zone = "topology.plugreg.test/zone";
        let rack = "topology.plugreg.test/rack";
        let nodes: HashMap<&str, BTreeMap<String, String>> = HashMap::from([
            (
                "n1",
                BTreeMap::from([(zone.into(), "a".into()), (rack.into(), "1".into())]),
            ),
            (
                "n2",
                BTreeMap::from([(zone.into(), "a".into()), (rack.into(), "1".into())]),
            ),
            (
                "n3",
                BTreeMap::from([(zone.into(), "b".into()), (rack.into(), "2".into())]),
            ),
            ("n4", BTreeMap::from([(zone.into(), "c".into())])),
        ]);
        let list = [
            csinode("n1", "d", Some(&[zone, rack])),
            csinode("n2", "d", Some(&[rack, zone])),
            csinode("n3", "d", Some(&[zone, rack])),
            // Lacks the rack label: no segment.
            csinode("n4", "d", Some(&[zone, rack])),
            // Another driver, and a node the cache does not know.
            csinode("n1", "other", Some(&[zone])),
            csinode("n9", "d", Some(&[zone])),
        ];
        let got = segments("d", &list, |n| nodes.get(n).cloned());
        let want: BTreeSet<Segment> = [
            BTreeMap::from([(zone.into(), "a".into()), (rack.into(), "1".into())]),
            BTreeMap::from([(zone.into(), "b".into()), (rack.into(), "2".into())]),
        ]
        .into();
        assert_eq!(got, want);
        // Registered without keys: the empty segment, for all nodes.
        let got = segments("d", &[csinode("n1", "d", None)], |n| nodes.get(n).cloned());
        assert_eq!(got, [Segment::new()].into());
    }

    #[test]
    fn classes_qualify_by_driver_and_binding() {
        let class = |provisioner: &str, mode: Option<&str>| StorageClass {
            provisioner: provisioner.into(),
            volume_binding_mode: mode.map(str::to_owned),
            ..StorageClass::default()
        };
        assert!(qualifies(
            &class("d", Some("WaitForFirstConsumer")),
            "d",
            false
        ));
        assert!(qualifies(&class("d", None), "d", false));
        assert!(!qualifies(&class("d", Some("Immediate")), "d", false));
        assert!(qualifies(&class("d", Some("Immediate")), "d", true));
        assert!(!qualifies(&class("other", None), "d", true));
    }

    #[test]
    fn plans_write_only_what_changed() {
        assert_eq!(plan(None, 5, None, false), Plan::Create);
        let e = Existing {
            capacity: Some("1Gi".into()),
            maximum_volume_size: None,
            has_owner: false,
        };
        assert_eq!(plan(Some(&e), 1 << 30, None, false), Plan::Nothing);
        assert_eq!(plan(Some(&e), 1 << 29, None, false), Plan::Update);
        assert_eq!(plan(Some(&e), 1 << 30, Some(5), false), Plan::Update);
        assert_eq!(
            plan(Some(&e), 1 << 30, None, true),
            Plan::Update,
            "owner appended"
        );
        let no_capacity = Existing::default();
        assert_eq!(plan(Some(&no_capacity), 0, None, false), Plan::Update);
        let plain = Existing {
            capacity: Some("1073741824".into()),
            maximum_volume_size: Some("0".into()),
            has_owner: true,
        };
        assert_eq!(plan(Some(&plain), 1 << 30, Some(0), true), Plan::Nothing);
    }
}
