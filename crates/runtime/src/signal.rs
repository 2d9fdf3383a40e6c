//! The signals plugreg's programs react to, as one stream: SIGTERM and SIGINT stop a program
//! (plugreg handles SIGINT like SIGTERM, R2), SIGHUP asks a daemon to rescan.

use std::io;

use tokio::signal::unix::{Signal as UnixSignal, SignalKind, signal};

/// A signal that arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// SIGTERM: stop.
    Terminate,
    /// SIGINT: stop, as SIGTERM.
    Interrupt,
    /// SIGHUP (only when asked for with [`Signals::with_hangup`]).
    Hangup,
}

impl Received {
    /// The signal's name, as logs print it (`SIGTERM`).
    pub fn name(self) -> &'static str {
        match self {
            Received::Terminate => "SIGTERM",
            Received::Interrupt => "SIGINT",
            Received::Hangup => "SIGHUP",
        }
    }

    /// Whether the program should stop.
    pub fn is_shutdown(self) -> bool {
        !matches!(self, Received::Hangup)
    }
}

/// Handlers for SIGTERM and SIGINT (and optionally SIGHUP), installed once, received in order.
#[derive(Debug)]
pub struct Signals {
    term: UnixSignal,
    int: UnixSignal,
    hup: Option<UnixSignal>,
}

impl Signals {
    /// Installs handlers for SIGTERM and SIGINT.
    pub fn new() -> io::Result<Self> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: None,
        })
    }

    /// Installs handlers for SIGTERM, SIGINT and SIGHUP.
    pub fn with_hangup() -> io::Result<Self> {
        let mut s = Signals::new()?;
        s.hup = Some(signal(SignalKind::hangup())?);
        Ok(s)
    }

    /// The next signal.
    pub async fn recv(&mut self) -> Received {
        let hup = async {
            match self.hup.as_mut() {
                Some(h) => h.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = self.term.recv() => Received::Terminate,
            _ = self.int.recv() => Received::Interrupt,
            _ = hup => Received::Hangup,
        }
    }

    /// The next SIGTERM or SIGINT (SIGHUPs before it are passed over).
    pub async fn shutdown(&mut self) -> Received {
        loop {
            let r = self.recv().await;
            if r.is_shutdown() {
                return r;
            }
        }
    }
}

/// Completes on the first SIGTERM or SIGINT after the call. If the handlers cannot be installed
/// (no signal support), it never completes: the program then stops only by other means.
pub async fn shutdown() -> Received {
    match Signals::new() {
        Ok(mut s) => s.shutdown().await,
        Err(_) => std::future::pending().await,
    }
}
