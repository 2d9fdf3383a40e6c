//! The images of `images/images.conf`, started by a real OCI runtime (podman with runc, from
//! Debian): each has its entrypoint, user and labels, no shell, and prints its version; the
//! sidecar image registers a driver with the `plugreg` image through a bind-mounted registry
//! directory, and both stop cleanly on SIGTERM as PID 1; the csi-provisioner image starts
//! against a driver socket in a shared directory and stops cleanly too.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use plugreg_deploy_tests::{
    IMAGES_DIR_ENV, Podman, image_archive, image_specs, read_or_note, run_ok, workspace_bin,
    workspace_version,
};
use plugreg_testpeers::PeerProcess;
use serde_json::Value;

const DEADLINE: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(100);

/// Polls `check` until it returns `Some`, or panics with `what` and `context()` at the deadline.
fn wait_for<T>(
    what: &str,
    mut check: impl FnMut() -> Option<T>,
    context: impl Fn() -> String,
) -> T {
    let end = Instant::now() + DEADLINE;
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(
            Instant::now() < end,
            "timed out waiting for {what}\n{}",
            context()
        );
        std::thread::sleep(POLL);
    }
}

/// Waits for a `podman run` child to exit (it exits when its container does).
fn wait_exit(child: &mut Child, what: &str) -> ExitStatus {
    wait_for(what, || child.try_wait().expect("try_wait"), String::new)
}

#[test]
fn every_image_has_its_entrypoint_user_labels_and_version_and_no_shell() {
    let podman = Podman::new();
    let specs = image_specs();
    assert!(!specs.is_empty(), "images/images.conf lists no image");
    for spec in specs {
        let archive = image_archive(&spec.name);
        let id = podman.load(&archive);
        let image = podman.inspect(&id);
        let config = &image["Config"];
        assert_eq!(
            config["Entrypoint"],
            serde_json::json!([format!("/{}", spec.name)]),
            "{}: entrypoint",
            spec.name
        );
        assert_eq!(
            config["User"],
            Value::from(spec.user.as_str()),
            "{}: user",
            spec.name
        );
        let labels = &image["Labels"];
        let label = |k: &str| labels[k].as_str().unwrap_or_default().to_owned();
        let version = label("org.opencontainers.image.version");
        if std::env::var_os(IMAGES_DIR_ENV).is_none() {
            assert_eq!(version, workspace_version(), "{}: version label", spec.name);
        }
        assert!(
            version.starts_with('v'),
            "{}: version label {version:?}",
            spec.name
        );
        let revision = label("org.opencontainers.image.revision");
        let hex = revision.trim_end_matches("-dirty");
        assert!(
            hex.len() == 40 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
            "{}: revision label {revision:?} is not a git commit",
            spec.name
        );
        assert_eq!(label("org.opencontainers.image.title"), spec.name);
        assert_eq!(
            label("org.opencontainers.image.description"),
            spec.description
        );

        // The binary's own --version names the release the label names. plugreg prints the
        // crate version without the "v" (clap's default), hence the comparison without it.
        let out = run_ok(podman.run_cmd().arg(&id).arg("--version"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let printed = stdout.split_whitespace().last().unwrap_or_default();
        assert_eq!(
            printed.trim_start_matches('v'),
            version.trim_start_matches('v'),
            "{}: --version printed {stdout:?}",
            spec.name
        );

        // No shell: running /bin/sh fails to start.
        let sh = podman
            .run_cmd()
            .args(["--entrypoint", "/bin/sh", &id, "-c", "true"])
            .stdin(Stdio::null())
            .output()
            .expect("podman run");
        assert!(
            !sh.status.success(),
            "{}: /bin/sh ran in the image",
            spec.name
        );

        eprintln!(
            "{}: {} bytes ({})",
            spec.name,
            std::fs::metadata(&archive).map(|m| m.len()).unwrap_or(0),
            archive.display()
        );
    }
}

/// `podman run -d`-like start of a named container whose output goes to files in `dir`.
fn start(podman: &Podman, dir: &Path, name: &str, args: &[&str]) -> Child {
    let out = File::create(dir.join(format!("{name}.log"))).expect("log file");
    let err = out.try_clone().expect("log file");
    podman
        .run_cmd()
        .args(["--name", name])
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("podman run")
}

#[tokio::test(flavor = "multi_thread")]
async fn sidecar_image_registers_a_driver_with_the_plugreg_image_and_both_stop_cleanly() {
    const DRIVER: &str = "csi.plugreg.test";
    const NODE_ID: &str = "node-in-a-container";
    let podman = Podman::new();
    let registrar = podman.load(&image_archive("csi-node-driver-registrar"));
    let plugreg = podman.load(&image_archive("plugreg"));

    // The node's directories, as the kubelet has them: the registry, and the driver's own.
    let tmp = tempfile::tempdir().expect("temp dir");
    let host = tmp.path();
    let registry = host.join("plugins_registry");
    let plugins = host.join("plugins");
    let driver_dir = plugins.join(DRIVER);
    let out = host.join("out");
    for d in [&registry, &driver_dir, &out] {
        std::fs::create_dir_all(d).expect("mkdir");
    }

    // The CSI driver runs on the host; only its socket is shared.
    let socket = driver_dir.join("csi.sock");
    let mut driver = PeerProcess::spawn_program(
        "csi-test-driver",
        &workspace_bin("csi-test-driver"),
        [
            "--socket",
            socket.to_str().expect("utf-8 path"),
            "--name",
            DRIVER,
            "--node-id",
            NODE_ID,
        ],
    )
    .expect("csi-test-driver starts");
    driver
        .next_event("listening", DEADLINE)
        .await
        .expect("driver listening");

    // `plugreg manager` plays the kubelet: it sees the registry and the plugins directory
    // at the kubelet's paths, and writes what it learns about the driver to a file.
    let mount = |from: &Path, to: &str| format!("--volume={}:{to}", from.display());
    let mut manager = start(
        &podman,
        host,
        "manager",
        &[
            &mount(&registry, "/var/lib/kubelet/plugins_registry"),
            &mount(&plugins, "/var/lib/kubelet/plugins"),
            &mount(&out, "/out"),
            &plugreg,
            "manager",
            "--registry-dir=/var/lib/kubelet/plugins_registry",
            "--plugin-types=CSIPlugin",
            "--node-info-file=/out/node-info.json",
            "-v=2",
        ],
    );
    // The sidecar as deploy/ runs it: read-only root, no capabilities, root user.
    let mut sidecar = start(
        &podman,
        host,
        "sidecar",
        &[
            "--read-only",
            "--cap-drop=ALL",
            "--security-opt=no-new-privileges",
            &mount(&registry, "/registration"),
            &mount(&driver_dir, "/csi"),
            &registrar,
            "--csi-address=/csi/csi.sock",
            &format!("--kubelet-registration-path=/var/lib/kubelet/plugins/{DRIVER}/csi.sock"),
            "--v=5",
        ],
    );
    let logs = || {
        format!(
            "manager log:\n{}\nsidecar log:\n{}\nnode-info.json: {}",
            read_or_note(&host.join("manager.log")),
            read_or_note(&host.join("sidecar.log")),
            read_or_note(&out.join("node-info.json")),
        )
    };
    let node_info = out.join("node-info.json");
    let driver_entry = || -> Option<Value> {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&node_info).ok()?).ok()?;
        v["csinode"]["drivers"]
            .as_array()?
            .iter()
            .find(|d| d["name"] == DRIVER)
            .cloned()
    };

    // Registered: the manager dialled the sidecar's socket (GetInfo), then the driver at the
    // endpoint the sidecar reported (NodeGetInfo), both across container boundaries.
    let entry = wait_for("the driver in node-info.json", driver_entry, logs);
    assert_eq!(entry["nodeID"], NODE_ID, "{}", logs());
    let reg_socket = registry.join(format!("{DRIVER}-reg.sock"));
    assert!(
        reg_socket.exists(),
        "no {}\n{}",
        reg_socket.display(),
        logs()
    );

    // SIGTERM to the sidecar (PID 1 in its container): socket removed, exit 0, and the
    // manager deregisters the driver.
    podman.stop("sidecar");
    let status = wait_exit(&mut sidecar, "the sidecar container to exit");
    assert!(status.success(), "sidecar exit {status}\n{}", logs());
    assert!(
        !reg_socket.exists(),
        "the sidecar left its socket behind\n{}",
        logs()
    );
    wait_for(
        "the driver to leave node-info.json",
        || driver_entry().is_none().then_some(()),
        logs,
    );

    podman.stop("manager");
    let status = wait_exit(&mut manager, "the manager container to exit");
    assert!(status.success(), "manager exit {status}\n{}", logs());

    driver.terminate().expect("SIGTERM the driver");
    driver.wait_exit(DEADLINE).await.expect("driver exits");
}

#[tokio::test(flavor = "multi_thread")]
async fn provisioner_image_starts_against_a_driver_and_stops_cleanly() {
    let podman = Podman::new();
    let provisioner = podman.load(&image_archive("csi-provisioner"));
    let tmp = tempfile::tempdir().expect("temp dir");
    let host = tmp.path();
    let socket_dir = host.join("csi");
    std::fs::create_dir_all(&socket_dir).expect("mkdir");

    // The controller plugin's driver runs on the host; only the socket directory is shared
    // (an emptyDir in deploy/base/controller).
    let socket = socket_dir.join("csi.sock");
    let mut driver = PeerProcess::spawn_program(
        "csi-test-driver",
        &workspace_bin("csi-test-driver"),
        [
            "--socket",
            socket.to_str().expect("utf-8 path"),
            "--controller",
        ],
    )
    .expect("csi-test-driver starts");
    driver
        .next_event("listening", DEADLINE)
        .await
        .expect("driver listening");

    // As deploy/ runs it (read-only root, no capabilities), up to the point where the
    // controller takes over; --master builds a kube config without a call (no network here).
    let mut child = start(
        &podman,
        host,
        "provisioner",
        &[
            "--read-only",
            "--cap-drop=ALL",
            "--security-opt=no-new-privileges",
            &format!("--volume={}:/csi", socket_dir.display()),
            &provisioner,
            "--csi-address=/csi/csi.sock",
            "--master=http://127.0.0.1:1",
            "--v=2",
        ],
    );
    let log = || read_or_note(&host.join("provisioner.log"));
    wait_for(
        "the provisioner to finish its start-up",
        || {
            log()
                .contains("not watching VolumeAttachments")
                .then_some(())
        },
        log,
    );
    assert!(
        log().contains("Detected CSI driver csi.plugreg.test"),
        "{}",
        log()
    );

    // SIGTERM to PID 1: a clean exit.
    podman.stop("provisioner");
    let status = wait_exit(&mut child, "the provisioner container to exit");
    assert!(status.success(), "provisioner exit {status}\n{}", log());

    driver.terminate().expect("SIGTERM the driver");
    driver.wait_exit(DEADLINE).await.expect("driver exits");
}

#[test]
fn images_conf_lines_have_a_dockerfile_stage() {
    let dockerfile =
        std::fs::read_to_string(plugreg_deploy_tests::repo_root().join("images/Dockerfile"))
            .expect("images/Dockerfile");
    for spec in image_specs() {
        let stage = format!("AS {}\n", spec.name);
        let entrypoint = format!("ENTRYPOINT [\"/{}\"]", spec.name);
        assert!(
            dockerfile.contains(&stage) && dockerfile.contains(&entrypoint),
            "images/Dockerfile has no stage `{stage}` with `{entrypoint}`"
        );
    }
}

#[test]
fn images_conf_profiles_are_cargo_profiles_and_plugreg_unwinds() {
    let cargo = std::fs::read_to_string(plugreg_deploy_tests::repo_root().join("Cargo.toml"))
        .expect("Cargo.toml");
    for spec in image_specs() {
        assert!(
            spec.profile == "release" || cargo.contains(&format!("\n[profile.{}]\n", spec.profile)),
            "{}: profile `{}` is not in the root Cargo.toml",
            spec.name,
            spec.profile
        );
    }
    // The manager catches a handler's panic (crates/manager/src/operation.rs): its binary must
    // unwind; the controller sidecars end on a panic and are built to abort.
    let profile = |name: &str| {
        image_specs()
            .into_iter()
            .find(|s| s.name == name)
            .map(|s| s.profile)
            .unwrap_or_else(|| panic!("{name} is not in images/images.conf"))
    };
    assert_eq!(profile("plugreg"), "release");
    let release = cargo
        .split("\n[profile.release]\n")
        .nth(1)
        .and_then(|rest| rest.split("\n[").next())
        .expect("[profile.release] in Cargo.toml");
    assert!(
        !release.contains("panic"),
        "the release profile must unwind: {release}"
    );
    for sidecar in ["csi-provisioner", "csi-attacher", "csi-sidecars"] {
        assert_eq!(profile(sidecar), "sidecar", "{sidecar}");
    }
}

/// The binaries the amd64 images carry pack their relative relocations (`.cargo/config.toml`):
/// their dynamic section has DT_RELR. The images run them (`--version`, above), so the glibc
/// the images carry reads it.
#[test]
#[cfg(target_arch = "x86_64")]
fn amd64_binaries_pack_their_relative_relocations() {
    for spec in image_specs() {
        let bin = workspace_bin(&spec.name);
        let out = run_ok(Command::new("readelf").arg("--dynamic").arg(&bin));
        let dynamic = String::from_utf8_lossy(&out.stdout);
        assert!(
            dynamic.contains("(RELR)"),
            "{}: {} has no DT_RELR:\n{dynamic}",
            spec.name,
            bin.display()
        );
    }
}
