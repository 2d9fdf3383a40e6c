//! Exponential back-off for one socket instance: 500 ms doubling to 2 min 2 s by default.
//!
//! D3: the record belongs to a socket *instance*; a socket re-created at the same path is a new
//! instance and starts with no back-off.

use std::time::Duration;

use tokio::time::Instant;

/// Back-off state after consecutive failures of one socket instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    /// The socket instance this belongs to.
    pub instance: u64,
    /// Failures in a row.
    pub failures: u32,
    /// The current wait.
    pub delay: Duration,
    /// No retry before this.
    pub retry_at: Instant,
}

impl Backoff {
    /// The record after one more failure at `now`, continuing `previous` when it belongs to the
    /// same instance.
    pub fn after_failure(
        previous: Option<&Backoff>,
        instance: u64,
        now: Instant,
        initial: Duration,
        max: Duration,
    ) -> Backoff {
        let (failures, delay) = match previous {
            Some(p) if p.instance == instance => (p.failures + 1, (p.delay * 2).min(max)),
            _ => (1, initial.min(max)),
        };
        Backoff {
            instance,
            failures,
            delay,
            retry_at: now + delay,
        }
    }

    /// Whether a retry of `instance` must still wait at `now`.
    pub fn blocks(&self, instance: u64, now: Instant) -> bool {
        self.instance == instance && now < self.retry_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_500ms_to_the_122s_cap() {
        let now = Instant::now();
        let (i, m) = (Duration::from_millis(500), Duration::from_secs(122));
        let mut b = Backoff::after_failure(None, 1, now, i, m);
        let mut seen = vec![b.delay];
        for _ in 0..10 {
            b = Backoff::after_failure(Some(&b), 1, now, i, m);
            seen.push(b.delay);
        }
        let secs: Vec<f64> = seen.iter().map(Duration::as_secs_f64).collect();
        assert_eq!(
            secs,
            [
                0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 122.0, 122.0, 122.0
            ]
        );
        assert_eq!(b.failures, 11);
    }

    #[test]
    fn a_new_instance_starts_afresh() {
        let now = Instant::now();
        let (i, m) = (Duration::from_millis(500), Duration::from_secs(122));
        let mut b = Backoff::after_failure(None, 1, now, i, m);
        for _ in 0..8 {
            b = Backoff::after_failure(Some(&b), 1, now, i, m);
        }
        assert!(b.blocks(1, now + Duration::from_secs(100)));
        assert!(!b.blocks(2, now), "another instance is not held back");
        let fresh = Backoff::after_failure(Some(&b), 2, now, i, m);
        assert_eq!((fresh.failures, fresh.delay), (1, i));
    }
}
