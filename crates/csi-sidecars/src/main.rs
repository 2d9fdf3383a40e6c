//! `csi-sidecars`: a CSI driver's controller sidecars (provisioner, attacher, resizer,
//! snapshotter) in one process, as KEP-4958 proposes and upstream has not shipped
//! (`docs/design.md` S1).
//!
//! One driver connection, one Probe, one GetPluginInfo and one capability read; one HTTP
//! server (`/metrics` with every controller's metrics, `/healthz/leader-election` for every
//! controller's Lease). Each controller is its sidecar's library, run with the flags its
//! sidecar would get ([`flags`]), its own token bucket, its own events and its sidecar's
//! upstream Lease, so that separate sidecars and `csi-sidecars` can replace one another under
//! load ([`run`]). A controller that loses its Lease stops, drops its state and campaigns
//! again; the others go on. A lost driver connection ends the process, as in every sidecar.
//!
//! Exit codes: 0 for `--version`, `--help` and a clean stop (SIGTERM/SIGINT: the controllers
//! finish their current calls, 10 s at most, the Leases are released where the controller's
//! gate says so); 1 for every start-up error, a lost driver connection and a controller that
//! failed; 2 for a command-line error.

mod flags;
mod run;

use std::process::ExitCode;

use plugreg_sidecar_kit::VERSION;
use plugreg_sidecar_kit::cli::exit;
use plugreg_sidecar_kit::goflag::FLAG_ERROR_EXIT;
use plugreg_sidecar_kit::logging::{self, LogFormat};

use crate::flags::{Outcome, Parsed};

/// The target of this program's lines.
const LOG: &str = "plugreg_csi_sidecars";
/// Target prefixes of this program's and its controllers' own lines (info lines at `-v=0`).
const OWN: &[&str] = &[
    LOG,
    "plugreg_provisioner",
    "plugreg_attacher",
    "plugreg_resizer",
    "plugreg_snapshotter",
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let argv0 = args.first().map_or("csi-sidecars", String::as_str);
    let parsed = match flags::parse(args.get(1..).unwrap_or_default()) {
        Ok(Outcome::Run(p)) => p,
        Ok(Outcome::Help) => {
            eprint!("{}", flags::usage(argv0));
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{e}");
            eprint!("{}", flags::usage(argv0));
            return exit(FLAG_ERROR_EXIT);
        }
    };
    if parsed.version {
        println!("{argv0} {VERSION}");
        return ExitCode::SUCCESS;
    }
    let log = log_options(&parsed);
    let format = match log.validate() {
        Ok(format) => format,
        Err(errors) => {
            logging::init(LogFormat::Text, 0, OWN);
            tracing::error!(err = %errors.join(", "), "LoggingConfiguration is invalid");
            return exit(1);
        }
    };
    logging::init(format, log.verbosity, OWN);
    tracing::info!(target: LOG, version = VERSION, controllers = %names(&parsed), "Version");
    for flag in &parsed.ignored {
        tracing::warn!(target: LOG, flag = %flag, "Ignoring a flag of a controller that is not in --controllers");
    }
    exit(run::start(*parsed))
}

/// The logging flags (every controller got the same ones).
fn log_options(parsed: &Parsed) -> plugreg_sidecar_kit::logging::LogOptions {
    let any = [
        parsed.provisioner.as_ref().map(|f| &f.logging),
        parsed.attacher.as_ref().map(|f| &f.logging),
        parsed.resizer.as_ref().map(|f| &f.logging),
        parsed.snapshotter.as_ref().map(|f| &f.logging),
    ];
    any.into_iter()
        .flatten()
        .next()
        .cloned()
        .unwrap_or_default()
}

fn names(parsed: &Parsed) -> String {
    let names: Vec<&str> = parsed.controllers.iter().map(|c| c.name()).collect();
    names.join(",")
}
