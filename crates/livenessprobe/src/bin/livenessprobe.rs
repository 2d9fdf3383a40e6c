//! `livenessprobe`: parse the flags the Go way, set up logging, serve `/healthz` on a
//! single-threaded runtime, and exit with upstream's codes (0 help, 1 runtime error, 2 flag
//! error). SIGTERM and SIGINT keep their default action (the process ends), as upstream.

use std::process::ExitCode;

use anyhow::Context;
use plugreg_livenessprobe::flags::{self, FLAG_ERROR_EXIT, Parsed};
use plugreg_livenessprobe::{VERSION, run};
use plugreg_sidecar_kit::logging::{self, LogFormat};
use tokio_util::sync::CancellationToken;

/// Target prefixes of this program's own lines.
const OWN: &[&str] = &["plugreg_livenessprobe", "livenessprobe"];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let argv0 = args.first().map_or("livenessprobe", String::as_str);
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
            logging::init(LogFormat::Text, 0, OWN);
            tracing::error!(err = %errors.join(", "), "LoggingConfiguration is invalid");
            return exit(1);
        }
    };
    logging::init(format, flags.logging.verbosity, OWN);
    if flags.version {
        println!("{argv0} {VERSION}");
        return ExitCode::SUCCESS;
    }
    for flag in &flags.legacy {
        tracing::warn!(flag = %flag, "Ignoring legacy klog flag: it has no effect");
    }
    if flags.config.automaxprocs {
        tracing::warn!("Ignoring --automaxprocs: it tunes the Go runtime and has no effect here");
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
fn serve(config: plugreg_livenessprobe::Config) -> anyhow::Result<i32> {
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

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
