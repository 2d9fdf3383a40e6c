//! The one back-off policy: a first wait, multiplied by a factor after each failure, capped, with
//! optional jitter.
//!
//! The policy is a value; callers keep their own attempt counters (the plugin manager keys them by
//! socket instance, D3), so the same policy serves a reconciler, a retry loop and a sleep.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// How long to wait after the n-th failure in a row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// The wait after the first failure.
    pub initial: Duration,
    /// No wait is longer than this (jitter included).
    pub max: Duration,
    /// Each further failure multiplies the wait by this.
    pub factor: u32,
    /// Up to this fraction of a wait is added at random (0.0: exact waits). Spreads the retries of
    /// many clients that failed together.
    pub jitter: f64,
}

impl Backoff {
    /// Doubling from `initial` up to `max`, without jitter.
    pub const fn new(initial: Duration, max: Duration) -> Self {
        Backoff {
            initial,
            max,
            factor: 2,
            jitter: 0.0,
        }
    }

    /// Upstream's plugin-manager back-off: 500 ms doubling to 2 min 2 s, exact.
    pub const KUBELET_OPERATIONS: Backoff =
        Backoff::new(Duration::from_millis(500), Duration::from_secs(122));

    /// The same policy with another factor.
    pub const fn with_factor(self, factor: u32) -> Self {
        Backoff { factor, ..self }
    }

    /// The same policy with jitter (a fraction in `0.0..=1.0`; other values are clamped).
    pub fn with_jitter(self, jitter: f64) -> Self {
        let jitter = if jitter.is_nan() {
            0.0
        } else {
            jitter.clamp(0.0, 1.0)
        };
        Backoff { jitter, ..self }
    }

    /// The wait after `failures` failures in a row (1 = the first), without jitter.
    /// `0` failures means no wait.
    pub fn base_delay(&self, failures: u32) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let mut d = self.initial.min(self.max);
        for _ in 1..failures {
            if d >= self.max {
                break;
            }
            d = d.saturating_mul(self.factor).min(self.max);
        }
        d
    }

    /// The wait after `failures` failures in a row, jitter included, never above `max`.
    pub fn delay(&self, failures: u32) -> Duration {
        let base = self.base_delay(failures);
        if self.jitter == 0.0 || base.is_zero() {
            return base;
        }
        let extra = base.mul_f64(self.jitter * unit_random());
        base.saturating_add(extra).min(self.max)
    }

    /// Sleeps for [`delay`](Self::delay)`(failures)` on tokio's clock.
    pub async fn sleep(&self, failures: u32) {
        tokio::time::sleep(self.delay(failures)).await;
    }
}

/// 64 random bits from the standard library's randomly keyed hasher (keys from the OS, a new
/// key per call): no RNG crate for jitter and identifiers that only need to differ.
pub fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x9e37_79b9_7f4a_7c15);
    h.finish()
}

/// A number in `[0, 1)` from [`random_u64`].
pub fn unit_random() -> f64 {
    (random_u64() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubelet_policy_doubles_from_500ms_to_the_122s_cap() {
        let b = Backoff::KUBELET_OPERATIONS;
        let secs: Vec<f64> = (1..=11).map(|n| b.delay(n).as_secs_f64()).collect();
        assert_eq!(
            secs,
            [
                0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 122.0, 122.0, 122.0
            ]
        );
        assert_eq!(b.delay(0), Duration::ZERO);
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(122));
    }

    #[test]
    fn factor_five_as_the_api_retries_use() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(10)).with_factor(5);
        let ms: Vec<u128> = (1..=5).map(|n| b.delay(n).as_millis()).collect();
        assert_eq!(ms, [100, 500, 2500, 10_000, 10_000]);
    }

    #[test]
    fn jitter_stays_between_the_base_and_the_cap() {
        let b =
            Backoff::new(Duration::from_millis(100), Duration::from_millis(350)).with_jitter(0.5);
        let mut seen_extra = false;
        for n in 1..=4 {
            for _ in 0..200 {
                let d = b.delay(n);
                assert!(d >= b.base_delay(n), "{d:?} below base");
                assert!(
                    d <= b.base_delay(n).mul_f64(1.5).min(b.max),
                    "{d:?} above bound"
                );
                seen_extra |= d > b.base_delay(n);
            }
        }
        assert!(seen_extra, "jitter never added anything");
    }

    #[test]
    fn out_of_range_jitter_is_clamped() {
        let b = Backoff::new(Duration::from_secs(1), Duration::from_secs(8));
        assert_eq!(b.with_jitter(-3.0).jitter, 0.0);
        assert_eq!(b.with_jitter(f64::NAN).jitter, 0.0);
        assert_eq!(b.with_jitter(7.0).jitter, 1.0);
    }

    #[tokio::test(start_paused = true)]
    async fn sleep_uses_tokio_time() {
        let b = Backoff::new(Duration::from_secs(30), Duration::from_secs(60));
        let t0 = tokio::time::Instant::now();
        b.sleep(2).await;
        assert_eq!(t0.elapsed(), Duration::from_secs(60));
    }
}
