//! The controller's one memory beyond the watch caches: the volumes it has recorded (see
//! [`crate::record`]) and what it did recently that the caches do not show yet.
//!
//! - Volumes: each recorded volume, whether a CreateVolume of it may have reached the driver
//!   (then only a PV or a DeleteVolume ends it), whether it is saved as a PV the cache has not
//!   shown yet (so that a claim synced again meanwhile is not provisioned twice), and whether
//!   a worker is acting on it (so that the claim's worker and the record's worker never act on
//!   one volume at once).
//! - Claims: upstream's slow set (an INVALID_ARGUMENT delays the claim's retries for five
//!   minutes while its class is unchanged). (A reschedule the cache does not show yet is the
//!   controller's [`Writes`](plugreg_sidecar_kit::runtime::Writes), the kit's one memory of
//!   our own writes.)
//! - PVs: the ones whose volume this process deleted, and the ones whose finalizer it removed,
//!   until the cache catches up.
//!
//! Everything but the recorded volumes expires (the caches catch up within seconds), and the
//! maps are swept when they grow.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::record::Entry;

/// How long an INVALID_ARGUMENT keeps a claim in the slow set (upstream's library default).
pub const INFEASIBLE_RETENTION: Duration = Duration::from_secs(300);
/// How long a PV deletion is remembered (the DELETE and the finalizer removal come back).
pub const DELETED_MEMORY: Duration = Duration::from_secs(600);
/// Notes kept before a sweep of the expired ones.
const SWEEP_AT: usize = 16_384;

/// Where a recorded volume stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// In the record; `ambiguous` once a CreateVolume may have reached the driver without a
    /// definite answer (a timeout, a transport failure), and for every volume read back from
    /// the record after a restart.
    Recorded {
        /// A CreateVolume may have created it.
        ambiguous: bool,
    },
    /// Saved as a PV at this instant; the cache may not show it yet.
    Saved(Instant),
}

/// A recorded volume as the decisions see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Volume {
    /// What the record holds.
    pub entry: Entry,
    /// Where it stands.
    pub phase: Phase,
}

impl Volume {
    /// Whether a CreateVolume may have created it (only a PV or DeleteVolume ends it then).
    pub fn ambiguous(&self) -> bool {
        matches!(
            self.phase,
            Phase::Recorded { ambiguous: true } | Phase::Saved(_)
        )
    }
}

#[derive(Debug, Default)]
struct ClaimNote {
    /// The class UID and time of the last INVALID_ARGUMENT.
    infeasible: Option<(String, Instant)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PvNote {
    Deleted(Instant),
    Finalized(Instant),
}

/// What the controller remembers of a PV it deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// Its volume is deleted (DeleteVolume succeeded); the finalizer may still be there.
    Volume,
    /// Its volume is deleted and its finalizer removed: nothing is left to do.
    Finalized,
}

#[derive(Debug, Default)]
struct State {
    volumes: HashMap<String, (Volume, bool)>,
    by_claim: HashMap<String, String>,
    claims: HashMap<String, ClaimNote>,
    pvs: HashMap<String, PvNote>,
}

/// The memory; cheap to share, one lock, never held across an await.
#[derive(Debug, Default)]
pub struct InFlight {
    state: Mutex<State>,
}

/// A worker's hold on a volume, released when dropped.
#[derive(Debug)]
pub struct Busy<'a> {
    memory: &'a InFlight,
    volume: String,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        if let Some((_, busy)) = self.memory.lock().volumes.get_mut(&self.volume) {
            *busy = false;
        }
    }
}

impl InFlight {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes a recorded volume (replacing what was known of it).
    pub fn add(&self, entry: Entry, ambiguous: bool) {
        let mut s = self.lock();
        s.by_claim.insert(entry.uid.clone(), entry.volume.clone());
        let volume = entry.volume.clone();
        let busy = s.volumes.get(&volume).is_some_and(|(_, b)| *b);
        s.volumes.insert(
            volume,
            (
                Volume {
                    entry,
                    phase: Phase::Recorded { ambiguous },
                },
                busy,
            ),
        );
    }

    /// The recorded volume `name`.
    pub fn volume(&self, name: &str) -> Option<Volume> {
        self.lock().volumes.get(name).map(|(v, _)| v.clone())
    }

    /// The recorded volume of the claim with this UID.
    pub fn volume_of_claim(&self, uid: &str) -> Option<Volume> {
        let s = self.lock();
        let name = s.by_claim.get(uid)?;
        s.volumes.get(name).map(|(v, _)| v.clone())
    }

    /// Every recorded volume's name.
    pub fn volumes(&self) -> Vec<String> {
        self.lock().volumes.keys().cloned().collect()
    }

    /// Takes `name` for one worker; `None` while another one acts on it (or it is unknown).
    pub fn begin(&self, name: &str) -> Option<Busy<'_>> {
        let mut s = self.lock();
        let (_, busy) = s.volumes.get_mut(name)?;
        if *busy {
            return None;
        }
        *busy = true;
        Some(Busy {
            memory: self,
            volume: name.to_owned(),
        })
    }

    /// A CreateVolume of `name` may have reached the driver.
    pub fn mark_ambiguous(&self, name: &str) {
        if let Some((v, _)) = self.lock().volumes.get_mut(name)
            && let Phase::Recorded { ambiguous } = &mut v.phase
        {
            *ambiguous = true;
        }
    }

    /// `name` is saved as a PV.
    pub fn mark_saved(&self, name: &str, now: Instant) {
        if let Some((v, _)) = self.lock().volumes.get_mut(name) {
            v.phase = Phase::Saved(now);
        }
    }

    /// Forgets the volume `name` (its PV is in the cache, or it is deleted, or nothing of it
    /// was ever created).
    pub fn remove(&self, name: &str) {
        let mut s = self.lock();
        if let Some((v, _)) = s.volumes.remove(name)
            && s.by_claim.get(&v.entry.uid).is_some_and(|n| n == name)
        {
            s.by_claim.remove(&v.entry.uid);
        }
    }

    /// Notes an INVALID_ARGUMENT for the claim `uid` of the class `class_uid`.
    pub fn set_infeasible(&self, uid: &str, class_uid: &str, now: Instant) {
        let mut s = self.lock();
        sweep(&mut s, now);
        s.claims.entry(uid.to_owned()).or_default().infeasible = Some((class_uid.to_owned(), now));
    }

    /// Whether the claim `uid` is in the slow set for `class_uid`.
    pub fn infeasible(&self, uid: &str, class_uid: &str, now: Instant) -> bool {
        self.lock()
            .claims
            .get(uid)
            .and_then(|n| n.infeasible.as_ref())
            .is_some_and(|(c, at)| c == class_uid && now.duration_since(*at) < INFEASIBLE_RETENTION)
    }

    /// Notes that the volume of the PV `uid` is deleted (`finalized`: its finalizer too).
    pub fn set_deleted(&self, uid: &str, finalized: bool, now: Instant) {
        let mut s = self.lock();
        sweep(&mut s, now);
        let note = if finalized {
            PvNote::Finalized(now)
        } else {
            PvNote::Deleted(now)
        };
        s.pvs.insert(uid.to_owned(), note);
    }

    /// What this process deleted of the PV `uid` recently.
    pub fn deleted(&self, uid: &str, now: Instant) -> Option<Deleted> {
        match self.lock().pvs.get(uid)? {
            PvNote::Deleted(at) if now.duration_since(*at) < DELETED_MEMORY => {
                Some(Deleted::Volume)
            }
            PvNote::Finalized(at) if now.duration_since(*at) < DELETED_MEMORY => {
                Some(Deleted::Finalized)
            }
            _ => None,
        }
    }

    /// Notes kept (volumes, claims, PVs), for tests and metrics.
    pub fn sizes(&self) -> (usize, usize, usize) {
        let s = self.lock();
        (s.volumes.len(), s.claims.len(), s.pvs.len())
    }
}

/// Drops expired notes once the maps are large.
fn sweep(s: &mut State, now: Instant) {
    if s.claims.len() >= SWEEP_AT {
        s.claims.retain(|_, n| {
            n.infeasible
                .as_ref()
                .is_some_and(|(_, at)| now.duration_since(*at) < INFEASIBLE_RETENTION)
        });
    }
    if s.pvs.len() >= SWEEP_AT {
        s.pvs.retain(|_, n| match n {
            PvNote::Deleted(at) | PvNote::Finalized(at) => now.duration_since(*at) < DELETED_MEMORY,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Template;
    use std::sync::Arc;

    fn entry(volume: &str, uid: &str) -> Entry {
        Entry {
            volume: volume.into(),
            namespace: "ns".into(),
            claim: "data".into(),
            uid: uid.into(),
            template: Arc::new(Template {
                request: Vec::new(),
                secret: None,
            }),
        }
    }

    #[test]
    fn a_volume_goes_from_recorded_to_saved_to_forgotten() {
        let m = InFlight::default();
        let now = Instant::now();
        m.add(entry("pvc-1", "u1"), false);
        assert!(!m.volume("pvc-1").unwrap().ambiguous());
        m.mark_ambiguous("pvc-1");
        assert!(m.volume_of_claim("u1").unwrap().ambiguous());
        m.mark_saved("pvc-1", now);
        assert_eq!(m.volume("pvc-1").unwrap().phase, Phase::Saved(now));
        m.remove("pvc-1");
        assert!(m.volume("pvc-1").is_none());
        assert!(m.volume_of_claim("u1").is_none());
        assert_eq!(m.sizes(), (0, 0, 0));
    }

    #[test]
    fn one_worker_at_a_time_acts_on_a_volume() {
        let m = InFlight::default();
        assert!(
            m.begin("pvc-1").is_none(),
            "unknown volumes cannot be taken"
        );
        m.add(entry("pvc-1", "u1"), true);
        let held = m.begin("pvc-1").unwrap();
        assert!(m.begin("pvc-1").is_none());
        // Recording it again (after a conflict) keeps the hold.
        m.add(entry("pvc-1", "u1"), true);
        assert!(m.begin("pvc-1").is_none());
        drop(held);
        assert!(m.begin("pvc-1").is_some());
    }

    #[test]
    fn notes_expire() {
        let m = InFlight::default();
        let t0 = Instant::now();
        m.set_infeasible("u1", "class-1", t0);
        assert!(m.infeasible("u1", "class-1", t0 + Duration::from_secs(299)));
        assert!(
            !m.infeasible("u1", "class-2", t0),
            "another class starts afresh"
        );
        assert!(!m.infeasible("u1", "class-1", t0 + INFEASIBLE_RETENTION));

        m.set_deleted("pv-1", false, t0);
        assert_eq!(m.deleted("pv-1", t0), Some(Deleted::Volume));
        m.set_deleted("pv-1", true, t0);
        assert_eq!(m.deleted("pv-1", t0), Some(Deleted::Finalized));
        assert_eq!(m.deleted("pv-1", t0 + DELETED_MEMORY), None);
    }

    #[test]
    fn sweeps_bound_the_notes() {
        let m = InFlight::default();
        let t0 = Instant::now();
        for i in 0..SWEEP_AT {
            m.set_deleted(&format!("pv-{i}"), true, t0);
            m.set_infeasible(&format!("u{i}"), "c", t0);
        }
        let later = t0 + DELETED_MEMORY;
        m.set_deleted("pv-new", true, later);
        m.set_infeasible("u-new", "c", later);
        assert_eq!(m.sizes(), (0, 1, 1));
    }
}
