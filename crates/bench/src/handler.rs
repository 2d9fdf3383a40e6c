//! The handler the benchmark's managers use: accepts every plugin and, when asked, reports when
//! it was called.

use std::time::Instant;

use plugreg_manager::{HandlerError, PluginHandler, async_trait};
use tokio::sync::mpsc;

/// The plugin type the benchmark's plugins advertise and its handler accepts. Not a type with a
/// real handler (`DevicePlugin` is dialled for its options since issue 10): the daemon accepts and
/// records a type it has no handler for, so the figures measure registration alone.
pub const PLUGIN_TYPE: &str = "BenchPlugin";

/// Which handler method was called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// `register`.
    Register,
    /// `deregister`.
    Deregister,
}

/// One handler call and when it happened.
#[derive(Debug, Clone)]
pub struct Call {
    /// What was called.
    pub kind: CallKind,
    /// The plugin's name.
    pub name: String,
    /// When the call began.
    pub at: Instant,
}

/// Accepts every plugin; sends each register and deregister call to `calls` when set.
#[derive(Debug, Default)]
pub struct AcceptAll {
    calls: Option<mpsc::UnboundedSender<Call>>,
}

impl AcceptAll {
    /// A handler that reports its calls on the returned channel.
    pub fn reporting() -> (Self, mpsc::UnboundedReceiver<Call>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { calls: Some(tx) }, rx)
    }

    fn report(&self, kind: CallKind, name: &str) {
        let at = Instant::now();
        if let Some(tx) = &self.calls {
            let _ = tx.send(Call {
                kind,
                name: name.to_owned(),
                at,
            });
        }
    }
}

#[async_trait]
impl PluginHandler for AcceptAll {
    async fn validate(&self, _: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn register(&self, name: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
        self.report(CallKind::Register, name);
        Ok(())
    }

    async fn deregister(&self, name: &str, _: &str) {
        self.report(CallKind::Deregister, name);
    }
}

/// What the benchmark's `n`-th plugin answers to GetInfo.
pub fn plugin_info(n: usize) -> plugreg_registrar::PluginInfo {
    plugreg_registrar::PluginInfo {
        r#type: PLUGIN_TYPE.to_owned(),
        name: format!("example.com/bench-{n}"),
        endpoint: String::new(),
        supported_versions: vec!["v1beta1".to_owned()],
    }
}

/// The registration socket file name of the `n`-th plugin.
pub fn socket_name(n: usize) -> String {
    format!("bench-{n}-reg.sock")
}
