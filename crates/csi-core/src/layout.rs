//! The kubelet's directory layout for CSI volumes under its root directory (docs/upstream/csi-wire.md §1.13,
//! decision C1), so that paths made by plugreg are the ones a driver sees from the kubelet.
//!
//! Every name that becomes a path component is checked first: a driver name by the driver-name
//! rule, pod UIDs and volume names must not be empty, `.`/`..`, or contain NUL; a `/` in a volume
//! name is escaped to `~` as the kubelet escapes qualified names. The volume handle is hashed, so
//! any handle is safe.

use std::path::{Path, PathBuf};

use crate::name::{DriverNameError, check_driver_name};

/// The kubelet's default root directory.
pub const DEFAULT_KUBELET_ROOT: &str = "/var/lib/kubelet";

/// Why a path could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The driver name cannot be a path component.
    #[error(transparent)]
    DriverName(#[from] DriverNameError),
    /// A pod UID or volume name cannot be a path component.
    #[error("invalid {what} {value:?}: {why}")]
    Component {
        /// `pod UID` or `volume name`.
        what: &'static str,
        /// The value (cut to 80 characters).
        value: String,
        /// Why.
        why: &'static str,
    },
}

/// The kubelet's CSI paths under one root directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletLayout {
    root: PathBuf,
}

impl Default for KubeletLayout {
    fn default() -> Self {
        Self::new(DEFAULT_KUBELET_ROOT)
    }
}

/// Escapes a qualified name as the kubelet does for a directory name: `/` becomes `~`.
pub fn escape_qualified_name(name: &str) -> String {
    name.replace('/', "~")
}

fn component(what: &'static str, value: &str) -> Result<String, LayoutError> {
    let err = |why| LayoutError::Component {
        what,
        value: value.chars().take(80).collect(),
        why,
    };
    let escaped = escape_qualified_name(value);
    if escaped.is_empty() {
        return Err(err("it is empty"));
    }
    if escaped == "." || escaped == ".." {
        return Err(err("it names a directory itself"));
    }
    if escaped.contains('\0') {
        return Err(err("it contains NUL"));
    }
    if escaped.len() > 255 {
        return Err(err("it is longer than a file name may be (255 bytes)"));
    }
    Ok(escaped)
}

impl KubeletLayout {
    /// The layout under `root` (e.g. `/var/lib/kubelet`).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Filesystem staging path:
    /// `<root>/plugins/kubernetes.io/csi/<driver>/<hex sha256 of the handle>/globalmount`.
    pub fn staging_path(&self, driver: &str, volume_handle: &str) -> Result<PathBuf, LayoutError> {
        check_driver_name(driver)?;
        Ok(self
            .root
            .join("plugins/kubernetes.io/csi")
            .join(driver)
            .join(crate::sha256::hex(volume_handle.as_bytes()))
            .join("globalmount"))
    }

    /// Filesystem publish (target) path:
    /// `<root>/pods/<pod uid>/volumes/kubernetes.io~csi/<escaped volume name>/mount`.
    pub fn publish_path(&self, pod_uid: &str, volume_name: &str) -> Result<PathBuf, LayoutError> {
        let pod = component("pod UID", pod_uid)?;
        let vol = component("volume name", volume_name)?;
        Ok(self
            .root
            .join("pods")
            .join(pod)
            .join("volumes/kubernetes.io~csi")
            .join(vol)
            .join("mount"))
    }

    /// Block staging path: `<root>/plugins/kubernetes.io/csi/volumeDevices/staging/<spec name>`.
    pub fn block_staging_path(&self, spec_name: &str) -> Result<PathBuf, LayoutError> {
        let name = component("volume name", spec_name)?;
        Ok(self
            .root
            .join("plugins/kubernetes.io/csi/volumeDevices/staging")
            .join(name))
    }

    /// Block publish path:
    /// `<root>/plugins/kubernetes.io/csi/volumeDevices/publish/<spec name>/<pod uid>`.
    pub fn block_publish_path(
        &self,
        spec_name: &str,
        pod_uid: &str,
    ) -> Result<PathBuf, LayoutError> {
        let name = component("volume name", spec_name)?;
        let pod = component("pod UID", pod_uid)?;
        Ok(self
            .root
            .join("plugins/kubernetes.io/csi/volumeDevices/publish")
            .join(name)
            .join(pod))
    }
}

/// The kubelet's volume metadata file, in the directory above a staging path or a target.
pub const VOL_DATA_FILE: &str = "vol_data.json";

/// Mode of the directories the kubelet makes for a volume.
pub const DIR_MODE: u32 = 0o750;

/// What the kubelet does before NodeStageVolume (`MountDevice`) or NodePublishVolume (`SetUp`):
/// makes `dir` with its missing parents (mode 0750), then writes [`VOL_DATA_FILE`] with `data`
/// in the directory above it. For staging, `dir` is the staging path itself (made whether or
/// not the driver stages); for publishing it is the target's parent (the driver makes the
/// target).
pub fn make_volume_dir(dir: &Path, data: &[(&str, &str)]) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)?;
    let meta_dir = if dir.ends_with("globalmount") {
        dir.parent().unwrap_or(dir)
    } else {
        dir
    };
    let mut json = String::from("{");
    for (i, (k, v)) in data.iter().enumerate() {
        if i > 0 {
            json.push(',');
        }
        json.push_str(&json_string(k));
        json.push(':');
        json.push_str(&json_string(v));
    }
    json.push('}');
    std::fs::write(meta_dir.join(VOL_DATA_FILE), json)
}

/// What the kubelet does after NodeUnpublishVolume (`TearDown`) or NodeUnstageVolume
/// (`UnmountDevice`), its `removeMountDir`: removes `mount_path`, then [`VOL_DATA_FILE`] and the
/// directory above it (if empty). A missing path is fine; one still mounted (EBUSY) or holding
/// files is an error, and then nothing else is removed.
pub fn remove_mount_dir(mount_path: &Path) -> std::io::Result<()> {
    use std::io::ErrorKind;
    match std::fs::remove_dir(mount_path) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    if let Some(dir) = mount_path.parent() {
        match std::fs::remove_file(dir.join(VOL_DATA_FILE)) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        match std::fs::remove_dir(dir) {
            Ok(()) => {}
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::DirectoryNotEmpty) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `s` as a JSON string.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_dirs_come_and_go_as_the_kubelets() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let l = KubeletLayout::new(tmp.path());
        let staging = l.staging_path("d.example", "h\"1\n").unwrap();
        make_volume_dir(
            &staging,
            &[("driverName", "d.example"), ("volumeHandle", "h\"1\n")],
        )
        .unwrap();
        let meta = std::fs::metadata(&staging).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o750);
        assert_eq!(
            std::fs::read_to_string(staging.parent().unwrap().join(VOL_DATA_FILE)).unwrap(),
            r#"{"driverName":"d.example","volumeHandle":"h\"1\u000a"}"#
        );
        let target = l.publish_path("pod", "vol").unwrap();
        make_volume_dir(target.parent().unwrap(), &[("specVolID", "vol")]).unwrap();
        assert!(!target.exists(), "the driver makes the target");
        assert!(target.parent().unwrap().join(VOL_DATA_FILE).exists());
        std::fs::create_dir(&target).unwrap();
        remove_mount_dir(&target).unwrap();
        assert!(!target.parent().unwrap().exists());
        remove_mount_dir(&staging).unwrap();
        assert!(!staging.parent().unwrap().exists());
        // Again: nothing left is fine.
        remove_mount_dir(&staging).unwrap();
    }

    #[test]
    fn paths_follow_the_kubelet() {
        let l = KubeletLayout::default();
        assert_eq!(
            l.staging_path("hostpath.csi.k8s.io", "abc").unwrap(),
            Path::new(
                "/var/lib/kubelet/plugins/kubernetes.io/csi/hostpath.csi.k8s.io/\
                 ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad/globalmount"
            )
        );
        assert_eq!(
            l.publish_path("uid-1", "pvc-1").unwrap(),
            Path::new("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~csi/pvc-1/mount")
        );
        assert_eq!(
            KubeletLayout::new("/k").publish_path("u", "a/b").unwrap(),
            Path::new("/k/pods/u/volumes/kubernetes.io~csi/a~b/mount")
        );
        assert_eq!(
            KubeletLayout::new("/k").block_staging_path("pv").unwrap(),
            Path::new("/k/plugins/kubernetes.io/csi/volumeDevices/staging/pv")
        );
        assert_eq!(
            KubeletLayout::new("/k")
                .block_publish_path("pv", "u")
                .unwrap(),
            Path::new("/k/plugins/kubernetes.io/csi/volumeDevices/publish/pv/u")
        );
        // Any handle is safe: it is hashed.
        assert!(
            l.staging_path("d.example", "../../etc")
                .unwrap()
                .starts_with(l.root())
        );
    }

    #[test]
    fn refuses_components_that_escape() {
        let l = KubeletLayout::new("/k");
        assert!(matches!(
            l.staging_path("../x", "v"),
            Err(LayoutError::DriverName(_))
        ));
        for bad in ["", ".", "..", "a\0b"] {
            assert!(l.publish_path(bad, "v").is_err(), "{bad:?}");
            assert!(l.publish_path("u", bad).is_err(), "{bad:?}");
        }
        // A slash is escaped, so "../x" stays one component.
        assert!(
            l.publish_path("u", "../x")
                .unwrap()
                .starts_with("/k/pods/u/volumes")
        );
        assert!(l.publish_path("u", &"x".repeat(256)).is_err());
    }
}
