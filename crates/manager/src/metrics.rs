//! The manager's counters, and their Prometheus text exposition (D8).
//!
//! Kept by hand rather than through a metrics crate: a handful of atomics and one renderer.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::operation::Step;
use crate::record::{PluginRecord, PluginState};

/// Upper bounds (seconds) of the registration latency histogram.
const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0, 120.0,
];

/// Counters updated by the reconciler.
#[derive(Debug, Default)]
pub struct Metrics {
    registrations: AtomicU64,
    deregistrations: AtomicU64,
    dead: AtomicU64,
    rescans: AtomicU64,
    failures: [AtomicU64; Step::ALL.len()],
    latency_buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    latency_count: AtomicU64,
    latency_sum_nanos: AtomicU64,
}

impl Metrics {
    /// A registration succeeded, `latency` after its socket was seen (unknown when the socket
    /// went away before the outcome was handled: it still counts as a registration).
    pub fn registered(&self, latency: Option<Duration>) {
        self.registrations.fetch_add(1, Ordering::Relaxed);
        let Some(latency) = latency else { return };
        let secs = latency.as_secs_f64();
        for (i, le) in LATENCY_BUCKETS.iter().enumerate() {
            if secs <= *le {
                self.latency_buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.latency_count.fetch_add(1, Ordering::Relaxed);
        self.latency_sum_nanos
            .fetch_add(latency.as_nanos() as u64, Ordering::Relaxed);
    }

    /// A deregistration ran.
    pub fn deregistered(&self) {
        self.deregistrations.fetch_add(1, Ordering::Relaxed);
    }

    /// A registration attempt failed at `step`.
    pub fn failed(&self, step: Step) {
        let i = Step::ALL.iter().position(|s| *s == step).unwrap_or(0);
        self.failures[i].fetch_add(1, Ordering::Relaxed);
    }

    /// The watcher rescanned the tree (inotify overflow, a re-created root, or on request).
    pub fn rescanned(&self) {
        self.rescans.fetch_add(1, Ordering::Relaxed);
    }

    /// A dead plugin was found (D5).
    pub fn dead(&self) {
        self.dead.fetch_add(1, Ordering::Relaxed);
    }

    /// Prometheus text exposition of these counters plus gauges computed from `records`.
    pub fn render(&self, records: &[PluginRecord]) -> String {
        let mut out = String::with_capacity(4096 + records.len() * 160);
        let c = |a: &AtomicU64| a.load(Ordering::Relaxed);

        out.push_str("# HELP plugin_manager_total_plugins Number of plugins in Plugin Manager\n");
        out.push_str("# TYPE plugin_manager_total_plugins gauge\n");
        for r in records {
            let path = plugreg_runtime::prom::escape_label(&r.socket.to_string_lossy());
            if r.desired {
                let _ = writeln!(
                    out,
                    "plugin_manager_total_plugins{{socket_path=\"{path}\",state=\"desired_state_of_world\"}} 1"
                );
            }
            if r.state == PluginState::Registered {
                let _ = writeln!(
                    out,
                    "plugin_manager_total_plugins{{socket_path=\"{path}\",state=\"actual_state_of_world\"}} 1"
                );
            }
        }

        out.push_str("# HELP plugreg_plugins Known plugin sockets by plugin type and state.\n");
        out.push_str("# TYPE plugreg_plugins gauge\n");
        let mut by: BTreeMap<(&str, &str), u64> = BTreeMap::new();
        for r in records {
            *by.entry((r.plugin_type.as_str(), r.state.as_str()))
                .or_default() += 1;
        }
        for ((t, s), n) in by {
            let _ = writeln!(
                out,
                "plugreg_plugins{{type=\"{}\",state=\"{s}\"}} {n}",
                plugreg_runtime::prom::escape_label(t)
            );
        }

        out.push_str("# HELP plugreg_registrations_total Successful registrations.\n");
        out.push_str("# TYPE plugreg_registrations_total counter\n");
        let _ = writeln!(
            out,
            "plugreg_registrations_total {}",
            c(&self.registrations)
        );
        out.push_str("# HELP plugreg_deregistrations_total Deregistrations.\n");
        out.push_str("# TYPE plugreg_deregistrations_total counter\n");
        let _ = writeln!(
            out,
            "plugreg_deregistrations_total {}",
            c(&self.deregistrations)
        );
        out.push_str("# HELP plugreg_dead_plugins_total Registered plugins found dead (socket refusing connections).\n");
        out.push_str("# TYPE plugreg_dead_plugins_total counter\n");
        let _ = writeln!(out, "plugreg_dead_plugins_total {}", c(&self.dead));

        out.push_str("# HELP plugreg_watcher_rescans_total Full rescans of the registry directory (inotify overflow, re-created directory, SIGHUP).\n");
        out.push_str("# TYPE plugreg_watcher_rescans_total counter\n");
        let _ = writeln!(out, "plugreg_watcher_rescans_total {}", c(&self.rescans));

        out.push_str(
            "# HELP plugreg_registration_failures_total Failed registration attempts by step.\n",
        );
        out.push_str("# TYPE plugreg_registration_failures_total counter\n");
        for (i, step) in Step::ALL.iter().enumerate() {
            let _ = writeln!(
                out,
                "plugreg_registration_failures_total{{step=\"{}\"}} {}",
                step.as_str(),
                c(&self.failures[i])
            );
        }

        out.push_str("# HELP plugreg_registration_latency_seconds Time from a socket being seen to its plugin being registered and notified.\n");
        out.push_str("# TYPE plugreg_registration_latency_seconds histogram\n");
        for (i, le) in LATENCY_BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "plugreg_registration_latency_seconds_bucket{{le=\"{le}\"}} {}",
                c(&self.latency_buckets[i])
            );
        }
        let count = c(&self.latency_count);
        let _ = writeln!(
            out,
            "plugreg_registration_latency_seconds_bucket{{le=\"+Inf\"}} {count}"
        );
        let _ = writeln!(
            out,
            "plugreg_registration_latency_seconds_sum {}",
            c(&self.latency_sum_nanos) as f64 / 1e9
        );
        let _ = writeln!(out, "plugreg_registration_latency_seconds_count {count}");
        out
    }
}
