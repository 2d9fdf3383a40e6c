//! A machine that lacks something the cluster needs gets a clear failure naming what is
//! missing and the command that provides it, never a cluster that silently does less (and
//! never a test that passes without one): shown with `plugreg-cluster up` against an empty
//! peers folder and an empty tools folder.

use std::process::Command;

fn up_with(env: &[(&str, &std::path::Path)]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_plugreg-cluster"));
    cmd.args(["up", "--kube-version", "v1.36.2"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run plugreg-cluster");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn missing_peers_name_the_peer_and_the_setup_script() {
    let empty = tempfile::tempdir().expect("temp dir");
    let (ok, text) = up_with(&[("PLUGREG_PEERS_DIR", empty.path())]);
    assert!(!ok, "started without peers:\n{text}");
    assert!(text.contains("cannot run here"), "{text}");
    assert!(text.contains("interop/build-peers.sh"), "{text}");
    assert!(
        text.contains("`etcd`"),
        "names the first missing peer: {text}"
    );
}

#[test]
fn missing_tools_name_the_setup_script() {
    let empty = tempfile::tempdir().expect("temp dir");
    let (ok, text) = up_with(&[("PLUGREG_DEPLOY_TOOLS", empty.path())]);
    assert!(!ok, "started without kubectl:\n{text}");
    assert!(text.contains("kubectl v1.20.2"), "{text}");
    assert!(text.contains("images/setup.sh"), "{text}");
}
