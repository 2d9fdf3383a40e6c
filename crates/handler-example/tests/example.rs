//! The example handler inside a real manager, against the real example plugin.

use std::sync::Arc;
use std::time::Duration;

use plugreg_example_plugin::{ExampleConfig, ExamplePlugin};
use plugreg_handler_example::{EXAMPLE_PLUGIN, ExampleHandler};
use plugreg_manager::{HandlerRegistry, ManagerConfig, PluginHandler, PluginManager};
use tokio_util::sync::CancellationToken;

const SOON: Duration = Duration::from_secs(10);

fn plugin(dir: &std::path::Path, file: &str, name: &str, versions: &[&str]) -> ExamplePlugin {
    ExamplePlugin::new(ExampleConfig {
        socket: dir.join(file),
        plugin_type: EXAMPLE_PLUGIN.into(),
        name: name.into(),
        endpoint: None,
        versions: versions.iter().map(|v| v.to_string()).collect(),
    })
}

#[tokio::test]
async fn example_handler_accepts_its_versions_calls_each_service_and_rejects_others() {
    let dir = tempfile::tempdir().unwrap();
    let token = CancellationToken::new();
    let handlers = HandlerRegistry::new().with(
        EXAMPLE_PLUGIN,
        Arc::new(ExampleHandler::new(vec![
            "v1beta1".into(),
            "v1beta2".into(),
        ])),
    );
    let _m = PluginManager::start(ManagerConfig::new(dir.path()), handlers, token.clone())
        .await
        .unwrap();

    let good = plugin(dir.path(), "good.sock", "good", &["v1beta1", "v1beta2"]);
    let bad = plugin(dir.path(), "bad.sock", "bad", &["v1beta1"]);
    for p in [&good, &bad] {
        let (p, t) = (p.clone(), token.clone());
        tokio::spawn(async move { p.serve(t).await.unwrap() });
    }
    let mut s = good.registrar().status();
    tokio::time::timeout(SOON, s.wait_for(|s| s.is_registered()))
        .await
        .unwrap()
        .unwrap();
    let mut s = bad.registrar().status();
    let st = tokio::time::timeout(SOON, s.wait_for(|s| s.rejected_total > 0))
        .await
        .unwrap()
        .unwrap()
        .clone();
    assert_eq!(
        st.last.unwrap().error,
        "RegisterPlugin error -- plugin validation failed with err: plugin supported versions [\"v1beta1\"] differ from the handler's [\"v1beta1\", \"v1beta2\"]"
    );
    token.cancel();
}

#[tokio::test]
async fn example_handler_register_fails_when_a_service_is_missing() {
    // The endpoint serves nothing but Registration: GetExampleInfo is UNIMPLEMENTED.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("bare.sock");
    let r = plugreg_registrar::Registrar::new(Default::default());
    let token = CancellationToken::new();
    tokio::spawn({
        let (r, s, t) = (r.clone(), sock.clone(), token.clone());
        async move { r.serve(&s, Default::default(), t).await.unwrap() }
    });
    while !sock.exists() {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let h = ExampleHandler::new(vec!["v1beta1".into()]);
    let err = h
        .register("bare", &sock.display().to_string(), &["v1beta1".into()])
        .await
        .unwrap_err();
    assert!(
        err.to_string().starts_with("GetExampleInfo v1beta1 at"),
        "{err}"
    );
    token.cancel();
}
