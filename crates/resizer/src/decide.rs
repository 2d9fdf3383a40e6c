//! The resizer's decisions, pure: which claim updates start a sync, what size a claim is grown
//! to (with RecoverVolumeExpansionFailure and in the legacy flow), how a driver's error is
//! classified, and what the modify controller does with a claim's VolumeAttributesClass.
//! Everything here is upstream's `pkg/controller` and `pkg/modifycontroller` behaviour as the
//! crate README describes it; the controller acts on the answers.

use tonic::Code;

/// `status.allocatedResourceStatuses["storage"]` values.
pub mod status {
    /// Written before ControllerExpandVolume.
    pub const CONTROLLER_IN_PROGRESS: &str = "ControllerResizeInProgress";
    /// Written after an infeasible error (InvalidArgument, OutOfRange, NotFound).
    pub const CONTROLLER_INFEASIBLE: &str = "ControllerResizeInfeasible";
    /// Written when the kubelet has to finish (NodeExpandVolume).
    pub const NODE_PENDING: &str = "NodeResizePending";
    /// Written by the kubelet.
    pub const NODE_IN_PROGRESS: &str = "NodeResizeInProgress";
    /// Written by the kubelet.
    pub const NODE_INFEASIBLE: &str = "NodeResizeInfeasible";
}

/// What a claim looks like to the resize decisions (sizes in bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimView {
    /// `spec.resources.requests.storage`.
    pub request: Option<i64>,
    /// `status.capacity.storage`.
    pub capacity: Option<i64>,
    /// `status.allocatedResources.storage`.
    pub allocated: Option<i64>,
    /// `status.allocatedResourceStatuses.storage`.
    pub resize_status: Option<String>,
    /// A `FileSystemResizePending=True` condition.
    pub fs_resize_pending: bool,
    /// `status.phase == Bound`.
    pub bound: bool,
    /// `spec.volumeName`.
    pub volume_name: String,
    /// The `volume.kubernetes.io/storage-resizer` annotation.
    pub resizer_annotation: Option<String>,
    /// `metadata.resourceVersion`.
    pub resource_version: String,
}

/// What the update filters keep of a claim's last view, for every claim: the sizes, and 64-bit
/// digests of the strings they only compare for equality (48 bytes and no allocation, where a
/// kept [`ClaimView`] and class name cost about 200 bytes and five allocations). Two different
/// strings share a digest with a chance of 2^-64: a missed update, which the next change or
/// resync brings anyway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    request: Option<i64>,
    capacity: Option<i64>,
    resizer_annotation: u64,
    resource_version: u64,
    resize_status: u64,
    class: u64,
}

fn digest<T: std::hash::Hash + ?Sized>(v: &T) -> u64 {
    use std::hash::{BuildHasher as _, BuildHasherDefault, DefaultHasher};
    BuildHasherDefault::<DefaultHasher>::default().hash_one(v)
}

impl Seen {
    /// What the filters keep of `view` and the claim's `spec.volumeAttributesClassName`.
    pub fn of(view: &ClaimView, class: &str) -> Seen {
        Seen {
            request: view.request,
            capacity: view.capacity,
            resizer_annotation: digest(&view.resizer_annotation),
            resource_version: digest(view.resource_version.as_str()),
            resize_status: digest(&view.resize_status),
            class: digest(class),
        }
    }
}

/// Whether an update of a claim from `old` to `new` starts a resize sync (an add always does).
pub fn resize_update_wanted(old: &Seen, new: &ClaimView, recover: bool) -> bool {
    let grew = |a: Option<i64>, b: Option<i64>| b.unwrap_or(0) > a.unwrap_or(0);
    if recover {
        if old.request != new.request {
            return true;
        }
    } else if grew(old.request, new.request) {
        return true;
    }
    old.resizer_annotation != digest(&new.resizer_annotation)
        || old.resource_version == digest(new.resource_version.as_str())
        || grew(old.capacity, new.capacity)
        || (recover && old.resize_status != digest(&new.resize_status))
}

/// Whether the claim asks for more than it has: bound, with a volume, request above
/// `status.capacity` (absent: 0).
pub fn needs_resize(c: &ClaimView) -> bool {
    c.bound && !c.volume_name.is_empty() && c.request.unwrap_or(0) > c.capacity.unwrap_or(0)
}

/// What the in-memory state of this process knows about a claim.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Memory {
    /// This process saw a final error for the claim (since its last success or uncertain
    /// error).
    pub final_error: bool,
    /// The claim is in the infeasible slow set (tested before this sync adds it).
    pub in_slow_set: bool,
}

/// What a resize sync does (RecoverVolumeExpansionFailure on).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resize {
    /// Nothing to do now (the kubelet's turn, or nothing to grow).
    Stop,
    /// Grow to `target` bytes; `update_status` is false in upstream's "don't update status"
    /// mode (allocated already equals the target: the resize status and the other resize
    /// conditions are left as they are).
    Expand {
        /// The size asked of the driver.
        target: i64,
        /// Whether the resize status is (re)written.
        update_status: bool,
    },
    /// The same infeasible target again within the slow-retry window: requeue after the
    /// remaining slow time.
    DelayRetry,
}

/// The target size (external-resizer's `expand_and_recover.go`): `pv_capacity` is the PV's
/// `spec.capacity.storage`; `controller_expands` is false for the trivial (node-only) resizer.
/// The caller has checked [`needs_resize`].
pub fn resize_target(
    c: &ClaimView,
    pv_capacity: i64,
    memory: Memory,
    controller_expands: bool,
) -> Resize {
    use status::*;
    let request = c.request.unwrap_or(0);
    let allocated_or_request = c.allocated.unwrap_or(request);
    let st = c.resize_status.as_deref();
    let target = if pv_capacity < request {
        match st {
            Some(NODE_INFEASIBLE) => allocated_or_request,
            Some(NODE_PENDING | NODE_IN_PROGRESS) => {
                if pv_capacity >= allocated_or_request {
                    return Resize::Stop;
                }
                allocated_or_request
            }
            Some(CONTROLLER_IN_PROGRESS) => {
                if memory.final_error {
                    request
                } else {
                    allocated_or_request
                }
            }
            _ => request,
        }
    } else {
        match st {
            Some(NODE_PENDING | NODE_IN_PROGRESS) => return Resize::Stop,
            Some(NODE_INFEASIBLE) => match c.allocated {
                Some(a) if controller_expands => a,
                _ => request,
            },
            Some(CONTROLLER_IN_PROGRESS | CONTROLLER_INFEASIBLE) => allocated_or_request,
            _ => match c.allocated {
                Some(a) => a,
                None => {
                    if c.fs_resize_pending {
                        return Resize::Stop;
                    }
                    request
                }
            },
        }
    };
    if c.allocated == Some(target) {
        if memory.in_slow_set {
            return Resize::DelayRetry;
        }
        return Resize::Expand {
            target,
            update_status: false,
        };
    }
    Resize::Expand {
        target,
        update_status: true,
    }
}

/// Whether the pre-RecoverVolumeExpansionFailure warning applies: PV at least the request, no
/// resize status and no allocated size (an API server older than 1.32 drops them).
pub fn old_api_server(c: &ClaimView, pv_capacity: i64) -> bool {
    pv_capacity >= c.request.unwrap_or(0) && c.resize_status.is_none() && c.allocated.is_none()
}

/// The legacy flow (RecoverVolumeExpansionFailure off): skip when the PV already has the
/// request and the kubelet's `FileSystemResizePending` is up; else grow to the request.
pub fn legacy_target(c: &ClaimView, pv_capacity: i64) -> Option<i64> {
    let request = c.request.unwrap_or(0);
    if pv_capacity >= request && c.fs_resize_pending {
        return None;
    }
    Some(request)
}

/// How a failed expansion is classified (`IsFinalError`, `IsInfeasibleError`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The driver may still be working on it (or the error came from this side): nothing is
    /// written, the target stays.
    Uncertain,
    /// Final and infeasible: `ControllerResizeInfeasible`, slow retries.
    Infeasible,
    /// Final: a `ControllerResizeError` condition, the user may lower the request.
    Final,
}

/// The class of a failure with gRPC code `code` (`None`: not a gRPC error).
pub fn classify(code: Option<Code>) -> Failure {
    match code {
        None
        | Some(
            Code::Cancelled
            | Code::DeadlineExceeded
            | Code::Unavailable
            | Code::ResourceExhausted
            | Code::Aborted,
        ) => Failure::Uncertain,
        Some(Code::InvalidArgument | Code::OutOfRange | Code::NotFound) => Failure::Infeasible,
        Some(_) => Failure::Final,
    }
}

/// `status.modifyVolumeStatus.status` values.
pub mod modify_status {
    /// The class does not exist (yet).
    pub const PENDING: &str = "Pending";
    /// ControllerModifyVolume is being called (or was, without a final answer).
    pub const IN_PROGRESS: &str = "InProgress";
    /// The driver refused the parameters (InvalidArgument).
    pub const INFEASIBLE: &str = "Infeasible";
}

/// What a claim looks like to the modify decisions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModifyView {
    /// `spec.volumeAttributesClassName` ("" if unset).
    pub spec: String,
    /// `status.currentVolumeAttributesClassName` ("" if unset).
    pub current: String,
    /// `status.modifyVolumeStatus`: (status, targetVolumeAttributesClassName).
    pub status: Option<(String, String)>,
    /// A `ModifyingVolume` condition exists.
    pub modifying_condition: bool,
}

/// What the modify sync does with the slow set before deciding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlowSet {
    /// Leave it.
    Keep,
    /// Add the claim (its target is infeasible).
    Add,
    /// Remove the claim.
    Remove,
}

/// What the modify controller does with a claim (external-resizer's `modify`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Modify {
    /// Nothing to do.
    Nothing,
    /// The same infeasible target within the slow-retry window: back off.
    SlowSkip,
    /// The user cleared the class before it was applied: drop `ModifyingVolume` (event
    /// `VolumeModifyCanceled` if it existed).
    Cancel,
    /// Keep calling the previous target (`st.target`) without re-marking it.
    Continue(String),
    /// Mark `InProgress` for the new target, then call.
    Start(String),
}

/// The modify decision, and what happens to the slow set first. `uncertain`: this process
/// saw a non-final answer for the claim's current target (or found it `InProgress` at start).
pub fn modify_decision(v: &ModifyView, in_slow_set: bool, uncertain: bool) -> (SlowSet, Modify) {
    use modify_status::*;
    let mut slow = SlowSet::Remove;
    if let Some((st, target)) = &v.status
        && !v.spec.is_empty()
        && *target == v.spec
    {
        if in_slow_set {
            return (SlowSet::Keep, Modify::SlowSkip);
        }
        slow = if st == INFEASIBLE {
            SlowSet::Add
        } else {
            SlowSet::Keep
        };
    }
    let st = v.status.as_ref().map(|(s, _)| s.as_str());
    if st.is_none() && v.spec == v.current {
        return (slow, Modify::Nothing);
    }
    if v.spec.is_empty() && st != Some(IN_PROGRESS) {
        return (slow, Modify::Cancel);
    }
    if let Some((IN_PROGRESS, target)) = v.status.as_ref().map(|(s, t)| (s.as_str(), t))
        && (uncertain || v.spec.is_empty())
    {
        return (slow, Modify::Continue(target.clone()));
    }
    (slow, Modify::Start(v.spec.clone()))
}

/// Whether a gRPC failure of ControllerModifyVolume leaves the target uncertain (the same
/// codes as resizing).
pub fn modify_uncertain(code: Code) -> bool {
    classify(Some(code)) == Failure::Uncertain
}

/// Whether an update of a claim starts a modify sync: the class changed, or there is no
/// modify status; and the claim is bound.
pub fn modify_update_wanted(old: &Seen, new: &ModifyView, bound: bool) -> bool {
    (old.class != digest(new.spec.as_str()) || new.status.is_none()) && bound
}

#[cfg(test)]
mod tests {
    use super::status::*;
    use super::*;

    const GI: i64 = 1 << 30;

    fn claim(request: i64, capacity: i64) -> ClaimView {
        ClaimView {
            request: Some(request),
            capacity: Some(capacity),
            bound: true,
            volume_name: "pv".into(),
            resource_version: "1".into(),
            ..ClaimView::default()
        }
    }

    #[test]
    fn which_updates_start_a_sync() {
        let old = claim(GI, GI);
        let mut new = ClaimView {
            resource_version: "2".into(),
            ..old.clone()
        };
        // A label-only update.
        assert!(!resize_update_wanted(&Seen::of(&old, ""), &new, true));
        // A resync (same resourceVersion).
        assert!(resize_update_wanted(&Seen::of(&old, ""), &old, true));
        new.request = Some(2 * GI);
        assert!(resize_update_wanted(&Seen::of(&old, ""), &new, true));
        assert!(resize_update_wanted(&Seen::of(&old, ""), &new, false));
        // Shrinking counts only with recovery.
        let shrunk = ClaimView {
            request: Some(GI / 2),
            resource_version: "2".into(),
            ..old.clone()
        };
        assert!(resize_update_wanted(&Seen::of(&old, ""), &shrunk, true));
        assert!(!resize_update_wanted(&Seen::of(&old, ""), &shrunk, false));
        let status = ClaimView {
            resize_status: Some(NODE_PENDING.into()),
            resource_version: "2".into(),
            ..old.clone()
        };
        assert!(resize_update_wanted(&Seen::of(&old, ""), &status, true));
        assert!(!resize_update_wanted(&Seen::of(&old, ""), &status, false));
        let annotated = ClaimView {
            resizer_annotation: Some("d".into()),
            resource_version: "2".into(),
            ..old.clone()
        };
        assert!(resize_update_wanted(&Seen::of(&old, ""), &annotated, false));
        let capacity = ClaimView {
            capacity: Some(2 * GI),
            resource_version: "2".into(),
            ..old.clone()
        };
        assert!(resize_update_wanted(&Seen::of(&old, ""), &capacity, false));
    }

    #[test]
    fn needs_resize_wants_a_bound_claim_asking_for_more() {
        assert!(needs_resize(&claim(2 * GI, GI)));
        assert!(!needs_resize(&claim(GI, GI)));
        let mut c = claim(2 * GI, GI);
        c.bound = false;
        assert!(!needs_resize(&c));
        let mut c = claim(2 * GI, GI);
        c.volume_name.clear();
        assert!(!needs_resize(&c));
        let mut c = claim(2 * GI, GI);
        c.capacity = None;
        assert!(needs_resize(&c));
    }

    fn with(status: Option<&str>, allocated: Option<i64>) -> ClaimView {
        ClaimView {
            resize_status: status.map(str::to_owned),
            allocated,
            ..claim(3 * GI, GI)
        }
    }

    fn expand(target: i64, update_status: bool) -> Resize {
        Resize::Expand {
            target,
            update_status,
        }
    }

    #[test]
    fn target_when_the_pv_is_smaller_than_the_request() {
        let m = Memory::default();
        let fin = Memory {
            final_error: true,
            ..m
        };
        let pv = GI;
        let cases: Vec<(ClaimView, Memory, Resize)> = vec![
            (
                with(Some(NODE_INFEASIBLE), Some(2 * GI)),
                m,
                expand(2 * GI, false),
            ),
            (with(Some(NODE_INFEASIBLE), None), m, expand(3 * GI, true)),
            (
                with(Some(NODE_PENDING), Some(2 * GI)),
                m,
                expand(2 * GI, false),
            ),
            (with(Some(NODE_IN_PROGRESS), Some(GI)), m, Resize::Stop),
            (
                with(Some(CONTROLLER_IN_PROGRESS), Some(2 * GI)),
                m,
                expand(2 * GI, false),
            ),
            (
                with(Some(CONTROLLER_IN_PROGRESS), Some(2 * GI)),
                fin,
                expand(3 * GI, true),
            ),
            (with(None, None), m, expand(3 * GI, true)),
            (
                with(Some(CONTROLLER_INFEASIBLE), Some(4 * GI)),
                m,
                expand(3 * GI, true),
            ),
            (
                with(Some(CONTROLLER_INFEASIBLE), Some(3 * GI)),
                m,
                expand(3 * GI, false),
            ),
        ];
        for (c, memory, want) in cases {
            assert_eq!(
                resize_target(&c, pv, memory, true),
                want,
                "{c:?} {memory:?}"
            );
        }
    }

    #[test]
    fn target_when_the_pv_has_the_request() {
        let m = Memory::default();
        let pv = 3 * GI;
        assert_eq!(
            resize_target(&with(Some(NODE_PENDING), Some(3 * GI)), pv, m, true),
            Resize::Stop
        );
        assert_eq!(
            resize_target(&with(Some(NODE_IN_PROGRESS), None), pv, m, true),
            Resize::Stop
        );
        assert_eq!(
            resize_target(&with(Some(NODE_INFEASIBLE), Some(2 * GI)), pv, m, true),
            expand(2 * GI, false)
        );
        // The trivial resizer grows to the request.
        assert_eq!(
            resize_target(&with(Some(NODE_INFEASIBLE), Some(2 * GI)), pv, m, false),
            expand(3 * GI, true)
        );
        assert_eq!(
            resize_target(
                &with(Some(CONTROLLER_INFEASIBLE), Some(2 * GI)),
                pv,
                m,
                true
            ),
            expand(2 * GI, false)
        );
        assert_eq!(
            resize_target(&with(None, Some(2 * GI)), pv, m, true),
            expand(2 * GI, false)
        );
        // An old API server: no allocated, no status.
        let mut old = with(None, None);
        assert!(old_api_server(&old, pv));
        assert_eq!(resize_target(&old, pv, m, true), expand(3 * GI, true));
        old.fs_resize_pending = true;
        assert_eq!(resize_target(&old, pv, m, true), Resize::Stop);
    }

    #[test]
    fn the_slow_set_delays_only_the_same_target() {
        let slow = Memory {
            in_slow_set: true,
            ..Memory::default()
        };
        let c = with(Some(CONTROLLER_INFEASIBLE), Some(3 * GI));
        assert_eq!(resize_target(&c, GI, slow, true), Resize::DelayRetry);
        // The user lowered the request: a new target bypasses it.
        let lowered = ClaimView {
            request: Some(2 * GI),
            ..c
        };
        assert_eq!(
            resize_target(&lowered, GI, slow, true),
            expand(2 * GI, true)
        );
    }

    #[test]
    fn the_legacy_flow_grows_to_the_request() {
        let mut c = claim(2 * GI, GI);
        assert_eq!(legacy_target(&c, GI), Some(2 * GI));
        c.fs_resize_pending = true;
        assert_eq!(legacy_target(&c, 2 * GI), None);
        assert_eq!(legacy_target(&c, GI), Some(2 * GI));
    }

    #[test]
    fn errors_are_classified_as_upstream() {
        use Code::*;
        for c in [
            Cancelled,
            DeadlineExceeded,
            Unavailable,
            ResourceExhausted,
            Aborted,
        ] {
            assert_eq!(classify(Some(c)), Failure::Uncertain, "{c:?}");
        }
        assert_eq!(classify(None), Failure::Uncertain);
        for c in [InvalidArgument, OutOfRange, NotFound] {
            assert_eq!(classify(Some(c)), Failure::Infeasible, "{c:?}");
        }
        for c in [
            Internal,
            Unknown,
            FailedPrecondition,
            Unimplemented,
            AlreadyExists,
        ] {
            assert_eq!(classify(Some(c)), Failure::Final, "{c:?}");
        }
    }

    fn mv(spec: &str, current: &str, status: Option<(&str, &str)>) -> ModifyView {
        ModifyView {
            spec: spec.into(),
            current: current.into(),
            status: status.map(|(s, t)| (s.into(), t.into())),
            modifying_condition: false,
        }
    }

    #[test]
    fn modify_decisions() {
        use modify_status::*;
        let cases: Vec<(ModifyView, bool, bool, (SlowSet, Modify))> = vec![
            (
                mv("a", "a", None),
                false,
                false,
                (SlowSet::Remove, Modify::Nothing),
            ),
            (
                mv("", "", None),
                false,
                false,
                (SlowSet::Remove, Modify::Nothing),
            ),
            (
                mv("b", "a", None),
                false,
                false,
                (SlowSet::Remove, Modify::Start("b".into())),
            ),
            (
                mv("b", "", None),
                false,
                false,
                (SlowSet::Remove, Modify::Start("b".into())),
            ),
            // Infeasible: one more call, then slow.
            (
                mv("b", "a", Some((INFEASIBLE, "b"))),
                false,
                false,
                (SlowSet::Add, Modify::Start("b".into())),
            ),
            (
                mv("b", "a", Some((INFEASIBLE, "b"))),
                true,
                false,
                (SlowSet::Keep, Modify::SlowSkip),
            ),
            // Roll-back to the current class after an infeasible target: called at once.
            (
                mv("a", "a", Some((INFEASIBLE, "b"))),
                false,
                false,
                (SlowSet::Remove, Modify::Start("a".into())),
            ),
            // Uncertain: the old target is pursued whatever the spec says now.
            (
                mv("c", "a", Some((IN_PROGRESS, "b"))),
                false,
                true,
                (SlowSet::Remove, Modify::Continue("b".into())),
            ),
            (
                mv("c", "a", Some((IN_PROGRESS, "b"))),
                false,
                false,
                (SlowSet::Remove, Modify::Start("c".into())),
            ),
            // Cancel: cleared before it was applied.
            (
                mv("", "", Some((INFEASIBLE, "b"))),
                false,
                false,
                (SlowSet::Remove, Modify::Cancel),
            ),
            (
                mv("", "", Some((IN_PROGRESS, "b"))),
                false,
                false,
                (SlowSet::Remove, Modify::Continue("b".into())),
            ),
            (
                mv("b", "", Some((PENDING, "b"))),
                false,
                false,
                (SlowSet::Keep, Modify::Start("b".into())),
            ),
        ];
        for (v, slow, uncertain, want) in cases {
            assert_eq!(
                modify_decision(&v, slow, uncertain),
                want,
                "{v:?} {slow} {uncertain}"
            );
        }
    }

    #[test]
    fn modify_updates() {
        let v = mv("b", "a", Some(("InProgress", "b")));
        let was = |class| Seen::of(&ClaimView::default(), class);
        assert!(modify_update_wanted(&was("a"), &v, true));
        assert!(!modify_update_wanted(&was("b"), &v, true));
        assert!(!modify_update_wanted(&was("a"), &v, false));
        assert!(modify_update_wanted(&was("b"), &mv("b", "b", None), true));
        assert!(modify_uncertain(Code::Unavailable));
        assert!(!modify_uncertain(Code::InvalidArgument));
    }
}
