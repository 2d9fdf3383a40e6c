//! The health monitor's decisions, apart from every call: which path the driver's capabilities
//! choose, names, event texts, what a volume's condition means to its claim's events
//! ([`Reports`]), and what a node's state means to its claims ([`Nodes`]).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use plugreg_sidecar_kit::leader::sanitize_name;
use tokio::time::Instant;

use crate::cached::{NodeHealth, Ready};

/// `VolumeConditionAbnormal` (Warning): the driver's message verbatim.
pub const REASON_ABNORMAL: &str = "VolumeConditionAbnormal";
/// `VolumeConditionNormal` (Normal), after an abnormal report.
pub const REASON_NORMAL: &str = "VolumeConditionNormal";
/// The message of [`REASON_NORMAL`].
pub const MESSAGE_NORMAL: &str = "The Volume returns to the healthy state";
/// `NodeFailed` (Warning): pods of the claim are on a failed node.
pub const REASON_NODE_FAILED: &str = "NodeFailed";
/// `NodeRecovered` (Warning, as upstream), once the failed node is Ready again.
pub const REASON_NODE_RECOVERED: &str = "NodeRecovered";

/// How long a node may be not Ready before its claims are told by default (upstream's
/// hard-coded 5 min; `--node-failure-grace`).
pub const NODE_FAILURE_GRACE: Duration = Duration::from_secs(300);

/// How often an unchanged abnormal condition is reported again: half of the API server's
/// default `--event-ttl` (1 h), so that the claim's event stays while the volume is abnormal,
/// at two writes an hour instead of upstream's one per check.
pub const REFRESH: Duration = Duration::from_secs(30 * 60);

/// The leader-election lock name, as upstream gives it to csi-lib-utils:
/// `external-health-monitor-leader-<driver>`, not sanitised. The `LeaderElection` event
/// comes from `<lock name>/<host name>`.
pub fn lock_name(driver: &str) -> String {
    format!("external-health-monitor-leader-{driver}")
}

/// The Lease of leader election: the [`lock_name`], sanitised.
pub fn lease_name(driver: &str) -> String {
    sanitize_name(&lock_name(driver))
}

/// The events' source component: `csi-pv-monitor-controller-<driver>` (not sanitised).
pub fn component(driver: &str) -> String {
    format!("csi-pv-monitor-controller-{driver}")
}

/// The message of [`REASON_NODE_FAILED`]: `pods` (sorted here; upstream's order is Go's map
/// order) each followed by one space, as upstream writes it.
pub fn node_failed_message(pods: &[&str], claim: &str, namespace: &str, node: &str) -> String {
    let mut listed = String::new();
    for p in pods {
        listed.push_str(p);
        listed.push(' ');
    }
    format!(
        "Pods: [ {listed}] consuming PVC: {claim} in namespace: {namespace} are now on a failed node: {node}"
    )
}

/// The message of [`REASON_NODE_RECOVERED`].
pub fn node_recovered_message(node: &str) -> String {
    format!("Node: {node} recovered")
}

/// How volume conditions are read, chosen once at start-up from ControllerGetCapabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// ListVolumes, page by page, every `--list-volumes-interval` (preferred).
    ListVolumes,
    /// ControllerGetVolume per PV, `--worker-threads` at a time.
    GetVolume,
}

/// The path for a driver with these capabilities; `None`: it cannot be monitored (upstream's
/// "does not support Controller ListVolumes and GetVolume service or does not implement
/// VolumeCondition", exit 1).
pub fn mode(list_volumes: bool, get_volume: bool, volume_condition: bool) -> Option<Mode> {
    match (volume_condition, list_volumes, get_volume) {
        (false, _, _) => None,
        (true, true, _) => Some(Mode::ListVolumes),
        (true, false, true) => Some(Mode::GetVolume),
        (true, false, false) => None,
    }
}

/// A volume's condition as the driver reported it (no condition: healthy, no message).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Condition {
    /// `volume_condition.abnormal`.
    pub abnormal: bool,
    /// `volume_condition.message`.
    pub message: String,
}

/// What a claim's events should say after a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// `VolumeConditionAbnormal` with this message.
    Abnormal(String),
    /// `VolumeConditionNormal`.
    Normal,
}

/// What this process last reported about each claim (by UID) whose volume is abnormal, and
/// when. Upstream finds the "was abnormal" side of a recovery in a cache of every Event in the
/// cluster and reports an abnormal volume at every check; this keeps one small entry per
/// abnormal claim and reports each change once ([`Reports::judge`]). It is filled at the start
/// of each leadership from the claims' live `VolumeConditionAbnormal` and
/// `VolumeConditionNormal` events ([`Reports::seed`]), so a restart neither repeats an abnormal
/// report nor forgets to report a recovery.
#[derive(Debug, Default)]
pub struct Reports {
    /// Claim UID -> the message reported and when (wall-clock time: a seeded report's time is
    /// an Event's timestamp, which may be older than this host's uptime).
    abnormal: HashMap<Box<str>, (Box<str>, SystemTime)>,
}

impl Reports {
    /// Remembers that `claim_uid` was reported abnormal with `message` at `at` (a live event).
    pub fn seed(&mut self, claim_uid: &str, message: &str, at: SystemTime) {
        self.abnormal.insert(claim_uid.into(), (message.into(), at));
    }

    /// Forgets `claim_uid` (a live `VolumeConditionNormal` newer than its abnormal event).
    pub fn seed_recovered(&mut self, claim_uid: &str) {
        self.abnormal.remove(claim_uid);
    }

    /// What to report about `claim_uid` whose volume is in `condition` at `now`, if anything:
    /// an abnormal condition when it is new, its message changed or it was last reported
    /// [`REFRESH`] ago; a healthy one only right after an abnormal report. The caller
    /// [`record`](Self::record)s a verdict once its event is queued.
    pub fn judge(
        &self,
        claim_uid: &str,
        condition: &Condition,
        now: SystemTime,
    ) -> Option<Verdict> {
        let last = self.abnormal.get(claim_uid);
        if condition.abnormal {
            match last {
                // A clock that went back counts as no time passed.
                Some((msg, at))
                    if **msg == *condition.message
                        && now.duration_since(*at).unwrap_or_default() < REFRESH =>
                {
                    None
                }
                _ => Some(Verdict::Abnormal(condition.message.clone())),
            }
        } else {
            last.map(|_| Verdict::Normal)
        }
    }

    /// Records that `verdict` was reported about `claim_uid` at `now`.
    pub fn record(&mut self, claim_uid: &str, verdict: &Verdict, now: SystemTime) {
        match verdict {
            Verdict::Abnormal(m) => {
                self.abnormal
                    .insert(claim_uid.into(), (m.as_str().into(), now));
            }
            Verdict::Normal => {
                self.abnormal.remove(claim_uid);
            }
        }
    }

    /// Forgets `claim_uid` (its volume is gone).
    pub fn forget(&mut self, claim_uid: &str) {
        self.abnormal.remove(claim_uid);
    }

    /// Claims currently reported abnormal.
    pub fn abnormal(&self) -> usize {
        self.abnormal.len()
    }
}

/// What the node watcher does about a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeVerdict {
    /// Nothing now.
    Nothing,
    /// Look again at this time (the grace of a not-Ready node ends then).
    LookAt(Instant),
    /// Tell the claims of its pods `NodeFailed`; [`Nodes::failed`] once they were told.
    Failed,
    /// Tell the claims of its pods `NodeRecovered`; [`Nodes::recovered`] once they were told.
    Recovered,
}

/// The node watcher's memory: when each node was first seen not Ready, and which nodes' claims
/// were told it failed. Upstream tells the claims again every five minutes while a node stays
/// down; this tells them once per failure.
#[derive(Debug)]
pub struct Nodes {
    grace: Duration,
    not_ready_since: HashMap<Box<str>, Instant>,
    down: HashSet<Box<str>>,
}

impl Default for Nodes {
    fn default() -> Self {
        Self::new(NODE_FAILURE_GRACE)
    }
}

impl Nodes {
    /// A memory in which a node fails after `grace` not Ready.
    pub fn new(grace: Duration) -> Self {
        Self {
            grace,
            not_ready_since: HashMap::new(),
            down: HashSet::new(),
        }
    }

    /// What to do about `node` (as cached now) at `now`.
    pub fn judge(&mut self, node: &NodeHealth, now: Instant) -> NodeVerdict {
        let name = &node.name;
        if node.ready == Ready::True && !node.terminated {
            self.not_ready_since.remove(name);
            return if self.down.contains(name) {
                NodeVerdict::Recovered
            } else {
                NodeVerdict::Nothing
            };
        }
        if self.down.contains(name) {
            return NodeVerdict::Nothing;
        }
        if node.terminated {
            return NodeVerdict::Failed;
        }
        if node.ready == Ready::Missing {
            return NodeVerdict::Nothing;
        }
        let since = *self.not_ready_since.entry(name.clone()).or_insert(now);
        let due = since + self.grace;
        if now >= due {
            NodeVerdict::Failed
        } else {
            NodeVerdict::LookAt(due)
        }
    }

    /// What to do about the deleted node `name`: its claims are told it failed unless they
    /// were already (upstream crashes here); either way the node is forgotten.
    pub fn deleted(&mut self, name: &str) -> NodeVerdict {
        self.not_ready_since.remove(name);
        if self.down.remove(name) {
            NodeVerdict::Nothing
        } else {
            NodeVerdict::Failed
        }
    }

    /// The claims of `name` were told it failed.
    pub fn failed(&mut self, name: &str) {
        self.not_ready_since.remove(name);
        self.down.insert(name.into());
    }

    /// The claims of `name` were told it recovered.
    pub fn recovered(&mut self, name: &str) {
        self.down.remove(name);
    }

    /// Whether `name`'s claims were told it failed.
    pub fn is_down(&self, name: &str) -> bool {
        self.down.contains(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_texts_are_upstreams() {
        assert_eq!(
            lease_name("fake.csi.io"),
            "external-health-monitor-leader-fake-csi-io"
        );
        assert_eq!(
            lock_name("fake.csi.io"),
            "external-health-monitor-leader-fake.csi.io"
        );
        assert_eq!(
            component("fake.csi.io"),
            "csi-pv-monitor-controller-fake.csi.io"
        );
        assert_eq!(
            node_failed_message(&["pod-a"], "pvc1", "default", "node1"),
            "Pods: [ pod-a ] consuming PVC: pvc1 in namespace: default are now on a failed node: node1"
        );
        assert_eq!(
            node_failed_message(&["a", "b"], "c", "ns", "n"),
            "Pods: [ a b ] consuming PVC: c in namespace: ns are now on a failed node: n"
        );
        assert_eq!(node_recovered_message("node1"), "Node: node1 recovered");
    }

    #[test]
    fn the_mode_follows_upstreams_table() {
        assert_eq!(mode(true, true, false), None);
        assert_eq!(mode(false, false, true), None);
        assert_eq!(mode(true, true, true), Some(Mode::ListVolumes));
        assert_eq!(mode(true, false, true), Some(Mode::ListVolumes));
        assert_eq!(mode(false, true, true), Some(Mode::GetVolume));
    }

    fn abnormal(m: &str) -> Condition {
        Condition {
            abnormal: true,
            message: m.into(),
        }
    }

    #[test]
    fn each_change_is_reported_once_and_a_recovery_only_after_an_abnormal_report() {
        let mut r = Reports::default();
        let t0 = SystemTime::now();
        let healthy = Condition::default();
        assert_eq!(r.judge("u", &healthy, t0), None);
        let v = r.judge("u", &abnormal("disk gone"), t0).unwrap();
        assert_eq!(v, Verdict::Abnormal("disk gone".into()));
        r.record("u", &v, t0);
        assert_eq!(r.judge("u", &abnormal("disk gone"), t0), None);
        let changed = r.judge("u", &abnormal("disk back?"), t0).unwrap();
        assert_eq!(changed, Verdict::Abnormal("disk back?".into()));
        r.record("u", &changed, t0);
        assert_eq!(
            r.judge("u", &abnormal("disk back?"), t0 + REFRESH),
            Some(Verdict::Abnormal("disk back?".into()))
        );
        assert_eq!(r.judge("u", &healthy, t0), Some(Verdict::Normal));
        r.record("u", &Verdict::Normal, t0);
        assert_eq!(r.judge("u", &healthy, t0), None);
        assert_eq!(r.abnormal(), 0);
    }

    #[test]
    fn a_seeded_report_is_not_repeated_and_its_recovery_is_reported() {
        let mut r = Reports::default();
        let t0 = SystemTime::now();
        r.seed("u", "m", t0);
        assert_eq!(r.judge("u", &abnormal("m"), t0), None);
        assert_eq!(
            r.judge("u", &Condition::default(), t0),
            Some(Verdict::Normal)
        );
        r.seed_recovered("u");
        assert_eq!(r.judge("u", &Condition::default(), t0), None);
        // An event older than the refresh (whatever the host's uptime) is due again.
        r.seed("v", "m", t0 - REFRESH - Duration::from_secs(1));
        assert_eq!(
            r.judge("v", &abnormal("m"), t0),
            Some(Verdict::Abnormal("m".into()))
        );
    }

    fn node(ready: Ready) -> NodeHealth {
        NodeHealth {
            name: "n".into(),
            ready,
            terminated: false,
        }
    }

    #[test]
    fn a_node_fails_after_its_grace_once_and_recovers_once() {
        let mut n = Nodes::default();
        let t0 = Instant::now();
        assert_eq!(n.judge(&node(Ready::True), t0), NodeVerdict::Nothing);
        assert_eq!(
            n.judge(&node(Ready::NotTrue), t0),
            NodeVerdict::LookAt(t0 + NODE_FAILURE_GRACE)
        );
        let later = t0 + Duration::from_secs(60);
        assert_eq!(
            n.judge(&node(Ready::NotTrue), later),
            NodeVerdict::LookAt(t0 + NODE_FAILURE_GRACE)
        );
        let due = t0 + NODE_FAILURE_GRACE;
        assert_eq!(n.judge(&node(Ready::NotTrue), due), NodeVerdict::Failed);
        n.failed("n");
        assert_eq!(
            n.judge(&node(Ready::NotTrue), due + NODE_FAILURE_GRACE * 3),
            NodeVerdict::Nothing
        );
        assert_eq!(n.judge(&node(Ready::True), due), NodeVerdict::Recovered);
        n.recovered("n");
        assert_eq!(n.judge(&node(Ready::True), due), NodeVerdict::Nothing);
        assert_eq!(n.judge(&node(Ready::Missing), due), NodeVerdict::Nothing);
    }

    #[test]
    fn a_ready_node_resets_the_grace_and_a_deleted_node_fails_once() {
        let mut n = Nodes::default();
        let t0 = Instant::now();
        n.judge(&node(Ready::NotTrue), t0);
        n.judge(&node(Ready::True), t0 + Duration::from_secs(200));
        let t1 = t0 + Duration::from_secs(250);
        assert_eq!(
            n.judge(&node(Ready::NotTrue), t1),
            NodeVerdict::LookAt(t1 + NODE_FAILURE_GRACE)
        );
        assert_eq!(n.deleted("n"), NodeVerdict::Failed);
        n.failed("n");
        assert_eq!(n.deleted("n"), NodeVerdict::Nothing);
        assert!(!n.is_down("n"));
    }
}
