//! `livenessprobe`: parse the flags the Go way, set up logging (the sidecar kit's `main`),
//! serve `/healthz` on a single-threaded runtime, and exit with upstream's codes (0 help,
//! 1 runtime error, 2 flag error). SIGTERM and SIGINT keep their default action (the process
//! ends), as upstream.

use std::process::ExitCode;

use anyhow::Context;
use plugreg_livenessprobe::flags::{COMMAND, Flags};
use plugreg_livenessprobe::{VERSION, run};
use plugreg_sidecar_kit::cli::Program;
use tokio_util::sync::CancellationToken;

const PROGRAM: Program = Program {
    name: "livenessprobe",
    version: VERSION,
    log_targets: &["plugreg_livenessprobe", "livenessprobe"],
    legacy_warning: "Ignoring legacy klog flag: it has no effect",
};

fn main() -> ExitCode {
    PROGRAM.main(&COMMAND, start)
}

/// After logging is set up: the version, the warnings, then the sidecar on a current-thread
/// runtime; returns the exit code.
fn start(argv0: &str, flags: Flags) -> anyhow::Result<i32> {
    if PROGRAM.version(argv0, &flags) {
        return Ok(0);
    }
    PROGRAM.warn_legacy(&flags.legacy);
    let config = flags.options;
    if config.automaxprocs {
        tracing::warn!("Ignoring --automaxprocs: it tunes the Go runtime and has no effect here");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the runtime")?;
    Ok(runtime.block_on(async {
        match run(config, CancellationToken::new()).await {
            Ok(()) => 0,
            Err(e) => e.exit_code(),
        }
    }))
}
