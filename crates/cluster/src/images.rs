//! The images a cluster runs, all from files: the pause and busybox images
//! (`images/node-images.sh`), plugreg's sidecars (`images/build.sh`) and the test driver
//! (`images/build.sh --conf images/test-images.conf`), built from this workspace's binaries.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::Error;
use crate::host::{self, IMAGES_SETUP};

/// The name the workload image is imported under (`<name>:<busybox version>`); tests use
/// [`ImageSet::busybox`] for the full reference.
pub const BUSYBOX: &str = "plugreg.test/busybox";
/// The registry host the plugreg and test images are imported under. `.test` never resolves,
/// and the loopback rules make every container `imagePullPolicy: Never`: nothing is pulled.
pub const REGISTRY: &str = "plugreg.test";
/// The images of `images/images.conf` a CSI driver deployment from `deploy/` uses.
pub const SIDECARS: &[&str] = &[
    "csi-node-driver-registrar",
    "livenessprobe",
    "csi-provisioner",
    "csi-attacher",
    "csi-resizer",
    "csi-snapshotter",
    "csi-external-health-monitor-controller",
    "csi-sidecars",
];
/// The test driver's image (`images/test-images.conf`).
pub const TEST_DRIVER: &str = "csi-test-driver";

/// One image archive and the name it is imported under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageFile {
    /// The archive (OCI or Docker).
    pub archive: PathBuf,
    /// `ctr images import --base-name`: the repository its tag is put on; `None` keeps the
    /// names the archive carries.
    pub base_name: Option<String>,
}

/// Built image archives, ready to import into any number of nodes.
#[derive(Debug, Clone)]
pub struct ImageSet {
    /// Every archive, with its name.
    pub files: Vec<ImageFile>,
    /// The full reference of the workload image.
    pub busybox: String,
    /// The tag of plugreg's images (the workspace version, `v0.1.0`).
    pub version: String,
}

impl ImageSet {
    /// Builds the pause and busybox images, plugreg's sidecar images and the test driver's
    /// image from the binaries in `bin_dir` into `out`.
    ///
    /// Needs umoci and busybox-static (`images/setup.sh`) and the binaries (`cargo build`).
    pub fn build(repo: &Path, bin_dir: &Path, out: &Path) -> Result<ImageSet, Error> {
        if host::on_path("umoci").is_none() {
            return Err(Error::missing("umoci (builds the images)", IMAGES_SETUP));
        }
        let busybox = host::tools_dir().join("busybox-static/busybox");
        if !busybox.is_file() {
            return Err(Error::missing(
                format!("busybox-static (looked for {})", busybox.display()),
                IMAGES_SETUP,
            ));
        }
        for name in SIDECARS.iter().chain([&TEST_DRIVER]) {
            let bin = bin_dir.join(name);
            if !bin.is_file() {
                return Err(Error::missing(
                    format!("the binary {} (its image is built from it)", bin.display()),
                    format!(
                        "cargo build --workspace --bins (with the profile of {})",
                        bin_dir.display()
                    ),
                ));
            }
        }
        std::fs::create_dir_all(out)
            .map_err(|e| Error::io(format!("creating {}", out.display()), e))?;
        let script = |name: &str| repo.join("images").join(name);
        host::run(
            Command::new("bash")
                .arg(script("node-images.sh"))
                .arg("--out")
                .arg(out),
        )?;
        // images/build.sh with the images of a list (images.conf, test-images.conf).
        let build = |conf: &str, images: &[&str]| {
            host::run(
                Command::new("bash")
                    .arg(script("build.sh"))
                    .arg("--bin-dir")
                    .arg(bin_dir)
                    .arg("--out")
                    .arg(out)
                    .arg("--conf")
                    .arg(script(conf))
                    .args(images),
            )
        };
        build("images.conf", SIDECARS)?;
        build("test-images.conf", &[TEST_DRIVER])?;
        let busybox_version = tag_of(&out.join("busybox.oci.tar"))?;
        let version = tag_of(&out.join(format!("{TEST_DRIVER}.oci.tar")))?;
        let mut files = vec![
            ImageFile {
                archive: out.join("pause.oci.tar"),
                base_name: Some("registry.k8s.io/pause".to_owned()),
            },
            ImageFile {
                archive: out.join("busybox.oci.tar"),
                base_name: Some(BUSYBOX.to_owned()),
            },
        ];
        for name in SIDECARS.iter().chain([&TEST_DRIVER]) {
            files.push(ImageFile {
                archive: out.join(format!("{name}.oci.tar")),
                base_name: Some(format!("{REGISTRY}/{name}")),
            });
        }
        Ok(ImageSet {
            files,
            busybox: format!("{BUSYBOX}:{busybox_version}"),
            version,
        })
    }
}

/// The tag an OCI archive carries (its index's `org.opencontainers.image.ref.name`).
fn tag_of(archive: &Path) -> Result<String, Error> {
    let index = host::run(
        Command::new("tar")
            .arg("-xOf")
            .arg(archive)
            .arg("./index.json"),
    )?;
    let v: serde_json::Value = serde_json::from_str(&index)
        .map_err(|e| Error::Manifest(format!("{}: index.json: {e}", archive.display())))?;
    v["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| {
            Error::Manifest(format!(
                "{}: no org.opencontainers.image.ref.name in index.json",
                archive.display()
            ))
        })
}
