//! A handler that panics, for the test that proves the release binary survives one
//! (`tests/release_panic.rs`). Compiled only with the `panicking-handler` feature, which the
//! images and `scripts/release.sh` never enable.

use plugreg_manager::{HandlerError, PluginHandler, async_trait};

/// The plugin type the panicking handler serves.
pub const PLUGIN_TYPE: &str = "PanickingTestPlugin";

/// Validates every plugin, then panics in `register` (and in `deregister`, should the manager
/// roll back).
#[derive(Debug, Default)]
pub struct PanickingHandler;

#[async_trait]
impl PluginHandler for PanickingHandler {
    async fn validate(&self, _: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn register(&self, name: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
        panic!("the panicking test handler refuses {name} by panicking");
    }

    async fn deregister(&self, name: &str, _: &str) {
        panic!("the panicking test handler panics in deregister of {name}");
    }
}
