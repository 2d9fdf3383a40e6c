//! plugreg's binaries built for other architectures, run under `qemu-user-static` beside the
//! amd64 peers (issue 32): linux/arm64, and linux/s390x, which is big-endian, so every byte
//! order assumption of the wire code, the socket handling and the Kubernetes client shows.
//!
//! For each platform: `csi-node-driver-registrar` registers the test driver with the real
//! kubelet plugin manager (v1.36.2), `livenessprobe` answers `/healthz` from the driver's Probe,
//! `csi-provisioner` provisions a claim against a real kube-apiserver and kube-controller-manager
//! and deletes its volume, and `plugreg csi check` passes against the test driver. The peers
//! and the test driver are the amd64 builds; only the binary under test is foreign.
//!
//! The first test of a platform builds that platform's four binaries with
//! `scripts/cross.sh build <platform> --profile qemu` (the cheap profile of the root
//! `Cargo.toml`: no optimisation, standard library included, one to a few minutes per platform
//! on two cores). The toolchain is Debian's (`scripts/cross.sh setup`, which `.ci/run` runs);
//! without it these tests fail and say so.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, PostParams};
use plugreg_csi_test_driver::{DriverConfig, Method, MountMode, NodeCapability};
use plugreg_testpeers::{ApiServer, ControllerManager, KubeVersion, LinesFrom, PeerProcess};
use serde_json::json;
use tokio::sync::OnceCell;

/// Long: a foreign binary runs unoptimised under emulation.
const WAIT: Duration = Duration::from_secs(120);

/// One foreign platform: its OCI name, Rust target, qemu and the cross sysroot Debian's
/// `libc6-<arch>-cross` installs (where qemu finds the dynamic loader and glibc).
struct Platform {
    oci: &'static str,
    triple: &'static str,
    qemu: &'static str,
    sysroot: &'static str,
    built: OnceCell<PathBuf>,
}

static ARM64: Platform = Platform {
    oci: "linux/arm64",
    triple: "aarch64-unknown-linux-gnu",
    qemu: "qemu-aarch64-static",
    sysroot: "/usr/aarch64-linux-gnu",
    built: OnceCell::const_new(),
};

static S390X: Platform = Platform {
    oci: "linux/s390x",
    triple: "s390x-unknown-linux-gnu",
    qemu: "qemu-s390x-static",
    sysroot: "/usr/s390x-linux-gnu",
    built: OnceCell::const_new(),
};

/// The binaries under test, by package.
const PACKAGES: [&str; 4] = [
    "plugreg-node-driver-registrar",
    "plugreg-livenessprobe",
    "plugreg-csi-provisioner",
    "plugreg",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The platform's binaries, built once per test binary (both platforms' builds share
/// `target/cross`, so cargo runs them one after the other).
async fn built(p: &'static Platform) -> &'static Path {
    p.built
        .get_or_init(|| async move {
            tokio::task::spawn_blocking(move || build(p))
                .await
                .expect("the build thread")
        })
        .await
}

fn build(p: &Platform) -> PathBuf {
    for tool in ["/usr/bin/rustc", &format!("/usr/bin/{}", p.qemu)] {
        assert!(
            Path::new(tool).exists(),
            "{tool} is missing: the cross toolchain is not installed (as root: scripts/cross.sh setup; .ci/run does it)"
        );
    }
    assert!(
        Path::new(p.sysroot).join("lib").exists(),
        "{} is missing: the cross C library is not installed (as root: scripts/cross.sh setup)",
        p.sysroot
    );
    let started = Instant::now();
    let mut cmd = Command::new("bash");
    cmd.arg(repo().join("scripts/cross.sh"))
        .args(["build", p.oci, "--profile", "qemu", "--bins"]);
    for package in PACKAGES {
        cmd.args(["-p", package]);
    }
    // The outer `cargo test` must not steer the inner build.
    let out = cmd
        .current_dir(repo())
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        .stdin(Stdio::null())
        .output()
        .expect("bash scripts/cross.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "scripts/cross.sh build {} failed ({:?}):\n{}",
        p.oci,
        out.status,
        tail(&stderr, 60)
    );
    eprintln!(
        "built {} for {} in {:.0} s",
        PACKAGES.join(", "),
        p.oci,
        started.elapsed().as_secs_f64()
    );
    repo().join("target/cross").join(p.triple).join("qemu")
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `binary` of `p` under qemu, with `args`.
async fn foreign(p: &'static Platform, binary: &str) -> Command {
    let path = built(p).await.join(binary);
    assert!(path.exists(), "{} was not built", path.display());
    let mut cmd = Command::new(p.qemu);
    // `-L`: the loader and glibc from the cross sysroot. The loader would still search the
    // host's `/lib/<multiarch>` before the sysroot's `/lib`, and a machine with that
    // architecture's own libc6 installed (another glibc build) then loads a libc that does not
    // match the loader: the guest spins at start-up. LD_LIBRARY_PATH (read by the guest's
    // loader) puts the sysroot's libraries first.
    cmd.arg("-L")
        .arg(p.sysroot)
        .env("LD_LIBRARY_PATH", Path::new(p.sysroot).join("lib"))
        .arg(path);
    cmd
}

/// The test driver (amd64, in this process) on `socket`: Controller and Node services, no real
/// mounts (staging and publishing make directories).
async fn driver(name: &str, socket: &Path) -> plugreg_csi_test_driver::RunningDriver {
    plugreg_csi_test_driver::start(
        DriverConfig {
            name: name.into(),
            controller: true,
            node_capabilities: vec![
                NodeCapability::StageUnstageVolume,
                NodeCapability::GetVolumeStats,
                NodeCapability::ExpandVolume,
            ],
            mount: MountMode::Directory,
            data_dir: Some(socket.with_extension("volumes")),
            ..DriverConfig::default()
        },
        socket,
    )
    .await
    .unwrap()
}

async fn registrar_registers_with_the_real_kubelet(p: &'static Platform) {
    common::node_driver_registrar_registers_and_deregisters(
        KubeVersion::V1_36_2,
        &format!("csi-node-driver-registrar ({})", p.oci),
        foreign(p, "csi-node-driver-registrar").await,
        WAIT,
    )
    .await;
}

async fn livenessprobe_answers_a_probe(p: &'static Platform) {
    let tmp = tempfile::tempdir().unwrap();
    let csi_sock = tmp.path().join("csi.sock");
    let driver = driver("live.qemu.plugreg.io", &csi_sock).await;
    let port = plugreg_testpeers::free_port().unwrap();
    let mut cmd = foreign(p, "livenessprobe").await;
    cmd.args([
        format!("--csi-address={}", csi_sock.display()),
        format!("--http-endpoint=127.0.0.1:{port}"),
    ]);
    let mut probe = PeerProcess::spawn_command(
        &format!("livenessprobe ({})", p.oci),
        cmd,
        LinesFrom::Stdout,
    )
    .unwrap();
    let deadline = Instant::now() + WAIT;
    let (status, body) = loop {
        match get(port, "/healthz").await {
            Ok(answer) => break answer,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("no /healthz answer: {e}\n{}", probe.stderr_tail()),
        }
    };
    assert_eq!(status, 200, "{body}\n{}", probe.stderr_tail());
    assert_eq!(body, "ok");
    assert!(
        driver.calls().count(Method::Probe) >= 1,
        "the probe reached the driver"
    );
    probe.terminate().unwrap();
    probe.wait_exit(WAIT).await.unwrap();
    let _ = driver.stop().await;
}

/// One HTTP/1.1 GET on 127.0.0.1:`port`: the status and the body.
async fn get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).await?;
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not HTTP: {answer:?}")))?;
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

async fn provisioner_provisions_a_claim(p: &'static Platform) {
    let api = ApiServer::shared(KubeVersion::V1_36_2)
        .await
        .expect("kube-apiserver");
    let _kcm = ControllerManager::start_volume_controllers(&api, &[])
        .await
        .expect("kube-controller-manager");
    let client = api.client().await.unwrap();
    let arch = p.triple.split('-').next().unwrap();
    let name = format!("{arch}-{}.qemu.plugreg.io", std::process::id());
    let ns = format!("qemu-{arch}-{}", std::process::id());
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap(),
        )
        .await
        .unwrap();
    Api::<StorageClass>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": name},
                "provisioner": name,
                "parameters": {"kind": "fast"},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let csi_sock = tmp.path().join("csi.sock");
    let driver = driver(&name, &csi_sock).await;

    let mut cmd = foreign(p, "csi-provisioner").await;
    cmd.args([
        format!("--csi-address={}", csi_sock.display()),
        format!("--kubeconfig={}", api.kubeconfig_path().display()),
        "--v=5".into(),
    ])
    .env_remove("KUBECONFIG")
    .env_remove("NAMESPACE")
    .env_remove("POD_NAME")
    .env_remove("NODE_NAME");
    let mut provisioner = PeerProcess::spawn_command(
        &format!("csi-provisioner ({})", p.oci),
        cmd,
        LinesFrom::Stdout,
    )
    .unwrap();

    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    claims
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "data"},
                "spec": {
                    "storageClassName": name,
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "3Mi"}},
                }
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    let claim = loop {
        let c = claims.get("data").await.unwrap();
        if c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound") {
            break c;
        }
        assert!(
            Instant::now() < deadline,
            "the claim is not Bound: {:?}\n{}",
            c.status,
            provisioner.stderr_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let pv_name = claim.spec.unwrap().volume_name.unwrap();
    let pv = Api::<PersistentVolume>::all(client.clone())
        .get(&pv_name)
        .await
        .unwrap();
    let spec = pv.spec.unwrap();
    let csi = spec.csi.unwrap();
    assert_eq!(csi.driver, name);
    // 3 MiB asked, and what the driver created is what the PV says (a byte order slip in a
    // quantity or in the wire's int64 would show here).
    assert_eq!(
        spec.capacity.unwrap()["storage"].0,
        "3Mi",
        "the PV's capacity"
    );
    let creates = driver.calls().create_requests();
    assert_eq!(creates.len(), 1, "{creates:?}");
    assert_eq!(
        creates[0].capacity_range.as_ref().map(|r| r.required_bytes),
        Some(3 << 20)
    );
    assert_eq!(
        creates[0].parameters,
        BTreeMap::from([("kind".to_string(), "fast".to_string())])
            .into_iter()
            .collect()
    );
    assert_eq!(creates[0].name, pv_name, "the volume is named after the PV");

    // Deleting the claim deletes the volume (reclaim policy Delete) and the PV.
    claims
        .delete("data", &DeleteParams::default())
        .await
        .unwrap();
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    let deadline = Instant::now() + WAIT;
    while volumes.get_opt(&pv_name).await.unwrap().is_some() {
        assert!(
            Instant::now() < deadline,
            "the PV is still there\n{}",
            provisioner.stderr_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deletes = driver.calls().delete_requests();
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert_eq!(deletes[0].volume_id, csi.volume_handle);
    provisioner.terminate().unwrap();
    provisioner.wait_exit(WAIT).await.unwrap();
    let _ = driver.stop().await;
}

async fn csi_check_passes_against_the_test_driver(p: &'static Platform) {
    let tmp = tempfile::tempdir().unwrap();
    let csi_sock = tmp.path().join("csi.sock");
    let driver = driver("check.qemu.plugreg.io", &csi_sock).await;
    let root = tmp.path().join("check");
    std::fs::create_dir(&root).unwrap();
    let mut cmd = foreign(p, "plugreg").await;
    cmd.env("TMPDIR", &root).args([
        "csi",
        "check",
        "--endpoint",
        &csi_sock.display().to_string(),
        "-o",
        "json",
    ]);
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let steps: Vec<&str> = report["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["step"].as_str().unwrap())
        .collect();
    for step in [
        "CreateVolume",
        "NodeStageVolume",
        "NodePublishVolume",
        "NodeExpandVolume",
        "DeleteVolume",
    ] {
        assert!(steps.contains(&step), "no {step} in {report:#}");
    }
    let _ = driver.stop().await;
}

macro_rules! per_platform {
    ($($test:ident),* $(,)?) => {
        mod arm64 {
            $(
                #[tokio::test(flavor = "multi_thread")]
                async fn $test() {
                    super::$test(&super::ARM64).await
                }
            )*
        }
        mod s390x {
            $(
                #[tokio::test(flavor = "multi_thread")]
                async fn $test() {
                    super::$test(&super::S390X).await
                }
            )*
        }
    };
}

per_platform!(
    registrar_registers_with_the_real_kubelet,
    livenessprobe_answers_a_probe,
    provisioner_provisions_a_claim,
    csi_check_passes_against_the_test_driver,
);

/// The images of both foreign platforms (`images/build.sh --platform`) carry the loader and
/// glibc their binaries need, at the paths the loader looks for them, so each image's own root
/// runs its binary under qemu; `images/index.py` joins them with the amd64 image into one OCI
/// image index whose manifests and blobs are all there and name the right platforms, the same
/// bytes twice.
#[tokio::test(flavor = "multi_thread")]
async fn images_of_each_platform_run_from_their_own_root_and_join_one_index() {
    let tmp = tempfile::tempdir().unwrap();
    let amd64 = plugreg_interop::workspace_bin("livenessprobe");
    let mut archives = vec![(
        "linux/amd64",
        image(
            "linux/amd64",
            amd64.parent().unwrap(),
            &tmp.path().join("amd64"),
        ),
    )];
    for p in [&ARM64, &S390X] {
        let dir = built(p).await;
        let out = tmp.path().join(p.triple);
        let archive = image(p.oci, dir, &out);
        // The image's root: its one layer unpacked.
        let layout = out.join("layout");
        untar(&archive, &layout, false);
        let index: serde_json::Value = read_json(&layout.join("index.json"));
        let manifest = read_json(&blob(&layout, &index["manifests"][0]["digest"]));
        let layers = manifest["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 1, "{manifest:#}");
        let root = out.join("root");
        untar(&blob(&layout, &layers[0]["digest"]), &root, true);
        let multiarch = Path::new(p.sysroot).file_name().unwrap();
        assert!(
            root.join("lib").join(multiarch).join("libc.so.6").exists(),
            "glibc is in the {} image",
            p.oci
        );
        // qemu with the image's root as the only prefix, and no LD_LIBRARY_PATH: the loader
        // finds everything in the image.
        let out = Command::new(p.qemu)
            .arg("-L")
            .arg(&root)
            .arg(root.join("livenessprobe"))
            .arg("--version")
            .env_remove("LD_LIBRARY_PATH")
            .output()
            .unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("livenessprobe"),
            "{} image: {out:?}",
            p.oci
        );
        archives.push((p.oci, archive));
    }

    let joined = |name: &str| {
        let out = tmp.path().join(name);
        let mut cmd = Command::new("python3");
        cmd.arg(repo().join("images/index.py")).arg(&out);
        for (platform, archive) in &archives {
            cmd.arg(format!("{platform}={}", archive.display()));
        }
        let status = cmd.env("SOURCE_DATE_EPOCH", "0").status().unwrap();
        assert!(status.success(), "images/index.py");
        std::fs::read(&out).unwrap()
    };
    let first = joined("one.oci.tar");
    assert_eq!(
        first,
        joined("two.oci.tar"),
        "the same inputs, the same bytes"
    );

    let layout = tmp.path().join("joined");
    untar(&tmp.path().join("one.oci.tar"), &layout, false);
    let top = read_json(&layout.join("index.json"));
    assert_eq!(
        top["manifests"][0]["mediaType"],
        "application/vnd.oci.image.index.v1+json"
    );
    let index = read_json(&blob(&layout, &top["manifests"][0]["digest"]));
    let manifests = index["manifests"].as_array().unwrap();
    let platforms: Vec<String> = manifests
        .iter()
        .map(|m| {
            format!("{}/{}", m["platform"]["os"], m["platform"]["architecture"]).replace('"', "")
        })
        .collect();
    assert_eq!(platforms, ["linux/amd64", "linux/arm64", "linux/s390x"]);
    for m in manifests {
        let manifest = read_json(&blob(&layout, &m["digest"]));
        let config = read_json(&blob(&layout, &manifest["config"]["digest"]));
        assert_eq!(config["architecture"], m["platform"]["architecture"]);
        for layer in manifest["layers"].as_array().unwrap() {
            blob(&layout, &layer["digest"]);
        }
    }
}

/// `images/build.sh --platform` of livenessprobe from `bin_dir` into `out`: the archive.
fn image(platform: &str, bin_dir: &Path, out: &Path) -> PathBuf {
    let status = Command::new("bash")
        .arg(repo().join("images/build.sh"))
        .args(["--platform", platform, "--bin-dir"])
        .arg(bin_dir)
        .arg("--out")
        .arg(out)
        .arg("livenessprobe")
        .env("SOURCE_DATE_EPOCH", "0")
        .status()
        .expect("bash images/build.sh (umoci: images/setup.sh installs it)");
    assert!(status.success(), "images/build.sh --platform {platform}");
    out.join("livenessprobe.oci.tar")
}

fn untar(archive: &Path, into: &Path, gzip: bool) {
    std::fs::create_dir_all(into).unwrap();
    let status = Command::new("tar")
        .arg(if gzip { "-xzf" } else { "-xf" })
        .arg(archive)
        .arg("-C")
        .arg(into)
        .status()
        .unwrap();
    assert!(status.success(), "tar {}", archive.display());
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The blob `digest` of the layout at `layout`, checked against its digest.
fn blob(layout: &Path, digest: &serde_json::Value) -> PathBuf {
    use sha2::Digest;
    let digest = digest.as_str().unwrap();
    let hex = digest.strip_prefix("sha256:").unwrap();
    let path = layout.join("blobs/sha256").join(hex);
    let data = std::fs::read(&path).unwrap_or_else(|e| panic!("blob {digest}: {e}"));
    let got: String = sha2::Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(got, hex, "blob {digest}");
    path
}
