//! Issue 17, finding 4: the release build of `plugreg manager` survives a panicking handler.
//!
//! The manager catches a handler's panic (and reaps an operation that panics) only when panics
//! unwind; with `panic = "abort"` in the release profile the whole daemon died instead. This
//! test builds the release profile itself, with the `panicking-handler` feature (a handler that
//! panics; never in the shipped binary), into a target directory of its own so that it never
//! replaces `target/release/plugreg`. That build is one extra release build of the daemon: a few
//! minutes on a 2-core machine the first time, seconds afterwards.
//!
//! The same build also shows that the release binary is lean: without `--features demo` it has
//! no demo and says how to get one (issue 18: the shipped binaries carry no test fakes).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Builds the daemon with the release profile and the panicking handler (once per test
/// process); returns the binary.
fn release_binary_with_panicking_handler() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(build_release_binary).clone()
}

fn build_release_binary() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // target/debug/plugreg -> target/panicking-handler
    let target = Path::new(env!("CARGO_BIN_EXE_plugreg"))
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in target/<profile>")
        .join("panicking-handler");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .current_dir(&workspace)
        .args([
            "build",
            "--release",
            "--locked",
            "-p",
            "plugreg",
            "--bin",
            "plugreg",
            "--features",
            "panicking-handler",
            "--target-dir",
        ])
        .arg(&target)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", Path::new(&cargo).display()));
    assert!(status.success(), "the release build failed: {status}");
    target.join("release/plugreg")
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls until `log` contains `text` or the daemon exits; fails after 60 s.
fn wait_for(daemon: &mut Daemon, log: &Path, text: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = std::fs::read_to_string(log).unwrap_or_default();
        if now.contains(text) {
            return now;
        }
        if let Some(status) = daemon.0.try_wait().unwrap() {
            panic!("the daemon exited ({status}) before logging {text:?}:\n{now}");
        }
        assert!(Instant::now() < deadline, "no {text:?} in 60 s:\n{now}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_release_daemon_survives_a_panicking_handler() {
    let bin = tokio::task::spawn_blocking(release_binary_with_panicking_handler)
        .await
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    let log = tmp.path().join("manager.log");
    let child = Command::new(&bin)
        .args(["manager", "--registry-dir"])
        .arg(&dir)
        .args([
            "--plugin-types",
            "PanickingTestPlugin,RecordedPlugin",
            "--liveness-interval",
            "0",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut daemon = Daemon(child);
    wait_for(&mut daemon, &log, "Starting Kubelet Plugin Manager");

    // A plugin whose handler panics in register: refused, not fatal.
    let panicking = plugreg_registrar::Registrar::new(plugreg_registrar::PluginInfo {
        r#type: "PanickingTestPlugin".into(),
        name: "example.com/panics".into(),
        endpoint: String::new(),
        supported_versions: vec!["v1".into()],
    });
    let token = tokio_util::sync::CancellationToken::new();
    let serve = |registrar: &plugreg_registrar::Registrar, file: &str| {
        let (r, path, t) = (registrar.clone(), dir.join(file), token.clone());
        tokio::spawn(async move { r.serve(&path, Default::default(), t).await })
    };
    let mut status = panicking.status();
    let _p = serve(&panicking, "panics.sock");
    tokio::time::timeout(
        Duration::from_secs(60),
        status.wait_for(|s| s.notifications() > 0),
    )
    .await
    .expect("the panicking plugin was answered")
    .unwrap();
    let refusal = status.borrow().clone();
    assert!(!refusal.is_registered(), "{refusal:?}");
    let text = wait_for(&mut daemon, &log, "handler panicked");
    assert!(
        text.contains("the panicking test handler refuses example.com/panics by panicking"),
        "{text}"
    );

    // Still alive and working: another plugin registers.
    let good = plugreg_registrar::Registrar::new(plugreg_registrar::PluginInfo {
        r#type: "RecordedPlugin".into(),
        name: "example.com/good".into(),
        endpoint: String::new(),
        supported_versions: vec!["v1".into()],
    });
    let mut status = good.status();
    let _g = serve(&good, "good.sock");
    tokio::time::timeout(
        Duration::from_secs(60),
        status.wait_for(|s| s.is_registered()),
    )
    .await
    .expect("a plugin registered after the panic")
    .unwrap();
    assert!(daemon.0.try_wait().unwrap().is_none(), "the daemon exited");
    token.cancel();
}

#[test]
fn the_release_build_has_no_demo_and_says_how_to_get_it() {
    let bin = release_binary_with_panicking_handler();
    let out = Command::new(&bin)
        .arg("demo")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(
        stderr.trim_end(),
        "plugreg: this plugreg is built without the demo (cargo feature `demo`), so that the shipped binary carries no test plugins; run it from a checkout with `cargo run -p plugreg --features demo -- demo`"
    );
}
