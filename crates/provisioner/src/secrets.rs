//! Which Secret each CSI call gets (`docs/upstream/upstream-external-provisioner.md` §7.5): the StorageClass
//! names it with `csi.storage.k8s.io/<op>-secret-name` / `-namespace` (or the deprecated
//! `csi<Op>SecretName` keys, or the default pair), as templates over the PV and claim names.
//! Pure: resolving a reference reads no Secret; only the provisioner secret is ever read, by
//! the controller.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, SecretReference};

use crate::classify::ProvisionError;

/// A resolved Secret reference.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SecretRef {
    /// The Secret's name.
    pub name: String,
    /// The Secret's namespace.
    pub namespace: String,
}

impl SecretRef {
    /// The reference as the PV's `spec.csi.*SecretRef` carries it.
    pub fn to_k8s(&self) -> SecretReference {
        SecretReference {
            name: Some(self.name.clone()),
            namespace: Some(self.namespace.clone()),
        }
    }
}

/// The seven secrets a StorageClass can name, one per CSI call that carries secrets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SecretKind {
    /// CreateVolume and DeleteVolume (the only one the provisioner reads).
    Provisioner,
    /// ControllerPublishVolume / ControllerUnpublishVolume (external-attacher).
    ControllerPublish,
    /// NodeStageVolume (kubelet).
    NodeStage,
    /// NodePublishVolume (kubelet).
    NodePublish,
    /// ControllerExpandVolume (external-resizer).
    ControllerExpand,
    /// NodeExpandVolume (kubelet).
    NodeExpand,
    /// ControllerModifyVolume (external-resizer, VolumeAttributesClass).
    ControllerModify,
}

/// The keys of one kind: its name in error texts, the reserved keys, and the deprecated ones.
struct Keys {
    name: &'static str,
    name_key: &'static str,
    namespace_key: &'static str,
    deprecated: Option<(&'static str, &'static str)>,
}

const DEFAULT_KEYS: Keys = Keys {
    name: "Default",
    name_key: "csi.storage.k8s.io/secret-name",
    namespace_key: "csi.storage.k8s.io/secret-namespace",
    deprecated: None,
};

impl SecretKind {
    /// Every kind, in the order upstream resolves them.
    pub const ALL: [SecretKind; 7] = [
        SecretKind::Provisioner,
        SecretKind::ControllerPublish,
        SecretKind::NodeStage,
        SecretKind::NodePublish,
        SecretKind::ControllerExpand,
        SecretKind::NodeExpand,
        SecretKind::ControllerModify,
    ];

    fn keys(self) -> Keys {
        match self {
            SecretKind::Provisioner => Keys {
                name: "Provisioner",
                name_key: "csi.storage.k8s.io/provisioner-secret-name",
                namespace_key: "csi.storage.k8s.io/provisioner-secret-namespace",
                deprecated: Some(("csiProvisionerSecretName", "csiProvisionerSecretNamespace")),
            },
            SecretKind::ControllerPublish => Keys {
                name: "ControllerPublish",
                name_key: "csi.storage.k8s.io/controller-publish-secret-name",
                namespace_key: "csi.storage.k8s.io/controller-publish-secret-namespace",
                deprecated: Some((
                    "csiControllerPublishSecretName",
                    "csiControllerPublishSecretNamespace",
                )),
            },
            SecretKind::NodeStage => Keys {
                name: "NodeStage",
                name_key: "csi.storage.k8s.io/node-stage-secret-name",
                namespace_key: "csi.storage.k8s.io/node-stage-secret-namespace",
                deprecated: Some(("csiNodeStageSecretName", "csiNodeStageSecretNamespace")),
            },
            SecretKind::NodePublish => Keys {
                name: "NodePublish",
                name_key: "csi.storage.k8s.io/node-publish-secret-name",
                namespace_key: "csi.storage.k8s.io/node-publish-secret-namespace",
                deprecated: Some(("csiNodePublishSecretName", "csiNodePublishSecretNamespace")),
            },
            SecretKind::ControllerExpand => Keys {
                name: "ControllerExpand",
                name_key: "csi.storage.k8s.io/controller-expand-secret-name",
                namespace_key: "csi.storage.k8s.io/controller-expand-secret-namespace",
                deprecated: None,
            },
            SecretKind::NodeExpand => Keys {
                name: "NodeExpand",
                name_key: "csi.storage.k8s.io/node-expand-secret-name",
                namespace_key: "csi.storage.k8s.io/node-expand-secret-namespace",
                deprecated: None,
            },
            SecretKind::ControllerModify => Keys {
                name: "ControllerModify",
                name_key: "csi.storage.k8s.io/controller-modify-secret-name",
                namespace_key: "csi.storage.k8s.io/controller-modify-secret-namespace",
                deprecated: None,
            },
        }
    }
}

/// The resolved references of one claim, one per kind (the PV's secret refs and annotations).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PvSecrets {
    /// CreateVolume / DeleteVolume; becomes the PV's deletion-secret annotations.
    pub provisioner: Option<SecretRef>,
    /// `spec.csi.controllerPublishSecretRef`.
    pub controller_publish: Option<SecretRef>,
    /// `spec.csi.nodeStageSecretRef`.
    pub node_stage: Option<SecretRef>,
    /// `spec.csi.nodePublishSecretRef`.
    pub node_publish: Option<SecretRef>,
    /// `spec.csi.controllerExpandSecretRef`.
    pub controller_expand: Option<SecretRef>,
    /// `spec.csi.nodeExpandSecretRef`.
    pub node_expand: Option<SecretRef>,
    /// The PV's controller-modify-secret annotations (for external-resizer).
    pub controller_modify: Option<SecretRef>,
}

impl PvSecrets {
    /// Resolves all seven kinds in upstream's order; the first error wins.
    pub fn resolve_all(
        params: &BTreeMap<String, String>,
        pv_name: &str,
        claim: &PersistentVolumeClaim,
    ) -> Result<Self, ProvisionError> {
        let r = |kind| resolve(kind, params, pv_name, claim);
        Ok(Self {
            provisioner: r(SecretKind::Provisioner)?,
            controller_publish: r(SecretKind::ControllerPublish)?,
            node_stage: r(SecretKind::NodeStage)?,
            node_publish: r(SecretKind::NodePublish)?,
            controller_expand: r(SecretKind::ControllerExpand)?,
            node_expand: r(SecretKind::NodeExpand)?,
            controller_modify: r(SecretKind::ControllerModify)?,
        })
    }

    /// The reference of one kind.
    pub fn get(&self, kind: SecretKind) -> Option<&SecretRef> {
        match kind {
            SecretKind::Provisioner => self.provisioner.as_ref(),
            SecretKind::ControllerPublish => self.controller_publish.as_ref(),
            SecretKind::NodeStage => self.node_stage.as_ref(),
            SecretKind::NodePublish => self.node_publish.as_ref(),
            SecretKind::ControllerExpand => self.controller_expand.as_ref(),
            SecretKind::NodeExpand => self.node_expand.as_ref(),
            SecretKind::ControllerModify => self.controller_modify.as_ref(),
        }
    }
}

/// Resolves the Secret of `kind` for the PV `pv_name` of `claim` (§7.5), or `None` when the
/// class names none. Every error is no-change, with upstream's text.
///
/// The provisioner secret sees only the claim's name and namespace: upstream hands it a claim
/// without annotations, so `${pvc.annotations['…']}` is an invalid token there.
pub fn resolve(
    kind: SecretKind,
    params: &BTreeMap<String, String>,
    pv_name: &str,
    claim: &PersistentVolumeClaim,
) -> Result<Option<SecretRef>, ProvisionError> {
    let templates = match templates(&kind.keys(), params) {
        Err(e) => {
            return Err(ProvisionError::no_change(format!(
                "failed to get name and namespace template from params: {e}"
            )));
        }
        Ok(Some(t)) => t,
        Ok(None) => match templates(&DEFAULT_KEYS, params) {
            Err(e) => {
                return Err(ProvisionError::no_change(format!(
                    "failed to get default name and namespace template from params: {e}"
                )));
            }
            Ok(Some(t)) => t,
            Ok(None) => return Ok(None),
        },
    };
    let (name_tpl, namespace_tpl) = templates;
    let pvc_name = claim.metadata.name.as_deref().unwrap_or_default();
    let pvc_namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
    let annotations = match kind {
        SecretKind::Provisioner => None,
        _ => claim.metadata.annotations.as_ref(),
    };

    // The namespace may use only what the claim's user does not control.
    let namespace = expand(&namespace_tpl, |token| match token {
        "pv.name" => Some(pv_name.to_owned()),
        "pvc.namespace" => Some(pvc_namespace.to_owned()),
        _ => None,
    })
    .map_err(|e| {
        ProvisionError::no_change(format!(
            "error resolving value {}: {e}",
            go_quote(&namespace_tpl)
        ))
    })?;
    if !is_dns1123_label(&namespace) {
        return Err(ProvisionError::no_change(invalid_text(
            &namespace_tpl,
            &namespace,
            "namespace",
        )));
    }

    let name = expand(&name_tpl, |token| match token {
        "pv.name" => Some(pv_name.to_owned()),
        "pvc.name" => Some(pvc_name.to_owned()),
        "pvc.namespace" => Some(pvc_namespace.to_owned()),
        _ => {
            let key = token
                .strip_prefix("pvc.annotations['")?
                .strip_suffix("']")?;
            annotations?.get(key).cloned()
        }
    })
    .map_err(|e| {
        ProvisionError::no_change(format!(
            "error resolving value {}: {e}",
            go_quote(&name_tpl)
        ))
    })?;
    if !is_dns1123_subdomain(&name) {
        return Err(ProvisionError::no_change(invalid_text(
            &name_tpl, &name, "secret",
        )));
    }
    Ok(Some(SecretRef { name, namespace }))
}

/// The deprecation warnings the class's secret keys cause (upstream logs one per deprecated
/// key it reads), in upstream's text.
pub fn deprecation_warnings(params: &BTreeMap<String, String>) -> Vec<String> {
    let mut out = Vec::new();
    for kind in SecretKind::ALL {
        let keys = kind.keys();
        if let Some((dep_name, dep_namespace)) = keys.deprecated {
            for (dep, new) in [
                (dep_name, keys.name_key),
                (dep_namespace, keys.namespace_key),
            ] {
                if params.contains_key(dep) {
                    out.push(deprecation_warning(dep, new));
                }
            }
        }
    }
    out
}

/// Upstream's `deprecationWarning` text.
pub(crate) fn deprecation_warning(deprecated: &str, new: &str) -> String {
    format!(
        "\"{deprecated}\" is deprecated and will be removed in a future release, please use \"{new}\" instead"
    )
}

fn invalid_text(template: &str, resolved: &str, what: &str) -> String {
    if template != resolved {
        format!(
            "{} resolved to {} which is not a valid {what} name",
            go_quote(template),
            go_quote(resolved)
        )
    } else {
        format!("{} is not a valid {what} name", go_quote(template))
    }
}

/// The name and namespace templates of one kind: `None` when neither key is given.
fn templates(
    keys: &Keys,
    params: &BTreeMap<String, String>,
) -> Result<Option<(String, String)>, String> {
    let mut names = Vec::new();
    let mut namespaces = Vec::new();
    if let Some((dep_name, dep_namespace)) = keys.deprecated {
        names.extend(params.get(dep_name));
        namespaces.extend(params.get(dep_namespace));
    }
    names.extend(params.get(keys.name_key));
    namespaces.extend(params.get(keys.namespace_key));
    let kind = keys.name;
    if names.len() > 1 || namespaces.len() > 1 {
        return Err(format!(
            "{kind} secrets specified in parameters with both \"csi\" and \"csi.storage.k8s.io/\" keys"
        ));
    }
    match (names.last(), namespaces.last()) {
        (None, None) => Ok(None),
        (Some(name), Some(namespace)) => {
            if name.is_empty() || namespace.is_empty() {
                Err(format!(
                    "{kind} secrets specified in parameters but value of either namespace or name is empty"
                ))
            } else {
                Ok(Some(((*name).clone(), (*namespace).clone())))
            }
        }
        _ => Err(format!(
            "either name and namespace for {kind} secrets specified, Both must be specified"
        )),
    }
}

/// Go's `os.Expand`: `${name}` or `$name` (letters, digits, `_`), a one-character special
/// variable (`$1`, `$*`, …), `${}` and an unclosed `${` are dropped, a lone `$` stays. Unknown
/// names are collected into upstream's `invalid tokens: [...]` error (sorted, Go-quoted).
fn expand(template: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<String, String> {
    let bytes = template.as_bytes();
    let mut out = String::with_capacity(template.len());
    let mut missing = BTreeSet::new();
    let mut copied = 0;
    let mut j = 0;
    while j < bytes.len() {
        if bytes[j] == b'$' && j + 1 < bytes.len() {
            out.push_str(&template[copied..j]);
            let (name, width) = shell_name(&template[j + 1..]);
            match name {
                None if width > 0 => {} // bad syntax: eaten
                None => out.push('$'),
                Some(name) => match lookup(name) {
                    Some(v) => out.push_str(&v),
                    None => {
                        missing.insert(name.to_owned());
                    }
                },
            }
            j += width;
            copied = j + 1;
        }
        j += 1;
    }
    out.push_str(&template[copied.min(template.len())..]);
    if missing.is_empty() {
        Ok(out)
    } else {
        let list: Vec<String> = missing.iter().map(|t| go_quote(t)).collect();
        Err(format!("invalid tokens: [{}]", list.join(" ")))
    }
}

/// Go's `getShellName`: the name after a `$` and how many bytes it takes.
fn shell_name(s: &str) -> (Option<&str>, usize) {
    let b = s.as_bytes();
    let special = |c: u8| b"*#$@!?-0123456789".contains(&c);
    if b[0] == b'{' {
        if b.len() > 2 && special(b[1]) && b[2] == b'}' {
            return (Some(&s[1..2]), 3);
        }
        return match b.iter().skip(1).position(|&c| c == b'}') {
            Some(0) => (None, 2), // "${}"
            Some(i) => (Some(&s[1..i + 1]), i + 2),
            None => (None, 1), // unclosed "${"
        };
    }
    if special(b[0]) {
        return (Some(&s[..1]), 1);
    }
    let n = b
        .iter()
        .take_while(|c| c.is_ascii_alphanumeric() || **c == b'_')
        .count();
    if n == 0 {
        (None, 0)
    } else {
        (Some(&s[..n]), n)
    }
}

/// Go's `%q` of a string (`strconv.Quote`) for the texts upstream prints.
pub(crate) use plugreg_sidecar_kit::gotext::quote as go_quote;

fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= 63
        && alnum(&b[0])
        && alnum(&b[b.len() - 1])
        && b.iter().all(|c| alnum(c) || *c == b'-')
}

fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|part| {
            // Each dot-separated part is a label without the 63-character limit.
            let b = part.as_bytes();
            let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
            !b.is_empty()
                && alnum(&b[0])
                && alnum(&b[b.len() - 1])
                && b.iter().all(|c| alnum(c) || *c == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::State;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn claim() -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some("data-0".into()),
                namespace: Some("apps".into()),
                annotations: Some(BTreeMap::from([
                    (
                        "example.com/secret".to_owned(),
                        "from-annotation".to_owned(),
                    ),
                    ("bad".to_owned(), "Not_Valid".to_owned()),
                ])),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn params(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn ok(kind: SecretKind, kv: &[(&str, &str)]) -> Option<SecretRef> {
        resolve(kind, &params(kv), "pvc-1234", &claim()).unwrap()
    }

    fn err(kind: SecretKind, kv: &[(&str, &str)]) -> String {
        let e = resolve(kind, &params(kv), "pvc-1234", &claim()).unwrap_err();
        assert_eq!(e.state, State::NoChange, "{e}");
        e.message
    }

    fn sref(name: &str, namespace: &str) -> Option<SecretRef> {
        Some(SecretRef {
            name: name.into(),
            namespace: namespace.into(),
        })
    }

    #[test]
    fn no_keys_means_no_secret() {
        for kind in SecretKind::ALL {
            assert_eq!(ok(kind, &[("other", "x")]), None, "{kind:?}");
        }
    }

    #[test]
    fn each_kind_reads_its_own_reserved_keys() {
        for kind in SecretKind::ALL {
            let k = kind.keys();
            let got = ok(kind, &[(k.name_key, "s"), (k.namespace_key, "ns")]);
            assert_eq!(got, sref("s", "ns"), "{kind:?}");
            // Another kind's keys are not this kind's.
            for other in SecretKind::ALL.into_iter().filter(|o| *o != kind) {
                assert_eq!(
                    ok(other, &[(k.name_key, "s"), (k.namespace_key, "ns")]),
                    None
                );
            }
        }
    }

    #[test]
    fn the_first_four_kinds_accept_the_deprecated_keys() {
        let cases = [
            (
                SecretKind::Provisioner,
                "csiProvisionerSecretName",
                "csiProvisionerSecretNamespace",
            ),
            (
                SecretKind::ControllerPublish,
                "csiControllerPublishSecretName",
                "csiControllerPublishSecretNamespace",
            ),
            (
                SecretKind::NodeStage,
                "csiNodeStageSecretName",
                "csiNodeStageSecretNamespace",
            ),
            (
                SecretKind::NodePublish,
                "csiNodePublishSecretName",
                "csiNodePublishSecretNamespace",
            ),
        ];
        for (kind, name_key, ns_key) in cases {
            assert_eq!(
                ok(kind, &[(name_key, "old"), (ns_key, "ns")]),
                sref("old", "ns")
            );
        }
        let p = params(&[
            ("csiProvisionerSecretName", "a"),
            ("csiNodeStageSecretNamespace", "b"),
        ]);
        assert_eq!(
            deprecation_warnings(&p),
            [
                "\"csiProvisionerSecretName\" is deprecated and will be removed in a future release, please use \"csi.storage.k8s.io/provisioner-secret-name\" instead",
                "\"csiNodeStageSecretNamespace\" is deprecated and will be removed in a future release, please use \"csi.storage.k8s.io/node-stage-secret-namespace\" instead",
            ]
        );
    }

    #[test]
    fn both_deprecated_and_reserved_key_is_an_error() {
        assert_eq!(
            err(
                SecretKind::NodeStage,
                &[
                    ("csiNodeStageSecretName", "a"),
                    ("csi.storage.k8s.io/node-stage-secret-name", "b"),
                    ("csi.storage.k8s.io/node-stage-secret-namespace", "ns"),
                ]
            ),
            "failed to get name and namespace template from params: NodeStage secrets specified in parameters with both \"csi\" and \"csi.storage.k8s.io/\" keys"
        );
    }

    #[test]
    fn name_without_namespace_is_an_error() {
        assert_eq!(
            err(
                SecretKind::ControllerExpand,
                &[("csi.storage.k8s.io/controller-expand-secret-name", "a")]
            ),
            "failed to get name and namespace template from params: either name and namespace for ControllerExpand secrets specified, Both must be specified"
        );
    }

    #[test]
    fn empty_value_is_an_error() {
        assert_eq!(
            err(
                SecretKind::Provisioner,
                &[
                    ("csi.storage.k8s.io/provisioner-secret-name", ""),
                    ("csi.storage.k8s.io/provisioner-secret-namespace", "ns"),
                ]
            ),
            "failed to get name and namespace template from params: Provisioner secrets specified in parameters but value of either namespace or name is empty"
        );
    }

    #[test]
    fn the_default_pair_applies_to_every_kind_without_own_keys() {
        let kv = [
            ("csi.storage.k8s.io/secret-name", "shared"),
            ("csi.storage.k8s.io/secret-namespace", "ns"),
            ("csi.storage.k8s.io/node-stage-secret-name", "own"),
            ("csi.storage.k8s.io/node-stage-secret-namespace", "ns2"),
        ];
        for kind in SecretKind::ALL {
            let want = if kind == SecretKind::NodeStage {
                sref("own", "ns2")
            } else {
                sref("shared", "ns")
            };
            assert_eq!(ok(kind, &kv), want, "{kind:?}");
        }
        assert_eq!(
            err(
                SecretKind::NodeExpand,
                &[("csi.storage.k8s.io/secret-namespace", "ns")]
            ),
            "failed to get default name and namespace template from params: either name and namespace for Default secrets specified, Both must be specified"
        );
        assert_eq!(
            err(
                SecretKind::NodeExpand,
                &[
                    ("csi.storage.k8s.io/secret-name", "x"),
                    ("csi.storage.k8s.io/secret-namespace", "")
                ]
            ),
            "failed to get default name and namespace template from params: Default secrets specified in parameters but value of either namespace or name is empty"
        );
    }

    #[test]
    fn every_template_token_resolves() {
        let k = SecretKind::NodePublish.keys();
        let got = ok(
            SecretKind::NodePublish,
            &[
                (
                    k.name_key,
                    "${pvc.name}.${pvc.namespace}.${pv.name}.${pvc.annotations['example.com/secret']}",
                ),
                (k.namespace_key, "${pvc.namespace}-${pv.name}"),
            ],
        );
        assert_eq!(
            got,
            sref("data-0.apps.pvc-1234.from-annotation", "apps-pvc-1234")
        );
        // Bare `$name` stops at the first non-identifier character; `$$` is a special variable.
        assert_eq!(
            err(
                SecretKind::NodePublish,
                &[(k.name_key, "$pv.name"), (k.namespace_key, "ns")]
            ),
            "error resolving value \"$pv.name\": invalid tokens: [\"pv\"]"
        );
    }

    #[test]
    fn namespace_template_may_not_use_the_claim_name_or_annotations() {
        let k = SecretKind::NodeStage.keys();
        assert_eq!(
            err(
                SecretKind::NodeStage,
                &[
                    (k.name_key, "s"),
                    (
                        k.namespace_key,
                        "${pvc.name}-${pvc.annotations['example.com/secret']}"
                    )
                ]
            ),
            "error resolving value \"${pvc.name}-${pvc.annotations['example.com/secret']}\": invalid tokens: [\"pvc.annotations['example.com/secret']\" \"pvc.name\"]"
        );
    }

    #[test]
    fn the_provisioner_secret_sees_no_annotations() {
        let k = SecretKind::Provisioner.keys();
        assert_eq!(
            err(
                SecretKind::Provisioner,
                &[
                    (k.name_key, "${pvc.annotations['example.com/secret']}"),
                    (k.namespace_key, "ns")
                ]
            ),
            "error resolving value \"${pvc.annotations['example.com/secret']}\": invalid tokens: [\"pvc.annotations['example.com/secret']\"]"
        );
        let k = SecretKind::ControllerModify.keys();
        assert_eq!(
            ok(
                SecretKind::ControllerModify,
                &[
                    (k.name_key, "${pvc.annotations['example.com/secret']}"),
                    (k.namespace_key, "ns")
                ]
            ),
            sref("from-annotation", "ns")
        );
    }

    #[test]
    fn unknown_tokens_are_listed_sorted() {
        let k = SecretKind::NodeStage.keys();
        assert_eq!(
            err(
                SecretKind::NodeStage,
                &[(k.name_key, "${zz}${aa}${zz}"), (k.namespace_key, "ns")]
            ),
            "error resolving value \"${zz}${aa}${zz}\": invalid tokens: [\"aa\" \"zz\"]"
        );
    }

    #[test]
    fn invalid_resolved_values_are_errors() {
        let k = SecretKind::NodeStage.keys();
        assert_eq!(
            err(
                SecretKind::NodeStage,
                &[(k.name_key, "s"), (k.namespace_key, "Bad_NS")]
            ),
            "\"Bad_NS\" is not a valid namespace name"
        );
        assert_eq!(
            err(
                SecretKind::NodeStage,
                &[(k.name_key, "s"), (k.namespace_key, "${pv.name}.x")]
            ),
            "\"${pv.name}.x\" resolved to \"pvc-1234.x\" which is not a valid namespace name"
        );
        assert_eq!(
            err(
                SecretKind::NodeStage,
                &[(k.name_key, "Bad Name"), (k.namespace_key, "ns")]
            ),
            "\"Bad Name\" is not a valid secret name"
        );
        assert_eq!(
            err(
                SecretKind::NodeStage,
                &[
                    (k.name_key, "${pvc.annotations['bad']}"),
                    (k.namespace_key, "ns")
                ]
            ),
            "\"${pvc.annotations['bad']}\" resolved to \"Not_Valid\" which is not a valid secret name"
        );
        // A subdomain may hold dots; a namespace (label) may not, nor exceed 63 characters.
        assert_eq!(
            ok(
                SecretKind::NodeStage,
                &[(k.name_key, "a.b-c"), (k.namespace_key, "ns")]
            ),
            sref("a.b-c", "ns")
        );
        let long = "a".repeat(64);
        assert_eq!(
            err(
                SecretKind::NodeStage,
                &[(k.name_key, "s"), (k.namespace_key, &long)]
            ),
            format!("\"{long}\" is not a valid namespace name")
        );
    }

    #[test]
    fn expand_follows_go_os_expand() {
        let look = |t: &str| (t == "x").then(|| "X".to_owned());
        assert_eq!(expand("a$", look).unwrap(), "a$");
        assert_eq!(expand("${x}$x", look).unwrap(), "XX");
        assert_eq!(expand("a${}b", look).unwrap(), "ab");
        assert_eq!(expand("a${x", look).unwrap(), "ax");
        assert_eq!(expand("$-x", look).unwrap_err(), "invalid tokens: [\"-\"]");
        assert_eq!(expand("a$/b", look).unwrap(), "a$/b");
        assert_eq!(expand("plain", look).unwrap(), "plain");
    }
}
