//! `csi-node-driver-registrar`: parse the flags the Go way, set up logging, run the sidecar on
//! a single-threaded runtime until SIGTERM or SIGINT, and exit with upstream's codes
//! (0 done, 1 runtime error, 2 flag error).

use std::process::ExitCode;

use anyhow::Context;
use plugreg_node_driver_registrar::flags::{self, FLAG_ERROR_EXIT, Parsed};
use plugreg_node_driver_registrar::logging::{self, LogFormat};
use plugreg_node_driver_registrar::{VERSION, run};
use plugreg_runtime::signal::Signals;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let argv0 = args
        .first()
        .map_or("csi-node-driver-registrar", String::as_str);
    let flags = match flags::parse(args.get(1..).unwrap_or_default()) {
        Ok(Parsed::Run(flags)) => flags,
        Ok(Parsed::Help) => {
            eprint!("{}", flags::usage(argv0));
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{e}");
            eprint!("{}", flags::usage(argv0));
            return exit(FLAG_ERROR_EXIT);
        }
    };
    let format = match flags.logging.validate() {
        Ok(format) => format,
        Err(errors) => {
            logging::init(LogFormat::Text, 0);
            tracing::error!(err = %errors.join(", "), "LoggingConfiguration is invalid");
            return exit(1);
        }
    };
    logging::init(format, flags.logging.verbosity);
    if flags.version {
        println!("{argv0} {VERSION}");
        return ExitCode::SUCCESS;
    }
    for flag in &flags.legacy {
        tracing::warn!(
            flag = %flag,
            "Ignoring legacy klog flag: it was removed in node-driver-registrar v2.11 and has no effect"
        );
    }
    match serve(flags.config) {
        Ok(code) => exit(code),
        Err(e) => {
            tracing::error!(err = %format!("{e:#}"), "Failed to start");
            exit(1)
        }
    }
}

/// Runs the sidecar on a current-thread runtime; returns the exit code.
fn serve(config: plugreg_node_driver_registrar::Config) -> anyhow::Result<i32> {
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
        Ok(match run(config, token).await {
            Ok(()) => 0,
            Err(e) => e.exit_code(),
        })
    })
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
