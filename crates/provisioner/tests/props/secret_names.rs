//! The checks behind the `secret_names` fuzz target and its property test: the Secret a CSI call
//! gets, resolved from a StorageClass's `csi.storage.k8s.io/*-secret-name` / `-namespace`
//! templates over the PV and claim names (`plugreg_provisioner::secrets`).
//!
//! Shared by `tests/props.rs` (arbtest, in the normal suite) and
//! `fuzz/fuzz_targets/secret_names.rs` (libFuzzer), which include this file with `#[path]`; the
//! including crate provides `crate::arbitrary` (the `arbitrary` crate).

use std::collections::BTreeMap;

use crate::arbitrary::{Result, Unstructured};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use plugreg_provisioner::classify::State;
use plugreg_provisioner::secrets::{self, SecretKind, SecretRef};

/// A (name, namespace) pair of keys.
type Pair = (&'static str, &'static str);

/// Each kind's (name, namespace) keys, then the deprecated pair, written out apart from the
/// crate's table.
const KEYS: [(&str, &str, Option<Pair>); 7] = [
    (
        "csi.storage.k8s.io/provisioner-secret-name",
        "csi.storage.k8s.io/provisioner-secret-namespace",
        Some(("csiProvisionerSecretName", "csiProvisionerSecretNamespace")),
    ),
    (
        "csi.storage.k8s.io/controller-publish-secret-name",
        "csi.storage.k8s.io/controller-publish-secret-namespace",
        Some((
            "csiControllerPublishSecretName",
            "csiControllerPublishSecretNamespace",
        )),
    ),
    (
        "csi.storage.k8s.io/node-stage-secret-name",
        "csi.storage.k8s.io/node-stage-secret-namespace",
        Some(("csiNodeStageSecretName", "csiNodeStageSecretNamespace")),
    ),
    (
        "csi.storage.k8s.io/node-publish-secret-name",
        "csi.storage.k8s.io/node-publish-secret-namespace",
        Some(("csiNodePublishSecretName", "csiNodePublishSecretNamespace")),
    ),
    (
        "csi.storage.k8s.io/controller-expand-secret-name",
        "csi.storage.k8s.io/controller-expand-secret-namespace",
        None,
    ),
    (
        "csi.storage.k8s.io/node-expand-secret-name",
        "csi.storage.k8s.io/node-expand-secret-namespace",
        None,
    ),
    (
        "csi.storage.k8s.io/controller-modify-secret-name",
        "csi.storage.k8s.io/controller-modify-secret-namespace",
        None,
    ),
];
const DEFAULT_NAME: &str = "csi.storage.k8s.io/secret-name";
const DEFAULT_NAMESPACE: &str = "csi.storage.k8s.io/secret-namespace";

/// Annotation keys a template may name (the last is never set).
const ANNOTATION_KEYS: [&str; 4] = ["example.com/secret", "k", "a'b", "missing"];

/// A DNS-1123 label (a namespace): 1-63 of `[a-z0-9-]`, alphanumeric at both ends.
fn is_label(s: &str) -> bool {
    let ok = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let b = s.as_bytes();
    (1..=63).contains(&b.len())
        && ok(b[0])
        && ok(b[b.len() - 1])
        && b.iter().all(|&c| ok(c) || c == b'-')
}

/// A DNS-1123 subdomain (a Secret's name): at most 253 bytes, dot-separated parts each
/// alphanumeric at both ends with `-` inside.
fn is_subdomain(s: &str) -> bool {
    let ok = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    s.len() <= 253
        && s.split('.').all(|p| {
            let b = p.as_bytes();
            !b.is_empty() && ok(b[0]) && ok(b[b.len() - 1]) && b.iter().all(|&c| ok(c) || c == b'-')
        })
}

/// A name: valid, or near one, or anything.
fn name(u: &mut Unstructured, valid: &'static [&'static str]) -> Result<String> {
    Ok(match u.int_in_range(0u8..=5)? {
        0 => u.arbitrary()?,
        1 => "x".repeat(u.int_in_range(60..=260)?),
        _ => (*u.choose(valid)?).to_owned(),
    })
}

/// One piece of a template and what it contributes when the template is well formed.
enum Piece {
    /// Literal text without `$`.
    Text(String),
    /// `${token}`.
    Token(&'static str, Option<&'static str>),
    /// Anything else (stray `$`, braces, raw bytes): the oracle does not predict the result.
    Raw(String),
}

fn piece(u: &mut Unstructured) -> Result<Piece> {
    Ok(match u.int_in_range(0u8..=9)? {
        0..=3 => Piece::Text(
            (*u.choose(&[
                "a", "b-", "0", "x.y", "-", ".", "Z", "_", "s3cr3t", "-.-", "é",
            ])?)
            .to_owned(),
        ),
        4..=7 => {
            let tokens: [(&str, Option<&str>); 8] = [
                ("pv.name", None),
                ("pvc.name", None),
                ("pvc.namespace", None),
                ("pvc.annotations['", Some(ANNOTATION_KEYS[0])),
                ("pvc.annotations['", Some(ANNOTATION_KEYS[1])),
                ("pvc.annotations['", Some(ANNOTATION_KEYS[2])),
                ("pvc.annotations['", Some(ANNOTATION_KEYS[3])),
                ("other", None),
            ];
            let (t, k) = *u.choose(&tokens)?;
            Piece::Token(t, k)
        }
        8 => Piece::Raw(
            (*u.choose(&[
                "$",
                "${",
                "${}",
                "$$",
                "}",
                "{",
                "$1",
                "$pv",
                "${pv.name",
                "$*",
            ])?)
            .to_owned(),
        ),
        _ => Piece::Raw(u.arbitrary()?),
    })
}

/// A template and its pieces.
fn template(u: &mut Unstructured) -> Result<(String, Vec<Piece>)> {
    let n = u.int_in_range(0..=6)?;
    let pieces: Vec<Piece> = (0..n).map(|_| piece(u)).collect::<Result<_>>()?;
    let text = pieces
        .iter()
        .map(|p| match p {
            Piece::Text(t) | Piece::Raw(t) => t.clone(),
            Piece::Token(t, None) => format!("${{{t}}}"),
            Piece::Token(t, Some(k)) => format!("${{{t}{k}']}}"),
        })
        .collect();
    Ok((text, pieces))
}

/// What the claim's user and the PV give the templates.
struct Names<'a> {
    pv: &'a str,
    claim: &'a PersistentVolumeClaim,
}

/// The expansion of well-formed pieces: `Ok(text)`, `Err(())` for an unknown token, or `None`
/// when a raw piece makes the result unpredictable here.
fn expand(
    pieces: &[Piece],
    names: &Names,
    namespace: bool,
    annotations: bool,
) -> Option<std::result::Result<String, ()>> {
    let mut out = String::new();
    let mut unknown = false;
    for p in pieces {
        match p {
            Piece::Raw(_) => return None,
            Piece::Text(t) => out.push_str(t),
            Piece::Token(t, key) => {
                let meta = &names.claim.metadata;
                let v = match (*t, key) {
                    ("pv.name", _) => Some(names.pv.to_owned()),
                    ("pvc.namespace", _) => meta.namespace.clone().or(Some(String::new())),
                    ("pvc.name", _) if !namespace => meta.name.clone().or(Some(String::new())),
                    (_, Some(k)) if !namespace && annotations => {
                        meta.annotations.as_ref().and_then(|a| a.get(*k).cloned())
                    }
                    _ => None,
                };
                match v {
                    Some(v) => out.push_str(&v),
                    None => unknown = true,
                }
            }
        }
    }
    Some(if unknown { Err(()) } else { Ok(out) })
}

/// The property: resolving never panics; a resolved reference is a valid Secret name and
/// namespace with every token replaced; a class without the keys names no Secret; an error is
/// no-change, one line; and where the templates are well formed, the exact outcome.
pub fn check(u: &mut Unstructured) -> Result<()> {
    let kind_index = u.choose_index(KEYS.len())?;
    let kind = SecretKind::ALL[kind_index];
    let (name_key, namespace_key, deprecated) = KEYS[kind_index];

    let pv = name(u, &["pvc-1234", "pvc-5f1e3b7c-9a2d", "", "PVC-1"])?;
    let mut annotations = BTreeMap::new();
    for key in &ANNOTATION_KEYS[..3] {
        if u.ratio(2, 3)? {
            annotations.insert(
                (*key).to_owned(),
                name(u, &["from-annotation", "Not_Valid", "a.b"])?,
            );
        }
    }
    let claim = PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(name(u, &["data-0", "data", "web-1"])?),
            namespace: Some(name(u, &["apps", "default", "kube-system"])?),
            annotations: Some(annotations),
            ..Default::default()
        },
        ..Default::default()
    };
    let names = Names {
        pv: &pv,
        claim: &claim,
    };

    let (name_tpl, name_pieces) = template(u)?;
    let (ns_tpl, ns_pieces) = template(u)?;
    let mut params = BTreeMap::new();
    // The simple case the oracle predicts exactly: the kind's two keys and nothing else.
    let simple = u.ratio(1, 2)?;
    params.insert(name_key.to_owned(), name_tpl.clone());
    params.insert(namespace_key.to_owned(), ns_tpl.clone());
    if !simple {
        let mut keys = vec![name_key, namespace_key, DEFAULT_NAME, DEFAULT_NAMESPACE];
        if let Some((a, b)) = deprecated {
            keys.extend([a, b]);
        }
        params.clear();
        for key in keys {
            if u.ratio(1, 2)? {
                let (t, _) = template(u)?;
                params.insert(key.to_owned(), t);
            }
        }
    }

    let got = secrets::resolve(kind, &params, &pv, &claim);
    let own = [
        Some(name_key),
        Some(namespace_key),
        deprecated.map(|d| d.0),
        deprecated.map(|d| d.1),
    ];
    let named = own.iter().flatten().any(|k| params.contains_key(*k))
        || params.contains_key(DEFAULT_NAME)
        || params.contains_key(DEFAULT_NAMESPACE);
    match &got {
        Ok(None) => assert!(!named, "{params:?}: keys given, no Secret"),
        Ok(Some(SecretRef { name, namespace })) => {
            assert!(named);
            assert!(
                is_label(namespace),
                "namespace {namespace:?} from {params:?}"
            );
            assert!(is_subdomain(name), "name {name:?} from {params:?}");
        }
        Err(e) => {
            assert!(named);
            assert_eq!(e.state, State::NoChange);
            assert!(!e.message.is_empty());
            assert!(!e.message.chars().any(char::is_control), "{:?}", e.message);
        }
    }

    if simple {
        let annotations_allowed = kind != SecretKind::Provisioner;
        let want = if name_tpl.is_empty() || ns_tpl.is_empty() {
            Some(Err(()))
        } else {
            match (
                expand(&ns_pieces, &names, true, false),
                expand(&name_pieces, &names, false, annotations_allowed),
            ) {
                (Some(Err(())), _) => Some(Err(())),
                (Some(Ok(ns)), _) if !is_label(&ns) => Some(Err(())),
                (Some(Ok(_)), Some(Err(()))) => Some(Err(())),
                (Some(Ok(_)), Some(Ok(n))) if !is_subdomain(&n) => Some(Err(())),
                (Some(Ok(ns)), Some(Ok(n))) => Some(Ok((n, ns))),
                _ => None,
            }
        };
        if let Some(want) = want {
            let got = got
                .clone()
                .map(|r| r.map(|r| (r.name, r.namespace)))
                .map_err(|_| ());
            assert_eq!(
                got,
                want.map(Some),
                "{params:?} pv {pv:?} claim {:?}",
                claim.metadata
            );
        }
    }

    let warnings = secrets::deprecation_warnings(&params);
    let deprecated_keys = KEYS
        .iter()
        .filter_map(|k| k.2)
        .flat_map(|(a, b)| [a, b])
        .filter(|k| params.contains_key(*k))
        .count();
    assert_eq!(warnings.len(), deprecated_keys);
    Ok(())
}
