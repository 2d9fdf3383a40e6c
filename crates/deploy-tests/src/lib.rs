//! Support for the shipping tests in `tests/`: the images of `images/images.conf` built by
//! `images/build.sh`, a hermetic podman (its own storage in a temporary directory), and the
//! kubectl binaries that render `deploy/`.
//!
//! Needs root and Debian's `podman`, `runc` and `umoci`, and kubectl v1.20.2 from Debian's
//! `kubernetes-client`: `images/setup.sh` installs them. Tests that miss a tool fail with
//! that command in the message; they never skip.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use serde_json::Value;
use tempfile::TempDir;

/// Set to a directory of `<image>.oci.tar` archives (e.g. `target/dist` from
/// `scripts/release.sh`) to test those instead of images built from the debug binaries.
pub const IMAGES_DIR_ENV: &str = "PLUGREG_IMAGES_DIR";
/// The OCI runtime podman uses (default `runc`: crun 1.8 refuses cgroup hybrid mode, which
/// some CI machines have).
pub const OCI_RUNTIME_ENV: &str = "PLUGREG_OCI_RUNTIME";
/// Where `images/setup.sh` puts kubectl v1.20.2 (default `$HOME/.cache/plugreg-deploy`).
pub const TOOLS_DIR_ENV: &str = "PLUGREG_DEPLOY_TOOLS";

const SETUP_HINT: &str = "run `bash images/setup.sh` (as root) first";

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One line of `images/images.conf`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSpec {
    /// Image name, also the binary's name and the entrypoint `/<name>`.
    pub name: String,
    /// The cargo package that builds the binary.
    pub package: String,
    /// The cargo profile the image's binary is built with (`release`, `sidecar`).
    pub profile: String,
    /// The image's default user (numeric).
    pub user: String,
    /// The image's description label.
    pub description: String,
}

/// Every image `images/images.conf` lists.
pub fn image_specs() -> Vec<ImageSpec> {
    let path = repo_root().join("images/images.conf");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let mut words = l.split_whitespace();
            let mut next = || words.next().map(str::to_owned).unwrap_or_default();
            let (name, package, profile, user) = (next(), next(), next(), next());
            let description = words.collect::<Vec<_>>().join(" ");
            ImageSpec {
                name,
                package,
                profile,
                user,
                description,
            }
        })
        .collect()
}

/// `v` + the workspace version: the version `images/build.sh` labels images with by default.
pub fn workspace_version() -> String {
    let text = std::fs::read_to_string(repo_root().join("Cargo.toml")).expect("Cargo.toml");
    let version = text
        .split("[workspace.package]")
        .nth(1)
        .and_then(|s| s.lines().find_map(|l| l.trim().strip_prefix("version = ")))
        .expect("[workspace.package] version in Cargo.toml");
    format!("v{}", version.trim_matches('"'))
}

/// `target/<profile>`, where cargo puts the workspace's binaries.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("test executables live in target/<profile>/deps")
        .to_path_buf()
}

/// The path of a binary of this workspace (`cargo test --workspace` builds them all).
pub fn workspace_bin(name: &str) -> PathBuf {
    let bin = profile_dir().join(name);
    assert!(
        bin.exists(),
        "binary {name} is not built at {}: run `cargo build --workspace --bins`",
        bin.display()
    );
    bin
}

/// Runs a command to completion; panics with its output unless it succeeds.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Whether `program` is found on `PATH`.
pub fn on_path(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|p| p.is_file())
    })
}

/// The directory holding `<image>.oci.tar` for every image of `images/images.conf`: the
/// directory named by [`IMAGES_DIR_ENV`], or else (once per test process) the images
/// `images/build.sh` builds from this profile's binaries into `target/<profile>/images`.
pub fn images_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os(IMAGES_DIR_ENV) {
            return PathBuf::from(dir);
        }
        assert!(
            on_path("umoci").is_some(),
            "umoci is not installed: {SETUP_HINT}"
        );
        for spec in image_specs() {
            workspace_bin(&spec.name);
        }
        let out = profile_dir().join("images");
        run_ok(
            Command::new("bash")
                .arg(repo_root().join("images/build.sh"))
                .arg("--bin-dir")
                .arg(profile_dir())
                .arg("--out")
                .arg(&out),
        );
        out
    })
}

/// The OCI archive of one image.
pub fn image_archive(name: &str) -> PathBuf {
    let path = images_dir().join(format!("{name}.oci.tar"));
    assert!(path.is_file(), "no image archive {}", path.display());
    path
}

/// A rootful podman with its own storage and run state in a temporary directory, so tests
/// neither see nor leave images or containers elsewhere. Dropping it removes its containers.
#[derive(Debug)]
pub struct Podman {
    dir: TempDir,
    runtime: String,
}

impl Podman {
    /// A new, empty podman store. Panics (with the setup command) without podman or root.
    pub fn new() -> Podman {
        assert!(
            on_path("podman").is_some(),
            "podman is not installed: {SETUP_HINT}"
        );
        assert!(
            rustix::process::geteuid().is_root(),
            "the image tests run rootful podman: run them as root"
        );
        let runtime = std::env::var(OCI_RUNTIME_ENV).unwrap_or_else(|_| "runc".to_owned());
        assert!(
            on_path(&runtime).is_some(),
            "{runtime} is not installed: {SETUP_HINT}"
        );
        let dir = tempfile::Builder::new()
            .prefix("plugreg-podman-")
            .tempdir()
            .expect("temp dir");
        Podman { dir, runtime }
    }

    /// `podman` with this store's global flags.
    pub fn cmd(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.arg("--root")
            .arg(self.dir.path().join("root"))
            .arg("--runroot")
            .arg(self.dir.path().join("run"))
            .args(["--storage-driver", "vfs", "--cgroup-manager", "cgroupfs"])
            .args(["--events-backend", "none", "--runtime", &self.runtime]);
        cmd
    }

    /// Loads an OCI archive; returns the image id.
    pub fn load(&self, archive: &Path) -> String {
        let out = run_ok(
            self.cmd()
                .args(["pull", "-q"])
                .arg(format!("oci-archive:{}", archive.display())),
        );
        let id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        assert!(!id.is_empty(), "podman pull printed no image id");
        id
    }

    /// `podman image inspect`: the image's JSON.
    pub fn inspect(&self, id: &str) -> Value {
        let out = run_ok(self.cmd().args(["image", "inspect", id]));
        let v: Value = serde_json::from_slice(&out.stdout).expect("podman image inspect JSON");
        v.get(0).cloned().expect("one image")
    }

    /// `podman run --rm` with the flags every test container gets: no network, and resource
    /// limits no higher than this process's own. (podman's rootful defaults, nofile 1048576
    /// and nproc 4194304, need CAP_SYS_RESOURCE, which containers running CI may lack.)
    pub fn run_cmd(&self) -> Command {
        let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        let nproc = rustix::process::getrlimit(rustix::process::Resource::Nproc);
        // podman caps its own nproc at kernel.pid_max, and the container cannot exceed it.
        let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(32768);
        let nofile = nofile.maximum.unwrap_or(1_048_576);
        let nproc = nproc.maximum.unwrap_or(pid_max).min(pid_max);
        let mut cmd = self.cmd();
        cmd.args(["run", "--rm", "--network", "none"])
            .arg(format!("--ulimit=nofile={nofile}:{nofile}"))
            .arg(format!("--ulimit=nproc={nproc}:{nproc}"));
        cmd
    }

    /// `podman stop` with a grace period; the container's own `podman run` then exits.
    pub fn stop(&self, name: &str) {
        run_ok(self.cmd().args(["stop", "--time", "30", name]));
    }
}

impl Default for Podman {
    fn default() -> Self {
        Podman::new()
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        // Containers still running after a failed assertion would outlive the test.
        let _ = self
            .cmd()
            .args(["rm", "--force", "--all", "--time", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Where `images/setup.sh` puts the pinned kubectl.
pub fn tools_dir() -> PathBuf {
    match std::env::var_os(TOOLS_DIR_ENV) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            Path::new(&home).join(".cache/plugreg-deploy")
        }
    }
}

/// The kubectl binaries the manifests are rendered and applied with: Debian's v1.20.2 (its
/// kustomize is v2.0.3, the oldest the manifests support; required), and the `kubectl` on
/// `PATH` when it is another binary (usually a newer kustomize).
pub fn kubectls() -> Vec<PathBuf> {
    let pinned = tools_dir().join("kubectl-v1.20.2");
    assert!(
        pinned.is_file(),
        "no kubectl v1.20.2 at {}: {SETUP_HINT}",
        pinned.display()
    );
    let mut all = vec![pinned.clone()];
    if let Some(other) = on_path("kubectl") {
        let same = std::fs::canonicalize(&other).ok() == std::fs::canonicalize(&pinned).ok();
        if !same {
            all.push(other);
        }
    }
    all
}

/// `kubectl version --client --short`-like one-liner for messages.
pub fn kubectl_version(kubectl: &Path) -> String {
    let out = run_ok(Command::new(kubectl).args(["version", "--client", "-o", "json"]));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    let client = v["clientVersion"]["gitVersion"].as_str().unwrap_or("?");
    let kustomize = v["kustomizeVersion"]
        .as_str()
        .unwrap_or("v2.0.3 (built in)");
    format!("kubectl {client}, kustomize {kustomize}")
}

/// Parses a stream of JSON values (what `kubectl apply -o json` prints for several objects).
pub fn json_stream(text: &[u8]) -> Vec<Value> {
    serde_json::Deserializer::from_slice(text)
        .into_iter::<Value>()
        .collect::<Result<Vec<_>, _>>()
        .unwrap_or_else(|e| {
            panic!(
                "not a JSON stream ({e}):\n{}",
                String::from_utf8_lossy(text)
            )
        })
}

/// The text of a file, or a note that it is missing (for failure messages).
pub fn read_or_note(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("({}: {e})", path.display()))
}
