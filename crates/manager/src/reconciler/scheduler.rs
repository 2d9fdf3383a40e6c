//! Timers of the reconciler on one [`DelayQueue`]: a socket's retry (back-off end, quick
//! re-dial) and its next liveness probe (D5). At most one timer of each kind per socket.

use std::collections::HashMap;
use std::path::PathBuf;

use futures::StreamExt;
use tokio::time::Instant;
use tokio_util::time::DelayQueue;
use tokio_util::time::delay_queue::Key;

/// What a timer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Timer {
    /// Look at the socket again (a back-off or re-dial wait ended).
    Retry,
    /// Probe the registered socket (D5).
    Probe,
}

#[derive(Default)]
pub(crate) struct Scheduler {
    queue: DelayQueue<(PathBuf, Timer)>,
    keys: HashMap<(PathBuf, Timer), (Key, Instant)>,
}

impl Scheduler {
    /// Sets the `timer` of `path` to fire at `at` (replacing an earlier setting).
    pub(crate) fn at(&mut self, path: &std::path::Path, timer: Timer, at: Instant) {
        let id = (path.to_owned(), timer);
        match self.keys.get_mut(&id) {
            Some((_, when)) if *when == at => {}
            Some((key, when)) => {
                self.queue.reset_at(key, at);
                *when = at;
            }
            None => {
                let key = self.queue.insert_at(id.clone(), at);
                self.keys.insert(id, (key, at));
            }
        }
    }

    /// Clears every timer of `path`.
    pub(crate) fn cancel(&mut self, path: &std::path::Path) {
        for timer in [Timer::Retry, Timer::Probe] {
            if let Some((key, _)) = self.keys.remove(&(path.to_owned(), timer)) {
                self.queue.remove(&key);
            }
        }
    }

    /// The next timer that fires; pending forever while none is set.
    pub(crate) async fn next(&mut self) -> (PathBuf, Timer) {
        loop {
            if self.queue.is_empty() {
                return std::future::pending().await;
            }
            if let Some(expired) = self.queue.next().await {
                let id = expired.into_inner();
                self.keys.remove(&id);
                return id;
            }
        }
    }

    /// How many timers are set.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn fires_in_time_order_and_once_per_socket_and_kind() {
        let mut s = Scheduler::default();
        let t0 = Instant::now();
        s.at(
            Path::new("/b"),
            Timer::Retry,
            t0 + Duration::from_millis(20),
        );
        s.at(
            Path::new("/a"),
            Timer::Probe,
            t0 + Duration::from_millis(10),
        );
        s.at(
            Path::new("/a"),
            Timer::Retry,
            t0 + Duration::from_millis(30),
        );
        // Moving a timer replaces it.
        s.at(Path::new("/a"), Timer::Retry, t0 + Duration::from_millis(5));
        assert_eq!(s.len(), 3);
        assert_eq!(s.next().await, (PathBuf::from("/a"), Timer::Retry));
        assert_eq!(t0.elapsed(), Duration::from_millis(5));
        assert_eq!(s.next().await, (PathBuf::from("/a"), Timer::Probe));
        s.cancel(Path::new("/b"));
        assert_eq!(s.len(), 0);
        let idle = tokio::time::timeout(Duration::from_secs(3600), s.next()).await;
        assert!(idle.is_err(), "no timer left, nothing fires");
    }
}
