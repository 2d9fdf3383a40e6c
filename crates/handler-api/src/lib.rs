//! The contract between the kubelet-side plugin manager and the handler of a plugin type: the
//! [`PluginHandler`] trait, its error type and the [`HandlerRegistry`] of handlers by type.
//!
//! A crate of its own so that a handler (CSI, device plugins, DRA, ...) depends on this and not on
//! the manager: no inotify, no kube, only `async-trait`.
//!
//! The plugin manager calls, per socket and strictly one at a time: `validate`, then `register`
//! (only after a successful validate), and `deregister` when the socket goes away or a failed
//! register is rolled back (D2). Handlers get the plugin's name, its endpoint (the registration
//! socket itself when the plugin left it empty) and its advertised versions.

use std::collections::HashMap;
use std::sync::Arc;

pub use async_trait::async_trait;

mod record;

pub use record::RecordHandler;

/// A handler's reason for refusing a plugin; its `Display` text is sent to the plugin inside
/// `RegistrationStatus.error`.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// The handler for one plugin type (CSIPlugin, DevicePlugin, DRAPlugin, ...).
#[async_trait]
pub trait PluginHandler: Send + Sync + 'static {
    /// Decides whether the plugin may register. No side effects.
    async fn validate(
        &self,
        name: &str,
        endpoint: &str,
        versions: &[String],
    ) -> Result<(), HandlerError>;

    /// Takes the plugin into use. On error the manager calls [`deregister`](Self::deregister)
    /// with the same name and endpoint and retries later with back-off.
    async fn register(
        &self,
        name: &str,
        endpoint: &str,
        versions: &[String],
    ) -> Result<(), HandlerError>;

    /// Forgets the plugin registered under `name` at `endpoint`. Makes no call to the plugin.
    async fn deregister(&self, name: &str, endpoint: &str);
}

/// Handlers by plugin type.
#[derive(Clone, Default)]
pub struct HandlerRegistry {
    handlers: HashMap<String, Arc<dyn PluginHandler>>,
}

impl HandlerRegistry {
    /// No handlers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the handler for `plugin_type`.
    pub fn insert(&mut self, plugin_type: impl Into<String>, handler: Arc<dyn PluginHandler>) {
        self.handlers.insert(plugin_type.into(), handler);
    }

    /// Builder form of [`insert`](Self::insert).
    #[must_use]
    pub fn with(mut self, plugin_type: impl Into<String>, handler: Arc<dyn PluginHandler>) -> Self {
        self.insert(plugin_type, handler);
        self
    }

    /// The handler for `plugin_type`.
    pub fn get(&self, plugin_type: &str) -> Option<&Arc<dyn PluginHandler>> {
        self.handlers.get(plugin_type)
    }

    /// The plugin types with a handler, sorted.
    pub fn types(&self) -> Vec<&str> {
        let mut t: Vec<&str> = self.handlers.keys().map(String::as_str).collect();
        t.sort_unstable();
        t
    }
}

impl std::fmt::Debug for HandlerRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerRegistry")
            .field("types", &self.types())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Accept;

    #[async_trait]
    impl PluginHandler for Accept {
        async fn validate(&self, _: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
            Ok(())
        }
        async fn register(&self, _: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
            Ok(())
        }
        async fn deregister(&self, _: &str, _: &str) {}
    }

    #[test]
    fn registry_finds_handlers_by_type_and_lists_types_sorted() {
        let first: Arc<dyn PluginHandler> = Arc::new(Accept);
        let second: Arc<dyn PluginHandler> = Arc::new(Accept);
        let mut r = HandlerRegistry::new()
            .with("DevicePlugin", first.clone())
            .with("CSIPlugin", first.clone());
        r.insert("DevicePlugin", second.clone());
        assert_eq!(r.types(), ["CSIPlugin", "DevicePlugin"]);
        assert!(Arc::ptr_eq(r.get("DevicePlugin").unwrap(), &second));
        assert!(Arc::ptr_eq(r.get("CSIPlugin").unwrap(), &first));
        assert!(r.get("DRAPlugin").is_none());
        assert_eq!(
            format!("{r:?}"),
            r#"HandlerRegistry { types: ["CSIPlugin", "DevicePlugin"] }"#
        );
    }
}
