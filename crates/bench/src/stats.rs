//! Percentiles and the other figures of a set of durations.

use std::time::Duration;

/// Figures of a set of measured durations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// How many were measured.
    pub count: usize,
    /// Nearest-rank median.
    pub p50: Duration,
    /// Nearest-rank 99th percentile.
    pub p99: Duration,
    /// Largest.
    pub max: Duration,
    /// Arithmetic mean.
    pub mean: Duration,
}

impl Summary {
    /// The figures of `samples`; `None` when there are none.
    pub fn of(samples: &[Duration]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        let mut sorted = samples.to_vec();
        sorted.sort_unstable();
        let total: Duration = sorted.iter().sum();
        Some(Self {
            count: sorted.len(),
            p50: percentile(&sorted, 50),
            p99: percentile(&sorted, 99),
            max: sorted[sorted.len() - 1],
            mean: total / sorted.len() as u32,
        })
    }
}

/// Nearest-rank percentile `p` (0-100) of non-empty, sorted `sorted`.
fn percentile(sorted: &[Duration], p: usize) -> Duration {
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted[rank.min(sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_millis(m)).collect()
    }

    #[test]
    fn nearest_rank_percentiles_of_a_hundred() {
        let v: Vec<u64> = (1..=100).rev().collect();
        let s = Summary::of(&ms(&v)).unwrap();
        assert_eq!(s.count, 100);
        assert_eq!(s.p50, Duration::from_millis(50));
        assert_eq!(s.p99, Duration::from_millis(99));
        assert_eq!(s.max, Duration::from_millis(100));
        assert_eq!(s.mean, Duration::from_micros(50_500));
    }

    #[test]
    fn one_sample_is_every_percentile() {
        let s = Summary::of(&ms(&[7])).unwrap();
        assert_eq!((s.p50, s.p99, s.max), (s.mean, s.mean, s.mean));
        assert!(Summary::of(&[]).is_none());
    }

    #[test]
    fn p99_of_two_hundred_is_the_198th() {
        let v: Vec<u64> = (1..=200).collect();
        assert_eq!(
            Summary::of(&ms(&v)).unwrap().p99,
            Duration::from_millis(198)
        );
    }
}
