//! D4 with a real inotify queue overflow. The kernel reads the queue limit when an inotify
//! instance is created, so the test lowers /proc/sys/fs/inotify/max_queued_events (root only)
//! just around the manager's start, then floods the directory with renames while plugins create
//! their sockets: their events are lost in the overflow, and the rescan must find them. This
//! file is its own test binary so no other test starts an inotify instance in that window.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;

const LIMIT: &str = "/proc/sys/fs/inotify/max_queued_events";

/// Restores the queue limit when dropped.
struct Limit(String);

impl Limit {
    fn lower_to(n: u32) -> Self {
        let old =
            std::fs::read_to_string(LIMIT).unwrap_or_else(|e| panic!("cannot read {LIMIT}: {e}"));
        std::fs::write(LIMIT, n.to_string()).unwrap_or_else(|e| {
            panic!("this test lowers {LIMIT} for a moment and needs root: {e}")
        });
        Self(old.trim().to_owned())
    }
}

impl Drop for Limit {
    fn drop(&mut self) {
        let _ = std::fs::write(LIMIT, &self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inotify_queue_overflow_is_followed_by_a_rescan_that_finds_every_socket() {
    let limit = Limit::lower_to(8);
    let h = Harness::start().await;
    drop(limit);

    // Flood the directory with events the watcher ignores (a regular file renamed back and
    // forth) so that the queue overflows while the plugins appear.
    let stop = Arc::new(AtomicBool::new(false));
    let storm = {
        let (stop, a, b) = (stop.clone(), h.root.join("noise-a"), h.root.join("noise-b"));
        std::fs::write(&a, b"").unwrap();
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                std::fs::rename(&a, &b).unwrap();
                std::fs::rename(&b, &a).unwrap();
                n += 1;
            }
            n
        })
    };
    let mut plugins = Vec::new();
    for i in 0..40 {
        plugins.push(
            Plugin::device(
                &h.root.join(format!("o{i}.sock")),
                &format!("example.com/o{i}"),
            )
            .await,
        );
    }
    stop.store(true, Ordering::Relaxed);
    let renames = storm.join().unwrap();
    assert!(renames > 0);

    for p in &plugins {
        p.wait_registered().await;
    }
    h.wait_registered_count(plugins.len()).await;
    let metrics = h.manager.render_metrics();
    let rescans: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("plugreg_watcher_rescans_total "))
        .and_then(|v| v.parse().ok())
        .expect("rescan counter");
    assert!(
        rescans >= 1,
        "the queue must have overflowed at least once:\n{metrics}"
    );
}
