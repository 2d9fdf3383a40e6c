//! Which claims to provision and the CreateVolumeRequest for one (`docs/upstream/upstream-external-provisioner.md`
//! §6 and §7): the volume name, size, capabilities, parameters, secrets and topology, exactly as
//! external-provisioner v6.3.0 decides them. Pure: the controller passes in the claim, its class
//! and the watch caches, and does the I/O (reading the provisioner secret, calling the driver).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use plugreg_proto::csi::v1::{
    CapacityRange, CreateVolumeRequest, VolumeCapability,
    volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode},
};
use plugreg_sidecar_kit::migration;

use crate::classify::ProvisionError;
use crate::quantity;
use crate::secrets::{self, PvSecrets, SecretRef, go_quote};
use crate::topology::{self, TopologySource};

/// The claim annotation naming its provisioner (set by kube-controller-manager from 1.23).
pub const ANN_STORAGE_PROVISIONER: &str = "volume.kubernetes.io/storage-provisioner";
/// The older claim annotation naming its provisioner (the only one 1.20-1.22 set).
pub const ANN_BETA_STORAGE_PROVISIONER: &str = "volume.beta.kubernetes.io/storage-provisioner";
/// The claim annotation of CSI migration naming the CSI driver.
pub const ANN_MIGRATED_TO: &str = "pv.kubernetes.io/migrated-to";
/// The node the scheduler chose for a WaitForFirstConsumer claim.
pub const ANN_SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
/// The alpha spelling of [`ANN_SELECTED_NODE`], read as a fallback.
pub const ANN_ALPHA_SELECTED_NODE: &str = "volume.alpha.kubernetes.io/selected-node";
/// The beta annotation naming the claim's class; it wins over `spec.storageClassName`.
pub const ANN_BETA_STORAGE_CLASS: &str = "volume.beta.kubernetes.io/storage-class";
/// The text of the Normal `Provisioning` event for a claim left to an external populator.
pub const POPULATOR_EVENT: &str = "Assuming an external populator will provision the volume";

const PREFIX: &str = "csi.storage.k8s.io/";
const FSTYPE_KEY: &str = "csi.storage.k8s.io/fstype";
/// The only `csi.storage.k8s.io/` keys a StorageClass may hold; they never reach the driver.
const RESERVED_KEYS: [&str; 17] = [
    "fstype",
    "secret-name",
    "secret-namespace",
    "provisioner-secret-name",
    "provisioner-secret-namespace",
    "controller-publish-secret-name",
    "controller-publish-secret-namespace",
    "node-stage-secret-name",
    "node-stage-secret-namespace",
    "node-publish-secret-name",
    "node-publish-secret-namespace",
    "controller-expand-secret-name",
    "controller-expand-secret-namespace",
    "node-expand-secret-name",
    "node-expand-secret-namespace",
    "controller-modify-secret-name",
    "controller-modify-secret-namespace",
];
/// The parameters `--extra-create-metadata` adds.
pub const PVC_NAME_KEY: &str = "csi.storage.k8s.io/pvc/name";
/// See [`PVC_NAME_KEY`].
pub const PVC_NAMESPACE_KEY: &str = "csi.storage.k8s.io/pvc/namespace";
/// See [`PVC_NAME_KEY`].
pub const PV_NAME_KEY: &str = "csi.storage.k8s.io/pv/name";

/// The settings (flags and driver capabilities) the request depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOptions {
    /// `--volume-name-prefix`.
    pub volume_name_prefix: String,
    /// `--volume-name-uuid-length` (-1: the whole UID).
    pub volume_name_uuid_length: i64,
    /// `--extra-create-metadata`.
    pub extra_create_metadata: bool,
    /// `--default-fstype`.
    pub default_fstype: String,
    /// `--controller-publish-readonly`.
    pub controller_publish_readonly: bool,
    /// `--strict-topology`.
    pub strict_topology: bool,
    /// `--immediate-topology`.
    pub immediate_topology: bool,
    /// The plugin reports VOLUME_ACCESSIBILITY_CONSTRAINTS and the `Topology` gate is on.
    pub topology: bool,
    /// The controller reports SINGLE_NODE_MULTI_WRITER.
    pub single_node_multi_writer: bool,
    /// The `VolumeAttributesClass` gate is on (and, unless set explicitly, the API server
    /// serves the v1 API).
    pub volume_attributes_class: bool,
    /// The controller reports MODIFY_VOLUME.
    pub modify_volume: bool,
    /// The controller reports CREATE_DELETE_SNAPSHOT (restores are possible).
    pub create_delete_snapshot: bool,
    /// The controller reports CLONE_VOLUME (clones are possible).
    pub clone_volume: bool,
    /// `--prevent-volume-mode-conversion`.
    pub prevent_volume_mode_conversion: bool,
}

impl Default for RequestOptions {
    /// Upstream's flag defaults, no topology, no SINGLE_NODE_MULTI_WRITER, no snapshots, no clones.
    fn default() -> Self {
        Self {
            volume_name_prefix: "pvc".into(),
            volume_name_uuid_length: -1,
            extra_create_metadata: false,
            default_fstype: String::new(),
            controller_publish_readonly: false,
            strict_topology: false,
            immediate_topology: true,
            topology: false,
            single_node_multi_writer: false,
            volume_attributes_class: true,
            modify_volume: false,
            create_delete_snapshot: false,
            clone_volume: false,
            prevent_volume_mode_conversion: true,
        }
    }
}

/// The volume (and PV) name of a claim (§7.2): `<prefix>-<uid>`, or with a UUID length N ≥ 0
/// `<prefix>-<uid without dashes, first N characters>`. Upstream panics for N > 32 or N < -1;
/// here N is clamped to the UID's length and any negative N means the whole UID.
pub fn volume_name(
    prefix: &str,
    uuid_length: i64,
    claim_uid: &str,
) -> Result<String, ProvisionError> {
    if prefix.is_empty() {
        return Err(ProvisionError::final_(
            "volume name prefix cannot be of length 0",
        ));
    }
    if claim_uid.is_empty() {
        return Err(ProvisionError::final_(
            "corrupted PVC object, it is missing UID",
        ));
    }
    let Ok(n) = usize::try_from(uuid_length) else {
        return Ok(format!("{prefix}-{claim_uid}"));
    };
    let short: String = claim_uid.chars().filter(|c| *c != '-').take(n).collect();
    Ok(format!("{prefix}-{short}"))
}

/// The value of the claim's annotation `key`, if it has one.
pub(crate) fn annotation<'a>(claim: &'a PersistentVolumeClaim, key: &str) -> Option<&'a str> {
    claim
        .metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

/// The claim's class: the beta annotation if present, else `spec.storageClassName`, else "".
pub fn claim_class(claim: &PersistentVolumeClaim) -> String {
    annotation(claim, ANN_BETA_STORAGE_CLASS)
        .map(str::to_owned)
        .or_else(|| claim.spec.as_ref()?.storage_class_name.clone())
        .unwrap_or_default()
}

/// The provisioner the claim names: the GA annotation if the key exists (even empty), else the
/// beta one.
pub fn storage_provisioner(claim: &PersistentVolumeClaim) -> Option<&str> {
    annotation(claim, ANN_STORAGE_PROVISIONER)
        .or_else(|| annotation(claim, ANN_BETA_STORAGE_PROVISIONER))
}

/// §6: whether this provisioner takes the claim. `Ok(false)`: skip silently (bound already,
/// another provisioner, a class of another provisioner, or WaitForFirstConsumer without a
/// selected node). `class` is the claim's class ([`claim_class`]) from the cache; `None` is
/// upstream's no-change error `storageClass "<name>" not found` (retried, no event).
///
/// Upstream's later silent stops that need no I/O are folded in: the class's `provisioner`
/// must be a known name (the driver, or the in-tree plugin it replaces when it is a
/// CSI-migration target: such a class is translated, [`csi_class`]).
pub fn should_provision(
    claim: &PersistentVolumeClaim,
    class: Option<&StorageClass>,
    driver: &str,
) -> Result<bool, ProvisionError> {
    let spec = claim.spec.as_ref();
    if spec
        .and_then(|s| s.volume_name.as_deref())
        .is_some_and(|v| !v.is_empty())
    {
        return Ok(false);
    }
    let in_tree = migration::in_tree_plugin(driver);
    let known = |name: &str| name == driver || Some(name) == in_tree;
    let named = storage_provisioner(claim);
    // The claim names the driver, or was migrated to it; the lib also wants the name it
    // carries to be a known one.
    let for_us = named == Some(driver) || annotation(claim, ANN_MIGRATED_TO) == Some(driver);
    if !for_us || !named.is_some_and(known) {
        return Ok(false);
    }
    let Some(class) = class else {
        return Err(ProvisionError::no_change(format!(
            "storageClass {} not found",
            go_quote(&claim_class(claim))
        )));
    };
    if !known(&class.provisioner) {
        return Ok(false);
    }
    if class.volume_binding_mode.as_deref() == Some("WaitForFirstConsumer") {
        return Ok(annotation(claim, ANN_SELECTED_NODE).is_some_and(|n| !n.is_empty()));
    }
    Ok(true)
}

/// The class a claim of `class` is provisioned with, and whether it is migrated: a class of the
/// in-tree plugin that `driver` replaces is translated to CSI (csi-translation-lib's rules;
/// upstream's final error `failed to translate storage class: ...` when it cannot be), any
/// other is used as it is.
pub fn csi_class<'a>(
    class: &'a StorageClass,
    driver: &str,
) -> Result<(Cow<'a, StorageClass>, bool), ProvisionError> {
    match migration::in_tree_plugin(driver) {
        Some(in_tree) if class.provisioner == in_tree => {
            tracing::debug!("translating storage class for in-tree plugin {in_tree} to CSI");
            migration::translate_storage_class(in_tree, class)
                .map(|c| (Cow::Owned(c), true))
                .map_err(|e| {
                    ProvisionError::final_(format!("failed to translate storage class: {e}"))
                })
        }
        _ => Ok((Cow::Borrowed(class), false)),
    }
}

/// The node the scheduler selected: the GA annotation, else the alpha one (the first key
/// present decides; an empty value is no node).
pub fn selected_node(claim: &PersistentVolumeClaim) -> Option<String> {
    annotation(claim, ANN_SELECTED_NODE)
        .or_else(|| annotation(claim, ANN_ALPHA_SELECTED_NODE))
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
}

/// The API group of a VolumeSnapshot data source.
pub const SNAPSHOT_GROUP: &str = "snapshot.storage.k8s.io";

/// What the claim's data source asks of the provisioner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// None: an empty volume.
    None,
    /// Restore the VolumeSnapshot `name` of `namespace` (the claim's).
    Snapshot {
        /// The VolumeSnapshot's name.
        name: String,
        /// Its namespace.
        namespace: String,
    },
    /// Clone the claim `name` of `namespace` (the claim's).
    Claim {
        /// The source claim's name.
        name: String,
        /// Its namespace.
        namespace: String,
    },
    /// A kind the provisioner does not handle: an external populator fills the volume. The
    /// controller emits Normal `Provisioning` [`POPULATOR_EVENT`] and stops (no requeue, no
    /// failure event).
    ExternalPopulator {
        /// The source's kind.
        kind: String,
    },
}

impl DataSource {
    /// The source's kind and name, as upstream names them in its errors.
    pub fn kind_and_name(&self) -> Option<(&'static str, &str)> {
        match self {
            DataSource::Snapshot { name, .. } => Some(("VolumeSnapshot", name)),
            DataSource::Claim { name, .. } => Some(("PersistentVolumeClaim", name)),
            DataSource::None | DataSource::ExternalPopulator { .. } => None,
        }
    }
}

/// The claim's data source, normalised as upstream does: `spec.dataSource` if set (in the
/// claim's namespace), else `spec.dataSourceRef` (whose own namespace needs the
/// CrossNamespaceVolumeDataSource gate, which this build does not support: a final error).
/// An empty name, or a VolumeSnapshot of another API group, is a final error; a
/// PersistentVolumeClaim is a clone whatever API group it names; any other kind is left to an
/// external populator.
pub fn data_source(claim: &PersistentVolumeClaim) -> Result<DataSource, ProvisionError> {
    let Some(spec) = claim.spec.as_ref() else {
        return Ok(DataSource::None);
    };
    let claim_ns = claim.metadata.namespace.clone().unwrap_or_default();
    let (kind, name, group) = if let Some(ds) = &spec.data_source {
        (ds.kind.as_str(), ds.name.as_str(), ds.api_group.as_deref())
    } else if let Some(dsr) = &spec.data_source_ref {
        if dsr.namespace.as_deref().is_some_and(|n| !n.is_empty()) {
            return Err(ProvisionError::final_(
                "dataSourceRef namespace specified but the CrossNamespaceVolumeDataSource feature is disabled",
            ));
        }
        (
            dsr.kind.as_str(),
            dsr.name.as_str(),
            dsr.api_group.as_deref(),
        )
    } else {
        return Ok(DataSource::None);
    };
    let claim_name = claim.metadata.name.as_deref().unwrap_or_default();
    if name.is_empty() {
        return Err(ProvisionError::final_(format!(
            "the PVC source not found for PVC {claim_name}"
        )));
    }
    match kind {
        "VolumeSnapshot" => {
            let group = group.unwrap_or_default();
            if group != SNAPSHOT_GROUP {
                return Err(ProvisionError::final_(format!(
                    "the PVC source does not belong to the right APIGroup. Expected {SNAPSHOT_GROUP}, Got {group}"
                )));
            }
            Ok(DataSource::Snapshot {
                name: name.to_owned(),
                namespace: claim_ns,
            })
        }
        "PersistentVolumeClaim" => Ok(DataSource::Claim {
            name: name.to_owned(),
            namespace: claim_ns,
        }),
        other => Ok(DataSource::ExternalPopulator {
            kind: other.to_owned(),
        }),
    }
}

/// The capability a data source needs (final errors with upstream's texts): a restore needs
/// CREATE_DELETE_SNAPSHOT (LIST_SNAPSHOTS does not matter), a clone CLONE_VOLUME.
pub fn check_source_capabilities(
    source: &DataSource,
    opts: &RequestOptions,
) -> Result<(), ProvisionError> {
    match source {
        DataSource::Snapshot { .. } if !opts.create_delete_snapshot => Err(ProvisionError::final_(
            "CSI driver does not support snapshot restore: controller CREATE_DELETE_SNAPSHOT capability is not reported",
        )),
        DataSource::Claim { .. } if !opts.clone_volume => Err(ProvisionError::final_(
            "CSI driver does not support clone operations: controller CLONE_VOLUME capability is not reported",
        )),
        _ => Ok(()),
    }
}

/// The per-attempt capability checks of §7.1 (upstream runs them before every provision).
pub fn check_capabilities(
    controller_service: bool,
    create_delete_volume: bool,
) -> Result<(), ProvisionError> {
    if !controller_service {
        return Err(ProvisionError::final_(
            "CSI driver does not support dynamic provisioning: plugin CONTROLLER_SERVICE capability is not reported",
        ));
    }
    if !create_delete_volume {
        return Err(ProvisionError::final_(
            "CSI driver does not support dynamic provisioning: controller CREATE_DELETE_VOLUME capability is not reported",
        ));
    }
    Ok(())
}

/// One claim access mode as a CSI access mode (§7.3, csi-lib-utils `accessmodes`).
pub fn csi_access_mode(mode: &str, single_node_multi_writer: bool) -> Result<Mode, ProvisionError> {
    Ok(match (mode, single_node_multi_writer) {
        ("ReadWriteOncePod", false) => Mode::SingleNodeWriter,
        ("ReadWriteOncePod", true) => Mode::SingleNodeSingleWriter,
        ("ReadWriteOnce", false) => Mode::SingleNodeWriter,
        ("ReadWriteOnce", true) => Mode::SingleNodeMultiWriter,
        ("ReadOnlyMany", _) => Mode::MultiNodeReaderOnly,
        ("ReadWriteMany", _) => Mode::MultiNodeMultiWriter,
        _ => {
            return Err(ProvisionError::final_(format!(
                "unsupported AccessMode combination: [{mode}]"
            )));
        }
    })
}

/// The fs type (§7.3): `csi.storage.k8s.io/fstype`, or the deprecated `fstype` key in any case
/// (with upstream's deprecation text in the returned warnings), else `default`.
pub fn fs_type(
    params: &BTreeMap<String, String>,
    default: &str,
) -> Result<(String, Vec<String>), ProvisionError> {
    let mut found = Vec::new();
    let mut warnings = Vec::new();
    for (k, v) in params {
        let deprecated = k.eq_ignore_ascii_case("fstype");
        if deprecated || k == FSTYPE_KEY {
            found.push(v);
        }
        if deprecated {
            warnings.push(secrets::deprecation_warning("fstype", FSTYPE_KEY));
        }
    }
    if found.len() > 1 {
        return Err(ProvisionError::final_(
            "fstype specified in parameters with both \"fstype\" and \"csi.storage.k8s.io/fstype\" keys",
        ));
    }
    let fs = found.first().map(|s| s.as_str()).unwrap_or_default();
    let fs = if fs.is_empty() { default } else { fs };
    Ok((fs.to_owned(), warnings))
}

/// The StorageClass parameters the driver sees (§7.4): every `csi.storage.k8s.io/` key removed,
/// each of which must be one of the 17 reserved keys.
pub fn driver_parameters(
    params: &BTreeMap<String, String>,
) -> Result<HashMap<String, String>, ProvisionError> {
    let mut out = HashMap::with_capacity(params.len());
    for (k, v) in params {
        match k.strip_prefix(PREFIX) {
            Some(rest) if RESERVED_KEYS.contains(&rest) => {}
            Some(_) => {
                return Err(ProvisionError::final_(format!(
                    "failed to strip CSI Parameters of prefixed keys: found unknown parameter key \"{k}\" with reserved namespace {PREFIX}"
                )));
            }
            None => {
                out.insert(k.clone(), v.clone());
            }
        }
    }
    Ok(out)
}

/// The claim's storage request in bytes, rounded up (0 when absent). Kubernetes validates the
/// quantity, so an error here means a corrupt object: final.
pub fn requested_bytes(claim: &PersistentVolumeClaim) -> Result<i64, ProvisionError> {
    let Some(q) = claim
        .spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
    else {
        return Ok(0);
    };
    quantity::parse_bytes(&q.0).map_err(|e| {
        ProvisionError::final_(format!("invalid storage request {}: {e}", go_quote(&q.0)))
    })
}

/// Whether the claim asks for a raw block volume.
pub fn is_block(claim: &PersistentVolumeClaim) -> bool {
    claim.spec.as_ref().and_then(|s| s.volume_mode.as_deref()) == Some("Block")
}

/// Everything one provisioning attempt needs, decided before the driver is called.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    /// The request; `secrets` is empty: the controller GETs [`Prepared::provisioner_secret`]
    /// and fills them in.
    pub request: CreateVolumeRequest,
    /// The PV (and volume) name.
    pub pv_name: String,
    /// The fs type (possibly empty; not used for Block).
    pub fs_type: String,
    /// `request.capacity_range.required_bytes`.
    pub requested_bytes: i64,
    /// The provisioner secret to read for CreateVolume (and DeleteVolume).
    pub provisioner_secret: Option<SecretRef>,
    /// Every resolved secret reference, for the PV.
    pub secrets: PvSecrets,
    /// Deprecation texts (upstream logs them with klog.Warning).
    pub warnings: Vec<String>,
    /// The selected node ([`selected_node`]); with topology, CreateVolume's
    /// RESOURCE_EXHAUSTED then reschedules.
    pub selected_node: Option<String>,
    /// The VolumeAttributesClass the claim names (with the gate on): the controller reads it
    /// and puts its parameters into `request.mutable_parameters`; the PV names it.
    pub volume_attributes_class: Option<String>,
}

/// Builds the CreateVolumeRequest of `claim` (§7) in upstream's order of checks: data source,
/// selector, name, fs type, size, capabilities, VolumeAttributesClass, topology (when
/// `opts.topology`), secrets, parameters.
///
/// Call [`data_source`] first: for a claim left to an external populator this returns upstream's
/// ignored-error text as a final error, which is not meant for a `ProvisioningFailed` event.
pub fn prepare(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    driver: &str,
    opts: &RequestOptions,
    topo: &dyn TopologySource,
) -> Result<Prepared, ProvisionError> {
    prepare_as(claim, class, driver, opts, topo, None)
}

/// [`prepare`] for the volume `name` instead of the one the flags give (a volume already
/// recorded keeps its name, whatever `--volume-name-prefix` says now).
pub fn prepare_as(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    driver: &str,
    opts: &RequestOptions,
    topo: &dyn TopologySource,
    name: Option<&str>,
) -> Result<Prepared, ProvisionError> {
    let source = data_source(claim)?;
    if let DataSource::ExternalPopulator { kind } = &source {
        return Err(ProvisionError::final_(format!(
            "data source ({kind}) is not handled by the provisioner, assuming an external populator will provision it"
        )));
    }
    check_source_capabilities(&source, opts)?;
    let spec = claim.spec.clone().unwrap_or_default();
    if spec.selector.is_some() {
        return Err(ProvisionError::final_("claim Selector is not supported"));
    }
    let uid = claim.metadata.uid.as_deref().unwrap_or_default();
    let pv_name = match name {
        Some(n) => n.to_owned(),
        None => volume_name(&opts.volume_name_prefix, opts.volume_name_uuid_length, uid)?,
    };

    let empty = BTreeMap::new();
    let params = class.parameters.as_ref().unwrap_or(&empty);
    let (fs_type, mut warnings) = fs_type(params, &opts.default_fstype)?;
    let requested_bytes = requested_bytes(claim)?;

    let access_type = if is_block(claim) {
        AccessType::Block(BlockVolume {})
    } else {
        AccessType::Mount(MountVolume {
            fs_type: fs_type.clone(),
            mount_flags: class.mount_options.clone().unwrap_or_default(),
            volume_mount_group: String::new(),
        })
    };
    let volume_capabilities = spec
        .access_modes
        .iter()
        .flatten()
        .map(|m| {
            Ok(VolumeCapability {
                access_mode: Some(AccessMode {
                    mode: csi_access_mode(m, opts.single_node_multi_writer)? as i32,
                }),
                access_type: Some(access_type.clone()),
            })
        })
        .collect::<Result<Vec<_>, ProvisionError>>()?;

    let volume_attributes_class = spec
        .volume_attributes_class_name
        .clone()
        .filter(|v| opts.volume_attributes_class && !v.is_empty());
    if volume_attributes_class.is_some() && !opts.modify_volume {
        return Err(ProvisionError::final_(
            "CSI driver does not support VolumeAttributesClass: controller MODIFY_VOLUME capability is not reported",
        ));
    }

    let selected = selected_node(claim);
    let accessibility_requirements = if opts.topology {
        topology::requirements(
            claim.metadata.name.as_deref().unwrap_or_default(),
            selected.as_deref(),
            class,
            driver,
            opts.strict_topology,
            opts.immediate_topology,
            topo,
        )?
    } else {
        None
    };

    let secrets = PvSecrets::resolve_all(params, &pv_name, claim)?;
    warnings.extend(secrets::deprecation_warnings(params));

    let mut parameters = driver_parameters(params)?;
    if opts.extra_create_metadata {
        let meta = &claim.metadata;
        parameters.insert(PVC_NAME_KEY.into(), meta.name.clone().unwrap_or_default());
        parameters.insert(
            PVC_NAMESPACE_KEY.into(),
            meta.namespace.clone().unwrap_or_default(),
        );
        parameters.insert(PV_NAME_KEY.into(), pv_name.clone());
    }

    let request = CreateVolumeRequest {
        name: pv_name.clone(),
        capacity_range: Some(CapacityRange {
            required_bytes: requested_bytes,
            limit_bytes: 0,
        }),
        volume_capabilities,
        parameters,
        secrets: HashMap::new(),
        volume_content_source: None,
        accessibility_requirements,
        mutable_parameters: HashMap::new(),
    };
    Ok(Prepared {
        request,
        pv_name,
        fs_type,
        requested_bytes,
        provisioner_secret: secrets.provisioner.clone(),
        secrets,
        warnings,
        selected_node: selected,
        volume_attributes_class,
    })
}

/// Puts the parameters of `class`, the VolumeAttributesClass `prepared` names, into its
/// CreateVolumeRequest's `mutable_parameters`, as upstream does; a class of another driver is a
/// final error with upstream's text.
pub fn apply_attributes_class(
    prepared: &mut Prepared,
    class: &plugreg_sidecar_kit::vac::VolumeAttributesClass,
    driver: &str,
) -> Result<(), ProvisionError> {
    if class.driver_name != driver {
        return Err(ProvisionError::final_(format!(
            "VAC {} referenced in PVC is for driver {} which does not match driver name {driver}",
            class.metadata.name.as_deref().unwrap_or_default(),
            class.driver_name
        )));
    }
    prepared.request.mutable_parameters = class
        .parameters
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::classify::State;
    use crate::topology::tests::{Cluster, DRIVER};
    use k8s_openapi::api::core::v1::{
        PersistentVolumeClaimSpec, TypedLocalObjectReference, TypedObjectReference,
        VolumeResourceRequirements,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};

    const UID: &str = "5f1e3b7c-9a2d-4e8f-b6c1-0d2e3f4a5b6c";

    fn claim() -> PersistentVolumeClaim {
        claim_with(UID)
    }

    /// The claim `apps/data` (uid `uid`) of class `fast` for 1 GiB, ReadWriteOnce, annotated for
    /// [`DRIVER`]: the fixture the request and PV tests share.
    pub(crate) fn claim_with(uid: &str) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some("data".into()),
                namespace: Some("apps".into()),
                uid: Some(uid.into()),
                annotations: Some(BTreeMap::from([(
                    ANN_STORAGE_PROVISIONER.to_owned(),
                    DRIVER.to_owned(),
                )])),
                ..Default::default()
            },
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                storage_class_name: Some("fast".into()),
                resources: Some(VolumeResourceRequirements {
                    requests: Some(BTreeMap::from([(
                        "storage".to_owned(),
                        Quantity("1Gi".into()),
                    )])),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The class `fast` of [`DRIVER`].
    pub(crate) fn class() -> StorageClass {
        StorageClass {
            metadata: ObjectMeta {
                name: Some("fast".into()),
                ..Default::default()
            },
            provisioner: DRIVER.into(),
            ..Default::default()
        }
    }

    fn with_params(kv: &[(&str, &str)]) -> StorageClass {
        StorageClass {
            parameters: Some(
                kv.iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..class()
        }
    }

    fn annotate(mut c: PersistentVolumeClaim, k: &str, v: &str) -> PersistentVolumeClaim {
        c.metadata
            .annotations
            .get_or_insert_default()
            .insert(k.into(), v.into());
        c
    }

    fn spec(c: &mut PersistentVolumeClaim) -> &mut PersistentVolumeClaimSpec {
        c.spec.get_or_insert_default()
    }

    fn prep(
        c: &PersistentVolumeClaim,
        sc: &StorageClass,
        opts: &RequestOptions,
    ) -> Result<Prepared, ProvisionError> {
        prepare(c, sc, DRIVER, opts, &Cluster::default())
    }

    fn final_err(c: &PersistentVolumeClaim, sc: &StorageClass, opts: &RequestOptions) -> String {
        let e = prep(c, sc, opts).unwrap_err();
        assert_eq!(e.state, State::Final, "{e}");
        e.message
    }

    // §7.2 name.

    #[test]
    fn name_is_prefix_and_full_uid_by_default() {
        assert_eq!(volume_name("pvc", -1, UID).unwrap(), format!("pvc-{UID}"));
        assert_eq!(
            prep(&claim(), &class(), &RequestOptions::default())
                .unwrap()
                .pv_name,
            format!("pvc-{UID}")
        );
    }

    #[test]
    fn uuid_length_cuts_the_dashless_uid_and_clamps() {
        assert_eq!(volume_name("vol", 8, UID).unwrap(), "vol-5f1e3b7c");
        assert_eq!(volume_name("vol", 0, UID).unwrap(), "vol-");
        assert_eq!(
            volume_name("vol", 32, UID).unwrap(),
            "vol-5f1e3b7c9a2d4e8fb6c10d2e3f4a5b6c"
        );
        assert_eq!(
            volume_name("vol", 33, UID).unwrap(),
            "vol-5f1e3b7c9a2d4e8fb6c10d2e3f4a5b6c"
        );
        assert_eq!(
            volume_name("vol", i64::MAX, UID).unwrap(),
            "vol-5f1e3b7c9a2d4e8fb6c10d2e3f4a5b6c"
        );
        assert_eq!(volume_name("vol", -7, UID).unwrap(), format!("vol-{UID}"));
    }

    #[test]
    fn empty_prefix_or_uid_is_final() {
        let e = volume_name("", -1, UID).unwrap_err();
        assert_eq!(
            (e.state, e.message.as_str()),
            (State::Final, "volume name prefix cannot be of length 0")
        );
        let e = volume_name("pvc", -1, "").unwrap_err();
        assert_eq!(
            (e.state, e.message.as_str()),
            (State::Final, "corrupted PVC object, it is missing UID")
        );
    }

    // §6 selection.

    #[test]
    fn ga_annotation_selects_even_when_beta_differs() {
        let c = annotate(claim(), ANN_BETA_STORAGE_PROVISIONER, "other");
        assert_eq!(should_provision(&c, Some(&class()), DRIVER), Ok(true));
    }

    #[test]
    fn beta_annotation_selects_without_the_ga_key() {
        let mut c = claim();
        c.metadata.annotations = None;
        let c = annotate(c, ANN_BETA_STORAGE_PROVISIONER, DRIVER);
        assert_eq!(should_provision(&c, Some(&class()), DRIVER), Ok(true));
    }

    #[test]
    fn empty_ga_key_hides_the_beta_annotation() {
        let c = annotate(
            annotate(claim(), ANN_STORAGE_PROVISIONER, ""),
            ANN_BETA_STORAGE_PROVISIONER,
            DRIVER,
        );
        assert_eq!(should_provision(&c, Some(&class()), DRIVER), Ok(false));
    }

    #[test]
    fn other_provisioner_or_none_is_skipped() {
        let c = annotate(claim(), ANN_STORAGE_PROVISIONER, "other.example.com");
        assert_eq!(should_provision(&c, Some(&class()), DRIVER), Ok(false));
        let mut c = claim();
        c.metadata.annotations = None;
        assert_eq!(should_provision(&c, Some(&class()), DRIVER), Ok(false));
    }

    #[test]
    fn migrated_to_alone_is_skipped_without_migration_support() {
        let c = annotate(
            annotate(claim(), ANN_STORAGE_PROVISIONER, "kubernetes.io/gce-pd"),
            ANN_MIGRATED_TO,
            DRIVER,
        );
        assert_eq!(should_provision(&c, Some(&class()), DRIVER), Ok(false));
    }

    /// CSI migration (§4.1): a migration target takes a claim of its in-tree plugin's class
    /// named for it (or migrated to it with the in-tree name), translating the class.
    #[test]
    fn a_migration_target_takes_in_tree_classes_translated() {
        const EBS: &str = "ebs.csi.aws.com";
        let in_tree = StorageClass {
            provisioner: "kubernetes.io/aws-ebs".into(),
            parameters: Some(BTreeMap::from([
                ("fsType".to_owned(), "xfs".to_owned()),
                ("zone".to_owned(), "us-east-1a".to_owned()),
            ])),
            ..class()
        };
        let for_ebs = |named: &str| annotate(claim(), ANN_STORAGE_PROVISIONER, named);
        let cases = [
            (
                "2: KCM names the CSI driver",
                for_ebs(EBS),
                &in_tree,
                EBS,
                true,
            ),
            (
                "older KCM: the in-tree name, migrated-to the driver",
                annotate(for_ebs("kubernetes.io/aws-ebs"), ANN_MIGRATED_TO, EBS),
                &in_tree,
                EBS,
                true,
            ),
            (
                "the in-tree name alone",
                for_ebs("kubernetes.io/aws-ebs"),
                &in_tree,
                EBS,
                false,
            ),
            ("3: another driver", for_ebs(EBS), &in_tree, DRIVER, false),
            (
                "another in-tree plugin's class",
                for_ebs(EBS),
                &StorageClass {
                    provisioner: "kubernetes.io/gce-pd".into(),
                    ..class()
                },
                EBS,
                false,
            ),
        ];
        for (what, c, sc, driver, want) in cases {
            assert_eq!(should_provision(&c, Some(sc), driver), Ok(want), "{what}");
        }

        let (translated, migrated) = csi_class(&in_tree, EBS).unwrap();
        assert!(migrated);
        assert_eq!(
            translated.parameters,
            Some(BTreeMap::from([(
                "csi.storage.k8s.io/fstype".to_owned(),
                "xfs".to_owned()
            )]))
        );
        assert!(translated.allowed_topologies.is_some());
        let (same, migrated) = csi_class(&in_tree, DRIVER).unwrap();
        assert!(!migrated && *same == in_tree);
        let conflict = StorageClass {
            allowed_topologies: Some(vec![Default::default()]),
            ..in_tree.clone()
        };
        let e = csi_class(&conflict, EBS).unwrap_err();
        assert_eq!(
            (e.state, e.message.as_str()),
            (
                State::Final,
                "failed to translate storage class: cannot simultaneously set allowed topologies and zone/zones parameters"
            )
        );
    }

    #[test]
    fn bound_claim_is_skipped() {
        let mut c = claim();
        spec(&mut c).volume_name = Some("pv-1".into());
        assert_eq!(should_provision(&c, Some(&class()), DRIVER), Ok(false));
    }

    #[test]
    fn missing_class_is_a_retried_error() {
        let e = should_provision(&claim(), None, DRIVER).unwrap_err();
        assert_eq!(
            (e.state, e.message.as_str()),
            (State::NoChange, "storageClass \"fast\" not found")
        );
        let c = annotate(claim(), ANN_BETA_STORAGE_CLASS, "old");
        assert_eq!(
            should_provision(&c, None, DRIVER).unwrap_err().message,
            "storageClass \"old\" not found"
        );
        assert_eq!(claim_class(&c), "old");
    }

    #[test]
    fn class_of_another_provisioner_is_skipped() {
        let sc = StorageClass {
            provisioner: "other".into(),
            ..class()
        };
        assert_eq!(should_provision(&claim(), Some(&sc), DRIVER), Ok(false));
    }

    #[test]
    fn wait_for_first_consumer_needs_a_selected_node() {
        let sc = StorageClass {
            volume_binding_mode: Some("WaitForFirstConsumer".into()),
            ..class()
        };
        assert_eq!(should_provision(&claim(), Some(&sc), DRIVER), Ok(false));
        let c = annotate(claim(), ANN_SELECTED_NODE, "");
        assert_eq!(should_provision(&c, Some(&sc), DRIVER), Ok(false));
        // The alpha key does not count here.
        let c = annotate(claim(), ANN_ALPHA_SELECTED_NODE, "n1");
        assert_eq!(should_provision(&c, Some(&sc), DRIVER), Ok(false));
        let c = annotate(claim(), ANN_SELECTED_NODE, "n1");
        assert_eq!(should_provision(&c, Some(&sc), DRIVER), Ok(true));
        let immediate = StorageClass {
            volume_binding_mode: Some("Immediate".into()),
            ..class()
        };
        assert_eq!(
            should_provision(&claim(), Some(&immediate), DRIVER),
            Ok(true)
        );
    }

    #[test]
    fn selected_node_reads_ga_then_alpha() {
        assert_eq!(selected_node(&claim()), None);
        assert_eq!(
            selected_node(&annotate(claim(), ANN_ALPHA_SELECTED_NODE, "a")),
            Some("a".into())
        );
        let both = annotate(
            annotate(claim(), ANN_ALPHA_SELECTED_NODE, "a"),
            ANN_SELECTED_NODE,
            "g",
        );
        assert_eq!(selected_node(&both), Some("g".into()));
    }

    // §7.1 preconditions.

    #[test]
    fn selector_is_final() {
        let mut c = claim();
        spec(&mut c).selector = Some(LabelSelector::default());
        assert_eq!(
            final_err(&c, &class(), &RequestOptions::default()),
            "claim Selector is not supported"
        );
    }

    #[test]
    fn capabilities_are_checked_in_order() {
        assert_eq!(
            check_capabilities(false, false).unwrap_err().message,
            "CSI driver does not support dynamic provisioning: plugin CONTROLLER_SERVICE capability is not reported"
        );
        let e = check_capabilities(true, false).unwrap_err();
        assert_eq!(
            (e.state, e.message.as_str()),
            (
                State::Final,
                "CSI driver does not support dynamic provisioning: controller CREATE_DELETE_VOLUME capability is not reported"
            )
        );
        assert_eq!(check_capabilities(true, true), Ok(()));
    }

    fn with_source(kind: &str, name: &str, group: Option<&str>) -> PersistentVolumeClaim {
        let mut c = claim();
        spec(&mut c).data_source = Some(TypedLocalObjectReference {
            kind: kind.into(),
            name: name.into(),
            api_group: group.map(Into::into),
        });
        c
    }

    #[test]
    fn snapshot_and_clone_sources_need_their_capability() {
        let opts = RequestOptions::default();
        let c = with_source("VolumeSnapshot", "snap", Some("snapshot.storage.k8s.io"));
        assert_eq!(
            data_source(&c),
            Ok(DataSource::Snapshot {
                name: "snap".into(),
                namespace: "apps".into()
            })
        );
        assert_eq!(
            final_err(&c, &class(), &opts),
            "CSI driver does not support snapshot restore: controller CREATE_DELETE_SNAPSHOT capability is not reported"
        );
        let snapshots = RequestOptions {
            create_delete_snapshot: true,
            ..RequestOptions::default()
        };
        // The content source is the controller's (it reads the snapshot); none here.
        let p = prep(&c, &class(), &snapshots).unwrap();
        assert_eq!(p.request.volume_content_source, None);
        // A claim of any API group is a clone.
        let c = with_source("PersistentVolumeClaim", "src", Some("whatever.example.com"));
        assert_eq!(
            data_source(&c),
            Ok(DataSource::Claim {
                name: "src".into(),
                namespace: "apps".into()
            })
        );
        assert_eq!(
            final_err(&c, &class(), &snapshots),
            "CSI driver does not support clone operations: controller CLONE_VOLUME capability is not reported"
        );
        let clones = RequestOptions {
            clone_volume: true,
            ..RequestOptions::default()
        };
        prep(&c, &class(), &clones).unwrap();
        // dataSourceRef alone, without a namespace: the claim's.
        let mut c = claim();
        spec(&mut c).data_source_ref = Some(TypedObjectReference {
            kind: "VolumeSnapshot".into(),
            name: "s".into(),
            api_group: Some(SNAPSHOT_GROUP.into()),
            namespace: Some(String::new()),
        });
        assert_eq!(
            data_source(&c),
            Ok(DataSource::Snapshot {
                name: "s".into(),
                namespace: "apps".into()
            })
        );
    }

    #[test]
    fn snapshot_of_the_wrong_group_and_nameless_sources_keep_upstreams_errors() {
        let opts = RequestOptions::default();
        let c = with_source("VolumeSnapshot", "snap", Some("example.com"));
        assert_eq!(
            final_err(&c, &class(), &opts),
            "the PVC source does not belong to the right APIGroup. Expected snapshot.storage.k8s.io, Got example.com"
        );
        let c = with_source("VolumeSnapshot", "", Some("snapshot.storage.k8s.io"));
        assert_eq!(
            final_err(&c, &class(), &opts),
            "the PVC source not found for PVC data"
        );
    }

    #[test]
    fn other_kinds_are_left_to_a_populator() {
        let c = with_source("Backup", "b1", Some("example.com"));
        assert_eq!(
            data_source(&c),
            Ok(DataSource::ExternalPopulator {
                kind: "Backup".into()
            })
        );
        assert_eq!(data_source(&claim()), Ok(DataSource::None));
        // The same through dataSourceRef alone.
        let mut c = claim();
        spec(&mut c).data_source_ref = Some(TypedObjectReference {
            kind: "Backup".into(),
            name: "b1".into(),
            api_group: Some("example.com".into()),
            namespace: None,
        });
        assert_eq!(
            data_source(&c),
            Ok(DataSource::ExternalPopulator {
                kind: "Backup".into()
            })
        );
        assert_eq!(
            final_err(&c, &class(), &RequestOptions::default()),
            "data source (Backup) is not handled by the provisioner, assuming an external populator will provision it"
        );
    }

    #[test]
    fn cross_namespace_data_source_ref_is_final() {
        let mut c = claim();
        spec(&mut c).data_source_ref = Some(TypedObjectReference {
            kind: "PersistentVolumeClaim".into(),
            name: "src".into(),
            api_group: None,
            namespace: Some("elsewhere".into()),
        });
        assert_eq!(
            final_err(&c, &class(), &RequestOptions::default()),
            "dataSourceRef namespace specified but the CrossNamespaceVolumeDataSource feature is disabled"
        );
    }

    #[test]
    fn volume_attributes_class_needs_modify_volume_and_its_driver() {
        let mut c = claim();
        spec(&mut c).volume_attributes_class_name = Some("gold".into());
        assert_eq!(
            final_err(&c, &class(), &RequestOptions::default()),
            "CSI driver does not support VolumeAttributesClass: controller MODIFY_VOLUME capability is not reported"
        );
        // With the gate off the class is not looked at.
        let off = RequestOptions {
            volume_attributes_class: false,
            ..RequestOptions::default()
        };
        let p = prep(&c, &class(), &off).unwrap();
        assert_eq!(p.volume_attributes_class, None);
        // With MODIFY_VOLUME: named, and its parameters go into mutable_parameters.
        let on = RequestOptions {
            modify_volume: true,
            ..RequestOptions::default()
        };
        let mut p = prep(&c, &class(), &on).unwrap();
        assert_eq!(p.volume_attributes_class.as_deref(), Some("gold"));
        assert!(p.request.mutable_parameters.is_empty());
        let mut vac = plugreg_sidecar_kit::vac::VolumeAttributesClass {
            driver_name: "other.csi.example.com".into(),
            parameters: BTreeMap::from([("iops".to_owned(), "300".to_owned())]),
            ..Default::default()
        };
        vac.metadata.name = Some("gold".into());
        let e = apply_attributes_class(&mut p, &vac, DRIVER).unwrap_err();
        assert_eq!(e.state, State::Final);
        assert_eq!(
            e.message,
            format!(
                "VAC gold referenced in PVC is for driver other.csi.example.com which does not match driver name {DRIVER}"
            )
        );
        vac.driver_name = DRIVER.into();
        apply_attributes_class(&mut p, &vac, DRIVER).unwrap();
        assert_eq!(
            p.request.mutable_parameters,
            HashMap::from([("iops".to_owned(), "300".to_owned())])
        );
    }

    // §7.2 capacity.

    #[test]
    fn capacity_is_the_request_rounded_up_and_limit_is_unset() {
        let opts = RequestOptions::default();
        let p = prep(&claim(), &class(), &opts).unwrap();
        assert_eq!(p.requested_bytes, 1 << 30);
        assert_eq!(
            p.request.capacity_range,
            Some(CapacityRange {
                required_bytes: 1 << 30,
                limit_bytes: 0
            })
        );
        let mut c = claim();
        spec(&mut c).resources.as_mut().unwrap().requests = Some(BTreeMap::from([(
            "storage".to_owned(),
            Quantity("1500m".into()),
        )]));
        assert_eq!(prep(&c, &class(), &opts).unwrap().requested_bytes, 2);
        spec(&mut c).resources = None;
        let p = prep(&c, &class(), &opts).unwrap();
        assert_eq!(
            p.request.capacity_range,
            Some(CapacityRange {
                required_bytes: 0,
                limit_bytes: 0
            })
        );
        spec(&mut c).resources = Some(VolumeResourceRequirements {
            requests: Some(BTreeMap::from([(
                "storage".to_owned(),
                Quantity("1Gb".into()),
            )])),
            ..Default::default()
        });
        assert!(
            final_err(&c, &class(), &opts)
                .starts_with("invalid storage request \"1Gb\": quantities must match")
        );
    }

    // §7.3 capabilities.

    #[test]
    fn access_modes_without_single_node_multi_writer() {
        assert_eq!(
            csi_access_mode("ReadWriteOncePod", false),
            Ok(Mode::SingleNodeWriter)
        );
        assert_eq!(
            csi_access_mode("ReadWriteOnce", false),
            Ok(Mode::SingleNodeWriter)
        );
        assert_eq!(
            csi_access_mode("ReadOnlyMany", false),
            Ok(Mode::MultiNodeReaderOnly)
        );
        assert_eq!(
            csi_access_mode("ReadWriteMany", false),
            Ok(Mode::MultiNodeMultiWriter)
        );
    }

    #[test]
    fn access_modes_with_single_node_multi_writer() {
        assert_eq!(
            csi_access_mode("ReadWriteOncePod", true),
            Ok(Mode::SingleNodeSingleWriter)
        );
        assert_eq!(
            csi_access_mode("ReadWriteOnce", true),
            Ok(Mode::SingleNodeMultiWriter)
        );
        assert_eq!(
            csi_access_mode("ReadOnlyMany", true),
            Ok(Mode::MultiNodeReaderOnly)
        );
        assert_eq!(
            csi_access_mode("ReadWriteMany", true),
            Ok(Mode::MultiNodeMultiWriter)
        );
    }

    #[test]
    fn unknown_access_mode_is_final() {
        for snmw in [false, true] {
            let e = csi_access_mode("ReadWriteSometimes", snmw).unwrap_err();
            assert_eq!(
                (e.state, e.message.as_str()),
                (
                    State::Final,
                    "unsupported AccessMode combination: [ReadWriteSometimes]"
                )
            );
        }
    }

    #[test]
    fn one_capability_per_access_mode_in_claim_order() {
        let mut c = claim();
        spec(&mut c).access_modes = Some(vec!["ReadOnlyMany".into(), "ReadWriteOnce".into()]);
        let sc = StorageClass {
            mount_options: Some(vec!["noatime".into(), "ro".into()]),
            ..with_params(&[(FSTYPE_KEY, "xfs")])
        };
        let p = prep(
            &c,
            &sc,
            &RequestOptions {
                single_node_multi_writer: true,
                ..Default::default()
            },
        )
        .unwrap();
        let mount = AccessType::Mount(MountVolume {
            fs_type: "xfs".into(),
            mount_flags: vec!["noatime".into(), "ro".into()],
            volume_mount_group: String::new(),
        });
        assert_eq!(
            p.request.volume_capabilities,
            [
                VolumeCapability {
                    access_mode: Some(AccessMode {
                        mode: Mode::MultiNodeReaderOnly as i32
                    }),
                    access_type: Some(mount.clone()),
                },
                VolumeCapability {
                    access_mode: Some(AccessMode {
                        mode: Mode::SingleNodeMultiWriter as i32
                    }),
                    access_type: Some(mount),
                },
            ]
        );
    }

    #[test]
    fn block_claims_get_block_capabilities_without_fs_type() {
        let mut c = claim();
        spec(&mut c).volume_mode = Some("Block".into());
        let p = prep(
            &c,
            &with_params(&[(FSTYPE_KEY, "ext4")]),
            &RequestOptions::default(),
        )
        .unwrap();
        assert_eq!(
            p.request.volume_capabilities[0].access_type,
            Some(AccessType::Block(BlockVolume {}))
        );
        spec(&mut c).volume_mode = Some("Filesystem".into());
        let p = prep(&c, &class(), &RequestOptions::default()).unwrap();
        assert!(matches!(
            p.request.volume_capabilities[0].access_type,
            Some(AccessType::Mount(_))
        ));
    }

    #[test]
    fn unknown_mode_in_a_claim_is_final() {
        let mut c = claim();
        spec(&mut c).access_modes = Some(vec!["ReadWriteOnce".into(), "Bogus".into()]);
        assert_eq!(
            final_err(&c, &class(), &RequestOptions::default()),
            "unsupported AccessMode combination: [Bogus]"
        );
    }

    // §7.3 fs type.

    #[test]
    fn fstype_from_the_reserved_key() {
        let (fs, w) = fs_type(
            &with_params(&[(FSTYPE_KEY, "xfs")]).parameters.unwrap(),
            "ext4",
        )
        .unwrap();
        assert_eq!((fs.as_str(), w.len()), ("xfs", 0));
    }

    #[test]
    fn deprecated_fstype_key_in_any_case_warns() {
        for key in ["fstype", "FsType", "FSTYPE"] {
            let (fs, w) = fs_type(&with_params(&[(key, "btrfs")]).parameters.unwrap(), "").unwrap();
            assert_eq!(fs, "btrfs");
            assert_eq!(
                w,
                [
                    "\"fstype\" is deprecated and will be removed in a future release, please use \"csi.storage.k8s.io/fstype\" instead"
                ]
            );
        }
        // The deprecated key stays in the driver's parameters.
        let p = prep(
            &claim(),
            &with_params(&[("fsType", "ext3")]),
            &RequestOptions::default(),
        )
        .unwrap();
        assert_eq!(p.fs_type, "ext3");
        assert_eq!(
            p.request.parameters.get("fsType").map(String::as_str),
            Some("ext3")
        );
        assert_eq!(p.warnings.len(), 1);
    }

    #[test]
    fn both_fstype_keys_is_final() {
        let sc = with_params(&[("fstype", "a"), (FSTYPE_KEY, "b")]);
        assert_eq!(
            final_err(&claim(), &sc, &RequestOptions::default()),
            "fstype specified in parameters with both \"fstype\" and \"csi.storage.k8s.io/fstype\" keys"
        );
    }

    #[test]
    fn default_fstype_applies_when_none_or_empty() {
        let opts = RequestOptions {
            default_fstype: "ext4".into(),
            ..Default::default()
        };
        assert_eq!(prep(&claim(), &class(), &opts).unwrap().fs_type, "ext4");
        assert_eq!(
            prep(&claim(), &with_params(&[(FSTYPE_KEY, "")]), &opts)
                .unwrap()
                .fs_type,
            "ext4"
        );
        assert_eq!(
            prep(&claim(), &class(), &RequestOptions::default())
                .unwrap()
                .fs_type,
            ""
        );
    }

    // §7.4 parameters.

    #[test]
    fn reserved_keys_are_removed_and_others_kept() {
        let mut kv: Vec<(String, String)> = RESERVED_KEYS
            .iter()
            .map(|k| (format!("{PREFIX}{k}"), "x".to_owned()))
            .collect();
        kv.push(("csiProvisionerSecretName".into(), "old".into()));
        kv.push(("plain".into(), "v".into()));
        let params: BTreeMap<String, String> = kv.into_iter().collect();
        let out = driver_parameters(&params).unwrap();
        assert_eq!(
            out,
            HashMap::from([
                ("csiProvisionerSecretName".to_owned(), "old".to_owned()),
                ("plain".to_owned(), "v".to_owned())
            ])
        );
    }

    #[test]
    fn unknown_reserved_key_is_final() {
        let sc = with_params(&[("csi.storage.k8s.io/mystery", "x")]);
        assert_eq!(
            final_err(&claim(), &sc, &RequestOptions::default()),
            "failed to strip CSI Parameters of prefixed keys: found unknown parameter key \"csi.storage.k8s.io/mystery\" with reserved namespace csi.storage.k8s.io/"
        );
    }

    #[test]
    fn parameters_are_never_nil_and_extra_metadata_is_added() {
        let p = prep(&claim(), &class(), &RequestOptions::default()).unwrap();
        assert!(p.request.parameters.is_empty());
        let opts = RequestOptions {
            extra_create_metadata: true,
            ..Default::default()
        };
        let p = prep(&claim(), &with_params(&[("a", "b")]), &opts).unwrap();
        assert_eq!(
            p.request.parameters,
            HashMap::from([
                ("a".to_owned(), "b".to_owned()),
                (PVC_NAME_KEY.to_owned(), "data".to_owned()),
                (PVC_NAMESPACE_KEY.to_owned(), "apps".to_owned()),
                (PV_NAME_KEY.to_owned(), format!("pvc-{UID}")),
            ])
        );
    }

    // §7.5 secrets through prepare.

    #[test]
    fn secrets_are_resolved_but_not_filled_in() {
        let sc = with_params(&[
            (
                "csi.storage.k8s.io/provisioner-secret-name",
                "prov-${pvc.name}",
            ),
            (
                "csi.storage.k8s.io/provisioner-secret-namespace",
                "${pvc.namespace}",
            ),
            ("csi.storage.k8s.io/node-stage-secret-name", "stage"),
            ("csi.storage.k8s.io/node-stage-secret-namespace", "ns"),
        ]);
        let p = prep(&claim(), &sc, &RequestOptions::default()).unwrap();
        let want = SecretRef {
            name: "prov-data".into(),
            namespace: "apps".into(),
        };
        assert_eq!(p.provisioner_secret, Some(want.clone()));
        assert_eq!(p.secrets.provisioner, Some(want));
        assert_eq!(
            p.secrets.node_stage,
            Some(SecretRef {
                name: "stage".into(),
                namespace: "ns".into()
            })
        );
        assert_eq!(p.secrets.node_publish, None);
        assert!(p.request.secrets.is_empty());
        assert!(p.request.parameters.is_empty());
    }

    #[test]
    fn secret_errors_are_no_change() {
        let sc = with_params(&[("csi.storage.k8s.io/provisioner-secret-name", "x")]);
        let e = prep(&claim(), &sc, &RequestOptions::default()).unwrap_err();
        assert_eq!(e.state, State::NoChange);
        assert_eq!(
            e.message,
            "failed to get name and namespace template from params: either name and namespace for Provisioner secrets specified, Both must be specified"
        );
    }

    // §8 through prepare.

    #[test]
    fn topology_only_when_supported() {
        let cluster = Cluster::default().with_node("n1", &[("zone", "z1")], &["zone"]);
        let opts = RequestOptions::default();
        let p = prepare(&claim(), &class(), DRIVER, &opts, &cluster).unwrap();
        assert_eq!(p.request.accessibility_requirements, None);
        let opts = RequestOptions {
            topology: true,
            ..Default::default()
        };
        let p = prepare(&claim(), &class(), DRIVER, &opts, &cluster).unwrap();
        let r = p.request.accessibility_requirements.unwrap();
        assert_eq!(r.requisite.len(), 1);
        let c = annotate(claim(), ANN_SELECTED_NODE, "gone");
        let e = prepare(&c, &class(), DRIVER, &opts, &cluster).unwrap_err();
        assert_eq!(e.state, State::Reschedule);
        assert!(
            e.message
                .starts_with("error generating accessibility requirements: ")
        );
    }

    #[test]
    fn mount_group_is_never_set_and_no_content_source() {
        let p = prep(&claim(), &class(), &RequestOptions::default()).unwrap();
        match &p.request.volume_capabilities[0].access_type {
            Some(AccessType::Mount(m)) => assert_eq!(m.volume_mount_group, ""),
            other => panic!("{other:?}"),
        }
        assert_eq!(p.request.volume_content_source, None);
        assert!(p.request.mutable_parameters.is_empty());
    }
}
