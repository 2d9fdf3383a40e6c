//! SIGTERM and SIGINT, as one future.

use tokio::signal::unix::{SignalKind, signal};

/// Completes on the first SIGTERM or SIGINT.
pub async fn stopped() {
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
