//! The example DRA driver binary as a real process: it serves its sockets, reports readiness,
//! answers the kubelet-side DRA handler, prints each call, and removes its sockets on SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use plugreg_handler_api::PluginHandler;
use plugreg_handler_dra::DraHandler;
use plugreg_proto::dra::v1::Claim;

#[tokio::test]
async fn serves_prepare_and_unprepare_and_prints_each_call() {
    let dir = tempfile::tempdir().unwrap();
    let registry = dir.path().join("registry");
    std::fs::create_dir_all(&registry).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_plugreg-example-dra-driver"))
        .args([
            "--driver-name",
            "gpu.example.com",
            "--devices",
            "2",
            "--node-name",
            "node-1",
        ])
        .arg("--registry-dir")
        .arg(&registry)
        .arg("--plugin-dir")
        .arg(dir.path().join("plugin"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = move || -> serde_json::Value {
        serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap()
    };
    let listening = next();
    assert_eq!(listening["event"], "listening");
    assert_eq!(
        listening["supported_versions"],
        serde_json::json!([
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth"
        ])
    );
    let endpoint = listening["endpoint"].as_str().unwrap().to_owned();
    assert_eq!(
        endpoint,
        dir.path().join("plugin/dra.sock").display().to_string()
    );
    assert!(registry.join("gpu.example.com-reg.sock").exists());

    let h = DraHandler::new();
    h.register("gpu.example.com", &endpoint, &["v1.DRAPlugin".into()])
        .await
        .unwrap();
    let claim = Claim {
        namespace: "ns".into(),
        uid: "uid-1".into(),
        name: "c".into(),
    };
    let r = h
        .prepare("gpu.example.com", vec![claim.clone()])
        .await
        .unwrap();
    let d = &r.claims["uid-1"].devices[0];
    assert_eq!(
        (d.pool_name.as_str(), d.device_name.as_str()),
        ("node-1", "dev-0")
    );
    assert_eq!(d.cdi_device_ids, ["gpu.example.com/dev=uid-1"]);
    // Idempotent: the same claim gets the same device.
    let again = h
        .prepare("gpu.example.com", vec![claim.clone()])
        .await
        .unwrap();
    assert_eq!(again.claims["uid-1"].devices[0].device_name, "dev-0");
    let line = next();
    assert_eq!(line["event"], "NodePrepareResources");
    assert_eq!(line["claims"][0]["uid"], "uid-1");
    next();
    let r = h.unprepare("gpu.example.com", vec![claim]).await.unwrap();
    assert_eq!(r.claims["uid-1"].error, "");
    assert_eq!(next()["event"], "NodeUnprepareResources");

    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    assert!(child.wait().unwrap().success());
    assert!(!registry.join("gpu.example.com-reg.sock").exists());
    assert!(!dir.path().join("plugin/dra.sock").exists());
}
