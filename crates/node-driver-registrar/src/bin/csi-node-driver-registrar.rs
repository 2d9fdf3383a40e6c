//! `csi-node-driver-registrar`: parse the flags the Go way, set up logging (the sidecar kit's
//! `main`), run the sidecar on a single-threaded runtime until SIGTERM or SIGINT, and exit with
//! upstream's codes (0 done, 1 runtime error, 2 flag error).

use std::process::ExitCode;

use anyhow::Context;
use plugreg_node_driver_registrar::flags::{COMMAND, Flags};
use plugreg_node_driver_registrar::logging::OWN_TARGETS;
use plugreg_node_driver_registrar::{VERSION, run};
use plugreg_runtime::signal::Signals;
use plugreg_sidecar_kit::cli::Program;
use tokio_util::sync::CancellationToken;

const PROGRAM: Program = Program {
    name: "csi-node-driver-registrar",
    version: VERSION,
    log_targets: OWN_TARGETS,
    legacy_warning: "Ignoring legacy klog flag: it was removed in node-driver-registrar v2.11 and has no effect",
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
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the runtime")?;
    runtime.block_on(async {
        let token = CancellationToken::new();
        let mut signals = Signals::new().context("installing the SIGTERM and SIGINT handlers")?;
        let stop = token.clone();
        tokio::spawn(async move {
            let received = signals.shutdown().await;
            tracing::info!(
                signal = received.name(),
                "Received signal, removing the registration socket"
            );
            stop.cancel();
        });
        Ok(match run(flags.options, token).await {
            Ok(()) => 0,
            Err(e) => e.exit_code(),
        })
    })
}
