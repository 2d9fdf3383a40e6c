//! Where the built peers live.

use std::path::{Path, PathBuf};

use crate::error::MissingPeer;

/// Environment variable that overrides the peers' cache folder.
pub const PEERS_DIR_ENV: &str = "PLUGREG_PEERS_DIR";
/// The real kubelet plugin manager (v1.20) wrapped to print JSON lines.
pub const PLUGIN_MANAGER_HARNESS: &str = "plugin-manager-harness";
/// The real pluginwatcher example plugin (v1.20) wrapped to print JSON lines.
pub const EXAMPLE_PLUGIN: &str = "example-plugin";
/// kube-apiserver v1.20.2.
pub const APISERVER: &str = "kube-apiserver";
/// kube-controller-manager v1.20.2.
pub const CONTROLLER_MANAGER: &str = "kube-controller-manager";
/// The whole kubelet v1.20.2 (for the one-node cluster).
pub const KUBELET: &str = "kubelet";
/// kube-scheduler v1.20.2.
pub const SCHEDULER: &str = "kube-scheduler";
/// etcd (Debian's etcd-server).
pub const ETCD: &str = "etcd";

/// The peers' cache folder: `$PLUGREG_PEERS_DIR`, else
/// `$HOME/.cache/plugreg-peers` (the same rule as `interop/build-peers.sh`).
pub fn peers_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(PEERS_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache").join("plugreg-peers")
}

/// The path of a built peer binary (`name` is one of [`PLUGIN_MANAGER_HARNESS`],
/// [`EXAMPLE_PLUGIN`], [`APISERVER`], [`CONTROLLER_MANAGER`], [`ETCD`], or a v1.36.2 peer).
///
/// Fails with [`MissingPeer`] (whose message says to run
/// `interop/build-peers.sh`) when the build has not completed (no `READY`
/// stamp) or the binary is not there.
pub fn peer(name: &str) -> Result<PathBuf, MissingPeer> {
    peer_in(&peers_dir(), name)
}

fn peer_in(dir: &Path, name: &str) -> Result<PathBuf, MissingPeer> {
    let path = dir.join("bin").join(name);
    let missing = |reason: String| MissingPeer {
        name: name.to_owned(),
        path: path.clone(),
        reason,
    };
    let ready = dir.join("READY");
    if !ready.is_file() {
        return Err(missing(format!(
            "no completed build: {} is missing",
            ready.display()
        )));
    }
    match std::fs::metadata(&path) {
        Ok(m) if m.is_file() => {
            use std::os::unix::fs::PermissionsExt;
            if m.permissions().mode() & 0o111 == 0 {
                return Err(missing("the file is not executable".to_owned()));
            }
            Ok(path)
        }
        Ok(_) => Err(missing("not a regular file".to_owned())),
        Err(e) => Err(missing(format!("{e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_build_names_the_peer_and_the_script() {
        let tmp = tempfile::tempdir().unwrap();
        let err = peer_in(tmp.path(), APISERVER).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("`kube-apiserver`"), "{msg}");
        assert!(msg.contains("interop/build-peers.sh"), "{msg}");
        assert!(msg.contains("READY"), "{msg}");
    }

    #[test]
    fn missing_binary_after_a_build_is_reported() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("READY"), "x\n").unwrap();
        let err = peer_in(tmp.path(), EXAMPLE_PLUGIN).unwrap_err();
        assert_eq!(err.name, EXAMPLE_PLUGIN);
        assert_eq!(err.path, tmp.path().join("bin").join(EXAMPLE_PLUGIN));
        assert!(err.to_string().contains("interop/build-peers.sh"));
    }

    #[test]
    fn built_binary_is_found() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("READY"), "x\n").unwrap();
        std::fs::create_dir(tmp.path().join("bin")).unwrap();
        let bin = tmp.path().join("bin").join(ETCD);
        std::fs::write(&bin, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(peer_in(tmp.path(), ETCD).unwrap(), bin);
    }
}
