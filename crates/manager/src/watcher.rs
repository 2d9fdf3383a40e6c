//! Watches the registry directory tree with inotify and reports which sockets exist.
//!
//! As upstream: the watch is added before the directory is listed, every sub-directory gets its
//! own watch (inotify is not recursive), names starting with `.` and files that are not sockets
//! are ignored. Where upstream loses events, this watcher does not (D4): a queue overflow
//! rescans the whole tree, a socket or sub-tree moved out or removed is reported gone, and a
//! removed registry directory is created and watched again.
//!
//! A symlink to a socket counts as a socket (upstream stats through symlinks when a file
//! appears); symlinked directories are not followed, so symlink loops cannot trap the walk.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::{Stream, StreamExt};
use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask, Watches};
use plugreg_runtime::Backoff;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::state::FileId;

/// What the watcher reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// A socket appeared (or was seen at start).
    Added {
        /// Its path.
        path: PathBuf,
        /// Which file it is.
        file: FileId,
    },
    /// The path is gone (deleted, or moved out of the tree).
    Removed {
        /// Its path.
        path: PathBuf,
    },
    /// Everything at or under the directory is gone.
    RemovedUnder {
        /// The directory.
        dir: PathBuf,
    },
    /// A full rescan: exactly these sockets exist now.
    Rescanned {
        /// Every socket in the tree.
        sockets: Vec<(PathBuf, FileId)>,
    },
}

/// Why the watcher could not start.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The registry directory could not be created.
    #[error("error (re-)creating root {path:?}")]
    CreateRoot {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// inotify could not be set up.
    #[error("failed to set up inotify")]
    Inotify(#[source] io::Error),
    /// The registry directory could not be watched.
    #[error("failed to watch {path:?}")]
    Watch {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// The wait after consecutive failed reads of the inotify stream: 10 ms doubling to 5 s. An
/// error that persists would otherwise be retried at once, forever: a core burnt and the log
/// flooded. The kernel keeps queueing events meanwhile (an overflow is rescanned), so nothing
/// is lost by waiting.
pub const STREAM_ERROR_BACKOFF: Backoff =
    Backoff::new(Duration::from_millis(10), Duration::from_secs(5));

fn dir_mask() -> WatchMask {
    WatchMask::CREATE
        | WatchMask::MOVED_TO
        | WatchMask::DELETE
        | WatchMask::MOVED_FROM
        | WatchMask::DELETE_SELF
        | WatchMask::MOVE_SELF
        | WatchMask::ONLYDIR
        | WatchMask::DONT_FOLLOW
}

fn hidden(name: &OsStr) -> bool {
    name.as_encoded_bytes().first() == Some(&b'.')
}

/// What a directory entry is to the watcher.
enum Kind {
    Dir,
    Socket(FileId),
    Ignored,
}

fn classify(path: &Path) -> io::Result<Kind> {
    let meta = std::fs::symlink_metadata(path)?;
    let ft = meta.file_type();
    if ft.is_dir() {
        return Ok(Kind::Dir);
    }
    let meta = if ft.is_symlink() {
        std::fs::metadata(path)?
    } else {
        meta
    };
    if meta.file_type().is_socket() {
        Ok(Kind::Socket(FileId {
            dev: meta.dev(),
            ino: meta.ino(),
        }))
    } else {
        Ok(Kind::Ignored)
    }
}

/// The inotify watches of one directory tree.
struct Tree {
    root: PathBuf,
    /// A watch on the root's parent: the root's own removal is reported there at once, while
    /// the root's IN_DELETE_SELF waits until no listening socket pins the directory.
    parent_wd: Option<WatchDescriptor>,
    watches: Watches,
    by_wd: HashMap<WatchDescriptor, PathBuf>,
    by_path: HashMap<PathBuf, WatchDescriptor>,
}

impl Tree {
    fn ensure_root(&mut self) -> Result<(), WatchError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&self.root)
            .map_err(|source| WatchError::CreateRoot {
                path: self.root.clone(),
                source,
            })?;
        if let Some(parent) = self.root.parent().filter(|p| !p.as_os_str().is_empty()) {
            let mask = WatchMask::DELETE | WatchMask::MOVED_FROM | WatchMask::ONLYDIR;
            match self.watches.add(parent, mask) {
                Ok(wd) => self.parent_wd = Some(wd),
                Err(e) => {
                    tracing::warn!(dir = %parent.display(), error = %e, "cannot watch the registry directory's parent")
                }
            }
        }
        Ok(())
    }

    /// Whether `event` reports the root itself removed or moved away, seen from its parent.
    fn is_root_gone(&self, wd: &WatchDescriptor, mask: EventMask, name: Option<&OsStr>) -> bool {
        self.parent_wd.as_ref() == Some(wd)
            && mask.intersects(EventMask::DELETE | EventMask::MOVED_FROM)
            && name.is_some()
            && name == self.root.file_name()
    }

    fn watch(&mut self, dir: &Path) -> io::Result<()> {
        let wd = self.watches.add(dir, dir_mask())?;
        if let Some(old) = self.by_wd.insert(wd.clone(), dir.to_owned())
            && old != dir
        {
            self.by_path.remove(&old);
        }
        self.by_path.insert(dir.to_owned(), wd);
        Ok(())
    }

    /// Walks the whole tree again (re-adding watches) and returns every socket in it.
    fn rescan(&mut self) -> Vec<(PathBuf, FileId)> {
        let mut sockets = Vec::new();
        let root = self.root.clone();
        if let Err(e) = self.walk(&root, &mut sockets) {
            tracing::warn!(root = %root.display(), error = %e, "rescan failed");
        }
        sockets
    }

    /// Forgets (and removes) the watches at or under `dir`.
    fn unwatch_under(&mut self, dir: &Path) {
        let gone: Vec<PathBuf> = self
            .by_path
            .keys()
            .filter(|p| p.starts_with(dir))
            .cloned()
            .collect();
        for p in gone {
            if let Some(wd) = self.by_path.remove(&p) {
                self.by_wd.remove(&wd);
                // The kernel already dropped the watch when the directory was deleted.
                let _ = self.watches.remove(wd);
            }
        }
    }

    /// Watches `dir` and everything under it, then lists it; sockets found go to `found`.
    /// Errors below the top are logged and skipped.
    fn walk(&mut self, dir: &Path, found: &mut Vec<(PathBuf, FileId)>) -> io::Result<()> {
        self.watch(dir)?;
        walk_tree(dir, found, |d| {
            self.watch(d)
                .map_err(
                    |e| tracing::warn!(dir = %d.display(), error = %e, "failed to watch directory"),
                )
                .is_ok()
        })
    }
}

/// An inotify watcher on a registry directory tree, created (and the root made) but not yet
/// running.
pub struct Watcher {
    stream: EventStream,
    tree: Tree,
}

impl Watcher {
    /// Creates the registry directory (0755, parents too) when missing and sets up inotify.
    pub fn new(root: PathBuf) -> Result<Self, WatchError> {
        let (stream, tree) = start(root)?;
        Ok(Self { stream, tree })
    }

    /// Watches and lists the tree, reporting sockets already there, then reports changes until
    /// `token` is cancelled. `retry_period` paces attempts to re-create a vanished root.
    /// `rescan` requests a full rescan, the same one an inotify queue overflow triggers.
    pub async fn run(
        self,
        events: mpsc::Sender<WatchEvent>,
        rescan: mpsc::Receiver<()>,
        retry_period: Duration,
        token: CancellationToken,
    ) -> Result<(), WatchError> {
        run(self.stream, self.tree, events, rescan, retry_period, token).await
    }
}

async fn run(
    mut stream: impl Stream<Item = io::Result<inotify::Event<OsString>>> + Unpin,
    mut tree: Tree,
    events: mpsc::Sender<WatchEvent>,
    mut rescan: mpsc::Receiver<()>,
    retry_period: Duration,
    token: CancellationToken,
) -> Result<(), WatchError> {
    let mut root_missing = false;
    let send = |ev: WatchEvent| {
        let events = events.clone();
        async move { events.send(ev).await.is_ok() }
    };
    let (t, found) = off_runtime(tree, |tree| {
        let mut found = Vec::new();
        tree.walk(&tree.root.clone(), &mut found).map(|()| found)
    })
    .await?;
    tree = t;
    let found = found.map_err(|source| WatchError::Watch {
        path: tree.root.clone(),
        source,
    })?;
    for (path, file) in found {
        if !send(WatchEvent::Added { path, file }).await {
            return Ok(());
        }
    }
    tracing::debug!(root = %tree.root.display(), "Plugin Watcher Start");
    let mut retry = tokio::time::interval(retry_period);
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Failed reads of the event stream in a row.
    let mut stream_errors = 0;

    loop {
        let event = tokio::select! {
            _ = token.cancelled() => return Ok(()),
            _ = retry.tick(), if root_missing => {
                let (t, recreated) = off_runtime(tree, recreate_root).await?;
                tree = t;
                match recreated {
                    Ok(sockets) => {
                        root_missing = false;
                        if !send(WatchEvent::Rescanned { sockets }).await { return Ok(()); }
                    }
                    Err(e) => tracing::warn!(root = %tree.root.display(), error = %e, "cannot re-create the registry directory yet"),
                }
                continue;
            }
            Some(()) = rescan.recv() => {
                let (t, sockets) = off_runtime(tree, Tree::rescan).await?;
                tree = t;
                if !send(WatchEvent::Rescanned { sockets }).await {
                    return Ok(());
                }
                continue;
            }
            ev = stream.next() => ev,
        };
        let Some(event) = event else { return Ok(()) };
        let event = match event {
            Ok(e) => {
                stream_errors = 0;
                e
            }
            Err(e) => {
                stream_errors += 1;
                let wait = STREAM_ERROR_BACKOFF.delay(stream_errors);
                tracing::error!(error = %e, retry_in = ?wait, "FsWatcher received error");
                tokio::select! {
                    _ = token.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(wait) => {}
                }
                continue;
            }
        };
        let mask = event.mask;
        if mask.contains(EventMask::Q_OVERFLOW) {
            tracing::warn!("inotify queue overflowed; rescanning the registry directory");
            let (t, sockets) = off_runtime(tree, Tree::rescan).await?;
            tree = t;
            if !send(WatchEvent::Rescanned { sockets }).await {
                return Ok(());
            }
            continue;
        }
        if tree.parent_wd.as_ref() == Some(&event.wd) {
            if tree.is_root_gone(&event.wd, mask, event.name.as_deref()) {
                let root = tree.root.clone();
                let (t, gone) = root_gone(tree, &events, &root).await?;
                tree = t;
                match gone {
                    None => return Ok(()),
                    Some(missing) => root_missing = missing,
                }
            }
            continue;
        }
        let Some(dir) = tree.by_wd.get(&event.wd).cloned() else {
            continue;
        };
        if mask.contains(EventMask::IGNORED) {
            if tree.by_wd.remove(&event.wd).is_some() {
                tree.by_path.remove(&dir);
            }
            continue;
        }
        if mask.intersects(EventMask::DELETE_SELF | EventMask::MOVE_SELF) {
            if dir == tree.root {
                let (t, gone) = root_gone(tree, &events, &dir).await?;
                tree = t;
                match gone {
                    None => return Ok(()),
                    Some(missing) => root_missing = missing,
                }
            }
            continue;
        }
        let Some(name) = event.name else { continue };
        if hidden(&name) {
            continue;
        }
        let path = dir.join(&name);
        let ev = if mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) {
            tracing::trace!(path = %path.display(), "Handling create event");
            match classify(&path) {
                Ok(Kind::Dir) => {
                    let (t, sockets) = off_runtime(tree, move |tree| {
                        let mut sockets = Vec::new();
                        if let Err(e) = tree.walk(&path, &mut sockets) {
                            tracing::warn!(dir = %path.display(), error = %e, "Error when handling create event");
                        }
                        sockets
                    })
                    .await?;
                    tree = t;
                    for (path, file) in sockets {
                        if !send(WatchEvent::Added { path, file }).await {
                            return Ok(());
                        }
                    }
                    continue;
                }
                Ok(Kind::Socket(file)) => WatchEvent::Added { path, file },
                Ok(Kind::Ignored) => {
                    tracing::trace!(path = %path.display(), "Ignoring non socket file");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "Error when handling create event");
                    continue;
                }
            }
        } else if mask.intersects(EventMask::DELETE | EventMask::MOVED_FROM) {
            tracing::trace!(path = %path.display(), "Handling delete event");
            if mask.contains(EventMask::ISDIR) {
                tree.unwatch_under(&path);
                WatchEvent::RemovedUnder { dir: path }
            } else {
                WatchEvent::Removed { path }
            }
        } else {
            continue;
        };
        if !send(ev).await {
            return Ok(());
        }
    }
}

type EventStream = inotify::EventStream<Vec<u8>>;

/// Runs `walk` (directory listings and stats, which can take long on a big tree or a slow
/// file system) on the blocking pool, so the async runtime keeps serving meanwhile.
async fn off_runtime<T: Send + 'static>(
    mut tree: Tree,
    walk: impl FnOnce(&mut Tree) -> T + Send + 'static,
) -> Result<(Tree, T), WatchError> {
    tokio::task::spawn_blocking(move || {
        let out = walk(&mut tree);
        (tree, out)
    })
    .await
    .map_err(|e| WatchError::Inotify(io::Error::other(format!("directory walk failed: {e}"))))
}

fn start(root: PathBuf) -> Result<(EventStream, Tree), WatchError> {
    let inotify = Inotify::init().map_err(WatchError::Inotify)?;
    let watches = inotify.watches();
    let stream = inotify
        .into_event_stream(vec![0u8; 64 * 1024])
        .map_err(WatchError::Inotify)?;
    let mut tree = Tree {
        root,
        parent_wd: None,
        watches,
        by_wd: HashMap::new(),
        by_path: HashMap::new(),
    };
    tree.ensure_root()?;
    Ok((stream, tree))
}

/// The root is gone: report everything under it gone, then create and watch it again. Gives
/// the tree back with `None` when the receiver is gone, else whether the root is still missing.
async fn root_gone(
    mut tree: Tree,
    events: &mpsc::Sender<WatchEvent>,
    root: &Path,
) -> Result<(Tree, Option<bool>), WatchError> {
    tracing::warn!(root = %root.display(), "the registry directory is gone; re-creating it");
    tree.unwatch_under(root);
    let removed = WatchEvent::RemovedUnder {
        dir: root.to_owned(),
    };
    if events.send(removed).await.is_err() {
        return Ok((tree, None));
    }
    let (tree, recreated) = off_runtime(tree, recreate_root).await?;
    let missing = match recreated {
        Ok(sockets) => {
            if events
                .send(WatchEvent::Rescanned { sockets })
                .await
                .is_err()
            {
                return Ok((tree, None));
            }
            false
        }
        Err(e) => {
            tracing::warn!(root = %root.display(), error = %e, "cannot re-create the registry directory yet");
            true
        }
    };
    Ok((tree, Some(missing)))
}

fn recreate_root(tree: &mut Tree) -> Result<Vec<(PathBuf, FileId)>, WatchError> {
    tree.ensure_root()?;
    let mut sockets = Vec::new();
    let root = tree.root.clone();
    tree.walk(&root, &mut sockets)
        .map_err(|source| WatchError::Watch { path: root, source })?;
    Ok(sockets)
}

/// Walks the tree under `root` by the watcher's rules (no `.` names, symlinks to sockets count,
/// symlinked directories are not followed), putting sockets into `found`. `enter` is asked
/// about each sub-directory before it is listed. An unreadable `root` is an error; unreadable
/// directories below it are logged and skipped.
fn walk_tree(
    root: &Path,
    found: &mut Vec<(PathBuf, FileId)>,
    mut enter: impl FnMut(&Path) -> bool,
) -> io::Result<()> {
    let mut stack = vec![root.to_owned()];
    let mut top = true;
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if top => return Err(e),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "Failed to traverse plugin socket path");
                continue;
            }
        };
        top = false;
        for entry in entries.flatten() {
            let path = entry.path();
            if hidden(&entry.file_name()) {
                tracing::trace!(path = %path.display(), "Ignoring file (starts with '.')");
                continue;
            }
            match classify(&path) {
                Ok(Kind::Dir) if enter(&path) => stack.push(path),
                Ok(Kind::Dir) => {}
                Ok(Kind::Socket(file)) => found.push((path, file)),
                Ok(Kind::Ignored) => tracing::trace!(path = %path.display(), "Ignoring file"),
                Err(e) => {
                    tracing::debug!(path = %path.display(), error = %e, "cannot stat; ignoring")
                }
            }
        }
    }
    Ok(())
}

/// Lists the sockets under `root` by the watcher's rules, without inotify. Sorted by path.
pub fn list_sockets(root: &Path) -> io::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    walk_tree(root, &mut found, |_| true)?;
    let mut paths: Vec<PathBuf> = found.into_iter().map(|(p, _)| p).collect();
    paths.sort();
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tokio::time::Instant;

    /// Issue 17, finding 6. The kernel's inotify read cannot be made to fail on purpose, so the
    /// event stream here is a stand-in that fails every read; the tree and its watches are real.
    #[tokio::test(start_paused = true)]
    async fn a_failing_event_stream_is_read_again_only_after_a_back_off() {
        let tmp = tempfile::tempdir().unwrap();
        let (_inotify, tree) = start(tmp.path().join("registry")).unwrap();
        let reads = Arc::new(Mutex::new(Vec::new()));
        let failing = {
            let reads = reads.clone();
            futures::stream::repeat_with(move || {
                reads.lock().unwrap().push(Instant::now());
                Err(io::Error::other("read failed"))
            })
            .take(12)
        };
        let (events, _rx) = mpsc::channel(16);
        let (_rescan, rescans) = mpsc::channel(1);
        let token = CancellationToken::new();
        run(
            failing,
            tree,
            events,
            rescans,
            Duration::from_secs(1),
            token,
        )
        .await
        .unwrap();
        let reads = reads.lock().unwrap();
        let gaps: Vec<Duration> = reads.windows(2).map(|w| w[1] - w[0]).collect();
        let expected: Vec<Duration> = (1..12).map(|n| STREAM_ERROR_BACKOFF.delay(n)).collect();
        assert_eq!(gaps, expected, "waits between failed reads");
        assert_eq!(expected.last(), Some(&Duration::from_secs(5)));
    }
}
