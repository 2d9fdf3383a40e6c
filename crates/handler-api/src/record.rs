//! The accept-and-record handler: what a plugin type without a handler of its own gets.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::{HandlerError, PluginHandler, async_trait};

/// Accepts every plugin and remembers which endpoint each name is registered at.
#[derive(Debug, Default)]
pub struct RecordHandler {
    plugins: Mutex<BTreeMap<String, String>>,
}

impl RecordHandler {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registered plugins: name -> endpoint.
    pub fn registered(&self) -> BTreeMap<String, String> {
        self.plugins
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

#[async_trait]
impl PluginHandler for RecordHandler {
    async fn validate(&self, _: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn register(&self, name: &str, endpoint: &str, _: &[String]) -> Result<(), HandlerError> {
        self.plugins
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned(), endpoint.to_owned());
        Ok(())
    }

    async fn deregister(&self, name: &str, endpoint: &str) {
        let mut plugins = self.plugins.lock().unwrap_or_else(|e| e.into_inner());
        // Forget the name only when it is registered at this endpoint (D6).
        if plugins.get(name).is_some_and(|e| e == endpoint) {
            plugins.remove(name);
        }
    }
}
