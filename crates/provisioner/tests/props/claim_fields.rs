//! The checks behind the `claim_fields` fuzz target and its property test: the fields of a
//! PersistentVolumeClaim and a PersistentVolume the provisioner reads, from arbitrary JSON
//! (mostly the right shape, any field any type), through everything that reads them: the
//! claim's checks and next step (`request`, `decide`), the CreateVolume request, the PV built
//! from an arbitrary CreateVolume answer (`pv`), and the cached PV and its next step
//! (`cached`, `decide`).
//!
//! Shared by `tests/props.rs` (arbtest, in the normal suite) and
//! `fuzz/fuzz_targets/claim_fields.rs` (libFuzzer), which include this file with `#[path]`; the
//! including crate provides `crate::arbitrary` (the `arbitrary` crate).

use std::collections::HashMap;
use std::sync::Arc;

use crate::arbitrary::{Result, Unstructured};
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use plugreg_proto::csi::v1::{CreateVolumeResponse, Topology, Volume};
use plugreg_provisioner::cached::CachedPv;
use plugreg_provisioner::decide::{self, ClaimAction, ClaimView, VolumeView};
use plugreg_provisioner::inflight::Deleted;
use plugreg_provisioner::quantity::parse_bytes;
use plugreg_provisioner::request::{self, RequestOptions};
use plugreg_provisioner::topology::TopologySource;
use plugreg_provisioner::{pv, quantity};
use serde_json::{Map, Value, json};

const DRIVER: &str = "csi.example.com";

/// No Nodes or CSINodes.
struct NoCluster;

impl TopologySource for NoCluster {
    fn csinode(&self, _: &str) -> Option<Arc<CSINode>> {
        None
    }
    fn node(&self, _: &str) -> Option<Arc<Node>> {
        None
    }
    fn csinodes(&self) -> Vec<Arc<CSINode>> {
        Vec::new()
    }
    fn nodes(&self) -> Vec<Arc<Node>> {
        Vec::new()
    }
}

/// Any JSON value, at most `depth` deep.
fn any(u: &mut Unstructured, depth: u32) -> Result<Value> {
    Ok(match u.int_in_range(0u8..=6)? {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary()?),
        2 => Value::from(u.arbitrary::<i64>()?),
        3 => Value::from(u.arbitrary::<f64>()?),
        4 if depth > 0 => Value::Array(
            (0..u.int_in_range(0..=3)?)
                .map(|_| any(u, depth - 1))
                .collect::<Result<_>>()?,
        ),
        5 if depth > 0 => Value::Object(
            (0..u.int_in_range(0..=3)?)
                .map(|_| Ok((u.arbitrary::<String>()?, any(u, depth - 1)?)))
                .collect::<Result<_>>()?,
        ),
        _ => Value::String(u.arbitrary()?),
    })
}

/// A string from `choices`, or any string, or (rarely) any JSON value.
fn string(u: &mut Unstructured, choices: &[&str]) -> Result<Value> {
    Ok(match u.int_in_range(0u8..=15)? {
        0 => any(u, 2)?,
        1..=3 => Value::String(u.arbitrary()?),
        _ => Value::String((*u.choose(choices)?).to_owned()),
    })
}

/// Makes one field's value.
type Field<'f> = &'f dyn Fn(&mut Unstructured) -> Result<Value>;

/// An object of the given fields, each present or not, each generated.
fn object(u: &mut Unstructured, fields: &[(&str, Field)]) -> Result<Value> {
    if u.ratio(1, 40)? {
        return any(u, 2);
    }
    let mut m = Map::new();
    for (name, generate) in fields {
        if u.ratio(3, 4)? {
            m.insert((*name).to_owned(), generate(u)?);
        }
    }
    if u.ratio(1, 10)? {
        m.insert(u.arbitrary()?, any(u, 2)?);
    }
    Ok(Value::Object(m))
}

/// A map of keys from `keys` to strings from `values`.
fn map(u: &mut Unstructured, keys: &[&str], values: &[&str]) -> Result<Value> {
    let mut m = Map::new();
    for _ in 0..u.int_in_range(0..=4)? {
        let k = if u.ratio(1, 8)? {
            u.arbitrary()?
        } else {
            (*u.choose(keys)?).to_owned()
        };
        m.insert(k, string(u, values)?);
    }
    Ok(Value::Object(m))
}

fn list(u: &mut Unstructured, values: &[&str]) -> Result<Value> {
    Ok(Value::Array(
        (0..u.int_in_range(0..=3)?)
            .map(|_| string(u, values))
            .collect::<Result<_>>()?,
    ))
}

const QUANTITIES: &[&str] = &[
    "1Gi",
    "1Mi",
    "0",
    "100m",
    "1.5Gi",
    "9223372036854775807",
    "8Ei",
    "-1",
    "1e3",
    "x",
    "",
];
const TIMES: &[&str] = &["2026-11-25T18:00:00Z", "1970-01-01T00:00:00Z", "yesterday"];

fn metadata(u: &mut Unstructured, annotations: &[&str]) -> Result<Value> {
    object(
        u,
        &[
            ("name", &|u| string(u, &["data", "data-web-3", "pvc-1", ""])),
            ("namespace", &|u| string(u, &["apps", "default", ""])),
            ("uid", &|u| {
                string(u, &["5f1e3b7c-9a2d-4e8f-b6c1-0d2e3f4a5b6c", "u", ""])
            }),
            ("resourceVersion", &|u| string(u, &["1", "42"])),
            ("annotations", &|u| {
                map(
                    u,
                    annotations,
                    &[DRIVER, "other.example.com", "fast", "n1", "", "pvc-1"],
                )
            }),
            ("finalizers", &|u| {
                list(
                    u,
                    &[
                        "external-provisioner.volume.kubernetes.io/finalizer",
                        "volume.plugreg.io/provisioning",
                        "kubernetes.io/pvc-protection",
                    ],
                )
            }),
            ("deletionTimestamp", &|u| string(u, TIMES)),
        ],
    )
}

/// A claim as JSON, mostly of the right shape.
pub fn claim_json(u: &mut Unstructured) -> Result<Value> {
    let mut claim = object(
        u,
        &[
            ("metadata", &|u| {
                metadata(
                    u,
                    &[
                        request::ANN_STORAGE_PROVISIONER,
                        request::ANN_BETA_STORAGE_PROVISIONER,
                        request::ANN_SELECTED_NODE,
                        request::ANN_ALPHA_SELECTED_NODE,
                        request::ANN_BETA_STORAGE_CLASS,
                        decide::LEGACY_INTENT,
                        "example.com/other",
                    ],
                )
            }),
            ("spec", &|u| {
                object(
                    u,
                    &[
                        ("accessModes", &|u| {
                            list(
                                u,
                                &[
                                    "ReadWriteOnce",
                                    "ReadOnlyMany",
                                    "ReadWriteMany",
                                    "ReadWriteOncePod",
                                    "Other",
                                ],
                            )
                        }),
                        ("resources", &|u| {
                            object(
                                u,
                                &[
                                    ("requests", &|u| map(u, &["storage", "cpu"], QUANTITIES)),
                                    ("limits", &|u| map(u, &["storage"], QUANTITIES)),
                                ],
                            )
                        }),
                        ("storageClassName", &|u| string(u, &["fast", "", "other"])),
                        ("volumeMode", &|u| string(u, &["Filesystem", "Block", ""])),
                        ("volumeName", &|u| string(u, &["", "pvc-1", "other"])),
                        ("volumeAttributesClassName", &|u| string(u, &["", "gold"])),
                        ("selector", &|u| {
                            object(u, &[("matchLabels", &|u| map(u, &["a"], &["b"]))])
                        }),
                        ("dataSource", &|u| {
                            object(
                                u,
                                &[
                                    ("kind", &|u| {
                                        string(
                                            u,
                                            &[
                                                "VolumeSnapshot",
                                                "PersistentVolumeClaim",
                                                "Populator",
                                                "",
                                            ],
                                        )
                                    }),
                                    ("name", &|u| string(u, &["src", ""])),
                                    ("apiGroup", &|u| {
                                        string(u, &["snapshot.storage.k8s.io", "example.com", ""])
                                    }),
                                ],
                            )
                        }),
                        ("dataSourceRef", &|u| {
                            object(
                                u,
                                &[
                                    ("kind", &|u| string(u, &["VolumeSnapshot", "Populator"])),
                                    ("name", &|u| string(u, &["src", ""])),
                                    ("namespace", &|u| string(u, &["", "other"])),
                                ],
                            )
                        }),
                    ],
                )
            }),
            ("status", &|u| {
                object(
                    u,
                    &[("phase", &|u| string(u, &["Pending", "Bound", "Lost"]))],
                )
            }),
        ],
    )?;
    if let Value::Object(m) = &mut claim {
        m.insert("apiVersion".into(), json!("v1"));
        m.insert("kind".into(), json!("PersistentVolumeClaim"));
    }
    Ok(claim)
}

/// A PV as JSON, mostly of the right shape.
pub fn pv_json(u: &mut Unstructured) -> Result<Value> {
    let mut pv = object(
        u,
        &[
            ("metadata", &|u| {
                metadata(
                    u,
                    &[
                        pv::ANN_PROVISIONED_BY,
                        "pv.kubernetes.io/bound-by-controller",
                        "example.com/other",
                    ],
                )
            }),
            ("spec", &|u| {
                object(
                    u,
                    &[
                        ("persistentVolumeReclaimPolicy", &|u| {
                            string(u, &["Delete", "Retain", "Recycle", ""])
                        }),
                        ("storageClassName", &|u| string(u, &["fast", ""])),
                        ("capacity", &|u| map(u, &["storage"], QUANTITIES)),
                        ("accessModes", &|u| list(u, &["ReadWriteOnce"])),
                        ("csi", &|u| {
                            object(
                                u,
                                &[
                                    ("driver", &|u| string(u, &[DRIVER, "other", ""])),
                                    ("volumeHandle", &|u| string(u, &["h", ""])),
                                    ("volumeAttributes", &|u| {
                                        map(
                                            u,
                                            &[pv::IDENTITY_KEY, "a"],
                                            &["1-2-csi.example.com", "b"],
                                        )
                                    }),
                                ],
                            )
                        }),
                    ],
                )
            }),
            ("status", &|u| {
                object(
                    u,
                    &[("phase", &|u| {
                        string(u, &["Pending", "Available", "Bound", "Released", "Failed"])
                    })],
                )
            }),
        ],
    )?;
    if let Value::Object(m) = &mut pv {
        m.insert("apiVersion".into(), json!("v1"));
        m.insert("kind".into(), json!("PersistentVolume"));
    }
    Ok(pv)
}

/// A CreateVolume answer: any capacity, maybe no ID, any topology.
fn response(u: &mut Unstructured) -> Result<CreateVolumeResponse> {
    if u.ratio(1, 10)? {
        return Ok(CreateVolumeResponse { volume: None });
    }
    let capacity = match u.int_in_range(0u8..=3)? {
        0 => 0,
        1 => 1 << 30,
        _ => u.arbitrary()?,
    };
    let topology = (0..u.int_in_range(0..=2)?)
        .map(|_| {
            Ok(Topology {
                segments: (0..u.int_in_range(0..=2)?)
                    .map(|_| Ok((u.arbitrary()?, u.arbitrary()?)))
                    .collect::<Result<HashMap<_, _>>>()?,
            })
        })
        .collect::<Result<_>>()?;
    Ok(CreateVolumeResponse {
        volume: Some(Volume {
            capacity_bytes: capacity,
            volume_id: if u.ratio(1, 8)? {
                String::new()
            } else {
                u.arbitrary()?
            },
            volume_context: (0..u.int_in_range(0..=2)?)
                .map(|_| Ok((u.arbitrary()?, u.arbitrary()?)))
                .collect::<Result<_>>()?,
            content_source: None,
            accessible_topology: topology,
        }),
    })
}

/// The property on one claim: every reader takes it without a panic, and they agree with each
/// other (the size with the quantity parser, the next step with the checks, the PV with the
/// request).
fn check_claim(u: &mut Unstructured, claim: &PersistentVolumeClaim) -> Result<()> {
    let class = StorageClass {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("fast".into()),
            ..Default::default()
        },
        provisioner: if u.ratio(7, 8)? {
            DRIVER.into()
        } else {
            "other".into()
        },
        volume_binding_mode: if u.arbitrary()? {
            Some("WaitForFirstConsumer".into())
        } else {
            None
        },
        reclaim_policy: Some("Delete".into()),
        ..Default::default()
    };
    let should = request::should_provision(claim, Some(&class), DRIVER);
    if should == Ok(true) {
        assert_eq!(request::storage_provisioner(claim), Some(DRIVER));
    }
    let _ = request::claim_class(claim);
    let _ = request::selected_node(claim);
    let _ = request::data_source(claim);
    let _ = request::is_block(claim);
    let _ = decide::has_legacy_intent(claim);
    let _ = decide::legacy_volume(claim);

    let storage = claim
        .spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"));
    match (request::requested_bytes(claim), storage) {
        (Ok(n), Some(q)) => assert_eq!(parse_bytes(&q.0), Ok(n)),
        (Ok(n), None) => assert_eq!(n, 0),
        (Err(_), q) => assert!(q.is_some_and(|q| parse_bytes(&q.0).is_err())),
    }

    let uid = claim.metadata.uid.as_deref().unwrap_or_default();
    let name = request::volume_name("pvc", u.int_in_range(-2..=40)?, uid);
    let view = ClaimView {
        claim,
        class: if u.ratio(7, 8)? { Some(&class) } else { None },
        driver: DRIVER,
        record: None,
        name: &name,
        pv_cached: u.arbitrary()?,
        infeasible: u.arbitrary()?,
        stale: u.arbitrary()?,
        named_has_class: u.arbitrary()?,
        another_node: u.arbitrary()?,
    };
    if let ClaimAction::Provision { volume } = decide::claim(&view) {
        assert_eq!(Ok(&volume), name.as_ref());
        assert_eq!(
            request::should_provision(claim, view.class, DRIVER),
            Ok(true)
        );
    }

    let opts = RequestOptions {
        extra_create_metadata: u.arbitrary()?,
        topology: u.arbitrary()?,
        single_node_multi_writer: u.arbitrary()?,
        controller_publish_readonly: u.arbitrary()?,
        ..Default::default()
    };
    let Ok(prepared) = request::prepare(claim, &class, DRIVER, &opts, &NoCluster) else {
        return Ok(());
    };
    assert!(prepared.requested_bytes >= 0);
    let response = response(u)?;
    if let Ok(built) = pv::build(
        &prepared,
        claim,
        &class,
        DRIVER,
        "1-2-csi.example.com",
        &response,
        &opts,
    ) {
        assert_eq!(
            built.metadata.name.as_deref(),
            Some(prepared.pv_name.as_str())
        );
        let spec = built.spec.as_ref().expect("a PV has a spec");
        let capacity = &spec.capacity.as_ref().expect("capacity")["storage"].0;
        let bytes = quantity::parse_bytes(capacity).expect("the PV's capacity parses");
        assert!(
            bytes >= prepared.requested_bytes,
            "{capacity} < {}",
            prepared.requested_bytes
        );
        assert_eq!(
            spec.claim_ref.as_ref().and_then(|r| r.uid.as_deref()),
            claim.metadata.uid.as_deref()
        );
        // It serialises, and reads back as a cached PV with the same driver and handle.
        let json = serde_json::to_value(&built).expect("the PV serialises");
        let cached: CachedPv = serde_json::from_value(json).expect("our PV reads back");
        let csi = cached.spec.and_then(|s| s.csi).expect("csi");
        assert_eq!(csi.driver, DRIVER);
    }
    Ok(())
}

/// The property on one PV: the cached form reads whatever the full type reads, the same
/// fields, and its next step is decided without a panic.
fn check_pv(u: &mut Unstructured, json: &Value) -> Result<()> {
    let cached = serde_json::from_value::<CachedPv>(json.clone());
    if let Ok(full) = serde_json::from_value::<PersistentVolume>(json.clone()) {
        let cached = cached.as_ref().unwrap_or_else(|e| {
            panic!("the cached form reads what the full type reads: {e}: {json}")
        });
        // The cached form keeps name, UID, resourceVersion, whether its finalizer is there and
        // deletionTimestamp (a missing one as empty); of the annotations, the provisioner's own become fields.
        let m = &full.metadata;
        assert_eq!(
            (
                &*cached.name,
                &*cached.uid,
                &*cached.resource_version,
                cached.has_finalizer,
                &cached.deletion_timestamp
            ),
            (
                m.name.as_deref().unwrap_or_default(),
                m.uid.as_deref().unwrap_or_default(),
                m.resource_version.as_deref().unwrap_or_default(),
                m.finalizers
                    .iter()
                    .flatten()
                    .any(|f| f == plugreg_provisioner::pv::FINALIZER),
                &m.deletion_timestamp
            )
        );
        let annotation = |k: &str| m.annotations.as_ref().and_then(|a| a.get(k)).cloned();
        assert_eq!(
            cached.provisioned_by.as_deref(),
            annotation(plugreg_provisioner::pv::ANN_PROVISIONED_BY).as_deref()
        );
        use plugreg_provisioner::cached::DeletionSecret;
        let secret = match (
            annotation(plugreg_provisioner::pv::ANN_DELETION_SECRET_NAME),
            annotation(plugreg_provisioner::pv::ANN_DELETION_SECRET_NAMESPACE),
        ) {
            (Some(n), Some(ns)) => DeletionSecret::Annotated(
                (!n.is_empty() && !ns.is_empty()).then(|| Box::new((n, ns))),
            ),
            _ => DeletionSecret::FromClass(
                full.spec
                    .as_ref()
                    .and_then(|s| s.claim_ref.as_ref())
                    .map(|r| {
                        Box::new((
                            r.name.clone().unwrap_or_default(),
                            r.namespace.clone().unwrap_or_default(),
                        ))
                    }),
            ),
        };
        assert_eq!(cached.deletion_secret, secret);
        let spec = full.spec.unwrap_or_default();
        let cspec = cached.spec.clone().unwrap_or_default();
        assert_eq!(
            cspec.persistent_volume_reclaim_policy,
            spec.persistent_volume_reclaim_policy
        );
        assert_eq!(cspec.storage_class_name, spec.storage_class_name);
        assert_eq!(
            cspec.csi.map(|c| (c.driver, c.volume_handle)),
            spec.csi.map(|c| (c.driver, c.volume_handle))
        );
        assert_eq!(
            cached.status.clone().and_then(|s| s.phase),
            full.status.and_then(|s| s.phase)
        );
    }
    if let Ok(pv) = &cached {
        let deleted = *u.choose(&[None, Some(Deleted::Volume), Some(Deleted::Finalized)])?;
        let _ = decide::volume(&VolumeView {
            pv,
            driver: DRIVER,
            deleted,
        });
    }
    Ok(())
}

/// The property: a claim and a PV from arbitrary JSON.
pub fn check(u: &mut Unstructured) -> Result<()> {
    let json = claim_json(u)?;
    if let Ok(claim) = serde_json::from_value::<PersistentVolumeClaim>(json) {
        check_claim(u, &claim)?;
    }
    let json = pv_json(u)?;
    check_pv(u, &json)
}
