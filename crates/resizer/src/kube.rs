//! The Kubernetes objects as the resizer reads and writes them: the claim's view for the
//! decisions, the resize and modify conditions, the status patches, and the
//! VolumeAttributesClass of `storage.k8s.io/v1` (the kit's type: newer than the generated types
//! this workspace builds against).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimCondition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use plugreg_sidecar_kit::quantity::parse_bytes;

use crate::decide::{ClaimView, ModifyView};

/// The annotation kube-controller-manager sets on migrated in-tree claims.
pub const ANN_STORAGE_RESIZER: &str = "volume.kubernetes.io/storage-resizer";
/// The annotation that tells newer kubelets to skip NodeExpandVolume.
pub const ANN_NODE_EXPANSION_NOT_REQUIRED: &str =
    "volume.kubernetes.io/node-expansion-not-required";
/// `AnnotateFsResize`: the PVC's capacity before the resize, on the PV.
pub const ANN_PRE_RESIZE_CAPACITY: &str = "volume.alpha.kubernetes.io/pre-resize-capacity";
/// The modify secret's name, on the PV (set by external-provisioner).
pub const ANN_MODIFY_SECRET_NAME: &str = "volume.kubernetes.io/controller-modify-secret-name";
/// The modify secret's namespace, on the PV.
pub const ANN_MODIFY_SECRET_NAMESPACE: &str =
    "volume.kubernetes.io/controller-modify-secret-namespace";

/// Condition `Resizing`.
pub const RESIZING: &str = "Resizing";
/// Condition `FileSystemResizePending`.
pub const FS_RESIZE_PENDING: &str = "FileSystemResizePending";
/// Condition `ControllerResizeError`.
pub const CONTROLLER_RESIZE_ERROR: &str = "ControllerResizeError";
/// Condition `NodeResizeError` (the kubelet's; dropped with the other resize conditions).
pub const NODE_RESIZE_ERROR: &str = "NodeResizeError";
/// Condition `ModifyingVolume`.
pub const MODIFYING_VOLUME: &str = "ModifyingVolume";
/// Condition `ModifyVolumeError`.
pub const MODIFY_VOLUME_ERROR: &str = "ModifyVolumeError";
/// The message of `FileSystemResizePending`.
pub const FS_RESIZE_PENDING_MESSAGE: &str =
    "Waiting for user to (re-)start a pod to finish file system resize of volume on node.";

const RESIZE_CONDITIONS: [&str; 4] = [
    RESIZING,
    FS_RESIZE_PENDING,
    CONTROLLER_RESIZE_ERROR,
    NODE_RESIZE_ERROR,
];

/// `namespace/name`.
pub fn claim_key(c: &PersistentVolumeClaim) -> String {
    format!(
        "{}/{}",
        c.metadata.namespace.as_deref().unwrap_or_default(),
        c.metadata.name.as_deref().unwrap_or_default()
    )
}

fn storage(
    map: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
) -> Option<i64> {
    map?.get("storage").and_then(|q| parse_bytes(&q.0).ok())
}

/// The PV's `spec.capacity.storage` in bytes (absent or unreadable: 0).
pub fn pv_capacity(pv: &PersistentVolume) -> i64 {
    storage(pv.spec.as_ref().and_then(|s| s.capacity.as_ref())).unwrap_or(0)
}

/// The claim as the resize decisions read it.
pub fn claim_view(c: &PersistentVolumeClaim) -> ClaimView {
    let spec = c.spec.as_ref();
    let status = c.status.as_ref();
    ClaimView {
        request: storage(spec.and_then(|s| s.resources.as_ref()?.requests.as_ref())),
        capacity: storage(status.and_then(|s| s.capacity.as_ref())),
        allocated: storage(status.and_then(|s| s.allocated_resources.as_ref())),
        resize_status: status.and_then(|s| {
            s.allocated_resource_statuses
                .as_ref()?
                .get("storage")
                .cloned()
        }),
        fs_resize_pending: has_condition(c, FS_RESIZE_PENDING),
        bound: status.and_then(|s| s.phase.as_deref()) == Some("Bound"),
        volume_name: spec.and_then(|s| s.volume_name.clone()).unwrap_or_default(),
        resizer_annotation: c
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANN_STORAGE_RESIZER).cloned()),
        resource_version: c.metadata.resource_version.clone().unwrap_or_default(),
    }
}

/// The claim as the modify decisions read it.
pub fn modify_view(c: &PersistentVolumeClaim) -> ModifyView {
    let status = c.status.as_ref();
    ModifyView {
        spec: c
            .spec
            .as_ref()
            .and_then(|s| s.volume_attributes_class_name.clone())
            .unwrap_or_default(),
        current: status
            .and_then(|s| s.current_volume_attributes_class_name.clone())
            .unwrap_or_default(),
        status: status
            .and_then(|s| s.modify_volume_status.as_ref())
            .map(|m| {
                (
                    m.status.clone(),
                    m.target_volume_attributes_class_name
                        .clone()
                        .unwrap_or_default(),
                )
            }),
        modifying_condition: has_condition(c, MODIFYING_VOLUME),
    }
}

/// Whether the claim has a condition of `type_` with status `True`.
pub fn has_condition(c: &PersistentVolumeClaim, type_: &str) -> bool {
    conditions(c)
        .iter()
        .any(|x| x.type_ == type_ && x.status == "True")
}

/// The claim's conditions.
pub fn conditions(c: &PersistentVolumeClaim) -> &[PersistentVolumeClaimCondition] {
    c.status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default()
}

/// A `True` condition with a transition time of `now`.
pub fn condition(type_: &str, message: &str, now: &Time) -> PersistentVolumeClaimCondition {
    PersistentVolumeClaimCondition {
        type_: type_.to_owned(),
        status: "True".to_owned(),
        message: (!message.is_empty()).then(|| message.to_owned()),
        last_transition_time: Some(now.clone()),
        ..PersistentVolumeClaimCondition::default()
    }
}

/// external-resizer's `MergeResizeConditionOnPVC`: other conditions stay; an existing resize
/// condition stays if `new` has the same type with the same status (keeping its transition
/// time), is replaced if `new` has the type with another status, and otherwise stays only when
/// `keep_old`; the rest of `new` is appended.
pub fn merge_resize_conditions(
    existing: &[PersistentVolumeClaimCondition],
    new: Vec<PersistentVolumeClaimCondition>,
    keep_old: bool,
) -> Vec<PersistentVolumeClaimCondition> {
    let mut new: Vec<Option<PersistentVolumeClaimCondition>> = new.into_iter().map(Some).collect();
    let mut out = Vec::new();
    for c in existing {
        if !RESIZE_CONDITIONS.contains(&c.type_.as_str()) {
            out.push(c.clone());
            continue;
        }
        match new
            .iter_mut()
            .find(|n| n.as_ref().is_some_and(|n| n.type_ == c.type_))
        {
            Some(slot) => {
                let n = slot.take().expect("found above");
                out.push(if n.status == c.status { c.clone() } else { n });
            }
            None if keep_old => out.push(c.clone()),
            None => {}
        }
    }
    out.extend(new.into_iter().flatten());
    out
}

/// Every condition but the resize ones.
pub fn without_resize_conditions(
    existing: &[PersistentVolumeClaimCondition],
) -> Vec<PersistentVolumeClaimCondition> {
    existing
        .iter()
        .filter(|c| !RESIZE_CONDITIONS.contains(&c.type_.as_str()))
        .cloned()
        .collect()
}

/// The modify controller's condition merge: by type; `lastProbeTime` now, `lastTransitionTime`
/// now when the status or reason changed, else kept; types in `remove` dropped.
pub fn merge_modify_conditions(
    existing: &[PersistentVolumeClaimCondition],
    new: &[PersistentVolumeClaimCondition],
    remove: &[&str],
    now: &Time,
) -> Vec<PersistentVolumeClaimCondition> {
    let mut out: Vec<PersistentVolumeClaimCondition> = existing
        .iter()
        .filter(|c| !remove.contains(&c.type_.as_str()))
        .cloned()
        .collect();
    for n in new {
        let mut n = n.clone();
        n.last_probe_time = Some(now.clone());
        match out.iter_mut().find(|c| c.type_ == n.type_) {
            Some(c) => {
                n.last_transition_time = if c.status == n.status && c.reason == n.reason {
                    c.last_transition_time.clone()
                } else {
                    Some(now.clone())
                };
                *c = n;
            }
            None => {
                n.last_transition_time = Some(now.clone());
                out.push(n);
            }
        }
    }
    out
}

/// A VolumeAttributesClass of `storage.k8s.io/v1` (the kit's: the provisioner reads it too).
pub use plugreg_sidecar_kit::vac::VolumeAttributesClass;

#[cfg(test)]
mod tests {
    use super::*;

    fn cond(type_: &str, status: &str, t: i64) -> PersistentVolumeClaimCondition {
        PersistentVolumeClaimCondition {
            type_: type_.into(),
            status: status.into(),
            last_transition_time: Some(Time(k8s_openapi::jiff::Timestamp::from_second(t).unwrap())),
            ..Default::default()
        }
    }

    #[test]
    fn resize_conditions_merge_as_upstream() {
        let existing = vec![
            cond("Other", "True", 1),
            cond(RESIZING, "True", 2),
            cond(CONTROLLER_RESIZE_ERROR, "True", 3),
        ];
        // Resizing again: the old Resizing keeps its time, the error goes.
        let merged = merge_resize_conditions(&existing, vec![cond(RESIZING, "True", 9)], false);
        assert_eq!(
            merged,
            vec![cond("Other", "True", 1), cond(RESIZING, "True", 2)]
        );
        // Keeping old ones: the pending condition is added after them.
        let merged =
            merge_resize_conditions(&existing, vec![cond(FS_RESIZE_PENDING, "True", 9)], true);
        assert_eq!(merged.len(), 4);
        assert_eq!(merged[3].type_, FS_RESIZE_PENDING);
        assert_eq!(
            without_resize_conditions(&existing),
            vec![cond("Other", "True", 1)]
        );
    }

    #[test]
    fn modify_conditions_keep_the_transition_time_when_nothing_changed() {
        let now = Time(k8s_openapi::jiff::Timestamp::from_second(100).unwrap());
        let existing = vec![
            cond(MODIFYING_VOLUME, "True", 1),
            cond(MODIFY_VOLUME_ERROR, "True", 1),
        ];
        let merged = merge_modify_conditions(
            &existing,
            &[cond(MODIFYING_VOLUME, "True", 5)],
            &[MODIFY_VOLUME_ERROR],
            &now,
        );
        assert_eq!(merged.len(), 1);
        assert_eq!(
            merged[0].last_transition_time,
            existing[0].last_transition_time
        );
        assert_eq!(merged[0].last_probe_time, Some(now));
    }
}
