//! Pure decisions of the snapshotter: which contents are its own, what a sync does with a
//! content, the CSI snapshot name, the CreateSnapshot parameters, the secret references, and
//! the texts of errors and events in upstream's words. Nothing here does I/O.

use std::collections::{BTreeMap, HashMap};

use plugreg_sidecar_kit::leader::sanitize_name;
use plugreg_sidecar_kit::snapshot::{
    ANN_BEING_CREATED, ANN_BEING_DELETED, ANN_DELETION_SECRET_NAME, ANN_DELETION_SECRET_NAMESPACE,
    ANN_GROUP_SNAPSHOT_HANDLE, VolumeSnapshotContent, VolumeSnapshotContentStatus,
};
use serde_json::{Value, json};
use tonic::Code;

/// The leader-election lock name of the snapshotters of `driver`, as upstream gives it to
/// csi-lib-utils: `external-snapshotter-leader-<driver>` with `/` turned into `-`, otherwise
/// not sanitised. The `LeaderElection` event comes from `<lock name>/<host name>`.
pub fn lock_name(driver: &str) -> String {
    format!("external-snapshotter-leader-{}", driver.replace('/', "-"))
}

/// The Lease of the snapshotters of `driver`: the [`lock_name`] with every character outside
/// `[a-zA-Z0-9-]` turned into `-` (csi-lib-utils' rule).
pub fn lease_name(driver: &str) -> String {
    sanitize_name(&lock_name(driver))
}

/// The CSI snapshot name of a content bound to the VolumeSnapshot `uid`: `<prefix>-<uid>`, or
/// with `uuid_length` N >= 0 the UID without dashes cut to N characters. Stable across
/// retries and restarts, so a re-sent CreateSnapshot is idempotent in the driver.
pub fn snapshot_name(prefix: &str, uid: &str, uuid_length: i64) -> String {
    match usize::try_from(uuid_length) {
        Ok(n) => {
            let dashless: String = uid.chars().filter(|&c| c != '-').collect();
            let cut: String = dashless.chars().take(n).collect();
            format!("{prefix}-{cut}")
        }
        Err(_) => format!("{prefix}-{uid}"),
    }
}

/// Whether `content` is this driver's (upstream's driver match): it has a source, its driver
/// is `driver`, and its class, if named and known (`class_driver`), is of `driver` too.
pub fn is_ours(content: &VolumeSnapshotContent, driver: &str, class_driver: Option<&str>) -> bool {
    let src = &content.spec.source;
    (src.volume_handle.is_some() || src.snapshot_handle.is_some())
        && content.spec.driver == driver
        && class_driver.is_none_or(|d| d == driver)
}

fn annotation<'a>(content: &'a VolumeSnapshotContent, key: &str) -> Option<&'a str> {
    content
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// Whether the being-created annotation is on `content`.
pub fn being_created(content: &VolumeSnapshotContent) -> bool {
    annotation(content, ANN_BEING_CREATED).is_some()
}

/// Whether `content` is a member of a group snapshot (never CreateSnapshot for it).
pub fn group_member(content: &VolumeSnapshotContent) -> bool {
    annotation(content, ANN_GROUP_SNAPSHOT_HANDLE).is_some()
}

/// What one sync does with a content (upstream's decision order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// DeleteSnapshot (by policy), clear the status, remove the finalizer.
    Delete,
    /// The first CreateSnapshot (failures are `SnapshotCreationFailed`).
    Create,
    /// Ready: remove the being-created annotation if it is still there.
    Ready,
    /// A pre-provisioned content's (or a group member's) status from ListSnapshots.
    CheckStatic,
    /// CreateSnapshot again until the snapshot is ready (failures are
    /// `SnapshotContentCheckandUpdateFailed`).
    CreateAgain,
    /// Nothing to do.
    Nothing,
}

/// Whether a deleted content may be handled now: an unbound pre-provisioned one at once;
/// otherwise never while a create may be in flight (the being-created annotation), and only
/// once the snapshot-controller has marked it (being-deleted annotation: its VolumeSnapshot is
/// going away). A content deleted by hand while its VolumeSnapshot exists waits.
pub fn should_delete(content: &VolumeSnapshotContent) -> bool {
    if content.metadata.deletion_timestamp.is_none() {
        return false;
    }
    let unbound = content
        .spec
        .volume_snapshot_ref
        .uid
        .as_deref()
        .is_none_or(str::is_empty);
    if content.spec.source.snapshot_handle.is_some() && unbound {
        return true;
    }
    if being_created(content) {
        return false;
    }
    annotation(content, ANN_BEING_DELETED).is_some()
}

/// What a sync of `content` does.
pub fn action(content: &VolumeSnapshotContent) -> Action {
    if should_delete(content) {
        return Action::Delete;
    }
    let member = group_member(content);
    if content.spec.source.volume_handle.is_some() && content.status.is_none() && !member {
        return Action::Create;
    }
    let status = content.status.as_ref();
    if status.and_then(|s| s.ready_to_use) == Some(true) {
        return Action::Ready;
    }
    let member_with_handles = member
        && status.is_some_and(|s| {
            s.volume_group_snapshot_handle.is_some() && s.snapshot_handle.is_some()
        });
    if content.spec.source.snapshot_handle.is_some() || member_with_handles {
        return Action::CheckStatic;
    }
    if !member {
        return Action::CreateAgain;
    }
    Action::Nothing
}

/// The reserved parameter prefix.
pub const RESERVED_PREFIX: &str = "csi.storage.k8s.io/";
/// The reserved keys a class may carry (they name secrets and are never sent to the driver).
const RESERVED_KEYS: [&str; 8] = [
    "csi.storage.k8s.io/snapshotter-secret-name",
    "csi.storage.k8s.io/snapshotter-secret-namespace",
    "csi.storage.k8s.io/snapshotter-list-secret-name",
    "csi.storage.k8s.io/snapshotter-list-secret-namespace",
    "csi.storage.k8s.io/group-snapshotter-secret-name",
    "csi.storage.k8s.io/group-snapshotter-secret-namespace",
    "csi.storage.k8s.io/group-snapshotter-get-secret-name",
    "csi.storage.k8s.io/group-snapshotter-get-secret-namespace",
];
/// `--extra-create-metadata`: the VolumeSnapshot's name.
pub const META_SNAPSHOT_NAME: &str = "csi.storage.k8s.io/volumesnapshot/name";
/// `--extra-create-metadata`: the VolumeSnapshot's namespace.
pub const META_SNAPSHOT_NAMESPACE: &str = "csi.storage.k8s.io/volumesnapshot/namespace";
/// `--extra-create-metadata`: the content's name.
pub const META_CONTENT_NAME: &str = "csi.storage.k8s.io/volumesnapshotcontent/name";

/// The class parameters without the reserved keys; an unknown key with the reserved prefix is
/// upstream's error.
pub fn strip_parameters(
    params: &BTreeMap<String, String>,
) -> Result<HashMap<String, String>, String> {
    let mut out = HashMap::new();
    for (k, v) in params {
        if k.starts_with(RESERVED_PREFIX) {
            if RESERVED_KEYS.contains(&k.as_str()) {
                continue;
            }
            return Err(format!(
                "failed to remove CSI Parameters of prefixed keys: found unknown parameter key {k:?} with reserved namespace {RESERVED_PREFIX}"
            ));
        }
        out.insert(k.clone(), v.clone());
    }
    Ok(out)
}

/// Adds the `--extra-create-metadata` keys for `content`.
pub fn add_metadata(params: &mut HashMap<String, String>, content: &VolumeSnapshotContent) {
    let r = &content.spec.volume_snapshot_ref;
    params.insert(
        META_SNAPSHOT_NAME.into(),
        r.name.clone().unwrap_or_default(),
    );
    params.insert(
        META_SNAPSHOT_NAMESPACE.into(),
        r.namespace.clone().unwrap_or_default(),
    );
    params.insert(
        META_CONTENT_NAME.into(),
        content.metadata.name.clone().unwrap_or_default(),
    );
}

/// A Secret to read: (namespace, name).
pub type SecretRef = (String, String);

/// The secret of CreateSnapshot and DeleteSnapshot, from the deletion-secret annotations the
/// snapshot-controller resolved: none unless both are there; either empty is an error.
pub fn annotated_secret(content: &VolumeSnapshotContent) -> Result<Option<SecretRef>, String> {
    let name = annotation(content, ANN_DELETION_SECRET_NAME);
    let namespace = annotation(content, ANN_DELETION_SECRET_NAMESPACE);
    match (namespace, name) {
        (Some(ns), Some(n)) if !ns.is_empty() && !n.is_empty() => {
            Ok(Some((ns.to_owned(), n.to_owned())))
        }
        (Some(_), Some(_)) => Err(format!(
            "cannot retrieve secrets for snapshot content {:?}, err: secret name or namespace not specified",
            name_of(content)
        )),
        _ => Ok(None),
    }
}

/// The ListSnapshots secret of a pre-provisioned content, from its class parameters
/// `csi.storage.k8s.io/snapshotter-list-secret-{name,namespace}` (only the
/// `${volumesnapshotcontent.name}` token is known there).
pub fn list_secret(
    params: &BTreeMap<String, String>,
    content_name: &str,
) -> Result<Option<SecretRef>, String> {
    class_secret(params, &LIST_SECRET, content_name)
}

/// Where a class names a secret, and the one token its templates know.
pub struct SecretKeys {
    /// The parameter naming the Secret.
    pub name: &'static str,
    /// The parameter naming its namespace.
    pub namespace: &'static str,
    /// Upstream's word for it in errors (`SnapshotterList`, `GroupSnapshotterGet`).
    pub kind: &'static str,
    /// The token a template may hold (`volumesnapshotcontent.name`).
    pub token: &'static str,
}

/// The ListSnapshots secret of a pre-provisioned content.
pub const LIST_SECRET: SecretKeys = SecretKeys {
    name: "csi.storage.k8s.io/snapshotter-list-secret-name",
    namespace: "csi.storage.k8s.io/snapshotter-list-secret-namespace",
    kind: "SnapshotterList",
    token: "volumesnapshotcontent.name",
};

/// The secret `keys` name in a class's `params`, its templates resolved for `content_name`.
pub fn class_secret(
    params: &BTreeMap<String, String>,
    keys: &SecretKeys,
    content_name: &str,
) -> Result<Option<SecretRef>, String> {
    let name = params.get(keys.name);
    let namespace = params.get(keys.namespace);
    let kind = keys.kind;
    let wrap = |e: String| format!("failed to get name and namespace template from params: {e}");
    let (ns_tpl, name_tpl) = match (namespace, name) {
        (None, None) => return Ok(None),
        (Some(ns), Some(n)) => (ns, n),
        _ => {
            return Err(wrap(format!(
                "either name and namespace for {kind} secrets specified, Both must be specified"
            )));
        }
    };
    if ns_tpl.is_empty() || name_tpl.is_empty() {
        return Err(wrap(format!(
            "{kind} secrets specified in parameters but value of either namespace or name is empty"
        )));
    }
    let ns = expand(ns_tpl, keys.token, content_name)?;
    if !is_dns1123_label(&ns) {
        return Err(if &ns == ns_tpl {
            format!("{ns_tpl:?} is not a valid namespace name")
        } else {
            format!("{ns_tpl:?} resolved to {ns:?} which is not a valid namespace name")
        });
    }
    let name = expand(name_tpl, keys.token, content_name)?;
    if !is_dns1123_subdomain(&name) {
        return Err(if &name == name_tpl {
            format!("{name_tpl:?} is not a valid secret name")
        } else {
            format!("{name_tpl:?} resolved to {name:?} which is not a valid secret name")
        });
    }
    Ok(Some((ns, name)))
}

/// Go's `os.Expand` of `tpl` with the one token `token`, standing for `value`.
fn expand(tpl: &str, token_name: &str, value: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut bad = Vec::new();
    let mut rest = tpl;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let (token, tail) = if let Some(body) = after.strip_prefix('{') {
            match body.find('}') {
                Some(end) => (&body[..end], &body[end + 1..]),
                None => ("", ""),
            }
        } else {
            let end = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            (&after[..end], &after[end..])
        };
        if token == token_name {
            out.push_str(value);
        } else {
            bad.push(format!("{token:?}"));
        }
        rest = tail;
    }
    out.push_str(rest);
    if bad.is_empty() {
        Ok(out)
    } else {
        Err(format!(
            "error resolving value {tpl:?}: invalid tokens: [{}]",
            bad.join(" ")
        ))
    }
}

fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    let ok = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= 63
        && ok(&b[0])
        && ok(&b[b.len() - 1])
        && b.iter().all(|c| ok(c) || *c == b'-')
}

fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns1123_label)
}

/// A failed CreateSnapshot may still be going on in the driver (the annotation stays and the
/// same call is sent again): these codes, and every failure without a gRPC status.
pub fn may_be_in_progress(code: Option<Code>) -> bool {
    match code {
        None => true,
        Some(c) => matches!(
            c,
            Code::Cancelled
                | Code::DeadlineExceeded
                | Code::ResourceExhausted
                | Code::Aborted
                | Code::Unavailable
        ),
    }
}

/// Go's `%q` of a string (`strconv.Quote`), for the texts upstream prints with it.
pub use plugreg_sidecar_kit::gotext::quote as go_quote;

fn name_of(content: &VolumeSnapshotContent) -> &str {
    content.metadata.name.as_deref().unwrap_or_default()
}

/// What the driver said about a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taken {
    /// The CSI snapshot ID.
    pub handle: String,
    /// Unix nanoseconds (0 when the driver gave none, as upstream stores).
    pub creation_time: i64,
    /// Bytes (written only when > 0).
    pub size: i64,
    /// Ready to restore from.
    pub ready: bool,
    /// The group snapshot's ID (written only when not empty).
    pub group_handle: String,
}

/// The status after `taken` (upstream's status update): a new status when there is none;
/// else each of handle, creation time, size and group handle only where absent, `readyToUse`
/// when absent or different, the error cleared once ready. `None`: nothing changes, no write.
pub fn status_after(
    current: Option<&VolumeSnapshotContentStatus>,
    taken: &Taken,
) -> Option<VolumeSnapshotContentStatus> {
    let size = (taken.size > 0).then_some(taken.size);
    let group = (!taken.group_handle.is_empty()).then(|| taken.group_handle.clone());
    let Some(cur) = current else {
        return Some(VolumeSnapshotContentStatus {
            snapshot_handle: Some(taken.handle.clone()),
            creation_time: Some(taken.creation_time),
            ready_to_use: Some(taken.ready),
            restore_size: size,
            error: None,
            volume_group_snapshot_handle: group,
        });
    };
    let mut next = cur.clone();
    next.snapshot_handle
        .get_or_insert_with(|| taken.handle.clone());
    next.creation_time.get_or_insert(taken.creation_time);
    if next.restore_size.is_none() {
        next.restore_size = size;
    }
    if next.volume_group_snapshot_handle.is_none() {
        next.volume_group_snapshot_handle = group;
    }
    if next.ready_to_use != Some(taken.ready) {
        next.ready_to_use = Some(taken.ready);
        if taken.ready {
            next.error = None;
        }
    }
    (&next != cur).then_some(next)
}

/// The status patch (a JSON merge patch of the status subresource) that writes `next`, with
/// explicit nulls for what it drops of `current`.
pub fn status_patch(next: &VolumeSnapshotContentStatus) -> Value {
    let mut status = serde_json::to_value(next).unwrap_or_else(|_| json!({}));
    if let Value::Object(o) = &mut status
        && next.error.is_none()
    {
        o.insert("error".into(), Value::Null);
    }
    json!({ "status": status })
}

/// The error status patch, unless `current` already holds `message` (then nothing is written
/// and no event recorded).
pub fn error_patch(
    current: Option<&VolumeSnapshotContentStatus>,
    message: &str,
    now_rfc3339: &str,
) -> Option<Value> {
    error_patch_over(current.and_then(|s| s.error.as_ref()), message, now_rfc3339)
}

/// [`error_patch`] of any status with this `error` (a group content's too).
pub fn error_patch_over(
    current: Option<&plugreg_sidecar_kit::snapshot::SnapshotError>,
    message: &str,
    now_rfc3339: &str,
) -> Option<Value> {
    let same = current.and_then(|e| e.message.as_deref()) == Some(message);
    (!same).then(|| {
        json!({"status": {
            "readyToUse": false,
            "error": {"time": now_rfc3339, "message": message},
        }})
    })
}

/// The status patch after a DeleteSnapshot: handle, readiness, time and size gone (the error
/// and the group handle stay).
pub fn cleared_status_patch() -> Value {
    json!({"status": {
        "snapshotHandle": null, "readyToUse": null, "creationTime": null, "restoreSize": null,
    }})
}

/// Event reason of a failed first create.
pub const REASON_CREATE_FAILED: &str = "SnapshotCreationFailed";
/// Event reason of a failed later check (a re-sent create, a ListSnapshots).
pub const REASON_CHECK_FAILED: &str = "SnapshotContentCheckandUpdateFailed";
/// Event reason of a failed deletion.
pub const REASON_DELETE_ERROR: &str = "SnapshotDeleteError";

/// The event reason and the message (also `status.error.message`) of a failed `action`.
pub fn failure(action: Action, err: &str) -> (&'static str, String) {
    if action == Action::Create {
        (
            REASON_CREATE_FAILED,
            format!("Failed to create snapshot: {err}"),
        )
    } else {
        (
            REASON_CHECK_FAILED,
            format!("Failed to check and update snapshot content: {err}"),
        )
    }
}

/// A hash of what makes a changed content worth a sync (upstream's
/// `ShouldEnqueueContentChange`): everything but the resource version, the status, the
/// finalizers, managed fields and the being-created annotation. The sidecar's own writes
/// leave it unchanged.
pub fn fingerprint(content: &VolumeSnapshotContent) -> u64 {
    fingerprint_of(&content.metadata, &content.spec, ANN_BEING_CREATED)
}

/// [`fingerprint`] of any object's `meta` and `spec`, leaving out the annotation
/// `being_created` (a group content's too).
pub fn fingerprint_of(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: &impl serde::Serialize,
    being_created: &str,
) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut annotations = meta.annotations.clone().unwrap_or_default();
    annotations.remove(being_created);
    annotations.hash(&mut h);
    meta.labels.hash(&mut h);
    meta.deletion_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
        .hash(&mut h);
    meta.uid.hash(&mut h);
    serde_json::to_string(spec).unwrap_or_default().hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use plugreg_sidecar_kit::snapshot::SnapshotError;

    fn content(v: Value) -> VolumeSnapshotContent {
        serde_json::from_value(v).unwrap()
    }

    fn dynamic() -> VolumeSnapshotContent {
        content(json!({
            "metadata": {"name": "snapcontent-1"},
            "spec": {"driver": "d", "deletionPolicy": "Delete",
                     "source": {"volumeHandle": "vol-1"},
                     "volumeSnapshotRef": {"name": "s", "namespace": "ns", "uid": "u-1"},
                     "volumeSnapshotClassName": "c"}
        }))
    }

    #[test]
    fn the_lease_and_the_snapshot_name_follow_upstream() {
        assert_eq!(
            lease_name("hostpath.csi.k8s.io"),
            "external-snapshotter-leader-hostpath-csi-k8s-io"
        );
        assert_eq!(lease_name("a/b_"), "external-snapshotter-leader-a-b-X");
        assert_eq!(lock_name("a/b_"), "external-snapshotter-leader-a-b_");
        assert_eq!(
            lock_name("hostpath.csi.k8s.io"),
            "external-snapshotter-leader-hostpath.csi.k8s.io"
        );
        let uid = "6f1d2c3b-aaaa-bbbb-cccc-0123456789ab";
        assert_eq!(
            snapshot_name("snapshot", uid, -1),
            format!("snapshot-{uid}")
        );
        assert_eq!(snapshot_name("snap", uid, 8), "snap-6f1d2c3b");
        assert_eq!(snapshot_name("snap", uid, 10), "snap-6f1d2c3baa");
        assert_eq!(snapshot_name("snap", uid, 0), "snap-");
    }

    #[test]
    fn only_the_drivers_contents_with_a_source_and_a_matching_class_are_ours() {
        let c = dynamic();
        assert!(is_ours(&c, "d", None));
        assert!(is_ours(&c, "d", Some("d")));
        assert!(!is_ours(&c, "d", Some("other")));
        assert!(!is_ours(&c, "e", None));
        let mut no_source = c.clone();
        no_source.spec.source = Default::default();
        assert!(!is_ours(&no_source, "d", None));
    }

    #[test]
    fn the_decision_order_is_upstreams() {
        let mut c = dynamic();
        assert_eq!(action(&c), Action::Create);
        c.status = Some(VolumeSnapshotContentStatus {
            ready_to_use: Some(false),
            ..Default::default()
        });
        assert_eq!(action(&c), Action::CreateAgain);
        c.status.as_mut().unwrap().ready_to_use = Some(true);
        assert_eq!(action(&c), Action::Ready);
        // Deleted by hand: waits for the controller's annotation.
        c.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        assert_eq!(action(&c), Action::Ready);
        c.metadata.annotations = Some([(ANN_BEING_DELETED.to_owned(), "yes".to_owned())].into());
        assert_eq!(action(&c), Action::Delete);
        // A create that may be in flight blocks the deletion.
        c.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(ANN_BEING_CREATED.into(), "yes".into());
        assert_eq!(action(&c), Action::Ready);
        // An unbound pre-provisioned content goes at once.
        let mut s = content(json!({
            "metadata": {"name": "static"},
            "spec": {"driver": "d", "deletionPolicy": "Retain",
                     "source": {"snapshotHandle": "h"},
                     "volumeSnapshotRef": {"name": "s", "namespace": "ns"}}
        }));
        assert_eq!(action(&s), Action::CheckStatic);
        s.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        assert_eq!(action(&s), Action::Delete);
    }

    #[test]
    fn reserved_parameters_are_stripped_and_unknown_ones_refused() {
        let p: BTreeMap<String, String> = [
            ("a", "1"),
            ("csi.storage.k8s.io/snapshotter-secret-name", "s"),
            ("csi.storage.k8s.io/snapshotter-list-secret-namespace", "n"),
        ]
        .iter()
        .map(|(k, v)| ((*k).into(), (*v).into()))
        .collect();
        let out = strip_parameters(&p).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out["a"], "1");
        let bad: BTreeMap<String, String> =
            [("csi.storage.k8s.io/bogus".to_owned(), "x".to_owned())].into();
        assert_eq!(
            strip_parameters(&bad).unwrap_err(),
            "failed to remove CSI Parameters of prefixed keys: found unknown parameter key \"csi.storage.k8s.io/bogus\" with reserved namespace csi.storage.k8s.io/"
        );
        let mut m = out;
        add_metadata(&mut m, &dynamic());
        assert_eq!(m[META_SNAPSHOT_NAME], "s");
        assert_eq!(m[META_SNAPSHOT_NAMESPACE], "ns");
        assert_eq!(m[META_CONTENT_NAME], "snapcontent-1");
    }

    #[test]
    fn secrets_come_from_the_annotations_and_the_list_template() {
        let mut c = dynamic();
        assert_eq!(annotated_secret(&c), Ok(None));
        c.metadata.annotations = Some(
            [
                (ANN_DELETION_SECRET_NAME.to_owned(), "sec".to_owned()),
                (ANN_DELETION_SECRET_NAMESPACE.to_owned(), "ns".to_owned()),
            ]
            .into(),
        );
        assert_eq!(annotated_secret(&c), Ok(Some(("ns".into(), "sec".into()))));
        c.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(ANN_DELETION_SECRET_NAME.into(), String::new());
        assert!(
            annotated_secret(&c)
                .unwrap_err()
                .contains("secret name or namespace not specified")
        );

        let p = |ns: &str, n: &str| -> BTreeMap<String, String> {
            [
                (
                    "csi.storage.k8s.io/snapshotter-list-secret-namespace".to_owned(),
                    ns.to_owned(),
                ),
                (
                    "csi.storage.k8s.io/snapshotter-list-secret-name".to_owned(),
                    n.to_owned(),
                ),
            ]
            .into()
        };
        assert_eq!(
            list_secret(&p("kube-system", "${volumesnapshotcontent.name}-s"), "c1"),
            Ok(Some(("kube-system".into(), "c1-s".into())))
        );
        assert_eq!(
            list_secret(&p("ns", "${volumesnapshot.name}"), "c1").unwrap_err(),
            "error resolving value \"${volumesnapshot.name}\": invalid tokens: [\"volumesnapshot.name\"]"
        );
        assert_eq!(
            list_secret(&p("Bad_NS", "x"), "c1").unwrap_err(),
            "\"Bad_NS\" is not a valid namespace name"
        );
        assert_eq!(list_secret(&BTreeMap::new(), "c1"), Ok(None));
    }

    #[test]
    fn in_progress_codes_keep_the_annotation() {
        for c in [
            Code::Cancelled,
            Code::DeadlineExceeded,
            Code::ResourceExhausted,
            Code::Aborted,
            Code::Unavailable,
        ] {
            assert!(may_be_in_progress(Some(c)));
        }
        assert!(may_be_in_progress(None));
        assert!(!may_be_in_progress(Some(Code::InvalidArgument)));
        assert!(!may_be_in_progress(Some(Code::Internal)));
        assert_eq!(go_quote("a \"b\" \\"), "\"a \\\"b\\\" \\\\\"");
    }

    #[test]
    fn the_status_is_written_only_where_it_changes() {
        let taken = Taken {
            handle: "h".into(),
            creation_time: 5,
            size: 0,
            ready: false,
            group_handle: String::new(),
        };
        let first = status_after(None, &taken).unwrap();
        assert_eq!(first.restore_size, None);
        assert_eq!(first.ready_to_use, Some(false));
        assert_eq!(status_after(Some(&first), &taken), None);
        let mut with_error = first.clone();
        with_error.error = Some(SnapshotError {
            time: None,
            message: Some("m".into()),
        });
        let ready = Taken {
            ready: true,
            size: 10,
            ..taken
        };
        let next = status_after(Some(&with_error), &ready).unwrap();
        assert_eq!(next.ready_to_use, Some(true));
        assert_eq!(next.restore_size, Some(10));
        assert_eq!(next.error, None);
        assert_eq!(status_patch(&next)["status"]["error"], Value::Null);
        assert!(error_patch(Some(&with_error), "m", "t").is_none());
        assert!(error_patch(Some(&with_error), "n", "t").is_some());
    }

    #[test]
    fn own_writes_do_not_change_the_fingerprint() {
        let c = dynamic();
        let mut mine = c.clone();
        mine.metadata.resource_version = Some("9".into());
        mine.metadata.finalizers = Some(vec!["f".into()]);
        mine.metadata.annotations = Some([(ANN_BEING_CREATED.to_owned(), "yes".to_owned())].into());
        mine.status = Some(Default::default());
        assert_eq!(fingerprint(&c), fingerprint(&mine));
        let mut labelled = c.clone();
        labelled.metadata.labels = Some([("a".to_owned(), "b".to_owned())].into());
        assert_ne!(fingerprint(&c), fingerprint(&labelled));
    }
}
