//! The two kinds of plugin the benchmark runs. plugreg's registrar binds under a hidden name and
//! renames a listening socket into place, so the manager never finds the socket refusing. A
//! Go-style plugin (the kubelet's Go example plugin, any plugin built on Go's or C's
//! `bind()` + `listen()`) binds at the path first: inotify reports the socket while
//! `connect()` is still refused, until it listens.

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use plugreg_registrar::Registrar;
use plugreg_testpeers::goplugin;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

/// How a benchmark plugin creates its socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// plugreg's registrar: a listening socket renamed into place.
    Registrar,
    /// Bound at the path, listening `gap` later (Go's `net.Listen` has no gap to speak of:
    /// `bind()` and `listen()` are consecutive system calls).
    BindThenListen {
        /// Between `bind()` and `listen()`.
        gap: Duration,
    },
}

impl Style {
    /// How the report names it.
    pub fn label(&self) -> String {
        match self {
            Style::Registrar => "registrar".to_owned(),
            Style::BindThenListen { gap } if gap.is_zero() => "bind-then-listen, gap 0".to_owned(),
            Style::BindThenListen { gap } => {
                format!("bind-then-listen, gap {}", humantime::format_duration(*gap))
            }
        }
    }

    /// Whether the socket is bound before it listens.
    pub fn is_go(&self) -> bool {
        matches!(self, Style::BindThenListen { .. })
    }
}

/// Binds at `path`, blocks the thread for `gap` (as the plugin's own thread would be busy
/// between its two system calls), then listens. Must be called inside a tokio runtime.
pub fn bind_then_listen(path: &Path, gap: Duration) -> anyhow::Result<UnixListener> {
    let bound = goplugin::bind_only(path).with_context(|| format!("binding {}", path.display()))?;
    if !gap.is_zero() {
        std::thread::sleep(gap);
    }
    bound
        .listen()
        .with_context(|| format!("listening on {}", path.display()))
}

/// Serves `registrar`'s Registration service on `listener` until `shutdown` completes. The
/// socket file stays where it is (a Go plugin does not remove it either); callers remove it.
pub async fn serve_listener(
    registrar: &Registrar,
    listener: UnixListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    plugreg_transport::server()
        .add_service(registrar.service())
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
        .await
        .context("serving the Registration service")
}

/// Parses a plugin style as given on the command line: `registrar`, or `go` / `go:GAP` (e.g.
/// `go:1ms`; `go` alone has no gap).
pub fn parse_style(s: &str) -> Result<Style, String> {
    match s.split_once(':') {
        None if s == "registrar" => Ok(Style::Registrar),
        None if s == "go" => Ok(Style::BindThenListen {
            gap: Duration::ZERO,
        }),
        Some(("go", gap)) => humantime::parse_duration(gap)
            .map(|gap| Style::BindThenListen { gap })
            .map_err(|e| format!("{gap:?}: {e}")),
        _ => Err(format!(
            "{s:?}: expected `registrar`, `go` or `go:GAP` (e.g. go:1ms)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_name_the_gap() {
        assert_eq!(Style::Registrar.label(), "registrar");
        let go = |ms| Style::BindThenListen {
            gap: Duration::from_millis(ms),
        };
        assert_eq!(go(0).label(), "bind-then-listen, gap 0");
        assert_eq!(go(1).label(), "bind-then-listen, gap 1ms");
    }

    #[test]
    fn parses_styles() {
        assert_eq!(parse_style("registrar"), Ok(Style::Registrar));
        assert_eq!(
            parse_style("go"),
            Ok(Style::BindThenListen {
                gap: Duration::ZERO
            })
        );
        assert_eq!(
            parse_style("go:1ms"),
            Ok(Style::BindThenListen {
                gap: Duration::from_millis(1)
            })
        );
        assert!(parse_style("go:x").is_err());
        assert!(parse_style("rust").is_err());
    }

    #[tokio::test]
    async fn a_go_style_plugin_answers_get_info_once_it_listens() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("go.sock");
        let registrar = Registrar::new(crate::handler::plugin_info(1));
        let listener = bind_then_listen(&path, Duration::from_millis(1)).unwrap();
        let token = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn({
            let registrar = registrar.clone();
            let token = token.clone();
            async move { serve_listener(&registrar, listener, token.cancelled_owned()).await }
        });
        let channel = plugreg_transport::connect_path(&path, Duration::from_secs(5))
            .await
            .unwrap();
        let mut client =
            plugreg_proto::pluginregistration::registration_client::RegistrationClient::new(
                channel,
            );
        let info = client
            .get_info(plugreg_proto::pluginregistration::InfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.name, "example.com/bench-1");
        token.cancel();
        server.await.unwrap().unwrap();
        assert!(path.exists(), "a Go-style plugin leaves its socket behind");
    }
}
