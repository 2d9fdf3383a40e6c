//! Restore and clone: the checks that turn a claim's data source (a VolumeSnapshot, or another
//! claim) into CreateVolume's `volume_content_source`, in external-provisioner v6.3.0's order and
//! with its texts. Pure: the controller reads the objects (live, as upstream) and passes them in.
//!
//! Each check returns upstream's inner message; the controller wraps it as upstream does
//! (`error getting handle for DataSource Type <Kind> by Name <name>: ...`) into a no-change
//! error, so the claim is retried with back-off after a `ProvisioningFailed` event.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use plugreg_proto::csi::v1::{VolumeContentSource, volume_content_source};
use plugreg_sidecar_kit::snapshot::{
    ANN_ALLOW_VOLUME_MODE_CHANGE, FINALIZER_PROVISIONER_SNAPSHOT_SOURCE, VolumeSnapshot,
    VolumeSnapshotContent,
};
use tracing::{debug, warn};

use crate::quantity;
use crate::request;

/// The finalizer csi-provisioner keeps on a VolumeSnapshot while it restores from it.
pub const SNAPSHOT_FINALIZER: &str = FINALIZER_PROVISIONER_SNAPSHOT_SOURCE;
/// The finalizer csi-provisioner puts on a claim before cloning it.
pub const CLONE_FINALIZER: &str = plugreg_sidecar_kit::snapshot::FINALIZER_PROVISIONER_CLONING;

fn has_finalizer(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    f: &str,
) -> bool {
    meta.finalizers.iter().flatten().any(|x| x == f)
}

/// The restore checks on the VolumeSnapshot alone: not being deleted (unless a restore from it
/// already started, which the provisioner's finalizer shows), and bound. Returns its content's
/// name.
pub fn snapshot_content_name(vs: &VolumeSnapshot) -> Result<String, String> {
    let name = vs.metadata.name.as_deref().unwrap_or_default();
    if vs.metadata.deletion_timestamp.is_some() {
        if !has_finalizer(&vs.metadata, SNAPSHOT_FINALIZER) {
            return Err(format!("snapshot {name} is being deleted"));
        }
        debug!(
            snapshot = %format!("{}/{name}", vs.metadata.namespace.as_deref().unwrap_or_default()),
            "snapshot is being deleted but has the volumesnapshot-as-source-protection finalizer, allowing provisioning to continue"
        );
    }
    vs.status
        .as_ref()
        .and_then(|s| s.bound_volume_snapshot_content_name.clone())
        .ok_or_else(|| not_bound(name))
}

/// Upstream's answer to a snapshot whose content is missing, of another snapshot or of another
/// driver (the reason goes to the log only).
pub fn not_bound(snapshot: &str) -> String {
    format!("snapshot {snapshot} not bound")
}

/// Go's `strconv.ParseBool`.
fn parse_go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        other => Err(format!(
            "strconv.ParseBool: parsing {}: invalid syntax",
            crate::secrets::go_quote(other)
        )),
    }
}

/// The restore checks on the content and the claim, in upstream's order, after
/// [`snapshot_content_name`]: the content belongs to the snapshot and to the class's driver,
/// the snapshot is ready, the content has a handle, the claim asks for at least the
/// snapshot's restore size, and (with `prevent_conversion`) the volume mode changes only where
/// the content allows it. Returns the content source naming the content's snapshot handle.
pub fn restore_source(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    vs: &VolumeSnapshot,
    vsc: &VolumeSnapshotContent,
    prevent_conversion: bool,
) -> Result<VolumeContentSource, String> {
    let vs_name = vs.metadata.name.as_deref().unwrap_or_default();
    let vs_ns = vs.metadata.namespace.as_deref().unwrap_or_default();
    let vsc_name = vsc.metadata.name.as_deref().unwrap_or_default();
    let r = &vsc.spec.volume_snapshot_ref;
    if r.uid != vs.metadata.uid
        || r.namespace.as_deref().unwrap_or_default() != vs_ns
        || r.name.as_deref().unwrap_or_default() != vs_name
    {
        warn!(
            "snapshotcontent {vsc_name} for snapshot {vs_ns}/{vs_name} is bound to a different snapshot"
        );
        return Err(not_bound(vs_name));
    }
    if vsc.spec.driver != class.provisioner {
        warn!(
            "snapshotcontent {vsc_name} for snapshot {vs_ns}/{vs_name} is handled by a different CSI driver than requested by StorageClass {}",
            class.metadata.name.as_deref().unwrap_or_default()
        );
        return Err(not_bound(vs_name));
    }
    if vs.status.as_ref().and_then(|s| s.ready_to_use) != Some(true) {
        return Err(format!("snapshot {vs_name} is not Ready"));
    }
    let Some(handle) = vsc.status.as_ref().and_then(|s| s.snapshot_handle.clone()) else {
        return Err(format!("snapshot handle {vs_name} is not available"));
    };
    let claim_name = claim.metadata.name.as_deref().unwrap_or_default();
    let claim_ns = claim.metadata.namespace.as_deref().unwrap_or_default();
    if let Some(size) = vs.status.as_ref().and_then(|s| s.restore_size.as_ref()) {
        let request = claim
            .spec
            .as_ref()
            .and_then(|s| s.resources.as_ref())
            .and_then(|r| r.requests.as_ref())
            .and_then(|r| r.get("storage"));
        let Some(request) = request else {
            return Err(format!(
                "error getting capacity for PVC {claim_name} when creating snapshot {vs_name}"
            ));
        };
        // Both were validated by the API server; a corrupt one counts as 0, as Go's Value().
        let requested = quantity::parse_bytes(&request.0).unwrap_or_default();
        let size = quantity::parse_bytes(&size.0).unwrap_or_default();
        if requested < size {
            return Err(format!(
                "requested volume size {requested} is less than the size {size} for the source snapshot {vs_name}"
            ));
        }
        if requested > size {
            warn!(
                "requested volume size {requested} is greater than the size {size} for the source snapshot {vs_name}. Volume plugin needs to handle volume expansion."
            );
        }
    }
    let claim_mode = claim.spec.as_ref().and_then(|s| s.volume_mode.as_deref());
    if prevent_conversion
        && let (Some(source_mode), Some(claim_mode)) =
            (vsc.spec.source_volume_mode.as_deref(), claim_mode)
        && source_mode != claim_mode
    {
        let who = format!(
            "requested volume {claim_ns}/{claim_name} modifies the mode of the source volume but does not have permission to do so."
        );
        let allow = vsc
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANN_ALLOW_VOLUME_MODE_CHANGE));
        let Some(allow) = allow else {
            return Err(format!(
                "{who} {ANN_ALLOW_VOLUME_MODE_CHANGE} annotation is not present on snapshotcontent {vsc_name}"
            ));
        };
        match parse_go_bool(allow) {
            Ok(true) => {}
            Ok(false) => {
                return Err(format!(
                    "{who} {ANN_ALLOW_VOLUME_MODE_CHANGE} is set to false on snapshotcontent {vsc_name}"
                ));
            }
            Err(e) => {
                return Err(format!(
                    "{who} failed to convert {ANN_ALLOW_VOLUME_MODE_CHANGE} annotation value to boolean with error: {e}"
                ));
            }
        }
    }
    Ok(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Snapshot(
            volume_content_source::SnapshotSource {
                snapshot_id: handle,
            },
        )),
    })
}

/// Go's `%v` of a claim's status (upstream prints the struct in the not-Bound error): the
/// phase, access modes and capacity, and the remaining fields as Go prints them when empty
/// (exact for the usual Pending source; conditions and allocated resources are not spelled out).
fn go_claim_status(claim: &PersistentVolumeClaim) -> String {
    let s = claim.status.clone().unwrap_or_default();
    let modes = s.access_modes.unwrap_or_default().join(" ");
    let capacity = s
        .capacity
        .unwrap_or_default()
        .iter()
        .map(|(k, v)| format!("{k}:{}", v.0))
        .collect::<Vec<_>>()
        .join(" ");
    // Go prints a pointer's address here; the name is more use to a reader.
    let class = s
        .current_volume_attributes_class_name
        .unwrap_or_else(|| "<nil>".to_owned());
    format!(
        "{{{} [{modes}] map[{capacity}] [] map[] map[] {class} <nil>}}",
        s.phase.unwrap_or_default()
    )
}

/// The clone checks on the source claim (read in the data source's namespace), in upstream's
/// order: Bound, not being deleted, both classes named, the new request at least the source's
/// request (not its capacity), a volume bound. Returns the source's volume name.
pub fn clone_claim_checks(
    claim: &PersistentVolumeClaim,
    source: &PersistentVolumeClaim,
) -> Result<String, String> {
    let src = source.metadata.name.as_deref().unwrap_or_default();
    let phase = source.status.as_ref().and_then(|s| s.phase.as_deref());
    if phase != Some("Bound") {
        return Err(format!(
            "the PVC DataSource {src} must have a status of Bound.  Got {}",
            go_claim_status(source)
        ));
    }
    if source.metadata.deletion_timestamp.is_some() {
        return Err(format!(
            "the PVC DataSource {src} is currently being deleted"
        ));
    }
    let source_spec = source.spec.clone().unwrap_or_default();
    let spec = claim.spec.clone().unwrap_or_default();
    if source_spec.storage_class_name.is_none() {
        return Err(format!(
            "the source PVC ({src}) storageclass cannot be empty"
        ));
    }
    if spec.storage_class_name.is_none() {
        return Err(format!(
            "the requested PVC ({}) storageclass cannot be empty",
            claim.metadata.name.as_deref().unwrap_or_default()
        ));
    }
    let requested = request::requested_bytes(claim).unwrap_or_default();
    let source_requested = request::requested_bytes(source).unwrap_or_default();
    if requested < source_requested {
        return Err(format!(
            "error, new PVC request must be greater than or equal in size to the specified PVC data source, requested {requested} but source is {source_requested}"
        ));
    }
    match source_spec.volume_name.filter(|v| !v.is_empty()) {
        Some(v) => Ok(v),
        None => Err(format!("volume name is empty in source PVC {src}")),
    }
}

/// Upstream's one answer to a source volume that is missing, not CSI, of another driver, or
/// not bound to the source claim (the reason goes to the log only).
pub const CLAIM_NOT_BOUND: &str = "claim in dataSource not bound or invalid";

/// The clone checks on the source's PersistentVolume (`None`: it could not be read): a CSI
/// volume of the class's driver, bound to the source claim, of the claim's volume mode.
/// Returns the content source naming the source volume's handle.
pub fn clone_source(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    source: &PersistentVolumeClaim,
    pv: Option<&PersistentVolume>,
) -> Result<VolumeContentSource, String> {
    let src = format!(
        "{}/{}",
        source.metadata.namespace.as_deref().unwrap_or_default(),
        source.metadata.name.as_deref().unwrap_or_default()
    );
    let Some(pv) = pv else {
        return Err(CLAIM_NOT_BOUND.into());
    };
    let pv_name = pv.metadata.name.as_deref().unwrap_or_default();
    let spec = pv.spec.clone().unwrap_or_default();
    let Some(csi) = spec.csi.as_ref() else {
        warn!("error getting volume source from {pv_name} for PVC {src}");
        return Err(CLAIM_NOT_BOUND.into());
    };
    if csi.driver != class.provisioner {
        warn!(
            "the source volume {pv_name} for PVC {src} is handled by a different CSI driver than requested by StorageClass {}",
            request::claim_class(claim)
        );
        return Err(CLAIM_NOT_BOUND.into());
    }
    let Some(r) = spec.claim_ref.as_ref() else {
        warn!("the source volume {pv_name} for PVC {src} is not bound");
        return Err(CLAIM_NOT_BOUND.into());
    };
    if r.uid != source.metadata.uid
        || r.namespace != source.metadata.namespace
        || r.name != source.metadata.name
    {
        warn!(
            "the source volume {pv_name} for PVC {src} is bound to a different PVC than requested"
        );
        return Err(CLAIM_NOT_BOUND.into());
    }
    let phase = pv.status.as_ref().and_then(|s| s.phase.as_deref());
    if phase != Some("Bound") {
        warn!(
            "the source volume {pv_name} for PVC {src} status is \"{}\", should instead be \"Bound\"",
            phase.unwrap_or_default()
        );
        return Err(CLAIM_NOT_BOUND.into());
    }
    let claim_mode = claim.spec.as_ref().and_then(|s| s.volume_mode.as_deref());
    let source_mode = spec.volume_mode.as_deref();
    if matches!(claim_mode, None | Some("Filesystem"))
        && source_mode.is_some_and(|m| m != "Filesystem")
    {
        return Err("the source PVC and destination PVCs must have the same volume mode for cloning.  Source is Block, but new PVC requested Filesystem".into());
    }
    if claim_mode == Some("Block") && source_mode != Some("Block") {
        return Err("the source PVC and destination PVCs must have the same volume mode for cloning.  Source is Filesystem, but new PVC requested Block".into());
    }
    Ok(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Volume(
            volume_content_source::VolumeSource {
                volume_id: csi.volume_handle.clone(),
            },
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::tests::{claim_with, class};
    use k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, ObjectReference, PersistentVolumeClaimStatus,
        PersistentVolumeSpec, PersistentVolumeStatus,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use plugreg_sidecar_kit::snapshot::{VolumeSnapshotContentStatus, VolumeSnapshotStatus};
    use serde_json::json;

    const UID: &str = "5f1e3b7c-9a2d-4e8f-b6c1-0d2e3f4a5b6c";

    fn snapshot() -> VolumeSnapshot {
        serde_json::from_value(json!({
            "metadata": {"name": "snap", "namespace": "apps", "uid": "vs-uid"},
            "spec": {"source": {"volumeSnapshotContentName": "content"}},
            "status": {"boundVolumeSnapshotContentName": "content", "readyToUse": true, "restoreSize": "1Gi"},
        }))
        .unwrap()
    }

    fn content() -> VolumeSnapshotContent {
        serde_json::from_value(json!({
            "metadata": {"name": "content"},
            "spec": {
                "driver": crate::topology::tests::DRIVER, "deletionPolicy": "Delete",
                "source": {"snapshotHandle": "snap-1"},
                "volumeSnapshotRef": {"name": "snap", "namespace": "apps", "uid": "vs-uid"},
                "sourceVolumeMode": "Filesystem",
            },
            "status": {"snapshotHandle": "snap-1", "readyToUse": true},
        }))
        .unwrap()
    }

    fn restore(
        c: &PersistentVolumeClaim,
        vs: &VolumeSnapshot,
        vsc: &VolumeSnapshotContent,
    ) -> Result<VolumeContentSource, String> {
        restore_source(c, &class(), vs, vsc, true)
    }

    #[test]
    fn restore_names_the_contents_handle() {
        let src = restore(&claim_with(UID), &snapshot(), &content()).unwrap();
        assert_eq!(
            src.r#type,
            Some(volume_content_source::Type::Snapshot(
                volume_content_source::SnapshotSource {
                    snapshot_id: "snap-1".into()
                }
            ))
        );
        assert_eq!(snapshot_content_name(&snapshot()).unwrap(), "content");
    }

    #[test]
    fn restore_checks_in_order_with_upstreams_texts() {
        let c = claim_with(UID);
        let mut vs = snapshot();
        vs.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert_eq!(
            snapshot_content_name(&vs).unwrap_err(),
            "snapshot snap is being deleted"
        );
        vs.metadata.finalizers = Some(vec![SNAPSHOT_FINALIZER.into()]);
        assert_eq!(snapshot_content_name(&vs).unwrap(), "content");
        let mut vs = snapshot();
        vs.status = Some(VolumeSnapshotStatus::default());
        assert_eq!(
            snapshot_content_name(&vs).unwrap_err(),
            "snapshot snap not bound"
        );

        let mut vsc = content();
        vsc.spec.volume_snapshot_ref.uid = Some("other".into());
        assert_eq!(
            restore(&c, &snapshot(), &vsc).unwrap_err(),
            "snapshot snap not bound"
        );
        let mut vsc = content();
        vsc.spec.driver = "other".into();
        assert_eq!(
            restore(&c, &snapshot(), &vsc).unwrap_err(),
            "snapshot snap not bound"
        );
        let mut vs = snapshot();
        vs.status.as_mut().unwrap().ready_to_use = Some(false);
        assert_eq!(
            restore(&c, &vs, &content()).unwrap_err(),
            "snapshot snap is not Ready"
        );
        let mut vsc = content();
        vsc.status = Some(VolumeSnapshotContentStatus::default());
        assert_eq!(
            restore(&c, &snapshot(), &vsc).unwrap_err(),
            "snapshot handle snap is not available"
        );
        let mut small = claim_with(UID);
        small
            .spec
            .as_mut()
            .unwrap()
            .resources
            .as_mut()
            .unwrap()
            .requests = Some([("storage".to_owned(), Quantity("512Mi".into()))].into());
        assert_eq!(
            restore(&small, &snapshot(), &content()).unwrap_err(),
            "requested volume size 536870912 is less than the size 1073741824 for the source snapshot snap"
        );
        let mut none = claim_with(UID);
        none.spec.as_mut().unwrap().resources = None;
        assert_eq!(
            restore(&none, &snapshot(), &content()).unwrap_err(),
            "error getting capacity for PVC data when creating snapshot snap"
        );
        // Larger is fine; without a restore size nothing is compared.
        let mut big = claim_with(UID);
        big.spec
            .as_mut()
            .unwrap()
            .resources
            .as_mut()
            .unwrap()
            .requests = Some([("storage".to_owned(), Quantity("2Gi".into()))].into());
        restore(&big, &snapshot(), &content()).unwrap();
        let mut vs = snapshot();
        vs.status.as_mut().unwrap().restore_size = None;
        restore(&none, &vs, &content()).unwrap();
    }

    #[test]
    fn volume_mode_conversion_needs_the_contents_permission() {
        let mut c = claim_with(UID);
        c.spec.as_mut().unwrap().volume_mode = Some("Block".into());
        let who = "requested volume apps/data modifies the mode of the source volume but does not have permission to do so.";
        assert_eq!(
            restore(&c, &snapshot(), &content()).unwrap_err(),
            format!(
                "{who} snapshot.storage.kubernetes.io/allow-volume-mode-change annotation is not present on snapshotcontent content"
            )
        );
        let with = |v: &str| {
            let mut vsc = content();
            vsc.metadata.annotations =
                Some([(ANN_ALLOW_VOLUME_MODE_CHANGE.to_owned(), v.to_owned())].into());
            vsc
        };
        assert_eq!(
            restore(&c, &snapshot(), &with("no")).unwrap_err(),
            format!(
                "{who} failed to convert snapshot.storage.kubernetes.io/allow-volume-mode-change annotation value to boolean with error: strconv.ParseBool: parsing \"no\": invalid syntax"
            )
        );
        assert_eq!(
            restore(&c, &snapshot(), &with("F")).unwrap_err(),
            format!(
                "{who} snapshot.storage.kubernetes.io/allow-volume-mode-change is set to false on snapshotcontent content"
            )
        );
        restore(&c, &snapshot(), &with("True")).unwrap();
        // The flag off: no check.
        restore_source(&c, &class(), &snapshot(), &content(), false).unwrap();
        // An unset mode on either side: no check.
        let mut vsc = content();
        vsc.spec.source_volume_mode = None;
        restore(&c, &snapshot(), &vsc).unwrap();
    }

    fn source() -> PersistentVolumeClaim {
        let mut s = claim_with("src-uid");
        s.metadata.name = Some("src".into());
        s.spec.as_mut().unwrap().volume_name = Some("pv-src".into());
        s.status = Some(PersistentVolumeClaimStatus {
            phase: Some("Bound".into()),
            ..Default::default()
        });
        s
    }

    fn source_pv() -> PersistentVolume {
        PersistentVolume {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some("pv-src".into()),
                ..Default::default()
            },
            spec: Some(PersistentVolumeSpec {
                csi: Some(CSIPersistentVolumeSource {
                    driver: crate::topology::tests::DRIVER.into(),
                    volume_handle: "vol-src".into(),
                    ..Default::default()
                }),
                claim_ref: Some(ObjectReference {
                    name: Some("src".into()),
                    namespace: Some("apps".into()),
                    uid: Some("src-uid".into()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: Some(PersistentVolumeStatus {
                phase: Some("Bound".into()),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn clone_names_the_source_volumes_handle() {
        let c = claim_with(UID);
        assert_eq!(clone_claim_checks(&c, &source()).unwrap(), "pv-src");
        let src = clone_source(&c, &class(), &source(), Some(&source_pv())).unwrap();
        assert_eq!(
            src.r#type,
            Some(volume_content_source::Type::Volume(
                volume_content_source::VolumeSource {
                    volume_id: "vol-src".into()
                }
            ))
        );
    }

    #[test]
    fn clone_checks_in_order_with_upstreams_texts() {
        let c = claim_with(UID);
        let mut s = source();
        s.status = Some(PersistentVolumeClaimStatus {
            phase: Some("Pending".into()),
            ..Default::default()
        });
        assert_eq!(
            clone_claim_checks(&c, &s).unwrap_err(),
            "the PVC DataSource src must have a status of Bound.  Got {Pending [] map[] [] map[] map[] <nil> <nil>}"
        );
        let mut s = source();
        s.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
        assert_eq!(
            clone_claim_checks(&c, &s).unwrap_err(),
            "the PVC DataSource src is currently being deleted"
        );
        let mut s = source();
        s.spec.as_mut().unwrap().storage_class_name = None;
        assert_eq!(
            clone_claim_checks(&c, &s).unwrap_err(),
            "the source PVC (src) storageclass cannot be empty"
        );
        let mut n = claim_with(UID);
        n.spec.as_mut().unwrap().storage_class_name = None;
        assert_eq!(
            clone_claim_checks(&n, &source()).unwrap_err(),
            "the requested PVC (data) storageclass cannot be empty"
        );
        let mut small = claim_with(UID);
        small
            .spec
            .as_mut()
            .unwrap()
            .resources
            .as_mut()
            .unwrap()
            .requests = Some([("storage".to_owned(), Quantity("1Mi".into()))].into());
        assert_eq!(
            clone_claim_checks(&small, &source()).unwrap_err(),
            "error, new PVC request must be greater than or equal in size to the specified PVC data source, requested 1048576 but source is 1073741824"
        );
        let mut s = source();
        s.spec.as_mut().unwrap().volume_name = None;
        assert_eq!(
            clone_claim_checks(&c, &s).unwrap_err(),
            "volume name is empty in source PVC src"
        );

        let bad = |edit: &dyn Fn(&mut PersistentVolume)| {
            let mut pv = source_pv();
            edit(&mut pv);
            clone_source(&c, &class(), &source(), Some(&pv)).unwrap_err()
        };
        assert_eq!(
            clone_source(&c, &class(), &source(), None).unwrap_err(),
            CLAIM_NOT_BOUND
        );
        assert_eq!(
            bad(&|pv| pv.spec.as_mut().unwrap().csi = None),
            CLAIM_NOT_BOUND
        );
        assert_eq!(
            bad(&|pv| pv.spec.as_mut().unwrap().csi.as_mut().unwrap().driver = "x".into()),
            CLAIM_NOT_BOUND
        );
        assert_eq!(
            bad(&|pv| pv.spec.as_mut().unwrap().claim_ref = None),
            CLAIM_NOT_BOUND
        );
        assert_eq!(
            bad(&|pv| pv.spec.as_mut().unwrap().claim_ref.as_mut().unwrap().uid = None),
            CLAIM_NOT_BOUND
        );
        assert_eq!(
            bad(&|pv| pv.status.as_mut().unwrap().phase = Some("Released".into())),
            CLAIM_NOT_BOUND
        );
        assert_eq!(
            bad(&|pv| pv.spec.as_mut().unwrap().volume_mode = Some("Block".into())),
            "the source PVC and destination PVCs must have the same volume mode for cloning.  Source is Block, but new PVC requested Filesystem"
        );
        let mut block = claim_with(UID);
        block.spec.as_mut().unwrap().volume_mode = Some("Block".into());
        assert_eq!(
            clone_source(&block, &class(), &source(), Some(&source_pv())).unwrap_err(),
            "the source PVC and destination PVCs must have the same volume mode for cloning.  Source is Filesystem, but new PVC requested Block"
        );
    }
}
