//! The contract between the kubelet-side plugin manager and the handler of a plugin type: the
//! [`PluginHandler`] trait, its error type and the [`HandlerRegistry`] of handlers by type.
//!
//! A crate of its own so that a handler (CSI, device plugins, DRA, ...) depends on this and not on
//! the manager: no inotify, no kube, only `async-trait` and `serde_json`.
//!
//! The plugin manager calls, per socket and strictly one at a time: `validate`, then `register`
//! (only after a successful validate), and `deregister` when the socket goes away or a failed
//! register is rolled back (D2). Handlers get the plugin's name, its endpoint (the registration
//! socket itself when the plugin left it empty) and its advertised versions.
//!
//! A handler also reports on what it holds: the `details` a plugin's `/plugins` entry carries,
//! entries for plugins it took in another way (device plugins through `kubelet.sock`), and its
//! Prometheus text. A daemon gathers these through the [`HandlerRegistry`], so it needs to know
//! no handler by name.

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

    /// What `/plugins` shows of the plugin registered under `name` at `endpoint` beyond the
    /// manager's record: its `details` object, or `None` when the handler adds nothing.
    fn plugin_details(&self, _name: &str, _endpoint: &str) -> Option<serde_json::Value> {
        None
    }

    /// `/plugins` entries, shaped like the manager's records, for the plugins this handler took
    /// in without the registry directory (device plugins registered through `kubelet.sock`).
    fn unlisted_plugins(&self) -> Vec<serde_json::Value> {
        Vec::new()
    }

    /// Appends this handler's Prometheus text (`# HELP`, `# TYPE` and samples) to `out`.
    fn write_metrics(&self, _out: &mut String) {}
}

/// Handlers by plugin type.
#[derive(Clone, Default)]
pub struct HandlerRegistry {
    handlers: HashMap<String, Arc<dyn PluginHandler>>,
    /// Handlers that serve no plugin type here but still report (see [`Self::add_reporter`]).
    reporters: Vec<Arc<dyn PluginHandler>>,
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

    /// Adds a handler that takes no registrations from the registry directory but reports
    /// what it took in another way (`unlisted_plugins`, `write_metrics`): the device-plugin
    /// handler when only the classic `kubelet.sock` registration is served.
    pub fn add_reporter(&mut self, handler: Arc<dyn PluginHandler>) {
        self.reporters.push(handler);
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

    /// Every handler once (one registered for several types too), in the order of its first
    /// type, then the reporters.
    fn distinct(&self) -> Vec<&Arc<dyn PluginHandler>> {
        let mut seen: Vec<&Arc<dyn PluginHandler>> = Vec::new();
        let by_type = self.types().into_iter().map(|t| &self.handlers[t]);
        for h in by_type.chain(self.reporters.iter()) {
            if !seen.iter().any(|s| Arc::ptr_eq(s, h)) {
                seen.push(h);
            }
        }
        seen
    }

    /// The `details` the handler of `plugin_type` gives the plugin `name` at `endpoint`.
    pub fn plugin_details(
        &self,
        plugin_type: &str,
        name: &str,
        endpoint: &str,
    ) -> Option<serde_json::Value> {
        self.get(plugin_type)?.plugin_details(name, endpoint)
    }

    /// Every handler's entries for plugins it took in without the registry directory.
    pub fn unlisted_plugins(&self) -> Vec<serde_json::Value> {
        self.distinct()
            .into_iter()
            .flat_map(|h| h.unlisted_plugins())
            .collect()
    }

    /// Every handler's Prometheus text, each handler once, in the order of the types.
    pub fn render_metrics(&self) -> String {
        let mut out = String::new();
        for h in self.distinct() {
            h.write_metrics(&mut out);
        }
        out
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

    /// Reports a fixed `details`, one unlisted plugin and one metric line.
    struct Reporting(&'static str);

    #[async_trait]
    impl PluginHandler for Reporting {
        async fn validate(&self, _: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
            Ok(())
        }
        async fn register(&self, _: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
            Ok(())
        }
        async fn deregister(&self, _: &str, _: &str) {}
        fn plugin_details(&self, name: &str, endpoint: &str) -> Option<serde_json::Value> {
            Some(serde_json::json!({ "by": self.0, "name": name, "endpoint": endpoint }))
        }
        fn unlisted_plugins(&self) -> Vec<serde_json::Value> {
            vec![serde_json::json!({ "by": self.0 })]
        }
        fn write_metrics(&self, out: &mut String) {
            out.push_str(&format!("reported{{by=\"{}\"}} 1\n", self.0));
        }
    }

    #[test]
    fn the_registry_gathers_each_handlers_report_once_in_type_order() {
        let shared: Arc<dyn PluginHandler> = Arc::new(Reporting("shared"));
        let r = HandlerRegistry::new()
            .with("ZPlugin", shared.clone())
            .with("DRAPlugin", Arc::new(Reporting("dra")))
            .with("APlugin", shared)
            .with("CSIPlugin", Arc::new(Accept));
        assert_eq!(
            r.render_metrics(),
            "reported{by=\"shared\"} 1\nreported{by=\"dra\"} 1\n"
        );
        assert_eq!(
            r.unlisted_plugins(),
            [
                serde_json::json!({ "by": "shared" }),
                serde_json::json!({ "by": "dra" })
            ]
        );
        assert_eq!(
            r.plugin_details("DRAPlugin", "d", "/e"),
            Some(serde_json::json!({ "by": "dra", "name": "d", "endpoint": "/e" }))
        );
        assert_eq!(r.plugin_details("CSIPlugin", "c", "/e"), None);
        assert_eq!(r.plugin_details("NoPlugin", "c", "/e"), None);
    }
}
