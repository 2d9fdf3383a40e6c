//! What the controller changes in an object it updates: edits of the object's JSON as the API
//! server has it now (read just before the Update, so that fields this build does not know
//! survive), without I/O. Each returns whether it changed the object: an edit that changes
//! nothing is not written.

use serde_json::json;

use crate::decide::{LEGACY_FINALIZER, LEGACY_INTENT};
use crate::request::ANN_SELECTED_NODE;

/// Adds (`on`) or removes `finalizer` in the object JSON `obj`.
pub fn finalizer(obj: &mut serde_json::Value, finalizer: &str, on: bool) -> bool {
    let meta = &mut obj["metadata"];
    let has = meta["finalizers"]
        .as_array()
        .is_some_and(|l| l.iter().any(|f| f.as_str() == Some(finalizer)));
    match (on, has) {
        (true, false) => {
            match meta["finalizers"].as_array_mut() {
                Some(list) => list.push(json!(finalizer)),
                None => meta["finalizers"] = json!([finalizer]),
            }
            true
        }
        (false, true) => {
            if let Some(list) = meta["finalizers"].as_array_mut() {
                list.retain(|f| f.as_str() != Some(finalizer));
            }
            true
        }
        _ => false,
    }
}

/// Removes `key` from the JSON object `map`.
pub fn remove_key(map: &mut serde_json::Value, key: &str) -> bool {
    map.as_object_mut().is_some_and(|m| m.remove(key).is_some())
}

/// Upstream's reschedule: the claim's selected-node annotation goes, so that the scheduler
/// picks another node.
pub fn unselect_node(claim: &mut serde_json::Value) -> bool {
    remove_key(&mut claim["metadata"]["annotations"], ANN_SELECTED_NODE)
}

/// A previous version's intent (annotation and finalizer) goes from the claim with `uid` (a
/// claim of the same name made since keeps whatever it has).
pub fn release_legacy(claim: &mut serde_json::Value, uid: &str) -> bool {
    if claim["metadata"]["uid"].as_str() != Some(uid) {
        return false;
    }
    let a = remove_key(&mut claim["metadata"]["annotations"], LEGACY_INTENT);
    let f = match claim["metadata"]["finalizers"].as_array_mut() {
        Some(list) => {
            let n = list.len();
            list.retain(|f| f.as_str() != Some(LEGACY_FINALIZER));
            list.len() != n
        }
        None => false,
    };
    a || f
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: &str = "example.com/protect";

    #[test]
    fn finalizers() {
        let cases = [
            (
                "added to none",
                json!({"metadata": {}}),
                true,
                true,
                json!([F]),
            ),
            (
                "added to others",
                json!({"metadata": {"finalizers": ["a"]}}),
                true,
                true,
                json!(["a", F]),
            ),
            (
                "there already",
                json!({"metadata": {"finalizers": [F]}}),
                true,
                false,
                json!([F]),
            ),
            (
                "removed",
                json!({"metadata": {"finalizers": ["a", F]}}),
                false,
                true,
                json!(["a"]),
            ),
            (
                "not there",
                json!({"metadata": {"finalizers": ["a"]}}),
                false,
                false,
                json!(["a"]),
            ),
        ];
        for (what, mut obj, on, changed, want) in cases {
            assert_eq!(finalizer(&mut obj, F, on), changed, "{what}");
            assert_eq!(obj["metadata"]["finalizers"], want, "{what}");
        }
    }

    #[test]
    fn a_reschedule_removes_only_the_selected_node() {
        let mut c = json!({"metadata": {"annotations": {ANN_SELECTED_NODE: "n1", "a": "b"}}});
        assert!(unselect_node(&mut c));
        assert_eq!(c["metadata"]["annotations"], json!({"a": "b"}));
        assert!(!unselect_node(&mut c));
        assert!(!remove_key(&mut json!("not an object"), "a"));
    }

    #[test]
    fn a_legacy_intent_is_released_from_its_own_claim_only() {
        let claim = |uid: &str| {
            json!({"metadata": {"uid": uid,
                "annotations": {LEGACY_INTENT: "pv-1", "a": "b"},
                "finalizers": [LEGACY_FINALIZER, "kubernetes.io/pvc-protection"]}})
        };
        let mut c = claim("u1");
        assert!(release_legacy(&mut c, "u1"));
        assert_eq!(c["metadata"]["annotations"], json!({"a": "b"}));
        assert_eq!(
            c["metadata"]["finalizers"],
            json!(["kubernetes.io/pvc-protection"])
        );
        assert!(!release_legacy(&mut c, "u1"), "released already");
        let mut other = claim("u2");
        assert!(
            !release_legacy(&mut other, "u1"),
            "another claim of its name"
        );
        assert_eq!(other, claim("u2"));
        let mut lone = json!({"metadata": {"uid": "u1", "finalizers": [LEGACY_FINALIZER]}});
        assert!(release_legacy(&mut lone, "u1"), "a lone finalizer");
    }
}
