//! The desired state (sockets the watcher has seen) and the actual state (plugins registered
//! with their handler), both keyed by socket path.
//!
//! Every time a socket is seen anew it gets a fresh instance id, so a socket re-created at the
//! same path is deregistered and registered again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tokio::time::Instant;

/// Which file a socket is: device and inode. A socket re-created at the same path is another
/// file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId {
    /// Device number.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
}

/// Errors of the state caches.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// The socket path is empty.
    #[error("socket path is empty")]
    EmptyPath,
}

/// One socket the watcher has seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredEntry {
    /// Instance id, new each time the socket is (re)added.
    pub instance: u64,
    /// The file, when known.
    pub file: Option<FileId>,
    /// When it was (re)added.
    pub seen_at: Instant,
}

/// Sockets that should be registered.
#[derive(Debug, Default)]
pub struct DesiredState {
    entries: HashMap<PathBuf, DesiredEntry>,
    next_instance: u64,
}

impl DesiredState {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the socket, or replaces its entry with a fresh instance (upstream's
    /// `AddOrUpdatePlugin`). Returns the new instance id.
    pub fn add_or_update(
        &mut self,
        path: &Path,
        file: Option<FileId>,
        now: Instant,
    ) -> Result<u64, StateError> {
        if path.as_os_str().is_empty() {
            return Err(StateError::EmptyPath);
        }
        self.next_instance += 1;
        let instance = self.next_instance;
        self.entries.insert(
            path.to_owned(),
            DesiredEntry {
                instance,
                file,
                seen_at: now,
            },
        );
        Ok(instance)
    }

    /// Adds the socket unless the same file is already there; returns whether anything changed.
    /// Used by rescans, which must not restart registrations of sockets that did not change.
    pub fn ensure(&mut self, path: &Path, file: FileId, now: Instant) -> Result<bool, StateError> {
        match self.entries.get(path) {
            Some(e) if e.file == Some(file) => Ok(false),
            _ => self.add_or_update(path, Some(file), now).map(|_| true),
        }
    }

    /// Removes the socket; returns whether it was there.
    pub fn remove(&mut self, path: &Path) -> bool {
        self.entries.remove(path).is_some()
    }

    /// Removes every socket at or under `dir`; returns the removed paths.
    pub fn remove_under(&mut self, dir: &Path) -> Vec<PathBuf> {
        let gone: Vec<PathBuf> = self
            .entries
            .keys()
            .filter(|p| p.starts_with(dir))
            .cloned()
            .collect();
        for p in &gone {
            self.entries.remove(p);
        }
        gone
    }

    /// The entry for `path`.
    pub fn get(&self, path: &Path) -> Option<&DesiredEntry> {
        self.entries.get(path)
    }

    /// Whether `path` is desired.
    pub fn contains(&self, path: &Path) -> bool {
        self.entries.contains_key(path)
    }

    /// All entries, unordered.
    pub fn iter(&self) -> impl Iterator<Item = (&PathBuf, &DesiredEntry)> {
        self.entries.iter()
    }

    /// Number of sockets.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A plugin registered with its handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActualEntry {
    /// The desired-state instance that was registered.
    pub instance: u64,
    /// Plugin type (selects the handler).
    pub plugin_type: String,
    /// Plugin name.
    pub name: String,
    /// Endpoint given to the handler.
    pub endpoint: String,
    /// Advertised versions.
    pub versions: Vec<String>,
}

/// Plugins registered with their handlers.
#[derive(Debug, Default)]
pub struct ActualState {
    entries: HashMap<PathBuf, ActualEntry>,
}

impl ActualState {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a registered plugin (overwrites).
    pub fn add(&mut self, path: &Path, entry: ActualEntry) -> Result<(), StateError> {
        if path.as_os_str().is_empty() {
            return Err(StateError::EmptyPath);
        }
        self.entries.insert(path.to_owned(), entry);
        Ok(())
    }

    /// Forgets the plugin at `path`, returning it.
    pub fn remove(&mut self, path: &Path) -> Option<ActualEntry> {
        self.entries.remove(path)
    }

    /// The plugin at `path`.
    pub fn get(&self, path: &Path) -> Option<&ActualEntry> {
        self.entries.get(path)
    }

    /// Whether the plugin at `path` is registered as `instance` (upstream's
    /// `PluginExistsWithCorrectUUID`).
    pub fn has_instance(&self, path: &Path, instance: u64) -> bool {
        self.entries
            .get(path)
            .is_some_and(|e| e.instance == instance)
    }

    /// All entries, unordered.
    pub fn iter(&self) -> impl Iterator<Item = (&PathBuf, &ActualEntry)> {
        self.entries.iter()
    }

    /// Number of registered plugins.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(instance: u64) -> ActualEntry {
        ActualEntry {
            instance,
            plugin_type: "DevicePlugin".into(),
            name: "n".into(),
            endpoint: "/e".into(),
            versions: vec!["v1beta1".into()],
        }
    }

    #[test]
    fn desired_add_new_plugin_is_listed() {
        let mut d = DesiredState::new();
        let p = Path::new("/r/a.sock");
        d.add_or_update(p, None, Instant::now()).unwrap();
        assert!(d.contains(p));
        assert_eq!(d.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>(), [p]);
    }

    #[test]
    fn desired_readd_keeps_one_entry_with_a_new_instance() {
        let mut d = DesiredState::new();
        let p = Path::new("/r/a.sock");
        let a = d.add_or_update(p, None, Instant::now()).unwrap();
        let b = d.add_or_update(p, None, Instant::now()).unwrap();
        assert_ne!(a, b);
        assert_eq!(d.len(), 1);
        assert_eq!(d.get(p).unwrap().instance, b);
    }

    #[test]
    fn desired_add_empty_path_is_refused() {
        let mut d = DesiredState::new();
        let err = d
            .add_or_update(Path::new(""), None, Instant::now())
            .unwrap_err();
        assert_eq!(err.to_string(), "socket path is empty");
        assert!(d.is_empty());
    }

    #[test]
    fn desired_remove_forgets() {
        let mut d = DesiredState::new();
        let p = Path::new("/r/a.sock");
        d.add_or_update(p, None, Instant::now()).unwrap();
        assert!(d.remove(p));
        assert!(!d.contains(p));
        assert!(!d.remove(p), "removing an unknown path is a no-op");
    }

    #[test]
    fn desired_remove_under_takes_the_subtree_only() {
        let mut d = DesiredState::new();
        for p in ["/r/a/x.sock", "/r/a/b/y.sock", "/r/ab.sock", "/r/z.sock"] {
            d.add_or_update(Path::new(p), None, Instant::now()).unwrap();
        }
        let mut gone = d.remove_under(Path::new("/r/a"));
        gone.sort();
        assert_eq!(
            gone,
            [PathBuf::from("/r/a/b/y.sock"), PathBuf::from("/r/a/x.sock")]
        );
        assert_eq!(d.len(), 2);
    }

    #[test]
    fn desired_ensure_keeps_an_unchanged_file() {
        let mut d = DesiredState::new();
        let p = Path::new("/r/a.sock");
        let f = FileId { dev: 1, ino: 2 };
        assert!(d.ensure(p, f, Instant::now()).unwrap());
        let i = d.get(p).unwrap().instance;
        assert!(!d.ensure(p, f, Instant::now()).unwrap());
        assert_eq!(d.get(p).unwrap().instance, i);
        assert!(
            d.ensure(p, FileId { dev: 1, ino: 3 }, Instant::now())
                .unwrap()
        );
        assert_ne!(
            d.get(p).unwrap().instance,
            i,
            "a replaced file is a new instance"
        );
    }

    #[test]
    fn actual_add_stores_the_entry() {
        let mut a = ActualState::new();
        let p = Path::new("/r/a.sock");
        a.add(p, entry(7)).unwrap();
        assert_eq!(a.get(p), Some(&entry(7)));
        assert!(a.has_instance(p, 7));
    }

    #[test]
    fn actual_add_empty_path_is_refused() {
        let mut a = ActualState::new();
        assert_eq!(a.add(Path::new(""), entry(1)), Err(StateError::EmptyPath));
        assert!(a.is_empty());
    }

    #[test]
    fn actual_remove_forgets() {
        let mut a = ActualState::new();
        let p = Path::new("/r/a.sock");
        a.add(p, entry(1)).unwrap();
        assert_eq!(a.remove(p), Some(entry(1)));
        assert!(a.is_empty());
    }

    #[test]
    fn actual_instance_mismatch_is_not_registered() {
        let mut a = ActualState::new();
        let p = Path::new("/r/a.sock");
        a.add(p, entry(1)).unwrap();
        assert!(!a.has_instance(p, 2));
    }
}
