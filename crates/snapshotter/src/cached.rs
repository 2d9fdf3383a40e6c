//! What both controllers' watch caches (contents and group contents) keep of an object, and
//! when a changed object is worth a sync.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher;
use plugreg_sidecar_kit::cache::{self, CompactStore, Keyed, Readiness, Watches};
use plugreg_sidecar_kit::compact::{Compact, Trim};
use plugreg_sidecar_kit::queue::WorkQueue;
use plugreg_sidecar_kit::runtime::Writes;
use plugreg_sidecar_kit::snapshot::LABEL_MANAGED_BY;

/// What the watch of a controller's kind `K` reads of each object before the cache trims it
/// (the trim is the kind's [`Trim`]).
pub struct Watched<K> {
    /// What makes a change worth a sync.
    pub fingerprint: fn(&K) -> u64,
    /// Its driver, readiness, and whether it is a group member with its snapshot.
    pub look: fn(&K) -> (&str, bool, bool),
}

/// An object as the cache keeps it: its compact form (design S7), with what its watch event
/// saw of it before the trim.
pub struct Cached<T: Trim> {
    /// The object, trimmed by `T`.
    pub compact: Compact<T>,
    /// Whether it is the driver's.
    pub ours: bool,
    sighting: Sighting,
}

impl<T: Trim> Keyed for Cached<T> {
    fn key(&self) -> &str {
        self.compact.key()
    }
}

/// The watch cache of the driver's objects of kind `T::Object` (with `--node-deployment`, only
/// those labelled for `node`), kept compact: each one worth a sync ([`Sightings::wake`]) goes
/// on `queue`; a deleted one is forgotten there and in `written`.
#[allow(clippy::too_many_arguments)]
pub fn watch_ours<T>(
    watches: &Watches,
    node: Option<&str>,
    driver: String,
    what: Watched<T::Object>,
    queue: Arc<WorkQueue<String>>,
    written: Arc<Writes<String>>,
    shutdown: &tokio_util::sync::CancellationToken,
    ready: &mut Readiness,
) -> CompactStore<Cached<T>>
where
    T: Trim + Send + Sync + 'static,
    T::Object: Clone + Debug + Send + Sync + 'static,
{
    let mut selector = watcher::Config::default();
    if let Some(node) = node {
        selector = selector.labels(&format!("{LABEL_MANAGED_BY}={node}"));
    }
    let seen = Sightings::default();
    let Watched { fingerprint, look } = what;
    cache::watch_compact::<T::Object, _>(
        watches,
        selector,
        shutdown,
        ready,
        // The sighting is taken of the whole object, before the trim drops what the
        // fingerprint covers (labels and annotations the cache does not keep).
        move |o: T::Object| {
            let (its_driver, is_ready, member_handle) = look(&o);
            let ours = its_driver == driver;
            let sighting = Sighting {
                fingerprint: fingerprint(&o),
                ready: is_ready,
                member_handle,
            };
            Cached {
                compact: Compact::new(o),
                ours,
                sighting,
            }
        },
        move |c: &Cached<T>, deleted| {
            let name = c.compact.name();
            if deleted {
                seen.forget(name);
                written.forget(name);
                return;
            }
            if c.ours && seen.wake(name, c.sighting) {
                queue.add(name.to_owned());
            }
        },
    )
}

/// How long a sync that found the cache behind its own last write waits before looking again.
pub const CACHE_CATCH_UP: Duration = Duration::from_millis(200);

/// Keeps of a class's metadata its name and resource version (the decisions read its driver
/// and parameters).
pub fn trim_class_meta(m: &mut ObjectMeta) {
    *m = ObjectMeta {
        name: m.name.take(),
        resource_version: m.resource_version.take(),
        ..ObjectMeta::default()
    };
}

/// Keeps of a reference its identity (name, namespace, UID), all that is read of it.
pub fn trim_ref(r: &mut ObjectReference) {
    r.api_version = None;
    r.field_path = None;
    r.kind = None;
    r.resource_version = None;
}

/// What the watch delivered of an object, as far as waking its sync goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sighting {
    /// What makes a change worth a sync (the sidecar's own writes leave it unchanged).
    pub fingerprint: u64,
    /// `status.readyToUse` is true.
    pub ready: bool,
    /// A group member whose status has its snapshot (written by the snapshot-controller).
    pub member_handle: bool,
}

/// The last sighting of each object, by name.
#[derive(Debug, Default)]
pub struct Sightings(Mutex<HashMap<String, Sighting>>);

impl Sightings {
    /// Records `now` for `name` and says whether it is worth a sync: a new object, a changed
    /// fingerprint, readiness gained, or a group member that the snapshot-controller just gave
    /// its snapshot or wrote back to not ready (status changes, but not this sidecar's own).
    pub fn wake(&self, name: &str, now: Sighting) -> bool {
        let before = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned(), now);
        match before {
            None => true,
            Some(was) => {
                was.fingerprint != now.fingerprint
                    || (now.ready && !was.ready)
                    || (now.member_handle && (!was.member_handle || (was.ready && !now.ready)))
            }
        }
    }

    /// Forgets a deleted object.
    pub fn forget(&self, name: &str) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(fingerprint: u64, ready: bool, member_handle: bool) -> Sighting {
        Sighting {
            fingerprint,
            ready,
            member_handle,
        }
    }

    #[test]
    fn only_changes_worth_a_sync_wake_it() {
        let s = Sightings::default();
        assert!(s.wake("a", seen(1, false, false)), "new");
        assert!(
            !s.wake("a", seen(1, false, false)),
            "a status write of ours"
        );
        assert!(s.wake("a", seen(2, false, false)), "changed");
        assert!(s.wake("a", seen(2, true, false)), "became ready");
        assert!(!s.wake("a", seen(2, false, false)), "not a member: no wake");
        assert!(s.wake("m", seen(1, false, false)));
        assert!(
            s.wake("m", seen(1, false, true)),
            "the member's snapshot written"
        );
        assert!(s.wake("m", seen(1, true, true)));
        assert!(s.wake("m", seen(1, false, true)), "the member written back");
        s.forget("m");
        assert!(s.wake("m", seen(1, false, true)), "new again");
    }
}
