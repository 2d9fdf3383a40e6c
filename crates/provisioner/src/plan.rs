//! Provisioning one claim, decided step by step without I/O: the claim's worker gathers the
//! facts of a step (the caches, the driver's and the API server's answers), asks the step's
//! function here, and carries out what it returns.
//!
//! The steps, in the order the controller takes them:
//! 1. [`take`]: whether this node provisions the claim at all (`--node-deployment`; becoming
//!    its owner first is [`crate::owner`]'s);
//! 2. [`start`]: the request, or why there is none (and whether the claim is rescheduled);
//!    then the restore's or clone's source: [`source_claim_unreadable`], and the answers to
//!    its protection ([`clone_protected`], [`snapshot_protected`]);
//! 3. [`send`]: what CreateVolume is sent, and whether the record is written first;
//! 4. [`created`]: CreateVolume's answer: the volume, or what its failure leaves behind;
//! 5. [`built`]: the PV to save, or the volume to delete again ([`cleaned_up`]);
//! 6. [`saved`]: the PV's save; then [`snapshot_to_release`] and [`snapshot_released`];
//! 7. [`finished`] and [`failed_event`]: what the attempt's end reports.
//!
//! A failed step is a [`Failed`]: what becomes of the recorded volume, whether the claim is
//! rescheduled, and the [`Failure`] reported. Every rule is tested below; the controller's
//! integration tests against a real API server and driver prove the acting.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use plugreg_proto::csi::v1::{CreateVolumeRequest, CreateVolumeResponse};
use plugreg_sidecar_kit::migration;

use crate::classify::{ProvisionError, State};
use crate::inflight::Volume;
use crate::node::{self, Take};
use crate::pv::{self, PvError};
use crate::record::Entry;
use crate::request::{self, DataSource, Prepared, RequestOptions};
use crate::secrets::{SecretRef, go_quote};
use crate::source;
use crate::topology::TopologySource;

/// How a provisioning attempt failed.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// Retry with back-off, no event (upstream's errors without events).
    Silent(String),
    /// Retry with back-off after a `ProvisioningFailed` event.
    Error(ProvisionError),
}

/// What becomes of the claim's recorded volume when a step fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordStep {
    /// It stays as it is.
    Keep,
    /// It goes from the record: nothing of it exists in the driver.
    Drop,
    /// It stays, marked ambiguous: a volume of it may exist in the driver.
    MarkAmbiguous,
}

/// A failed step.
#[derive(Debug, Clone, PartialEq)]
pub struct Failed {
    /// First, the record.
    pub record: RecordStep,
    /// Then remove the claim's selected-node annotation, so that the scheduler picks another
    /// node (a failure of that is reported instead of [`Failed::failure`]).
    pub reschedule: bool,
    /// What is reported.
    pub failure: Failure,
}

impl Failed {
    /// `e` reported, the record kept, no reschedule.
    fn report(e: ProvisionError) -> Self {
        Failed {
            record: RecordStep::Keep,
            reschedule: false,
            failure: Failure::Error(e),
        }
    }
}

/// The claim being provisioned, and what it is provisioned with.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The claim as cached.
    pub claim: &'a PersistentVolumeClaim,
    /// Its class as cached.
    pub class: &'a StorageClass,
    /// The driver (= provisioner) name.
    pub driver: &'a str,
    /// The provisioner identity put into every PV.
    pub identity: &'a str,
    /// The request options from the flags.
    pub options: &'a RequestOptions,
    /// The volume name.
    pub volume: &'a str,
    /// The claim's recorded volume.
    pub record: Option<&'a Volume>,
}

/// `--node-deployment`: this node's name and whether it competes for claims of immediate
/// binding.
#[derive(Debug, Clone, Copy)]
pub struct ThisNode<'a> {
    /// The node's name.
    pub name: &'a str,
    /// `--node-deployment-immediate-binding`.
    pub immediate_binding: bool,
}

/// §B.3: whether this provisioner provisions the claim: always without `--node-deployment`
/// and for a claim it recorded (its own), else by [`node::take`].
pub fn take(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    recorded: bool,
    node: Option<ThisNode<'_>>,
) -> Take {
    match node {
        Some(n) if !recorded => node::take(claim, class, n.name, n.immediate_binding),
        _ => Take::Provision,
    }
}

/// The error reported when becoming the claim's owner failed (`key`: `namespace/name`).
pub fn owner_failed(key: &str, e: &str) -> ProvisionError {
    ProvisionError::no_change(format!("node check failed: PVC {key}: {e}"))
}

/// What the provisioning works with once the request is prepared.
#[derive(Debug, Clone, PartialEq)]
pub struct Ready {
    /// The request as the claim and its class make it now.
    pub prepared: Prepared,
    /// The class is the in-tree plugin's this driver replaces (CSI migration).
    pub migrated: bool,
    /// A CreateVolume of the volume may have run: the recorded request is repeated as it was
    /// (the driver answers a repeated request with the volume it made).
    pub repeat: bool,
    /// The VolumeAttributesClass to read live and apply (none: the claim names none, or the
    /// request is repeated).
    pub attributes_class: Option<String>,
    /// The claim's data source.
    pub source: DataSource,
    /// Read the restore's or clone's source live and check it (not when repeating: the
    /// recorded request keeps the source it had).
    pub read_source: bool,
    /// A failed CreateVolume may reschedule the claim: topology is on and it has a selected
    /// node.
    pub reschedule_possible: bool,
}

/// Step 2: the request, prepared from the claim, its class (translated if it is the in-tree
/// plugin's this driver replaces) and the cluster's topology; or the failure. A reschedule
/// drops a recorded volume that no CreateVolume may have created yet.
pub fn start(
    c: &Claim<'_>,
    capabilities: Result<(), ProvisionError>,
    topology: &dyn TopologySource,
) -> Result<Ready, Failed> {
    capabilities.map_err(Failed::report)?;
    let repeat = c.record.is_some_and(Volume::ambiguous);
    // Mount options, reclaim policy and binding mode are the same in both classes.
    let (csi_class, migrated) = request::csi_class(c.class, c.driver).map_err(Failed::report)?;
    let prepared = request::prepare_as(
        c.claim,
        &csi_class,
        c.driver,
        c.options,
        topology,
        Some(c.volume),
    )
    .map_err(|e| Failed {
        record: if e.state == State::Reschedule && c.record.is_some() && !repeat {
            RecordStep::Drop
        } else {
            RecordStep::Keep
        },
        reschedule: e.state == State::Reschedule,
        failure: Failure::Error(e),
    })?;
    // `prepare_as` read the data source first: it reads again without an error.
    let source = request::data_source(c.claim).map_err(Failed::report)?;
    Ok(Ready {
        attributes_class: prepared.volume_attributes_class.clone().filter(|_| !repeat),
        prepared,
        migrated,
        repeat,
        source,
        read_source: !repeat,
        reschedule_possible: c.options.topology && request::selected_node(c.claim).is_some(),
    })
}

/// What CreateVolume is sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Send {
    /// The request (its secrets are the controller's to fill in).
    pub request: CreateVolumeRequest,
    /// The provisioner secret to read into the request.
    pub secret: Option<SecretRef>,
    /// The entry to write into the record before the driver hears of the volume (none: the
    /// record holds it as it is).
    pub record: Option<Entry>,
}

/// Step 3: the request prepared now, or the recorded one when it is repeated; recorded
/// unless the record holds it already (a request not sent yet is recorded anew when the
/// claim changed it).
pub fn send(c: &Claim<'_>, ready: &Ready) -> Result<Send, Failed> {
    let (request, secret) = match c.record.filter(|_| ready.repeat) {
        Some(v) => (
            v.entry
                .request()
                .map_err(|e| Failed::report(ProvisionError::no_change(e.to_string())))?,
            v.entry.template.secret.clone(),
        ),
        None => (
            ready.prepared.request.clone(),
            ready.prepared.provisioner_secret.clone(),
        ),
    };
    let entry = Entry::new(c.claim, &request, secret.clone());
    let write = c.record.is_none_or(|v| !ready.repeat && v.entry != entry);
    Ok(Send {
        request,
        secret,
        record: write.then_some(entry),
    })
}

/// Step 4: CreateVolume's answer. A failure that may leave a volume in the driver keeps it
/// recorded as ambiguous; a definite answer to the first request drops it; a reschedule
/// drops it too (unless repeated) and removes the selected node.
pub fn created(
    ready: &Ready,
    answer: Result<CreateVolumeResponse, tonic::Status>,
) -> Result<CreateVolumeResponse, Failed> {
    let status = match answer {
        Ok(r) => return Ok(r),
        Err(s) => s,
    };
    let e = ProvisionError::from_create_volume(&status, ready.reschedule_possible);
    let dropped = if ready.repeat {
        RecordStep::Keep
    } else {
        RecordStep::Drop
    };
    let (record, reschedule) = match e.state {
        State::Background => (RecordStep::MarkAmbiguous, false),
        State::Reschedule => (dropped, true),
        State::Final | State::NoChange => (dropped, false),
    };
    Err(Failed {
        record,
        reschedule,
        failure: Failure::Error(e),
    })
}

/// What becomes of the created volume.
#[derive(Debug, Clone, PartialEq)]
pub enum Built {
    /// Save this PV.
    Save(Box<PersistentVolume>),
    /// The volume cannot be used: log `warning` (if any), DeleteVolume `id` (with the
    /// request's secrets), and report the end with [`cleaned_up`].
    Cleanup {
        /// The volume ID.
        id: String,
        /// Why it cannot be used.
        message: String,
        /// Logged first (a PV that does not translate back to its in-tree form).
        warning: Option<String>,
    },
    /// Nothing can be cleaned up.
    Fail(Failed),
}

/// Step 5: the PV of the created volume (in its in-tree form for a migrated class), or the
/// cleanup of a volume that cannot be used (decisions M2: also one whose PV does not
/// translate, which upstream leaves behind).
pub fn built(c: &Claim<'_>, ready: &Ready, response: &CreateVolumeResponse) -> Built {
    let mut warning = None;
    let pv = pv::build(
        &ready.prepared,
        c.claim,
        c.class,
        c.driver,
        c.identity,
        response,
        c.options,
    )
    .and_then(|pv| {
        if !ready.migrated {
            return Ok(pv);
        }
        migration::translate_csi_pv_to_in_tree(&pv).map_err(|e| {
            warning = Some(format!(
                "failed to translate CSI PV to in-tree due to: {e}. Deleting provisioned PV"
            ));
            PvError::InTree(e.to_string())
        })
    });
    let message = match pv {
        Ok(pv) => return Built::Save(Box::new(pv)),
        Err(PvError::TooSmall {
            capacity,
            requested,
        }) => {
            format!("created volume capacity {capacity} less than requested capacity {requested}")
        }
        Err(PvError::MissingContentSource) => "volume content source missing".into(),
        Err(PvError::InTree(e)) => e,
        Err(PvError::NoVolumeId) => {
            // Nothing to clean up without an id; the driver broke the spec. Its volume may
            // exist: the record stays.
            return Built::Fail(Failed {
                record: RecordStep::MarkAmbiguous,
                reschedule: false,
                failure: Failure::Error(ProvisionError::final_(
                    "CreateVolume returned no volume id",
                )),
            });
        }
    };
    let id = response
        .volume
        .as_ref()
        .map(|v| v.volume_id.clone())
        .unwrap_or_default();
    Built::Cleanup {
        id,
        message,
        warning,
    }
}

/// The end of a cleanup ([`Built::Cleanup`]) of `volume`: a deleted volume leaves the
/// record; one that is left keeps it until a retry cleans it up.
pub fn cleaned_up(volume: &str, message: String, deleted: Result<(), tonic::Status>) -> Failed {
    let (record, message) = match deleted {
        Ok(()) => (RecordStep::Drop, message),
        Err(status) => {
            // Upstream's two texts differ in the case of one letter.
            let cleanup = if message == "volume content source missing" {
                "cleanup"
            } else {
                "Cleanup"
            };
            let message = format!(
                "{message}. {cleanup} of volume {volume} failed, volume is orphaned: {}",
                plugreg_runtime::report::grpc(&status)
            );
            (RecordStep::MarkAmbiguous, message)
        }
    };
    Failed {
        record,
        reschedule: false,
        failure: Failure::Error(ProvisionError::new(State::Background, message)),
    }
}

/// A failed API call as the decisions read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status of the API server's answer (none: there was no answer).
    pub code: Option<u16>,
    /// The error as the client prints it.
    pub text: String,
    /// The error as Go's client prints it: the API server's message, or the client's error.
    pub message: String,
}

/// The PV's save.
#[derive(Debug, Clone, PartialEq)]
pub enum Saved {
    /// Saved now.
    Created,
    /// It existed already (a retry's save, or another process's).
    Existed,
    /// Not saved: log `warning`, then fail.
    Failed {
        /// Logged first.
        warning: String,
        /// The failure.
        failed: Failed,
    },
}

/// Step 6: the answer to the PV's create. A PV that is not saved leaves the volume in the
/// driver: the record stays and the retry repeats the request (CreateVolume is idempotent by
/// name), as upstream retries the save.
pub fn saved(volume: &str, answer: Result<(), ApiError>) -> Saved {
    match answer {
        Ok(()) => Saved::Created,
        Err(e) if e.code == Some(409) => Saved::Existed,
        Err(e) => Saved::Failed {
            warning: format!("Failed to save volume: {}", e.text),
            failed: Failed {
                record: RecordStep::MarkAmbiguous,
                reschedule: false,
                failure: Failure::Error(ProvisionError::new(
                    State::Background,
                    format!("failed to save persistentvolume {volume}: {}", e.text),
                )),
            },
        },
    }
}

/// Why the source claim `name` of a clone cannot be read (the claim's namespace `ns`): a
/// claim that is not there reads as upstream's lister says it.
pub fn source_claim_unreadable(name: &str, ns: &str, e: &ApiError) -> String {
    let why = match e.code {
        Some(404) => format!("persistentvolumeclaim {} not found", go_quote(name)),
        _ => e.message.clone(),
    };
    format!(
        "error getting PVC {name} (namespace {}) from api server: {why}",
        go_quote(ns)
    )
}

/// The answer to putting the cloning protection on the source claim: any failure fails the
/// attempt (no change).
pub fn clone_protected(answer: Result<(), ApiError>) -> Result<(), Failure> {
    answer.map_err(|e| Failure::Error(ProvisionError::no_change(e.message)))
}

/// The answer to putting the restore protection on the source snapshot `ns/name`: Forbidden
/// is tolerated, as upstream (RBAC may not grant it; the info line is returned); any other
/// failure fails the attempt (no change).
pub fn snapshot_protected(
    ns: &str,
    name: &str,
    answer: Result<(), ApiError>,
) -> Result<Option<String>, Failure> {
    match answer {
        Ok(()) => Ok(None),
        Err(e) if e.code == Some(403) => Ok(Some(format!(
            "not allowed to add the volumesnapshot-as-source-protection finalizer: {}",
            e.message
        ))),
        Err(e) => Err(Failure::Error(ProvisionError::no_change(format!(
            "failed to add finalizer {} to snapshot {ns}/{name}: {}",
            source::SNAPSHOT_FINALIZER,
            e.message
        )))),
    }
}

/// The answer to removing the restore protection from the snapshot `ns/name` after its
/// restore: a snapshot gone, or a finalizer RBAC does not let us touch, is fine; any other
/// failure is the returned warning, and left to the sweeper (provisioning succeeded).
pub fn snapshot_released(ns: &str, name: &str, answer: Result<(), ApiError>) -> Option<String> {
    match answer {
        Ok(()) => None,
        Err(e) if matches!(e.code, Some(403 | 404)) => None,
        Err(e) => Some(format!(
            "Failed to remove snapshot finalizer from {ns}/{name}: {}",
            e.message
        )),
    }
}

/// The snapshot (of the claim's namespace) whose restore protection goes once the PV is
/// saved: only a `spec.dataSource` snapshot's, as upstream; any other is left to the sweeper.
pub fn snapshot_to_release(claim: &PersistentVolumeClaim) -> Option<&str> {
    claim
        .spec
        .as_ref()
        .and_then(|s| s.data_source.as_ref())
        .filter(|ds| ds.kind == "VolumeSnapshot")
        .map(|ds| ds.name.as_str())
}

/// What the claim's worker does at the end of an attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// Refresh the capacity of the claim's class: a volume was made, or an error changed
    /// state.
    pub refresh_capacity: bool,
    /// Put the claim in upstream's slow set (the driver answered INVALID_ARGUMENT).
    pub slow: bool,
    /// The attempt's result.
    pub result: Result<(), Failure>,
}

/// Step 7: the end of the attempt.
pub fn finished(result: Result<(), Failure>) -> Finished {
    Finished {
        refresh_capacity: !matches!(result, Err(Failure::Silent(_))),
        slow: matches!(&result, Err(Failure::Error(e)) if e.infeasible),
        result,
    }
}

/// Upstream's `ProvisioningFailed` event and log line of a failure with the class `class`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedEvent {
    /// The event's message.
    pub event: String,
    /// The log line's message.
    pub log: String,
}

/// The event and log line of `e`, wrapped as the library wraps every Provision error; an
/// infeasible error says its retries are delayed.
pub fn failed_event(class: &str, e: ProvisionError) -> FailedEvent {
    let e = e.context(&format!(
        "failed to provision volume with StorageClass {}",
        crate::secrets::go_quote(class)
    ));
    let event = if e.infeasible {
        format!(
            "Volume provisioning failed with infeasible error. Retries will be delayed. {}",
            e.message
        )
    } else {
        e.message.clone()
    };
    FailedEvent {
        event,
        log: e.message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inflight::Phase;
    use crate::record::Template;
    use crate::request::tests::{claim_with, class};
    use crate::topology::tests::{Cluster, DRIVER};
    use k8s_openapi::api::core::v1::TypedLocalObjectReference;
    use kube::ResourceExt;
    use plugreg_proto::csi::v1::{Volume as CsiVolume, VolumeContentSource};
    use std::sync::Arc;
    use tonic::Code;

    const UID: &str = "5f1e3b7c-9a2d-4e8f-b6c1-0d2e3f4a5b6c";
    const NAME: &str = "pvc-5f1e3b7c-9a2d-4e8f-b6c1-0d2e3f4a5b6c";
    const GIB: i64 = 1 << 30;

    /// The fixtures a [`Claim`] borrows.
    struct Fixture {
        claim: PersistentVolumeClaim,
        class: StorageClass,
        options: RequestOptions,
        record: Option<Volume>,
    }

    impl Fixture {
        fn new() -> Self {
            Fixture {
                claim: claim_with(UID),
                class: class(),
                options: RequestOptions {
                    modify_volume: true,
                    ..RequestOptions::default()
                },
                record: None,
            }
        }
        fn claim(mut self, edit: impl FnOnce(&mut PersistentVolumeClaim)) -> Self {
            edit(&mut self.claim);
            self
        }
        fn options(mut self, edit: impl FnOnce(&mut RequestOptions)) -> Self {
            edit(&mut self.options);
            self
        }
        /// The claim's volume recorded with the request prepared now, in `phase`.
        fn recorded(mut self, phase: Phase) -> Self {
            let ready = start(&self.view(), Ok(()), &Cluster::default()).unwrap();
            let entry = Entry::new(&self.claim, &ready.prepared.request, None);
            self.record = Some(Volume { entry, phase });
            self
        }
        /// The claim's volume recorded with a request that does not decode.
        fn recorded_garbled(mut self) -> Self {
            let entry = Entry {
                volume: NAME.into(),
                namespace: "apps".into(),
                claim: "data".into(),
                uid: UID.into(),
                template: Arc::new(Template {
                    request: vec![0xff; 3],
                    secret: None,
                }),
            };
            self.record = Some(Volume {
                entry,
                phase: ambiguous(),
            });
            self
        }
        fn view(&self) -> Claim<'_> {
            Claim {
                claim: &self.claim,
                class: &self.class,
                driver: DRIVER,
                identity: "id-1",
                options: &self.options,
                volume: NAME,
                record: self.record.as_ref(),
            }
        }
        fn start(&self) -> Result<Ready, Failed> {
            start(&self.view(), Ok(()), &Cluster::default())
        }
        fn ready(&self) -> Ready {
            self.start().unwrap()
        }
    }

    fn ambiguous() -> Phase {
        Phase::Recorded { ambiguous: true }
    }

    fn fresh() -> Phase {
        Phase::Recorded { ambiguous: false }
    }

    fn selected(c: &mut PersistentVolumeClaim, node: &str) {
        c.annotations_mut()
            .insert(request::ANN_SELECTED_NODE.into(), node.into());
    }

    fn topology(o: &mut RequestOptions) {
        o.topology = true;
    }

    fn snapshots(o: &mut RequestOptions) {
        o.create_delete_snapshot = true;
    }

    fn restore(c: &mut PersistentVolumeClaim) {
        c.spec.as_mut().unwrap().data_source = Some(TypedLocalObjectReference {
            api_group: Some(request::SNAPSHOT_GROUP.into()),
            kind: "VolumeSnapshot".into(),
            name: "snap".into(),
        });
    }

    fn reported(record: RecordStep, reschedule: bool, e: ProvisionError) -> Failed {
        Failed {
            record,
            reschedule,
            failure: Failure::Error(e),
        }
    }

    #[test]
    fn takes() {
        let mut immediate = class();
        immediate.volume_binding_mode = Some("Immediate".into());
        let here = ThisNode {
            name: "n1",
            immediate_binding: true,
        };
        let on = |n: &str| {
            let mut c = claim_with(UID);
            selected(&mut c, n);
            c
        };
        let unscheduled = claim_with(UID);
        let cases = [
            (
                "no node deployment",
                &unscheduled,
                false,
                None,
                Take::Provision,
            ),
            (
                "selected for this node",
                &on("n1"),
                false,
                Some(here),
                Take::Provision,
            ),
            (
                "selected for another node",
                &on("n2"),
                false,
                Some(here),
                Take::Skip,
            ),
            (
                "recorded: this node's",
                &on("n2"),
                true,
                Some(here),
                Take::Provision,
            ),
            (
                "immediate, no node",
                &unscheduled,
                false,
                Some(here),
                Take::TryOwner,
            ),
        ];
        for (what, claim, recorded, node, want) in cases {
            assert_eq!(take(claim, &immediate, recorded, node), want, "{what}");
        }
        assert_eq!(
            owner_failed("apps/data", "PVC was replaced").message,
            "node check failed: PVC apps/data: PVC was replaced"
        );
    }

    #[test]
    fn starts() {
        let no_caps = ProvisionError::final_("no CREATE_DELETE_VOLUME");
        let f = Fixture::new();
        assert_eq!(
            start(&f.view(), Err(no_caps.clone()), &Cluster::default()),
            Err(Failed::report(no_caps)),
            "a driver that cannot provision"
        );

        let r = f.ready();
        assert_eq!(
            (r.repeat, r.read_source, r.migrated, r.reschedule_possible),
            (false, true, false, false),
            "a new claim"
        );
        assert_eq!((r.source, r.attributes_class), (DataSource::None, None));

        let vac = |c: &mut PersistentVolumeClaim| {
            c.spec.as_mut().unwrap().volume_attributes_class_name = Some("gold".into());
        };
        let f = Fixture::new().claim(vac);
        assert_eq!(f.ready().attributes_class.as_deref(), Some("gold"));
        let f = Fixture::new().claim(vac).recorded(ambiguous());
        let r = f.ready();
        assert_eq!(
            (r.repeat, r.read_source, r.attributes_class),
            (true, false, None),
            "a repeated request keeps its attributes and source"
        );
        let f = Fixture::new().claim(vac).recorded(fresh());
        assert!(!f.ready().repeat, "recorded, never sent");

        let f = Fixture::new().claim(restore).options(snapshots);
        let r = f.ready();
        assert_eq!(
            r.source,
            DataSource::Snapshot {
                name: "snap".into(),
                namespace: "apps".into()
            }
        );

        let f = Fixture::new()
            .claim(|c| selected(c, "n1"))
            .options(topology);
        let with_node = Cluster::default().with_node("n1", &[("zone", "z1")], &["zone"]);
        let r = start(&f.view(), Ok(()), &with_node).unwrap();
        assert!(r.reschedule_possible, "topology and a selected node");
        assert!(
            !Fixture::new()
                .claim(|c| selected(c, "n1"))
                .ready()
                .reschedule_possible,
            "no topology"
        );
    }

    /// A missing CSINode of the selected node reschedules the claim; a volume recorded but
    /// never sent goes with it, one that may exist stays.
    #[test]
    fn a_selected_node_without_its_csinode_reschedules() {
        let gone = |c: &mut PersistentVolumeClaim| selected(c, "gone");
        for (what, phase, record) in [
            ("not recorded", None, RecordStep::Keep),
            ("recorded, never sent", Some(fresh()), RecordStep::Drop),
            ("may exist", Some(ambiguous()), RecordStep::Keep),
        ] {
            let mut f = Fixture::new().claim(gone).options(topology);
            if let Some(phase) = phase {
                // Recorded while the node had its CSINode.
                let with_node = Cluster::default().with_node("gone", &[("zone", "z1")], &["zone"]);
                let ready = start(&f.view(), Ok(()), &with_node).unwrap();
                let entry = Entry::new(&f.claim, &ready.prepared.request, None);
                f.record = Some(Volume { entry, phase });
            }
            let failed = f.start().unwrap_err();
            assert_eq!((failed.record, failed.reschedule), (record, true), "{what}");
            assert!(
                matches!(&failed.failure, Failure::Error(e) if e.state == State::Reschedule),
                "{what}"
            );
        }
        // Another failure of the request keeps everything (a restore without
        // CREATE_DELETE_SNAPSHOT).
        let f = Fixture::new().claim(restore);
        let failed = f.start().unwrap_err();
        assert_eq!(
            (failed.record, failed.reschedule),
            (RecordStep::Keep, false)
        );
    }

    #[test]
    fn sends() {
        // New: prepared now, recorded first.
        let f = Fixture::new();
        let ready = f.ready();
        let s = send(&f.view(), &ready).unwrap();
        assert_eq!(s.request, ready.prepared.request);
        assert_eq!(
            s.record,
            Some(Entry::new(&f.claim, &ready.prepared.request, None))
        );

        // Recorded with the same request, never sent: not written again.
        let f = Fixture::new().recorded(fresh());
        let ready = f.ready();
        assert_eq!(send(&f.view(), &ready).unwrap().record, None);

        // Recorded, never sent, and the claim changed the request: recorded anew.
        let mut f = Fixture::new().recorded(fresh());
        f.claim.spec.as_mut().unwrap().access_modes = Some(vec!["ReadWriteMany".into()]);
        let ready = f.ready();
        let s = send(&f.view(), &ready).unwrap();
        assert_eq!(s.request, ready.prepared.request);
        assert!(s.record.is_some(), "recorded anew");

        // May exist: the recorded request is repeated as it was, and not written again.
        let mut f = Fixture::new().recorded(ambiguous());
        let recorded = f.record.as_ref().unwrap().entry.request().unwrap();
        f.claim.spec.as_mut().unwrap().access_modes = Some(vec!["ReadWriteMany".into()]);
        let ready = f.ready();
        let s = send(&f.view(), &ready).unwrap();
        assert_eq!((s.request, s.record), (recorded, None));

        // A recorded request that does not decode.
        let f = Fixture::new().recorded_garbled();
        let ready = f.ready();
        let failed = send(&f.view(), &ready).unwrap_err();
        assert_eq!(failed.record, RecordStep::Keep);
        assert!(
            matches!(&failed.failure, Failure::Error(e) if e.state == State::NoChange),
            "{failed:?}"
        );
    }

    #[test]
    fn create_volume_answers() {
        let new = Fixture::new().ready();
        let repeat = Fixture::new().recorded(ambiguous()).ready();
        let mut reschedulable = new.clone();
        reschedulable.reschedule_possible = true;
        use RecordStep::*;
        let cases = [
            (
                "timeout: may exist",
                &new,
                Code::DeadlineExceeded,
                MarkAmbiguous,
                false,
            ),
            ("a definite no", &new, Code::Internal, Drop, false),
            (
                "a definite no, repeated",
                &repeat,
                Code::Internal,
                Keep,
                false,
            ),
            (
                "no room, no reschedule",
                &new,
                Code::ResourceExhausted,
                Drop,
                false,
            ),
            (
                "no room on the node",
                &reschedulable,
                Code::ResourceExhausted,
                Drop,
                true,
            ),
            (
                "timeout of a repeat",
                &repeat,
                Code::Unavailable,
                MarkAmbiguous,
                false,
            ),
        ];
        for (what, ready, code, record, reschedule) in cases {
            let status = tonic::Status::new(code, "no");
            let failed = created(ready, Err(status.clone())).unwrap_err();
            let e = ProvisionError::from_create_volume(&status, ready.reschedule_possible);
            assert_eq!(failed, reported(record, reschedule, e), "{what}");
        }
        let ok = CreateVolumeResponse::default();
        assert_eq!(created(&new, Ok(ok.clone())), Ok(ok));
        let invalid = created(&new, Err(tonic::Status::invalid_argument("bad"))).unwrap_err();
        assert!(matches!(invalid.failure, Failure::Error(e) if e.infeasible));
    }

    fn response(id: &str, bytes: i64) -> CreateVolumeResponse {
        CreateVolumeResponse {
            volume: Some(CsiVolume {
                volume_id: id.into(),
                capacity_bytes: bytes,
                ..Default::default()
            }),
        }
    }

    #[test]
    fn builds() {
        let f = Fixture::new();
        let ready = f.ready();
        match built(&f.view(), &ready, &response("vol-1", GIB)) {
            Built::Save(pv) => assert_eq!(pv.name_any(), NAME),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            built(&f.view(), &ready, &response("vol-1", GIB / 2)),
            Built::Cleanup {
                id: "vol-1".into(),
                message: format!(
                    "created volume capacity {} less than requested capacity {GIB}",
                    GIB / 2
                ),
                warning: None,
            }
        );
        assert_eq!(
            built(&f.view(), &ready, &response("", GIB)),
            Built::Fail(reported(
                RecordStep::MarkAmbiguous,
                false,
                ProvisionError::final_("CreateVolume returned no volume id")
            ))
        );
        // A restore answered without its content source.
        let f = Fixture::new().claim(restore).options(snapshots);
        let mut ready = f.ready();
        ready.prepared.request.volume_content_source = Some(VolumeContentSource::default());
        assert_eq!(
            built(&f.view(), &ready, &response("vol-1", GIB)),
            Built::Cleanup {
                id: "vol-1".into(),
                message: "volume content source missing".into(),
                warning: None,
            }
        );
    }

    /// CSI migration: the PV is saved in its in-tree form; one that does not translate back
    /// is deleted again, with a warning.
    #[test]
    fn a_migrated_claims_pv_is_saved_in_tree() {
        const GCE: &str = "pd.csi.storage.gke.io";
        let mut f = Fixture::new();
        f.class = StorageClass {
            provisioner: "kubernetes.io/gce-pd".into(),
            ..class()
        };
        f.claim
            .annotations_mut()
            .insert(request::ANN_STORAGE_PROVISIONER.into(), GCE.into());
        let c = Claim {
            driver: GCE,
            ..f.view()
        };
        let ready = start(&c, Ok(()), &Cluster::default()).unwrap();
        assert!(ready.migrated);
        let handle = "projects/p/zones/z1/disks/d1";
        match built(&c, &ready, &response(handle, GIB)) {
            Built::Save(pv) => {
                let spec = pv.spec.unwrap();
                assert_eq!(
                    (spec.csi, spec.gce_persistent_disk.unwrap().pd_name),
                    (None, "d1".into())
                );
            }
            other => panic!("{other:?}"),
        }
        match built(&c, &ready, &response("not-a-gce-handle", GIB)) {
            Built::Cleanup {
                id,
                message,
                warning,
            } => {
                assert_eq!(id, "not-a-gce-handle");
                assert_eq!(
                    warning,
                    Some(format!(
                        "failed to translate CSI PV to in-tree due to: {message}. Deleting provisioned PV"
                    ))
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn cleanups() {
        let background = |m: &str| ProvisionError::new(State::Background, m);
        let too_small = "created volume capacity 1 less than requested capacity 2";
        let missing = "volume content source missing";
        let refused = tonic::Status::internal("busy");
        let cases = [
            (
                "deleted",
                too_small,
                Ok(()),
                RecordStep::Drop,
                too_small.to_owned(),
            ),
            (
                "left",
                too_small,
                Err(refused.clone()),
                RecordStep::MarkAmbiguous,
                format!(
                    "{too_small}. Cleanup of volume {NAME} failed, volume is orphaned: rpc error: code = Internal desc = busy"
                ),
            ),
            (
                "left, upstream's other case",
                missing,
                Err(refused),
                RecordStep::MarkAmbiguous,
                format!(
                    "{missing}. cleanup of volume {NAME} failed, volume is orphaned: rpc error: code = Internal desc = busy"
                ),
            ),
        ];
        for (what, message, deleted, record, want) in cases {
            assert_eq!(
                cleaned_up(NAME, message.into(), deleted),
                reported(record, false, background(&want)),
                "{what}"
            );
        }
    }

    #[test]
    fn saves() {
        let err = |code: Option<u16>| ApiError {
            code,
            text: "boom".into(),
            message: "go".into(),
        };
        assert_eq!(saved(NAME, Ok(())), Saved::Created);
        assert_eq!(saved(NAME, Err(err(Some(409)))), Saved::Existed);
        for code in [Some(500), Some(403), None] {
            assert_eq!(
                saved(NAME, Err(err(code))),
                Saved::Failed {
                    warning: "Failed to save volume: boom".into(),
                    failed: reported(
                        RecordStep::MarkAmbiguous,
                        false,
                        ProvisionError::new(
                            State::Background,
                            format!("failed to save persistentvolume {NAME}: boom")
                        )
                    ),
                },
                "{code:?}"
            );
        }
    }

    fn api(code: Option<u16>) -> ApiError {
        ApiError {
            code,
            text: "text".into(),
            message: "message".into(),
        }
    }

    #[test]
    fn a_clones_source_claim_that_cannot_be_read() {
        assert_eq!(
            source_claim_unreadable("src", "apps", &api(Some(404))),
            "error getting PVC src (namespace \"apps\") from api server: persistentvolumeclaim \"src\" not found"
        );
        for code in [Some(500), None] {
            assert_eq!(
                source_claim_unreadable("src", "apps", &api(code)),
                "error getting PVC src (namespace \"apps\") from api server: message"
            );
        }
    }

    #[test]
    fn source_protection_answers() {
        let no_change = |m: &str| Err(Failure::Error(ProvisionError::no_change(m)));
        assert_eq!(clone_protected(Ok(())), Ok(()));
        assert_eq!(clone_protected(Err(api(Some(403)))), no_change("message"));
        assert_eq!(clone_protected(Err(api(None))), no_change("message"));
        let refused = |m: &str| Err(Failure::Error(ProvisionError::no_change(m)));
        let failed = format!(
            "failed to add finalizer {} to snapshot apps/snap: message",
            source::SNAPSHOT_FINALIZER
        );
        let cases = [
            ("protected", Ok(()), Ok(None)),
            (
                "not allowed: tolerated",
                Err(api(Some(403))),
                Ok(Some(
                    "not allowed to add the volumesnapshot-as-source-protection finalizer: message"
                        .to_owned(),
                )),
            ),
            ("gone", Err(api(Some(404))), refused(&failed)),
            ("no answer", Err(api(None)), refused(&failed)),
        ];
        for (what, answer, want) in cases {
            assert_eq!(snapshot_protected("apps", "snap", answer), want, "{what}");
        }
    }

    #[test]
    fn snapshot_release_answers() {
        let warned = Some("Failed to remove snapshot finalizer from apps/snap: message".to_owned());
        let cases = [
            ("released", Ok(()), None),
            ("not allowed", Err(api(Some(403))), None),
            ("gone", Err(api(Some(404))), None),
            ("conflict", Err(api(Some(409))), warned.clone()),
            ("no answer", Err(api(None)), warned),
        ];
        for (what, answer, want) in cases {
            assert_eq!(snapshot_released("apps", "snap", answer), want, "{what}");
        }
    }

    #[test]
    fn only_a_data_source_snapshot_is_released() {
        assert_eq!(snapshot_to_release(&claim_with(UID)), None);
        let mut c = claim_with(UID);
        restore(&mut c);
        assert_eq!(snapshot_to_release(&c), Some("snap"));
        let mut c = claim_with(UID);
        c.spec.as_mut().unwrap().data_source = Some(TypedLocalObjectReference {
            api_group: None,
            kind: "PersistentVolumeClaim".into(),
            name: "src".into(),
        });
        assert_eq!(snapshot_to_release(&c), None);
    }

    #[test]
    fn finishes() {
        let mut infeasible = ProvisionError::final_("bad");
        infeasible.infeasible = true;
        let cases = [
            ("succeeded", Ok(()), true, false),
            ("silent", Err(Failure::Silent("busy".into())), false, false),
            (
                "failed",
                Err(Failure::Error(ProvisionError::final_("no"))),
                true,
                false,
            ),
            ("infeasible", Err(Failure::Error(infeasible)), true, true),
        ];
        for (what, result, refresh_capacity, slow) in cases {
            assert_eq!(
                finished(result.clone()),
                Finished {
                    refresh_capacity,
                    slow,
                    result
                },
                "{what}"
            );
        }
    }

    #[test]
    fn failure_events() {
        let plain = failed_event("fast", ProvisionError::final_("no"));
        let wrapped = "failed to provision volume with StorageClass \"fast\": no";
        assert_eq!(
            plain,
            FailedEvent {
                event: wrapped.into(),
                log: wrapped.into()
            }
        );
        let mut e = ProvisionError::final_("no");
        e.infeasible = true;
        assert_eq!(
            failed_event("fast", e),
            FailedEvent {
                event: format!(
                    "Volume provisioning failed with infeasible error. Retries will be delayed. {wrapped}"
                ),
                log: wrapped.into()
            }
        );
    }
}
