//! `--node-deployment` (§B.4): a node's attempt to become the owner of a claim of immediate
//! binding, decided without I/O. The claim's worker waits its turn, watches the cached claim,
//! asks the driver for capacity and writes its node into the claim; each answer is read here:
//! - [`excluded`]: whether the class's allowed topologies exclude this node (no attempt);
//! - [`waited`]: the cached claim while waiting: wait on, stop, or fail;
//! - [`capacity_check`] and [`capacity_answer`]: whether the node has room for the claim;
//! - [`patch`] and [`patched`]: the write that makes the node the owner, and its answer.

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use plugreg_proto::csi::v1::{GetCapacityRequest, Topology};
use serde_json::json;

use crate::node::{self, Waiting};
use crate::plan::ApiError;
use crate::request::{self, ANN_SELECTED_NODE, RequestOptions};
use crate::secrets::go_quote;
use crate::topology::{self, TopologySource};

/// The claim's `namespace/name`, as the log lines and errors name it.
pub fn key(claim: &PersistentVolumeClaim) -> String {
    format!(
        "{}/{}",
        claim.namespace().unwrap_or_default(),
        claim.name_any()
    )
}

/// What the owner checks read besides the claim.
#[derive(Clone, Copy)]
pub struct Context<'a> {
    /// This node's name.
    pub node: &'a str,
    /// The claim's class.
    pub class: &'a StorageClass,
    /// The driver name.
    pub driver: &'a str,
    /// The request options from the flags.
    pub options: &'a RequestOptions,
    /// The cluster's topology (with `--node-deployment`, this node only).
    pub topology: &'a (dyn TopologySource + Sync),
}

/// Why the class's allowed topologies exclude this node (the debug line; then the node does
/// not try to become the claim's owner); none: they do not, or topology is off.
pub fn excluded(claim: &PersistentVolumeClaim, cx: &Context<'_>) -> Option<String> {
    let restricted = cx
        .class
        .allowed_topologies
        .as_ref()
        .is_some_and(|t| !t.is_empty());
    if !cx.options.topology || !restricted {
        return None;
    }
    let e = topology::requirements(
        &claim.name_any(),
        Some(cx.node),
        cx.class,
        cx.driver,
        cx.options.strict_topology,
        cx.options.immediate_topology,
        cx.topology,
    )
    .err()?;
    Some(format!(
        "the allowed topologies of storage class {} are not compatible with node {} for PVC {}: {}",
        cx.class.name_any(),
        cx.node,
        key(claim),
        e.message
    ))
}

/// What the waiting node does with the claim as cached now.
#[derive(Debug, Clone, PartialEq)]
pub enum Waited {
    /// Still nobody's: wait on (at the deadline, go on with this claim).
    Free(Box<PersistentVolumeClaim>),
    /// Stop without an error.
    Stop {
        /// Forget this node's attempts at the claim (the next wait starts short again).
        forget_attempts: bool,
        /// The debug line, if any.
        log: Option<String>,
    },
    /// Stop with this error.
    Fail(String),
}

/// §B.4 step 2: the claim `name` (with `uid`) as cached now (none: gone), for the node
/// `node`.
pub fn waited(current: Option<PersistentVolumeClaim>, name: &str, uid: &str, node: &str) -> Waited {
    let Some(current) = current else {
        return Waited::Fail(format!(
            "PVC not found: persistentvolumeclaim {} not found",
            go_quote(name)
        ));
    };
    match node::waiting(&current, uid, node) {
        Waiting::Free => Waited::Free(Box::new(current)),
        Waiting::Replaced => Waited::Fail("PVC was replaced".to_owned()),
        Waiting::Bound => Waited::Stop {
            forget_attempts: true,
            log: Some(format!(
                "PVC {} is bound already, not trying to become its owner",
                key(&current)
            )),
        },
        // Another node's now (or ours: its event brings the claim back).
        Waiting::Taken { ours } => Waited::Stop {
            forget_attempts: !ours,
            log: None,
        },
    }
}

/// Whether to ask the driver for capacity.
#[derive(Debug, Clone, PartialEq)]
pub enum CapacityCheck {
    /// Go on without asking (with the debug line, if any).
    Proceed(Option<String>),
    /// Ask these: any answer of at least `needed` bytes is room.
    Ask {
        /// The claim's bytes.
        needed: i64,
        /// One request per topology term of the claim's request (one without topology).
        requests: Vec<GetCapacityRequest>,
    },
}

/// §B.4 step 3: what to ask the driver to know whether this node has room for the claim. A
/// claim of zero bytes needs no room; a request that cannot be prepared lets the node
/// proceed, as upstream. Unlike upstream, preparing the request has no side effects (no
/// finalizer is added to a data source, no secret is read): the request is only looked at.
pub fn capacity_check(claim: &PersistentVolumeClaim, cx: &Context<'_>) -> CapacityCheck {
    let mut claim = claim.clone();
    claim
        .annotations_mut()
        .insert(ANN_SELECTED_NODE.to_owned(), cx.node.to_owned());
    let prepared = request::csi_class(cx.class, cx.driver).and_then(|(class, _)| {
        request::prepare(&claim, &class, cx.driver, cx.options, cx.topology)
    });
    let prepared = match prepared {
        Ok(p) => p,
        Err(e) => {
            return CapacityCheck::Proceed(Some(format!(
                "proceeding with becoming owner of PVC {} although the capacity check failed: {}",
                key(&claim),
                e.message
            )));
        }
    };
    if prepared.requested_bytes == 0 {
        return CapacityCheck::Proceed(None);
    }
    let terms: Vec<Option<Topology>> = match prepared
        .request
        .accessibility_requirements
        .as_ref()
        .filter(|r| !r.requisite.is_empty())
    {
        Some(r) => r.requisite.iter().cloned().map(Some).collect(),
        None => vec![None],
    };
    let requests = terms
        .into_iter()
        .map(|term| GetCapacityRequest {
            volume_capabilities: prepared.request.volume_capabilities.clone(),
            parameters: prepared.request.parameters.clone(),
            accessible_topology: term,
        })
        .collect();
    CapacityCheck::Ask {
        needed: prepared.requested_bytes,
        requests,
    }
}

/// What one GetCapacity answer means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CapacityAnswer {
    /// Room enough.
    Enough,
    /// Too little: ask the next term (none left: no room).
    Short,
    /// The call failed: go on as if there were room, as upstream (with the debug line).
    Proceed(String),
}

/// One GetCapacity answer (its available bytes) for the claim `key` of `needed` bytes.
pub fn capacity_answer(
    key: &str,
    answer: Result<i64, tonic::Status>,
    needed: i64,
) -> CapacityAnswer {
    match answer {
        Ok(available) if available >= needed => CapacityAnswer::Enough,
        Ok(_) => CapacityAnswer::Short,
        Err(status) => CapacityAnswer::Proceed(format!(
            "proceeding with becoming owner of PVC {key} although the capacity check failed: GetCapacity: {}",
            plugreg_runtime::report::grpc(&status)
        )),
    }
}

/// The write that makes `node` the claim's owner: upstream's Update, as a merge patch that
/// carries the cached resourceVersion (the same precondition, without sending the whole
/// claim back: the cache keeps only part of it).
pub fn patch(current: &PersistentVolumeClaim, node: &str) -> serde_json::Value {
    json!({"metadata": {
        "resourceVersion": current.resource_version(),
        "annotations": {ANN_SELECTED_NODE: node},
    }})
}

/// The answer to [`patch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Patched {
    /// The node is the owner now: forget its attempts.
    Owner,
    /// A conflict: wait the next turn and try again.
    Retry,
    /// Stop with this error.
    Fail(String),
}

/// The answer to [`patch`] for `node`.
pub fn patched(answer: Result<(), ApiError>, node: &str) -> Patched {
    match answer {
        Ok(()) => Patched::Owner,
        Err(e) if e.code == Some(409) => Patched::Retry,
        Err(e) => Patched::Fail(format!(
            "selecting node {} for PVC failed: {}",
            go_quote(node),
            e.message
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::tests::{claim_with, class};
    use crate::topology::tests::{Cluster, DRIVER};
    use k8s_openapi::api::core::v1::{
        PersistentVolumeClaimStatus, TopologySelectorLabelRequirement, TopologySelectorTerm,
    };

    const UID: &str = "5f1e3b7c-9a2d-4e8f-b6c1-0d2e3f4a5b6c";
    const GIB: i64 = 1 << 30;

    fn cx<'a>(
        class: &'a StorageClass,
        options: &'a RequestOptions,
        cluster: &'a Cluster,
    ) -> Context<'a> {
        Context {
            node: "n1",
            class,
            driver: DRIVER,
            options,
            topology: cluster,
        }
    }

    fn in_zone(zone: &str) -> StorageClass {
        StorageClass {
            allowed_topologies: Some(vec![TopologySelectorTerm {
                match_label_expressions: Some(vec![TopologySelectorLabelRequirement {
                    key: "zone".into(),
                    values: vec![zone.into()],
                }]),
            }]),
            ..class()
        }
    }

    #[test]
    fn allowed_topologies_may_exclude_the_node() {
        let cluster = Cluster::default().with_node("n1", &[("zone", "z1")], &["zone"]);
        let topology = RequestOptions {
            topology: true,
            ..Default::default()
        };
        let off = RequestOptions::default();
        let claim = claim_with(UID);
        let (plain, here, there) = (class(), in_zone("z1"), in_zone("z2"));
        let cases = [
            ("topology off", &there, &off, false),
            ("no allowed topologies", &plain, &topology, false),
            ("allowed here", &here, &topology, false),
            ("allowed elsewhere", &there, &topology, true),
        ];
        for (what, class, options, want) in cases {
            let got = excluded(&claim, &cx(class, options, &cluster));
            assert_eq!(got.is_some(), want, "{what}: {got:?}");
        }
        let why = excluded(&claim, &cx(&there, &topology, &cluster)).unwrap();
        assert!(
            why.starts_with(
                "the allowed topologies of storage class fast are not compatible with node n1 for PVC apps/data: "
            ),
            "{why}"
        );
    }

    #[test]
    fn waits() {
        let free = claim_with(UID);
        let mut bound = claim_with(UID);
        bound.status = Some(PersistentVolumeClaimStatus {
            phase: Some("Bound".into()),
            ..Default::default()
        });
        let on = |n: &str| {
            let mut c = claim_with(UID);
            c.annotations_mut()
                .insert(ANN_SELECTED_NODE.into(), n.into());
            c
        };
        let stop = |forget_attempts, log: Option<&str>| Waited::Stop {
            forget_attempts,
            log: log.map(str::to_owned),
        };
        let cases = [
            (
                "gone",
                None,
                Waited::Fail("PVC not found: persistentvolumeclaim \"data\" not found".into()),
            ),
            ("free", Some(free.clone()), Waited::Free(Box::new(free))),
            (
                "replaced",
                Some(claim_with("another-uid")),
                Waited::Fail("PVC was replaced".into()),
            ),
            (
                "bound",
                Some(bound),
                stop(
                    true,
                    Some("PVC apps/data is bound already, not trying to become its owner"),
                ),
            ),
            ("taken by another node", Some(on("n2")), stop(true, None)),
            ("taken by this node", Some(on("n1")), stop(false, None)),
        ];
        for (what, current, want) in cases {
            assert_eq!(waited(current, "data", UID, "n1"), want, "{what}");
        }
    }

    #[test]
    fn capacity_is_asked_per_term() {
        let options = RequestOptions::default();
        let plain = class();
        let cluster = Cluster::default();
        match capacity_check(&claim_with(UID), &cx(&plain, &options, &cluster)) {
            CapacityCheck::Ask { needed, requests } => {
                assert_eq!(needed, GIB);
                assert_eq!(requests.len(), 1);
                assert_eq!(requests[0].accessible_topology, None);
            }
            other => panic!("{other:?}"),
        }
        // With topology: one request per requisite term.
        let topology = RequestOptions {
            topology: true,
            ..Default::default()
        };
        let cluster = Cluster::default().with_node("n1", &[("zone", "z1")], &["zone"]);
        match capacity_check(&claim_with(UID), &cx(&plain, &topology, &cluster)) {
            CapacityCheck::Ask { requests, .. } => {
                let terms: Vec<_> = requests
                    .iter()
                    .map(|r| r.accessible_topology.clone().unwrap().segments)
                    .collect();
                assert_eq!(terms.len(), 1);
                assert_eq!(terms[0].get("zone").map(String::as_str), Some("z1"));
            }
            other => panic!("{other:?}"),
        }
        // No bytes: no room needed.
        let mut empty = claim_with(UID);
        empty.spec.as_mut().unwrap().resources = None;
        assert_eq!(
            capacity_check(&empty, &cx(&plain, &options, &Cluster::default())),
            CapacityCheck::Proceed(None)
        );
        // A request that cannot be prepared: proceed (the node's CSINode is missing).
        match capacity_check(&claim_with(UID), &cx(&plain, &topology, &Cluster::default())) {
            CapacityCheck::Proceed(Some(why)) => assert!(
                why.starts_with(
                    "proceeding with becoming owner of PVC apps/data although the capacity check failed: "
                ),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn capacity_answers() {
        let cases = [
            ("more", Ok(2 * GIB), CapacityAnswer::Enough),
            ("just enough", Ok(GIB), CapacityAnswer::Enough),
            ("too little", Ok(GIB - 1), CapacityAnswer::Short),
            (
                "failed",
                Err(tonic::Status::unavailable("down")),
                CapacityAnswer::Proceed(
                    "proceeding with becoming owner of PVC apps/data although the capacity check failed: GetCapacity: rpc error: code = Unavailable desc = down".into(),
                ),
            ),
        ];
        for (what, answer, want) in cases {
            assert_eq!(capacity_answer("apps/data", answer, GIB), want, "{what}");
        }
    }

    #[test]
    fn patches_and_their_answers() {
        let mut c = claim_with(UID);
        c.metadata.resource_version = Some("7".into());
        assert_eq!(
            patch(&c, "n1"),
            json!({"metadata": {"resourceVersion": "7",
                "annotations": {ANN_SELECTED_NODE: "n1"}}})
        );
        let err = |code| ApiError {
            code,
            text: "text".into(),
            message: "message".into(),
        };
        let cases = [
            ("written", Ok(()), Patched::Owner),
            ("conflict", Err(err(Some(409))), Patched::Retry),
            (
                "refused",
                Err(err(Some(403))),
                Patched::Fail("selecting node \"n1\" for PVC failed: message".into()),
            ),
            (
                "no answer",
                Err(err(None)),
                Patched::Fail("selecting node \"n1\" for PVC failed: message".into()),
            ),
        ];
        for (what, answer, want) in cases {
            assert_eq!(patched(answer, "n1"), want, "{what}");
        }
    }
}
