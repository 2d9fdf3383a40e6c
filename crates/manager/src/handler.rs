//! What a plugin type's handler does with a plugin, and the registry of handlers by type.
//!
//! The plugin manager calls, per socket and strictly one at a time: `validate`, then `register`
//! (only after a successful validate), and `deregister` when the socket goes away or a failed
//! register is rolled back (D2). Handlers get the plugin's name, its endpoint (the registration
//! socket itself when the plugin left it empty) and its advertised versions.

use std::collections::HashMap;
use std::sync::Arc;

pub use async_trait::async_trait;

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
