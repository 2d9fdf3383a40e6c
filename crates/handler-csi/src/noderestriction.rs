//! Which Node labels a kubelet may set on its own Node: the rule of the API server's
//! NodeRestriction admission, applied by plugreg before it writes a label on a plugin's word.
//!
//! The kubelet publishes a CSI driver's topology segments as labels of its Node, and the API
//! server checks every label the kubelet adds, changes or removes (`plugin/pkg/admission/
//! noderestriction` with the list of `k8s.io/kubelet/pkg/apis`). plugreg writes the same labels
//! with its own credentials, which NodeRestriction does not restrict, so it applies the rule
//! itself: a plugin gets no more power over the Node than the kubelet has.
//!
//! A label key is refused when
//! * its prefix is `node-restriction.kubernetes.io` or ends in `.node-restriction.kubernetes.io`
//!   (reserved for administrators to steer workloads to nodes), or
//! * its prefix is `kubernetes.io`, `k8s.io` or ends in `.kubernetes.io` / `.k8s.io`, and the key
//!   is neither one of the labels the kubelet sets itself ([`KUBELET_LABELS`]) nor under
//!   `kubelet.kubernetes.io` or `node.kubernetes.io` (or a subdomain of either).
//!
//! Any other key (`topology.example.com/zone`, keys without a prefix) is allowed. The rule is the
//! same from Kubernetes 1.20 to 1.36 (the list gained nothing, lost nothing); the interop tests
//! compare it with the real NodeRestriction of both.

/// The label prefix no kubelet may set.
pub const NODE_RESTRICTION_PREFIX: &str = "node-restriction.kubernetes.io";

/// The `kubernetes.io` / `k8s.io` labels a kubelet may set on its own Node.
pub const KUBELET_LABELS: [&str; 11] = [
    "kubernetes.io/hostname",
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/region",
    "beta.kubernetes.io/instance-type",
    "node.kubernetes.io/instance-type",
    "kubernetes.io/os",
    "kubernetes.io/arch",
    "beta.kubernetes.io/os",
    "beta.kubernetes.io/arch",
];

/// Label prefixes (and their subdomains) a kubelet may set on its own Node.
pub const KUBELET_LABEL_PREFIXES: [&str; 2] = ["kubelet.kubernetes.io", "node.kubernetes.io"];

/// The part of a label key before the first `/`; empty when there is none.
fn prefix(key: &str) -> &str {
    key.split_once('/').map_or("", |(p, _)| p)
}

/// Whether `prefix` is `domain` or a subdomain of it.
fn within(prefix: &str, domain: &str) -> bool {
    prefix == domain
        || prefix
            .strip_suffix(domain)
            .is_some_and(|rest| rest.ends_with('.'))
}

/// Whether a kubelet may add, change or remove the label `key` on its own Node.
pub fn kubelet_may_set(key: &str) -> bool {
    let p = prefix(key);
    if within(p, NODE_RESTRICTION_PREFIX) {
        return false;
    }
    let kubernetes = within(p, "kubernetes.io") || within(p, "k8s.io");
    !kubernetes
        || KUBELET_LABELS.contains(&key)
        || KUBELET_LABEL_PREFIXES.iter().any(|d| within(p, d))
}

/// The keys of `keys` a kubelet may not set, sorted and without duplicates.
pub fn forbidden<'a>(keys: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let set: std::collections::BTreeSet<&str> =
        keys.into_iter().filter(|k| !kubelet_may_set(k)).collect();
    set.into_iter().map(str::to_owned).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_prefixes_are_refused_and_the_kubelets_own_labels_allowed() {
        for key in [
            "node-restriction.kubernetes.io/pwn",
            "node-restriction.kubernetes.io/",
            "a.node-restriction.kubernetes.io/x",
            "node-role.kubernetes.io/control-plane",
            "node-role.kubernetes.io/worker",
            "kubernetes.io/role",
            "k8s.io/x",
            "example.k8s.io/x",
            "beta.kubernetes.io/fluentd-ds-ready",
            "topology.kubernetes.io/rack",
            "failure-domain.kubernetes.io/zone",
            "storage.kubernetes.io/csi",
        ] {
            assert!(!kubelet_may_set(key), "{key} must be refused");
        }
        for key in KUBELET_LABELS {
            assert!(kubelet_may_set(key), "{key}");
        }
        for key in [
            "node.kubernetes.io/exclude-from-external-load-balancers",
            "kubelet.kubernetes.io/x",
            "a.kubelet.kubernetes.io/x",
            "extra.node.kubernetes.io/x",
            "topology.hostpath.csi/node",
            "topology.example.com/zone",
            "example.com/kubernetes.io",
            "zone",
            "notkubernetes.io/x",
            "xk8s.io/x",
            "node-restriction.kubernetes.io.example.com/x",
        ] {
            assert!(kubelet_may_set(key), "{key} must be allowed");
        }
    }

    #[test]
    fn forbidden_keys_come_sorted_once() {
        assert_eq!(
            forbidden([
                "node-role.kubernetes.io/control-plane",
                "topology.example.com/zone",
                "node-restriction.kubernetes.io/pwn",
                "node-role.kubernetes.io/control-plane",
            ]),
            [
                "node-restriction.kubernetes.io/pwn",
                "node-role.kubernetes.io/control-plane"
            ]
        );
        assert!(forbidden(["kubernetes.io/hostname"]).is_empty());
    }
}
