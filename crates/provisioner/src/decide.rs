//! What to do next, decided from a view of the caches and the in-flight memory, without I/O.
//!
//! The controller gathers a view ([`ClaimView`], [`RecordView`], [`VolumeView`]), asks the
//! matching function for an action, and carries it out. Every rule is tested below table by
//! table; the controller's integration tests against a real API server prove the acting.
//!
//! Two workers can touch one recorded volume: the claim's (it provisions) and the record's (it
//! finishes a volume whose claim or class is gone). The claim's worker never deletes a volume:
//! it hands such a volume over to the record's worker ([`ClaimAction::HandOver`]), so that a
//! volume is only ever deleted from one place.

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;

use crate::classify::ProvisionError;
use crate::inflight::{Deleted, Phase, Volume};
use crate::record::Entry;
use crate::request::{self, DataSource, RequestOptions};
use crate::topology::TopologySource;

/// The annotation of plugreg versions before the Lease record: the claim's volume name while
/// a CreateVolume was in flight.
pub const LEGACY_INTENT: &str = "volume.plugreg.io/provisioning";
/// The finalizer that went with [`LEGACY_INTENT`].
pub const LEGACY_FINALIZER: &str = "volume.plugreg.io/provisioning";

/// Whether the claim still carries an intent of a previous plugreg version (of any driver:
/// the key is the same for every plugreg provisioner; see [`legacy_intent_of`]).
pub fn has_legacy_intent(c: &PersistentVolumeClaim) -> bool {
    c.annotations().contains_key(LEGACY_INTENT)
        || c.finalizers().iter().any(|f| f == LEGACY_FINALIZER)
}

/// Whether the claim carries an intent that a previous version of *this* driver's provisioner
/// wrote. Every plugreg provisioner used the same annotation, so the key alone does not say
/// whose it is. An intent was only written on a claim whose storage-provisioner annotation and
/// StorageClass both named the driver, so:
/// - the annotation names this driver: ours;
/// - else the claim's class (cached) decides: ours when its provisioner is this driver (the
///   annotation was changed since);
/// - else, with the class gone too, the intent is an orphan only if no cached StorageClass
///   belongs to the provisioner the annotation names (`named_has_class`): then nobody else will
///   take it, and this provisioner finishes it rather than let the claim hang. Otherwise it is
///   that provisioner's.
///
/// Adopting another driver's intent would send CreateVolume and DeleteVolume to the wrong
/// driver and release the finalizer before the right one recorded its volume.
pub fn legacy_intent_of(
    c: &PersistentVolumeClaim,
    class: Option<&StorageClass>,
    driver: &str,
    named_has_class: bool,
) -> bool {
    if !has_legacy_intent(c) {
        return false;
    }
    if request::storage_provisioner(c) == Some(driver) {
        return true;
    }
    match class {
        Some(class) => class.provisioner == driver,
        None => !named_has_class,
    }
}

/// The volume name of a previous version's intent.
pub fn legacy_volume(c: &PersistentVolumeClaim) -> Option<&str> {
    c.annotations()
        .get(LEGACY_INTENT)
        .map(String::as_str)
        .filter(|v| !v.is_empty())
}

/// The record entry of a previous version's in-flight volume `volume`: its request built from
/// the claim and its class, or (the class gone) from the claim alone, with a stand-in class
/// of this driver.
pub fn legacy_entry(
    c: &PersistentVolumeClaim,
    class: Option<&StorageClass>,
    driver: &str,
    options: &RequestOptions,
    topology: &dyn TopologySource,
    volume: &str,
) -> Result<Entry, ProvisionError> {
    let stand_in;
    let class = match class {
        Some(c) => c,
        None => {
            stand_in = StorageClass {
                provisioner: driver.to_owned(),
                ..Default::default()
            };
            &stand_in
        }
    };
    let prepared = request::prepare_as(c, class, driver, options, topology, Some(volume))?;
    Ok(Entry::new(
        c,
        &prepared.request,
        prepared.provisioner_secret,
    ))
}

/// Who finishes a previous version's volume once it is in the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adopted {
    /// The claim is being deleted: the record's worker deletes the volume (with a
    /// `ProvisioningCancelled` event).
    Delete,
    /// The claim's next sync provisions it.
    Provision,
}

/// Who finishes the volume of a previous version's intent adopted from the claim.
pub fn adopted(c: &PersistentVolumeClaim) -> Adopted {
    if c.metadata.deletion_timestamp.is_some() {
        Adopted::Delete
    } else {
        Adopted::Provision
    }
}

/// What the claim's worker sees.
#[derive(Debug)]
pub struct ClaimView<'a> {
    /// The claim as cached.
    pub claim: &'a PersistentVolumeClaim,
    /// Its class as cached.
    pub class: Option<&'a StorageClass>,
    /// The driver (= provisioner) name.
    pub driver: &'a str,
    /// The claim's recorded volume.
    pub record: Option<&'a Volume>,
    /// The name the flags give its volume.
    pub name: &'a Result<String, ProvisionError>,
    /// Whether a PV of the claim's volume name (recorded, legacy, or from the flags) is cached.
    pub pv_cached: bool,
    /// Whether the claim is in upstream's slow set for its class.
    pub infeasible: bool,
    /// Whether the cached claim predates this process's reschedule of it.
    pub stale: bool,
    /// Whether a cached StorageClass belongs to the provisioner the claim's annotation names
    /// (read for a previous version's intent only: see [`legacy_intent_of`]).
    pub named_has_class: bool,
    /// `--node-deployment`: the claim is selected for another node than this provisioner's
    /// (a volume this node recorded for it is not used).
    pub another_node: bool,
}

/// What the claim's worker does.
#[derive(Debug, Clone, PartialEq)]
pub enum ClaimAction {
    /// Nothing (not ours, done, or waiting for the cache to show a change).
    Nothing,
    /// The cache predates our own write: retry after the back-off.
    WaitForCache,
    /// Retry after the back-off, without an event (upstream's errors without events).
    Retry(String),
    /// A `ProvisioningFailed` event, then retry after the back-off.
    Fail(ProvisionError),
    /// Drop the volume from the record: it is a cached PV, or nothing of it can exist.
    Forget(String),
    /// The claim gives up its volume (deleted, or its class is gone): the record's worker
    /// finishes and deletes it.
    HandOver(String),
    /// Remove a previous version's intent from the claim: its volume is a PV.
    ReleaseLegacy,
    /// Put a previous version's in-flight volume into the record, then remove the intent.
    AdoptLegacy(String),
    /// Left to an external populator: upstream's event only.
    Populator,
    /// Record the volume (unless recorded) and provision it under this name.
    Provision {
        /// The volume name (a recorded one wins over the flags).
        volume: String,
    },
}

/// The claim's next step.
pub fn claim(v: &ClaimView<'_>) -> ClaimAction {
    let c = v.claim;
    if v.stale {
        return ClaimAction::WaitForCache;
    }
    let deleting = c.metadata.deletion_timestamp.is_some();
    let legacy = legacy_intent_of(c, v.class, v.driver, v.named_has_class);
    let bound_to = c
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .filter(|v| !v.is_empty());
    if let Some(bound_to) = bound_to {
        if let Some(r) = v.record {
            // Bound to its own volume: the PV is the record now. Bound to another volume: ours
            // may still exist in the driver.
            return if r.entry.volume == bound_to {
                ClaimAction::Forget(r.entry.volume.clone())
            } else {
                ClaimAction::HandOver(r.entry.volume.clone())
            };
        }
        // KCM's status write is its last to the claim: releasing after it never races it.
        if legacy && (is_bound(c) || deleting) {
            return ClaimAction::ReleaseLegacy;
        }
        return ClaimAction::Nothing;
    }
    if let Some(r) = v.record {
        if v.pv_cached || matches!(r.phase, Phase::Saved(_)) {
            return if v.pv_cached {
                ClaimAction::Forget(r.entry.volume.clone())
            } else {
                ClaimAction::Nothing
            };
        }
        if v.another_node {
            // Rescheduled to another node: what this node may have made goes.
            return if r.ambiguous() {
                ClaimAction::HandOver(r.entry.volume.clone())
            } else {
                ClaimAction::Forget(r.entry.volume.clone())
            };
        }
        if !r.ambiguous() {
            // Nothing of it can exist yet: a claim that is not ours (any more) just drops it.
            let ours =
                !deleting && matches!(request::should_provision(c, v.class, v.driver), Ok(true));
            if !ours {
                return ClaimAction::Forget(r.entry.volume.clone());
            }
        }
        if deleting || v.class.is_none() {
            return ClaimAction::HandOver(r.entry.volume.clone());
        }
        if v.infeasible {
            return infeasible(c);
        }
        return ClaimAction::Provision {
            volume: r.entry.volume.clone(),
        };
    }
    if legacy {
        return match legacy_volume(c) {
            // Its volume is a PV: the intent goes once the claim is Bound (or now, if it is
            // being deleted: it will not be bound any more).
            Some(_) if v.pv_cached => {
                if deleting {
                    ClaimAction::ReleaseLegacy
                } else {
                    ClaimAction::Nothing
                }
            }
            Some(name) => ClaimAction::AdoptLegacy(name.to_owned()),
            // A finalizer without a name: nothing was recorded with it.
            None => ClaimAction::ReleaseLegacy,
        };
    }
    if deleting {
        return ClaimAction::Nothing;
    }
    if v.infeasible {
        return infeasible(c);
    }
    match request::should_provision(c, v.class, v.driver) {
        Ok(true) => {}
        Ok(false) => return ClaimAction::Nothing,
        Err(e) => return ClaimAction::Retry(e.message),
    }
    if v.pv_cached {
        return ClaimAction::Nothing;
    }
    match request::data_source(c) {
        Ok(DataSource::ExternalPopulator { .. }) => return ClaimAction::Populator,
        Ok(_) => {}
        Err(e) => return ClaimAction::Fail(e),
    }
    match v.name {
        Ok(name) => ClaimAction::Provision {
            volume: name.clone(),
        },
        Err(e) => ClaimAction::Fail(e.clone()),
    }
}

/// The provisioner whose StorageClasses the claim's worker looks for
/// ([`ClaimView::named_has_class`]): the one a previous version's intent's annotation names
/// when that is not this driver and the claim's class is gone. Only then does the intent's
/// owner depend on the classes (see [`legacy_intent_of`]).
pub fn class_to_find<'a>(
    c: &'a PersistentVolumeClaim,
    class: Option<&StorageClass>,
    driver: &str,
) -> Option<&'a str> {
    if !has_legacy_intent(c) || class.is_some() {
        return None;
    }
    request::storage_provisioner(c).filter(|n| *n != driver)
}

/// The name of the claim's volume whose PV the claim's worker looks for
/// ([`ClaimView::pv_cached`]): the recorded one, else the one of a previous version's intent
/// of this driver, else the one the flags give (`name`). The other arguments are
/// [`ClaimView`]'s.
pub fn volume_to_find(
    c: &PersistentVolumeClaim,
    class: Option<&StorageClass>,
    driver: &str,
    named_has_class: bool,
    record: Option<&Volume>,
    name: &Result<String, ProvisionError>,
) -> Option<String> {
    if let Some(r) = record {
        return Some(r.entry.volume.clone());
    }
    legacy_intent_of(c, class, driver, named_has_class)
        .then(|| legacy_volume(c).map(str::to_owned))
        .flatten()
        .or_else(|| name.clone().ok())
}

/// `--node-deployment`: whether the claim is selected for another node than `node` (this
/// provisioner's; none: not a node's provisioner).
pub fn another_node(c: &PersistentVolumeClaim, node: Option<&str>) -> bool {
    node.is_some_and(|node| crate::node::selected(c).is_some_and(|n| n != node))
}

fn infeasible(c: &PersistentVolumeClaim) -> ClaimAction {
    ClaimAction::Retry(format!(
        "skipping volume provisioning for pvc {}, because provisioning previously failed with infeasible error",
        c.uid().unwrap_or_default()
    ))
}

fn is_bound(c: &PersistentVolumeClaim) -> bool {
    c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
}

/// What the record's worker sees of one recorded volume.
#[derive(Debug)]
pub struct RecordView<'a> {
    /// The volume.
    pub volume: &'a Volume,
    /// The cached claim of the recorded namespace and name (maybe a newer one of that name).
    pub claim: Option<&'a PersistentVolumeClaim>,
    /// Whether the claim's class is cached.
    pub class_cached: bool,
    /// Whether a PV of the volume's name is cached.
    pub pv_cached: bool,
    /// `--node-deployment`: the claim is selected for another node than this provisioner's.
    pub another_node: bool,
}

/// What the record's worker does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordAction {
    /// The claim's worker owns it (queue the claim).
    Claim,
    /// The volume is a PV (the PV's own lifecycle deletes it): drop it from the record.
    Forget,
    /// Nobody will use it: CreateVolume with the recorded request (idempotent by name: it
    /// returns the volume's ID), then DeleteVolume, then drop it from the record.
    Delete,
}

/// The recorded volume's next step. The caller holds the volume (no CreateVolume of it runs).
pub fn record(v: &RecordView<'_>) -> RecordAction {
    if v.pv_cached || matches!(v.volume.phase, Phase::Saved(_)) {
        return RecordAction::Forget;
    }
    let owner = v.claim.filter(|c| {
        c.metadata.uid.as_deref() == Some(v.volume.entry.uid.as_str())
            && c.metadata.deletion_timestamp.is_none()
    });
    let Some(c) = owner else {
        return RecordAction::Delete;
    };
    let bound_elsewhere = c
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .is_some_and(|b| !b.is_empty() && b != v.volume.entry.volume);
    if bound_elsewhere || !v.class_cached || v.another_node {
        return RecordAction::Delete;
    }
    RecordAction::Claim
}

/// [`record`], except that a volume no CreateVolume may have created yet is only dropped.
pub fn record_held(v: &RecordView<'_>) -> RecordAction {
    match record(v) {
        RecordAction::Delete if !v.volume.ambiguous() => RecordAction::Forget,
        a => a,
    }
}

/// What the volume's worker reads of a PV: plain facts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PvFacts<'a> {
    /// Its `pv.kubernetes.io/provisioned-by` annotation.
    pub provisioned_by: Option<&'a str>,
    /// The driver of its CSI source (of an in-tree PV: its translation's).
    pub csi_driver: Option<&'a str>,
    /// Whether it is an in-tree PV (CSI migration).
    pub in_tree: bool,
    /// `persistentVolumeReclaimPolicy` (unset: `Delete`).
    pub reclaim_policy: Option<&'a str>,
    /// Its phase.
    pub phase: Option<&'a str>,
    /// Whether its deletion was asked for.
    pub deleting: bool,
    /// Whether it carries the provisioner's finalizer.
    pub has_finalizer: bool,
}

/// A PV as some store keeps it, read as [`PvFacts`] (the watch cache's `CachedPv` is one):
/// the decisions depend on the facts, not on the cache.
pub trait AsPvFacts {
    /// The facts.
    fn pv_facts(&self) -> PvFacts<'_>;
}

impl AsPvFacts for PvFacts<'_> {
    fn pv_facts(&self) -> PvFacts<'_> {
        *self
    }
}

/// What the volume's worker sees.
#[derive(Debug)]
pub struct VolumeView<'a, P: ?Sized> {
    /// The PV.
    pub pv: &'a P,
    /// The driver name.
    pub driver: &'a str,
    /// What this process deleted of it recently.
    pub deleted: Option<Deleted>,
}

/// What the volume's worker does (upstream's deletion and finalizer rules).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VolumeAction {
    /// Nothing.
    Nothing,
    /// Add the provisioner's finalizer (a Bound PV with the Delete policy).
    AddFinalizer,
    /// Remove the provisioner's finalizer (Retain/Recycle, or the volume is deleted already).
    RemoveFinalizer,
    /// DeleteVolume, then delete the PV, then remove the finalizer.
    Delete,
}

/// The PV's next step.
pub fn volume<P: AsPvFacts + ?Sized>(v: &VolumeView<'_, P>) -> VolumeAction {
    let pv = v.pv.pv_facts();
    let ours = match pv.provisioned_by {
        // A PV saved in-tree for a migrated claim names the in-tree plugin.
        Some(p) => {
            p == v.driver || Some(p) == plugreg_sidecar_kit::migration::in_tree_plugin(v.driver)
        }
        // A static in-tree PV is kube-controller-manager's, whatever its translation says.
        None => !pv.in_tree && pv.csi_driver == Some(v.driver),
    };
    if !ours {
        return VolumeAction::Nothing;
    }
    let policy = pv.reclaim_policy.unwrap_or("Delete");
    let phase = pv.phase.unwrap_or("");
    let deleting = pv.deleting;
    let has_finalizer = pv.has_finalizer;
    if policy == "Delete" && !deleting && phase == "Bound" && !has_finalizer {
        return VolumeAction::AddFinalizer;
    }
    if (policy == "Retain" || policy == "Recycle") && has_finalizer {
        return VolumeAction::RemoveFinalizer;
    }
    if (!has_finalizer && deleting) || phase != "Released" || policy != "Delete" {
        return VolumeAction::Nothing;
    }
    if deleting {
        // Our own DELETE coming back through the cache.
        match v.deleted {
            Some(Deleted::Finalized) => return VolumeAction::Nothing,
            Some(Deleted::Volume) => return VolumeAction::RemoveFinalizer,
            None => {}
        }
    }
    VolumeAction::Delete
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::State;
    use crate::record::{Entry, Template};
    use crate::request::tests::{claim_with, class};
    use crate::topology::tests::DRIVER;
    use k8s_openapi::api::core::v1::{PersistentVolumeClaimStatus, TypedLocalObjectReference};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use std::sync::Arc;
    use tokio::time::Instant;

    const UID: &str = "5f1e3b7c-9a2d-4e8f-b6c1-0d2e3f4a5b6c";
    const NAME: &str = "pvc-5f1e3b7c-9a2d-4e8f-b6c1-0d2e3f4a5b6c";

    fn now() -> Time {
        Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)
    }

    fn recorded(volume: &str, phase: Phase) -> Volume {
        Volume {
            entry: Entry {
                volume: volume.into(),
                namespace: "apps".into(),
                claim: "data".into(),
                uid: UID.into(),
                template: Arc::new(Template {
                    request: Vec::new(),
                    secret: None,
                }),
            },
            phase,
        }
    }

    fn wait_for_consumer() -> StorageClass {
        let mut c = class();
        c.volume_binding_mode = Some("WaitForFirstConsumer".into());
        c
    }

    fn fresh() -> Phase {
        Phase::Recorded { ambiguous: false }
    }

    /// The claim with `edit` applied.
    fn pvc(edit: impl FnOnce(&mut PersistentVolumeClaim)) -> PersistentVolumeClaim {
        let mut c = claim_with(UID);
        edit(&mut c);
        c
    }

    fn deleting(c: &mut PersistentVolumeClaim) {
        c.metadata.deletion_timestamp = Some(now());
    }

    fn bound_to(c: &mut PersistentVolumeClaim, v: &str) {
        c.spec.as_mut().unwrap().volume_name = Some(v.into());
        c.status = Some(PersistentVolumeClaimStatus {
            phase: Some("Bound".into()),
            ..Default::default()
        });
    }

    /// The claim's storage-provisioner annotation names another driver.
    fn other(c: &mut PersistentVolumeClaim) {
        c.annotations_mut()
            .insert(request::ANN_STORAGE_PROVISIONER.into(), "other".into());
    }

    fn other_class() -> StorageClass {
        StorageClass {
            provisioner: "other".into(),
            ..class()
        }
    }

    fn legacy(c: &mut PersistentVolumeClaim, v: &str) {
        c.annotations_mut().insert(LEGACY_INTENT.into(), v.into());
        c.finalizers_mut().push(LEGACY_FINALIZER.into());
    }

    struct Case {
        what: &'static str,
        claim: PersistentVolumeClaim,
        class: Option<StorageClass>,
        record: Option<Volume>,
        name: Result<String, ProvisionError>,
        pv_cached: bool,
        infeasible: bool,
        stale: bool,
        named_has_class: bool,
        another_node: bool,
        want: ClaimAction,
    }

    impl Case {
        fn new(what: &'static str, claim: PersistentVolumeClaim, want: ClaimAction) -> Self {
            Case {
                what,
                claim,
                class: Some(class()),
                record: None,
                name: Ok(NAME.into()),
                pv_cached: false,
                infeasible: false,
                stale: false,
                named_has_class: false,
                another_node: false,
                want,
            }
        }
        fn another_node(mut self) -> Self {
            self.another_node = true;
            self
        }
        fn named_has_class(mut self) -> Self {
            self.named_has_class = true;
            self
        }
        fn record(mut self, v: Volume) -> Self {
            self.record = Some(v);
            self
        }
        fn no_class(mut self) -> Self {
            self.class = None;
            self
        }
        fn class(mut self, c: StorageClass) -> Self {
            self.class = Some(c);
            self
        }
        fn pv_cached(mut self) -> Self {
            self.pv_cached = true;
            self
        }
        fn infeasible(mut self) -> Self {
            self.infeasible = true;
            self
        }
        fn stale(mut self) -> Self {
            self.stale = true;
            self
        }
        fn name(mut self, n: Result<String, ProvisionError>) -> Self {
            self.name = n;
            self
        }
    }

    fn provision(v: &str) -> ClaimAction {
        ClaimAction::Provision { volume: v.into() }
    }

    #[test]
    fn claims() {
        let bad_prefix = ProvisionError::final_("volume name prefix cannot be of length 0");
        let cases = vec![
            Case::new("a new claim is provisioned", pvc(|_| {}), provision(NAME)),
            Case::new(
                "the cache predates our reschedule",
                pvc(|_| {}),
                ClaimAction::WaitForCache,
            )
            .stale(),
            Case::new(
                "another provisioner's claim",
                pvc(|c| {
                    c.annotations_mut()
                        .insert(request::ANN_STORAGE_PROVISIONER.into(), "other".into());
                }),
                ClaimAction::Nothing,
            ),
            Case::new(
                "no class: upstream's silent retry",
                pvc(|_| {}),
                ClaimAction::Retry("storageClass \"fast\" not found".into()),
            )
            .no_class(),
            Case::new("a PV exists already", pvc(|_| {}), ClaimAction::Nothing).pv_cached(),
            Case::new(
                "node deployment: a claim moved to another node drops what was only recorded",
                pvc(|_| {}),
                ClaimAction::Forget(NAME.into()),
            )
            .record(recorded(NAME, fresh()))
            .another_node(),
            Case::new(
                "node deployment: a claim moved to another node hands a volume that may exist over",
                pvc(|_| {}),
                ClaimAction::HandOver(NAME.into()),
            )
            .record(recorded(NAME, Phase::Recorded { ambiguous: true }))
            .another_node(),
            Case::new(
                "a deleted claim without a record is left alone",
                pvc(deleting),
                ClaimAction::Nothing,
            ),
            Case::new(
                "bound claims need nothing",
                pvc(|c| bound_to(c, NAME)),
                ClaimAction::Nothing,
            ),
            Case::new(
                "the slow set",
                pvc(|_| {}),
                ClaimAction::Retry(format!(
                    "skipping volume provisioning for pvc {UID}, because provisioning previously failed with infeasible error"
                )),
            )
            .infeasible(),
            Case::new(
                "an external populator",
                pvc(|c| {
                    c.spec.as_mut().unwrap().data_source_ref = Some(
                        k8s_openapi::api::core::v1::TypedObjectReference {
                            api_group: Some("populators.example.com".into()),
                            kind: "Thing".into(),
                            name: "t".into(),
                            namespace: None,
                        },
                    );
                }),
                ClaimAction::Populator,
            ),
            Case::new(
                "a name that cannot be made",
                pvc(|_| {}),
                ClaimAction::Fail(bad_prefix.clone()),
            )
            .name(Err(bad_prefix)),
            // The record.
            Case::new(
                "the recorded name wins over the flags",
                pvc(|_| {}),
                provision("old-prefix-1234"),
            )
            .record(recorded("old-prefix-1234", fresh())),
            Case::new(
                "a recorded claim is ours whatever its annotations say now",
                pvc(|c| {
                    c.annotations_mut()
                        .insert(request::ANN_STORAGE_PROVISIONER.into(), "other".into());
                }),
                provision(NAME),
            )
            .record(recorded(NAME, Phase::Recorded { ambiguous: true })),
            Case::new(
                "a saved volume waits for the cache",
                pvc(|_| {}),
                ClaimAction::Nothing,
            )
            .record(recorded(NAME, Phase::Saved(Instant::now()))),
            Case::new(
                "a cached PV ends the record",
                pvc(|_| {}),
                ClaimAction::Forget(NAME.into()),
            )
            .record(recorded(NAME, Phase::Saved(Instant::now())))
            .pv_cached(),
            Case::new(
                "bound to its volume ends the record",
                pvc(|c| bound_to(c, NAME)),
                ClaimAction::Forget(NAME.into()),
            )
            .record(recorded(NAME, fresh())),
            Case::new(
                "bound to another volume: ours is deleted",
                pvc(|c| bound_to(c, "static-pv")),
                ClaimAction::HandOver(NAME.into()),
            )
            .record(recorded(NAME, Phase::Recorded { ambiguous: true })),
            Case::new(
                "a deleted claim hands its volume over",
                pvc(deleting),
                ClaimAction::HandOver(NAME.into()),
            )
            .record(recorded(NAME, Phase::Recorded { ambiguous: true })),
            Case::new(
                "a vanished class hands the volume over",
                pvc(|_| {}),
                ClaimAction::HandOver(NAME.into()),
            )
            .record(recorded(NAME, Phase::Recorded { ambiguous: true }))
            .no_class(),
            Case::new(
                "nothing created yet: a deleted claim drops it",
                pvc(deleting),
                ClaimAction::Forget(NAME.into()),
            )
            .record(recorded(NAME, fresh())),
            Case::new(
                "nothing created yet: a vanished class drops it",
                pvc(|_| {}),
                ClaimAction::Forget(NAME.into()),
            )
            .record(recorded(NAME, fresh()))
            .no_class(),
            Case::new(
                "nothing created yet: waiting for a new node drops it",
                pvc(|c| {
                    c.annotations_mut().remove(request::ANN_SELECTED_NODE);
                }),
                ClaimAction::Forget(NAME.into()),
            )
            .record(recorded(NAME, fresh()))
            .class(wait_for_consumer()),
            Case::new(
                "the slow set holds a recorded claim too",
                pvc(|_| {}),
                infeasible(&claim_with(UID)),
            )
            .record(recorded(NAME, Phase::Recorded { ambiguous: true }))
            .infeasible(),
            // A previous version's intent.
            Case::new(
                "an intent is adopted into the record",
                pvc(|c| legacy(c, "old-1")),
                ClaimAction::AdoptLegacy("old-1".into()),
            ),
            Case::new(
                "an intent of a deleted claim is adopted too",
                pvc(|c| {
                    legacy(c, "old-1");
                    deleting(c);
                }),
                ClaimAction::AdoptLegacy("old-1".into()),
            ),
            Case::new(
                "an intent whose class is gone is adopted too",
                pvc(|c| legacy(c, "old-1")),
                ClaimAction::AdoptLegacy("old-1".into()),
            )
            .no_class(),
            Case::new(
                "an intent whose annotation changed is still ours by its class",
                pvc(|c| {
                    legacy(c, "old-1");
                    other(c);
                }),
                ClaimAction::AdoptLegacy("old-1".into()),
            ),
            Case::new(
                "an intent on another driver's claim is that driver's",
                pvc(|c| {
                    legacy(c, "old-1");
                    other(c);
                }),
                ClaimAction::Nothing,
            )
            .class(other_class()),
            Case::new(
                "an intent on another driver's deleted claim is that driver's",
                pvc(|c| {
                    legacy(c, "old-1");
                    other(c);
                    deleting(c);
                }),
                ClaimAction::Nothing,
            )
            .class(other_class()),
            Case::new(
                "an intent on another driver's bound claim is that driver's to release",
                pvc(|c| {
                    legacy(c, "old-1");
                    other(c);
                    c.spec.get_or_insert_with(Default::default).volume_name =
                        Some("old-1".into());
                    c.status.get_or_insert_with(Default::default).phase = Some("Bound".into());
                }),
                ClaimAction::Nothing,
            )
            .class(other_class()),
            Case::new(
                "an intent without its class, named for a provisioner with classes, is its",
                pvc(|c| {
                    legacy(c, "old-1");
                    other(c);
                    deleting(c);
                }),
                ClaimAction::Nothing,
            )
            .no_class()
            .named_has_class(),
            Case::new(
                "an orphaned intent (annotation changed, class gone) is finished here",
                pvc(|c| {
                    legacy(c, "old-1");
                    other(c);
                    deleting(c);
                }),
                ClaimAction::AdoptLegacy("old-1".into()),
            )
            .no_class(),
            Case::new(
                "an intent whose PV exists waits for Bound",
                pvc(|c| legacy(c, "old-1")),
                ClaimAction::Nothing,
            )
            .pv_cached(),
            Case::new(
                "an intent whose PV exists is released from a deleted claim",
                pvc(|c| {
                    legacy(c, "old-1");
                    deleting(c);
                }),
                ClaimAction::ReleaseLegacy,
            )
            .pv_cached(),
            Case::new(
                "an intent is released once Bound",
                pvc(|c| {
                    legacy(c, "old-1");
                    bound_to(c, "old-1");
                }),
                ClaimAction::ReleaseLegacy,
            ),
            Case::new(
                "a lone intent finalizer is released",
                pvc(|c| c.finalizers_mut().push(LEGACY_FINALIZER.into())),
                ClaimAction::ReleaseLegacy,
            ),
        ];
        for case in &cases {
            let view = ClaimView {
                claim: &case.claim,
                class: case.class.as_ref(),
                driver: DRIVER,
                record: case.record.as_ref(),
                name: &case.name,
                pv_cached: case.pv_cached,
                infeasible: case.infeasible,
                stale: case.stale,
                named_has_class: case.named_has_class,
                another_node: case.another_node,
            };
            assert_eq!(super::claim(&view), case.want, "{}", case.what);
        }
    }

    #[test]
    fn an_adopted_intent_is_recorded_with_its_class_or_a_stand_in() {
        use crate::topology::tests::Cluster;
        let opts = RequestOptions::default();
        let c = pvc(|c| legacy(c, "old-1"));
        let mut fast = class();
        fast.parameters = Some([("type".to_owned(), "ssd".to_owned())].into());
        let with_class =
            legacy_entry(&c, Some(&fast), DRIVER, &opts, &Cluster::default(), "old-1").unwrap();
        let without = legacy_entry(&c, None, DRIVER, &opts, &Cluster::default(), "old-1").unwrap();
        assert_eq!(
            (with_class.volume.as_str(), with_class.uid.as_str()),
            ("old-1", UID)
        );
        let params = |e: &Entry| e.request().unwrap().parameters;
        assert_eq!(
            params(&with_class).get("type").map(String::as_str),
            Some("ssd")
        );
        assert!(
            params(&without).is_empty(),
            "the stand-in has no parameters"
        );
        // A restore without CREATE_DELETE_SNAPSHOT makes no request.
        let restore = pvc(|c| {
            legacy(c, "old-1");
            c.spec.as_mut().unwrap().data_source = Some(TypedLocalObjectReference {
                api_group: Some(request::SNAPSHOT_GROUP.into()),
                kind: "VolumeSnapshot".into(),
                name: "snap".into(),
            });
        });
        let e = legacy_entry(&restore, None, DRIVER, &opts, &Cluster::default(), "old-1");
        assert_eq!(e.map_err(|e| e.state), Err(State::Final));
        assert_eq!(adopted(&c), Adopted::Provision);
        assert_eq!(adopted(&pvc(deleting)), Adopted::Delete);
    }

    #[test]
    fn the_classes_are_scanned_only_for_an_intent_without_its_class() {
        let cases = [
            ("no intent", pvc(other), None, None),
            (
                "an intent with its class",
                pvc(|c| legacy(c, "old-1")),
                Some(class()),
                None,
            ),
            (
                "an intent of this driver",
                pvc(|c| legacy(c, "old-1")),
                None,
                None,
            ),
            (
                "an intent named for another provisioner, class gone",
                pvc(|c| {
                    legacy(c, "old-1");
                    other(c);
                }),
                None,
                Some("other"),
            ),
        ];
        for (what, claim, class, want) in cases {
            assert_eq!(
                class_to_find(&claim, class.as_ref(), DRIVER),
                want,
                "{what}"
            );
        }
    }

    #[test]
    fn the_volume_looked_for_is_the_recorded_then_the_intents_then_the_flags() {
        let name: Result<String, ProvisionError> = Ok(NAME.into());
        let no_name = Err(ProvisionError::final_(
            "volume name prefix cannot be of length 0",
        ));
        let recorded = recorded("old-prefix-1234", fresh());
        let plain = pvc(|_| {});
        let intent = pvc(|c| legacy(c, "old-1"));
        let others = pvc(|c| {
            legacy(c, "old-1");
            other(c);
        });
        let cl = class();
        let oc = other_class();
        #[allow(clippy::type_complexity)]
        let cases: [(
            &str,
            &PersistentVolumeClaim,
            Option<&StorageClass>,
            Option<&Volume>,
            &Result<String, ProvisionError>,
            Option<&str>,
        ); 6] = [
            ("the flags'", &plain, Some(&cl), None, &name, Some(NAME)),
            ("no name", &plain, Some(&cl), None, &no_name, None),
            (
                "recorded",
                &intent,
                Some(&cl),
                Some(&recorded),
                &name,
                Some("old-prefix-1234"),
            ),
            (
                "an intent of this driver",
                &intent,
                Some(&cl),
                None,
                &name,
                Some("old-1"),
            ),
            (
                "another driver's intent",
                &others,
                Some(&oc),
                None,
                &name,
                Some(NAME),
            ),
            (
                "an orphaned intent",
                &others,
                None,
                None,
                &name,
                Some("old-1"),
            ),
        ];
        for (what, claim, class, record, name, want) in cases {
            let got = volume_to_find(claim, class, DRIVER, false, record, name);
            assert_eq!(got.as_deref(), want, "{what}");
        }
    }

    #[test]
    fn another_node_is_a_selected_node_not_ours() {
        let on = |n: &str| {
            pvc(|c| {
                c.annotations_mut()
                    .insert(request::ANN_SELECTED_NODE.into(), n.into());
            })
        };
        let cases = [
            ("no node deployment", on("n2"), None, false),
            ("ours", on("n1"), Some("n1"), false),
            ("another's", on("n2"), Some("n1"), true),
            ("not scheduled", on(""), Some("n1"), false),
        ];
        for (what, claim, node, want) in cases {
            assert_eq!(another_node(&claim, node), want, "{what}");
        }
    }

    #[test]
    fn a_populator_claim_of_another_provisioner_is_not_ours() {
        let c = pvc(|c| {
            c.spec.as_mut().unwrap().data_source = Some(TypedLocalObjectReference {
                api_group: None,
                kind: "PersistentVolumeClaim".into(),
                name: "src".into(),
            });
            c.annotations_mut()
                .insert(request::ANN_STORAGE_PROVISIONER.into(), "other".into());
        });
        let name = Ok(NAME.to_owned());
        let cl = class();
        let view = ClaimView {
            claim: &c,
            class: Some(&cl),
            driver: DRIVER,
            record: None,
            name: &name,
            pv_cached: false,
            infeasible: false,
            stale: false,
            named_has_class: false,
            another_node: false,
        };
        assert_eq!(super::claim(&view), ClaimAction::Nothing);
        let _ = State::Final;
    }

    /// What, the volume, its claim, class cached, PV cached, the action wanted.
    type RecordCase<'a> = (
        &'a str,
        &'a Volume,
        Option<&'a PersistentVolumeClaim>,
        bool,
        bool,
        RecordAction,
    );

    #[test]
    fn records() {
        let ambiguous = recorded(NAME, Phase::Recorded { ambiguous: true });
        let saved = recorded(NAME, Phase::Saved(Instant::now()));
        let live = pvc(|_| {});
        let gone_deleting = pvc(deleting);
        let recreated = pvc(|c| c.metadata.uid = Some("another-uid".into()));
        let elsewhere = pvc(|c| bound_to(c, "static-pv"));
        let mine = pvc(|c| bound_to(c, NAME));
        let cases: Vec<RecordCase<'_>> = vec![
            (
                "its claim owns it",
                &ambiguous,
                Some(&live),
                true,
                false,
                RecordAction::Claim,
            ),
            (
                "bound to it: its claim forgets it",
                &ambiguous,
                Some(&mine),
                true,
                false,
                RecordAction::Claim,
            ),
            (
                "claim gone",
                &ambiguous,
                None,
                true,
                false,
                RecordAction::Delete,
            ),
            (
                "claim being deleted",
                &ambiguous,
                Some(&gone_deleting),
                true,
                false,
                RecordAction::Delete,
            ),
            (
                "claim deleted and made again",
                &ambiguous,
                Some(&recreated),
                true,
                false,
                RecordAction::Delete,
            ),
            (
                "claim bound to another volume",
                &ambiguous,
                Some(&elsewhere),
                true,
                false,
                RecordAction::Delete,
            ),
            (
                "class gone",
                &ambiguous,
                Some(&live),
                false,
                false,
                RecordAction::Delete,
            ),
            (
                "a PV holds it",
                &ambiguous,
                None,
                true,
                true,
                RecordAction::Forget,
            ),
            (
                "saved as a PV, cache behind",
                &saved,
                None,
                true,
                false,
                RecordAction::Forget,
            ),
        ];
        let fresh_volume = recorded(NAME, fresh());
        let held: Vec<RecordCase<'_>> = vec![
            (
                "nothing created yet: claim gone",
                &fresh_volume,
                None,
                true,
                false,
                RecordAction::Forget,
            ),
            (
                "nothing created yet: class gone",
                &fresh_volume,
                Some(&live),
                false,
                false,
                RecordAction::Forget,
            ),
            (
                "nothing created yet: its claim owns it",
                &fresh_volume,
                Some(&live),
                true,
                false,
                RecordAction::Claim,
            ),
            (
                "may exist: claim gone",
                &ambiguous,
                None,
                true,
                false,
                RecordAction::Delete,
            ),
        ];
        for (what, volume, claim, class_cached, pv_cached, want) in held {
            let view = RecordView {
                volume,
                claim,
                class_cached,
                pv_cached,
                another_node: false,
            };
            assert_eq!(record_held(&view), want, "{what}");
        }
        for (what, volume, claim, class_cached, pv_cached, want) in cases {
            let view = RecordView {
                volume,
                claim,
                class_cached,
                pv_cached,
                another_node: false,
            };
            assert_eq!(record(&view), want, "{what}");
        }
        // Node deployment: a live claim now selected for another node leaves this node's
        // volume to be deleted.
        let view = RecordView {
            volume: &ambiguous,
            claim: Some(&live),
            class_cached: true,
            pv_cached: false,
            another_node: true,
        };
        assert_eq!(record(&view), RecordAction::Delete);
    }

    /// A Bound PV of the driver with the Delete policy, `edit` applied.
    fn pv(edit: impl FnOnce(&mut PvFacts<'static>)) -> PvFacts<'static> {
        let mut v = PvFacts {
            provisioned_by: Some(DRIVER),
            csi_driver: Some(DRIVER),
            reclaim_policy: Some("Delete"),
            phase: Some("Bound"),
            ..PvFacts::default()
        };
        edit(&mut v);
        v
    }

    fn phase(v: &mut PvFacts<'static>, p: &'static str) {
        v.phase = Some(p);
    }

    fn finalizer(v: &mut PvFacts<'_>) {
        v.has_finalizer = true;
    }

    fn policy(v: &mut PvFacts<'static>, p: &'static str) {
        v.reclaim_policy = Some(p);
    }

    #[test]
    fn volumes() {
        use VolumeAction::*;
        let cases: Vec<(&str, PvFacts<'static>, Option<Deleted>, VolumeAction)> = vec![
            ("bound: finalizer added", pv(|_| {}), None, AddFinalizer),
            ("bound with finalizer", pv(finalizer), None, Nothing),
            (
                "another driver's",
                pv(|v| v.provisioned_by = Some("other")),
                None,
                Nothing,
            ),
            (
                "static PV of our driver",
                pv(|v| {
                    v.provisioned_by = None;
                    phase(v, "Released");
                    finalizer(v);
                }),
                None,
                Delete,
            ),
            (
                "retained: finalizer removed",
                pv(|v| {
                    policy(v, "Retain");
                    finalizer(v);
                }),
                None,
                RemoveFinalizer,
            ),
            (
                "released: deleted",
                pv(|v| {
                    phase(v, "Released");
                    finalizer(v);
                }),
                None,
                Delete,
            ),
            (
                "released without finalizer: deleted",
                pv(|v| phase(v, "Released")),
                None,
                Delete,
            ),
            (
                "released and retained: kept",
                pv(|v| {
                    phase(v, "Released");
                    policy(v, "Retain");
                }),
                None,
                Nothing,
            ),
            (
                "being deleted without our finalizer",
                pv(|v| {
                    phase(v, "Released");
                    v.deleting = true;
                }),
                None,
                Nothing,
            ),
            (
                "our own delete coming back",
                pv(|v| {
                    phase(v, "Released");
                    finalizer(v);
                    v.deleting = true;
                }),
                Some(Deleted::Volume),
                RemoveFinalizer,
            ),
            (
                "our own delete, finalizer removed already",
                pv(|v| {
                    phase(v, "Released");
                    finalizer(v);
                    v.deleting = true;
                }),
                Some(Deleted::Finalized),
                Nothing,
            ),
            (
                "someone else's delete of a released PV",
                pv(|v| {
                    phase(v, "Released");
                    finalizer(v);
                    v.deleting = true;
                }),
                None,
                Delete,
            ),
        ];
        for (what, pv, deleted, want) in cases {
            let view = VolumeView {
                pv: &pv,
                driver: DRIVER,
                deleted,
            };
            assert_eq!(volume(&view), want, "{what}");
        }
    }

    /// CSI migration: a PV saved in-tree names the in-tree plugin as its provisioner; it is the
    /// migration target's, and no other driver's.
    #[test]
    fn an_in_tree_pv_is_its_migration_targets() {
        let released = pv(|v| {
            v.provisioned_by = Some("kubernetes.io/gce-pd");
            phase(v, "Released");
            finalizer(v);
        });
        for (driver, want) in [
            ("pd.csi.storage.gke.io", VolumeAction::Delete),
            ("ebs.csi.aws.com", VolumeAction::Nothing),
            (DRIVER, VolumeAction::Nothing),
        ] {
            let view = VolumeView {
                pv: &released,
                driver,
                deleted: None,
            };
            assert_eq!(volume(&view), want, "{driver}");
        }
        // §5.1: a static in-tree PV (no provisioned-by) stays kube-controller-manager's.
        let static_pv = pv(|v| {
            v.provisioned_by = None;
            v.csi_driver = Some("pd.csi.storage.gke.io");
            v.in_tree = true;
            phase(v, "Released");
        });
        let view = VolumeView {
            pv: &static_pv,
            driver: "pd.csi.storage.gke.io",
            deleted: None,
        };
        assert_eq!(volume(&view), VolumeAction::Nothing);
    }
}
