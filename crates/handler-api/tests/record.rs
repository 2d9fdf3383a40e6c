//! The accept-and-record handler.

use plugreg_handler_api::{PluginHandler, RecordHandler};

#[tokio::test]
async fn record_handler_forgets_only_the_current_endpoint() {
    let h = RecordHandler::new();
    h.register("d", "/old", &[]).await.unwrap();
    h.register("d", "/new", &[]).await.unwrap();
    h.deregister("d", "/old").await;
    assert_eq!(h.registered().get("d").map(String::as_str), Some("/new"));
    h.deregister("d", "/new").await;
    assert!(h.registered().is_empty());
}
