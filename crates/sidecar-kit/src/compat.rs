//! What older releases of the upstream sidecars accepted and today's refuse, for the manifests
//! that still pass it (`decisions.md` M1): flags removed from a sidecar ([`OLD_FLAGS`]) and
//! feature gates that upstream graduated and then removed ([`GRADUATED_GATES`]). Upstream
//! refuses them all (exit 2 for a flag, its fatal error for a gate), so an image upgrade breaks
//! such a manifest; here they are accepted, each with a warning, when that is safe:
//!
//! - a flag whose meaning survives under another name is that flag ([`Meaning::Successor`],
//!   [`Meaning::Gate`]);
//! - a flag whose only effect is gone is accepted with upstream's old deprecation warning
//!   ([`Meaning::Gone`]), its value still checked against its old type;
//! - a removed gate set to the value it graduated to is what the sidecar does anyway; set to
//!   the other value it stays upstream's error (the gate is left for the sidecar to refuse).
//!
//! Flags that only a vendor's own build of a sidecar defines are in neither table: they stay
//! errors. [`Command::parse`](crate::flags::Command::parse) applies these rules and lists what
//! it accepted in [`Flags::outdated`](crate::flags::Flags::outdated), which the kit's `main`
//! logs as warnings.

use crate::goflag::{Kind, Spec, flag};
use crate::gosyntax::parse_bool;
use Upstream::{Attacher, LivenessProbe, Provisioner, Resizer, Snapshotter};

/// The upstream sidecar a command line is a drop-in for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upstream {
    /// external-provisioner.
    Provisioner,
    /// external-attacher.
    Attacher,
    /// external-resizer.
    Resizer,
    /// external-snapshotter's csi-snapshotter.
    Snapshotter,
    /// node-driver-registrar.
    Registrar,
    /// livenessprobe.
    LivenessProbe,
    /// external-health-monitor's controller.
    HealthMonitor,
}

impl Upstream {
    /// The upstream project's name, as its release notes name it.
    pub fn project(self) -> &'static str {
        match self {
            Upstream::Provisioner => "external-provisioner",
            Upstream::Attacher => "external-attacher",
            Upstream::Resizer => "external-resizer",
            Upstream::Snapshotter => "external-snapshotter",
            Upstream::Registrar => "node-driver-registrar",
            Upstream::LivenessProbe => "livenessprobe",
            Upstream::HealthMonitor => "external-health-monitor",
        }
    }
}

/// What a removed flag means today.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Meaning {
    /// Today's flag of this name, with the same type and meaning.
    Successor(&'static str),
    /// A boolean that became this feature gate: `--flag=B` is `--feature-gates=<gate>=B`.
    Gate(&'static str),
    /// Nothing: its effect is gone (or what it chose is the only behaviour left). Its value is
    /// checked against its old type and ignored.
    Gone,
    /// `--leader-election-type`: the Lease lock is the only one left; the values the old
    /// releases took are accepted, any other is refused as they refused it.
    LeaseOnly,
}

/// A flag older releases of some sidecars defined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OldFlag {
    /// The sidecars whose older releases defined it.
    pub upstream: &'static [Upstream],
    /// The flag, as the parser sees it (its old type).
    pub spec: Spec,
    /// What it means today.
    pub meaning: Meaning,
    /// Which releases had it, for the warning and the README.
    pub history: &'static str,
}

const fn old(
    upstream: &'static [Upstream],
    name: &'static str,
    kind: Kind,
    meaning: Meaning,
    history: &'static str,
) -> OldFlag {
    OldFlag {
        upstream,
        spec: flag(name, kind, "", "", ""),
        meaning,
        history,
    }
}

/// Every removed flag that real manifests still pass, with what it means today. A flag a
/// sidecar defines today is never taken from here (node-driver-registrar still has
/// `--connection-timeout`).
pub const OLD_FLAGS: &[OldFlag] = &[
    old(
        &[Provisioner, Attacher, Snapshotter, LivenessProbe],
        "connection-timeout",
        Kind::Duration,
        Meaning::Gone,
        "deprecated with no effect since the v1.1 releases (they connect until the driver answers), then removed",
    ),
    old(
        &[Provisioner],
        "enable-leader-election",
        Kind::Bool,
        Meaning::Successor("leader-election"),
        "external-provisioner v1.x; --leader-election since v2.0",
    ),
    old(
        &[Snapshotter],
        "enable-volume-group-snapshots",
        Kind::Bool,
        Meaning::Gate("CSIVolumeGroupSnapshot"),
        "external-snapshotter v7.0 to v8.1; the CSIVolumeGroupSnapshot feature gate since v8.2",
    ),
    old(
        &[Resizer],
        "csiTimeout",
        Kind::Duration,
        Meaning::Successor("timeout"),
        "external-resizer v0.x (the deadline of each CSI call); --timeout since v1.0",
    ),
    old(
        &[Attacher, Resizer],
        "leader-election-identity",
        Kind::String,
        Meaning::Gone,
        "external-attacher v1.x (deprecated with no effect in v1.1) and external-resizer v0.x; the holder identity is the host name since",
    ),
    old(
        &[Provisioner, Attacher],
        "leader-election-type",
        Kind::String,
        Meaning::LeaseOnly,
        "external-provisioner and external-attacher v1.x (endpoints or configmaps, and leases); Lease only since v2.0",
    ),
    old(
        &[Provisioner],
        "provisioner",
        Kind::String,
        Meaning::Gone,
        "external-provisioner v0.x; deprecated with no effect in v1.0 (the name is the driver's, from GetPluginInfo)",
    ),
    old(
        &[Snapshotter],
        "snapshotter",
        Kind::String,
        Meaning::Gone,
        "external-snapshotter v1.0; deprecated with no effect in v1.1 (the name is the driver's, from GetPluginInfo)",
    ),
];

/// The removed flags of `upstream` that `known` (today's table) does not define, and whose
/// successor it does.
pub fn old_flags(upstream: Upstream, known: &[Spec]) -> impl Iterator<Item = &'static OldFlag> {
    let known: Vec<&'static str> = known.iter().map(|s| s.name).collect();
    OLD_FLAGS.iter().filter(move |o| {
        let successor = match o.meaning {
            Meaning::Successor(name) => Some(name),
            Meaning::Gate(_) => Some("feature-gates"),
            Meaning::Gone | Meaning::LeaseOnly => None,
        };
        o.upstream.contains(&upstream)
            && !known.contains(&o.spec.name)
            && successor.is_none_or(|s| known.contains(&s))
    })
}

/// A feature gate that upstream graduated (locked to `value`) and then removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraduatedGate {
    /// The sidecar that had it.
    pub upstream: Upstream,
    /// The gate's name.
    pub name: &'static str,
    /// The value it graduated to: what the sidecar does now, always.
    pub value: bool,
    /// When it graduated and went, for the warning and the README.
    pub history: &'static str,
}

/// Every feature gate a sidecar graduated and then removed. The other sidecars' gates of their
/// releases (external-attacher's MutableCSINodeAllocatableCount, external-resizer's
/// RecoverVolumeExpansionFailure, external-snapshotter's CSIVolumeGroupSnapshot,
/// external-provisioner's Topology and VolumeAttributesClass) all still exist.
pub const GRADUATED_GATES: &[GraduatedGate] = &[GraduatedGate {
    upstream: Provisioner,
    name: "HonorPVReclaimPolicy",
    value: true,
    history: "alpha in v3.x, beta (on) in v5.x, then GA locked on, removed in v6.2: the PV deletion finalizer is always managed",
}];

/// A flag or feature gate of an older release that was accepted, and the warning to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    /// As given: `name=value` (a gate: `Gate=value`).
    pub given: String,
    /// What to log (a warning).
    pub warning: String,
}

impl OldFlag {
    /// The warning for `--<name>=<value>` accepted; `value` as given.
    pub fn accepted(&self, project: &str, value: &str) -> Accepted {
        let name = self.spec.name;
        let warning = match self.meaning {
            // csi-lib-utils' deprecatedflags, which these releases used, in its klog v1 words.
            Meaning::Gone => {
                format!("Warning: option {name}={value:?} is deprecated and has no effect")
            }
            Meaning::Successor(new) => format!(
                "Option --{name} was removed from {project} ({}): taken as --{new}={value}",
                self.history
            ),
            Meaning::Gate(gate) => format!(
                "Option --{name} was removed from {project} ({}): taken as --feature-gates={gate}={value}",
                self.history
            ),
            Meaning::LeaseOnly if value == "leases" => format!(
                "Option --leader-election-type was removed from {project} ({}): leader election uses a Lease, as asked",
                self.history
            ),
            Meaning::LeaseOnly => format!(
                "Option --leader-election-type={value} was removed from {project} ({}): leader election uses a Lease instead; replicas of a release that holds the {value} lock do not see it, so replace them all at once",
                self.history
            ),
        };
        Accepted {
            given: format!("{name}={value}"),
            warning,
        }
    }
}

/// Checks a `--leader-election-type` value as the old releases did.
pub fn check_lease_type(value: &str) -> Result<(), String> {
    match value {
        "leases" | "endpoints" | "configmaps" => Ok(()),
        other => Err(format!("unknown leader election type: {other}")),
    }
}

/// Takes the graduated gates of `upstream` set to their graduated value out of a
/// `--feature-gates` value. Returns `None` when there is none (the value goes to the sidecar
/// unchanged), else the value without them and what was accepted. A graduated gate set to the
/// other value, and anything malformed, stays in for the sidecar to refuse in upstream's words.
pub fn take_graduated(upstream: Upstream, value: &str) -> Option<(String, Vec<Accepted>)> {
    let mut kept = Vec::new();
    let mut accepted = Vec::new();
    for pair in value.split(',') {
        let graduated = pair.split_once('=').and_then(|(k, v)| {
            let (k, v) = (k.trim(), v.trim());
            GRADUATED_GATES
                .iter()
                .find(|g| g.upstream == upstream && g.name == k)
                .filter(|g| parse_bool(v) == Ok(g.value))
        });
        match graduated {
            Some(g) => accepted.push(Accepted {
                given: format!("{}={}", g.name, g.value),
                warning: format!(
                    "Feature gate {}={} was removed from {} ({}): ignored, its behaviour is the only one",
                    g.name,
                    g.value,
                    upstream.project(),
                    g.history
                ),
            }),
            None => kept.push(pair),
        }
    }
    (!accepted.is_empty()).then(|| (kept.join(","), accepted))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graduated_gates_at_their_value_are_taken_out_with_a_warning() {
        let (rest, accepted) =
            take_graduated(Provisioner, "Topology=true, HonorPVReclaimPolicy = true").unwrap();
        assert_eq!(rest, "Topology=true");
        assert_eq!(accepted.len(), 1);
        assert_eq!(accepted[0].given, "HonorPVReclaimPolicy=true");
        assert!(
            accepted[0]
                .warning
                .contains("removed from external-provisioner"),
            "{}",
            accepted[0].warning
        );
        let (rest, _) = take_graduated(Provisioner, "HonorPVReclaimPolicy=1").unwrap();
        assert_eq!(rest, "");
    }

    #[test]
    fn graduated_gates_at_the_other_value_stay_for_the_sidecar_to_refuse() {
        assert_eq!(
            take_graduated(Provisioner, "HonorPVReclaimPolicy=false"),
            None
        );
        assert_eq!(
            take_graduated(Provisioner, "HonorPVReclaimPolicy=yes"),
            None
        );
        assert_eq!(take_graduated(Provisioner, "HonorPVReclaimPolicy"), None);
        // Another sidecar never had it.
        assert_eq!(take_graduated(Attacher, "HonorPVReclaimPolicy=true"), None);
        let (rest, _) =
            take_graduated(Provisioner, "HonorPVReclaimPolicy=true,Bogus=true").unwrap();
        assert_eq!(rest, "Bogus=true");
    }

    #[test]
    fn old_flags_belong_to_their_sidecars_and_yield_to_todays() {
        let names = |u: Upstream, known: &[Spec]| -> Vec<&str> {
            old_flags(u, known).map(|o| o.spec.name).collect()
        };
        let le = [flag("leader-election", Kind::Bool, "", "", "")];
        assert_eq!(
            names(Provisioner, &le),
            [
                "connection-timeout",
                "enable-leader-election",
                "leader-election-type",
                "provisioner"
            ]
        );
        // Without its successor a flag is not taken.
        assert!(!names(Provisioner, &[]).contains(&"enable-leader-election"));
        assert_eq!(names(Resizer, &[]), ["leader-election-identity"]);
        let today = [flag("connection-timeout", Kind::Duration, "", "", "")];
        assert!(!names(Attacher, &today).contains(&"connection-timeout"));
        assert!(names(Upstream::Registrar, &[]).is_empty());
    }

    #[test]
    fn warnings_say_what_the_flag_became() {
        let find = |name: &str| OLD_FLAGS.iter().find(|o| o.spec.name == name).unwrap();
        assert_eq!(
            find("connection-timeout")
                .accepted("external-snapshotter", "15s")
                .warning,
            "Warning: option connection-timeout=\"15s\" is deprecated and has no effect"
        );
        let a = find("enable-leader-election").accepted("external-provisioner", "true");
        assert_eq!(a.given, "enable-leader-election=true");
        assert!(
            a.warning.contains("taken as --leader-election=true"),
            "{}",
            a.warning
        );
        let a = find("enable-volume-group-snapshots").accepted("external-snapshotter", "false");
        assert!(
            a.warning
                .contains("taken as --feature-gates=CSIVolumeGroupSnapshot=false"),
            "{}",
            a.warning
        );
        let a = find("leader-election-type").accepted("external-provisioner", "endpoints");
        assert!(a.warning.contains("uses a Lease instead"), "{}", a.warning);
        assert!(check_lease_type("leases").is_ok() && check_lease_type("configmaps").is_ok());
        assert_eq!(
            check_lease_type("etcd").unwrap_err(),
            "unknown leader election type: etcd"
        );
    }

    #[test]
    fn the_tables_name_each_flag_and_gate_once() {
        let mut names: Vec<_> = OLD_FLAGS.iter().map(|o| o.spec.name).collect();
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
        for g in GRADUATED_GATES {
            assert!(!g.history.is_empty() && !g.name.is_empty());
        }
    }
}
