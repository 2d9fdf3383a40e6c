//! The `main` every sidecar binary shares ([`Program::main`]): read the arguments, parse them
//! with the sidecar's [`Command`], print the usage for `-h`/`--help` (exit 0) or a flag error
//! and the usage (exit [`FLAG_ERROR_EXIT`]), refuse an invalid logging configuration with
//! upstream's "LoggingConfiguration is invalid" (exit 1), set up the klog-style logs, then hand
//! over to the sidecar; a start-up error it returns is logged as "Failed to start" (exit 1).
//!
//! The sidecar decides when `--version` is answered ([`Program::version`]: upstream's
//! provisioner checks its feature gates first) and warns about the removed klog flags with
//! [`Program::warn_legacy`]. The flags and gates of older upstream releases that were accepted
//! ([`crate::compat`]) are logged here, as warnings, before the sidecar runs.

use std::fmt::Display;
use std::process::ExitCode;

use crate::flags::{Command, Flags, Parsed, SidecarFlags};
use crate::goflag::FLAG_ERROR_EXIT;
use crate::logging::{self, LogFormat};

/// A sidecar binary: its name, version and log targets.
#[derive(Debug, Clone, Copy)]
pub struct Program {
    /// The program name when the arguments have none.
    pub name: &'static str,
    /// What `--version` prints after the program name.
    pub version: &'static str,
    /// Target prefixes of the sidecar's own lines (their info lines show at `-v=0`).
    pub log_targets: &'static [&'static str],
    /// The warning logged for each removed klog flag given.
    pub legacy_warning: &'static str,
}

impl Program {
    /// Parses the command line, sets up logging and runs `run(argv0, flags)`, which returns
    /// the exit code (or a start-up error: logged, exit 1).
    pub fn main<O, E>(
        &self,
        command: &Command,
        run: impl FnOnce(&str, Flags<O>) -> Result<i32, E>,
    ) -> ExitCode
    where
        O: SidecarFlags,
        E: Display,
    {
        let args: Vec<String> = std::env::args_os()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let argv0 = args.first().map_or(self.name, String::as_str);
        let flags = match command.parse::<O, _>(args.get(1..).unwrap_or_default()) {
            Ok(Parsed::Run(flags)) => flags,
            Ok(Parsed::Help) => {
                eprint!("{}", command.usage::<O>(argv0));
                return ExitCode::SUCCESS;
            }
            Err(e) => {
                eprintln!("{e}");
                eprint!("{}", command.usage::<O>(argv0));
                return exit(FLAG_ERROR_EXIT);
            }
        };
        let format = match flags.logging.validate() {
            Ok(format) => format,
            Err(errors) => {
                logging::init(LogFormat::Text, 0, self.log_targets);
                tracing::error!(err = %errors.join(", "), "LoggingConfiguration is invalid");
                return exit(1);
            }
        };
        logging::init(format, flags.logging.verbosity, self.log_targets);
        // Where upstream's old releases logged them: while parsing, before anything else.
        for accepted in &flags.outdated {
            tracing::warn!(option = %accepted.given, "{}", accepted.warning);
        }
        match run(argv0, *flags) {
            Ok(code) => exit(code),
            Err(e) => {
                tracing::error!(err = %format!("{e:#}"), "Failed to start");
                exit(1)
            }
        }
    }

    /// With `--version`: prints `<argv0> <version>` to stdout and returns `true` (exit 0).
    pub fn version<O>(&self, argv0: &str, flags: &Flags<O>) -> bool {
        if flags.version {
            println!("{argv0} {}", self.version);
        }
        flags.version
    }

    /// Logs [`legacy_warning`](Self::legacy_warning) for each removed klog flag given.
    pub fn warn_legacy(&self, legacy: &[String]) {
        for flag in legacy {
            tracing::warn!(flag = %flag, "{}", self.legacy_warning);
        }
    }
}

/// `code` as the process's exit status (anything outside 0..=255 is 1).
pub fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
