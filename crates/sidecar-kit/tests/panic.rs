//! A panic in a controller sidecar ends its process, as an unrecovered panic ends a Go
//! sidecar (exit 2): Tokio would otherwise catch a panicking task and run on without it, a
//! worker gone and its key never synced again. Each test runs itself again as a child process
//! (this test binary, the one test, an environment variable saying which part to play), so
//! the exit code and the lines are a real process's.

use std::pin::Pin;
use std::process::{Command, Output};
use std::time::Duration;

use plugreg_sidecar_kit::lifecycle::{self, PANIC_EXIT};

/// Set in the child: which test it runs as.
const CHILD: &str = "PLUGREG_PANIC_TEST_CHILD";

/// How long a child would wait, if its panic did not end it, before ending by itself (exit 0).
const LONG: Duration = Duration::from_secs(30);

/// Runs `test` of this binary again as a child playing its part, and returns what it did.
fn run_child(test: &str) -> Output {
    let exe = std::env::current_exe().expect("the test binary's path");
    Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, test)
        .output()
        .expect("running the test binary again")
}

fn is_child(test: &str) -> bool {
    std::env::var(CHILD).is_ok_and(|v| v == test)
}

fn assert_panicked_out(out: &Output, message: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(PANIC_EXIT),
        "the child's status: {:?}, stderr:\n{stderr}",
        out.status
    );
    assert!(
        stderr.contains(message),
        "the default hook's lines are kept; stderr:\n{stderr}"
    );
}

/// A task that panics while others go on: without the hook the runtime would run on to the
/// end of `LONG` and return normally.
async fn panic_in_a_task() {
    tokio::spawn(async { panic!("a worker's sync panicked") });
    tokio::time::sleep(LONG).await;
}

/// `lifecycle::block_on` or `block_on_multi_thread`, for one future type.
type BlockOn = fn(Pin<Box<dyn Future<Output = ()>>>) -> std::io::Result<()>;

/// Test `name`: as the child, runs [`panic_in_a_task`] on the runtime `block_on` builds; as
/// the parent, checks that the child ended with [`PANIC_EXIT`] and the panic's message.
fn a_panicking_task_ends_the_process(name: &str, block_on: BlockOn) {
    if is_child(name) {
        block_on(Box::pin(panic_in_a_task())).expect("a runtime");
        return;
    }
    assert_panicked_out(&run_child(name), "a worker's sync panicked");
}

#[test]
fn a_panicking_task_ends_a_one_thread_sidecar_with_exit_2() {
    a_panicking_task_ends_the_process(
        "a_panicking_task_ends_a_one_thread_sidecar_with_exit_2",
        lifecycle::block_on,
    );
}

#[test]
fn a_panicking_task_ends_a_multi_thread_sidecar_with_exit_2() {
    a_panicking_task_ends_the_process(
        "a_panicking_task_ends_a_multi_thread_sidecar_with_exit_2",
        lifecycle::block_on_multi_thread,
    );
}

#[test]
fn a_panic_after_the_run_is_the_callers_to_handle() {
    const NAME: &str = "a_panic_after_the_run_is_the_callers_to_handle";
    if is_child(NAME) {
        lifecycle::block_on(async {}).expect("a runtime");
        // Disarmed once the run's future has returned: caught here as anywhere else.
        let caught = std::panic::catch_unwind(|| panic!("after the run"));
        assert!(caught.is_err());
        return;
    }
    let out = run_child(NAME);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the child's status: {:?}, stderr:\n{stderr}",
        out.status
    );
    assert!(stderr.contains("after the run"), "stderr:\n{stderr}");
}
