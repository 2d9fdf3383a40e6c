//! The state machine of one socket and the pure decision of what to do next.
//!
//! [`decide`] looks at the desired entry, the actual entry, the socket's machine state and the
//! time, and names the next move. It does no I/O and reads no clock, so every rule (upstream's
//! reconciler, D1-D5) is tested below with explicit instants.

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::operation::Step;
use crate::record::PluginState;
use crate::state::{ActualEntry, DesiredEntry, FileId};

/// Where a socket's machine stands; published as its [`PluginState`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Seen; waiting for an operation slot or a quick re-dial.
    Pending,
    /// A registration runs.
    Registering,
    /// Registered with its handler since then.
    Registered {
        /// Wall-clock time of the registration.
        since: SystemTime,
    },
    /// The last attempt failed; the retry waits for the back-off.
    BackingOff,
    /// A deregistration runs.
    Deregistering,
    /// Its plugin is dead but the file stays (D5).
    Failed,
}

impl Phase {
    /// The published state.
    pub(crate) fn state(self) -> PluginState {
        match self {
            Phase::Pending => PluginState::Pending,
            Phase::Registering => PluginState::Registering,
            Phase::Registered { .. } => PluginState::Registered,
            Phase::BackingOff => PluginState::BackingOff,
            Phase::Deregistering => PluginState::Deregistering,
            Phase::Failed => PluginState::Failed,
        }
    }

    /// Whether an operation runs.
    pub(crate) fn busy(self) -> bool {
        matches!(self, Phase::Registering | Phase::Deregistering)
    }
}

/// Failed attempts in a row of one socket instance (D3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Attempts {
    /// The instance they belong to.
    pub(crate) instance: u64,
    /// How many in a row.
    pub(crate) failures: u32,
    /// No retry before this.
    pub(crate) retry_at: Instant,
}

/// Quiet re-dials of a young socket that refused (D1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Redial {
    /// The instance.
    pub(crate) instance: u64,
    /// Re-dials so far.
    pub(crate) count: u32,
    /// The next may start then.
    pub(crate) at: Instant,
}

/// Re-dials of a young socket made 1 ms apart before they space out.
const QUICK_REDIALS: u32 = 20;

/// The wait before re-dial number `count` (0-based) of a young socket: every 1 ms for the first
/// 20 (a Go or C plugin listens within microseconds of binding, a slow one within a few ms),
/// then every 4 ms until the socket is a second old: at most about 265 refused dials, each a
/// failed `connect()`, for a socket that never listens. Measured: a plugin that listens 1 ms
/// after binding registered with p99 9.5 ms when the waits doubled to 4 ms at once.
pub(crate) fn redial_delay(count: u32) -> Duration {
    if count < QUICK_REDIALS {
        Duration::from_millis(1)
    } else {
        Duration::from_millis(4)
    }
}

/// What the plugin said about itself, last time it answered GetInfo.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Info {
    pub(crate) plugin_type: String,
    pub(crate) name: String,
    pub(crate) endpoint: String,
    pub(crate) versions: Vec<String>,
}

/// Everything the machine keeps about one socket besides the desired and actual entries.
#[derive(Debug, Clone)]
pub(crate) struct Socket {
    pub(crate) phase: Phase,
    pub(crate) attempts: Option<Attempts>,
    pub(crate) redial: Option<Redial>,
    pub(crate) last_error: Option<(Step, String)>,
    pub(crate) info: Option<Info>,
    /// The file of a plugin found dead (D5): that file is not registered again.
    pub(crate) dead: Option<FileId>,
    /// Liveness probes refused in a row.
    pub(crate) refusals: u32,
    /// Waiting in the runner's queue.
    pub(crate) queued: bool,
}

impl Default for Socket {
    fn default() -> Self {
        Socket {
            phase: Phase::Pending,
            attempts: None,
            redial: None,
            last_error: None,
            info: None,
            dead: None,
            refusals: 0,
            queued: false,
        }
    }
}

/// The next move for one socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Stay as it is: an operation runs, or it is registered as desired.
    Stay,
    /// Start registering this desired instance.
    Register(u64),
    /// Start deregistering (gone, replaced by a new instance, or dead).
    Deregister,
    /// Wait for the back-off of the desired instance to end.
    BackOffUntil(Instant),
    /// Re-dial the young socket then (D1).
    RedialAt(Instant),
    /// An operation is due but every slot is taken.
    Queue,
    /// Dead plugin whose file stays (D5): wait for the file to go or change.
    Failed,
    /// Nothing left to track.
    Forget,
}

/// Decides the next move. `free_slot`: whether the runner can start an operation now.
pub(crate) fn decide(
    desired: Option<&DesiredEntry>,
    actual: Option<&ActualEntry>,
    socket: &Socket,
    now: Instant,
    free_slot: bool,
) -> Decision {
    if socket.phase.busy() {
        return Decision::Stay;
    }
    let want = desired.map(|d| d.instance);
    if let Some(a) = actual {
        // Upstream's order: deregistrations first; a new instance replaces the old one.
        if want == Some(a.instance) {
            return Decision::Stay;
        }
        return if free_slot {
            Decision::Deregister
        } else {
            Decision::Queue
        };
    }
    let Some(instance) = want else {
        return if socket.dead.is_some() {
            Decision::Failed
        } else {
            Decision::Forget
        };
    };
    if let Some(r) = socket.redial
        && r.instance == instance
        && now < r.at
    {
        return Decision::RedialAt(r.at);
    }
    if let Some(a) = socket.attempts
        && a.instance == instance
        && now < a.retry_at
    {
        return Decision::BackOffUntil(a.retry_at);
    }
    if free_slot {
        Decision::Register(instance)
    } else {
        Decision::Queue
    }
}

/// The record after one more failure of `instance` at `now` (D3: another instance's record
/// does not carry over).
pub(crate) fn after_failure(
    previous: Option<Attempts>,
    instance: u64,
    now: Instant,
    policy: &plugreg_runtime::Backoff,
) -> Attempts {
    let failures = match previous {
        Some(p) if p.instance == instance => p.failures.saturating_add(1),
        _ => 1,
    };
    Attempts {
        instance,
        failures,
        retry_at: now + policy.delay(failures),
    }
}

/// The next quiet re-dial of a young socket (D1).
pub(crate) fn next_redial(previous: Option<Redial>, instance: u64, now: Instant) -> Redial {
    let count = match previous {
        Some(r) if r.instance == instance => r.count.saturating_add(1),
        _ => 0,
    };
    Redial {
        instance,
        count,
        at: now + redial_delay(count),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugreg_runtime::Backoff;

    fn desired(instance: u64, now: Instant) -> DesiredEntry {
        DesiredEntry {
            instance,
            file: Some(FileId {
                dev: 1,
                ino: instance,
            }),
            seen_at: now,
        }
    }

    fn actual(instance: u64) -> ActualEntry {
        ActualEntry {
            instance,
            plugin_type: "DevicePlugin".into(),
            name: "example.com/gpu".into(),
            endpoint: "/r/gpu.sock".into(),
            versions: vec!["v1beta1".into()],
        }
    }

    fn registered() -> Socket {
        Socket {
            phase: Phase::Registered {
                since: SystemTime::UNIX_EPOCH,
            },
            ..Socket::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_desired_nothing_registered_is_forgotten() {
        // upstream Test_Run_Positive_DoNothing.
        let now = Instant::now();
        assert_eq!(
            decide(None, None, &Socket::default(), now, true),
            Decision::Forget
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_desired_socket_is_registered_with_its_instance() {
        // upstream Test_Run_Positive_Register.
        let now = Instant::now();
        let d = desired(7, now);
        let s = Socket::default();
        assert_eq!(decide(Some(&d), None, &s, now, true), Decision::Register(7));
    }

    #[tokio::test(start_paused = true)]
    async fn a_registered_socket_as_desired_stays() {
        let now = Instant::now();
        let d = desired(7, now);
        assert_eq!(
            decide(Some(&d), Some(&actual(7)), &registered(), now, true),
            Decision::Stay
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_removed_socket_is_deregistered() {
        // upstream Test_Run_Positive_RegisterThenUnregister.
        let now = Instant::now();
        assert_eq!(
            decide(None, Some(&actual(7)), &registered(), now, true),
            Decision::Deregister
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_instance_deregisters_the_old_one_first() {
        // upstream Test_Run_Positive_ReRegister: deregister, then (next decision) register.
        let now = Instant::now();
        let d = desired(8, now);
        assert_eq!(
            decide(Some(&d), Some(&actual(7)), &registered(), now, true),
            Decision::Deregister
        );
        let s = Socket::default();
        assert_eq!(decide(Some(&d), None, &s, now, true), Decision::Register(8));
    }

    #[tokio::test(start_paused = true)]
    async fn one_operation_per_socket_at_a_time() {
        // upstream operation executor: a second operation on the same key is refused while the
        // first runs, whether register or deregister.
        let now = Instant::now();
        let d = desired(8, now);
        for phase in [Phase::Registering, Phase::Deregistering] {
            let s = Socket {
                phase,
                ..Socket::default()
            };
            assert_eq!(decide(Some(&d), None, &s, now, true), Decision::Stay);
            assert_eq!(
                decide(None, Some(&actual(7)), &s, now, true),
                Decision::Stay
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_free_slot_registrations_and_deregistrations_queue() {
        // D7: both kinds share the cap.
        let now = Instant::now();
        let d = desired(1, now);
        let s = Socket::default();
        assert_eq!(decide(Some(&d), None, &s, now, false), Decision::Queue);
        assert_eq!(
            decide(None, Some(&actual(1)), &registered(), now, false),
            Decision::Queue
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_backs_off_500ms_doubling_to_122s() {
        // upstream goroutinemap back-off, through the decision.
        let policy = Backoff::KUBELET_OPERATIONS;
        let d = desired(3, Instant::now());
        let mut s = Socket::default();
        let mut waits = Vec::new();
        for _ in 0..10 {
            let now = Instant::now();
            s.attempts = Some(after_failure(s.attempts, 3, now, &policy));
            s.phase = Phase::BackingOff;
            let Decision::BackOffUntil(at) = decide(Some(&d), None, &s, now, true) else {
                panic!("not backing off");
            };
            waits.push((at - now).as_secs_f64());
            tokio::time::advance(at - now - Duration::from_millis(1)).await;
            assert!(matches!(
                decide(Some(&d), None, &s, Instant::now(), true),
                Decision::BackOffUntil(_)
            ));
            tokio::time::advance(Duration::from_millis(1)).await;
            assert_eq!(
                decide(Some(&d), None, &s, Instant::now(), true),
                Decision::Register(3)
            );
        }
        assert_eq!(
            waits,
            [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 122.0, 122.0]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_registration_is_retried_not_left_half_registered() {
        // D2: a failed register or notify leaves no actual entry (the operation rolled the
        // handler back), so the socket backs off and registers again.
        let policy = Backoff::KUBELET_OPERATIONS;
        let now = Instant::now();
        let d = desired(2, now);
        let s = Socket {
            phase: Phase::BackingOff,
            attempts: Some(after_failure(None, 2, now, &policy)),
            last_error: Some((Step::Notify, "failed to send registration status".into())),
            ..Socket::default()
        };
        assert_eq!(
            decide(Some(&d), None, &s, now, true),
            Decision::BackOffUntil(now + Duration::from_millis(500))
        );
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(
            decide(Some(&d), None, &s, Instant::now(), true),
            Decision::Register(2)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_recreated_socket_starts_without_back_off() {
        // D3: the back-off of instance 3 does not hold instance 4 back.
        let now = Instant::now();
        let policy = Backoff::KUBELET_OPERATIONS;
        let mut attempts = None;
        for _ in 0..8 {
            attempts = Some(after_failure(attempts, 3, now, &policy));
        }
        let s = Socket {
            phase: Phase::BackingOff,
            attempts,
            ..Socket::default()
        };
        assert!(matches!(
            decide(Some(&desired(3, now)), None, &s, now, true),
            Decision::BackOffUntil(_)
        ));
        assert_eq!(
            decide(Some(&desired(4, now)), None, &s, now, true),
            Decision::Register(4)
        );
        let fresh = after_failure(attempts, 4, now, &policy);
        assert_eq!(fresh.failures, 1);
        assert_eq!(fresh.retry_at - now, Duration::from_millis(500));
    }

    #[tokio::test(start_paused = true)]
    async fn a_young_refusing_socket_is_redialled_within_milliseconds() {
        // D1: no back-off, no failure; every 1 ms twenty times, then every 4 ms.
        let d = desired(5, Instant::now());
        let mut s = Socket::default();
        let mut waits = Vec::new();
        for _ in 0..22 {
            let now = Instant::now();
            s.redial = Some(next_redial(s.redial, 5, now));
            let Decision::RedialAt(at) = decide(Some(&d), None, &s, now, true) else {
                panic!("not re-dialling");
            };
            waits.push((at - now).as_millis());
            tokio::time::advance(at - now).await;
            assert_eq!(
                decide(Some(&d), None, &s, Instant::now(), true),
                Decision::Register(5)
            );
        }
        let mut expected = vec![1; 20];
        expected.extend([4, 4]);
        assert_eq!(waits, expected);
        assert_eq!(s.attempts, None, "no failure recorded");
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_plugin_stays_failed_until_its_file_changes() {
        // D5: after the dead plugin's deregistration, nothing is desired but the record stays.
        let now = Instant::now();
        let s = Socket {
            phase: Phase::Deregistering,
            dead: Some(FileId { dev: 1, ino: 9 }),
            ..Socket::default()
        };
        assert_eq!(decide(None, None, &s, now, true), Decision::Stay);
        let s = Socket {
            phase: Phase::Pending,
            ..s
        };
        assert_eq!(decide(None, None, &s, now, true), Decision::Failed);
        let s = Socket { dead: None, ..s };
        assert_eq!(decide(None, None, &s, now, true), Decision::Forget);
    }

    #[test]
    fn phases_publish_as_their_states() {
        let all = [
            Phase::Pending,
            Phase::Registering,
            Phase::Registered {
                since: SystemTime::UNIX_EPOCH,
            },
            Phase::BackingOff,
            Phase::Deregistering,
            Phase::Failed,
        ];
        let states: Vec<PluginState> = all.iter().map(|p| p.state()).collect();
        assert_eq!(states, PluginState::ALL);
    }
}
