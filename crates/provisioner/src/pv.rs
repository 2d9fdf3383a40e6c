//! The PersistentVolume made from a created volume (`docs/upstream/upstream-external-provisioner.md` §9), with
//! the parts upstream's library adds (claimRef, finalizer, `provisioned-by`, class name). Pure:
//! the controller creates it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
    ObjectReference, PersistentVolume, PersistentVolumeClaim, PersistentVolumeSpec,
    VolumeNodeAffinity,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use plugreg_proto::csi::v1::{
    CreateVolumeResponse, Topology, volume_capability::access_mode::Mode,
};

use crate::quantity;
use crate::request::{self, Prepared, RequestOptions};

/// The finalizer on every PV the provisioner creates; removed when the volume is deleted.
pub const FINALIZER: &str = "external-provisioner.volume.kubernetes.io/finalizer";
/// The annotation naming the PV's provisioner.
pub const ANN_PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
/// The provisioner secret's name for DeleteVolume ("" when none is needed).
pub const ANN_DELETION_SECRET_NAME: &str = "volume.kubernetes.io/provisioner-deletion-secret-name";
/// The provisioner secret's namespace for DeleteVolume ("" when none is needed).
pub const ANN_DELETION_SECRET_NAMESPACE: &str =
    "volume.kubernetes.io/provisioner-deletion-secret-namespace";
/// The controller-modify secret's name (for external-resizer), only when configured.
pub const ANN_MODIFY_SECRET_NAME: &str = "volume.kubernetes.io/controller-modify-secret-name";
/// The controller-modify secret's namespace, only when configured.
pub const ANN_MODIFY_SECRET_NAMESPACE: &str =
    "volume.kubernetes.io/controller-modify-secret-namespace";
/// The volume attribute naming the provisioner instance that created the volume.
pub const IDENTITY_KEY: &str = "storage.kubernetes.io/csiProvisionerIdentity";

/// A created volume that must not get a PV: the controller deletes it again (upstream's
/// cleanup, result in background).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PvError {
    /// The driver made a smaller volume than requested.
    #[error("created volume capacity {capacity} less than requested capacity {requested}")]
    TooSmall {
        /// `capacity_bytes` of the response.
        capacity: i64,
        /// The requested bytes.
        requested: i64,
    },
    /// The claim has a data source but the response no content source.
    #[error("volume content source missing")]
    MissingContentSource,
    /// The response has no volume, or one without `volume_id` (CSI requires both): nothing to
    /// clean up and nothing to put in a PV. Upstream dereferences nil here.
    #[error("CreateVolume response has no volume id")]
    NoVolumeId,
    /// CSI migration: the CSI PV of a claim of an in-tree class could not be written back in
    /// its in-tree form (csi-translation-lib's error).
    #[error("{0}")]
    InTree(String),
}

/// The claimRef of a claim (§6 step 2): kind, apiVersion, namespace, name, uid and
/// resourceVersion.
pub fn claim_ref(claim: &PersistentVolumeClaim) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolumeClaim".into()),
        namespace: claim.metadata.namespace.clone(),
        name: claim.metadata.name.clone(),
        uid: claim.metadata.uid.clone(),
        resource_version: claim.metadata.resource_version.clone(),
        field_path: None,
    }
}

/// The PV of a created volume (§9, every row). `identity` is the provisioner's identity
/// (`storage.kubernetes.io/csiProvisionerIdentity`).
///
/// `spec.capacity.storage` is `capacity_bytes` (the request when 0) printed as apimachinery
/// prints a BinarySI quantity: `"1Gi"`, `"1536Mi"`, `"1500"`, below 1024 decimal (`"500"`,
/// `"1k"`); always exactly that many bytes.
pub fn build(
    prepared: &Prepared,
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    driver: &str,
    identity: &str,
    response: &CreateVolumeResponse,
    opts: &RequestOptions,
) -> Result<PersistentVolume, PvError> {
    let volume = response
        .volume
        .as_ref()
        .filter(|v| !v.volume_id.is_empty())
        .ok_or(PvError::NoVolumeId)?;
    let requested = prepared.requested_bytes;
    let capacity = match volume.capacity_bytes {
        // 0 means unknown; the API server needs a size.
        0 => requested,
        c if c < requested => {
            return Err(PvError::TooSmall {
                capacity: c,
                requested,
            });
        }
        c => c,
    };
    let spec = claim.spec.clone().unwrap_or_default();
    if spec.data_source.is_some() && volume.content_source.is_none() {
        return Err(PvError::MissingContentSource);
    }

    let secrets = &prepared.secrets;
    let mut annotations = BTreeMap::from([
        (ANN_PROVISIONED_BY.to_owned(), class.provisioner.clone()),
        (
            ANN_DELETION_SECRET_NAME.to_owned(),
            secrets
                .provisioner
                .as_ref()
                .map(|s| s.name.clone())
                .unwrap_or_default(),
        ),
        (
            ANN_DELETION_SECRET_NAMESPACE.to_owned(),
            secrets
                .provisioner
                .as_ref()
                .map(|s| s.namespace.clone())
                .unwrap_or_default(),
        ),
    ]);
    if let Some(modify) = &secrets.controller_modify {
        annotations.insert(ANN_MODIFY_SECRET_NAME.to_owned(), modify.name.clone());
        annotations.insert(
            ANN_MODIFY_SECRET_NAMESPACE.to_owned(),
            modify.namespace.clone(),
        );
    }

    // The driver's context wins over the identity key.
    let mut attributes = BTreeMap::from([(IDENTITY_KEY.to_owned(), identity.to_owned())]);
    attributes.extend(
        volume
            .volume_context
            .iter()
            .map(|(k, v)| (k.clone(), v.clone())),
    );

    let caps = &prepared.request.volume_capabilities;
    let read_only = opts.controller_publish_readonly
        && caps.len() == 1
        && caps[0]
            .access_mode
            .is_some_and(|m| m.mode == Mode::MultiNodeReaderOnly as i32);
    let block = request::is_block(claim);

    let csi = CSIPersistentVolumeSource {
        driver: driver.to_owned(),
        volume_handle: volume.volume_id.clone(),
        volume_attributes: Some(attributes),
        fs_type: (!block && !prepared.fs_type.is_empty()).then(|| prepared.fs_type.clone()),
        read_only: read_only.then_some(true),
        controller_publish_secret_ref: secrets.controller_publish.as_ref().map(|s| s.to_k8s()),
        node_stage_secret_ref: secrets.node_stage.as_ref().map(|s| s.to_k8s()),
        node_publish_secret_ref: secrets.node_publish.as_ref().map(|s| s.to_k8s()),
        controller_expand_secret_ref: secrets.controller_expand.as_ref().map(|s| s.to_k8s()),
        node_expand_secret_ref: secrets.node_expand.as_ref().map(|s| s.to_k8s()),
    };
    let class_name = request::claim_class(claim);

    Ok(PersistentVolume {
        metadata: ObjectMeta {
            name: Some(prepared.pv_name.clone()),
            annotations: Some(annotations),
            finalizers: Some(vec![FINALIZER.to_owned()]),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            access_modes: spec.access_modes.clone(),
            capacity: Some(BTreeMap::from([(
                "storage".to_owned(),
                Quantity(quantity::format_binary_si(capacity)),
            )])),
            claim_ref: Some(claim_ref(claim)),
            csi: Some(csi),
            mount_options: class.mount_options.clone(),
            node_affinity: if opts.topology {
                node_affinity(&volume.accessible_topology)
            } else {
                None
            },
            persistent_volume_reclaim_policy: class.reclaim_policy.clone(),
            storage_class_name: (!class_name.is_empty()).then_some(class_name),
            volume_mode: spec.volume_mode.clone(),
            volume_attributes_class_name: prepared.volume_attributes_class.clone(),
            ..Default::default()
        }),
        status: None,
    })
}

/// One NodeSelectorTerm per non-empty topology, one `key In [value]` per segment (sorted by
/// key; upstream's order is Go's map order). No non-empty topology: no affinity (upstream
/// would write an affinity without terms, which the API server rejects).
fn node_affinity(topology: &[Topology]) -> Option<VolumeNodeAffinity> {
    let terms: Vec<NodeSelectorTerm> = topology
        .iter()
        .filter(|t| !t.segments.is_empty())
        .map(|t| {
            let sorted: BTreeMap<&String, &String> = t.segments.iter().collect();
            NodeSelectorTerm {
                match_expressions: Some(
                    sorted
                        .into_iter()
                        .map(|(k, v)| NodeSelectorRequirement {
                            key: k.clone(),
                            operator: "In".into(),
                            values: Some(vec![v.clone()]),
                        })
                        .collect(),
                ),
                match_fields: None,
            }
        })
        .collect();
    if terms.is_empty() {
        return None;
    }
    Some(VolumeNodeAffinity {
        required: Some(NodeSelector {
            node_selector_terms: terms,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::tests::class;
    use crate::request::{ANN_BETA_STORAGE_CLASS, prepare};
    use crate::topology::tests::{Cluster, DRIVER};
    use k8s_openapi::api::core::v1::{SecretReference, TypedLocalObjectReference};
    use plugreg_proto::csi::v1::{Volume, VolumeContentSource};
    use std::collections::HashMap;

    const UID: &str = "11111111-2222-3333-4444-555555555555";

    fn claim() -> PersistentVolumeClaim {
        let mut c = crate::request::tests::claim_with(UID);
        c.metadata.resource_version = Some("42".into());
        c
    }

    fn response(capacity: i64) -> CreateVolumeResponse {
        CreateVolumeResponse {
            volume: Some(Volume {
                capacity_bytes: capacity,
                volume_id: "vol-1".into(),
                ..Default::default()
            }),
        }
    }

    fn build_with(
        c: &PersistentVolumeClaim,
        sc: &StorageClass,
        resp: &CreateVolumeResponse,
        opts: &RequestOptions,
    ) -> Result<PersistentVolume, PvError> {
        let p = prepare(c, sc, DRIVER, opts, &Cluster::default()).unwrap();
        build(
            &p,
            c,
            sc,
            DRIVER,
            "1700000000000-8081-csi.example.com",
            resp,
            opts,
        )
    }

    fn pv() -> PersistentVolume {
        build_with(
            &claim(),
            &class(),
            &response(1 << 30),
            &RequestOptions::default(),
        )
        .unwrap()
    }

    fn spec(pv: &PersistentVolume) -> &PersistentVolumeSpec {
        pv.spec.as_ref().unwrap()
    }

    fn csi(pv: &PersistentVolume) -> &CSIPersistentVolumeSource {
        spec(pv).csi.as_ref().unwrap()
    }

    fn ann<'a>(pv: &'a PersistentVolume, k: &str) -> Option<&'a str> {
        pv.metadata.annotations.as_ref()?.get(k).map(String::as_str)
    }

    #[test]
    fn name_is_the_volume_name_without_labels() {
        let pv = pv();
        assert_eq!(pv.metadata.name.as_deref(), Some(&*format!("pvc-{UID}")));
        assert_eq!(pv.metadata.labels, None);
        assert_eq!(pv.status, None);
    }

    #[test]
    fn provisioned_by_is_the_class_provisioner() {
        assert_eq!(ann(&pv(), ANN_PROVISIONED_BY), Some(DRIVER));
    }

    #[test]
    fn deletion_secret_annotations_are_always_present() {
        let pv = pv();
        assert_eq!(ann(&pv, ANN_DELETION_SECRET_NAME), Some(""));
        assert_eq!(ann(&pv, ANN_DELETION_SECRET_NAMESPACE), Some(""));
        let sc = StorageClass {
            parameters: Some(BTreeMap::from([
                (
                    "csi.storage.k8s.io/provisioner-secret-name".to_owned(),
                    "p-${pvc.name}".to_owned(),
                ),
                (
                    "csi.storage.k8s.io/provisioner-secret-namespace".to_owned(),
                    "sec".to_owned(),
                ),
            ])),
            ..class()
        };
        let pv = build_with(&claim(), &sc, &response(0), &RequestOptions::default()).unwrap();
        assert_eq!(ann(&pv, ANN_DELETION_SECRET_NAME), Some("p-data"));
        assert_eq!(ann(&pv, ANN_DELETION_SECRET_NAMESPACE), Some("sec"));
    }

    #[test]
    fn modify_secret_annotations_only_when_configured() {
        let pv = pv();
        assert_eq!(ann(&pv, ANN_MODIFY_SECRET_NAME), None);
        assert_eq!(ann(&pv, ANN_MODIFY_SECRET_NAMESPACE), None);
        let sc = StorageClass {
            parameters: Some(BTreeMap::from([
                (
                    "csi.storage.k8s.io/controller-modify-secret-name".to_owned(),
                    "m".to_owned(),
                ),
                (
                    "csi.storage.k8s.io/controller-modify-secret-namespace".to_owned(),
                    "ns".to_owned(),
                ),
            ])),
            ..class()
        };
        let pv = build_with(&claim(), &sc, &response(0), &RequestOptions::default()).unwrap();
        assert_eq!(ann(&pv, ANN_MODIFY_SECRET_NAME), Some("m"));
        assert_eq!(ann(&pv, ANN_MODIFY_SECRET_NAMESPACE), Some("ns"));
    }

    #[test]
    fn finalizer_is_set() {
        assert_eq!(pv().metadata.finalizers, Some(vec![FINALIZER.to_owned()]));
    }

    #[test]
    fn capacity_is_the_response_or_the_request_as_binary_si() {
        let cap = |pv: &PersistentVolume| spec(pv).capacity.as_ref().unwrap()["storage"].0.clone();
        assert_eq!(cap(&pv()), "1Gi");
        let opts = RequestOptions::default();
        let pv = build_with(&claim(), &class(), &response(0), &opts).unwrap();
        assert_eq!(cap(&pv), "1Gi", "0 means the request");
        let pv = build_with(&claim(), &class(), &response((1 << 30) + 1), &opts).unwrap();
        assert_eq!(cap(&pv), "1073741825", "no rounding");
        let pv = build_with(&claim(), &class(), &response(3 << 29), &opts).unwrap();
        assert_eq!(cap(&pv), "1536Mi");
    }

    #[test]
    fn smaller_volume_is_an_error() {
        let e = build_with(
            &claim(),
            &class(),
            &response(1000),
            &RequestOptions::default(),
        )
        .unwrap_err();
        assert_eq!(
            e,
            PvError::TooSmall {
                capacity: 1000,
                requested: 1 << 30
            }
        );
        assert_eq!(
            e.to_string(),
            "created volume capacity 1000 less than requested capacity 1073741824"
        );
    }

    #[test]
    fn missing_volume_or_id_is_an_error() {
        let opts = RequestOptions::default();
        let none = CreateVolumeResponse { volume: None };
        assert_eq!(
            build_with(&claim(), &class(), &none, &opts),
            Err(PvError::NoVolumeId)
        );
        let mut empty = response(0);
        empty.volume.as_mut().unwrap().volume_id.clear();
        assert_eq!(
            build_with(&claim(), &class(), &empty, &opts),
            Err(PvError::NoVolumeId)
        );
    }

    #[test]
    fn data_source_without_content_source_is_an_error() {
        // prepare refuses every data source plugreg handles, so build it from a plain claim.
        let opts = RequestOptions::default();
        let p = prepare(&claim(), &class(), DRIVER, &opts, &Cluster::default()).unwrap();
        let mut c = claim();
        c.spec.as_mut().unwrap().data_source = Some(TypedLocalObjectReference {
            kind: "PersistentVolumeClaim".into(),
            name: "src".into(),
            api_group: None,
        });
        let e = build(&p, &c, &class(), DRIVER, "id", &response(0), &opts).unwrap_err();
        assert_eq!(e, PvError::MissingContentSource);
        assert_eq!(e.to_string(), "volume content source missing");
        let mut with_source = response(0);
        with_source.volume.as_mut().unwrap().content_source = Some(VolumeContentSource::default());
        assert!(build(&p, &c, &class(), DRIVER, "id", &with_source, &opts).is_ok());
    }

    #[test]
    fn access_modes_are_copied_from_the_claim() {
        let mut c = claim();
        c.spec.as_mut().unwrap().access_modes =
            Some(vec!["ReadOnlyMany".into(), "ReadWriteMany".into()]);
        let pv = build_with(&c, &class(), &response(0), &RequestOptions::default()).unwrap();
        assert_eq!(
            spec(&pv).access_modes,
            Some(vec!["ReadOnlyMany".to_owned(), "ReadWriteMany".to_owned()])
        );
    }

    #[test]
    fn mount_options_and_reclaim_policy_come_from_the_class() {
        assert_eq!(spec(&pv()).mount_options, None);
        assert_eq!(spec(&pv()).persistent_volume_reclaim_policy, None);
        let sc = StorageClass {
            mount_options: Some(vec!["noatime".into()]),
            reclaim_policy: Some("Retain".into()),
            ..class()
        };
        let pv = build_with(&claim(), &sc, &response(0), &RequestOptions::default()).unwrap();
        assert_eq!(spec(&pv).mount_options, Some(vec!["noatime".to_owned()]));
        assert_eq!(
            spec(&pv).persistent_volume_reclaim_policy.as_deref(),
            Some("Retain")
        );
    }

    #[test]
    fn storage_class_name_is_the_claims_class() {
        assert_eq!(spec(&pv()).storage_class_name.as_deref(), Some("fast"));
        let mut c = claim();
        c.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(ANN_BETA_STORAGE_CLASS.into(), "beta-class".into());
        let pv = build_with(&c, &class(), &response(0), &RequestOptions::default()).unwrap();
        assert_eq!(spec(&pv).storage_class_name.as_deref(), Some("beta-class"));
    }

    #[test]
    fn volume_mode_is_copied_when_set() {
        assert_eq!(spec(&pv()).volume_mode, None);
        let mut c = claim();
        c.spec.as_mut().unwrap().volume_mode = Some("Block".into());
        let pv = build_with(&c, &class(), &response(0), &RequestOptions::default()).unwrap();
        assert_eq!(spec(&pv).volume_mode.as_deref(), Some("Block"));
    }

    #[test]
    fn claim_ref_names_the_claim_with_uid_and_resource_version() {
        let want = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("PersistentVolumeClaim".into()),
            namespace: Some("apps".into()),
            name: Some("data".into()),
            uid: Some(UID.into()),
            resource_version: Some("42".into()),
            field_path: None,
        };
        assert_eq!(claim_ref(&claim()), want);
        assert_eq!(spec(&pv()).claim_ref, Some(want));
    }

    #[test]
    fn node_affinity_from_accessible_topology_with_topology_only() {
        let mut resp = response(0);
        resp.volume.as_mut().unwrap().accessible_topology = vec![
            Topology {
                segments: HashMap::from([
                    ("zone".to_owned(), "z1".to_owned()),
                    ("rack".to_owned(), "r1".to_owned()),
                ]),
            },
            Topology::default(),
            Topology {
                segments: HashMap::from([("zone".to_owned(), "z2".to_owned())]),
            },
        ];
        let pv = build_with(&claim(), &class(), &resp, &RequestOptions::default()).unwrap();
        assert_eq!(spec(&pv).node_affinity, None, "no topology support");
        let opts = RequestOptions {
            topology: true,
            immediate_topology: false,
            ..Default::default()
        };
        let pv = build_with(&claim(), &class(), &resp, &opts).unwrap();
        let req = |k: &str, v: &str| NodeSelectorRequirement {
            key: k.into(),
            operator: "In".into(),
            values: Some(vec![v.into()]),
        };
        let term = |reqs: Vec<NodeSelectorRequirement>| NodeSelectorTerm {
            match_expressions: Some(reqs),
            match_fields: None,
        };
        assert_eq!(
            spec(&pv).node_affinity,
            Some(VolumeNodeAffinity {
                required: Some(NodeSelector {
                    node_selector_terms: vec![
                        term(vec![req("rack", "r1"), req("zone", "z1")]),
                        term(vec![req("zone", "z2")]),
                    ]
                })
            })
        );
        let pv = build_with(&claim(), &class(), &response(0), &opts).unwrap();
        assert_eq!(spec(&pv).node_affinity, None, "no entries");
        let mut only_empty = response(0);
        only_empty.volume.as_mut().unwrap().accessible_topology = vec![Topology::default()];
        let pv = build_with(&claim(), &class(), &only_empty, &opts).unwrap();
        assert_eq!(spec(&pv).node_affinity, None, "only empty entries");
    }

    #[test]
    fn csi_driver_handle_and_attributes() {
        let mut resp = response(0);
        resp.volume.as_mut().unwrap().volume_context = HashMap::from([
            ("a".to_owned(), "1".to_owned()),
            (IDENTITY_KEY.to_owned(), "from-driver".to_owned()),
        ]);
        let pv = build_with(&claim(), &class(), &response(0), &RequestOptions::default()).unwrap();
        assert_eq!(csi(&pv).driver, DRIVER);
        assert_eq!(csi(&pv).volume_handle, "vol-1");
        assert_eq!(
            csi(&pv).volume_attributes,
            Some(BTreeMap::from([(
                IDENTITY_KEY.to_owned(),
                "1700000000000-8081-csi.example.com".to_owned()
            )]))
        );
        let pv = build_with(&claim(), &class(), &resp, &RequestOptions::default()).unwrap();
        assert_eq!(
            csi(&pv).volume_attributes,
            Some(BTreeMap::from([
                ("a".to_owned(), "1".to_owned()),
                (IDENTITY_KEY.to_owned(), "from-driver".to_owned()),
            ])),
            "a context key of the same name overrides the identity"
        );
    }

    #[test]
    fn fs_type_for_filesystem_volumes_only() {
        let sc = StorageClass {
            parameters: Some(BTreeMap::from([(
                "csi.storage.k8s.io/fstype".to_owned(),
                "xfs".to_owned(),
            )])),
            ..class()
        };
        let pv = build_with(&claim(), &sc, &response(0), &RequestOptions::default()).unwrap();
        assert_eq!(csi(&pv).fs_type.as_deref(), Some("xfs"));
        let mut c = claim();
        c.spec.as_mut().unwrap().volume_mode = Some("Block".into());
        let pv = build_with(&c, &sc, &response(0), &RequestOptions::default()).unwrap();
        assert_eq!(csi(&pv).fs_type, None);
        assert_eq!(csi(&pv_default_fs("")).fs_type, None, "empty stays unset");
        assert_eq!(csi(&pv_default_fs("ext4")).fs_type.as_deref(), Some("ext4"));
    }

    fn pv_default_fs(fs: &str) -> PersistentVolume {
        let opts = RequestOptions {
            default_fstype: fs.into(),
            ..Default::default()
        };
        build_with(&claim(), &class(), &response(0), &opts).unwrap()
    }

    #[test]
    fn read_only_only_for_a_single_reader_only_mode_with_the_flag() {
        let ro = |modes: &[&str], flag: bool| {
            let mut c = claim();
            c.spec.as_mut().unwrap().access_modes =
                Some(modes.iter().map(|m| (*m).to_owned()).collect());
            let opts = RequestOptions {
                controller_publish_readonly: flag,
                ..Default::default()
            };
            csi(&build_with(&c, &class(), &response(0), &opts).unwrap()).read_only
        };
        assert_eq!(ro(&["ReadOnlyMany"], true), Some(true));
        assert_eq!(ro(&["ReadOnlyMany"], false), None);
        assert_eq!(ro(&["ReadOnlyMany", "ReadWriteOnce"], true), None);
        assert_eq!(ro(&["ReadWriteOnce"], true), None);
    }

    #[test]
    fn secret_refs_for_each_kind_and_the_default_pair() {
        let sc = StorageClass {
            parameters: Some(BTreeMap::from([
                (
                    "csi.storage.k8s.io/secret-name".to_owned(),
                    "shared".to_owned(),
                ),
                (
                    "csi.storage.k8s.io/secret-namespace".to_owned(),
                    "ns".to_owned(),
                ),
                (
                    "csi.storage.k8s.io/node-publish-secret-name".to_owned(),
                    "np".to_owned(),
                ),
                (
                    "csi.storage.k8s.io/node-publish-secret-namespace".to_owned(),
                    "ns2".to_owned(),
                ),
            ])),
            ..class()
        };
        let pv = build_with(&claim(), &sc, &response(0), &RequestOptions::default()).unwrap();
        let shared = Some(SecretReference {
            name: Some("shared".into()),
            namespace: Some("ns".into()),
        });
        let csi = csi(&pv);
        assert_eq!(csi.controller_publish_secret_ref, shared);
        assert_eq!(csi.node_stage_secret_ref, shared);
        assert_eq!(
            csi.node_publish_secret_ref,
            Some(SecretReference {
                name: Some("np".into()),
                namespace: Some("ns2".into())
            })
        );
        assert_eq!(csi.controller_expand_secret_ref, shared);
        assert_eq!(csi.node_expand_secret_ref, shared);
        assert_eq!(ann(&pv, ANN_DELETION_SECRET_NAME), Some("shared"));
        let none = super::tests::pv();
        let csi = super::tests::csi(&none);
        assert_eq!(
            (
                &csi.controller_publish_secret_ref,
                &csi.node_stage_secret_ref,
                &csi.node_publish_secret_ref,
                &csi.controller_expand_secret_ref,
                &csi.node_expand_secret_ref
            ),
            (&None, &None, &None, &None, &None)
        );
    }

    #[test]
    fn serialises_to_the_json_the_api_server_expects() {
        let json = serde_json::to_value(pv()).unwrap();
        assert_eq!(json["spec"]["capacity"]["storage"], "1Gi");
        assert_eq!(json["spec"]["csi"]["volumeHandle"], "vol-1");
        assert!(json["spec"]["csi"].get("fsType").is_none());
        assert!(json["spec"]["csi"].get("readOnly").is_none());
        assert_eq!(json["spec"]["claimRef"]["kind"], "PersistentVolumeClaim");
    }

    /// The PV as the real kube-apiserver (v1.20.2 and v1.36.2) takes it: it passes validation,
    /// and what comes back is what was sent (capacity strings included, which the server
    /// re-prints in canonical form).
    async fn api_server_accepts_the_pv(version: plugreg_testpeers::KubeVersion) {
        use kube::api::{Api, PostParams};
        let server = plugreg_testpeers::ApiServer::shared(version)
            .await
            .expect("start kube-apiserver");
        let pvs: Api<PersistentVolume> = Api::all(server.client().await.expect("client"));
        let sc = StorageClass {
            parameters: Some(
                [
                    "provisioner",
                    "controller-publish",
                    "node-stage",
                    "node-publish",
                    "controller-expand",
                    "node-expand",
                    "controller-modify",
                ]
                .iter()
                .flat_map(|op| {
                    [
                        (
                            format!("csi.storage.k8s.io/{op}-secret-name"),
                            format!("{op}-s"),
                        ),
                        (
                            format!("csi.storage.k8s.io/{op}-secret-namespace"),
                            "sec".to_owned(),
                        ),
                    ]
                })
                .chain([("csi.storage.k8s.io/fstype".to_owned(), "xfs".to_owned())])
                .collect(),
            ),
            mount_options: Some(vec!["noatime".into()]),
            reclaim_policy: Some("Retain".into()),
            ..class()
        };
        let opts = RequestOptions {
            topology: true,
            immediate_topology: false,
            controller_publish_readonly: true,
            ..Default::default()
        };
        let v = match version {
            plugreg_testpeers::KubeVersion::V1_20_2 => "a",
            plugreg_testpeers::KubeVersion::V1_36_2 => "b",
        };
        for (i, bytes) in [1i64 << 30, 3 << 29, (1 << 30) + 1, 500, 1000, 1024, 1500]
            .into_iter()
            .enumerate()
        {
            let mut c = claim();
            c.metadata.uid = Some(format!("{v}{i}111111-2222-3333-4444-555555555555"));
            c.spec.as_mut().unwrap().access_modes = Some(vec!["ReadOnlyMany".into()]);
            c.spec.as_mut().unwrap().resources = None;
            let mut resp = response(bytes);
            resp.volume.as_mut().unwrap().accessible_topology = vec![
                Topology {
                    segments: HashMap::from([
                        ("zone".to_owned(), "z1".to_owned()),
                        ("rack".to_owned(), "r1".to_owned()),
                    ]),
                },
                Topology {
                    segments: HashMap::from([("zone".to_owned(), "z2".to_owned())]),
                },
            ];
            let sent = build_with(&c, &sc, &resp, &opts).unwrap();
            let got = pvs
                .create(&PostParams::default(), &sent)
                .await
                .unwrap_or_else(|e| panic!("{version:?} rejected the PV: {e}"));
            let (s, g) = (spec(&sent), spec(&got));
            let storage = &g.capacity.as_ref().unwrap()["storage"].0;
            assert_eq!(
                storage,
                &s.capacity.as_ref().unwrap()["storage"].0,
                "{bytes}"
            );
            assert_eq!(quantity::parse_bytes(storage), Ok(bytes));
            let mut want_csi = s.csi.clone().unwrap();
            if version == plugreg_testpeers::KubeVersion::V1_20_2 {
                // nodeExpandSecretRef exists from 1.25; older servers drop it.
                want_csi.node_expand_secret_ref = None;
            }
            assert_eq!(g.csi.as_ref(), Some(&want_csi));
            assert_eq!(want_csi.read_only, Some(true));
            assert_eq!(g.node_affinity, s.node_affinity);
            assert_eq!(g.claim_ref, s.claim_ref);
            assert_eq!(g.access_modes, s.access_modes);
            assert_eq!(g.mount_options, s.mount_options);
            assert_eq!(
                g.persistent_volume_reclaim_policy.as_deref(),
                Some("Retain")
            );
            assert_eq!(g.storage_class_name.as_deref(), Some("fast"));
            let anns = got.metadata.annotations.as_ref().unwrap();
            for (k, val) in sent.metadata.annotations.as_ref().unwrap() {
                assert_eq!(anns.get(k), Some(val), "{k}");
            }
            assert!(
                got.metadata
                    .finalizers
                    .as_ref()
                    .unwrap()
                    .contains(&FINALIZER.to_owned())
            );
        }
    }

    /// `n / 1024` as an exact decimal with the `Ki` suffix: a BinarySI quantity of `n` bytes,
    /// whatever `n` is (1/1024 = 5^10 / 10^10 terminates).
    fn as_binary_si_input(n: i64) -> String {
        let m = u128::try_from(n).unwrap() * 9_765_625;
        let (int, frac) = (m / 10_000_000_000, m % 10_000_000_000);
        let frac = format!("{frac:010}");
        let frac = frac.trim_end_matches('0');
        if frac.is_empty() {
            format!("{int}Ki")
        } else {
            format!("{int}.{frac}Ki")
        }
    }

    /// The real apimachinery prints a BinarySI quantity of `n` bytes as `NewQuantity(n, BinarySI)`
    /// does, and the server stores that text and parses it again. For sizes below 1024 and
    /// multiples of 1024 what comes back is therefore exactly upstream's text, which our
    /// formatter must match; every other size comes back as plain digits re-read in decimal SI
    /// (`1000000` -> `1M`), so for those only the value is compared.
    async fn api_server_prints_sizes_as_we_do(version: plugreg_testpeers::KubeVersion) {
        use kube::api::{Api, PostParams};
        let server = plugreg_testpeers::ApiServer::shared(version)
            .await
            .expect("start kube-apiserver");
        let pvs: Api<PersistentVolume> = Api::all(server.client().await.expect("client"));
        let sizes = [
            1,
            500,
            999,
            1000,
            1001,
            1023,
            1024,
            1025,
            1500,
            2048,
            1_000_000,
            1 << 20,
            (1 << 20) + 512,
            1 << 30,
            3 << 29,
            (1 << 30) + 1,
            1_000_000_000,
            5 << 40,
            123_456_789_012,
            1 << 62,
            i64::MAX,
        ];
        let v = match version {
            plugreg_testpeers::KubeVersion::V1_20_2 => "c",
            plugreg_testpeers::KubeVersion::V1_36_2 => "d",
        };
        for (i, n) in sizes.into_iter().enumerate() {
            let mut pv = pv();
            pv.metadata.name = Some(format!("size-{v}-{i}"));
            pv.spec.as_mut().unwrap().capacity = Some(BTreeMap::from([(
                "storage".to_owned(),
                Quantity(as_binary_si_input(n)),
            )]));
            let got = pvs
                .create(&PostParams::default(), &pv)
                .await
                .unwrap_or_else(|e| panic!("{version:?}, {n}: {e}"));
            let printed = &spec(&got).capacity.as_ref().unwrap()["storage"].0;
            let sent = as_binary_si_input(n);
            assert_eq!(quantity::parse_bytes(printed), Ok(n), "{n} sent as {sent}");
            if n < 1024 || n % 1024 == 0 {
                assert_eq!(
                    printed,
                    &quantity::format_binary_si(n),
                    "{n} sent as {sent}"
                );
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kube_apiserver_v1_20_accepts_the_pv() {
        api_server_accepts_the_pv(plugreg_testpeers::KubeVersion::V1_20_2).await;
        api_server_prints_sizes_as_we_do(plugreg_testpeers::KubeVersion::V1_20_2).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kube_apiserver_v1_36_accepts_the_pv() {
        api_server_accepts_the_pv(plugreg_testpeers::KubeVersion::V1_36_2).await;
        api_server_prints_sizes_as_we_do(plugreg_testpeers::KubeVersion::V1_36_2).await;
    }
}
