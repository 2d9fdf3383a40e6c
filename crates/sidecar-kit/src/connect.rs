//! Reaching the CSI driver at start-up, as csi-lib-utils does: dial again and again until the
//! driver answers, the window closes, or the sidecar is stopped; log "Still connecting" every
//! [`REPORT_EVERY`] meanwhile, so that a driver that never comes up shows in the logs.
//!
//! The dial itself is the caller's (`plugreg_transport`'s dialers, or one with a loss signal):
//! [`ConnectWindow::connect`] calls it with the time one attempt may take.

use std::future::Future;
use std::time::Duration;

use plugreg_runtime::backoff::Backoff;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How often "Still connecting" is logged.
pub const REPORT_EVERY: Duration = Duration::from_secs(10);

/// When the next attempt starts after a failed one.
#[derive(Debug, Clone, Copy)]
pub enum Retry {
    /// A fixed period after the failed attempt started (one attempt about every period).
    Every(Duration),
    /// After the failure, by a back-off over the failures so far.
    Backoff(Backoff),
}

/// How long and how often to try.
#[derive(Debug, Clone, Copy)]
pub struct ConnectWindow {
    /// The end of the window; `None` tries until stopped (upstream's blocking dial).
    pub end: Option<Instant>,
    /// The longest one attempt may take (the window's rest, if shorter).
    pub attempt: Duration,
    /// The pause between attempts.
    pub retry: Retry,
}

/// How connecting ended.
#[derive(Debug)]
pub enum Outcome<T, E> {
    /// Connected.
    Connected(T),
    /// The window closed; the last attempt's error.
    Closed(E),
    /// The token was cancelled.
    Stopped,
}

impl ConnectWindow {
    /// Dials with `dial(attempt_timeout)` until it succeeds, the window closes or `token` is
    /// cancelled. `shown` is the address as logged (`unix:///csi/csi.sock`) in the info line
    /// "Still connecting" every [`REPORT_EVERY`]. Each failure is the dial's to log (as a line
    /// of the sidecar's own, so that its `-v` applies).
    pub async fn connect<T, E, F, Fut>(
        &self,
        shown: &str,
        token: &CancellationToken,
        dial: F,
    ) -> Outcome<T, E>
    where
        F: FnMut(Duration) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.connect_reporting(token, dial, || {
            tracing::info!(address = %shown, "Still connecting");
        })
        .await
    }

    /// [`Self::connect`] with the caller's own "still connecting" line, `report`, called every
    /// [`REPORT_EVERY`] while the driver does not answer (the controller sidecars word it as
    /// csi-lib-utils' Info line with an `address` field: [`crate::driver::connect`]).
    pub async fn connect_reporting<T, E, F, Fut>(
        &self,
        token: &CancellationToken,
        mut dial: F,
        mut report: impl FnMut(),
    ) -> Outcome<T, E>
    where
        F: FnMut(Duration) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let mut next_report = Instant::now() + REPORT_EVERY;
        let mut failures = 0;
        loop {
            let started = Instant::now();
            let timeout = match self.end {
                Some(end) => end.saturating_duration_since(started).min(self.attempt),
                None => self.attempt,
            };
            let result = tokio::select! {
                _ = token.cancelled() => return Outcome::Stopped,
                r = dial(timeout) => r,
            };
            let err = match result {
                Ok(c) => return Outcome::Connected(c),
                Err(e) => e,
            };
            let now = Instant::now();
            if self.end.is_some_and(|end| now >= end) {
                return Outcome::Closed(err);
            }
            if now >= next_report {
                report();
                next_report += REPORT_EVERY;
            }
            failures += 1;
            let retry_at = match self.retry {
                Retry::Every(period) => started + period,
                Retry::Backoff(backoff) => now + backoff.delay(failures),
            };
            let retry_at = self.end.map_or(retry_at, |end| retry_at.min(end));
            tokio::select! {
                _ = token.cancelled() => return Outcome::Stopped,
                _ = tokio::time::sleep_until(retry_at) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("refused")]
    struct Refused;

    #[tokio::test(start_paused = true)]
    async fn tries_until_the_dial_succeeds() {
        let window = ConnectWindow {
            end: None,
            attempt: Duration::from_secs(1),
            retry: Retry::Every(Duration::from_secs(1)),
        };
        let mut calls = 0;
        let start = Instant::now();
        let outcome = window
            .connect("unix:///x", &CancellationToken::new(), |timeout| {
                calls += 1;
                assert_eq!(timeout, Duration::from_secs(1));
                let ok = calls == 25;
                async move { if ok { Ok(calls) } else { Err(Refused) } }
            })
            .await;
        assert!(matches!(outcome, Outcome::Connected(25)));
        assert_eq!(start.elapsed(), Duration::from_secs(24));
    }

    #[tokio::test(start_paused = true)]
    async fn the_window_bounds_attempts_and_waits() {
        let start = Instant::now();
        let window = ConnectWindow {
            end: Some(start + Duration::from_secs(3)),
            attempt: Duration::from_secs(10),
            retry: Retry::Backoff(Backoff::new(
                Duration::from_millis(500),
                Duration::from_secs(1),
            )),
        };
        let mut timeouts = Vec::new();
        let outcome: Outcome<(), Refused> = window
            .connect("unix:///x", &CancellationToken::new(), |timeout| {
                timeouts.push(timeout);
                async { Err(Refused) }
            })
            .await;
        assert!(matches!(outcome, Outcome::Closed(Refused)));
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        assert_eq!(timeouts[0], Duration::from_secs(3));
        assert!(timeouts.windows(2).all(|w| w[1] < w[0]), "{timeouts:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_token_stops_the_wait() {
        let token = CancellationToken::new();
        let window = ConnectWindow {
            end: None,
            attempt: Duration::from_secs(1),
            retry: Retry::Every(Duration::from_secs(60)),
        };
        let stop = token.clone();
        let outcome: Outcome<(), Refused> = window
            .connect("unix:///x", &token, |_| {
                stop.cancel();
                async { Err(Refused) }
            })
            .await;
        assert!(matches!(outcome, Outcome::Stopped));
    }
}
