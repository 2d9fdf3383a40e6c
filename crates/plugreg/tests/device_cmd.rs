//! `plugreg device ...` against the example device plugin process (and a socket that never
//! answers), all real processes and sockets.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use plugreg_testpeers::{LinesFrom, PeerProcess};
use serde_json::Value;

const SOON: Duration = Duration::from_secs(15);

fn device_plugin_bin() -> PathBuf {
    let bin = Path::new(env!("CARGO_BIN_EXE_plugreg"))
        .parent()
        .unwrap()
        .join("plugreg-example-device-plugin");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p plugreg-example-device-plugin`",
        bin.display()
    );
    bin
}

/// Starts the example device plugin (registering into a directory nobody watches) and waits
/// until it serves.
async fn plugin(dir: &Path, name: &str, extra: &[&str]) -> (PeerProcess, String) {
    let socket = dir.join(format!("{name}.sock"));
    let mut cmd = Command::new(device_plugin_bin());
    cmd.args([
        "--resource",
        "example.com/widget",
        "--devices",
        "3",
        "--numa-nodes",
        "2",
    ])
    .args(extra)
    .arg("--registry-dir")
    .arg(dir.join(format!("registry-{name}")))
    .arg("--socket")
    .arg(&socket);
    std::fs::create_dir_all(dir.join(format!("registry-{name}"))).unwrap();
    let mut p =
        PeerProcess::spawn_command("example device plugin", cmd, LinesFrom::Stdout).unwrap();
    p.next_matching(|v| v["event"] == "serving", SOON)
        .await
        .unwrap();
    (p, socket.display().to_string())
}

fn plugreg(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_plugreg"))
        .args(args)
        .output()
        .unwrap()
}

fn ok_json(args: &[&str]) -> Value {
    let o = plugreg(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

fn fails(args: &[&str]) -> String {
    let o = plugreg(args);
    assert!(!o.status.success(), "{args:?} succeeded");
    String::from_utf8(o.stderr).unwrap()
}

#[tokio::test]
async fn device_commands_call_the_plugin_as_the_kubelet_does() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut p, ep) = plugin(tmp.path(), "w", &["--pre-start"]).await;
    let e = ep.as_str();

    let o = ok_json(&["device", "options", "--endpoint", e, "-o", "json"]);
    assert_eq!(
        o,
        serde_json::json!({"pre_start_required": true, "get_preferred_allocation_available": true})
    );
    let t = plugreg(&["device", "options", "--endpoint", e]);
    assert_eq!(
        String::from_utf8(t.stdout).unwrap(),
        "PRE_START_REQUIRED                  true\nGET_PREFERRED_ALLOCATION_AVAILABLE  true\n"
    );

    let d = ok_json(&["device", "devices", "--endpoint", e, "-o", "json"]);
    assert_eq!(d["devices"].as_array().unwrap().len(), 3);
    assert_eq!(
        d["devices"][1],
        serde_json::json!({"id": "widget-1", "health": "Healthy", "topology": [1]})
    );
    let t = plugreg(&["device", "devices", "--endpoint", e]);
    let text = String::from_utf8(t.stdout).unwrap();
    assert!(
        text.starts_with("ID        HEALTH   NUMA\nwidget-0  Healthy  0\n"),
        "{text}"
    );

    let a = ok_json(&[
        "device",
        "allocate",
        "--endpoint",
        e,
        "--devices",
        "widget-0,widget-2",
        "-o",
        "json",
    ]);
    assert_eq!(a["envs"]["EXAMPLE_WIDGETS"], "widget-0,widget-2");
    p.next_matching(|v| v["event"] == "allocate", SOON)
        .await
        .unwrap();
    let err = fails(&["device", "allocate", "--endpoint", e, "--devices", "nope"]);
    assert!(
        err.contains("Allocate on")
            && err.contains("code = InvalidArgument desc = unknown device \"nope\""),
        "{err}"
    );

    let pr = ok_json(&[
        "device",
        "preferred",
        "--endpoint",
        e,
        "--available",
        "widget-0,widget-1,widget-2",
        "--must-include",
        "widget-2",
        "--size",
        "2",
        "-o",
        "json",
    ]);
    assert_eq!(
        pr["device_ids"],
        serde_json::json!(["widget-2", "widget-0"])
    );

    let ps = ok_json(&[
        "device",
        "prestart",
        "--endpoint",
        e,
        "--devices",
        "widget-1",
        "-o",
        "json",
    ]);
    assert_eq!(ps["ok"], true);
    p.next_matching(|v| v["event"] == "pre_start", SOON)
        .await
        .unwrap();

    // --watch streams every answer: flip a device and see the next one.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_plugreg"));
    cmd.args([
        "device",
        "devices",
        "--watch",
        "--endpoint",
        e,
        "-o",
        "json",
    ]);
    let mut watch =
        PeerProcess::spawn_command("plugreg device devices --watch", cmd, LinesFrom::Stdout)
            .unwrap();
    watch
        .next_matching(|v| v["devices"][0]["health"] == "Healthy", SOON)
        .await
        .unwrap();
    let ok = Command::new("kill")
        .args(["-USR1", &p.pid().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    watch
        .next_matching(|v| v["devices"][0]["health"] == "Unhealthy", SOON)
        .await
        .unwrap();

    // The plugin stops: the watch ends with it (cleanly: the stream ended).
    p.terminate().unwrap();
    assert!(p.wait_exit(SOON).await.unwrap().success());
    assert!(watch.wait_exit(SOON).await.unwrap().success());
}

#[tokio::test]
async fn calls_the_kubelet_would_not_make_are_refused_and_hung_plugins_time_out() {
    let tmp = tempfile::tempdir().unwrap();
    let (_p, ep) = plugin(tmp.path(), "plain", &[]).await;
    let err = fails(&[
        "device",
        "prestart",
        "--endpoint",
        &ep,
        "--devices",
        "widget-0",
    ]);
    assert!(
        err.contains(
            "does not set pre_start_required: the kubelet would not call PreStartContainer"
        ),
        "{err}"
    );
    let o = plugreg(&[
        "device",
        "prestart",
        "--endpoint",
        &ep,
        "--devices",
        "widget-0",
        "--force",
    ]);
    assert!(o.status.success());

    // A socket that accepts connections and never answers.
    let hung = tmp.path().join("hung.sock");
    let listener = std::os::unix::net::UnixListener::bind(&hung).unwrap();
    let _keep = std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming() {
            held.push(c);
        }
    });
    let h = hung.display().to_string();
    for args in [
        vec!["device", "options"],
        vec!["device", "devices"],
        vec!["device", "allocate", "--devices", "x"],
    ] {
        let mut a = args.clone();
        a.extend(["--endpoint", &h, "--timeout", "300ms"]);
        let err = fails(&a);
        assert!(err.contains(&h) && err.contains("300ms"), "{a:?}: {err}");
    }
    let err = fails(&[
        "device",
        "options",
        "--endpoint",
        &tmp.path().join("none.sock").display().to_string(),
    ]);
    assert!(err.contains("cannot connect to device plugin"), "{err}");
}

/// A device plugin (the plugin-side library, in this test process) whose Allocate,
/// GetPreferredAllocation and PreStartContainer never answer.
struct Stuck {
    devices: tokio::sync::watch::Sender<Vec<plugreg_deviceplugin::api::Device>>,
}

#[plugreg_deviceplugin::async_trait]
impl plugreg_deviceplugin::DeviceLogic for Stuck {
    fn options(&self) -> plugreg_deviceplugin::api::DevicePluginOptions {
        plugreg_deviceplugin::api::DevicePluginOptions {
            pre_start_required: true,
            get_preferred_allocation_available: true,
        }
    }
    fn devices(&self) -> tokio::sync::watch::Receiver<Vec<plugreg_deviceplugin::api::Device>> {
        self.devices.subscribe()
    }
    async fn allocate(
        &self,
        _: plugreg_deviceplugin::api::ContainerAllocateRequest,
    ) -> Result<plugreg_deviceplugin::api::ContainerAllocateResponse, tonic::Status> {
        std::future::pending().await
    }
    async fn preferred_allocation(
        &self,
        _: plugreg_deviceplugin::api::ContainerPreferredAllocationRequest,
    ) -> Result<plugreg_deviceplugin::api::ContainerPreferredAllocationResponse, tonic::Status>
    {
        std::future::pending().await
    }
    async fn pre_start(&self, _: Vec<String>) -> Result<(), tonic::Status> {
        std::future::pending().await
    }
}

#[tokio::test]
async fn a_plugin_that_hangs_in_a_call_is_reported_after_the_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let socket = tmp.path().join("stuck.sock");
    let token = tokio_util::sync::CancellationToken::new();
    let logic = std::sync::Arc::new(Stuck {
        devices: tokio::sync::watch::Sender::new(Vec::new()),
    });
    let service = plugreg_deviceplugin::DevicePluginService::new(logic, token.clone());
    let bound = plugreg_transport::bind(&socket).unwrap();
    let router = plugreg_transport::server().add_service(service.into_server());
    let t = token.clone();
    tokio::spawn(async move { plugreg_transport::serve(router, bound, t.cancelled_owned()).await });
    let s = socket.display().to_string();
    for (call, args) in [
        ("Allocate", vec!["allocate", "--devices", "a"]),
        (
            "GetPreferredAllocation",
            vec!["preferred", "--available", "a,b", "--size", "1"],
        ),
        ("PreStartContainer", vec!["prestart", "--devices", "a"]),
    ] {
        let mut a = vec!["device"];
        a.extend(args);
        a.extend(["--endpoint", &s, "--timeout", "300ms"]);
        let o = tokio::task::spawn_blocking({
            let a: Vec<String> = a.iter().map(|x| x.to_string()).collect();
            move || {
                Command::new(env!("CARGO_BIN_EXE_plugreg"))
                    .args(&a)
                    .output()
                    .unwrap()
            }
        })
        .await
        .unwrap();
        assert!(!o.status.success());
        let err = String::from_utf8(o.stderr).unwrap();
        assert_eq!(
            err.trim_end(),
            format!("plugreg: {s} did not answer {call} within 300ms")
        );
    }
    token.cancel();
}
