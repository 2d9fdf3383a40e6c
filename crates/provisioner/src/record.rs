//! The durable record of volumes that may exist in the driver without a PersistentVolume.
//!
//! Upstream keeps its in-flight CreateVolume calls in memory only, so a restart, a new leader
//! or a claim deleted at the wrong moment can leak a volume. plugreg writes the volume's name,
//! its claim and the CreateVolumeRequest (without its secrets: only the reference to the
//! provisioner Secret) into a [`Journal`] **before** CreateVolume is called, and removes it
//! once the volume is saved as a PersistentVolume or deleted again with DeleteVolume. After a
//! restart, the next leader reads the record and finishes or deletes each volume: CreateVolume
//! is idempotent by name, so repeating the recorded request returns the volume's ID, which
//! DeleteVolume needs.
//!
//! Where: a few `coordination.k8s.io/v1` Leases in the provisioner's namespace, named
//! `<lease name of the driver>-volumes-<n>` and labelled [`LABEL`]; the record is the JSON
//! value of their annotation [`ANNOTATION`]. Upstream's sample RBAC already lets the provisioner
//! get, list, create and update Leases there (for leader election), so nothing more is needed.
//!
//! What it costs: every write carries every change of its Lease made since the last one, so
//! the claims started together share one write, and removals ride along with the next
//! addition (or go alone, at low priority, when nothing else is written). Requests of the same
//! shape are stored once per Lease. A Lease holds at most [`MAX_PAGE_BYTES`] of record (the API
//! server refuses more than 256 KiB of annotations per object); at most [`MAX_PAGES`] Leases
//! are used, and a volume that does not fit waits (its claim is retried with back-off).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, ListParams, PostParams};
use plugreg_proto::csi::v1::CreateVolumeRequest;
use plugreg_runtime::backoff::Backoff;
use plugreg_sidecar_kit::ratelimit::{Priority, RateLimiter};
use prost::Message as _;
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::secrets::SecretRef;

/// The Lease annotation that holds one page of the record.
pub const ANNOTATION: &str = "volume.plugreg.io/in-flight";
/// The label that marks a Lease as a page of the record (value: the driver's lease name).
pub const LABEL: &str = "volume.plugreg.io/in-flight";
/// The most bytes of record one Lease holds (well under the API server's 256 KiB of
/// annotations per object).
pub const MAX_PAGE_BYTES: usize = 96 * 1024;
/// The most Leases the record uses.
pub const MAX_PAGES: usize = 64;
/// The bytes of a page besides its entries and templates (its JSON skeleton), rounded up.
const PAGE_OVERHEAD: usize = 64;
/// The version of the page format.
const FORMAT: u32 = 1;
/// The wait after failed writes of a page (doubling, with jitter).
const WRITE_BACKOFF: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));

/// What a volume was requested with, minus its name and secrets: shared by the volumes of
/// claims of the same shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Template {
    /// The CreateVolumeRequest, protobuf-encoded, with `name` and `secrets` empty.
    pub request: Vec<u8>,
    /// The provisioner Secret (CreateVolume's and DeleteVolume's).
    pub secret: Option<SecretRef>,
}

/// One volume that may exist in the driver without a PersistentVolume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The volume (and PV) name: CreateVolume's `name`.
    pub volume: String,
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub claim: String,
    /// The claim's UID.
    pub uid: String,
    /// What it was requested with.
    pub template: Arc<Template>,
}

impl Entry {
    /// The entry of `request` (its secrets are not kept) for `claim`.
    pub fn new(
        claim: &PersistentVolumeClaim,
        request: &CreateVolumeRequest,
        secret: Option<SecretRef>,
    ) -> Self {
        let mut r = request.clone();
        let volume = std::mem::take(&mut r.name);
        r.secrets.clear();
        Entry {
            volume,
            namespace: claim.metadata.namespace.clone().unwrap_or_default(),
            claim: claim.metadata.name.clone().unwrap_or_default(),
            uid: claim.metadata.uid.clone().unwrap_or_default(),
            template: Arc::new(Template {
                request: r.encode_to_vec(),
                secret,
            }),
        }
    }

    /// The recorded request, with its name (and without secrets).
    pub fn request(&self) -> Result<CreateVolumeRequest, RecordError> {
        let mut r = CreateVolumeRequest::decode(self.template.request.as_slice())
            .map_err(|e| RecordError::Decode(format!("volume {}: {e}", self.volume)))?;
        r.name.clone_from(&self.volume);
        Ok(r)
    }

    /// `namespace/claim`, for logs and events.
    pub fn claim_key(&self) -> String {
        format!("{}/{}", self.namespace, self.claim)
    }
}

/// A failure of the record.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RecordError {
    /// A page could not be read or written.
    #[error("failed to write the in-flight record {lease}: {reason}")]
    Write {
        /// The Lease.
        lease: String,
        /// What the API server said.
        reason: String,
    },
    /// The Leases could not be listed.
    #[error("failed to read the in-flight record: {0}")]
    Read(String),
    /// A page is not in the format this version writes.
    #[error("the in-flight record cannot be read: {0}")]
    Decode(String),
    /// One volume's request alone is larger than a page.
    #[error("the CreateVolume request of volume {0} is too large to be recorded")]
    TooLarge(String),
    /// Every page is full.
    #[error("the in-flight record is full ({MAX_PAGES} Leases); waiting for volumes to finish")]
    Full,
    /// The provisioner is stopping.
    #[error("the provisioner is stopping")]
    Stopped,
}

#[derive(Serialize, Deserialize)]
struct WirePage {
    v: u32,
    templates: Vec<WireTemplate>,
    volumes: Vec<WireEntry>,
}

#[derive(Serialize, Deserialize)]
struct WireTemplate {
    request: ByteString,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    secret: Option<(String, String)>,
}

#[derive(Serialize, Deserialize)]
struct WireEntry {
    volume: String,
    namespace: String,
    claim: String,
    uid: String,
    template: usize,
}

fn wire_template(t: &Template) -> WireTemplate {
    WireTemplate {
        request: ByteString(t.request.clone()),
        secret: t
            .secret
            .as_ref()
            .map(|s| (s.namespace.clone(), s.name.clone())),
    }
}

fn wire_entry(e: &Entry, template: usize) -> WireEntry {
    WireEntry {
        volume: e.volume.clone(),
        namespace: e.namespace.clone(),
        claim: e.claim.clone(),
        uid: e.uid.clone(),
        template,
    }
}

/// The bytes `value` takes in a page (plus its separator).
fn json_len<T: Serialize>(value: &T) -> usize {
    serde_json::to_vec(value).map_or(0, |v| v.len()) + 1
}

/// The page of `entries`, each distinct template once.
pub fn encode<'a>(entries: impl IntoIterator<Item = &'a Entry>) -> String {
    let mut index: HashMap<&Template, usize> = HashMap::new();
    let mut page = WirePage {
        v: FORMAT,
        templates: Vec::new(),
        volumes: Vec::new(),
    };
    for e in entries {
        let next = index.len();
        let t = *index.entry(&e.template).or_insert_with(|| {
            page.templates.push(wire_template(&e.template));
            next
        });
        page.volumes.push(wire_entry(e, t));
    }
    serde_json::to_string(&page).unwrap_or_default()
}

/// The entries of a page.
pub fn decode(page: &str) -> Result<Vec<Entry>, RecordError> {
    let page: WirePage =
        serde_json::from_str(page).map_err(|e| RecordError::Decode(e.to_string()))?;
    if page.v != FORMAT {
        return Err(RecordError::Decode(format!(
            "format {} (this provisioner writes {FORMAT})",
            page.v
        )));
    }
    let templates: Vec<Arc<Template>> = page
        .templates
        .into_iter()
        .map(|t| {
            Arc::new(Template {
                request: t.request.0,
                secret: t
                    .secret
                    .map(|(namespace, name)| SecretRef { name, namespace }),
            })
        })
        .collect();
    page.volumes
        .into_iter()
        .map(|v| {
            let template = templates.get(v.template).cloned().ok_or_else(|| {
                RecordError::Decode(format!("volume {} names no template", v.volume))
            })?;
            Ok(Entry {
                volume: v.volume,
                namespace: v.namespace,
                claim: v.claim,
                uid: v.uid,
                template,
            })
        })
        .collect()
}

/// A volume waiting for a write: the generation that holds it, its name, and whom to tell.
type Waiter = (u64, String, oneshot::Sender<Result<(), RecordError>>);

/// One Lease of the record as this process wants it and as it last wrote it.
#[derive(Default)]
struct Page {
    name: String,
    /// The resourceVersion last read or written; `None` while the Lease does not exist.
    version: Option<String>,
    entries: BTreeMap<String, Entry>,
    /// Templates in use, with how many entries use each.
    templates: HashMap<Arc<Template>, usize>,
    bytes: usize,
    /// Generation of `entries`; bumped by every change.
    wanted: u64,
    /// Generation last written.
    written: u64,
    /// Volumes added and not yet written: a write is urgent (their CreateVolume waits).
    waiters: Vec<Waiter>,
    /// Volumes removed and not yet written, with the generation of the removal (not to be
    /// taken back from the Lease after a conflict).
    removed: HashMap<String, u64>,
    failures: u32,
}

impl Page {
    /// The encoded size of the page, at least.
    fn size(&self) -> usize {
        self.bytes + PAGE_OVERHEAD
    }

    fn urgent(&self) -> bool {
        !self.waiters.is_empty()
    }

    fn dirty(&self) -> bool {
        self.wanted > self.written
    }

    /// The bytes `e` adds to this page.
    fn cost(&self, e: &Entry) -> usize {
        let t = if self.templates.contains_key(&e.template) {
            0
        } else {
            json_len(&wire_template(&e.template))
        };
        t + json_len(&wire_entry(e, self.templates.len()))
    }

    fn insert(&mut self, mut e: Entry) {
        self.remove(&e.volume);
        // Entries of one shape share one template in memory too.
        if let Some((t, _)) = self.templates.get_key_value(&e.template) {
            e.template = Arc::clone(t);
        }
        self.bytes += self.cost(&e);
        *self.templates.entry(Arc::clone(&e.template)).or_default() += 1;
        self.removed.remove(&e.volume);
        self.entries.insert(e.volume.clone(), e);
        self.wanted += 1;
    }

    fn remove(&mut self, volume: &str) -> bool {
        let Some(e) = self.entries.remove(volume) else {
            return false;
        };
        self.bytes = self
            .bytes
            .saturating_sub(json_len(&wire_entry(&e, self.templates.len())));
        if let Some(n) = self.templates.get_mut(&e.template) {
            *n -= 1;
            if *n == 0 {
                self.templates.remove(&e.template);
                self.bytes = self
                    .bytes
                    .saturating_sub(json_len(&wire_template(&e.template)));
            }
        }
        self.wanted += 1;
        self.removed.insert(volume.to_owned(), self.wanted);
        true
    }
}

#[derive(Default)]
struct State {
    pages: Vec<Page>,
    /// Which page holds each volume.
    index: HashMap<String, usize>,
    stopped: bool,
}

/// The record: pages in memory, written to their Leases by [`Journal::run`].
pub struct Journal {
    leases: Api<Lease>,
    limiter: Arc<RateLimiter>,
    base: String,
    state: Mutex<State>,
    /// A page became dirty.
    changed: Notify,
    /// A page became urgent.
    urgent: Notify,
    /// Entries found in a Lease that another process wrote (a former leader's late write).
    found: mpsc::UnboundedSender<Entry>,
}

impl Journal {
    /// A record in the Leases `<base>-volumes-<n>` of `namespace`. `client` must not be rate
    /// limited itself: every request takes its token from `limiter` here, so that waiting for
    /// a low-priority token can give way to an urgent write. Entries other processes wrote
    /// arrive on the returned receiver.
    pub fn new(
        client: kube::Client,
        limiter: Arc<RateLimiter>,
        namespace: &str,
        base: &str,
    ) -> (Arc<Self>, mpsc::UnboundedReceiver<Entry>) {
        let (found, rx) = mpsc::unbounded_channel();
        let journal = Journal {
            leases: Api::namespaced(client, namespace),
            limiter,
            base: base.to_owned(),
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            urgent: Notify::new(),
            found,
        };
        (Arc::new(journal), rx)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn page_name(&self, n: usize) -> String {
        format!("{}-volumes-{n}", self.base)
    }

    /// Reads every page (at start-up and on becoming leader) and returns their entries.
    pub async fn load(&self) -> Result<Vec<Entry>, RecordError> {
        self.limiter.acquire(Priority::High, "LIST leases").await;
        let list = self
            .leases
            .list(&ListParams::default().labels(LABEL))
            .await
            .map_err(|e| RecordError::Read(e.to_string()))?;
        let prefix = format!("{}-volumes-", self.base);
        let mut all = Vec::new();
        let mut s = self.lock();
        for lease in list.items {
            let name = lease.metadata.name.clone().unwrap_or_default();
            let Some(n) = name
                .strip_prefix(&prefix)
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|n| *n < MAX_PAGES)
            else {
                continue;
            };
            let entries = match lease_entries(&lease) {
                Ok(e) => e,
                Err(e) => {
                    // Kept as it is: never overwritten, so that nothing it names is lost.
                    warn!(lease = %name, "{e}; leaving this Lease alone");
                    continue;
                }
            };
            while s.pages.len() <= n {
                let name = self.page_name(s.pages.len());
                s.pages.push(Page {
                    name,
                    ..Page::default()
                });
            }
            let page = &mut s.pages[n];
            page.version = lease.metadata.resource_version.clone();
            for e in &entries {
                page.insert(e.clone());
            }
            page.removed.clear();
            page.written = page.wanted;
            for e in entries {
                s.index.insert(e.volume.clone(), n);
                all.push(e);
            }
        }
        Ok(all)
    }

    /// Records `entry` and returns once it is written (with the other volumes of its batch).
    pub async fn record(&self, entry: Entry) -> Result<(), RecordError> {
        let rx = {
            let mut s = self.lock();
            if s.stopped {
                return Err(RecordError::Stopped);
            }
            let volume = entry.volume.clone();
            if let Some(old) = s.index.remove(&volume) {
                s.pages[old].remove(&volume);
            }
            if Page::default().size() + Page::default().cost(&entry) > MAX_PAGE_BYTES {
                return Err(RecordError::TooLarge(volume));
            }
            let n = match s
                .pages
                .iter()
                .position(|p| p.size() + p.cost(&entry) <= MAX_PAGE_BYTES)
            {
                Some(n) => n,
                None if s.pages.len() < MAX_PAGES => {
                    let name = self.page_name(s.pages.len());
                    s.pages.push(Page {
                        name,
                        ..Page::default()
                    });
                    s.pages.len() - 1
                }
                None => return Err(RecordError::Full),
            };
            let page = &mut s.pages[n];
            page.insert(entry);
            let (tx, rx) = oneshot::channel();
            page.waiters.push((page.wanted, volume.clone(), tx));
            s.index.insert(volume, n);
            rx
        };
        self.urgent.notify_one();
        self.changed.notify_one();
        rx.await.unwrap_or(Err(RecordError::Stopped))
    }

    /// Removes `volume` from the record (written with the next write of its page).
    pub fn forget(&self, volume: &str) {
        let mut s = self.lock();
        if let Some(n) = s.index.remove(volume)
            && s.pages[n].remove(volume)
        {
            drop(s);
            self.changed.notify_one();
        }
    }

    /// Whether `volume` is in the record (as this process wants it).
    pub fn contains(&self, volume: &str) -> bool {
        self.lock().index.contains_key(volume)
    }

    /// Volumes in the record and Leases in use.
    pub fn len(&self) -> (usize, usize) {
        let s = self.lock();
        (s.index.len(), s.pages.len())
    }

    /// Whether every change is written.
    pub fn settled(&self) -> bool {
        self.lock().pages.iter().all(|p| !p.dirty())
    }

    /// Writes dirty pages until `shutdown`: urgent ones (volumes waiting to be created) first
    /// with high priority, the others (only removals) with low priority.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            let job = self.next_job();
            let Some((n, urgent)) = job else {
                tokio::select! {
                    () = self.changed.notified() => continue,
                    () = shutdown.cancelled() => break,
                }
            };
            if urgent {
                tokio::select! {
                    () = self.limiter.acquire(Priority::High, "PUT leases") => {}
                    () = shutdown.cancelled() => break,
                }
            } else {
                // A removal waits behind all other work, and gives way to an urgent write.
                tokio::select! {
                    () = self.limiter.acquire(Priority::Low, "PUT leases") => {}
                    () = self.urgent.notified() => continue,
                    () = shutdown.cancelled() => break,
                }
            }
            self.write(n).await;
            let failures = self.lock().pages[n].failures;
            if failures > 0 {
                let backoff = WRITE_BACKOFF.with_jitter(0.2);
                tokio::select! {
                    () = backoff.sleep(failures) => {}
                    () = shutdown.cancelled() => break,
                }
            }
        }
        let mut s = self.lock();
        s.stopped = true;
        for p in &mut s.pages {
            for (_, _, tx) in p.waiters.drain(..) {
                let _ = tx.send(Err(RecordError::Stopped));
            }
        }
    }

    /// The page to write next: an urgent one if any, else a dirty one.
    fn next_job(&self) -> Option<(usize, bool)> {
        let s = self.lock();
        if let Some(n) = s.pages.iter().position(Page::urgent) {
            return Some((n, true));
        }
        s.pages.iter().position(Page::dirty).map(|n| (n, false))
    }

    /// One write of page `n` as wanted now; on a conflict, the Lease is read again and what
    /// another process added to it is kept.
    async fn write(&self, n: usize) {
        let (lease, generation) = {
            let s = self.lock();
            let p = &s.pages[n];
            (self.lease_of(p), p.wanted)
        };
        let name = lease.metadata.name.clone().unwrap_or_default();
        let result = if lease.metadata.resource_version.is_some() {
            self.leases
                .replace(&name, &PostParams::default(), &lease)
                .await
        } else {
            self.leases.create(&PostParams::default(), &lease).await
        };
        match result {
            Ok(written) => {
                let mut s = self.lock();
                let p = &mut s.pages[n];
                p.version = written.metadata.resource_version;
                p.written = generation;
                p.failures = 0;
                p.removed.retain(|_, g| *g > generation);
                let (done, waiting) = std::mem::take(&mut p.waiters)
                    .into_iter()
                    .partition(|(g, _, _)| *g <= generation);
                p.waiters = waiting;
                let done: Vec<_> = done;
                debug!(lease = %name, volumes = p.entries.len(), recorded = done.len(), "in-flight record written");
                for (_, _, tx) in done {
                    let _ = tx.send(Ok(()));
                }
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                debug!(lease = %name, "in-flight record changed meanwhile; reading it again");
                self.reread(n, &name).await;
            }
            Err(e) => {
                warn!(lease = %name, "failed to write the in-flight record: {e}");
                let err = RecordError::Write {
                    lease: name,
                    reason: e.to_string(),
                };
                // The volumes waiting for this write are not recorded: their claims retry.
                let mut s = self.lock();
                let p = &mut s.pages[n];
                p.failures += 1;
                let failed = std::mem::take(&mut p.waiters);
                for (_, volume, _) in &failed {
                    p.remove(volume);
                }
                for (_, volume, _) in &failed {
                    s.index.remove(volume);
                }
                for (_, _, tx) in failed {
                    let _ = tx.send(Err(err.clone()));
                }
            }
        }
    }

    /// After a conflict: the Lease's current version, and the entries another process added.
    async fn reread(&self, n: usize, name: &str) {
        self.limiter.acquire(Priority::High, "GET leases").await;
        let current = match self.leases.get_opt(name).await {
            Ok(c) => c,
            Err(e) => {
                warn!(lease = %name, "failed to read the in-flight record: {e}");
                self.lock().pages[n].failures += 1;
                return;
            }
        };
        let theirs = match current.as_ref().map(lease_entries).transpose() {
            Ok(t) => t.unwrap_or_default(),
            Err(e) => {
                warn!(lease = %name, "{e}; not overwriting it");
                self.lock().pages[n].failures += 1;
                return;
            }
        };
        let mut s = self.lock();
        let State { pages, index, .. } = &mut *s;
        let p = &mut pages[n];
        p.version = current.and_then(|c| c.metadata.resource_version);
        p.failures += 1;
        // Make sure the page is written again.
        p.wanted += 1;
        for e in theirs {
            if p.entries.contains_key(&e.volume)
                || p.removed.contains_key(&e.volume)
                || index.contains_key(&e.volume)
            {
                continue;
            }
            index.insert(e.volume.clone(), n);
            p.insert(e.clone());
            let _ = self.found.send(e);
        }
    }

    fn lease_of(&self, p: &Page) -> Lease {
        let mut lease = Lease::default();
        lease.metadata.name = Some(p.name.clone());
        lease.metadata.resource_version.clone_from(&p.version);
        lease.metadata.labels = Some(BTreeMap::from([(LABEL.to_owned(), self.base.clone())]));
        lease.metadata.annotations = Some(BTreeMap::from([(
            ANNOTATION.to_owned(),
            encode(p.entries.values()),
        )]));
        lease
    }
}

/// The entries of a Lease of the record (none without the annotation).
fn lease_entries(lease: &Lease) -> Result<Vec<Entry>, RecordError> {
    match lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION))
    {
        Some(page) => decode(page),
        None => Ok(Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugreg_proto::csi::v1::CapacityRange;

    fn claim(ns: &str, name: &str, uid: &str) -> PersistentVolumeClaim {
        let mut c = PersistentVolumeClaim::default();
        c.metadata.namespace = Some(ns.into());
        c.metadata.name = Some(name.into());
        c.metadata.uid = Some(uid.into());
        c
    }

    fn request(name: &str, bytes: i64) -> CreateVolumeRequest {
        CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: bytes,
                limit_bytes: 0,
            }),
            parameters: [("type".to_owned(), "fast".to_owned())].into(),
            secrets: [("token".to_owned(), "s3cr3t".to_owned())].into(),
            ..Default::default()
        }
    }

    fn secret() -> Option<SecretRef> {
        Some(SecretRef {
            name: "creds".into(),
            namespace: "kube-system".into(),
        })
    }

    #[test]
    fn entries_keep_the_request_without_its_secrets() {
        let e = Entry::new(
            &claim("ns", "data", "u1"),
            &request("pvc-1", 1024),
            secret(),
        );
        assert_eq!(e.volume, "pvc-1");
        assert_eq!(e.claim_key(), "ns/data");
        let r = e.request().unwrap();
        assert_eq!(r.name, "pvc-1");
        assert!(r.secrets.is_empty());
        assert_eq!(r.capacity_range.unwrap().required_bytes, 1024);
        assert_eq!(r.parameters.get("type").map(String::as_str), Some("fast"));
        let page = encode([&e]);
        assert!(!page.contains("s3cr3t"), "{page}");
        assert_eq!(decode(&page).unwrap(), vec![e]);
    }

    #[test]
    fn a_shape_is_stored_once_per_page() {
        let entries: Vec<Entry> = (0..100)
            .map(|i| {
                let mut e = Entry::new(
                    &claim("ns", &format!("c{i}"), &format!("u{i}")),
                    &request(&format!("pvc-{i}"), 1024),
                    secret(),
                );
                // Same shape: share the template, as the controller's page does.
                e.template = Arc::new((*e.template).clone());
                e
            })
            .collect();
        let page = encode(&entries);
        let wire: WirePage = serde_json::from_str(&page).unwrap();
        assert_eq!(wire.templates.len(), 1);
        assert_eq!(wire.volumes.len(), 100);
        let back = decode(&page).unwrap();
        assert_eq!(back, entries);
        // About a hundred bytes a volume.
        assert!(page.len() < 100 * 120, "{}", page.len());
    }

    #[test]
    fn page_bytes_track_what_is_encoded() {
        let mut p = Page::default();
        let mut all = Vec::new();
        for i in 0..50 {
            let e = Entry::new(
                &claim("ns", &format!("c{i}"), &format!("u{i}")),
                &request(&format!("pvc-{i}"), 1024 * (i % 3 + 1)),
                secret(),
            );
            p.insert(e.clone());
            all.push(e);
        }
        let encoded = encode(p.entries.values()).len();
        assert!(p.size() >= encoded, "{} < {encoded}", p.size());
        assert!(p.size() <= encoded + 200, "{} vs {encoded}", p.size());
        for e in &all[..49] {
            assert!(p.remove(&e.volume));
        }
        assert_eq!(p.templates.len(), 1);
        let encoded = encode(p.entries.values()).len();
        assert!(
            p.size() >= encoded && p.size() <= encoded + 200,
            "{}",
            p.size()
        );
        assert!(p.remove(&all[49].volume));
        assert_eq!(p.bytes, 0);
        assert!(!p.remove("pvc-none"));
    }

    /// Against a real kube-apiserver: volumes recorded together share one write, a second
    /// process (a new leader) reads them back, and removals are written too.
    async fn batches_against(version: plugreg_testpeers::KubeVersion) {
        let server = plugreg_testpeers::ApiServer::shared(version).await.unwrap();
        let client = server.client().await.unwrap();
        // One token a second: while the first write waits for its answer and the second for
        // its token, the other volumes gather.
        let limiter = Arc::new(RateLimiter::new(1.0, 1));
        // One API server per release: the name only has to differ between test processes.
        let base = format!("batch-{}", std::process::id());
        let (journal, _found) =
            Journal::new(client.clone(), Arc::clone(&limiter), "default", &base);
        let stop = CancellationToken::new();
        let writer = tokio::spawn(Arc::clone(&journal).run(stop.clone()));
        const N: usize = 50;
        let records = (0..N).map(|i| {
            let j = Arc::clone(&journal);
            async move {
                let c = claim("ns", &format!("c{i}"), &format!("u{i}"));
                j.record(Entry::new(
                    &c,
                    &request(&format!("pvc-{i}"), 1024),
                    secret(),
                ))
                .await
            }
        });
        for r in futures::future::join_all(records).await {
            r.unwrap();
        }
        let writes = limiter.requests_by_kind()["PUT leases"];
        assert!(writes <= 3, "{N} volumes took {writes} writes");

        // A new leader reads them back.
        let (other, _) = Journal::new(
            client.clone(),
            Arc::new(RateLimiter::new(-1.0, 0)),
            "default",
            &base,
        );
        let mut loaded: Vec<String> = other
            .load()
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.volume)
            .collect();
        loaded.sort();
        let mut want: Vec<String> = (0..N).map(|i| format!("pvc-{i}")).collect();
        want.sort();
        assert_eq!(loaded, want);
        assert_eq!(
            other.load().await.unwrap()[0]
                .request()
                .unwrap()
                .capacity_range
                .unwrap()
                .required_bytes,
            1024
        );

        // Removals reach the Lease without anyone waiting for them.
        for i in 0..N {
            journal.forget(&format!("pvc-{i}"));
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !journal.settled() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "removals not written"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (third, _) = Journal::new(
            client,
            Arc::new(RateLimiter::new(-1.0, 0)),
            "default",
            &base,
        );
        assert!(third.load().await.unwrap().is_empty());
        stop.cancel();
        writer.await.unwrap();
        assert!(matches!(
            journal
                .record(Entry::new(
                    &claim("ns", "late", "u"),
                    &request("pvc-late", 1),
                    None
                ))
                .await,
            Err(RecordError::Stopped)
        ));
    }

    #[tokio::test]
    async fn volumes_recorded_together_share_a_write_v1_20_2() {
        batches_against(plugreg_testpeers::KubeVersion::V1_20_2).await;
    }

    #[tokio::test]
    async fn volumes_recorded_together_share_a_write_v1_36_2() {
        batches_against(plugreg_testpeers::KubeVersion::V1_36_2).await;
    }

    #[test]
    fn foreign_or_damaged_pages_are_refused() {
        assert!(matches!(decode("{}"), Err(RecordError::Decode(_))));
        assert!(matches!(
            decode(r#"{"v":2,"templates":[],"volumes":[]}"#),
            Err(RecordError::Decode(_))
        ));
        let dangling = r#"{"v":1,"templates":[],"volumes":[{"volume":"pvc-1","namespace":"n","claim":"c","uid":"u","template":0}]}"#;
        assert!(matches!(decode(dangling), Err(RecordError::Decode(_))));
        assert!(
            decode(r#"{"v":1,"templates":[],"volumes":[]}"#)
                .unwrap()
                .is_empty()
        );
    }
}
