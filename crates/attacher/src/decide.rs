//! The attacher's decisions, as pure functions over a VolumeAttachment and the cached objects
//! it names (its PersistentVolume, its node's CSINode): what to send to the driver and what to
//! write to the API server. The controller ([`crate::controller`]) only carries them out.
//!
//! Upstream's texts (errors stored in `attachError` / `detachError`) are reproduced exactly:
//! users grep for them and the A/D controller surfaces them in pod events.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeSpec, SecretReference};
use k8s_openapi::api::storage::v1::{CSINode, VolumeAttachment};
use plugreg_proto::csi::v1::volume_capability::{self, access_mode::Mode};
use plugreg_proto::csi::v1::{VolumeCapability, volume_capability::AccessType};
use plugreg_sidecar_kit::leader::sanitize_name;
use plugreg_sidecar_kit::migration;
use serde_json::{Value, json};

/// The VolumeAttachment annotation holding the node ID used at attach (the detach fallback
/// when the node's CSINode no longer names the driver).
pub const NODE_ID_ANNOTATION: &str = "csi.alpha.kubernetes.io/node-id";
/// The PV annotation naming the CSI driver an in-tree PV was migrated to.
pub const MIGRATED_TO_ANNOTATION: &str = "pv.kubernetes.io/migrated-to";

/// The finalizer on VolumeAttachments and PersistentVolumes: `external-attacher/<driver>`
/// with the driver name sanitised as a Lease name (`hostpath.csi.k8s.io` ->
/// `external-attacher/hostpath-csi-k8s-io`).
pub fn finalizer(driver: &str) -> String {
    format!("external-attacher/{}", sanitize_name(driver))
}

/// The leader-election lock name, as upstream gives it to csi-lib-utils:
/// `external-attacher-leader-<driver>`, not sanitised. The `LeaderElection` event comes from
/// `<lock name>/<host name>`.
pub fn lock_name(driver: &str) -> String {
    format!("external-attacher-leader-{driver}")
}

/// The leader-election Lease name: the [`lock_name`], sanitised
/// (`external-attacher-leader-hostpath-csi-k8s-io`).
pub fn lease_name(driver: &str) -> String {
    sanitize_name(&lock_name(driver))
}

/// What the driver can do, as far as the attacher cares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverCaps {
    /// Plugin capability CONTROLLER_SERVICE.
    pub controller_service: bool,
    /// PUBLISH_UNPUBLISH_VOLUME: the real handler; without it the trivial one.
    pub publish_unpublish: bool,
    /// PUBLISH_READONLY: without it `readonly` is always sent false.
    pub publish_readonly: bool,
    /// SINGLE_NODE_MULTI_WRITER: the finer single-node access modes.
    pub single_node_multi_writer: bool,
    /// LIST_VOLUMES.
    pub list_volumes: bool,
    /// LIST_VOLUMES_PUBLISHED_NODES.
    pub list_volumes_published_nodes: bool,
}

impl DriverCaps {
    /// Whether the real handler runs (else every VolumeAttachment is marked attached with no
    /// call, as upstream's trivial handler does).
    pub fn real_handler(&self) -> bool {
        self.controller_service && self.publish_unpublish
    }

    /// Whether the ListVolumes reconciler runs.
    pub fn reconciles(&self) -> bool {
        self.real_handler() && self.list_volumes && self.list_volumes_published_nodes
    }
}

/// Whether `va` is this driver's.
pub fn is_ours(va: &VolumeAttachment, driver: &str) -> bool {
    va.spec.attacher == driver
}

/// Whether `va` is being deleted.
pub fn deleting(va: &VolumeAttachment) -> bool {
    va.metadata.deletion_timestamp.is_some()
}

/// Whether `va` says attached.
pub fn attached(va: &VolumeAttachment) -> bool {
    va.status.as_ref().is_some_and(|s| s.attached)
}

fn has_finalizer(finalizers: Option<&Vec<String>>, fin: &str) -> bool {
    finalizers.is_some_and(|f| f.iter().any(|x| x == fin))
}

/// A fingerprint of what a sync of `va` reads: everything but `status.attachError`,
/// `status.detachError`, the resource version and managed fields. An update that leaves it
/// unchanged (saving an error) is not queued, so it does not cut the back-off short.
pub fn sync_fingerprint(va: &VolumeAttachment) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut va = va.clone();
    va.metadata.resource_version = None;
    va.metadata.managed_fields = None;
    if let Some(s) = va.status.as_mut() {
        s.attach_error = None;
        s.detach_error = None;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_string(&va).unwrap_or_default().hash(&mut h);
    h.finish()
}

/// Where a VolumeAttachment's volume is described.
#[derive(Debug, Clone, PartialEq)]
pub enum Source<'a> {
    /// `spec.source.persistentVolumeName`.
    Pv(&'a str),
    /// `spec.source.inlineVolumeSpec` (a migrated in-line volume).
    Inline(&'a PersistentVolumeSpec),
}

/// The volume source of `va`, or upstream's error text.
pub fn source(va: &VolumeAttachment) -> Result<Source<'_>, String> {
    let s = &va.spec.source;
    match (&s.persistent_volume_name, &s.inline_volume_spec) {
        (Some(_), Some(_)) => {
            Err("both InlineCSIVolumeSource and PersistentVolumeName specified in VA source".into())
        }
        (None, None) => Err(
            "neither InlineCSIVolumeSource nor PersistentVolumeName specified in VA source".into(),
        ),
        (Some(name), None) => Ok(Source::Pv(name)),
        (None, Some(spec)) => {
            if spec.csi.is_none() {
                return Err("inline volume spec contains nil CSI source".into());
            }
            Ok(Source::Inline(spec))
        }
    }
}

/// The lister's NotFound text for a missing PersistentVolume.
pub fn pv_not_found(name: &str) -> String {
    format!("persistentvolume \"{name}\" not found")
}

/// The lister's NotFound text for a missing CSINode.
pub fn csinode_not_found(node: &str) -> String {
    format!("csinode.storage.k8s.io \"{node}\" not found")
}

/// The node ID of the driver on `node` from its CSINode (`csinode`, as cached).
pub fn node_id_from_csinode(
    csinode: Option<&CSINode>,
    node: &str,
    driver: &str,
) -> Result<String, String> {
    let Some(csinode) = csinode else {
        return Err(csinode_not_found(node));
    };
    csinode
        .spec
        .drivers
        .iter()
        .find(|d| d.name == driver)
        .map(|d| d.node_id.clone())
        .ok_or_else(|| format!("CSINode {node} does not contain driver {driver}"))
}

/// The node ID for a detach (or the reconciler): the CSINode's, else the annotation written at
/// attach, so a node whose driver is gone can still be detached.
pub fn node_id_for_detach(
    va: &VolumeAttachment,
    csinode: Option<&CSINode>,
    driver: &str,
) -> Result<String, String> {
    node_id_from_csinode(csinode, &va.spec.node_name, driver).or_else(|e| {
        va.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NODE_ID_ANNOTATION))
            .filter(|id| !id.is_empty())
            .cloned()
            .ok_or(e)
    })
}

/// The CSI access mode of a PV's access modes (duplicates ignored), or upstream's error.
pub fn access_mode(modes: &[String], single_node_multi_writer: bool) -> Result<Mode, String> {
    let has = |m: &str| modes.iter().any(|x| x == m);
    let distinct = {
        let mut d: Vec<&str> = modes.iter().map(String::as_str).collect();
        d.sort_unstable();
        d.dedup();
        d.len()
    };
    if has("ReadWriteOncePod") {
        if distinct > 1 {
            return Err("Kubernetes does not support use of ReadWriteOncePod with other access modes on the same PersistentVolume".into());
        }
        return Ok(if single_node_multi_writer {
            Mode::SingleNodeSingleWriter
        } else {
            Mode::SingleNodeWriter
        });
    }
    if has("ReadWriteMany") {
        return Ok(Mode::MultiNodeMultiWriter);
    }
    if has("ReadOnlyMany") && has("ReadWriteOnce") {
        return Err(
            "CSI does not support ReadOnlyMany and ReadWriteOnce on the same PersistentVolume"
                .into(),
        );
    }
    if has("ReadOnlyMany") {
        return Ok(Mode::MultiNodeReaderOnly);
    }
    if has("ReadWriteOnce") {
        return Ok(if single_node_multi_writer {
            Mode::SingleNodeMultiWriter
        } else {
            Mode::SingleNodeWriter
        });
    }
    Err(format!(
        "unsupported AccessMode combination: [{}]",
        modes.join(" ")
    ))
}

/// The volume capability of a PV spec: block or mount (fs type from the PV, else
/// `default_fstype`; mount flags from `mountOptions`) and the access mode.
pub fn volume_capability(
    spec: &PersistentVolumeSpec,
    default_fstype: &str,
    single_node_multi_writer: bool,
) -> Result<VolumeCapability, String> {
    let Some(csi) = &spec.csi else {
        return Err("CSI volume source was nil".into());
    };
    let access_type = if spec.volume_mode.as_deref() == Some("Block") {
        AccessType::Block(volume_capability::BlockVolume {})
    } else {
        let fs_type = match csi.fs_type.as_deref() {
            Some(t) if !t.is_empty() => t.to_owned(),
            _ => default_fstype.to_owned(),
        };
        AccessType::Mount(volume_capability::MountVolume {
            fs_type,
            mount_flags: spec.mount_options.clone().unwrap_or_default(),
            volume_mount_group: String::new(),
        })
    };
    let mode = access_mode(
        spec.access_modes.as_deref().unwrap_or_default(),
        single_node_multi_writer,
    )?;
    Ok(VolumeCapability {
        access_type: Some(access_type),
        access_mode: Some(volume_capability::AccessMode { mode: mode as i32 }),
    })
}

/// What ControllerPublishVolume gets, but the secrets and the node ID.
#[derive(Debug, Clone, PartialEq)]
pub struct PublishInputs {
    /// `spec.csi.volumeHandle`.
    pub volume_id: String,
    /// The capability.
    pub capability: VolumeCapability,
    /// `spec.csi.readOnly`, forced false without PUBLISH_READONLY.
    pub readonly: bool,
    /// `spec.csi.volumeAttributes`.
    pub volume_context: BTreeMap<String, String>,
    /// `spec.csi.controllerPublishSecretRef`.
    pub secret: Option<SecretReference>,
    /// Whether the spec is a translated in-tree PV's (the `migrated` metrics label).
    pub migrated: bool,
}

/// The publish inputs of a PV spec (`migrated`: whether it was translated from an in-tree PV).
pub fn publish_inputs(
    spec: &PersistentVolumeSpec,
    caps: &DriverCaps,
    default_fstype: &str,
    migrated: bool,
) -> Result<PublishInputs, String> {
    let capability = volume_capability(spec, default_fstype, caps.single_node_multi_writer)?;
    let csi = spec.csi.as_ref().ok_or("CSI volume source was nil")?;
    Ok(PublishInputs {
        volume_id: csi.volume_handle.clone(),
        capability,
        readonly: caps.publish_readonly && csi.read_only.unwrap_or(false),
        volume_context: csi.volume_attributes.clone().unwrap_or_default(),
        secret: csi.controller_publish_secret_ref.clone(),
        migrated,
    })
}

/// Whether a PV spec has an in-tree source that CSI migration translates (chosen by the
/// source field, whatever driver the attacher serves, as upstream).
pub fn in_tree(spec: &PersistentVolumeSpec) -> bool {
    migration::in_tree_plugin_of_pv(spec).is_some()
}

/// The CSI volume spec an attach or detach uses, and whether it was translated from an in-tree
/// PV (the `migrated` label of the driver calls: `true` only then; an in-line volume arrives
/// translated by kube-controller-manager and its calls say `false`, as upstream's).
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeSpec<'a> {
    /// The spec, with `spec.csi` set.
    pub spec: Cow<'a, PersistentVolumeSpec>,
    /// Whether it is a translated in-tree PV's.
    pub migrated: bool,
}

/// The volume spec an attach or detach uses: the PV's (translated to CSI when it is an
/// in-tree PV) or the in-line one, or upstream's error. `deleting_pv_is_error`: attach refuses
/// a PV marked for deletion, detach does not.
pub fn volume_spec<'a>(
    src: &Source<'a>,
    pv: Option<&'a PersistentVolume>,
    deleting_pv_is_error: bool,
) -> Result<VolumeSpec<'a>, String> {
    let (pv, name) = match src {
        Source::Inline(spec) => {
            return Ok(VolumeSpec {
                spec: Cow::Borrowed(*spec),
                migrated: false,
            });
        }
        Source::Pv(name) => (pv.ok_or_else(|| pv_not_found(name))?, name),
    };
    if deleting_pv_is_error && pv.metadata.deletion_timestamp.is_some() {
        return Err(format!(
            "PersistentVolume \"{name}\" is marked for deletion"
        ));
    }
    let spec = pv.spec.as_ref().ok_or_else(|| pv_not_found(name))?;
    if in_tree(spec) {
        let translated = migration::translate_in_tree_pv_to_csi(pv)
            .map_err(|e| format!("failed to translate in tree pv to CSI: {e}"))?;
        return Ok(VolumeSpec {
            spec: Cow::Owned(translated.spec.unwrap_or_default()),
            migrated: true,
        });
    }
    if spec.csi.is_none() {
        return Err("pv spec contained non-csi source that was not migrated".into());
    }
    Ok(VolumeSpec {
        spec: Cow::Borrowed(spec),
        migrated: false,
    })
}

/// The handle the ListVolumes reconciler looks up in the driver's published volumes: a
/// translated in-tree PV's or an in-line volume's repaired for the node as upstream's
/// (`RepairVolumeHandle`: GCE PD fills in an `UNSPECIFIED` project and zone from the node ID),
/// any other as it is.
pub fn reconciled_handle(
    src: &Source<'_>,
    v: &VolumeSpec<'_>,
    node_id: &str,
) -> Result<String, String> {
    let Some(csi) = v.spec.csi.as_ref() else {
        return Ok(String::new());
    };
    if !v.migrated && !matches!(src, Source::Inline(_)) {
        return Ok(csi.volume_handle.clone());
    }
    migration::repair_volume_handle(&csi.driver, &csi.volume_handle, node_id).map_err(|e| {
        format!(
            "Failed to repair volume handle for driver {}: {e}",
            csi.driver
        )
    })
}

/// The JSON Patch (RFC 6902) adding `fin` to a PV's finalizers, or `None` when it is there.
/// The `test` operations make a concurrent change fail the patch instead of being undone.
pub fn pv_add_finalizer_patch(pv: &PersistentVolume, fin: &str) -> Option<Value> {
    match &pv.metadata.finalizers {
        Some(f) if f.iter().any(|x| x == fin) => None,
        None => Some(json!([
            {"op": "test", "path": "/metadata/finalizers", "value": null},
            {"op": "add", "path": "/metadata/finalizers", "value": [fin]},
        ])),
        Some(f) if f.is_empty() => Some(json!([
            {"op": "test", "path": "/metadata/finalizers", "value": []},
            {"op": "replace", "path": "/metadata/finalizers", "value": [fin]},
        ])),
        Some(_) => Some(json!([
            {"op": "add", "path": "/metadata/finalizers/-", "value": fin},
        ])),
    }
}

/// Whether a PV from the PV queue may lose the finalizer `fin`: it carries it, it is being
/// deleted (or is an in-tree PV migrated away from `driver`), and no VolumeAttachment in
/// `attachment_pvs` (the PV names of every cached VolumeAttachment) names it. Returns the
/// strategic-merge patch that removes `fin` by value (`$deleteFromPrimitiveList`, as
/// csi-provisioner removes its own).
///
/// Upstream sends a JSON Patch, `test` + `remove` at the finalizer's index in its cached PV.
/// The API server refuses it (422) whenever the list changed since, and a deleted PV's list
/// does change then: the provisioner removes its own finalizer in the same second. Each refusal
/// costs a back-off, a request and a token of the attacher's bucket before the retry. Removing
/// by value conflicts with no one and undoes no other client's change (checklist 14).
pub fn pv_remove_finalizer_patch<S: AsRef<str>>(
    pv: &PersistentVolume,
    fin: &str,
    driver: &str,
    mut attachment_pvs: impl Iterator<Item = S>,
) -> Option<Value> {
    let name = pv.metadata.name.as_deref().unwrap_or_default();
    let migrated_away = pv.spec.as_ref().is_some_and(in_tree)
        && pv
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(MIGRATED_TO_ANNOTATION))
            .is_none_or(|to| to != driver);
    if pv.metadata.deletion_timestamp.is_none() && !migrated_away {
        return None;
    }
    if !has_finalizer(pv.metadata.finalizers.as_ref(), fin) {
        return None;
    }
    if attachment_pvs.any(|p| p.as_ref() == name) {
        return None;
    }
    Some(json!({"metadata": {"$deleteFromPrimitiveList/finalizers": [fin]}}))
}

/// Whether a PV event is worth queueing: it carries `fin` and is being deleted (or migrated
/// away from `driver`).
pub fn pv_needs_sync(pv: &PersistentVolume, fin: &str, driver: &str) -> bool {
    has_finalizer(pv.metadata.finalizers.as_ref(), fin)
        && pv_remove_finalizer_patch(pv, fin, driver, std::iter::empty::<&str>()).is_some()
}

/// The merge patch on the VolumeAttachment (main resource) before ControllerPublish: the
/// finalizer and the node-ID annotation, or `None` when both are there. A merge patch replaces
/// the finalizer list whole, so the list is the cached one plus `fin`.
pub fn va_attach_patch(va: &VolumeAttachment, fin: &str, node_id: &str) -> Option<Value> {
    let finalizers = va.metadata.finalizers.clone().unwrap_or_default();
    let has_fin = finalizers.iter().any(|f| f == fin);
    let has_annotation = va
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NODE_ID_ANNOTATION))
        .is_some_and(|id| id == node_id);
    if has_fin && has_annotation {
        return None;
    }
    let mut metadata = serde_json::Map::new();
    if !has_fin {
        let mut f = finalizers;
        f.push(fin.to_owned());
        metadata.insert("finalizers".into(), json!(f));
    }
    if !has_annotation {
        metadata.insert("annotations".into(), json!({ NODE_ID_ANNOTATION: node_id }));
    }
    Some(json!({ "metadata": metadata }))
}

/// The merge patch on the VolumeAttachment removing `fin` (after a successful
/// ControllerUnpublish), or `None` when it is not there.
pub fn va_remove_finalizer_patch(va: &VolumeAttachment, fin: &str) -> Option<Value> {
    let finalizers = va.metadata.finalizers.as_ref()?;
    if !finalizers.iter().any(|f| f == fin) {
        return None;
    }
    let rest: Vec<&String> = finalizers.iter().filter(|f| *f != fin).collect();
    Some(json!({ "metadata": { "finalizers": rest } }))
}

/// Whether removing `fin` lets the API server delete the VolumeAttachment at once (it is being
/// deleted and `fin` is its last finalizer): then the `attached: false` status patch after it
/// would only find it gone, and is not sent.
pub fn removal_deletes(va: &VolumeAttachment, fin: &str) -> bool {
    deleting(va)
        && va
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().all(|x| x == fin))
}

/// The status merge patch after a successful publish: attached, the publish context as
/// `attachmentMetadata` (keys no longer there removed), no `attachError`.
pub fn attached_status_patch(
    va: &VolumeAttachment,
    publish_context: &BTreeMap<String, String>,
) -> Value {
    let old = va
        .status
        .as_ref()
        .and_then(|s| s.attachment_metadata.clone())
        .unwrap_or_default();
    let metadata = if publish_context.is_empty() {
        Value::Null
    } else {
        let mut m: serde_json::Map<String, Value> = old
            .keys()
            .filter(|k| !publish_context.contains_key(*k))
            .map(|k| (k.clone(), Value::Null))
            .collect();
        for (k, v) in publish_context {
            m.insert(k.clone(), Value::String(v.clone()));
        }
        Value::Object(m)
    };
    json!({"status": {"attached": true, "attachmentMetadata": metadata, "attachError": null}})
}

/// The status merge patch of the trivial handler: attached, nothing else.
pub fn trivially_attached_patch() -> Value {
    json!({"status": {"attached": true}})
}

/// The status merge patch after a successful unpublish, or `None` when there is nothing to
/// clear.
pub fn detached_status_patch(va: &VolumeAttachment) -> Option<Value> {
    let s = va.status.as_ref()?;
    let dirty = s.attached || s.detach_error.is_some() || s.attachment_metadata.is_some();
    dirty.then(
        || json!({"status": {"attached": false, "detachError": null, "attachmentMetadata": null}}),
    )
}

/// The status merge patch saving an attach error (`error_code`: the gRPC code number, only
/// for gRPC errors and only with the MutableCSINodeAllocatableCount gate).
pub fn attach_error_patch(message: &str, time: &str, error_code: Option<i32>) -> Value {
    let mut e = json!({"message": message, "time": time});
    if let Some(code) = error_code {
        e["errorCode"] = json!(code);
    }
    json!({"status": {"attachError": e}})
}

/// The status merge patch saving a detach error (never an error code, as upstream).
pub fn detach_error_patch(message: &str, time: &str) -> Value {
    json!({"status": {"detachError": {"message": message, "time": time}}})
}

/// What a VolumeAttachment needs.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Not ours, or nothing to do (already attached, already detached).
    Nothing(&'static str),
    /// Trivial handler: mark attached without a call.
    MarkAttached,
    /// Real handler: attach (the steps are the controller's, on [`attach_plan`]).
    Attach,
    /// Real handler: detach.
    Detach,
}

/// The first decision on a cached VolumeAttachment. `forced`: the reconciler found the
/// driver's state differs from `status.attached`, so the skip rules do not apply.
pub fn decide(va: &VolumeAttachment, driver: &str, caps: &DriverCaps, forced: bool) -> Action {
    if !is_ours(va, driver) {
        return Action::Nothing("VolumeAttachment of another driver");
    }
    if !caps.real_handler() {
        if deleting(va) || attached(va) {
            return Action::Nothing("VolumeAttachment is already attached");
        }
        return Action::MarkAttached;
    }
    let fin = finalizer(driver);
    if deleting(va) {
        if !forced && !has_finalizer(va.metadata.finalizers.as_ref(), &fin) {
            return Action::Nothing("VolumeAttachment is already detached");
        }
        return Action::Detach;
    }
    if attached(va) && !forced {
        return Action::Nothing("VolumeAttachment is already attached");
    }
    Action::Attach
}

/// Everything an attach needs from the caches, in upstream's order: the volume spec (errors
/// before any write), the PV finalizer patch, then the publish inputs and the node ID (errors
/// after the PV finalizer, before the VolumeAttachment finalizer).
#[derive(Debug, Clone, PartialEq)]
pub struct AttachPlan {
    /// JSON Patch adding the finalizer to the PV, if it needs it.
    pub pv_patch: Option<(String, Value)>,
    /// The publish inputs, or the error to save.
    pub inputs: Result<PublishInputs, String>,
    /// The node ID, or the error to save.
    pub node_id: Result<String, String>,
}

/// The attach plan of `va`, or the error to save before anything is written.
pub fn attach_plan(
    va: &VolumeAttachment,
    driver: &str,
    caps: &DriverCaps,
    default_fstype: &str,
    pv: Option<&PersistentVolume>,
    csinode: Option<&CSINode>,
) -> Result<AttachPlan, String> {
    let src = source(va)?;
    if let Source::Pv(name) = &src {
        // The lister's checks come first; the finalizer goes on before the spec is read.
        let pv = pv.ok_or_else(|| pv_not_found(name))?;
        if pv.metadata.deletion_timestamp.is_some() {
            return Err(format!(
                "PersistentVolume \"{name}\" is marked for deletion"
            ));
        }
    }
    let fin = finalizer(driver);
    let pv_patch = match (&src, pv) {
        (Source::Pv(name), Some(pv)) => {
            pv_add_finalizer_patch(pv, &fin).map(|p| ((*name).to_owned(), p))
        }
        _ => None,
    };
    let inputs = volume_spec(&src, pv, true)
        .and_then(|v| publish_inputs(&v.spec, caps, default_fstype, v.migrated));
    let node_id = node_id_from_csinode(csinode, &va.spec.node_name, driver);
    Ok(AttachPlan {
        pv_patch,
        inputs,
        node_id,
    })
}

/// What ControllerUnpublish gets, but the secrets.
#[derive(Debug, Clone, PartialEq)]
pub struct DetachPlan {
    /// The volume handle.
    pub volume_id: String,
    /// The node ID (CSINode, else the annotation written at attach).
    pub node_id: String,
    /// `controllerPublishSecretRef`.
    pub secret: Option<SecretReference>,
    /// Whether the spec is a translated in-tree PV's (the `migrated` metrics label).
    pub migrated: bool,
}

/// The detach plan of `va`, or the error to save.
pub fn detach_plan(
    va: &VolumeAttachment,
    driver: &str,
    pv: Option<&PersistentVolume>,
    csinode: Option<&CSINode>,
) -> Result<DetachPlan, String> {
    let src = source(va)?;
    let VolumeSpec { spec, migrated } = volume_spec(&src, pv, false)?;
    let csi = spec.csi.as_ref().ok_or("CSI volume source was nil")?;
    let node_id = node_id_for_detach(va, csinode, driver)?;
    Ok(DetachPlan {
        volume_id: csi.volume_handle.clone(),
        node_id,
        secret: csi.controller_publish_secret_ref.clone(),
        migrated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::CSIPersistentVolumeSource;
    use k8s_openapi::api::storage::v1::{
        CSINodeDriver, CSINodeSpec, VolumeAttachmentSource, VolumeAttachmentSpec,
        VolumeAttachmentStatus, VolumeError,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    const DRIVER: &str = "hostpath.csi.k8s.io";

    fn caps() -> DriverCaps {
        DriverCaps {
            controller_service: true,
            publish_unpublish: true,
            ..DriverCaps::default()
        }
    }

    fn va(pv: &str) -> VolumeAttachment {
        VolumeAttachment {
            metadata: ObjectMeta {
                name: Some("csi-1".into()),
                ..ObjectMeta::default()
            },
            spec: VolumeAttachmentSpec {
                attacher: DRIVER.into(),
                node_name: "node-a".into(),
                source: VolumeAttachmentSource {
                    persistent_volume_name: Some(pv.into()),
                    ..VolumeAttachmentSource::default()
                },
            },
            status: None,
        }
    }

    fn now() -> Time {
        Time(k8s_openapi::jiff::Timestamp::now())
    }

    fn pv(name: &str, modes: &[&str]) -> PersistentVolume {
        PersistentVolume {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            spec: Some(PersistentVolumeSpec {
                access_modes: Some(modes.iter().map(|m| (*m).to_owned()).collect()),
                csi: Some(CSIPersistentVolumeSource {
                    driver: DRIVER.into(),
                    volume_handle: "vol-1".into(),
                    read_only: Some(true),
                    volume_attributes: Some([("k".to_owned(), "v".to_owned())].into()),
                    ..CSIPersistentVolumeSource::default()
                }),
                ..PersistentVolumeSpec::default()
            }),
            status: None,
        }
    }

    fn csinode(drivers: &[(&str, &str)]) -> CSINode {
        CSINode {
            metadata: ObjectMeta {
                name: Some("node-a".into()),
                ..ObjectMeta::default()
            },
            spec: CSINodeSpec {
                drivers: drivers
                    .iter()
                    .map(|(n, id)| CSINodeDriver {
                        name: (*n).into(),
                        node_id: (*id).into(),
                        ..CSINodeDriver::default()
                    })
                    .collect(),
            },
        }
    }

    #[test]
    fn names_follow_the_sanitising_rule() {
        assert_eq!(finalizer(DRIVER), "external-attacher/hostpath-csi-k8s-io");
        assert_eq!(
            lease_name(DRIVER),
            "external-attacher-leader-hostpath-csi-k8s-io"
        );
        assert_eq!(
            lock_name(DRIVER),
            "external-attacher-leader-hostpath.csi.k8s.io"
        );
        assert_eq!(finalizer("a_"), "external-attacher/a-X");
    }

    #[test]
    fn access_mode_table() {
        use Mode::*;
        let m = |modes: &[&str], snmw: bool| {
            access_mode(
                &modes.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>(),
                snmw,
            )
        };
        let rows: &[(&[&str], bool, Result<Mode, &str>)] = &[
            (&["ReadWriteOncePod"], false, Ok(SingleNodeWriter)),
            (&["ReadWriteOncePod"], true, Ok(SingleNodeSingleWriter)),
            (
                &["ReadWriteOncePod", "ReadWriteOncePod"],
                true,
                Ok(SingleNodeSingleWriter),
            ),
            (
                &["ReadWriteOncePod", "ReadWriteOnce"],
                false,
                Err(
                    "Kubernetes does not support use of ReadWriteOncePod with other access modes on the same PersistentVolume",
                ),
            ),
            (&["ReadWriteMany"], false, Ok(MultiNodeMultiWriter)),
            (
                &["ReadWriteMany", "ReadWriteOnce"],
                true,
                Ok(MultiNodeMultiWriter),
            ),
            (
                &["ReadOnlyMany", "ReadWriteOnce"],
                false,
                Err(
                    "CSI does not support ReadOnlyMany and ReadWriteOnce on the same PersistentVolume",
                ),
            ),
            (&["ReadOnlyMany"], true, Ok(MultiNodeReaderOnly)),
            (&["ReadWriteOnce"], false, Ok(SingleNodeWriter)),
            (&["ReadWriteOnce"], true, Ok(SingleNodeMultiWriter)),
            (&[], false, Err("unsupported AccessMode combination: []")),
            (
                &["Bogus"],
                false,
                Err("unsupported AccessMode combination: [Bogus]"),
            ),
        ];
        for (modes, snmw, want) in rows {
            assert_eq!(
                m(modes, *snmw),
                want.map_err(str::to_owned),
                "{modes:?} {snmw}"
            );
        }
    }

    #[test]
    fn capability_block_mount_fstype_and_flags() {
        let mut p = pv("pv", &["ReadWriteOnce"]).spec.unwrap();
        let fs = |c: VolumeCapability| match c.access_type {
            Some(AccessType::Mount(m)) => Some((m.fs_type, m.mount_flags)),
            _ => None,
        };
        assert_eq!(
            fs(volume_capability(&p, "", false).unwrap()),
            Some((String::new(), vec![]))
        );
        assert_eq!(
            fs(volume_capability(&p, "ext4", false).unwrap()),
            Some(("ext4".into(), vec![]))
        );
        p.csi.as_mut().unwrap().fs_type = Some("xfs".into());
        p.mount_options = Some(vec!["ro".into()]);
        assert_eq!(
            fs(volume_capability(&p, "ext4", false).unwrap()),
            Some(("xfs".into(), vec!["ro".into()]))
        );
        p.volume_mode = Some("Block".into());
        assert!(matches!(
            volume_capability(&p, "ext4", false).unwrap().access_type,
            Some(AccessType::Block(_))
        ));
        p.csi = None;
        assert_eq!(
            volume_capability(&p, "", false).unwrap_err(),
            "CSI volume source was nil"
        );
    }

    #[test]
    fn readonly_needs_publish_readonly() {
        let p = pv("pv", &["ReadWriteOnce"]).spec.unwrap();
        assert!(!publish_inputs(&p, &caps(), "", false).unwrap().readonly);
        let with = DriverCaps {
            publish_readonly: true,
            ..caps()
        };
        let i = publish_inputs(&p, &with, "", false).unwrap();
        assert!(i.readonly);
        assert_eq!(i.volume_id, "vol-1");
        assert_eq!(i.volume_context.get("k").map(String::as_str), Some("v"));
    }

    #[test]
    fn source_errors() {
        let mut v = va("pv");
        assert_eq!(source(&v), Ok(Source::Pv("pv")));
        v.spec.source.inline_volume_spec = Some(PersistentVolumeSpec::default());
        assert_eq!(
            source(&v).unwrap_err(),
            "both InlineCSIVolumeSource and PersistentVolumeName specified in VA source"
        );
        v.spec.source.persistent_volume_name = None;
        assert_eq!(
            source(&v).unwrap_err(),
            "inline volume spec contains nil CSI source"
        );
        v.spec.source.inline_volume_spec = None;
        assert_eq!(
            source(&v).unwrap_err(),
            "neither InlineCSIVolumeSource nor PersistentVolumeName specified in VA source"
        );
    }

    #[test]
    fn node_id_from_csinode_or_annotation_for_detach() {
        let v = va("pv");
        assert_eq!(
            node_id_from_csinode(None, "node-a", DRIVER).unwrap_err(),
            "csinode.storage.k8s.io \"node-a\" not found"
        );
        let other = csinode(&[("other", "x")]);
        assert_eq!(
            node_id_from_csinode(Some(&other), "node-a", DRIVER).unwrap_err(),
            "CSINode node-a does not contain driver hostpath.csi.k8s.io"
        );
        let ours = csinode(&[("other", "x"), (DRIVER, "id-a")]);
        assert_eq!(node_id_for_detach(&v, Some(&ours), DRIVER).unwrap(), "id-a");
        assert!(node_id_for_detach(&v, Some(&other), DRIVER).is_err());
        let mut annotated = v.clone();
        annotated.metadata.annotations =
            Some([(NODE_ID_ANNOTATION.into(), "id-old".into())].into());
        assert_eq!(
            node_id_for_detach(&annotated, None, DRIVER).unwrap(),
            "id-old"
        );
    }

    #[test]
    fn decide_table() {
        let real = caps();
        let trivial = DriverCaps {
            controller_service: true,
            ..DriverCaps::default()
        };
        let fin = finalizer(DRIVER);
        let plain = va("pv");
        let mut attached_va = plain.clone();
        attached_va.status = Some(VolumeAttachmentStatus {
            attached: true,
            ..VolumeAttachmentStatus::default()
        });
        let mut deleted = plain.clone();
        deleted.metadata.deletion_timestamp = Some(now());
        let mut deleted_fin = deleted.clone();
        deleted_fin.metadata.finalizers = Some(vec![fin.clone()]);
        let mut other = plain.clone();
        other.spec.attacher = "other".into();

        assert!(matches!(
            decide(&other, DRIVER, &real, true),
            Action::Nothing(_)
        ));
        assert_eq!(
            decide(&plain, DRIVER, &trivial, false),
            Action::MarkAttached
        );
        assert!(matches!(
            decide(&attached_va, DRIVER, &trivial, false),
            Action::Nothing(_)
        ));
        assert!(matches!(
            decide(&deleted, DRIVER, &trivial, false),
            Action::Nothing(_)
        ));
        assert_eq!(decide(&plain, DRIVER, &real, false), Action::Attach);
        assert_eq!(
            decide(&attached_va, DRIVER, &real, false),
            Action::Nothing("VolumeAttachment is already attached")
        );
        assert_eq!(decide(&attached_va, DRIVER, &real, true), Action::Attach);
        assert_eq!(
            decide(&deleted, DRIVER, &real, false),
            Action::Nothing("VolumeAttachment is already detached")
        );
        assert_eq!(decide(&deleted, DRIVER, &real, true), Action::Detach);
        assert_eq!(decide(&deleted_fin, DRIVER, &real, false), Action::Detach);
    }

    #[test]
    fn attach_plan_checks_the_pv_before_any_write() {
        let v = va("pv");
        let c = caps();
        let node = csinode(&[(DRIVER, "id-a")]);
        assert_eq!(
            attach_plan(&v, DRIVER, &c, "", None, Some(&node)).unwrap_err(),
            "persistentvolume \"pv\" not found"
        );
        let mut gone = pv("pv", &["ReadWriteOnce"]);
        gone.metadata.deletion_timestamp = Some(now());
        assert_eq!(
            attach_plan(&v, DRIVER, &c, "", Some(&gone), Some(&node)).unwrap_err(),
            "PersistentVolume \"pv\" is marked for deletion"
        );
        let p = pv("pv", &["ReadWriteOnce"]);
        let plan = attach_plan(&v, DRIVER, &c, "", Some(&p), Some(&node)).unwrap();
        assert_eq!(plan.node_id.as_deref(), Ok("id-a"));
        assert_eq!(plan.pv_patch.as_ref().unwrap().0, "pv");
        // A bad access mode is found after the PV finalizer, as upstream.
        let bad = pv("pv", &["ReadOnlyMany", "ReadWriteOnce"]);
        let plan = attach_plan(&v, DRIVER, &c, "", Some(&bad), None).unwrap();
        assert!(plan.pv_patch.is_some() && plan.inputs.is_err() && plan.node_id.is_err());
    }

    #[test]
    fn pv_finalizers_are_added_with_tests_and_removed_by_value() {
        let fin = finalizer(DRIVER);
        let mut p = pv("pv", &["ReadWriteOnce"]);
        assert_eq!(
            pv_add_finalizer_patch(&p, &fin).unwrap(),
            json!([{"op":"test","path":"/metadata/finalizers","value":null},{"op":"add","path":"/metadata/finalizers","value":[fin]}])
        );
        p.metadata.finalizers = Some(vec![]);
        assert_eq!(
            pv_add_finalizer_patch(&p, &fin).unwrap()[1]["op"],
            "replace"
        );
        p.metadata.finalizers = Some(vec!["kubernetes.io/pv-protection".into()]);
        assert_eq!(
            pv_add_finalizer_patch(&p, &fin).unwrap(),
            json!([{"op":"add","path":"/metadata/finalizers/-","value":fin}])
        );
        p.metadata.finalizers = Some(vec!["kubernetes.io/pv-protection".into(), fin.clone()]);
        assert!(pv_add_finalizer_patch(&p, &fin).is_none());
        // Not deleted: kept.
        assert!(pv_remove_finalizer_patch(&p, &fin, DRIVER, std::iter::empty::<&str>()).is_none());
        p.metadata.deletion_timestamp = Some(now());
        assert!(pv_needs_sync(&p, &fin, DRIVER));
        // A VolumeAttachment still names it: kept.
        assert!(pv_remove_finalizer_patch(&p, &fin, DRIVER, ["x", "pv"].into_iter()).is_none());
        assert_eq!(
            pv_remove_finalizer_patch(&p, &fin, DRIVER, ["x"].into_iter()).unwrap(),
            json!({"metadata":{"$deleteFromPrimitiveList/finalizers":[fin]}})
        );
        // Not carrying it: nothing to remove.
        p.metadata.finalizers = Some(vec!["kubernetes.io/pv-protection".into()]);
        assert!(pv_remove_finalizer_patch(&p, &fin, DRIVER, ["x"].into_iter()).is_none());
    }

    #[test]
    fn va_patches() {
        let fin = finalizer(DRIVER);
        let mut v = va("pv");
        v.metadata.finalizers = Some(vec!["other/x".into()]);
        assert_eq!(
            va_attach_patch(&v, &fin, "id-a").unwrap(),
            json!({"metadata":{"finalizers":["other/x", fin],"annotations":{NODE_ID_ANNOTATION:"id-a"}}})
        );
        v.metadata.finalizers = Some(vec!["other/x".into(), fin.clone()]);
        v.metadata.annotations = Some([(NODE_ID_ANNOTATION.into(), "id-a".into())].into());
        assert!(va_attach_patch(&v, &fin, "id-a").is_none());
        assert_eq!(
            va_attach_patch(&v, &fin, "id-b").unwrap(),
            json!({"metadata":{"annotations":{NODE_ID_ANNOTATION:"id-b"}}})
        );
        assert_eq!(
            va_remove_finalizer_patch(&v, &fin).unwrap(),
            json!({"metadata":{"finalizers":["other/x"]}})
        );
        v.metadata.deletion_timestamp = Some(now());
        assert!(!removal_deletes(&v, &fin));
        v.metadata.finalizers = Some(vec![fin.clone()]);
        assert!(removal_deletes(&v, &fin));
    }

    #[test]
    fn status_patches() {
        let mut v = va("pv");
        v.status = Some(VolumeAttachmentStatus {
            attached: false,
            attachment_metadata: Some([("old".to_owned(), "1".to_owned())].into()),
            attach_error: Some(VolumeError::default()),
            ..VolumeAttachmentStatus::default()
        });
        let ctx: BTreeMap<String, String> = [("device".to_owned(), "/dev/x".to_owned())].into();
        assert_eq!(
            attached_status_patch(&v, &ctx),
            json!({"status":{"attached":true,"attachmentMetadata":{"old":null,"device":"/dev/x"},"attachError":null}})
        );
        assert_eq!(
            attached_status_patch(&v, &BTreeMap::new())["status"]["attachmentMetadata"],
            Value::Null
        );
        assert_eq!(
            attach_error_patch("m", "t", Some(8)),
            json!({"status":{"attachError":{"message":"m","time":"t","errorCode":8}}})
        );
        assert_eq!(
            attach_error_patch("m", "t", None),
            json!({"status":{"attachError":{"message":"m","time":"t"}}})
        );
        assert!(detached_status_patch(&v).is_some());
        v.status = Some(VolumeAttachmentStatus::default());
        assert!(detached_status_patch(&v).is_none());
    }

    #[test]
    fn error_only_updates_do_not_sync() {
        let mut old = va("pv");
        old.metadata.resource_version = Some("1".into());
        old.status = Some(VolumeAttachmentStatus::default());
        let mut new = old.clone();
        new.metadata.resource_version = Some("2".into());
        new.status = Some(VolumeAttachmentStatus {
            attach_error: Some(VolumeError {
                message: Some("x".into()),
                ..VolumeError::default()
            }),
            ..VolumeAttachmentStatus::default()
        });
        assert_eq!(sync_fingerprint(&old), sync_fingerprint(&new));
        new.metadata.deletion_timestamp = Some(now());
        assert_ne!(sync_fingerprint(&old), sync_fingerprint(&new));
    }

    #[test]
    fn detach_plan_falls_back_to_the_annotation() {
        let mut v = va("pv");
        let p = pv("pv", &["ReadWriteOnce"]);
        assert_eq!(
            detach_plan(&v, DRIVER, Some(&p), None).unwrap_err(),
            "csinode.storage.k8s.io \"node-a\" not found"
        );
        v.metadata.annotations = Some([(NODE_ID_ANNOTATION.into(), "id-old".into())].into());
        let plan = detach_plan(&v, DRIVER, Some(&p), None).unwrap();
        assert_eq!(plan.node_id, "id-old");
        assert_eq!(plan.volume_id, "vol-1");
    }

    fn in_tree_pv(
        name: &str,
        spec: serde_json::Value,
        labels: serde_json::Value,
    ) -> PersistentVolume {
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}, "spec": spec}))
            .unwrap()
    }

    /// Checklist 21, 23, 24: an in-tree PV is attached with its translated handle, context,
    /// access mode, and `migrated`; its finalizer goes on the in-tree PV.
    #[test]
    fn in_tree_pvs_are_published_translated() {
        let csinode = csinode(&[(DRIVER, "node-id-a")]);
        let cases = [
            (
                "21/23: EBS aws:// ID",
                json!({"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/vol-0abc"},
                       "accessModes": ["ReadWriteOnce"]}),
                json!({}),
                "vol-0abc",
                &[("partition", "0")][..],
                Mode::SingleNodeWriter,
            ),
            (
                "24: GCE zonal, RWX as RWO",
                json!({"gcePersistentDisk": {"pdName": "pd1"}, "accessModes": ["ReadWriteMany"]}),
                json!({"topology.kubernetes.io/zone": "us-central1-a"}),
                "projects/UNSPECIFIED/zones/us-central1-a/disks/pd1",
                &[("partition", "")][..],
                Mode::SingleNodeWriter,
            ),
            (
                "24: GCE ROX",
                json!({"gcePersistentDisk": {"pdName": "pd1"}, "accessModes": ["ReadOnlyMany"]}),
                json!({"topology.kubernetes.io/zone": "us-central1-a"}),
                "projects/UNSPECIFIED/zones/us-central1-a/disks/pd1",
                &[("partition", "")][..],
                Mode::MultiNodeReaderOnly,
            ),
        ];
        for (case, spec, labels, handle, context, mode) in cases {
            let p = in_tree_pv("pv", spec, labels);
            let plan = attach_plan(&va("pv"), DRIVER, &caps(), "ext4", Some(&p), Some(&csinode))
                .unwrap_or_else(|e| panic!("{case}: {e}"));
            assert!(plan.pv_patch.is_some(), "{case}: PV finalizer");
            let inputs = plan.inputs.unwrap_or_else(|e| panic!("{case}: {e}"));
            assert_eq!(inputs.volume_id, handle, "{case}");
            let want: BTreeMap<String, String> = context
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            assert_eq!(inputs.volume_context, want, "{case}");
            assert_eq!(
                inputs.capability.access_mode,
                Some(volume_capability::AccessMode { mode: mode as i32 }),
                "{case}"
            );
            assert!(inputs.migrated, "{case}: migrated");
            let detach = detach_plan(&va("pv"), DRIVER, Some(&p), Some(&csinode)).unwrap();
            assert_eq!(
                (detach.volume_id.as_str(), detach.migrated),
                (handle, true),
                "{case}"
            );
        }
    }

    /// Checklist 23, 25, 26, 28: what does not translate is stored with upstream's text.
    #[test]
    fn untranslatable_pvs_fail_with_upstreams_text() {
        let cases = [
            (
                json!({"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/bad"}, "accessModes": ["ReadWriteOnce"]}),
                "failed to translate in tree pv to CSI: failed to translate Kubernetes ID to EBS Volume ID Invalid format for AWS volume (aws://us-east-1a/bad)",
            ),
            (
                json!({"azureDisk": {"diskName": "d1", "diskURI": "https://a/vhds/d1.vhd", "kind": "Shared"}}),
                "failed to translate in tree pv to CSI: kind(Shared) is not supported in csi migration",
            ),
            (
                json!({"azureFile": {"secretName": "s", "shareName": "sh"}}),
                "failed to translate in tree pv to CSI: could not find a secret namespace in PersistentVolumeSource or ClaimRef",
            ),
            (
                json!({"nfs": {"server": "s", "path": "/"}}),
                "pv spec contained non-csi source that was not migrated",
            ),
        ];
        for (spec, want) in cases {
            let p = in_tree_pv("pv", spec, json!({}));
            let plan = attach_plan(&va("pv"), DRIVER, &caps(), "", Some(&p), None).unwrap();
            assert_eq!(plan.inputs.unwrap_err(), want);
            assert_eq!(
                detach_plan(&va("pv"), DRIVER, Some(&p), None).unwrap_err(),
                want
            );
        }
    }

    /// Checklist 29: an in-line spec is used as it is, without a PV, with `migrated` false.
    #[test]
    fn in_line_volumes_are_published_as_they_are() {
        let mut v = va("pv");
        v.spec.source.persistent_volume_name = None;
        v.spec.source.inline_volume_spec = pv("unused", &["ReadWriteOnce"]).spec;
        let csinode = csinode(&[(DRIVER, "node-id-a")]);
        let plan = attach_plan(&v, DRIVER, &caps(), "", None, Some(&csinode)).unwrap();
        assert_eq!(plan.pv_patch, None);
        let inputs = plan.inputs.unwrap();
        assert_eq!(
            (inputs.volume_id.as_str(), inputs.migrated),
            ("vol-1", false)
        );
    }

    /// Checklist 30: the reconciler looks a translated or in-line volume up under its handle
    /// repaired for the node (GCE PD's `UNSPECIFIED` parts from the node ID), any other as is.
    #[test]
    fn the_reconciler_repairs_translated_and_in_line_handles() {
        const NODE: &str = "projects/p1/zones/us-central1-a/instances/n1";
        let gce = in_tree_pv(
            "pv",
            json!({"gcePersistentDisk": {"pdName": "d1"}}),
            json!({}),
        );
        let src = Source::Pv("pv");
        let v = volume_spec(&src, Some(&gce), false).unwrap();
        assert_eq!(
            reconciled_handle(&src, &v, NODE).as_deref(),
            Ok("projects/p1/zones/us-central1-a/disks/d1")
        );
        let inline: PersistentVolumeSpec = serde_json::from_value(json!({"csi": {
            "driver": "pd.csi.storage.gke.io",
            "volumeHandle": "projects/UNSPECIFIED/zones/UNSPECIFIED/disks/d2"}}))
        .unwrap();
        let src = Source::Inline(&inline);
        let v = volume_spec(&src, None, false).unwrap();
        assert_eq!(
            reconciled_handle(&src, &v, NODE).as_deref(),
            Ok("projects/p1/zones/us-central1-a/disks/d2")
        );
        let csi = pv("pv", &["ReadWriteOnce"]);
        let src = Source::Pv("pv");
        let v = volume_spec(&src, Some(&csi), false).unwrap();
        assert_eq!(reconciled_handle(&src, &v, NODE).as_deref(), Ok("vol-1"));
        let short = in_tree_pv(
            "pv",
            json!({"gcePersistentDisk": {"pdName": "d1"}}),
            json!({}),
        );
        let v = volume_spec(&Source::Pv("pv"), Some(&short), false).unwrap();
        assert_eq!(
            reconciled_handle(&Source::Pv("pv"), &v, "n1").unwrap_err(),
            "Failed to repair volume handle for driver pd.csi.storage.gke.io: node handle has wrong number of elements; got 1, wanted 6 or more"
        );
    }
}
